//! Ray Serve's default autoscaling policy, re-implemented from its
//! documented configuration and behaviour.
//!
//! Sources: Ray docs "Ray Serve Autoscaling" and "Advanced Ray Serve
//! Autoscaling" (docs.ray.io/en/latest/serve/autoscaling-guide.html,
//! .../advanced-guides/advanced-autoscaling.html) and the
//! `ray.serve.config.AutoscalingConfig` reference. Defaults:
//! `target_ongoing_requests` 2 (since Ray 2.32; 1 before),
//! `upscale_delay_s` 30, `downscale_delay_s` 600, `downscale_to_zero_delay_s`
//! unset (falls back to `downscale_delay_s`), `upscaling_factor` and
//! `downscaling_factor` unset (the smoothing factor, 1.0),
//! `look_back_period_s` 30; the controller loop runs every 0.1 s.
//!
//! Algorithm (the default queue-length policy):
//!
//! 1. `ongoing` = average over the look-back period of requests running on
//!    replicas plus those queued at handles;
//! 2. `error_ratio = (ongoing / running_replicas) / target_ongoing_requests`;
//!    the distance from 1 is multiplied by the upscaling or downscaling
//!    factor: `desired = ceil(running × (1 + (error_ratio − 1) × factor))`,
//!    and if the factor alone keeps a downscale stuck at the current count,
//!    one replica less;
//! 3. the new target is applied only once the controller has decided the
//!    same direction on every loop for the upscale (or downscale) delay;
//!    it then jumps to the latest desired count, and the count restarts;
//! 4. at zero running replicas, any ongoing request scales to
//!    `max(ceil(1 × upscaling_factor), target)` at once.
//!
//! Ray counts consecutive 0.1 s loops; here the same rule is expressed in
//! time (the direction has held for at least the delay), so the policy is
//! faithful at any call cadence. The replicas Ray's target counts as
//! "running" are the ready ones.

use serde::{Deserialize, Serialize};

use crate::observe::{Observation, WindowAverage};
use crate::policy::{ceil_u32, nonzero_ms, positive, Bounds, Decision, Monotonic, Policy, Reason};
use crate::ScaleError;

/// Ray Serve `autoscaling_config`; `Default` gives Ray's defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RayServeConfig {
    /// Ongoing requests per replica to aim for (2).
    pub target_ongoing_requests: f64,
    /// How long an upscale decision must hold (30 s).
    pub upscale_delay_ms: u64,
    /// How long a downscale decision must hold (600 s).
    pub downscale_delay_ms: u64,
    /// How long a 1 → 0 decision must hold; `None` uses the downscale delay.
    pub downscale_to_zero_delay_ms: Option<u64>,
    /// Gain on upscale error (1.0).
    pub upscaling_factor: f64,
    /// Gain on downscale error (1.0).
    pub downscaling_factor: f64,
    /// Averaging period of the ongoing-request metric (30 s).
    pub look_back_period_ms: u64,
    /// Controller loop period (100 ms).
    pub control_loop_interval_ms: u64,
}

impl Default for RayServeConfig {
    fn default() -> Self {
        Self {
            target_ongoing_requests: 2.0,
            upscale_delay_ms: 30_000,
            downscale_delay_ms: 600_000,
            downscale_to_zero_delay_ms: None,
            upscaling_factor: 1.0,
            downscaling_factor: 1.0,
            look_back_period_ms: 30_000,
            control_loop_interval_ms: 100,
        }
    }
}

/// Which way a pending decision points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Up,
    Down,
}

/// The Ray Serve controller's autoscaling state for one deployment: its
/// target, the metric window and the pending decision (Ray's decision
/// counter).
#[derive(Debug, Clone)]
pub struct RayServe {
    cfg: RayServeConfig,
    bounds: Bounds,
    clock: Monotonic,
    ongoing: WindowAverage,
    target: Option<u32>,
    pending: Option<(Direction, u64)>,
}

impl RayServe {
    /// A deployment autoscaled within `bounds`.
    pub fn new(cfg: RayServeConfig, bounds: Bounds) -> Result<Self, ScaleError> {
        positive("target_ongoing_requests", cfg.target_ongoing_requests)?;
        positive("upscaling_factor", cfg.upscaling_factor)?;
        positive("downscaling_factor", cfg.downscaling_factor)?;
        nonzero_ms("look_back_period_ms", cfg.look_back_period_ms)?;
        nonzero_ms("control_loop_interval_ms", cfg.control_loop_interval_ms)?;
        // Ray reports metrics every few seconds; one-second buckets keep the
        // window small however often the caller samples.
        let ongoing = WindowAverage::new(cfg.look_back_period_ms, 1_000);
        Ok(Self {
            cfg,
            bounds,
            clock: Monotonic::default(),
            ongoing,
            target: None,
            pending: None,
        })
    }

    /// Step 2: the smoothed desired count for `ongoing` requests over
    /// `running` replicas.
    fn desired(&self, ongoing: f64, running: u32) -> u32 {
        let running_f = f64::from(running);
        let error = (ongoing / running_f) / self.cfg.target_ongoing_requests;
        let factor = if error >= 1.0 {
            self.cfg.upscaling_factor
        } else {
            self.cfg.downscaling_factor
        };
        let smoothed = 1.0 + (error - 1.0) * factor;
        let mut desired = ceil_u32(running_f * smoothed);
        if ceil_u32(running_f * error) < running && desired == running {
            desired = running.saturating_sub(1);
        }
        self.bounds.clamp(desired)
    }
}

impl Policy for RayServe {
    fn name(&self) -> &'static str {
        "ray"
    }

    fn bounds(&self) -> Bounds {
        self.bounds
    }

    fn interval_ms(&self) -> u64 {
        self.cfg.control_loop_interval_ms
    }

    fn decide(&mut self, now_ms: u64, obs: &Observation) -> Decision {
        let now = self.clock.advance(now_ms);
        self.ongoing.record(now, obs.concurrency());
        let target = *self
            .target
            .get_or_insert_with(|| self.bounds.clamp(obs.current()));
        let ongoing = self.ongoing.average(now);

        if obs.ready == 0 {
            self.pending = None;
            if ongoing > 0.0 || obs.concurrency() > 0.0 {
                let n = self
                    .bounds
                    .clamp(ceil_u32(self.cfg.upscaling_factor).max(1).max(target));
                self.target = Some(n);
                return Decision::new(n, Reason::FromZero);
            }
            return self.bounds.apply(Decision::new(target, Reason::Metric));
        }

        let desired = self.desired(ongoing, obs.ready);
        let (direction, delay) = if desired > target {
            (Direction::Up, self.cfg.upscale_delay_ms)
        } else if desired < target {
            let delay = if target == 1 && desired == 0 {
                self.cfg
                    .downscale_to_zero_delay_ms
                    .unwrap_or(self.cfg.downscale_delay_ms)
            } else {
                self.cfg.downscale_delay_ms
            };
            (Direction::Down, delay)
        } else {
            self.pending = None;
            return self.bounds.apply(Decision::new(target, Reason::Metric));
        };

        let since = match self.pending {
            Some((d, t)) if d == direction => t,
            _ => {
                self.pending = Some((direction, now));
                now
            }
        };
        if now.saturating_sub(since) >= delay {
            self.pending = None;
            self.target = Some(desired);
            let reason = if desired == 0 {
                Reason::ScaledToZero
            } else {
                Reason::Metric
            };
            return Decision::new(desired, reason);
        }
        self.bounds
            .apply(Decision::new(target, Reason::DelayPending))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ray(min: u32) -> RayServe {
        RayServe::new(RayServeConfig::default(), Bounds::new(min, 100).unwrap()).unwrap()
    }

    fn obs(ready: u32, ongoing: u32) -> Observation {
        Observation {
            ready,
            in_flight: ongoing,
            ..Observation::default()
        }
    }

    /// Call every 100 ms over `[from, to)`, returning the time of the first
    /// decision that differs from `start`, if any.
    fn first_change(
        r: &mut RayServe,
        from: u64,
        to: u64,
        o: &Observation,
        start: u32,
    ) -> Option<(u64, u32)> {
        for t in (from..to).step_by(100) {
            let d = r.decide(t, o);
            if d.replicas != start {
                return Some((t, d.replicas));
            }
        }
        None
    }

    #[test]
    fn waits_upscale_delay() {
        let mut r = ray(1);
        // 2 replicas, 8 ongoing: 2 per replica wanted, so 4.
        let o = obs(2, 8);
        let (t, n) = first_change(&mut r, 0, 60_000, &o, 2).unwrap();
        assert_eq!((t, n), (30_000, 4));
    }

    #[test]
    fn waits_downscale_delay() {
        let mut r = ray(1);
        r.decide(0, &obs(4, 8));
        // Load drops to 2 ongoing on 4 replicas at 0.1 s: the decision to go
        // down starts then and must hold for 600 s; it then jumps to the
        // latest desired count, ceil(4 × (2 / 4) / 2) = 1.
        let change = first_change(&mut r, 100, 700_000, &obs(4, 2), 4);
        assert_eq!(change, Some((600_100, 1)));
    }

    #[test]
    fn interrupted_decision_restarts_the_delay() {
        let cfg = RayServeConfig {
            look_back_period_ms: 1_000,
            ..RayServeConfig::default()
        };
        let mut r = RayServe::new(cfg, Bounds::new(1, 100).unwrap()).unwrap();
        for t in (0..20_000).step_by(100) {
            assert_eq!(r.decide(t, &obs(2, 8)).replicas, 2);
        }
        // Back on target for 3 s: the pending upscale is forgotten.
        for t in (20_000..23_000).step_by(100) {
            assert_eq!(r.decide(t, &obs(2, 4)).replicas, 2);
        }
        // Up again from 23 s: a full 30 s more.
        let change = first_change(&mut r, 23_000, 90_000, &obs(2, 8), 2);
        assert_eq!(change, Some((53_000, 4)));
    }

    #[test]
    fn smoothing_factor_damps_the_step() {
        let cfg = RayServeConfig {
            upscaling_factor: 0.5,
            ..RayServeConfig::default()
        };
        let mut r = RayServe::new(cfg, Bounds::new(1, 100).unwrap()).unwrap();
        // error ratio 4 → 1 + 3 × 0.5 = 2.5 → ceil(2 × 2.5) = 5, not 8.
        let (_, n) = first_change(&mut r, 0, 60_000, &obs(2, 16), 2).unwrap();
        assert_eq!(n, 5);
    }

    #[test]
    fn from_zero_at_once() {
        let mut r = ray(0);
        let o = Observation {
            queued: 1,
            ..Observation::default()
        };
        assert_eq!(r.decide(0, &o), Decision::new(1, Reason::FromZero));
    }

    #[test]
    fn to_zero_waits_downscale_delay() {
        let mut r = ray(0);
        r.decide(0, &obs(1, 1));
        // Desired is ceil(error) = 1 while any request remains in the 30 s
        // look-back; it reaches 0 at 31 s (the 0 s bucket leaves), and the
        // 1 → 0 decision then holds for the 600 s downscale delay.
        let change = first_change(&mut r, 100, 1_000_000, &obs(1, 0), 1);
        assert_eq!(change, Some((631_000, 0)));
    }
}
