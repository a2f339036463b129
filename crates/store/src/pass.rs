//! What one scheduling pass reads, read as one snapshot.
//!
//! A pass sees the nodes' free GPUs, the queue, the work holding GPUs and
//! the promises, quotas and recent use behind the queue's order. Read
//! statement by statement, those can come from different moments: an
//! instance that exits between the read of the GPUs (still taken) and the
//! read of the running work (gone) leaves a GPU that nobody holds and that
//! never frees, so the blocked head of the queue cannot count on it, gets
//! no reservation there, and the work behind the head is placed on the
//! head's machine instead (the race `sharing.rs`'s backfill test caught
//! about one run in ten under load). So every read here runs in one
//! read-only transaction: on PostgreSQL at REPEATABLE READ (one snapshot
//! for every statement, where READ COMMITTED takes one per statement); on
//! SQLite a deferred transaction, whose first read fixes the WAL snapshot
//! the rest see.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use flotilla_core::api::WeightTier;
use flotilla_core::id::{GpuId, JobId, NodeId, TenantId, WorkId};
use flotilla_core::placement::NodeSnapshot;
use flotilla_core::quota::Quota;

use crate::instances::{HeldInstance, RecentUsage};
use crate::waiting::PendingWork;
use crate::{Backend, Result, Store};

/// Everything a scheduling pass reads, as of one moment.
#[derive(Debug, Clone, Default)]
pub struct PassInputs {
    /// Every node with its free GPUs, CPU and memory.
    pub nodes: Vec<NodeSnapshot>,
    /// Pending instances and queued jobs, oldest first
    /// ([`Store::pending_work`]).
    pub queue: Vec<PendingWork>,
    /// Instances holding GPUs.
    pub held: Vec<HeldInstance>,
    /// Time limits (seconds) of running jobs that have one; read only
    /// when a held instance belongs to a job.
    pub time_limits: BTreeMap<JobId, u64>,
    /// GPUs promised to waiting preemptors.
    pub promised: BTreeMap<WorkId, Vec<GpuId>>,
    /// What each node holds of replicas' weights; read only when a
    /// pending instance declares weights.
    pub weights: BTreeMap<NodeId, BTreeMap<String, WeightTier>>,
    /// Tenants' quotas (those that set one).
    pub quotas: BTreeMap<TenantId, Quota>,
    /// GPU use since `usage_since`, for the fair share.
    pub usage: Vec<RecentUsage>,
}

impl Store {
    /// Reads a pass's inputs in one read-only transaction (see the
    /// module): at most `queue_limit` pieces of waiting work, the oldest,
    /// and GPU use since `usage_since`.
    pub async fn pass_inputs(
        &self,
        queue_limit: u32,
        usage_since: DateTime<Utc>,
    ) -> Result<PassInputs> {
        let mut tx = crate::txn::begin(self.pool()).await?;
        if self.backend() == Backend::Postgres {
            sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                .execute(&mut *tx)
                .await?;
        }
        let nodes = crate::nodes::placement_snapshot_in(&mut tx).await?;
        let queue = crate::waiting::pending_work_in(&mut tx, queue_limit).await?;
        let held = crate::instances::held_instances_in(&mut tx).await?;
        let time_limits = if held.iter().any(|h| h.job_id.is_some()) {
            crate::jobs::running_time_limits_in(&mut tx).await?
        } else {
            BTreeMap::new()
        };
        let promised = crate::instances::promised_gpus_in(&mut tx).await?;
        let declares_weights =
            |w: &PendingWork| matches!(w, PendingWork::Instance(p) if p.weights.is_some());
        let weights = if queue.iter().any(declares_weights) {
            crate::weights::weights_by_node_in(&mut tx).await?
        } else {
            BTreeMap::new()
        };
        let quotas = crate::tenants::quotas_in(&mut tx).await?;
        let usage = crate::instances::recent_usage_in(&mut tx, usage_since).await?;
        // Nothing was written: ending it either way releases the snapshot.
        tx.rollback().await?;
        Ok(PassInputs {
            nodes,
            queue,
            held,
            time_limits,
            promised,
            weights,
            quotas,
            usage,
        })
    }
}
