//! Flotilla's trace-driven autoscaling simulator.
//!
//! A discrete-event simulation on a virtual clock ([`engine`]): requests
//! from a [`trace::Trace`] arrive, wait in one FIFO queue, are routed to the
//! least-loaded ready replica, and hold one of its `max_concurrency` slots
//! for prefill then decode ([`service`]). Replicas start after a cold start
//! drawn from a measured shape ([`coldstart`]), optionally on nodes of a
//! [`nodes::NodePool`] grown and shrunk through a
//! [`nodes::CapacityProvider`] and placed by the server's own scheduling
//! pass (`flotilla_sched::pass::plan`). [`history`] replays a cluster's
//! recorded demand through that pass under other settings
//! (`flotilla simulate --from-history`). The replica count comes from the real
//! `flotilla-scale` policies ([`policies`]), called with the virtual `now`
//! at each policy's own cadence, exactly as the live server calls them with
//! the wall clock. [`oracle`] computes a perfect-foresight lower bound on
//! the GPU-seconds any policy needs; [`cost`] prices GPU time from the
//! billing crate's price book; [`report`] renders the comparison.
//!
//! Determinism: the only randomness is a `rand_chacha` generator seeded by
//! the caller, nothing iterates a hash map, and reports format numbers
//! explicitly, so the same trace, setting and seed give byte-identical
//! reports. The core loop does no I/O; [`trace`] and [`coldstart`] read
//! files and return plain data.

pub mod coldstart;
pub mod cost;
pub mod engine;
pub mod history;
pub mod nodes;
pub mod oracle;
pub mod policies;
pub mod report;
pub mod scenario;
pub mod service;
pub mod trace;

pub use coldstart::ColdStartModel;
pub use engine::{simulate, SimConfig, SimResult, TierSetting, TierStats};
pub use flotilla_scale::{ReadinessTiers, Tier};
pub use policies::PolicyKind;
pub use service::ServiceModel;
pub use trace::{Request, Trace};

/// Errors of the simulator: bad input files, bad settings. The simulation
/// itself never fails once its inputs are valid.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A line of an input file is malformed.
    #[error("line {line}, field {field}: {message}")]
    Parse {
        line: usize,
        field: &'static str,
        message: String,
    },
    /// The trace has no request.
    #[error("the trace has no request")]
    EmptyTrace,
    /// A setting is out of range.
    #[error("invalid simulation setting {field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    /// The price book has no price for the simulated GPU type.
    #[error("prices: {source}")]
    Pricing {
        #[source]
        source: flotilla_billing::BillingError,
    },
    /// A policy rejected its configuration.
    #[error("policy {policy}: {source}")]
    Policy {
        policy: &'static str,
        #[source]
        source: flotilla_scale::ScaleError,
    },
}

impl SimError {
    pub(crate) fn parse(line: usize, field: &'static str, message: String) -> Self {
        Self::Parse {
            line,
            field,
            message,
        }
    }

    pub(crate) fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid {
            field,
            message: message.into(),
        }
    }
}
