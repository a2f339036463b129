//! What the inference gateway asks of the control plane: the route table,
//! whether an inference key may call endpoints, the demand it sees (which
//! wakes the endpoint autoscaler at once when a request waits at zero
//! replicas), and the usage of finished requests (metered once by request
//! id). Callable with a provider key (the gateway's, like the agent's) or
//! an operator key.

use axum::extract::State;
use axum::Json;
use flotilla_billing::meter::{EventKey, Meter, Subject, SubjectKind, UsageEvent};
use flotilla_core::gateway::{
    Accepted, AuthorizeRequest, KeyGrant, RequestUsage, RouteTable, SignalsBatch, UsageBatch,
};
use flotilla_core::id::{EndpointId, TenantId};
use flotilla_core::instance::BillingClass;
use flotilla_core::tenant::Role;
use flotilla_core::FieldError;
use rust_decimal::Decimal;
use std::collections::BTreeMap;

use crate::auth::{hash_secret, Caller};
use crate::error::{ApiError, ApiResult};
use crate::extract::ApiJson;
use crate::state::AppState;

const GATEWAY: [Role; 1] = [Role::Provider];
/// Most signals or usage records in one call.
const MAX_BATCH: usize = 10_000;
/// The usage ledger's source of gateway events.
pub const SOURCE: &str = "gateway";

/// Every live endpoint with its ready replicas.
#[utoipa::path(get, path = "/v1/gateway/routes", tag = "gateway",
    responses((status = 200, body = RouteTable), (status = 403, body = flotilla_core::api::ErrorBody)))]
pub async fn routes(State(st): State<AppState>, caller: Caller) -> ApiResult<Json<RouteTable>> {
    caller.require(&GATEWAY, "read the gateway's routes")?;
    Ok(Json(st.store().route_table().await?))
}

/// What an inference key may call: a tenant admin or member key, every
/// endpoint of its tenant; an inference key, the endpoints it names. 404
/// for unknown, revoked, operator and provider keys.
#[utoipa::path(post, path = "/v1/gateway/authorize", tag = "gateway", request_body = AuthorizeRequest,
    responses((status = 200, body = KeyGrant), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn authorize(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<AuthorizeRequest>,
) -> ApiResult<Json<KeyGrant>> {
    caller.require(&GATEWAY, "authorize inference keys")?;
    if req.key.len() > 200 {
        return Err(ApiError::not_found("key"));
    }
    let key = st
        .store()
        .key_by_hash(&hash_secret(&req.key))
        .await?
        .filter(|k| matches!(k.role, Role::TenantAdmin | Role::TenantMember))
        .ok_or_else(|| ApiError::not_found("key"))?;
    let over_hard_cap = over_hard_cap(&st, &key.tenant_id).await?;
    Ok(Json(KeyGrant {
        tenant_id: key.tenant_id,
        endpoints: key.endpoints.unwrap_or_default(),
        over_hard_cap,
    }))
}

/// Whether the tenant's budget is hard-capped and this month's spend has
/// reached it: serverless requests are then refused (402) by the gateway.
async fn over_hard_cap(st: &AppState, tenant: &TenantId) -> ApiResult<bool> {
    let Some(b) = st.store().budget(tenant).await? else {
        return Ok(false);
    };
    if !b.budget.hard_cap {
        return Ok(false);
    }
    let spent = crate::budgets::spend(st, tenant)
        .await
        .map_err(ApiError::internal)?;
    Ok(spent >= b.budget.limit)
}

fn batch_len<T>(v: &[T], field: &str) -> ApiResult<()> {
    if v.len() > MAX_BATCH {
        return Err(FieldError::new(
            field,
            format!("at most {MAX_BATCH} records per call, got {}", v.len()),
        )
        .into());
    }
    Ok(())
}

/// Demand per endpoint. Recorded for the autoscaler; a request waiting at
/// an endpoint with no ready replica wakes it at once.
#[utoipa::path(post, path = "/v1/gateway/signals", tag = "gateway", request_body = SignalsBatch,
    responses((status = 200, body = Accepted), (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn signals(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(SignalsBatch { signals: batch }): ApiJson<SignalsBatch>,
) -> ApiResult<Json<Accepted>> {
    caller.require(&GATEWAY, "report endpoint signals")?;
    batch_len(&batch, "signals")?;
    let now = st.now();
    let mut wake = false;
    let mut accepted = 0;
    for (i, s) in batch.iter().enumerate() {
        for (f, v) in [
            ("ttft_p50_ms", s.ttft_p50_ms),
            ("ttft_p95_ms", s.ttft_p95_ms),
            ("latency_p95_ms", s.latency_p95_ms),
        ] {
            if v.is_some_and(|v| !(v.is_finite() && v >= 0.0)) {
                return Err(FieldError::new(
                    format!("signals[{i}].{f}"),
                    "must be a number of ms >= 0",
                )
                .into());
            }
        }
        match st
            .store()
            .set_endpoint_signals(&s.endpoint_id, s, now)
            .await
        {
            Ok(()) => accepted += 1,
            // A deleted endpoint's gateway may still report for a moment.
            Err(flotilla_store::StoreError::NotFound(_)) => continue,
            Err(e) => return Err(e.into()),
        }
        if s.queued > 0 {
            wake = true;
        }
    }
    if wake {
        st.wake_endpoints();
    }
    Ok(Json(Accepted {
        accepted,
        duplicates: 0,
        rejected: Vec::new(),
    }))
}

/// The ledger events of one request: one request, and its input and
/// output tokens, keyed by the request id so a re-send is a duplicate.
pub fn usage_events(u: &RequestUsage, tenant: &TenantId) -> Vec<UsageEvent> {
    use chrono::SubsecRound;
    // The ledger keeps whole milliseconds.
    let start = u.started_at.trunc_subsecs(3);
    let end = u.finished_at.trunc_subsecs(3).max(start);
    let event = |suffix: &str, meter: Meter, amount: u64| UsageEvent {
        key: EventKey {
            tenant: tenant.clone(),
            source: SOURCE.into(),
            id: format!("{}/{suffix}", u.request_id),
        },
        subject: Subject {
            kind: SubjectKind::Endpoint,
            id: u.endpoint_id.to_string(),
        },
        meter,
        billing_class: BillingClass::OnDemand,
        start,
        end,
        amount: Decimal::from(amount),
        node: None,
        corrects: None,
    };
    let mut out = vec![event("requests", Meter::Requests, 1)];
    if u.input_tokens > 0 {
        out.push(event("input_tokens", Meter::InputTokens, u.input_tokens));
    }
    if u.output_tokens > 0 {
        out.push(event("output_tokens", Meter::OutputTokens, u.output_tokens));
    }
    out
}

/// Usage of finished requests, metered into the ledger: each request
/// counts once by its id (a re-sent batch is all duplicates). Requests
/// refused before they reached a replica (no `instance_id`) are not billed.
#[utoipa::path(post, path = "/v1/gateway/usage", tag = "gateway", request_body = UsageBatch,
    responses((status = 200, body = Accepted), (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn usage(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(UsageBatch { requests: batch }): ApiJson<UsageBatch>,
) -> ApiResult<Json<Accepted>> {
    caller.require(&GATEWAY, "meter requests")?;
    batch_len(&batch, "requests")?;
    let mut tenants: BTreeMap<EndpointId, TenantId> = BTreeMap::new();
    let mut events = Vec::new();
    for (i, u) in batch.iter().enumerate() {
        if u.finished_at < u.started_at {
            return Err(FieldError::new(
                format!("requests[{i}].finished_at"),
                "is before started_at",
            )
            .into());
        }
        // Every request the gateway finished counts in its latency,
        // refused ones too: that is what its clients waited.
        let took = (u.finished_at - u.started_at).num_milliseconds().max(0) as f64 / 1000.0;
        st.ops()
            .gateway_requests
            .get_or_create(&vec![("endpoint", u.endpoint_id.to_string())])
            .observe(took);
        if u.instance_id.is_none() {
            continue;
        }
        let tenant = match tenants.get(&u.endpoint_id) {
            Some(t) => t.clone(),
            None => {
                let t = match st.store().endpoint(&u.endpoint_id).await {
                    Ok(e) => e.tenant_id,
                    Err(flotilla_store::StoreError::NotFound(_)) => {
                        return Err(FieldError::new(
                            format!("requests[{i}].endpoint_id"),
                            format!("no endpoint {}", u.endpoint_id),
                        )
                        .into())
                    }
                    Err(e) => return Err(e.into()),
                };
                tenants.insert(u.endpoint_id.clone(), t.clone());
                t
            }
        };
        events.extend(usage_events(u, &tenant));
    }
    let mut accepted = 0;
    let mut duplicates = 0;
    let mut rejected = Vec::new();
    // The ledger takes bounded batches.
    for chunk in events.chunks(1000) {
        let started = tokio::time::Instant::now();
        let out = st
            .store()
            .append_usage(chunk, crate::metering::grace(), st.now())
            .await?;
        st.ops()
            .usage_ingest
            .observe(started.elapsed().as_secs_f64());
        accepted += out.accepted;
        duplicates += out.duplicates;
        for r in out.rejected {
            tracing::warn!(key = %r.key, code = r.code, message = %r.message, "request usage refused");
            rejected.push(format!("{}: {} {}", r.key, r.code, r.message));
        }
    }
    st.ops()
        .usage_outcome("gateway", accepted, duplicates, rejected.len() as u64);
    Ok(Json(Accepted {
        accepted,
        duplicates,
        rejected,
    }))
}
