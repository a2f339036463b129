//! Flotilla's placement engine: given an immutable cluster snapshot and one
//! request, decide which node and which GPUs it goes to, or explain in words
//! a person can act on why it fits nowhere.
//!
//! The pipeline is filter -> score -> select ([`filter`], [`score`],
//! [`select`]), with pluggable scorers: faithful re-implementations of the
//! baselines of the ATC'23 paper *Beware of Fragmentation* (Random, BestFit,
//! DotProd, GpuPacking, GpuClustering, FGD) and Flotilla's default policy.
//! [`frag`] holds the paper's fragmentation measure; [`startup`] ranks
//! nodes by how soon a replica would be ready there (what each caches),
//! then by the scorer.
//!
//! Around the single-request pipeline, and built on it: [`gang`] placement
//! (all-or-nothing, optionally in one topology domain or region), [`mig`]
//! profiles as GPU shares, the [`queue`] (priority, weighted DRF fair share,
//! FIFO, EASY backfill), [`quota`] admission (guaranteed and borrowed), and
//! [`preempt`]ion (cheapest sufficient set of evictable victims). They share
//! the vocabulary of [`alloc`].
//!
//! This crate is pure and must stay so: no I/O, no clock, no threads, no
//! global state. Randomness (tie-breaking, the Random policy) comes from a
//! seeded `rand::Rng` the caller passes in, so the live server and the
//! simulator replay the same decisions. Committing a decision is the caller's
//! job; [`snapshot::Cluster::commit`] only updates this crate's own model of
//! free capacity.
//!
//! Everything is index-based (nodes are `u32` indices, GPUs `u16` device
//! indices, models `u8` indices into a [`snapshot::ModelTable`]) so a decision
//! over tens of thousands of nodes stays in the tens of microseconds. Nodes in
//! the same state (model, free CPU/memory, multiset of free GPU shares) are
//! kept in one equivalence class and scored once, so the cost of a decision
//! grows with the number of distinct node states, not the number of nodes.

pub mod alloc;
pub mod filter;
pub mod frag;
pub mod gang;
pub mod input;
pub mod mig;
pub mod pass;
pub mod pool_fit;
pub mod preempt;
pub mod queue;
pub mod quota;
pub mod request;
pub mod score;
pub mod select;
pub mod snapshot;
pub mod startup;

pub use alloc::{Allocation, AllocationId, Resources, Tenant, Tier};
pub use filter::{Explanation, Reason};
pub use frag::TargetWorkload;
pub use request::{GpuDemand, ModelSet, Request};
pub use score::{Policy, Scorer};
pub use select::{Decision, Engine, Placement};
pub use snapshot::{Cluster, ModelId, ModelTable, NodeSpec, NodeState, Runtime};
pub use startup::NodeStartup;

/// Errors of the placement engine. Every variant is a caller mistake or an
/// inconsistent snapshot; an unschedulable request is not an error but a
/// [`Decision::Unschedulable`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// A cluster may name at most 64 GPU models, so that an allowed-model set
    /// fits in one `u64` bitmask (the filter's hot path).
    #[error("too many gpu models: at most {max} are supported")]
    TooManyModels { max: usize },
    /// A request's share must be 1..=1000 milli-GPU and its count at least 1.
    #[error("invalid gpu request: {0}")]
    InvalidRequest(&'static str),
    /// A node index beyond the snapshot.
    #[error("unknown node index {0}")]
    UnknownNode(u32),
    /// Committing a placement would overdraw a GPU, CPU or memory, or it names
    /// a GPU the node does not have.
    #[error("placement does not fit node {node}: {what}")]
    Overcommit { node: u32, what: &'static str },
}

/// One whole GPU in milli-GPU.
pub const MILLI: u16 = 1000;
