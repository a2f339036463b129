//! The agent protocol: register, sync (heartbeat + observed state in,
//! desired assignments out, long-polled) and log upload.

use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use flotilla_core::api::{
    Assignment, LogBatch, NodeWeights, ObservedInstance, ObservedPhase, RegisterNode, Registered,
    SyncRequest, SyncResponse, WeightTier,
};
use flotilla_core::id::{GpuId, InstanceId, NodeId, ProviderId};
use flotilla_core::node::NodeState;
use flotilla_core::registry::registry_of;
use flotilla_core::tenant::{validate_name, Role};
use flotilla_core::FieldError;
use flotilla_store::StoreError;

use super::path_id;
use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::ApiJson;
use crate::state::AppState;

const AGENT_ROLES: [Role; 1] = [Role::Provider];
/// Longest a sync may be held.
const MAX_WAIT: Duration = Duration::from_secs(30);

/// Registers a node, or re-attaches to the node of the same name.
#[utoipa::path(post, path = "/v1/agent/register", tag = "agent", request_body = RegisterNode,
    responses((status = 200, body = Registered), (status = 403, body = flotilla_core::api::ErrorBody), (status = 409, body = flotilla_core::api::ErrorBody)))]
pub async fn register(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<RegisterNode>,
) -> ApiResult<Json<Registered>> {
    caller.require(&AGENT_ROLES, "register nodes")?;
    if req.name.is_empty()
        || req.name.len() > 253
        || !req
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-._".contains(c))
    {
        return Err(
            FieldError::new("name", "must be 1-253 letters, digits, '-', '.' or '_'").into(),
        );
    }
    for (label, value) in [("region", &req.region), ("pool", &req.pool)] {
        if let Some(v) = value {
            validate_name(v, label)?;
        }
    }
    if req.gpus.len() > 64 {
        return Err(FieldError::new("gpus", "at most 64 GPUs per node").into());
    }
    // The store keeps these as signed 64-bit integers: a larger value
    // would come back negative.
    for (field, v) in [("cpu_milli", req.cpu_milli), ("memory_mb", req.memory_mb)] {
        if i64::try_from(v).is_err() {
            return Err(FieldError::new(field, format!("at most {}", i64::MAX)).into());
        }
    }
    for (i, g) in req.gpus.iter().enumerate() {
        if i64::try_from(g.memory_mib).is_err() {
            return Err(FieldError::new(
                format!("gpus[{i}].memory_mib"),
                format!("at most {}", i64::MAX),
            )
            .into());
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    for (i, g) in req.gpus.iter().enumerate() {
        st.catalog()
            .resolve(&g.model, &format!("gpus[{i}].model"))?;
        if !seen.insert(g.index) {
            return Err(FieldError::new(format!("gpus[{i}].index"), "duplicate GPU index").into());
        }
    }
    let mut req = req;
    for g in &mut req.gpus {
        g.model = st.catalog().resolve(&g.model, "gpus")?;
    }
    let count = req.gpus.len();
    let ids = || {
        let (t, r) = st.ids();
        (
            NodeId::generate(t, r),
            (0..count)
                .map(|i| GpuId::generate(t, r.wrapping_add(i as u128 + 1)))
                .collect(),
        )
    };
    let node = st
        .store()
        .register_node(&caller.tenant_id, &req, ids, st.now())
        .await?;
    if caller.role == Role::Provider {
        // Marketplace: the node's usage is paid out to its provider.
        let (t, r) = st.ids();
        let provider = st
            .store()
            .provider_for_tenant(&caller.tenant_id, &ProviderId::generate(t, r), st.now())
            .await?;
        st.store()
            .set_node_provider(&node.id, Some(&provider))
            .await?;
    }
    if !node.created {
        let failed = st
            .store()
            .fail_started_on(&node.id, &req.running, st.now())
            .await?;
        if failed > 0 {
            tracing::warn!(node = %node.id, failed, "agent re-registered; instances it had started are failed");
        }
    }
    tracing::info!(node = %node.id, name = %req.name, gpus = count, created = node.created, "node registered");
    // New capacity for the pass; no other node's assignments change.
    st.notify_control();
    Ok(Json(Registered {
        node_id: node.id,
        heartbeat_interval_ms: heartbeat_interval(&st).as_millis() as u64,
        lease_ms: lease_ms(&st),
        busy_answers: true,
    }))
}

fn heartbeat_interval(st: &AppState) -> Duration {
    st.config().heartbeat_interval()
}

/// When an agent answered busy is to sync again: half the heartbeat
/// interval (2.5 s by default), as long as an idle agent's long poll. Its
/// lease was just renewed, so the wait costs only how late its report
/// lands. Shorter spends the time a busy answer saves on more of them:
/// with a fifth of the interval, 2,000 nodes made some 1,500 busy syncs a
/// second, each an authenticated request with two reads and a heartbeat,
/// and full reports fell to 87 a second (docs/scale.md).
fn busy_retry(st: &AppState) -> Duration {
    heartbeat_interval(st) / 2
}

/// How long after a stop was asked a syncing agent that does not report
/// the instance is taken not to hold it: the node's lease and margin (an
/// agent out of lease stops its work unreported) and the longest grace a
/// stop gives (a preemption's notice).
fn unreported_stop_wait(st: &AppState) -> chrono::Duration {
    let cfg = st.config();
    chrono::Duration::from_std(cfg.node_lease() + cfg.node_lease_margin())
        .unwrap_or(chrono::Duration::seconds(20))
        + chrono::Duration::milliseconds(
            flotilla_store::instances::PREEMPT_NOTICE_MS.min(i64::MAX as u64) as i64,
        )
}

/// How long after a sync arrived its answer records the node's heartbeat
/// again (the lease's renewal), in milliseconds.
const ANSWER_RENEWS_AFTER_MS: i64 = 100;

/// The node lease the agent is told, in milliseconds.
fn lease_ms(st: &AppState) -> Option<u64> {
    u64::try_from(st.config().node_lease().as_millis()).ok()
}

/// A node the caller owns (operators: any) and may sync as an agent, or
/// 404.
async fn own_node(st: &AppState, caller: &Caller, raw: &str) -> ApiResult<NodeId> {
    let id = super::offers::own_node(st, caller, raw).await?;
    caller.require(&AGENT_ROLES, "sync nodes")?;
    Ok(id)
}

/// Takes every GPU whose reading shows a fault (see
/// [`flotilla_core::health::assess`]) out of placement, with a `gpu_fault`
/// event on its node. A GPU already out stays as first judged; only an
/// operator's reset brings it back. Returns whether any GPU went out.
async fn take_out_faulty_gpus(
    st: &AppState,
    node: &NodeId,
    samples: &[flotilla_core::api::GpuSample],
    now: chrono::DateTime<chrono::Utc>,
) -> ApiResult<bool> {
    let policy = st.config().gpu_health;
    let faults: Vec<_> = samples
        .iter()
        .filter_map(|s| flotilla_core::health::assess(s, &policy).map(|f| (s, f)))
        .collect();
    if faults.is_empty() {
        return Ok(false);
    }
    let gpus = st.store().node_gpus(node).await?;
    let mut any = false;
    for (sample, fault) in faults {
        // Only a GPU the node registered, matched by index and UUID.
        let Some(gpu) = gpus
            .iter()
            .find(|g| g.index == sample.index && g.uuid == sample.uuid)
        else {
            continue;
        };
        if gpu.fault.is_some() {
            continue;
        }
        if st
            .store()
            .set_gpu_fault(node, &gpu.id, Some(&fault.to_string()), now)
            .await?
        {
            tracing::warn!(node = %node, gpu = %gpu.id, kind = fault.kind(), %fault, "gpu out of placement");
            st.ops()
                .gpu_faults
                .get_or_create(&vec![("kind", fault.kind().to_string())])
                .inc();
            any = true;
        }
    }
    Ok(any)
}

/// Adds each reading of a GPU held whole by an instance to that
/// instance's profile (utilisation and memory), for its advice. Who holds
/// which GPU comes from the node's assignments, which the sync reads
/// anyway (a GPU held whole is one its assignment lists with no slices).
fn profile_instances(
    st: &AppState,
    assignments: &[Assignment],
    samples: &[flotilla_core::api::GpuSample],
    now: chrono::DateTime<chrono::Utc>,
) {
    let mut by_instance: std::collections::BTreeMap<&InstanceId, Vec<_>> = Default::default();
    for s in samples {
        let Some(util) = s.gpu_util_pct else { continue };
        let Some(inst) = assignments
            .iter()
            .filter(|a| a.gpu_slices.is_empty())
            .find(|a| {
                a.gpu_indices
                    .iter()
                    .zip(&a.gpu_uuids)
                    .any(|(i, u)| *i == s.index && *u == s.uuid)
            })
            .map(|a| &a.instance_id)
        else {
            continue;
        };
        by_instance
            .entry(inst)
            .or_default()
            .push(flotilla_core::advice::UsageSample {
                util_pct: util,
                mem_mib: s.fb_used_mib,
            });
    }
    for (inst, readings) in by_instance {
        st.record_profile(inst, now, readings);
    }
}

/// Whether the agent has something to do now: new work, a stop, or an
/// instance to forget.
fn needs_action(assignments: &[Assignment], observed: &[ObservedInstance]) -> bool {
    let known = |id: &InstanceId| observed.iter().find(|o| &o.instance_id == id);
    assignments.iter().any(|a| match known(&a.instance_id) {
        None => true,
        Some(o) => a.stop && !matches!(o.phase, ObservedPhase::Exited { .. }),
    }) || observed
        .iter()
        .any(|o| !assignments.iter().any(|a| a.instance_id == o.instance_id))
}

/// Heartbeat and reconcile: the agent reports what it runs, the server
/// records the transitions and answers with what the node should run. When
/// nothing is to be done the answer is held up to `wait_ms` (long-poll).
#[utoipa::path(post, path = "/v1/agent/nodes/{node_id}/sync", tag = "agent", request_body = SyncRequest,
    params(("node_id" = String, Path, description = "node id (node_…)")),
    responses((status = 200, body = SyncResponse), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn sync(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(req): ApiJson<SyncRequest>,
) -> ApiResult<Json<SyncResponse>> {
    let started = std::time::Instant::now();
    let id = match own_node(&st, &caller, &raw).await {
        Err(e)
            if e.status == StatusCode::NOT_FOUND
                && caller.role != Role::TenantAdmin
                && caller.role != Role::TenantMember =>
        {
            // A node the database forgot (e.g. a reset): let the agent
            // register again instead of failing forever.
            if let Ok(id) = NodeId::parse(&raw, "node_id") {
                if matches!(st.store().node(&id).await, Err(StoreError::NotFound(_))) {
                    return Ok(Json(SyncResponse {
                        assignments: vec![],
                        reregister: true,
                        lease_ms: lease_ms(&st),
                        sessions: vec![],
                        unpark: vec![],
                        busy_retry_ms: None,
                    }));
                }
            }
            return Err(e);
        }
        other => other?,
    };
    req.validate_gpus().map_err(ApiError::field)?;
    req.validate_images().map_err(ApiError::field)?;
    req.validate_weights().map_err(ApiError::field)?;
    let now = st.now();
    let was_unreachable = st.heartbeat(&id, now).await? == NodeState::Unreachable;
    // Admission. The heartbeat above is committed, so the lease is
    // renewed; what follows reads and writes the node's instances, and a
    // replica short of database time would queue it until the agent gives
    // up (the lease then runs out and the agent stops its work, with the
    // report half written and rolled back). An agent that takes busy
    // answers is told at once to keep what it runs and come back; others
    // (older agents, the Slurm bridge) and a node coming back from lost
    // wait their turn.
    let slot = if req.busy_ok && !was_unreachable {
        match st.sync_report_slots().try_acquire() {
            Ok(slot) => Some(slot),
            Err(_) => {
                st.ops().agent_syncs_busy.inc();
                st.ops().agent_sync_part("busy", started.elapsed());
                return Ok(Json(SyncResponse {
                    assignments: vec![],
                    reregister: false,
                    lease_ms: lease_ms(&st),
                    sessions: vec![],
                    unpark: vec![],
                    busy_retry_ms: Some(busy_retry(&st).as_millis() as u64),
                }));
            }
        }
    } else {
        // Never closed: an error here cannot happen, and would only mean
        // going on without a slot.
        st.sync_report_slots().acquire().await.ok()
    };
    if let Some(images) = &req.images {
        st.store().set_node_images(&id, images, now).await?;
    }
    crate::parking::record_report(&st, &id, req.weights.as_deref(), &req.parks_ended, now).await?;
    if !req.gpus.is_empty() {
        if take_out_faulty_gpus(&st, &id, &req.gpus, now).await? {
            // Placement must see the GPU gone before it places again.
            st.notify_control();
        }
        st.record_telemetry(&id, now, req.gpus.clone());
    }
    let mut changed = st
        .store()
        .apply_observed_all(&id, &req.observed, now)
        .await?;
    if was_unreachable {
        let reported: Vec<InstanceId> = req
            .observed
            .iter()
            .filter(|o| matches!(o.phase, ObservedPhase::Running { .. }))
            .map(|o| o.instance_id.clone())
            .collect();
        st.store().fail_unreported_lost(&id, &reported, now).await?;
        st.store().mark_node_ready(&id, now).await?;
        tracing::info!(node = %id, reattached = reported.len(), "node is back");
        changed = true;
    }
    // What this node reported is for the control loops (a pass, a job's
    // other members): what they decide for other nodes they signal
    // themselves. Other nodes' held syncs are not woken by it.
    if changed {
        st.notify_control();
    }
    let wait = Duration::from_millis(req.wait_ms)
        .min(MAX_WAIT)
        .min(heartbeat_interval(&st));
    let mut changes = st.subscribe();
    changes.borrow_and_update();
    let mut mine = st.subscribe_node(&id);
    let mut assignments = st.store().assignments(&id).await?;
    profile_instances(&st, &assignments, &req.gpus, now);
    // Work asked to stop that this agent does not report, long enough
    // after the stop for an agent holding it to have reported it (its
    // lease, the margin, the longest stop grace): no agent holds it, and
    // nothing else would ever end it. Looked for only when such a stop is
    // among the assignments, so that the usual sync makes no query for it.
    if assignments
        .iter()
        .any(|a| a.stop && !req.observed.iter().any(|o| o.instance_id == a.instance_id))
    {
        let reported: Vec<InstanceId> =
            req.observed.iter().map(|o| o.instance_id.clone()).collect();
        let asked_by = now - unreported_stop_wait(&st);
        if !st
            .store()
            .end_unreported_stops(&id, &reported, asked_by, now)
            .await?
            .is_empty()
        {
            st.notify_control();
            assignments = st.store().assignments(&id).await?;
        }
    }
    drop(slot);
    st.ops().agent_sync_part("report", started.elapsed());
    let mut answering = std::time::Instant::now();
    // A session waiting for this node answers at once (see crate::access).
    if !needs_action(&assignments, &req.observed)
        && st.access().for_node(&id).is_empty()
        && !wait.is_zero()
    {
        let mut shutdown = st.shutdown_signal();
        tokio::select! {
            _ = changes.changed() => {}
            _ = mine.changed() => {}
            _ = shutdown.changed() => {}
            _ = tokio::time::sleep(wait) => {}
        }
        answering = std::time::Instant::now();
        assignments = st.store().assignments(&id).await?;
    }
    attach_registry_auth(&st, &mut assignments, &req.observed).await?;
    // The answer renews the node's lease: the agent counts it from when
    // the answer arrives, so a long poll does not eat into it. Recorded
    // again unless the answer follows the arrival at once (the agent's
    // count then trails the server's by that moment and the answer's
    // transit, which the kill lead leaves room for; see the agent's
    // `NodeLease`).
    let answered = st.now();
    if answered - now >= chrono::Duration::milliseconds(ANSWER_RENEWS_AFTER_MS) {
        st.heartbeat(&id, answered).await?;
    }
    // A deleted endpoint's replicas stop outright and its parks end:
    // asked only of a node that runs a replica or reports parked ones (not
    // on every sync of a node running plain work).
    let runs_replicas = assignments
        .iter()
        .any(|a| a.env.contains_key(flotilla_core::endpoint::ENV_ENDPOINT_ID));
    let unpark = if !runs_replicas && !reports_parked(req.weights.as_deref()) {
        vec![]
    } else {
        st.store().replicas_to_unpark(&id).await?
    };
    st.ops().agent_sync_part("answer", answering.elapsed());
    Ok(Json(SyncResponse {
        assignments,
        reregister: false,
        lease_ms: lease_ms(&st),
        sessions: st.access().for_node(&id),
        unpark,
        busy_retry_ms: None,
    }))
}

/// Whether an agent's weights report may hold a parked replica (no
/// report: it may).
fn reports_parked(weights: Option<&[NodeWeights]>) -> bool {
    weights.is_none_or(|w| w.iter().any(|w| w.tier == WeightTier::Parked))
}

/// Gives each assignment the agent is about to start (one it does not
/// report yet, not to be stopped) its tenant's login for its image's
/// registry, when the tenant stored one. Opened only here, only for that
/// registry, and only until the agent reports the instance: the pull
/// happens before that, and the secret need not cross the wire again.
async fn attach_registry_auth(
    st: &AppState,
    assignments: &mut [Assignment],
    observed: &[ObservedInstance],
) -> ApiResult<()> {
    for a in assignments.iter_mut() {
        let (Some(image), Some(tenant)) = (&a.image, &a.tenant_id) else {
            continue;
        };
        if a.stop || observed.iter().any(|o| o.instance_id == a.instance_id) {
            continue;
        }
        let registry = registry_of(&image.image);
        // The key is loaded only for a tenant that stored a login: a
        // server without one still runs public images.
        let stored = st.store().registry_credentials(tenant).await?;
        if !stored.iter().any(|c| c.registry == registry) {
            continue;
        }
        // A login that cannot be opened (the key changed) must not stop
        // the node's sync: the pull goes without it and fails with the
        // registry's answer, which the instance's failure shows.
        let opened = match st.secret_key() {
            Ok(key) => st
                .store()
                .registry_auth(tenant, &registry, &key)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.message),
        };
        match opened {
            Ok(auth) => a.registry_auth = auth,
            Err(error) => {
                tracing::error!(instance_id = %a.instance_id, %registry, %error, "cannot open the registry credential")
            }
        }
    }
    Ok(())
}

/// Appends an instance's output. Lines the server has (same seq) are
/// ignored, so an agent may resend a batch after a failure.
#[utoipa::path(post, path = "/v1/agent/instances/{instance_id}/logs", tag = "agent", request_body = LogBatch,
    params(("instance_id" = String, Path, description = "instance id (inst_…)")),
    responses((status = 204, description = "stored"), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn push_logs(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(batch): ApiJson<LogBatch>,
) -> ApiResult<StatusCode> {
    let id = path_id(&raw, "instance_id", InstanceId::parse)?;
    let inst = st.store().instance(&id).await?;
    let node = match &inst.node_id {
        Some(n) => st.store().node(n).await?,
        None => return Err(ApiError::not_found("instance")),
    };
    if !caller.sees(&node.owner_tenant_id) {
        return Err(ApiError::not_found("instance"));
    }
    caller.require(&AGENT_ROLES, "push logs")?;
    if batch.lines.len() > 10_000 {
        return Err(FieldError::new("lines", "at most 10000 lines per batch").into());
    }
    if let Some(i) = batch
        .lines
        .iter()
        .position(|l| i64::try_from(l.seq).is_err())
    {
        return Err(FieldError::new(
            format!("lines[{i}].seq"),
            format!(
                "at most {} (the store keeps seq as a signed 64-bit integer)",
                i64::MAX
            ),
        )
        .into());
    }
    st.store().append_logs(&id, &batch.lines).await?;
    // For log followers; no assignment changed.
    st.notify_control();
    Ok(StatusCode::NO_CONTENT)
}
