//! The executor trait: one cluster engine, many nodes.

use flotilla_core::api::{Assignment, LogLine, ObservedInstance, RegisterNode};
use flotilla_core::id::InstanceId;
use flotilla_core::node::ExecutorKind;
use futures::future::BoxFuture;

/// Why an executor call failed. Transient failures (the engine's API is
/// down, a timeout) are retried by the bridge on its next round; the rest
/// are reported against the instance that caused them.
#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    /// The engine could not be reached or answered with a server error.
    #[error("{engine} unavailable: {message}")]
    Unavailable {
        /// Which engine.
        engine: ExecutorKind,
        /// What happened.
        message: String,
    },
    /// The engine refused a request (bad submission, permission).
    #[error("{engine} refused: {message}")]
    Refused {
        /// Which engine.
        engine: ExecutorKind,
        /// What it said.
        message: String,
    },
    /// The engine's answer could not be understood.
    #[error("unexpected answer from {engine}: {message}")]
    Protocol {
        /// Which engine.
        engine: ExecutorKind,
        /// What was wrong with it.
        message: String,
    },
}

impl ExecutorError {
    /// Whether retrying later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, ExecutorError::Unavailable { .. })
    }
}

/// A cluster engine that runs Flotilla's placed work on the nodes it
/// manages. Object safe: the bridge holds an `Arc<dyn Executor>` chosen by
/// configuration. Every method is idempotent and safe to call again after a
/// crash at any line: the engine is the source of truth for what runs.
pub trait Executor: Send + Sync {
    /// Which engine this is.
    fn kind(&self) -> ExecutorKind;

    /// The engine's nodes with their GPUs, as Flotilla registers them: the
    /// engine's partition or node pool as `pool`, its runtime as the kind of
    /// work it takes (commands for Slurm, images for Kubernetes).
    fn inventory(&self) -> BoxFuture<'_, Result<Vec<RegisterNode>, ExecutorError>>;

    /// Makes the engine run what the server assigned to `node` (by its
    /// registered name) and stop what it wants stopped: submits assignments
    /// not yet submitted (pinned to that node and those GPUs), cancels those
    /// with `stop` set. Called on every sync with the full list.
    fn apply<'a>(
        &'a self,
        node: &'a str,
        assignments: &'a [Assignment],
    ) -> BoxFuture<'a, Result<(), ExecutorError>>;

    /// What the engine reports of the instances it runs (or ran) for
    /// Flotilla on `node`.
    fn observe<'a>(
        &'a self,
        node: &'a str,
    ) -> BoxFuture<'a, Result<Vec<ObservedInstance>, ExecutorError>>;

    /// An instance's output from line `since` on (numbered from 0 without
    /// gaps, as agents ship it).
    fn logs<'a>(
        &'a self,
        instance: &'a InstanceId,
        since: u64,
    ) -> BoxFuture<'a, Result<Vec<LogLine>, ExecutorError>>;
}
