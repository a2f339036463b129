//! Secrets at rest: values the store must keep but never hold in plain
//! text (a tenant's registry passwords) are sealed with AES-256-GCM under
//! the server's secrets key before they reach the database, and opened only
//! when they are about to be used.
//!
//! The key is 32 random bytes, hex-encoded: from `FLOTILLA_SECRETS_KEY`
//! when set (several server replicas must share it), else from a key file
//! in the server's data directory, created with mode 0600 on first use.
//! Each sealed value binds the row it belongs to as associated data, so a
//! sealed value moved to another tenant's row fails to open instead of
//! leaking.

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Key, Nonce};
use rand::RngCore as _;

/// Environment variable holding the secrets key (64 hex digits).
pub const KEY_ENV: &str = "FLOTILLA_SECRETS_KEY";
/// Prefix of a value sealed by this version's scheme.
const VERSION: &str = "v1:";
/// AES-GCM's nonce length.
const NONCE_LEN: usize = 12;

/// Why a key could not be had or a sealed value could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The key file could not be read or created.
    #[error("secrets key file `{path}`: {source}")]
    KeyFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The key is not 64 hex digits.
    #[error("secrets key from {from} is not 64 hex digits (32 bytes)")]
    BadKey {
        /// Where it came from.
        from: String,
    },
    /// The value does not open under this key: another key sealed it, or
    /// it was altered or moved to another row.
    #[error("a sealed secret does not open with this server's secrets key (another key sealed it, or it was altered)")]
    WrongKey,
    /// The stored value is not in the sealed format.
    #[error("a sealed secret is malformed")]
    Malformed,
}

/// The server's secrets key. Its `Debug` form never shows it.
#[derive(Clone)]
pub struct SecretKey(Key<Aes256Gcm>);

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretKey(<redacted>)")
    }
}

impl SecretKey {
    /// A fresh random key.
    pub fn generate() -> Self {
        let mut bytes = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut bytes);
        Self(bytes.into())
    }

    /// Parses 64 hex digits; `from` says where they came from, for the
    /// error.
    pub fn from_hex(text: &str, from: &str) -> Result<Self, SecretError> {
        let bad = || SecretError::BadKey { from: from.into() };
        let bytes = hex::decode(text.trim()).map_err(|_| bad())?;
        let bytes: [u8; 32] = bytes.try_into().map_err(|_| bad())?;
        Ok(Self(bytes.into()))
    }

    /// The key in [`KEY_ENV`], when it is set.
    pub fn from_env() -> Option<Result<Self, SecretError>> {
        std::env::var(KEY_ENV)
            .ok()
            .map(|text| Self::from_hex(&text, KEY_ENV))
    }

    /// The key from [`KEY_ENV`] when set, else from `file` (see
    /// [`SecretKey::load_file`]).
    pub fn load(file: &Path) -> Result<Self, SecretError> {
        Self::from_env().unwrap_or_else(|| Self::load_file(file))
    }

    /// The key in `file`, created (mode 0600, a fresh key) when missing.
    /// The new key is written to a private temporary file first and then
    /// linked into place, so two processes starting at once end with one
    /// key, and none ever reads a half-written file.
    pub fn load_file(file: &Path) -> Result<Self, SecretError> {
        let io = |source| SecretError::KeyFile {
            path: file.to_path_buf(),
            source,
        };
        if !file.exists() {
            let key = Self::generate();
            let tmp = file.with_extension(format!("tmp-{}", rand::random::<u64>()));
            let written = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)
                .and_then(|mut f| {
                    f.write_all(hex::encode(key.0).as_bytes())?;
                    f.sync_all()
                });
            let linked = written.and_then(|()| std::fs::hard_link(&tmp, file));
            let _ = std::fs::remove_file(&tmp);
            match linked {
                Ok(()) => return Ok(key),
                // Another process made it first: use theirs.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io(e)),
            }
        }
        std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
        let text = std::fs::read_to_string(file).map_err(io)?;
        Self::from_hex(&text, &file.display().to_string())
    }

    /// Seals `plain`, bound to `context` (which must be given again to
    /// open it): `v1:` and the hex of a random nonce and the ciphertext.
    pub fn seal(&self, plain: &str, context: &str) -> String {
        let mut nonce = [0u8; NONCE_LEN];
        rand::rngs::OsRng.fill_bytes(&mut nonce);
        let cipher = Aes256Gcm::new(&self.0);
        // Encryption fails only for inputs beyond AES-GCM's 64 GiB bound;
        // the callers' values are a few KiB.
        let sealed = cipher
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: plain.as_bytes(),
                    aad: context.as_bytes(),
                },
            )
            .unwrap_or_default();
        let mut out = Vec::with_capacity(NONCE_LEN + sealed.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        format!("{VERSION}{}", hex::encode(out))
    }

    /// 32 bytes derived from the key for one `purpose` (HMAC-SHA256 of the
    /// purpose under the key): a secret that must stay the same across
    /// restarts and replicas, as the key does, without being stored
    /// anywhere (the SSH endpoint's host key is made from one). Distinct
    /// purposes give unrelated values, and none reveals the key.
    pub fn derive(&self, purpose: &str) -> [u8; 32] {
        use hmac::Mac as _;
        // HMAC pads a key shorter than the hash's block (64 bytes) with
        // zeros (RFC 2104): padding it here is the same HMAC, without the
        // length check `new_from_slice` would need handled.
        let mut block = [0u8; 64];
        block[..32].copy_from_slice(self.0.as_slice());
        let mut mac = <hmac::Hmac<sha2::Sha256> as hmac::Mac>::new(&block.into());
        mac.update(purpose.as_bytes());
        mac.finalize().into_bytes().into()
    }

    /// Opens what [`SecretKey::seal`] made with the same `context`.
    pub fn open(&self, sealed: &str, context: &str) -> Result<String, SecretError> {
        let bytes = sealed
            .strip_prefix(VERSION)
            .and_then(|h| hex::decode(h).ok())
            .filter(|b| b.len() > NONCE_LEN)
            .ok_or(SecretError::Malformed)?;
        let (nonce, ciphertext) = bytes.split_at(NONCE_LEN);
        let plain = Aes256Gcm::new(&self.0)
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: ciphertext,
                    aad: context.as_bytes(),
                },
            )
            .map_err(|_| SecretError::WrongKey)?;
        String::from_utf8(plain).map_err(|_| SecretError::Malformed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_values_are_stable_per_key_and_purpose() {
        let k = SecretKey::from_hex(&"ab".repeat(32), "test").unwrap();
        let again = SecretKey::from_hex(&"ab".repeat(32), "test").unwrap();
        assert_eq!(k.derive("ssh-host-key"), again.derive("ssh-host-key"));
        assert_ne!(k.derive("ssh-host-key"), k.derive("other"));
        assert_ne!(
            k.derive("ssh-host-key"),
            SecretKey::generate().derive("ssh-host-key")
        );
        // The padded key is the HMAC of the key itself.
        use hmac::Mac as _;
        let mut plain =
            <hmac::Hmac<sha2::Sha256> as hmac::Mac>::new_from_slice(&[0xab; 32]).unwrap();
        plain.update(b"ssh-host-key");
        let want: [u8; 32] = plain.finalize().into_bytes().into();
        assert_eq!(k.derive("ssh-host-key"), want);
    }

    #[test]
    fn sealing_round_trips_and_hides_the_value() {
        let k = SecretKey::generate();
        let s = k.seal("hunter2", "ctx");
        assert!(s.starts_with("v1:") && !s.contains("hunter2"));
        assert_ne!(s, k.seal("hunter2", "ctx"), "a fresh nonce each time");
        assert_eq!(k.open(&s, "ctx").unwrap(), "hunter2");
        assert!(matches!(k.open(&s, "other"), Err(SecretError::WrongKey)));
        assert!(matches!(
            SecretKey::generate().open(&s, "ctx"),
            Err(SecretError::WrongKey)
        ));
        let mut tampered = s.clone();
        tampered.replace_range(s.len() - 2.., if s.ends_with("00") { "11" } else { "00" });
        assert!(matches!(
            k.open(&tampered, "ctx"),
            Err(SecretError::WrongKey)
        ));
        assert!(matches!(
            k.open("hunter2", "ctx"),
            Err(SecretError::Malformed)
        ));
        assert!(matches!(
            k.open("v1:zz", "ctx"),
            Err(SecretError::Malformed)
        ));
    }

    #[test]
    fn the_key_file_is_created_private_once_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("secrets.key");
        let k = SecretKey::load_file(&f).unwrap();
        let mode = std::fs::metadata(&f).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let again = SecretKey::load_file(&f).unwrap();
        assert_eq!(again.open(&k.seal("x", "c"), "c").unwrap(), "x");
        std::fs::write(&f, "not hex").unwrap();
        assert!(matches!(
            SecretKey::load_file(&f),
            Err(SecretError::BadKey { .. })
        ));
        assert!(matches!(
            SecretKey::from_hex(&"ab".repeat(31), "env"),
            Err(SecretError::BadKey { .. })
        ));
        assert!(!format!("{k:?}").contains(&hex::encode(k.0)));
    }
}
