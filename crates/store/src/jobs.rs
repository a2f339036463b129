//! Jobs and their members.
//!
//! A job row holds the spec and the state; its members are instances
//! (`job_id`, `job_rank`, `job_attempt`), created only when the whole gang
//! is placed: [`Store::schedule_work`] inserts every member already
//! `scheduled`, with its GPUs claimed, and moves the job to `running`, in
//! one transaction, so a gang is placed whole or not at all. Every job
//! change is conditional on the state and attempt the caller saw, so two
//! passes racing change it once.

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use flotilla_core::api::{Job, JobEvent, JobMember};
use flotilla_core::id::{InstanceId, JobId, TenantId};
use flotilla_core::instance::{InstanceSpec, InstanceState};
use flotilla_core::job::{member_env, JobSpec, JobState};
use flotilla_core::placement::Placement;
use sqlx::any::AnyRow;
use sqlx::{Any, Row, Transaction};

use crate::work::add_event;
use crate::{at, json, ms, to_json, PageOf, PageReq, Result, Store, StoreError, WorkTable};

fn state_of(s: &str) -> Result<JobState> {
    JobState::parse(s).ok_or_else(|| StoreError::Corrupt(format!("job state `{s}`")))
}

fn small(v: i64) -> u32 {
    v.clamp(0, u32::MAX as i64) as u32
}

pub(crate) fn job(row: &AnyRow) -> Result<Job> {
    let started: Option<i64> = row.try_get("started_at")?;
    let finished: Option<i64> = row.try_get("finished_at")?;
    Ok(Job {
        id: JobId::from_trusted(row.try_get("id")?),
        tenant_id: TenantId::from_trusted(row.try_get("tenant_id")?),
        state: state_of(&row.try_get::<String, _>("state")?)?,
        state_reason: row.try_get("state_reason")?,
        spec: json(&row.try_get::<String, _>("spec")?, "job spec")?,
        attempts: small(row.try_get("attempt")?),
        failures: small(row.try_get("failures")?),
        cancel_requested: row.try_get::<i64, _>("cancel_requested")? != 0,
        created_at: at(row.try_get("created_at")?),
        started_at: started.map(at),
        finished_at: finished.map(at),
        members: Vec::new(),
        events: Vec::new(),
    })
}

/// What the scheduler needs of a queued job.
#[derive(Debug, Clone)]
pub struct QueuedJob {
    /// Id.
    pub id: JobId,
    /// Owner.
    pub tenant_id: TenantId,
    /// The spec (gang size, per-member demand, tier, priority).
    pub spec: JobSpec,
    /// Attempts started so far; [`Store::schedule_work`] checks it.
    pub attempt: u32,
    /// Current queued reason.
    pub state_reason: String,
    /// Submission time (FIFO; a requeued job keeps its seniority).
    pub created_at: DateTime<Utc>,
}

/// What the job loop needs of a running job and its current members.
#[derive(Debug, Clone)]
pub struct RunningJob {
    /// The job (its `members` and `events` are left empty).
    pub job: Job,
    /// The current members' instances, by rank.
    pub members: Vec<flotilla_core::api::Instance>,
}

impl Store {
    /// Admits and records a new job in `queued`. The tenant row is updated
    /// first, serialising concurrent submissions of one tenant, so the
    /// quota check (which counts queued jobs) cannot be raced past.
    pub async fn create_job(
        &self,
        id: &JobId,
        tenant: &TenantId,
        spec: &JobSpec,
        now: DateTime<Utc>,
    ) -> Result<Job> {
        let mut tx = self.begin().await?;
        let q = sqlx::query(
            "UPDATE tenants SET updated_at = $1 WHERE id = $2 \
             RETURNING quota_gpus_total, quota_gpus_per_model, quota_gpus_guaranteed, fair_share_weight",
        )
        .bind(ms(now))
        .bind(tenant.as_str())
        .fetch_optional(&mut *tx)
        .await?
        .ok_or(StoreError::NotFound("tenant"))?;
        let quota = crate::tenants::quota(&q)?;
        crate::tenants::admit_in(
            &mut tx,
            tenant,
            &quota,
            &spec.gpu_types,
            u64::from(spec.gpus) * 1000,
        )
        .await?;
        let reason = "waiting for placement";
        sqlx::query(
            "INSERT INTO jobs (id, tenant_id, state, state_reason, spec, gpus, nodes, gpu_types, \
             priority, tier, created_at, updated_at) \
             VALUES ($1, $2, 'queued', $3, $4, $5, $6, $7, $8, $9, $10, $10)",
        )
        .bind(id.as_str())
        .bind(tenant.as_str())
        .bind(reason)
        .bind(to_json(spec))
        .bind(i64::from(spec.gpus))
        .bind(i64::from(spec.nodes))
        .bind(to_json(&spec.gpu_types))
        .bind(i64::from(spec.priority))
        .bind(i64::from(spec.tier))
        .bind(ms(now))
        .execute(&mut *tx)
        .await?;
        add_event(&mut tx, id, JobState::Queued, reason, now).await?;
        crate::txn::commit(tx).await?;
        self.job(id).await
    }

    /// One job with every attempt's members and its events.
    pub async fn job(&self, id: &JobId) -> Result<Job> {
        let row = sqlx::query("SELECT * FROM jobs WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::NotFound("job"))?;
        let mut j = job(&row)?;
        self.fill(&mut j).await?;
        Ok(j)
    }

    /// Fills one job's members (every attempt's) and events.
    async fn fill(&self, j: &mut Job) -> Result<()> {
        self.fill_all(std::slice::from_mut(j)).await
    }

    /// Fills the members and events of `jobs` (sorted by id) in two
    /// queries over their id range, rather than two per job.
    async fn fill_all(&self, jobs: &mut [Job]) -> Result<()> {
        let (Some(lo), Some(hi)) = (jobs.first(), jobs.last()) else {
            return Ok(());
        };
        let (lo, hi) = (lo.id.to_string(), hi.id.to_string());
        let mut members: HashMap<String, Vec<JobMember>> = jobs
            .iter()
            .map(|j| (j.id.to_string(), Vec::new()))
            .collect();
        let rows = sqlx::query(
            "SELECT id, job_id, state, node_id, exit_code, job_rank, job_attempt FROM instances \
             WHERE job_id >= $1 AND job_id <= $2 ORDER BY job_id, job_attempt, job_rank",
        )
        .bind(&lo)
        .bind(&hi)
        .fetch_all(self.pool())
        .await?;
        for r in &rows {
            // The range may hold jobs of other tenants or states: skip them.
            let Some(list) = members.get_mut(&r.try_get::<String, _>("job_id")?) else {
                continue;
            };
            let s: String = r.try_get("state")?;
            let exit: Option<i64> = r.try_get("exit_code")?;
            list.push(JobMember {
                rank: small(r.try_get::<Option<i64>, _>("job_rank")?.unwrap_or(0)),
                attempt: small(r.try_get::<Option<i64>, _>("job_attempt")?.unwrap_or(0)),
                instance_id: InstanceId::from_trusted(r.try_get("id")?),
                state: InstanceState::parse(&s)
                    .ok_or_else(|| StoreError::Corrupt(format!("instance state `{s}`")))?,
                node_id: r
                    .try_get::<Option<String>, _>("node_id")?
                    .map(flotilla_core::id::NodeId::from_trusted),
                exit_code: exit.map(|c| c.clamp(i32::MIN as i64, i32::MAX as i64) as i32),
            });
        }
        let mut events = self
            .transitions(WorkTable::Jobs, jobs.iter().map(|j| j.id.as_str()))
            .await?;
        for j in jobs.iter_mut() {
            j.members = members.remove(j.id.as_str()).unwrap_or_default();
            j.events = events
                .remove(j.id.as_str())
                .unwrap_or_default()
                .into_iter()
                .map(|t| {
                    Ok(JobEvent {
                        state: state_of(&t.state)?,
                        reason: t.reason,
                        at: t.at,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
        }
        Ok(())
    }

    /// Jobs by id, optionally of one tenant and in one state.
    pub async fn list_jobs(
        &self,
        only: Option<&TenantId>,
        state: Option<JobState>,
        page: &PageReq,
    ) -> Result<PageOf<Job>> {
        let rows = self
            .work_page(WorkTable::Jobs, only, state.map(|s| s.as_str()), page)
            .await?;
        let items = rows.iter().map(job).collect::<Result<Vec<_>>>()?;
        let mut page = PageOf::from_overfetch(items, page, |j| j.id.to_string());
        self.fill_all(&mut page.items).await?;
        Ok(page)
    }

    /// Running jobs with their current attempt's members (without their
    /// events, which the job rule does not read): two queries whatever the
    /// number of jobs, as the job loop runs this on every pass.
    pub async fn running_jobs(&self) -> Result<Vec<RunningJob>> {
        let rows = sqlx::query("SELECT * FROM jobs WHERE state = 'running' ORDER BY id")
            .fetch_all(self.pool())
            .await?;
        let member_rows = sqlx::query(
            "SELECT i.* FROM instances i JOIN jobs j ON i.job_id = j.id AND i.job_attempt = j.attempt \
             WHERE j.state = 'running' ORDER BY i.job_id, i.job_rank",
        )
        .fetch_all(self.pool())
        .await?;
        let mut members: BTreeMap<JobId, Vec<flotilla_core::api::Instance>> = BTreeMap::new();
        for r in &member_rows {
            let i = crate::instances::instance(r)?;
            if let Some(m) = &i.job {
                members.entry(m.job_id.clone()).or_default().push(i);
            }
        }
        rows.iter()
            .map(|r| {
                let j = job(r)?;
                let members = members.remove(&j.id).unwrap_or_default();
                Ok(RunningJob { job: j, members })
            })
            .collect()
    }

    /// Time limits (seconds) of the running jobs that have one.
    pub async fn running_time_limits(&self) -> Result<BTreeMap<JobId, u64>> {
        running_time_limits_in(&mut *self.pool().acquire().await?).await
    }

    /// Ends or requeues a running job at `attempt`: `to` is `queued`
    /// (restart or requeue; `failure` counts it against the retries) or a
    /// final state. False (and no change) when the job moved on meanwhile.
    pub async fn settle_job(
        &self,
        id: &JobId,
        attempt: u32,
        to: JobState,
        failure: bool,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        debug_assert!(to != JobState::Running);
        let mut tx = self.begin().await?;
        let n = sqlx::query(
            "UPDATE jobs SET state = $1, state_reason = $2, updated_at = $3, failures = failures + $4, \
             finished_at = $5 WHERE id = $6 AND state = 'running' AND attempt = $7",
        )
        .bind(to.as_str())
        .bind(reason)
        .bind(ms(now))
        .bind(i64::from(failure))
        .bind(to.is_terminal().then(|| ms(now)))
        .bind(id.as_str())
        .bind(i64::from(attempt))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if n != 1 {
            return Ok(false);
        }
        add_event(&mut tx, id, to, reason, now).await?;
        crate::txn::commit(tx).await?;
        Ok(true)
    }

    /// Records why a running job is changing (members being stopped or
    /// preempted) without changing its state.
    pub async fn note_job(&self, id: &JobId, reason: &str, now: DateTime<Utc>) -> Result<()> {
        let mut tx = self.begin().await?;
        let row = sqlx::query("SELECT state, state_reason FROM jobs WHERE id = $1")
            .bind(id.as_str())
            .fetch_one(&mut *tx)
            .await?;
        let state = state_of(&row.try_get::<String, _>("state")?)?;
        if row.try_get::<String, _>("state_reason")? == reason {
            return Ok(());
        }
        sqlx::query("UPDATE jobs SET state_reason = $1, updated_at = $2 WHERE id = $3")
            .bind(reason)
            .bind(ms(now))
            .bind(id.as_str())
            .execute(&mut *tx)
            .await?;
        add_event(&mut tx, id, state, reason, now).await?;
        crate::txn::commit(tx).await?;
        Ok(())
    }

    /// Cancels a job: a queued one ends `cancelled` at once; a running one
    /// is flagged, and the job loop stops its members and ends it once
    /// they have stopped. `Conflict` when it already ended.
    pub async fn cancel_job(&self, id: &JobId, now: DateTime<Utc>) -> Result<Job> {
        let mut tx = self.begin().await?;
        let row = sqlx::query("SELECT state FROM jobs WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(StoreError::NotFound("job"))?;
        let state = state_of(&row.try_get::<String, _>("state")?)?;
        match state {
            s if s.is_terminal() => {
                return Err(StoreError::Conflict(format!(
                    "job {id} already {}",
                    s.as_str()
                )));
            }
            JobState::Queued => {
                let reason = "cancelled on request";
                sqlx::query(
                    "UPDATE jobs SET state = 'cancelled', state_reason = $1, cancel_requested = 1, \
                     updated_at = $2, finished_at = $2 WHERE id = $3 AND state = 'queued'",
                )
                .bind(reason)
                .bind(ms(now))
                .bind(id.as_str())
                .execute(&mut *tx)
                .await?;
                add_event(&mut tx, id, JobState::Cancelled, reason, now).await?;
            }
            _ => {
                sqlx::query("UPDATE jobs SET cancel_requested = 1, updated_at = $1 WHERE id = $2")
                    .bind(ms(now))
                    .bind(id.as_str())
                    .execute(&mut *tx)
                    .await?;
            }
        }
        crate::txn::commit(tx).await?;
        self.job(id).await
    }
}

/// Queued jobs, oldest first, on `conn`: half of [`Store::pending_work`],
/// which a scheduling pass reads inside its one snapshot transaction
/// ([`Store::pass_inputs`]).
pub(crate) async fn queued_jobs_in(
    conn: &mut sqlx::AnyConnection,
    limit: u32,
) -> Result<Vec<QueuedJob>> {
    let rows = sqlx::query("SELECT * FROM jobs WHERE state = 'queued' ORDER BY id LIMIT $1")
        .bind(i64::from(limit))
        .fetch_all(&mut *conn)
        .await?;
    rows.iter()
        .map(|r| {
            let j = job(r)?;
            Ok(QueuedJob {
                id: j.id,
                tenant_id: j.tenant_id,
                spec: j.spec,
                attempt: j.attempts,
                state_reason: j.state_reason,
                created_at: j.created_at,
            })
        })
        .collect()
}

/// [`Store::running_time_limits`] on `conn`: a scheduling pass reads it inside its
/// one snapshot transaction ([`Store::pass_inputs`]).
pub(crate) async fn running_time_limits_in(
    conn: &mut sqlx::AnyConnection,
) -> Result<BTreeMap<JobId, u64>> {
    let rows = sqlx::query("SELECT id, spec FROM jobs WHERE state = 'running'")
        .fetch_all(&mut *conn)
        .await?;
    let mut out = BTreeMap::new();
    for r in &rows {
        let spec: JobSpec = json(&r.try_get::<String, _>("spec")?, "job spec")?;
        if let Some(t) = spec.time_limit_s {
            out.insert(JobId::from_trusted(r.try_get("id")?), t);
        }
    }
    Ok(out)
}

/// Places a queued job's whole gang inside `tx` (see
/// [`Store::schedule_work`]): `plans[r]` is rank r's placement and `ids[r]`
/// its new instance's id. The job moves to `running` with a new attempt
/// (only if it is still queued at `attempt`) and every member is inserted
/// and scheduled with its GPUs claimed; any GPU taken meanwhile is a
/// `Conflict`, and the caller's rollback undoes all of it. Members run with
/// the job's spec and the `FLOTILLA_JOB_*` variables.
pub(crate) async fn schedule_gang_in(
    tx: &mut Transaction<'static, Any>,
    id: &JobId,
    attempt: u32,
    plans: &[Placement],
    ids: &[InstanceId],
    now: DateTime<Utc>,
) -> Result<()> {
    let row = sqlx::query("SELECT * FROM jobs WHERE id = $1")
        .bind(id.as_str())
        .fetch_optional(&mut **tx)
        .await?
        .ok_or(StoreError::NotFound("job"))?;
    let j = job(&row)?;
    if j.state != JobState::Queued || j.attempts != attempt {
        return Err(StoreError::Conflict(format!(
            "job {id} is no longer queued"
        )));
    }
    if plans.len() != j.spec.nodes as usize || ids.len() != plans.len() {
        return Err(StoreError::Conflict(format!(
            "job {id} has {} members, the plan {}",
            j.spec.nodes,
            plans.len()
        )));
    }
    let next = attempt + 1;
    let placed_on: Vec<String> = plans.iter().map(|p| p.node.to_string()).collect();
    let reason = format!("attempt {next}: {} members placed", plans.len());
    let n = sqlx::query(
        "UPDATE jobs SET state = 'running', state_reason = $1, attempt = $2, updated_at = $3, \
         started_at = COALESCE(started_at, $3) WHERE id = $4 AND state = 'queued' AND attempt = $5",
    )
    .bind(&reason)
    .bind(i64::from(next))
    .bind(ms(now))
    .bind(id.as_str())
    .bind(i64::from(attempt))
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if n != 1 {
        return Err(StoreError::Conflict(format!(
            "job {id} is no longer queued"
        )));
    }
    // Node names by rank, for the members' rendezvous.
    let mut names = Vec::with_capacity(plans.len());
    for node in &placed_on {
        let name: String = sqlx::query("SELECT name FROM nodes WHERE id = $1")
            .bind(node)
            .fetch_one(&mut **tx)
            .await?
            .try_get("name")?;
        names.push(name);
    }
    let world = u32::try_from(plans.len()).unwrap_or(u32::MAX);
    for (rank, (plan, member)) in plans.iter().zip(ids).enumerate() {
        let rank = u32::try_from(rank).unwrap_or(u32::MAX);
        let mut env = j.spec.env.clone();
        env.extend(member_env(id.as_str(), rank, world, next, &names));
        let spec = InstanceSpec {
            name: j.spec.name.as_ref().map(|n| format!("{n}-{rank}")),
            gpus: j.spec.gpus_per_member(),
            gpu_types: j.spec.gpu_types.clone(),
            cpu_milli: j.spec.cpu_milli,
            memory_mb: j.spec.memory_mb,
            command: j.spec.command.clone(),
            env,
            workdir: j.spec.workdir.clone(),
            billing_class: j.spec.billing_class,
            priority: j.spec.priority,
            tier: j.spec.tier,
            preemptible: j.spec.preemptible,
            // What the planner placed it as: whole GPUs, or the job's share.
            share: plan.share.clone(),
            image: j.spec.image.clone(),
            disk_mb: j.spec.disk_mb,
        };
        let why = format!("rank {rank} of {id}, attempt {next}");
        crate::instances::insert_pending(tx, member, &j.tenant_id, &spec, None, &why, now).await?;
        sqlx::query(
            "UPDATE instances SET job_id = $1, job_rank = $2, job_attempt = $3 WHERE id = $4",
        )
        .bind(id.as_str())
        .bind(i64::from(rank))
        .bind(i64::from(next))
        .bind(member.as_str())
        .execute(&mut **tx)
        .await?;
        crate::instances::schedule_in(tx, member, plan, now).await?;
    }
    add_event(tx, id, JobState::Running, &reason, now).await?;
    Ok(())
}
