//! KEDA (Kubernetes Event-driven Autoscaling) `ScaledObject`, re-implemented
//! from its documented behaviour.
//!
//! Source: KEDA docs, "ScaledObject specification" (keda.sh/docs/latest/
//! reference/scaledobject-spec/) and "Scaling Deployments" concepts page.
//! KEDA splits the work in two:
//!
//! - the KEDA operator polls each trigger every `pollingInterval` (default
//!   30 s); a trigger is *active* when its metric exceeds its
//!   `activationThreshold` (default 0). At zero replicas an active trigger
//!   scales the target to `max(minReplicaCount, 1)`; when no trigger has
//!   been active for `cooldownPeriod` (default 300 s) and
//!   `minReplicaCount` is 0, it scales the target from 1 to 0;
//! - between 1 and N replicas an HPA it creates does the work, reading the
//!   trigger as an `External` metric with an `AverageValue` target, so
//!   `desired = ceil(metric / target)` with the HPA's tolerance,
//!   stabilisation and rate limits (see [`crate::hpa`]).
//!
//! Simplified: one trigger (KEDA takes the largest over several, as the HPA
//! does); no `fallback`, `idleReplicaCount` or `initialCooldownPeriod`
//! (its default 0 is what this does); a trigger with no reading is inactive.

use serde::{Deserialize, Serialize};

use crate::hpa::{Hpa, HpaConfig, MetricTarget};
use crate::observe::{Observation, Signal};
use crate::policy::{nonzero_ms, positive, Bounds, Decision, Monotonic, Policy, Reason};
use crate::ScaleError;

/// KEDA configuration; [`KedaConfig::new`] fills KEDA's defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KedaConfig {
    /// The trigger's metric (a total over the endpoint).
    pub signal: Signal,
    /// Target value per replica (the trigger's `threshold`/`targetValue`).
    pub target: f64,
    /// Active when the metric is strictly above this (default 0).
    pub activation_threshold: f64,
    /// How often triggers are polled for activity (default 30 s).
    pub polling_interval_ms: u64,
    /// Inactivity before 1 → 0 (default 300 s).
    pub cooldown_period_ms: u64,
    /// The HPA KEDA creates for 1 ↔ N; its metric list is replaced by the
    /// trigger.
    pub hpa: HpaConfig,
}

impl KedaConfig {
    /// KEDA defaults for one trigger on `signal` with a per-replica target.
    pub fn new(signal: Signal, target: f64) -> Self {
        Self {
            signal,
            target,
            activation_threshold: 0.0,
            polling_interval_ms: 30_000,
            cooldown_period_ms: 300_000,
            hpa: HpaConfig::new(vec![MetricTarget::external(signal, target)]),
        }
    }
}

/// A KEDA `ScaledObject`: the operator's last-active time and poll time,
/// plus the HPA it owns.
#[derive(Debug, Clone)]
pub struct Keda {
    cfg: KedaConfig,
    bounds: Bounds,
    hpa: Hpa,
    clock: Monotonic,
    last_poll_ms: Option<u64>,
    /// Result of the last poll.
    active: bool,
    /// When a trigger was last seen active (initially: first seen).
    last_active_ms: Option<u64>,
}

impl Keda {
    /// A scaled object within `bounds`; the HPA it owns works within
    /// `bounds` with the minimum raised to 1, as KEDA sets it up.
    pub fn new(mut cfg: KedaConfig, bounds: Bounds) -> Result<Self, ScaleError> {
        positive("target", cfg.target)?;
        if !cfg.activation_threshold.is_finite() {
            return Err(ScaleError::InvalidConfig {
                field: "activation_threshold",
                reason: "must be finite",
            });
        }
        nonzero_ms("polling_interval_ms", cfg.polling_interval_ms)?;
        cfg.hpa.metrics = vec![MetricTarget::external(cfg.signal, cfg.target)];
        let hpa = Hpa::new(cfg.hpa.clone(), bounds.at_least_one())?;
        Ok(Self {
            cfg,
            bounds,
            hpa,
            clock: Monotonic::default(),
            last_poll_ms: None,
            active: false,
            last_active_ms: None,
        })
    }
}

impl Policy for Keda {
    fn name(&self) -> &'static str {
        "keda"
    }

    fn bounds(&self) -> Bounds {
        self.bounds
    }

    fn interval_ms(&self) -> u64 {
        self.cfg.polling_interval_ms.min(self.hpa.interval_ms())
    }

    fn decide(&mut self, now_ms: u64, obs: &Observation) -> Decision {
        let now = self.clock.advance(now_ms);
        if self.last_active_ms.is_none() {
            self.last_active_ms = Some(now);
        }
        let due = self
            .last_poll_ms
            .is_none_or(|t| now.saturating_sub(t) >= self.cfg.polling_interval_ms);
        if due {
            self.last_poll_ms = Some(now);
            let v = obs.value(self.cfg.signal).unwrap_or(0.0);
            self.active = v > self.cfg.activation_threshold;
            if self.active {
                self.last_active_ms = Some(now);
            }
        }

        let current = obs.current();
        if current == 0 {
            // The HPA is idle at zero; only the operator's poll wakes it.
            return if due && self.active {
                Decision::new(self.bounds.at_least_one().min(), Reason::Activated)
            } else {
                self.bounds.apply(Decision::new(0, Reason::NotDue))
            };
        }
        let idle_for = now.saturating_sub(self.last_active_ms.unwrap_or(now));
        if self.bounds.allows_zero() && !self.active && idle_for >= self.cfg.cooldown_period_ms {
            return Decision::new(0, Reason::Deactivated);
        }
        // 1 ↔ N belongs to the HPA, which never goes below 1.
        self.bounds.apply(self.hpa.decide(now, obs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keda() -> Keda {
        Keda::new(
            KedaConfig::new(Signal::Concurrency, 10.0),
            Bounds::new(0, 50).unwrap(),
        )
        .unwrap()
    }

    fn obs(ready: u32, in_flight: u32) -> Observation {
        Observation {
            ready,
            in_flight,
            ..Observation::default()
        }
    }

    #[test]
    fn activates_from_zero_on_first_request() {
        let mut k = keda();
        assert_eq!(k.decide(0, &obs(0, 0)).replicas, 0);
        // The next poll is due at 30 s: a request at 10 s waits for it.
        assert_eq!(k.decide(10_000, &obs(0, 1)).replicas, 0);
        assert_eq!(
            k.decide(30_000, &obs(0, 1)),
            Decision::new(1, Reason::Activated)
        );
    }

    #[test]
    fn activation_threshold_is_strict() {
        let mut cfg = KedaConfig::new(Signal::Concurrency, 10.0);
        cfg.activation_threshold = 5.0;
        let mut k = Keda::new(cfg, Bounds::new(0, 50).unwrap()).unwrap();
        assert_eq!(k.decide(0, &obs(0, 5)).replicas, 0);
        assert_eq!(k.decide(30_000, &obs(0, 6)).replicas, 1);
    }

    #[test]
    fn one_to_zero_only_after_cooldown() {
        let mut k = keda();
        assert_eq!(k.decide(0, &obs(1, 3)).replicas, 1);
        // Traffic stops after the 0 s poll; last active stays at 0 s.
        let mut t = 15_000;
        while t < 300_000 {
            let d = k.decide(t, &obs(1, 0));
            assert_eq!(d.replicas, 1, "went to zero early at {t} ms");
            t += 15_000;
        }
        assert_eq!(
            k.decide(300_000, &obs(1, 0)),
            Decision::new(0, Reason::Deactivated)
        );
    }

    #[test]
    fn activity_restarts_the_cooldown() {
        let mut k = keda();
        k.decide(0, &obs(1, 3));
        k.decide(240_000, &obs(1, 2)); // poll: active again
        assert_eq!(k.decide(300_000, &obs(1, 0)).replicas, 1);
        assert_eq!(k.decide(540_000, &obs(1, 0)).replicas, 0);
    }

    #[test]
    fn hpa_scales_between_one_and_n() {
        let mut k = keda();
        // 95 requests / 10 per replica: ceil(9.5) = 10, rate-limited to
        // max(2 × 2, 2 + 4) = 6 from 2 replicas.
        assert_eq!(
            k.decide(0, &obs(2, 95)),
            Decision::new(6, Reason::RateLimited)
        );
    }

    #[test]
    fn min_above_zero_never_deactivates() {
        let mut k = Keda::new(
            KedaConfig::new(Signal::Concurrency, 10.0),
            Bounds::new(2, 50).unwrap(),
        )
        .unwrap();
        for t in (0..1_000_000).step_by(15_000) {
            assert!(k.decide(t, &obs(2, 0)).replicas >= 2);
        }
    }
}
