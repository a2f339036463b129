//! The audit log's writer: a layer on the whole API, so that no route can
//! forget it. Every POST, PUT, PATCH and DELETE by an authenticated
//! caller is recorded with its key, tenant, method, route template, the
//! object it named (the last id in its path) or created (the `id` of a
//! 2xx answer), the time and the answer's status, refusals included.
//!
//! Not recorded:
//! - calls without a valid key: they changed nothing and name nobody, and
//!   recording them would let anyone fill the table (they are rate-limited
//!   by address instead, see `crate::auth::layer`);
//! - the protocol traffic of agents and the gateway and reported metrics
//!   ([`crate::routes::kinds::AUDIT_EXEMPT`]): observations sent every few seconds, not decisions of a
//!   person, whose own records (the ledger, logs, node state) keep them;
//! - `POST …/estimates`, which computes a price and stores nothing.

use axum::body::{to_bytes, Body};
use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use flotilla_core::api::AuditEntry;
use flotilla_core::id::AuditId;

use crate::auth::Authn;
use crate::state::AppState;

/// Largest answer read back for the id of a created object; creations
/// answer with the object, far smaller than this.
const CREATED_BODY_LIMIT: usize = 4 * 1024 * 1024;

/// The value of the last `{parameter}` of `template` in `path`: the object
/// a call names (`/v1/instances/{instance_id}/stop` names the instance).
pub fn named_object(template: &str, path: &str) -> Option<String> {
    template
        .split('/')
        .zip(path.split('/'))
        .filter(|(t, _)| t.starts_with('{') && t.ends_with('}'))
        .map(|(_, p)| p)
        .last()
        .filter(|p| !p.is_empty() && p.len() <= 128)
        .map(str::to_string)
}

/// The id of an object a 2xx answer carries: `id`, or `key.id` (a minted
/// API key's answer). Nothing else of the answer is kept: a minted key's
/// secret must never reach the log.
fn created_id(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let id = v
        .get("id")
        .or_else(|| v.get("key").and_then(|k| k.get("id")))?;
    id.as_str().filter(|s| s.len() <= 128).map(str::to_string)
}

/// The layer. It runs inside `crate::auth::layer` (which found the
/// caller) and outside the idempotency layer (so a replay or a refused
/// reuse of an `Idempotency-Key` is recorded as what it answered).
pub async fn layer(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let Some(template) = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
    else {
        return next.run(req).await;
    };
    if !crate::routes::kinds::audited(req.method(), &template) {
        return next.run(req).await;
    }
    let Some(Authn(Ok(caller))) = req.extensions().get::<Authn>().cloned() else {
        return next.run(req).await;
    };
    let method = req.method().to_string();
    let named = named_object(&template, req.uri().path());
    let request_id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| v.len() <= 128)
        .map(str::to_string);
    let resp = next.run(req).await;
    let status = resp.status();
    let json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    let (resp, object_id) = match named {
        Some(id) => (resp, Some(id)),
        None if status.is_success() && json => {
            let (parts, body) = resp.into_parts();
            match to_bytes(body, CREATED_BODY_LIMIT).await {
                Ok(bytes) => {
                    let id = created_id(&bytes);
                    (Response::from_parts(parts, Body::from(bytes)), id)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read an answer for the audit log");
                    (Response::from_parts(parts, Body::empty()), None)
                }
            }
        }
        None => (resp, None),
    };
    let now = st.now();
    let entry = AuditEntry {
        id: AuditId::generate(now.timestamp_millis().max(0) as u64, rand::random()),
        at: now,
        key_id: caller.key_id,
        tenant_id: caller.tenant_id,
        method,
        route: template,
        object_id,
        status: status.as_u16(),
        request_id,
    };
    // The change is made and answered; a failed write is the server's
    // trouble to report, not a reason to tell the caller it failed.
    if let Err(e) = st.store().record_audit(&entry).await {
        tracing::error!(error = %e, route = %entry.route, key = %entry.key_id, "cannot write the audit log");
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_named_object_is_the_last_path_parameter() {
        assert_eq!(
            named_object("/instances/{instance_id}/stop", "/instances/inst_1/stop"),
            Some("inst_1".into())
        );
        assert_eq!(
            named_object("/tenants/{tenant_id}/quota", "/tenants/ten_9/quota"),
            Some("ten_9".into())
        );
        assert_eq!(named_object("/instances", "/instances"), None);
    }

    #[test]
    fn created_ids_never_carry_the_rest_of_the_answer() {
        assert_eq!(
            created_id(br#"{"id": "inst_1", "command": ["x"]}"#),
            Some("inst_1".into())
        );
        assert_eq!(
            created_id(br#"{"key": {"id": "key_1"}, "secret": "flt_abc"}"#),
            Some("key_1".into())
        );
        assert_eq!(created_id(br#"{"secret": "flt_abc"}"#), None);
        assert_eq!(created_id(b"not json"), None);
    }
}
