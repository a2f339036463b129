//! Cost estimates: what a workload would cost per month under each billing
//! model and GPU model, and the cheapest option that still meets it. Used
//! by `flotilla estimate` and the API before anything is rented.
//!
//! A month is 30 days (2,592,000 s), stated on every estimate, so that
//! estimates of different months compare.

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

use crate::error::BillingError;
use crate::money::{self, Currency};
use crate::price::{PriceBook, PriceVersion, SpotSeries};
use crate::Result;

/// Seconds in an estimate month (30 days).
pub const MONTH_SECONDS: i64 = 30 * 86_400;

/// A workload on dedicated GPUs (instances, jobs, or replicas).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuWorkload {
    /// GPU model; `None`: estimate every model of the catalog.
    pub model: Option<String>,
    /// GPUs held at once.
    pub gpus: u32,
    /// Hours a day the GPUs are held (0–24).
    pub hours_per_day: Decimal,
    /// Fraction of held time with work running (0–1); only serverless
    /// bills by it, since it scales to zero when idle.
    pub duty_cycle: Decimal,
    /// 1: must not be preempted; 2–3: tolerates preemption.
    pub tier: u8,
    /// Whether it serves requests, so that a serverless endpoint could run it.
    pub serves_requests: bool,
}

/// A request-serving workload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerlessWorkload {
    /// GPU model; `None`: every model with a serverless price.
    pub model: Option<String>,
    /// Average requests per second.
    pub requests_per_second: Decimal,
    /// Input tokens per request.
    pub input_tokens_per_request: Decimal,
    /// Output tokens per request.
    pub output_tokens_per_request: Decimal,
    /// GPU-seconds of compute per request.
    pub gpu_seconds_per_request: Decimal,
    /// 1: must not be preempted; 2–3: tolerates preemption.
    pub tier: u8,
    /// GB of model weights kept parked in host memory on average between
    /// bursts (an endpoint's `model_gb` times the replicas it keeps
    /// parked), billed per GB-hour on the serverless option; 0: none.
    #[serde(default)]
    pub parked_gb: Decimal,
}

/// What to estimate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Workload {
    /// Dedicated GPUs.
    Gpu(GpuWorkload),
    /// Requests and tokens.
    Serverless(ServerlessWorkload),
}

/// A billing model.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BillingModel {
    /// Per second, on-demand.
    OnDemand,
    /// A commitment of this term and discount (billed 24 h a day).
    Reserved {
        /// Term length in days.
        term_days: u32,
        /// Discount fraction.
        discount: Decimal,
    },
    /// Spot, at the latest recorded price (mid-band if none).
    Spot,
    /// Serverless, per request, token and active GPU-second.
    Serverless,
}

/// One priced option.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EstimateOption {
    /// GPU model.
    pub model: String,
    /// Billing model.
    pub billing_model: BillingModel,
    /// GPUs held (dedicated) or 0 (serverless).
    pub gpus: u32,
    /// Monthly cost, rounded half-even.
    pub monthly_cost: Decimal,
    /// Whether it meets the workload's needs (tier, request serving).
    pub meets: bool,
    /// Why, in a few words.
    pub note: String,
}

/// Every option and the cheapest that meets the workload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Estimate {
    /// Currency.
    pub currency: Currency,
    /// The price version used.
    pub price_version: u32,
    /// Seconds in the estimate month.
    pub month_seconds: i64,
    /// All options, in model then billing-model order.
    pub options: Vec<EstimateOption>,
    /// The cheapest option that meets the workload (ties: first listed).
    pub cheapest: Option<EstimateOption>,
}

fn check_range(v: Decimal, lo: Decimal, hi: Decimal, field: &str) -> Result<()> {
    if v < lo || v > hi {
        return Err(BillingError::invalid(
            field,
            format!("must be between {lo} and {hi}"),
        ));
    }
    Ok(())
}

fn check_tier(tier: u8) -> Result<()> {
    if !(1..=3).contains(&tier) {
        return Err(BillingError::invalid("tier", "must be 1, 2 or 3"));
    }
    Ok(())
}

/// Estimates `workload` with the prices in force at `at`.
pub fn estimate(
    workload: &Workload,
    book: &PriceBook,
    spot: &SpotSeries,
    at: DateTime<Utc>,
) -> Result<Estimate> {
    let v = book.in_force(at)?;
    let currency = v.currency.clone();
    let month = Decimal::from(MONTH_SECONDS);
    let mut options = Vec::new();
    match workload {
        Workload::Gpu(w) => {
            if w.gpus == 0 || w.gpus > crate::meter::MAX_UNITS {
                return Err(BillingError::invalid(
                    "gpus",
                    "must be between 1 and 1000000",
                ));
            }
            check_range(
                w.hours_per_day,
                Decimal::ZERO,
                Decimal::from(24),
                "hours_per_day",
            )?;
            check_range(w.duty_cycle, Decimal::ZERO, Decimal::ONE, "duty_cycle")?;
            check_tier(w.tier)?;
            let held = money::mul(
                money::mul(Decimal::from(w.gpus), w.hours_per_day, "estimate")?,
                Decimal::from(30 * 3600),
                "estimate",
            )?;
            for model in models(v, w.model.as_deref(), false)? {
                if v.on_demand.contains_key(&model) {
                    dedicated(
                        &mut options,
                        v,
                        spot,
                        &model,
                        w.gpus,
                        held,
                        w.tier,
                        &currency,
                    )?;
                }
                if let Some(p) = v.serverless.per_gpu_second.get(&model) {
                    let active = money::mul(held, w.duty_cycle, "estimate")?;
                    options.push(EstimateOption {
                        model: model.clone(),
                        billing_model: BillingModel::Serverless,
                        gpus: 0,
                        monthly_cost: currency.round(money::mul(active, *p, "estimate")?),
                        meets: w.serves_requests,
                        note: if w.serves_requests {
                            "scales to zero: bills active GPU time only".into()
                        } else {
                            "only request-serving workloads run serverless".into()
                        },
                    });
                }
            }
        }
        Workload::Serverless(w) => {
            check_tier(w.tier)?;
            for (f, x) in [
                ("requests_per_second", w.requests_per_second),
                ("input_tokens_per_request", w.input_tokens_per_request),
                ("output_tokens_per_request", w.output_tokens_per_request),
                ("gpu_seconds_per_request", w.gpu_seconds_per_request),
                ("parked_gb", w.parked_gb),
            ] {
                check_range(x, Decimal::ZERO, Decimal::from(1_000_000_000), f)?;
            }
            let requests = money::mul(w.requests_per_second, month, "estimate")?;
            let million = Decimal::from(1_000_000);
            let input = money::div(
                money::mul(requests, w.input_tokens_per_request, "estimate")?,
                million,
                "estimate",
            )?;
            let output = money::div(
                money::mul(requests, w.output_tokens_per_request, "estimate")?,
                million,
                "estimate",
            )?;
            let gpu_secs = money::mul(requests, w.gpu_seconds_per_request, "estimate")?;
            // Parked memory is held all month, GPU or not.
            let mut counted = money::mul(
                money::mul(w.parked_gb, month, "estimate")?,
                v.parked_per_gb_second(),
                "estimate",
            )?;
            for (schedule, q) in [
                (&v.serverless.per_request, requests),
                (&v.serverless.per_million_input_tokens, input),
                (&v.serverless.per_million_output_tokens, output),
            ] {
                for p in schedule.price(Decimal::ZERO, q, q)? {
                    counted = money::add(
                        counted,
                        money::mul(p.quantity, p.unit_price, "estimate")?,
                        "estimate",
                    )?;
                }
            }
            // One GPU serves one GPU-second of work per second; a dedicated
            // fleet needs at least one replica, and runs all month.
            let replicas_dec = money::div(gpu_secs, month, "estimate")?
                .ceil()
                .max(Decimal::ONE);
            let replicas: u32 = replicas_dec.to_string().parse().map_err(|_| {
                BillingError::invalid("requests_per_second", "needs too many replicas")
            })?;
            let held = money::mul(replicas_dec, month, "estimate")?;
            for model in models(v, w.model.as_deref(), true)? {
                if let Some(p) = v.serverless.per_gpu_second.get(&model) {
                    let cost =
                        money::add(counted, money::mul(gpu_secs, *p, "estimate")?, "estimate")?;
                    options.push(EstimateOption {
                        model: model.clone(),
                        billing_model: BillingModel::Serverless,
                        gpus: 0,
                        monthly_cost: currency.round(cost),
                        meets: true,
                        note: "per request, token and active GPU-second".into(),
                    });
                }
                if v.on_demand.contains_key(&model) {
                    dedicated(
                        &mut options,
                        v,
                        spot,
                        &model,
                        replicas,
                        held,
                        w.tier,
                        &currency,
                    )?;
                }
            }
        }
    }
    let cheapest = options
        .iter()
        .filter(|o| o.meets)
        .min_by(|a, b| a.monthly_cost.cmp(&b.monthly_cost))
        .cloned();
    Ok(Estimate {
        currency,
        price_version: v.version,
        month_seconds: MONTH_SECONDS,
        options,
        cheapest,
    })
}

fn models(v: &PriceVersion, model: Option<&str>, serverless: bool) -> Result<Vec<String>> {
    match model {
        Some(m) if v.on_demand.contains_key(m) || v.serverless.per_gpu_second.contains_key(m) => {
            Ok(vec![m.to_string()])
        }
        Some(m) => Err(BillingError::NoPriceForModel {
            version: v.version,
            kind: "on_demand",
            model: m.to_string(),
        }),
        None => {
            let mut all: Vec<String> = v.on_demand.keys().cloned().collect();
            if serverless {
                all.extend(v.serverless.per_gpu_second.keys().cloned());
                all.sort();
                all.dedup();
            }
            Ok(all)
        }
    }
}

/// On-demand, reserved (each offer) and spot options for `gpus` GPUs held
/// `held` GPU-seconds a month.
#[allow(
    clippy::too_many_arguments,
    reason = "internal helper over the estimate's locals"
)]
fn dedicated(
    out: &mut Vec<EstimateOption>,
    v: &PriceVersion,
    spot: &SpotSeries,
    model: &str,
    gpus: u32,
    held: Decimal,
    tier: u8,
    currency: &Currency,
) -> Result<()> {
    let od = v.on_demand(model)?.per_gpu_second;
    out.push(EstimateOption {
        model: model.to_string(),
        billing_model: BillingModel::OnDemand,
        gpus,
        monthly_cost: currency.round(money::mul(held, od, "estimate")?),
        meets: true,
        note: "pay per second held".into(),
    });
    let full = money::mul(
        Decimal::from(gpus),
        Decimal::from(MONTH_SECONDS),
        "estimate",
    )?;
    for o in &v.reserved_offers {
        let rate = money::mul(od, Decimal::ONE - o.discount, "estimate")?;
        out.push(EstimateOption {
            model: model.to_string(),
            billing_model: BillingModel::Reserved {
                term_days: o.term_days,
                discount: o.discount,
            },
            gpus,
            monthly_cost: currency.round(money::mul(full, rate, "estimate")?),
            meets: true,
            note: format!(
                "{}-day commitment, billed 24 h a day whether used or not",
                o.term_days
            ),
        });
    }
    if let Some(band) = v.spot.get(model) {
        let price = match spot.latest(model) {
            Some(p) => p.per_gpu_second,
            None => money::div(
                money::add(band.floor, band.ceiling, "estimate")?,
                Decimal::TWO,
                "estimate",
            )?,
        };
        out.push(EstimateOption {
            model: model.to_string(),
            billing_model: BillingModel::Spot,
            gpus,
            monthly_cost: currency.round(money::mul(held, price, "estimate")?),
            meets: tier >= 2,
            note: if tier >= 2 {
                "may be preempted".into()
            } else {
                "tier 1 work must not be preempted".into()
            },
        });
    }
    Ok(())
}
