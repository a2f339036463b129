//! TLS for Flotilla's HTTP surfaces (the API server and the gateway), and
//! the trust a client places in them. One crate owns it so that the server,
//! the gateway, the CLI, the agent and the executors speak one dialect:
//!
//! - [`ServerTls`]: the certificate a server presents, read from PEM files
//!   (`--tls-cert`/`--tls-key`) or made self-signed at first start and kept
//!   in the data directory (key file mode 0600), so a restart presents the
//!   same certificate and clients' pins keep holding;
//! - [`TlsListener`]: accepts TCP connections and completes TLS handshakes
//!   concurrently (a slow or silent client holds up no other), answering a
//!   plain-HTTP request with a plain 400 that says to use `https://`;
//! - [`Trust`]: how a client decides to believe a server: the system's root
//!   certificates, a CA file, or a [`Fingerprint`] pinned to exactly one
//!   leaf certificate (names and dates are not consulted, the handshake
//!   signature still is), failing with both fingerprints named.
//!
//! Everything uses rustls with the ring provider, the stack reqwest and
//! sqlx already use here. This crate never decides *whether* to use TLS
//! (the binaries' flags do), never prints, and never reads the process
//! environment.

mod error;
mod explain;
mod fingerprint;
mod listener;
mod server;
mod trust;

pub use error::TlsError;
pub use explain::{explain, find};
pub use fingerprint::{Fingerprint, PinMismatch};
pub use listener::{TlsListener, HANDSHAKE_TIMEOUT};
pub use server::{ServerTls, CERT_FILE, KEY_FILE};
pub use trust::{PinnedVerifier, Trust};

/// A server's TLS stream, as [`TlsListener::accept`] yields it.
pub use tokio_rustls::server::TlsStream;

/// The crypto provider every configuration here is built with: ring, the
/// one the rest of the workspace's rustls users compile in. Naming it
/// explicitly keeps a process-wide default (or its absence) from deciding.
pub(crate) fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}
