//! A simulated fleet: many node agents in one process, real on the wire,
//! for load tests of the control plane (`flotilla agent --simulate-fleet
//! N`).
//!
//! Each node is a whole agent ([`crate::run_with`]): its own name, GPUs,
//! registration, key, node lease, sync loop, log shipper and lease
//! watchdog, with the payloads and intervals a real agent uses. What the
//! nodes share is what would make thousands of them in one process
//! impossible, and nothing the server can tell apart: one tokio runtime,
//! one HTTP connection pool (each node still sends its own key) and one
//! [`SimulatedRuntime`], whose workloads are timers instead of processes
//! but are reported, stopped, fenced and metered as real ones are.
//!
//! The fleet also keeps what a load test reads of it ([`SyncTimes`]),
//! written to a JSON file every [`STATS_EVERY`] when asked.
//!
//! It must never run a process or anything on the host for a workload:
//! that is the point of it.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use chrono::Utc;
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::client::Client;
use crate::runtime::simulated::SimulatedRuntime;
use crate::{AgentConfig, Provided};

/// Time between two nodes' starts: 2,000 nodes register within 10 s
/// instead of in one burst a real fleet never sends.
pub const START_SPACING: Duration = Duration::from_millis(5);
/// How often the statistics file is rewritten.
pub const STATS_EVERY: Duration = Duration::from_secs(2);
/// The statistics' percentiles cover the syncs answered this long before.
pub const STATS_WINDOW: Duration = Duration::from_secs(30);
/// Most sync timings kept for the window (the oldest go first).
const MAX_SAMPLES: usize = 200_000;

/// A fleet to run.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// What every node shares: the server, region, pool, simulated GPUs and
    /// host size. Its `name` is the prefix of the nodes' names
    /// (`NAME-00000`, `NAME-00001`, ...), and each node works under
    /// `work_dir/NAME-00000` and so on.
    pub base: AgentConfig,
    /// How many nodes.
    pub nodes: usize,
    /// Keys the nodes register with: one for all (the server's agent key),
    /// or one per node, in node order (the first `nodes` are used).
    pub tokens: Vec<String>,
    /// Where to write the statistics every [`STATS_EVERY`]; `None`: nowhere.
    pub stats_file: Option<PathBuf>,
}

/// Why a fleet cannot run as configured.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// No node, or more than a fleet is meant for.
    #[error("--simulate-fleet: must be 1 to {max} nodes, got {got}")]
    Nodes {
        /// The most nodes allowed.
        max: usize,
        /// What was asked.
        got: usize,
    },
    /// Nodes without GPUs to simulate.
    #[error("--simulate-fleet needs --simulate-gpus: a fleet's nodes are simulated")]
    NotSimulated,
    /// Per-node keys, but not one for each node.
    #[error("--simulate-fleet: {nodes} nodes need one key or {nodes} keys, got {keys}")]
    Tokens {
        /// Nodes asked for.
        nodes: usize,
        /// Keys given.
        keys: usize,
    },
}

/// Most nodes one fleet process runs.
pub const MAX_NODES: usize = 20_000;

impl FleetConfig {
    /// Checks the configuration before anything starts.
    pub fn validate(&self) -> Result<(), FleetError> {
        if self.nodes == 0 || self.nodes > MAX_NODES {
            return Err(FleetError::Nodes {
                max: MAX_NODES,
                got: self.nodes,
            });
        }
        if self.base.simulate_gpus.is_none() {
            return Err(FleetError::NotSimulated);
        }
        if self.tokens.is_empty() || (self.tokens.len() > 1 && self.tokens.len() < self.nodes) {
            return Err(FleetError::Tokens {
                nodes: self.nodes,
                keys: self.tokens.len(),
            });
        }
        Ok(())
    }

    /// The name of node `i`.
    pub fn node_name(&self, i: usize) -> String {
        format!("{}-{i:05}", self.base.name)
    }

    /// The configuration of node `i`.
    fn node(&self, i: usize) -> AgentConfig {
        let mut c = self.base.clone();
        c.name = self.node_name(i);
        c.work_dir = self.base.work_dir.join(&c.name);
        c.token = self.token(i).to_string();
        // No per-node fence process or metrics listener: a fleet has one
        // process; its lease watchdog stops a node's workloads in-process.
        c.fence_program = None;
        c.metrics_bind = None;
        c
    }

    fn token(&self, i: usize) -> &str {
        if self.tokens.len() == 1 {
            &self.tokens[0]
        } else {
            &self.tokens[i]
        }
    }
}

/// Runs the fleet until `shutdown` resolves, then stops every node as
/// [`crate::run`] stops one (its work stopped and reported). Fails when a
/// node fails (its registration refused for good): a fleet short of nodes
/// would measure something else than what was asked.
pub async fn run(
    config: FleetConfig,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    config.validate()?;
    let base = &config.base;
    // One connection pool for every node; each node's clone carries its key.
    let pool = Client::with_trust(&base.server_url, config.token(0), base.trust.clone())
        .context("the fleet's http client")?;
    let runtime = Arc::new(SimulatedRuntime::new());
    let times = Arc::new(SyncTimes::new(config.nodes));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut nodes = JoinSet::new();
    let stats = config.stats_file.clone().map(|file| {
        let (times, runtime) = (times.clone(), runtime.clone());
        tokio::spawn(write_stats_forever(file, times, runtime))
    });
    tokio::pin!(shutdown);
    tracing::info!(nodes = config.nodes, server = %base.server_url, "starting a simulated fleet");
    let mut result = Ok(());
    'run: {
        for i in 0..config.nodes {
            let node = config.node(i);
            let provided = Provided {
                client: Some(pool.with_token(&node.token)),
                runtime: Some(runtime.clone()),
                sync_times: Some(times.clone()),
            };
            let mut stop = stop_rx.clone();
            let name = node.name.clone();
            nodes.spawn(async move {
                let stopped = async move {
                    let _ = stop.wait_for(|s| *s).await;
                };
                crate::run_with(node, provided, stopped)
                    .await
                    .with_context(|| format!("simulated node {name}"))
            });
            tokio::select! {
                () = tokio::time::sleep(START_SPACING) => {}
                () = &mut shutdown => break 'run,
                Some(ended) = nodes.join_next() => {
                    result = node_ended(ended);
                    break 'run;
                }
            }
        }
        tracing::info!(nodes = config.nodes, "every simulated node started");
        tokio::select! {
            () = &mut shutdown => {}
            Some(ended) = nodes.join_next() => result = node_ended(ended),
        }
    }
    tracing::info!("simulated fleet stopping");
    let _ = stop_tx.send(true);
    while let Some(ended) = nodes.join_next().await {
        if let Err(error) = node_ended(ended) {
            tracing::warn!(%error, "simulated node ended badly");
        }
    }
    if let Some(stats) = stats {
        stats.abort();
    }
    result
}

/// A node's task that ended: its error, or that it ended at all (only a
/// shutdown ends a node).
fn node_ended(ended: Result<anyhow::Result<()>, tokio::task::JoinError>) -> anyhow::Result<()> {
    match ended {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(error),
        Err(error) => Err(anyhow::anyhow!("a simulated node's task failed: {error}")),
    }
}

/// The timing of the fleet's syncs: how many were answered or failed, and
/// the round trips of the last [`STATS_WINDOW`].
///
/// A sync is a long poll: the server holds it up to the wait the agent
/// asked for, and answers sooner when there is work for the node or
/// anything in the cluster changed. A sync held for its whole wait tells
/// what the server spent on it apart from waiting (the round trip less
/// the wait: *overhead*); one answered sooner tells how fast work reaches
/// a node (its round trip: *early*). Both are kept apart.
#[derive(Debug)]
pub struct SyncTimes {
    nodes: usize,
    registered: AtomicU64,
    answered: AtomicU64,
    failed: AtomicU64,
    busy: AtomicU64,
    samples: Mutex<VecDeque<Sample>>,
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    /// Microseconds: the round trip less the wait for a held sync, the
    /// round trip for an early one.
    micros: u64,
    held: bool,
}

impl SyncTimes {
    /// No sync yet, for a fleet of `nodes`.
    pub fn new(nodes: usize) -> Self {
        Self {
            nodes,
            registered: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            busy: AtomicU64::new(0),
            samples: Mutex::new(VecDeque::new()),
        }
    }

    /// A node registered.
    pub fn registered(&self) {
        self.registered.fetch_add(1, Ordering::Relaxed);
    }

    /// A sync that asked to be held up to `wait` was answered after
    /// `round_trip`.
    pub fn answered(&self, round_trip: Duration, wait: Duration) {
        self.answered.fetch_add(1, Ordering::Relaxed);
        let held = round_trip >= wait;
        let spent = if held { round_trip - wait } else { round_trip };
        let sample = Sample {
            at: Instant::now(),
            micros: u64::try_from(spent.as_micros()).unwrap_or(u64::MAX),
            held,
        };
        let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        if samples.len() >= MAX_SAMPLES {
            samples.pop_front();
        }
        samples.push_back(sample);
    }

    /// A sync failed (the server unreachable, or an error answer).
    pub fn failed(&self) {
        self.failed.fetch_add(1, Ordering::Relaxed);
    }

    /// A sync was answered busy: the lease renewed, the report not taken.
    pub fn busy(&self) {
        self.busy.fetch_add(1, Ordering::Relaxed);
    }

    /// What the file says, as of `now`; drops samples older than the window.
    pub fn report(&self, now: Instant, running: u64) -> FleetStats {
        let mut held = Vec::new();
        let mut early = Vec::new();
        {
            let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
            while samples
                .front()
                .is_some_and(|s| now.saturating_duration_since(s.at) > STATS_WINDOW)
            {
                samples.pop_front();
            }
            for s in samples.iter() {
                if s.held {
                    held.push(s.micros);
                } else {
                    early.push(s.micros);
                }
            }
        }
        FleetStats {
            at: Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            nodes: self.nodes as u64,
            registered: self.registered.load(Ordering::Relaxed),
            syncs_answered: self.answered.load(Ordering::Relaxed),
            syncs_failed: self.failed.load(Ordering::Relaxed),
            syncs_busy: self.busy.load(Ordering::Relaxed),
            running_workloads: running,
            window_s: STATS_WINDOW.as_secs(),
            overhead: Percentiles::of(held),
            early: Percentiles::of(early),
        }
    }
}

/// What the fleet's statistics file holds (rewritten whole each time).
#[derive(Debug, Clone, Serialize)]
pub struct FleetStats {
    /// When written, RFC 3339 UTC.
    pub at: String,
    /// Nodes the fleet runs.
    pub nodes: u64,
    /// Registrations so far (a node that registers again counts again).
    pub registered: u64,
    /// Syncs answered so far.
    pub syncs_answered: u64,
    /// Syncs failed so far.
    pub syncs_failed: u64,
    /// Syncs answered busy so far (not in `syncs_answered`): the server
    /// renewed the lease and took nothing else.
    pub syncs_busy: u64,
    /// Simulated workloads running now.
    pub running_workloads: u64,
    /// The percentiles cover this many seconds before `at`.
    pub window_s: u64,
    /// Syncs held their whole wait: round trip less the wait.
    pub overhead: Percentiles,
    /// Syncs answered before their wait: round trip.
    pub early: Percentiles,
}

/// Percentiles of a set of timings, in milliseconds.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Percentiles {
    /// How many timings.
    pub count: u64,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

impl Percentiles {
    /// Of `micros` (nearest rank; zeros when empty).
    pub fn of(mut micros: Vec<u64>) -> Self {
        if micros.is_empty() {
            return Self::default();
        }
        micros.sort_unstable();
        let at = |q: f64| {
            let rank = ((q * micros.len() as f64).ceil() as usize).clamp(1, micros.len());
            micros[rank - 1] as f64 / 1000.0
        };
        Self {
            count: micros.len() as u64,
            p50_ms: at(0.50),
            p99_ms: at(0.99),
            max_ms: at(1.0),
        }
    }
}

async fn write_stats_forever(file: PathBuf, times: Arc<SyncTimes>, runtime: Arc<SimulatedRuntime>) {
    loop {
        tokio::time::sleep(STATS_EVERY).await;
        let stats = times.report(Instant::now(), runtime.running());
        let Ok(text) = serde_json::to_string_pretty(&stats) else {
            continue;
        };
        // Whole or not at all: a reader never sees half a file.
        let tmp = file.with_extension("tmp");
        let written = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, &file));
        if let Err(error) = written {
            tracing::warn!(%error, file = %file.display(), "cannot write the fleet's statistics");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(nodes: usize, tokens: &[&str]) -> FleetConfig {
        let mut base = AgentConfig::new("http://127.0.0.1:1", "k", "sim", "/tmp/fleet");
        base.simulate_gpus = Some("8xH100".into());
        FleetConfig {
            base,
            nodes,
            tokens: tokens.iter().map(|t| t.to_string()).collect(),
            stats_file: None,
        }
    }

    #[test]
    fn each_node_has_its_own_name_dir_and_key() {
        let c = config(3, &["a", "b", "c"]);
        c.validate().unwrap();
        let n = c.node(2);
        assert_eq!(n.name, "sim-00002");
        assert_eq!(n.work_dir, PathBuf::from("/tmp/fleet/sim-00002"));
        assert_eq!(n.token, "c");
        assert!(n.fence_program.is_none());
        assert_eq!(config(3, &["shared"]).node(1).token, "shared");
    }

    #[test]
    fn bad_configurations_are_refused_with_the_flag_named() {
        assert!(matches!(
            config(0, &["k"]).validate(),
            Err(FleetError::Nodes { got: 0, .. })
        ));
        assert!(matches!(
            config(3, &["a", "b"]).validate(),
            Err(FleetError::Tokens { nodes: 3, keys: 2 })
        ));
        let mut c = config(2, &["k"]);
        c.base.simulate_gpus = None;
        let e = c.validate().unwrap_err();
        assert!(e.to_string().contains("--simulate-gpus"), "{e}");
    }

    #[test]
    fn held_syncs_count_their_overhead_and_early_ones_their_round_trip() {
        let t = SyncTimes::new(2);
        let wait = Duration::from_millis(2_500);
        t.answered(Duration::from_millis(2_512), wait);
        t.answered(Duration::from_millis(40), wait);
        t.failed();
        let r = t.report(Instant::now(), 7);
        assert_eq!(
            (r.syncs_answered, r.syncs_failed, r.running_workloads),
            (2, 1, 7)
        );
        assert_eq!(r.overhead.count, 1);
        assert_eq!(r.overhead.p99_ms, 12.0);
        assert_eq!(r.early.p50_ms, 40.0);
        let later = Instant::now() + STATS_WINDOW + Duration::from_secs(1);
        assert_eq!(t.report(later, 0).overhead.count, 0, "out of the window");
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let p = Percentiles::of((1..=100).map(|ms| ms * 1000).collect());
        assert_eq!(
            (p.count, p.p50_ms, p.p99_ms, p.max_ms),
            (100, 50.0, 99.0, 100.0)
        );
        assert_eq!(Percentiles::of(vec![]), Percentiles::default());
    }
}
