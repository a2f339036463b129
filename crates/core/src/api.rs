//! Wire types of the HTTP API, shared by the server (which documents them
//! in OpenAPI), the agent and the CLI, so the three cannot drift apart.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::catalog::Vendor;
use crate::id::{GpuId, InstanceId, JobId, KeyId, NodeId, TenantId, WorkId};
use crate::instance::{ImageSpec, InstanceState};
use crate::job::{JobSpec, JobState};
use crate::node::{ExecutorKind, NodeState, RuntimeKind};
use crate::tenant::Role;

/// One page of a list. Pass `next_cursor` back as `cursor` for the next
/// page; it is absent on the last page.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Page<T> {
    /// The items of this page, oldest first.
    pub items: Vec<T>,
    /// Cursor of the next page, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// The error body of every non-2xx answer.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    /// Machine-readable code, e.g. `invalid_field`, `not_found`,
    /// `quota_exceeded`, `conflict`, `rate_limited`.
    pub code: String,
    /// One human sentence.
    pub message: String,
    /// Structured context, e.g. `{"field": "gpus"}`.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub details: serde_json::Value,
}

/// A tenant.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Tenant {
    /// Id.
    pub id: TenantId,
    /// Unique DNS-label name.
    pub name: String,
    /// Creation time.
    pub created_at: DateTime<Utc>,
}

/// Create a tenant (operators only).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTenant {
    /// Unique DNS-label name.
    pub name: String,
}

/// An API key's public description; the secret is never shown again.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ApiKey {
    /// Id.
    pub id: KeyId,
    /// Owning tenant.
    pub tenant_id: TenantId,
    /// What it may do.
    pub role: Role,
    /// Free-form label.
    pub name: String,
    /// The first characters of the secret, to recognise it.
    pub prefix: String,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Set once revoked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<DateTime<Utc>>,
    /// Set on an inference key: the endpoints it may call through the
    /// gateway (empty: every endpoint of its tenant). Inference keys
    /// cannot call the management API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<Vec<crate::id::EndpointId>>,
}

/// One mutating API call, as the audit log keeps it: who (the key and
/// its tenant), what (method, route and the object it named or created),
/// when, and how it ended. Written by the server for every authenticated
/// POST, PUT, PATCH and DELETE, whatever its result; never edited.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AuditEntry {
    /// Id; sorts by time.
    pub id: crate::id::AuditId,
    /// When the answer was sent.
    pub at: DateTime<Utc>,
    /// The key that made the call.
    pub key_id: KeyId,
    /// The key's tenant.
    pub tenant_id: TenantId,
    /// HTTP method.
    pub method: String,
    /// The route's template, e.g. `/v1/instances/{instance_id}/stop`.
    pub route: String,
    /// The object the call named in its path, or the one it created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object_id: Option<String>,
    /// The HTTP status of the answer.
    pub status: u16,
    /// The request's `x-request-id`, to find it in the server's log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// Create an API key.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateApiKey {
    /// Tenant the key acts for; default: the caller's tenant. Only
    /// operators may name another tenant.
    #[serde(default)]
    pub tenant_id: Option<TenantId>,
    /// Role of the new key.
    pub role: Role,
    /// Label (default: empty).
    #[serde(default)]
    pub name: String,
    /// Makes an inference key for the gateway, limited to these endpoints
    /// of the tenant (empty list: all of them); its role must be
    /// `tenant_member`. Absent: an API key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<Vec<crate::id::EndpointId>>,
}

/// A freshly created key: the only time the secret is shown.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreatedApiKey {
    /// The key's description.
    pub key: ApiKey,
    /// The bearer secret. Store it now: only its hash is kept.
    pub secret: String,
}

/// A tenant's quota and what it uses now.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct QuotaView {
    /// Tenant.
    pub tenant_id: TenantId,
    /// Limits.
    pub quota: crate::quota::Quota,
    /// GPUs held by live instances.
    pub usage: crate::quota::Usage,
}

/// A catalog model with the pool's capacity.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GpuTypeView {
    /// The catalog entry.
    #[serde(flatten)]
    pub model: crate::catalog::GpuModel,
    /// GPUs of this model on ready nodes.
    pub total: u32,
    /// Of those, not held by any instance.
    pub free: u32,
}

/// One GPU of a node.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Gpu {
    /// Id.
    pub id: GpuId,
    /// Index on the node (what `CUDA_VISIBLE_DEVICES` names).
    pub index: u32,
    /// Catalog model.
    pub model: String,
    /// Device UUID (`GPU-…`), simulated ones included.
    pub uuid: String,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Instance holding it whole, if any (hidden from other tenants).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<InstanceId>,
    /// In MIG mode: it takes MIG profiles only, never whole or fractional
    /// work.
    #[serde(default)]
    pub mig_mode: bool,
    /// Milli-GPU held by work on it (whole GPUs, fractions or MIG
    /// instances), 0..=1000.
    #[serde(default)]
    pub used_milli: u32,
    /// Why the GPU is out of placement (an XID or ECC error, over
    /// temperature), as the server decided from its agent's telemetry;
    /// absent while it is healthy. Work already on it keeps running; no new
    /// work is placed there until an operator resets it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<String>,
}

/// Something that happened to a node or one of its GPUs, for operators
/// (`GET /v1/nodes/{id}/events`): a GPU taken out of placement, a cordon,
/// a drain, the node declared unreachable.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeEvent {
    /// The node.
    pub node_id: NodeId,
    /// 1, 2, … per node, in order.
    pub seq: u64,
    /// What happened: `gpu_fault`, `gpu_reset`, `cordoned`, `uncordoned`,
    /// `drained`, `unreachable`.
    pub kind: String,
    /// The GPU concerned, for GPU events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_id: Option<GpuId>,
    /// What a person reads.
    pub message: String,
    /// When.
    pub at: DateTime<Utc>,
}

/// What `POST /v1/nodes/{id}/drain` did.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DrainReport {
    /// The node, now cordoned.
    pub node: Node,
    /// The instances asked to stop (their jobs restart elsewhere as their
    /// restart policy says).
    pub stopping: Vec<InstanceId>,
}

/// What one piece of work holds of one GPU: the whole of it, a fraction or
/// a MIG instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GpuSlice {
    /// The GPU.
    pub gpu_id: GpuId,
    /// Its share in milli-GPU (1000: the whole GPU; MIG: slices / 7,
    /// rounded down).
    pub milli: u32,
    /// The MIG profile, for a MIG instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_profile: Option<String>,
    /// The MIG device as `CUDA_VISIBLE_DEVICES` names it
    /// (`MIG-<gpu uuid>/<gpu instance>/<compute instance>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_device: Option<String>,
    /// GPU memory the work may use, in MiB (fractions and MIG instances).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_limit_mib: Option<u64>,
}

/// A node.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Node {
    /// Id.
    pub id: NodeId,
    /// Name, unique, usually the hostname.
    pub name: String,
    /// Tenant (provider) that registered it.
    pub owner_tenant_id: TenantId,
    /// Region.
    pub region: String,
    /// Node pool.
    pub pool: String,
    /// Liveness.
    pub state: NodeState,
    /// Out of scheduling.
    pub cordoned: bool,
    /// GPUs are simulated (no real device behind them).
    pub simulated: bool,
    /// CPU capacity in milli-cores.
    pub cpu_milli: u64,
    /// Memory capacity in MiB.
    pub memory_mb: u64,
    /// How its agent runs workloads: work with an image goes only to
    /// `container` nodes, work without one only to `process` nodes.
    #[serde(default)]
    pub runtime: RuntimeKind,
    /// Which engine runs its work: `agent` (Flotilla's node agent),
    /// `slurm` or `kubernetes` (a cluster engine's node, registered by an
    /// executor bridge).
    #[serde(default)]
    pub executor: ExecutorKind,
    /// Last heartbeat.
    pub last_heartbeat_at: DateTime<Utc>,
    /// Registration time.
    pub created_at: DateTime<Utc>,
    /// Its GPUs.
    pub gpus: Vec<Gpu>,
    /// The images its agent last reported in its cache, most recently
    /// used first (`GET /v1/nodes/{id}` only; empty in lists and for
    /// agents that run no containers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<NodeImage>,
    /// The endpoint replicas' model weights its agent last reported:
    /// parked replicas in host memory and weights on its disk
    /// (`GET /v1/nodes/{id}` only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub weights: Vec<NodeWeights>,
    /// The limits its agent said it cannot hold workloads to, with why
    /// (`memory: …`); empty: every limit is enforced.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unenforced_limits: Vec<String>,
    /// How it isolates its workloads' network (`GET /v1/nodes/{id}`),
    /// as its agent last registered it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NodeNetwork>,
}

/// One image in a node's image cache, as its agent reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeImage {
    /// The reference instances asked for (`registry.example/app:1`).
    pub image: String,
    /// The engine's image id (`sha256:…`): references of one image share it.
    pub id: String,
    /// Size in bytes as the engine reports it (layers shared with other
    /// images are counted in each).
    pub size_bytes: u64,
    /// When an instance last started from it on this node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_used: Option<DateTime<Utc>>,
}

/// One lifecycle transition.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct InstanceEvent {
    /// State entered.
    pub state: InstanceState,
    /// Why.
    pub reason: String,
    /// When.
    pub at: DateTime<Utc>,
}

crate::work::resolved_work! {
/// An instance.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Instance {
    /// Id.
    pub id: InstanceId,
    /// Owner.
    pub tenant_id: TenantId,
    /// Display name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Current state.
    pub state: InstanceState,
    /// Why it is in that state (for `pending`: why it is not placed).
    pub state_reason: String,
    /// GPUs asked for.
    pub gpus: u32,
    /// Node it runs on, once scheduled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<NodeId>,
    /// Model it got, once scheduled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_model: Option<String>,
    /// GPUs it holds (or held), once scheduled.
    pub gpu_ids: Vec<GpuId>,
    /// What it holds (or held) of each of its GPUs, once scheduled: which
    /// slice of a shared GPU is its.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_slices: Vec<GpuSlice>,
    /// Exit status, once exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// A stop was requested.
    pub stop_requested: bool,
    /// Set when the scheduler preempted it: the instance or job it made
    /// room for.
    /// A preempted instance ends `stopped` and its work is requeued as a
    /// new instance whose `requeued_from` names this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub preempted_by: Option<WorkId>,
    /// The preempted instance this one requeues (same spec, same tenant).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requeued_from: Option<InstanceId>,
    /// The job this instance is a member of, with its rank and the job's
    /// attempt it belongs to; absent for a plain instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<JobMembership>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// When it started running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<DateTime<Utc>>,
    /// When it reached a final state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<DateTime<Utc>>,
    /// Every transition, oldest first.
    pub events: Vec<InstanceEvent>,
    /// Its published ports and where to reach them, once its container
    /// runs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub published_ports: Vec<PublishedPort>,
    /// How long each step of its start took, once it started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cold_start: Option<ColdStart>,
}
}

/// Where a replica's weights are on a node, fastest to start from first.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum WeightTier {
    /// In host memory, the GPU released: back in about a second.
    Parked,
    /// On the node's local disk.
    Cached,
    /// Nothing on the node: downloaded.
    Remote,
}

impl WeightTier {
    /// Lowercase name, as the API and `FLOTILLA_LOAD_TIER` spell it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Parked => "parked",
            Self::Cached => "cached",
            Self::Remote => "remote",
        }
    }
}

impl std::fmt::Display for WeightTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Model weights a node holds, as its agent reports them: on its disk
/// (`cached`) or as a parked replica in host memory (`parked`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeWeights {
    /// The cache key (`ep_…-rN`: an endpoint's weights at a revision).
    pub key: String,
    /// `parked` or `cached`.
    pub tier: WeightTier,
    /// Bytes held (disk or host memory).
    pub size_bytes: u64,
    /// Parked: when it was parked; cached: when last used.
    pub since: DateTime<Utc>,
    /// Parked: the replica instance that parked (one entry each).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica: Option<InstanceId>,
    /// Parked: the endpoint billed for the host memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_id: Option<crate::id::EndpointId>,
}

/// A park that ended on the node, as its agent saw it: the replica's
/// weights left host memory at `ended_at` on the agent's clock (restored
/// onto a GPU, its `keep_parked_s` ran out, dropped for a newer park, or
/// released because its endpoint was deleted). The server bills the park
/// from `since` to `ended_at` rather than to the sync that no longer lists
/// it, so the bill is exact to the millisecond instead of to a sync
/// interval. The agent resends it until a sync is answered; the ledger's
/// key (the replica and `since`) bills it once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EndedPark {
    /// The replica instance that was parked.
    pub replica: InstanceId,
    /// The endpoint billed for the host memory.
    pub endpoint_id: crate::id::EndpointId,
    /// The weights' cache key (`ep_…-rN`).
    pub key: String,
    /// Bytes of host memory the park held.
    pub size_bytes: u64,
    /// When it was parked (as its weights entry reported).
    pub since: DateTime<Utc>,
    /// When the park ended, on the agent's clock.
    pub ended_at: DateTime<Utc>,
}

impl EndedPark {
    /// The park as the weights entry it was while it lasted.
    pub fn as_weights(&self) -> NodeWeights {
        NodeWeights {
            key: self.key.clone(),
            tier: WeightTier::Parked,
            size_bytes: self.size_bytes,
            since: self.since,
            replica: Some(self.replica.clone()),
            endpoint_id: Some(self.endpoint_id.clone()),
        }
    }
}

/// A container port published on the instance's node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PublishedPort {
    /// The port inside the container.
    pub container_port: u16,
    /// The node's port it is published on.
    pub host_port: u16,
    /// Where a tenant reaches it (`http://<node>:<host port>`).
    pub url: String,
}

/// The cold-start breakdown of one instance: when each step ended. The
/// server adds `queued_ms` (creation to placement); the agent reports the
/// rest.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ColdStart {
    /// The image was already on the node: no pull.
    pub image_cached: bool,
    /// Where the replica's model weights loaded from (endpoints that
    /// declare `model_gb`): host memory (parked), the node's disk
    /// (cached) or nothing local (remote).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights_tier: Option<WeightTier>,
    /// Waiting for a placement, ms (creation to `scheduled`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued_ms: Option<u64>,
    /// Pulling the image, ms (0 when cached).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pulling_ms: Option<u64>,
    /// Creating and starting the container after the pull, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starting_ms: Option<u64>,
    /// When the pull began, when the container was created, when it was
    /// running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull_started_at: Option<DateTime<Utc>>,
    /// When the container was created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<DateTime<Utc>>,
    /// When it ran (ready).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_at: Option<DateTime<Utc>>,
}

/// What an agent's container runtime adds to an observation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ObservedContainer {
    /// The engine's container id.
    pub container_id: String,
    /// Published ports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<PublishedPort>,
    /// The cold-start breakdown (agent side).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cold_start: Option<ColdStart>,
    /// It was killed for exceeding its memory limit.
    #[serde(default)]
    pub oom_killed: bool,
}

/// Where a member instance stands in its job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JobMembership {
    /// The job.
    pub job_id: JobId,
    /// Rank, 0-based.
    pub rank: u32,
    /// The job's attempt (1-based) this member was started for.
    pub attempt: u32,
}

/// One pending instance in queue order (`GET /v1/queue`).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct QueueEntry {
    /// 1-based place in the whole queue (work of other tenants ahead of it
    /// counts, without being shown).
    pub position: u32,
    /// The pending instance; `state_reason` says why it is not placed.
    pub instance: Instance,
}

/// Which output a log line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum LogStream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// One line of an instance's output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LogLine {
    /// Position in the instance's log, from 0, without gaps.
    pub seq: u64,
    /// Source.
    pub stream: LogStream,
    /// When the agent read it.
    pub at: DateTime<Utc>,
    /// The text, without the newline.
    pub line: String,
}

// ---- Agent protocol -------------------------------------------------------

/// A GPU the agent found (or simulates).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DiscoveredGpu {
    /// Index on the node.
    pub index: u32,
    /// Catalog model.
    pub model: String,
    /// Device UUID.
    pub uuid: String,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Vendor.
    pub vendor: Vendor,
    /// The GPU is in MIG mode (NVML's current mode, or a simulated
    /// `1xH100:mig`): it takes MIG profiles only.
    #[serde(default)]
    pub mig_mode: bool,
}

/// Sent by an agent when it starts, and again when the server forgot it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegisterNode {
    /// Node name, unique in the deployment; re-registering the same name
    /// re-attaches to the same node.
    pub name: String,
    /// Region (default `local`).
    #[serde(default)]
    pub region: Option<String>,
    /// Node pool (default `default`).
    #[serde(default)]
    pub pool: Option<String>,
    /// CPU capacity in milli-cores.
    pub cpu_milli: u64,
    /// Memory capacity in MiB.
    pub memory_mb: u64,
    /// GPUs are simulated.
    pub simulated: bool,
    /// The GPUs.
    pub gpus: Vec<DiscoveredGpu>,
    /// Agent version.
    #[serde(default)]
    pub agent_version: String,
    /// How the agent runs workloads. Absent means `process`, so agents
    /// from before it was sent keep registering; left out when `process`,
    /// so such an agent still registers with an older server.
    #[serde(default, skip_serializing_if = "RuntimeKind::is_process")]
    pub runtime: RuntimeKind,
    /// Which engine runs the node's work: Flotilla's agent, or a cluster
    /// engine through an executor bridge. Absent means `agent`, so agents
    /// from before it was sent keep registering; left out when `agent`, so
    /// an agent still registers with an older server.
    #[serde(default, skip_serializing_if = "ExecutorKind::is_agent")]
    pub executor: ExecutorKind,
    /// Instances the agent still runs (taken over from an earlier agent
    /// process after a restart): the server must not fail them. Every
    /// other instance it had started there is gone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub running: Vec<InstanceId>,
    /// The limits (memory, cpu, pids, disk) this node cannot hold its
    /// workloads to, each with why; left out when it enforces all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unenforced_limits: Vec<String>,
    /// How the node isolates its workloads' network, as its agent set it
    /// up. Absent from agents before it was sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NodeNetwork>,
}

/// How a node's agent isolates its workloads' network.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeNetwork {
    /// Workloads are behind the agent's firewall (a namespace each on the
    /// process runtime; tenant networks held to the policy on the
    /// container runtime). False: they share the host's network.
    pub isolated: bool,
    /// What the agent said about it (why not, when not isolated).
    pub detail: String,
    /// The operator's `--allow-egress` rules: inward networks workloads
    /// may reach anyway.
    #[serde(default)]
    pub allow_egress: Vec<String>,
}

/// The server's answer to a registration.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Registered {
    /// The node's id.
    pub node_id: NodeId,
    /// How often to sync, at least.
    pub heartbeat_interval_ms: u64,
    /// The node's lease: an agent that could not sync for this long stops
    /// its work itself, because the server then restarts it elsewhere.
    /// Absent from servers without node leases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
    /// The server may answer a sync that asks for it (`busy_ok`) with a
    /// busy answer ([`SyncResponse::busy_retry_ms`]) when it is at its
    /// limit of reports in flight. Absent from older servers, which would
    /// refuse the field: an agent sends `busy_ok` only to a server that
    /// said this.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub busy_answers: bool,
}

/// What the agent observed of one instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum ObservedPhase {
    /// The process is being spawned.
    Starting,
    /// The process runs.
    Running {
        /// Its process id.
        pid: u32,
    },
    /// The process exited (`signal` set when a signal ended it).
    Exited {
        /// Exit status (128 + signal when killed by one).
        code: i32,
        /// The stop was requested by the server.
        stopped: bool,
    },
    /// The process could not be started.
    FailedToStart {
        /// Why.
        reason: String,
    },
}

/// One instance as the agent sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ObservedInstance {
    /// Instance.
    pub instance_id: InstanceId,
    /// Its phase.
    #[serde(flatten)]
    pub phase: ObservedPhase,
    /// When the agent saw this phase begin.
    pub at: DateTime<Utc>,
    /// When the work began running, sent with an exit: work that started
    /// and ended between two reports was never reported running, and
    /// without its start the server would meter it from its exit (zero).
    /// An executor sends its engine's start (Slurm's `start_time`), the
    /// agent its process's spawn. Absent: the server takes the exit time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<DateTime<Utc>>,
    /// What is happening while it starts (an image pull's progress).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Its container, when it runs in one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<ObservedContainer>,
    /// Where its model weights loaded from, for a replica that declares
    /// them; recorded in its cold-start breakdown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights_tier: Option<WeightTier>,
    /// The limit it was ended for exceeding, once it exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_exceeded: Option<LimitExceeded>,
}

/// A limit a node ended an instance for exceeding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum LimitExceeded {
    /// Its memory limit: the kernel killed it (out of memory).
    Memory,
    /// Its disk limit: the agent stopped it.
    Disk,
}

/// An agent's periodic report; the answer is its desired work.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SyncRequest {
    /// Every instance the agent knows of that the server last assigned,
    /// and finished ones until the server stops assigning them.
    pub observed: Vec<ObservedInstance>,
    /// Long-poll: how long the server may hold the answer when nothing
    /// changed (capped at 30 s; 0 answers at once).
    #[serde(default)]
    pub wait_ms: u64,
    /// Telemetry of the node's GPUs, read when the request was built; empty
    /// where the agent has no driver to read it from (simulated GPUs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<GpuSample>,
    /// The node's image cache, from agents that run containers: replaces
    /// what the server knew. Absent: nothing to report (the server keeps
    /// what it had).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images: Option<Vec<NodeImage>>,
    /// Model weights the node holds (disk cache and parked replicas):
    /// replaces what the server knew. Absent: nothing to report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<Vec<NodeWeights>>,
    /// Parks that ended since the agent's last answered sync, with when
    /// each ended on its clock: their bill ends there. Absent from older
    /// agents (a park's bill then ends at the sync that no longer lists
    /// it), and left out when empty, which older servers accept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parks_ended: Vec<EndedPark>,
    /// The agent takes a busy answer ([`SyncResponse::busy_retry_ms`]):
    /// under load the server may renew the lease without taking the
    /// report. Sent only to servers whose registration answer said
    /// `busy_answers`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub busy_ok: bool,
}

/// One reading of one GPU's counters, as the driver reports them. A field
/// the device does not support (power on some boards, say) is absent
/// rather than zero, so a dashboard shows a gap instead of a false value.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GpuSample {
    /// Index on the node.
    pub index: u32,
    /// Device UUID.
    pub uuid: String,
    /// Device name as the driver reports it (`NVIDIA H200`).
    pub device_name: String,
    /// Percent of the last sample period a kernel ran (0–100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_util_pct: Option<u32>,
    /// Percent of the period device memory was read or written (0–100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_copy_util_pct: Option<u32>,
    /// Frame-buffer memory in use, MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fb_used_mib: Option<u64>,
    /// Frame-buffer memory free, MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fb_free_mib: Option<u64>,
    /// Core temperature, °C.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_c: Option<u32>,
    /// Board power draw, W.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_w: Option<f64>,
    /// Streaming-multiprocessor clock, MHz.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_clock_mhz: Option<u32>,
    /// The last XID error the driver raised on this GPU since the agent
    /// started (DCGM's `DCGM_FI_DEV_XID_ERRORS`); absent when none was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_xid: Option<u64>,
    /// Uncorrectable (double-bit) ECC errors since the driver loaded
    /// (`DCGM_FI_DEV_ECC_DBE_VOL_TOTAL`); absent where ECC is off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ecc_uncorrected: Option<u64>,
}

/// The latest telemetry of the GPUs an instance holds
/// (`GET /v1/instances/{id}/telemetry`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct InstanceTelemetry {
    /// The instance.
    pub instance_id: InstanceId,
    /// Node it runs on, once placed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<NodeId>,
    /// When the node's agent sent these readings; absent when there are
    /// none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<DateTime<Utc>>,
    /// One sample per GPU it holds. Empty while it holds none (pending or
    /// ended), on simulated GPUs (no driver to read), or when its node has
    /// not reported within the heartbeat timeout.
    pub gpus: Vec<GpuSample>,
}

impl SyncRequest {
    /// Most GPU samples one sync may carry (the largest nodes have 16).
    pub const MAX_GPU_SAMPLES: usize = 64;

    /// Most cached images one sync may report.
    pub const MAX_IMAGES: usize = 1000;

    /// Most weight entries one sync may report.
    pub const MAX_WEIGHTS: usize = 1000;

    /// Most ended parks one sync may report (the agent keeps no more).
    pub const MAX_PARKS_ENDED: usize = 1000;

    /// Checks the weights part (held weights and ended parks); the field
    /// names the entry at fault. An ended park's times are not checked
    /// against each other or the server's clock: they are the agent's,
    /// and the server clamps them when billing (refusing them would have
    /// the agent resend the same sync forever).
    pub fn validate_weights(&self) -> Result<(), crate::FieldError> {
        if self.parks_ended.len() > Self::MAX_PARKS_ENDED {
            return Err(crate::FieldError::new(
                "parks_ended",
                format!("at most {} entries", Self::MAX_PARKS_ENDED),
            ));
        }
        for (i, p) in self.parks_ended.iter().enumerate() {
            if p.key.is_empty() || p.key.len() > 200 {
                return Err(crate::FieldError::new(
                    format!("parks_ended[{i}].key"),
                    "1 to 200 characters",
                ));
            }
            if i64::try_from(p.size_bytes).is_err() {
                return Err(crate::FieldError::new(
                    format!("parks_ended[{i}].size_bytes"),
                    "too large",
                ));
            }
        }
        let Some(weights) = &self.weights else {
            return Ok(());
        };
        if weights.len() > Self::MAX_WEIGHTS {
            return Err(crate::FieldError::new(
                "weights",
                format!("at most {} entries", Self::MAX_WEIGHTS),
            ));
        }
        for (i, w) in weights.iter().enumerate() {
            if w.key.is_empty() || w.key.len() > 200 {
                return Err(crate::FieldError::new(
                    format!("weights[{i}].key"),
                    "1 to 200 characters",
                ));
            }
            if i64::try_from(w.size_bytes).is_err() {
                return Err(crate::FieldError::new(
                    format!("weights[{i}].size_bytes"),
                    "too large",
                ));
            }
            match w.tier {
                WeightTier::Remote => {
                    return Err(crate::FieldError::new(
                        format!("weights[{i}].tier"),
                        "a node holds weights parked or cached, never remote",
                    ))
                }
                WeightTier::Parked if w.replica.is_none() || w.endpoint_id.is_none() => {
                    return Err(crate::FieldError::new(
                        format!("weights[{i}].replica"),
                        "a parked entry names its replica and endpoint",
                    ))
                }
                _ => {}
            }
            if weights[..i]
                .iter()
                .any(|o| o.tier == w.tier && o.key == w.key && o.replica == w.replica)
            {
                return Err(crate::FieldError::new(
                    format!("weights[{i}].key"),
                    format!("`{}` is listed twice", w.key),
                ));
            }
        }
        Ok(())
    }

    /// Checks the image cache part; the field names the entry at fault.
    pub fn validate_images(&self) -> Result<(), crate::FieldError> {
        let Some(images) = &self.images else {
            return Ok(());
        };
        if images.len() > Self::MAX_IMAGES {
            return Err(crate::FieldError::new(
                "images",
                format!("at most {} images", Self::MAX_IMAGES),
            ));
        }
        for (i, img) in images.iter().enumerate() {
            if img.image.is_empty() || img.image.len() > 255 {
                return Err(crate::FieldError::new(
                    format!("images[{i}].image"),
                    "1 to 255 characters",
                ));
            }
            if img.id.is_empty() || img.id.len() > 128 {
                return Err(crate::FieldError::new(
                    format!("images[{i}].id"),
                    "1 to 128 characters",
                ));
            }
            if i64::try_from(img.size_bytes).is_err() {
                return Err(crate::FieldError::new(
                    format!("images[{i}].size_bytes"),
                    "too large",
                ));
            }
            if images[..i].iter().any(|o| o.image == img.image) {
                return Err(crate::FieldError::new(
                    format!("images[{i}].image"),
                    format!("`{}` is listed twice", img.image),
                ));
            }
        }
        Ok(())
    }

    /// Checks the telemetry part; the field names the sample at fault.
    pub fn validate_gpus(&self) -> Result<(), crate::FieldError> {
        if self.gpus.len() > Self::MAX_GPU_SAMPLES {
            return Err(crate::FieldError::new(
                "gpus",
                format!("at most {} samples", Self::MAX_GPU_SAMPLES),
            ));
        }
        for (i, g) in self.gpus.iter().enumerate() {
            let field = |name: &str| format!("gpus[{i}].{name}");
            if g.uuid.is_empty() || g.uuid.len() > 128 {
                return Err(crate::FieldError::new(field("uuid"), "1 to 128 characters"));
            }
            if g.device_name.len() > 128 {
                return Err(crate::FieldError::new(
                    field("device_name"),
                    "at most 128 characters",
                ));
            }
            for (name, pct) in [
                ("gpu_util_pct", g.gpu_util_pct),
                ("mem_copy_util_pct", g.mem_copy_util_pct),
            ] {
                if pct.is_some_and(|p| p > 100) {
                    return Err(crate::FieldError::new(
                        field(name),
                        "a percentage, 0 to 100",
                    ));
                }
            }
            if g.power_w.is_some_and(|w| !w.is_finite() || w < 0.0) {
                return Err(crate::FieldError::new(
                    field("power_w"),
                    "a finite, non-negative number of watts",
                ));
            }
        }
        Ok(())
    }
}

/// Work the server wants on a node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Assignment {
    /// Instance.
    pub instance_id: InstanceId,
    /// Its tenant: the agent runs each tenant's work as its own
    /// unprivileged user. Absent from older servers (each instance then
    /// gets a user of its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<TenantId>,
    /// Program and arguments.
    pub command: Vec<String>,
    /// Extra environment (device variables are added by the agent).
    pub env: BTreeMap<String, String>,
    /// Working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// Node-local GPU indices it owns.
    pub gpu_indices: Vec<u32>,
    /// Their UUIDs, in the same order.
    pub gpu_uuids: Vec<String>,
    /// What it holds of each GPU when it shares them (fractions, MIG);
    /// empty for whole GPUs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_slices: Vec<GpuSlice>,
    /// The server wants it stopped (SIGTERM, grace, SIGKILL).
    pub stop: bool,
    /// Grace between SIGTERM and SIGKILL, in milliseconds.
    pub stop_grace_ms: u64,
    /// Run from this image in a container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageSpec>,
    /// CPU limit, milli-cores (enforced by both runtimes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_milli: Option<u32>,
    /// Memory limit, MiB (enforced by both runtimes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// Limit of its directory's size, MiB (the process runtime enforces
    /// it); absent: the node's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mb: Option<u64>,
    /// The tenant's login for the registry of `image`, when it stored one:
    /// sent only until the agent reports the instance (the pull happens
    /// before that), and only for an image on that very registry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry_auth: Option<crate::registry::RegistryAuth>,
}

/// The server's answer to a sync.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SyncResponse {
    /// Every instance the node should run or stop. An instance absent
    /// here that the agent still runs is orphaned and gets stopped.
    pub assignments: Vec<Assignment>,
    /// The node is unknown (e.g. the database was reset): register again.
    #[serde(default)]
    pub reregister: bool,
    /// The node's lease (see [`Registered::lease_ms`]), renewed by this
    /// answer: counted from when it arrives. The server declares the
    /// node's work lost one heartbeat interval after the lease's end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
    /// Sessions into instances of this node (exec, shell, port-forward)
    /// the agent is to dial back; each is listed until the agent dialled
    /// it or its tenant gave up.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sessions: Vec<crate::access::AccessSession>,
    /// Replicas of deleted endpoints on this node: not to be parked when
    /// they stop (the endpoint will never restore them), and released if
    /// parked already. Absent from older servers (nothing to release).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unpark: Vec<InstanceId>,
    /// A busy answer (only to a sync with `busy_ok`): the server is at its
    /// limit of reports in flight, recorded the heartbeat (`lease_ms` is
    /// renewed from this answer, as for any other) and took nothing else
    /// of the report. The agent keeps running what it runs, takes nothing
    /// from `assignments` (empty here), and sends its whole report again
    /// after about this many milliseconds. Shedding a report this way,
    /// instead of letting it wait and time out, keeps a node's lease alive
    /// while the control plane is overloaded, so no agent stops its work
    /// for a lease that ran out only because the server was slow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub busy_retry_ms: Option<u64>,
}

/// Log lines pushed by an agent.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LogBatch {
    /// The lines, `seq` consecutive; lines the server already has are
    /// ignored, so a batch may be resent safely.
    pub lines: Vec<LogLine>,
}

/// Who the caller is (`GET /v1/me`).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Me {
    /// The key used.
    pub key: ApiKey,
    /// Its tenant.
    pub tenant: Tenant,
}

/// One job state change.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JobEvent {
    /// State entered (or kept, with a new reason).
    pub state: JobState,
    /// Why.
    pub reason: String,
    /// When.
    pub at: DateTime<Utc>,
}

/// One member of a job's attempt.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JobMember {
    /// Rank, 0-based.
    pub rank: u32,
    /// Attempt (1-based) it belongs to.
    pub attempt: u32,
    /// The member instance (its logs are the rank's logs).
    pub instance_id: InstanceId,
    /// Its state.
    pub state: InstanceState,
    /// Node it was placed on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<NodeId>,
    /// Exit status, once exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
}

/// A job: its spec, its state derived from its members, and every attempt's
/// members.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Job {
    /// Id.
    pub id: JobId,
    /// Owner.
    pub tenant_id: TenantId,
    /// State.
    pub state: JobState,
    /// Why it is in that state (for `queued`: why the gang is not placed).
    pub state_reason: String,
    /// What was asked for, after defaults.
    pub spec: JobSpec,
    /// Attempts started (a restart or a requeue starts a new one).
    pub attempts: u32,
    /// Attempts that ended in a failure (counted against `max_retries`).
    pub failures: u32,
    /// A cancel was asked for.
    pub cancel_requested: bool,
    /// Submission time.
    pub created_at: DateTime<Utc>,
    /// When the first attempt was placed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<DateTime<Utc>>,
    /// When it reached a final state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<DateTime<Utc>>,
    /// Members of every attempt, by attempt then rank.
    pub members: Vec<JobMember>,
    /// Every state change, oldest first.
    pub events: Vec<JobEvent>,
}

/// One queued job in the scheduler's order (`GET /v1/jobs/queue`).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JobQueueEntry {
    /// 1-based place in the whole queue (instances and jobs of every
    /// tenant ahead of it count, without being shown).
    pub position: u32,
    /// The queued job; `state_reason` says why it is not placed.
    pub job: Job,
}
