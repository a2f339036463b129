//! Backends behind small traits (architecture principle 4): where placed
//! work runs when a node is not one of Flotilla's own agents, and where
//! capacity comes from.
//!
//! An [`Executor`] fronts a cluster engine (Slurm, Kubernetes) that owns
//! many nodes. It speaks to the control plane exactly as agents do: its
//! bridge registers every engine node it reports as a Flotilla node and
//! syncs each one (observed state up, assignments down), so the scheduler,
//! metering, logs, stop and preemption need no executor-specific code in
//! the server. The executor only translates: an assignment becomes an
//! engine submission that honours Flotilla's placement (that node, those
//! GPUs), and the engine's job states become [`ObservedInstance`]s.
//!
//! A [`capacity::CapacityProvider`] hands out machines for a node pool:
//! the simulated cloud (shared with the simulator), OpenStack Nova, or
//! local agent processes. The node-pool autoscaler's loop in the server
//! drives it; new machines join with a one-time join token.
//!
//! [`ObservedInstance`]: flotilla_core::api::ObservedInstance

pub mod capacity;
pub mod executor;
#[cfg(feature = "kubernetes")]
pub mod kube;

pub use executor::{Executor, ExecutorError};
