//! A tenant's registered SSH public keys: `flotilla ssh` (an SSH
//! `ProxyCommand`) reaches the tenant's running instances through the
//! control plane, which lets in a client only when it proves it holds the
//! private half of one of these. Only public halves are ever sent or
//! stored, so nothing here is secret.
//!
//! Parsing the key itself (its algorithm and fingerprint) needs an SSH
//! library; that is the server's job, so this crate stays free of it. What
//! is checked here is what needs no cryptography.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::id::SshKeyId;
use crate::FieldError;

/// Longest key name accepted.
pub const MAX_NAME_LEN: usize = 100;
/// Longest public key line accepted: an RSA key of 16384 bits, the
/// largest OpenSSH makes, is about 2.8 kB in its one-line form.
pub const MAX_PUBLIC_KEY_LEN: usize = 8192;

/// `POST /v1/ssh-keys`: one public key for the caller's tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSshKey {
    /// A name to tell keys apart (`laptop`); the key's own comment when
    /// not given, else its fingerprint.
    #[serde(default)]
    pub name: Option<String>,
    /// The public key in OpenSSH's one-line form, as in `id_ed25519.pub`:
    /// `ssh-ed25519 AAAA… comment`.
    pub public_key: String,
}

impl CreateSshKey {
    /// Checks what needs no parsing of the key and returns the request
    /// with the name and the key trimmed; the error names the field.
    pub fn validate(mut self) -> Result<Self, FieldError> {
        self.public_key = self.public_key.trim().to_string();
        if self.public_key.is_empty()
            || self.public_key.len() > MAX_PUBLIC_KEY_LEN
            || self.public_key.contains(['\n', '\r'])
        {
            return Err(FieldError::new(
                "public_key",
                format!(
                    "must be one public key line (`ssh-ed25519 AAAA… comment`), at most {MAX_PUBLIC_KEY_LEN} bytes"
                ),
            ));
        }
        if let Some(name) = &self.name {
            let name = name.trim();
            if name.is_empty() || name.len() > MAX_NAME_LEN || name.chars().any(char::is_control) {
                return Err(FieldError::new(
                    "name",
                    format!("must be 1 to {MAX_NAME_LEN} characters without control characters"),
                ));
            }
            self.name = Some(name.to_string());
        }
        Ok(self)
    }
}

/// A registered public key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SshKey {
    /// Id (`sshk_…`).
    pub id: SshKeyId,
    /// Its name.
    pub name: String,
    /// The key's algorithm (`ssh-ed25519`, `ecdsa-sha2-nistp256`,
    /// `ssh-rsa`).
    pub algorithm: String,
    /// `SHA256:…`, as `ssh-keygen -lf KEY.pub` and `ssh -v` show it.
    pub fingerprint: String,
    /// The key, `ALGORITHM BASE64` (without its comment).
    pub public_key: String,
    /// When it was registered.
    pub created_at: DateTime<Utc>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(name: Option<&str>, key: &str) -> CreateSshKey {
        CreateSshKey {
            name: name.map(str::to_string),
            public_key: key.to_string(),
        }
    }

    #[test]
    fn requests_are_trimmed_and_checked_naming_the_field() {
        let ok = req(Some(" laptop "), " ssh-ed25519 AAAA x\n")
            .validate()
            .unwrap();
        assert_eq!(ok.name.as_deref(), Some("laptop"));
        assert_eq!(ok.public_key, "ssh-ed25519 AAAA x");
        assert_eq!(req(None, "").validate().unwrap_err().field, "public_key");
        assert_eq!(
            req(None, "ssh-ed25519 A\nssh-ed25519 B")
                .validate()
                .unwrap_err()
                .field,
            "public_key"
        );
        let long = "x".repeat(MAX_PUBLIC_KEY_LEN + 1);
        assert_eq!(req(None, &long).validate().unwrap_err().field, "public_key");
        assert_eq!(req(Some(" "), "k").validate().unwrap_err().field, "name");
        assert_eq!(
            req(Some("a\u{7}"), "k").validate().unwrap_err().field,
            "name"
        );
    }

    #[test]
    fn unknown_fields_are_refused() {
        let r: Result<CreateSshKey, _> =
            serde_json::from_str(r#"{"public_key": "k", "private_key": "x"}"#);
        assert!(r.is_err());
    }
}
