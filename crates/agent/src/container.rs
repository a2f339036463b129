//! The container runtime: runs an instance as an OCI container through the
//! Docker Engine API (Docker on GPU servers, Podman's Docker-compatible
//! service where Docker is absent), with exactly the instance's GPUs, its
//! CPU and memory limits enforced by the engine's cgroups, its output split
//! into the agent's [`LogBuffer`], and labels that let a restarted agent
//! find and re-adopt what still runs ([`ContainerRuntime::adopt`]).
//!
//! Isolation is not optional here: a container is never privileged, drops
//! every capability, cannot gain privileges (`no-new-privileges`), never
//! joins the host's network, PID or IPC namespaces, mounts no host path
//! (its only writable scratch space is a size-capped tmpfs at
//! [`SCRATCH_DIR`]), runs as an unprivileged user whatever the image's
//! `USER` says (its tenant's own uid under a root agent, see
//! [`ContainerRuntime::with_tenant_users`], else [`DEFAULT_USER`]: a rootful
//! engine does not remap users, so an image's root would be the host's),
//! and joins its tenant's own network, so one tenant's
//! containers cannot reach another's.
//!
//! This module must never talk to the Flotilla server, never pull an image
//! the node already has, and never touch a container without Flotilla's
//! labels.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bollard::auth::DockerCredentials;
use bollard::container::{
    Config, CreateContainerOptions, InspectContainerOptions, KillContainerOptions,
    ListContainersOptions, LogOutput, LogsOptions, NetworkingConfig, RemoveContainerOptions,
    StartContainerOptions, StopContainerOptions, WaitContainerOptions,
};
use bollard::image::CreateImageOptions;
use bollard::models::{
    ContainerInspectResponse, DeviceMapping, DeviceRequest, EndpointSettings, HostConfig,
    PortBinding,
};
use bollard::network::CreateNetworkOptions;
use bollard::Docker;
use chrono::{DateTime, Utc};
use flotilla_core::api::{ColdStart, GpuSlice, LogStream, ObservedContainer};
use flotilla_core::catalog::Vendor;
use flotilla_core::id::{InstanceId, TenantId};
use flotilla_core::registry::{registry_of, RegistryAuth};
use futures::future::BoxFuture;
use futures::StreamExt;
use tokio::sync::{mpsc, watch};

pub use crate::container_error::ContainerError;
pub use crate::image_cache::CachedImage;
use crate::image_cache::{ImageCache, ImagePin};
use crate::runtime::sandbox::Users;
use crate::runtime::{
    device_env, Exit, LogBuffer, Runtime, RuntimeError, RuntimeKind, SpawnError, SpawnSpec, Wakers,
    Workload, MAX_LINE_BYTES, SHIP_BATCH_LINES,
};

/// Label naming the instance a container runs.
pub const LABEL_INSTANCE: &str = "flotilla.instance";
/// Label naming the node (agent) that started it.
pub const LABEL_NODE: &str = "flotilla.node";
/// Label naming the tenant that owns it.
pub const LABEL_TENANT: &str = "flotilla.tenant";
/// Where the instance's scratch space is mounted; also its `HOME`.
pub const SCRATCH_DIR: &str = "/scratch";
/// Scratch size when the spec states none.
pub const DEFAULT_SCRATCH_MB: u64 = 1024;
/// The user a container runs as unless the configuration names another:
/// `nobody`, so a workload that escapes its namespaces is no one on the
/// host (rootful engines do not remap users).
pub const DEFAULT_USER: &str = "65534:65534";
/// Timeout of the engine calls that answer at once (create, start,
/// inspect); waits and log streams have none.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a running container's memory cgroup is read for OOM kills.
const OOM_POLL: Duration = Duration::from_millis(50);
/// How long to wait for the log stream to end after the container exited.
const LOG_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// How an instance's GPUs reach its container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuPassthrough {
    /// Simulated GPUs: only the environment variables are set.
    #[default]
    Simulated,
    /// Docker `DeviceRequests` for the NVIDIA container runtime (driver
    /// `nvidia`, device ids = the GPUs' UUIDs).
    DeviceRequests,
    /// CDI device names `nvidia.com/gpu=<uuid>` (Podman, or Docker with CDI
    /// enabled), for nodes set up with `nvidia-ctk cdi generate`.
    Cdi,
}

impl std::str::FromStr for GpuPassthrough {
    type Err = String;

    /// `simulated`, `device-requests` or `cdi` (`--container-gpus`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "simulated" => Ok(GpuPassthrough::Simulated),
            "device-requests" => Ok(GpuPassthrough::DeviceRequests),
            "cdi" => Ok(GpuPassthrough::Cdi),
            other => Err(format!(
                "unknown gpu passthrough `{other}` (expected `simulated`, `device-requests` or `cdi`)"
            )),
        }
    }
}

/// How the container runtime reaches its engine and shapes containers.
#[derive(Debug, Clone)]
pub struct ContainerConfig {
    /// The engine's API, `unix:///run/docker.sock` or `unix:///…/podman.sock`.
    pub docker_host: String,
    /// This node's name, written into [`LABEL_NODE`]: adoption only takes
    /// containers of this node.
    pub node: String,
    /// How GPUs are passed through.
    pub gpus: GpuPassthrough,
    /// `uid:gid` the workload runs as ([`DEFAULT_USER`]).
    pub user: String,
    /// Mount the image's root filesystem read-only (the scratch tmpfs stays
    /// writable).
    pub read_only_rootfs: bool,
    /// Address published ports bind to on the node (`0.0.0.0`: every
    /// interface, so tenants reach them at the node's address).
    pub publish_ip: String,
    /// Address tenants reach the node at, for the URLs of published ports.
    pub public_host: String,
    /// Per-node image cache limit in bytes; `None`: no eviction.
    pub image_cache_bytes: Option<u64>,
    /// Where the image cache keeps its record of last uses, so a restarted
    /// agent evicts in the same order; `None`: not kept.
    pub state_dir: Option<PathBuf>,
}

impl ContainerConfig {
    /// Defaults for `node` on the engine at `docker_host`: simulated GPUs,
    /// [`DEFAULT_USER`], a writable root filesystem, ports on every
    /// interface shown at `127.0.0.1`, no image cache limit.
    pub fn new(docker_host: impl Into<String>, node: impl Into<String>) -> Self {
        Self {
            docker_host: docker_host.into(),
            node: node.into(),
            gpus: GpuPassthrough::Simulated,
            user: DEFAULT_USER.to_string(),
            read_only_rootfs: false,
            publish_ip: "0.0.0.0".to_string(),
            public_host: "127.0.0.1".to_string(),
            image_cache_bytes: None,
            state_dir: None,
        }
    }
}

/// What to run for one instance in a container.
#[derive(Debug, Clone)]
pub struct ContainerSpec {
    /// The instance.
    pub instance_id: InstanceId,
    /// Its owner: decides the network it joins.
    pub tenant_id: TenantId,
    /// Image reference, pulled when the node does not have it.
    pub image: String,
    /// Command; empty runs the image's default.
    pub command: Vec<String>,
    /// Extra environment.
    pub env: BTreeMap<String, String>,
    /// Container ports (TCP) to publish on the node; the engine picks the
    /// host ports.
    pub ports: Vec<u16>,
    /// CPU limit in milli-cores; `None`: unlimited.
    pub cpu_milli: Option<u32>,
    /// Memory limit in MiB (swap included); `None`: unlimited.
    pub memory_mb: Option<u64>,
    /// Scratch space at [`SCRATCH_DIR`] in MiB ([`DEFAULT_SCRATCH_MB`]).
    pub scratch_mb: Option<u64>,
    /// Node-local GPU indices the instance owns.
    pub gpu_indices: Vec<u32>,
    /// Their UUIDs, in the same order.
    pub gpu_uuids: Vec<String>,
    /// Their vendors.
    pub vendors: Vec<Vendor>,
    /// What it holds of each GPU when it shares them (fractions, MIG).
    pub gpu_slices: Vec<GpuSlice>,
    /// The tenant's login for the image's registry, from the assignment:
    /// used for the pull only, and only when it names the image's registry.
    pub registry_auth: Option<RegistryAuth>,
}

/// A container port published on the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedPort {
    /// The port inside the container.
    pub container_port: u16,
    /// The node's port the engine chose.
    pub host_port: u16,
    /// Where a tenant reaches it: `http://<public host>:<host port>`.
    pub url: String,
}

/// How a container ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContainerExit {
    /// Exit status; 128 + signal when a signal ended it.
    pub code: i32,
    /// When it ended (the engine's record, else when the agent saw it).
    pub at: DateTime<Utc>,
    /// A stop had been requested through [`Container::stop`].
    pub stop_requested: bool,
    /// The kernel's OOM killer ended it: it went over its memory limit.
    pub oom_killed: bool,
}

impl ContainerExit {
    /// Why it ended, for a person: "out of memory" for an OOM kill.
    pub fn reason(&self) -> String {
        if self.oom_killed {
            format!(
                "out of memory: killed by the kernel for exceeding its memory limit (exit code {})",
                self.code
            )
        } else {
            format!("exit code {}", self.code)
        }
    }
}

/// How the instance's container came to run: the cold-start breakdown.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StartTimings {
    /// The image was already on the node: no pull.
    pub cached: bool,
    /// When the pull began and ended (`None` when cached or adopted).
    pub pull: Option<(DateTime<Utc>, DateTime<Utc>)>,
    /// When the container was created.
    pub created_at: Option<DateTime<Utc>>,
    /// When it started running.
    pub started_at: Option<DateTime<Utc>>,
}

/// A supervised container. Cheap to clone; every clone controls the same
/// container. Dropping all clones neither stops nor removes it.
#[derive(Debug, Clone)]
pub struct Container {
    id: String,
    instance_id: InstanceId,
    pid: u32,
    started_at: DateTime<Utc>,
    ports: Vec<PublishedPort>,
    ips: BTreeMap<String, String>,
    timings: StartTimings,
    adopted: bool,
    stop_tx: mpsc::UnboundedSender<Duration>,
    exit_rx: watch::Receiver<Option<ContainerExit>>,
    logs: Arc<LogBuffer>,
    docker: Docker,
}

impl Container {
    /// The engine's container id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The instance it runs.
    pub fn instance_id(&self) -> &InstanceId {
        &self.instance_id
    }

    /// Host pid of its init process when it started (0 when the engine
    /// did not say).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// When it started running.
    pub fn started_at(&self) -> DateTime<Utc> {
        self.started_at
    }

    /// Its published ports.
    pub fn ports(&self) -> &[PublishedPort] {
        &self.ports
    }

    /// Its address on each network it joined, by network name.
    pub fn ips(&self) -> &BTreeMap<String, String> {
        &self.ips
    }

    /// The cold-start breakdown.
    pub fn timings(&self) -> &StartTimings {
        &self.timings
    }

    /// Found running by [`ContainerRuntime::adopt`] rather than started by
    /// this agent process.
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    /// Asks the engine to stop it: SIGTERM now, SIGKILL after `grace`
    /// (rounded up to whole seconds, the engine's unit). Returns at once.
    pub fn stop(&self, grace: Duration) {
        // A closed channel means the supervisor is done: nothing to stop.
        let _ = self.stop_tx.send(grace);
    }

    /// How it ended, once it ended and its output was fully read.
    pub fn exit(&self) -> Option<ContainerExit> {
        *self.exit_rx.borrow()
    }

    /// Waits until it ended and its output was fully read.
    pub async fn wait(&self) -> ContainerExit {
        let mut rx = self.exit_rx.clone();
        let published = rx.wait_for(Option::is_some).await.ok().and_then(|e| *e);
        published.unwrap_or(ContainerExit {
            code: -1,
            at: Utc::now(),
            stop_requested: false,
            oom_killed: false,
        })
    }

    /// Its captured output.
    pub fn logs(&self) -> &Arc<LogBuffer> {
        &self.logs
    }

    /// Removes the container from the engine (killing it if it still runs),
    /// once the agent no longer needs its exit status or logs.
    pub async fn remove(&self) -> Result<(), ContainerError> {
        let opts = RemoveContainerOptions {
            force: true,
            v: true,
            ..Default::default()
        };
        match self.docker.remove_container(&self.id, Some(opts)).await {
            Ok(()) => Ok(()),
            Err(e) if status_of(&e) == Some(404) => Ok(()),
            Err(source) => Err(ContainerError::Engine {
                what: "remove container",
                source,
            }),
        }
    }
}

/// The container runtime of one node.
#[derive(Clone)]
pub struct ContainerRuntime {
    docker: Docker,
    config: ContainerConfig,
    cache: Arc<ImageCache>,
    /// What each start under way last said (an image pull's progress).
    progress: Arc<Mutex<BTreeMap<InstanceId, String>>>,
    /// Each tenant's own uid, when set: its containers run as it.
    users: Option<Arc<Users>>,
    /// The host's workload firewall, when the agent runs it: tenants'
    /// networks are held to its egress policy.
    firewall: Option<crate::runtime::network::Namespaces>,
}

impl std::fmt::Debug for ContainerRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContainerRuntime")
            .field("config", &self.config)
            .finish()
    }
}

fn status_of(e: &bollard::errors::Error) -> Option<u16> {
    match e {
        bollard::errors::Error::DockerResponseServerError { status_code, .. } => Some(*status_code),
        _ => None,
    }
}

async fn timed<T>(
    what: &'static str,
    f: impl std::future::Future<Output = Result<T, bollard::errors::Error>>,
) -> Result<T, ContainerError> {
    match tokio::time::timeout(CALL_TIMEOUT, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(ContainerError::Engine { what, source }),
        Err(_) => Err(ContainerError::Timeout(what)),
    }
}

/// The tenant's network for containers that publish no port: internal, no
/// route out of it, shared only by that tenant's containers.
pub fn tenant_network(tenant: &TenantId) -> String {
    format!("flotilla-t-{}", tenant.as_str())
}

/// The tenant's network for containers that publish ports: reachable from
/// the node (and out), still the tenant's alone.
pub fn tenant_ports_network(tenant: &TenantId) -> String {
    format!("flotilla-t-{}-ports", tenant.as_str())
}

/// The container's name: one per instance, so a second create of the same
/// instance fails instead of running it twice.
pub fn container_name(instance: &InstanceId) -> String {
    format!("flotilla-{}", instance.as_str())
}

/// The environment a container gets: the spec's variables, then the GPU
/// selection (set last so a spec cannot override which GPUs it sees), and
/// `HOME` in the scratch space.
///
/// Simulated GPUs get [`device_env`]'s variables as a process would. Real
/// GPUs are renumbered from 0 inside a container, so the selection there is
/// by UUID (MIG: by MIG device name), which means the same devices inside
/// and out.
pub fn container_env(spec: &ContainerSpec, gpus: GpuPassthrough) -> Vec<String> {
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert("HOME".into(), SCRATCH_DIR.into());
    env.extend(spec.env.clone());
    for (k, v) in device_env(
        &spec.instance_id,
        &spec.gpu_indices,
        &spec.gpu_uuids,
        &spec.vendors,
        &spec.gpu_slices,
    ) {
        env.insert(k, v);
    }
    if gpus != GpuPassthrough::Simulated {
        let selection = visible_devices(spec);
        env.insert("NVIDIA_VISIBLE_DEVICES".into(), selection.clone());
        env.insert("CUDA_VISIBLE_DEVICES".into(), selection);
    }
    env.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
}

/// The devices by name: MIG device names when the instance holds MIG
/// slices, else the GPUs' UUIDs.
fn visible_devices(spec: &ContainerSpec) -> String {
    let mig: Vec<&str> = spec
        .gpu_slices
        .iter()
        .filter_map(|s| s.mig_device.as_deref())
        .collect();
    if mig.is_empty() {
        spec.gpu_uuids.join(",")
    } else {
        mig.join(",")
    }
}

/// The engine's container configuration for `spec`: everything the
/// runtime enforces is decided here, so it is checked without an engine.
pub fn container_config(spec: &ContainerSpec, config: &ContainerConfig) -> Config<String> {
    let labels = HashMap::from([
        (LABEL_INSTANCE.to_string(), spec.instance_id.to_string()),
        (LABEL_NODE.to_string(), config.node.clone()),
        (LABEL_TENANT.to_string(), spec.tenant_id.to_string()),
    ]);
    let network = if spec.ports.is_empty() {
        tenant_network(&spec.tenant_id)
    } else {
        tenant_ports_network(&spec.tenant_id)
    };
    let port_key = |p: &u16| format!("{p}/tcp");
    let exposed: HashMap<String, HashMap<(), ()>> = spec
        .ports
        .iter()
        .map(|p| (port_key(p), HashMap::new()))
        .collect();
    let bindings: HashMap<String, Option<Vec<PortBinding>>> = spec
        .ports
        .iter()
        .map(|p| {
            (
                port_key(p),
                Some(vec![PortBinding {
                    // Every interface is no address at all: netavark 1.4
                    // reads `0.0.0.0` literally and matches no packet.
                    host_ip: Some(config.publish_ip.clone())
                        .filter(|ip| !ip.is_empty() && ip != "0.0.0.0"),
                    // Empty: the engine picks a free port.
                    host_port: Some(String::new()),
                }]),
            )
        })
        .collect();
    let memory = spec
        .memory_mb
        .map(|mb| i64::try_from(mb.saturating_mul(1024 * 1024)).unwrap_or(i64::MAX));
    let scratch_mb = spec.scratch_mb.unwrap_or(DEFAULT_SCRATCH_MB);
    let (device_requests, devices) = match config.gpus {
        _ if spec.gpu_uuids.is_empty() => (None, None),
        GpuPassthrough::Simulated => (None, None),
        GpuPassthrough::DeviceRequests => (
            Some(vec![DeviceRequest {
                driver: Some("nvidia".into()),
                device_ids: Some(spec.gpu_uuids.clone()),
                capabilities: Some(vec![vec!["gpu".into()]]),
                ..Default::default()
            }]),
            None,
        ),
        GpuPassthrough::Cdi => {
            let names: Vec<DeviceMapping> = visible_devices(spec)
                .split(',')
                .map(|d| DeviceMapping {
                    path_on_host: Some(format!("nvidia.com/gpu={d}")),
                    path_in_container: None,
                    cgroup_permissions: Some("rwm".into()),
                })
                .collect();
            (None, Some(names))
        }
    };
    let host_config = HostConfig {
        privileged: Some(false),
        cap_drop: Some(vec!["ALL".into()]),
        cap_add: Some(Vec::new()),
        security_opt: Some(vec!["no-new-privileges".into()]),
        network_mode: Some(network.clone()),
        port_bindings: (!bindings.is_empty()).then_some(bindings),
        memory,
        // Equal to the memory limit: no swap beyond it, so the limit is
        // what the workload gets and going over it is an OOM kill.
        memory_swap: memory,
        nano_cpus: spec.cpu_milli.map(|m| i64::from(m) * 1_000_000),
        pids_limit: Some(4096),
        readonly_rootfs: Some(config.read_only_rootfs),
        tmpfs: Some(HashMap::from([(
            SCRATCH_DIR.to_string(),
            format!("rw,nosuid,nodev,size={scratch_mb}m,mode=1777"),
        )])),
        device_requests,
        devices,
        // No mounts, no binds, no volumes: a host path never enters.
        ..Default::default()
    };
    Config {
        image: Some(spec.image.clone()),
        cmd: (!spec.command.is_empty()).then(|| spec.command.clone()),
        env: Some(container_env(spec, config.gpus)),
        user: Some(config.user.clone()),
        working_dir: Some(SCRATCH_DIR.to_string()),
        labels: Some(labels),
        exposed_ports: (!exposed.is_empty()).then_some(exposed),
        attach_stdout: Some(false),
        attach_stderr: Some(false),
        tty: Some(false),
        host_config: Some(host_config),
        networking_config: Some(NetworkingConfig {
            endpoints_config: HashMap::from([(network, EndpointSettings::default())]),
        }),
        ..Default::default()
    }
}

impl ContainerRuntime {
    /// Connects to the engine at `config.docker_host` and checks that it
    /// answers.
    pub async fn connect(config: ContainerConfig) -> Result<Self, ContainerError> {
        let Some(path) = config.docker_host.strip_prefix("unix://") else {
            return Err(ContainerError::UnsupportedHost(config.docker_host.clone()));
        };
        let unreachable = |source| ContainerError::Unreachable {
            host: config.docker_host.clone(),
            source,
        };
        // Waits and followed logs last as long as the container: the
        // client's own timeout would cut them, so it is effectively off and
        // each short call carries its own (see `timed`).
        let docker = Docker::connect_with_unix(path, 365 * 24 * 3600, bollard::API_DEFAULT_VERSION)
            .map_err(unreachable)?;
        match tokio::time::timeout(CALL_TIMEOUT, docker.ping()).await {
            Ok(Ok(_)) => {}
            Ok(Err(source)) => return Err(unreachable(source)),
            Err(_) => return Err(ContainerError::Timeout("ping")),
        }
        let cache = Arc::new(ImageCache::open(
            config.image_cache_bytes,
            config.state_dir.as_deref(),
        ));
        if cache.limit_bytes().is_some() {
            tokio::spawn(enforce_forever(Arc::downgrade(&cache), docker.clone()));
        }
        Ok(Self {
            docker,
            config,
            cache,
            progress: Arc::default(),
            users: None,
            firewall: None,
        })
    }

    /// Runs each tenant's containers as the tenant's own uid, claimed
    /// from `users` (the process runtime's claims, so a tenant is one user
    /// on the node whichever runtime runs its work), instead of
    /// [`ContainerConfig::user`]. A rootful engine does not remap users:
    /// two tenants sharing a uid would share it on the host too, should a
    /// workload escape its namespaces.
    pub fn with_tenant_users(mut self, users: Users) -> Self {
        self.users = Some(Arc::new(users));
        self
    }

    /// Holds the tenants' networks to the host firewall's egress policy
    /// (see [`crate::runtime::network`]): no host address, loopback
    /// service, link-local or private range unless allowed, no other
    /// network's containers.
    pub fn with_firewall(mut self, firewall: crate::runtime::network::Namespaces) -> Self {
        self.firewall = Some(firewall);
        self
    }

    /// Puts the network `name`'s subnets under the firewall, before any
    /// container of it starts.
    async fn guard_network(&self, name: &str) -> Result<(), ContainerError> {
        let Some(firewall) = self.firewall.clone() else {
            return Ok(());
        };
        let net = timed(
            "inspect network",
            self.docker.inspect_network::<String>(name, None),
        )
        .await?;
        let subnets: Vec<(flotilla_egress::IpNet, Option<std::net::Ipv4Addr>)> = net
            .ipam
            .and_then(|i| i.config)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|c| {
                let subnet = c.subnet?.parse().ok()?;
                Some((subnet, c.gateway.and_then(|g| g.parse().ok())))
            })
            .collect();
        let guarded = tokio::task::spawn_blocking(move || {
            subnets
                .into_iter()
                .try_for_each(|(subnet, gw)| firewall.guard_containers(subnet, gw))
        })
        .await;
        match guarded {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ContainerError::Firewall(e.to_string())),
            Err(e) => Err(ContainerError::Firewall(e.to_string())),
        }
    }

    /// The `uid:gid` `tenant`'s containers run as.
    async fn user_of(&self, tenant: &TenantId) -> Result<String, ContainerError> {
        let Some(users) = self.users.clone() else {
            return Ok(self.config.user.clone());
        };
        let owner = tenant.to_string();
        let uid = tokio::task::spawn_blocking(move || users.uid_of(&owner))
            .await
            .map_err(|e| ContainerError::User(std::io::Error::other(e)))?
            .map_err(ContainerError::User)?;
        Ok(format!("{uid}:{uid}"))
    }

    /// The configuration.
    pub fn config(&self) -> &ContainerConfig {
        &self.config
    }

    /// The engine client, for callers that inspect what the runtime made.
    pub fn docker(&self) -> &Docker {
        &self.docker
    }

    /// What the image cache holds, by image reference.
    pub fn cached_images(&self) -> Vec<CachedImage> {
        self.cache.images()
    }

    /// The image cache as the agent reports it to the server.
    pub fn image_report(&self) -> Vec<flotilla_core::api::NodeImage> {
        self.cache.report()
    }

    /// Removes the least recently used images until the cache fits its
    /// limit (see [`crate::image_cache`]); returns the references removed.
    /// Runs after every start and every [`crate::image_cache::ENFORCE_EVERY`].
    pub async fn enforce_image_cache(&self) -> Result<Vec<String>, ContainerError> {
        self.cache.enforce(&self.docker).await
    }

    /// Makes sure the node has `image`: pulls it when missing, reporting
    /// progress through `progress`. Returns the pull's start and end, or
    /// `None` when the node had it.
    pub async fn ensure_image(
        &self,
        image: &str,
        progress: &(dyn Fn(String) + Send + Sync),
    ) -> Result<Option<(DateTime<Utc>, DateTime<Utc>)>, ContainerError> {
        self.ensure_image_pinned(image, None, progress)
            .await
            .map(|(pull, _)| pull)
    }

    /// [`ContainerRuntime::ensure_image`] with the tenant's registry login,
    /// returning a pin that keeps the image from eviction until the
    /// container exists.
    async fn ensure_image_pinned(
        &self,
        image: &str,
        auth: Option<&RegistryAuth>,
        progress: &(dyn Fn(String) + Send + Sync),
    ) -> Result<(Option<(DateTime<Utc>, DateTime<Utc>)>, ImagePin), ContainerError> {
        let inspected = |i: bollard::models::ImageInspect| {
            (
                i.id.unwrap_or_default(),
                i.size.and_then(|s| u64::try_from(s).ok()).unwrap_or(0),
            )
        };
        {
            let _starting = self.cache.starting().await;
            match self.docker.inspect_image(image).await {
                Ok(i) => {
                    let (id, size) = inspected(i);
                    let pin = self.cache.record_use(image, &id, size, Utc::now(), false);
                    return Ok((None, pin));
                }
                Err(e) if status_of(&e) == Some(404) => {}
                Err(source) => {
                    return Err(ContainerError::Engine {
                        what: "inspect image",
                        source,
                    })
                }
            }
        }
        // Not under the start gate: a pull takes minutes, and enforcement
        // (which waits for the gate) must not stall other starts that long.
        let _pulling = self.cache.pulling(image);
        let started = Utc::now();
        progress(format!("pulling image {image}"));
        let opts = CreateImageOptions {
            from_image: image.to_string(),
            ..Default::default()
        };
        // A login goes only to the registry it was stored for.
        let credentials =
            auth.filter(|a| a.registry == registry_of(image))
                .map(|a| DockerCredentials {
                    username: Some(a.username.clone()),
                    password: Some(a.secret.clone()),
                    serveraddress: Some(a.registry.clone()),
                    ..Default::default()
                });
        let mut stream = self.docker.create_image(Some(opts), None, credentials);
        while let Some(item) = stream.next().await {
            let info = item.map_err(|source| ContainerError::Pull {
                image: image.to_string(),
                source,
            })?;
            if let Some(status) = info.status {
                let detail = info.progress.unwrap_or_default();
                progress(
                    format!("pulling image {image}: {status} {detail}")
                        .trim_end()
                        .to_string(),
                );
            }
        }
        let finished = Utc::now();
        let _starting = self.cache.starting().await;
        let (id, size) = match self.docker.inspect_image(image).await {
            Ok(i) => inspected(i),
            Err(source) => {
                return Err(ContainerError::Engine {
                    what: "inspect pulled image",
                    source,
                })
            }
        };
        let pin = self.cache.record_use(image, &id, size, finished, true);
        Ok((Some((started, finished)), pin))
    }

    /// Creates the tenant's network when missing. Networks are isolated
    /// from each other (netavark's `isolate`; Docker isolates bridges by
    /// default); the one for containers without ports is `internal`.
    async fn ensure_network(
        &self,
        name: &str,
        tenant: &TenantId,
        internal: bool,
    ) -> Result<(), ContainerError> {
        match self.docker.inspect_network::<String>(name, None).await {
            Ok(_) => return Ok(()),
            Err(e) if status_of(&e) == Some(404) => {}
            Err(source) => {
                return Err(ContainerError::Engine {
                    what: "inspect network",
                    source,
                })
            }
        }
        let opts = CreateNetworkOptions {
            name: name.to_string(),
            check_duplicate: true,
            driver: "bridge".to_string(),
            internal,
            options: HashMap::from([("isolate".to_string(), "true".to_string())]),
            labels: HashMap::from([(LABEL_TENANT.to_string(), tenant.to_string())]),
            ..Default::default()
        };
        match self.docker.create_network(opts).await {
            Ok(_) => Ok(()),
            // Created by a concurrent start of the same tenant.
            Err(e) if status_of(&e) == Some(409) => Ok(()),
            Err(source) => Err(ContainerError::Engine {
                what: "create network",
                source,
            }),
        }
    }

    /// Pulls the image if needed, creates and starts the container, and
    /// starts supervising it. `progress` hears the pull's progress.
    pub async fn start(
        &self,
        spec: &ContainerSpec,
        wakers: Wakers,
        progress: &(dyn Fn(String) + Send + Sync),
    ) -> Result<Container, ContainerError> {
        let (pull, pin) = self
            .ensure_image_pinned(&spec.image, spec.registry_auth.as_ref(), progress)
            .await?;
        let mut timings = StartTimings {
            cached: pull.is_none(),
            pull,
            ..Default::default()
        };
        let network = if spec.ports.is_empty() {
            tenant_network(&spec.tenant_id)
        } else {
            tenant_ports_network(&spec.tenant_id)
        };
        self.ensure_network(&network, &spec.tenant_id, spec.ports.is_empty())
            .await?;
        self.guard_network(&network).await?;
        progress("creating container".to_string());
        let config = ContainerConfig {
            user: self.user_of(&spec.tenant_id).await?,
            ..self.config.clone()
        };
        let name = container_name(&spec.instance_id);
        let created = timed(
            "create container",
            self.docker.create_container(
                Some(CreateContainerOptions {
                    name: name.clone(),
                    platform: None,
                }),
                container_config(spec, &config),
            ),
        )
        .await?;
        timings.created_at = Some(Utc::now());
        // The container now holds the image against eviction.
        drop(pin);
        if let Err(e) = timed(
            "start container",
            self.docker
                .start_container(&created.id, None::<StartContainerOptions<String>>),
        )
        .await
        {
            // Never leave a created container behind that a later adopt
            // would mistake for work.
            let _ = self
                .docker
                .remove_container(
                    &created.id,
                    Some(RemoveContainerOptions {
                        force: true,
                        ..Default::default()
                    }),
                )
                .await;
            return Err(e);
        }
        timings.started_at = Some(Utc::now());
        let inspected = self.inspect(&created.id).await?;
        tracing::info!(instance_id = %spec.instance_id, container = %created.id, image = %spec.image, cached = timings.cached, "container started");
        if self.cache.limit_bytes().is_some() {
            if let Err(error) = self.enforce_image_cache().await {
                tracing::warn!(%error, "cannot enforce the image cache limit");
            }
        }
        Ok(self.supervise(
            spec.instance_id.clone(),
            inspected,
            timings,
            false,
            0,
            wakers,
        ))
    }

    async fn inspect(&self, id: &str) -> Result<ContainerInspectResponse, ContainerError> {
        inspect(&self.docker, id).await
    }

    /// Every container of this node carrying Flotilla's labels, running or
    /// not, with its instance: what a restarted agent finds.
    pub async fn list(&self) -> Result<Vec<(InstanceId, String)>, ContainerError> {
        let filters = HashMap::from([(
            "label".to_string(),
            vec![format!("{LABEL_NODE}={}", self.config.node)],
        )]);
        let found = timed(
            "list containers",
            self.docker.list_containers(Some(ListContainersOptions {
                all: true,
                filters,
                ..Default::default()
            })),
        )
        .await?;
        let mut out = Vec::new();
        for c in found {
            let id = c.id.unwrap_or_default();
            let label = c
                .labels
                .as_ref()
                .and_then(|l| l.get(LABEL_INSTANCE))
                .and_then(|v| v.parse::<InstanceId>().ok())
                .ok_or_else(|| ContainerError::BadLabel {
                    id: id.clone(),
                    label: LABEL_INSTANCE,
                })?;
            out.push((label, id));
        }
        Ok(out)
    }

    /// Takes over the container running `instance_id` on this node, if
    /// there is one: its exit is waited for and its output followed again.
    /// The log is replayed from its beginning with the same sequence
    /// numbers as before (the engine keeps one ordered log), and the first
    /// `shipped` lines, which the server already has, are skipped, so the
    /// server's copy continues without a gap or a duplicate.
    pub async fn adopt(
        &self,
        instance_id: &InstanceId,
        shipped: u64,
        wakers: Wakers,
    ) -> Result<Option<Container>, ContainerError> {
        let Some((_, id)) = self
            .list()
            .await?
            .into_iter()
            .find(|(i, _)| i == instance_id)
        else {
            return Ok(None);
        };
        let inspected = self.inspect(&id).await?;
        tracing::info!(%instance_id, container = %id, "container adopted");
        Ok(Some(self.supervise(
            instance_id.clone(),
            inspected,
            StartTimings::default(),
            true,
            shipped,
            wakers,
        )))
    }

    fn supervise(
        &self,
        instance_id: InstanceId,
        inspected: ContainerInspectResponse,
        timings: StartTimings,
        adopted: bool,
        skip_lines: u64,
        wakers: Wakers,
    ) -> Container {
        let id = inspected.id.clone().unwrap_or_default();
        let state = inspected.state.clone().unwrap_or_default();
        let started_at = state
            .started_at
            .as_deref()
            .and_then(|s| DateTime::parse_from_rfc3339(s).ok())
            .map_or_else(Utc::now, |t| t.with_timezone(&Utc));
        let settings = inspected.network_settings.clone().unwrap_or_default();
        let mut ports: Vec<PublishedPort> = settings
            .ports
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(key, bindings)| {
                let container_port = key.split('/').next()?.parse().ok()?;
                let host_port = bindings?
                    .into_iter()
                    .find_map(|b| b.host_port?.parse::<u16>().ok())?;
                Some(PublishedPort {
                    container_port,
                    host_port,
                    url: format!("http://{}:{host_port}", self.config.public_host),
                })
            })
            .collect();
        ports.sort_by_key(|p| p.container_port);
        let ips = settings
            .networks
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(name, ep)| Some((name, ep.ip_address.filter(|ip| !ip.is_empty())?)))
            .collect();
        let pid = state.pid.and_then(|p| u32::try_from(p).ok()).unwrap_or(0);
        let cgroup = Some(pid).filter(|p| *p > 0).and_then(memory_cgroup_of);
        let logs = Arc::new(LogBuffer::new(instance_id.clone()));
        let (stop_tx, stop_rx) = mpsc::unbounded_channel();
        let (exit_tx, exit_rx) = watch::channel(None);
        let pump = tokio::spawn(follow_logs(
            self.docker.clone(),
            id.clone(),
            logs.clone(),
            skip_lines,
            wakers.logs.clone(),
        ));
        tokio::spawn(supervise(Supervised {
            docker: self.docker.clone(),
            id: id.clone(),
            instance_id: instance_id.clone(),
            stop_rx,
            exit_tx,
            pump,
            cgroup,
            wakers,
        }));
        Container {
            id,
            instance_id,
            pid,
            started_at,
            ports,
            ips,
            timings,
            adopted,
            stop_tx,
            exit_rx,
            logs,
            docker: self.docker.clone(),
        }
    }
}

impl ContainerSpec {
    /// The container to run for what the agent was assigned: the spawn
    /// spec's image, ports and scratch space, its limits (0 means none)
    /// and its tenant, which decides the network it joins.
    pub fn for_spawn(spec: SpawnSpec) -> Result<Self, SpawnError> {
        let image = spec.image.ok_or(SpawnError::NoImageOnContainerNode)?;
        let tenant_id = spec.tenant_id.ok_or(SpawnError::NoTenant)?;
        Ok(ContainerSpec {
            instance_id: spec.instance_id,
            tenant_id,
            image: image.image,
            command: spec.command,
            env: spec.env,
            ports: image.ports,
            cpu_milli: spec.cpu_milli.filter(|m| *m > 0),
            memory_mb: spec.memory_mb.filter(|m| *m > 0),
            scratch_mb: image.scratch_mb,
            gpu_indices: spec.gpu_indices,
            gpu_uuids: spec.gpu_uuids,
            vendors: spec.vendors,
            gpu_slices: spec.gpu_slices,
            registry_auth: spec.registry_auth,
        })
    }
}

impl StartTimings {
    /// The agent's side of the cold-start breakdown; `None` for a
    /// container this agent process did not start (adopted).
    pub fn cold_start(&self) -> Option<ColdStart> {
        let ready = self.started_at?;
        let ms = |from: DateTime<Utc>, to: DateTime<Utc>| {
            u64::try_from((to - from).num_milliseconds()).unwrap_or(0)
        };
        // Starting counts from the end of the pull, or from the create
        // when the node had the image.
        let start_from = self.pull.map(|(_, end)| end).or(self.created_at)?;
        Some(ColdStart {
            image_cached: self.cached,
            weights_tier: None,
            queued_ms: None,
            pulling_ms: Some(self.pull.map_or(0, |(from, to)| ms(from, to))),
            starting_ms: Some(ms(start_from, ready)),
            pull_started_at: self.pull.map(|(from, _)| from),
            created_at: self.created_at,
            ready_at: Some(ready),
        })
    }
}

impl Container {
    /// What the server is told about it with every observation.
    pub fn observed(&self) -> ObservedContainer {
        ObservedContainer {
            container_id: self.id.clone(),
            ports: self
                .ports
                .iter()
                .map(|p| flotilla_core::api::PublishedPort {
                    container_port: p.container_port,
                    host_port: p.host_port,
                    url: p.url.clone(),
                })
                .collect(),
            cold_start: self.timings.cold_start(),
            oom_killed: false,
        }
    }

    /// The agent's handle for it: stops asked of the handle reach the
    /// engine, and its exit (with the OOM verdict) comes back through it.
    fn into_workload(self, wakers: Wakers) -> Workload {
        let (workload, mut control) = Workload::new(
            self.instance_id.clone(),
            self.pid,
            // The engine, not a process group on the host, stops it: the
            // node lease's fence process cannot, the agent's watchdog does.
            None,
            self.started_at,
            self.logs.clone(),
        );
        let workload = workload.in_container(self.observed());
        tokio::spawn(async move {
            let exit = loop {
                tokio::select! {
                    exit = self.wait() => break exit,
                    grace = control.stop_requested() => self.stop(grace),
                }
            };
            control.exited(Exit {
                code: exit.code,
                at: exit.at,
                stop_requested: exit.stop_requested,
                oom_killed: exit.oom_killed,
                disk_exceeded: false,
            });
            // The container's supervisor woke them before this handle
            // had the exit: wake them again now that it has.
            wakers.logs.notify_one();
            wakers.changed.notify_one();
        });
        workload
    }
}

/// The agent's face of the container runtime: an instance's assignment
/// becomes a container, a restarted agent takes over this node's
/// containers, and a container is removed once the agent is done with it.
impl Runtime for ContainerRuntime {
    fn kind(&self) -> RuntimeKind {
        RuntimeKind::Container
    }

    fn engine(&self) -> Option<Docker> {
        Some(self.docker.clone())
    }

    fn network(&self) -> Option<flotilla_core::api::NodeNetwork> {
        Some(match &self.firewall {
            Some(f) => crate::runtime::network::Network::Isolated(f.clone()).report(f.allow()),
            None => crate::runtime::network::Network::Shared {
                why: "the agent is not root or nftables is missing".into(),
            }
            .report(&[]),
        })
    }

    fn start(
        &self,
        spec: SpawnSpec,
        wakers: Wakers,
    ) -> BoxFuture<'_, Result<Workload, SpawnError>> {
        Box::pin(async move {
            let spec = ContainerSpec::for_spawn(spec)?;
            let id = spec.instance_id.clone();
            let progress = self.progress.clone();
            // Reported with the next sync, not sooner: a pull says a lot,
            // and each wake-up would resend the sync.
            let say = move |message: String| {
                progress
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id.clone(), message);
            };
            let started = ContainerRuntime::start(self, &spec, wakers.clone(), &say).await;
            self.progress
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&spec.instance_id);
            Ok(started?.into_workload(wakers))
        })
    }

    fn adopt(&self, wakers: Wakers) -> BoxFuture<'_, Result<Vec<Workload>, RuntimeError>> {
        Box::pin(async move {
            let engine = |e: ContainerError| RuntimeError::Engine(e.to_string());
            let mut adopted = Vec::new();
            for (instance_id, _) in self.list().await.map_err(engine)? {
                // The engine keeps the whole log: it is replayed under the
                // same sequence numbers, and the server ignores the lines
                // it already has.
                if let Some(c) = ContainerRuntime::adopt(self, &instance_id, 0, wakers.clone())
                    .await
                    .map_err(engine)?
                {
                    adopted.push(c.into_workload(wakers.clone()));
                }
            }
            Ok(adopted)
        })
    }

    fn cached_images(&self) -> Option<Vec<flotilla_core::api::NodeImage>> {
        Some(self.image_report())
    }

    fn progress(&self, instance_id: &InstanceId) -> Option<String> {
        self.progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(instance_id)
            .cloned()
    }

    fn release(&self, instance_id: &InstanceId) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let docker = self.docker.clone();
        let name = container_name(instance_id);
        let instance_id = instance_id.clone();
        handle.spawn(async move {
            let opts = RemoveContainerOptions {
                force: true,
                v: true,
                ..Default::default()
            };
            match docker.remove_container(&name, Some(opts)).await {
                Ok(()) => tracing::info!(%instance_id, container = %name, "container removed"),
                Err(e) if status_of(&e) == Some(404) => {}
                Err(error) => {
                    tracing::warn!(%instance_id, container = %name, %error, "cannot remove container")
                }
            }
        });
    }
}

/// Enforces the image cache's limit every [`crate::image_cache::ENFORCE_EVERY`]
/// until the runtime is dropped.
async fn enforce_forever(cache: std::sync::Weak<ImageCache>, docker: Docker) {
    loop {
        tokio::time::sleep(crate::image_cache::ENFORCE_EVERY).await;
        let Some(cache) = cache.upgrade() else {
            return;
        };
        if let Err(error) = cache.enforce(&docker).await {
            tracing::warn!(%error, "cannot enforce the image cache limit");
        }
    }
}

/// Inspects a container. Podman reports a container between its end and
/// its cleanup as `stopped`, a state the Docker API (and so bollard's
/// model) does not have: that answer is asked again until the state
/// settles (`exited`).
async fn inspect(docker: &Docker, id: &str) -> Result<ContainerInspectResponse, ContainerError> {
    let start = tokio::time::Instant::now();
    loop {
        match timed(
            "inspect container",
            docker.inspect_container(id, None::<InspectContainerOptions>),
        )
        .await
        {
            Err(ContainerError::Engine {
                source: bollard::errors::Error::JsonDataError { .. },
                ..
            }) if start.elapsed() < CALL_TIMEOUT => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other,
        }
    }
}

/// The memory cgroup directory of process `pid` on this host (cgroup v1
/// `memory` controller, or the v2 unified hierarchy), when readable.
fn memory_cgroup_of(pid: u32) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let mut unified = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let rel = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "memory") {
            let dir = Path::new("/sys/fs/cgroup/memory").join(rel);
            if dir.is_dir() {
                return Some(dir);
            }
        } else if controllers.is_empty() {
            unified = Some(rel.to_string());
        }
    }
    let rel = unified?;
    [
        Path::new("/sys/fs/cgroup").join(&rel),
        Path::new("/sys/fs/cgroup/unified").join(&rel),
    ]
    .into_iter()
    .find(|d| d.join("memory.events").is_file())
}

/// OOM kills the kernel counted in a memory cgroup (`oom_kill` of cgroup
/// v1's `memory.oom_control` or v2's `memory.events`).
fn oom_kills(dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join("memory.oom_control"))
        .or_else(|_| std::fs::read_to_string(dir.join("memory.events")))
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
}

/// Whether a memory cgroup's usage ever reached its limit (cgroup v1's
/// `memory.failcnt`, v2's `max` event). Counted from the first page that
/// hits the limit, so it is seen well before the kill, while the cgroup
/// still exists.
fn limit_reached(dir: &Path) -> bool {
    if let Ok(n) = std::fs::read_to_string(dir.join("memory.failcnt")) {
        return n.trim().parse::<u64>().is_ok_and(|n| n > 0);
    }
    std::fs::read_to_string(dir.join("memory.events")).is_ok_and(|t| {
        t.lines()
            .find_map(|l| l.strip_prefix("max "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > 0)
    })
}

struct Supervised {
    docker: Docker,
    id: String,
    instance_id: InstanceId,
    stop_rx: mpsc::UnboundedReceiver<Duration>,
    exit_tx: watch::Sender<Option<ContainerExit>>,
    pump: tokio::task::JoinHandle<()>,
    cgroup: Option<PathBuf>,
    wakers: Wakers,
}

/// Waits for the container to end, applying stop requests and watching its
/// memory cgroup for OOM kills; then waits for its log stream to drain and
/// publishes the exit.
///
/// OOM kills are read from the cgroup as well as from the engine's
/// `State.OOMKilled` because Podman with cgroup v1 does not set the latter;
/// the cgroup is polled while the container runs, since it disappears soon
/// after the container ends.
async fn supervise(mut s: Supervised) {
    let mut stop_requested = false;
    let mut stops_open = true;
    let mut oom_seen = false;
    // The kill itself can come and the cgroup go between two polls; a
    // container that hit its memory limit and then died of SIGKILL that
    // nobody asked for was killed by the kernel's OOM killer.
    let mut at_limit = false;
    let mut poll = tokio::time::interval(OOM_POLL);
    let wait = wait_for_exit(s.docker.clone(), s.id.clone());
    tokio::pin!(wait);
    loop {
        tokio::select! {
            () = &mut wait => break,
            grace = s.stop_rx.recv(), if stops_open => match grace {
                Some(grace) => {
                    if !stop_requested {
                        stop_requested = true;
                        tracing::info!(instance_id = %s.instance_id, container = %s.id, grace_ms = grace.as_millis() as u64, "stopping container");
                        tokio::spawn(stop_container(s.docker.clone(), s.id.clone(), grace));
                    }
                }
                None => stops_open = false,
            },
            _ = poll.tick(), if s.cgroup.is_some() && !oom_seen => {
                if let Some(dir) = &s.cgroup {
                    oom_seen = oom_kills(dir).is_some_and(|n| n > 0);
                    at_limit = at_limit || limit_reached(dir);
                }
            }
        }
    }
    if let Some(dir) = &s.cgroup {
        oom_seen = oom_seen || oom_kills(dir).is_some_and(|n| n > 0);
    }
    let state = match inspect(&s.docker, &s.id).await {
        Ok(i) => i.state.unwrap_or_default(),
        Err(error) => {
            tracing::error!(instance_id = %s.instance_id, container = %s.id, %error, "cannot read how the container ended");
            Default::default()
        }
    };
    let code = state
        .exit_code
        .and_then(|c| i32::try_from(c).ok())
        .unwrap_or(-1);
    let at = state
        .finished_at
        .as_deref()
        .and_then(|s| DateTime::parse_from_rfc3339(s).ok())
        .map(|t| t.with_timezone(&Utc))
        .filter(|t| t.timestamp() > 0)
        .unwrap_or_else(Utc::now);
    let oom_killed = state.oom_killed.unwrap_or(false)
        || oom_seen
        || (at_limit && code == 137 && !stop_requested);
    if tokio::time::timeout(LOG_DRAIN_TIMEOUT, &mut s.pump)
        .await
        .is_err()
    {
        tracing::warn!(instance_id = %s.instance_id, container = %s.id, "log stream still open after the container ended, closing it");
        s.pump.abort();
    }
    tracing::info!(instance_id = %s.instance_id, container = %s.id, code, oom_killed, stopped = stop_requested, "container exited");
    s.exit_tx.send_replace(Some(ContainerExit {
        code,
        at,
        stop_requested,
        oom_killed,
    }));
    s.wakers.logs.notify_one();
    s.wakers.changed.notify_one();
}

/// Resolves once the container no longer runs. The engine's wait is the
/// fast path; if it fails (the engine restarted, the connection dropped)
/// the state is polled.
async fn wait_for_exit(docker: Docker, id: String) {
    let mut stream = docker.wait_container(
        &id,
        Some(WaitContainerOptions {
            condition: "not-running",
        }),
    );
    match stream.next().await {
        Some(Ok(_)) | Some(Err(bollard::errors::Error::DockerContainerWaitError { .. })) => return,
        Some(Err(error)) => {
            tracing::debug!(container = %id, %error, "container wait failed, polling its state")
        }
        None => {}
    }
    loop {
        match inspect(&docker, &id).await {
            Ok(i) if i.state.as_ref().and_then(|s| s.running) == Some(true) => {}
            Err(ContainerError::Engine { source, .. }) if status_of(&source) == Some(404) => return,
            Err(_) => {}
            Ok(_) => return,
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The engine's stop (SIGTERM, then SIGKILL after the grace), and a kill
/// if the container somehow still runs after it.
async fn stop_container(docker: Docker, id: String, grace: Duration) {
    let t =
        i64::try_from(grace.as_secs() + u64::from(grace.subsec_nanos() > 0)).unwrap_or(i64::MAX);
    if let Err(error) = docker
        .stop_container(&id, Some(StopContainerOptions { t }))
        .await
    {
        if matches!(status_of(&error), Some(304 | 404)) {
            return;
        }
        tracing::warn!(container = %id, %error, "stop failed, killing the container");
        let _ = docker
            .kill_container(&id, Some(KillContainerOptions { signal: "SIGKILL" }))
            .await;
    }
}

/// Follows the container's output from its beginning into `logs`, a line
/// per entry, until the stream ends. Frames carry chunks of a stream, not
/// lines, so each stream keeps its own partial line; a line longer than
/// [`MAX_LINE_BYTES`] is cut there, like a process's.
async fn follow_logs(
    docker: Docker,
    id: String,
    logs: Arc<LogBuffer>,
    skip_lines: u64,
    wake: Arc<tokio::sync::Notify>,
) {
    let opts = LogsOptions::<String> {
        follow: true,
        stdout: true,
        stderr: true,
        tail: "all".to_string(),
        ..Default::default()
    };
    let mut stream = docker.logs(&id, Some(opts));
    let mut out = LineSplitter::default();
    let mut err = LineSplitter::default();
    let mut skipped = 0u64;
    let mut emit = |stream: LogStream, line: &[u8]| {
        let text = String::from_utf8_lossy(line.strip_suffix(b"\r").unwrap_or(line)).into_owned();
        let pending = logs.push(stream, text);
        if skipped < skip_lines {
            // Already on the server: keep the numbering, not the line.
            skipped += 1;
            logs.ack(logs.captured() - 1);
        } else if pending >= SHIP_BATCH_LINES {
            wake.notify_one();
        }
    };
    while let Some(item) = stream.next().await {
        match item {
            Ok(LogOutput::StdOut { message }) | Ok(LogOutput::Console { message }) => {
                out.feed(&message, |l| emit(LogStream::Stdout, l));
            }
            Ok(LogOutput::StdErr { message }) => {
                err.feed(&message, |l| emit(LogStream::Stderr, l));
            }
            Ok(LogOutput::StdIn { .. }) => {}
            Err(error) => {
                tracing::warn!(container = %id, %error, "container log stream failed");
                break;
            }
        }
    }
    out.finish(|l| emit(LogStream::Stdout, l));
    err.finish(|l| emit(LogStream::Stderr, l));
    wake.notify_one();
}

/// Reassembles lines from chunks of one stream.
#[derive(Default)]
struct LineSplitter {
    line: Vec<u8>,
    truncated: bool,
}

impl LineSplitter {
    fn feed(&mut self, mut chunk: &[u8], mut emit: impl FnMut(&[u8])) {
        while !chunk.is_empty() {
            let (part, rest, end) = match chunk.iter().position(|b| *b == b'\n') {
                Some(i) => (&chunk[..i], &chunk[i + 1..], true),
                None => (chunk, &chunk[chunk.len()..], false),
            };
            let room = MAX_LINE_BYTES.saturating_sub(self.line.len());
            if part.len() > room {
                self.truncated = true;
            }
            self.line.extend_from_slice(&part[..part.len().min(room)]);
            if end {
                emit(&self.line);
                self.line.clear();
                self.truncated = false;
            }
            chunk = rest;
        }
    }

    fn finish(&mut self, mut emit: impl FnMut(&[u8])) {
        if !self.line.is_empty() || self.truncated {
            emit(&self.line);
        }
        self.line.clear();
        self.truncated = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ContainerSpec {
        ContainerSpec {
            instance_id: InstanceId::generate(1, 1),
            tenant_id: TenantId::generate(1, 2),
            image: "localhost/img:1".into(),
            command: vec!["sh".into(), "-c".into(), "true".into()],
            env: BTreeMap::from([
                ("A".to_string(), "1".to_string()),
                ("CUDA_VISIBLE_DEVICES".to_string(), "all".to_string()),
            ]),
            ports: vec![8080],
            cpu_milli: Some(1500),
            memory_mb: Some(512),
            scratch_mb: Some(64),
            gpu_indices: vec![1, 3],
            gpu_uuids: vec!["GPU-a".into(), "GPU-b".into()],
            vendors: vec![Vendor::Nvidia, Vendor::Nvidia],
            gpu_slices: Vec::new(),
            registry_auth: None,
        }
    }

    fn env_of(c: &Config<String>, k: &str) -> Option<String> {
        c.env
            .as_ref()?
            .iter()
            .find_map(|e| e.strip_prefix(&format!("{k}=")).map(str::to_string))
    }

    #[test]
    fn the_config_enforces_limits_and_isolation() {
        let s = spec();
        let cfg = ContainerConfig::new("unix:///x.sock", "node-1");
        let c = container_config(&s, &cfg);
        let h = c.host_config.as_ref().unwrap();
        assert_eq!(h.privileged, Some(false));
        assert_eq!(h.cap_drop.as_deref(), Some(&["ALL".to_string()][..]));
        assert_eq!(h.cap_add.as_deref(), Some(&[][..]));
        assert_eq!(
            h.security_opt.as_deref(),
            Some(&["no-new-privileges".to_string()][..])
        );
        assert_eq!(h.memory, Some(512 * 1024 * 1024));
        assert_eq!(h.memory_swap, h.memory);
        assert_eq!(h.nano_cpus, Some(1_500_000_000));
        assert!(h.binds.is_none() && h.mounts.is_none());
        let net = tenant_ports_network(&s.tenant_id);
        assert_eq!(h.network_mode.as_deref(), Some(net.as_str()));
        assert!(net.starts_with("flotilla-t-ten_"));
        assert_eq!(
            h.tmpfs.as_ref().unwrap()[SCRATCH_DIR],
            "rw,nosuid,nodev,size=64m,mode=1777"
        );
        assert!(h.port_bindings.as_ref().unwrap().contains_key("8080/tcp"));
        assert_eq!(c.user.as_deref(), Some(DEFAULT_USER));
        let labels = c.labels.as_ref().unwrap();
        assert_eq!(labels[LABEL_INSTANCE], s.instance_id.to_string());
        assert_eq!(labels[LABEL_NODE], "node-1");
        assert_eq!(labels[LABEL_TENANT], s.tenant_id.to_string());
        // Simulated GPUs: the variables only, and the spec cannot override
        // the selection.
        assert!(h.device_requests.is_none() && h.devices.is_none());
        assert_eq!(env_of(&c, "CUDA_VISIBLE_DEVICES").as_deref(), Some("1,3"));
        assert_eq!(env_of(&c, "NVIDIA_VISIBLE_DEVICES").as_deref(), Some("1,3"));
        assert_eq!(env_of(&c, "A").as_deref(), Some("1"));
        assert_eq!(env_of(&c, "HOME").as_deref(), Some(SCRATCH_DIR));

        let mut no_ports = spec();
        no_ports.ports.clear();
        let c = container_config(&no_ports, &cfg);
        let h = c.host_config.as_ref().unwrap();
        assert_eq!(
            h.network_mode.as_deref(),
            Some(tenant_network(&no_ports.tenant_id).as_str())
        );
        assert!(h.port_bindings.is_none() && c.exposed_ports.is_none());
    }

    #[test]
    fn real_gpus_are_passed_by_uuid_or_cdi_name() {
        let s = spec();
        let mut cfg = ContainerConfig::new("unix:///x.sock", "n");
        cfg.gpus = GpuPassthrough::DeviceRequests;
        let c = container_config(&s, &cfg);
        let r = &c
            .host_config
            .as_ref()
            .unwrap()
            .device_requests
            .as_ref()
            .unwrap()[0];
        assert_eq!(r.driver.as_deref(), Some("nvidia"));
        assert_eq!(r.device_ids.as_ref().unwrap(), &s.gpu_uuids);
        assert_eq!(
            env_of(&c, "NVIDIA_VISIBLE_DEVICES").as_deref(),
            Some("GPU-a,GPU-b")
        );
        assert_eq!(
            env_of(&c, "CUDA_VISIBLE_DEVICES").as_deref(),
            Some("GPU-a,GPU-b")
        );

        cfg.gpus = GpuPassthrough::Cdi;
        let mut mig = spec();
        mig.gpu_indices = vec![0];
        mig.gpu_uuids = vec!["GPU-a".into()];
        mig.gpu_slices = vec![GpuSlice {
            gpu_id: flotilla_core::id::GpuId::generate(1, 3),
            milli: 142,
            mig_profile: Some("1g.10gb".into()),
            mig_device: Some("MIG-GPU-a/2/0".into()),
            memory_limit_mib: Some(10_240),
        }];
        let c = container_config(&mig, &cfg);
        let h = c.host_config.as_ref().unwrap();
        assert!(h.device_requests.is_none());
        let names: Vec<_> = h
            .devices
            .as_ref()
            .unwrap()
            .iter()
            .map(|d| d.path_on_host.clone().unwrap())
            .collect();
        assert_eq!(names, vec!["nvidia.com/gpu=MIG-GPU-a/2/0"]);
        assert_eq!(
            env_of(&c, "CUDA_VISIBLE_DEVICES").as_deref(),
            Some("MIG-GPU-a/2/0")
        );
    }

    #[test]
    fn lines_are_reassembled_per_stream_and_capped() {
        let mut s = LineSplitter::default();
        let mut got: Vec<String> = Vec::new();
        s.feed(b"ab", |l| got.push(String::from_utf8_lossy(l).into()));
        s.feed(b"c\nd\r\n\ne", |l| {
            got.push(String::from_utf8_lossy(l).into())
        });
        s.finish(|l| got.push(String::from_utf8_lossy(l).into()));
        assert_eq!(got, vec!["abc", "d\r", "", "e"]);
        let mut long = Vec::new();
        let big = vec![b'x'; MAX_LINE_BYTES + 10];
        s.feed(&big, |l| long.push(l.len()));
        s.feed(b"yy\nz\n", |l| long.push(l.len()));
        assert_eq!(long, vec![MAX_LINE_BYTES, 1]);
    }

    #[test]
    fn assignments_become_container_specs() {
        let base = SpawnSpec {
            instance_id: InstanceId::generate(1, 1),
            tenant_id: Some(TenantId::generate(1, 2)),
            command: vec!["httpd".into()],
            env: BTreeMap::from([("A".to_string(), "1".to_string())]),
            workdir: PathBuf::from("/unused"),
            gpu_indices: vec![0],
            gpu_uuids: vec!["GPU-a".into()],
            vendors: vec![Vendor::Nvidia],
            gpu_slices: Vec::new(),
            image: Some(flotilla_core::instance::ImageSpec {
                image: "localhost/img:1".into(),
                ports: vec![8080],
                scratch_mb: Some(32),
            }),
            cpu_milli: Some(0),
            memory_mb: Some(256),
            disk_mb: None,
            registry_auth: None,
        };
        let c = ContainerSpec::for_spawn(base.clone()).unwrap();
        assert_eq!(c.image, "localhost/img:1");
        assert_eq!(c.ports, vec![8080]);
        assert_eq!(c.scratch_mb, Some(32));
        assert_eq!(c.cpu_milli, None, "0 is no limit");
        assert_eq!(c.memory_mb, Some(256));
        assert_eq!(c.gpu_uuids, vec!["GPU-a".to_string()]);
        let no_image = SpawnSpec {
            image: None,
            ..base.clone()
        };
        assert!(matches!(
            ContainerSpec::for_spawn(no_image),
            Err(SpawnError::NoImageOnContainerNode)
        ));
        let no_tenant = SpawnSpec {
            tenant_id: None,
            ..base
        };
        assert!(matches!(
            ContainerSpec::for_spawn(no_tenant),
            Err(SpawnError::NoTenant)
        ));
        assert_eq!("cdi".parse(), Ok(GpuPassthrough::Cdi));
        assert!("gpu"
            .parse::<GpuPassthrough>()
            .unwrap_err()
            .contains("`gpu`"));
    }

    #[test]
    fn cold_starts_count_the_pull_and_the_start() {
        let t = |s: i64| DateTime::from_timestamp(1_700_000_000 + s, 0).unwrap();
        let pulled = StartTimings {
            cached: false,
            pull: Some((t(0), t(5))),
            created_at: Some(t(6)),
            started_at: Some(t(7)),
        };
        let c = pulled.cold_start().unwrap();
        assert!(!c.image_cached);
        assert_eq!((c.pulling_ms, c.starting_ms), (Some(5000), Some(2000)));
        assert_eq!(c.ready_at, Some(t(7)));
        let cached = StartTimings {
            cached: true,
            pull: None,
            created_at: Some(t(1)),
            started_at: Some(t(2)),
        };
        let c = cached.cold_start().unwrap();
        assert!(c.image_cached && c.pull_started_at.is_none());
        assert_eq!((c.pulling_ms, c.starting_ms), (Some(0), Some(1000)));
        assert_eq!(StartTimings::default().cold_start(), None, "adopted");
    }

    #[test]
    fn exit_reasons_name_out_of_memory() {
        let e = ContainerExit {
            code: 137,
            at: Utc::now(),
            stop_requested: false,
            oom_killed: true,
        };
        assert!(e.reason().starts_with("out of memory"), "{}", e.reason());
        let e = ContainerExit {
            oom_killed: false,
            ..e
        };
        assert_eq!(e.reason(), "exit code 137");
    }
}
