//! The endpoint controller: for each endpoint, probe the readiness of its
//! starting replicas, ask its autoscaling policy (the same `flotilla-scale`
//! state machine the simulator runs, built by the same builder) for a
//! count from the gateway's demand signals and the replicas' states, bound
//! it by the endpoint's minimum, maximum and idle window
//! (`flotilla_core::endpoint::desired_replicas`), and turn "N ready
//! replicas of revision R" into replicas to start, drain and stop
//! (`flotilla_core::endpoint::plan_rollout`): gather, decide, apply.
//!
//! A replica enters the gateway's route table only once its readiness
//! path answered 2xx; one scaled down or replaced leaves rotation first
//! (draining) and is stopped after the endpoint's drain grace, so no
//! request in flight is cut. The loop ticks every `tick` and is woken at
//! once when a request waits at zero replicas ([`AppState::wake_endpoints`]).

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use flotilla_core::endpoint::{
    desired_replicas, is_idle, plan_rollout, scheduled_min, Endpoint, EndpointSpec, ReplicaView,
};
use flotilla_core::id::{EndpointId, InstanceId};
use flotilla_core::instance::InstanceState;
use flotilla_core::queue_trigger::{queue_demand, trigger_wants, TriggerStatus};
use flotilla_scale::builder::{build, PolicyKind};
use flotilla_scale::vertical::{GpuClass, Vertical, VerticalConfig, VerticalSignals};
use flotilla_scale::{Latency, Observation, Policy};
use flotilla_store::endpoints::ReplicaRow;
use flotilla_store::StoreError;

use crate::state::AppState;

/// Signals older than this no longer describe the present: a gateway that
/// stopped reporting is read as no traffic in flight.
const SIGNALS_FRESH_MS: i64 = 10_000;
/// How long a readiness probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How often passes run while a replica is starting: its readiness is
/// probed this often, so a replica restored from host memory in a second
/// takes traffic within a tenth of one, not a whole tick later.
const STARTING_TICK: Duration = Duration::from_millis(100);

/// The policy settings an endpoint's spec carries; a change rebuilds it.
fn policy_key(s: &EndpointSpec) -> String {
    format!(
        "{}/{}/{}/{}/{}/{}",
        s.policy,
        s.replica_concurrency,
        s.mean_service_ms,
        s.cold_start_ms,
        s.slo_p95_ms,
        s.max_replicas
    )
}

/// The policy an endpoint's spec describes.
pub fn policy_for(s: &EndpointSpec) -> Option<Box<dyn Policy + Send>> {
    let kind = s.policy.parse::<PolicyKind>().ok()?;
    build(
        kind,
        &flotilla_scale::Endpoint {
            max_concurrency: s.replica_concurrency,
            mean_service_ms: s.mean_service_ms,
            cold_start_ms: s.cold_start_ms,
            slo_ms: s.slo_p95_ms,
            max_replicas: s.max_replicas,
        },
    )
    .ok()
}

/// What the policy sees: ready replicas (probed, not draining), starting
/// ones, and the gateway's demand while fresh.
pub fn observation(ep: &Endpoint, live: &[&ReplicaRow], now: DateTime<Utc>) -> Observation {
    let active = live.iter().filter(|r| r.draining_at.is_none());
    let ready = active.clone().filter(|r| r.is_ready()).count() as u32;
    let starting = active.filter(|r| !r.is_ready()).count() as u32;
    let fresh = ep
        .signals
        .as_ref()
        .filter(|s| (now - s.at).num_milliseconds() <= SIGNALS_FRESH_MS);
    Observation {
        ready,
        starting,
        in_flight: fresh.map_or(0, |s| s.in_flight),
        queued: fresh.map_or(0, |s| s.queued),
        requests_total: ep.signals.as_ref().map_or(0, |s| s.requests_total),
        gpu_utilization: 0.0,
        latency: fresh.and_then(|s| {
            s.ttft_p95_ms.map(|p95| Latency {
                p50_ms: s.ttft_p50_ms.unwrap_or(p95),
                p95_ms: p95,
                p99_ms: s.latency_p95_ms.unwrap_or(p95).max(p95),
            })
        }),
        slo_ms: Some(ep.spec.slo_p95_ms as f64),
        custom: ep.custom_metric,
    }
}

/// The loop's memory: one live policy per endpoint, with the settings it
/// was built from.
#[derive(Default)]
pub struct Controller {
    policies: BTreeMap<EndpointId, (String, Box<dyn Policy + Send>)>,
    http: reqwest::Client,
    queues: flotilla_triggers::Scaler,
    /// Opted-in endpoints' vertical state machines, with the opt-in they
    /// were built from (a changed opt-in starts afresh).
    verticals: BTreeMap<EndpointId, (flotilla_core::advice::VerticalOptIn, Vertical)>,
    /// The last pass saw a live replica not yet ready.
    starting: bool,
}

/// Readings per replica the vertical policy looks at: the most recent,
/// about a minute at the default sync interval.
const VERTICAL_WINDOW_SAMPLES: usize = 12;

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("endpoints", &self.policies.len())
            .finish()
    }
}

/// What one pass did to one endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The endpoint.
    pub endpoint: EndpointId,
    /// Replicas wanted.
    pub desired: u32,
    /// Why.
    pub reason: String,
    /// Replicas started.
    pub started: u32,
    /// Replicas taken out of rotation.
    pub drained: u32,
    /// Replicas stopped.
    pub stopped: u32,
}

impl Controller {
    /// A controller with no policy yet, its queue triggers reaching what
    /// `egress` allows.
    pub fn new(egress: flotilla_egress::EgressPolicy) -> Self {
        Self {
            policies: BTreeMap::new(),
            http: reqwest::Client::builder()
                .timeout(PROBE_TIMEOUT)
                .build()
                .unwrap_or_default(),
            queues: flotilla_triggers::Scaler::default().with_policy(egress),
            verticals: BTreeMap::new(),
            starting: false,
        }
    }

    /// One pass over every endpoint.
    pub async fn pass(&mut self, st: &AppState) -> Result<Vec<Outcome>, StoreError> {
        self.starting = false;
        let ids = st.store().endpoint_ids_to_scale().await?;
        self.policies.retain(|id, _| ids.contains(id));
        self.verticals.retain(|id, _| ids.contains(id));
        let mut out = Vec::new();
        for id in ids {
            match self.endpoint(st, &id).await {
                Ok(o) => out.push(o),
                Err(e) => {
                    tracing::warn!(endpoint = %id, error = %e, "scaling the endpoint failed; retrying")
                }
            }
        }
        Ok(out)
    }

    async fn endpoint(&mut self, st: &AppState, id: &EndpointId) -> Result<Outcome, StoreError> {
        // Gather: probe starting replicas, then read the endpoint whole.
        let rows = st.store().endpoint_replicas(id).await?;
        let ep = st.store().endpoint(id).await?;
        let mut probes = Vec::new();
        let http = &self.http;
        for r in rows
            .iter()
            .filter(|r| r.is_live() && r.state == InstanceState::Running && r.ready_at.is_none())
        {
            let url = format!("{}{}", r.url(), ep.spec.readiness_path);
            probes.push(async move { (r.instance_id.clone(), probe(http, &url).await) });
        }
        let mut became_ready = false;
        for (inst, ok) in futures::future::join_all(probes).await {
            if ok {
                st.store().mark_replica_ready(&inst, st.now()).await?;
                tracing::info!(endpoint = %id, instance = %inst, "replica ready");
                became_ready = true;
            }
        }
        let rows = if became_ready {
            st.store().endpoint_replicas(id).await?
        } else {
            rows
        };
        // Queue depths, read concurrently (each read bounded in time).
        let triggers = if ep.deleting {
            &[][..]
        } else {
            &ep.spec.queue_triggers[..]
        };
        let reads = futures::future::join_all(triggers.iter().map(|t| self.queues.depth(t))).await;
        let read_at = st.now();
        let statuses: Vec<TriggerStatus> = triggers
            .iter()
            .zip(&reads)
            .map(|(t, r)| {
                if let Err(e) = r {
                    tracing::warn!(endpoint = %id, trigger = %t.label(), error = %e, "queue trigger read failed");
                }
                let depth = r.as_ref().ok().copied();
                TriggerStatus {
                    trigger: t.label(),
                    depth,
                    wants: trigger_wants(depth, t.messages_per_replica, ep.spec.max_replicas),
                    error: r.as_ref().err().map(ToString::to_string),
                    read_at,
                }
            })
            .collect();
        let depths: Vec<Option<u64>> = statuses.iter().map(|s| s.depth).collect();
        let now = st.now();
        let live: Vec<&ReplicaRow> = rows.iter().filter(|r| r.is_live()).collect();
        self.starting |= live
            .iter()
            .any(|r| r.draining_at.is_none() && !r.is_ready());

        // Decide.
        let (queue_wants, queue_depth) = queue_demand(triggers, &depths, ep.spec.max_replicas);
        let (desired, reason) = if ep.deleting {
            (0, "deleted".to_string())
        } else {
            let key = policy_key(&ep.spec);
            if self.policies.get(id).is_none_or(|(k, _)| *k != key) {
                match policy_for(&ep.spec) {
                    Some(p) => {
                        self.policies.insert(id.clone(), (key, p));
                    }
                    None => {
                        return Err(StoreError::Conflict(format!(
                            "endpoint policy `{}` does not build",
                            ep.spec.policy
                        )))
                    }
                }
            }
            let obs = observation(&ep, &live, now);
            let Some((_, policy)) = self.policies.get_mut(id) else {
                return Err(StoreError::NotFound("endpoint policy"));
            };
            let now_ms = u64::try_from(now.timestamp_millis()).unwrap_or(0);
            let d = policy.decide(now_ms, &obs);
            let last = ep.last_request_at.unwrap_or(ep.created_at);
            let idle = is_idle(&ep.spec, last, ep.signals.as_ref(), now)
                // Stale signals say nothing of what is queued now.
                && obs.queued == 0
                // Messages waiting in a queue are demand.
                && queue_depth == 0;
            desired_replicas(
                &ep.spec,
                d.replicas,
                d.reason.as_str(),
                obs.ready + obs.starting,
                obs.queued,
                idle,
                scheduled_min(&ep.spec, now),
                queue_wants,
            )
        };
        let views: Vec<ReplicaView> = live
            .iter()
            .map(|r| ReplicaView {
                instance_id: r.instance_id.clone(),
                revision: r.revision,
                ready: r.is_ready(),
                draining_since: r.draining_at,
                created_at: r.created_at,
            })
            .collect();
        // A policy not due to decide again keeps the count, and the reason
        // that set it still stands (the activator's, a schedule's): the
        // endpoint keeps saying that one rather than "not-due", which
        // explains nothing to whoever reads it.
        let reason = match &ep.reason {
            Some(kept) if reason == "not-due" && ep.desired_replicas == Some(desired) => {
                kept.clone()
            }
            _ => reason,
        };
        let plan = plan_rollout(ep.revision, desired, &views, now, ep.spec.drain_grace_ms);

        // Apply.
        if !statuses.is_empty() || !ep.triggers.is_empty() {
            st.store()
                .set_endpoint_triggers(id, &statuses, queue_depth > 0, now)
                .await?;
        }
        st.store()
            .set_endpoint_decision(id, desired, &reason)
            .await?;
        st.ops()
            .scaling_decision("endpoint", ep.desired_replicas.unwrap_or(0), desired);
        for inst in &plan.drain {
            st.store().mark_replica_draining(inst, now).await?;
            tracing::info!(endpoint = %id, instance = %inst, "replica draining");
        }
        for inst in &plan.stop {
            stop(st, inst, now).await?;
            tracing::info!(endpoint = %id, instance = %inst, "replica stopped");
        }
        for _ in 0..plan.start {
            let inst = start_replica(st, &ep).await?;
            tracing::info!(endpoint = %id, instance = %inst, revision = ep.revision, "replica started");
        }
        self.starting |= plan.start > 0;
        if plan.start > 0 || !plan.stop.is_empty() {
            st.notify_change();
        }
        if !ep.deleting {
            if let Err(e) = self.vertical(st, &ep, &live, now).await {
                tracing::warn!(endpoint = %id, error = %e, "vertical move failed; retrying");
            }
        }
        Ok(Outcome {
            endpoint: id.clone(),
            desired,
            reason,
            started: plan.start,
            drained: plan.drain.len() as u32,
            stopped: plan.stop.len() as u32,
        })
    }
}

/// Whether the readiness path answers 2xx.
async fn probe(http: &reqwest::Client, url: &str) -> bool {
    matches!(http.get(url).send().await, Ok(r) if r.status().is_success())
}

async fn stop(st: &AppState, inst: &InstanceId, now: DateTime<Utc>) -> Result<(), StoreError> {
    match st.store().request_stop(inst, now).await {
        // Ended on its own meanwhile: nothing to stop.
        Ok(_) | Err(StoreError::Conflict(_)) => Ok(()),
        Err(e) => Err(e),
    }
}

/// A port free on this machine now and given to no live replica: the
/// replica will listen there. Replicas are reached on the loopback (see
/// `flotilla_store::endpoints::REPLICA_HOST`), so the port is checked here.
async fn free_port(st: &AppState) -> Result<u16, StoreError> {
    let taken = st.store().replica_ports_in_use().await?;
    for _ in 0..32 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| StoreError::Conflict(format!("no free port for a replica: {e}")))?;
        if !taken.contains(&port) {
            return Ok(port);
        }
    }
    Err(StoreError::Conflict("no free port for a replica".into()))
}

async fn start_replica(st: &AppState, ep: &Endpoint) -> Result<InstanceId, StoreError> {
    let port = free_port(st).await?;
    let spec = ep
        .spec
        .replica_instance(st.catalog(), &ep.id, ep.revision, port)
        .map_err(|e| StoreError::Conflict(format!("{}: {}", e.field, e.message)))?;
    let (t, r) = st.ids();
    let id = InstanceId::generate(t, r);
    let now = st.now();
    st.store()
        .create_instance(&id, &ep.tenant_id, &spec, now)
        .await?;
    st.store()
        .add_endpoint_replica(&ep.id, &id, ep.revision, port, now)
        .await?;
    Ok(id)
}

/// Runs passes every `tick`, and at once when woken, until shutdown.
pub async fn run(st: AppState, tick: Duration) {
    let mut shutdown = st.shutdown_signal();
    let wake = st.endpoints_wake();
    let mut ctl = Controller::new(st.config().egress());
    loop {
        if *shutdown.borrow() {
            return;
        }
        if st.leads() {
            if let Err(e) = ctl.pass(&st).await {
                tracing::warn!(error = %e, "endpoint pass failed; retrying");
            }
        }
        let next = if ctl.starting {
            tick.min(STARTING_TICK)
        } else {
            tick
        };
        tokio::select! {
            _ = tokio::time::sleep(next) => {}
            _ = wake.notified() => {}
            _ = shutdown.changed() => {}
        }
    }
}

impl Controller {
    /// Automatic vertical moves of an opted-in endpoint: gather its live
    /// replicas' recent utilisation and its p95 time to first token, let
    /// `flotilla_scale::vertical` decide, and roll a move out as a new
    /// revision whose `gpu_types` name the new class. Without readings (no
    /// replica, or GPUs that report nothing) it decides nothing.
    async fn vertical(
        &mut self,
        st: &AppState,
        ep: &Endpoint,
        live: &[&ReplicaRow],
        now: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        let Some(status) = st.store().vertical(&ep.id).await? else {
            self.verticals.remove(&ep.id);
            return Ok(());
        };
        let mut util = Vec::new();
        let mut peak_mib = 0u64;
        let mut model = None;
        for r in live.iter().filter(|r| r.draining_at.is_none()) {
            let p = st.profile(&r.instance_id);
            let recent = &p[p.len().saturating_sub(VERTICAL_WINDOW_SAMPLES)..];
            util.extend(
                recent
                    .iter()
                    .map(|s| f64::from(s.util_pct.min(100)) / 100.0),
            );
            peak_mib = peak_mib.max(recent.iter().filter_map(|s| s.mem_mib).max().unwrap_or(0));
            if model.is_none() && !recent.is_empty() {
                model = st.store().instance(&r.instance_id).await?.gpu_model;
            }
        }
        if util.is_empty() {
            return Ok(());
        }
        if self
            .verticals
            .get(&ep.id)
            .is_none_or(|(o, _)| *o != status.opt_in)
        {
            // The class it runs on: the one its spec pins, else its
            // replicas'.
            let current = match ep.spec.gpu_types.as_slice() {
                [one] => Some(one.clone()),
                _ => model.clone(),
            };
            let Some(current) = current else {
                return Ok(());
            };
            let classes: Vec<GpuClass> = status
                .opt_in
                .classes
                .iter()
                .filter_map(|c| st.catalog().models().iter().find(|m| &m.name == c))
                .map(|m| GpuClass {
                    name: m.name.clone(),
                    // A ranking input only; money is rated exactly elsewhere.
                    price_per_hour: m.list_price_per_hour.to_string().parse().unwrap_or(0.0),
                    relative_performance: m.relative_performance,
                    memory_gib: m.memory_gib,
                })
                .collect();
            let config = VerticalConfig {
                sustain_ms: status.opt_in.sustain_s.saturating_mul(1000),
                // What the replicas were seen to need, else the default.
                min_memory_gib: u32::try_from(peak_mib.div_ceil(1024))
                    .unwrap_or(u32::MAX)
                    .max(1),
                min_replicas: ep.spec.min_replicas.max(1),
                ..VerticalConfig::default()
            };
            match Vertical::new(config, classes, &current) {
                Ok(v) => {
                    self.verticals
                        .insert(ep.id.clone(), (status.opt_in.clone(), v));
                }
                Err(e) => {
                    tracing::warn!(endpoint = %ep.id, error = %e, current, "vertical policy does not build");
                    return Ok(());
                }
            }
        }
        let Some((_, policy)) = self.verticals.get_mut(&ep.id) else {
            return Ok(());
        };
        let fresh = ep.signals.as_ref();
        // Without a measurement of time to first token (no traffic), the
        // whole of it is taken as GPU-bound: the cautious projection for a
        // move to a slower class.
        let p95 = fresh.and_then(|s| s.ttft_p95_ms).unwrap_or(0.0);
        let signals = VerticalSignals {
            p95_ttft_ms: p95,
            p95_gpu_ms: p95,
            slo_ms: ep.spec.slo_p95_ms as f64,
            utilisation: util.iter().sum::<f64>() / util.len() as f64,
            replicas: live.len() as u32,
        };
        let now_ms = u64::try_from(now.timestamp_millis()).unwrap_or(0);
        let Some(mv) = policy.decide(now_ms, &signals) else {
            return Ok(());
        };
        let update = flotilla_core::endpoint::UpdateEndpoint {
            gpu_types: Some(vec![mv.to.clone()]),
            ..Default::default()
        };
        let (spec, bump) = ep
            .spec
            .update(update, st.catalog())
            .map_err(|e| StoreError::Conflict(format!("vertical move: {e}")))?;
        let moved = st.store().update_endpoint(&ep.id, &spec, bump, now).await?;
        let what = format!("to {} (revision {}): {}", mv.to, moved.revision, mv.reason);
        st.store().record_vertical_move(&ep.id, &what, now).await?;
        st.ops()
            .scaling_decisions
            .get_or_create(&vec![
                ("kind", "vertical".to_string()),
                ("direction", "move".to_string()),
            ])
            .inc();
        tracing::info!(endpoint = %ep.id, to = %mv.to, revision = moved.revision, reason = %mv.reason, "vertical move");
        st.notify_change();
        Ok(())
    }
}
