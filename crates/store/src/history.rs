//! The recorded demand of a window, for `GET /v1/history/demand`: every
//! instance (not a job's member) and every job submitted in it, with when
//! each was first placed. The server turns them into
//! `flotilla_core::history::RecordedWork` (a job's share needs the
//! catalog); `flotilla simulate --from-history` replays them.

use chrono::{DateTime, Utc};
use flotilla_core::api::{Instance, Job};
use flotilla_core::placement::GpuShare;

use crate::instances::{instance, share_of};
use crate::jobs::job;
use crate::{at, ms, Result, Store};

/// An instance as it was asked for and ran.
#[derive(Debug, Clone)]
pub struct RecordedInstance {
    /// The instance (its spec, times and state).
    pub instance: Instance,
    /// What each of its GPUs takes.
    pub share: GpuShare,
    /// When it was first placed (its first `scheduled` event): GPUs are
    /// held from here.
    pub placed_at: Option<DateTime<Utc>>,
}

/// The most works one window returns: a replay of more reads a narrower
/// window at a time.
pub const MAX_RECORDED: i64 = 100_000;

impl Store {
    /// Instances that are no job's member, and jobs, created in
    /// `[from, to)`, oldest first.
    pub async fn recorded_demand(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<(Vec<RecordedInstance>, Vec<Job>)> {
        let rows = sqlx::query(
            "SELECT i.*, (SELECT MIN(e.at) FROM instance_events e \
             WHERE e.instance_id = i.id AND e.state = 'scheduled') AS placed_ms \
             FROM instances i WHERE i.job_id IS NULL AND i.created_at >= $1 AND i.created_at < $2 \
             ORDER BY i.created_at, i.id LIMIT $3",
        )
        .bind(ms(from))
        .bind(ms(to))
        .bind(MAX_RECORDED)
        .fetch_all(self.pool())
        .await?;
        let mut instances = Vec::with_capacity(rows.len());
        for r in &rows {
            let placed: Option<i64> = sqlx::Row::try_get(r, "placed_ms")?;
            instances.push(RecordedInstance {
                instance: instance(r)?,
                share: share_of(r)?,
                placed_at: placed.map(at),
            });
        }
        let rows = sqlx::query(
            "SELECT * FROM jobs WHERE created_at >= $1 AND created_at < $2 \
             ORDER BY created_at, id LIMIT $3",
        )
        .bind(ms(from))
        .bind(ms(to))
        .bind(MAX_RECORDED)
        .fetch_all(self.pool())
        .await?;
        let jobs = rows.iter().map(job).collect::<Result<Vec<_>>>()?;
        Ok((instances, jobs))
    }
}
