//! Comparing policies on one trace: run each, compute the oracle, and
//! render the rows as Markdown and JSON. Numbers are rounded and formatted
//! explicitly, so the same inputs and seed give byte-identical output.

use rust_decimal::Decimal;
use serde::Serialize;

use crate::cost::Pricing;
use crate::engine::{simulate, SimConfig, SimResult};
use crate::oracle::{lower_bound, Oracle};
use crate::policies::{build, Endpoint, PolicyKind};
use crate::trace::Trace;
use crate::SimError;

/// One policy on one trace: the row of the benchmark table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    pub trace: String,
    pub policy: String,
    pub slo_ms: u64,
    pub slo_attainment_pct: f64,
    pub gpu_seconds: f64,
    /// The fixed-delay oracle: the bound for a cold start fixed at the
    /// setting's median. The ratio column divides by it.
    pub oracle_gpu_seconds: f64,
    pub cost_ratio_to_oracle: f64,
    /// The strict oracle: the bound for the shortest cold start the model
    /// can draw, valid for every draw of the cold starts.
    pub strict_oracle_gpu_seconds: f64,
    pub p50_ms: u64,
    pub p95_ms: u64,
    pub p99_ms: u64,
    pub e2e_p99_ms: u64,
    /// Replica GPU time at the on-demand price.
    pub cost: Decimal,
    /// With a node pool: node GPU time, on-demand and spot at their prices.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_cost: Option<Decimal>,
    pub cold_starts: u64,
    pub scaling_actions: u64,
    pub dropped: u64,
    pub requests: u64,
}

/// Every policy's result on one trace, with the oracle.
#[derive(Debug, Clone)]
pub struct Comparison {
    pub trace: String,
    pub requests: u64,
    /// The fixed-delay oracle (cold start = the model's median).
    pub oracle: Oracle,
    /// The strict oracle (cold start = the shortest the model draws).
    pub strict_oracle: Oracle,
    /// The prices costs were computed with.
    pub pricing: Pricing,
    pub results: Vec<SimResult>,
    pub rows: Vec<Row>,
}

fn round(x: f64, digits: i32) -> f64 {
    let k = 10f64.powi(digits);
    (x * k).round() / k
}

/// Run `policies` on `trace` with `cfg`. `max_replicas` bounds every
/// policy. `progress(policy, done, total)` reports progress.
pub fn compare(
    trace: &Trace,
    policies: &[PolicyKind],
    cfg: &SimConfig,
    max_replicas: u32,
    progress: &mut dyn FnMut(&str, u64, u64),
) -> Result<Comparison, SimError> {
    let n = trace.len() as f64;
    let mean_service_ms = trace
        .requests()
        .iter()
        .map(|r| cfg.service.service_ms(r) as f64)
        .sum::<f64>()
        / n;
    let ep = Endpoint {
        max_concurrency: cfg.service.max_concurrency,
        mean_service_ms,
        cold_start_ms: cfg.cold_start.median_ms(),
        slo_ms: cfg.slo_ms,
        max_replicas,
    };
    let oracle = lower_bound(trace, &cfg.service, cfg.slo_ms, cfg.cold_start.median_ms());
    let strict_oracle = lower_bound(trace, &cfg.service, cfg.slo_ms, cfg.cold_start.min_ms());
    let pricing = match &cfg.prices {
        Some(v) => Pricing::from_version(v, &cfg.service.gpu)?,
        None => Pricing::list(&cfg.service.gpu)?,
    };
    let mut results = Vec::new();
    let mut rows = Vec::new();
    for &kind in policies {
        let mut policy = build(kind, &ep)?;
        let r = simulate(trace, policy.as_mut(), cfg, &mut |d, t| {
            progress(kind.as_str(), d, t)
        });
        let cost = pricing.on_demand(r.gpu_ms);
        let node_cost = r.node_gpu_ms.map(|(od, spot)| pricing.nodes(od, spot));
        rows.push(Row {
            trace: trace.name.clone(),
            policy: r.policy.clone(),
            slo_ms: cfg.slo_ms,
            slo_attainment_pct: round(r.slo_attainment_pct(), 3),
            gpu_seconds: round(r.gpu_seconds(), 1),
            oracle_gpu_seconds: round(oracle.gpu_ms as f64 / 1000.0, 1),
            cost_ratio_to_oracle: if oracle.gpu_ms == 0 {
                0.0
            } else {
                round(r.gpu_ms as f64 / oracle.gpu_ms as f64, 3)
            },
            strict_oracle_gpu_seconds: round(strict_oracle.gpu_ms as f64 / 1000.0, 1),
            p50_ms: r.ttft.p50,
            p95_ms: r.ttft.p95,
            p99_ms: r.ttft.p99,
            e2e_p99_ms: r.e2e.p99,
            cost,
            node_cost,
            cold_starts: r.cold_starts,
            scaling_actions: r.scaling_actions,
            dropped: r.dropped,
            requests: r.requests,
        });
        results.push(r);
    }
    Ok(Comparison {
        trace: trace.name.clone(),
        requests: trace.len() as u64,
        oracle,
        strict_oracle,
        pricing,
        results,
        rows,
    })
}

/// The Markdown table of `rows` (one header, one line per row).
pub fn markdown_table(rows: &[Row]) -> String {
    let mut s = String::from(
        "| trace | policy | SLO attainment % | TTFT p50 ms | p95 ms | p99 ms | e2e p99 ms | GPU-s | oracle GPU-s (fixed delay) | ratio to oracle | strict oracle GPU-s | cost | cold starts | scaling actions | dropped |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {:.3} | {} | {} | {} | {} | {:.1} | {:.1} | {:.3} | {:.1} | {} | {} | {} | {} |\n",
            r.trace,
            r.policy,
            r.slo_attainment_pct,
            r.p50_ms,
            r.p95_ms,
            r.p99_ms,
            r.e2e_p99_ms,
            r.gpu_seconds,
            r.oracle_gpu_seconds,
            r.cost_ratio_to_oracle,
            r.strict_oracle_gpu_seconds,
            r.cost,
            r.cold_starts,
            r.scaling_actions,
            r.dropped
        ));
    }
    s
}

/// The rows as pretty JSON with a trailing newline.
pub fn json(rows: &[Row]) -> String {
    let mut s = serde_json::to_string_pretty(rows).unwrap_or_else(|_| "[]".to_string());
    s.push('\n');
    s
}
