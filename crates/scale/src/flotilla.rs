//! Flotilla's own policy, first version: cold-start-aware and
//! trace-agnostic (nothing in it is fitted to a particular trace; it will be
//! tuned against the simulator later).
//!
//! The baselines react to load they can already see; on GPUs a replica
//! started now serves only after the cold start `H` (provision + pull +
//! load, often a minute or more), so reacting is always `H` late. The rule:
//!
//! 1. **Forecast over the cold-start horizon.** Arrivals are counted from
//!    the monotone request counter. A Holt (level + trend) exponentially
//!    weighted estimate of the rate, extrapolated `H` ahead, anticipates
//!    ramps (the trend term capped at doubling the level within one
//!    horizon so one noisy burst cannot order a fleet).
//! 2. **Headroom in slots, from Little's law.** A replica runs `C`
//!    requests at once and completes `μ` per second, so each request holds
//!    a slot for `s = C / μ` seconds and `λ` requests per second keep
//!    `a = λ·s` slots busy (the offered load in Erlangs). Slots are the
//!    servers of this queue, so square-root staffing applies to them:
//!    `a + β·√a` slots (`β` = 1 by default), `ceil(· / C)` replicas.
//! 3. **Keep the recent peak.** The highest demand seen over the peak
//!    window (300 s by default, Kubernetes' scale-down stabilisation) is
//!    kept as capacity: traffic that burst once within a few cold starts is
//!    likely to burst again, and a burst met by a replica that is still
//!    starting is a burst of SLO misses. Demand is in slots: requests in
//!    flight, plus each queued request weighed by `min(1, s / SLO)` — the
//!    share of a slot it needs to be started within the SLO (a queue of
//!    short requests is drained by a fraction of its length in slots;
//!    counting it whole kept several times the capacity a burst needs).
//! 4. **Keep levels that recur, by cost.** Past the peak window, replica
//!    level `j` is still kept while demand keeps climbing back to it often
//!    enough: the long-run rate `λ_j` of climbs to `j` (after a dip of at
//!    least one SLO; shorter dips are within one request's wait) goes
//!    through step 6's trade-off, and the level stays while the expected
//!    penalty of a cold level over one cold start exceeds its idle cost.
//!    This is the scale-down counterpart of scale to zero: bursts that
//!    recur at intervals longer than the peak window but shorter than the
//!    break-even no longer find their capacity gone.
//! 5. **Backlog.** Requests in flight need `ceil(in_flight / C)` replicas
//!    now; requests waiting are worked off over one cold start (a replica
//!    started now helps no sooner): `ceil(queued·s / (C·H))` more, at least
//!    one. The largest of forecast, peak, recurring level and backlog wins.
//!
//! (First version: the peak was of arrival rates in SLO-long buckets and
//! the headroom `β·√R` in replicas; measured in the simulator, headroom in
//! replicas over-provisions by `√C` and rate peaks miss the hold time.
//! Second version: the peak counted queued requests whole, and the peak
//! window was the only memory of bursts; see docs/autoscaling.md for the
//! measurements on every trace.)
//!
//! 6. **Scale to zero by cost.** When one replica or fewer is needed, no
//!    request is in flight or queued and none has arrived for `min_idle`,
//!    the policy compares, over the next horizon `H`: the idle cost of one
//!    warm replica, `gpus × price × H`, with the expected cost of going
//!    cold, `P(a request within H) × (miss_cost × (1 + λH) + gpus × price ×
//!    H)` — the first request and those arriving during its cold start miss
//!    the SLO, and the cold start itself burns GPU time — with
//!    `P = 1 − e^(−λH)` for Poisson arrivals at the long-run rate `λ`. It
//!    scales to zero only when the idle cost is the larger. For small `λ`
//!    this is the ski-rental break-even `λ < price / (miss_cost + price·H)`:
//!    scale to zero when requests are rarer than the warm replica's cost can
//!    justify.
//!
//! Not in this first slice: vertical moves between GPU classes, spot versus
//! on-demand by tier, schedules and events. Costs here are `f64` estimates
//! for a decision, never billed amounts (billing uses decimal money).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::observe::Observation;
use crate::policy::{ceil_u32, nonzero_ms, positive, Bounds, Decision, Monotonic, Policy, Reason};
use crate::ScaleError;

/// How long a new replica takes to serve on one GPU type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColdStart {
    /// Getting a node (zero when one is free).
    pub provision_ms: u64,
    /// Pulling the image.
    pub pull_ms: u64,
    /// Loading the weights onto the GPU.
    pub load_ms: u64,
}

impl ColdStart {
    /// The whole cold start.
    pub fn total_ms(&self) -> u64 {
        self.provision_ms
            .saturating_add(self.pull_ms)
            .saturating_add(self.load_ms)
    }
}

/// What one replica can do on the GPU type it runs on.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ServiceModel {
    /// Requests per second one replica completes at its maximum concurrency
    /// (`μ`).
    pub service_rate: f64,
    /// Requests one replica serves at once (`C`).
    pub max_concurrency: u32,
}

/// Flotilla policy configuration. [`FlotillaConfig::new`] fills defaults;
/// the cold start and service model are per GPU type, so the caller passes
/// those of the type the endpoint runs on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlotillaConfig {
    /// Cold start on this GPU type.
    pub cold_start: ColdStart,
    /// Service model on this GPU type.
    pub service: ServiceModel,
    /// The endpoint's latency objective (time to first token), in ms.
    pub slo_ms: f64,
    /// Decision cadence (default 1 s; estimates update on every call).
    pub tick_ms: u64,
    /// Time constant of the rate level (default 30 s).
    pub level_time_constant_ms: u64,
    /// Time constant of the rate trend (default 120 s).
    pub trend_time_constant_ms: u64,
    /// Time constant of the long-run rate used for scale to zero (default
    /// 600 s).
    pub long_time_constant_ms: u64,
    /// Window over which the peak concurrency is kept (default 300 s).
    pub peak_window_ms: u64,
    /// Square-root staffing factor `β` (default 1.0; 0 disables headroom).
    pub headroom_beta: f64,
    /// GPUs one replica holds (default 1).
    pub gpus_per_replica: u32,
    /// Price of one GPU-hour, in the operator's currency (default 2.5).
    pub gpu_price_per_hour: f64,
    /// Cost the operator assigns to one request missing its SLO because of
    /// a cold start, same currency (default 0.1).
    pub miss_cost: f64,
    /// Quiet time before scale to zero is considered (default 60 s).
    pub min_idle_ms: u64,
    /// Price of holding one replica at a level for an hour when that is not
    /// its GPUs (`None`, the default: `gpus × gpu_price_per_hour`). The
    /// tiered policy sets it to the host memory a parked replica occupies,
    /// so the same trade-off decides how many replicas stay parked.
    #[serde(default)]
    pub hold_price_per_hour: Option<f64>,
    /// How long a queued request may wait for a slot of the ready replicas
    /// before the queue counts as demand, ms (default 0: every queued
    /// request is demand at once). The tiered policy sets the part of the
    /// SLO a restore leaves over: a short queue that the ready replicas
    /// clear within it costs no miss, and a replica added for it would idle
    /// once the queue is gone.
    #[serde(default)]
    pub queue_tolerance_ms: u64,
    /// Whether a backlog that the last decision does not cover is acted
    /// on when it is seen, between decisions (default true). A caller that
    /// decides more often than `tick_ms` (the server, woken by the gateway
    /// whenever a queue forms) then starts replicas for it at once. The
    /// tiered policy's standby side turns it off: it sizes what stays
    /// parked over a cold start, and its warm side already meets queues
    /// every quarter restore.
    #[serde(default = "yes")]
    pub backlog_between_ticks: bool,
}

fn yes() -> bool {
    true
}

impl FlotillaConfig {
    /// Defaults around the endpoint's cold start, service model and SLO.
    pub fn new(cold_start: ColdStart, service: ServiceModel, slo_ms: f64) -> Self {
        Self {
            cold_start,
            service,
            slo_ms,
            tick_ms: 1_000,
            level_time_constant_ms: 30_000,
            trend_time_constant_ms: 120_000,
            long_time_constant_ms: 600_000,
            peak_window_ms: 300_000,
            headroom_beta: 1.0,
            gpus_per_replica: 1,
            gpu_price_per_hour: 2.5,
            miss_cost: 0.1,
            min_idle_ms: 60_000,
            hold_price_per_hour: None,
            queue_tolerance_ms: 0,
            backlog_between_ticks: true,
        }
    }

    /// Of `queued` requests, those the `ready` replicas do not clear within
    /// [`FlotillaConfig::queue_tolerance_ms`] (slots free at the service
    /// rate of each ready replica while all are busy).
    pub fn excess_queue(&self, queued: u32, ready: u32) -> f64 {
        let cleared =
            self.queue_tolerance_ms as f64 / 1000.0 * f64::from(ready) * self.service.service_rate;
        (f64::from(queued) - cleared.floor()).max(0.0)
    }

    fn validate(&self) -> Result<(), ScaleError> {
        positive("service.service_rate", self.service.service_rate)?;
        if self.service.max_concurrency == 0 {
            return Err(ScaleError::InvalidConfig {
                field: "service.max_concurrency",
                reason: "must be at least 1",
            });
        }
        positive("slo_ms", self.slo_ms)?;
        nonzero_ms("tick_ms", self.tick_ms)?;
        nonzero_ms("level_time_constant_ms", self.level_time_constant_ms)?;
        nonzero_ms("trend_time_constant_ms", self.trend_time_constant_ms)?;
        nonzero_ms("long_time_constant_ms", self.long_time_constant_ms)?;
        nonzero_ms("peak_window_ms", self.peak_window_ms)?;
        for (field, x) in [
            ("headroom_beta", self.headroom_beta),
            ("gpu_price_per_hour", self.gpu_price_per_hour),
            ("miss_cost", self.miss_cost),
            (
                "hold_price_per_hour",
                self.hold_price_per_hour.unwrap_or(0.0),
            ),
        ] {
            if !(x.is_finite() && x >= 0.0) {
                return Err(ScaleError::InvalidConfig {
                    field,
                    reason: "must be finite and not negative",
                });
            }
        }
        Ok(())
    }

    /// Step 6's two sides for a long-run arrival rate `rate` (requests per
    /// second): `(idle cost of one warm replica over the cold-start
    /// horizon, expected penalty of being cold over it)`. Scale to zero
    /// only when the first is larger. The idle side is priced at
    /// [`FlotillaConfig::hold_price_per_hour`] when set; the cold start a
    /// miss costs always burns GPU time.
    pub fn zero_tradeoff(&self, rate: f64) -> (f64, f64) {
        let h = self.cold_start.total_ms() as f64 / 1000.0;
        let price_s = f64::from(self.gpus_per_replica) * self.gpu_price_per_hour / 3600.0;
        let hold_s = self.hold_price_per_hour.map_or(price_s, |p| p / 3600.0);
        let lambda = if rate.is_finite() && rate > 0.0 {
            rate
        } else {
            0.0
        };
        let idle = hold_s * h;
        let p = 1.0 - (-lambda * h).exp();
        let penalty = p * (self.miss_cost * (1.0 + lambda * h) + price_s * h);
        (idle, penalty)
    }

    /// Width of a peak bucket: one SLO, within 1 s ..= 60 s.
    fn bucket_ms(&self) -> u64 {
        (self.slo_ms as u64).clamp(1_000, 60_000)
    }
}

/// Flotilla's policy state: the rate estimators, recent per-bucket arrival
/// counts and the last time traffic was seen.
#[derive(Debug, Clone)]
pub struct Flotilla {
    cfg: FlotillaConfig,
    bounds: Bounds,
    clock: Monotonic,
    /// Counter and time of the last rate sample.
    last_sample: Option<(u64, u64)>,
    /// Counter value already put into buckets.
    counted: Option<u64>,
    /// Rate level and trend (requests/s, requests/s²).
    level: f64,
    trend: f64,
    /// Long-run rate (requests/s).
    long_rate: f64,
    buckets: VecDeque<(u64, u64)>,
    last_traffic_ms: Option<u64>,
    last_tick_ms: Option<u64>,
    last: Option<Decision>,
    /// Sliding maximum of the observed concurrency (in flight + queued)
    /// over the peak window: a monotone deque of `(time, concurrency)`.
    peak_demand: VecDeque<(u64, f64)>,
    /// Per replica level `j` (index `j − 1`): the long-run rate (per
    /// second) at which demand climbs back to `j` replicas or more after at
    /// least one cold start below, and since when it has been below (`None`
    /// while at or above).
    level_rate: Vec<f64>,
    level_down_since: Vec<Option<u64>>,
    /// When `level_rate` was last decayed.
    level_at_ms: Option<u64>,
}

impl Flotilla {
    /// The policy within `bounds`.
    pub fn new(cfg: FlotillaConfig, bounds: Bounds) -> Result<Self, ScaleError> {
        cfg.validate()?;
        Ok(Self {
            cfg,
            bounds,
            clock: Monotonic::default(),
            last_sample: None,
            counted: None,
            level: 0.0,
            trend: 0.0,
            long_rate: 0.0,
            buckets: VecDeque::new(),
            last_traffic_ms: None,
            last_tick_ms: None,
            last: None,
            peak_demand: VecDeque::new(),
            level_rate: Vec::new(),
            level_down_since: Vec::new(),
            level_at_ms: None,
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &FlotillaConfig {
        &self.cfg
    }

    /// Change [`FlotillaConfig::queue_tolerance_ms`]: the tiered policy
    /// sets it before each decision from what it has measured.
    pub fn set_queue_tolerance_ms(&mut self, ms: u64) {
        self.cfg.queue_tolerance_ms = ms;
    }

    /// Fold the observation into the estimators.
    fn observe(&mut self, now: u64, obs: &Observation) {
        let total = obs.requests_total;

        // Peak buckets: every arrival counted once, whatever the cadence.
        let new = match self.counted {
            Some(c) if total >= c => total - c,
            _ => 0, // first sight or counter reset
        };
        self.counted = Some(total);
        let bucket_ms = self.cfg.bucket_ms();
        let idx = now / bucket_ms;
        if new > 0 {
            match self.buckets.back_mut() {
                Some((i, n)) if *i >= idx => *n = n.saturating_add(new),
                _ => self.buckets.push_back((idx, new)),
            }
        }
        let oldest = now.saturating_sub(self.cfg.peak_window_ms) / bucket_ms;
        while self.buckets.front().is_some_and(|(i, _)| *i < oldest) {
            self.buckets.pop_front();
        }
        let hold_s = f64::from(self.cfg.service.max_concurrency) / self.cfg.service.service_rate;
        let drain = (hold_s * 1000.0 / self.cfg.slo_ms).min(1.0);
        let demand =
            f64::from(obs.in_flight) + self.cfg.excess_queue(obs.queued, obs.ready) * drain;
        self.count_level_climbs(now, demand);
        while self.peak_demand.back().is_some_and(|(_, d)| *d <= demand) {
            self.peak_demand.pop_back();
        }
        self.peak_demand.push_back((now, demand));
        while self
            .peak_demand
            .front()
            .is_some_and(|(t, _)| now.saturating_sub(*t) > self.cfg.peak_window_ms)
        {
            self.peak_demand.pop_front();
        }
        if new > 0 || obs.concurrency() > 0.0 || self.last_traffic_ms.is_none() {
            self.last_traffic_ms = Some(now);
        }

        // Rate estimators, sampled whenever time has passed.
        match self.last_sample {
            None => self.last_sample = Some((now, total)),
            Some((_, n0)) if total < n0 => self.last_sample = Some((now, total)),
            Some((t0, n0)) if now > t0 => {
                let dt = (now - t0) as f64 / 1000.0;
                let x = (total - n0) as f64 / dt;
                let a = 1.0 - (-dt * 1000.0 / self.cfg.level_time_constant_ms as f64).exp();
                let b = 1.0 - (-dt * 1000.0 / self.cfg.trend_time_constant_ms as f64).exp();
                let c = 1.0 - (-dt * 1000.0 / self.cfg.long_time_constant_ms as f64).exp();
                let predicted = (self.level + self.trend * dt).max(0.0);
                let level = predicted + a * (x - predicted);
                self.trend += b * ((level - self.level) / dt - self.trend);
                self.level = level.max(0.0);
                self.long_rate += c * (x - self.long_rate);
                self.last_sample = Some((now, total));
            }
            Some(_) => {}
        }
    }

    /// Step 4's bookkeeping: decay every level's climb rate to `now`, then
    /// count a climb for each level `demand` reaches after one cold start or
    /// more below it. Shorter dips are noise the peak window already covers:
    /// only a lull a replica could have been stopped and restarted across
    /// is a lull the level survives.
    fn count_level_climbs(&mut self, now: u64, demand: f64) {
        let tau_s = self.cfg.long_time_constant_ms as f64 / 1000.0;
        if let Some(t0) = self.level_at_ms {
            let keep = (-(now.saturating_sub(t0) as f64 / 1000.0) / tau_s).exp();
            for r in &mut self.level_rate {
                *r *= keep;
            }
        }
        self.level_at_ms = Some(now);
        let c = f64::from(self.cfg.service.max_concurrency);
        let level = ceil_u32(demand / c).min(self.bounds.max()) as usize;
        if level > self.level_rate.len() {
            self.level_rate.resize(level, 0.0);
            // A level never reached before was below since the start.
            self.level_down_since.resize(level, Some(0));
        }
        let h = self.cfg.slo_ms as u64;
        for (j, (rate, down)) in self
            .level_rate
            .iter_mut()
            .zip(self.level_down_since.iter_mut())
            .enumerate()
        {
            if j < level {
                if down.is_some_and(|since| now.saturating_sub(since) >= h) {
                    *rate += 1.0 / tau_s;
                }
                *down = None;
            } else if down.is_none() {
                *down = Some(now);
            }
        }
    }

    /// Step 4: the highest replica level worth keeping through a lull —
    /// the highest `j` whose climbs recur often enough that, over one cold
    /// start, the expected penalty of having let it go exceeds its idle
    /// cost (the scale-to-zero trade-off, per level).
    pub fn recurring_level(&self) -> u32 {
        self.level_rate
            .iter()
            .rposition(|&rate| {
                let (idle, penalty) = self.cfg.zero_tradeoff(rate);
                penalty > idle
            })
            .map_or(0, |i| u32::try_from(i + 1).unwrap_or(u32::MAX))
    }

    /// Peak arrival rate over the recent window, per second, averaged over
    /// SLO-long buckets.
    pub fn peak_rate(&self) -> f64 {
        let secs = self.cfg.bucket_ms() as f64 / 1000.0;
        self.buckets
            .iter()
            .map(|(_, n)| *n as f64 / secs)
            .fold(0.0, f64::max)
    }

    /// The highest concurrency (in flight + queued, in slots) observed over
    /// the peak window.
    pub fn peak_demand(&self) -> f64 {
        self.peak_demand.front().map_or(0.0, |(_, d)| *d)
    }

    /// The smoothed arrival rate extrapolated one cold start ahead, in
    /// requests per second (the trend term at most doubles the level).
    pub fn forecast_rate(&self) -> f64 {
        let h = self.cfg.cold_start.total_ms() as f64 / 1000.0;
        let ahead = (self.level + self.trend.max(0.0) * h).min(2.0 * self.level);
        ahead.max(self.level)
    }

    /// Step 5: replicas the requests in flight and waiting need now.
    fn backlog_need(&self, obs: &Observation) -> u32 {
        let svc = self.cfg.service;
        let c = f64::from(svc.max_concurrency);
        let hold_s = c / svc.service_rate;
        let horizon_s = (self.cfg.cold_start.total_ms() as f64 / 1000.0).max(1.0);
        let queued = self.cfg.excess_queue(obs.queued, obs.ready);
        ceil_u32(f64::from(obs.in_flight) / c).saturating_add(if queued > 0.0 {
            ceil_u32(queued * hold_s / (c * horizon_s)).max(1)
        } else {
            0
        })
    }

    fn tick(&mut self, now: u64, obs: &Observation) -> Decision {
        let svc = self.cfg.service;
        let c = f64::from(svc.max_concurrency);
        // Seconds one request holds a slot.
        let hold_s = c / svc.service_rate;
        let load = self.forecast_rate() * hold_s;
        let by_rate = if load > 0.0 {
            ceil_u32((load + self.cfg.headroom_beta * load.sqrt()) / c)
        } else {
            0
        }
        .max(ceil_u32(self.peak_demand() / c))
        .max(self.recurring_level());
        let by_backlog = self.backlog_need(obs);
        let (mut need, mut reason) = if by_backlog > by_rate {
            (by_backlog, Reason::Backlog)
        } else {
            (by_rate, Reason::Forecast)
        };

        if need <= 1 && self.bounds.allows_zero() && obs.concurrency() <= 0.0 {
            let quiet_for = now.saturating_sub(self.last_traffic_ms.unwrap_or(now));
            if quiet_for < self.cfg.min_idle_ms {
                if need == 1 || obs.current() > 0 {
                    (need, reason) = (1, Reason::RecentTraffic);
                }
            } else {
                let (idle, penalty) = self.cfg.zero_tradeoff(self.long_rate);
                (need, reason) = if idle > penalty {
                    (0, Reason::ScaledToZero)
                } else {
                    (1, Reason::KeepWarm)
                };
            }
        }
        self.bounds.apply(Decision::new(need, reason))
    }
}

impl Policy for Flotilla {
    fn name(&self) -> &'static str {
        "flotilla"
    }

    fn bounds(&self) -> Bounds {
        self.bounds
    }

    fn interval_ms(&self) -> u64 {
        self.cfg.tick_ms
    }

    fn decide(&mut self, now_ms: u64, obs: &Observation) -> Decision {
        let now = self.clock.advance(now_ms);
        self.observe(now, obs);
        if let (Some(t), Some(last)) = (self.last_tick_ms, self.last) {
            // Between decisions, a backlog the last decision does not
            // cover is acted on at once: the server calls this whenever
            // the gateway reports a queue forming, and waiting for the
            // cadence would add up to a second to every request queued
            // meanwhile (a simulator deciding on the cadence never gets
            // here). Scale-down and the forecast keep the cadence.
            if now.saturating_sub(t) < self.cfg.tick_ms
                && !(self.cfg.backlog_between_ticks
                    && self.bounds.clamp(self.backlog_need(obs)) > last.replicas)
            {
                return Decision::new(last.replicas, Reason::NotDue);
            }
        }
        let d = self.tick(now, obs);
        self.last_tick_ms = Some(now);
        self.last = Some(d);
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> FlotillaConfig {
        FlotillaConfig::new(
            ColdStart {
                provision_ms: 0,
                pull_ms: 10_000,
                load_ms: 50_000,
            },
            ServiceModel {
                service_rate: 2.0,
                max_concurrency: 8,
            },
            2_000.0,
        )
    }

    fn at(total: u64) -> Observation {
        Observation {
            ready: 1,
            requests_total: total,
            ..Observation::default()
        }
    }

    #[test]
    fn a_queue_the_ready_replicas_clear_in_time_is_not_demand() {
        let mut c = cfg();
        c.headroom_beta = 0.0;
        let busy = |queued| Observation {
            ready: 4,
            in_flight: 32, // every slot of the 4 replicas busy
            queued,
            requests_total: 0,
            ..Observation::default()
        };
        // Without a tolerance any queue is a replica more.
        let mut f = Flotilla::new(c.clone(), Bounds::new(0, 100).unwrap()).unwrap();
        assert_eq!(f.decide(0, &busy(3)).replicas, 5);
        // 4 replicas free 4 × 2 = 8 slots a second: within 1 s they clear
        // 8 queued requests, so 8 wait and the ninth is demand.
        c.queue_tolerance_ms = 1_000;
        assert_eq!(c.excess_queue(8, 4), 0.0);
        assert_eq!(c.excess_queue(9, 4), 1.0);
        assert_eq!(c.excess_queue(9, 0), 9.0, "no ready replica clears nothing");
        let mut f = Flotilla::new(c.clone(), Bounds::new(0, 100).unwrap()).unwrap();
        assert_eq!(f.decide(0, &busy(8)).replicas, 4);
        // 40 queued: 32 beyond the tolerance are 4 replicas' slots more.
        let mut f = Flotilla::new(c, Bounds::new(0, 100).unwrap()).unwrap();
        assert_eq!(f.decide(0, &busy(40)).replicas, 8);
    }

    #[test]
    fn a_queue_forming_between_decisions_is_met_at_once() {
        let mut c = cfg();
        c.headroom_beta = 0.0;
        let mut f = Flotilla::new(c, Bounds::new(0, 100).unwrap()).unwrap();
        let obs = |in_flight, queued| Observation {
            ready: 1,
            in_flight,
            queued,
            requests_total: 10,
            ..Observation::default()
        };
        assert_eq!(f.decide(0, &obs(8, 0)).replicas, 1);
        // Within the cadence, nothing new: the last decision stands.
        assert_eq!(f.decide(300, &obs(8, 0)), Decision::new(1, Reason::NotDue));
        // A queue behind the busy replica cannot wait for the next tick.
        let d = f.decide(400, &obs(8, 1));
        assert_eq!(d.replicas, 2, "{d:?}");
        assert_ne!(d.reason, Reason::NotDue);
        // Covered now: the cadence holds again, also for scaling down.
        assert_eq!(f.decide(600, &obs(8, 1)).reason, Reason::NotDue);
        assert_eq!(f.decide(700, &obs(0, 0)).reason, Reason::NotDue);
    }

    #[test]
    fn steady_load_gets_square_root_headroom() {
        let mut f = Flotilla::new(cfg(), Bounds::new(0, 100).unwrap()).unwrap();
        let mut d = Decision::new(0, Reason::NotDue);
        for s in 0..=600u64 {
            d = f.decide(s * 1000, &at(20 * s));
        }
        // 20 r/s, each holding one of 8 slots for 8 / 2 = 4 s: a = 80
        // busy slots, + √80 headroom = 88.9 slots → 12 replicas.
        assert_eq!(d, Decision::new(12, Reason::Forecast));
    }

    #[test]
    fn scales_ahead_of_a_ramp() {
        // λ(t) = 1 + 0.05 t r/s; one cold start is 60 s.
        let mut c = cfg();
        c.headroom_beta = 0.0;
        let mut f = Flotilla::new(c, Bounds::new(0, 1000).unwrap()).unwrap();
        let lambda = |t: f64| 1.0 + 0.05 * t;
        for s in 0..=600u64 {
            let t = s as f64;
            let total = (t + 0.025 * t * t).floor() as u64;
            let d = f.decide(s * 1000, &at(total));
            if s >= 300 {
                let later = lambda(t + 60.0);
                // Provisioned now for the rate one cold start ahead ...
                assert!(
                    f.forecast_rate() >= 0.95 * later,
                    "at {s} s: {} < {later}",
                    f.forecast_rate()
                );
                assert!(
                    d.replicas >= ceil_u32(0.95 * later / 2.0),
                    "at {s} s: {d:?}"
                );
                // ... which the current rate alone would not cover.
                assert!(lambda(t) < 0.95 * later);
            }
        }
    }

    #[test]
    fn keeps_capacity_for_the_recent_peak_concurrency() {
        let mut f = Flotilla::new(cfg(), Bounds::new(0, 100).unwrap()).unwrap();
        let busy = Observation {
            ready: 10,
            in_flight: 80,
            requests_total: 0,
            ..Observation::default()
        };
        assert_eq!(f.decide(0, &busy).replicas, 10);
        // Quiet afterwards: the 80 slots of the peak are kept for the
        // peak window (300 s), then released.
        let quiet = Observation {
            ready: 10,
            ..Observation::default()
        };
        assert_eq!(f.decide(299_000, &quiet).replicas, 10);
        assert!(f.decide(301_000, &quiet).replicas <= 1);
    }

    #[test]
    fn backlog_from_zero_scales_at_once() {
        let mut f = Flotilla::new(cfg(), Bounds::new(0, 100).unwrap()).unwrap();
        let o = Observation {
            queued: 20,
            requests_total: 20,
            ..Observation::default()
        };
        // 20 waiting are worked off over one cold start: one replica now
        // (the peak concurrency of 20 asks for 3 of 8 slots).
        assert_eq!(f.decide(0, &o).replicas, 3);
    }

    #[test]
    fn never_below_min() {
        let mut f = Flotilla::new(cfg(), Bounds::new(3, 100).unwrap()).unwrap();
        for s in 0..7200u64 {
            assert!(f.decide(s * 1000, &at(0)).replicas >= 3);
        }
    }

    /// One request every `gap` seconds for an hour, then ten minutes of
    /// silence; returns the decision of every second.
    fn sparse_then_quiet(c: FlotillaConfig, gap: u64) -> Vec<Decision> {
        let mut f = Flotilla::new(c, Bounds::new(0, 100).unwrap()).unwrap();
        let mut total = 0;
        (0..4200u64)
            .map(|s| {
                if s < 3600 && s % gap == 0 {
                    total += 1;
                }
                f.decide(s * 1000, &at(total))
            })
            .collect()
    }

    #[test]
    fn scales_to_zero_when_idle_cost_wins() {
        // One request per 10 min: λ ≈ 0.0017 r/s, below the break-even
        // price / (miss + price·H) ≈ 0.00069 / 0.142 ≈ 0.0049 r/s.
        let c = cfg();
        let (idle, penalty) = c.zero_tradeoff(1.0 / 600.0);
        assert!(idle > penalty);
        let ds = sparse_then_quiet(c, 600);
        // Warm for the minimum idle time after the 3000 s request ...
        assert!(ds[3000..3060].iter().all(|d| d.replicas == 1));
        // ... then zero until the next one.
        assert_eq!(ds[3100], Decision::new(0, Reason::ScaledToZero));
        assert!(ds[3100..3600].iter().all(|d| d.replicas == 0));
        assert_eq!(ds.last().map(|d| d.replicas), Some(0));
    }

    #[test]
    fn keeps_warm_when_penalty_wins() {
        // One request per 30 s: λ ≈ 0.033 r/s, above the break-even.
        let c = cfg();
        let (idle, penalty) = c.zero_tradeoff(1.0 / 30.0);
        assert!(penalty > idle);
        let ds = sparse_then_quiet(c, 30);
        assert!(ds[60..].iter().all(|d| d.replicas == 1));
        assert_eq!(ds[3700].reason, Reason::KeepWarm);
    }

    #[test]
    fn free_misses_make_zero_the_right_call() {
        // Same busy traffic, but the operator prices a miss at zero: idle
        // cost always wins once traffic stops.
        let mut c = cfg();
        c.miss_cost = 0.0;
        let ds = sparse_then_quiet(c, 30);
        assert_eq!(ds.last().map(|d| d.replicas), Some(0));
    }

    #[test]
    fn a_queue_of_short_requests_counts_by_its_share_of_the_slo() {
        // Requests hold a slot 8 / 16 = 0.5 s; SLO 2 s: each queued one
        // needs a quarter of a slot to start in time. 256 queued = 64
        // slots = 8 replicas (counted whole they would ask for 32).
        let mut c = cfg();
        c.service.service_rate = 16.0;
        let mut f = Flotilla::new(c, Bounds::new(0, 100).unwrap()).unwrap();
        let o = Observation {
            queued: 256,
            requests_total: 256,
            ..Observation::default()
        };
        assert_eq!(f.decide(0, &o).replicas, 8);
    }

    #[test]
    fn recurring_bursts_keep_their_level_through_the_lull() {
        // A burst needing 5 replicas every 120 s: past the 300 s peak
        // window the level still recurs often enough to keep.
        let mut f = Flotilla::new(cfg(), Bounds::new(0, 100).unwrap()).unwrap();
        let burst = |total| Observation {
            ready: 5,
            in_flight: 40,
            requests_total: total,
            ..Observation::default()
        };
        let quiet = |total| Observation {
            ready: 5,
            requests_total: total,
            ..Observation::default()
        };
        let mut total = 0;
        for s in 0..1_800u64 {
            let o = if s % 120 < 10 {
                total += 4;
                burst(total)
            } else {
                quiet(total)
            };
            f.decide(s * 1000, &o);
        }
        assert!(f.recurring_level() >= 5, "{}", f.recurring_level());
        // Silence: the level decays and goes after the break-even.
        let mut last = 5;
        for s in 1_800..6_000u64 {
            last = f.decide(s * 1000, &quiet(total)).replicas;
        }
        assert!(last <= 1, "{last}");
        // A single burst long ago is not a pattern.
        let mut g = Flotilla::new(cfg(), Bounds::new(0, 100).unwrap()).unwrap();
        g.decide(0, &burst(40));
        for s in 1..400u64 {
            g.decide(s * 1000, &quiet(40));
        }
        assert_eq!(g.recurring_level(), 0);
    }
}
