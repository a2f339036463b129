//! The cluster's recorded demand, as `GET /v1/history/demand` answers it
//! and `flotilla simulate --from-history` replays it: every instance and
//! job submitted in a window, with what it asked for, when it was
//! submitted, when it started and when it ended, and the machines of the
//! pool. Enough to hand the same demand to the scheduling pass again under
//! other settings and to compare with what happened.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::id::{TenantId, WorkId};
use crate::node::RuntimeKind;

/// One instance or job as it was asked for and as it ran. An instance of
/// a job is not listed on its own: the job is, with all its members.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RecordedWork {
    /// The instance or job.
    #[schema(value_type = String)]
    pub id: WorkId,
    /// Whose.
    pub tenant_id: TenantId,
    /// Members placed together (1 for an instance; a job's `nodes`).
    pub members: u32,
    /// GPUs per member.
    pub gpus: u32,
    /// Thousandths of a GPU each of those GPUs takes: 1000 for whole GPUs,
    /// less for a fraction or a MIG slice.
    pub gpu_milli: u32,
    /// The share is a MIG slice (goes only to GPUs in MIG mode).
    pub mig: bool,
    /// Acceptable GPU models; empty: any.
    pub gpu_types: Vec<String>,
    /// CPU per member, milli-cores.
    pub cpu_milli: u32,
    /// Memory per member, MiB.
    pub memory_mb: u64,
    /// Service tier, 1..=3.
    pub tier: u8,
    /// Queue priority.
    pub priority: i32,
    /// May be preempted.
    pub preemptible: bool,
    /// Needs a container runtime (has an image) or a process one.
    pub runtime: RuntimeKind,
    /// When it was submitted.
    pub submitted_at: DateTime<Utc>,
    /// When it started running (its first start), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<DateTime<Utc>>,
    /// When it ended, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<DateTime<Utc>>,
    /// The GPU model it ran on, if it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_model: Option<String>,
}

impl RecordedWork {
    /// Milli-GPU the whole work holds while it runs.
    pub fn milli(&self) -> u64 {
        u64::from(self.members) * u64::from(self.gpus) * u64::from(self.gpu_milli)
    }

    /// How long it ran within the window ending at `to`, ms: from its start
    /// to its end, or to `to` while it still runs. `None` when it never
    /// started before `to`.
    pub fn ran_ms(&self, to: DateTime<Utc>) -> Option<u64> {
        let start = self.started_at.filter(|s| *s < to)?;
        let end = self.finished_at.map_or(to, |f| f.min(to));
        Some(u64::try_from((end - start).num_milliseconds()).unwrap_or(0))
    }
}

/// A machine of the pool, as the replay needs it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RecordedNode {
    /// Its name.
    pub name: String,
    /// Region.
    pub region: String,
    /// Node pool.
    pub pool: String,
    /// How it runs work.
    pub runtime: RuntimeKind,
    /// CPU, milli-cores.
    pub cpu_milli: u64,
    /// Memory, MiB.
    pub memory_mb: u64,
    /// Its GPUs' catalog models, by GPU index.
    pub gpus: Vec<String>,
    /// Which of its GPUs are in MIG mode, by GPU index.
    pub mig: Vec<bool>,
}

/// The demand of a window and the pool it ran on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DemandHistory {
    /// Start of the window, inclusive.
    pub from: DateTime<Utc>,
    /// End of the window, exclusive.
    pub to: DateTime<Utc>,
    /// Work submitted in the window, oldest first.
    pub works: Vec<RecordedWork>,
    /// The machines registered now (not removed).
    pub nodes: Vec<RecordedNode>,
    /// The placement policy the server schedules with (`BestFit`, `Fgd`,
    /// `Flotilla`, …): a replay's default.
    pub placement_policy: String,
}
