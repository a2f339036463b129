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
use flotilla_store::StoreError;

use crate::placement::PassPlanner;
use crate::state::AppState;

/// Places what it can of the pending instances, oldest first. Returns
/// how many were placed.
pub async fn schedule_pass(st: &AppState) -> Result<usize, StoreError> {
    let pending = st.store().pending_instances(500).await?;
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
    let mut quotas: BTreeMap<TenantId, (Quota, Usage)> = BTreeMap::new();
    let mut placed = 0;
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
                let reason = format!("waiting for GPUs: {why}");
                if reason != p.state_reason {
                    st.store().set_pending_reason(&p.id, &reason, now).await?;
                }
            }
        }
    }
    if placed > 0 {
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
