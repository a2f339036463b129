//! The crate's one error type: every variant names the file or the input
//! at fault, so a server refusing to start says which flag to fix.

use std::path::PathBuf;

/// Why a certificate, key, fingerprint or trust setting could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read (missing, unreadable).
    #[error("cannot read the {what} {}: {source}", path.display())]
    Read {
        /// `TLS certificate`, `TLS key` or `CA certificate`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file could not be written (self-signed certificate and key).
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file was read but holds nothing usable of what was expected.
    #[error("{} is not a usable {what}: {message}", path.display())]
    Invalid {
        /// `TLS certificate`, `TLS key` or `CA certificate`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The key is not the certificate's.
    #[error("the TLS key {} does not belong to the certificate {}", key.display(), cert.display())]
    KeyMismatch {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
    },
    /// Of a self-signed pair in the data directory only one file exists:
    /// making a new pair would silently replace what clients pinned.
    #[error("{} exists but {} does not: restore it, or remove both to make a new self-signed certificate (clients must then pin the new fingerprint)", present.display(), missing.display())]
    HalfPair {
        /// The file that is there.
        present: PathBuf,
        /// The file that is missing.
        missing: PathBuf,
    },
    /// A fingerprint that does not parse.
    #[error("invalid TLS fingerprint `{input}`: {message}")]
    Fingerprint {
        /// What was given.
        input: String,
        /// What is wrong with it.
        message: String,
    },
    /// The system has no root certificates to trust.
    #[error("no system root certificates found: install them (ca-certificates), or pass --ca-cert FILE or --tls-fingerprint sha256:…")]
    NoSystemRoots,
    /// Making the self-signed certificate failed.
    #[error("cannot make a self-signed certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// rustls refused the configuration.
    #[error("TLS set-up failed: {0}")]
    Rustls(#[from] rustls::Error),
}
