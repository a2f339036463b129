//! What a scheduling pass plans over: one snapshot of the machines, the
//! work holding GPUs, the queue, tenants' quotas and recent use, as plain
//! data with dense indices. The server gathers it from the store, the
//! simulator builds it from a trace; [`crate::pass::plan`] reads it and
//! nothing else, and [`crate::pool_fit`] asks of it whether work could
//! ever fit. Kept apart from the planner so that both can name it without
//! importing each other.

use std::collections::BTreeMap;

use flotilla_core::catalog::{MIG_COMPUTE_SLICES, MIG_MEMORY_SLICES};
use flotilla_core::placement::GpuShare;

use crate::alloc::{Tenant, Tier};
use crate::gang::Locality;
use crate::preempt::PreemptConfig;
use crate::queue::FairShareConfig;
use crate::quota::Quota;
use crate::request::GpuDemand;
use crate::score::Policy;
use crate::snapshot::Runtime;
use crate::{Error, MILLI};

/// The caller's name for a piece of work (queued or running), opaque here.
pub type WorkKey = u64;

/// The suffix that makes a MIG-mode GPU's engine model (`H100/mig`).
pub const MIG_SUFFIX: &str = "/mig";

/// What each member of a work asks of GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpuAsk {
    /// No GPU (CPU-only work).
    None,
    /// `n` whole GPUs of one model on one machine.
    Whole(u16),
    /// A share of one GPU in milli-GPU (1..=999); a GPU not in MIG mode.
    Fraction(u16),
    /// One MIG instance on a GPU in MIG mode, taking this many milli-GPU
    /// of it as the caller's MIG geometry counts it (see
    /// [`GpuAsk::mig_profile`] for the compute-slice count alone).
    Mig(u16),
}

impl GpuAsk {
    /// The engine's demand for it.
    pub(crate) fn demand(self) -> Result<GpuDemand, Error> {
        Ok(match self {
            GpuAsk::None => GpuDemand::None,
            GpuAsk::Whole(n) if n > 0 => GpuDemand::whole(n),
            GpuAsk::Whole(_) => return Err(Error::InvalidRequest("whole gpus: at least 1")),
            GpuAsk::Fraction(m) => GpuDemand::share(m)?,
            GpuAsk::Mig(m) if m >= MILLI => GpuDemand::whole(1),
            GpuAsk::Mig(m) => GpuDemand::share(m)?,
        })
    }

    /// What each member of a work asks when it takes `gpus` GPUs of
    /// `share` (the platform's one share type, `flotilla_core`'s): none,
    /// whole GPUs, a fraction of one, or a MIG instance counted by the
    /// larger of its compute and memory fractions ([`mig_milli`]).
    pub fn of(share: &GpuShare, gpus: u32) -> GpuAsk {
        match share {
            GpuShare::Whole if gpus == 0 => GpuAsk::None,
            GpuShare::Whole => GpuAsk::Whole(u16::try_from(gpus).unwrap_or(u16::MAX)),
            GpuShare::Fraction { milli } => GpuAsk::Fraction(*milli),
            GpuShare::Mig(p) => GpuAsk::Mig(mig_milli(p.compute_slices, p.memory_slices).0),
        }
    }

    /// Milli-GPU one member holds.
    pub fn milli(self) -> u64 {
        self.demand().map_or(0, |d| u64::from(d.total_milli()))
    }
}

/// A MIG instance of `compute` compute and `memory` memory slices as
/// milli-GPU, rounded down, counted both ways: `(the larger, the smaller)`
/// of the two fractions. An instance asks for the larger and a MIG-mode
/// GPU offers the smaller of its free fractions, so whatever the planner
/// fits also fits the GPU's geometry, which the store checks again when it
/// writes (rounding down keeps seven 1g slices within 1000).
pub fn mig_milli(compute: u8, memory: u8) -> (u16, u16) {
    let c = u32::from(compute.min(MIG_COMPUTE_SLICES)) * 1000 / u32::from(MIG_COMPUTE_SLICES);
    let m = u32::from(memory.min(MIG_MEMORY_SLICES)) * 1000 / u32::from(MIG_MEMORY_SLICES);
    // Both at most 1000: fit u16.
    (c.max(m) as u16, c.min(m) as u16)
}

/// One GPU of a machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuSnap {
    /// Catalog model name.
    pub model: String,
    /// In MIG mode: takes MIG profiles only.
    pub mig: bool,
    /// Milli-GPU no work holds (0..=1000). Promised capacity is free here
    /// and listed in [`Snapshot::promises`].
    pub free_milli: u16,
}

/// One machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSnap {
    /// Heartbeats arrive; an unready machine takes nothing.
    pub ready: bool,
    /// Taken out of scheduling by an operator.
    pub cordoned: bool,
    /// Region (gangs may be kept within one).
    pub region: String,
    /// Node pool (the topology domain a gang may be kept within).
    pub pool: String,
    /// How it runs work: only work needing that runtime goes there.
    pub runtime: Runtime,
    /// CPU the machine offers, milli-cores.
    pub cpu_total_milli: u32,
    /// Memory the machine offers, MiB.
    pub mem_total_mib: u64,
    /// CPU no work holds, milli-cores (work in [`Snapshot::running`] and
    /// anything else the caller counts as taken).
    pub cpu_free_milli: u32,
    /// Memory no work holds, MiB.
    pub mem_free_mib: u64,
    /// Its GPUs; a GPU is named by its index here.
    pub gpus: Vec<GpuSnap>,
}

/// What one member of running work holds: GPUs of one machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// Index into [`Snapshot::nodes`].
    pub node: usize,
    /// `(GPU index on the node, milli-GPU held)`.
    pub gpus: Vec<(u16, u16)>,
    /// CPU it holds there, milli-cores.
    pub cpu_milli: u32,
    /// Memory it holds there, MiB.
    pub mem_mib: u64,
}

/// Work holding GPUs now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningWork {
    pub key: WorkKey,
    pub tenant: Tenant,
    pub tier: Tier,
    pub priority: i32,
    /// Accepted being preempted.
    pub preemptible: bool,
    /// When it started (ms): the work a preemption throws away grows with it.
    pub started_ms: u64,
    /// When it will have ended at the latest (a time limit), if known: what
    /// lets a reservation plan the head's start.
    pub ends_by_ms: Option<u64>,
    /// Already told to stop (preempted, or stopping): never chosen again;
    /// its capacity goes to whoever preempted it.
    pub stopping: bool,
    /// The work it was preempted for, while it still holds its GPUs: that
    /// work waits for it rather than preempting more.
    pub preempted_by: Option<WorkKey>,
    /// One hold per member.
    pub members: Vec<Hold>,
}

/// Free capacity set aside for a preemptor: its victims released it, and
/// no one else may take it until the preemptor is placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Promise {
    pub node: usize,
    pub gpu: u16,
    pub milli: u16,
    pub to: WorkKey,
}

/// Waiting work: an instance is a work of one member, a job of several.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedWork {
    pub key: WorkKey,
    pub tenant: Tenant,
    pub tier: Tier,
    pub priority: i32,
    pub submitted_ms: u64,
    /// Members, all placed or none (at least 1).
    pub members: u16,
    /// Every member on a machine of its own.
    pub spread: bool,
    /// Where members may go relative to each other.
    pub locality: Locality,
    /// Per member.
    pub gpu: GpuAsk,
    /// Acceptable GPU models; empty: any.
    pub models: Vec<String>,
    /// Per member.
    pub cpu_milli: u32,
    /// Per member.
    pub mem_mib: u64,
    /// The runtime its machines must run (containers for an image).
    pub runtime: Runtime,
    /// How long it runs at most once started (a time limit), if known:
    /// work that ends before the head's start may backfill on its nodes.
    pub max_runtime_ms: Option<u64>,
    /// Time until it would be ready on each machine, ms, by machine index
    /// (an endpoint replica: its weights parked, cached or remote there);
    /// empty: where it starts does not change when it is ready. A single
    /// member placed anywhere then goes where it is ready soonest, the
    /// policy's score breaking ties ([`crate::startup`]); a machine the
    /// list does not reach is taken as slowest.
    pub ready_ms: Vec<u64>,
}

/// A tenant's quota and fair-share weight. Tenants absent from
/// [`Snapshot::tenants`] have no guarantee, no limit and weight 1.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TenantPolicy {
    /// Guarantee and burst, milli-GPU ([`crate::quota`]).
    pub quota: Quota,
    /// Most milli-GPU of one model, by catalog name.
    pub per_model_milli: BTreeMap<String, u64>,
    /// Fair-share weight (> 0).
    pub weight: f64,
}

impl TenantPolicy {
    /// No guarantee, no limit, weight 1.
    pub fn unlimited() -> Self {
        TenantPolicy {
            quota: Quota {
                guaranteed_milli: 0,
                burst_milli: u64::MAX,
            },
            per_model_milli: BTreeMap::new(),
            weight: 1.0,
        }
    }
}

/// GPU time a tenant used recently, for fair share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UsageSpan {
    pub tenant: Tenant,
    pub gpu_milli: u64,
    pub from_ms: u64,
    pub to_ms: u64,
}

/// Everything one pass looks at.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The pass's time.
    pub now_ms: u64,
    /// Seeds tie-breaking: the same snapshot and seed plan the same.
    pub seed: u64,
    /// The scoring policy.
    pub policy: Policy,
    pub nodes: Vec<NodeSnap>,
    pub running: Vec<RunningWork>,
    pub promises: Vec<Promise>,
    /// Waiting work, in any order.
    pub queue: Vec<QueuedWork>,
    pub tenants: BTreeMap<Tenant, TenantPolicy>,
    /// Recent GPU use, for the queue's fair share.
    pub usage: Vec<UsageSpan>,
    pub fair_share: FairShareConfig,
    pub preempt: PreemptConfig,
}

impl Snapshot {
    /// A pass over `nodes`, `running` and `queue` with nothing promised,
    /// every tenant unlimited with weight 1, no recent use and the default
    /// fair-share and preemption settings: what a model without quotas
    /// (the simulator's) plans with.
    pub fn unlimited(
        now_ms: u64,
        seed: u64,
        policy: Policy,
        nodes: Vec<NodeSnap>,
        running: Vec<RunningWork>,
        queue: Vec<QueuedWork>,
    ) -> Self {
        Snapshot {
            now_ms,
            seed,
            policy,
            nodes,
            running,
            promises: Vec::new(),
            queue,
            tenants: BTreeMap::new(),
            usage: Vec::new(),
            fair_share: FairShareConfig::default(),
            preempt: PreemptConfig::default(),
        }
    }
}
