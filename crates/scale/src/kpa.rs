//! Knative Pod Autoscaler (KPA), re-implemented from Knative Serving's
//! documented algorithm and `config-autoscaler` defaults.
//!
//! Sources: Knative docs "Additional autoscaling configuration for Knative
//! Pod Autoscaler" (knative.dev/docs/serving/autoscaling/kpa-specific/),
//! "Configuring targets" and "Configuring scale to zero", and the
//! `config-autoscaler` ConfigMap defaults. Defaults:
//!
//! - metric: concurrency (requests in flight and queued in the pod's
//!   queue-proxy, or buffered by the activator at zero), target
//!   `container-concurrency-target-default` 100 × target utilisation 0.7;
//! - stable window 60 s; panic window 10 % of it (6 s); the autoscaler ticks
//!   every 2 s;
//! - `desired = ceil(window average concurrency / (target × utilisation))`,
//!   held within `[floor(ready / max-scale-down-rate),
//!   ceil(ready × max-scale-up-rate)]`, rates 2.0 and 1000.0, with
//!   `ready` counted as at least 1;
//! - panic when the panic-window desired count is ≥ 200 % of the ready
//!   replicas; while panicking the count never goes down (only up), and
//!   panic ends once the threshold has not been crossed for a whole stable
//!   window;
//! - scale to zero: the last replica goes only after no traffic for the
//!   whole stable window, and then after the 30 s
//!   `scale-to-zero-grace-period` during which the activator is put in the
//!   request path; until then it holds one replica.
//!
//! Simplified: the windows average samples taken at each `decide` call in
//! one-second buckets (Knative scrapes each pod about every second); the
//! activator's burst capacity, `scale-down-delay` (default 0) and
//! `activation-scale` (default 1) are not modelled.

use serde::{Deserialize, Serialize};

use crate::observe::{Observation, WindowAverage};
use crate::policy::{floor_u32, nonzero_ms, positive, Bounds, Decision, Monotonic, Policy, Reason};
use crate::ScaleError;

/// KPA configuration; `Default` gives Knative's defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KpaConfig {
    /// Concurrency one replica should handle (`containerConcurrency` or
    /// `container-concurrency-target-default`, 100).
    pub target_concurrency: f64,
    /// Fraction of the target to aim for (0.7).
    pub target_utilization: f64,
    /// Stable window (60 s).
    pub stable_window_ms: u64,
    /// Panic window as a percentage of the stable window (10 %).
    pub panic_window_pct: f64,
    /// Panic when the panic-window desired count reaches this percentage of
    /// the ready replicas (200 %).
    pub panic_threshold_pct: f64,
    /// At most this factor up per tick (1000).
    pub max_scale_up_rate: f64,
    /// At most this factor down per tick (2).
    pub max_scale_down_rate: f64,
    /// After deciding zero, wait this long before removing the last replica
    /// (30 s).
    pub scale_to_zero_grace_ms: u64,
    /// Decider tick (2 s).
    pub tick_ms: u64,
}

impl Default for KpaConfig {
    fn default() -> Self {
        Self {
            target_concurrency: 100.0,
            target_utilization: 0.7,
            stable_window_ms: 60_000,
            panic_window_pct: 10.0,
            panic_threshold_pct: 200.0,
            max_scale_up_rate: 1000.0,
            max_scale_down_rate: 2.0,
            scale_to_zero_grace_ms: 30_000,
            tick_ms: 2_000,
        }
    }
}

impl KpaConfig {
    fn validate(&self) -> Result<(), ScaleError> {
        positive("target_concurrency", self.target_concurrency)?;
        positive("target_utilization", self.target_utilization)?;
        positive("panic_window_pct", self.panic_window_pct)?;
        positive("panic_threshold_pct", self.panic_threshold_pct)?;
        positive("max_scale_up_rate", self.max_scale_up_rate)?;
        positive("max_scale_down_rate", self.max_scale_down_rate)?;
        nonzero_ms("stable_window_ms", self.stable_window_ms)?;
        nonzero_ms("tick_ms", self.tick_ms)
    }

    fn panic_window_ms(&self) -> u64 {
        let ms = self.stable_window_ms as f64 * self.panic_window_pct / 100.0;
        (ms as u64).max(1)
    }
}

/// Scrape granularity: Knative's one-second buckets.
const BUCKET_MS: u64 = 1_000;

/// The KPA decider for one revision: its two windows, panic state, the
/// last time traffic was seen and when it first decided zero.
#[derive(Debug, Clone)]
pub struct Kpa {
    cfg: KpaConfig,
    bounds: Bounds,
    clock: Monotonic,
    stable: WindowAverage,
    panic: WindowAverage,
    /// Last time the panic threshold was crossed while panicking; `None`
    /// when in stable mode.
    panic_time_ms: Option<u64>,
    max_panic_pods: u32,
    last_traffic_ms: Option<u64>,
    zero_since_ms: Option<u64>,
    last_tick_ms: Option<u64>,
    last: Option<Decision>,
}

impl Kpa {
    /// A KPA within `bounds`.
    pub fn new(cfg: KpaConfig, bounds: Bounds) -> Result<Self, ScaleError> {
        cfg.validate()?;
        let panic_ms = cfg.panic_window_ms();
        Ok(Self {
            stable: WindowAverage::new(cfg.stable_window_ms, BUCKET_MS),
            panic: WindowAverage::new(panic_ms, BUCKET_MS),
            cfg,
            bounds,
            clock: Monotonic::default(),
            panic_time_ms: None,
            max_panic_pods: 0,
            last_traffic_ms: None,
            zero_since_ms: None,
            last_tick_ms: None,
            last: None,
        })
    }

    /// Whether the autoscaler is in panic mode.
    pub fn in_panic(&self) -> bool {
        self.panic_time_ms.is_some()
    }

    fn tick(&mut self, now: u64, obs: &Observation) -> Decision {
        let cfg = &self.cfg;
        let target = cfg.target_concurrency * cfg.target_utilization;
        let ready = f64::from(obs.ready.max(1));
        let max_up = (cfg.max_scale_up_rate * ready).ceil();
        let max_down = (ready / cfg.max_scale_down_rate).floor();

        let dspc = (self.stable.average(now) / target).ceil();
        let dppc = (self.panic.average(now) / target).ceil();
        let stable_pods = floor_u32(dspc.max(max_down).min(max_up));
        let panic_pods = floor_u32(dppc.max(max_down).min(max_up));

        let over = dppc / ready >= cfg.panic_threshold_pct / 100.0;
        match self.panic_time_ms {
            _ if over => self.panic_time_ms = Some(now),
            // Knative un-panics once `panicTime + stableWindow` is strictly
            // before now.
            Some(t) if now.saturating_sub(t) > cfg.stable_window_ms => {
                self.panic_time_ms = None;
                self.max_panic_pods = 0;
            }
            _ => {}
        }

        let mut desired = stable_pods;
        let mut reason = Reason::Stable;
        if self.panic_time_ms.is_some() {
            // Provision for the larger of the two windows, never below the
            // panic high-water mark.
            desired = desired.max(panic_pods);
            self.max_panic_pods = self.max_panic_pods.max(desired);
            desired = self.max_panic_pods;
            reason = Reason::Panic;
        }

        // Scale to zero: only after a stable window without traffic, then
        // the grace period with one replica left.
        if desired == 0 {
            let quiet = self
                .last_traffic_ms
                .is_none_or(|t| now.saturating_sub(t) >= cfg.stable_window_ms);
            if !quiet {
                desired = 1;
            } else if obs.current() > 0 {
                let since = *self.zero_since_ms.get_or_insert(now);
                if now.saturating_sub(since) < cfg.scale_to_zero_grace_ms {
                    desired = 1;
                    reason = Reason::ZeroGrace;
                } else {
                    reason = Reason::ScaledToZero;
                }
            }
        } else {
            self.zero_since_ms = None;
        }
        self.bounds.apply(Decision::new(desired, reason))
    }
}

impl Policy for Kpa {
    fn name(&self) -> &'static str {
        "kpa"
    }

    fn bounds(&self) -> Bounds {
        self.bounds
    }

    fn interval_ms(&self) -> u64 {
        self.cfg.tick_ms
    }

    fn decide(&mut self, now_ms: u64, obs: &Observation) -> Decision {
        let now = self.clock.advance(now_ms);
        // Metrics are scraped on every call; decisions are made on ticks.
        let c = obs.concurrency();
        self.stable.record(now, c);
        self.panic.record(now, c);
        if c > 0.0 {
            self.last_traffic_ms = Some(now);
        } else if self.last_traffic_ms.is_none() {
            // A revision starts active: the quiet period counts from its
            // first observation, not from the dawn of time.
            self.last_traffic_ms = Some(now);
        }
        if let (Some(t), Some(last)) = (self.last_tick_ms, self.last) {
            if now.saturating_sub(t) < self.cfg.tick_ms {
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

    /// Target 10 per replica × 0.7 = 7, so numbers stay small.
    fn kpa(min: u32) -> Kpa {
        let cfg = KpaConfig {
            target_concurrency: 10.0,
            ..KpaConfig::default()
        };
        Kpa::new(cfg, Bounds::new(min, 1000).unwrap()).unwrap()
    }

    fn obs(ready: u32, concurrency: u32) -> Observation {
        Observation {
            ready,
            in_flight: concurrency,
            ..Observation::default()
        }
    }

    /// Feed `c` concurrency every second over `[from, to)` with `ready`
    /// replicas; return the last decision.
    fn run(k: &mut Kpa, from: u64, to: u64, ready: u32, c: u32) -> Decision {
        let mut last = Decision::new(0, Reason::NotDue);
        for t in (from..to).step_by(1_000) {
            last = k.decide(t, &obs(ready, c));
        }
        last
    }

    #[test]
    fn stable_mode_targets_seventy_percent() {
        let mut k = kpa(0);
        // 35 concurrent over a full window: ceil(35 / 7) = 5 (ready 4, no
        // panic: 5 / 4 < 2).
        let d = run(&mut k, 0, 61_000, 4, 35);
        assert_eq!(d.replicas, 5);
        assert!(!k.in_panic());
    }

    #[test]
    fn enters_panic_at_twice_ready() {
        let mut k = kpa(0);
        run(&mut k, 0, 60_000, 2, 14); // steady: 2 replicas
        assert!(!k.in_panic());
        // A burst: panic window desires ceil(28 / 7) = 4 = 2 × 2 ready.
        let d = run(&mut k, 60_000, 67_000, 2, 28);
        assert!(k.in_panic());
        assert_eq!(d, Decision::new(4, Reason::Panic));
    }

    #[test]
    fn below_twice_ready_is_no_panic() {
        let mut k = kpa(0);
        run(&mut k, 0, 60_000, 2, 14);
        // ceil(21 / 7) = 3 < 4: no panic.
        run(&mut k, 60_000, 67_000, 2, 21);
        assert!(!k.in_panic());
    }

    #[test]
    fn never_scales_down_while_panicking_and_exits_after_stable_window() {
        let mut k = kpa(0);
        run(&mut k, 0, 60_000, 2, 14);
        // Burst to 56: panic, up to ceil(56/7) = 8.
        let d = run(&mut k, 60_000, 70_000, 2, 56);
        assert!(k.in_panic());
        assert_eq!(d.replicas, 8);
        // Burst ends at 70 s; 8 ready replicas, little load. The threshold
        // was last crossed at the 68 s tick; panic lasts until a full stable
        // window after that (the 130 s tick), and the count never drops.
        let mut t = 70_000;
        let mut exited_at = None;
        while t < 200_000 {
            let d = k.decide(t, &obs(8, 7));
            if k.in_panic() {
                assert!(d.replicas >= 8, "scaled down in panic at {t} ms");
            } else if exited_at.is_none() {
                exited_at = Some(t);
            }
            t += 1_000;
        }
        let exited = exited_at.expect("panic never ended");
        assert_eq!(exited, 130_000, "exited at {exited}");
        // Back in stable mode it scales down (at most halving per tick).
        let d = k.decide(200_000, &obs(8, 7));
        assert!(d.replicas < 8);
    }

    #[test]
    fn scale_to_zero_after_window_and_grace() {
        let mut k = kpa(0);
        run(&mut k, 0, 10_000, 1, 3); // last traffic at 9 s
                                      // No traffic: zero is not allowed before 9 s + 60 s = 69 s.
        let mut t = 10_000;
        let mut zero_at = None;
        while t < 200_000 {
            let d = k.decide(t, &obs(1, 0));
            if d.replicas == 0 {
                zero_at = Some(t);
                assert_eq!(d.reason, Reason::ScaledToZero);
                break;
            }
            assert_eq!(d.replicas, 1, "at {t}");
            if t >= 70_000 {
                // The stable window no longer holds the 9 s traffic.
                assert!(
                    matches!(d.reason, Reason::ZeroGrace | Reason::NotDue),
                    "at {t}"
                );
            }
            t += 1_000;
        }
        // Decided zero at the 70 s tick, then 30 s of grace.
        assert_eq!(zero_at, Some(100_000));
    }

    #[test]
    fn traffic_during_grace_cancels_zero() {
        let mut k = kpa(0);
        run(&mut k, 0, 10_000, 1, 3);
        run(&mut k, 10_000, 80_000, 1, 0); // in grace
        let d = k.decide(80_000, &obs(1, 1));
        assert_eq!(d.replicas, 1);
        assert_eq!(run(&mut k, 81_000, 120_000, 1, 0).replicas, 1);
    }

    #[test]
    fn scales_from_zero_on_buffered_requests() {
        let mut k = kpa(0);
        let o = Observation {
            queued: 3,
            ..Observation::default()
        };
        assert!(k.decide(0, &o).replicas >= 1);
    }

    #[test]
    fn scale_down_at_most_halves_per_tick() {
        let mut k = kpa(1);
        run(&mut k, 0, 60_000, 10, 70);
        // Load vanishes: from 10 ready, at most down to 5.
        let d = run(&mut k, 60_000, 200_000, 10, 0);
        assert_eq!(d.replicas, 5);
    }
}
