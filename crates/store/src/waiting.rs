//! Work waiting to be placed, over both kinds: the scheduler sees pending
//! instances and queued jobs as one queue, so waiting work is read, placed
//! and explained through one API: [`Store::pending_work`],
//! [`Store::schedule_work`] and [`Store::set_work_reason`], over
//! [`PendingWork`]. What differs by kind (one member or a whole gang) is
//! decided here, once, and not again by every caller.

use chrono::{DateTime, Utc};
use sqlx::AnyConnection;

use flotilla_core::id::{InstanceId, TenantId, WorkId};
use flotilla_core::placement::Placement;

use crate::instances::PendingInstance;
use crate::jobs::QueuedJob;
use crate::{Result, Store, StoreError};

/// Work waiting to be placed, as the scheduler reads it: a pending
/// instance (work of one member) or a queued job (a gang placed whole).
/// What [`Store::schedule_work`] is handed back, so a placement is
/// conditional on the work as the caller saw it (a job at its attempt).
#[derive(Debug, Clone)]
pub enum PendingWork {
    /// A pending instance.
    Instance(PendingInstance),
    /// A queued job.
    Job(QueuedJob),
}

impl PendingWork {
    /// Its id.
    pub fn id(&self) -> WorkId {
        match self {
            PendingWork::Instance(p) => WorkId::Instance(p.id.clone()),
            PendingWork::Job(j) => WorkId::Job(j.id.clone()),
        }
    }

    /// Its owner.
    pub fn tenant_id(&self) -> &TenantId {
        match self {
            PendingWork::Instance(p) => &p.tenant_id,
            PendingWork::Job(j) => &j.tenant_id,
        }
    }

    /// Why it is not placed yet, as last written.
    pub fn state_reason(&self) -> &str {
        match self {
            PendingWork::Instance(p) => &p.state_reason,
            PendingWork::Job(j) => &j.state_reason,
        }
    }

    /// When it was submitted (a requeued job keeps its first submission).
    pub fn created_at(&self) -> DateTime<Utc> {
        match self {
            PendingWork::Instance(p) => p.created_at,
            PendingWork::Job(j) => j.created_at,
        }
    }
}

/// [`Store::pending_work`] on `conn`: a scheduling pass reads it inside
/// its one snapshot transaction ([`Store::pass_inputs`]).
pub(crate) async fn pending_work_in(
    conn: &mut AnyConnection,
    limit: u32,
) -> Result<Vec<PendingWork>> {
    // The oldest `limit` of both kinds are among the oldest `limit` of
    // each (ids sort by creation time).
    let mut work: Vec<PendingWork> = crate::instances::pending_instances_in(conn, limit)
        .await?
        .into_iter()
        .map(PendingWork::Instance)
        .collect();
    work.extend(
        crate::jobs::queued_jobs_in(conn, limit)
            .await?
            .into_iter()
            .map(PendingWork::Job),
    );
    // Stable: work submitted in one millisecond keeps the reads' order,
    // instances before jobs and each kind by id.
    work.sort_by_key(PendingWork::created_at);
    work.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
    Ok(work)
}

impl Store {
    /// Pending instances and queued jobs together, at most `limit` of
    /// them, oldest first: the queue a scheduling pass orders (its own
    /// read is [`Store::pass_inputs`], in one snapshot with the rest).
    pub async fn pending_work(&self, limit: u32) -> Result<Vec<PendingWork>> {
        pending_work_in(&mut *self.pool().acquire().await?, limit).await
    }

    /// Places waiting work, in one transaction: a pending instance's one
    /// member (`placements` holds exactly one placement), or a queued
    /// job's whole gang (`placements[r]` is rank r's, and `new_member`
    /// names each rank's new instance: the caller owns ids' time and
    /// randomness). Each GPU is taken only if it is still free; a job only
    /// if it is still queued at the attempt `work` was read at, and it
    /// moves to `running` with a new attempt. `Conflict`, and no change at
    /// all, when a GPU was taken meanwhile, the work left the queue, or
    /// the plan has the wrong number of members. Returns the instances now
    /// scheduled, by rank (for an instance: itself).
    pub async fn schedule_work(
        &self,
        work: &PendingWork,
        placements: &[Placement],
        new_member: impl FnMut() -> InstanceId,
        now: DateTime<Utc>,
    ) -> Result<Vec<InstanceId>> {
        self.schedule_works(&[(work, placements)], new_member, now)
            .await?
            .pop()
            .unwrap_or_else(|| Err(StoreError::Corrupt("a batch of one wrote none".into())))
    }

    /// [`Store::schedule_work`] for several works in one transaction, each
    /// in a savepoint of its own: one commit for the lot (at a fleet's
    /// fill, a commit per placement made the leader's pass write for
    /// minutes; docs/scale.md), and a work that lost a race (`Conflict`,
    /// `NotFound`) or is over quota (`Quota`) leaves nothing behind while
    /// the others stand. Those come back per work, in order; any other
    /// error ends the batch, which then writes nothing.
    pub async fn schedule_works(
        &self,
        batch: &[(&PendingWork, &[Placement])],
        mut new_member: impl FnMut() -> InstanceId,
        now: DateTime<Utc>,
    ) -> Result<Vec<Result<Vec<InstanceId>>>> {
        let mut tx = self.begin().await?;
        let mut out = Vec::with_capacity(batch.len());
        for (work, placements) in batch {
            // Not `placing`: a reserved word in PostgreSQL.
            sqlx::query("SAVEPOINT place_one").execute(&mut *tx).await?;
            let one = match work {
                PendingWork::Instance(p) => match placements {
                    [plan] => crate::instances::schedule_in(&mut tx, &p.id, plan, now)
                        .await
                        .map(|()| vec![p.id.clone()]),
                    _ => Err(StoreError::Conflict(format!(
                        "instance {} has 1 member, the plan {}",
                        p.id,
                        placements.len()
                    ))),
                },
                PendingWork::Job(j) => {
                    let ids: Vec<InstanceId> = placements.iter().map(|_| new_member()).collect();
                    crate::jobs::schedule_gang_in(&mut tx, &j.id, j.attempt, placements, &ids, now)
                        .await
                        .map(|()| ids)
                }
            };
            match one {
                Ok(_) => {}
                Err(StoreError::Conflict(_) | StoreError::NotFound(_) | StoreError::Quota(_)) => {
                    sqlx::query("ROLLBACK TO SAVEPOINT place_one")
                        .execute(&mut *tx)
                        .await?;
                }
                Err(e) => return Err(e),
            }
            sqlx::query("RELEASE SAVEPOINT place_one")
                .execute(&mut *tx)
                .await?;
            out.push(one);
        }
        crate::txn::commit(tx).await?;
        Ok(out)
    }

    /// Updates why waiting work is not placed yet; nothing when it has
    /// left the queue meanwhile.
    pub async fn set_work_reason(
        &self,
        id: &WorkId,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<()> {
        match id {
            WorkId::Instance(i) => self.set_wait_reason(i, reason, now).await,
            WorkId::Job(j) => self.set_wait_reason(j, reason, now).await,
        }
    }

    /// The newest waiting instance's and job's ids: cheap (one index
    /// probe each), and different whenever work was submitted or requeued
    /// through any replica since the last read, so the leader can tell
    /// that its pass is due without planning.
    pub async fn newest_waiting(&self) -> Result<(Option<String>, Option<String>)> {
        let instance: Option<String> = sqlx::query_scalar(
            "SELECT id FROM instances WHERE state = 'pending' ORDER BY id DESC LIMIT 1",
        )
        .fetch_optional(self.pool())
        .await?;
        let job: Option<String> = sqlx::query_scalar(
            "SELECT id FROM jobs WHERE state = 'queued' ORDER BY id DESC LIMIT 1",
        )
        .fetch_optional(self.pool())
        .await?;
        Ok((instance, job))
    }
}
