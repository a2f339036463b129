//! One typed method per API route the CLI, the agent and the test kit use:
//! here the caller's identity, SSH keys, an instance's life and logs, and
//! the agent protocol; the other domains have modules of their own
//! (`billing`, `endpoints`, `instances`, `jobs`, `nodes`, `registries`,
//! `tenants`). Callers outside this crate name no path: a route without a
//! method gets one, rather than a path string handed to the generic verbs
//! ([`Client::get`], [`Client::post`], [`Client::list`], …).

use std::time::Duration;

use flotilla_core::api::{
    Instance, LogBatch, LogLine, Me, Page, RegisterNode, Registered, SyncRequest, SyncResponse,
};
use flotilla_core::id::{InstanceId, NodeId, SshKeyId};
use flotilla_core::instance::CreateInstance;
use flotilla_core::ssh_key::{CreateSshKey, SshKey};
use reqwest::Method;

use crate::client::{Call, Client, LOG_PAGE_SIZE};
use crate::logs::LogFollow;
use crate::Result;

/// Slack on top of a long-poll's wait before the request is given up.
/// How much longer than its `wait_ms` a long-poll sync may take before it
/// counts as unanswered.
pub const LONG_POLL_SLACK: Duration = Duration::from_secs(15);
/// Time for an agent call that is not a long-poll.
const AGENT_TIMEOUT: Duration = Duration::from_secs(15);

impl Client {
    /// `GET /v1/history/demand`: the work submitted in `[from, to)` and the
    /// pool's machines (operators), for `flotilla simulate --from-history`.
    pub async fn demand_history(
        &self,
        from: chrono::DateTime<chrono::Utc>,
        to: chrono::DateTime<chrono::Utc>,
    ) -> Result<flotilla_core::history::DemandHistory> {
        let q = [
            (
                "from",
                from.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            ),
            (
                "to",
                to.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            ),
        ];
        self.get("/v1/history/demand", &q).await
    }

    /// `GET /v1/me`: who the key is.
    pub async fn me(&self) -> Result<Me> {
        self.get("/v1/me", &[]).await
    }

    /// `GET /v1/ssh-keys`: the tenant's registered SSH keys.
    pub async fn ssh_keys(&self) -> Result<Vec<SshKey>> {
        let page: Page<SshKey> = self.get("/v1/ssh-keys", &[]).await?;
        Ok(page.items)
    }

    /// `POST /v1/ssh-keys`: registers a public key for `flotilla ssh`.
    pub async fn add_ssh_key(&self, req: &CreateSshKey) -> Result<SshKey> {
        self.post("/v1/ssh-keys", req).await
    }

    /// `DELETE /v1/ssh-keys/{id}`.
    pub async fn remove_ssh_key(&self, id: &SshKeyId) -> Result<()> {
        self.delete(&format!("/v1/ssh-keys/{id}")).await
    }

    /// `GET /v1/instances/{id}`.
    pub async fn instance(&self, id: &str) -> Result<Instance> {
        self.get(&format!("/v1/instances/{id}"), &[]).await
    }

    /// `POST /v1/instances`.
    pub async fn create_instance(&self, req: &CreateInstance) -> Result<Instance> {
        self.post("/v1/instances", req).await
    }

    /// `POST /v1/instances/{id}/stop`.
    pub async fn stop_instance(&self, id: &str) -> Result<Instance> {
        self.post(&format!("/v1/instances/{id}/stop"), &serde_json::Map::new())
            .await
    }

    /// One page of an instance's log from `since`.
    pub async fn logs_page(&self, id: &str, since: u64) -> Result<Page<LogLine>> {
        let q = [
            ("since", since.to_string()),
            ("limit", LOG_PAGE_SIZE.to_string()),
        ];
        self.get(&format!("/v1/instances/{id}/logs"), &q).await
    }

    /// Every log line from `since` on that the server has now.
    pub async fn logs_all(&self, id: &str, mut since: u64) -> Result<Vec<LogLine>> {
        let mut lines = Vec::new();
        loop {
            let page = self.logs_page(id, since).await?;
            let before = since;
            for l in page.items {
                if l.seq >= since {
                    since = l.seq + 1;
                    lines.push(l);
                }
            }
            let cursor = page.next_cursor.and_then(|c| c.parse::<u64>().ok());
            match cursor {
                Some(c) if since > before => since = since.max(c),
                _ => break,
            }
        }
        Ok(lines)
    }

    /// Opens the follow stream of an instance's log from `since`.
    pub async fn follow_logs(&self, id: &str, since: u64) -> Result<LogFollow> {
        let path = format!("/v1/instances/{id}/logs");
        let query = [("since", since.to_string()), ("follow", "true".to_string())];
        let mut call = Call::new(Method::GET, &path);
        call.query = &query;
        call.accept = "application/x-ndjson";
        // The stream lasts as long as the instance runs.
        call.unbounded = true;
        let resp = self.send(&call).await?;
        let server = resp.url().origin().ascii_serialization();
        let ndjson = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("ndjson"));
        if ndjson {
            return Ok(LogFollow::streaming(server, resp));
        }
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| crate::Error::from_reqwest(&server, &e))?;
        let page: Page<LogLine> =
            serde_json::from_slice(&bytes).map_err(|source| crate::Error::Decode { source })?;
        Ok(LogFollow::page(server, page.items))
    }

    // ---- Agent protocol ---------------------------------------------------

    /// `POST /v1/agent/join`: trades a node-pool machine's one-time join
    /// token for its agent key (the client's own key is not used). Sent
    /// once, never retried: a retry of a join the server took would find
    /// the token spent.
    pub async fn join_node(&self, token: &str) -> Result<flotilla_core::nodepool::Joined> {
        let mut call = Call::new(Method::POST, "/v1/agent/join");
        call.body = Some(
            serde_json::to_vec(&flotilla_core::nodepool::JoinNode {
                token: token.to_string(),
            })
            .map_err(|e| crate::Error::Config {
                field: "body",
                message: format!("cannot encode the request: {e}"),
            })?,
        );
        call.idempotent = false;
        call.timeout = Some(AGENT_TIMEOUT);
        self.json(&call).await
    }

    /// `POST /v1/agent/register`.
    pub async fn register_node(&self, node: &RegisterNode) -> Result<Registered> {
        self.post_agent(crate::paths::AGENT_REGISTER, node, Some(AGENT_TIMEOUT))
            .await
    }

    /// `POST /v1/agent/nodes/{node_id}/sync`; the server may hold the answer
    /// up to `req.wait_ms`.
    pub async fn sync_node(&self, node_id: &NodeId, req: &SyncRequest) -> Result<SyncResponse> {
        let timeout = Duration::from_millis(req.wait_ms) + LONG_POLL_SLACK;
        self.sync_node_within(node_id, req, timeout).await
    }

    /// [`Client::sync_node`], given up after `timeout` (a transport error
    /// that sends the next call to the next server): a server that
    /// accepted the connection but stopped answering must not hold an
    /// agent past its node lease.
    pub async fn sync_node_within(
        &self,
        node_id: &NodeId,
        req: &SyncRequest,
        timeout: Duration,
    ) -> Result<SyncResponse> {
        let path = crate::paths::agent_sync(node_id.as_str());
        self.post_agent(&path, req, Some(timeout)).await
    }

    /// `POST /v1/agent/instances/{instance_id}/logs`; lines the server
    /// already has are ignored, so a batch may be resent.
    pub async fn push_logs(&self, instance_id: &InstanceId, lines: Vec<LogLine>) -> Result<()> {
        let path = format!("/v1/agent/instances/{instance_id}/logs");
        let _: serde_json::Value = self
            .post_agent(&path, &LogBatch { lines }, Some(AGENT_TIMEOUT))
            .await?;
        Ok(())
    }
}
