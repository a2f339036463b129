//! Bearer API keys: minting, hashing, the layer that authenticates and
//! rate-limits every request, and the `Caller` extractor handlers take.
//!
//! A secret is `flt_` plus 64 hex digits (32 random bytes). Only its
//! SHA-256 is stored; with that much entropy a slow password hash would buy
//! nothing and cost every request.

use std::net::SocketAddr;

use axum::extract::{ConnectInfo, FromRequestParts, Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use flotilla_core::id::{KeyId, TenantId};
use flotilla_core::tenant::Role;
use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::error::ApiError;
use crate::state::AppState;

/// Prefix of every secret, so leaked keys are easy to scan for.
pub const SECRET_PREFIX: &str = "flt_";

/// A new secret and what the store keeps of it.
#[derive(Debug)]
pub struct MintedSecret {
    /// The bearer secret, shown once.
    pub secret: String,
    /// Its first characters, to recognise it in lists.
    pub prefix: String,
    /// Hex SHA-256 of the secret.
    pub hash: String,
}

/// Mints a secret from 32 bytes of the OS's randomness.
pub fn mint_secret() -> MintedSecret {
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    let secret = format!("{SECRET_PREFIX}{}", hex::encode(bytes));
    MintedSecret {
        prefix: secret[..12].to_string(),
        hash: hash_secret(&secret),
        secret,
    }
}

/// Hex SHA-256 of a secret.
pub fn hash_secret(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// The authenticated caller of a request.
#[derive(Debug, Clone)]
pub struct Caller {
    /// Key used.
    pub key_id: KeyId,
    /// Its tenant.
    pub tenant_id: TenantId,
    /// Its role.
    pub role: Role,
}

impl Caller {
    /// Operators see every tenant.
    pub fn is_operator(&self) -> bool {
        self.role == Role::Operator
    }

    /// `None` for operators (no filter), else the caller's tenant: the
    /// filter every list query gets.
    pub fn scope(&self) -> Option<&TenantId> {
        (!self.is_operator()).then_some(&self.tenant_id)
    }

    /// Whether a resource of `owner` is visible; invisible ones are 404.
    pub fn sees(&self, owner: &TenantId) -> bool {
        self.is_operator() || &self.tenant_id == owner
    }

    /// 403 unless the caller has one of `roles` (operators always pass).
    pub fn require(&self, roles: &[Role], action: &str) -> Result<(), ApiError> {
        if self.is_operator() || roles.contains(&self.role) {
            Ok(())
        } else {
            Err(ApiError::forbidden(format!(
                "a {} key may not {action}",
                self.role.as_str()
            )))
        }
    }
}

/// Reads the bearer secret of a request, if any.
pub fn bearer(parts: &Parts) -> Option<&str> {
    let v = parts.headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

/// Why a request has no caller. Kept in the request's extensions by
/// [`layer`] so that the handler's [`Caller`] extractor (and the
/// idempotency layer, before any replay) answer the same error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// No `Authorization: Bearer …` header.
    Missing,
    /// A secret that is not one of ours, or revoked.
    Invalid,
    /// An inference key, which works at the gateway only.
    InferenceKey,
}

impl AuthFailure {
    /// The API error for it.
    pub fn error(self) -> ApiError {
        match self {
            AuthFailure::Missing => {
                ApiError::unauthenticated("missing `Authorization: Bearer <api key>` header")
            }
            AuthFailure::Invalid => ApiError::unauthenticated("invalid or revoked API key"),
            AuthFailure::InferenceKey => ApiError::forbidden(
                "an inference key calls endpoints through the gateway only, not the API",
            ),
        }
    }
}

/// What authentication found for one request.
#[derive(Debug, Clone)]
pub struct Authn(pub Result<Caller, AuthFailure>);

/// Looks the request's key up. `Err` only when the store fails.
pub async fn authenticate(
    state: &AppState,
    parts: &Parts,
) -> Result<Result<Caller, AuthFailure>, ApiError> {
    let Some(secret) = bearer(parts) else {
        return Ok(Err(AuthFailure::Missing));
    };
    if !secret.starts_with(SECRET_PREFIX) || secret.len() > 200 {
        return Ok(Err(AuthFailure::Invalid));
    }
    let Some(key) = state.store().key_by_hash(&hash_secret(secret)).await? else {
        return Ok(Err(AuthFailure::Invalid));
    };
    if key.endpoints.is_some() {
        return Ok(Err(AuthFailure::InferenceKey));
    }
    Ok(Ok(Caller {
        key_id: key.id,
        tenant_id: key.tenant_id,
        role: key.role,
    }))
}

/// The authentication layer, outermost of the API's own layers: every
/// request's key is looked up once, before the idempotency layer could
/// replay a stored answer (a revoked key must not get back the secret a
/// `POST /v1/keys` minted) and before the audit layer records who called.
///
/// Rate limits: a valid key gets its own budget
/// ([`crate::ServerConfig::rate_limit_per_second`]), and another for
/// machine protocol ([`crate::ServerConfig::protocol_rate_limit_per_second`]:
/// a fleet's agents often share one key); a request without a
/// valid key (none, unknown, revoked) on a route that needs one is limited
/// by its source address
/// ([`crate::ServerConfig::anonymous_rate_limit_per_second`]), so guessing
/// keys or hammering the API without one answers 429 rather than costing
/// a database lookup each time.
pub async fn layer(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let (mut parts, body) = req.into_parts();
    let found = match authenticate(&st, &parts).await {
        Ok(found) => found,
        Err(e) => return e.into_response(),
    };
    match &found {
        Ok(caller) => {
            if let Err(e) = st.check_rate_for(caller.key_id.as_str(), parts.uri.path()) {
                return e.into_response();
            }
        }
        Err(AuthFailure::Missing) if crate::routes::kinds::is_public(parts.uri.path()) => {}
        Err(_) => {
            let addr = parts
                .extensions
                .get::<ConnectInfo<SocketAddr>>()
                .map(|c| c.0.ip());
            if let Err(e) = st.check_anonymous_rate(addr) {
                return e.into_response();
            }
        }
    }
    parts.extensions.insert(Authn(found));
    next.run(Request::from_parts(parts, body)).await
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        if let Some(Authn(found)) = parts.extensions.get::<Authn>() {
            return found.clone().map_err(AuthFailure::error);
        }
        // A router without [`layer`] (tests that mount routes alone).
        let caller = authenticate(state, parts)
            .await?
            .map_err(AuthFailure::error)?;
        state.check_rate(caller.key_id.as_str())?;
        Ok(caller)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_long_prefixed_and_hashed() {
        let a = mint_secret();
        let b = mint_secret();
        assert_ne!(a.secret, b.secret);
        assert!(a.secret.starts_with(SECRET_PREFIX));
        assert_eq!(a.secret.len(), 4 + 64, "32 random bytes in hex");
        assert_eq!(a.hash, hash_secret(&a.secret));
        assert!(!a.hash.contains(&a.secret[4..]));
        assert!(a.secret.starts_with(&a.prefix));
    }
}
