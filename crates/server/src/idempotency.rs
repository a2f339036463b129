//! `Idempotency-Key` on every POST, PATCH and DELETE: the first answer (2xx) is stored and
//! replayed for a retry with the same key and body; a different body with
//! the same key is refused; a retry while the first is in flight gets 409.
//! Authentication comes first: a request whose key is missing, unknown or
//! revoked is refused before a stored answer could be replayed to it.
//! Non-2xx answers are not stored, so a corrected retry can succeed.
//! Agent and gateway routes and usage batches are exempt: they are idempotent by design
//! (agents long-poll; usage events carry their own keys).

use axum::body::{to_bytes, Body};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use flotilla_store::idempotency::Claim;
use sha2::{Digest, Sha256};

use crate::auth::{AuthFailure, Authn};
use crate::error::ApiError;
use crate::extract::BODY_LIMIT;
use crate::state::AppState;

/// Header carrying the key.
pub const HEADER: &str = "idempotency-key";
/// Set on replayed answers.
pub const REPLAYED: &str = "idempotent-replayed";

/// The middleware.
pub async fn layer(State(st): State<AppState>, req: Request, next: Next) -> Response {
    // Usage batches are idempotent event by event (their keys) and may be
    // far larger than the body limit buffered here.
    if !matches!(*req.method(), Method::POST | Method::PATCH | Method::DELETE)
        || crate::routes::kinds::is_protocol(req.uri().path())
    {
        return next.run(req).await;
    }
    let Some(key) = req.headers().get(HEADER).cloned() else {
        return next.run(req).await;
    };
    // Only an authenticated caller gets a stored answer: authentication
    // ran first (`crate::auth::layer`), and a missing, unknown or revoked
    // key is refused here, before any replay. Answers are scoped by the
    // key, so one caller's keys never collide with another's.
    let scope = match req.extensions().get::<Authn>() {
        Some(Authn(Ok(caller))) => caller.key_id.to_string(),
        Some(Authn(Err(failure))) => return failure.error().into_response(),
        None => return AuthFailure::Missing.error().into_response(),
    };
    let key = match key.to_str() {
        Ok(k) if !k.is_empty() && k.len() <= 255 => k.to_string(),
        _ => {
            return ApiError::bad_request(
                "Idempotency-Key",
                "must be 1-255 visible ASCII characters",
            )
            .into_response();
        }
    };
    let (parts, body) = req.into_parts();
    let bytes = match to_bytes(body, BODY_LIMIT).await {
        Ok(b) => b,
        Err(_) => return ApiError::too_large(BODY_LIMIT).into_response(),
    };
    let mut h = Sha256::new();
    h.update(parts.method.as_str());
    h.update([0]);
    h.update(parts.uri.path());
    h.update([0]);
    h.update(&bytes);
    let hash = hex::encode(h.finalize());
    match st
        .store()
        .claim_idempotency_key(&scope, &key, &hash, st.now())
        .await
    {
        Err(e) => return ApiError::from(e).into_response(),
        Ok(Claim::InFlight) => {
            return ApiError::conflict(
                "a request with this Idempotency-Key is still being handled; retry later",
            )
            .into_response();
        }
        Ok(Claim::Mismatch) => {
            return ApiError::field(flotilla_core::FieldError::new(
                "Idempotency-Key",
                "was already used with a different request",
            ))
            .into_response();
        }
        Ok(Claim::Done { status, body }) => {
            let mut resp = (
                StatusCode::from_u16(status).unwrap_or(StatusCode::OK),
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                body,
            )
                .into_response();
            resp.headers_mut()
                .insert(REPLAYED, HeaderValue::from_static("true"));
            return resp;
        }
        Ok(Claim::New) => {}
    }
    let resp = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    if !resp.status().is_success() {
        if let Err(e) = st.store().release_idempotency_key(&scope, &key).await {
            tracing::warn!(error = %e, "could not release idempotency key");
        }
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let body = match to_bytes(body, 16 * BODY_LIMIT).await {
        Ok(b) => b,
        Err(e) => return ApiError::internal(e).into_response(),
    };
    let text = String::from_utf8_lossy(&body).into_owned();
    if let Err(e) = st
        .store()
        .complete_idempotency_key(&scope, &key, parts.status.as_u16(), &text)
        .await
    {
        tracing::warn!(error = %e, "could not store idempotent answer");
    }
    Response::from_parts(parts, Body::from(body))
}
