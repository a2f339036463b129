//! SSH public keys a tenant registers for `flotilla ssh`: whoever proves
//! they hold the private half of one reaches the tenant's running
//! instances over SSH (with an API key that may enter them). Public
//! halves only; each is parsed when registered, so what is stored is a
//! key the SSH endpoint can check (see [`crate::ssh`]).

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use flotilla_core::api::Page;
use flotilla_core::id::SshKeyId;
use flotilla_core::ssh_key::{CreateSshKey, SshKey};

use super::path_id;
use super::work::WORK_ROLES;
use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::ApiJson;
use crate::state::AppState;

/// The caller's tenant's SSH keys, oldest first.
#[utoipa::path(get, path = "/v1/ssh-keys", tag = "ssh",
    responses((status = 200, body = Page<SshKey>), (status = 403, body = flotilla_core::api::ErrorBody)))]
pub async fn list_ssh_keys(
    State(st): State<AppState>,
    caller: Caller,
) -> ApiResult<Json<Page<SshKey>>> {
    caller.require(&WORK_ROLES, "list SSH keys")?;
    Ok(Json(Page {
        items: st.store().ssh_keys(&caller.tenant_id).await?,
        next_cursor: None,
    }))
}

/// Registers an SSH public key (OpenSSH's one-line form, as in
/// `~/.ssh/id_ed25519.pub`) for the caller's tenant: `ssh` through
/// `flotilla ssh` then logs in to the tenant's running instances with it.
/// 422 naming `public_key` for anything else than a public key of an
/// accepted kind (ed25519, ECDSA, RSA); 409 when the tenant registered it
/// already.
#[utoipa::path(post, path = "/v1/ssh-keys", tag = "ssh", request_body = CreateSshKey,
    responses((status = 201, body = SshKey), (status = 403, body = flotilla_core::api::ErrorBody),
        (status = 409, body = flotilla_core::api::ErrorBody), (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn create_ssh_key(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateSshKey>,
) -> ApiResult<(StatusCode, Json<SshKey>)> {
    caller.require(&WORK_ROLES, "register SSH keys")?;
    let req = req.validate().map_err(ApiError::field)?;
    let parsed = crate::ssh::parse_public_key(&req.public_key).map_err(ApiError::field)?;
    let name = req
        .name
        .or_else(|| (!parsed.comment.is_empty()).then(|| parsed.comment.clone()))
        .unwrap_or_else(|| parsed.fingerprint.clone());
    let (t, r) = st.ids();
    let key = SshKey {
        id: SshKeyId::generate(t, r),
        name: name
            .chars()
            .take(flotilla_core::ssh_key::MAX_NAME_LEN)
            .collect(),
        algorithm: parsed.algorithm,
        fingerprint: parsed.fingerprint,
        public_key: parsed.public_key,
        created_at: st.now(),
    };
    let made = st.store().add_ssh_key(&caller.tenant_id, &key).await?;
    tracing::info!(tenant = %caller.tenant_id, ssh_key = %made.id, fingerprint = %made.fingerprint, "ssh key registered");
    Ok((StatusCode::CREATED, Json(made)))
}

/// Removes one of the caller's tenant's SSH keys: it no longer logs in
/// (from the next login on; connections open now stay open).
#[utoipa::path(delete, path = "/v1/ssh-keys/{ssh_key_id}", tag = "ssh",
    params(("ssh_key_id" = String, Path, description = "SSH key id (sshk_…)")),
    responses((status = 204, description = "removed"), (status = 403, body = flotilla_core::api::ErrorBody), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn delete_ssh_key(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<StatusCode> {
    let id = path_id(&raw, "ssh_key_id", SshKeyId::parse)?;
    // Another tenant's key is not found, whatever the caller's role.
    let own = st.store().ssh_keys(&caller.tenant_id).await?;
    if !own.iter().any(|k| k.id == id) {
        return Err(ApiError::not_found("SSH key"));
    }
    caller.require(&WORK_ROLES, "remove SSH keys")?;
    st.store().delete_ssh_key(&caller.tenant_id, &id).await?;
    tracing::info!(tenant = %caller.tenant_id, ssh_key = %id, "ssh key removed");
    Ok(StatusCode::NO_CONTENT)
}
