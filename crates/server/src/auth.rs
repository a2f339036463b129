//! Bearer API keys: minting, hashing and the `Caller` extractor that
//! authenticates and rate-limits every request.
//!
//! A secret is `flt_` plus 64 hex digits (32 random bytes). Only its
//! SHA-256 is stored; with that much entropy a slow password hash would buy
//! nothing and cost every request.

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
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

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let secret = bearer(parts).ok_or_else(|| {
            ApiError::unauthenticated("missing `Authorization: Bearer <api key>` header")
        })?;
        if !secret.starts_with(SECRET_PREFIX) || secret.len() > 200 {
            return Err(ApiError::unauthenticated("invalid API key"));
        }
        let key = state
            .store()
            .key_by_hash(&hash_secret(secret))
            .await?
            .ok_or_else(|| ApiError::unauthenticated("invalid or revoked API key"))?;
        if key.endpoints.is_some() {
            return Err(ApiError::forbidden(
                "an inference key calls endpoints through the gateway only, not the API",
            ));
        }
        state.check_rate(key.id.as_str())?;
        Ok(Caller {
            key_id: key.id,
            tenant_id: key.tenant_id,
            role: key.role,
        })
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
