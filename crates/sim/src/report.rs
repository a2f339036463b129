//! Comparing policies on one trace: run each, compute the oracle, and
//! render the rows as Markdown and JSON. Numbers are rounded and formatted
//! explicitly, so the same inputs and seed give byte-identical output.

use rust_decimal::Decimal;
use serde::Serialize;

use crate::cost::Pricing;
use crate::engine::{simulate, SimConfig, SimResult};
use crate::oracle::{lower_bound, tiered_lower_bound, Oracle, TieredOracle};
use crate::policies::{build, build_tiered, Endpoint, PolicyKind};
use crate::trace::Trace;
use crate::SimError;
use flotilla_scale::TierEconomics;
use rust_decimal::prelude::ToPrimitive;

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
    /// With readiness tiers: starts by tier, parked memory and the cost
    /// in money.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tiers: Option<TierRow>,
}

/// The tiered columns of a [`Row`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TierRow {
    /// Starts restored from host memory.
    pub cold_starts_parked: u64,
    /// Starts from a local disk copy.
    pub cold_starts_cached: u64,
    /// Starts from nothing local.
    pub cold_starts_remote: u64,
    /// GB-seconds of host memory held by parked replicas.
    pub parked_gb_seconds: f64,
    /// Parked memory at the price book's `per_parked_gb_hour`.
    pub memory_cost: Decimal,
    /// GPU cost plus memory cost.
    pub total_cost: Decimal,
    /// The fixed-delay oracle's GPU time at the same on-demand price.
    pub oracle_cost: Decimal,
    /// `total_cost / oracle_cost`: the ratio in money.
    pub money_ratio_to_oracle: f64,
    /// The tiered oracle (a bound for any schedule that may also park and
    /// restore, at the same tier speeds and memory price), in money.
    pub tiered_oracle_cost: Decimal,
    /// `total_cost / tiered_oracle_cost`.
    pub money_ratio_to_tiered_oracle: f64,
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
    /// With readiness tiers: the tiered oracle (restore from host memory,
    /// remote start the shortest the model draws, parked memory at its
    /// price).
    pub tiered_oracle: Option<TieredOracle>,
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
/// policy. `progress(policy, done, total)` reports progress. With
/// readiness tiers (`cfg.tiers`), Flotilla's policy runs in its tiered
/// form ([`flotilla_scale::TieredFlotilla`]: it parks replicas); the
/// baselines know no tiers (they park nothing, but their released
/// replicas leave weights on disk like anyone's).
pub fn compare(
    trace: &Trace,
    policies: &[PolicyKind],
    cfg: &SimConfig,
    max_replicas: u32,
    progress: &mut dyn FnMut(&str, u64, u64),
) -> Result<Comparison, SimError> {
    compare_with(trace, policies, cfg, max_replicas, None, progress)
}

/// [`compare`], with the tiered policy's queue tolerance fixed at
/// `fixed_tolerance_ms` instead of learned when it is `Some` (to measure
/// what learning it changes).
pub fn compare_with(
    trace: &Trace,
    policies: &[PolicyKind],
    cfg: &SimConfig,
    max_replicas: u32,
    fixed_tolerance_ms: Option<u64>,
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
    let tiered_oracle = cfg.tiers.as_ref().map(|t| {
        let weight = (pricing.parked_per_gb_second
            * Decimal::try_from(t.model_gb).unwrap_or(Decimal::ZERO))
        .checked_div(pricing.on_demand_per_gpu_second)
        .and_then(|w| w.to_f64())
        .unwrap_or(0.0);
        tiered_lower_bound(
            trace,
            &cfg.service,
            cfg.slo_ms,
            t.tiers.restore_ms(flotilla_scale::Tier::Parked, t.model_gb),
            cfg.cold_start.min_ms(),
            weight,
        )
    });
    let mut results = Vec::new();
    let mut rows = Vec::new();
    for &kind in policies {
        let mut policy = match (&cfg.tiers, kind) {
            (Some(t), PolicyKind::Flotilla) => {
                let econ = TierEconomics {
                    tiers: t.tiers,
                    model_gb: t.model_gb,
                    memory_price_per_gb_hour: (pricing.parked_per_gb_second * Decimal::from(3600))
                        .to_f64()
                        .unwrap_or(0.0),
                    parked_capacity: t.parked_capacity(),
                };
                build_tiered(&ep, econ, fixed_tolerance_ms)?
            }
            _ => build(kind, &ep)?,
        };
        let r = simulate(trace, policy.as_mut(), cfg, &mut |d, t| {
            progress(kind.as_str(), d, t)
        });
        let cost = pricing.on_demand(r.gpu_ms);
        let node_cost = r.node_gpu_ms.map(|(od, spot)| pricing.nodes(od, spot));
        let tiers = match (&cfg.tiers, r.tiers) {
            (Some(t), Some(st)) => {
                let memory_cost = pricing.parked(st.parked_replica_ms, t.model_gb);
                let total_cost = cost + memory_cost;
                let oracle_cost = pricing.on_demand(oracle.gpu_ms);
                let tiered_oracle_cost =
                    pricing.on_demand(tiered_oracle.map_or(0, |o| o.gpu_equivalent_ms));
                let ratio = |to: Decimal| {
                    if to.is_zero() {
                        0.0
                    } else {
                        round((total_cost / to).to_f64().unwrap_or(0.0), 3)
                    }
                };
                Some(TierRow {
                    cold_starts_parked: st.parked_starts,
                    cold_starts_cached: st.cached_starts,
                    cold_starts_remote: st.remote_starts,
                    parked_gb_seconds: round(st.parked_gb_seconds, 1),
                    memory_cost,
                    total_cost,
                    oracle_cost,
                    money_ratio_to_oracle: ratio(oracle_cost),
                    tiered_oracle_cost,
                    money_ratio_to_tiered_oracle: ratio(tiered_oracle_cost),
                })
            }
            _ => None,
        };
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
            tiers,
        });
        results.push(r);
    }
    Ok(Comparison {
        trace: trace.name.clone(),
        requests: trace.len() as u64,
        oracle,
        strict_oracle,
        tiered_oracle,
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

/// The Markdown table of tiered `rows` (rows without tiers are skipped):
/// cold starts by tier, parked memory and the cost ratio in money.
pub fn tiered_markdown_table(rows: &[Row]) -> String {
    let mut s = String::from(
        "| trace | policy | SLO attainment % | TTFT p50 ms | p95 ms | p99 ms | GPU-s | parked GB-s | starts parked / cached / remote | GPU cost | memory cost | total cost | oracle cost (fixed delay) | ratio in money | tiered oracle cost | ratio to tiered oracle |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let Some(t) = &r.tiers else { continue };
        s.push_str(&format!(
            "| {} | {} | {:.3} | {} | {} | {} | {:.1} | {:.0} | {} / {} / {} | {} | {} | {} | {} | {:.3} | {} | {:.3} |\n",
            r.trace,
            r.policy,
            r.slo_attainment_pct,
            r.p50_ms,
            r.p95_ms,
            r.p99_ms,
            r.gpu_seconds,
            t.parked_gb_seconds,
            t.cold_starts_parked,
            t.cold_starts_cached,
            t.cold_starts_remote,
            r.cost,
            t.memory_cost,
            t.total_cost,
            t.oracle_cost,
            t.money_ratio_to_oracle,
            t.tiered_oracle_cost,
            t.money_ratio_to_tiered_oracle,
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
