//! The agent's side of the agent protocol (registration, the long-poll
//! sync and log upload) over `flotilla-client`, the one client of the API:
//! its error type, and failover across the server URLs the agent was given
//! (several control-plane replicas, comma-separated).
//!
//! This module must never retry, sleep or decide what an error means for
//! the agent's work: the client is built without retries (the agent's
//! loops back off themselves, and stacking two backoffs would only slow
//! recovery), each call is one try (on every server URL in turn while one
//! cannot be reached or answers 503), and [`Retryable::is_retryable`] helps
//! the caller choose. It never panics on a malformed answer.

use flotilla_client::RetryPolicy;
/// How much longer than its `wait_ms` a long-poll sync may take.
pub use flotilla_client::LONG_POLL_SLACK;
use flotilla_core::api::{LogLine, RegisterNode, Registered, SyncRequest, SyncResponse};
use flotilla_core::id::{InstanceId, NodeId};

/// A failed call: `flotilla-client`'s one error type.
pub use flotilla_client::Error as ClientError;

/// The agent's reading of a failed call.
pub trait Retryable {
    /// Worth retrying later: transport errors, 5xx, 408, 429, malformed
    /// answers, and 401/403 (a key may be fixed on the server side without
    /// restarting the agent).
    fn is_retryable(&self) -> bool;
}

impl Retryable for ClientError {
    fn is_retryable(&self) -> bool {
        match self {
            Self::Decode { .. } => true,
            Self::Config { .. } => false,
            // A certificate the agent does not trust: the server's may be
            // restored without restarting the agent, and a log line must
            // not be given up over it. The first registration fails at
            // once on it instead (`Agent::register`).
            Self::Tls { .. } => true,
            e => e.is_transient() || e.is_auth(),
        }
    }
}

/// A client of the Flotilla servers the agent reports to.
#[derive(Debug, Clone)]
pub struct Client(flotilla_client::Client);

impl Client {
    /// A client of `server_urls` (one URL, or several comma-separated, e.g.
    /// `http://10.0.0.1:7420,http://10.0.0.2:7420`; a trailing `/` or `/v1`
    /// is tolerated) authenticating with `token`.
    pub fn new(server_urls: &str, token: &str) -> Result<Self, ClientError> {
        Self::with_trust(server_urls, token, flotilla_client::Trust::System)
    }

    /// [`Client::new`], trusting `https://` servers by `trust`.
    pub fn with_trust(
        server_urls: &str,
        token: &str,
        trust: flotilla_client::Trust,
    ) -> Result<Self, ClientError> {
        flotilla_client::Client::builder(server_urls, token)
            .trust(trust)
            .retry(RetryPolicy::none())
            .user_agent(concat!("flotilla-agent/", env!("CARGO_PKG_VERSION")))
            .build()
            .map(Self)
    }

    /// The same servers and connection pool with another key: the nodes of
    /// a simulated fleet ([`crate::fleet`]) each send their own.
    pub fn with_token(&self, token: &str) -> Self {
        Self(self.0.with_token(token))
    }

    /// The server that answered last, without `/v1`.
    pub fn base_url(&self) -> &str {
        self.0.current_server()
    }

    /// `POST /v1/agent/register`.
    pub async fn register(&self, node: &RegisterNode) -> Result<Registered, ClientError> {
        self.0.register_node(node).await
    }

    /// `POST /v1/agent/nodes/{node_id}/sync`; the server may hold the answer
    /// up to `req.wait_ms`.
    pub async fn sync(
        &self,
        node_id: &NodeId,
        req: &SyncRequest,
    ) -> Result<SyncResponse, ClientError> {
        self.0.sync_node(node_id, req).await
    }

    /// [`Client::sync`], given up after `timeout`; the next call then goes
    /// to the next server URL. Under a node lease the agent bounds every
    /// sync so that a server that stopped answering cannot hold it past
    /// the lease.
    pub async fn sync_within(
        &self,
        node_id: &NodeId,
        req: &SyncRequest,
        timeout: std::time::Duration,
    ) -> Result<SyncResponse, ClientError> {
        self.0.sync_node_within(node_id, req, timeout).await
    }

    /// The agent's end of a session into an instance its sync listed.
    pub async fn attach_session(
        &self,
        node_id: &NodeId,
        session_id: &flotilla_core::id::AccessSessionId,
    ) -> Result<flotilla_client::Session, ClientError> {
        self.0.attach_session(node_id, session_id).await
    }

    /// Every server URL, normalised, in the order given.
    pub fn base_urls(&self) -> &[String] {
        self.0.servers()
    }

    /// `POST /v1/agent/instances/{instance_id}/logs`.
    pub async fn push_logs(
        &self,
        instance_id: &InstanceId,
        lines: Vec<LogLine>,
    ) -> Result<(), ClientError> {
        self.0.push_logs(instance_id, lines).await
    }
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
            " http://h:1/v1/ , http://h:2",
        ] {
            assert_eq!(Client::new(url, "t").unwrap().base_url(), "http://h:1");
        }
    }

    #[test]
    fn retry_policy_follows_status() {
        let err = |s: u16| ClientError::Api {
            status: s,
            code: String::new(),
            message: String::new(),
            field: None,
            retry_after: None,
        };
        assert!(err(503).is_retryable());
        assert!(err(429).is_retryable());
        assert!(err(401).is_retryable() && err(401).is_auth());
        assert!(!err(400).is_retryable());
        assert!(!err(404).is_retryable() && err(404).is_not_found());
        assert!(!err(422).is_retryable());
    }
}
