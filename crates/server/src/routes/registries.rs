//! Registry credentials: a tenant's logins to private container
//! registries. The secret is write-only: sealed with the server's secrets
//! key when stored, never returned, opened only when an assignment of the
//! tenant's instance pulls from that registry (see `agent::sync`).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use flotilla_core::api::Page;
use flotilla_core::id::RegistryCredentialId;
use flotilla_core::registry::{CreateRegistryCredential, RegistryCredential};
use flotilla_core::tenant::Role;

use super::path_id;
use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::ApiJson;
use crate::state::AppState;

/// The port a registry named without one is reached on (HTTPS).
const REGISTRY_PORT: u16 = 443;

/// The caller's tenant's registry credentials, without their secrets.
#[utoipa::path(get, path = "/v1/registry-credentials", tag = "registries",
    responses((status = 200, body = Page<RegistryCredential>), (status = 403, body = flotilla_core::api::ErrorBody)))]
pub async fn list_registry_credentials(
    State(st): State<AppState>,
    caller: Caller,
) -> ApiResult<Json<Page<RegistryCredential>>> {
    caller.require(
        &[Role::TenantAdmin, Role::TenantMember],
        "list registry credentials",
    )?;
    Ok(Json(Page {
        items: st.store().registry_credentials(&caller.tenant_id).await?,
        next_cursor: None,
    }))
}

/// Stores a login to one registry for the caller's tenant; its instances
/// whose image is on that registry are pulled with it. One per registry:
/// remove the old one to replace it. A registry that is, or resolves to,
/// a loopback, private, link-local (…) address is refused (422,
/// `registry`) unless the operator allows it (`--allow-egress`).
#[utoipa::path(post, path = "/v1/registry-credentials", tag = "registries", request_body = CreateRegistryCredential,
    responses((status = 201, body = RegistryCredential), (status = 403, body = flotilla_core::api::ErrorBody),
        (status = 409, body = flotilla_core::api::ErrorBody), (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn create_registry_credential(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateRegistryCredential>,
) -> ApiResult<(StatusCode, Json<RegistryCredential>)> {
    caller.require(&[Role::TenantAdmin], "store registry credentials")?;
    let req = req.validate().map_err(ApiError::field)?;
    // The agent's engine logs in to this host with the tenant's secret:
    // it must not be the operator's own network unless allowed.
    let (host, port) = match req.registry.rsplit_once(':') {
        Some((h, p)) => (h, p.parse().unwrap_or(REGISTRY_PORT)),
        None => (req.registry.as_str(), REGISTRY_PORT),
    };
    crate::outbound::check_destination(&st.config().egress(), host, port, "registry").await?;
    let key = st.secret_key()?;
    let (t, r) = st.ids();
    let made = st
        .store()
        .add_registry_credential(
            &RegistryCredentialId::generate(t, r),
            &caller.tenant_id,
            &req,
            &key,
            st.now(),
        )
        .await?;
    tracing::info!(tenant = %caller.tenant_id, credential = %made.id, registry = %made.registry, "registry credential stored");
    Ok((StatusCode::CREATED, Json(made)))
}

/// Removes one of the caller's tenant's registry credentials.
#[utoipa::path(delete, path = "/v1/registry-credentials/{credential_id}", tag = "registries",
    params(("credential_id" = String, Path, description = "credential id (rcred_…)")),
    responses((status = 204, description = "removed"), (status = 403, body = flotilla_core::api::ErrorBody), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn delete_registry_credential(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<StatusCode> {
    let id = path_id(&raw, "credential_id", RegistryCredentialId::parse)?;
    // Another tenant's credential is not found, whatever the caller's role.
    let own = st.store().registry_credentials(&caller.tenant_id).await?;
    if !own.iter().any(|c| c.id == id) {
        return Err(ApiError::not_found("registry credential"));
    }
    caller.require(&[Role::TenantAdmin], "remove registry credentials")?;
    st.store()
        .delete_registry_credential(&caller.tenant_id, &id)
        .await?;
    tracing::info!(tenant = %caller.tenant_id, credential = %id, "registry credential removed");
    Ok(StatusCode::NO_CONTENT)
}
