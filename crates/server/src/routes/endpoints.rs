//! Serverless endpoints: deploy, list, show, update (a change of what a
//! replica runs rolls out a new revision), delete (replicas drain, then
//! stop), replica logs and custom metrics. The controller in
//! `crate::endpoints` does the scaling.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use flotilla_core::advice::{VerticalOptIn, VerticalStatus};
use flotilla_core::api::Page;
use flotilla_core::endpoint::{
    CreateEndpoint, CustomMetric, Endpoint, ReplicaLogLine, UpdateEndpoint,
};
use flotilla_core::id::{EndpointId, InstanceId};
use flotilla_core::tenant::Role;
use serde::Deserialize;

use super::{page, page_req, path_id};
use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::{serde_urlencoded_query, ApiJson, Pagination};
use crate::state::AppState;

const WORK_ROLES: [Role; 2] = [Role::TenantAdmin, Role::TenantMember];

async fn visible(st: &AppState, caller: &Caller, raw: &str) -> ApiResult<Endpoint> {
    let id = path_id(raw, "endpoint_id", EndpointId::parse)?;
    let ep = st.store().endpoint(&id).await?;
    if !caller.sees(&ep.tenant_id) {
        return Err(ApiError::not_found("endpoint"));
    }
    Ok(ep)
}

/// Deploys an endpoint. It starts with `min_replicas` replicas (default
/// 0: the first request through the gateway starts one).
#[utoipa::path(post, path = "/v1/endpoints", tag = "endpoints", request_body = CreateEndpoint,
    params(("Idempotency-Key" = Option<String>, Header, description = "replays the first answer for a retried request")),
    responses((status = 201, body = Endpoint), (status = 403, body = flotilla_core::api::ErrorBody),
              (status = 409, body = flotilla_core::api::ErrorBody, description = "the name is taken"),
              (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn create_endpoint(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(mut req): ApiJson<CreateEndpoint>,
) -> ApiResult<(StatusCode, Json<Endpoint>)> {
    caller.require(&WORK_ROLES, "deploy endpoints")?;
    // Per replica.
    let ask = crate::request_defaults::Ask {
        gpus: req.gpus.unwrap_or(1),
        gpu_types: &req.gpu_types,
        gpu_fraction: req.gpu_fraction,
        mig_profile: req.mig_profile.as_deref(),
    };
    crate::request_defaults::fill(&st, ask, &mut req.cpu_milli, &mut req.memory_mb).await?;
    let spec = req.validate(st.catalog())?;
    crate::outbound::check_triggers(&st.config().egress(), &spec.queue_triggers).await?;
    let (t, r) = st.ids();
    let id = EndpointId::generate(t, r);
    let ep = st
        .store()
        .create_endpoint(&id, &caller.tenant_id, &spec, st.now())
        .await?;
    tracing::info!(endpoint = %ep.id, tenant = %ep.tenant_id, name = %ep.name, policy = %ep.spec.policy, "endpoint deployed");
    st.wake_endpoints();
    Ok((StatusCode::CREATED, Json(ep.redacted())))
}

/// Endpoints of the caller's tenant (operators: all).
#[utoipa::path(get, path = "/v1/endpoints", tag = "endpoints",
    params(("limit" = Option<u32>, Query, description = "page size, 1-1000"), ("cursor" = Option<String>, Query, description = "from next_cursor")),
    responses((status = 200, body = Page<Endpoint>)))]
pub async fn list_endpoints(
    State(st): State<AppState>,
    caller: Caller,
    p: Pagination,
) -> ApiResult<Json<Page<Endpoint>>> {
    let mut eps = st
        .store()
        .list_endpoints(caller.scope(), &page_req(&p))
        .await?;
    eps.items = eps.items.into_iter().map(Endpoint::redacted).collect();
    Ok(page(eps))
}

/// One endpoint with its replicas, last signals and decision.
#[utoipa::path(get, path = "/v1/endpoints/{endpoint_id}", tag = "endpoints",
    params(("endpoint_id" = String, Path, description = "endpoint id (ep_…)")),
    responses((status = 200, body = Endpoint), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn get_endpoint(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<Endpoint>> {
    Ok(Json(visible(&st, &caller, &raw).await?.redacted()))
}

/// Changes an endpoint. A new command, environment or resources make a
/// new revision: its replicas start, and the old ones leave rotation only
/// as new ones pass their readiness probe.
#[utoipa::path(patch, path = "/v1/endpoints/{endpoint_id}", tag = "endpoints", request_body = UpdateEndpoint,
    params(("endpoint_id" = String, Path, description = "endpoint id (ep_…)"),
           ("Idempotency-Key" = Option<String>, Header, description = "replays the first answer for a retried request")),
    responses((status = 200, body = Endpoint), (status = 404, body = flotilla_core::api::ErrorBody),
              (status = 409, body = flotilla_core::api::ErrorBody, description = "being deleted"),
              (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn update_endpoint(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(req): ApiJson<UpdateEndpoint>,
) -> ApiResult<Json<Endpoint>> {
    let ep = visible(&st, &caller, &raw).await?;
    caller.require(&WORK_ROLES, "update endpoints")?;
    if ep.deleting {
        return Err(ApiError::conflict("the endpoint is being deleted"));
    }
    let (spec, bump) = ep.spec.update(req, st.catalog())?;
    crate::outbound::check_triggers(&st.config().egress(), &spec.queue_triggers).await?;
    let ep = st
        .store()
        .update_endpoint(&ep.id, &spec, bump, st.now())
        .await?;
    tracing::info!(endpoint = %ep.id, revision = ep.revision, new_revision = bump, "endpoint updated");
    st.wake_endpoints();
    Ok(Json(ep.redacted()))
}

/// Deletes an endpoint: it leaves the gateway's routes at once, its
/// replicas drain and stop. Deleting twice answers the same.
#[utoipa::path(delete, path = "/v1/endpoints/{endpoint_id}", tag = "endpoints",
    params(("endpoint_id" = String, Path, description = "endpoint id (ep_…)")),
    responses((status = 200, body = Endpoint), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn delete_endpoint(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<Endpoint>> {
    let ep = visible(&st, &caller, &raw).await?;
    caller.require(&WORK_ROLES, "delete endpoints")?;
    let ep = st.store().delete_endpoint(&ep.id, st.now()).await?;
    tracing::info!(endpoint = %ep.id, "endpoint deleted");
    st.wake_endpoints();
    Ok(Json(ep.redacted()))
}

/// Reports a custom metric (a queue depth, say); policies that scale on a
/// custom metric read it on their next pass.
#[utoipa::path(post, path = "/v1/endpoints/{endpoint_id}/metrics", tag = "endpoints", request_body = CustomMetric,
    params(("endpoint_id" = String, Path, description = "endpoint id (ep_…)")),
    responses((status = 200, body = Endpoint), (status = 404, body = flotilla_core::api::ErrorBody), (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn report_metric(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(m): ApiJson<CustomMetric>,
) -> ApiResult<Json<Endpoint>> {
    let ep = visible(&st, &caller, &raw).await?;
    caller.require(&WORK_ROLES, "report endpoint metrics")?;
    m.validate()?;
    st.store()
        .set_endpoint_custom_metric(&ep.id, m.value)
        .await?;
    st.wake_endpoints();
    Ok(Json(st.store().endpoint(&ep.id).await?.redacted()))
}

#[derive(Deserialize)]
struct LogQuery {
    replica: Option<String>,
}

/// Output of the endpoint's replicas (or of one, `replica`), oldest first:
/// the first `limit` lines of each replica, merged by time.
#[utoipa::path(get, path = "/v1/endpoints/{endpoint_id}/logs", tag = "endpoints",
    params(("endpoint_id" = String, Path, description = "endpoint id (ep_…)"),
           ("replica" = Option<String>, Query, description = "only this replica (inst_…)"),
           ("limit" = Option<u32>, Query, description = "lines per replica, 1-1000")),
    responses((status = 200, body = Page<ReplicaLogLine>), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn endpoint_logs(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    p: Pagination,
    uri: axum::http::Uri,
) -> ApiResult<Json<Page<ReplicaLogLine>>> {
    let ep = visible(&st, &caller, &raw).await?;
    let q: LogQuery = serde_urlencoded_query(uri.query())?;
    let only = q
        .replica
        .as_deref()
        .map(|r| path_id(r, "replica", InstanceId::parse))
        .transpose()?;
    let replicas = st.store().endpoint_replicas(&ep.id).await?;
    if let Some(o) = &only {
        if !replicas.iter().any(|r| &r.instance_id == o) {
            return Err(ApiError::bad_request(
                "replica",
                format!("{o} is not a replica of this endpoint"),
            ));
        }
    }
    let mut items = Vec::new();
    for r in replicas
        .iter()
        .filter(|r| only.as_ref().is_none_or(|o| o == &r.instance_id))
    {
        for line in st.store().logs(&r.instance_id, 0, p.limit).await? {
            items.push(ReplicaLogLine {
                instance_id: r.instance_id.clone(),
                revision: r.revision,
                line,
            });
        }
    }
    items.sort_by_key(|a| a.line.at);
    Ok(Json(Page {
        items,
        next_cursor: None,
    }))
}

/// Opts the endpoint into automatic vertical moves between the listed GPU
/// classes: when `flotilla_scale::vertical`'s recommendation (from its
/// replicas' utilisation and its time to first token against its SLO) has
/// held for `sustain_s`, its `gpu_types` become the new class, rolled out
/// as a new revision. Replaces an earlier opt-in.
#[utoipa::path(put, path = "/v1/endpoints/{endpoint_id}/vertical", tag = "endpoints", request_body = VerticalOptIn,
    params(("endpoint_id" = String, Path, description = "endpoint id (ep_…)")),
    responses((status = 200, body = VerticalStatus), (status = 404, body = flotilla_core::api::ErrorBody),
              (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn set_vertical(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(opt_in): ApiJson<VerticalOptIn>,
) -> ApiResult<Json<VerticalStatus>> {
    let ep = visible(&st, &caller, &raw).await?;
    caller.require(&WORK_ROLES, "change endpoints")?;
    opt_in
        .validate(st.catalog().models())
        .map_err(ApiError::field)?;
    let status = st.store().set_vertical(&ep.id, &opt_in, st.now()).await?;
    tracing::info!(endpoint = %ep.id, classes = ?opt_in.classes, sustain_s = opt_in.sustain_s, "vertical moves opted in");
    Ok(Json(status))
}

/// The endpoint's vertical opt-in and its last move; 404 without one.
#[utoipa::path(get, path = "/v1/endpoints/{endpoint_id}/vertical", tag = "endpoints",
    params(("endpoint_id" = String, Path, description = "endpoint id (ep_…)")),
    responses((status = 200, body = VerticalStatus), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn get_vertical(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<VerticalStatus>> {
    let ep = visible(&st, &caller, &raw).await?;
    st.store()
        .vertical(&ep.id)
        .await?
        .map(Json)
        .ok_or_else(|| ApiError::not_found("vertical opt-in"))
}
