//! The long-running processes: `flotilla up` (control plane and a local
//! agent in one process), `flotilla server` and `flotilla agent`.
//!
//! This module wires the library crates together and owns process concerns
//! only: data directory, listener, signals, logging, and the order of a
//! graceful shutdown (agent first, so it can stop running work and report
//! it while the server still listens; then the server). It holds no
//! control-plane logic of its own.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use flotilla_core::catalog::Catalog;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::config::{self, Credentials};
pub(crate) use crate::daemon::{
    certificate_names, data_dir, hostname, init_logging, Signals, TlsArgs,
};
use crate::output::say;

/// GPUs `flotilla up` simulates on a machine without an NVIDIA driver.
pub const DEFAULT_SIMULATED_GPUS: &str = "4xH100,2xL40S";
/// Where `up` and `server` listen by default.
pub const DEFAULT_BIND: &str = "127.0.0.1:7420";
/// How long the agent may take to stop its work on shutdown.
const AGENT_STOP_TIMEOUT: Duration = Duration::from_secs(60);
/// Time a simulated fleet is given to stop its nodes: each stops its work
/// and reports it, thousands at once through one connection pool.
const FLEET_STOP_TIMEOUT: Duration = Duration::from_secs(120);
/// Pause between the agent's final report and the server's shutdown.
const FOLLOWER_GRACE: Duration = Duration::from_millis(1200);
/// How long the server may take to drain on shutdown.
const SERVER_STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// Options shared by `up` and `server`.
#[derive(Debug, Args)]
pub struct ServerArgs {
    /// Address to listen on.
    #[arg(long, default_value = DEFAULT_BIND, value_name = "ADDR")]
    pub bind: String,
    /// Database URL (`sqlite://PATH?mode=rwc` or `postgres://…`); default:
    /// SQLite in the data directory.
    #[arg(
        long,
        env = "FLOTILLA_DATABASE_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub database_url: Option<String>,
    /// Directory for the database, the agent token and the local agent's
    /// work; default: the platform data directory + `flotilla`.
    #[arg(long, env = "FLOTILLA_DATA_DIR", value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Seconds without a sync after which a node is unreachable and its
    /// instances lost.
    #[arg(long, default_value_t = 15, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub heartbeat_timeout: u64,
    /// Requests per second allowed per API key (bursts of twice that).
    #[arg(long, default_value_t = 100, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub rate_limit: u32,
    /// Machine-protocol requests per second allowed per API key (agent
    /// syncs and logs, gateway reports, usage batches; bursts of twice
    /// that): a budget apart from --rate-limit, as one key often serves a
    /// whole fleet of agents.
    #[arg(long, default_value_t = 2_000, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub protocol_rate_limit: u32,
    /// Requests per second allowed per source address without a valid
    /// API key (bursts of twice that); more answer 429.
    #[arg(long, default_value_t = 10, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub anonymous_rate_limit: u32,
    /// Agent sync reports one server works on at once; past that, an
    /// agent's sync renews its node's lease and is asked to come back
    /// (a busy answer) rather than queue for the database.
    #[arg(long, default_value_t = 8, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub sync_reports_in_flight: u32,
    /// Placement policy: flotilla (default), fgd, bestfit, dotprod,
    /// gpupacking, gpuclustering or random.
    #[arg(long, default_value = "flotilla", value_name = "POLICY", value_parser = parse_policy)]
    pub placement_policy: flotilla_sched::Policy,
    /// Let budget webhooks reach loopback, private, link-local,
    /// unique-local and unspecified addresses (a receiver on this host or
    /// the operator's network). Off by default: a tenant admin sets the
    /// URL, and the server must not be made to call inward.
    #[arg(long)]
    pub webhook_allow_private: bool,
    /// Let the control plane's calls for tenants (queue-trigger brokers,
    /// budget webhooks, registry logins) reach this inward destination:
    /// `CIDR`, `CIDR:PORT` or `CIDR:LOW-HIGH`, e.g. `10.2.0.0/16:5672`
    /// (repeatable). Loopback, private, link-local and the like are
    /// refused otherwise. On `flotilla up` the same rules let the local
    /// node's workloads through its firewall too: one egress policy.
    #[arg(long, value_name = "CIDR[:PORTS]")]
    pub allow_egress: Vec<flotilla_egress::AllowRule>,
    /// Seconds between billing steps: spot prices recorded, budgets
    /// checked, webhooks delivered.
    #[arg(long, default_value_t = 30, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub billing_every: u64,
    /// Percent of a provider's gross revenue the operator keeps in payout
    /// statements: a decimal from 0 to 100, e.g. `15` or `12.5`.
    #[arg(long, default_value = "15", value_name = "PERCENT", value_parser = parse_fee_percent)]
    pub operator_fee_percent: rust_decimal::Decimal,
    /// Node pools grown and shrunk through a capacity provider.
    #[command(flatten)]
    pub node_pools: crate::nodepools::NodePoolArgs,
    /// HTTPS.
    #[command(flatten)]
    pub tls: TlsArgs,
}

/// An operator fee: a plain decimal between 0 and 100 inclusive.
fn parse_fee_percent(s: &str) -> Result<rust_decimal::Decimal, String> {
    let d: rust_decimal::Decimal = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a decimal number (e.g. 15 or 12.5)"))?;
    if d.is_sign_negative() || d > rust_decimal::Decimal::ONE_HUNDRED {
        return Err(format!("must be between 0 and 100, got {s}"));
    }
    Ok(d.normalize())
}

fn parse_policy(s: &str) -> Result<flotilla_sched::Policy, String> {
    flotilla_server::schedule::parse_policy(s).ok_or_else(|| {
        let names: Vec<String> = flotilla_sched::Policy::ALL
            .iter()
            .map(|p| p.name().to_lowercase())
            .collect();
        format!("unknown policy `{s}`; one of {}", names.join(", "))
    })
}

impl ServerArgs {
    fn config(&self) -> flotilla_server::ServerConfig {
        flotilla_server::ServerConfig {
            heartbeat_timeout: std::time::Duration::from_secs(self.heartbeat_timeout),
            rate_limit_per_second: self.rate_limit,
            protocol_rate_limit_per_second: self.protocol_rate_limit,
            anonymous_rate_limit_per_second: self.anonymous_rate_limit,
            sync_reports_in_flight: self.sync_reports_in_flight as usize,
            placement_policy: self.placement_policy,
            webhook_allow_private: self.webhook_allow_private,
            allow_egress: self.allow_egress.clone(),
            billing_every: std::time::Duration::from_secs(self.billing_every),
            operator_fee_percent: self.operator_fee_percent,
            ..Default::default()
        }
    }
}

/// Options of the container runtime (`--runtime container`), shared by
/// `up` and `agent`.
#[derive(Debug, Clone, Args)]
pub struct ContainerArgs {
    /// The container engine's API: Docker's socket, or Podman's
    /// Docker-compatible service (`scripts/podman-service` prints one).
    #[arg(long, value_name = "unix:///PATH", env = "DOCKER_HOST")]
    pub docker_host: Option<String>,
    /// How GPUs reach containers: `simulated` (variables only),
    /// `device-requests` (the NVIDIA container runtime) or `cdi`; default:
    /// `simulated` for simulated GPUs, else `device-requests`.
    #[arg(long, value_name = "MODE")]
    pub container_gpus: Option<flotilla_agent::container::GpuPassthrough>,
    /// Address tenants reach this node at, shown in the URLs of published
    /// container ports (default `127.0.0.1`).
    #[arg(long, value_name = "HOST")]
    pub public_host: Option<String>,
}

/// How a node runs workloads: the options `up` and `agent` share, declared
/// and applied to the agent's configuration in one place.
#[derive(Debug, Clone, Args)]
pub struct WorkloadArgs {
    /// Where workloads run: `process` (sandboxed processes) or
    /// `container`.
    #[arg(long, value_name = "RUNTIME", default_value = "process")]
    pub runtime: flotilla_agent::runtime::RuntimeKind,
    /// As root without bubblewrap, run workloads anyway, separated only by
    /// per-tenant users (they see the host's files and processes).
    #[arg(long)]
    pub insecure_process_runtime: bool,
    /// A host path shown inside every sandboxed workload, at the same path:
    /// `PATH` read-only or `PATH:rw` (repeatable). Every tenant on the node
    /// sees it: for shared weights, datasets or scratch, never secrets.
    #[arg(long, value_name = "PATH[:rw]")]
    pub sandbox_share: Vec<flotilla_agent::runtime::sandbox::SharedPath>,
    /// The process runtime's default limits.
    #[command(flatten)]
    pub limits: crate::limits::LimitArgs,
    /// The container runtime's options.
    #[command(flatten)]
    pub containers: ContainerArgs,
    /// Size limit of the node's image cache (container runtime), in GB:
    /// past it the least recently used images no container uses are
    /// removed. 0: no limit.
    #[arg(long, value_name = "GB", default_value_t = flotilla_agent::image_cache::DEFAULT_IMAGE_CACHE_GB)]
    pub image_cache_gb: u64,
    /// Size limit of the node's disk cache of endpoint replicas' model
    /// weights, in GB (least recently used evicted first).
    #[arg(long, value_name = "GB", default_value_t = flotilla_agent::weights::DEFAULT_WEIGHT_CACHE_GB)]
    pub weight_cache_gb: u64,
    /// Host memory parked endpoint replicas may hold, in GB (oldest park
    /// dropped first); default: half the node's memory.
    #[arg(long, value_name = "GB")]
    pub parked_gb: Option<u64>,
    /// Keep an ended instance's working directory this long for debugging
    /// (`30m`, `1h`, at most `7d`); by default it is removed once the
    /// instance's output was shipped.
    #[arg(long, value_name = "DURATION", value_parser = flotilla_agent::runtime::leftovers::parse_keep)]
    pub keep_workdirs: Option<std::time::Duration>,
}

impl WorkloadArgs {
    /// Sets the agent's runtime, sandbox, container and image cache
    /// options.
    fn apply(self, config: &mut flotilla_agent::AgentConfig) {
        config.runtime = self.runtime;
        config.insecure_process_runtime = self.insecure_process_runtime;
        config.sandbox_shares = with_own_binary(self.sandbox_share);
        config.limit_defaults = self.limits.defaults();
        config.docker_host = self.containers.docker_host;
        config.container_gpus = self.containers.container_gpus;
        config.public_host = self.containers.public_host;
        config.image_cache_bytes =
            (self.image_cache_gb > 0).then(|| self.image_cache_gb.saturating_mul(1_000_000_000));
        config.weight_cache_bytes = self.weight_cache_gb.saturating_mul(1_000_000_000);
        config.parked_bytes = self.parked_gb.map(|gb| gb.saturating_mul(1_000_000_000));
        config.keep_workdirs = self.keep_workdirs;
    }
}

/// Options of `up` beyond the server's.
#[derive(Debug, Args)]
pub struct UpArgs {
    /// Server options.
    #[command(flatten)]
    pub server: ServerArgs,
    /// Simulated GPUs for the local node, e.g. `4xH100,2xL40S`; default:
    /// real GPUs through NVML, or that inventory when no driver is found.
    #[arg(long, value_name = "SPEC")]
    pub simulate_gpus: Option<String>,
    /// The local node's reported size.
    #[command(flatten)]
    pub host: SimulatedHost,
    /// Name of the local node; default: the hostname.
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,
    /// Address the inference gateway listens on.
    #[arg(long, default_value = crate::gateway::DEFAULT_GATEWAY_BIND, value_name = "ADDR")]
    pub gateway_bind: String,
    /// Requests per second the gateway allows per source address without
    /// a valid inference key (bursts of twice that); more answer 429.
    #[arg(long, default_value_t = crate::gateway::DEFAULT_ANONYMOUS_RATE_LIMIT, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub gateway_anonymous_rate_limit: u32,
    /// How the local node runs workloads.
    #[command(flatten)]
    pub workloads: WorkloadArgs,
}

/// The CPU and memory a node reports instead of the host's: to try a
/// machine of another shape (with simulated GPUs), or to keep some of the
/// host for itself. Requests that name no CPU or memory get a GPU's share
/// of what the node reports.
#[derive(Debug, Clone, Args)]
pub struct SimulatedHost {
    /// CPUs to report (e.g. `2` or `1.5`); default: the host's.
    #[arg(long, value_name = "N", value_parser = parse_cpus)]
    pub simulate_cpus: Option<u64>,
    /// Memory to report, in GB (10^9 bytes); default: the host's.
    #[arg(long, value_name = "GB", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub simulate_memory_gb: Option<u64>,
}

impl SimulatedHost {
    /// `(milli-cores, MiB)` for the agent's configuration.
    fn reported(&self) -> (Option<u64>, Option<u64>) {
        (
            self.simulate_cpus,
            self.simulate_memory_gb
                .map(|gb| gb.saturating_mul(1_000_000_000) / (1024 * 1024)),
        )
    }
}

/// A CPU count as milli-cores: a positive decimal with at most three
/// places.
fn parse_cpus(s: &str) -> Result<u64, String> {
    let d: rust_decimal::Decimal = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of CPUs (e.g. 2 or 1.5)"))?;
    let milli = d * rust_decimal::Decimal::ONE_THOUSAND;
    if milli < rust_decimal::Decimal::ONE
        || milli.fract() != rust_decimal::Decimal::ZERO
        || milli > rust_decimal::Decimal::from(1_024_000)
    {
        return Err(format!(
            "must be between 0.001 and 1024, in steps of 0.001; got {s}"
        ));
    }
    u64::try_from(milli).map_err(|_| format!("`{s}` is out of range"))
}

/// Options of `agent`.
#[derive(Debug, Args)]
pub struct AgentArgs {
    /// Agent token (from the server's data directory, `agent.token`).
    #[arg(long, env = "FLOTILLA_AGENT_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// A node-pool machine's one-time join token, instead of `--token`:
    /// traded once for this machine's own agent key, node name and pool
    /// (kept in the work directory, so a restarted agent does not need
    /// the spent token again).
    #[arg(
        long,
        env = "FLOTILLA_JOIN_TOKEN",
        hide_env_values = true,
        conflicts_with = "token"
    )]
    pub join_token: Option<String>,
    /// Node name; default: the hostname.
    #[arg(long)]
    pub name: Option<String>,
    /// Region of the node (default `local`).
    #[arg(long)]
    pub region: Option<String>,
    /// Node pool (default `default`).
    #[arg(long)]
    pub pool: Option<String>,
    /// Simulated GPUs, e.g. `4xH100,2xL40S`; default: real GPUs via NVML.
    #[arg(long, value_name = "SPEC")]
    pub simulate_gpus: Option<String>,
    /// With `--simulate-gpus`: a JSON file standing in for the GPU driver,
    /// read at every sync: `{"0": {"last_xid": 79, "temperature_c": 95,
    /// "gpu_util_pct": 40, "fb_used_mib": 2048}}` by GPU index. Injects
    /// XID and ECC errors, heat and utilisation into simulated GPUs.
    #[arg(long, value_name = "FILE", requires = "simulate_gpus")]
    pub simulated_telemetry: Option<PathBuf>,
    /// The node's reported size.
    #[command(flatten)]
    pub host: SimulatedHost,
    /// Lets workloads reach an inward network anyway (private, loopback,
    /// link-local: refused by default), `CIDR[:PORT[-PORT]]`, e.g.
    /// `10.2.0.0/16:5432` (repeatable). A loopback rule with ports
    /// (`127.0.0.1:5672`) reaches those ports of the host's loopback.
    /// (`flotilla up` takes one `--allow-egress` for its workloads and its
    /// server alike.)
    #[arg(long, value_name = "CIDR[:PORTS]")]
    pub allow_egress: Vec<flotilla_egress::AllowRule>,
    /// Serve the agent's own Prometheus metrics (sync outcomes, workloads,
    /// GPU readings under DCGM's names) at `http://ADDR/metrics`, without
    /// a key: bind an address only the monitoring network reaches.
    #[arg(long, value_name = "ADDR")]
    pub metrics_bind: Option<std::net::SocketAddr>,
    /// Directory for the instances' working directories and logs;
    /// default: the platform data directory + `flotilla/agent`.
    #[arg(long, value_name = "DIR")]
    pub work_dir: Option<PathBuf>,
    /// How this node runs workloads.
    #[command(flatten)]
    pub workloads: WorkloadArgs,
    /// Run N simulated nodes in this process instead of one node: a load
    /// generator for the control plane, real on the wire. Each node is a
    /// whole agent (its own name `NAME-00000`..., registration, key, lease
    /// and sync loop) with `--simulate-gpus` GPUs; their workloads are
    /// simulated in-process (`sleep S` runs S seconds, anything else until
    /// stopped), reported and metered as real ones.
    #[arg(
        long,
        value_name = "N",
        requires = "simulate_gpus",
        conflicts_with = "join_token"
    )]
    pub simulate_fleet: Option<usize>,
    /// With `--simulate-fleet`: a file of agent keys, one per line, one for
    /// each node in order, instead of one `--token` for all of them.
    #[arg(long, value_name = "FILE", requires = "simulate_fleet")]
    pub fleet_tokens: Option<PathBuf>,
    /// With `--simulate-fleet`: write the fleet's statistics (nodes
    /// registered, syncs, their timings, running workloads) to this JSON
    /// file every 2 s.
    #[arg(long, value_name = "FILE", requires = "simulate_fleet")]
    pub fleet_stats: Option<PathBuf>,
}

fn check_simulated(spec: &str) -> Result<()> {
    flotilla_core::node::parse_simulated_gpus(spec, &Catalog::default())
        .map(drop)
        .map_err(|e| anyhow!("--simulate-gpus: {}", e.message))
}

/// Checks what a node is asked to run before anything starts (`up` and
/// `agent` alike): the simulated GPUs parse and the workload runtime can
/// run on this machine.
fn check_node(simulate_gpus: Option<&str>, workloads: &WorkloadArgs) -> Result<()> {
    if let Some(spec) = simulate_gpus {
        check_simulated(spec)?;
    }
    crate::preflight::check(workloads.runtime, workloads.insecure_process_runtime)
}

/// Binds the API listener and derives the URL clients and the local agent
/// use (a wildcard address is reached through loopback).
async fn bind(addr: &str, https: bool) -> Result<(TcpListener, String)> {
    let listener = TcpListener::bind(addr).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            let host = addr.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
            anyhow!("{addr} is in use: pass --bind {host}:PORT")
        } else {
            anyhow!("cannot listen on {addr}: {e}")
        }
    })?;
    let local = listener
        .local_addr()
        .with_context(|| format!("reading the address of {addr}"))?;
    Ok((listener, url_for(local, https)))
}

fn url_for(addr: SocketAddr, https: bool) -> String {
    let ip = match addr.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => std::net::Ipv6Addr::LOCALHOST.into(),
        ip => ip,
    };
    let scheme = if https { "https" } else { "http" };
    format!("{scheme}://{}", SocketAddr::new(ip, addr.port()))
}

/// The control plane, started: the serve task and its shutdown switch.
struct RunningServer {
    url: String,
    data_dir: PathBuf,
    task: JoinHandle<Result<()>>,
    stop: oneshot::Sender<()>,
    operator_key: Option<String>,
    agent_token: String,
    /// The certificate it serves, when it serves HTTPS.
    tls: Option<flotilla_tls::ServerTls>,
    /// Whether that certificate is the self-signed one in the data
    /// directory (clients pin it) rather than the operator's files.
    self_signed: bool,
}

impl RunningServer {
    /// How clients started beside the server (the local agent, the
    /// gateway) trust it: by the fingerprint of the certificate it serves,
    /// self-signed or not, since they start and stop with it.
    fn local_trust(&self) -> flotilla_client::Trust {
        match &self.tls {
            Some(tls) => flotilla_client::Trust::Pinned(tls.fingerprint()),
            None => flotilla_client::Trust::System,
        }
    }

    /// The pin clients elsewhere use: the self-signed certificate's
    /// fingerprint. (A certificate from the operator's files is trusted
    /// through its CA; pinning it would break at every renewal.)
    fn pin(&self) -> Option<flotilla_tls::Fingerprint> {
        self.tls
            .as_ref()
            .filter(|_| self.self_signed)
            .map(|t| t.fingerprint())
    }
}

async fn start_server(args: ServerArgs) -> Result<RunningServer> {
    let mut server_config = args.config();
    let data_dir = data_dir(args.data_dir)?;
    config::create_private_dir(&data_dir)?;
    server_config.secrets_key_file = Some(data_dir.join("secrets.key"));
    let database_url = args
        .database_url
        .unwrap_or_else(|| default_database_url(&data_dir));
    // Bind and read the certificate before bootstrap: a first start that
    // fails on a taken port or a bad certificate must not mint an
    // operator key that is then never shown.
    let tls = args.tls.load(&data_dir, &certificate_names(&args.bind))?;
    let (listener, url) = bind(&args.bind, tls.is_some()).await?;
    // Machines that join pin a self-signed certificate like any agent.
    let pin = tls
        .as_ref()
        .filter(|_| args.tls.self_signed())
        .map(|t| t.fingerprint().to_string());
    server_config.node_pools =
        crate::nodepools::build(&args.node_pools, &url, pin, &data_dir).await?;
    let store = flotilla_server::open_store(&database_url, server_config.store_timeouts())
        .await
        .map_err(|e| anyhow!("opening the database: {e:#}"))?;
    let boot = flotilla_server::bootstrap(&store, &data_dir)
        .await
        .map_err(|e| anyhow!("initialising the database: {e:#}"))?;
    let (stop, stopped) = oneshot::channel::<()>();
    let stopped = async move {
        let _ = stopped.await;
    };
    let task = match tls.clone() {
        Some(tls) => tokio::spawn(flotilla_server::serve_https(
            store,
            server_config,
            listener,
            tls,
            stopped,
        )),
        None => tokio::spawn(flotilla_server::serve(
            store,
            server_config,
            listener,
            stopped,
        )),
    };
    tracing::info!(%url, data_dir = %data_dir.display(), "server listening");
    Ok(RunningServer {
        url,
        data_dir,
        task,
        stop,
        operator_key: boot.operator_key,
        agent_token: boot.agent_token,
        tls,
        self_signed: args.tls.self_signed(),
    })
}

/// Saves and shows the operator key of a first start, or says where the
/// saved credentials are. Credentials saved for this server's address are
/// kept pointing at it as it serves now: its scheme and, for a self-signed
/// certificate, the pin (so `flotilla up --tls self-signed` after plain
/// starts leaves the CLI working without flags).
fn announce_credentials(server: &RunningServer) {
    let path = config::credentials_path();
    let pin = server.pin().map(|p| p.to_string());
    match (&server.operator_key, path) {
        (Some(key), Ok(path)) => {
            let creds = Credentials {
                tls_fingerprint: pin,
                ..Credentials::new(server.url.clone(), key.clone())
            };
            match config::save(&path, &creds) {
                Ok(()) => say!(
                    "operator API key (shown once, saved to {}):\n  {key}",
                    path.display()
                ),
                Err(e) => {
                    say!("operator API key (shown once; could not save it: {e:#}):\n  {key}")
                }
            }
        }
        (Some(key), Err(e)) => {
            say!("operator API key (shown once; could not save it: {e:#}):\n  {key}")
        }
        (None, Ok(path)) if path.exists() => match follow_server(&path, &server.url, pin) {
            Ok(true) => say!("credentials: {} (now for {})", path.display(), server.url),
            Ok(false) => say!("credentials: {}", path.display()),
            Err(e) => say!("credentials: {} (not updated: {e:#})", path.display()),
        },
        (None, _) => say!(
            "credentials: none saved; use `flotilla login --server {} --api-key KEY`",
            server.url
        ),
    }
}

/// Points saved credentials for the server at `url`'s address (same host
/// and port, either scheme) at `url` and `pin`; whether it changed them.
/// Credentials for another server are left alone.
fn follow_server(path: &Path, url: &str, pin: Option<String>) -> Result<bool> {
    let Some(saved) = config::load(path)? else {
        return Ok(false);
    };
    let authority = |u: &str| {
        u.split_once("://")
            .map_or(u, |(_, rest)| rest)
            .trim_end_matches('/')
            .to_string()
    };
    if saved.server.contains(',') || authority(&saved.server) != authority(url) {
        return Ok(false);
    }
    let https = url.starts_with("https://");
    let updated = Credentials {
        server: url.to_string(),
        // A CA file the operator chose stays; a pin follows the server.
        tls_fingerprint: if https {
            pin.or(saved.tls_fingerprint.clone())
                .filter(|_| saved.ca_cert.is_none())
        } else {
            None
        },
        ca_cert: if https { saved.ca_cert.clone() } else { None },
        api_key: saved.api_key.clone(),
    };
    if updated == saved {
        return Ok(false);
    }
    config::save(path, &updated)?;
    Ok(true)
}

/// Says how the server's certificate is trusted: its fingerprint for
/// clients to pin, or the files it came from.
fn announce_tls(server: &RunningServer) {
    let Some(tls) = &server.tls else {
        return;
    };
    if let Some(pin) = server.pin() {
        let made = if tls.created() { "made now" } else { "kept" };
        say!(
            "TLS:      self-signed certificate ({made}, {}), fingerprint\n  {pin}",
            server.data_dir.join(flotilla_tls::CERT_FILE).display()
        );
        say!("          clients elsewhere: --tls-fingerprint {pin}");
    } else {
        say!(
            "TLS:      certificate fingerprint {} (clients trust it through its CA, or --ca-cert)",
            tls.fingerprint()
        );
    }
}

fn announce_urls(url: &str) {
    say!("API:      {url}");
    say!("console:  {url}/ (sign in with an API key)");
    say!("docs:     {url}{}", flotilla_client::paths::DOCS);
    say!("OpenAPI:  {url}{}", flotilla_client::paths::OPENAPI);
}

/// Awaits a task's end within `limit`, turning panics and timeouts into
/// errors named after `what`.
async fn join_within(what: &str, task: &mut JoinHandle<Result<()>>, limit: Duration) -> Result<()> {
    match tokio::time::timeout(limit, &mut *task).await {
        Ok(Ok(r)) => r.map_err(|e| anyhow!("{what}: {e:#}")),
        Ok(Err(e)) if e.is_panic() => Err(anyhow!("{what} crashed")),
        Ok(Err(_)) => Err(anyhow!("{what} was cancelled")),
        Err(_) => {
            task.abort();
            Err(anyhow!("{what} did not stop within {}s", limit.as_secs()))
        }
    }
}

fn task_ended(
    what: &str,
    r: std::result::Result<Result<()>, tokio::task::JoinError>,
) -> anyhow::Error {
    match r {
        Ok(Ok(())) => anyhow!("{what} stopped unexpectedly"),
        Ok(Err(e)) => anyhow!("{what}: {e:#}"),
        Err(e) if e.is_panic() => anyhow!("{what} crashed"),
        Err(_) => anyhow!("{what} was cancelled"),
    }
}

/// `flotilla up`.
pub async fn up(args: UpArgs) -> Result<ExitCode> {
    init_logging();
    // Before the server binds and "flotilla is up" is printed.
    check_node(args.simulate_gpus.as_deref(), &args.workloads)?;
    let mut signals = Signals::new()?;
    // One egress policy for the node's workloads and the control plane's
    // calls made for tenants (`--allow-egress` on `up`).
    let allow_egress = args.server.allow_egress.clone();
    let mut server = start_server(args.server).await?;

    let simulate = match args.simulate_gpus {
        Some(spec) => Some(spec),
        None => {
            let nvml = tokio::task::spawn_blocking(flotilla_agent::nvml_available)
                .await
                .unwrap_or(false);
            if nvml {
                None
            } else {
                say!("no NVIDIA driver found: simulating {DEFAULT_SIMULATED_GPUS}");
                Some(DEFAULT_SIMULATED_GPUS.to_string())
            }
        }
    };
    let node_name = args.node_name.unwrap_or_else(hostname);
    let mut agent_config = flotilla_agent::AgentConfig::new(
        server.url.clone(),
        server.agent_token.clone(),
        node_name.clone(),
        server.data_dir.join("agent"),
    );
    agent_config.simulate_gpus = simulate.clone();
    agent_config.simulated_host = args.host.reported();
    agent_config.trust = server.local_trust();
    // The node lease's fence, as for `flotilla agent`: if this process is
    // killed, the work is stopped before the lease runs out and the server
    // hands its GPUs to other work (a quick restart takes it over first).
    agent_config.fence_program = std::env::current_exe().ok();
    args.workloads.apply(&mut agent_config);
    agent_config.allow_egress = allow_egress;
    let (agent_stop, agent_stopped) = oneshot::channel::<()>();
    let mut agent = tokio::spawn(flotilla_agent::run(agent_config, async move {
        let _ = agent_stopped.await;
    }));

    // The gateway speaks to the server's API with the local agent's
    // provider key, as a gateway on another machine would.
    // It serves HTTPS with the server's certificate when the server does.
    let gateway = match crate::gateway::start(
        &server.url,
        &server.agent_token,
        server.local_trust(),
        &args.gateway_bind,
        server.tls.clone(),
        args.gateway_anonymous_rate_limit,
    )
    .await
    {
        Ok(g) => g,
        Err(e) => {
            let _ = agent_stop.send(());
            let _ = join_within("agent", &mut agent, AGENT_STOP_TIMEOUT).await;
            let _ = server.stop.send(());
            let _ = join_within("server", &mut server.task, SERVER_STOP_TIMEOUT).await;
            return Err(e);
        }
    };

    say!("flotilla is up");
    announce_urls(&server.url);
    announce_tls(&server);
    say!(
        "gateway:  {} (OpenAI-compatible; /e/<endpoint>/…)",
        gateway.url()
    );
    match &simulate {
        Some(spec) => say!("node:     {node_name} (simulated {spec})"),
        None => say!("node:     {node_name}"),
    }
    say!("data:     {}", server.data_dir.display());
    announce_credentials(&server);
    // Simulated GPUs have no driver behind them: suggest a command that
    // runs anywhere and still shows the GPUs the instance got.
    match &simulate {
        Some(_) => say!("try:      flotilla run --gpus 2 -- sh -c 'echo $CUDA_VISIBLE_DEVICES'"),
        None => say!("try:      flotilla run --gpus 1 -- nvidia-smi"),
    }
    say!("demo:     flotilla demo (an emulated model takes a traffic spike: replicas, latency and cost, live)");
    say!("press Ctrl-C to stop");

    let failure = tokio::select! {
        _ = signals.recv() => None,
        r = &mut server.task => {
            let e = task_ended("server", r);
            // Said now, not after the agent stopped: with no server to
            // report to, its stop can take the whole timeout.
            tracing::error!(error = %format!("{e:#}"), "the server stopped; stopping the agent");
            // The agent cannot report anywhere now; stop it anyway.
            let _ = agent_stop.send(());
            let _ = join_within("agent", &mut agent, AGENT_STOP_TIMEOUT).await;
            return Err(e);
        }
        r = &mut agent => Some(task_ended("agent", r)),
    };

    eprintln!("stopping: the gateway drains, the agent stops its work, then the server");
    let shutdown = async {
        // Requests in flight finish and their usage is delivered while
        // the server still answers.
        gateway.shutdown().await;
        let agent_result = if failure.is_none() {
            let _ = agent_stop.send(());
            join_within("agent", &mut agent, AGENT_STOP_TIMEOUT).await
        } else {
            Ok(())
        };
        // The agent has just reported how its work ended; give clients
        // following that work (`flotilla run` polls every 500 ms) a moment
        // to read it before the API goes away.
        tokio::time::sleep(FOLLOWER_GRACE).await;
        let _ = server.stop.send(());
        let server_result = join_within("server", &mut server.task, SERVER_STOP_TIMEOUT).await;
        (agent_result, server_result)
    };
    let (agent_result, server_result) = tokio::select! {
        r = shutdown => r,
        _ = signals.recv() => {
            eprintln!("forced exit");
            return Ok(ExitCode::from(130));
        }
    };
    if let Some(e) = failure {
        return Err(e);
    }
    agent_result?;
    server_result?;
    say!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// `flotilla server`.
pub async fn server(args: ServerArgs) -> Result<ExitCode> {
    init_logging();
    let mut signals = Signals::new()?;
    let mut server = start_server(args).await?;
    say!("flotilla server is up");
    announce_urls(&server.url);
    announce_tls(&server);
    say!("data:     {}", server.data_dir.display());
    announce_credentials(&server);
    let pin = server
        .pin()
        .map(|p| format!(" --tls-fingerprint {p}"))
        .unwrap_or_default();
    say!(
        "agents:   flotilla agent --server {}{pin} --token \"$(cat {})\"",
        server.url,
        server.data_dir.join("agent.token").display()
    );
    say!("press Ctrl-C to stop");

    tokio::select! {
        _ = signals.recv() => {}
        r = &mut server.task => return Err(task_ended("server", r)),
    }
    let _ = server.stop.send(());
    tokio::select! {
        r = join_within("server", &mut server.task, SERVER_STOP_TIMEOUT) => r?,
        _ = signals.recv() => {
            eprintln!("forced exit");
            return Ok(ExitCode::from(130));
        }
    }
    say!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// `flotilla agent`.
pub async fn agent(
    server_url: Option<String>,
    tls: config::TlsFlags<'_>,
    args: AgentArgs,
) -> Result<ExitCode> {
    init_logging();
    let trust = config::trust(tls.fingerprint, tls.ca_cert)?;
    if args.simulate_fleet.is_some() {
        return fleet(server_url, trust, args).await;
    }
    check_node(args.simulate_gpus.as_deref(), &args.workloads)?;
    let server_url = config::server_urls(server_url);
    let work_dir = match args.work_dir {
        Some(w) => w,
        None => data_dir(None)?.join("agent"),
    };
    let (token, name, pool) = match (args.token, args.join_token) {
        (_, Some(join)) => {
            let joined = join_pool(&server_url, &trust, join.trim(), &work_dir).await?;
            (joined.agent_token, joined.name, Some(joined.pool))
        }
        (Some(token), None) if !token.trim().is_empty() => (
            token.trim().to_string(),
            args.name.unwrap_or_else(hostname),
            args.pool,
        ),
        _ => bail!(
            "pass --token (the server's agent token) or --join-token (a node-pool machine's \
             one-time join token)"
        ),
    };
    let mut signals = Signals::new()?;
    let mut cfg =
        flotilla_agent::AgentConfig::new(server_url.clone(), token, name.clone(), work_dir);
    cfg.region = args.region;
    cfg.pool = pool;
    cfg.simulate_gpus = args.simulate_gpus;
    cfg.simulated_telemetry = args.simulated_telemetry;
    cfg.simulated_host = args.host.reported();
    cfg.metrics_bind = args.metrics_bind;
    cfg.trust = trust;
    args.workloads.apply(&mut cfg);
    cfg.allow_egress = args.allow_egress;
    // The node lease's fence: this binary, as `flotilla agent-fence`.
    cfg.fence_program = std::env::current_exe().ok();
    let (stop, stopped) = oneshot::channel::<()>();
    let mut task = tokio::spawn(flotilla_agent::run(cfg, async move {
        let _ = stopped.await;
    }));
    eprintln!("agent {name} reporting to {server_url}; press Ctrl-C to stop");
    tokio::select! {
        _ = signals.recv() => {}
        r = &mut task => return Err(task_ended("agent", r)),
    }
    let _ = stop.send(());
    tokio::select! {
        r = join_within("agent", &mut task, AGENT_STOP_TIMEOUT) => r?,
        _ = signals.recv() => {
            eprintln!("forced exit");
            return Ok(ExitCode::from(130));
        }
    }
    eprintln!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// `flotilla agent --simulate-fleet N`: N simulated nodes in this process
/// ([`flotilla_agent::fleet`]). The node runtime's checks do not apply (no
/// workload runs on this host), so they are not made.
async fn fleet(
    server_url: Option<String>,
    trust: flotilla_client::Trust,
    args: AgentArgs,
) -> Result<ExitCode> {
    let nodes = args.simulate_fleet.unwrap_or(0);
    if let Some(spec) = args.simulate_gpus.as_deref() {
        check_simulated(spec)?;
    }
    if args.workloads.runtime != flotilla_agent::runtime::RuntimeKind::Process {
        bail!("--simulate-fleet: the nodes' workloads are simulated; drop --runtime");
    }
    let server_url = config::server_urls(server_url);
    let work_dir = match args.work_dir {
        Some(w) => w,
        None => data_dir(None)?.join("fleet"),
    };
    let tokens: Vec<String> = match (&args.fleet_tokens, &args.token) {
        (Some(file), _) => std::fs::read_to_string(file)
            .with_context(|| format!("--fleet-tokens: reading {}", file.display()))?
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect(),
        (None, Some(token)) if !token.trim().is_empty() => vec![token.trim().to_string()],
        _ => {
            bail!("--simulate-fleet: pass --token (the server's agent key) or --fleet-tokens FILE")
        }
    };
    let name = args.name.unwrap_or_else(|| "sim".to_string());
    let mut base = flotilla_agent::AgentConfig::new(server_url.clone(), "", name, work_dir);
    base.region = args.region;
    base.pool = args.pool;
    base.simulate_gpus = args.simulate_gpus;
    base.simulated_telemetry = args.simulated_telemetry;
    base.simulated_host = args.host.reported();
    base.trust = trust;
    let config = flotilla_agent::fleet::FleetConfig {
        base,
        nodes,
        tokens,
        stats_file: args.fleet_stats,
    };
    config.validate()?;
    let mut signals = Signals::new()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let mut task = tokio::spawn(flotilla_agent::fleet::run(config, async move {
        let _ = stopped.await;
    }));
    eprintln!("simulated fleet of {nodes} nodes reporting to {server_url}; press Ctrl-C to stop");
    tokio::select! {
        _ = signals.recv() => {}
        r = &mut task => return Err(task_ended("fleet", r)),
    }
    let _ = stop.send(());
    tokio::select! {
        r = join_within("fleet", &mut task, FLEET_STOP_TIMEOUT) => r?,
        _ = signals.recv() => {
            eprintln!("forced exit");
            return Ok(ExitCode::from(130));
        }
    }
    eprintln!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// A node-pool machine joins: trades its one-time join token for its own
/// agent key, node name and pool, and keeps them in `work_dir/joined.json`
/// (mode 0600). A restarted agent finds them there and does not spend the
/// token again (the server would refuse it as used).
async fn join_pool(
    server_url: &str,
    trust: &flotilla_client::Trust,
    token: &str,
    work_dir: &Path,
) -> Result<flotilla_core::nodepool::Joined> {
    let saved = work_dir.join("joined.json");
    if let Ok(text) = std::fs::read_to_string(&saved) {
        if let Ok(joined) = serde_json::from_str::<flotilla_core::nodepool::Joined>(&text) {
            eprintln!("joined before as {} in pool {}", joined.name, joined.pool);
            return Ok(joined);
        }
    }
    if token.is_empty() {
        bail!("--join-token is empty");
    }
    let client = flotilla_client::Client::builder(server_url, "")
        .trust(trust.clone())
        .build()?;
    let joined = client
        .join_node(token)
        .await
        .map_err(|e| anyhow!("joining the node pool: {e}"))?;
    config::create_private_dir(work_dir)?;
    write_private_file(&saved, &serde_json::to_string(&joined)?)?;
    eprintln!("joined as {} in pool {}", joined.name, joined.pool);
    Ok(joined)
}

/// Writes `text` to `path`, readable by this user only.
fn write_private_file(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    Ok(())
}

/// The default database URL for a data directory.
pub fn default_database_url(data_dir: &Path) -> String {
    format!(
        "sqlite://{}?mode=rwc",
        data_dir.join("flotilla.db").display()
    )
}

/// The operator's shares plus this `flotilla` binary, read-only, so that a
/// workload can run `flotilla emulator` (what `flotilla demo` and the docs'
/// endpoint examples deploy) wherever the binary lives: the sandbox shows
/// only the system directories, and a binary in a build directory or a
/// home was `not found` to every replica. The binary holds no secret; the
/// files it would read (credentials, the database) stay hidden.
fn with_own_binary(
    mut shares: Vec<flotilla_agent::runtime::sandbox::SharedPath>,
) -> Vec<flotilla_agent::runtime::sandbox::SharedPath> {
    if let Ok(exe) = std::env::current_exe() {
        if !shares.iter().any(|s| exe.starts_with(&s.path)) {
            shares.push(flotilla_agent::runtime::sandbox::SharedPath {
                path: exe,
                writable: false,
            });
        }
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcard_binds_are_reached_through_loopback() {
        assert_eq!(
            url_for("0.0.0.0:7420".parse().unwrap(), false),
            "http://127.0.0.1:7420"
        );
        assert_eq!(
            url_for("[::]:80".parse().unwrap(), false),
            "http://[::1]:80"
        );
        assert_eq!(
            url_for("10.0.0.5:9".parse().unwrap(), true),
            "https://10.0.0.5:9"
        );
    }

    #[test]
    fn default_database_is_sqlite_in_the_data_dir() {
        assert_eq!(
            default_database_url(Path::new("/var/lib/flotilla")),
            "sqlite:///var/lib/flotilla/flotilla.db?mode=rwc"
        );
    }

    #[tokio::test]
    async fn a_taken_port_names_the_flag_to_use() {
        let (held, _) = bind("127.0.0.1:0", false).await.unwrap();
        let addr = held.local_addr().unwrap().to_string();
        let e = bind(&addr, false).await.unwrap_err().to_string();
        assert_eq!(e, format!("{addr} is in use: pass --bind 127.0.0.1:PORT"));
    }

    #[test]
    fn self_signed_certificates_name_loopback_and_a_particular_bind() {
        let names = certificate_names("0.0.0.0:7420");
        assert!(names.starts_with(&["localhost".into(), "127.0.0.1".into(), "::1".into()]));
        assert!(!names.iter().any(|n| n == "0.0.0.0"), "{names:?}");
        assert!(!certificate_names("[::]:1").iter().any(|n| n == "::"));
        assert!(certificate_names("10.1.2.3:7420").contains(&"10.1.2.3".to_string()));
        assert!(certificate_names("[fd00::5]:7420").contains(&"fd00::5".to_string()));
        let n = certificate_names("127.0.0.1:7420");
        assert_eq!(n.iter().filter(|n| *n == "127.0.0.1").count(), 1, "{n:?}");
    }

    #[test]
    fn credentials_follow_their_server_to_https_and_its_pin() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("credentials.json");
        let pin = Some(format!("sha256:{}", "ab".repeat(32)));
        assert!(!follow_server(&path, "https://127.0.0.1:7420", pin.clone()).unwrap());
        config::save(&path, &Credentials::new("http://127.0.0.1:7420", "k")).unwrap();
        // Another server's credentials are left alone.
        assert!(!follow_server(&path, "https://127.0.0.1:7421", pin.clone()).unwrap());
        assert!(follow_server(&path, "https://127.0.0.1:7420", pin.clone()).unwrap());
        let c = config::load(&path).unwrap().unwrap();
        assert_eq!(c.server, "https://127.0.0.1:7420");
        assert_eq!(c.tls_fingerprint, pin);
        assert_eq!(c.api_key, "k");
        assert!(!follow_server(&path, "https://127.0.0.1:7420", pin.clone()).unwrap());
        // Back to plain HTTP: the pin goes.
        assert!(follow_server(&path, "http://127.0.0.1:7420", None).unwrap());
        assert_eq!(
            config::load(&path).unwrap().unwrap(),
            Credentials::new("http://127.0.0.1:7420", "k")
        );
    }

    #[test]
    fn bad_simulated_inventories_are_caught_early() {
        assert!(check_simulated("4xH100,2xL40S").is_ok());
        let e = check_simulated("4xZ9").unwrap_err().to_string();
        assert!(e.starts_with("--simulate-gpus: unknown GPU model"), "{e}");
    }
}
