//! The certificate a server presents: from the operator's PEM files, or
//! self-signed, made once and kept in the data directory.

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::{CertifiedKey, SingleCertAndKey};
use rustls::InconsistentKeys;
use tokio::net::TcpListener;

use crate::{provider, Fingerprint, TlsError, TlsListener};

/// The self-signed certificate's file name in its directory (PEM, public).
pub const CERT_FILE: &str = "tls.crt";
/// The self-signed certificate's key file name (PEM, mode 0600).
pub const KEY_FILE: &str = "tls.key";

/// A server's certificate and key, loaded and checked: what an HTTPS
/// listener presents. Cheap to clone.
#[derive(Clone)]
pub struct ServerTls {
    config: Arc<rustls::ServerConfig>,
    leaf: CertificateDer<'static>,
    fingerprint: Fingerprint,
    created: bool,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("fingerprint", &self.fingerprint)
            .field("created", &self.created)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Reads a PEM certificate chain (leaf first) and its PEM private key
    /// (PKCS#8, PKCS#1 or SEC1), and checks that the key is the leaf's.
    /// Each failure names the file: a server refuses to start on it.
    pub fn from_files(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let cert_pem = read(cert, "TLS certificate")?;
        let chain = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid(cert, "TLS certificate", e.to_string()))?;
        let Some(leaf) = chain.first().cloned() else {
            return Err(invalid(
                cert,
                "TLS certificate",
                "no PEM certificate in it".to_string(),
            ));
        };
        let key_pem = read(key, "TLS key")?;
        let key_der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
            invalid(
                key,
                "TLS key",
                format!("no PEM private key in it (PKCS#8, PKCS#1 or SEC1): {e}"),
            )
        })?;
        let provider = provider();
        let signing_key = provider
            .key_provider
            .load_private_key(key_der)
            .map_err(|e| invalid(key, "TLS key", e.to_string()))?;
        let certified = CertifiedKey::new(chain, signing_key);
        match certified.keys_match() {
            // ring reads the public half of every key type it loads, so
            // `Unknown` does not happen; were it to, the handshake itself
            // would fail, so it is not worth refusing over.
            Ok(()) | Err(rustls::Error::InconsistentKeys(InconsistentKeys::Unknown)) => {}
            Err(rustls::Error::InconsistentKeys(InconsistentKeys::KeyMismatch)) => {
                return Err(TlsError::KeyMismatch {
                    cert: cert.to_path_buf(),
                    key: key.to_path_buf(),
                })
            }
            Err(e) => return Err(invalid(cert, "TLS certificate", e.to_string())),
        }
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(SingleCertAndKey::from(certified)));
        // The API and the gateway speak HTTP/1.1.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            config: Arc::new(config),
            fingerprint: Fingerprint::of(&leaf),
            leaf,
            created: false,
        })
    }

    /// The self-signed certificate kept in `dir` ([`CERT_FILE`],
    /// [`KEY_FILE`]): read when both are there, else made now (ECDSA
    /// P-256, valid for `names`, host names or IP addresses) and written,
    /// the key owner-only. A restart thus presents the same certificate
    /// and its pinned fingerprint keeps holding.
    ///
    /// A certificate without its key is an error (what clients pinned
    /// cannot be served any more, and replacing it silently would look
    /// like an attack to them). A key without its certificate is the trace
    /// of a first start that stopped between the two writes (the
    /// certificate is written last): no client can have pinned it, so a
    /// new pair is made.
    pub fn self_signed(dir: &Path, names: &[String]) -> Result<Self, TlsError> {
        let cert = dir.join(CERT_FILE);
        let key = dir.join(KEY_FILE);
        match (cert.exists(), key.exists()) {
            (true, true) => {
                keep_private(&key)?;
                Self::from_files(&cert, &key)
            }
            (true, false) => Err(TlsError::HalfPair {
                present: cert,
                missing: key,
            }),
            (false, key_left) => {
                if key_left {
                    tracing::warn!(key = %key.display(), "a TLS key without its certificate: making a new pair");
                }
                let made = make(names)?;
                std::fs::create_dir_all(dir).map_err(|source| TlsError::Write {
                    path: dir.to_path_buf(),
                    source,
                })?;
                write_file(&key, made.signing_key.serialize_pem().as_bytes(), 0o600)?;
                write_file(&cert, made.cert.pem().as_bytes(), 0o644)?;
                let mut tls = Self::from_files(&cert, &key)?;
                tls.created = true;
                Ok(tls)
            }
        }
    }

    /// The SHA-256 fingerprint of the leaf certificate: what clients pin.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// The leaf certificate, DER.
    pub fn certificate(&self) -> &CertificateDer<'static> {
        &self.leaf
    }

    /// Whether [`ServerTls::self_signed`] made the certificate just now
    /// (clients have not pinned it yet).
    pub fn created(&self) -> bool {
        self.created
    }

    /// The rustls server configuration.
    pub fn config(&self) -> Arc<rustls::ServerConfig> {
        self.config.clone()
    }

    /// An HTTPS listener on `tcp` presenting this certificate.
    pub fn listen(&self, tcp: TcpListener) -> std::io::Result<TlsListener> {
        TlsListener::new(tcp, self.config.clone())
    }
}

fn read(path: &Path, what: &'static str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn invalid(path: &Path, what: &'static str, message: String) -> TlsError {
    TlsError::Invalid {
        what,
        path: path.to_path_buf(),
        message,
    }
}

/// A fresh self-signed certificate for `names`.
fn make(names: &[String]) -> Result<rcgen::CertifiedKey<rcgen::KeyPair>, TlsError> {
    let mut names: Vec<String> = names
        .iter()
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty())
        .collect();
    names.dedup();
    if names.is_empty() {
        names.push("localhost".to_string());
    }
    let signing_key = rcgen::KeyPair::generate()?;
    // `new` files names that parse as IP addresses as IP SANs.
    let mut params = rcgen::CertificateParams::new(names)?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "flotilla self-signed");
    let cert = params.self_signed(&signing_key)?;
    Ok(rcgen::CertifiedKey { cert, signing_key })
}

/// Writes `bytes` to `path` through a temporary sibling renamed over it,
/// so that a crash never leaves a half-written file behind; the mode is
/// set before a byte is written.
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), TlsError> {
    let err = |source| TlsError::Write {
        path: path.to_path_buf(),
        source,
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp: PathBuf = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create(true).truncate(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
            opts.mode(mode);
            let mut f = opts.open(&tmp)?;
            // A stale temporary file keeps its old mode: set it anyway.
            f.set_permissions(std::fs::Permissions::from_mode(mode))?;
            f.write_all(bytes)?;
            f.sync_all()?;
        }
        #[cfg(not(unix))]
        {
            let _ = mode;
            let mut f = opts.open(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        err(e)
    })
}

/// A kept key that group or others may read is made owner-only again
/// (a restore from a backup, a careless `chmod`).
fn keep_private(key: &Path) -> Result<(), TlsError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let err = |source| TlsError::Read {
            what: "TLS key",
            path: key.to_path_buf(),
            source,
        };
        let mode = std::fs::metadata(key).map_err(err)?.permissions().mode();
        if mode & 0o077 != 0 {
            tracing::warn!(key = %key.display(), mode = format!("{:o}", mode & 0o777), "the TLS key was readable by others: made it 0600");
            std::fs::set_permissions(key, std::fs::Permissions::from_mode(0o600)).map_err(
                |source| TlsError::Write {
                    path: key.to_path_buf(),
                    source,
                },
            )?;
        }
    }
    #[cfg(not(unix))]
    let _ = key;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn a_self_signed_pair_is_made_once_then_reused() {
        let dir = tempfile::tempdir().unwrap();
        let names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
        let first = ServerTls::self_signed(dir.path(), &names).unwrap();
        assert!(first.created());
        assert_eq!(mode(&dir.path().join(KEY_FILE)), 0o600);
        assert_eq!(mode(&dir.path().join(CERT_FILE)), 0o644);
        let again = ServerTls::self_signed(dir.path(), &names).unwrap();
        assert!(!again.created());
        assert_eq!(again.fingerprint(), first.fingerprint());
        assert_eq!(again.certificate(), first.certificate());
        // No temporary file is left behind.
        let mut files: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(files, [CERT_FILE, KEY_FILE]);
    }

    #[test]
    fn a_key_opened_up_is_made_private_again() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        ServerTls::self_signed(dir.path(), &[]).unwrap();
        let key = dir.path().join(KEY_FILE);
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        ServerTls::self_signed(dir.path(), &[]).unwrap();
        assert_eq!(mode(&key), 0o600);
    }

    #[test]
    fn half_pairs_are_refused_or_remade() {
        let dir = tempfile::tempdir().unwrap();
        let first = ServerTls::self_signed(dir.path(), &[]).unwrap();
        std::fs::remove_file(dir.path().join(KEY_FILE)).unwrap();
        let e = ServerTls::self_signed(dir.path(), &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tls.crt exists but") && e.contains("tls.key does not"),
            "{e}"
        );
        // A key left alone by an interrupted first start: a new pair.
        std::fs::remove_file(dir.path().join(CERT_FILE)).unwrap();
        std::fs::write(dir.path().join(KEY_FILE), "stale").unwrap();
        let second = ServerTls::self_signed(dir.path(), &[]).unwrap();
        assert!(second.created());
        assert_ne!(second.fingerprint(), first.fingerprint());
    }

    #[test]
    fn unreadable_empty_and_mismatched_files_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        ServerTls::self_signed(&a, &[]).unwrap();
        ServerTls::self_signed(&b, &[]).unwrap();
        let (cert_a, key_a) = (a.join(CERT_FILE), a.join(KEY_FILE));
        let key_b = b.join(KEY_FILE);

        assert!(ServerTls::from_files(&cert_a, &key_a).is_ok());
        let e = ServerTls::from_files(&cert_a, &key_b)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            format!(
                "the TLS key {} does not belong to the certificate {}",
                key_b.display(),
                cert_a.display()
            )
        );
        let missing = dir.path().join("missing.pem");
        let e = ServerTls::from_files(&missing, &key_a)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!(
                "cannot read the TLS certificate {}:",
                missing.display()
            )),
            "{e}"
        );
        let e = ServerTls::from_files(&cert_a, &missing)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("cannot read the TLS key"), "{e}");
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "hello\n").unwrap();
        let e = ServerTls::from_files(&junk, &key_a)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            format!(
                "{} is not a usable TLS certificate: no PEM certificate in it",
                junk.display()
            )
        );
        // The certificate where the key should be.
        let e = ServerTls::from_files(&cert_a, &cert_a)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is not a usable TLS key: no PEM private key"),
            "{e}"
        );
    }
}
