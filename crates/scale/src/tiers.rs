//! Readiness tiers: where a replica waits when it is not serving, how fast
//! it comes back from there, and a policy that chooses how many wait where.
//!
//! A replica is in one of four tiers:
//!
//! - **warm**: on a GPU, serving;
//! - **parked**: its weights in the node's host memory, the GPU released
//!   (vLLM's sleep mode, ServerlessLLM's DRAM tier); back in about a
//!   second: the weights cross PCIe at host-to-GPU bandwidth;
//! - **cached**: image and weights on the node's local disk; back after a
//!   container and engine start plus an NVMe read;
//! - **remote**: nothing local; the image is pulled and the weights
//!   downloaded.
//!
//! Each tier's restore time is `overhead + model size / bandwidth`
//! ([`TierSpeed`]). The defaults ([`ReadinessTiers::default`]) come from
//! published measurements; docs/autoscaling.md lists the sources and the
//! arithmetic for an 8B model. Every number is configurable.
//!
//! [`TieredFlotilla`] decides the tiers with the same cost rule
//! Flotilla's policy already applies to scale to zero and to recurring
//! levels, once per tier: the warm count is Flotilla's policy with the
//! *parked* restore as its cold start and the GPU price as the holding
//! cost; the count kept ready to come back fast (warm + parked) is
//! Flotilla's policy with the full (remote) cold start as its horizon and
//! the host memory a parked replica occupies as the holding cost. The
//! difference is parked; the rest is cached where a disk has room, or
//! released. Pure: no clock, no I/O.

use serde::{Deserialize, Serialize};

use crate::flotilla::{ColdStart, Flotilla, FlotillaConfig};
use crate::observe::{Observation, Timing};
use crate::policy::{Bounds, Decision, Policy};
use crate::tolerance::QueueTolerance;
use crate::ScaleError;

/// Where a replica is, from fastest to slowest to serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// On a GPU, serving.
    Warm,
    /// Weights in host memory, GPU released.
    Parked,
    /// Image and weights on local disk.
    Cached,
    /// Nothing on the node: pulled and downloaded.
    Remote,
}

impl Tier {
    /// All tiers, fastest first.
    pub const ALL: [Self; 4] = [Self::Warm, Self::Parked, Self::Cached, Self::Remote];

    /// Lowercase name for reports, metrics and the API.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Warm => "warm",
            Self::Parked => "parked",
            Self::Cached => "cached",
            Self::Remote => "remote",
        }
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Tier {
    type Err = ScaleError;
    fn from_str(s: &str) -> Result<Self, ScaleError> {
        Self::ALL
            .into_iter()
            .find(|t| t.as_str().eq_ignore_ascii_case(s.trim()))
            .ok_or(ScaleError::InvalidConfig {
                field: "tier",
                reason: "expected warm, parked, cached or remote",
            })
    }
}

/// How fast one tier brings a replica back: a fixed start-up part plus the
/// weights at the tier's bandwidth.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TierSpeed {
    /// Weights moved per second on the way to the GPU, GB/s (10⁹ bytes).
    pub bandwidth_gb_per_s: f64,
    /// Time that does not depend on the model size (engine or container
    /// start, CUDA context, KV-cache allocation), ms.
    pub overhead_ms: u64,
}

impl TierSpeed {
    /// Restore time of `model_gb` GB of weights, ms (rounded up).
    pub fn restore_ms(&self, model_gb: f64) -> u64 {
        let load_s = if model_gb.is_finite() && model_gb > 0.0 && self.bandwidth_gb_per_s > 0.0 {
            model_gb / self.bandwidth_gb_per_s
        } else {
            0.0
        };
        self.overhead_ms
            .saturating_add((load_s * 1000.0).ceil().min(u64::MAX as f64) as u64)
    }
}

/// The speeds of the three tiers a replica can come back from.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ReadinessTiers {
    /// Host memory to GPU.
    pub parked: TierSpeed,
    /// Local NVMe to GPU.
    pub cached: TierSpeed,
    /// Registry and object store to GPU.
    pub remote: TierSpeed,
}

impl Default for ReadinessTiers {
    /// Published measurements (sources in docs/autoscaling.md):
    ///
    /// - parked: 50 GB/s, the practical pinned host-to-device rate of a
    ///   PCIe Gen5 x16 link (64 GB/s per direction nominal; ServerlessLLM's
    ///   DRAM loader runs at the link's bandwidth), plus 500 ms to wake the
    ///   engine (vLLM's sleep mode: CUDA context kept, KV cache
    ///   re-allocated): 0.82 s for 16 GB;
    /// - cached: 6.5 GB/s, one PCIe Gen4 NVMe drive's sequential read
    ///   (ServerlessLLM's SSD loader reaches the drive's bandwidth), plus
    ///   10 s of container and engine start: 12.5 s for 16 GB;
    /// - remote: 0.5 GB/s, one node's sustained download from an object
    ///   store, plus 30 s of image pull and start: 62 s for 16 GB, in line
    ///   with the 60 s median of GenTD26's measured load latencies.
    fn default() -> Self {
        Self {
            parked: TierSpeed {
                bandwidth_gb_per_s: 50.0,
                overhead_ms: 500,
            },
            cached: TierSpeed {
                bandwidth_gb_per_s: 6.5,
                overhead_ms: 10_000,
            },
            remote: TierSpeed {
                bandwidth_gb_per_s: 0.5,
                overhead_ms: 30_000,
            },
        }
    }
}

impl ReadinessTiers {
    /// Restore time from `tier` of `model_gb` GB of weights, ms (0 for
    /// warm).
    pub fn restore_ms(&self, tier: Tier, model_gb: f64) -> u64 {
        match tier {
            Tier::Warm => 0,
            Tier::Parked => self.parked.restore_ms(model_gb),
            Tier::Cached => self.cached.restore_ms(model_gb),
            Tier::Remote => self.remote.restore_ms(model_gb),
        }
    }

    /// Every bandwidth finite and positive; slower tiers never faster than
    /// faster ones would be a mistake, not a setting, but it is allowed
    /// (a node may have a slow disk and a fast network).
    pub fn validate(&self) -> Result<(), ScaleError> {
        for (field, s) in [
            ("tiers.parked.bandwidth_gb_per_s", self.parked),
            ("tiers.cached.bandwidth_gb_per_s", self.cached),
            ("tiers.remote.bandwidth_gb_per_s", self.remote),
        ] {
            crate::policy::positive(field, s.bandwidth_gb_per_s)?;
        }
        Ok(())
    }
}

/// Weights of a model of `params_billion` parameters at `bytes_per_param`
/// bytes each, GB (an 8B model in BF16: 16 GB).
pub fn model_gb(params_billion: f64, bytes_per_param: f64) -> f64 {
    params_billion * bytes_per_param
}

/// What tiering costs and holds, for [`TieredFlotilla`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TierEconomics {
    /// Tier speeds.
    pub tiers: ReadinessTiers,
    /// Size of the model's weights, GB: what a parked replica holds in
    /// host memory and what every restore moves.
    pub model_gb: f64,
    /// Price of one GB-hour of host memory (the price book's
    /// `per_parked_gb_hour`; 0 is allowed), same currency as the GPU price.
    pub memory_price_per_gb_hour: f64,
    /// Most replicas host memory can hold parked (the nodes' parking
    /// budgets over the model size).
    pub parked_capacity: u32,
}

impl TierEconomics {
    fn validate(&self) -> Result<(), ScaleError> {
        self.tiers.validate()?;
        crate::policy::positive("model_gb", self.model_gb)?;
        if !(self.memory_price_per_gb_hour.is_finite() && self.memory_price_per_gb_hour >= 0.0) {
            return Err(ScaleError::InvalidConfig {
                field: "memory_price_per_gb_hour",
                reason: "must be finite and not negative",
            });
        }
        Ok(())
    }

    /// Restore time of a parked replica, ms.
    pub fn parked_restore_ms(&self) -> u64 {
        self.tiers.restore_ms(Tier::Parked, self.model_gb)
    }
}

/// The tier plan of one decision: how many replicas warm, how many parked.
/// The rest are cached where a node's disk has room, else released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierPlan {
    /// Replicas on GPUs (the [`Decision`]'s count).
    pub warm: u32,
    /// Replicas parked in host memory.
    pub parked: u32,
}

/// Flotilla's policy over readiness tiers (module documentation).
#[derive(Debug, Clone)]
pub struct TieredFlotilla {
    /// Decides the warm count: parked restore as the cold start, GPU price
    /// as the holding cost.
    warm: Flotilla,
    /// Decides the fast-to-serve count (warm + parked): the full cold start
    /// as the horizon, host memory as the holding cost.
    standby: Flotilla,
    parked_capacity: u32,
    plan: TierPlan,
    /// The warm side's queue tolerance, learned from measured prefill and
    /// restore times ([`crate::tolerance`]).
    tolerance: QueueTolerance,
}

/// Time constant of the warm side's rate level, ms (trend: four times).
const WARM_LEVEL_MS: u64 = 5_000;

impl TieredFlotilla {
    /// The tiered policy within `bounds`. `base` is the untiered
    /// configuration: its cold start is the one a replica pays when nothing
    /// is parked (remote, or cached), its GPU price the warm holding cost.
    ///
    /// The warm side runs `base` with the parked restore `r` as its cold
    /// start and every time scale shrunk with it, each rule keeping its
    /// reason:
    ///
    /// - the peak of demand is kept for one restore (at least
    ///   `min_peak_window_ms`), as is the quiet time before zero: a level
    ///   released now can be back within a restore, so holding it longer
    ///   only pays for a GPU the parked copy makes unnecessary (the
    ///   untiered policy keeps five 60 s cold starts' worth for the
    ///   opposite reason);
    /// - the rate estimate's time constants are 5 s (level) and 20 s
    ///   (trend) instead of 30 s and 120 s: a forecast over a horizon of
    ///   `r` must follow the rate at that scale;
    /// - no square-root headroom: headroom covers arrivals during a cold
    ///   start; when the restore fits in the SLO, a short queue is the
    ///   headroom;
    /// - a climb met from host memory costs no SLO miss when the restore
    ///   and one decision fit in three quarters of the SLO (the rest is
    ///   for the prefill), so the miss cost of the
    ///   level-keeping and scale-to-zero trade-offs is zero then (the idle
    ///   GPU is the only cost left, and it wins);
    /// - decisions every quarter restore (at least 100 ms, at most
    ///   `base.tick_ms`): a burst waits for one tick plus one restore, not
    ///   for a tick longer than the restore itself;
    /// - a queue is demand only beyond what the ready replicas clear within
    ///   the queue tolerance ([`FlotillaConfig::queue_tolerance_ms`]): the
    ///   SLO less a high quantile of the restore times, one tick and a high
    ///   quantile of the prefill times, both measured online
    ///   ([`Policy::record`], [`crate::tolerance`]; before any measurement,
    ///   the configured restore and a tenth of the SLO). The untiered
    ///   policy meets any queue at once because a replica it adds arrives
    ///   a cold start later; here a short queue costs no miss, and a
    ///   replica restored for it would idle once the queue is gone.
    pub fn new(
        base: FlotillaConfig,
        econ: TierEconomics,
        min_peak_window_ms: u64,
        bounds: Bounds,
    ) -> Result<Self, ScaleError> {
        econ.validate()?;
        let restore = econ.parked_restore_ms().max(1);
        let mut warm = base.clone();
        warm.cold_start = ColdStart {
            provision_ms: 0,
            pull_ms: 0,
            load_ms: restore,
        };
        let window = restore.max(min_peak_window_ms);
        warm.peak_window_ms = window.min(base.peak_window_ms);
        warm.min_idle_ms = window.min(base.min_idle_ms);
        warm.level_time_constant_ms = WARM_LEVEL_MS.min(base.level_time_constant_ms);
        warm.trend_time_constant_ms = (4 * WARM_LEVEL_MS).min(base.trend_time_constant_ms);
        warm.headroom_beta = 0.0;
        warm.tick_ms = (restore / 4).clamp(100, base.tick_ms.max(100));
        if (restore + warm.tick_ms) as f64 <= 0.75 * base.slo_ms {
            warm.miss_cost = 0.0;
        }
        let tolerance = QueueTolerance::learned(base.slo_ms as u64, warm.tick_ms, restore);
        warm.queue_tolerance_ms = tolerance.tolerance_ms();
        let mut standby = base;
        // Its cadence is the point: it sizes the parked level over a cold
        // start, and the warm side meets queues (see the field).
        standby.backlog_between_ticks = false;
        standby.hold_price_per_hour = Some(econ.model_gb * econ.memory_price_per_gb_hour);
        Ok(Self {
            warm: Flotilla::new(warm, bounds)?,
            standby: Flotilla::new(standby, bounds)?,
            parked_capacity: econ.parked_capacity,
            plan: TierPlan { warm: 0, parked: 0 },
            tolerance,
        })
    }

    /// The same policy with its queue tolerance fixed at `ms` instead of
    /// learned (the constant it replaced was 775 ms; for comparisons).
    pub fn with_fixed_queue_tolerance(mut self, ms: u64) -> Self {
        self.tolerance = QueueTolerance::fixed(ms);
        self.warm.set_queue_tolerance_ms(ms);
        self
    }

    /// The warm side's queue tolerance and what it has learned.
    pub fn queue_tolerance(&self) -> &QueueTolerance {
        &self.tolerance
    }

    /// The last decision's plan.
    pub fn plan(&self) -> TierPlan {
        self.plan
    }

    /// The warm side's configuration.
    pub fn warm_config(&self) -> &FlotillaConfig {
        self.warm.config()
    }
}

impl Policy for TieredFlotilla {
    fn name(&self) -> &'static str {
        "flotilla-tiered"
    }

    fn bounds(&self) -> Bounds {
        self.warm.bounds()
    }

    fn interval_ms(&self) -> u64 {
        self.warm.interval_ms()
    }

    fn decide(&mut self, now_ms: u64, obs: &Observation) -> Decision {
        self.warm
            .set_queue_tolerance_ms(self.tolerance.tolerance_ms());
        let d = self.warm.decide(now_ms, obs);
        let ready_soon = self.standby.decide(now_ms, obs).replicas;
        self.plan = TierPlan {
            warm: d.replicas,
            parked: ready_soon
                .saturating_sub(d.replicas)
                .min(self.parked_capacity),
        };
        d
    }

    fn parked(&self) -> u32 {
        self.plan.parked
    }

    fn record(&mut self, now_ms: u64, timing: Timing) {
        self.tolerance.record(now_ms, timing);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flotilla::ServiceModel;

    fn base() -> FlotillaConfig {
        FlotillaConfig::new(
            ColdStart {
                provision_ms: 0,
                pull_ms: 0,
                load_ms: 60_000,
            },
            ServiceModel {
                service_rate: 16.0,
                max_concurrency: 32,
            },
            2_000.0,
        )
    }

    fn econ() -> TierEconomics {
        TierEconomics {
            tiers: ReadinessTiers::default(),
            model_gb: model_gb(8.0, 2.0),
            memory_price_per_gb_hour: 0.0043,
            parked_capacity: 100,
        }
    }

    #[test]
    fn restore_time_is_overhead_plus_size_over_bandwidth() {
        let t = ReadinessTiers::default();
        let gb = model_gb(8.0, 2.0);
        assert_eq!(gb, 16.0);
        assert_eq!(t.restore_ms(Tier::Warm, gb), 0);
        assert_eq!(t.restore_ms(Tier::Parked, gb), 500 + 320);
        assert_eq!(t.restore_ms(Tier::Cached, gb), 10_000 + 2_462);
        assert_eq!(t.restore_ms(Tier::Remote, gb), 30_000 + 32_000);
        // Each tier slower than the one before it, for any size.
        for gb in [1.0, 16.0, 140.0] {
            let ms: Vec<u64> = Tier::ALL.iter().map(|&x| t.restore_ms(x, gb)).collect();
            assert!(ms.windows(2).all(|w| w[0] < w[1]), "{ms:?}");
        }
        // Nonsense sizes cost only the overhead, never a panic.
        assert_eq!(t.parked.restore_ms(f64::NAN), 500);
        assert_eq!("Parked".parse::<Tier>(), Ok(Tier::Parked));
        assert!("hot".parse::<Tier>().is_err());
    }

    #[test]
    fn bad_economics_name_the_field() {
        let mut e = econ();
        e.tiers.cached.bandwidth_gb_per_s = 0.0;
        let err = TieredFlotilla::new(base(), e, 1_000, Bounds::new(0, 10).unwrap()).unwrap_err();
        assert!(err.to_string().contains("tiers.cached"), "{err}");
        let mut e = econ();
        e.memory_price_per_gb_hour = -1.0;
        let err = TieredFlotilla::new(base(), e, 1_000, Bounds::new(0, 10).unwrap()).unwrap_err();
        assert!(err.to_string().contains("memory_price"), "{err}");
    }

    #[test]
    fn warm_side_runs_on_the_parked_restore() {
        let p = TieredFlotilla::new(base(), econ(), 1_000, Bounds::new(0, 10).unwrap()).unwrap();
        let w = p.warm_config();
        assert_eq!(w.cold_start.total_ms(), 820);
        assert_eq!(w.peak_window_ms, 1_000);
        assert_eq!(w.tick_ms, 205);
        assert_eq!(w.headroom_beta, 0.0);
        // 0.82 s restore + 0.2 s tick fit in 3/4 of the 2 s SLO: no miss.
        assert_eq!(w.miss_cost, 0.0);
        // Before any measurement a queue may wait 2 s − 0.82 s restore −
        // 0.205 s tick − 0.2 s prefill (a tenth of the SLO) for the ready
        // replicas.
        assert_eq!(w.queue_tolerance_ms, 775);
    }

    #[test]
    fn the_queue_tolerance_follows_measured_prefills() {
        let mut p =
            TieredFlotilla::new(base(), econ(), 1_000, Bounds::new(0, 100).unwrap()).unwrap();
        // Prompts of 500 ms and restores as configured: 2,000 − 820 − 205
        // − 500.
        for i in 0..1_000u64 {
            p.record(i, Timing::Prefill { ms: 500 });
            p.record(i, Timing::Restore { ms: 820 });
        }
        p.decide(1_000, &Observation::default());
        assert_eq!(p.queue_tolerance().tolerance_ms(), 475);
        assert_eq!(p.warm_config().queue_tolerance_ms, 475);
        // A queue of 10 behind 4 busy ready replicas (16 requests a second
        // each): within 475 ms they clear floor(0.475 × 64) = 30, so the
        // queue asks for nothing; fixed at 0 ms, it asks for a replica.
        let busy = Observation {
            ready: 4,
            in_flight: 128,
            queued: 10,
            requests_total: 0,
            ..Observation::default()
        };
        assert_eq!(p.warm_config().excess_queue(10, 4), 0.0);
        let mut strict = TieredFlotilla::new(base(), econ(), 1_000, Bounds::new(0, 100).unwrap())
            .unwrap()
            .with_fixed_queue_tolerance(0);
        assert!(strict.decide(2_000, &busy).replicas > p.decide(2_000, &busy).replicas);
    }

    /// A burst needing 5 replicas for 10 s every 120 s.
    fn bursts(p: &mut TieredFlotilla, until_s: u64) -> Vec<TierPlan> {
        let mut total = 0;
        let mut plans = Vec::new();
        for ms in (0..until_s * 1000).step_by(100) {
            let s = ms / 1000;
            let o = if s % 120 < 10 {
                total += 8;
                Observation {
                    ready: 5,
                    in_flight: 150,
                    requests_total: total,
                    ..Observation::default()
                }
            } else {
                Observation {
                    ready: 1,
                    requests_total: total,
                    ..Observation::default()
                }
            };
            p.decide(ms, &o);
            plans.push(p.plan());
        }
        plans
    }

    #[test]
    fn lulls_shorter_than_a_cold_start_are_parked_not_warm() {
        let mut p =
            TieredFlotilla::new(base(), econ(), 1_000, Bounds::new(0, 100).unwrap()).unwrap();
        let plans = bursts(&mut p, 1_200);
        // During a burst: its 5 replicas warm.
        let in_burst = plans[(960 + 5) * 10];
        assert!(in_burst.warm >= 5, "{in_burst:?}");
        // Deep in the lull: GPUs released, the burst's level parked.
        let lull = plans[(960 + 100) * 10];
        assert!(lull.warm <= 1, "{lull:?}");
        assert!(lull.warm + lull.parked >= 5, "{lull:?}");
        // The untiered policy holds the level warm through the same lull.
        let mut f = Flotilla::new(base(), Bounds::new(0, 100).unwrap()).unwrap();
        let mut total = 0;
        let mut last = 0;
        for ms in (0..1_060_000u64).step_by(100) {
            let s = ms / 1000;
            let o = if s % 120 < 10 {
                total += 8;
                Observation {
                    ready: 5,
                    in_flight: 150,
                    requests_total: total,
                    ..Observation::default()
                }
            } else {
                Observation {
                    ready: 5,
                    requests_total: total,
                    ..Observation::default()
                }
            };
            last = f.decide(ms, &o).replicas;
        }
        assert!(last >= 5, "{last}");
    }

    #[test]
    fn parking_is_bounded_by_host_memory_and_its_price() {
        let mut e = econ();
        e.parked_capacity = 2;
        let mut p = TieredFlotilla::new(base(), e, 1_000, Bounds::new(0, 100).unwrap()).unwrap();
        let plans = bursts(&mut p, 1_200);
        assert!(plans.iter().all(|t| t.parked <= 2));
        assert_eq!(p.parked(), p.plan().parked);
    }
}
