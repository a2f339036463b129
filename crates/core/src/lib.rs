//! Flotilla's domain: identifiers, the GPU catalog, tenants and roles, quotas,
//! nodes, instances and their lifecycle, first-fit placement and the wire
//! types shared by the server, the agent and the CLI.
//!
//! This crate must never do I/O: no network, no disk, no threads and no
//! reading of the wall clock. Decision code takes `now` as an argument so the
//! live server and the simulator can call the same functions.

pub mod access;
pub mod advice;
pub mod api;
pub mod catalog;
pub mod clock;
pub mod endpoint;
pub mod error;
pub mod gateway;
pub mod health;
pub mod history;
pub mod id;
pub mod instance;
pub mod job;
pub mod node;
pub mod nodepool;
pub mod offer;
pub mod placement;
pub mod queue_trigger;
pub mod quota;
pub mod registry;
pub mod ssh_key;
pub mod tenant;
pub mod text;
pub mod work;

pub use error::{FieldError, QuotaExceeded};
