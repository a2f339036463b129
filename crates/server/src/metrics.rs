//! `GET /metrics`: the pool in Prometheus' text format.
//!
//! GPU counters carry the names and labels of NVIDIA's DCGM exporter
//! (`DCGM_FI_DEV_GPU_UTIL{gpu, UUID, device, modelName, Hostname}` …), so
//! dashboards and alerts written for it work unchanged; Flotilla adds the
//! node, region, pool and the instance holding the GPU (where DCGM on
//! Kubernetes adds the pod). The readings are the agents' latest, sent with
//! every sync; a node silent for longer than the heartbeat timeout drops out
//! rather than exporting a stale value. Simulated GPUs have no driver and so
//! no DCGM series; they appear in the `flotilla_gpus` capacity gauge.
//!
//! The registry is built per scrape from the store and the telemetry map:
//! nothing is kept between scrapes, so the exposition can never disagree
//! with the API. The endpoint wants an operator key (instance ids are
//! tenants' data); Prometheus sends it with `authorization: {credentials}`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use flotilla_core::api::{GpuSample, Node};
use flotilla_core::id::EndpointId;
use flotilla_core::queue_trigger::TriggerStatus;
use flotilla_core::tenant::Role;
use flotilla_store::PageReq;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::ops_metrics::OpsMetrics;
use crate::state::{AppState, Telemetry};

/// The OpenMetrics media type `encode` writes.
const CONTENT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(&'static str, String)>;
type GaugeFamily = Family<Labels, Gauge<f64, AtomicU64>>;

/// One DCGM field: exposition name, help text, and its reading.
struct Field {
    name: &'static str,
    help: &'static str,
    read: fn(&GpuSample) -> Option<f64>,
}

/// The fields of the DCGM exporter's default set that NVML answers.
const FIELDS: &[Field] = &[
    Field {
        name: "DCGM_FI_DEV_GPU_UTIL",
        help: "GPU utilization (in %)",
        read: |g| g.gpu_util_pct.map(f64::from),
    },
    Field {
        name: "DCGM_FI_DEV_MEM_COPY_UTIL",
        help: "Memory utilization (in %)",
        read: |g| g.mem_copy_util_pct.map(f64::from),
    },
    Field {
        name: "DCGM_FI_DEV_FB_USED",
        help: "Framebuffer memory used (in MiB)",
        read: |g| g.fb_used_mib.map(|v| v as f64),
    },
    Field {
        name: "DCGM_FI_DEV_FB_FREE",
        help: "Framebuffer memory free (in MiB)",
        read: |g| g.fb_free_mib.map(|v| v as f64),
    },
    Field {
        name: "DCGM_FI_DEV_GPU_TEMP",
        help: "GPU temperature (in C)",
        read: |g| g.temperature_c.map(f64::from),
    },
    Field {
        name: "DCGM_FI_DEV_POWER_USAGE",
        help: "Power draw (in W)",
        read: |g| g.power_w,
    },
    Field {
        name: "DCGM_FI_DEV_SM_CLOCK",
        help: "SM clock frequency (in MHz)",
        read: |g| g.sm_clock_mhz.map(f64::from),
    },
    Field {
        name: "DCGM_FI_DEV_XID_ERRORS",
        help: "Value of the last XID error encountered",
        read: |g| g.last_xid.map(|v| v as f64),
    },
    Field {
        name: "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        help: "Total number of double-bit volatile ECC errors",
        read: |g| g.ecc_uncorrected.map(|v| v as f64),
    },
];

/// What `/metrics` shows of the fleet beyond nodes and GPUs: the queue,
/// live work by tenant, endpoints' replica targets and budget alert
/// levels, read from the store at scrape time.
#[derive(Debug, Default)]
pub struct Fleet {
    /// Waiting work by kind.
    pub queue: Vec<flotilla_store::fleet::QueueStat>,
    /// Live instances by tenant and state.
    pub work: Vec<flotilla_store::fleet::TenantWork>,
    /// Endpoints: id, tenant, replica target.
    pub endpoints: Vec<(EndpointId, String, Option<u32>)>,
    /// Highest budget alert threshold per tenant this period.
    pub budgets: Vec<(flotilla_core::id::TenantId, u32)>,
    /// When the scrape reads it (for the queue's wait).
    pub now: Option<chrono::DateTime<chrono::Utc>>,
}

/// Prometheus exposition of GPU telemetry and pool capacity.
pub async fn metrics(State(st): State<AppState>, caller: Caller) -> ApiResult<Response> {
    caller.require(&[Role::Operator], "read the metrics")?;
    let nodes = all_nodes(&st).await?;
    let telemetry = st.fresh_telemetry();
    let queues = st.store().endpoint_trigger_statuses().await?;
    let fleet = Fleet {
        queue: st.store().queue_stats().await?,
        work: st.store().tenant_work().await?,
        endpoints: st.store().endpoint_targets().await?,
        budgets: st.store().budget_alert_levels().await?,
        now: Some(st.now()),
    };
    let body = render_full(
        &nodes,
        &telemetry,
        Some(st.leads()),
        &queues,
        &fleet,
        Some(st.ops()),
    )
    .map_err(ApiError::internal)?;
    Ok(([(CONTENT_TYPE, CONTENT)], body).into_response())
}

async fn all_nodes(st: &AppState) -> ApiResult<Vec<Node>> {
    let mut nodes = Vec::new();
    let mut after = None;
    loop {
        let page = st.store().list_nodes(&PageReq::new(after, 1000)).await?;
        nodes.extend(page.items);
        match page.next {
            Some(next) => after = Some(next),
            None => return Ok(nodes),
        }
    }
}

/// The exposition text for `nodes` and their latest `telemetry`.
pub fn render(
    nodes: &[Node],
    telemetry: &HashMap<flotilla_core::id::NodeId, Telemetry>,
) -> Result<String, std::fmt::Error> {
    render_replica(nodes, telemetry, None)
}

/// [`render`], plus the `flotilla_leader` gauge (1 on the replica that
/// runs the control loops, 0 on the others) when `leader` is given.
pub fn render_replica(
    nodes: &[Node],
    telemetry: &HashMap<flotilla_core::id::NodeId, Telemetry>,
    leader: Option<bool>,
) -> Result<String, std::fmt::Error> {
    render_all(nodes, telemetry, leader, &[])
}

/// [`render_replica`], plus `flotilla_endpoint_queue_depth{endpoint,
/// trigger}`: the depth each endpoint's queue trigger last read (a failed
/// read exports no sample rather than a stale or made-up one).
pub fn render_all(
    nodes: &[Node],
    telemetry: &HashMap<flotilla_core::id::NodeId, Telemetry>,
    leader: Option<bool>,
    queues: &[(EndpointId, Vec<TriggerStatus>)],
) -> Result<String, std::fmt::Error> {
    render_full(nodes, telemetry, leader, queues, &Fleet::default(), None)
}

/// [`render_all`], plus the [`Fleet`]'s series and this replica's
/// operational counters and histograms ([`OpsMetrics`]) when given.
pub fn render_full(
    nodes: &[Node],
    telemetry: &HashMap<flotilla_core::id::NodeId, Telemetry>,
    leader: Option<bool>,
    queues: &[(EndpointId, Vec<TriggerStatus>)],
    fleet: &Fleet,
    ops: Option<&OpsMetrics>,
) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    if let Some(ops) = ops {
        ops.register(&mut registry);
    }
    register_fleet(&mut registry, fleet);
    if let Some(leads) = leader {
        let g = Gauge::<f64, AtomicU64>::default();
        g.set(if leads { 1.0 } else { 0.0 });
        registry.register(
            "flotilla_leader",
            "1 on the server replica that holds the leader lease and runs the control loops, else 0",
            g,
        );
    }

    // Capacity, from the store: every GPU is free, allocated, faulty (out
    // of placement by an XID or ECC error or heat; work on it may still
    // run), or unavailable (its node not ready or cordoned).
    let mut capacity: BTreeMap<(String, &'static str), u32> = BTreeMap::new();
    let mut node_states: BTreeMap<String, u32> = BTreeMap::new();
    for n in nodes {
        *node_states.entry(n.state.as_str().to_string()).or_default() += 1;
        let usable = n.state == flotilla_core::node::NodeState::Ready && !n.cordoned;
        for g in &n.gpus {
            let state = match (&g.instance_id, usable) {
                _ if g.fault.is_some() => "faulty",
                (Some(_), _) => "allocated",
                (None, true) => "free",
                (None, false) => "unavailable",
            };
            *capacity.entry((g.model.clone(), state)).or_default() += 1;
        }
    }
    let gpus = GaugeFamily::default();
    for ((model, state), count) in capacity {
        gpus.get_or_create(&vec![("model", model), ("state", state.to_string())])
            .set(f64::from(count));
    }
    registry.register(
        "flotilla_gpus",
        "GPUs of the pool by model and state (free, allocated, faulty, unavailable)",
        gpus,
    );
    // One series per faulty GPU, so an alert names it.
    let faulty = GaugeFamily::default();
    for n in nodes {
        for g in n.gpus.iter().filter(|g| g.fault.is_some()) {
            faulty
                .get_or_create(&vec![
                    ("node_id", n.id.to_string()),
                    ("Hostname", n.name.clone()),
                    ("gpu", g.index.to_string()),
                    ("gpu_id", g.id.to_string()),
                    ("model", g.model.clone()),
                    ("reason", g.fault.clone().unwrap_or_default()),
                ])
                .set(1.0);
        }
    }
    registry.register(
        "flotilla_gpu_faulty",
        "1 for each GPU out of placement by a fault, with the reason",
        faulty,
    );
    let cordoned = GaugeFamily::default();
    for n in nodes {
        cordoned
            .get_or_create(&vec![
                ("node_id", n.id.to_string()),
                ("Hostname", n.name.clone()),
            ])
            .set(if n.cordoned { 1.0 } else { 0.0 });
    }
    registry.register(
        "flotilla_node_cordoned",
        "1 for a cordoned node (no new work placed), else 0",
        cordoned,
    );
    let heartbeat = GaugeFamily::default();
    for n in nodes {
        heartbeat
            .get_or_create(&vec![
                ("node_id", n.id.to_string()),
                ("Hostname", n.name.clone()),
                ("state", n.state.as_str().to_string()),
            ])
            .set(n.last_heartbeat_at.timestamp_millis() as f64 / 1000.0);
    }
    registry.register(
        "flotilla_node_last_heartbeat_timestamp_seconds",
        "When each node's agent last synced, Unix seconds",
        heartbeat,
    );
    let states = GaugeFamily::default();
    for (state, count) in node_states {
        states
            .get_or_create(&vec![("state", state)])
            .set(f64::from(count));
    }
    registry.register("flotilla_nodes", "Nodes by state", states);

    // DCGM-named telemetry, labelled as the exporter does plus Flotilla's.
    let families: Vec<GaugeFamily> = FIELDS.iter().map(|_| GaugeFamily::default()).collect();
    for n in nodes {
        let Some(reading) = telemetry.get(&n.id) else {
            continue;
        };
        for sample in &reading.gpus {
            // Only GPUs the node registered: a sample must match one by
            // index and UUID to be exported.
            let Some(gpu) = n
                .gpus
                .iter()
                .find(|g| g.index == sample.index && g.uuid == sample.uuid)
            else {
                continue;
            };
            let labels: Labels = vec![
                ("gpu", sample.index.to_string()),
                ("UUID", sample.uuid.clone()),
                ("device", format!("nvidia{}", sample.index)),
                ("modelName", sample.device_name.clone()),
                ("Hostname", n.name.clone()),
                ("node_id", n.id.to_string()),
                ("region", n.region.clone()),
                ("pool", n.pool.clone()),
                (
                    "instance_id",
                    gpu.instance_id
                        .as_ref()
                        .map(ToString::to_string)
                        .unwrap_or_default(),
                ),
            ];
            for (field, family) in FIELDS.iter().zip(&families) {
                if let Some(v) = (field.read)(sample) {
                    family.get_or_create(&labels).set(v);
                }
            }
        }
    }
    for (field, family) in FIELDS.iter().zip(families) {
        registry.register(field.name, field.help, family);
    }

    let depth = GaugeFamily::default();
    for (endpoint, triggers) in queues {
        for t in triggers {
            if let Some(d) = t.depth {
                depth
                    .get_or_create(&vec![
                        ("endpoint", endpoint.to_string()),
                        ("trigger", t.trigger.clone()),
                    ])
                    .set(d as f64);
            }
        }
    }
    registry.register(
        "flotilla_endpoint_queue_depth",
        "Messages waiting in an endpoint's external queue trigger at its last read",
        depth,
    );

    let mut out = String::new();
    encode(&mut out, &registry)?;
    Ok(out)
}

/// The [`Fleet`]'s series.
fn register_fleet(registry: &mut Registry, fleet: &Fleet) {
    if !fleet.queue.is_empty() {
        let depth = GaugeFamily::default();
        let wait = GaugeFamily::default();
        for q in &fleet.queue {
            let labels: Labels = vec![("kind", q.kind.to_string())];
            depth.get_or_create(&labels).set(q.depth as f64);
            let waited = match (q.oldest, fleet.now) {
                (Some(oldest), Some(now)) => {
                    (now - oldest).num_milliseconds().max(0) as f64 / 1000.0
                }
                _ => 0.0,
            };
            wait.get_or_create(&labels).set(waited);
        }
        registry.register(
            "flotilla_queue_depth",
            "Work waiting for placement: pending instances, queued jobs",
            depth,
        );
        registry.register(
            "flotilla_queue_oldest_wait_seconds",
            "How long the longest-waiting work of each kind has waited (0 when none waits)",
            wait,
        );
    }
    let instances = GaugeFamily::default();
    let gpus = GaugeFamily::default();
    for w in &fleet.work {
        let labels: Labels = vec![
            ("tenant_id", w.tenant.to_string()),
            ("state", w.state.clone()),
        ];
        instances.get_or_create(&labels).set(w.instances as f64);
        gpus.get_or_create(&labels).set(w.gpus as f64);
    }
    registry.register(
        "flotilla_tenant_instances",
        "Live instances (job members and endpoint replicas included) by tenant and state",
        instances,
    );
    registry.register(
        "flotilla_tenant_gpus",
        "GPUs asked for by live instances, by tenant and state",
        gpus,
    );
    let desired = GaugeFamily::default();
    for (id, tenant, want) in &fleet.endpoints {
        if let Some(want) = want {
            desired
                .get_or_create(&vec![
                    ("endpoint", id.to_string()),
                    ("tenant_id", tenant.clone()),
                ])
                .set(f64::from(*want));
        }
    }
    registry.register(
        "flotilla_endpoint_desired_replicas",
        "Replicas each endpoint's autoscaler last asked for",
        desired,
    );
    let budget = GaugeFamily::default();
    for (tenant, level) in &fleet.budgets {
        budget
            .get_or_create(&vec![("tenant_id", tenant.to_string())])
            .set(f64::from(*level));
    }
    registry.register(
        "flotilla_budget_alert_percent",
        "Highest budget threshold (percent of the limit) each tenant reached this period; 100 or more: spent",
        budget,
    );
}
