//! The agent's own `/metrics` (`flotilla agent --metrics-bind ADDR`), for
//! a Prometheus on the node's network: how its syncs with the control
//! plane go, what it runs, and its GPUs' latest readings under the DCGM
//! exporter's names, so the node can be watched even while the control
//! plane is down (the server's `/metrics` drops a silent node).
//!
//! Nothing here decides anything: it shows what the sync loop last saw.
//! No key is asked for, like the DCGM exporter: bind it to an address only
//! the monitoring network reaches.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use axum::http::header::CONTENT_TYPE;
use axum::routing::get;
use flotilla_core::api::{GpuSample, ObservedInstance, ObservedPhase};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, String)>;
type GaugeFamily = Family<Labels, Gauge<f64, AtomicU64>>;

/// What the sync loop last saw.
#[derive(Debug, Default)]
pub struct AgentMetrics {
    syncs_ok: Counter<u64, AtomicU64>,
    syncs_failed: Counter<u64, AtomicU64>,
    last: Mutex<Last>,
}

#[derive(Debug, Default)]
struct Last {
    node_id: Option<String>,
    synced_at: Option<chrono::DateTime<chrono::Utc>>,
    phases: [u64; 4],
    gpus: Vec<GpuSample>,
}

const PHASES: [&str; 4] = ["starting", "running", "exited", "failed_to_start"];

impl AgentMetrics {
    fn last(&self) -> std::sync::MutexGuard<'_, Last> {
        // One assignment per field: a poisoned lock still holds whole values.
        self.last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A sync that the server answered.
    pub fn synced(
        &self,
        node_id: &str,
        at: chrono::DateTime<chrono::Utc>,
        observed: &[ObservedInstance],
        gpus: &[GpuSample],
    ) {
        self.syncs_ok.inc();
        let mut phases = [0u64; 4];
        for o in observed {
            let i = match o.phase {
                ObservedPhase::Starting => 0,
                ObservedPhase::Running { .. } => 1,
                ObservedPhase::Exited { .. } => 2,
                ObservedPhase::FailedToStart { .. } => 3,
            };
            phases[i] += 1;
        }
        let mut last = self.last();
        last.node_id = Some(node_id.to_string());
        last.synced_at = Some(at);
        last.phases = phases;
        last.gpus = gpus.to_vec();
    }

    /// A sync that failed (no answer, or an error).
    pub fn sync_failed(&self) {
        self.syncs_failed.inc();
    }

    /// The exposition text; `node` is the node's name.
    pub fn render(&self, node: &str) -> Result<String, std::fmt::Error> {
        let mut registry = Registry::default();
        let syncs = Family::<Labels, Counter<u64, AtomicU64>>::default();
        syncs
            .get_or_create(&vec![("outcome", "ok".into())])
            .inc_by(self.syncs_ok.get());
        syncs
            .get_or_create(&vec![("outcome", "failed".into())])
            .inc_by(self.syncs_failed.get());
        registry.register(
            "flotilla_agent_syncs",
            "Syncs with the control plane by outcome (ok, failed)",
            syncs,
        );
        let last = self.last();
        let node_id = last.node_id.clone().unwrap_or_default();
        let info = GaugeFamily::default();
        info.get_or_create(&vec![
            ("Hostname", node.to_string()),
            ("node_id", node_id.clone()),
            ("version", env!("CARGO_PKG_VERSION").to_string()),
        ])
        .set(1.0);
        registry.register("flotilla_agent_info", "The agent: node and version", info);
        if let Some(at) = last.synced_at {
            let g = Gauge::<f64, AtomicU64>::default();
            g.set(at.timestamp_millis() as f64 / 1000.0);
            registry.register(
                "flotilla_agent_last_sync_timestamp_seconds",
                "When the control plane last answered a sync, Unix seconds",
                g,
            );
        }
        let work = GaugeFamily::default();
        for (phase, n) in PHASES.iter().zip(last.phases) {
            work.get_or_create(&vec![("phase", (*phase).to_string())])
                .set(n as f64);
        }
        registry.register(
            "flotilla_agent_workloads",
            "Workloads the agent reported in its last sync, by phase",
            work,
        );
        type Read = fn(&GpuSample) -> Option<f64>;
        let fields: [(&str, &str, Read); 7] = [
            ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)", |g| {
                g.gpu_util_pct.map(f64::from)
            }),
            (
                "DCGM_FI_DEV_FB_USED",
                "Framebuffer memory used (in MiB)",
                |g| g.fb_used_mib.map(|v| v as f64),
            ),
            ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)", |g| {
                g.temperature_c.map(f64::from)
            }),
            ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)", |g| {
                g.power_w
            }),
            ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz)", |g| {
                g.sm_clock_mhz.map(f64::from)
            }),
            (
                "DCGM_FI_DEV_XID_ERRORS",
                "Value of the last XID error encountered",
                |g| g.last_xid.map(|v| v as f64),
            ),
            (
                "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
                "Total number of double-bit volatile ECC errors",
                |g| g.ecc_uncorrected.map(|v| v as f64),
            ),
        ];
        for (name, help, read) in fields {
            let family = GaugeFamily::default();
            for s in &last.gpus {
                if let Some(v) = read(s) {
                    family
                        .get_or_create(&vec![
                            ("gpu", s.index.to_string()),
                            ("UUID", s.uuid.clone()),
                            ("device", format!("nvidia{}", s.index)),
                            ("modelName", s.device_name.clone()),
                            ("Hostname", node.to_string()),
                            ("node_id", node_id.clone()),
                        ])
                        .set(v);
                }
            }
            registry.register(name, help, family);
        }
        drop(last);
        let mut out = String::new();
        encode(&mut out, &registry)?;
        Ok(out)
    }
}

/// Serves `GET /metrics` on `addr` until the task is dropped. Binding
/// fails early, so a wrong address stops the agent at start.
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<AgentMetrics>,
    node: String,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "agent metrics listening");
    let app = axum::Router::new().route(
        "/metrics",
        get(move || {
            let metrics = metrics.clone();
            let node = node.clone();
            async move {
                match metrics.render(&node) {
                    Ok(body) => (
                        axum::http::StatusCode::OK,
                        [(
                            CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        body,
                    ),
                    Err(_) => (
                        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                        [(CONTENT_TYPE, "text/plain; charset=utf-8")],
                        "cannot encode metrics".to_string(),
                    ),
                }
            }
        }),
    );
    Ok(tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::warn!(%error, "agent metrics server stopped");
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shows_syncs_workloads_and_gpu_readings() {
        let m = AgentMetrics::default();
        m.sync_failed();
        let gpu = GpuSample {
            index: 1,
            uuid: "GPU-1".into(),
            device_name: "Simulated H100".into(),
            temperature_c: Some(91),
            last_xid: Some(79),
            ..GpuSample::default()
        };
        m.synced("node_x", chrono::Utc::now(), &[], &[gpu]);
        let out = m.render("gpu-01").unwrap();
        for line in [
            "flotilla_agent_syncs_total{outcome=\"ok\"} 1",
            "flotilla_agent_syncs_total{outcome=\"failed\"} 1",
            "flotilla_agent_workloads{phase=\"running\"} 0",
            "DCGM_FI_DEV_XID_ERRORS{gpu=\"1\",UUID=\"GPU-1\",device=\"nvidia1\",modelName=\"Simulated H100\",Hostname=\"gpu-01\",node_id=\"node_x\"} 79",
        ] {
            assert!(out.contains(line), "missing `{line}` in:\n{out}");
        }
        // Counters the GPU did not report are absent, not zero.
        assert!(!out.contains("DCGM_FI_DEV_GPU_UTIL{"), "{out}");
    }
}
