//! The executor bridge: makes every node of a cluster engine a Flotilla
//! node, speaking the agent protocol on its behalf.
//!
//! For each node the [`Executor`] reports, the bridge registers it
//! (`POST /v1/agent/register`, `executor` set) and runs the agent's loop:
//! observe the engine → ship new output → sync (observed state up, the
//! node's full assignment list down, long-polled) → apply the assignments
//! to the engine. Scheduling, metering, stops and preemption therefore
//! stay in the server, unchanged: to the server an engine's node is a node.
//!
//! Like the agent, the bridge never reports an instance as ended before
//! the server accepted all its output, and never reports an end the
//! server has not seen begin (an instance the engine started and finished
//! between two syncs is reported running first, at the engine's start
//! time), so the server meters the engine's own start and end times. Past
//! the node lease without a successful sync it cancels the node's work
//! (an empty assignment list), because the server then restarts it
//! elsewhere: a job must never run twice.
//!
//! The bridge must never decide what runs: it only carries the server's
//! decisions to the engine and the engine's facts to the server.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use flotilla_client::RetryPolicy;
use flotilla_core::api::{
    Assignment, ObservedInstance, ObservedPhase, RegisterNode, Registered, SyncRequest,
};
use flotilla_core::id::{InstanceId, NodeId};
use tokio::time::Instant;

use crate::{Executor, ExecutorError};

/// First retry delay after a failed call.
const BACKOFF_MIN: Duration = Duration::from_millis(250);
/// Longest retry delay.
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Log lines per upload.
const LOG_BATCH: usize = 1_000;
/// Least time between two rounds of one node, so an engine or server that
/// answers at once cannot spin the loop.
const MIN_ROUND_SPACING: Duration = Duration::from_millis(200);

/// Why the bridge stopped.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// The server URL or key cannot be used at all.
    #[error("bad server configuration: {0}")]
    Config(String),
    /// The server refused a registration for good (bad key, invalid node).
    #[error("the server refused node `{node}`: {message}")]
    Refused {
        /// The node.
        node: String,
        /// What the server said.
        message: String,
    },
}

/// How the bridge reaches the server.
#[derive(Clone)]
pub struct BridgeConfig {
    /// The server, or several replicas comma-separated.
    pub server_url: String,
    /// A provider or operator key.
    pub token: String,
    /// Long-poll wait asked for each sync, in milliseconds; short, so the
    /// engine's changes (a job ended) reach the server soon.
    pub sync_wait_ms: u64,
    /// How often the engine's node list is read again for new nodes.
    pub inventory_interval: Duration,
    /// Which certificates an `https://` server may present (default: the
    /// system's roots).
    pub trust: flotilla_client::Trust,
}

impl std::fmt::Debug for BridgeConfig {
    /// Never prints the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BridgeConfig")
            .field("server_url", &self.server_url)
            .field("token", &"<redacted>")
            .field("sync_wait_ms", &self.sync_wait_ms)
            .field("inventory_interval", &self.inventory_interval)
            .field("trust", &self.trust)
            .finish()
    }
}

impl BridgeConfig {
    /// A configuration with a 2 s long-poll and a 30 s inventory refresh.
    pub fn new(server_url: impl Into<String>, token: impl Into<String>) -> Self {
        Self {
            server_url: server_url.into(),
            token: token.into(),
            sync_wait_ms: 2_000,
            inventory_interval: Duration::from_secs(30),
            trust: flotilla_client::Trust::System,
        }
    }
}

fn backoff(failures: u32) -> Duration {
    BACKOFF_MIN
        .saturating_mul(2u32.saturating_pow(failures.min(8)))
        .min(BACKOFF_MAX)
}

/// Runs the bridge until `shutdown` resolves: registers every node the
/// executor reports (again each `inventory_interval`, for nodes that
/// appear) and runs one loop per node. Returns an error only when the
/// server refuses the configuration for good; an unreachable engine or
/// server is waited for.
pub async fn run(
    executor: Arc<dyn Executor>,
    config: BridgeConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), BridgeError> {
    let client = flotilla_client::Client::builder(&config.server_url, &config.token)
        .trust(config.trust.clone())
        .retry(RetryPolicy::none())
        .user_agent(concat!("flotilla-bridge/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| BridgeError::Config(e.to_string()))?;
    let (fatal_tx, mut fatal_rx) = tokio::sync::mpsc::channel::<BridgeError>(4);
    let mut loops: HashMap<String, tokio::task::JoinHandle<()>> = HashMap::new();
    tokio::pin!(shutdown);
    let mut failures = 0u32;
    loop {
        let next = match executor.inventory().await {
            Ok(nodes) => {
                failures = 0;
                for node in nodes {
                    if loops.get(&node.name).is_some_and(|h| !h.is_finished()) {
                        continue;
                    }
                    tracing::info!(node = %node.name, gpus = node.gpus.len(), engine = %executor.kind(), "bridging node");
                    let name = node.name.clone();
                    let l = NodeLoop {
                        executor: executor.clone(),
                        client: client.clone(),
                        config: config.clone(),
                        registration: node,
                        fatal: fatal_tx.clone(),
                    };
                    loops.insert(name, tokio::spawn(l.run()));
                }
                config.inventory_interval
            }
            Err(error) => {
                failures += 1;
                tracing::warn!(%error, "engine inventory failed");
                backoff(failures)
            }
        };
        tokio::select! {
            () = &mut shutdown => break,
            Some(e) = fatal_rx.recv() => {
                for h in loops.values() { h.abort(); }
                return Err(e);
            }
            () = tokio::time::sleep(next) => {}
        }
    }
    for h in loops.values() {
        h.abort();
    }
    Ok(())
}

/// What the bridge tracks of one instance on its node.
#[derive(Debug, Default)]
struct Tracked {
    /// Next log seq to ship.
    shipped: u64,
    /// The server accepted a sync that reported it running (or it never
    /// ran): its end may be reported.
    running_reported: bool,
    /// When the engine said it started, once seen running.
    started: Option<chrono::DateTime<chrono::Utc>>,
}

struct NodeLoop {
    executor: Arc<dyn Executor>,
    client: flotilla_client::Client,
    config: BridgeConfig,
    registration: RegisterNode,
    fatal: tokio::sync::mpsc::Sender<BridgeError>,
}

impl NodeLoop {
    async fn register(&mut self) -> Registered {
        let mut failures = 0u32;
        loop {
            // What still runs there, so the server keeps it.
            if let Ok(obs) = self.executor.observe(&self.registration.name).await {
                self.registration.running = obs
                    .iter()
                    .filter(|o| {
                        matches!(
                            o.phase,
                            ObservedPhase::Running { .. } | ObservedPhase::Starting
                        )
                    })
                    .map(|o| o.instance_id.clone())
                    .collect();
            }
            match self.client.register_node(&self.registration).await {
                Ok(r) => {
                    tracing::info!(node = %self.registration.name, node_id = %r.node_id, "node registered");
                    return r;
                }
                Err(e) if !e.is_transient() && !e.is_auth() => {
                    let _ = self
                        .fatal
                        .send(BridgeError::Refused {
                            node: self.registration.name.clone(),
                            message: e.to_string(),
                        })
                        .await;
                    // The bridge ends; wait to be aborted.
                    std::future::pending::<()>().await;
                }
                Err(error) => {
                    failures += 1;
                    tracing::warn!(node = %self.registration.name, %error, "registration failed; retrying");
                    tokio::time::sleep(backoff(failures)).await;
                }
            }
        }
    }

    async fn run(mut self) {
        let node = self.registration.name.clone();
        let mut reg = self.register().await;
        let mut tracked: HashMap<InstanceId, Tracked> = HashMap::new();
        // The server's last list for this node; `None` until the first
        // answer (nothing is cancelled as an orphan before it).
        let mut assigned: Option<Vec<Assignment>> = None;
        let mut last_ok = Instant::now();
        let mut lease = reg.lease_ms.filter(|m| *m > 0).map(Duration::from_millis);
        let mut failures = 0u32;
        loop {
            let round = Instant::now();
            match self
                .round(&node, &reg.node_id, &mut tracked, &mut assigned)
                .await
            {
                Ok(Round::Synced { lease_ms }) => {
                    failures = 0;
                    last_ok = Instant::now();
                    lease = lease_ms
                        .filter(|m| *m > 0)
                        .map(Duration::from_millis)
                        .or(lease);
                }
                Ok(Round::Reregister) => {
                    tracing::warn!(node = %node, "the server forgot the node; registering again");
                    reg = self.register().await;
                    tracked.clear();
                    assigned = None;
                    last_ok = Instant::now();
                    continue;
                }
                Err(error) => {
                    failures += 1;
                    tracing::warn!(node = %node, %error, "bridge round failed");
                    if let Some(lease) = lease {
                        if last_ok.elapsed() > lease && assigned.is_some() {
                            // The server has given the work up by now.
                            tracing::error!(node = %node, "node lease ran out; cancelling its work");
                            if self.executor.apply(&node, &[]).await.is_ok() {
                                assigned = Some(Vec::new());
                            }
                        }
                    }
                    tokio::time::sleep(backoff(failures)).await;
                    continue;
                }
            }
            let spent = round.elapsed();
            if spent < MIN_ROUND_SPACING {
                tokio::time::sleep(MIN_ROUND_SPACING - spent).await;
            }
        }
    }

    /// One round: observe, ship output, report, apply the answer.
    async fn round(
        &self,
        node: &str,
        node_id: &NodeId,
        tracked: &mut HashMap<InstanceId, Tracked>,
        assigned: &mut Option<Vec<Assignment>>,
    ) -> Result<Round, RoundError> {
        let observed = self.executor.observe(node).await?;
        let mut report = Vec::new();
        let mut reported_running = Vec::new();
        for o in observed {
            // Report only what the server assigned here; the rest is
            // cancelled by `apply` as orphaned. Before the first answer
            // the server's list is unknown: report only what still runs
            // (so it is kept), and ship no output yet (the engine may
            // still list work of an earlier deployment).
            match assigned.as_ref() {
                Some(list) if !list.iter().any(|a| a.instance_id == o.instance_id) => continue,
                Some(_) => {}
                None => {
                    if matches!(
                        o.phase,
                        ObservedPhase::Running { .. } | ObservedPhase::Starting
                    ) {
                        report.push(o);
                    }
                    continue;
                }
            }
            let t = tracked.entry(o.instance_id.clone()).or_default();
            let drained = self.ship_logs(&o.instance_id, t).await;
            if let ObservedPhase::Running { .. } = o.phase {
                t.started = Some(o.at);
            }
            report.push(match &o.phase {
                ObservedPhase::Exited { stopped, .. }
                    if (t.started.is_some() || o.started_at.is_some() || !stopped)
                        && (!t.running_reported || !drained) =>
                {
                    // Its end waits for its output and for the server to
                    // have seen it run (so the server meters from the
                    // engine's start); meanwhile it runs. Work that began
                    // and ended between two rounds was never seen running:
                    // it runs from the start the engine sent with its exit
                    // (a 0.5 s Slurm job was billed nothing when its end
                    // stood in for its start), and only an engine that
                    // sent none has its end stand in. Work stopped before
                    // it ever ran ends at once (nothing to meter).
                    reported_running.push(o.instance_id.clone());
                    let started = t.started.or(o.started_at).unwrap_or(o.at);
                    t.started = Some(started);
                    ObservedInstance {
                        phase: ObservedPhase::Running { pid: 0 },
                        at: started,
                        started_at: None,
                        ..o
                    }
                }
                ObservedPhase::Running { .. } => {
                    reported_running.push(o.instance_id.clone());
                    o
                }
                _ => o,
            });
        }
        // Stops of work the engine never took: say it ended.
        if let Some(list) = assigned.as_ref() {
            for a in list {
                if a.stop && !report.iter().any(|o| o.instance_id == a.instance_id) {
                    report.push(ObservedInstance {
                        instance_id: a.instance_id.clone(),
                        phase: ObservedPhase::Exited {
                            code: 0,
                            stopped: true,
                        },
                        at: chrono::Utc::now(),
                        started_at: None,
                        message: Some("stopped before it started".into()),
                        container: None,
                        weights_tier: None,
                        limit_exceeded: None,
                    });
                }
            }
        }
        let req = SyncRequest {
            observed: report,
            wait_ms: self.config.sync_wait_ms,
            gpus: Vec::new(),
            images: None,
            weights: None,
            parks_ended: vec![],
            busy_ok: false,
        };
        let timeout =
            Duration::from_millis(self.config.sync_wait_ms) + flotilla_client::LONG_POLL_SLACK;
        let resp = self
            .client
            .sync_node_within(node_id, &req, timeout)
            .await
            .map_err(RoundError::Server)?;
        if resp.reregister {
            return Ok(Round::Reregister);
        }
        for id in reported_running {
            if let Some(t) = tracked.get_mut(&id) {
                t.running_reported = true;
            }
        }
        tracked.retain(|id, _| resp.assignments.iter().any(|a| &a.instance_id == id));
        *assigned = Some(resp.assignments.clone());
        self.executor.apply(node, &resp.assignments).await?;
        Ok(Round::Synced {
            lease_ms: resp.lease_ms,
        })
    }

    /// Ships new output of `id`; true when nothing was left to ship.
    async fn ship_logs(&self, id: &InstanceId, t: &mut Tracked) -> bool {
        loop {
            let lines = match self.executor.logs(id, t.shipped).await {
                Ok(l) => l,
                Err(error) => {
                    tracing::warn!(instance_id = %id, %error, "reading output failed");
                    return false;
                }
            };
            if lines.is_empty() {
                return true;
            }
            for chunk in lines.chunks(LOG_BATCH) {
                let n = chunk.len() as u64;
                if let Err(error) = self.client.push_logs(id, chunk.to_vec()).await {
                    tracing::warn!(instance_id = %id, %error, "log upload failed");
                    return false;
                }
                t.shipped += n;
            }
        }
    }
}

enum Round {
    Synced { lease_ms: Option<u64> },
    Reregister,
}

#[derive(Debug, thiserror::Error)]
enum RoundError {
    #[error(transparent)]
    Engine(#[from] ExecutorError),
    #[error("server: {0}")]
    Server(flotilla_client::Error),
}
