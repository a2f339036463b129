//! What the instance and job tables share. An instance is work of one
//! member and a job a gang of instances; each has a row with a tenant and
//! a state, and an append-only table of the transitions it went through.
//! Paging those rows and writing and reading those transitions is written
//! once, here, for both.
//!
//! The scheduler sees both kinds as one queue, so waiting work is read,
//! placed and explained through one API: [`Store::pending_work`],
//! [`Store::schedule_work`] and [`Store::set_work_reason`], over
//! [`PendingWork`]. What differs by kind (one member or a whole gang) is
//! decided here, once, and not again by every caller.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;
use sqlx::{Any, AnyConnection, Row, Transaction};

use flotilla_core::id::{InstanceId, JobId, TenantId, WorkId};
use flotilla_core::instance::InstanceState;
use flotilla_core::job::JobState;
use flotilla_core::placement::Placement;

use crate::instances::PendingInstance;
use crate::jobs::QueuedJob;
use crate::{at, ms, PageReq, Result, Store, StoreError};

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

/// The tables that hold work: a closed set, so a table name is never
/// built from input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WorkTable {
    Instances,
    Jobs,
}

impl WorkTable {
    fn name(self) -> &'static str {
        match self {
            WorkTable::Instances => "instances",
            WorkTable::Jobs => "jobs",
        }
    }

    /// Its transitions' table and the column naming the work there.
    fn events(self) -> (&'static str, &'static str) {
        match self {
            WorkTable::Instances => ("instance_events", "instance_id"),
            WorkTable::Jobs => ("job_events", "job_id"),
        }
    }
}

/// One recorded transition, its state still the stored name: the caller
/// parses it into its own kind of state.
#[derive(Debug, Clone)]
pub(crate) struct Transition {
    pub state: String,
    pub reason: String,
    pub at: DateTime<Utc>,
}

/// An id of work, and which table and states go with it.
pub(crate) trait WorkKey {
    /// The table its rows are in.
    const TABLE: WorkTable;
    /// Its kind of state.
    type State: Copy;
    /// The state it waits in before it is placed.
    const WAITING: &'static str;
    /// The id as stored.
    fn key(&self) -> &str;
    /// A state's stored name.
    fn state_name(state: Self::State) -> &'static str;
}

impl WorkKey for InstanceId {
    const TABLE: WorkTable = WorkTable::Instances;
    const WAITING: &'static str = "pending";
    type State = InstanceState;
    fn key(&self) -> &str {
        self.as_str()
    }
    fn state_name(state: InstanceState) -> &'static str {
        state.as_str()
    }
}

impl WorkKey for JobId {
    const TABLE: WorkTable = WorkTable::Jobs;
    const WAITING: &'static str = "queued";
    type State = JobState;
    fn key(&self) -> &str {
        self.as_str()
    }
    fn state_name(state: JobState) -> &'static str {
        state.as_str()
    }
}

/// Appends a transition of work `id` inside `tx`, numbered after the last.
pub(crate) async fn add_event<K: WorkKey>(
    tx: &mut Transaction<'static, Any>,
    id: &K,
    state: K::State,
    reason: &str,
    now: DateTime<Utc>,
) -> Result<()> {
    let (events, key) = K::TABLE.events();
    let sql = format!(
        "INSERT INTO {events} ({key}, seq, state, reason, at) \
         SELECT $1, COALESCE(MAX(seq), -1) + 1, $2, $3, $4 FROM {events} WHERE {key} = $1"
    );
    sqlx::query(&sql)
        .bind(id.key())
        .bind(K::state_name(state))
        .bind(reason)
        .bind(ms(now))
        .execute(&mut **tx)
        .await?;
    Ok(())
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
        mut new_member: impl FnMut() -> InstanceId,
        now: DateTime<Utc>,
    ) -> Result<Vec<InstanceId>> {
        let mut tx = self.begin().await?;
        let members = match work {
            PendingWork::Instance(p) => {
                let [plan] = placements else {
                    return Err(StoreError::Conflict(format!(
                        "instance {} has 1 member, the plan {}",
                        p.id,
                        placements.len()
                    )));
                };
                crate::instances::schedule_in(&mut tx, &p.id, plan, now).await?;
                vec![p.id.clone()]
            }
            PendingWork::Job(j) => {
                let ids: Vec<InstanceId> = placements.iter().map(|_| new_member()).collect();
                crate::jobs::schedule_gang_in(&mut tx, &j.id, j.attempt, placements, &ids, now)
                    .await?;
                ids
            }
        };
        crate::txn::commit(tx).await?;
        Ok(members)
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

    /// [`Store::set_work_reason`] for one kind of work.
    async fn set_wait_reason<K: WorkKey>(
        &self,
        id: &K,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let sql = format!(
            "UPDATE {} SET state_reason = $1, updated_at = $2 WHERE id = $3 AND state = $4",
            K::TABLE.name()
        );
        sqlx::query(&sql)
            .bind(reason)
            .bind(ms(now))
            .bind(id.key())
            .bind(K::WAITING)
            .execute(self.writer())
            .await?;
        Ok(())
    }

    /// A page of work rows by id, optionally of one tenant and in one state
    /// (the state's stored name), over-fetched by one to learn whether a
    /// next page exists.
    pub(crate) async fn work_page(
        &self,
        table: WorkTable,
        only: Option<&flotilla_core::id::TenantId>,
        state: Option<&str>,
        page: &PageReq,
    ) -> Result<Vec<AnyRow>> {
        // Only the filters given are written into the statement, so the
        // database can walk the index that matches them in id order and
        // stop after one page: `(tenant_id, state, id)`, `(tenant_id,
        // id)`, `(state, id)` or the primary key. (`$2 = '' OR tenant_id =
        // $2` hides that choice from the planner: it walked the primary key
        // and filtered, reading every other tenant's rows on the way.)
        let mut filter = String::new();
        let mut next = 2;
        for (column, value) in [("tenant_id", only.map(|t| t.as_str())), ("state", state)] {
            if value.is_some() {
                filter.push_str(&format!("{column} = ${next} AND "));
                next += 1;
            }
        }
        let sql = format!(
            "SELECT * FROM {} WHERE {filter}id > $1 ORDER BY id LIMIT ${next}",
            table.name()
        );
        let mut q = sqlx::query(&sql).bind(page.after_or_empty());
        for value in [only.map(|t| t.as_str()), state].into_iter().flatten() {
            q = q.bind(value);
        }
        Ok(q.bind(page.fetch()).fetch_all(self.pool()).await?)
    }

    /// The transitions of the works `ids` (a page: at most
    /// [`PageReq`]'s 1,000), oldest first, by work id; one query for all
    /// of them, each read through the events' primary key. (A range from
    /// the lowest to the highest id read the events of every other work
    /// created between them, other tenants' included.)
    pub(crate) async fn transitions<'a>(
        &self,
        table: WorkTable,
        ids: impl IntoIterator<Item = &'a str>,
    ) -> Result<HashMap<String, Vec<Transition>>> {
        let mut out: HashMap<String, Vec<Transition>> = ids
            .into_iter()
            .map(|id| (id.to_string(), Vec::new()))
            .collect();
        if out.is_empty() {
            return Ok(out);
        }
        let (events, key) = table.events();
        let params = (1..=out.len())
            .map(|n| format!("${n}"))
            .collect::<Vec<_>>()
            .join(", ");
        let sql = format!(
            "SELECT {key} AS work_id, state, reason, at FROM {events} \
             WHERE {key} IN ({params}) ORDER BY {key}, seq"
        );
        let mut q = sqlx::query(&sql);
        for id in out.keys() {
            q = q.bind(id.clone());
        }
        let rows = q.fetch_all(self.pool()).await?;
        for r in &rows {
            let Some(list) = out.get_mut(&r.try_get::<String, _>("work_id")?) else {
                continue;
            };
            list.push(Transition {
                state: r.try_get("state")?,
                reason: r.try_get("reason")?,
                at: at(r.try_get("at")?),
            });
        }
        Ok(out)
    }
}
