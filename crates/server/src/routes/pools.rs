//! Replica pools: a template instance, an autoscaling policy, and metrics
//! reported by whatever serves the pool's traffic. The autoscaling loop
//! (`crate::autoscale`) turns the metrics into a replica count.

use std::str::FromStr;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use flotilla_core::api::{CreateReplicaPool, PoolMetrics, ReplicaPool};
use flotilla_core::id::ReplicaPoolId;
use flotilla_core::tenant::Role;
use flotilla_core::FieldError;
use flotilla_scale::PolicyKind;

use super::path_id;
use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::ApiJson;
use crate::state::AppState;

const WORK_ROLES: [Role; 2] = [Role::TenantAdmin, Role::TenantMember];

/// Checks a pool body; every error names its field.
pub(crate) fn validate(req: &CreateReplicaPool, st: &AppState) -> Result<(), FieldError> {
    flotilla_core::tenant::validate_name(&req.name, "name")?;
    PolicyKind::from_str(&req.policy.kind).map_err(|_| {
        FieldError::new(
            "policy.kind",
            "must be one of flotilla, hpa, keda, kpa, ray",
        )
    })?;
    let p = &req.policy;
    if p.max_concurrency == 0 || p.max_concurrency > 4096 {
        return Err(FieldError::new(
            "policy.max_concurrency",
            "must be between 1 and 4096",
        ));
    }
    if !(p.mean_service_ms.is_finite() && p.mean_service_ms > 0.0) {
        return Err(FieldError::new(
            "policy.mean_service_ms",
            "must be greater than 0",
        ));
    }
    if p.slo_ms == 0 {
        return Err(FieldError::new("policy.slo_ms", "must be greater than 0"));
    }
    if req.max_replicas == 0 || req.max_replicas > 1000 {
        return Err(FieldError::new(
            "max_replicas",
            "must be between 1 and 1000",
        ));
    }
    req.replica
        .clone()
        .validate(st.catalog())
        .map_err(|e| FieldError::new(format!("replica.{}", e.field), e.message))?;
    Ok(())
}

async fn visible(st: &AppState, caller: &Caller, raw: &str) -> ApiResult<ReplicaPool> {
    let id = path_id(raw, "pool_id", ReplicaPoolId::parse)?;
    let pool = st.store().replica_pool(&id).await?;
    if !caller.sees(&pool.tenant_id) {
        return Err(ApiError::not_found("replica pool"));
    }
    Ok(pool)
}

/// Creates a replica pool. Its policy decides from the first metrics
/// report on; until then it keeps the policy's minimum.
#[utoipa::path(post, path = "/v1/pools", tag = "pools", request_body = CreateReplicaPool,
    params(("Idempotency-Key" = Option<String>, Header, description = "replays the first answer for a retried request")),
    responses((status = 201, body = ReplicaPool), (status = 403, body = flotilla_core::api::ErrorBody), (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn create_pool(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateReplicaPool>,
) -> ApiResult<(StatusCode, Json<ReplicaPool>)> {
    caller.require(&WORK_ROLES, "create replica pools")?;
    validate(&req, &st)?;
    let (t, r) = st.ids();
    let id = ReplicaPoolId::generate(t, r);
    let pool = st
        .store()
        .create_replica_pool(&id, &caller.tenant_id, &req, st.now())
        .await?;
    tracing::info!(pool = %pool.id, tenant = %pool.tenant_id, policy = %pool.policy.kind, "replica pool created");
    Ok((StatusCode::CREATED, Json(pool)))
}

/// A replica pool, with its last metrics, decision and live replicas.
#[utoipa::path(get, path = "/v1/pools/{pool_id}", tag = "pools",
    params(("pool_id" = String, Path, description = "replica pool id (rpool_…)")),
    responses((status = 200, body = ReplicaPool), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn get_pool(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<ReplicaPool>> {
    Ok(Json(visible(&st, &caller, &raw).await?))
}

/// Reports the pool's current metrics; the autoscaling loop decides on
/// its next pass.
#[utoipa::path(post, path = "/v1/pools/{pool_id}/metrics", tag = "pools", request_body = PoolMetrics,
    params(("pool_id" = String, Path, description = "replica pool id (rpool_…)")),
    responses((status = 200, body = ReplicaPool), (status = 404, body = flotilla_core::api::ErrorBody), (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn report_metrics(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(m): ApiJson<PoolMetrics>,
) -> ApiResult<Json<ReplicaPool>> {
    let pool = visible(&st, &caller, &raw).await?;
    caller.require(&WORK_ROLES, "report replica pool metrics")?;
    m.validate()?;
    st.store().set_pool_metrics(&pool.id, &m, st.now()).await?;
    Ok(Json(st.store().replica_pool(&pool.id).await?))
}
