//! Kubernetes Horizontal Pod Autoscaler (`autoscaling/v2`), re-implemented
//! from the published algorithm so it can run as a baseline in the simulator.
//!
//! Source: Kubernetes docs, "Horizontal Pod Autoscaling", sections
//! *Algorithm details*, *Stabilization window* and *Default Behavior*
//! (kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/), and
//! the `HPAScalingRules` API reference. Defaults:
//!
//! - `desiredReplicas = ceil(currentReplicas × currentMetric / targetMetric)`,
//!   evaluated every 15 s (`--horizontal-pod-autoscaler-sync-period`);
//! - no change while the ratio is within `1 ± 0.1`
//!   (`--horizontal-pod-autoscaler-tolerance`);
//! - several metrics: the largest recommendation wins;
//! - scale-down stabilisation 300 s: the highest recommendation of the last
//!   300 s is used; scale-up stabilisation 0 s;
//! - scale-up policies: +100 % or +4 pods per 15 s, the larger (`Max`);
//!   scale-down policy: −100 % per 15 s.
//!
//! Simplified, and why: pods with *missing* metrics are not modelled (the
//! gateway reports every replica); *not-ready* pods are handled as the docs
//! say for scale-up (they count at zero usage, and if that cancels or
//! reverses the scale-up the HPA holds) but there is no CPU-initialisation
//! period, since GPU replicas report nothing until ready. Kubernetes leaves a
//! target that sits at zero replicas alone; here it is moved to the bounds'
//! minimum, which is zero exactly when scale to zero is allowed, so plain HPA
//! never scales from zero (KEDA exists for that, see [`crate::keda`]).

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::observe::{Aggregation, Observation, Signal};
use crate::policy::{
    ceil_u32, floor_u32, nonzero_ms, positive, Bounds, Decision, Monotonic, Policy, Reason,
};
use crate::ScaleError;

/// How a metric's value relates to replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricSource {
    /// A `Pods` or `Resource` metric: averaged over the ready replicas and
    /// compared with the per-replica target; not-ready replicas get the
    /// docs' conservative treatment.
    PerReplica,
    /// An `External` metric with an `AverageValue` target, as KEDA exposes
    /// its triggers: `desired = ceil(total / target)`, the ratio for the
    /// tolerance check taken against the current replica count.
    External,
}

/// One metric and its target.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MetricTarget {
    /// What is measured.
    pub signal: Signal,
    /// Target value per replica (an average for [`Aggregation::Average`]
    /// signals, e.g. 0.7 GPU utilisation).
    pub target: f64,
    /// How it maps to replicas.
    pub source: MetricSource,
}

impl MetricTarget {
    /// A per-replica (`Pods`/`Resource`) metric.
    pub const fn per_replica(signal: Signal, target: f64) -> Self {
        Self {
            signal,
            target,
            source: MetricSource::PerReplica,
        }
    }

    /// An external metric with an `AverageValue` target.
    pub const fn external(signal: Signal, target: f64) -> Self {
        Self {
            signal,
            target,
            source: MetricSource::External,
        }
    }
}

/// One scaling policy: how far replicas may move within a period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ScalingPolicy {
    /// At most `value` pods per `period_ms`.
    Pods { value: u32, period_ms: u64 },
    /// At most `value` percent of the replicas at the period's start.
    Percent { value: u32, period_ms: u64 },
}

impl ScalingPolicy {
    const fn period_ms(self) -> u64 {
        match self {
            Self::Pods { period_ms, .. } | Self::Percent { period_ms, .. } => period_ms,
        }
    }
}

/// Which policy applies when several do (`selectPolicy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SelectPolicy {
    /// The policy allowing the largest change (the default).
    Max,
    /// The policy allowing the smallest change.
    Min,
    /// No scaling in this direction.
    Disabled,
}

/// `HPAScalingRules` for one direction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScalingRules {
    /// Recommendations from this far back are taken into account.
    pub stabilization_window_ms: u64,
    /// Rate limits.
    pub policies: Vec<ScalingPolicy>,
    /// How the policies combine.
    pub select: SelectPolicy,
}

impl ScalingRules {
    /// Kubernetes' default scale-up rules: no stabilisation; +100 % or
    /// +4 pods per 15 s, whichever is larger.
    pub fn default_up() -> Self {
        Self {
            stabilization_window_ms: 0,
            policies: vec![
                ScalingPolicy::Percent {
                    value: 100,
                    period_ms: 15_000,
                },
                ScalingPolicy::Pods {
                    value: 4,
                    period_ms: 15_000,
                },
            ],
            select: SelectPolicy::Max,
        }
    }

    /// Kubernetes' default scale-down rules: 300 s stabilisation; −100 %
    /// per 15 s.
    pub fn default_down() -> Self {
        Self {
            stabilization_window_ms: 300_000,
            policies: vec![ScalingPolicy::Percent {
                value: 100,
                period_ms: 15_000,
            }],
            select: SelectPolicy::Max,
        }
    }
}

/// HPA configuration; [`HpaConfig::new`] fills Kubernetes' defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HpaConfig {
    /// Metrics; the largest recommendation wins. At least one.
    pub metrics: Vec<MetricTarget>,
    /// Controller sync period (default 15 s).
    pub sync_period_ms: u64,
    /// No change while `|1 − ratio| ≤ tolerance` (default 0.1).
    pub tolerance: f64,
    /// Scale-up behaviour.
    pub scale_up: ScalingRules,
    /// Scale-down behaviour.
    pub scale_down: ScalingRules,
}

impl HpaConfig {
    /// Kubernetes defaults around the given metrics.
    pub fn new(metrics: Vec<MetricTarget>) -> Self {
        Self {
            metrics,
            sync_period_ms: 15_000,
            tolerance: 0.1,
            scale_up: ScalingRules::default_up(),
            scale_down: ScalingRules::default_down(),
        }
    }

    fn validate(&self) -> Result<(), ScaleError> {
        if self.metrics.is_empty() {
            return Err(ScaleError::InvalidConfig {
                field: "metrics",
                reason: "at least one metric is required",
            });
        }
        for m in &self.metrics {
            positive("metrics.target", m.target)?;
        }
        nonzero_ms("sync_period_ms", self.sync_period_ms)?;
        if !(self.tolerance.is_finite() && self.tolerance >= 0.0) {
            return Err(ScaleError::InvalidConfig {
                field: "tolerance",
                reason: "must be finite and not negative",
            });
        }
        for p in self
            .scale_up
            .policies
            .iter()
            .chain(&self.scale_down.policies)
        {
            nonzero_ms("policies.period_ms", p.period_ms())?;
        }
        Ok(())
    }
}

/// A replica change the HPA made, kept for the rate-limit periods.
#[derive(Debug, Clone, Copy)]
struct ScaleEvent {
    at_ms: u64,
    /// Positive: added; negative: removed.
    change: i64,
}

/// The Kubernetes HPA as a state machine: its recommendation history (for
/// stabilisation) and its scale events (for the rate limits), as the
/// controller keeps them per HPA object.
#[derive(Debug, Clone)]
pub struct Hpa {
    cfg: HpaConfig,
    bounds: Bounds,
    clock: Monotonic,
    last_sync_ms: Option<u64>,
    last: Option<Decision>,
    recommendations: VecDeque<(u64, u32)>,
    events: VecDeque<ScaleEvent>,
}

impl Hpa {
    /// An HPA within `bounds`.
    pub fn new(cfg: HpaConfig, bounds: Bounds) -> Result<Self, ScaleError> {
        cfg.validate()?;
        Ok(Self {
            cfg,
            bounds,
            clock: Monotonic::default(),
            last_sync_ms: None,
            last: None,
            recommendations: VecDeque::new(),
            events: VecDeque::new(),
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &HpaConfig {
        &self.cfg
    }

    /// Raw recommendation for one metric (before stabilisation), or `None`
    /// if it cannot be computed.
    fn recommend_metric(
        &self,
        m: &MetricTarget,
        obs: &Observation,
        current: u32,
    ) -> Option<(u32, Reason)> {
        let value = obs.value(m.signal)?;
        let tol = self.cfg.tolerance;
        match m.source {
            MetricSource::External => {
                // GetExternalPerPodMetricReplicas: ratio against the current
                // count, desired straight from the total.
                let ratio = value / (m.target * f64::from(current));
                if (1.0 - ratio).abs() <= tol {
                    Some((current, Reason::WithinTolerance))
                } else {
                    Some((ceil_u32(value / m.target), Reason::Metric))
                }
            }
            MetricSource::PerReplica => {
                let ready = obs.ready;
                if ready == 0 {
                    // No pod reports a metric: the controller cannot compute
                    // a ratio and leaves the count alone.
                    return None;
                }
                let avg = match m.signal.aggregation() {
                    Aggregation::Total => value / f64::from(ready),
                    Aggregation::Average => value,
                };
                let ratio = avg / m.target;
                if (1.0 - ratio).abs() <= tol {
                    return Some((current, Reason::WithinTolerance));
                }
                if ratio > 1.0 && obs.starting > 0 {
                    // Scaling up with not-ready pods: count them at zero
                    // usage; if that brings the ratio within tolerance or
                    // reverses the direction, do not scale.
                    let with = f64::from(ready) + f64::from(obs.starting);
                    let new_ratio = avg * f64::from(ready) / (m.target * with);
                    if new_ratio <= 1.0 || (1.0 - new_ratio).abs() <= tol {
                        return Some((current, Reason::NotReadyHold));
                    }
                    let n = ceil_u32(new_ratio * with);
                    if n < current {
                        return Some((current, Reason::NotReadyHold));
                    }
                    return Some((n, Reason::Metric));
                }
                Some((ceil_u32(ratio * f64::from(ready)), Reason::Metric))
            }
        }
    }

    /// Replicas changed by this HPA within `period_ms` before `now`:
    /// `(added, removed)`.
    fn changes_within(&self, now: u64, period_ms: u64) -> (i64, i64) {
        let (mut up, mut down) = (0i64, 0i64);
        for e in &self.events {
            if e.at_ms.saturating_add(period_ms) > now {
                if e.change > 0 {
                    up += e.change;
                } else {
                    down -= e.change;
                }
            }
        }
        (up, down)
    }

    /// The highest count the scale-up policies allow now.
    fn scale_up_limit(&self, now: u64, current: u32) -> u32 {
        let rules = &self.cfg.scale_up;
        let mut result: Option<i64> = None;
        for p in &rules.policies {
            let (added, removed) = self.changes_within(now, p.period_ms());
            let start = (i64::from(current) - added + removed).max(0);
            let proposed = match *p {
                ScalingPolicy::Pods { value, .. } => start + i64::from(value),
                ScalingPolicy::Percent { value, .. } => {
                    i64::from(ceil_u32(start as f64 * (1.0 + f64::from(value) / 100.0)))
                }
            };
            result = Some(match (result, rules.select) {
                (None, _) => proposed,
                (Some(r), SelectPolicy::Min) => r.min(proposed),
                (Some(r), _) => r.max(proposed),
            });
        }
        let limit = match (rules.select, result) {
            (SelectPolicy::Disabled, _) | (_, None) => i64::from(current),
            (_, Some(r)) => r,
        };
        // "We shouldn't scale up further until the scale-up events expire."
        clamp_i64(limit.max(i64::from(current)))
    }

    /// The lowest count the scale-down policies allow now.
    fn scale_down_limit(&self, now: u64, current: u32) -> u32 {
        let rules = &self.cfg.scale_down;
        let mut result: Option<i64> = None;
        for p in &rules.policies {
            let (added, removed) = self.changes_within(now, p.period_ms());
            let start = (i64::from(current) - added + removed).max(0);
            let proposed = match *p {
                ScalingPolicy::Pods { value, .. } => start - i64::from(value),
                ScalingPolicy::Percent { value, .. } => {
                    i64::from(floor_u32(start as f64 * (1.0 - f64::from(value) / 100.0)))
                }
            };
            // For scale-down the largest change is the lowest count.
            result = Some(match (result, rules.select) {
                (None, _) => proposed,
                (Some(r), SelectPolicy::Min) => r.max(proposed),
                (Some(r), _) => r.min(proposed),
            });
        }
        let limit = match (rules.select, result) {
            (SelectPolicy::Disabled, _) | (_, None) => i64::from(current),
            (_, Some(r)) => r,
        };
        clamp_i64(limit.min(i64::from(current)))
    }

    /// One controller sync: metrics → stabilisation → rate limits → bounds.
    fn sync(&mut self, now: u64, obs: &Observation) -> Decision {
        let current = obs.current();
        if current == 0 {
            return Decision::new(self.bounds.min(), Reason::DisabledAtZero);
        }

        // 1. Metrics: the largest recommendation wins.
        let mut raw: Option<(u32, Reason)> = None;
        for m in &self.cfg.metrics {
            if let Some(r) = self.recommend_metric(m, obs, current) {
                if raw.is_none_or(|(n, _)| r.0 > n) {
                    raw = Some(r);
                }
            }
        }
        let Some((raw, mut reason)) = raw else {
            return self.bounds.apply(Decision::new(current, Reason::NoMetric));
        };

        // 2. Stabilisation: at least the lowest recommendation of the
        // scale-up window, at most the highest of the scale-down window.
        // A recommendation counts while strictly younger than the window
        // (Kubernetes: `timestamp.After(now - window)`).
        let up_window = self.cfg.scale_up.stabilization_window_ms;
        let down_window = self.cfg.scale_down.stabilization_window_ms;
        let (mut up_rec, mut down_rec) = (raw, raw);
        for &(t, r) in &self.recommendations {
            let age = now.saturating_sub(t);
            if age < up_window {
                up_rec = up_rec.min(r);
            }
            if age < down_window {
                down_rec = down_rec.max(r);
            }
        }
        let mut desired = current.max(up_rec).min(down_rec);
        if desired != raw {
            reason = Reason::Stabilised;
        }
        self.recommendations.push_back((now, raw));
        let longest = up_window.max(down_window);
        while self
            .recommendations
            .front()
            .is_some_and(|(t, _)| now.saturating_sub(*t) >= longest)
        {
            self.recommendations.pop_front();
        }

        // 3. Rate limits, then bounds (Kubernetes folds both into one step).
        if desired > current {
            let limit = self.scale_up_limit(now, current);
            if desired > limit {
                desired = limit;
                reason = Reason::RateLimited;
            }
        } else if desired < current {
            let limit = self.scale_down_limit(now, current);
            if desired < limit {
                desired = limit;
                reason = Reason::RateLimited;
            }
        }
        let d = self.bounds.apply(Decision::new(desired, reason));

        // 4. Remember the change for the rate-limit periods.
        if d.replicas != current {
            self.events.push_back(ScaleEvent {
                at_ms: now,
                change: i64::from(d.replicas) - i64::from(current),
            });
        }
        let longest = self
            .cfg
            .scale_up
            .policies
            .iter()
            .chain(&self.cfg.scale_down.policies)
            .map(|p| p.period_ms())
            .max()
            .unwrap_or(0);
        while self
            .events
            .front()
            .is_some_and(|e| e.at_ms.saturating_add(longest) <= now)
        {
            self.events.pop_front();
        }
        d
    }
}

fn clamp_i64(x: i64) -> u32 {
    u32::try_from(x.max(0)).unwrap_or(u32::MAX)
}

impl Policy for Hpa {
    fn name(&self) -> &'static str {
        "hpa"
    }

    fn bounds(&self) -> Bounds {
        self.bounds
    }

    fn interval_ms(&self) -> u64 {
        self.cfg.sync_period_ms
    }

    fn decide(&mut self, now_ms: u64, obs: &Observation) -> Decision {
        let now = self.clock.advance(now_ms);
        if let (Some(t), Some(last)) = (self.last_sync_ms, self.last) {
            if now.saturating_sub(t) < self.cfg.sync_period_ms {
                return Decision::new(last.replicas, Reason::NotDue);
            }
        }
        let d = self.sync(now, obs);
        self.last_sync_ms = Some(now);
        self.last = Some(d);
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hpa(min: u32, max: u32) -> Hpa {
        let cfg = HpaConfig::new(vec![MetricTarget::per_replica(Signal::GpuUtilization, 0.5)]);
        Hpa::new(cfg, Bounds::new(min, max).unwrap()).unwrap()
    }

    fn obs(ready: u32, util: f64) -> Observation {
        Observation {
            ready,
            gpu_utilization: util,
            ..Observation::default()
        }
    }

    #[test]
    fn textbook_formula() {
        // 4 replicas at 75 % against a 50 % target: ceil(4 × 1.5) = 6.
        let mut h = hpa(1, 100);
        assert_eq!(h.decide(0, &obs(4, 0.75)), Decision::new(6, Reason::Metric));
    }

    #[test]
    fn holds_inside_tolerance() {
        let mut h = hpa(1, 100);
        // Ratio 1.08 and 0.92: inside 1 ± 0.1.
        assert_eq!(
            h.decide(0, &obs(10, 0.54)),
            Decision::new(10, Reason::WithinTolerance)
        );
        assert_eq!(
            h.decide(15_000, &obs(10, 0.46)),
            Decision::new(10, Reason::WithinTolerance)
        );
        // Ratio 1.12: outside, ceil(10 × 1.12) = 12.
        assert_eq!(h.decide(30_000, &obs(10, 0.56)).replicas, 12);
    }

    #[test]
    fn evaluates_only_every_sync_period() {
        let mut h = hpa(1, 100);
        assert_eq!(h.decide(0, &obs(2, 1.0)).replicas, 4);
        let d = h.decide(10_000, &obs(4, 1.0));
        assert_eq!(d, Decision::new(4, Reason::NotDue));
        assert_eq!(h.decide(15_000, &obs(4, 1.0)).replicas, 8);
    }

    #[test]
    fn waits_out_scale_down_stabilisation() {
        let mut h = hpa(1, 100);
        assert_eq!(h.decide(0, &obs(10, 0.5)).replicas, 10);
        // Load halves at 15 s: raw recommendation 5, but 10 was recommended
        // within the last 300 s.
        let mut t = 15_000;
        while t < 300_000 {
            let d = h.decide(t, &obs(10, 0.25));
            assert_eq!(d.replicas, 10, "scaled down early at {t} ms");
            t += 15_000;
        }
        // At 300 s the 0 s recommendation leaves the window (strictly after
        // the cut-off counts), so the HPA drops to 5.
        assert_eq!(
            h.decide(300_000, &obs(10, 0.25)),
            Decision::new(5, Reason::Metric)
        );
    }

    #[test]
    fn scales_up_at_once_bounded_by_policy() {
        // 2 replicas at 40× the target: raw 80, but at most
        // max(2 × 2, 2 + 4) = 6 within one 15 s period.
        let mut h = Hpa::new(
            HpaConfig::new(vec![MetricTarget::per_replica(Signal::Concurrency, 1.0)]),
            Bounds::new(1, 1000).unwrap(),
        )
        .unwrap();
        let o = Observation {
            ready: 2,
            in_flight: 80,
            ..Observation::default()
        };
        assert_eq!(h.decide(0, &o), Decision::new(6, Reason::RateLimited));
        // The next sync starts a new 15 s period from 6: max(12, 10) = 12.
        let o = Observation {
            ready: 6,
            in_flight: 80,
            ..Observation::default()
        };
        assert_eq!(h.decide(15_000, &o), Decision::new(12, Reason::RateLimited));
    }

    #[test]
    fn rate_limit_counts_changes_within_the_period() {
        let mut cfg = HpaConfig::new(vec![MetricTarget::per_replica(Signal::Concurrency, 1.0)]);
        cfg.sync_period_ms = 5_000;
        let mut h = Hpa::new(cfg, Bounds::new(1, 1000).unwrap()).unwrap();
        let o = |ready| Observation {
            ready,
            in_flight: 80,
            ..Observation::default()
        };
        assert_eq!(h.decide(0, &o(2)).replicas, 6);
        // 5 s later the period still started at 2 replicas: no more.
        assert_eq!(
            h.decide(5_000, &o(6)),
            Decision::new(6, Reason::RateLimited)
        );
        // From 15 s the +4 has left the period.
        assert_eq!(h.decide(15_000, &o(6)).replicas, 12);
    }

    #[test]
    fn not_ready_replicas_cancel_a_marginal_scale_up() {
        let mut h = hpa(1, 100);
        // 2 ready at 60 % (ratio 1.2) but 2 more starting: counted at zero
        // the ratio is 0.6, a reversal, so hold.
        let o = Observation {
            ready: 2,
            starting: 2,
            gpu_utilization: 0.6,
            ..Observation::default()
        };
        assert_eq!(h.decide(0, &o), Decision::new(4, Reason::NotReadyHold));
    }

    #[test]
    fn largest_metric_wins_and_bounds_apply() {
        let cfg = HpaConfig::new(vec![
            MetricTarget::per_replica(Signal::GpuUtilization, 0.5),
            MetricTarget::per_replica(Signal::Concurrency, 4.0),
        ]);
        let mut h = Hpa::new(cfg, Bounds::new(2, 5).unwrap()).unwrap();
        let o = Observation {
            ready: 4,
            gpu_utilization: 0.5,
            in_flight: 24,
            ..Observation::default()
        };
        // Concurrency asks ceil(4 × 1.5) = 6, above max 5.
        assert_eq!(h.decide(0, &o), Decision::new(5, Reason::Bounded));
    }

    #[test]
    fn stays_at_zero() {
        let mut h = hpa(0, 10);
        let o = Observation {
            queued: 50,
            ..Observation::default()
        };
        assert_eq!(h.decide(0, &o), Decision::new(0, Reason::DisabledAtZero));
    }
}
