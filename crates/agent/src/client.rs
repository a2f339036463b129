//! HTTP client of the agent protocol: registration, the long-poll sync and
//! log upload, with the bearer key on every call and the server's JSON error
//! body decoded into [`ClientError`].
//!
//! This module must never retry, sleep or decide what an error means for
//! the agent's work: it makes one request and says how it went
//! ([`ClientError::is_retryable`] helps the caller choose). It never panics
//! on a malformed answer.
//!
//! Several servers (replicas on one database) may be given, comma
//! separated: each call goes to the current one, and a call that cannot
//! reach it, or gets a 5xx, moves the next call on to the following URL.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flotilla_core::api::{
    ErrorBody, LogBatch, LogLine, RegisterNode, Registered, SyncRequest, SyncResponse,
};
use flotilla_core::id::{InstanceId, NodeId};
use reqwest::StatusCode;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Time to establish a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for a request that is not a long-poll.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// Slack on top of the long-poll wait before a sync is given up.
pub const LONG_POLL_SLACK: Duration = Duration::from_secs(15);

/// A failed call.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server could not be reached, or the connection broke.
    #[error("server unreachable: {0}")]
    Transport(#[source] reqwest::Error),
    /// The server answered with an error status.
    #[error("server answered {status}: {code}: {message}")]
    Status {
        /// HTTP status.
        status: StatusCode,
        /// The error code of the body (`not_found`, …), or empty.
        code: String,
        /// The message of the body, or the start of a non-JSON body.
        message: String,
    },
    /// The server answered 2xx with a body that does not decode.
    #[error("malformed answer from the server: {0}")]
    Decode(#[source] serde_json::Error),
    /// The client could not be built (bad TLS setup).
    #[error("cannot build http client: {0}")]
    Build(#[source] reqwest::Error),
}

impl ClientError {
    /// Worth retrying later: transport errors, 5xx, 408, 429, malformed
    /// answers, and 401/403 (a key may be fixed on the server side without
    /// restarting the agent).
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Transport(_) | Self::Decode(_) => true,
            Self::Status { status, .. } => {
                status.is_server_error()
                    || matches!(
                        *status,
                        StatusCode::REQUEST_TIMEOUT
                            | StatusCode::TOO_MANY_REQUESTS
                            | StatusCode::UNAUTHORIZED
                            | StatusCode::FORBIDDEN
                    )
            }
            Self::Build(_) => false,
        }
    }

    /// The server does not know the resource (node or instance).
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::Status { status, .. } if *status == StatusCode::NOT_FOUND)
    }

    /// The server refused the key.
    pub fn is_auth(&self) -> bool {
        matches!(self, Self::Status { status, .. }
            if *status == StatusCode::UNAUTHORIZED || *status == StatusCode::FORBIDDEN)
    }
}

/// A client of one Flotilla server, or of several replicas of one.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    /// Base URLs, without `/v1`; never empty.
    bases: Arc<Vec<String>>,
    /// Index into `bases` of the server calls go to now (shared by clones,
    /// so the log shipper follows the sync loop's failover).
    current: Arc<AtomicUsize>,
    token: String,
}

/// `url` without surrounding blanks, a trailing `/` or `/v1`.
fn normalise(url: &str) -> String {
    let trimmed = url.trim().trim_end_matches('/');
    trimmed.strip_suffix("/v1").unwrap_or(trimmed).to_string()
}

impl Client {
    /// A client of `server_url` (e.g. `http://127.0.0.1:7420`; a trailing
    /// `/` or `/v1` is tolerated; several comma-separated URLs are replicas
    /// to fail over between) authenticating with `token`.
    pub fn new(server_url: &str, token: &str) -> Result<Self, ClientError> {
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .user_agent(concat!("flotilla-agent/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(ClientError::Build)?;
        let mut bases: Vec<String> = server_url
            .split(',')
            .map(normalise)
            .filter(|b| !b.is_empty())
            .collect();
        if bases.is_empty() {
            bases.push(normalise(server_url));
        }
        Ok(Self {
            http,
            bases: Arc::new(bases),
            current: Arc::new(AtomicUsize::new(0)),
            token: token.to_string(),
        })
    }

    /// The base URL calls go to now, without `/v1`.
    pub fn base_url(&self) -> &str {
        let i = self.current.load(Ordering::Relaxed) % self.bases.len();
        &self.bases[i]
    }

    /// Every server URL, in failover order.
    pub fn base_urls(&self) -> &[String] {
        &self.bases
    }

    /// The server at `base` failed a call: the next call goes to the
    /// following one (unless another call moved on already).
    fn fail_over(&self, base: &str) {
        let n = self.bases.len();
        if n < 2 {
            return;
        }
        let i = self.current.load(Ordering::Relaxed) % n;
        if self.bases[i] == base {
            let _ =
                self.current
                    .compare_exchange(i, (i + 1) % n, Ordering::Relaxed, Ordering::Relaxed);
            tracing::info!(from = %base, to = %self.bases[(i + 1) % n], "server unreachable, failing over");
        }
    }

    /// `POST /v1/agent/register`.
    pub async fn register(&self, node: &RegisterNode) -> Result<Registered, ClientError> {
        let resp = self
            .post("/v1/agent/register", node, REQUEST_TIMEOUT)
            .await?;
        decode(resp).await
    }

    /// `POST /v1/agent/nodes/{node_id}/sync`; the server may hold the answer
    /// up to `req.wait_ms`.
    pub async fn sync(
        &self,
        node_id: &NodeId,
        req: &SyncRequest,
    ) -> Result<SyncResponse, ClientError> {
        let timeout = Duration::from_millis(req.wait_ms) + LONG_POLL_SLACK;
        self.sync_within(node_id, req, timeout).await
    }

    /// [`Client::sync`], given up (a transport error, which moves the next
    /// call to the next server) after `timeout`: a server that accepted
    /// the connection but stopped answering must not hold the agent past
    /// its node lease.
    pub async fn sync_within(
        &self,
        node_id: &NodeId,
        req: &SyncRequest,
        timeout: Duration,
    ) -> Result<SyncResponse, ClientError> {
        let path = format!("/v1/agent/nodes/{node_id}/sync");
        let resp = self.post(&path, req, timeout).await?;
        decode(resp).await
    }

    /// `POST /v1/agent/instances/{instance_id}/logs`.
    pub async fn push_logs(
        &self,
        instance_id: &InstanceId,
        lines: Vec<LogLine>,
    ) -> Result<(), ClientError> {
        let path = format!("/v1/agent/instances/{instance_id}/logs");
        self.post(&path, &LogBatch { lines }, REQUEST_TIMEOUT)
            .await?;
        Ok(())
    }

    /// Sends a JSON POST; a non-2xx answer becomes [`ClientError::Status`].
    async fn post<B: Serialize + ?Sized>(
        &self,
        path: &str,
        body: &B,
        timeout: Duration,
    ) -> Result<reqwest::Response, ClientError> {
        let base = self.base_url().to_string();
        let sent = self
            .http
            .post(format!("{base}{path}"))
            .bearer_auth(&self.token)
            .timeout(timeout)
            .json(body)
            .send()
            .await;
        let resp = match sent {
            Ok(resp) => resp,
            Err(e) => {
                self.fail_over(&base);
                return Err(ClientError::Transport(e));
            }
        };
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        if status.is_server_error() {
            self.fail_over(&base);
        }
        let bytes = resp.bytes().await.unwrap_or_default();
        Err(match serde_json::from_slice::<ErrorBody>(&bytes) {
            Ok(body) => ClientError::Status {
                status,
                code: body.error.code,
                message: body.error.message,
            },
            Err(_) => ClientError::Status {
                status,
                code: String::new(),
                message: String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned(),
            },
        })
    }
}

async fn decode<T: DeserializeOwned>(resp: reqwest::Response) -> Result<T, ClientError> {
    let bytes = resp.bytes().await.map_err(ClientError::Transport)?;
    serde_json::from_slice(&bytes).map_err(ClientError::Decode)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_url_is_normalised() {
        for url in [
            "http://h:1",
            "http://h:1/",
            "http://h:1/v1",
            "http://h:1/v1/",
        ] {
            assert_eq!(Client::new(url, "t").unwrap().base_url(), "http://h:1");
        }
    }

    #[test]
    fn several_urls_fail_over_in_turn() {
        let c = Client::new("http://a:1/v1, http://b:2/ ,http://c:3", "t").unwrap();
        assert_eq!(c.base_urls(), ["http://a:1", "http://b:2", "http://c:3"]);
        assert_eq!(c.base_url(), "http://a:1");
        let shipper = c.clone();
        c.fail_over("http://a:1");
        // Clones follow; a late failure report about a server already left
        // behind does not move on twice.
        assert_eq!(shipper.base_url(), "http://b:2");
        shipper.fail_over("http://a:1");
        assert_eq!(c.base_url(), "http://b:2");
        c.fail_over("http://b:2");
        c.fail_over("http://c:3");
        assert_eq!(c.base_url(), "http://a:1");
        let one = Client::new("http://a:1", "t").unwrap();
        one.fail_over("http://a:1");
        assert_eq!(one.base_url(), "http://a:1");
    }

    #[test]
    fn retry_policy_follows_status() {
        let err = |s: u16| ClientError::Status {
            status: StatusCode::from_u16(s).unwrap(),
            code: String::new(),
            message: String::new(),
        };
        assert!(err(503).is_retryable());
        assert!(err(429).is_retryable());
        assert!(err(401).is_retryable() && err(401).is_auth());
        assert!(!err(400).is_retryable());
        assert!(!err(404).is_retryable() && err(404).is_not_found());
        assert!(!err(422).is_retryable());
    }
}
