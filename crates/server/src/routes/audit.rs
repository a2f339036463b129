//! `GET /v1/audit`: the audit log (see `crate::audit`), newest first.

use axum::extract::State;
use axum::Json;
use flotilla_core::api::{AuditEntry, Page};
use flotilla_core::id::TenantId;
use flotilla_core::tenant::Role;
use serde::Deserialize;

use super::{page, page_req};
use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::{serde_urlencoded_query, Pagination};
use crate::state::AppState;

#[derive(Deserialize)]
struct AuditQuery {
    tenant_id: Option<String>,
}

/// Mutating calls, newest first: every POST, PUT, PATCH and DELETE made
/// with a valid key (refused ones included), except the agents' and the
/// gateway's protocol traffic and reported metrics. Operators read every
/// tenant's (or one's, with `tenant_id`); a tenant admin reads its own
/// tenant's.
#[utoipa::path(get, path = "/v1/audit", tag = "audit",
    params(("limit" = Option<u32>, Query, description = "page size, 1-1000"), ("cursor" = Option<String>, Query, description = "from next_cursor"),
           ("tenant_id" = Option<String>, Query, description = "only this tenant's calls (operators; others see their own anyway)")),
    responses((status = 200, body = Page<AuditEntry>), (status = 400, body = flotilla_core::api::ErrorBody),
              (status = 403, body = flotilla_core::api::ErrorBody), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn list_audit(
    State(st): State<AppState>,
    caller: Caller,
    p: Pagination,
    uri: axum::http::Uri,
) -> ApiResult<Json<Page<AuditEntry>>> {
    caller.require(&[Role::TenantAdmin], "read the audit log")?;
    let q: AuditQuery = serde_urlencoded_query(uri.query())?;
    let only = match q.tenant_id.as_deref() {
        None => caller.scope().cloned(),
        Some(raw) => {
            let t = TenantId::parse(raw, "tenant_id")
                .map_err(|e| ApiError::bad_request("tenant_id", e.message))?;
            if !caller.sees(&t) {
                return Err(ApiError::not_found("tenant"));
            }
            Some(t)
        }
    };
    Ok(page(
        st.store().list_audit(only.as_ref(), &page_req(&p)).await?,
    ))
}
