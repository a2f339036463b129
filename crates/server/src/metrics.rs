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
];

/// Prometheus exposition of GPU telemetry and pool capacity.
pub async fn metrics(State(st): State<AppState>, caller: Caller) -> ApiResult<Response> {
    caller.require(&[Role::Operator], "read the metrics")?;
    let nodes = all_nodes(&st).await?;
    let telemetry = st.fresh_telemetry();
    let queues = st.store().endpoint_trigger_statuses().await?;
    let body =
        render_all(&nodes, &telemetry, Some(st.leads()), &queues).map_err(ApiError::internal)?;
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
    let mut registry = Registry::default();
    if let Some(leads) = leader {
        let g = Gauge::<f64, AtomicU64>::default();
        g.set(if leads { 1.0 } else { 0.0 });
        registry.register(
            "flotilla_leader",
            "1 on the server replica that holds the leader lease and runs the control loops, else 0",
            g,
        );
    }

    // Capacity, from the store: every GPU is free, allocated, or
    // unavailable (its node not ready or cordoned).
    let mut capacity: BTreeMap<(String, &'static str), u32> = BTreeMap::new();
    let mut node_states: BTreeMap<String, u32> = BTreeMap::new();
    for n in nodes {
        *node_states.entry(n.state.as_str().to_string()).or_default() += 1;
        let usable = n.state == flotilla_core::node::NodeState::Ready && !n.cordoned;
        for g in &n.gpus {
            let state = match (&g.instance_id, usable) {
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
        "GPUs of the pool by model and state (free, allocated, unavailable)",
        gpus,
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
