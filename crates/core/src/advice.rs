//! Right-sizing advice: what a workload used of its GPUs, and the cheapest
//! catalog class that would serve the same load.
//!
//! Pure arithmetic over telemetry samples and the catalog's list prices:
//! the server gathers the samples, this module summarises them and prices
//! the alternatives. The rule, in one paragraph:
//!
//! The work the instance did is its p95 GPU utilisation times its GPUs
//! times its class's relative performance (in the catalog's reference
//! units); planned at [`TARGET_UTIL`] per GPU so bursts fit, a class with
//! relative performance `p` needs `ceil(work / (p × TARGET_UTIL))` GPUs, at
//! least one, and enough GPUs that their memory holds the peak memory seen
//! plus [`MEMORY_HEADROOM`]. The cheapest such fit by list price wins; it
//! is recommended when it saves at least [`MIN_SAVING_PERCENT`] of the
//! current price. Money stays `Decimal`; only the load arithmetic uses
//! floats, as utilisation is a measurement.

use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

use crate::catalog::GpuModel;

/// Utilisation a GPU is planned at: headroom for bursts.
pub const TARGET_UTIL: f64 = 0.7;
/// Memory kept free above the peak seen, as a fraction of it.
pub const MEMORY_HEADROOM: f64 = 0.1;
/// Least saving (percent of the current hourly price) worth a move.
pub const MIN_SAVING_PERCENT: u32 = 15;
/// Below this utilisation (percent) a sample counts as idle.
pub const IDLE_BELOW_PCT: u32 = 5;

/// One reading of one GPU: utilisation percent and memory in use, MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageSample {
    /// GPU utilisation, 0–100.
    pub util_pct: u32,
    /// Frame-buffer memory in use, MiB (absent where not reported).
    pub mem_mib: Option<u64>,
}

/// What a workload used of its GPUs over the samples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct UtilisationSummary {
    /// Samples summarised (one per GPU per agent sync).
    pub samples: u64,
    /// Mean GPU utilisation, percent.
    pub mean_util_pct: f64,
    /// 95th percentile (nearest rank) of GPU utilisation, percent.
    pub p95_util_pct: u32,
    /// Most memory seen in use on one GPU, MiB.
    pub peak_memory_mib: u64,
    /// Share of samples below [`IDLE_BELOW_PCT`] utilisation, 0–1.
    pub idle_fraction: f64,
}

/// Summarises `samples`; `None` without any.
pub fn summarise(samples: &[UsageSample]) -> Option<UtilisationSummary> {
    if samples.is_empty() {
        return None;
    }
    let mut utils: Vec<u32> = samples.iter().map(|s| s.util_pct.min(100)).collect();
    utils.sort_unstable();
    let n = utils.len();
    // Nearest rank: the smallest value with at least 95 % at or below it.
    let rank = (n * 95).div_ceil(100).max(1);
    let sum: u64 = utils.iter().map(|u| u64::from(*u)).sum();
    let idle = utils.iter().filter(|u| **u < IDLE_BELOW_PCT).count();
    Some(UtilisationSummary {
        samples: n as u64,
        mean_util_pct: sum as f64 / n as f64,
        p95_util_pct: utils[rank - 1],
        peak_memory_mib: samples.iter().filter_map(|s| s.mem_mib).max().unwrap_or(0),
        idle_fraction: idle as f64 / n as f64,
    })
}

/// A class and count that would serve the load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Fit {
    /// Catalog model.
    pub model: String,
    /// GPUs of it.
    pub gpus: u32,
    /// List price per hour of that many, in the catalog's currency.
    #[schema(value_type = String)]
    pub price_per_hour: Decimal,
}

/// The advice for one workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Recommendation {
    /// What it runs on now.
    pub current: Fit,
    /// The cheapest fit; the same as `current` when nothing is cheaper
    /// enough.
    pub suggested: Fit,
    /// Hourly saving, `current - suggested` (0 when staying).
    #[schema(value_type = String)]
    pub saving_per_hour: Decimal,
    /// The saving as a whole percent of the current price.
    pub saving_percent: u32,
    /// Whether a move is advised (saves at least [`MIN_SAVING_PERCENT`]).
    pub advised: bool,
    /// One sentence a person can check.
    pub reason: String,
}

/// Why no advice could be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdviceError {
    /// The current model is not in the catalog.
    #[error("gpu model `{0}` is not in the catalog")]
    UnknownModel(String),
    /// The workload holds no GPU.
    #[error("the workload holds no gpu")]
    NoGpus,
}

fn fit(model: &GpuModel, gpus: u32) -> Fit {
    Fit {
        model: model.name.clone(),
        gpus,
        price_per_hour: model.list_price_per_hour * Decimal::from(gpus),
    }
}

/// The GPUs of `model` needed for `work` (reference units at full use)
/// and `memory_mib` on one GPU (the peak seen, which a model sharded over
/// `gpus` GPUs needs on each of that many, so in total).
fn needed(model: &GpuModel, work: f64, total_memory_mib: f64) -> u32 {
    let perf = model.relative_performance.max(f64::MIN_POSITIVE);
    let for_work = (work / (perf * TARGET_UTIL)).ceil();
    let per_gpu_mib = f64::from(model.memory_gib) * 1024.0;
    let for_memory = (total_memory_mib * (1.0 + MEMORY_HEADROOM) / per_gpu_mib).ceil();
    // Bounded by the catalog's sizes and 100 % use: far below u32::MAX.
    for_work.max(for_memory).max(1.0).min(f64::from(u32::MAX)) as u32
}

/// Prices the workload's `summary` on `gpus` × `current` against every
/// model of `catalog` (same vendor family is not required: the catalog
/// lists what the fleet offers).
pub fn recommend(
    summary: &UtilisationSummary,
    current: &str,
    gpus: u32,
    catalog: &[GpuModel],
) -> Result<Recommendation, AdviceError> {
    if gpus == 0 {
        return Err(AdviceError::NoGpus);
    }
    let cur = catalog
        .iter()
        .find(|m| m.name == current)
        .ok_or_else(|| AdviceError::UnknownModel(current.to_string()))?;
    let work = f64::from(summary.p95_util_pct) / 100.0 * f64::from(gpus) * cur.relative_performance;
    // Peak per GPU, on each of the GPUs it runs on now.
    let memory = summary.peak_memory_mib as f64 * f64::from(gpus);
    let now = fit(cur, gpus);
    let best = catalog
        .iter()
        .map(|m| fit(m, needed(m, work, memory)))
        .min_by(|a, b| {
            a.price_per_hour
                .cmp(&b.price_per_hour)
                .then(a.gpus.cmp(&b.gpus))
                .then_with(|| a.model.cmp(&b.model))
        })
        .unwrap_or_else(|| now.clone());
    let saving = now.price_per_hour - best.price_per_hour;
    let percent = if now.price_per_hour > Decimal::ZERO && saving > Decimal::ZERO {
        // Whole percent, rounded down: never overstate a saving.
        (saving * Decimal::from(100) / now.price_per_hour)
            .floor()
            .try_into()
            .unwrap_or(0u32)
    } else {
        0
    };
    let advised = percent >= MIN_SAVING_PERCENT && best != now;
    let used = format!(
        "averaged {:.0} % (p95 {} %) of {}×{}",
        summary.mean_util_pct, summary.p95_util_pct, gpus, cur.name
    );
    let (suggested, saving, reason) = if advised {
        let reason = format!(
            "{used}: {}×{} would serve it for {percent} % less ({} instead of {} per hour)",
            best.gpus, best.model, best.price_per_hour, now.price_per_hour
        );
        (best, saving, reason)
    } else {
        (
            now.clone(),
            Decimal::ZERO,
            format!("{used}: no class would serve it for at least {MIN_SAVING_PERCENT} % less"),
        )
    };
    Ok(Recommendation {
        current: now,
        suggested,
        saving_per_hour: saving,
        saving_percent: if advised { percent } else { 0 },
        advised,
        reason,
    })
}

/// An instance's GPU utilisation as its agents reported it, and what it
/// would cost on the cheapest catalog class that serves the same load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct InstanceAdvice {
    /// The instance.
    pub instance_id: crate::id::InstanceId,
    /// Its GPU model, once placed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_model: Option<String>,
    /// GPUs it holds (asked for).
    pub gpus: u32,
    /// Its utilisation over the readings this server received; absent
    /// before any (simulated GPUs without readings report none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<UtilisationSummary>,
    /// The right-sizing advice, against the catalog's list prices; absent
    /// without a summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recommendation: Option<Recommendation>,
}

/// An endpoint's utilisation over its replicas' GPUs, and the cheapest
/// class one replica could run on (`GET /v1/endpoints/{id}/advice`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EndpointAdvice {
    /// The endpoint.
    pub endpoint_id: crate::id::EndpointId,
    /// The GPU model its newest placed replica runs on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_model: Option<String>,
    /// GPUs per replica.
    pub gpus_per_replica: u32,
    /// Replicas whose readings are summarised.
    pub replicas: u32,
    /// Utilisation of every replica's GPUs together; absent before any
    /// reading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<UtilisationSummary>,
    /// Per replica, against the catalog's list prices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recommendation: Option<Recommendation>,
}

/// An endpoint's opt-in to automatic vertical moves
/// (`PUT /v1/endpoints/{id}/vertical`): `flotilla_scale::vertical` may
/// move its replicas between these GPU classes, each move a new revision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VerticalOptIn {
    /// Catalog models the replicas may run on (2 to 16), the current one
    /// among them.
    pub classes: Vec<String>,
    /// How long a recommendation must hold before it is a move, seconds
    /// (default 600, 1 to 86400).
    #[serde(default = "default_sustain_s")]
    pub sustain_s: u64,
}

fn default_sustain_s() -> u64 {
    600
}

impl VerticalOptIn {
    /// Checks the opt-in against `catalog`; the field names the fault.
    pub fn validate(&self, catalog: &[GpuModel]) -> Result<(), crate::FieldError> {
        if !(2..=16).contains(&self.classes.len()) {
            return Err(crate::FieldError::new(
                "classes",
                "must list 2 to 16 gpu models",
            ));
        }
        for (i, c) in self.classes.iter().enumerate() {
            if !catalog.iter().any(|m| &m.name == c) {
                return Err(crate::FieldError::new(
                    format!("classes[{i}]"),
                    format!("`{c}` is not a gpu model of the catalog"),
                ));
            }
            if self.classes[..i].contains(c) {
                return Err(crate::FieldError::new(
                    format!("classes[{i}]"),
                    format!("`{c}` is listed twice"),
                ));
            }
        }
        if !(1..=86_400).contains(&self.sustain_s) {
            return Err(crate::FieldError::new(
                "sustain_s",
                "must be between 1 and 86400",
            ));
        }
        Ok(())
    }
}

/// An endpoint's vertical opt-in and its last move.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VerticalStatus {
    /// The opt-in.
    #[serde(flatten)]
    pub opt_in: VerticalOptIn,
    /// When it was made.
    pub opted_at: chrono::DateTime<chrono::Utc>,
    /// The last move and why, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_move: Option<String>,
    /// When it was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_at: Option<chrono::DateTime<chrono::Utc>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::Catalog;

    fn at(util: u32, mem: u64) -> UsageSample {
        UsageSample {
            util_pct: util,
            mem_mib: Some(mem),
        }
    }

    fn summary(util: &[u32], mem: u64) -> UtilisationSummary {
        summarise(&util.iter().map(|u| at(*u, mem)).collect::<Vec<_>>()).unwrap()
    }

    fn model<'a>(c: &'a [GpuModel], name: &str) -> &'a GpuModel {
        c.iter().find(|m| m.name == name).unwrap()
    }

    #[test]
    fn summary_of_samples() {
        assert_eq!(summarise(&[]), None);
        let mut s: Vec<UsageSample> = (1..=100).map(|u| at(u, u64::from(u) * 10)).collect();
        s.push(UsageSample {
            util_pct: 0,
            mem_mib: None,
        });
        let sum = summarise(&s).unwrap();
        assert_eq!(sum.samples, 101);
        assert!((sum.mean_util_pct - 5050.0 / 101.0).abs() < 1e-9);
        // Nearest rank of 95 % of 101 is the 96th value: 95.
        assert_eq!(sum.p95_util_pct, 95);
        assert_eq!(sum.peak_memory_mib, 1000);
        // 0, 1, 2, 3, 4 are idle.
        assert!((sum.idle_fraction - 5.0 / 101.0).abs() < 1e-9);
    }

    /// The example: 18 % of 2×H100 fits one smaller class, priced
    /// from the catalog.
    #[test]
    fn a_lightly_used_pair_of_h100s_moves_to_one_cheaper_gpu() {
        let catalog = Catalog::default().models().to_vec();
        let s = summary(&[18; 20], 10_000);
        let r = recommend(&s, "H100", 2, &catalog).unwrap();
        let h100 = model(&catalog, "H100");
        assert_eq!(r.current.gpus, 2);
        assert_eq!(
            r.current.price_per_hour,
            h100.list_price_per_hour * Decimal::from(2)
        );
        assert!(r.advised, "{r:?}");
        // Work: 0.18 × 2 × perf(H100). Check the choice is the cheapest fit
        // by brute force over the catalog with the module's own rule.
        let work = 0.36 * h100.relative_performance;
        let mut cheapest: Option<(Decimal, u32, String)> = None;
        for m in &catalog {
            let n = needed(m, work, 20_000.0);
            let p = m.list_price_per_hour * Decimal::from(n);
            let c = (p, n, m.name.clone());
            if cheapest.as_ref().is_none_or(|best| c < *best) {
                cheapest = Some(c);
            }
        }
        let (price, n, name) = cheapest.unwrap();
        assert_eq!(
            (
                r.suggested.model.as_str(),
                r.suggested.gpus,
                r.suggested.price_per_hour
            ),
            (name.as_str(), n, price)
        );
        assert_eq!(r.saving_per_hour, r.current.price_per_hour - price);
        let pct = ((r.current.price_per_hour - price) * Decimal::from(100)
            / r.current.price_per_hour)
            .floor();
        assert_eq!(Decimal::from(r.saving_percent), pct);
        assert!(
            r.reason.contains("averaged 18 % (p95 18 %) of 2×H100"),
            "{}",
            r.reason
        );
        assert!(r.reason.contains(&format!("{pct} % less")), "{}", r.reason);
    }

    #[test]
    fn exact_prices_on_a_small_catalog() {
        let mk = |name: &str, perf: f64, mem: u32, price: i64| GpuModel {
            name: name.into(),
            vendor: crate::catalog::Vendor::Nvidia,
            memory_gib: mem,
            mig_profiles: vec![],
            mig_geometry: None,
            relative_performance: perf,
            list_price_per_hour: Decimal::new(price, 2),
        };
        let catalog = vec![
            mk("BIG", 4.0, 80, 400),  // 4.00 an hour
            mk("MID", 2.0, 48, 150),  // 1.50
            mk("SMALL", 1.0, 24, 60), // 0.60
        ];
        // 2×BIG at 20 %: work 0.2 × 2 × 4 = 1.6 reference units.
        // MID needs ceil(1.6 / 1.4) = 2 (3.00); SMALL ceil(1.6 / 0.7) = 3
        // (1.80); BIG ceil(1.6 / 2.8) = 1 (4.00). SMALL wins: 8.00 → 1.80,
        // 6.20 saved, 77 %.
        let r = recommend(&summary(&[20; 10], 1000), "BIG", 2, &catalog).unwrap();
        assert_eq!(r.suggested.model, "SMALL");
        assert_eq!(r.suggested.gpus, 3);
        assert_eq!(r.suggested.price_per_hour, Decimal::new(180, 2));
        assert_eq!(r.saving_per_hour, Decimal::new(620, 2));
        assert_eq!(r.saving_percent, 77);
        assert!(r.advised);
        // Memory decides too: 30 GiB peak on each of 2 GPUs (60 GiB, +10 %
        // = 66 GiB) needs 3 SMALL for memory alone (and 3 for work), 2 MID.
        let r = recommend(&summary(&[20; 10], 30 * 1024), "BIG", 2, &catalog).unwrap();
        assert_eq!((r.suggested.model.as_str(), r.suggested.gpus), ("SMALL", 3));
        let r = recommend(&summary(&[20; 10], 40 * 1024), "BIG", 2, &catalog).unwrap();
        // 88 GiB: SMALL needs 4 (2.40), MID 2 (3.00), BIG 2 (8.00).
        assert_eq!((r.suggested.model.as_str(), r.suggested.gpus), ("SMALL", 4));
        assert_eq!(r.suggested.price_per_hour, Decimal::new(240, 2));
        // A busy workload stays: 1×SMALL at 90 % needs 2 SMALL (1.20), or 1
        // MID (1.50); nothing is cheaper than 0.60.
        let r = recommend(&summary(&[90; 10], 1000), "SMALL", 1, &catalog).unwrap();
        assert!(!r.advised);
        assert_eq!(r.suggested, r.current);
        assert_eq!(r.saving_per_hour, Decimal::ZERO);
        assert!(r.reason.contains("no class would serve it"), "{}", r.reason);
        // A saving under 15 % is not worth a move: 1×MID at 10 % → 1 SMALL
        // saves 60 %; but 1 MID vs 2 SMALL at 60 % (1.20 vs 1.50) saves 20 %.
        let r = recommend(&summary(&[60; 10], 1000), "MID", 1, &catalog).unwrap();
        assert_eq!((r.suggested.model.as_str(), r.suggested.gpus), ("SMALL", 2));
        assert_eq!(r.saving_percent, 20);
        assert!(matches!(
            recommend(&summary(&[1], 1), "Z80", 1, &catalog),
            Err(AdviceError::UnknownModel(_))
        ));
        assert_eq!(
            recommend(&summary(&[1], 1), "MID", 0, &catalog),
            Err(AdviceError::NoGpus)
        );
    }
}
