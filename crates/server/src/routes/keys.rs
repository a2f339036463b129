//! API keys: list, mint (secret shown once), revoke.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use flotilla_core::api::{ApiKey, CreateApiKey, CreatedApiKey, Page};
use flotilla_core::id::KeyId;
use flotilla_core::tenant::Role;
use flotilla_store::keys::NewKey;

use super::{page, page_req, path_id};
use crate::auth::{mint_secret, Caller};
use crate::error::{ApiError, ApiResult};
use crate::extract::{ApiJson, Pagination};
use crate::state::AppState;

/// Keys of the caller's tenant (operators: all).
#[utoipa::path(get, path = "/v1/keys", tag = "keys",
    params(("limit" = Option<u32>, Query, description = "page size, 1-1000"), ("cursor" = Option<String>, Query, description = "from next_cursor")),
    responses((status = 200, body = Page<ApiKey>), (status = 403, body = flotilla_core::api::ErrorBody)))]
pub async fn list_keys(
    State(st): State<AppState>,
    caller: Caller,
    p: Pagination,
) -> ApiResult<Json<Page<ApiKey>>> {
    caller.require(&[Role::TenantAdmin], "list keys")?;
    Ok(page(
        st.store().list_keys(caller.scope(), &page_req(&p)).await?,
    ))
}

/// Mints a key. The secret is in this answer only.
#[utoipa::path(post, path = "/v1/keys", tag = "keys", request_body = CreateApiKey,
    params(("Idempotency-Key" = Option<String>, Header, description = "replays the first answer for a retried request")),
    responses((status = 201, body = CreatedApiKey), (status = 403, body = flotilla_core::api::ErrorBody), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn create_key(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateApiKey>,
) -> ApiResult<(StatusCode, Json<CreatedApiKey>)> {
    caller.require(&[Role::TenantAdmin], "create keys")?;
    let tenant = req
        .tenant_id
        .clone()
        .unwrap_or_else(|| caller.tenant_id.clone());
    if !caller.sees(&tenant) {
        return Err(ApiError::not_found("tenant"));
    }
    if !caller.role.may_grant(req.role) {
        return Err(ApiError::forbidden(format!(
            "a {} key may not create {} keys",
            caller.role.as_str(),
            req.role.as_str()
        )));
    }
    if req.name.len() > 128 {
        return Err(flotilla_core::FieldError::new("name", "at most 128 characters").into());
    }
    st.store().tenant(&tenant).await?;
    if let Some(eps) = &req.endpoints {
        if req.role != Role::TenantMember {
            return Err(flotilla_core::FieldError::new(
                "role",
                "an inference key (with `endpoints`) must have the tenant_member role",
            )
            .into());
        }
        for (i, id) in eps.iter().enumerate() {
            let found = match st.store().endpoint(id).await {
                Ok(e) => e.tenant_id == tenant && !e.deleting,
                Err(flotilla_store::StoreError::NotFound(_)) => false,
                Err(e) => return Err(e.into()),
            };
            if !found {
                return Err(flotilla_core::FieldError::new(
                    format!("endpoints[{i}]"),
                    format!("no endpoint {id} in this tenant"),
                )
                .into());
            }
        }
    }
    let minted = mint_secret();
    let (t, r) = st.ids();
    let key = st
        .store()
        .create_key(
            &NewKey {
                id: KeyId::generate(t, r),
                tenant_id: tenant,
                role: req.role,
                name: req.name,
                prefix: minted.prefix,
                secret_hash: minted.hash,
            },
            st.now(),
        )
        .await?;
    let key = match &req.endpoints {
        Some(eps) => st.store().set_key_endpoints(&key.id, eps).await?,
        None => key,
    };
    tracing::info!(key = %key.id, tenant = %key.tenant_id, role = key.role.as_str(), "key created");
    Ok((
        StatusCode::CREATED,
        Json(CreatedApiKey {
            key,
            secret: minted.secret,
        }),
    ))
}

/// Revokes a key; it stops working at once.
#[utoipa::path(delete, path = "/v1/keys/{key_id}", tag = "keys",
    params(("key_id" = String, Path, description = "key id (key_…)")),
    responses((status = 200, body = ApiKey), (status = 403, body = flotilla_core::api::ErrorBody), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn revoke_key(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<ApiKey>> {
    let id = path_id(&raw, "key_id", KeyId::parse)?;
    let key = st.store().key(&id).await?;
    if !caller.sees(&key.tenant_id) {
        return Err(ApiError::not_found("key"));
    }
    caller.require(&[Role::TenantAdmin], "revoke keys")?;
    if !caller.role.may_grant(key.role) {
        return Err(ApiError::forbidden(format!(
            "a {} key may not revoke {} keys",
            caller.role.as_str(),
            key.role.as_str()
        )));
    }
    let key = st.store().revoke_key(&id, st.now()).await?;
    tracing::info!(key = %key.id, "key revoked");
    Ok(Json(key))
}
