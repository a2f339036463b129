//! The control loops: placement of pending instances and node liveness.
//! Each pass reads the store, decides with pure code (`flotilla-sched`'s
//! engine, `flotilla-core`'s quotas), and commits through the store's
//! conditional writes, so a pass may be cut at any line and rerun.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::Duration as ChronoDuration;
use flotilla_core::id::TenantId;
use flotilla_core::placement::PlacementRequest;
use flotilla_core::quota::{Quota, Usage};
use flotilla_sched::preempt::Preemptor;
use flotilla_sched::queue::{self, FairShareConfig, FairShareState, QueueItem};
use flotilla_sched::{Resources, Tier};
use flotilla_store::instances::{HeldInstance, PendingInstance};
use flotilla_store::StoreError;

use crate::placement::{Held, PassPlanner};
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

fn tier_of(n: u8) -> Tier {
    Tier::from_number(n).unwrap_or(Tier::Dedicated)
}

/// The pending instances in the order the scheduler tries them: priority
/// (higher first), then weighted fair share across tenants (dominant
/// share of GPU-seconds over the last day, decayed with the sched crate's
/// default half-life, equal weights), then FIFO. Recomputed from the store
/// on each pass, so it survives restarts and needs no loop state.
pub async fn queue(st: &AppState) -> Result<Vec<PendingInstance>, StoreError> {
    let pending = st.store().pending_instances(500).await?;
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
            gpu_milli: u64::from(u.gpus) * 1000,
            cpu_milli: 0,
            mem_mib: 0,
        };
        share.charge(tenants.index(&u.tenant_id), held, from, to.max(from));
    }
    share.advance(now_ms);
    let items: Vec<QueueItem> = pending
        .iter()
        .map(|p| QueueItem {
            tenant: tenants.index(&p.tenant_id),
            tier: tier_of(p.tier),
            priority: p.priority,
            submitted_ms: ms_of(p.created_at),
            demand: Resources {
                gpu_milli: u64::from(p.gpus) * 1000,
                cpu_milli: u64::from(p.cpu_milli),
                mem_mib: p.memory_mb,
            },
            expected_runtime_ms: None,
        })
        .collect();
    let order = queue::order(&items, &share, now_ms);
    let mut slots: Vec<Option<PendingInstance>> = pending.into_iter().map(Some).collect();
    Ok(order
        .into_iter()
        .filter_map(|i| slots.get_mut(i).and_then(Option::take))
        .collect())
}

/// Places what it can of the pending instances, in queue order
/// ([`queue`]). One that fits nowhere may preempt preemptible work it
/// outranks (a better tier or a higher priority; never tier 1): the
/// victims are told to stop with a notice, and it is placed on a later
/// pass, once they have released their GPUs. Returns how many were placed.
pub async fn schedule_pass(st: &AppState) -> Result<usize, StoreError> {
    let pending = queue(st).await?;
    if pending.is_empty() {
        return Ok(0);
    }
    let mut snapshot = st.store().placement_snapshot().await?;
    let requests: Vec<PlacementRequest> = pending
        .iter()
        .map(|p| PlacementRequest {
            gpus: p.gpus,
            models: p.gpu_types.clone(),
            cpu_milli: u64::from(p.cpu_milli),
            memory_mb: p.memory_mb,
        })
        .collect();
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
    let mut quotas: BTreeMap<TenantId, (Quota, Usage)> = BTreeMap::new();
    let mut placed = 0;
    let mut preempted = 0;
    for (p, req) in pending.into_iter().zip(requests) {
        if !quotas.contains_key(&p.tenant_id) {
            let q = st.store().quota(&p.tenant_id).await?;
            let u = st.store().usage(&p.tenant_id).await?;
            quotas.insert(p.tenant_id.clone(), (q, u));
        }
        let (quota, usage) = &quotas[&p.tenant_id];
        let now = st.now();
        match planner.place(&snapshot, &req, |m| quota.model_fits(usage, m, p.gpus)) {
            Ok(plan) => match st.store().schedule_instance(&p.id, &plan, now).await {
                Ok(()) => {
                    tracing::info!(instance = %p.id, node = %plan.node, gpus = plan.gpus.len(), "instance scheduled");
                    placed += 1;
                    // Keep the snapshot true for the rest of this pass.
                    if let Some(n) = snapshot.iter_mut().find(|n| n.id == plan.node) {
                        n.cpu_milli_free = n.cpu_milli_free.saturating_sub(req.cpu_milli);
                        n.memory_mb_free = n.memory_mb_free.saturating_sub(req.memory_mb);
                        for g in n.gpus.iter_mut().filter(|g| plan.gpus.contains(&g.id)) {
                            g.free = false;
                        }
                    }
                    planner.committed(&snapshot, &req, &plan);
                    if let Some((_, u)) = quotas.get_mut(&p.tenant_id) {
                        u.gpus_total += p.gpus;
                        *u.gpus_per_model.entry(plan.model.clone()).or_default() += p.gpus;
                    }
                }
                Err(StoreError::Conflict(why)) => {
                    tracing::debug!(instance = %p.id, why, "placement lost a race; retrying next pass");
                    snapshot = st.store().placement_snapshot().await?;
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
                    .filter(|h| h.preempted_by.as_ref() == Some(&p.id))
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
                    let candidates: Vec<&HeldInstance> =
                        all.iter().filter(|h| !h.stop_requested).collect();
                    let offered: Vec<Held> = candidates
                        .iter()
                        .map(|h| Held {
                            node: h.node_id.clone(),
                            gpus: h.gpu_ids.clone(),
                            tenant: tenants.index(&h.tenant_id),
                            tier: tier_of(h.tier),
                            priority: h.priority,
                            preemptible: h.preemptible,
                            started_ms: ms_of(h.since),
                        })
                        .collect();
                    let who = Preemptor {
                        tenant: tenants.index(&p.tenant_id),
                        tier: tier_of(p.tier),
                        priority: p.priority,
                        reclaiming: false,
                    };
                    let plan = planner.preempt(
                        &req,
                        |m| quota.model_fits(usage, m, p.gpus),
                        &offered,
                        who,
                        ms_of(now),
                    );
                    if let Some((victims, _)) = plan.filter(|(v, _)| !v.is_empty()) {
                        let mut ids = Vec::new();
                        for v in victims {
                            let Some(h) = candidates.get(v) else { continue };
                            if st.store().preempt(&h.id, &p.id, now).await? {
                                tracing::info!(victim = %h.id, by = %p.id, "instance preempted");
                                ids.push(h.id.to_string());
                                preempted += 1;
                            }
                        }
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
