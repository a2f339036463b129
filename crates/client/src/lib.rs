//! The typed HTTP client of Flotilla's API, used by the CLI, the node agent,
//! the test kit and the web console (in-process, see [`InProcess`]), so
//! that every caller of the API speaks it the same way:
//!
//! - requests and answers are the API's own types (`flotilla_core::api`),
//!   the ones the server serialises, so client and server cannot drift;
//! - every failure is one [`Error`]: the server's error body decoded
//!   (status, code, message and the offending field), a transport failure,
//!   or an answer that does not decode;
//! - one [`RetryPolicy`]: idempotent requests (GET, PUT, DELETE, and POSTs
//!   that carry an `Idempotency-Key`, which this client adds to every POST
//!   it makes) are retried with backoff on connection errors, 5xx and 429,
//!   never sooner than a `Retry-After` asks;
//! - failover: a client holds one or more server URLs (replicas of the
//!   control plane); a request that cannot connect, or is answered 503, is
//!   tried on the next URL, and the URL that answered is remembered for the
//!   next request.
//!
//! - TLS: `https://` URLs are verified by the [`Trust`] given to the
//!   [`Builder`]: the system's roots, a CA file, or a pinned certificate
//!   fingerprint; a failed verification is [`Error::Tls`], never retried.
//!
//! This crate never prints, never reads the process environment and never
//! decides what an error means for the caller's work; it only says what
//! happened ([`Error::is_transient`] and friends help the caller choose).

mod access;
mod billing;
mod client;
mod endpoints;
mod error;
mod in_process;
mod instances;
mod jobs;
mod logs;
mod nodes;
mod offers;
pub mod paths;
mod registries;
mod retry;
mod routes;
mod tenants;

pub use access::{Session, SessionReceiver, SessionSender, Tunnel, TunnelReceiver, TunnelSender};
pub use billing::{ReconcileQuery, UsageRange};
pub use client::{idempotency_key, parse_servers, Builder, Client, LOG_PAGE_SIZE, PAGE_SIZE};
pub use error::{Error, TransportKind};
/// Server trust for `https://` URLs, and the fingerprints pinned in it.
pub use flotilla_tls::{Fingerprint, Trust};
pub use in_process::{InProcess, IN_PROCESS_URL};
pub use logs::LogFollow;
pub use retry::RetryPolicy;
pub use routes::LONG_POLL_SLACK;

/// The result of a client call.
pub type Result<T, E = Error> = std::result::Result<T, E>;
