//! Instances, their lifecycle events and their GPU allocations.
//!
//! Every state change goes through [`transition`]: a conditional UPDATE on
//! the expected current state plus an event row, in one transaction, so a
//! change is recorded exactly once even when two loops race.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use flotilla_core::api::{
    Assignment, ColdStart, GpuSlice, Instance, InstanceEvent, JobMembership, LimitExceeded,
    ObservedInstance, ObservedPhase,
};
use flotilla_core::catalog::{MigProfile, MIG_COMPUTE_SLICES, MIG_MEMORY_SLICES};
use flotilla_core::id::{GpuId, InstanceId, JobId, NodeId, TenantId, WorkId};
use flotilla_core::instance::{BillingClass, InstanceSpec, InstanceState};
use flotilla_core::node::RuntimeKind;
use flotilla_core::placement::{GpuShare, Placement, MILLI_PER_GPU};
use flotilla_core::quota::Quota;
use sqlx::any::AnyRow;
use sqlx::{Any, Row, Transaction};

use crate::work::add_event;
use crate::{at, json, ms, to_json, PageOf, PageReq, Result, Store, StoreError, WorkTable};

/// Grace between SIGTERM and SIGKILL when an instance is stopped.
pub const STOP_GRACE_MS: u64 = 10_000;

/// Notice a preempted instance gets between SIGTERM and SIGKILL, to
/// checkpoint (the default, `flotilla_sched::preempt::DEFAULT_NOTICE_MS`).
pub const PREEMPT_NOTICE_MS: u64 = 30_000;

fn state_of(s: &str) -> Result<InstanceState> {
    InstanceState::parse(s).ok_or_else(|| StoreError::Corrupt(format!("instance state `{s}`")))
}

pub(crate) fn instance(row: &AnyRow) -> Result<Instance> {
    let billing: String = row.try_get("billing_class")?;
    let node: Option<String> = row.try_get("node_id")?;
    let exit: Option<i64> = row.try_get("exit_code")?;
    let started: Option<i64> = row.try_get("started_at")?;
    let finished: Option<i64> = row.try_get("finished_at")?;
    let gpu_ids: Vec<String> = json(&row.try_get::<String, _>("gpu_ids")?, "gpu_ids")?;
    let share = share_of(row)?;
    Ok(Instance {
        id: InstanceId::from_trusted(row.try_get("id")?),
        tenant_id: TenantId::from_trusted(row.try_get("tenant_id")?),
        name: row.try_get("name")?,
        state: state_of(&row.try_get::<String, _>("state")?)?,
        state_reason: row.try_get("state_reason")?,
        gpus: row.try_get::<i64, _>("gpus")?.clamp(0, u32::MAX as i64) as u32,
        gpu_types: json(&row.try_get::<String, _>("gpu_types")?, "gpu_types")?,
        cpu_milli: row
            .try_get::<i64, _>("cpu_milli")?
            .clamp(0, u32::MAX as i64) as u32,
        memory_mb: row.try_get::<i64, _>("memory_mb")?.max(0) as u64,
        disk_mb: row
            .try_get::<Option<i64>, _>("disk_mb")?
            .map(|v| v.max(0) as u64),
        command: json(&row.try_get::<String, _>("command")?, "command")?,
        env: json(&row.try_get::<String, _>("env")?, "env")?,
        workdir: row.try_get("workdir")?,
        billing_class: BillingClass::parse(&billing)
            .ok_or_else(|| StoreError::Corrupt(format!("billing class `{billing}`")))?,
        node_id: node.map(NodeId::from_trusted),
        gpu_model: row.try_get("gpu_model")?,
        gpu_ids: gpu_ids.into_iter().map(GpuId::from_trusted).collect(),
        gpu_fraction: match share {
            GpuShare::Fraction { milli } => Some(f64::from(milli) / 1000.0),
            _ => None,
        },
        mig_profile: match share {
            GpuShare::Mig(p) => Some(p.name),
            _ => None,
        },
        gpu_slices: json(&row.try_get::<String, _>("gpu_slices")?, "gpu_slices")?,
        exit_code: exit.map(|c| c.clamp(i32::MIN as i64, i32::MAX as i64) as i32),
        stop_requested: row.try_get::<i64, _>("stop_requested")? != 0,
        priority: row
            .try_get::<i64, _>("priority")?
            .clamp(i32::MIN as i64, i32::MAX as i64) as i32,
        tier: row.try_get::<i64, _>("tier")?.clamp(1, 3) as u8,
        preemptible: row.try_get::<i64, _>("preemptible")? != 0,
        preempted_by: row
            .try_get::<Option<String>, _>("preempted_by")?
            .map(WorkId::from_trusted),
        requeued_from: row
            .try_get::<Option<String>, _>("requeued_from")?
            .map(InstanceId::from_trusted),
        job: membership(row)?,
        created_at: at(row.try_get("created_at")?),
        started_at: started.map(at),
        finished_at: finished.map(at),
        events: Vec::new(),
        image: opt_json(row, "image")?,
        published_ports: opt_json(row, "published_ports")?.unwrap_or_default(),
        cold_start: opt_json(row, "cold_start")?,
    })
}

/// A nullable JSON column.
pub(crate) fn opt_json<T: serde::de::DeserializeOwned>(
    row: &AnyRow,
    column: &str,
) -> Result<Option<T>> {
    row.try_get::<Option<String>, _>(column)?
        .map(|s| json(&s, column))
        .transpose()
}

/// Completes the cold-start breakdown with the time it waited for a
/// placement (creation to its first `scheduled` event).
fn with_queued(mut i: Instance) -> Instance {
    if let Some(c) = i.cold_start.as_mut() {
        c.queued_ms = i
            .events
            .iter()
            .find(|e| e.state == InstanceState::Scheduled)
            .and_then(|e| u64::try_from((e.at - i.created_at).num_milliseconds()).ok());
    }
    i
}

/// The share an instance row asked for (whole GPUs when none).
pub(crate) fn share_of(row: &AnyRow) -> Result<GpuShare> {
    let small = |v: Option<i64>| v.unwrap_or(0).clamp(0, i64::from(u8::MAX)) as u8;
    if let Some(name) = row.try_get::<Option<String>, _>("mig_profile")? {
        return Ok(GpuShare::Mig(MigProfile {
            name,
            compute_slices: small(row.try_get("mig_compute")?),
            memory_slices: small(row.try_get("mig_memory")?),
            memory_mib: row
                .try_get::<Option<i64>, _>("mig_memory_mib")?
                .unwrap_or(0)
                .max(0) as u64,
        }));
    }
    Ok(match row.try_get::<Option<i64>, _>("share_milli")? {
        Some(m) if (1..i64::from(MILLI_PER_GPU)).contains(&m) => GpuShare::Fraction {
            // In 1..1000 by the guard.
            milli: m as u16,
        },
        _ => GpuShare::Whole,
    })
}

/// A member's job, rank and attempt; `None` for a plain instance.
fn membership(row: &AnyRow) -> Result<Option<JobMembership>> {
    let Some(job) = row.try_get::<Option<String>, _>("job_id")? else {
        return Ok(None);
    };
    let small = |v: Option<i64>| v.unwrap_or(0).clamp(0, u32::MAX as i64) as u32;
    Ok(Some(JobMembership {
        job_id: JobId::from_trusted(job),
        rank: small(row.try_get("job_rank")?),
        attempt: small(row.try_get("job_attempt")?),
    }))
}

/// The columns of an instance that applying an agent's report reads
/// ([`Store::apply_observed`]).
const OBSERVED_COLUMNS: &str =
    "state, node_id, stop_requested, gpu_ids, preempted_by, job_id, share_milli, \
     mig_profile, mig_compute, mig_memory, mig_memory_mib, updated_at, started_at, exit_code, \
     published_ports, cold_start";

/// A late exit of an instance that ended while lost: `state` is final,
/// reached from `lost` without an exit code (its node came back without
/// reporting it, or a stop ended it while its node was gone), and its
/// agent now reports that the work exited with `code` at `exit`. Typically
/// the node lease's fence killed the work while the agent was frozen, and
/// the agent saw it end only after its first sync back, which did not
/// report it, so the server had already failed it. What the work ran to
/// is then known: the exit is recorded as the instance's end (metering
/// corrects the ledger to it), without reopening the instance; its GPUs
/// were freed when it was lost and stay free. Only an exit before the
/// loss counts: the loss is where the bill stopped, and the GPUs were
/// free for others from then, so a late report may shorten a bill, never
/// lengthen it. Once recorded, the exit code is set and a resent report
/// changes nothing.
async fn late_exit(
    tx: &mut Transaction<'static, Any>,
    id: &InstanceId,
    state: InstanceState,
    code: i32,
    exit: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Result<bool> {
    let last_two = sqlx::query(
        "SELECT state, at FROM instance_events WHERE instance_id = $1 ORDER BY seq DESC LIMIT 2",
    )
    .bind(id.as_str())
    .fetch_all(&mut **tx)
    .await?;
    let [last, before] = last_two.as_slice() else {
        return Ok(false);
    };
    let lost_at = at(before.try_get("at")?);
    if state_of(&last.try_get::<String, _>("state")?)? != state
        || state_of(&before.try_get::<String, _>("state")?)? != InstanceState::Lost
        || exit > lost_at
    {
        return Ok(false);
    }
    let note = format!(
        "; its agent then reported the exit (code {code}) at {}",
        exit.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    );
    let n = sqlx::query(
        "UPDATE instances SET exit_code = $1, finished_at = $2, state_reason = state_reason || $3, \
         updated_at = $4 WHERE id = $5 AND state = $6 AND exit_code IS NULL AND started_at IS NOT NULL",
    )
    .bind(i64::from(code))
    .bind(ms(exit))
    .bind(note)
    .bind(ms(now))
    .bind(id.as_str())
    .bind(state.as_str())
    .execute(&mut **tx)
    .await?
    .rows_affected();
    Ok(n == 1)
}

/// Moves `id` from `from` to `to` inside `tx`. Returns false (and changes
/// nothing) when the instance is no longer in `from`. Entering a final or
/// lost state releases the instance's GPUs.
async fn transition(
    tx: &mut Transaction<'static, Any>,
    id: &InstanceId,
    from: InstanceState,
    to: InstanceState,
    reason: &str,
    exit_code: Option<i32>,
    now: DateTime<Utc>,
) -> Result<bool> {
    debug_assert!(from.can_transition_to(to), "{from:?} -> {to:?}");
    let finished = to.is_terminal().then(|| ms(now));
    let n = sqlx::query(
        "UPDATE instances SET state = $1, state_reason = $2, updated_at = $3, \
         exit_code = COALESCE($4, exit_code), \
         started_at = CASE WHEN $1 = 'running' AND started_at IS NULL THEN $3 ELSE started_at END, \
         finished_at = COALESCE($5, finished_at) \
         WHERE id = $6 AND state = $7",
    )
    .bind(to.as_str())
    .bind(reason)
    .bind(ms(now))
    .bind(exit_code.map(i64::from))
    .bind(finished)
    .bind(id.as_str())
    .bind(from.as_str())
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if n == 0 {
        return Ok(false);
    }
    if !to.holds_gpus() {
        release_gpus(tx, id).await?;
    }
    add_event(tx, id, to, reason, now).await?;
    Ok(true)
}

/// Gives back everything `id` holds: its share of each GPU (and the MIG
/// slices), its allocation rows, and the GPUs it held whole.
async fn release_gpus(tx: &mut Transaction<'static, Any>, id: &InstanceId) -> Result<()> {
    sqlx::query(
        "UPDATE gpus SET \
         used_milli = used_milli - (SELECT a.milli FROM gpu_allocations a WHERE a.gpu_id = gpus.id AND a.instance_id = $1), \
         used_mig_compute = used_mig_compute - (SELECT a.mig_compute FROM gpu_allocations a WHERE a.gpu_id = gpus.id AND a.instance_id = $1), \
         used_mig_memory = used_mig_memory - (SELECT a.mig_memory FROM gpu_allocations a WHERE a.gpu_id = gpus.id AND a.instance_id = $1) \
         WHERE id IN (SELECT gpu_id FROM gpu_allocations WHERE instance_id = $1)",
    )
    .bind(id.as_str())
    .execute(&mut **tx)
    .await?;
    sqlx::query("DELETE FROM gpu_allocations WHERE instance_id = $1")
        .bind(id.as_str())
        .execute(&mut **tx)
        .await?;
    sqlx::query("UPDATE gpus SET instance_id = NULL WHERE instance_id = $1")
        .bind(id.as_str())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Takes `share` of each GPU for `id`, each with one conditional UPDATE of
/// the GPU row that checks its capacity (1000 milli; for a GPU in MIG mode
/// also its compute and memory slices) and its mode (MIG profiles only on
/// GPUs in MIG mode, whole and fractional work only on the others), then
/// records the allocation. The UPDATE holds the GPU row until commit, so
/// concurrent placements on one GPU serialise and each sees the others'
/// sums. `Ok(Err(gpu))` names the first GPU that had no room; the caller
/// rolls the transaction back.
async fn claim_gpus(
    tx: &mut Transaction<'static, Any>,
    id: &InstanceId,
    gpus: &[&str],
    share: &GpuShare,
) -> Result<std::result::Result<Vec<GpuSlice>, String>> {
    let mut slices = Vec::with_capacity(gpus.len());
    for g in gpus {
        let milli = i64::from(share.milli());
        let (compute, memory) = match share {
            GpuShare::Mig(p) => (i64::from(p.compute_slices), i64::from(p.memory_slices)),
            _ => (0, 0),
        };
        let n = match share {
            GpuShare::Whole => sqlx::query(
                "UPDATE gpus SET instance_id = $1, used_milli = 1000 \
                 WHERE id = $2 AND instance_id IS NULL AND used_milli = 0 AND mig_mode = 0",
            )
            .bind(id.as_str())
            .bind(*g),
            GpuShare::Fraction { .. } => sqlx::query(
                "UPDATE gpus SET used_milli = used_milli + $1 \
                 WHERE id = $2 AND instance_id IS NULL AND mig_mode = 0 AND used_milli + $1 <= 1000",
            )
            .bind(milli)
            .bind(*g),
            GpuShare::Mig(_) => sqlx::query(
                "UPDATE gpus SET used_milli = used_milli + $1, used_mig_compute = used_mig_compute + $2, \
                 used_mig_memory = used_mig_memory + $3 \
                 WHERE id = $4 AND instance_id IS NULL AND mig_mode = 1 AND used_milli + $1 <= 1000 \
                 AND used_mig_compute + $2 <= $5 AND used_mig_memory + $3 <= $6",
            )
            .bind(milli)
            .bind(compute)
            .bind(memory)
            .bind(*g)
            .bind(i64::from(MIG_COMPUTE_SLICES))
            .bind(i64::from(MIG_MEMORY_SLICES)),
        }
        .execute(&mut **tx)
        .await?
        .rows_affected();
        if n != 1 {
            return Ok(Err(g.to_string()));
        }
        let gpu = sqlx::query("SELECT uuid, memory_mib FROM gpus WHERE id = $1")
            .bind(*g)
            .fetch_one(&mut **tx)
            .await?;
        let uuid: String = gpu.try_get("uuid")?;
        let gpu_memory = gpu.try_get::<i64, _>("memory_mib")?.max(0) as u64;
        // A MIG instance gets the lowest GPU-instance number free on its
        // GPU; the row lock taken above makes the choice race-free.
        let slot = if share.is_mig() {
            let taken = sqlx::query(
                "SELECT mig_slot FROM gpu_allocations WHERE gpu_id = $1 AND mig_slot IS NOT NULL",
            )
            .bind(*g)
            .fetch_all(&mut **tx)
            .await?
            .iter()
            .map(|r| r.try_get::<i64, _>("mig_slot"))
            .collect::<std::result::Result<Vec<i64>, _>>()?;
            (1..).find(|s| !taken.contains(s))
        } else {
            None
        };
        let profile = match share {
            GpuShare::Mig(p) => Some(p),
            _ => None,
        };
        sqlx::query(
            "INSERT INTO gpu_allocations (gpu_id, instance_id, milli, mig_profile, mig_compute, mig_memory, mig_slot) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(*g)
        .bind(id.as_str())
        .bind(milli)
        .bind(profile.map(|p| p.name.clone()))
        .bind(compute)
        .bind(memory)
        .bind(slot)
        .execute(&mut **tx)
        .await?;
        slices.push(GpuSlice {
            gpu_id: GpuId::from_trusted(g.to_string()),
            milli: u32::from(share.milli()),
            mig_profile: profile.map(|p| p.name.clone()),
            // The GPU-instance number and compute instance 0, in the form
            // CUDA accepts in CUDA_VISIBLE_DEVICES.
            mig_device: slot.map(|s| format!("MIG-{uuid}/{s}/0")),
            memory_limit_mib: match share {
                GpuShare::Whole => None,
                GpuShare::Fraction { milli } => {
                    Some(gpu_memory * u64::from(*milli) / u64::from(MILLI_PER_GPU))
                }
                GpuShare::Mig(p) => Some(p.memory_mib),
            },
        });
    }
    Ok(Ok(slices))
}

/// Scheduled → starting: the agent picked the instance up.
async fn mark_starting(
    tx: &mut Transaction<'static, Any>,
    id: &InstanceId,
    now: DateTime<Utc>,
) -> Result<bool> {
    use InstanceState::*;
    transition(
        tx,
        id,
        Scheduled,
        Starting,
        "agent is starting the command",
        None,
        now,
    )
    .await
}

/// Commits an instance's placement inside `tx`: takes each GPU only if it
/// is still free and moves the instance to `scheduled`; `Conflict` when a
/// GPU was taken meanwhile or the instance left `pending` (the caller's
/// rollback then undoes the rest). [`Store::schedule_work`] places a
/// pending instance with it, and a job's members one by one.
pub(crate) async fn schedule_in(
    tx: &mut Transaction<'static, Any>,
    id: &InstanceId,
    plan: &Placement,
    now: DateTime<Utc>,
) -> Result<()> {
    let ids: Vec<&str> = plan.gpus.iter().map(|g| g.as_str()).collect();
    let slices = match claim_gpus(tx, id, &ids, &plan.share).await? {
        Ok(slices) => slices,
        Err(g) => {
            let what = match plan.share {
                GpuShare::Whole => "is no longer free".to_string(),
                _ => format!("has no room for {}", plan.share.label(&plan.model)),
            };
            return Err(StoreError::Conflict(format!("gpu {g} {what}")));
        }
    };
    let reason = match &plan.share {
        GpuShare::Whole => format!(
            "placed on {} ({}x{})",
            plan.node,
            plan.gpus.len(),
            plan.model
        ),
        share => format!("placed on {} ({})", plan.node, share.label(&plan.model)),
    };
    // Whole GPUs need no slice description: the GPU ids say it all.
    let slices = match plan.share {
        GpuShare::Whole => Vec::new(),
        _ => slices,
    };
    sqlx::query("UPDATE instances SET node_id = $1, gpu_model = $2, gpu_ids = $3, gpu_slices = $4 WHERE id = $5 AND state = 'pending'")
            .bind(plan.node.as_str())
            .bind(&plan.model)
            .bind(to_json(&ids))
            .bind(to_json(&slices))
            .bind(id.as_str())
            .execute(&mut **tx)
            .await?;
    if !transition(
        tx,
        id,
        InstanceState::Pending,
        InstanceState::Scheduled,
        &reason,
        None,
        now,
    )
    .await?
    {
        return Err(StoreError::Conflict(format!(
            "instance {id} is no longer pending"
        )));
    }
    Ok(())
}

/// What the scheduler needs of a pending instance.
#[derive(Debug, Clone)]
pub struct PendingInstance {
    /// Id.
    pub id: InstanceId,
    /// Owner.
    pub tenant_id: TenantId,
    /// GPU count.
    pub gpus: u32,
    /// Allowed models (empty: any).
    pub gpu_types: Vec<String>,
    /// CPU.
    pub cpu_milli: u32,
    /// Memory.
    pub memory_mb: u64,
    /// Current pending reason.
    pub state_reason: String,
    /// Queue priority, higher first.
    pub priority: i32,
    /// Service tier, 1..=3.
    pub tier: u8,
    /// Creation time (FIFO within equal priority and share).
    pub created_at: DateTime<Utc>,
    /// Whole GPUs, a fraction of one or a MIG instance.
    pub share: GpuShare,
    /// The runtime its node must run: containers when it has an image
    /// (endpoint replicas with one too), processes otherwise.
    pub runtime: RuntimeKind,
    /// The model weights of an endpoint replica that declares them:
    /// placement prefers the node where it is ready soonest.
    pub weights: Option<flotilla_core::endpoint::ReplicaWeights>,
}

/// What preemption planning needs of an instance holding GPUs.
#[derive(Debug, Clone)]
pub struct HeldInstance {
    /// Id.
    pub id: InstanceId,
    /// Owner.
    pub tenant_id: TenantId,
    /// Node.
    pub node_id: NodeId,
    /// GPUs held.
    pub gpu_ids: Vec<GpuId>,
    /// Service tier, 1..=3.
    pub tier: u8,
    /// Queue priority.
    pub priority: i32,
    /// May be preempted.
    pub preemptible: bool,
    /// A stop (or a preemption) is already under way.
    pub stop_requested: bool,
    /// The instance or job a preemption of this one makes room for.
    pub preempted_by: Option<WorkId>,
    /// When it started running (or was created, if not yet).
    pub since: DateTime<Utc>,
    /// The job it is a member of: preempting it preempts the whole gang.
    pub job_id: Option<JobId>,
    /// Model of its GPUs.
    pub gpu_model: String,
    /// When it was placed (created, for a job member: members are created
    /// placed), which a time limit counts from.
    pub created_at: DateTime<Utc>,
    /// Milli-GPU it holds of each of its GPUs (1000: whole GPUs).
    pub milli_per_gpu: u16,
    /// CPU it holds on its node, milli-cores.
    pub cpu_milli: u32,
    /// Memory it holds on its node, MiB.
    pub memory_mb: u64,
}

/// GPU usage of one instance that ran recently, for fair share.
#[derive(Debug, Clone)]
pub struct RecentUsage {
    /// Owner.
    pub tenant_id: TenantId,
    /// GPUs held.
    pub gpus: u32,
    /// Milli-GPU held of each (1000: whole GPUs): fair share counts shares.
    pub milli_per_gpu: u16,
    /// Start of its run.
    pub started_at: DateTime<Utc>,
    /// End of its run; `None` while it runs.
    pub finished_at: Option<DateTime<Utc>>,
}

/// A requeued instance's id: derived from the preempted one and the time,
/// so that the store (which holds no randomness) mints it inside the
/// transaction that stops the victim.
fn requeue_id(old: &InstanceId, now: DateTime<Utc>) -> InstanceId {
    use std::hash::{Hash, Hasher};
    let mut a = std::collections::hash_map::DefaultHasher::new();
    (old.as_str(), 1u8).hash(&mut a);
    let mut b = std::collections::hash_map::DefaultHasher::new();
    (old.as_str(), 2u8).hash(&mut b);
    let random = (u128::from(a.finish()) << 64) | u128::from(b.finish());
    InstanceId::generate(ms(now).max(0) as u64, random)
}

/// Inserts a pending instance after the quota check, inside `tx` (whose
/// tenant row the caller has locked). Quota errors come back as
/// `StoreError::Quota` without a write.
pub(crate) async fn insert_pending(
    tx: &mut Transaction<'static, Any>,
    id: &InstanceId,
    tenant: &TenantId,
    spec: &InstanceSpec,
    requeued_from: Option<&InstanceId>,
    reason: &str,
    now: DateTime<Utc>,
) -> Result<()> {
    let q = sqlx::query("SELECT * FROM tenants WHERE id = $1")
        .bind(tenant.as_str())
        .fetch_one(&mut **tx)
        .await?;
    let quota = crate::tenants::quota(&q)?;
    insert_admitted(tx, id, tenant, &quota, spec, requeued_from, reason, now).await?;
    Ok(())
}

/// A new instance of `tenant`, whose row `tx` has locked and whose quota
/// it read, admitted and recorded in `pending`, as a read of it after the
/// commit would show it (its row as inserted, its one event), without
/// that read.
async fn admit_pending(
    tx: &mut Transaction<'static, Any>,
    id: &InstanceId,
    tenant: &TenantId,
    quota: &Quota,
    spec: &InstanceSpec,
    now: DateTime<Utc>,
) -> Result<Instance> {
    let reason = "waiting for placement";
    let row = insert_admitted(tx, id, tenant, quota, spec, None, reason, now).await?;
    let mut inst = instance(&row)?;
    inst.events = vec![InstanceEvent {
        state: InstanceState::Pending,
        reason: reason.to_string(),
        // As stored: whole milliseconds.
        at: at(ms(now)),
    }];
    Ok(with_queued(inst))
}

/// [`insert_pending`] under `quota`, the tenant's as `tx` read it with
/// the tenant's row locked; the inserted row, every column.
#[allow(clippy::too_many_arguments)] // reason: insert_pending's, plus the quota read with the lock
async fn insert_admitted(
    tx: &mut Transaction<'static, Any>,
    id: &InstanceId,
    tenant: &TenantId,
    quota: &Quota,
    spec: &InstanceSpec,
    requeued_from: Option<&InstanceId>,
    reason: &str,
    now: DateTime<Utc>,
) -> Result<AnyRow> {
    crate::tenants::admit_in(
        tx,
        tenant,
        quota,
        &spec.gpu_types,
        u64::from(spec.gpus) * u64::from(spec.share.milli()),
    )
    .await?;
    let (milli, profile) = match &spec.share {
        GpuShare::Whole => (None, None),
        GpuShare::Fraction { milli } => (Some(i64::from(*milli)), None),
        GpuShare::Mig(p) => (None, Some(p)),
    };
    // One statement for the whole row (the columns added since the table
    // was made included) that hands it back as stored.
    let row = sqlx::query(
        "INSERT INTO instances (id, tenant_id, name, state, state_reason, gpus, gpu_types, cpu_milli, memory_mb, \
         command, env, workdir, billing_class, created_at, updated_at, priority, tier, preemptible, requeued_from, \
         disk_mb, image, share_milli, mig_profile, mig_compute, mig_memory, mig_memory_mib) \
         VALUES ($1, $2, $3, 'pending', $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $13, $14, $15, $16, $17, \
         $18, $19, $20, $21, $22, $23, $24) RETURNING *",
    )
    .bind(id.as_str())
    .bind(tenant.as_str())
    .bind(spec.name.clone())
    .bind(reason)
    .bind(i64::from(spec.gpus))
    .bind(to_json(&spec.gpu_types))
    .bind(i64::from(spec.cpu_milli))
    .bind(spec.memory_mb as i64)
    .bind(to_json(&spec.command))
    .bind(to_json(&spec.env))
    .bind(spec.workdir.clone())
    .bind(spec.billing_class.as_str())
    .bind(ms(now))
    .bind(i64::from(spec.priority))
    .bind(i64::from(spec.tier))
    .bind(i64::from(spec.preemptible))
    .bind(requeued_from.map(|r| r.as_str().to_string()))
    .bind(spec.disk_mb.map(|mb| i64::try_from(mb).unwrap_or(i64::MAX)))
    .bind(spec.image.as_ref().map(to_json))
    .bind(milli)
    .bind(profile.map(|p| p.name.clone()))
    .bind(profile.map(|p| i64::from(p.compute_slices)))
    .bind(profile.map(|p| i64::from(p.memory_slices)))
    .bind(profile.map(|p| p.memory_mib as i64))
    .fetch_one(&mut **tx)
    .await?;
    add_event(tx, id, InstanceState::Pending, reason, now).await?;
    Ok(row)
}

/// The spec an instance was created with, to requeue it unchanged.
fn spec_of(i: &Instance, share: GpuShare) -> InstanceSpec {
    InstanceSpec {
        share,
        name: i.name.clone(),
        gpus: i.gpus,
        gpu_types: i.gpu_types.clone(),
        cpu_milli: i.cpu_milli,
        memory_mb: i.memory_mb,
        command: i.command.clone(),
        env: i.env.clone(),
        workdir: i.workdir.clone(),
        billing_class: i.billing_class,
        priority: i.priority,
        tier: i.tier,
        preemptible: i.preemptible,
        image: i.image.clone(),
        disk_mb: i.disk_mb,
    }
}

/// Outcome of applying one observation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// A transition was recorded.
    Changed,
    /// Nothing to record.
    Unchanged,
    /// The instance is unknown or not on this node: the agent must drop it.
    Foreign,
}

/// Whether `obs` reports nothing new of an instance recorded in `state`:
/// still running as recorded, or still starting with no progress message.
/// The usual report on a fleet, every sync for every instance.
fn no_news(obs: &ObservedInstance, state: InstanceState) -> bool {
    match (&obs.phase, state) {
        (ObservedPhase::Running { .. }, InstanceState::Running) => true,
        (ObservedPhase::Starting, InstanceState::Starting) => obs.message.is_none(),
        _ => false,
    }
}

/// What the container runtime reports of an instance (published ports,
/// cold start), to record whatever the transition, when it differs from
/// what is stored: `(ports, cold start)` as stored JSON, ports `None` when
/// no container was reported. The tier a replica's weights loaded from
/// joins its cold-start breakdown (the container runtime's, or one of its
/// own).
fn runtime_update(
    obs: &ObservedInstance,
    stored_ports: Option<String>,
    stored_cold: Option<String>,
) -> Option<(Option<String>, Option<String>)> {
    let with_tier = |c: Option<&ColdStart>| {
        obs.weights_tier.map(|t| ColdStart {
            weights_tier: Some(t),
            ..c.cloned().unwrap_or_default()
        })
    };
    match &obs.container {
        Some(c) => {
            let cold = with_tier(c.cold_start.as_ref()).or_else(|| c.cold_start.clone());
            Some((Some(to_json(&c.ports)), cold.as_ref().map(to_json)))
        }
        None => with_tier(None).map(|cold| (None, Some(to_json(&cold)))),
    }
    .filter(|(ports, cold)| {
        ports
            .as_ref()
            .is_some_and(|p| Some(p) != stored_ports.as_ref())
            || *cold != stored_cold
    })
}

impl Store {
    /// Admits and records a new instance in `pending`. The tenant row is
    /// updated first, which serialises concurrent creates of one tenant
    /// (a row lock on PostgreSQL, the write lock on SQLite), so the quota
    /// check cannot be raced past.
    ///
    /// On PostgreSQL a tenant whose quota limits nothing has no check to
    /// race past, and serialising its creates would make each wait for the
    /// one before it to flush its commit: there the row is only share-locked
    /// (`FOR SHARE`, which reads the latest committed quota), so creates
    /// commit side by side and their flushes group, while a quota change,
    /// which updates the row, still waits for them, and creates after it
    /// see it. When the share-locked row turns out to limit something, the
    /// create starts over on the serialised path (never upgrading the share
    /// lock, which two creates could deadlock on).
    ///
    /// The quota is read once, with the lock, and the instance returned is
    /// the row as the insert stored it with its one event: the statements
    /// a create costs are the lock, the insert and the event.
    pub async fn create_instance(
        &self,
        id: &InstanceId,
        tenant: &TenantId,
        spec: &InstanceSpec,
        now: DateTime<Utc>,
    ) -> Result<Instance> {
        if self.backend() == crate::Backend::Postgres {
            let mut tx = self.begin().await?;
            let row = sqlx::query("SELECT * FROM tenants WHERE id = $1 FOR SHARE")
                .bind(tenant.as_str())
                .fetch_optional(&mut *tx)
                .await?
                .ok_or(StoreError::NotFound("tenant"))?;
            let quota = crate::tenants::quota(&row)?;
            if quota.limits_nothing() {
                let created = admit_pending(&mut tx, id, tenant, &quota, spec, now).await?;
                crate::txn::commit(tx).await?;
                return Ok(created);
            }
            tx.rollback().await?;
        }
        let mut tx = self.begin().await?;
        let row = sqlx::query("UPDATE tenants SET updated_at = $1 WHERE id = $2 RETURNING *")
            .bind(ms(now))
            .bind(tenant.as_str())
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(StoreError::NotFound("tenant"))?;
        let quota = crate::tenants::quota(&row)?;
        let created = admit_pending(&mut tx, id, tenant, &quota, spec, now).await?;
        crate::txn::commit(tx).await?;
        Ok(created)
    }

    /// One instance with its events.
    pub async fn instance(&self, id: &InstanceId) -> Result<Instance> {
        let row = sqlx::query("SELECT * FROM instances WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::NotFound("instance"))?;
        let mut inst = instance(&row)?;
        inst.events = self
            .events(std::slice::from_ref(&inst.id))
            .await?
            .remove(&inst.id)
            .unwrap_or_default();
        Ok(with_queued(inst))
    }

    pub(crate) async fn events(
        &self,
        ids: &[InstanceId],
    ) -> Result<BTreeMap<InstanceId, Vec<InstanceEvent>>> {
        let mut out = BTreeMap::new();
        let ids = ids.iter().map(InstanceId::as_str);
        for (id, list) in self.transitions(WorkTable::Instances, ids).await? {
            let list = list
                .into_iter()
                .map(|t| {
                    Ok(InstanceEvent {
                        state: state_of(&t.state)?,
                        reason: t.reason,
                        at: t.at,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            out.insert(InstanceId::from_trusted(id), list);
        }
        Ok(out)
    }

    /// Instances by id, optionally of one tenant and in one state.
    pub async fn list_instances(
        &self,
        only: Option<&TenantId>,
        state: Option<InstanceState>,
        page: &PageReq,
    ) -> Result<PageOf<Instance>> {
        let rows = self
            .work_page(WorkTable::Instances, only, state.map(|s| s.as_str()), page)
            .await?;
        let items = rows.iter().map(instance).collect::<Result<Vec<_>>>()?;
        let mut page = PageOf::from_overfetch(items, page, |i| i.id.to_string());
        page.items = self.with_events(std::mem::take(&mut page.items)).await?;
        Ok(page)
    }

    /// `items` with their transitions (one read per 1,000) and their time
    /// queued: what a list or a metering page returns.
    async fn with_events(&self, items: Vec<Instance>) -> Result<Vec<Instance>> {
        let ids: Vec<InstanceId> = items.iter().map(|i| i.id.clone()).collect();
        let mut events = BTreeMap::new();
        for chunk in ids.chunks(1000) {
            events.append(&mut self.events(chunk).await?);
        }
        Ok(items
            .into_iter()
            .map(|mut i| {
                i.events = events.remove(&i.id).unwrap_or_default();
                with_queued(i)
            })
            .collect())
    }

    /// Asks for an instance to stop. Not yet placed: stopped at once. On a
    /// node: flagged, and the agent stops it. Lost: stopped at once (its
    /// node is gone). Final: `Conflict`.
    pub async fn request_stop(&self, id: &InstanceId, now: DateTime<Utc>) -> Result<Instance> {
        let inst = self.instance(id).await?;
        let mut tx = self.begin().await?;
        match inst.state {
            s if s.is_terminal() => {
                return Err(StoreError::Conflict(format!(
                    "instance {id} already {}",
                    s.as_str()
                )));
            }
            InstanceState::Pending | InstanceState::Lost => {
                transition(
                    &mut tx,
                    id,
                    inst.state,
                    InstanceState::Stopped,
                    "stopped on request",
                    None,
                    now,
                )
                .await?;
            }
            _ => {
                sqlx::query(
                    "UPDATE instances SET stop_requested = 1, updated_at = $1 WHERE id = $2",
                )
                .bind(ms(now))
                .bind(id.as_str())
                .execute(&mut *tx)
                .await?;
            }
        }
        crate::txn::commit(tx).await?;
        self.instance(id).await
    }

    /// Applies what an agent observed of each of its instances on `node`;
    /// whether any transition was recorded.
    ///
    /// One read answers the usual sync of a fleet, where every instance is
    /// still as recorded ([`no_news`] and no runtime change), and the rest
    /// are written in one transaction: a node that starts six works
    /// reports twelve transitions in a sync or two, and one commit each
    /// held the database's connections and WAL flushes when a fleet of
    /// 2,000 started its work at once (docs/scale.md). A read per
    /// instance per sync did the same at 1,000 nodes.
    pub async fn apply_observed_all(
        &self,
        node: &NodeId,
        observed: &[ObservedInstance],
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let mut rows: BTreeMap<String, AnyRow> = BTreeMap::new();
        for chunk in observed.chunks(500) {
            let sql = format!(
                "SELECT id, {OBSERVED_COLUMNS} FROM instances WHERE id IN ({})",
                crate::params(chunk.len())
            );
            let mut q = sqlx::query(&sql);
            for obs in chunk {
                q = q.bind(obs.instance_id.as_str());
            }
            for r in q.fetch_all(self.pool()).await? {
                rows.insert(r.try_get::<String, _>("id")?, r);
            }
        }
        let mut tx = None;
        let mut changed = false;
        for obs in observed {
            let Some(row) = rows.get(obs.instance_id.as_str()) else {
                continue;
            };
            changed |= self
                .apply_observed_row(&mut tx, node, obs, row, now)
                .await?
                == Applied::Changed;
        }
        if let Some(tx) = tx {
            crate::txn::commit(tx).await?;
        }
        Ok(changed)
    }

    /// Applies what an agent observed of one instance on `node`.
    pub async fn apply_observed(
        &self,
        node: &NodeId,
        obs: &ObservedInstance,
        now: DateTime<Utc>,
    ) -> Result<Applied> {
        let row = sqlx::query(&format!(
            "SELECT {OBSERVED_COLUMNS} FROM instances WHERE id = $1"
        ))
        .bind(obs.instance_id.as_str())
        .fetch_optional(self.pool())
        .await?;
        let Some(row) = row else {
            return Ok(Applied::Foreign);
        };
        let mut tx = None;
        let applied = self
            .apply_observed_row(&mut tx, node, obs, &row, now)
            .await?;
        if let Some(tx) = tx {
            crate::txn::commit(tx).await?;
        }
        Ok(applied)
    }

    /// Applies `obs` to the instance as `row` (its [`OBSERVED_COLUMNS`])
    /// read it, in `tx`: begun here at the first write, so a report with
    /// no news writes nothing, and left for the caller to commit, so one
    /// sync's reports share a commit. A report that turns out to be of
    /// work someone else holds now leaves nothing of itself in `tx`.
    async fn apply_observed_row(
        &self,
        tx: &mut Option<Transaction<'static, Any>>,
        node: &NodeId,
        obs: &ObservedInstance,
        row: &AnyRow,
        now: DateTime<Utc>,
    ) -> Result<Applied> {
        use InstanceState::*;
        let on: Option<String> = row.try_get("node_id")?;
        if on.as_deref() != Some(node.as_str()) {
            return Ok(Applied::Foreign);
        }
        let state = state_of(&row.try_get::<String, _>("state")?)?;
        let stop_requested = row.try_get::<i64, _>("stop_requested")? != 0;
        let no_exit_code = row.try_get::<Option<i64>, _>("exit_code")?.is_none();
        let preempted_by: Option<String> = row.try_get("preempted_by")?;
        // A job member is not requeued alone: its job requeues the gang.
        let in_job = row.try_get::<Option<String>, _>("job_id")?.is_some();
        let id = &obs.instance_id;
        // When the phase began, as the node saw it (an executor reports the
        // engine's own start and end times), so metering counts the time
        // the work ran rather than when the report arrived. Kept between
        // the instance's last change and now: a node's clock cannot move
        // billing before what the server already recorded, or ahead of it.
        // A time far outside that window (a node whose clock is off, a
        // server on a test clock) is not trusted at all: the server's own
        // time stands. The slack covers whole-second engine clocks. A lost
        // instance's last change is the server's guess (its lease's end):
        // the exit its agent reports when back may lie before it, back to
        // its start (a fence that stopped it, work that ended meanwhile).
        // An engine that counts whole seconds (Slurm) reports the second an
        // event fell in, which may begin before the server's last change
        // (by under a second): the floor is that change's whole second, so
        // such an engine's record is billed as it stands.
        // A final instance that ended while lost was last changed by the
        // server's guess too: a late exit is trusted back to its start.
        let since = match (state, row.try_get::<Option<i64>, _>("started_at")?) {
            (s, Some(started)) if s == Lost || s.is_terminal() => at(started),
            _ => at(row.try_get("updated_at")?),
        };
        let floor =
            since - chrono::Duration::nanoseconds(i64::from(since.timestamp_subsec_nanos()));
        let slack = chrono::Duration::seconds(2);
        let trusted = |t: DateTime<Utc>| {
            (t >= since - slack && t <= now + slack).then(|| t.clamp(floor, now.max(floor)))
        };
        let seen = trusted(obs.at).unwrap_or(now);
        // When an exit's work began running, as the node saw it: work that
        // started and ended between two reports is metered from there, not
        // from its exit (which billed it nothing).
        let ran_from = obs.started_at.and_then(trusted).map(|t| t.min(seen));
        let runtime = runtime_update(
            obs,
            row.try_get("published_ports")?,
            row.try_get("cold_start")?,
        );
        if runtime.is_none() && no_news(obs, state) {
            return Ok(Applied::Unchanged);
        }
        let tx = match tx.take() {
            Some(begun) => tx.insert(begun),
            None => tx.insert(self.begin().await?),
        };
        if state == Lost {
            // The GPUs may be someone else's by now (see the claim below).
            sqlx::query("SAVEPOINT observed_lost")
                .execute(&mut **tx)
                .await?;
        }
        match runtime {
            Some((Some(ports), cold)) => {
                sqlx::query(
                    "UPDATE instances SET published_ports = $1, cold_start = $2 WHERE id = $3",
                )
                .bind(ports)
                .bind(cold)
                .bind(id.as_str())
                .execute(&mut **tx)
                .await?;
            }
            Some((None, cold)) => {
                sqlx::query("UPDATE instances SET cold_start = $1 WHERE id = $2")
                    .bind(cold)
                    .bind(id.as_str())
                    .execute(&mut **tx)
                    .await?;
            }
            None => {}
        }
        let oom = obs.container.as_ref().is_some_and(|c| c.oom_killed)
            || obs.limit_exceeded == Some(LimitExceeded::Memory);
        let disk_full = obs.limit_exceeded == Some(LimitExceeded::Disk);
        let changed = match (&obs.phase, state) {
            // Final without an exit code, reported exited: see `late_exit`.
            (ObservedPhase::Exited { code, .. }, s) if s.is_terminal() && no_exit_code => {
                match trusted(obs.at) {
                    Some(exit) => late_exit(tx, id, s, *code, exit.max(since), now).await?,
                    None => false,
                }
            }
            (_, s) if s.is_terminal() => false,
            (ObservedPhase::Starting, Scheduled) => mark_starting(tx, id, seen.max(since)).await?,
            (ObservedPhase::Starting, Starting) => {
                // Progress (an image pull) shows in the state's reason.
                if let Some(message) = &obs.message {
                    sqlx::query(
                        "UPDATE instances SET state_reason = $1 WHERE id = $2 AND state = 'starting'",
                    )
                    .bind(message)
                    .bind(id.as_str())
                    .execute(&mut **tx)
                    .await?;
                }
                false
            }
            (ObservedPhase::Running { pid }, Scheduled | Starting) => {
                let reason = format!("running as pid {pid}");
                if state == Scheduled {
                    mark_starting(tx, id, seen).await?;
                }
                transition(tx, id, Starting, Running, &reason, None, seen).await?
            }
            (ObservedPhase::Running { .. }, Lost) => {
                // The agent came back and the command survived: take the
                // GPUs back, unless someone else holds them now.
                let gpu_ids: Vec<String> = json(&row.try_get::<String, _>("gpu_ids")?, "gpu_ids")?;
                let gpu_ids: Vec<&str> = gpu_ids.iter().map(String::as_str).collect();
                let share = share_of(row)?;
                let ok = claim_gpus(tx, id, &gpu_ids, &share).await?.is_ok();
                if ok {
                    transition(
                        tx,
                        id,
                        Lost,
                        Running,
                        "node re-attached; command still running",
                        None,
                        now,
                    )
                    .await?
                } else {
                    // Someone else holds the GPUs now: nothing of this
                    // instance's report stands (see `OBSERVED_LOST`).
                    sqlx::query("ROLLBACK TO SAVEPOINT observed_lost")
                        .execute(&mut **tx)
                        .await?;
                    sqlx::query("RELEASE SAVEPOINT observed_lost")
                        .execute(&mut **tx)
                        .await?;
                    return Ok(Applied::Foreign);
                }
            }
            (
                ObservedPhase::Exited { code, stopped },
                from @ (Scheduled | Starting | Running | Lost),
            ) => {
                let (to, reason) = if let Some(by) = &preempted_by {
                    (
                        Stopped,
                        format!("preempted by {by}: stopped (exit code {code})"),
                    )
                } else if *stopped || stop_requested {
                    // A stop of work the node never started says so
                    // (there is no exit code to speak of).
                    match &obs.message {
                        Some(why) if from == Scheduled => (Stopped, why.clone()),
                        _ => (Stopped, format!("stopped (exit code {code})")),
                    }
                } else if oom {
                    (
                        Failed,
                        format!("out of memory: killed for exceeding its memory limit (exit code {code})"),
                    )
                } else if disk_full {
                    (
                        Failed,
                        format!("disk limit exceeded: stopped for writing past its disk limit (exit code {code})"),
                    )
                } else if *code == 0 {
                    (Succeeded, "exit code 0".to_string())
                } else {
                    (Failed, format!("exit code {code}"))
                };
                // An exit means the process ran, even when it ended before
                // any report said so (a short command, a slow sync): it
                // passes through `running`, which is what starts its
                // metering, at the start the node reports with the exit
                // (else at the exit: nothing to bill). Missing that made a
                // short job's members unbilled, depending on whether a sync
                // fell in their lifetime. A stop of work never started has
                // no start and no run; a stopped one with a start ran.
                let ran =
                    matches!(from, Scheduled | Starting) && (to != Stopped || ran_from.is_some());
                let done = if ran {
                    let ran_from = ran_from.unwrap_or(seen);
                    if from == Scheduled {
                        mark_starting(tx, id, ran_from.max(since)).await?;
                    }
                    transition(tx, id, Starting, Running, "running", None, ran_from).await?;
                    transition(tx, id, Running, to, &reason, Some(*code), seen).await?
                } else {
                    transition(tx, id, from, to, &reason, Some(*code), seen).await?
                };
                if done && preempted_by.is_some() && !in_job {
                    self.requeue_in(tx, id, now).await?;
                }
                done
            }
            (ObservedPhase::FailedToStart { reason }, from @ (Scheduled | Starting | Lost)) => {
                transition(
                    tx,
                    id,
                    from,
                    Failed,
                    &format!("failed to start: {reason}"),
                    None,
                    now,
                )
                .await?
            }
            _ => false,
        };
        if state == Lost {
            sqlx::query("RELEASE SAVEPOINT observed_lost")
                .execute(&mut **tx)
                .await?;
        }
        Ok(if changed {
            Applied::Changed
        } else {
            Applied::Unchanged
        })
    }

    /// What `node` should run or stop now.
    pub async fn assignments(&self, node: &NodeId) -> Result<Vec<Assignment>> {
        let rows = sqlx::query(
            "SELECT * FROM instances WHERE node_id = $1 AND state IN ('scheduled', 'starting', 'running') ORDER BY id",
        )
        .bind(node.as_str())
        .fetch_all(self.pool())
        .await?;
        let gpu_rows = sqlx::query("SELECT id, idx, uuid FROM gpus WHERE node_id = $1")
            .bind(node.as_str())
            .fetch_all(self.pool())
            .await?;
        let mut gpus: BTreeMap<String, (u32, String)> = BTreeMap::new();
        for r in &gpu_rows {
            let idx: i64 = r.try_get("idx")?;
            gpus.insert(
                r.try_get("id")?,
                (idx.clamp(0, u32::MAX as i64) as u32, r.try_get("uuid")?),
            );
        }
        rows.iter()
            .map(|r| {
                let i = instance(r)?;
                let mut held: Vec<(u32, String)> = i
                    .gpu_ids
                    .iter()
                    .filter_map(|g| gpus.get(g.as_str()).cloned())
                    .collect();
                held.sort();
                Ok(Assignment {
                    instance_id: i.id,
                    tenant_id: Some(i.tenant_id),
                    command: i.command,
                    env: i.env,
                    workdir: i.workdir,
                    gpu_indices: held.iter().map(|(idx, _)| *idx).collect(),
                    gpu_uuids: held.into_iter().map(|(_, u)| u).collect(),
                    gpu_slices: i.gpu_slices,
                    stop: i.stop_requested,
                    stop_grace_ms: if i.preempted_by.is_some() {
                        PREEMPT_NOTICE_MS
                    } else {
                        STOP_GRACE_MS
                    },
                    image: i.image,
                    cpu_milli: Some(i.cpu_milli),
                    memory_mb: Some(i.memory_mb),
                    // Filled by the server, which holds the secrets key.
                    registry_auth: None,
                    disk_mb: i.disk_mb,
                })
            })
            .collect()
    }

    /// Moves every instance on `node` that is in one of `from` to `to`,
    /// each in its own transaction, skipping those in `except`. Returns the
    /// instances changed.
    async fn move_all_on(
        &self,
        node: &NodeId,
        from: &[InstanceState],
        except: &[InstanceId],
        to: InstanceState,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<Vec<InstanceId>> {
        let rows = sqlx::query("SELECT id, state FROM instances WHERE node_id = $1 ORDER BY id")
            .bind(node.as_str())
            .fetch_all(self.pool())
            .await?;
        let mut moved = Vec::new();
        for r in &rows {
            let id = InstanceId::from_trusted(r.try_get("id")?);
            let state = state_of(&r.try_get::<String, _>("state")?)?;
            if !from.contains(&state) || except.contains(&id) {
                continue;
            }
            let mut tx = self.begin().await?;
            if transition(&mut tx, &id, state, to, reason, None, now).await? {
                moved.push(id);
            }
            crate::txn::commit(tx).await?;
        }
        Ok(moved)
    }

    /// The node stopped answering: every instance it holds becomes `lost`
    /// and releases its GPUs, except those asked to stop, which end
    /// `stopped` (their agent, out of lease, stopped them; a lost one
    /// waits for an agent that may never come back, and a stop must end
    /// it). Returns the instances changed.
    pub async fn mark_node_lost(
        &self,
        node: &NodeId,
        now: DateTime<Utc>,
    ) -> Result<Vec<InstanceId>> {
        use InstanceState::*;
        let mut changed = self
            .end_stops_on(node, &[], None, "node unreachable", now)
            .await?;
        let reason = "node unreachable: heartbeats stopped";
        changed.extend(
            self.move_all_on(
                node,
                &[Scheduled, Starting, Running],
                &[],
                Lost,
                reason,
                now,
            )
            .await?,
        );
        Ok(changed)
    }

    /// Instances on `node` asked to stop that its agent, syncing, does not
    /// report (`reported`) although the stop was asked at or before
    /// `asked_by`: no agent holds them (it never took them, forgot them,
    /// or restarted), so they end `stopped` and free their GPUs. The
    /// caller leaves `asked_by` far enough back for an agent that holds
    /// one to have reported it. Returns the instances changed.
    pub async fn end_unreported_stops(
        &self,
        node: &NodeId,
        reported: &[InstanceId],
        asked_by: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Result<Vec<InstanceId>> {
        self.end_stops_on(
            node,
            reported,
            Some(asked_by),
            "its node no longer reports it",
            now,
        )
        .await
    }

    /// Ends as `stopped` every instance on `node` holding GPUs and asked
    /// to stop (at or before `asked_by`, by its last change, when given),
    /// except `except`; each in its own transaction. A preempted one is
    /// requeued, as when its agent reports the stop.
    async fn end_stops_on(
        &self,
        node: &NodeId,
        except: &[InstanceId],
        asked_by: Option<DateTime<Utc>>,
        why: &str,
        now: DateTime<Utc>,
    ) -> Result<Vec<InstanceId>> {
        use InstanceState::*;
        let rows = sqlx::query(
            "SELECT id, state, updated_at, preempted_by, job_id FROM instances WHERE node_id = $1 \
             AND stop_requested = 1 AND state IN ('scheduled', 'starting', 'running') ORDER BY id",
        )
        .bind(node.as_str())
        .fetch_all(self.pool())
        .await?;
        let mut ended = Vec::new();
        for r in &rows {
            let id = InstanceId::from_trusted(r.try_get("id")?);
            let state = state_of(&r.try_get::<String, _>("state")?)?;
            let changed_at = at(r.try_get("updated_at")?);
            if except.contains(&id) || asked_by.is_some_and(|t| changed_at > t) {
                continue;
            }
            let reason = if state == Scheduled {
                format!("stopped before it started; {why}")
            } else {
                format!("stopped on request; {why}")
            };
            let preempted = r.try_get::<Option<String>, _>("preempted_by")?.is_some();
            let in_job = r.try_get::<Option<String>, _>("job_id")?.is_some();
            let mut tx = self.begin().await?;
            if transition(&mut tx, &id, state, Stopped, &reason, None, now).await? {
                if preempted && !in_job {
                    self.requeue_in(&mut tx, &id, now).await?;
                }
                ended.push(id);
            }
            crate::txn::commit(tx).await?;
        }
        Ok(ended)
    }

    /// Lost instances on `node` the returning agent did not report: they
    /// are gone for good.
    pub async fn fail_unreported_lost(
        &self,
        node: &NodeId,
        reported: &[InstanceId],
        now: DateTime<Utc>,
    ) -> Result<u64> {
        use InstanceState::*;
        let reason = "node returned without this instance";
        let failed = self
            .move_all_on(node, &[Lost], reported, Failed, reason, now)
            .await?;
        Ok(failed.len() as u64)
    }

    /// A node's agent registered afresh: it lost track of the commands it
    /// had started, so instances past `scheduled` there fail, except those
    /// it says still run (`running`: it took them over). Scheduled ones
    /// stay; the new agent starts them.
    pub async fn fail_started_on(
        &self,
        node: &NodeId,
        running: &[InstanceId],
        now: DateTime<Utc>,
    ) -> Result<u64> {
        use InstanceState::*;
        let reason = "node agent restarted and lost track of the command";
        let failed = self
            .move_all_on(node, &[Starting, Running], running, Failed, reason, now)
            .await?;
        Ok(failed.len() as u64)
    }

    /// Instances whose usage is due at `now`, `limit` at most, in id order
    /// after `after` (a pass pages through them all): final ones metered
    /// short of their finish or past it (minutes metered before an earlier
    /// exit was reported, which the final pass corrects), and running (or
    /// starting) ones with a whole slice of `slice_secs` complete since
    /// metering last reached. With their events and how far metering got.
    ///
    /// A running instance already metered to the current slice is not
    /// read: on a fleet nearly all of them are, between slice boundaries,
    /// and reading them on every pass took the pass seconds to write
    /// nothing (and, with a plain limit and no due filter, the oldest 500
    /// running held the page while newer finished work went unmetered).
    pub async fn instances_to_meter(
        &self,
        now: DateTime<Utc>,
        slice_secs: u32,
        after: Option<&InstanceId>,
        limit: u32,
    ) -> Result<Vec<(Instance, Option<DateTime<Utc>>)>> {
        let slice = i64::from(slice_secs.max(1));
        let boundary = now.timestamp().div_euclid(slice) * slice * 1000;
        let rows = sqlx::query(
            "SELECT * FROM instances WHERE id > $1 AND started_at IS NOT NULL AND (\
             (finished_at IS NOT NULL AND (metered_until IS NULL OR metered_until <> finished_at)) \
             OR (finished_at IS NULL AND state IN ('running', 'starting') AND started_at < $2 \
             AND (metered_until IS NULL OR metered_until < $2))) \
             ORDER BY id LIMIT $3",
        )
        .bind(after.map_or("", InstanceId::as_str))
        .bind(boundary)
        .bind(i64::from(limit))
        .fetch_all(self.pool())
        .await?;
        let mut found = Vec::with_capacity(rows.len());
        let mut untils = Vec::with_capacity(rows.len());
        for r in &rows {
            let until: Option<i64> = r.try_get("metered_until")?;
            found.push(instance(r)?);
            untils.push(until.map(at));
        }
        Ok(self
            .with_events(found)
            .await?
            .into_iter()
            .zip(untils)
            .collect())
    }

    /// Records how far each instance's usage has been metered, in one
    /// statement.
    pub async fn set_metered_until_many(
        &self,
        reached: &[(InstanceId, DateTime<Utc>)],
    ) -> Result<()> {
        for chunk in reached.chunks(500) {
            let sql = crate::keyed_bigint_update("instances", "metered_until", chunk.len());
            let mut q = sqlx::query(&sql);
            for (id, until) in chunk {
                q = q.bind(id.as_str()).bind(ms(*until));
            }
            q.execute(self.writer()).await?;
        }
        Ok(())
    }

    /// Asks a running (or scheduled, starting) instance to stop, saying
    /// why in its `state_reason`: the notice its tenant reads while the
    /// agent stops it (SIGTERM, then the grace period). False when it is
    /// not live or already asked to stop.
    pub async fn stop_with_notice(
        &self,
        id: &InstanceId,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        // Fenced: the leader's offer pass calls it.
        let mut tx = self.begin().await?;
        let n = sqlx::query(
            "UPDATE instances SET stop_requested = 1, state_reason = $1, updated_at = $2 \
             WHERE id = $3 AND stop_requested = 0 AND state IN ('scheduled', 'starting', 'running')",
        )
        .bind(reason)
        .bind(ms(now))
        .bind(id.as_str())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        crate::txn::commit(tx).await?;
        Ok(n > 0)
    }

    /// Instances holding GPUs on one node (for shutdown and tests).
    pub async fn instances_on(&self, node: &NodeId) -> Result<Vec<InstanceId>> {
        let rows = sqlx::query(
            "SELECT id FROM instances WHERE node_id = $1 AND state IN ('scheduled', 'starting', 'running')",
        )
        .bind(node.as_str())
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| Ok(InstanceId::from_trusted(r.try_get("id")?)))
            .collect()
    }

    /// Requeues the preempted instance `old`, which `tx` just stopped: a
    /// new pending instance with the same spec in the same tenant, whose
    /// `requeued_from` names `old`. The lifecycle has no way back from
    /// `stopped`, so the work moves to a fresh id and the old instance's
    /// history stays as it happened. Over quota (the tenant's limits
    /// changed meanwhile): not requeued, and the old instance says so.
    async fn requeue_in(
        &self,
        tx: &mut Transaction<'static, Any>,
        old: &InstanceId,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let row = sqlx::query("SELECT * FROM instances WHERE id = $1")
            .bind(old.as_str())
            .fetch_one(&mut **tx)
            .await?;
        let inst = instance(&row)?;
        sqlx::query("UPDATE tenants SET updated_at = $1 WHERE id = $2")
            .bind(ms(now))
            .bind(inst.tenant_id.as_str())
            .execute(&mut **tx)
            .await?;
        let new = requeue_id(old, now);
        let reason = format!("requeued after {old} was preempted; waiting for placement");
        let outcome = insert_pending(
            tx,
            &new,
            &inst.tenant_id,
            &spec_of(&inst, share_of(&row)?),
            Some(old),
            &reason,
            now,
        )
        .await;
        let note = match outcome {
            Ok(()) => format!("{}; requeued as {new}", inst.state_reason),
            Err(StoreError::Quota(e)) => {
                format!("{}; not requeued: {e}", inst.state_reason)
            }
            Err(e) => return Err(e),
        };
        sqlx::query("UPDATE instances SET state_reason = $1 WHERE id = $2")
            .bind(&note)
            .bind(old.as_str())
            .execute(&mut **tx)
            .await?;
        tracing::info!(old = %old, new = %new, "preempted instance requeued");
        Ok(())
    }

    /// Instances holding GPUs, with what preemption planning needs.
    pub async fn held_instances(&self) -> Result<Vec<HeldInstance>> {
        held_instances_in(&mut *self.pool().acquire().await?).await
    }

    /// GPUs promised to preemptors still waiting: for each pending
    /// instance or queued job whose preemption stopped (or is stopping) other work, the
    /// GPUs its victims hold or held. Until it is placed, no one else may
    /// take them, or a third party could steal the capacity a preemption
    /// freed during the victims' notice.
    pub async fn promised_gpus(&self) -> Result<BTreeMap<WorkId, Vec<GpuId>>> {
        promised_gpus_in(&mut *self.pool().acquire().await?).await
    }

    /// GPU usage of instances that ran at some time after `since`, for the
    /// queue's fair share.
    pub async fn recent_usage(&self, since: DateTime<Utc>) -> Result<Vec<RecentUsage>> {
        recent_usage_in(&mut *self.pool().acquire().await?, since).await
    }

    /// Preempts `victim` for `by`: it stays in its state, with an event
    /// saying so; `stop_requested` makes its agent send SIGTERM and kill it
    /// after [`PREEMPT_NOTICE_MS`]. Returns false (and changes nothing) when
    /// it no longer holds GPUs, is already stopping, or is not preemptible.
    pub async fn preempt(
        &self,
        victim: &InstanceId,
        by: &WorkId,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let mut tx = self.begin().await?;
        let Some(row) = sqlx::query("SELECT state FROM instances WHERE id = $1")
            .bind(victim.as_str())
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(false);
        };
        let state = state_of(&row.try_get::<String, _>("state")?)?;
        if !state.holds_gpus() {
            return Ok(false);
        }
        let reason = format!("preempted by {by}: notice {} s", PREEMPT_NOTICE_MS / 1000);
        let n = sqlx::query(
            "UPDATE instances SET stop_requested = 1, preempted_by = $1, state_reason = $2, updated_at = $3 \
             WHERE id = $4 AND state = $5 AND stop_requested = 0 AND preemptible = 1 AND tier <> 1",
        )
        .bind(by.as_str())
        .bind(&reason)
        .bind(ms(now))
        .bind(victim.as_str())
        .bind(state.as_str())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if n == 0 {
            tx.rollback().await?;
            return Ok(false);
        }
        add_event(&mut tx, victim, state, &reason, now).await?;
        crate::txn::commit(tx).await?;
        Ok(true)
    }
}

/// Pending instances, oldest first, on `conn`: half of
/// [`Store::pending_work`], which a scheduling pass reads inside its one
/// snapshot transaction ([`Store::pass_inputs`]).
pub(crate) async fn pending_instances_in(
    conn: &mut sqlx::AnyConnection,
    limit: u32,
) -> Result<Vec<PendingInstance>> {
    let rows = sqlx::query("SELECT * FROM instances WHERE state = 'pending' ORDER BY id LIMIT $1")
        .bind(i64::from(limit))
        .fetch_all(&mut *conn)
        .await?;
    rows.iter()
        .map(|r| {
            let i = instance(r)?;
            Ok(PendingInstance {
                weights: flotilla_core::endpoint::ReplicaWeights::from_env(&i.env),
                share: share_of(r)?,
                id: i.id,
                tenant_id: i.tenant_id,
                gpus: i.gpus,
                gpu_types: i.gpu_types,
                cpu_milli: i.cpu_milli,
                memory_mb: i.memory_mb,
                state_reason: i.state_reason,
                priority: i.priority,
                tier: i.tier,
                created_at: i.created_at,
                runtime: RuntimeKind::for_work(i.image.is_some()),
            })
        })
        .collect()
}

/// [`Store::held_instances`] on `conn`: a scheduling pass reads it inside its
/// one snapshot transaction ([`Store::pass_inputs`]).
pub(crate) async fn held_instances_in(conn: &mut sqlx::AnyConnection) -> Result<Vec<HeldInstance>> {
    let rows = sqlx::query(
        "SELECT * FROM instances WHERE state IN ('scheduled', 'starting', 'running') ORDER BY id",
    )
    .fetch_all(&mut *conn)
    .await?;
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        let i = instance(r)?;
        let Some(node_id) = i.node_id else { continue };
        out.push(HeldInstance {
            milli_per_gpu: share_of(r)?.milli(),
            cpu_milli: i.cpu_milli,
            memory_mb: i.memory_mb,
            id: i.id,
            tenant_id: i.tenant_id,
            node_id,
            gpu_ids: i.gpu_ids,
            tier: i.tier,
            priority: i.priority,
            preemptible: i.preemptible,
            stop_requested: i.stop_requested,
            preempted_by: i.preempted_by,
            since: i.started_at.unwrap_or(i.created_at),
            job_id: i.job.map(|j| j.job_id),
            gpu_model: i.gpu_model.unwrap_or_default(),
            created_at: i.created_at,
        });
    }
    Ok(out)
}

/// [`Store::promised_gpus`] on `conn`: a scheduling pass reads it inside its
/// one snapshot transaction ([`Store::pass_inputs`]).
pub(crate) async fn promised_gpus_in(
    conn: &mut sqlx::AnyConnection,
) -> Result<BTreeMap<WorkId, Vec<GpuId>>> {
    let rows = sqlx::query(
        "SELECT v.preempted_by AS by, v.gpu_ids AS gpu_ids FROM instances v \
             WHERE v.preempted_by IN (SELECT id FROM instances WHERE state = 'pending') \
             OR v.preempted_by IN (SELECT id FROM jobs WHERE state = 'queued') ORDER BY v.id",
    )
    .fetch_all(&mut *conn)
    .await?;
    let mut out: BTreeMap<WorkId, Vec<GpuId>> = BTreeMap::new();
    for r in &rows {
        let by = WorkId::from_trusted(r.try_get("by")?);
        let gpus: Vec<String> = json(&r.try_get::<String, _>("gpu_ids")?, "gpu_ids")?;
        out.entry(by)
            .or_default()
            .extend(gpus.into_iter().map(GpuId::from_trusted));
    }
    Ok(out)
}

/// [`Store::recent_usage`] on `conn`: a scheduling pass reads it inside its
/// one snapshot transaction ([`Store::pass_inputs`]).
pub(crate) async fn recent_usage_in(
    conn: &mut sqlx::AnyConnection,
    since: DateTime<Utc>,
) -> Result<Vec<RecentUsage>> {
    let rows = sqlx::query(
            "SELECT tenant_id, gpus, share_milli, mig_profile, mig_compute, mig_memory, mig_memory_mib, \
             started_at, finished_at FROM instances \
             WHERE started_at IS NOT NULL AND (finished_at IS NULL OR finished_at > $1)",
        )
        .bind(ms(since))
        .fetch_all(&mut *conn)
        .await?;
    rows.iter()
        .map(|r| {
            let started: i64 = r.try_get("started_at")?;
            let finished: Option<i64> = r.try_get("finished_at")?;
            Ok(RecentUsage {
                tenant_id: TenantId::from_trusted(r.try_get("tenant_id")?),
                gpus: r.try_get::<i64, _>("gpus")?.clamp(0, u32::MAX as i64) as u32,
                milli_per_gpu: share_of(r)?.milli(),
                started_at: at(started),
                finished_at: finished.map(at),
            })
        })
        .collect()
}
