//! Tenants, quotas and `GET /v1/me`.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use flotilla_core::api::{CreateTenant, Me, Page, QuotaView, Tenant};
use flotilla_core::id::TenantId;
use flotilla_core::quota::Quota;
use flotilla_core::tenant::validate_name;
use flotilla_core::FieldError;

use super::{page, page_req, path_id};
use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::{ApiJson, Pagination};
use crate::state::AppState;

/// Who the caller is.
#[utoipa::path(get, path = "/v1/me", tag = "meta",
    responses((status = 200, body = Me), (status = 401, body = flotilla_core::api::ErrorBody)))]
pub async fn me(State(st): State<AppState>, caller: Caller) -> ApiResult<Json<Me>> {
    Ok(Json(Me {
        key: st.store().key(&caller.key_id).await?,
        tenant: st.store().tenant(&caller.tenant_id).await?,
    }))
}

/// Tenants visible to the caller (operators: all; others: their own).
#[utoipa::path(get, path = "/v1/tenants", tag = "tenants",
    params(("limit" = Option<u32>, Query, description = "page size, 1-1000"), ("cursor" = Option<String>, Query, description = "from next_cursor")),
    responses((status = 200, body = Page<Tenant>)))]
pub async fn list_tenants(
    State(st): State<AppState>,
    caller: Caller,
    p: Pagination,
) -> ApiResult<Json<Page<Tenant>>> {
    Ok(page(
        st.store()
            .list_tenants(caller.scope(), &page_req(&p))
            .await?,
    ))
}

/// Creates a tenant (operators only).
#[utoipa::path(post, path = "/v1/tenants", tag = "tenants", request_body = CreateTenant,
    params(("Idempotency-Key" = Option<String>, Header, description = "replays the first answer for a retried request")),
    responses((status = 201, body = Tenant), (status = 403, body = flotilla_core::api::ErrorBody), (status = 409, body = flotilla_core::api::ErrorBody)))]
pub async fn create_tenant(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateTenant>,
) -> ApiResult<(StatusCode, Json<Tenant>)> {
    caller.require(&[], "create tenants")?;
    validate_name(&req.name, "name")?;
    let (t, r) = st.ids();
    let tenant = st
        .store()
        .create_tenant(&TenantId::generate(t, r), &req.name, st.now())
        .await?;
    tracing::info!(tenant = %tenant.id, name = %tenant.name, "tenant created");
    Ok((StatusCode::CREATED, Json(tenant)))
}

/// The tenant in the path, when the caller may see it; another tenant
/// is 404, as for every resource the caller cannot see.
pub(crate) async fn visible_tenant(
    st: &AppState,
    caller: &Caller,
    raw: &str,
) -> ApiResult<TenantId> {
    let id = path_id(raw, "tenant_id", TenantId::parse)?;
    if !caller.sees(&id) {
        return Err(ApiError::not_found("tenant"));
    }
    st.store().tenant(&id).await?;
    Ok(id)
}

/// One tenant.
#[utoipa::path(get, path = "/v1/tenants/{tenant_id}", tag = "tenants",
    params(("tenant_id" = String, Path, description = "tenant id (ten_…)")),
    responses((status = 200, body = Tenant), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn get_tenant(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<Tenant>> {
    let id = visible_tenant(&st, &caller, &raw).await?;
    Ok(Json(st.store().tenant(&id).await?))
}

/// A tenant's quota and current use.
#[utoipa::path(get, path = "/v1/tenants/{tenant_id}/quota", tag = "tenants",
    params(("tenant_id" = String, Path, description = "tenant id (ten_…)")),
    responses((status = 200, body = QuotaView), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn get_quota(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<QuotaView>> {
    let id = visible_tenant(&st, &caller, &raw).await?;
    quota_view(&st, id).await
}

async fn quota_view(st: &AppState, id: TenantId) -> ApiResult<Json<QuotaView>> {
    Ok(Json(QuotaView {
        quota: st.store().quota(&id).await?,
        usage: st.store().usage(&id).await?,
        tenant_id: id,
    }))
}

/// Replaces a tenant's quota (operators only).
#[utoipa::path(put, path = "/v1/tenants/{tenant_id}/quota", tag = "tenants", request_body = Quota,
    params(("tenant_id" = String, Path, description = "tenant id (ten_…)")),
    responses((status = 200, body = QuotaView), (status = 403, body = flotilla_core::api::ErrorBody), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn set_quota(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    ApiJson(req): ApiJson<Quota>,
) -> ApiResult<Json<QuotaView>> {
    let id = visible_tenant(&st, &caller, &raw).await?;
    caller.require(&[], "change quotas")?;
    let mut q = Quota {
        gpus_total: req.gpus_total,
        gpus_per_model: Default::default(),
        gpus_guaranteed: req.gpus_guaranteed,
        weight: req.weight,
    };
    q.validate()?;
    for (model, n) in req.gpus_per_model {
        let canonical = st
            .catalog()
            .resolve(&model, &format!("gpus_per_model.{model}"))?;
        q.gpus_per_model.insert(canonical, n);
    }
    if q.gpus_total == Some(u32::MAX) {
        return Err(FieldError::new("gpus_total", "use null for no limit").into());
    }
    st.store().set_quota(&id, &q, st.now()).await?;
    tracing::info!(tenant = %id, quota = ?q, "quota changed");
    quota_view(&st, id).await
}
