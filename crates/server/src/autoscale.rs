//! The autoscaling loop: each replica pool's policy — the same
//! `flotilla-scale` state machine the simulator runs, built the same way
//! (`flotilla_scale::builder::build`) — is called with the wall clock and an
//! observation made of the pool's last reported metrics and its replicas'
//! states; the loop then starts or stops replica instances to match.
//!
//! Policies keep state (windows, stabilisation, forecasts) in this loop's
//! memory, like the controllers they re-implement: a server restart starts
//! each policy afresh from the next report. The last decision is stored so
//! the API can show it.

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_core::api::{PoolMetrics, PoolPolicy, ReplicaPool};
use flotilla_core::id::{InstanceId, ReplicaPoolId};
use flotilla_core::instance::InstanceState;
use flotilla_scale::builder::{build, Endpoint, PolicyKind};
use flotilla_scale::{Decision, Latency, Observation, Policy};
use flotilla_store::pools::PoolMember;
use flotilla_store::StoreError;

use crate::state::AppState;

/// What the policy sees: the reported metrics (zero when none yet) and the
/// pool's replicas — running ones are ready; pending, scheduled and
/// starting ones are starting; those ended or being stopped do not count.
/// Only a p95 is reported, so it stands for every percentile.
pub fn observation(
    metrics: Option<&PoolMetrics>,
    members: &[PoolMember],
    slo_ms: u64,
) -> Observation {
    let live = members.iter().filter(|m| m.is_live());
    let ready = live
        .clone()
        .filter(|m| m.state == InstanceState::Running)
        .count() as u32;
    let starting = live
        .filter(|m| {
            matches!(
                m.state,
                InstanceState::Pending | InstanceState::Scheduled | InstanceState::Starting
            )
        })
        .count() as u32;
    let m = metrics.copied().unwrap_or(PoolMetrics {
        in_flight: 0,
        queued: 0,
        requests_total: 0,
        gpu_utilization: None,
        p95_ms: None,
    });
    Observation {
        ready,
        starting,
        in_flight: m.in_flight,
        queued: m.queued,
        requests_total: m.requests_total,
        gpu_utilization: m.gpu_utilization.unwrap_or(0.0),
        latency: m.p95_ms.map(|p| Latency {
            p50_ms: p,
            p95_ms: p,
            p99_ms: p,
        }),
        slo_ms: Some(slo_ms as f64),
        custom: None,
    }
}

/// The policy a pool's settings describe.
pub fn policy_for(p: &PoolPolicy, max_replicas: u32) -> Option<Box<dyn Policy + Send>> {
    let kind = p.kind.parse::<PolicyKind>().ok()?;
    let ep = Endpoint {
        max_concurrency: p.max_concurrency,
        mean_service_ms: p.mean_service_ms,
        cold_start_ms: p.cold_start_ms,
        slo_ms: p.slo_ms,
        max_replicas,
    };
    build(kind, &ep).ok()
}

/// The loop's memory: one live policy per pool.
#[derive(Default)]
pub struct Autoscaler {
    policies: BTreeMap<ReplicaPoolId, Box<dyn Policy + Send>>,
}

impl std::fmt::Debug for Autoscaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Autoscaler")
            .field("pools", &self.policies.len())
            .finish()
    }
}

impl Autoscaler {
    /// An autoscaler with no policy yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// One pass over every pool: decide, record, start or stop replicas.
    /// Returns the decisions, by pool.
    pub async fn pass(
        &mut self,
        st: &AppState,
    ) -> Result<Vec<(ReplicaPoolId, Decision)>, StoreError> {
        let now = st.now();
        let now_ms = u64::try_from(now.timestamp_millis()).unwrap_or(0);
        let mut out = Vec::new();
        for id in st.store().replica_pool_ids().await? {
            let pool = st.store().replica_pool(&id).await?;
            let members = st.store().pool_members(&id).await?;
            if !self.policies.contains_key(&id) {
                let Some(p) = policy_for(&pool.policy, pool.max_replicas) else {
                    tracing::warn!(pool = %id, "replica pool policy does not build; skipped");
                    continue;
                };
                self.policies.insert(id.clone(), p);
            }
            let Some(policy) = self.policies.get_mut(&id) else {
                continue;
            };
            let obs = observation(pool.metrics.as_ref(), &members, pool.policy.slo_ms);
            let d = policy.decide(now_ms, &obs);
            st.store()
                .set_pool_decision(&id, d.replicas, d.reason.as_str())
                .await?;
            st.ops()
                .scaling_decision("pool", pool.desired_replicas.unwrap_or(0), d.replicas);
            if let Err(e) = apply(st, &pool, &members, d.replicas).await {
                tracing::warn!(pool = %id, error = %e, "scaling the replica pool failed; retrying");
            }
            out.push((id, d));
        }
        Ok(out)
    }
}

/// Start or stop replicas until `want` are live.
async fn apply(
    st: &AppState,
    pool: &ReplicaPool,
    members: &[PoolMember],
    want: u32,
) -> Result<(), StoreError> {
    let live: Vec<&PoolMember> = members.iter().filter(|m| m.is_live()).collect();
    let have = live.len() as u32;
    let now = st.now();
    if want > have {
        let spec = pool
            .replica
            .clone()
            .validate(st.catalog())
            .map_err(|e| StoreError::Conflict(format!("replica.{}: {}", e.field, e.message)))?;
        for _ in have..want {
            let (t, r) = st.ids();
            let id = InstanceId::generate(t, r);
            st.store()
                .create_instance(&id, &pool.tenant_id, &spec, now)
                .await?;
            st.store().add_pool_member(&pool.id, &id, now).await?;
            tracing::info!(pool = %pool.id, instance = %id, "replica started");
        }
        st.notify_change();
    } else if want < have {
        // Not-yet-running replicas first (nothing to lose), newest
        // first; then the newest running ones.
        let mut order: Vec<&PoolMember> = live.clone();
        order.sort_by_key(|m| m.state == InstanceState::Running);
        let mut stopping: Vec<&PoolMember> = Vec::new();
        for running in [false, true] {
            stopping.extend(
                order
                    .iter()
                    .rev()
                    .filter(|m| (m.state == InstanceState::Running) == running),
            );
        }
        for m in stopping.into_iter().take((have - want) as usize) {
            st.store().request_stop(&m.instance_id, now).await?;
            tracing::info!(pool = %pool.id, instance = %m.instance_id, "replica stopped");
        }
        st.notify_change();
    }
    Ok(())
}

/// Runs passes every `tick` until shutdown.
pub async fn run(st: AppState, tick: Duration) {
    let mut shutdown = st.shutdown_signal();
    let mut scaler = Autoscaler::new();
    loop {
        if *shutdown.borrow() {
            return;
        }
        if !st.leads() {
            // See `reconcile::run`: a lapsed lease makes no decisions.
        } else if let Err(e) = scaler.pass(&st).await {
            tracing::warn!(error = %e, "autoscaling pass failed; retrying");
        }
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = shutdown.changed() => {}
        }
    }
}
