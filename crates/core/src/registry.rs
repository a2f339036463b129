//! Container registries: which registry an image reference names, and a
//! tenant's credentials for one. The secret travels in two places only:
//! in the request that stores it and in the assignment of an instance whose
//! image comes from that registry; it is never part of an answer a tenant
//! reads back, and its `Debug` form is redacted.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::id::RegistryCredentialId;
use crate::FieldError;

/// The registry an image reference pulls from when it names none.
pub const DEFAULT_REGISTRY: &str = "docker.io";
/// Longest registry host (with port) accepted.
pub const MAX_REGISTRY_LEN: usize = 253;
/// Longest user name accepted.
pub const MAX_USERNAME_LEN: usize = 255;
/// Longest secret (password or token) accepted: registry tokens, JWTs
/// included, fit well within it.
pub const MAX_SECRET_LEN: usize = 8192;

/// The registry host an image reference pulls from, by the engine's rule:
/// the first path component is a registry when it contains a `.` or a `:`
/// or is `localhost`; otherwise the image is on [`DEFAULT_REGISTRY`].
/// Lowercased, since host names are case-insensitive.
pub fn registry_of(image: &str) -> String {
    match image.split_once('/') {
        Some((first, _)) if first.contains(['.', ':']) || first == "localhost" => {
            first.to_ascii_lowercase()
        }
        _ => DEFAULT_REGISTRY.to_string(),
    }
}

/// `POST /v1/registry-credentials`: credentials for one registry of the
/// caller's tenant.
#[derive(Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateRegistryCredential {
    /// Registry host, with a port when it is not 443
    /// (`registry.example.com`, `registry.example.com:5000`, `docker.io`).
    pub registry: String,
    /// User name at the registry.
    pub username: String,
    /// Password or access token. Write-only: stored encrypted, never
    /// returned.
    pub secret: String,
}

impl std::fmt::Debug for CreateRegistryCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CreateRegistryCredential")
            .field("registry", &self.registry)
            .field("username", &self.username)
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl CreateRegistryCredential {
    /// Checks every field and returns the request with the registry in
    /// its canonical (lowercase) form; the error names the field at fault.
    pub fn validate(mut self) -> Result<Self, FieldError> {
        let registry = self.registry.trim().to_ascii_lowercase();
        let (host, port) = match registry.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (registry.as_str(), None),
        };
        let host_ok = !host.is_empty()
            && registry.len() <= MAX_REGISTRY_LEN
            && host.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && !label.starts_with('-')
                    && !label.ends_with('-')
                    && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            });
        let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok_and(|p| p > 0));
        if !host_ok || !port_ok {
            return Err(FieldError::new(
                "registry",
                "must be a registry host such as `registry.example.com` or `registry.example.com:5000` (no scheme, no path)",
            ));
        }
        self.registry = registry;
        if self.username.is_empty()
            || self.username.len() > MAX_USERNAME_LEN
            || self.username.chars().any(char::is_control)
        {
            return Err(FieldError::new(
                "username",
                format!("must be 1 to {MAX_USERNAME_LEN} characters without control characters"),
            ));
        }
        if self.secret.is_empty() || self.secret.len() > MAX_SECRET_LEN {
            return Err(FieldError::new(
                "secret",
                format!("must be 1 to {MAX_SECRET_LEN} bytes"),
            ));
        }
        Ok(self)
    }
}

/// A stored registry credential as its tenant sees it: everything but the
/// secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RegistryCredential {
    /// Id.
    pub id: RegistryCredentialId,
    /// Registry host.
    pub registry: String,
    /// User name at the registry.
    pub username: String,
    /// When it was stored.
    pub created_at: DateTime<Utc>,
}

/// What an agent needs to pull an image from a registry that wants a
/// login: sent in the assignment of an instance whose image is on
/// `registry`, and only there.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RegistryAuth {
    /// Registry host.
    pub registry: String,
    /// User name.
    pub username: String,
    /// Password or token, decrypted for this assignment.
    pub secret: String,
}

impl std::fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryAuth")
            .field("registry", &self.registry)
            .field("username", &self.username)
            .field("secret", &"<redacted>")
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_registry_of_an_image_follows_the_engines_rule() {
        assert_eq!(registry_of("ubuntu:24.04"), "docker.io");
        assert_eq!(registry_of("library/ubuntu"), "docker.io");
        assert_eq!(registry_of("me/app:1"), "docker.io");
        assert_eq!(registry_of("ghcr.io/me/app:1"), "ghcr.io");
        assert_eq!(
            registry_of("Registry.Example:5000/app"),
            "registry.example:5000"
        );
        assert_eq!(registry_of("localhost/app"), "localhost");
        assert_eq!(registry_of("app@sha256:abc"), "docker.io");
    }

    fn req(registry: &str, username: &str, secret: &str) -> CreateRegistryCredential {
        CreateRegistryCredential {
            registry: registry.into(),
            username: username.into(),
            secret: secret.into(),
        }
    }

    #[test]
    fn validation_names_the_field_and_canonicalises_the_host() {
        let ok = req(" Registry.Example:5000 ", "u", "s").validate().unwrap();
        assert_eq!(ok.registry, "registry.example:5000");
        for bad in [
            "",
            "https://r.example",
            "r.example/path",
            "r.example:0",
            "r.example:x",
            "-r.example",
            "a..b",
        ] {
            assert_eq!(
                req(bad, "u", "s").validate().unwrap_err().field,
                "registry",
                "{bad}"
            );
        }
        assert_eq!(
            req("r.example", "", "s").validate().unwrap_err().field,
            "username"
        );
        assert_eq!(
            req("r.example", "a\nb", "s").validate().unwrap_err().field,
            "username"
        );
        assert_eq!(
            req("r.example", "u", "").validate().unwrap_err().field,
            "secret"
        );
        let long = "x".repeat(MAX_SECRET_LEN + 1);
        assert_eq!(
            req("r.example", "u", &long).validate().unwrap_err().field,
            "secret"
        );
    }

    #[test]
    fn debug_never_shows_the_secret() {
        let a = RegistryAuth {
            registry: "r".into(),
            username: "u".into(),
            secret: "hunter2".into(),
        };
        assert!(!format!("{a:?}").contains("hunter2"));
        assert!(!format!("{:?}", req("r", "u", "hunter2")).contains("hunter2"));
    }
}
