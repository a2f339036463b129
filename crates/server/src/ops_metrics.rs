//! The server's own operational series, kept across scrapes: how long
//! placement passes take, what the autoscalers decided, how long gateway
//! requests took, and what the ledger ingested. `GET /metrics` builds the
//! fleet's gauges afresh from the store on every scrape ([`crate::metrics`]);
//! these are counters and histograms of what this replica did since it
//! started, so they live here, shared by the loops and the routes.
//!
//! Naming follows Prometheus' conventions: base units (seconds), `_total`
//! on counters, `flotilla_` prefix.

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, String)>;

/// Buckets for the control plane's passes, seconds: a millisecond to ten.
const PASS_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// Buckets for inference requests, seconds: 10 ms to two minutes.
const REQUEST_BUCKETS: [f64; 14] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
];

fn pass_histogram() -> Histogram {
    Histogram::new(PASS_BUCKETS)
}

fn request_histogram() -> Histogram {
    Histogram::new(REQUEST_BUCKETS)
}

/// The series; cheap to clone (every metric is shared).
#[derive(Clone)]
pub struct OpsMetrics {
    /// Whole scheduling passes (gather, plan, apply) that had work queued.
    pub placement_pass: Histogram,
    /// The planner's part of those passes (pure decision time).
    pub placement_plan: Histogram,
    /// Every scheduling pass the leader started, work queued or not: the
    /// pass runs when it is due (`reconcile::PassTrigger`), not every round.
    pub placement_passes: Counter<u64, AtomicU64>,
    /// Scaling decisions by `kind` (endpoint, vertical) and `direction`
    /// (up, down, hold; a vertical move is `move`).
    pub scaling_decisions: Family<Labels, Counter<u64, AtomicU64>>,
    /// Gateway requests, from the usage the gateways report, by `endpoint`:
    /// start to finish.
    pub gateway_requests: Family<Labels, Histogram, fn() -> Histogram>,
    /// Usage events offered to the ledger by `source` (agent metering,
    /// gateway, api) and `outcome` (accepted, duplicate, rejected).
    pub usage_events: Family<Labels, Counter<u64, AtomicU64>>,
    /// Usage batches' ingestion time, seconds.
    pub usage_ingest: Histogram,
    /// GPUs taken out of placement by a fault, by `kind` (xid, ecc,
    /// over_temperature).
    pub gpu_faults: Family<Labels, Counter<u64, AtomicU64>>,
    /// Instances whose bill and run differed beyond the threshold at the
    /// leader's last billing reconciliation ([`crate::reconciliation`]).
    pub billing_reconcile_differences: Gauge,
    /// The leader's passes by `pass` (jobs, placement, offers, liveness,
    /// metering), each run whether or not it found work, the placement
    /// pass's reading of the fleet (`placement_gather`) and writing of its
    /// plan (`placement_apply`, when it had work), `round` for a
    /// whole round of the reconcile loop and `wait` for the wait after it
    /// (for a change, and at least `ROUND_DUTY` times the round): where the
    /// leader's time goes.
    pub leader_passes: Family<Labels, Histogram, fn() -> Histogram>,
    /// The server's own work in an agent's sync by `part`: `report`
    /// (from the handler's start to the long poll's hold: the heartbeat,
    /// what the node reported, its assignments) and `answer` (after the
    /// hold: the assignments again, the lease's renewal, unparks). The
    /// hold itself is not in either, so the two added up are what a sync
    /// costs the server; the agent's round trip less the hold less these
    /// is transport and waiting for a CPU.
    pub agent_sync: Family<Labels, Histogram, fn() -> Histogram>,
    /// Syncs answered busy: the replica was at its limit of reports in
    /// flight (`ServerConfig::sync_reports_in_flight`), renewed the node's
    /// lease and took nothing else. A steady rate means the control plane
    /// is short of database time for its fleet.
    pub agent_syncs_busy: Counter<u64, AtomicU64>,
}

impl Default for OpsMetrics {
    fn default() -> Self {
        Self {
            placement_pass: pass_histogram(),
            placement_plan: pass_histogram(),
            placement_passes: Counter::default(),
            scaling_decisions: Family::default(),
            gateway_requests: Family::new_with_constructor(request_histogram),
            usage_events: Family::default(),
            usage_ingest: pass_histogram(),
            gpu_faults: Family::default(),
            billing_reconcile_differences: Gauge::default(),
            leader_passes: Family::new_with_constructor(pass_histogram),
            agent_sync: Family::new_with_constructor(pass_histogram),
            agent_syncs_busy: Counter::default(),
        }
    }
}

impl std::fmt::Debug for OpsMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OpsMetrics")
    }
}

impl OpsMetrics {
    /// Counts one scaling decision from `from` to `to` replicas.
    pub fn scaling_decision(&self, kind: &str, from: u32, to: u32) {
        let direction = match to.cmp(&from) {
            std::cmp::Ordering::Greater => "up",
            std::cmp::Ordering::Less => "down",
            std::cmp::Ordering::Equal => "hold",
        };
        self.scaling_decisions
            .get_or_create(&vec![
                ("kind", kind.to_string()),
                ("direction", direction.to_string()),
            ])
            .inc();
    }

    /// Counts what the ledger did with a batch from `source`.
    pub fn usage_outcome(&self, source: &str, accepted: u64, duplicates: u64, rejected: u64) {
        for (outcome, n) in [
            ("accepted", accepted),
            ("duplicate", duplicates),
            ("rejected", rejected),
        ] {
            // Created even at 0, so a rate over it exists from the start.
            self.usage_events
                .get_or_create(&vec![
                    ("source", source.to_string()),
                    ("outcome", outcome.to_string()),
                ])
                .inc_by(n);
        }
    }

    /// Records that the leader's `pass` took `took`.
    pub fn leader_pass(&self, pass: &'static str, took: std::time::Duration) {
        self.leader_passes
            .get_or_create(&vec![("pass", pass.to_string())])
            .observe(took.as_secs_f64());
    }

    /// Records that the `part` of an agent's sync took `took`.
    pub fn agent_sync_part(&self, part: &'static str, took: std::time::Duration) {
        self.agent_sync
            .get_or_create(&vec![("part", part.to_string())])
            .observe(took.as_secs_f64());
    }

    /// Adds every series to `registry` (shared, not copied).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "flotilla_placement_pass_duration_seconds",
            "Scheduling passes with work queued: gather, plan and apply",
            self.placement_pass.clone(),
        );
        registry.register(
            "flotilla_placement_passes",
            "Scheduling passes started (they run on a change or a planned time, not every round)",
            self.placement_passes.clone(),
        );
        registry.register(
            "flotilla_placement_plan_duration_seconds",
            "The planner's part of a scheduling pass",
            self.placement_plan.clone(),
        );
        registry.register(
            "flotilla_scaling_decisions",
            "Autoscaling decisions by kind (endpoint, vertical) and direction (up, down, hold, move)",
            self.scaling_decisions.clone(),
        );
        registry.register(
            "flotilla_gateway_request_duration_seconds",
            "Inference requests through the gateways, start to finish, by endpoint",
            self.gateway_requests.clone(),
        );
        registry.register(
            "flotilla_usage_events",
            "Usage events offered to the ledger by source and outcome (accepted, duplicate, rejected)",
            self.usage_events.clone(),
        );
        registry.register(
            "flotilla_usage_ingest_duration_seconds",
            "Time to write one batch of usage events to the ledger",
            self.usage_ingest.clone(),
        );
        registry.register(
            "flotilla_gpu_faults",
            "GPUs taken out of placement by a fault, by kind (xid, ecc, over_temperature)",
            self.gpu_faults.clone(),
        );
        registry.register(
            "flotilla_billing_reconcile_differences",
            "Instances whose billed time and observed run differed beyond the threshold at the last \
             reconciliation of the last hour (set by the leader; see flotilla_leader)",
            self.billing_reconcile_differences.clone(),
        );
        registry.register(
            "flotilla_leader_pass_duration_seconds",
            "The leader's passes by pass (jobs, placement, offers, liveness, metering; placement_gather \
             and placement_apply: a placement pass's reads and writes; round: a whole reconcile round; \
             wait: the wait after it), whether or not they found work",
            self.leader_passes.clone(),
        );
        registry.register(
            "flotilla_agent_sync_duration_seconds",
            "The server's work in an agent's sync by part (report: before the long poll's hold; \
             answer: after it), the hold itself excluded",
            self.agent_sync.clone(),
        );
        registry.register(
            "flotilla_agent_syncs_busy",
            "Agent syncs answered busy: the lease renewed, the report not taken (the replica was at \
             its limit of reports in flight)",
            self.agent_syncs_busy.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_are_named_the_prometheus_way() {
        let m = OpsMetrics::default();
        m.placement_pass.observe(0.004);
        m.scaling_decision("endpoint", 1, 3);
        m.scaling_decision("endpoint", 3, 3);
        m.usage_outcome("gateway", 5, 1, 0);
        m.billing_reconcile_differences.set(2);
        m.leader_pass("liveness", std::time::Duration::from_millis(3));
        m.gateway_requests
            .get_or_create(&vec![("endpoint", "ep_x".to_string())])
            .observe(0.3);
        let mut r = Registry::default();
        m.register(&mut r);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        for line in [
            "flotilla_placement_pass_duration_seconds_count 1",
            "flotilla_scaling_decisions_total{kind=\"endpoint\",direction=\"up\"} 1",
            "flotilla_scaling_decisions_total{kind=\"endpoint\",direction=\"hold\"} 1",
            "flotilla_usage_events_total{source=\"gateway\",outcome=\"accepted\"} 5",
            "flotilla_usage_events_total{source=\"gateway\",outcome=\"rejected\"} 0",
            "flotilla_billing_reconcile_differences 2",
            "flotilla_leader_pass_duration_seconds_bucket{le=\"0.005\",pass=\"liveness\"} 1",
            "flotilla_gateway_request_duration_seconds_bucket{le=\"0.5\",endpoint=\"ep_x\"} 1",
        ] {
            assert!(out.contains(line), "missing `{line}` in:\n{out}");
        }
    }
}
