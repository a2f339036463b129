//! Serverless endpoints: a command serving a model behind the gateway, run
//! as replica instances whose count an autoscaling policy sets, down to
//! zero when idle. This module holds the spec and its validation (every
//! error names its field), revisions, and the pure rollout decision that
//! turns "want N replicas of revision R" into replicas to start, drain and
//! stop without dropping traffic.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::api::LogLine;
use crate::catalog::Catalog;
use crate::error::FieldError;
use crate::gateway::{Balance, EndpointSignals};
use crate::id::{EndpointId, InstanceId, TenantId};
use crate::instance::{BillingClass, CreateInstance, InstanceSpec, InstanceState};
use crate::offer::{minutes, window_open, DAYS};
use crate::queue_trigger::{keep_secrets, validate_triggers, QueueTrigger, TriggerStatus};

/// The policies an endpoint may name (`flotilla-scale` builds them).
pub const POLICIES: [&str; 5] = ["flotilla", "hpa", "keda", "kpa", "ray"];
/// Most replicas an endpoint may ask for.
pub const MAX_REPLICAS: u32 = 1000;
/// Most model names one endpoint serves.
pub const MAX_MODELS: usize = 64;

/// What a tenant asks for when deploying an endpoint. Everything but the
/// name and the command has a default.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateEndpoint {
    /// DNS-label name, unique among the tenant's endpoints; requests under
    /// `/e/{name}/…` on the gateway go here.
    pub name: String,
    /// Program and arguments of a replica, run without a shell. The
    /// replica gets `PORT` in its environment and must serve HTTP there.
    /// With `image`, it replaces the image's command and may be empty.
    #[serde(default)]
    pub command: Vec<String>,
    /// Extra environment of a replica (`PORT` is set by Flotilla).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Run each replica from this OCI image in a container (on nodes whose
    /// agent runs the container runtime) instead of the command on the
    /// node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// With `image`: the container ports to publish; the replica serves
    /// on the first (its `PORT`; default 8080), where the gateway reaches
    /// it through the port the node published.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    /// Model names served: an OpenAI request whose `model` is one of them
    /// is routed here. Default: the endpoint's name.
    #[serde(default)]
    pub models: Vec<String>,
    /// Whole GPUs per replica (default 1).
    #[serde(default)]
    pub gpus: Option<u32>,
    /// Acceptable GPU models; empty: any.
    #[serde(default)]
    pub gpu_types: Vec<String>,
    /// A share of one GPU per replica instead of whole GPUs (0.001..=1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_fraction: Option<f64>,
    /// One MIG instance of this profile per replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_profile: Option<String>,
    /// CPU per replica in milli-cores (default 1000).
    #[serde(default)]
    pub cpu_milli: Option<u32>,
    /// Memory per replica in MiB (default 1024).
    #[serde(default)]
    pub memory_mb: Option<u64>,
    /// Fewest replicas (default 0: scales to zero when idle).
    #[serde(default)]
    pub min_replicas: Option<u32>,
    /// Most replicas (default 4, at most 1000).
    #[serde(default)]
    pub max_replicas: Option<u32>,
    /// Latency objective, p95 time to first byte in ms (default 2000).
    #[serde(default)]
    pub slo_p95_ms: Option<u64>,
    /// Service tier of the replicas: 1 dedicated (default), 2 or 3
    /// preemptible.
    #[serde(default)]
    pub tier: Option<u8>,
    /// Autoscaling policy: flotilla (default), hpa, keda, kpa or ray.
    #[serde(default)]
    pub policy: Option<String>,
    /// Median cold start of a replica, ms, as Flotilla's policy plans
    /// with (default 30000).
    #[serde(default)]
    pub cold_start_ms: Option<u64>,
    /// Mean time a request holds a replica slot, ms (default 1000).
    #[serde(default)]
    pub mean_service_ms: Option<f64>,
    /// Path probed on a replica; it takes traffic once this answers 2xx
    /// (default `/health`).
    #[serde(default)]
    pub readiness_path: Option<String>,
    /// Seconds without a request before the endpoint scales to zero
    /// (default 300; only when `min_replicas` is 0).
    #[serde(default)]
    pub idle_window_s: Option<u64>,
    /// Requests that may wait for a replica before new ones get 429
    /// (default 1000).
    #[serde(default)]
    pub queue_limit: Option<u32>,
    /// How long a request may wait for a replica before a 503, ms
    /// (default 120000: longer than a cold start).
    #[serde(default)]
    pub queue_timeout_ms: Option<u64>,
    /// Requests one replica takes at once (default 8).
    #[serde(default)]
    pub replica_concurrency: Option<u32>,
    /// How the gateway picks a replica (default least outstanding).
    #[serde(default)]
    pub balance: Option<Balance>,
    /// Requests per second per inference key; absent: unlimited.
    #[serde(default)]
    pub rate_limit_rps: Option<u32>,
    /// How long a replica being scaled down or replaced stays in the
    /// route table as draining (finishing what it has) before it is
    /// stopped, ms (default 30000).
    #[serde(default)]
    pub drain_grace_ms: Option<u64>,
    /// IANA time zone the schedules are read in (default `UTC`).
    #[serde(default)]
    pub timezone: Option<String>,
    /// Minimum replicas by time window (a schedule trigger); the highest
    /// minimum of the windows open now wins over `min_replicas`.
    #[serde(default)]
    pub schedules: Vec<ScheduleWindow>,
    /// Size of a replica's model weights, GB. With it the node's agent
    /// keeps the weights in its disk cache after a first download, keeps
    /// scaled-down replicas parked in host memory, and tells each replica
    /// which tier its weights load from (`FLOTILLA_LOAD_TIER`); placement
    /// prefers the node where the replica is ready soonest. Absent: every
    /// start is a plain cold start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_gb: Option<f64>,
    /// How long a replica scaled down stays parked (weights in the node's
    /// host memory, GPU released, billed per GB-hour of memory) for a
    /// restart in about a second, s. Needs `model_gb`; default 600 with
    /// it; 0 parks nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_parked_s: Option<u64>,
    /// External queues whose depth asks for replicas (RabbitMQ queues,
    /// NATS JetStream consumers); the highest demand of traffic, schedule
    /// and queues wins, and a queue with messages keeps the endpoint from
    /// going idle.
    #[serde(default)]
    pub queue_triggers: Vec<QueueTrigger>,
}

/// A time window with a minimum replica count, in the endpoint's time
/// zone: `start` to `end` (`HH:MM`, 24 h; an `end` at or before `start`
/// runs past midnight) on `days` (`mon`…`sun`; empty: every day; the day
/// is the one the window starts on).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ScheduleWindow {
    /// Days the window opens on.
    #[serde(default)]
    pub days: Vec<String>,
    /// Opening time, `HH:MM`.
    pub start: String,
    /// Closing time, `HH:MM`.
    pub end: String,
    /// Fewest replicas while open.
    pub min_replicas: u32,
}

/// A change to an endpoint (`PATCH`): absent fields stay. A change of the
/// command, environment or resources makes a new revision, rolled out
/// without dropping traffic; the rest applies at once.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateEndpoint {
    /// New command (new revision).
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// New environment, replacing the old one (new revision).
    #[serde(default)]
    pub env: Option<BTreeMap<String, String>>,
    /// New image (new revision); an empty string runs the command on the
    /// node again.
    #[serde(default)]
    pub image: Option<String>,
    /// New container ports, replacing the old ones (new revision).
    #[serde(default)]
    pub ports: Option<Vec<u16>>,
    /// New model names.
    #[serde(default)]
    pub models: Option<Vec<String>>,
    /// Whole GPUs per replica (new revision).
    #[serde(default)]
    pub gpus: Option<u32>,
    /// Acceptable GPU models (new revision).
    #[serde(default)]
    pub gpu_types: Option<Vec<String>>,
    /// Share of one GPU (new revision).
    #[serde(default)]
    pub gpu_fraction: Option<f64>,
    /// MIG profile (new revision).
    #[serde(default)]
    pub mig_profile: Option<String>,
    /// CPU per replica (new revision).
    #[serde(default)]
    pub cpu_milli: Option<u32>,
    /// Memory per replica (new revision).
    #[serde(default)]
    pub memory_mb: Option<u64>,
    /// Fewest replicas.
    #[serde(default)]
    pub min_replicas: Option<u32>,
    /// Most replicas.
    #[serde(default)]
    pub max_replicas: Option<u32>,
    /// Latency objective, ms.
    #[serde(default)]
    pub slo_p95_ms: Option<u64>,
    /// Autoscaling policy.
    #[serde(default)]
    pub policy: Option<String>,
    /// Readiness path.
    #[serde(default)]
    pub readiness_path: Option<String>,
    /// Idle window, s.
    #[serde(default)]
    pub idle_window_s: Option<u64>,
    /// Queue limit.
    #[serde(default)]
    pub queue_limit: Option<u32>,
    /// Queue timeout, ms.
    #[serde(default)]
    pub queue_timeout_ms: Option<u64>,
    /// Replica concurrency.
    #[serde(default)]
    pub replica_concurrency: Option<u32>,
    /// Balance mode.
    #[serde(default)]
    pub balance: Option<Balance>,
    /// Rate limit per key, requests per second.
    #[serde(default)]
    pub rate_limit_rps: Option<u32>,
    /// Drain grace, ms.
    #[serde(default)]
    pub drain_grace_ms: Option<u64>,
    /// Time zone of the schedules.
    #[serde(default)]
    pub timezone: Option<String>,
    /// Schedules, replacing the old ones.
    #[serde(default)]
    pub schedules: Option<Vec<ScheduleWindow>>,
    /// Size of the model weights, GB (new revision: the weights differ).
    #[serde(default)]
    pub model_gb: Option<f64>,
    /// Seconds a scaled-down replica stays parked (0: none).
    #[serde(default)]
    pub keep_parked_s: Option<u64>,
    /// Queue triggers, replacing the old ones (`[]` removes them). A URL
    /// sent back as shown (password `***`) keeps the stored password.
    #[serde(default)]
    pub queue_triggers: Option<Vec<QueueTrigger>>,
}

/// An endpoint's spec after validation, defaults applied: what is stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EndpointSpec {
    /// Name.
    pub name: String,
    /// Replica command.
    pub command: Vec<String>,
    /// Replica environment.
    pub env: BTreeMap<String, String>,
    /// The image replicas run from, in containers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// With an image: the container ports published, the first served
    /// (never empty when `image` is set).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    /// Model names served.
    pub models: Vec<String>,
    /// Whole GPUs per replica.
    pub gpus: u32,
    /// Acceptable GPU models (canonical names); empty: any.
    pub gpu_types: Vec<String>,
    /// Share of one GPU per replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_fraction: Option<f64>,
    /// MIG profile per replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_profile: Option<String>,
    /// CPU per replica, milli-cores.
    pub cpu_milli: u32,
    /// Memory per replica, MiB.
    pub memory_mb: u64,
    /// Fewest replicas.
    pub min_replicas: u32,
    /// Most replicas.
    pub max_replicas: u32,
    /// p95 latency objective, ms.
    pub slo_p95_ms: u64,
    /// Replica tier.
    pub tier: u8,
    /// Autoscaling policy.
    pub policy: String,
    /// Median cold start, ms.
    pub cold_start_ms: u64,
    /// Mean service time, ms.
    pub mean_service_ms: f64,
    /// Readiness path.
    pub readiness_path: String,
    /// Idle window before scale to zero, s.
    pub idle_window_s: u64,
    /// Queue limit.
    pub queue_limit: u32,
    /// Queue timeout, ms.
    pub queue_timeout_ms: u64,
    /// Requests per replica at once.
    pub replica_concurrency: u32,
    /// Balance mode.
    pub balance: Balance,
    /// Requests per second per key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit_rps: Option<u32>,
    /// Drain grace, ms.
    pub drain_grace_ms: u64,
    /// Size of the model weights, GB; `None`: no readiness tiers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_gb: Option<f64>,
    /// Seconds a scaled-down replica stays parked; 0 parks nothing.
    #[serde(default)]
    pub keep_parked_s: u64,
    /// Time zone of the schedules.
    #[serde(default = "utc")]
    pub timezone: String,
    /// Minimum replicas by time window.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub schedules: Vec<ScheduleWindow>,
    /// External queue triggers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub queue_triggers: Vec<QueueTrigger>,
}

fn utc() -> String {
    "UTC".into()
}

fn validate_schedules(
    tz: &str,
    windows: &[ScheduleWindow],
    max_replicas: u32,
) -> Result<(), FieldError> {
    tz.parse::<chrono_tz::Tz>().map_err(|_| {
        FieldError::new(
            "timezone",
            format!("`{tz}` is not an IANA time zone such as Europe/Paris"),
        )
    })?;
    if windows.len() > 64 {
        return Err(FieldError::new("schedules", "at most 64 windows"));
    }
    for (i, w) in windows.iter().enumerate() {
        for (f, v) in [("start", &w.start), ("end", &w.end)] {
            if minutes(v).is_none() {
                return Err(FieldError::new(
                    format!("schedules[{i}].{f}"),
                    format!("must be a time HH:MM, got `{v}`"),
                ));
            }
        }
        for (j, d) in w.days.iter().enumerate() {
            if !DAYS.contains(&d.to_ascii_lowercase().as_str()) {
                return Err(FieldError::new(
                    format!("schedules[{i}].days[{j}]"),
                    format!("must be one of {}, got `{d}`", DAYS.join(", ")),
                ));
            }
        }
        if w.min_replicas > max_replicas {
            return Err(FieldError::new(
                format!("schedules[{i}].min_replicas"),
                format!("must be at most max_replicas ({max_replicas})"),
            ));
        }
    }
    Ok(())
}

/// The highest minimum of the schedule windows open at `now`, read in the
/// endpoint's time zone; 0 when none is open.
pub fn scheduled_min(spec: &EndpointSpec, now: DateTime<Utc>) -> u32 {
    use chrono::{Datelike, Timelike};
    let Ok(tz) = spec.timezone.parse::<chrono_tz::Tz>() else {
        return 0;
    };
    let local = now.with_timezone(&tz);
    let at = local.hour() * 60 + local.minute();
    let today = local.weekday().num_days_from_monday() as usize;
    spec.schedules
        .iter()
        .filter(|w| window_open(&w.days, &w.start, &w.end, today, at))
        .map(|w| w.min_replicas)
        .max()
        .unwrap_or(0)
}

/// The replica template's JSON path prefix is the endpoint's own: the
/// resource fields share their names with an instance's.
fn instance_request(c: &CreateEndpoint, tier: u8) -> CreateInstance {
    CreateInstance {
        name: None,
        gpus: c.gpus.unwrap_or(1),
        gpu_types: c.gpu_types.clone(),
        cpu_milli: c.cpu_milli,
        memory_mb: c.memory_mb,
        command: c.command.clone(),
        env: c.env.clone(),
        workdir: None,
        billing_class: BillingClass::OnDemand,
        priority: None,
        tier: Some(tier),
        preemptible: Some(tier > 1),
        gpu_fraction: c.gpu_fraction,
        mig_profile: c.mig_profile.clone(),
        image: c.image.clone(),
        ports: c.ports.clone(),
        scratch_mb: None,
        disk_mb: None,
    }
}

/// The container port a replica serves on when its endpoint names an
/// image and no port.
pub const DEFAULT_CONTAINER_PORT: u16 = 8080;

/// Largest model an endpoint may declare, GB (a 1T-parameter model in
/// BF16 is 2000 GB).
pub const MAX_MODEL_GB: f64 = 4_000.0;
/// Default time a scaled-down replica stays parked when the endpoint
/// declares its weights, s: long enough to bridge the lulls of a bursty
/// load (minutes), short enough that forgotten parks cost little.
pub const DEFAULT_KEEP_PARKED_S: u64 = 600;
/// Longest a replica may stay parked, s (a day).
pub const MAX_KEEP_PARKED_S: u64 = 86_400;

fn validate_weights(
    model_gb: Option<f64>,
    keep_parked_s: Option<u64>,
) -> Result<(Option<f64>, u64), FieldError> {
    let Some(gb) = model_gb else {
        if keep_parked_s.is_some_and(|s| s > 0) {
            return Err(FieldError::new(
                "keep_parked_s",
                "needs model_gb: parking holds the weights in host memory",
            ));
        }
        return Ok((None, 0));
    };
    if !(gb.is_finite() && gb > 0.0 && gb <= MAX_MODEL_GB) {
        return Err(FieldError::new(
            "model_gb",
            format!("must be a number of GB greater than 0 and at most {MAX_MODEL_GB}, got {gb}"),
        ));
    }
    let keep = keep_parked_s.unwrap_or(DEFAULT_KEEP_PARKED_S);
    if keep > MAX_KEEP_PARKED_S {
        return Err(FieldError::new(
            "keep_parked_s",
            format!("must be at most {MAX_KEEP_PARKED_S} (a day), got {keep}"),
        ));
    }
    Ok((Some(gb), keep))
}

/// The endpoint a replica serves, in every replica's environment (set by
/// the server, whatever the endpoint's spec says).
pub const ENV_ENDPOINT_ID: &str = "FLOTILLA_ENDPOINT_ID";

/// Environment a replica of an endpoint that declares its weights gets,
/// read back by the node's agent (which keeps its caches by it) and by
/// the model server (which loads that much from the tier it is told).
pub const ENV_WEIGHTS_KEY: &str = "FLOTILLA_WEIGHTS_KEY";
/// The weights' size, GB.
pub const ENV_MODEL_GB: &str = "FLOTILLA_MODEL_GB";
/// Seconds the replica stays parked once scaled down.
pub const ENV_KEEP_PARKED_S: &str = "FLOTILLA_KEEP_PARKED_S";
/// Set by the agent: the tier the weights load from (`parked`, `cached`
/// or `remote`).
pub const ENV_LOAD_TIER: &str = "FLOTILLA_LOAD_TIER";

/// What a replica's weights are, as the server, the agent and the model
/// server share them through the replica's environment.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaWeights {
    /// What the node's caches hold them under: the endpoint and its
    /// revision (a new revision may run other weights, and one tenant's
    /// weights never serve another's endpoint).
    pub key: String,
    /// The endpoint.
    pub endpoint_id: EndpointId,
    /// Size, GB.
    pub model_gb: f64,
    /// Seconds to stay parked after a scale-down; 0: not parked.
    pub keep_parked_s: u64,
}

impl ReplicaWeights {
    /// The cache key of `endpoint`'s weights at `revision`.
    pub fn key_of(endpoint: &EndpointId, revision: u32) -> String {
        format!("{endpoint}-r{revision}")
    }

    /// Reads them from a replica's environment; `None` when the replica
    /// declares no weights (or the variables are not Flotilla's).
    pub fn from_env(env: &BTreeMap<String, String>) -> Option<Self> {
        let key = env.get(ENV_WEIGHTS_KEY)?.clone();
        let endpoint_id = EndpointId::parse(env.get(ENV_ENDPOINT_ID)?, "env").ok()?;
        let model_gb: f64 = env.get(ENV_MODEL_GB)?.parse().ok()?;
        let keep_parked_s = env
            .get(ENV_KEEP_PARKED_S)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let key_ok = !key.is_empty()
            && key.len() <= 200
            && key
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        (key_ok && model_gb.is_finite() && model_gb > 0.0).then_some(Self {
            key,
            endpoint_id,
            model_gb,
            keep_parked_s,
        })
    }

    /// The weights' size in bytes (GB = 10^9 bytes).
    pub fn size_bytes(&self) -> u64 {
        (self.model_gb * 1e9).round().min(u64::MAX as f64) as u64
    }
}

fn positive_ms(v: u64, field: &str) -> Result<u64, FieldError> {
    if v == 0 || v > 24 * 3_600_000 {
        return Err(FieldError::new(
            field,
            "must be between 1 and 86400000 (a day)",
        ));
    }
    Ok(v)
}

impl CreateEndpoint {
    /// Validates against the catalog and fills in defaults; every error
    /// names the JSON field at fault.
    pub fn validate(mut self, catalog: &Catalog) -> Result<EndpointSpec, FieldError> {
        crate::tenant::validate_name(&self.name, "name")?;
        if self.env.contains_key("PORT") {
            return Err(FieldError::new(
                "env.PORT",
                "is set by flotilla to the port the replica must listen on",
            ));
        }
        let tier = self.tier.unwrap_or(1);
        if self.image.is_some() && self.ports.is_empty() {
            self.ports = vec![DEFAULT_CONTAINER_PORT];
        }
        let inst = instance_request(&self, tier).validate(catalog)?;
        let models = if self.models.is_empty() {
            vec![self.name.clone()]
        } else {
            self.models.clone()
        };
        if models.len() > MAX_MODELS {
            return Err(FieldError::new(
                "models",
                format!("at most {MAX_MODELS} names"),
            ));
        }
        for (i, m) in models.iter().enumerate() {
            if m.is_empty() || m.len() > 256 || m.chars().any(char::is_control) {
                return Err(FieldError::new(
                    format!("models[{i}]"),
                    "must be 1-256 printable characters",
                ));
            }
        }
        let min_replicas = self.min_replicas.unwrap_or(0);
        let max_replicas = self.max_replicas.unwrap_or(4.max(min_replicas));
        if max_replicas == 0 || max_replicas > MAX_REPLICAS {
            return Err(FieldError::new(
                "max_replicas",
                format!("must be between 1 and {MAX_REPLICAS}, got {max_replicas}"),
            ));
        }
        if min_replicas > max_replicas {
            return Err(FieldError::new(
                "min_replicas",
                format!("must be at most max_replicas ({max_replicas}), got {min_replicas}"),
            ));
        }
        let policy = self.policy.unwrap_or_else(|| "flotilla".into());
        let policy = policy.to_ascii_lowercase();
        if !POLICIES.contains(&policy.as_str()) {
            return Err(FieldError::new(
                "policy",
                format!("must be one of {}, got `{policy}`", POLICIES.join(", ")),
            ));
        }
        let readiness_path = self.readiness_path.unwrap_or_else(|| "/health".into());
        if !readiness_path.starts_with('/')
            || readiness_path.len() > 1024
            || readiness_path
                .chars()
                .any(|c| c.is_control() || c.is_whitespace())
        {
            return Err(FieldError::new(
                "readiness_path",
                "must be an absolute URL path such as /health",
            ));
        }
        let mean_service_ms = self.mean_service_ms.unwrap_or(1000.0);
        if !(mean_service_ms.is_finite() && mean_service_ms > 0.0) {
            return Err(FieldError::new(
                "mean_service_ms",
                "must be a number of ms greater than 0",
            ));
        }
        let replica_concurrency = self.replica_concurrency.unwrap_or(8);
        if replica_concurrency == 0 || replica_concurrency > 4096 {
            return Err(FieldError::new(
                "replica_concurrency",
                "must be between 1 and 4096",
            ));
        }
        let queue_limit = self.queue_limit.unwrap_or(1000);
        if queue_limit > 1_000_000 {
            return Err(FieldError::new("queue_limit", "must be at most 1000000"));
        }
        if self.rate_limit_rps == Some(0) {
            return Err(FieldError::new(
                "rate_limit_rps",
                "must be at least 1 (leave it out for no limit)",
            ));
        }
        let idle_window_s = self.idle_window_s.unwrap_or(300);
        if idle_window_s == 0 || idle_window_s > 30 * 86_400 {
            return Err(FieldError::new(
                "idle_window_s",
                "must be between 1 and 2592000 (30 days)",
            ));
        }
        let timezone = self.timezone.unwrap_or_else(utc);
        validate_schedules(&timezone, &self.schedules, max_replicas)?;
        validate_triggers(&self.queue_triggers)?;
        let (model_gb, keep_parked_s) = validate_weights(self.model_gb, self.keep_parked_s)?;
        Ok(EndpointSpec {
            name: self.name,
            command: inst.command,
            env: inst.env,
            ports: inst
                .image
                .as_ref()
                .map(|i| i.ports.clone())
                .unwrap_or_default(),
            image: inst.image.map(|i| i.image),
            models,
            gpus: inst.gpus,
            gpu_types: inst.gpu_types,
            gpu_fraction: self.gpu_fraction,
            mig_profile: self.mig_profile,
            cpu_milli: inst.cpu_milli,
            memory_mb: inst.memory_mb,
            min_replicas,
            max_replicas,
            slo_p95_ms: positive_ms(self.slo_p95_ms.unwrap_or(2000), "slo_p95_ms")?,
            tier,
            policy,
            cold_start_ms: self.cold_start_ms.unwrap_or(30_000),
            mean_service_ms,
            readiness_path,
            idle_window_s,
            queue_limit,
            queue_timeout_ms: positive_ms(
                self.queue_timeout_ms.unwrap_or(120_000),
                "queue_timeout_ms",
            )?,
            replica_concurrency,
            balance: self.balance.unwrap_or_default(),
            rate_limit_rps: self.rate_limit_rps,
            drain_grace_ms: self.drain_grace_ms.unwrap_or(30_000),
            model_gb,
            keep_parked_s,
            timezone,
            schedules: self.schedules,
            queue_triggers: self.queue_triggers,
        })
    }
}

impl EndpointSpec {
    /// The create request this spec came from (defaults spelled out).
    fn to_request(&self) -> CreateEndpoint {
        CreateEndpoint {
            name: self.name.clone(),
            command: self.command.clone(),
            env: self.env.clone(),
            image: self.image.clone(),
            ports: self.ports.clone(),
            models: self.models.clone(),
            gpus: Some(self.gpus),
            gpu_types: self.gpu_types.clone(),
            gpu_fraction: self.gpu_fraction,
            mig_profile: self.mig_profile.clone(),
            cpu_milli: Some(self.cpu_milli),
            memory_mb: Some(self.memory_mb),
            min_replicas: Some(self.min_replicas),
            max_replicas: Some(self.max_replicas),
            slo_p95_ms: Some(self.slo_p95_ms),
            tier: Some(self.tier),
            policy: Some(self.policy.clone()),
            cold_start_ms: Some(self.cold_start_ms),
            mean_service_ms: Some(self.mean_service_ms),
            readiness_path: Some(self.readiness_path.clone()),
            idle_window_s: Some(self.idle_window_s),
            queue_limit: Some(self.queue_limit),
            queue_timeout_ms: Some(self.queue_timeout_ms),
            replica_concurrency: Some(self.replica_concurrency),
            balance: Some(self.balance),
            rate_limit_rps: self.rate_limit_rps,
            drain_grace_ms: Some(self.drain_grace_ms),
            model_gb: self.model_gb,
            keep_parked_s: Some(self.keep_parked_s),
            timezone: Some(self.timezone.clone()),
            schedules: self.schedules.clone(),
            queue_triggers: self.queue_triggers.clone(),
        }
    }

    /// Applies a change; the new spec, and whether it needs a new revision
    /// (what a replica runs changed).
    pub fn update(
        &self,
        u: UpdateEndpoint,
        catalog: &Catalog,
    ) -> Result<(EndpointSpec, bool), FieldError> {
        let mut c = self.to_request();
        let mut u = u;
        if let Some(new) = u.queue_triggers.as_mut() {
            keep_secrets(&self.queue_triggers, new);
        }
        macro_rules! set {
            ($($f:ident),*) => { $( if let Some(v) = u.$f { c.$f = v.into(); } )* };
        }
        set!(
            command,
            env,
            models,
            gpu_types,
            schedules,
            queue_triggers,
            ports
        );
        if let Some(image) = u.image {
            // Empty: back to the command on the node, without ports.
            c.image = Some(image).filter(|i| !i.trim().is_empty());
            if c.image.is_none() {
                c.ports.clear();
            }
        }
        macro_rules! set_opt {
            ($($f:ident),*) => { $( if u.$f.is_some() { c.$f = u.$f; } )* };
        }
        set_opt!(
            gpus,
            cpu_milli,
            memory_mb,
            min_replicas,
            max_replicas,
            slo_p95_ms,
            policy,
            readiness_path,
            idle_window_s,
            queue_limit,
            queue_timeout_ms,
            replica_concurrency,
            balance,
            rate_limit_rps,
            drain_grace_ms,
            model_gb,
            keep_parked_s,
            timezone
        );
        // A share and a MIG profile exclude each other: naming one clears
        // the other, so a switch needs no second call.
        if u.gpu_fraction.is_some() {
            c.gpu_fraction = u.gpu_fraction;
            c.mig_profile = None;
        }
        if u.mig_profile.is_some() {
            c.mig_profile = u.mig_profile;
            c.gpu_fraction = None;
        }
        let next = c.validate(catalog)?;
        let bump = next.command != self.command
            || next.env != self.env
            || next.image != self.image
            || next.ports != self.ports
            || next.gpus != self.gpus
            || next.gpu_types != self.gpu_types
            || next.gpu_fraction != self.gpu_fraction
            || next.mig_profile != self.mig_profile
            || next.cpu_milli != self.cpu_milli
            || next.memory_mb != self.memory_mb
            || next.model_gb != self.model_gb;
        Ok((next, bump))
    }

    /// The container port a replica serves on, when it runs from an image.
    pub fn served_port(&self) -> Option<u16> {
        self.image.as_ref().map(|_| {
            self.ports
                .first()
                .copied()
                .unwrap_or(DEFAULT_CONTAINER_PORT)
        })
    }

    /// The instance a replica of `revision` is: the command with `PORT`
    /// and the endpoint's identity in its environment. `port` is the
    /// node's port it listens on; a replica in a container listens on its
    /// served container port instead, which the node publishes.
    pub fn replica_instance(
        &self,
        catalog: &Catalog,
        endpoint: &EndpointId,
        revision: u32,
        port: u16,
    ) -> Result<InstanceSpec, FieldError> {
        let mut c = instance_request(&self.to_request(), self.tier);
        c.name = Some(
            format!("{}-r{revision}", self.name)
                .chars()
                .take(63)
                .collect(),
        );
        let port = self.served_port().unwrap_or(port);
        c.env.insert("PORT".into(), port.to_string());
        c.env.insert(ENV_ENDPOINT_ID.into(), endpoint.to_string());
        c.env
            .insert("FLOTILLA_ENDPOINT_REVISION".into(), revision.to_string());
        if let Some(gb) = self.model_gb {
            c.env.insert(
                ENV_WEIGHTS_KEY.into(),
                ReplicaWeights::key_of(endpoint, revision),
            );
            c.env.insert(ENV_MODEL_GB.into(), gb.to_string());
            c.env
                .insert(ENV_KEEP_PARKED_S.into(), self.keep_parked_s.to_string());
        }
        c.validate(catalog)
    }

    /// GPU-seconds one replica-second is billed: whole GPUs, or the share.
    pub fn gpus_per_replica(&self) -> f64 {
        self.gpu_fraction.unwrap_or(f64::from(self.gpus))
    }
}

/// One replica of an endpoint as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EndpointReplica {
    /// Its instance.
    pub instance_id: InstanceId,
    /// The revision it runs.
    pub revision: u32,
    /// The instance's state.
    pub state: InstanceState,
    /// Where it serves.
    pub url: String,
    /// Its readiness probe answered: it takes traffic.
    pub ready: bool,
    /// Scaled down or replaced: it finishes what it has, gets nothing new.
    pub draining: bool,
}

/// A custom metric reported through the API (`POST /v1/endpoints/{id}/metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CustomMetric {
    /// The value, summed over the endpoint (a queue depth, say); policies
    /// that target a custom metric read it.
    pub value: f64,
}

impl CustomMetric {
    /// Rejects values that cannot be right.
    pub fn validate(&self) -> Result<(), FieldError> {
        if !(self.value.is_finite() && self.value >= 0.0) {
            return Err(FieldError::new("value", "must be a finite number >= 0"));
        }
        Ok(())
    }
}

/// An endpoint as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Endpoint {
    /// Id (`ep_…`).
    pub id: EndpointId,
    /// Owner.
    pub tenant_id: TenantId,
    /// Name (also in `spec`).
    pub name: String,
    /// The revision new replicas run; bumped by a change of what a
    /// replica runs.
    pub revision: u32,
    /// The spec in force.
    pub spec: EndpointSpec,
    /// The autoscaler's last decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_replicas: Option<u32>,
    /// Why (the policy's reason, or `idle`, `activator`, `min_replicas`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Replicas not yet stopped.
    pub replicas: Vec<EndpointReplica>,
    /// The gateway's last demand signals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signals: Option<EndpointSignals>,
    /// The last custom metric reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom_metric: Option<f64>,
    /// When a request was last seen, or a queue trigger last read
    /// messages waiting: the idle window counts from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_request_at: Option<DateTime<Utc>>,
    /// What each queue trigger's last read showed (depth, or the error).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub triggers: Vec<TriggerStatus>,
    /// Being deleted: its replicas drain and stop.
    pub deleting: bool,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
}

impl Endpoint {
    /// The endpoint as the API shows it: broker passwords in its queue
    /// triggers replaced by `***` (the stored spec keeps them).
    pub fn redacted(mut self) -> Endpoint {
        for t in &mut self.spec.queue_triggers {
            *t = t.redacted();
        }
        self
    }
}

/// One line of one replica's output.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplicaLogLine {
    /// The replica.
    pub instance_id: InstanceId,
    /// The revision it runs.
    pub revision: u32,
    /// The line.
    #[serde(flatten)]
    pub line: LogLine,
}

/// A replica as the rollout decision sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaView {
    /// Its instance.
    pub instance_id: InstanceId,
    /// Its revision.
    pub revision: u32,
    /// Passed its readiness probe.
    pub ready: bool,
    /// Since when it drains, if it does.
    pub draining_since: Option<DateTime<Utc>>,
    /// Created (newest are removed first).
    pub created_at: DateTime<Utc>,
}

/// What to do to an endpoint's replicas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RolloutPlan {
    /// New replicas of the current revision to start.
    pub start: u32,
    /// Ready replicas to mark draining (out of rotation, still running).
    pub drain: Vec<InstanceId>,
    /// Replicas to stop now: never ready, or drained for the grace.
    pub stop: Vec<InstanceId>,
}

/// Decides how `live` replicas (not ended, not being stopped) become
/// `want` ready replicas of `revision`:
///
/// - replicas of the current revision are started up to `want`;
/// - an old revision's ready replicas keep serving until as many new ones
///   are ready (then they drain), so a rollout never lowers capacity;
///   old ones that never became ready are stopped at once;
/// - scaling down takes not-ready replicas first (stopped: they never had
///   traffic), then the newest ready ones (drained);
/// - a draining replica is stopped once it drained for `drain_grace_ms`.
pub fn plan_rollout(
    revision: u32,
    want: u32,
    live: &[ReplicaView],
    now: DateTime<Utc>,
    drain_grace_ms: u64,
) -> RolloutPlan {
    let mut plan = RolloutPlan::default();
    let grace = chrono::Duration::milliseconds(i64::try_from(drain_grace_ms).unwrap_or(i64::MAX));
    for r in live {
        if let Some(since) = r.draining_since {
            if !r.ready || now - since >= grace {
                plan.stop.push(r.instance_id.clone());
            }
        }
    }
    let active: Vec<&ReplicaView> = live.iter().filter(|r| r.draining_since.is_none()).collect();
    let mut current: Vec<&ReplicaView> = active
        .iter()
        .copied()
        .filter(|r| r.revision == revision)
        .collect();
    let mut old: Vec<&ReplicaView> = active
        .iter()
        .copied()
        .filter(|r| r.revision != revision)
        .collect();
    let want_n = want as usize;
    if current.len() > want_n {
        // Keep ready before not-ready, older before newer; remove the tail.
        current.sort_by(|a, b| b.ready.cmp(&a.ready).then(a.created_at.cmp(&b.created_at)));
        for r in current.split_off(want_n) {
            if r.ready {
                plan.drain.push(r.instance_id.clone());
            } else {
                plan.stop.push(r.instance_id.clone());
            }
        }
    }
    plan.start = u32::try_from(want_n.saturating_sub(current.len())).unwrap_or(0);
    let ready_new = current.iter().filter(|r| r.ready).count();
    let keep_old = want_n.saturating_sub(ready_new);
    old.sort_by(|a, b| b.ready.cmp(&a.ready).then(a.created_at.cmp(&b.created_at)));
    for (i, r) in old.into_iter().enumerate() {
        if !r.ready {
            plan.stop.push(r.instance_id.clone());
        } else if i >= keep_old {
            plan.drain.push(r.instance_id.clone());
        }
    }
    plan
}

/// Whether the endpoint has been idle (no request seen, nothing in flight
/// or queued) for its whole idle window.
pub fn is_idle(
    spec: &EndpointSpec,
    last_request_at: DateTime<Utc>,
    signals: Option<&EndpointSignals>,
    now: DateTime<Utc>,
) -> bool {
    if signals.is_some_and(|s| s.in_flight > 0 || s.queued > 0) {
        return false;
    }
    let window = chrono::Duration::seconds(i64::try_from(spec.idle_window_s).unwrap_or(i64::MAX));
    now - last_request_at >= window
}

/// The replica count an endpoint should have: the policy's wish within
/// `[min_replicas, max_replicas]`, at least one while requests wait at zero
/// (the activator's demand never waits for a policy window), at least one
/// while serving within the idle window, and zero once idle with a minimum
/// of zero; a schedule window open now raises the minimum, and the queue
/// triggers' wish (`queue_wants`, from
/// [`crate::queue_trigger::queue_demand`]) raises the count (the highest
/// demand wins; an endpoint whose queues hold messages is never idle).
/// Returns the count and the reason.
#[allow(clippy::too_many_arguments)]
pub fn desired_replicas(
    spec: &EndpointSpec,
    policy_wants: u32,
    policy_reason: &str,
    active: u32,
    queued: u32,
    idle: bool,
    scheduled_min: u32,
    queue_wants: u32,
) -> (u32, String) {
    let min = spec.min_replicas.max(scheduled_min).min(spec.max_replicas);
    let mut n = policy_wants.clamp(min, spec.max_replicas);
    let mut reason = if n == policy_wants {
        policy_reason.to_string()
    } else if n == scheduled_min && scheduled_min > spec.min_replicas {
        "schedule".to_string()
    } else {
        "replica_bounds".to_string()
    };
    let queue_wants = queue_wants.min(spec.max_replicas);
    if queue_wants > n {
        n = queue_wants;
        reason = "queue".into();
    }
    // A request waiting with no replica live: the first one is the
    // activator's, whether the policy asked for it or not (a policy that
    // meets backlogs between its decisions asks for it too; the reason
    // still says why the endpoint left zero).
    if queued > 0 && (n == 0 || (n == 1 && active == 0)) {
        n = 1;
        reason = "activator".into();
    }
    if idle && min == 0 && queued == 0 && queue_wants == 0 {
        return (0, "idle".into());
    }
    if n == 0 && active > 0 && !idle {
        n = 1;
        reason = "idle_window".into();
    }
    (n, reason)
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn declared_weights_reach_the_replica_and_are_validated() {
        let c = Catalog::default();
        let s = CreateEndpoint {
            model_gb: Some(16.0),
            ..req()
        }
        .validate(&c)
        .unwrap();
        assert_eq!(s.keep_parked_s, DEFAULT_KEEP_PARKED_S);
        let ep = EndpointId::generate(1, 2);
        let inst = s.replica_instance(&c, &ep, 3, 4567).unwrap();
        let w = ReplicaWeights::from_env(&inst.env).unwrap();
        assert_eq!(w.key, format!("{ep}-r3"));
        assert_eq!((w.model_gb, w.keep_parked_s), (16.0, 600));
        assert_eq!(w.size_bytes(), 16_000_000_000);
        // Without weights, nothing is declared.
        let plain = req().validate(&c).unwrap();
        let inst = plain.replica_instance(&c, &ep, 1, 4567).unwrap();
        assert_eq!(ReplicaWeights::from_env(&inst.env), None);
        assert_eq!(plain.keep_parked_s, 0);
        // A new size is a new revision (other weights).
        let (_, bump) = s
            .update(
                UpdateEndpoint {
                    model_gb: Some(8.0),
                    ..UpdateEndpoint::default()
                },
                &c,
            )
            .unwrap();
        assert!(bump);
        let (next, bump) = s
            .update(
                UpdateEndpoint {
                    keep_parked_s: Some(0),
                    ..UpdateEndpoint::default()
                },
                &c,
            )
            .unwrap();
        assert!(!bump);
        assert_eq!(next.keep_parked_s, 0);
        for (bad, field) in [
            (
                CreateEndpoint {
                    model_gb: Some(0.0),
                    ..req()
                },
                "model_gb",
            ),
            (
                CreateEndpoint {
                    model_gb: Some(f64::INFINITY),
                    ..req()
                },
                "model_gb",
            ),
            (
                CreateEndpoint {
                    keep_parked_s: Some(60),
                    ..req()
                },
                "keep_parked_s",
            ),
            (
                CreateEndpoint {
                    model_gb: Some(1.0),
                    keep_parked_s: Some(MAX_KEEP_PARKED_S + 1),
                    ..req()
                },
                "keep_parked_s",
            ),
        ] {
            assert_eq!(bad.validate(&c).unwrap_err().field, field);
        }
    }

    fn req() -> CreateEndpoint {
        CreateEndpoint {
            name: "chat".into(),
            command: vec!["serve".into()],
            ..CreateEndpoint::default()
        }
    }

    #[test]
    fn defaults_and_field_errors() {
        let c = Catalog::default();
        let s = req().validate(&c).unwrap();
        assert_eq!(s.models, vec!["chat".to_string()]);
        assert_eq!((s.min_replicas, s.max_replicas, s.gpus), (0, 4, 1));
        assert_eq!(s.readiness_path, "/health");
        assert_eq!(s.policy, "flotilla");
        let cases: Vec<(CreateEndpoint, &str)> = vec![
            (
                CreateEndpoint {
                    name: "Bad".into(),
                    ..req()
                },
                "name",
            ),
            (
                CreateEndpoint {
                    command: vec![],
                    ..req()
                },
                "command",
            ),
            (
                CreateEndpoint {
                    policy: Some("vpa".into()),
                    ..req()
                },
                "policy",
            ),
            (
                CreateEndpoint {
                    min_replicas: Some(5),
                    max_replicas: Some(2),
                    ..req()
                },
                "min_replicas",
            ),
            (
                CreateEndpoint {
                    max_replicas: Some(0),
                    ..req()
                },
                "max_replicas",
            ),
            (
                CreateEndpoint {
                    gpu_fraction: Some(2.0),
                    ..req()
                },
                "gpu_fraction",
            ),
            (
                CreateEndpoint {
                    gpu_types: vec!["X9".into()],
                    ..req()
                },
                "gpu_types[0]",
            ),
            (
                CreateEndpoint {
                    readiness_path: Some("health".into()),
                    ..req()
                },
                "readiness_path",
            ),
            (
                CreateEndpoint {
                    env: [("PORT".to_string(), "1".to_string())].into(),
                    ..req()
                },
                "env.PORT",
            ),
            (
                CreateEndpoint {
                    rate_limit_rps: Some(0),
                    ..req()
                },
                "rate_limit_rps",
            ),
            (
                CreateEndpoint {
                    models: vec![String::new()],
                    ..req()
                },
                "models[0]",
            ),
        ];
        for (r, field) in cases {
            assert_eq!(r.validate(&c).unwrap_err().field, field);
        }
    }

    #[test]
    fn updates_bump_the_revision_only_for_what_a_replica_runs() {
        let c = Catalog::default();
        let s = req().validate(&c).unwrap();
        let (n, bump) = s
            .update(
                UpdateEndpoint {
                    max_replicas: Some(9),
                    ..UpdateEndpoint::default()
                },
                &c,
            )
            .unwrap();
        assert!(!bump);
        assert_eq!(n.max_replicas, 9);
        let (n, bump) = s
            .update(
                UpdateEndpoint {
                    command: Some(vec!["serve".into(), "--v2".into()]),
                    ..UpdateEndpoint::default()
                },
                &c,
            )
            .unwrap();
        assert!(bump);
        assert_eq!(n.command.len(), 2);
        let e = s
            .update(
                UpdateEndpoint {
                    min_replicas: Some(50),
                    ..UpdateEndpoint::default()
                },
                &c,
            )
            .unwrap_err();
        assert_eq!(e.field, "min_replicas");
        let i = s
            .replica_instance(&c, &EndpointId::generate(1, 2), 3, 4567)
            .unwrap();
        assert_eq!(i.env["PORT"], "4567");
        assert_eq!(i.env["FLOTILLA_ENDPOINT_REVISION"], "3");
        assert!(i.image.is_none());
    }

    #[test]
    fn image_replicas_serve_on_a_published_container_port() {
        let c = Catalog::default();
        let s = CreateEndpoint {
            image: Some("registry.example/vllm:1".into()),
            command: Vec::new(),
            ..req()
        }
        .validate(&c)
        .unwrap();
        assert_eq!(s.ports, vec![DEFAULT_CONTAINER_PORT], "the default port");
        assert_eq!(s.served_port(), Some(DEFAULT_CONTAINER_PORT));
        let i = s
            .replica_instance(&c, &EndpointId::generate(1, 2), 1, 4567)
            .unwrap();
        let image = i.image.as_ref().unwrap();
        assert_eq!(image.image, "registry.example/vllm:1");
        assert_eq!(image.ports, vec![8080]);
        assert_eq!(i.env["PORT"], "8080", "the container port, not the node's");

        // A new image or port is a new revision; an empty image goes back
        // to the command (which it then needs).
        let (n, bump) = s
            .update(
                UpdateEndpoint {
                    ports: Some(vec![9000, 9001]),
                    ..UpdateEndpoint::default()
                },
                &c,
            )
            .unwrap();
        assert!(bump);
        assert_eq!(n.served_port(), Some(9000));
        let (n, bump) = s
            .update(
                UpdateEndpoint {
                    image: Some(String::new()),
                    command: Some(vec!["serve".into()]),
                    ..UpdateEndpoint::default()
                },
                &c,
            )
            .unwrap();
        assert!(bump);
        assert!(n.image.is_none() && n.ports.is_empty() && n.served_port().is_none());

        // Bad input names its field.
        let e = CreateEndpoint {
            image: Some("not an image!".into()),
            ..req()
        }
        .validate(&c)
        .unwrap_err();
        assert_eq!(e.field, "image");
        let e = CreateEndpoint {
            ports: vec![8080],
            ..req()
        }
        .validate(&c)
        .unwrap_err();
        assert_eq!(e.field, "ports");
    }

    fn t(s: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_700_000_000 + s, 0).unwrap()
    }

    fn rep(n: u128, revision: u32, ready: bool, draining: Option<i64>) -> ReplicaView {
        ReplicaView {
            instance_id: InstanceId::generate(1, n),
            revision,
            ready,
            draining_since: draining.map(t),
            created_at: t(n as i64),
        }
    }

    #[test]
    fn rollout_keeps_old_replicas_until_new_ones_are_ready() {
        let old = [rep(1, 1, true, None), rep(2, 1, true, None)];
        // Revision 2 asked for: two new replicas start, nothing drains.
        let p = plan_rollout(2, 2, &old, t(100), 1000);
        assert_eq!((p.start, p.drain.len(), p.stop.len()), (2, 0, 0));
        // One new one ready: one old one drains, the other still serves.
        let mut live = old.to_vec();
        live.push(rep(3, 2, true, None));
        live.push(rep(4, 2, false, None));
        let p = plan_rollout(2, 2, &live, t(100), 1000);
        assert_eq!(p.start, 0);
        assert_eq!(p.drain, vec![live[1].instance_id.clone()]);
        assert!(p.stop.is_empty());
        // Drained past the grace: stopped.
        live[1].draining_since = Some(t(100));
        live[3].ready = true;
        let p = plan_rollout(2, 2, &live, t(102), 1000);
        assert_eq!(p.stop, vec![live[1].instance_id.clone()]);
        assert_eq!(p.drain, vec![live[0].instance_id.clone()]);
    }

    #[test]
    fn scale_down_stops_unready_first_then_drains_the_newest() {
        let live = [
            rep(1, 1, true, None),
            rep(2, 1, true, None),
            rep(3, 1, false, None),
        ];
        let p = plan_rollout(1, 1, &live, t(10), 1000);
        assert_eq!(p.stop, vec![live[2].instance_id.clone()]);
        assert_eq!(p.drain, vec![live[1].instance_id.clone()]);
        let p = plan_rollout(1, 0, &live, t(10), 1000);
        assert_eq!(p.drain.len(), 2);
        assert_eq!(p.start, 0);
    }

    #[test]
    fn desired_follows_policy_activator_and_idle_window() {
        let s = CreateEndpoint {
            max_replicas: Some(3),
            ..req()
        }
        .validate(&Catalog::default())
        .unwrap();
        assert_eq!(desired_replicas(&s, 9, "p", 0, 0, false, 0, 0).0, 3);
        assert_eq!(
            desired_replicas(&s, 0, "p", 0, 5, false, 0, 0),
            (1, "activator".into())
        );
        assert_eq!(
            desired_replicas(&s, 1, "backlog", 0, 5, false, 0, 0),
            (1, "activator".into()),
            "the policy's first replica from zero is the activator's too"
        );
        assert_eq!(
            desired_replicas(&s, 2, "backlog", 0, 5, false, 0, 0),
            (2, "backlog".into())
        );
        assert_eq!(
            desired_replicas(&s, 0, "p", 2, 0, false, 0, 0),
            (1, "idle_window".into())
        );
        assert_eq!(
            desired_replicas(&s, 2, "p", 2, 0, true, 0, 0),
            (0, "idle".into())
        );
        let last = t(0);
        assert!(!is_idle(&s, last, None, t(299)));
        assert!(is_idle(&s, last, None, t(300)));
        // An open schedule window beats idleness and a lower policy wish.
        assert_eq!(
            desired_replicas(&s, 0, "p", 0, 0, true, 2, 0),
            (2, "schedule".into())
        );
    }

    #[test]
    fn schedules_open_in_the_endpoints_time_zone() {
        let c = Catalog::default();
        let window = |days: &[&str], start: &str, end: &str, min| ScheduleWindow {
            days: days.iter().map(|d| d.to_string()).collect(),
            start: start.into(),
            end: end.into(),
            min_replicas: min,
        };
        let s = CreateEndpoint {
            timezone: Some("Europe/Paris".into()),
            schedules: vec![
                window(&["mon", "tue", "wed", "thu", "fri"], "09:00", "18:00", 2),
                window(&[], "22:00", "02:00", 1),
            ],
            ..req()
        }
        .validate(&c)
        .unwrap();
        let utc = |y, mo, d, h, mi| Utc.with_ymd_and_hms(y, mo, d, h, mi, 0).unwrap();
        // Monday 2026-06-01, 07:00 UTC is 09:00 in Paris (CEST): open.
        assert_eq!(scheduled_min(&s, utc(2026, 6, 1, 7, 0)), 2);
        assert_eq!(scheduled_min(&s, utc(2026, 6, 1, 6, 59)), 0);
        // Saturday: the weekday window stays shut.
        assert_eq!(scheduled_min(&s, utc(2026, 6, 6, 10, 0)), 0);
        // 01:00 Paris on Sunday belongs to Saturday's night window.
        assert_eq!(scheduled_min(&s, utc(2026, 6, 6, 23, 0)), 1);
        for (w, field) in [
            (
                CreateEndpoint {
                    timezone: Some("Mars/Olympus".into()),
                    ..req()
                },
                "timezone",
            ),
            (
                CreateEndpoint {
                    schedules: vec![window(&[], "9:00", "18:00", 1)],
                    ..req()
                },
                "schedules[0].start",
            ),
            (
                CreateEndpoint {
                    schedules: vec![window(&["funday"], "09:00", "18:00", 1)],
                    ..req()
                },
                "schedules[0].days[0]",
            ),
            (
                CreateEndpoint {
                    schedules: vec![window(&[], "09:00", "18:00", 99)],
                    ..req()
                },
                "schedules[0].min_replicas",
            ),
        ] {
            assert_eq!(w.validate(&c).unwrap_err().field, field);
        }
    }

    #[test]
    fn queue_demand_wins_and_keeps_the_endpoint_from_idling() {
        let s = CreateEndpoint {
            max_replicas: Some(4),
            ..req()
        }
        .validate(&Catalog::default())
        .unwrap();
        // A full queue at zero: scale from zero, capped by the maximum.
        assert_eq!(
            desired_replicas(&s, 0, "p", 0, 0, true, 0, 50),
            (4, "queue".into())
        );
        // Traffic wanting more than the queue wins.
        assert_eq!(
            desired_replicas(&s, 3, "p", 3, 0, false, 0, 1),
            (3, "p".into())
        );
        // Drained but within the idle window: one replica stays.
        assert_eq!(
            desired_replicas(&s, 0, "p", 2, 0, false, 0, 0),
            (1, "idle_window".into())
        );
        // Drained and idle: back to zero.
        assert_eq!(
            desired_replicas(&s, 0, "p", 2, 0, true, 0, 0),
            (0, "idle".into())
        );
    }

    proptest::proptest! {
        #[test]
        fn desired_stays_within_bounds_and_is_zero_only_without_queue_demand(
            min in 0u32..4, extra in 1u32..6, policy in 0u32..20, active in 0u32..8,
            queued in 0u32..4, idle: bool, sched in 0u32..10, queue in 0u32..20,
        ) {
            let max = min + extra;
            let s = CreateEndpoint {
                min_replicas: Some(min),
                max_replicas: Some(max),
                ..req()
            }
            .validate(&Catalog::default())
            .unwrap();
            let (n, _) = desired_replicas(&s, policy, "p", active, queued, idle, sched, queue);
            proptest::prop_assert!(n <= max);
            proptest::prop_assert!(n >= sched.min(max));
            proptest::prop_assert!(n >= min);
            proptest::prop_assert!(n >= queue.min(max));
            if n == 0 {
                proptest::prop_assert_eq!(queue, 0);
                proptest::prop_assert!(idle || active == 0);
            }
        }
    }
}
