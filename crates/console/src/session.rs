//! Console sessions: signing in with an API key, the session cookie, CSRF
//! tokens, and the typed client that calls the API as the signed-in key.
//!
//! A session is a random id (32 bytes from the OS) in an `HttpOnly`,
//! `SameSite=Strict` cookie; the server keeps what it stands for in memory
//! (a client holding the key's secret, needed to call the API as that key,
//! and the form token). Nothing of the key reaches the browser after
//! sign-in, and a restart signs everyone out, which is the safe failure.
//! Pages never read the store for a tenant's objects themselves: they call
//! the API through `flotilla_client` (in-process when the server mounts
//! the console) with the key as the bearer, so every page answers by
//! exactly the API's rules (roles, tenant scoping, 404 for another
//! tenant's objects, rate limits, a revoked key stops working at once).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::http::header::COOKIE;
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use flotilla_client::Client;
use flotilla_core::id::TenantId;
use flotilla_core::tenant::Role;
use rand::RngCore;

use super::{ConsoleError, ConsoleState};

impl From<flotilla_client::Error> for ConsoleError {
    /// The API's refusal as the console shows it: 401 (the key stopped
    /// working) signs the browser out, another status keeps the API's
    /// status and message; a failure on the way is internal.
    fn from(e: flotilla_client::Error) -> Self {
        match e.status() {
            Some(401) => ConsoleError::SignIn,
            Some(status) => ConsoleError::Api {
                status: StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
                message: e.message(),
            },
            None => ConsoleError::internal(e),
        }
    }
}

/// Name of the session cookie.
pub const SESSION_COOKIE: &str = "flotilla_session";
/// Name of the cookie that carries the sign-in form's token before a
/// session exists (double submit: a cross-site page can neither read it
/// nor set it).
pub const LOGIN_COOKIE: &str = "flotilla_login";
/// How long a session lasts from sign-in.
pub const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
/// Most sessions kept at once; the oldest go first beyond it, so a flood
/// of sign-ins cannot grow memory without bound.
const MAX_SESSIONS: usize = 10_000;

/// 32 random bytes from the OS, hex.
pub fn random_token() -> String {
    let mut b = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut b);
    hex::encode(b)
}

/// Equality that takes as long for every pair of equal-length inputs, for
/// comparing tokens.
pub fn same_token(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// A signed-in browser.
#[derive(Clone)]
pub struct Session {
    /// Its id (the cookie's value).
    pub id: String,
    /// The API as the session's key: pages call it, never the store.
    pub api: Client,
    /// The token every form of this session carries.
    pub csrf: String,
    /// The key's role when it signed in (the API checks it again on every
    /// call).
    pub role: Role,
    /// The key's tenant.
    pub tenant_id: TenantId,
    /// The tenant's name, for the header.
    pub tenant_name: String,
    /// When it ends.
    expires: tokio::time::Instant,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("role", &self.role)
            .field("tenant_id", &self.tenant_id)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// Operators see every tenant and run the fleet.
    pub fn is_operator(&self) -> bool {
        self.role == Role::Operator
    }

    /// Providers (and operators) see nodes and payouts.
    pub fn is_provider(&self) -> bool {
        matches!(self.role, Role::Provider | Role::Operator)
    }

    /// A 403 unless the form's token is this session's.
    pub fn check_csrf(&self, token: Option<&str>) -> Result<(), ConsoleError> {
        match token {
            Some(t) if same_token(t, &self.csrf) => Ok(()),
            _ => Err(ConsoleError::Csrf),
        }
    }
}

/// The sessions of this server replica.
#[derive(Default, Clone)]
pub struct Sessions {
    map: Arc<Mutex<HashMap<String, Session>>>,
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        // Each change is one insert or remove: a poisoned map is whole.
        self.map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Opens a session for a key that the API accepted.
    pub fn open(
        &self,
        api: Client,
        role: Role,
        tenant_id: TenantId,
        tenant_name: String,
    ) -> Session {
        let s = Session {
            id: random_token(),
            api,
            csrf: random_token(),
            role,
            tenant_id,
            tenant_name,
            expires: tokio::time::Instant::now() + SESSION_TTL,
        };
        let mut map = self.lock();
        let now = tokio::time::Instant::now();
        map.retain(|_, s| s.expires > now);
        if map.len() >= MAX_SESSIONS {
            if let Some(oldest) = map.values().min_by_key(|s| s.expires).map(|s| s.id.clone()) {
                map.remove(&oldest);
            }
        }
        map.insert(s.id.clone(), s.clone());
        s
    }

    /// The live session `id` names.
    pub fn get(&self, id: &str) -> Option<Session> {
        let mut map = self.lock();
        match map.get(id) {
            Some(s) if s.expires > tokio::time::Instant::now() => Some(s.clone()),
            Some(_) => {
                map.remove(id);
                None
            }
            None => None,
        }
    }

    /// Ends a session.
    pub fn close(&self, id: &str) {
        self.lock().remove(id);
    }
}

/// The value of cookie `name` in a request's headers.
pub fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// `Set-Cookie` for a session cookie (or its removal with `None`).
pub fn set_cookie(name: &str, value: Option<&str>, max_age: Duration) -> String {
    match value {
        Some(v) => format!(
            "{name}={v}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}",
            max_age.as_secs()
        ),
        None => format!("{name}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"),
    }
}

impl FromRequestParts<ConsoleState> for Session {
    type Rejection = ConsoleError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &ConsoleState,
    ) -> Result<Self, Self::Rejection> {
        cookie(&parts.headers, SESSION_COOKIE)
            .and_then(|id| state.sessions.get(id))
            .ok_or(ConsoleError::SignIn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_and_compared_whole() {
        let (a, b) = (random_token(), random_token());
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
        assert!(same_token(&a, &a.clone()));
        assert!(!same_token(&a, &b));
        assert!(!same_token(&a, &a[..63]));
    }

    #[test]
    fn cookies_are_found_by_name_and_set_strict() {
        let mut h = HeaderMap::new();
        h.insert(COOKIE, "a=1; flotilla_session=abc; b=2".parse().unwrap());
        assert_eq!(cookie(&h, SESSION_COOKIE), Some("abc"));
        assert_eq!(cookie(&h, "c"), None);
        let c = set_cookie(SESSION_COOKIE, Some("x"), SESSION_TTL);
        assert!(c.contains("HttpOnly") && c.contains("SameSite=Strict"));
        assert!(set_cookie(SESSION_COOKIE, None, SESSION_TTL).contains("Max-Age=0"));
    }

    #[tokio::test]
    async fn sessions_open_find_and_close() {
        let s = Sessions::default();
        let t = TenantId::generate(1, 1);
        let api = Client::new("http://127.0.0.1:1", "flt_x").unwrap();
        let a = s.open(api, Role::TenantAdmin, t, "acme".into());
        assert_eq!(s.get(&a.id).map(|x| x.csrf), Some(a.csrf.clone()));
        assert!(a.check_csrf(Some(&a.csrf)).is_ok());
        assert!(a.check_csrf(Some("nope")).is_err());
        assert!(a.check_csrf(None).is_err());
        s.close(&a.id);
        assert!(s.get(&a.id).is_none());
    }
}
