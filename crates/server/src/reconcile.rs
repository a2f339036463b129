//! The control loops: placement of pending instances and node liveness.
//! Each pass reads the store, decides with pure code (`flotilla-sched`'s
//! engine, `flotilla-core`'s quotas), and commits through the store's
//! conditional writes, so a pass may be cut at any line and rerun.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use chrono::Duration as ChronoDuration;
use flotilla_core::id::TenantId;
use flotilla_core::id::{GpuId, InstanceId, WorkId};
use flotilla_core::job::Locality as JobLocality;
use flotilla_core::placement::{GpuShare, NodeSnapshot, Placement, PlacementRequest};
use flotilla_core::quota::{Quota, Usage};
use flotilla_sched::preempt::Preemptor;
use flotilla_sched::queue::{self, FairShareConfig, FairShareState, QueueItem, Reservation};
use flotilla_sched::{Resources, Tier};
use flotilla_store::instances::{HeldInstance, PendingInstance};
use flotilla_store::jobs::QueuedJob;
use flotilla_store::StoreError;

use crate::placement::{Ending, Held, PassPlanner};
use crate::state::AppState;

/// How far back the queue's fair share looks at GPU usage.
const FAIR_SHARE_WINDOW_H: i64 = 24;

fn ms_of(t: chrono::DateTime<chrono::Utc>) -> u64 {
    t.timestamp_millis().max(0) as u64
}

/// Dense tenant indices for `flotilla-sched`, which reasons in integers.
#[derive(Debug, Default)]
struct Tenants(BTreeMap<TenantId, u32>);

impl Tenants {
    fn index(&mut self, t: &TenantId) -> u32 {
        let next = u32::try_from(self.0.len()).unwrap_or(u32::MAX);
        *self.0.entry(t.clone()).or_insert(next)
    }
}

/// What one member of a job asks for.
fn member_request(j: &QueuedJob, catalog: &flotilla_core::catalog::Catalog) -> PlacementRequest {
    PlacementRequest {
        gpus: j.spec.gpus_per_member(),
        models: j.spec.gpu_types.clone(),
        cpu_milli: u64::from(j.spec.cpu_milli),
        memory_mb: j.spec.memory_mb,
        share: j.spec.share(catalog),
    }
}

fn tier_of(n: u8) -> Tier {
    Tier::from_number(n).unwrap_or(Tier::Dedicated)
}

/// One piece of queued work: a pending instance or a queued job (a gang
/// placed whole).
#[derive(Debug, Clone)]
pub enum Queued {
    /// A pending instance.
    Instance(PendingInstance),
    /// A queued job.
    Job(QueuedJob),
}

impl Queued {
    fn item(&self, tenants: &mut Tenants, catalog: &flotilla_core::catalog::Catalog) -> QueueItem {
        let (tenant, tier, priority, created, gpus, cpu, mem) = match self {
            Queued::Instance(p) => (
                &p.tenant_id,
                p.tier,
                p.priority,
                p.created_at,
                u64::from(p.gpus) * u64::from(p.share.milli()),
                u64::from(p.cpu_milli),
                p.memory_mb,
            ),
            Queued::Job(j) => (
                &j.tenant_id,
                j.spec.tier,
                j.spec.priority,
                j.created_at,
                u64::from(j.spec.gpus) * u64::from(j.spec.share(catalog).milli()),
                u64::from(j.spec.cpu_milli) * u64::from(j.spec.nodes),
                j.spec.memory_mb * u64::from(j.spec.nodes),
            ),
        };
        QueueItem {
            tenant: tenants.index(tenant),
            tier: tier_of(tier),
            priority,
            submitted_ms: ms_of(created),
            demand: Resources {
                // Already in milli-GPU: a share counts as its share.
                gpu_milli: gpus,
                cpu_milli: cpu,
                mem_mib: mem,
            },
            expected_runtime_ms: None,
        }
    }
}

/// The pending instances in the order the scheduler tries them (see
/// [`queue_all`], whose order they keep).
pub async fn queue(st: &AppState) -> Result<Vec<PendingInstance>, StoreError> {
    Ok(queue_all(st)
        .await?
        .into_iter()
        .filter_map(|q| match q {
            Queued::Instance(p) => Some(p),
            Queued::Job(_) => None,
        })
        .collect())
}

/// Pending instances and queued jobs in the order the scheduler tries
/// them: priority (higher first), then weighted fair share across tenants
/// (dominant share of GPU-seconds over the last day, decayed with the sched
/// crate's default half-life, equal weights), then FIFO. A job counts as
/// one piece of work holding all its members' GPUs. Recomputed from the
/// store on each pass, so it survives restarts and needs no loop state.
pub async fn queue_all(st: &AppState) -> Result<Vec<Queued>, StoreError> {
    let mut pending: Vec<Queued> = st
        .store()
        .pending_instances(500)
        .await?
        .into_iter()
        .map(Queued::Instance)
        .collect();
    pending.extend(
        st.store()
            .queued_jobs(500)
            .await?
            .into_iter()
            .map(Queued::Job),
    );
    if pending.len() < 2 {
        return Ok(pending);
    }
    let now = st.now();
    let now_ms = ms_of(now);
    let capacity: u64 = st
        .store()
        .placement_snapshot()
        .await?
        .iter()
        .map(|n| n.gpus.len() as u64)
        .sum();
    let mut tenants = Tenants::default();
    let config = FairShareConfig::default();
    let resources = Resources {
        gpu_milli: capacity.max(1) * 1000,
        cpu_milli: 0,
        mem_mib: 0,
    };
    let Ok(mut share) = FairShareState::new(config, resources) else {
        return Ok(pending);
    };
    let since = now - ChronoDuration::hours(FAIR_SHARE_WINDOW_H);
    let mut usage = st.store().recent_usage(since).await?;
    // Charge in end order, as time moves forward in the fair-share state.
    usage.sort_by_key(|u| u.finished_at.unwrap_or(now));
    for u in &usage {
        let from = ms_of(u.started_at.max(since));
        let to = ms_of(u.finished_at.unwrap_or(now).min(now));
        let held = Resources {
            gpu_milli: u64::from(u.gpus) * u64::from(u.milli_per_gpu),
            cpu_milli: 0,
            mem_mib: 0,
        };
        share.charge(tenants.index(&u.tenant_id), held, from, to.max(from));
    }
    share.advance(now_ms);
    // Operators' weights (the tenant quota API): a tenant of weight 2 is
    // entitled to twice the GPU-time of one of weight 1.
    for (t, q) in st.store().sharing_quotas().await? {
        if let Some(w) = q.weight {
            let _ = share.set_weight(tenants.index(&t), f64::from(w));
        }
    }
    let items: Vec<QueueItem> = pending
        .iter()
        .map(|p| p.item(&mut tenants, st.catalog()))
        .collect();
    let order = queue::order(&items, &share, now_ms);
    let mut slots: Vec<Option<Queued>> = pending.into_iter().map(Some).collect();
    Ok(order
        .into_iter()
        .filter_map(|i| slots.get_mut(i).and_then(Option::take))
        .collect())
}

/// The work to preempt for one waiting piece of work. `plan` is the
/// engine's choice over the offered work (indices into it). Work already
/// stopping is never offered (its GPUs are promised to whoever preempted
/// it). Preempting a job member stops its whole gang, on other nodes too,
/// so plain instances are offered first and job members only when no set
/// of those makes room.
fn choose_victims<'a>(
    held: &'a [HeldInstance],
    borrowed: &HashSet<InstanceId>,
    tenants: &mut Tenants,
    mut plan: impl FnMut(&[Held]) -> Option<Vec<usize>>,
) -> Vec<&'a HeldInstance> {
    let candidates: Vec<&HeldInstance> = held.iter().filter(|h| !h.stop_requested).collect();
    let singles: Vec<&HeldInstance> = candidates
        .iter()
        .copied()
        .filter(|h| h.job_id.is_none())
        .collect();
    for offer in [&singles, &candidates] {
        let offered: Vec<Held> = offer
            .iter()
            .map(|h| Held {
                node: h.node_id.clone(),
                gpus: h.gpu_ids.clone(),
                tenant: tenants.index(&h.tenant_id),
                tier: tier_of(h.tier),
                priority: h.priority,
                preemptible: h.preemptible,
                borrowed: borrowed.contains(&h.id),
                started_ms: ms_of(h.since),
                milli_per_gpu: h.milli_per_gpu,
            })
            .collect();
        let victims: Vec<&HeldInstance> = plan(&offered)
            .unwrap_or_default()
            .iter()
            .filter_map(|&v| offer.get(v).copied())
            .collect();
        if !victims.is_empty() {
            return victims;
        }
    }
    Vec::new()
}

/// Preempts `victims` for `by` (each gets its notice); the ids of those
/// it preempted. One that no longer holds GPUs, is already stopping or is
/// not preemptible is skipped ([`flotilla_store::Store::preempt`]).
async fn preempt_all(
    st: &AppState,
    victims: &[&HeldInstance],
    by: &WorkId,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<Vec<String>, StoreError> {
    let mut ids = Vec::new();
    for h in victims {
        if st.store().preempt(&h.id, by, now).await? {
            tracing::info!(victim = %h.id, %by, "instance preempted");
            ids.push(h.id.to_string());
        }
    }
    Ok(ids)
}

/// Job members whose job has a time limit: they end by then (the job loop
/// stops them), which lets a reservation plan the head's start.
async fn endings(st: &AppState, held: &[HeldInstance]) -> Result<Vec<Ending>, StoreError> {
    if !held.iter().any(|h| h.job_id.is_some()) {
        return Ok(Vec::new());
    }
    let limits = st.store().running_time_limits().await?;
    Ok(held
        .iter()
        .filter_map(|h| {
            let limit = limits.get(h.job_id.as_ref()?)?;
            Some(Ending {
                node: h.node_id.clone(),
                model: h.gpu_model.clone(),
                gpus: h.gpu_ids.clone(),
                end_ms: ms_of(h.created_at).saturating_add(limit.saturating_mul(1000)),
            })
        })
        .collect())
}

/// Which of `held` run on borrowed capacity: per tenant, oldest first,
/// the instances beyond its guaranteed GPUs (all of them without a
/// guarantee). Borrowed work is what a tenant within its guarantee may
/// reclaim by preemption (only if that work is preemptible).
fn borrowed_of(held: &[HeldInstance], quotas: &BTreeMap<TenantId, Quota>) -> HashSet<InstanceId> {
    let mut by_tenant: BTreeMap<&TenantId, Vec<&HeldInstance>> = BTreeMap::new();
    for h in held {
        by_tenant.entry(&h.tenant_id).or_default().push(h);
    }
    let mut out = HashSet::new();
    for (t, mut list) in by_tenant {
        list.sort_by_key(|h| (h.since, h.id.clone()));
        let guaranteed = quotas.get(t).and_then(|q| q.gpus_guaranteed).unwrap_or(0);
        let mut used = 0u32;
        for h in list {
            used = used.saturating_add(u32::try_from(h.gpu_ids.len()).unwrap_or(u32::MAX));
            if used > guaranteed {
                out.insert(h.id.clone());
            }
        }
    }
    out
}

/// Why work that fits is not placed: it would delay the head.
fn behind(head: &str) -> String {
    format!(
        "waiting behind {head}: it is first in the queue and holds the nodes this would fit on \
         until it can start (backfill only where it cannot delay it)"
    )
}

/// The pool for this pass: GPUs promised to a pending preemptor
/// ([`flotilla_store::Store::promised_gpus`]) are shown as taken. Also
/// returns which of them are really free (their victims stopped), to offer
/// them to their preemptor alone.
async fn promised_snapshot(
    st: &AppState,
    promised: &BTreeMap<WorkId, Vec<GpuId>>,
) -> Result<(Vec<NodeSnapshot>, HashSet<GpuId>), StoreError> {
    let mut snapshot = st.store().placement_snapshot().await?;
    let all: HashSet<&GpuId> = promised.values().flatten().collect();
    let mut freed = HashSet::new();
    for g in snapshot.iter_mut().flat_map(|n| n.gpus.iter_mut()) {
        if all.contains(&g.id) {
            if g.free {
                freed.insert(g.id.clone());
            }
            set_slot_free(g, false);
        }
    }
    Ok((snapshot, freed))
}

/// Shows a GPU as entirely taken (`free` false), or entirely free: used
/// only on GPUs that are entirely free in the store, to mask and unmask
/// them.
fn set_slot_free(g: &mut flotilla_core::placement::GpuSlot, free: bool) {
    let whole = if g.mig_mode {
        flotilla_core::placement::GpuSlot::mig(g.id.clone(), g.index, g.model.clone())
    } else {
        flotilla_core::placement::GpuSlot::whole(g.id.clone(), g.index, g.model.clone(), true)
    };
    if free {
        *g = whole;
    } else {
        g.take(&GpuShare::Whole);
        g.mig_compute_free = 0;
        g.mig_memory_free = 0;
    }
}

fn set_free(snapshot: &mut [NodeSnapshot], gpus: &[&GpuId], free: bool) {
    for g in snapshot.iter_mut().flat_map(|n| n.gpus.iter_mut()) {
        if gpus.contains(&&g.id) {
            set_slot_free(g, free);
        }
    }
}

/// Marks `plan`'s GPUs, CPU and memory taken in `snapshot`, so the rest of
/// the pass sees them.
fn take(snapshot: &mut [NodeSnapshot], req: &PlacementRequest, plan: &Placement) {
    if let Some(n) = snapshot.iter_mut().find(|n| n.id == plan.node) {
        n.cpu_milli_free = n.cpu_milli_free.saturating_sub(req.cpu_milli);
        n.memory_mb_free = n.memory_mb_free.saturating_sub(req.memory_mb);
        for g in n.gpus.iter_mut().filter(|g| plan.gpus.contains(&g.id)) {
            g.take(&plan.share);
        }
    }
}

/// Places what it can of the pending instances, in queue order
/// ([`queue`]). One that fits nowhere may preempt preemptible work it
/// outranks (a better tier or a higher priority; never tier 1): the
/// victims are told to stop with a notice, and it is placed on a later
/// pass, once they have released their GPUs. Returns how many were placed.
pub async fn schedule_pass(st: &AppState) -> Result<usize, StoreError> {
    let all = queue_all(st).await?;
    if all.is_empty() {
        return Ok(0);
    }
    let promised = st.store().promised_gpus().await?;
    let (mut snapshot, mut freed) = promised_snapshot(st, &promised).await?;
    let mut pending = Vec::new();
    let mut requests = Vec::new();
    let mut jobs = Vec::new();
    for q in all {
        match q {
            Queued::Instance(p) => {
                requests.push(PlacementRequest {
                    gpus: p.gpus,
                    models: p.gpu_types.clone(),
                    cpu_milli: u64::from(p.cpu_milli),
                    memory_mb: p.memory_mb,
                    share: p.share.clone(),
                });
                pending.push(Some(p));
            }
            Queued::Job(j) => {
                requests.push(member_request(&j, st.catalog()));
                pending.push(None);
                jobs.push(j);
            }
        }
    }
    let mut jobs = jobs.into_iter();
    // Seeded from the clock so ties spread over time, yet a pass replayed
    // with the same inputs and time decides the same.
    let seed = st.now().timestamp_millis() as u64;
    let mut planner = PassPlanner::new(
        st.config().placement_policy,
        st.catalog(),
        &snapshot,
        &requests,
        seed,
    );
    let mut tenants = Tenants::default();
    // Loaded lazily: only a pass where something does not fit needs them.
    let mut held: Option<Vec<HeldInstance>> = None;
    let mut sharing: Option<BTreeMap<TenantId, Quota>> = None;
    let mut quotas: BTreeMap<TenantId, (Quota, Usage)> = BTreeMap::new();
    let mut placed = 0;
    let mut preempted = 0;
    // The first blocked piece of work (the head) and its reservation: work
    // behind it is placed only where it cannot delay the head (backfill).
    let mut reservation: Option<(String, Reservation)> = None;
    for (p, req) in pending.into_iter().zip(requests) {
        let Some(p) = p else {
            let Some(job) = jobs.next() else { continue };
            if !quotas.contains_key(&job.tenant_id) {
                let q = st.store().quota(&job.tenant_id).await?;
                let u = st.store().usage(&job.tenant_id).await?;
                quotas.insert(job.tenant_id.clone(), (q, u));
            }
            let (quota, usage) = &quotas[&job.tenant_id];
            let now = st.now();
            let members = job.spec.nodes as usize;
            let me = WorkId::Job(job.id.clone());
            let mine: Vec<&GpuId> = promised
                .get(&me)
                .map(|g| g.iter().filter(|g| freed.contains(*g)).collect())
                .unwrap_or_default();
            if !mine.is_empty() {
                set_free(&mut snapshot, &mine, true);
                planner.rebuild(&snapshot);
            }
            let plans = planner.place_gang(&req, members, job.spec.locality, |m| {
                quota.model_fits(usage, m, job.spec.gpus)
            });
            if !mine.is_empty() && plans.is_err() {
                set_free(&mut snapshot, &mine, false);
                planner.rebuild(&snapshot);
            }
            let mut plans = plans;
            // A time-limited job ends by then: it may backfill ahead of the
            // head wherever it is gone before the head's start.
            let job_end = job
                .spec
                .time_limit_s
                .map(|t| ms_of(now).saturating_add(t.saturating_mul(1000)));
            if let (Some((head, r)), true) = (reservation.as_mut(), mine.is_empty()) {
                let delays = plans.as_ref().is_ok_and(|ps| {
                    !ps.iter()
                        .all(|plan| planner.backfill_allowed(r, &req, plan, job_end))
                });
                if delays {
                    let fits = |m: &str| quota.model_fits(usage, m, job.spec.gpus);
                    match planner.place_outside(&req, members, job.spec.locality, fits, r) {
                        Some(other) => plans = Ok(other),
                        None => {
                            let reason = behind(head);
                            if reason != job.state_reason {
                                st.store().set_job_reason(&job.id, &reason, now).await?;
                            }
                            continue;
                        }
                    }
                }
            }
            match plans {
                Ok(plans) => {
                    let ids: Vec<InstanceId> = plans
                        .iter()
                        .map(|_| {
                            let (t, r) = st.ids();
                            InstanceId::generate(t, r)
                        })
                        .collect();
                    match st
                        .store()
                        .schedule_job(&job.id, job.attempt, &plans, &ids, now)
                        .await
                    {
                        Ok(_) => {
                            tracing::info!(job = %job.id, members, attempt = job.attempt + 1, "job gang scheduled");
                            placed += 1;
                            for plan in &plans {
                                take(&mut snapshot, &req, plan);
                                planner.committed(&snapshot, &req, plan);
                            }
                            if let Some((_, u)) = quotas.get_mut(&job.tenant_id) {
                                for plan in &plans {
                                    u.add(Some(&plan.model), req.gpus, plan.share.milli());
                                }
                            }
                        }
                        Err(StoreError::Conflict(_) | StoreError::NotFound(_)) => {
                            tracing::debug!(job = %job.id, "gang placement lost a race; retrying next pass");
                            (snapshot, freed) = promised_snapshot(st, &promised).await?;
                            planner.rebuild(&snapshot);
                        }
                        Err(StoreError::Quota(e)) => {
                            let reason = format!("over quota: {e}");
                            if reason != job.state_reason {
                                st.store().set_job_reason(&job.id, &reason, now).await?;
                            }
                        }
                        Err(e) => return Err(e),
                    }
                }
                Err(why) => {
                    if held.is_none() {
                        held = Some(st.store().held_instances().await?);
                    }
                    let all = held.as_deref().unwrap_or_default();
                    let mut reason = format!("waiting for GPUs: {why}");
                    let stopping: Vec<String> = all
                        .iter()
                        .filter(|h| h.preempted_by.as_ref() == Some(&me))
                        .map(|h| h.id.to_string())
                        .collect();
                    let waiting = if !stopping.is_empty() {
                        reason = format!(
                            "waiting for preempted instances to stop: {}",
                            stopping.join(", ")
                        );
                        true
                    } else {
                        if sharing.is_none() {
                            sharing = Some(st.store().sharing_quotas().await?);
                        }
                        let borrowed =
                            borrowed_of(all, sharing.as_ref().unwrap_or(&BTreeMap::new()));
                        let who = Preemptor {
                            tenant: tenants.index(&job.tenant_id),
                            tier: tier_of(job.spec.tier),
                            priority: job.spec.priority,
                            reclaiming: quota.within_guarantee(usage, job.spec.gpus),
                        };
                        let victims = choose_victims(all, &borrowed, &mut tenants, |offered| {
                            planner
                                .preempt_gang(
                                    &req,
                                    members,
                                    job.spec.locality,
                                    |m| quota.model_fits(usage, m, job.spec.gpus),
                                    offered,
                                    who,
                                    ms_of(now),
                                )
                                .map(|(v, _)| v)
                        });
                        let ids = preempt_all(st, &victims, &me, now).await?;
                        preempted += ids.len();
                        if !ids.is_empty() {
                            reason = format!(
                                "waiting for preempted instances to stop: {}",
                                ids.join(", ")
                            );
                            held = None;
                        }
                        !ids.is_empty()
                    };
                    if reason != job.state_reason {
                        st.store().set_job_reason(&job.id, &reason, now).await?;
                    }
                    if reservation.is_none() && !waiting {
                        if held.is_none() {
                            held = Some(st.store().held_instances().await?);
                        }
                        let ending = endings(st, held.as_deref().unwrap_or_default()).await?;
                        reservation = planner
                            .reserve(
                                &snapshot,
                                &req,
                                members,
                                job.spec.locality,
                                |m| quota.model_fits(usage, m, job.spec.gpus),
                                &ending,
                                ms_of(now),
                            )
                            .map(|r| (job.id.to_string(), r));
                    }
                }
            }
            continue;
        };
        if !quotas.contains_key(&p.tenant_id) {
            let q = st.store().quota(&p.tenant_id).await?;
            let u = st.store().usage(&p.tenant_id).await?;
            quotas.insert(p.tenant_id.clone(), (q, u));
        }
        let (quota, usage) = &quotas[&p.tenant_id];
        // Shares count by their share against limits and the guarantee.
        let milli = u64::from(p.gpus) * u64::from(p.share.milli());
        let now = st.now();
        // The GPUs its victims released are this one's alone: offered to
        // it, and to no one else (they stay masked for the others).
        let mine: Vec<&GpuId> = promised
            .get(&WorkId::Instance(p.id.clone()))
            .map(|g| g.iter().filter(|g| freed.contains(*g)).collect())
            .unwrap_or_default();
        if !mine.is_empty() {
            set_free(&mut snapshot, &mine, true);
            planner.rebuild(&snapshot);
        }
        let attempt = planner.place(&snapshot, &req, |m| quota.model_fits_milli(usage, m, milli));
        if !mine.is_empty() && attempt.is_err() {
            set_free(&mut snapshot, &mine, false);
            planner.rebuild(&snapshot);
        }
        // A preemptor taking its promised GPUs is not backfill: the head
        // could never use them.
        let mut attempt = attempt;
        if let (Some((head, r)), true) = (reservation.as_mut(), mine.is_empty()) {
            let delays = attempt
                .as_ref()
                .is_ok_and(|plan| !planner.backfill_allowed(r, &req, plan, None));
            if delays {
                let fits = |m: &str| quota.model_fits_milli(usage, m, milli);
                match planner
                    .place_outside(&req, 1, JobLocality::Any, fits, r)
                    .and_then(|mut v| v.pop())
                {
                    Some(other) => attempt = Ok(other),
                    None => {
                        let reason = behind(head);
                        if reason != p.state_reason {
                            st.store().set_pending_reason(&p.id, &reason, now).await?;
                        }
                        continue;
                    }
                }
            }
        }
        match attempt {
            Ok(plan) => match st.store().schedule_instance(&p.id, &plan, now).await {
                Ok(()) => {
                    tracing::info!(instance = %p.id, node = %plan.node, gpus = plan.gpus.len(), "instance scheduled");
                    placed += 1;
                    // Keep the snapshot true for the rest of this pass.
                    take(&mut snapshot, &req, &plan);
                    planner.committed(&snapshot, &req, &plan);
                    if let Some((_, u)) = quotas.get_mut(&p.tenant_id) {
                        u.add(Some(&plan.model), p.gpus, p.share.milli());
                    }
                }
                Err(StoreError::Conflict(why)) => {
                    tracing::debug!(instance = %p.id, why, "placement lost a race; retrying next pass");
                    (snapshot, freed) = promised_snapshot(st, &promised).await?;
                    planner.rebuild(&snapshot);
                }
                Err(e) => return Err(e),
            },
            Err(why) => {
                if held.is_none() {
                    held = Some(st.store().held_instances().await?);
                }
                let all = held.as_deref().unwrap_or_default();
                let mut reason = format!("waiting for GPUs: {why}");
                let stopping: Vec<&HeldInstance> = all
                    .iter()
                    .filter(|h| h.preempted_by.as_ref().is_some_and(|b| *b == p.id))
                    .collect();
                if !stopping.is_empty() {
                    // Its victims are still in their notice period: wait for
                    // them rather than preempt more.
                    let ids: Vec<String> = stopping.iter().map(|h| h.id.to_string()).collect();
                    reason = format!(
                        "waiting for preempted instances to stop: {}",
                        ids.join(", ")
                    );
                } else {
                    // Work already stopping is not offered again: its GPUs
                    // are promised to whoever preempted it.
                    if sharing.is_none() {
                        sharing = Some(st.store().sharing_quotas().await?);
                    }
                    let borrowed = borrowed_of(all, sharing.as_ref().unwrap_or(&BTreeMap::new()));
                    let who = Preemptor {
                        tenant: tenants.index(&p.tenant_id),
                        tier: tier_of(p.tier),
                        priority: p.priority,
                        // Within its guarantee, it may take back capacity
                        // other tenants borrowed.
                        reclaiming: quota.within_guarantee_milli(usage, milli),
                    };
                    let victims = choose_victims(all, &borrowed, &mut tenants, |offered| {
                        planner
                            .preempt(
                                &req,
                                |m| quota.model_fits_milli(usage, m, milli),
                                offered,
                                who,
                                ms_of(now),
                            )
                            .map(|(v, _)| v)
                    });
                    if !victims.is_empty() {
                        let me = WorkId::Instance(p.id.clone());
                        let ids = preempt_all(st, &victims, &me, now).await?;
                        preempted += ids.len();
                        if !ids.is_empty() {
                            reason = format!(
                                "waiting for preempted instances to stop: {}",
                                ids.join(", ")
                            );
                            // The victims' state changed: reload before the
                            // next request looks at them.
                            held = None;
                        }
                    }
                }
                if reason != p.state_reason {
                    st.store().set_pending_reason(&p.id, &reason, now).await?;
                }
                // Waiting for its own victims, its GPUs are promised to it
                // already; otherwise it becomes the head others wait behind.
                if reservation.is_none() && !reason.starts_with("waiting for preempted") {
                    if held.is_none() {
                        held = Some(st.store().held_instances().await?);
                    }
                    let ending = endings(st, held.as_deref().unwrap_or_default()).await?;
                    reservation = planner
                        .reserve(
                            &snapshot,
                            &req,
                            1,
                            JobLocality::Any,
                            |m| quota.model_fits_milli(usage, m, milli),
                            &ending,
                            ms_of(now),
                        )
                        .map(|r| (p.id.to_string(), r));
                }
            }
        }
    }
    if placed > 0 || preempted > 0 {
        st.notify_change();
    }
    Ok(placed)
}

/// Marks nodes whose heartbeats stopped as unreachable and their work
/// lost. After a restart the server first waits one timeout, so agents get
/// the chance to sync before they are declared gone.
pub async fn liveness_pass(st: &AppState) -> Result<usize, StoreError> {
    let now = st.now();
    let timeout = ChronoDuration::from_std(st.config().heartbeat_timeout)
        .unwrap_or(ChronoDuration::seconds(15));
    if now - st.started_at() < timeout {
        return Ok(0);
    }
    let cutoff = now - timeout;
    let mut lost = 0;
    for node in st.store().stale_nodes(cutoff).await? {
        if st.store().mark_node_unreachable(&node, cutoff).await? {
            let ids = st.store().mark_node_lost(&node, now).await?;
            tracing::warn!(node = %node, lost = ids.len(), "node unreachable: heartbeats stopped");
            lost += ids.len();
        }
    }
    if lost > 0 {
        st.notify_change();
    }
    Ok(lost)
}

/// Seconds between metering passes.
const METERING_EVERY_S: i64 = 2;

/// Runs the passes until shutdown: placement on every change (and at least
/// each `tick`), liveness each `tick`, lifecycle metering every few
/// seconds, housekeeping hourly.
pub async fn run(st: AppState, tick: Duration) {
    let mut changes = st.subscribe();
    let mut shutdown = st.shutdown_signal();
    let mut last_housekeeping = st.now();
    let mut last_metering = st.now() - ChronoDuration::seconds(METERING_EVERY_S);
    loop {
        if *shutdown.borrow() {
            return;
        }
        if let Err(e) = crate::jobs::jobs_pass(&st).await {
            tracing::warn!(error = %e, "job pass failed; retrying");
        }
        if let Err(e) = schedule_pass(&st).await {
            tracing::warn!(error = %e, "placement pass failed; retrying");
        }
        if let Err(e) = liveness_pass(&st).await {
            tracing::warn!(error = %e, "liveness pass failed; retrying");
        }
        // Metering only needs minute slices: at most every few seconds, not
        // on every change signal.
        if st.now() - last_metering >= ChronoDuration::seconds(METERING_EVERY_S) {
            last_metering = st.now();
            if let Err(e) = crate::metering::metering_pass(&st).await {
                tracing::warn!(error = %e, "metering pass failed; retrying");
            }
        }
        crate::pricing::billing_pass(&st);
        let now = st.now();
        if now - last_housekeeping > ChronoDuration::hours(1) {
            last_housekeeping = now;
            st.prune_rate_limits();
            match st
                .store()
                .expire_idempotency_keys(now - ChronoDuration::hours(24))
                .await
            {
                Ok(n) if n > 0 => tracing::info!(expired = n, "idempotency keys expired"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "could not expire idempotency keys"),
            }
        }
        changes.borrow_and_update();
        tokio::select! {
            _ = changes.changed() => {}
            _ = shutdown.changed() => {}
            _ = tokio::time::sleep(tick) => {}
        }
    }
}
