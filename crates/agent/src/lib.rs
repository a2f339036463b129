//! The Flotilla node agent: discovers this node's GPUs (NVML or simulated),
//! registers with the control plane, and runs a reconcile loop over the
//! long-poll sync: it reports every instance it knows, starts what the
//! server assigns, stops what the server wants stopped or no longer lists,
//! and ships the instances' output.
//!
//! The agent must never restart a process on its own: an instance id it has
//! seen once is never spawned again by this agent process. Losing the
//! server pauses reporting; the work goes on for as long as the node's
//! lease (which the server states, and renews, in every sync answer)
//! lasts, counted from when the last answer arrived. Once it ran out the
//! agent stops the work itself (SIGTERM, then SIGKILL half a heartbeat
//! interval later), because the server declares it lost one interval
//! after the lease's end and may restart it elsewhere: a job must never
//! run twice. It must never report an instance as exited before the server
//! accepted all of its log lines.
//!
//! Modules: [`discovery`] (what the node offers), [`runtime`] (where
//! workloads run: the [`runtime::Runtime`] trait and its runtimes, log
//! capture), [`client`] (HTTP to the server); this file
//! holds the configuration and the loops that tie them together.

pub mod access;
pub mod client;
pub mod container;
pub mod container_error;
pub mod discovery;
pub mod fence;
pub mod fleet;
pub mod image_cache;
pub mod metrics;
pub mod runtime;
pub mod telemetry;
pub mod weight_cache;
pub mod weights;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use flotilla_core::api::{
    Assignment, ObservedInstance, ObservedPhase, RegisterNode, Registered, SyncRequest,
    SyncResponse,
};
use flotilla_core::api::{LimitExceeded, WeightTier};
use flotilla_core::catalog::{Catalog, Vendor};
use flotilla_core::endpoint::{ReplicaWeights, ENV_LOAD_TIER};
use flotilla_core::id::InstanceId;
use tokio::sync::Notify;
use tokio::time::Instant;

pub use discovery::{discover, nvml_available, DiscoveryError};

use client::{Client, ClientError, Retryable};
use runtime::{Runtime, RuntimeKind, SpawnSpec, Wakers, Workload};
use telemetry::Telemetry;

/// First retry delay after a failed server call.
const BACKOFF_MIN: Duration = Duration::from_millis(250);
/// Longest retry delay.
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How often pending log lines are shipped.
const LOG_TICK: Duration = Duration::from_millis(200);
/// Batches shipped for one instance per round, so a chatty instance cannot
/// starve the others.
const MAX_BATCHES_PER_ROUND: usize = 20;
/// Grace given to an orphan (running here, unknown to the server).
const ORPHAN_GRACE: Duration = Duration::from_secs(10);
/// Longest grace given to an instance when the agent shuts down.
const SHUTDOWN_GRACE_MAX: Duration = Duration::from_secs(10);
/// Time allowed for each best-effort step of the shutdown (log flush,
/// final report).
const SHUTDOWN_STEP_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an exited instance waits for its output to be accepted while
/// the server answers syncs but refuses the lines, before its exit is
/// reported anyway: a broken log endpoint must not hold GPUs forever.
const LOG_FLUSH_DEADLINE: Duration = Duration::from_secs(60);
/// Least time between two syncs unless something changed here, so a server
/// that answers at once cannot spin the loop.
const MIN_SYNC_SPACING: Duration = Duration::from_millis(200);
/// How often the lease watchdog looks at the node's lease.
const LEASE_CHECK: Duration = Duration::from_millis(100);

/// How the agent runs.
#[derive(Clone)]
pub struct AgentConfig {
    /// The server, e.g. `http://127.0.0.1:7420` (no trailing `/v1`), or
    /// several replicas of it, comma-separated: calls fail over between them.
    pub server_url: String,
    /// Bearer API key (provider or operator role).
    pub token: String,
    /// Node name; re-registering the same name re-attaches to the same node.
    pub name: String,
    /// Region (server default: `local`).
    pub region: Option<String>,
    /// Node pool (server default: `default`).
    pub pool: Option<String>,
    /// Simulated inventory, e.g. `4xH100,2xL40S`; `None` discovers with NVML.
    pub simulate_gpus: Option<String>,
    /// CPU (milli-cores) and memory (MiB) to report instead of the host's:
    /// a simulated node of another size (`--simulate-cpus`,
    /// `--simulate-memory-gb`).
    pub simulated_host: (Option<u64>, Option<u64>),
    /// Per-instance default working dirs go under `work_dir/instances/<id>`.
    pub work_dir: PathBuf,
    /// Long-poll wait to ask for, in milliseconds.
    pub sync_wait_ms: u64,
    /// A program to run as the node lease's fence ([`fence`]), as
    /// `PROGRAM agent-fence --file F --agent-pid P`: `flotilla agent` passes
    /// its own binary. `None`: no fence process (the agent still stops its
    /// work itself when the lease runs out, but not while it is paused).
    /// The process runtime runs it as `PROGRAM agent-log-relay` to relay
    /// workloads' output with back-pressure ([`runtime::relay`]); `None`:
    /// workloads write their output files directly.
    pub fence_program: Option<PathBuf>,
    /// Keep ended instances' directories this long for debugging
    /// (`--keep-workdirs`); `None`: removed once their output was shipped
    /// (see [`runtime::leftovers`]).
    pub keep_workdirs: Option<Duration>,
    /// Where workloads run (default: sandboxed processes).
    pub runtime: RuntimeKind,
    /// Lets the process runtime run workloads as root's agent without a
    /// sandbox (bubblewrap missing): only per-tenant users separate them.
    pub insecure_process_runtime: bool,
    /// Host paths shown inside every sandboxed workload (`--sandbox-share`).
    pub sandbox_shares: Vec<runtime::sandbox::SharedPath>,
    /// Inward networks and ports workloads may reach anyway
    /// (`--allow-egress`; see [`runtime::network`]).
    pub allow_egress: Vec<flotilla_egress::AllowRule>,
    /// The process runtime's limits for what an instance leaves out
    /// (`--default-memory`, `--default-pids`, `--default-disk`).
    pub limit_defaults: runtime::limits::LimitDefaults,
    /// The container engine's API, for the container runtime
    /// (`--docker-host`; default [`DEFAULT_DOCKER_HOST`]).
    pub docker_host: Option<String>,
    /// How GPUs reach containers; default: simulated GPUs get only their
    /// variables, real ones Docker's `DeviceRequests`.
    pub container_gpus: Option<container::GpuPassthrough>,
    /// Address tenants reach this node at, shown in the URLs of published
    /// container ports (default `127.0.0.1`).
    pub public_host: Option<String>,
    /// Size limit of the container runtime's image cache in bytes
    /// ([`image_cache`]; its record lives in `work_dir`); `None`: no
    /// limit.
    pub image_cache_bytes: Option<u64>,
    /// Size limit of the disk cache of endpoint replicas' model weights
    /// ([`weights`]; under `work_dir/weights`), bytes.
    pub weight_cache_bytes: u64,
    /// Host memory parked replicas may hold, bytes; `None`: half the
    /// node's memory.
    pub parked_bytes: Option<u64>,
    /// For simulated GPUs: a readings file standing in for the driver
    /// (`--simulated-telemetry`; see [`telemetry`]), read at every sync,
    /// so XID errors, ECC errors, heat or utilisation can be injected.
    pub simulated_telemetry: Option<PathBuf>,
    /// Where to serve the agent's own `/metrics` ([`metrics`]); `None`:
    /// nowhere.
    pub metrics_bind: Option<std::net::SocketAddr>,
    /// Which certificates an `https://` server may present: the system's
    /// roots (default), a CA file, or a pinned fingerprint
    /// (`--tls-fingerprint`).
    pub trust: flotilla_client::Trust,
}

/// The Docker Engine's usual socket, used when no `--docker-host` is given.
pub const DEFAULT_DOCKER_HOST: &str = "unix:///var/run/docker.sock";

impl std::fmt::Debug for AgentConfig {
    /// Like a derived `Debug`, but never prints the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConfig")
            .field("server_url", &self.server_url)
            .field("token", &"<redacted>")
            .field("name", &self.name)
            .field("region", &self.region)
            .field("pool", &self.pool)
            .field("simulate_gpus", &self.simulate_gpus)
            .field("work_dir", &self.work_dir)
            .field("sync_wait_ms", &self.sync_wait_ms)
            .field("fence_program", &self.fence_program)
            .field("keep_workdirs", &self.keep_workdirs)
            .field("runtime", &self.runtime)
            .field("insecure_process_runtime", &self.insecure_process_runtime)
            .field("sandbox_shares", &self.sandbox_shares)
            .field("allow_egress", &self.allow_egress)
            .field("limit_defaults", &self.limit_defaults)
            .field("docker_host", &self.docker_host)
            .field("container_gpus", &self.container_gpus)
            .field("public_host", &self.public_host)
            .field("image_cache_bytes", &self.image_cache_bytes)
            .field("weight_cache_bytes", &self.weight_cache_bytes)
            .field("parked_bytes", &self.parked_bytes)
            .field("simulated_telemetry", &self.simulated_telemetry)
            .field("metrics_bind", &self.metrics_bind)
            .field("trust", &self.trust)
            .finish()
    }
}

impl AgentConfig {
    /// A configuration with no region or pool (server defaults), NVML
    /// discovery and a 10 s long-poll.
    pub fn new(
        server_url: impl Into<String>,
        token: impl Into<String>,
        name: impl Into<String>,
        work_dir: impl Into<PathBuf>,
    ) -> Self {
        Self {
            server_url: server_url.into(),
            token: token.into(),
            name: name.into(),
            region: None,
            pool: None,
            simulate_gpus: None,
            simulated_host: (None, None),
            work_dir: work_dir.into(),
            sync_wait_ms: 10_000,
            fence_program: None,
            keep_workdirs: None,
            runtime: RuntimeKind::default(),
            insecure_process_runtime: false,
            sandbox_shares: Vec::new(),
            allow_egress: Vec::new(),
            limit_defaults: Default::default(),
            docker_host: None,
            container_gpus: None,
            public_host: None,
            image_cache_bytes: Some(image_cache::DEFAULT_IMAGE_CACHE_GB * 1_000_000_000),
            weight_cache_bytes: weights::DEFAULT_WEIGHT_CACHE_GB * 1_000_000_000,
            parked_bytes: None,
            simulated_telemetry: None,
            metrics_bind: None,
            trust: flotilla_client::Trust::System,
        }
    }
}

/// Runs the agent until `shutdown` resolves; then stops all running
/// instances (SIGTERM, grace, SIGKILL), flushes their logs, reports their
/// exits to the server (best effort, short timeout), and returns.
///
/// Fails early when discovery fails or the server refuses the first
/// registration for good (bad key, invalid node); an unreachable server is
/// waited for.
pub async fn run(
    config: AgentConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    run_with(config, Provided::default(), shutdown).await
}

/// What an agent may be handed instead of making its own: the agents of a
/// simulated fleet ([`fleet`]) share one connection pool and one runtime,
/// and report every sync's timing to one place. Everything else (node
/// identity, registration, key, lease, loops) stays the agent's own.
#[derive(Clone, Default)]
pub struct Provided {
    /// The client to call the server with (its key is the agent's own);
    /// `None`: one made from the configuration.
    pub client: Option<Client>,
    /// Where workloads run; `None`: the one the configuration names.
    pub runtime: Option<Arc<dyn Runtime>>,
    /// Told of every answered sync.
    pub sync_times: Option<Arc<fleet::SyncTimes>>,
}

/// [`run`], with what the caller provides.
pub async fn run_with(
    config: AgentConfig,
    provided: Provided,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let simulate = config.simulate_gpus.clone();
    let name = config.name.clone();
    let gpus = match simulate {
        // Parsing a spec: no need for a blocking thread (a fleet starts
        // thousands of agents).
        Some(spec) => discovery::simulated_gpus(&spec, &name, &Catalog::default())?,
        None => tokio::task::spawn_blocking(move || discover(None, &name, &Catalog::default()))
            .await
            .context("gpu discovery task failed")??,
    };
    tracing::info!(
        node = %config.name,
        gpus = gpus.len(),
        simulated = config.simulate_gpus.is_some(),
        "gpus discovered"
    );
    let vendors = gpus.iter().map(|g| (g.index, g.vendor)).collect();
    let telemetry = if config.simulate_gpus.is_some() {
        match &config.simulated_telemetry {
            Some(file) => Telemetry::simulated(file.clone(), &gpus),
            None => Telemetry::None,
        }
    } else {
        let indices: Vec<u32> = gpus.iter().map(|g| g.index).collect();
        match tokio::task::spawn_blocking(move || Telemetry::nvml(indices))
            .await
            .context("telemetry task failed")?
        {
            Ok(t) => t,
            Err(error) => {
                tracing::warn!(%error, "gpu telemetry unavailable");
                Telemetry::None
            }
        }
    };
    let mut registration = RegisterNode {
        name: config.name.clone(),
        region: config.region.clone(),
        pool: config.pool.clone(),
        cpu_milli: config
            .simulated_host
            .0
            .unwrap_or_else(discovery::host_cpu_milli),
        memory_mb: config
            .simulated_host
            .1
            .unwrap_or_else(discovery::host_memory_mib),
        simulated: config.simulate_gpus.is_some(),
        gpus,
        agent_version: env!("CARGO_PKG_VERSION").to_string(),
        runtime: config.runtime,
        executor: Default::default(),
        running: Vec::new(),
        unenforced_limits: Vec::new(),
        network: None,
    };
    let runtime = match provided.runtime {
        Some(runtime) => runtime,
        None => runtime_for(&config).await?,
    };
    registration.unenforced_limits = runtime.unenforced_limits();
    registration.network = runtime.network();
    // However `run` ends (a refused registration, a shutdown, the task
    // dropped), what the runtime set up and no longer needs goes.
    let _close = CloseOnDrop(runtime.clone());
    let client = match provided.client {
        Some(client) => client,
        None => Client::with_trust(&config.server_url, &config.token, config.trust.clone())?,
    };
    let shared = Arc::new(Shared::default());
    let metrics = Arc::new(metrics::AgentMetrics::default());
    let metrics_server = match config.metrics_bind {
        Some(addr) => Some(
            metrics::serve(addr, metrics.clone(), config.name.clone())
                .await
                .with_context(|| format!("cannot serve agent metrics on {addr}"))?,
        ),
        None => None,
    };
    let parked_bytes = config
        .parked_bytes
        .unwrap_or(registration.memory_mb.saturating_mul(1 << 20) / 2);
    let node_weights = weights::NodeWeightsState::new(
        config.work_dir.join("weights"),
        config.weight_cache_bytes,
        parked_bytes,
    );
    let mut agent = Agent {
        sync_times: provided.sync_times,
        weights: node_weights,
        metrics,
        config,
        client: client.clone(),
        registration,
        vendors,
        telemetry,
        shared: shared.clone(),
        node: None,
        runtime,
        seen: HashSet::new(),
        not_started: HashMap::new(),
        sessions: HashMap::new(),
    };

    // Before registering: the server fails whatever the node does not say
    // still runs.
    agent.adopt().await;
    // The adopted work stays under the lease its agent held, fenced by
    // this process from now on (see `take_over_stale_fences`). Left
    // running if this returns early: it guards that work until the lease
    // runs out, and leaves with this process.
    let fence = agent.start_fence();
    agent.take_over_stale_fences();
    let watchdog = tokio::spawn(fence_forever(shared.clone()));
    tokio::pin!(shutdown);
    tokio::select! {
        registered = agent.register(true) => {
            let registered = match registered {
                Ok(r) => r,
                Err(e) => {
                    watchdog.abort();
                    return Err(e);
                }
            };
            // Known from the start, so the first syncs are timed for it; it
            // only begins to count with the first sync that succeeds.
            agent
                .shared
                .node_lease()
                .stated(registered.lease_ms, registered.heartbeat_interval_ms);
            if let Some(times) = &agent.sync_times {
                times.registered();
            }
            agent.node = Some(registered);
        }
        () = &mut shutdown => {
            watchdog.abort();
            return Ok(());
        }
    }
    let shipper = tokio::spawn(ship_logs_forever(shared.clone(), client));
    tokio::select! {
        () = agent.sync_forever() => {}
        () = &mut shutdown => {}
    }
    tracing::info!("agent shutting down");
    if let Some(m) = metrics_server {
        m.abort();
    }
    shipper.abort();
    watchdog.abort();
    agent.shutdown().await;
    // A clean stop: the fence has nothing left to guard. It ends by
    // itself once the file it saw is gone, but one that never saw a file
    // (no node lease, as under `flotilla up`) waits while this process
    // lives: end it rather than wait for it.
    let _ = std::fs::remove_file(agent.fence_file());
    let _ = std::fs::remove_file(fence::ended_path(&agent.fence_file()));
    if let Some(mut f) = fence {
        let _ = f.kill();
        let _ = f.wait();
    }
    tracing::info!("agent stopped");
    Ok(())
}

/// Closes a runtime when dropped ([`Runtime::close`]).
struct CloseOnDrop(Arc<dyn Runtime>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// The runtime the configuration names: the process runtime probes the
/// host for its sandbox (blocking, so off the async threads); the
/// container runtime connects to its engine and fails when none answers.
async fn runtime_for(config: &AgentConfig) -> anyhow::Result<Arc<dyn Runtime>> {
    match config.runtime {
        RuntimeKind::Process => {
            let sandbox = runtime::sandbox::SandboxConfig {
                insecure: config.insecure_process_runtime,
                shares: config.sandbox_shares.clone(),
                allow_egress: config.allow_egress.clone(),
                ..runtime::sandbox::SandboxConfig::new(&config.work_dir)
            };
            let node = config.name.clone();
            let defaults = config.limit_defaults;
            // The fence's program (this binary) also relays output.
            let (relay, keep) = (config.fence_program.clone(), config.keep_workdirs);
            let work_dir = config.work_dir.clone();
            let runtime = tokio::task::spawn_blocking(move || {
                let limits = runtime::limits::Enforcement::detect(
                    &node,
                    &work_dir,
                    defaults,
                    discovery::host_memory_mib(),
                );
                runtime::ProcessRuntime::new(&sandbox).map(|r| {
                    r.for_node(&node)
                        .with_limits(limits)
                        .with_relay(relay)
                        .keeping_workdirs(keep)
                })
            })
            .await
            .context("runtime setup task failed")??;
            if let Some(limits) = runtime.limits() {
                let unenforced = limits.unenforced();
                if unenforced.is_empty() {
                    tracing::info!(cgroups = limits.cgroups.hierarchy().name(), defaults = ?limits.defaults, "workloads are held to their memory, cpu, pids and disk limits");
                } else {
                    tracing::warn!(cgroups = limits.cgroups.hierarchy().name(), unenforced = ?unenforced, "some limits cannot be enforced on this node: workloads may use more than they asked for");
                }
            }
            Ok(Arc::new(runtime))
        }
        RuntimeKind::Container => {
            let host = config
                .docker_host
                .clone()
                .unwrap_or_else(|| DEFAULT_DOCKER_HOST.to_string());
            let mut c = container::ContainerConfig::new(host, config.name.clone());
            c.gpus = config
                .container_gpus
                .unwrap_or(if config.simulate_gpus.is_some() {
                    container::GpuPassthrough::Simulated
                } else {
                    container::GpuPassthrough::DeviceRequests
                });
            if let Some(public_host) = &config.public_host {
                c.public_host = public_host.clone();
            }
            c.image_cache_bytes = config.image_cache_bytes;
            c.state_dir = Some(config.work_dir.clone());
            let mut runtime = container::ContainerRuntime::connect(c)
                .await
                .context("the container runtime cannot reach its engine")?;
            if nix::unistd::geteuid().is_root() {
                // A rootful engine: each tenant its own uid on the host.
                let sandbox = runtime::sandbox::SandboxConfig::new(&config.work_dir);
                runtime = runtime.with_tenant_users(runtime::sandbox::Users::new(&sandbox)?);
            }
            let allow = config.allow_egress.clone();
            match tokio::task::spawn_blocking(move || runtime::network::Network::probe(allow))
                .await
                .context("firewall setup task failed")?
            {
                runtime::network::Network::Isolated(firewall) => {
                    runtime = runtime.with_firewall(firewall);
                }
                runtime::network::Network::Shared { why } => {
                    tracing::warn!(reason = %why, "containers are NOT held to the egress policy: they reach the host's addresses, private ranges and the metadata service");
                }
            }
            tracing::info!(docker_host = %runtime.config().docker_host, gpus = ?runtime.config().gpus, "running workloads in containers");
            Ok(Arc::new(runtime))
        }
    }
}

/// What runs (or ran) for one instance.
enum Work {
    /// The runtime is starting it (an image pull may take minutes).
    Starting {
        since: DateTime<Utc>,
    },
    Running(Workload),
    FailedToStart {
        reason: String,
        at: DateTime<Utc>,
    },
}

/// One instance the agent knows.
struct Tracked {
    work: Work,
    /// The server asked for the stop.
    server_stop: bool,
    /// Grace between SIGTERM and SIGKILL the server asked for.
    grace: Duration,
    /// The server no longer lists it: stopped, not reported, forgotten once
    /// it ended.
    orphaned: bool,
    /// Since when it exited with output still unshipped while syncs
    /// succeed; reset whenever the server is unreachable.
    flush_waiting_since: Option<Instant>,
    /// Its exit is reported although output is still unshipped (see
    /// [`LOG_FLUSH_DEADLINE`]).
    flush_given_up: bool,
    /// Stopped by the agent because the node's lease ran out.
    fenced: bool,
    /// Its exit was in a sync request (every later one carries it too).
    exit_reported: bool,
    /// An endpoint replica's weights, and the tier they loaded from.
    weights: Option<(ReplicaWeights, WeightTier)>,
    /// Parked (or found not to park) after its stop.
    park_decided: bool,
    /// Its endpoint was deleted: it stops without parking.
    no_park: bool,
}

impl Tracked {
    fn new(work: Work, grace: Duration) -> Self {
        Tracked {
            work,
            server_stop: false,
            grace,
            orphaned: false,
            flush_waiting_since: None,
            flush_given_up: false,
            fenced: false,
            exit_reported: false,
            weights: None,
            park_decided: false,
            no_park: false,
        }
    }

    fn workload(&self) -> Option<&Workload> {
        match &self.work {
            Work::Running(w) => Some(w),
            Work::Starting { .. } | Work::FailedToStart { .. } => None,
        }
    }

    fn running(&self) -> bool {
        self.workload().is_some_and(|p| p.exit().is_none())
    }

    /// The phase to report. An exited process stays `Running` until the
    /// server accepted all its output, so that clients following the logs
    /// see every line before the instance turns final.
    fn observed(&self, instance_id: &InstanceId) -> ObservedInstance {
        let (phase, at, started_at) = match &self.work {
            Work::FailedToStart { reason, at } => (
                ObservedPhase::FailedToStart {
                    reason: reason.clone(),
                },
                *at,
                None,
            ),
            Work::Starting { since } => (ObservedPhase::Starting, *since, None),
            Work::Running(p) => match p.exit() {
                Some(exit) if p.logs().pending() == 0 || self.flush_given_up => (
                    ObservedPhase::Exited {
                        code: exit.code,
                        stopped: self.server_stop && exit.stop_requested,
                    },
                    exit.at,
                    Some(p.started_at()),
                ),
                _ => (
                    ObservedPhase::Running { pid: p.pid() },
                    p.started_at(),
                    None,
                ),
            },
        };
        let container = self.workload().and_then(|w| {
            let mut c = w.container()?.clone();
            c.oom_killed = w.exit().is_some_and(|e| e.oom_killed);
            Some(c)
        });
        ObservedInstance {
            instance_id: instance_id.clone(),
            phase,
            at,
            started_at,
            message: None,
            container,
            weights_tier: self.weights.as_ref().map(|(_, t)| *t),
            limit_exceeded: self.workload().and_then(|w| {
                let exit = w.exit()?;
                if exit.oom_killed {
                    Some(LimitExceeded::Memory)
                } else {
                    exit.disk_exceeded.then_some(LimitExceeded::Disk)
                }
            }),
        }
    }
}

/// What the agent reports of work the server stopped before it was
/// started here: a stopped exit with nothing behind it (the Slurm and
/// Kubernetes bridges report such stops the same way), which ends the
/// instance without a run to meter.
fn not_started(id: &InstanceId, at: chrono::DateTime<Utc>) -> ObservedInstance {
    ObservedInstance {
        instance_id: id.clone(),
        phase: ObservedPhase::Exited {
            code: 0,
            stopped: true,
        },
        at,
        started_at: None,
        message: Some("stopped before it started".into()),
        container: None,
        weights_tier: None,
        limit_exceeded: None,
    }
}

/// The node's lease as the agent keeps it: how long it lasts, until when
/// (by this process's monotonic clock) the last sync the server answered
/// keeps it, and how long after its end the work may take to be gone.
/// `None` until a server states one (an older server has none).
#[derive(Debug, Default, Clone, Copy)]
struct NodeLease {
    length: Option<Duration>,
    until: Option<Instant>,
    /// From the lease's end to the kill: half a heartbeat interval. The
    /// server declares the node's work lost a whole interval after the
    /// lease's end, so the other half covers the answer's transit (the
    /// agent counts from the arrival, the server from its answer).
    lead: Option<Duration>,
}

impl NodeLease {
    /// What registration stated: the lease's length and the heartbeat
    /// interval the kill lead derives from. The lease only begins to
    /// count with the first answered sync.
    fn stated(&mut self, lease_ms: Option<u64>, heartbeat_interval_ms: u64) {
        self.length = lease_ms.filter(|ms| *ms > 0).map(Duration::from_millis);
        if self.length.is_some() && heartbeat_interval_ms > 0 {
            self.lead = Some(Duration::from_millis(heartbeat_interval_ms) / 2);
        }
    }

    /// The answer to a sync, stating `lease_ms`, arrived at `acked`. The
    /// server renews the lease when it answers (after the long poll, not
    /// when the sync arrived), so the whole lease counts from here: a
    /// long poll does not eat into it.
    fn renewed(&mut self, acked: Instant, lease_ms: Option<u64>) {
        if let Some(ms) = lease_ms.filter(|ms| *ms > 0) {
            let length = Duration::from_millis(ms);
            self.length = Some(length);
            self.until = Some(acked + length);
        }
    }

    /// The lease an earlier agent process held, read from its fence's
    /// file, for the work taken over from it: it holds until this process
    /// renews it (a later end is kept).
    fn inherited(&mut self, until: Instant, lead: Duration) {
        if self.until.is_none_or(|u| u < until) {
            self.until = Some(until);
            self.lead = Some(self.lead.unwrap_or(lead));
        }
    }

    /// When to begin stopping work (the lease's end: not before it ran
    /// out) and the grace to give it, so that it is gone before the
    /// server declares it lost.
    fn stop_from(&self) -> Option<(Instant, Duration)> {
        let until = self.until?;
        let lead = self
            .lead
            .or(self.length.map(|l| l / 6))
            .unwrap_or(Duration::ZERO);
        Some((until, lead))
    }
}

/// State shared by the sync loop, the log shipper and the lease watchdog.
#[derive(Default)]
struct Shared {
    instances: Mutex<BTreeMap<InstanceId, Tracked>>,
    wakers: Wakers,
    lease: Mutex<NodeLease>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<InstanceId, Tracked>> {
        // No critical section panics half-way, so a poisoned map is intact.
        self.instances.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn node_lease(&self) -> MutexGuard<'_, NodeLease> {
        self.lease.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops every running instance when the node's lease is about to run
    /// out (see [`NodeLease::stop_from`]); returns how many it stopped.
    fn fence_if_due(&self, now: Instant) -> usize {
        let Some((from, lead)) = self.node_lease().stop_from() else {
            return 0;
        };
        if now < from {
            return 0;
        }
        let mut stopped = 0;
        for (id, t) in self.lock().iter_mut() {
            if t.fenced || !t.running() {
                continue;
            }
            if let Some(p) = t.workload() {
                let grace = t.grace.min(lead);
                tracing::warn!(instance_id = %id, pid = p.pid(), grace_ms = grace.as_millis() as u64, "node lease running out without a sync: stopping the instance");
                p.stop(grace);
                t.fenced = true;
                stopped += 1;
            }
        }
        stopped
    }

    /// Every process whose output may still need shipping.
    /// A start the runtime finished: records the workload, or why it did
    /// not start. One asked to stop meanwhile (or forgotten: the server no
    /// longer lists it) is stopped at once.
    fn started(&self, id: &InstanceId, result: Result<Workload, runtime::SpawnError>) {
        let mut instances = self.lock();
        let work = match result {
            Ok(w) => Work::Running(w),
            Err(error) => {
                tracing::warn!(instance_id = %id, %error, "instance failed to start");
                Work::FailedToStart {
                    reason: error.to_string(),
                    at: Utc::now(),
                }
            }
        };
        let t = instances.entry(id.clone()).or_insert_with(|| Tracked {
            orphaned: true,
            ..Tracked::new(Work::Starting { since: Utc::now() }, ORPHAN_GRACE)
        });
        t.work = work;
        if let Some(w) = t.workload() {
            if t.server_stop || t.orphaned {
                tracing::info!(instance_id = %id, "instance stopped while it was starting, stopping it");
                w.stop(if t.orphaned { ORPHAN_GRACE } else { t.grace });
            }
        }
        drop(instances);
        self.wakers.changed.notify_one();
    }

    /// Every workload whose output may still need shipping.
    fn workloads(&self) -> Vec<(InstanceId, Workload)> {
        self.lock()
            .iter()
            .filter_map(|(id, t)| t.workload().map(|p| (id.clone(), p.clone())))
            .collect()
    }
}

struct Agent {
    /// Told of every answered sync (a simulated fleet's statistics).
    sync_times: Option<Arc<fleet::SyncTimes>>,
    /// What `/metrics` shows of the sync loop.
    metrics: Arc<metrics::AgentMetrics>,
    config: AgentConfig,
    client: Client,
    registration: RegisterNode,
    vendors: HashMap<u32, Vendor>,
    /// GPU counters sent with every sync.
    telemetry: Telemetry,
    shared: Arc<Shared>,
    node: Option<Registered>,
    /// Where workloads run.
    runtime: Arc<dyn Runtime>,
    /// Every instance id ever started (or tried) by this process.
    seen: HashSet<InstanceId>,
    /// Work the server stopped before this agent started it, with when the
    /// stop was seen: reported as a stopped exit while the server still
    /// lists it, so that the instance ends and its GPUs return (ignoring
    /// such a stop left the instance `scheduled` for good).
    not_started: HashMap<InstanceId, chrono::DateTime<Utc>>,
    /// Sessions into instances this process dialled back, and when: a
    /// sync may list one again until the server saw the dial.
    sessions: HashMap<flotilla_core::id::AccessSessionId, Instant>,
    /// Endpoint replicas' weights held here (disk cache, parked).
    weights: weights::NodeWeightsState,
}

impl Agent {
    /// Where the fence reads the lease: one file per agent process, since
    /// agents may share a work directory.
    fn fence_file(&self) -> PathBuf {
        self.config
            .work_dir
            .join(format!("node-lease.{}", std::process::id()))
    }

    /// Starts the fence process, if the configuration names a program for
    /// it; a fence that cannot start is a warning, not a failure.
    fn start_fence(&self) -> Option<std::process::Child> {
        use std::os::unix::process::CommandExt;
        let program = self.config.fence_program.as_ref()?;
        let _ = std::fs::remove_file(self.fence_file());
        let _ = std::fs::remove_file(fence::ended_path(&self.fence_file()));
        match std::process::Command::new(program)
            .arg("agent-fence")
            .arg("--file")
            .arg(self.fence_file())
            .arg("--agent-pid")
            .arg(std::process::id().to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            // Its own group: a signal to the agent's group is not for it.
            .process_group(0)
            .spawn()
        {
            Ok(child) => {
                tracing::info!(pid = child.id(), "node lease fence started");
                Some(child)
            }
            Err(error) => {
                tracing::warn!(%error, "node lease fence not started: work will not be stopped while the agent is paused");
                None
            }
        }
    }

    /// Takes over from the fences of agents that are gone (killed, so
    /// they could not stop them): the latest lease their files hold
    /// becomes this agent's until a sync renews it, and this agent's own
    /// fence guards the work adopted from them with it. Then their files
    /// go, so their fences leave instead of stopping the work this agent
    /// now answers for. Done before registering: a restart that took
    /// most of the lease must not lose the work to the old fence while it
    /// registers, nor keep it past the lease if it cannot register.
    fn take_over_stale_fences(&self) {
        let Ok(entries) = std::fs::read_dir(&self.config.work_dir) else {
            return;
        };
        let mut stale = Vec::new();
        let mut latest: Option<fence::Lease> = None;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .and_then(|n| n.strip_prefix("node-lease."))
                .and_then(|p| p.parse::<i32>().ok())
            else {
                continue;
            };
            let gone = pid <= 0
                || nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None)
                    == Err(nix::errno::Errno::ESRCH);
            if !gone || pid == std::process::id() as i32 {
                continue;
            }
            if let Some(old) = fence::read(&entry.path()) {
                if latest
                    .as_ref()
                    .is_none_or(|l| l.stop_from_ms < old.stop_from_ms)
                {
                    latest = Some(old);
                }
            }
            stale.push((pid, entry.path()));
        }
        if let Some(old) = latest {
            let (now, wall) = (Instant::now(), fence::now_ms());
            let until = now + Duration::from_millis(old.stop_from_ms.saturating_sub(wall));
            let lead = Duration::from_millis(old.until_ms.saturating_sub(old.stop_from_ms));
            tracing::info!(
                left_ms = old.stop_from_ms.saturating_sub(wall),
                "holding the lease of the agent that is gone until a sync renews it"
            );
            self.shared.node_lease().inherited(until, lead);
            // In this agent's fence file before the old files go.
            self.tell_fence();
        }
        for (pid, path) in stale {
            tracing::info!(pid, "retiring the fence of an agent that is gone");
            let _ = std::fs::remove_file(path);
        }
    }

    /// Writes the lease and the running workloads' process groups
    /// for the fence (a no-op without a lease).
    fn tell_fence(&self) {
        if self.config.fence_program.is_none() {
            return;
        }
        let Some((from, lead)) = self.shared.node_lease().stop_from() else {
            return;
        };
        let now = Instant::now();
        let wall = fence::now_ms();
        let at =
            |t: Instant| wall.saturating_add(t.saturating_duration_since(now).as_millis() as u64);
        let groups = self
            .shared
            .lock()
            .values()
            .filter(|t| t.running() && !t.fenced)
            .filter_map(|t| t.workload().and_then(Workload::process_group))
            .collect();
        let lease = fence::Lease {
            agent_pid: std::process::id(),
            stop_from_ms: at(from),
            until_ms: at(from + lead),
            groups,
        };
        if let Err(error) = fence::write(&self.fence_file(), &lease) {
            tracing::warn!(%error, "could not tell the node lease fence");
        }
    }

    /// Registers, retrying while the server is unreachable. On the first
    /// registration a refusal (bad key, invalid node) is returned at once;
    /// later ones retry forever since running work depends on getting back
    /// in touch.
    async fn register(&self, initial: bool) -> anyhow::Result<Registered> {
        let mut backoff = Backoff::new("register");
        loop {
            let mut registration = self.registration.clone();
            registration.running = self
                .shared
                .lock()
                .iter()
                .filter(|(_, t)| !t.orphaned && matches!(t.work, Work::Running(_)))
                .map(|(id, _)| id.clone())
                .collect();
            match self.client.register(&registration).await {
                Ok(registered) => {
                    backoff.succeeded();
                    tracing::info!(
                        node = %self.registration.name,
                        node_id = %registered.node_id,
                        heartbeat_interval_ms = registered.heartbeat_interval_ms,
                        "registered with the server"
                    );
                    return Ok(registered);
                }
                Err(error @ ClientError::Tls { .. }) if initial => {
                    return Err(error).context("cannot register this node");
                }
                Err(error) if initial && (!error.is_retryable() || error.is_auth()) => {
                    return Err(error).context("the server refused to register this node");
                }
                Err(error) => tokio::time::sleep(backoff.failed(&error)).await,
            }
        }
    }

    /// The reconcile loop; returns only when cancelled.
    async fn sync_forever(&mut self) {
        let mut backoff = Backoff::new("sync");
        loop {
            let Some(node) = self.node.clone() else {
                // Retrying forever: the error arm cannot be reached.
                if let Ok(registered) = self.register(false).await {
                    self.node = Some(registered);
                }
                continue;
            };
            // A sync after a long silence (this process was paused, say)
            // must not report work its lease no longer covers as running.
            self.shared.fence_if_due(Instant::now());
            // A workload that started since the last renewal (starts run
            // off this loop and wake it) must be in the fence's file before
            // the sync below tells the server it runs: the agent may be
            // paused right after.
            self.tell_fence();
            let changed = &self.shared.wakers.changed;
            // What the request below reports covers every change so far.
            consume_permit(changed).await;
            let (wait_ms, timeout) = self.sync_timing(&node);
            let req = SyncRequest {
                observed: self.observed(),
                wait_ms,
                gpus: self.telemetry.sample(),
                images: self.runtime.cached_images(),
                weights: Some(self.weights.report()),
                parks_ended: self.weights.ended(),
                busy_ok: node.busy_answers,
            };
            let sent = Instant::now();
            let result = tokio::select! {
                result = self.client.sync_within(&node.node_id, &req, timeout) => result,
                () = changed.notified() => {
                    tracing::debug!("local change, resending sync");
                    continue;
                }
            };
            match result {
                Ok(resp) if resp.reregister => {
                    backoff.succeeded();
                    tracing::info!(node_id = %node.node_id, "server asks to register again");
                    self.node = None;
                }
                Ok(SyncResponse {
                    busy_retry_ms: Some(retry_ms),
                    lease_ms,
                    ..
                }) => {
                    // The server renewed the lease and took nothing else:
                    // keep running what runs, apply nothing (the answer's
                    // assignments are not the node's), acknowledge no
                    // park's end, and send the whole report again later.
                    backoff.succeeded();
                    if let Some(times) = &self.sync_times {
                        times.busy();
                    }
                    self.shared.node_lease().renewed(Instant::now(), lease_ms);
                    self.tell_fence();
                    let retry = Duration::from_millis(retry_ms);
                    tracing::debug!(
                        retry_ms = retry.as_millis() as u64,
                        "server busy, lease renewed"
                    );
                    tokio::time::sleep(spread(retry.max(MIN_SYNC_SPACING))).await;
                }
                Ok(resp) => {
                    backoff.succeeded();
                    if let Some(times) = &self.sync_times {
                        times.answered(sent.elapsed(), Duration::from_millis(wait_ms));
                    }
                    self.metrics.synced(
                        node.node_id.as_str(),
                        Utc::now(),
                        &req.observed,
                        &req.gpus,
                    );
                    self.shared
                        .node_lease()
                        .renewed(Instant::now(), resp.lease_ms);
                    // The server billed the ends this sync carried.
                    self.weights.acknowledge(&req.parks_ended);
                    self.apply(resp.assignments, &resp.unpark);
                    self.open_sessions(resp.sessions);
                    self.tell_fence();
                    let elapsed = sent.elapsed();
                    if elapsed < MIN_SYNC_SPACING {
                        tokio::select! {
                            () = tokio::time::sleep(MIN_SYNC_SPACING - elapsed) => {}
                            () = self.shared.wakers.changed.notified() => {}
                        }
                    }
                }
                Err(error) if error.is_not_found() => {
                    tracing::info!(node_id = %node.node_id, "server does not know this node, registering again");
                    self.node = None;
                }
                Err(error) => {
                    self.metrics.sync_failed();
                    if let Some(times) = &self.sync_times {
                        times.failed();
                    }
                    for t in self.shared.lock().values_mut() {
                        t.flush_waiting_since = None;
                    }
                    tokio::time::sleep(backoff.failed(&error)).await;
                }
            }
        }
    }

    /// The long-poll wait to ask for, and when to give a sync up. Under a
    /// node lease both are half a heartbeat interval (a quarter lease at
    /// most): the lease counts from the last answer, so a server that stops
    /// answering mid-poll must leave time to fail over to another before
    /// the lease runs out.
    fn sync_timing(&self, node: &Registered) -> (u64, Duration) {
        let interval = node.heartbeat_interval_ms;
        let lease = self.shared.node_lease().length;
        if let Some(lease) = lease {
            let quarter = u64::try_from(lease.as_millis() / 4).unwrap_or(u64::MAX);
            let half = (interval / 2).min(quarter).max(1);
            (
                self.config.sync_wait_ms.min(half),
                Duration::from_millis(self.config.sync_wait_ms.min(half) + half)
                    .min(Duration::from_millis(self.config.sync_wait_ms) + client::LONG_POLL_SLACK),
            )
        } else {
            let wait = self.config.sync_wait_ms.min(interval);
            (wait, Duration::from_millis(wait) + client::LONG_POLL_SLACK)
        }
    }

    /// Every instance to report: orphans excluded, and work stopped for
    /// the lease until it has exited (the server must not take it back
    /// as running).
    fn observed(&self) -> Vec<ObservedInstance> {
        let mut report: Vec<ObservedInstance> = self
            .shared
            .lock()
            .iter_mut()
            .filter(|(_, t)| !(t.orphaned || (t.fenced && t.running())))
            .map(|(id, t)| {
                let mut observed = t.observed(id);
                t.exit_reported |= matches!(observed.phase, ObservedPhase::Exited { .. });
                if matches!(t.work, Work::Starting { .. }) {
                    observed.message = self.runtime.progress(id);
                }
                if let Some(killed) = self.fenced_end(t) {
                    observed.at = observed.at.min(killed);
                }
                observed
            })
            .collect();
        report.extend(self.not_started.iter().map(|(id, at)| not_started(id, *at)));
        report
    }

    /// When the fence process saw `t`'s exited work end, if it stopped it
    /// (the lease ran out while this agent was paused): this process saw
    /// the exit only once it ran again, and the work is billed to its
    /// kill, not to that. A record from before the work started is another
    /// group's of the same id.
    fn fenced_end(&self, t: &Tracked) -> Option<chrono::DateTime<Utc>> {
        let w = t.workload()?;
        w.exit()?;
        let ms = fence::ended_at(&self.fence_file(), w.process_group()?)?;
        let at = chrono::DateTime::from_timestamp_millis(i64::try_from(ms).ok()?)?;
        (at >= w.started_at()).then_some(at)
    }

    /// Applies the server's desired work; `unpark`: replicas of deleted
    /// endpoints, neither to park nor to keep parked.
    fn apply(&mut self, assignments: Vec<Assignment>, unpark: &[InstanceId]) {
        let listed: HashSet<InstanceId> =
            assignments.iter().map(|a| a.instance_id.clone()).collect();
        let mut to_start = Vec::new();
        let mut forgotten = Vec::new();
        {
            let mut instances = self.shared.lock();
            for a in assignments {
                match instances.get_mut(&a.instance_id) {
                    Some(t) => {
                        if t.orphaned {
                            continue;
                        }
                        t.grace = Duration::from_millis(a.stop_grace_ms);
                        if a.stop && !t.server_stop {
                            t.server_stop = true;
                            if let Some(p) = t.workload().filter(|p| p.exit().is_none()) {
                                tracing::info!(instance_id = %a.instance_id, grace_ms = a.stop_grace_ms, "server asks to stop instance");
                                p.stop(t.grace);
                            }
                        }
                    }
                    None if self.seen.contains(&a.instance_id) => {
                        tracing::debug!(instance_id = %a.instance_id, "ignoring assignment of an instance this agent already ran");
                    }
                    None if a.stop => {
                        if !self.not_started.contains_key(&a.instance_id) {
                            tracing::info!(instance_id = %a.instance_id, "stopped before it started: reporting it ended");
                            self.not_started.insert(a.instance_id.clone(), Utc::now());
                        }
                    }
                    None => to_start.push(a),
                }
            }
            for (id, t) in instances.iter_mut() {
                let unshipped = t
                    .workload()
                    .filter(|p| p.exit().is_some())
                    .map_or(0, |p| p.logs().pending());
                if unshipped == 0 || t.flush_given_up {
                    continue;
                }
                let since = *t.flush_waiting_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= LOG_FLUSH_DEADLINE {
                    tracing::warn!(instance_id = %id, unshipped, "server keeps refusing log lines, reporting the exit anyway");
                    t.flush_given_up = true;
                }
            }
            // A replica the server stopped that exited cleanly parks
            // (a scale-down) unless its endpoint was deleted (told once,
            // remembered: the exit may come syncs later); decided once,
            // before it may be forgotten.
            let now = Utc::now();
            for (id, t) in instances.iter_mut() {
                t.no_park |= unpark.contains(id);
                if t.park_decided || !t.server_stop {
                    continue;
                }
                let Some(exit) = t.workload().and_then(|w| w.exit()) else {
                    continue;
                };
                t.park_decided = true;
                if let (Some((w, _)), true, false) = (&t.weights, exit.stop_requested, t.no_park) {
                    if self.weights.park(id, w, now) {
                        tracing::info!(instance_id = %id, key = %w.key, keep_s = w.keep_parked_s, "replica parked");
                    }
                }
            }
            // Reported until the server stops listing it.
            self.not_started.retain(|id, _| listed.contains(id));
            for r in self.weights.expire(now) {
                tracing::info!(instance_id = %r, "parked replica released");
            }
            for r in unpark {
                if self.weights.release(r, now) {
                    tracing::info!(instance_id = %r, "parked replica of a deleted endpoint released");
                }
            }
            instances.retain(|id, t| {
                let keep = Self::keep(id, t, &listed);
                if !keep {
                    forgotten.push(id.clone());
                }
                keep
            });
        }
        for id in forgotten {
            self.runtime.release(&id);
        }
        for a in to_start {
            self.start(a);
        }
    }

    /// Whether to keep tracking an instance the server lists (or not):
    /// one it no longer lists is stopped, and forgotten once it ended (work
    /// the lease's fence stopped: once its exit was reported).
    fn keep(id: &InstanceId, t: &mut Tracked, listed: &HashSet<InstanceId>) -> bool {
        {
            {
                if listed.contains(id) && !t.orphaned {
                    return true;
                }
                // Work the lease's fence stopped, which the server ended
                // meanwhile (lost, then not reported by the first sync
                // back, while its end was not yet reaped): kept, already
                // stopping, until its exit has been reported, so that the
                // server learns when it ended and bills it to then.
                if t.fenced && !t.orphaned && !t.exit_reported {
                    return true;
                }
                if matches!(t.work, Work::Starting { .. }) {
                    // Stopped as soon as it started (see `Shared::started`).
                    t.orphaned = true;
                    return true;
                }
                match t.workload().filter(|p| p.exit().is_none()).cloned() {
                    Some(p) => {
                        if !t.orphaned {
                            tracing::warn!(instance_id = %id, pid = p.pid(), "server no longer lists running instance, stopping orphan");
                            t.orphaned = true;
                            p.stop(ORPHAN_GRACE);
                        }
                        true
                    }
                    // Finished (or an orphan that ended): forget it.
                    _ => false,
                }
            }
        }
    }

    /// Starts an assignment; a spawn error becomes `FailedToStart`.
    fn start(&mut self, a: Assignment) {
        self.seen.insert(a.instance_id.clone());
        let default_dir = self
            .config
            .work_dir
            .join("instances")
            .join(a.instance_id.as_str());
        // An absolute workdir replaces the default; a relative one lands
        // inside it.
        let workdir = match &a.workdir {
            Some(dir) => default_dir.join(dir),
            None => default_dir,
        };
        let mut vendors = Vec::new();
        for index in &a.gpu_indices {
            match self.vendors.get(index) {
                Some(v) => vendors.push(*v),
                None => {
                    tracing::warn!(instance_id = %a.instance_id, index, "assignment names a gpu index this node does not have")
                }
            }
        }
        // An endpoint replica that declares its weights loads them from
        // the fastest tier this node has; the model server is told which.
        let mut env = a.env;
        let weights = ReplicaWeights::from_env(&env).map(|w| {
            let tier = self.weights.start(&w, Utc::now());
            tracing::info!(instance_id = %a.instance_id, key = %w.key, %tier, "replica weights");
            env.insert(ENV_LOAD_TIER.into(), tier.as_str().into());
            (w, tier)
        });
        let spec = SpawnSpec {
            instance_id: a.instance_id.clone(),
            tenant_id: a.tenant_id,
            command: a.command,
            env,
            workdir,
            gpu_indices: a.gpu_indices,
            gpu_uuids: a.gpu_uuids,
            vendors,
            gpu_slices: a.gpu_slices,
            image: a.image,
            cpu_milli: a.cpu_milli,
            memory_mb: a.memory_mb,
            disk_mb: a.disk_mb,
            registry_auth: a.registry_auth,
        };
        let mut tracked = Tracked::new(
            Work::Starting { since: Utc::now() },
            Duration::from_millis(a.stop_grace_ms),
        );
        tracked.weights = weights;
        self.shared.lock().insert(a.instance_id.clone(), tracked);
        self.shared.wakers.changed.notify_one();
        // Off the sync loop: a container runtime may pull an image first.
        let runtime = self.runtime.clone();
        let shared = self.shared.clone();
        let id = a.instance_id;
        tokio::spawn(async move {
            let result = runtime.start(spec, shared.wakers.clone()).await;
            shared.started(&id, result);
        });
    }

    /// Serves each session into an instance the server listed and this
    /// process has not dialled yet (see [`access`]), off the sync loop.
    fn open_sessions(&mut self, sessions: Vec<flotilla_core::access::AccessSession>) {
        let now = Instant::now();
        // The server lists a session only until it was dialled or given up
        // (well within a minute).
        self.sessions
            .retain(|_, at| now.duration_since(*at) < Duration::from_secs(120));
        let Some(node) = self.node.as_ref().map(|n| n.node_id.clone()) else {
            return;
        };
        for session in sessions {
            if self.sessions.insert(session.id.clone(), now).is_some() {
                continue;
            }
            let place = if self.runtime.simulated() {
                Err("a simulated workload has no process to enter".to_string())
            } else {
                self.shared
                    .lock()
                    .get(&session.instance_id)
                    .and_then(|t| t.workload().filter(|_| t.running()).cloned())
                    .ok_or_else(|| "the instance does not run on this node".to_string())
                    .map(|w| access_place(&w, self.runtime.engine()))
            };
            tokio::spawn(access::serve(
                self.client.clone(),
                node.clone(),
                session,
                place,
            ));
        }
    }

    /// Takes over the workloads an earlier agent process left running on
    /// this node, so that they are reported (and billed) again, stopped
    /// when the server no longer wants them, and fenced by the lease.
    async fn adopt(&mut self) {
        let adopted = match self.runtime.adopt(self.shared.wakers.clone()).await {
            Ok(adopted) => adopted,
            Err(error) => {
                tracing::error!(%error, runtime = %self.runtime.kind(), "cannot list the workloads left by an earlier agent");
                return;
            }
        };
        let mut instances = self.shared.lock();
        for w in adopted {
            tracing::info!(instance_id = %w.instance_id(), pid = w.pid(), "adopted a running workload");
            self.seen.insert(w.instance_id().clone());
            // The server states the grace with the next sync.
            instances.insert(
                w.instance_id().clone(),
                Tracked::new(Work::Running(w), ORPHAN_GRACE),
            );
        }
    }

    /// Stops everything, flushes logs and reports the exits, each step
    /// bounded in time.
    async fn shutdown(&mut self) {
        // Work ended by the agent's own shutdown is a stop, not a failure:
        // it is reported like a stop the server asked for.
        let running: Vec<(InstanceId, Workload, Duration)> = self
            .shared
            .lock()
            .iter_mut()
            .filter(|(_, t)| t.running())
            .filter_map(|(id, t)| {
                t.server_stop = true;
                t.workload().map(|p| (id.clone(), p.clone(), t.grace))
            })
            .collect();
        if !running.is_empty() {
            tracing::info!(count = running.len(), "stopping running instances");
        }
        for (_, p, grace) in &running {
            p.stop((*grace).min(SHUTDOWN_GRACE_MAX));
        }
        let all_exited = async {
            for (_, p, _) in &running {
                p.wait().await;
            }
        };
        let limit = SHUTDOWN_GRACE_MAX + SHUTDOWN_STEP_TIMEOUT + Duration::from_secs(1);
        if tokio::time::timeout(limit, all_exited).await.is_err() {
            tracing::warn!("some instances did not exit in time");
        }

        let flush = async {
            let mut backoff = Backoff::new("final log upload");
            while let Err(error) = ship_pending(&self.shared, &self.client).await {
                tokio::time::sleep(backoff.failed(&error)).await;
            }
        };
        if tokio::time::timeout(SHUTDOWN_STEP_TIMEOUT, flush)
            .await
            .is_err()
        {
            tracing::warn!("could not ship all log lines before shutdown");
        }

        let Some(node) = self.node.clone() else {
            return;
        };
        // Parks live in this process's bookkeeping: they end with it, and
        // the server bills each to now, not to the next agent's first sync.
        let released = self.weights.release_all(Utc::now());
        if !released.is_empty() {
            tracing::info!(count = released.len(), "parked replicas released");
        }
        let req = SyncRequest {
            observed: self.observed(),
            wait_ms: 0,
            gpus: Vec::new(),
            images: None,
            weights: Some(self.weights.report()),
            parks_ended: self.weights.ended(),
            // The last report must be taken: it waits its turn.
            busy_ok: false,
        };
        match tokio::time::timeout(SHUTDOWN_STEP_TIMEOUT, self.client.sync(&node.node_id, &req))
            .await
        {
            Ok(Ok(_)) => tracing::info!(instances = req.observed.len(), "final state reported"),
            Ok(Err(error)) => tracing::warn!(%error, "could not report final state"),
            Err(_) => tracing::warn!("timed out reporting final state"),
        }
    }
}

/// The lease watchdog: apart from the sync loop, so that a sync stuck on a
/// server that stopped answering cannot delay it.
/// Where a running workload can be entered.
fn access_place(w: &Workload, engine: Option<bollard::Docker>) -> access::Place {
    match (w.container(), engine) {
        (Some(c), Some(engine)) => access::Place::Container {
            id: c.container_id.clone(),
            pid: w.pid(),
            engine,
        },
        (Some(_), None) => access::Place::Unknown,
        (None, _) => {
            let ns_pid = w.process_group().unwrap_or(w.pid());
            access::Place::Process {
                ns_pid,
                leader: w.pid(),
                // A sandbox's init is another process than its leader
                // (bubblewrap); without one they are the same.
                sandboxed: ns_pid != w.pid(),
            }
        }
    }
}

async fn fence_forever(shared: Arc<Shared>) {
    loop {
        let stopped = shared.fence_if_due(Instant::now());
        if stopped > 0 {
            shared.wakers.changed.notify_one();
        }
        tokio::time::sleep(LEASE_CHECK).await;
    }
}

/// Ships pending output of every instance every [`LOG_TICK`], or sooner
/// when a buffer fills up; retries with backoff while the server is away.
async fn ship_logs_forever(shared: Arc<Shared>, client: Client) {
    let mut backoff = Backoff::new("log upload");
    loop {
        tokio::select! {
            () = tokio::time::sleep(LOG_TICK) => {}
            () = shared.wakers.logs.notified() => {}
        }
        match ship_pending(&shared, &client).await {
            Ok(()) => backoff.succeeded(),
            Err(error) => tokio::time::sleep(backoff.failed(&error)).await,
        }
    }
}

/// Ships what is pending now, in batches that fit the server's limit on a
/// request body. Stops at the first retryable failure (the caller retries
/// with backoff). A batch refused for good is split in halves until the
/// line at fault is alone; that line is then given up and a marker line
/// ("N lines of output lost") takes its place in the log. Lines of an
/// instance the server does not know are dropped with a warning: there is
/// no log to deliver them to.
async fn ship_pending(shared: &Shared, client: &Client) -> Result<(), ClientError> {
    for (id, p) in shared.workloads() {
        let mut shipped = false;
        let mut max_lines = runtime::SHIP_BATCH_LINES;
        for _ in 0..MAX_BATCHES_PER_ROUND {
            let batch = p.logs().peek_batch(max_lines, runtime::SHIP_BATCH_BYTES);
            let Some(last) = batch.last().map(|l| l.seq) else {
                break;
            };
            let count = batch.len();
            match client.push_logs(&id, batch.clone()).await {
                Ok(()) => {
                    p.logs().ack(last);
                    max_lines = runtime::SHIP_BATCH_LINES;
                }
                Err(error) if error.is_not_found() => {
                    tracing::warn!(instance_id = %id, lines = p.logs().pending(), %error, "server does not know the instance, dropping its log lines");
                    p.logs().discard();
                }
                Err(error) if !error.is_retryable() && count > 1 => {
                    tracing::debug!(instance_id = %id, lines = count, %error, "server refused a log batch, splitting it");
                    max_lines = count / 2;
                }
                Err(error) if !error.is_retryable() => {
                    tracing::warn!(instance_id = %id, seq = last, %error, "server refused a log line, marking it lost in the log");
                    p.logs().give_up(&batch);
                }
                Err(error) => return Err(error),
            }
            shipped = true;
        }
        if shipped && p.exit().is_some() && p.logs().pending() == 0 {
            // Its exit may now be reported.
            shared.wakers.changed.notify_one();
        }
    }
    Ok(())
}

/// Consumes a stored wake-up permit, if any, without waiting.
async fn consume_permit(notify: &Notify) {
    tokio::select! {
        biased;
        () = notify.notified() => {}
        () = std::future::ready(()) => {}
    }
}

/// `d` spread uniformly over half to one and a half times itself, so that
/// agents told to come back together (a busy server's answers) do not.
fn spread(d: Duration) -> Duration {
    d.mul_f64(rand::random::<f64>() + 0.5)
}

/// Retry delays (250 ms doubling to 5 s) and log throttling for one kind of
/// server call: the first failure and every 20th warn, the rest are debug.
struct Backoff {
    what: &'static str,
    next: Duration,
    failures: u32,
}

impl Backoff {
    fn new(what: &'static str) -> Self {
        Self {
            what,
            next: BACKOFF_MIN,
            failures: 0,
        }
    }

    /// Records a failure; returns how long to wait before retrying.
    fn failed(&mut self, error: &ClientError) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(BACKOFF_MAX);
        self.failures += 1;
        let retry_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        if self.failures == 1 || self.failures.is_multiple_of(20) {
            tracing::warn!(call = self.what, failures = self.failures, retry_ms, %error, "server call failed, retrying");
        } else {
            tracing::debug!(call = self.what, failures = self.failures, retry_ms, %error, "server call failed, retrying");
        }
        delay
    }

    fn succeeded(&mut self) {
        if self.failures > 0 {
            tracing::info!(
                call = self.what,
                failures = self.failures,
                "server reachable again"
            );
        }
        self.next = BACKOFF_MIN;
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err() -> ClientError {
        ClientError::Api {
            status: 503,
            code: String::new(),
            message: String::new(),
            field: None,
            retry_after: None,
        }
    }

    #[test]
    fn backoff_doubles_to_five_seconds_and_resets() {
        let mut b = Backoff::new("test");
        let delays: Vec<u64> = (0..7)
            .map(|_| b.failed(&err()).as_millis() as u64)
            .collect();
        assert_eq!(delays, vec![250, 500, 1000, 2000, 4000, 5000, 5000]);
        b.succeeded();
        assert_eq!(b.failed(&err()), BACKOFF_MIN);
    }

    #[test]
    fn the_lease_is_counted_from_the_answer_and_work_stops_once_it_ran_out() {
        let t0 = Instant::now();
        let mut l = NodeLease::default();
        assert!(l.stop_from().is_none(), "no lease stated, nothing to fence");
        l.renewed(t0, None);
        assert!(l.stop_from().is_none());
        // Registration: a 15 s lease, syncs every 5 s.
        l.stated(Some(15_000), 5_000);
        assert!(l.stop_from().is_none(), "counts from the first answer");
        l.renewed(t0, Some(15_000));
        let (from, grace) = l.stop_from().unwrap();
        assert_eq!(from, t0 + Duration::from_secs(15), "not before its end");
        assert_eq!(grace, Duration::from_millis(2_500));
        // Killed before the server (lease end + one interval) gives it away.
        assert!(from + grace < t0 + Duration::from_secs(20));
        // A later answer moves it; one from an older server keeps it.
        l.renewed(t0 + Duration::from_secs(5), Some(15_000));
        l.renewed(t0 + Duration::from_secs(6), None);
        assert_eq!(l.stop_from().unwrap().0, t0 + Duration::from_secs(20));
        // A lease taken over from a killed agent holds until renewed, and
        // never shortens one this process holds.
        let mut fresh = NodeLease::default();
        fresh.inherited(t0 + Duration::from_secs(3), Duration::from_secs(1));
        assert_eq!(
            fresh.stop_from(),
            Some((t0 + Duration::from_secs(3), Duration::from_secs(1)))
        );
        l.inherited(t0 + Duration::from_secs(3), Duration::from_secs(1));
        assert_eq!(l.stop_from().unwrap().0, t0 + Duration::from_secs(20));
    }

    #[test]
    fn config_defaults() {
        let c = AgentConfig::new("http://127.0.0.1:7420", "tok", "n1", "/tmp/w");
        assert_eq!(c.sync_wait_ms, 10_000);
        assert!(c.simulate_gpus.is_none() && c.region.is_none() && c.pool.is_none());
        assert_eq!(c.work_dir, PathBuf::from("/tmp/w"));
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("tok\"") && shown.contains("<redacted>"),
            "{shown}"
        );
    }
}
