//! The contract every autoscaling policy meets: [`Policy`], its answer
//! [`Decision`] with a [`Reason`], and the replica [`Bounds`] it must respect.

use serde::{Deserialize, Serialize};

use crate::observe::{Observation, Timing};
use crate::ScaleError;

/// An autoscaling policy: a deterministic state machine over
/// `(state, observation, now)`.
///
/// The caller (the server's loop on the wall clock, the simulator on a
/// virtual one) calls [`Policy::decide`] with a non-decreasing `now_ms` —
/// milliseconds since an origin of the caller's choosing; only differences
/// matter. A time that goes backwards is treated as no time having passed,
/// so a clock step never panics or scales. Calling more often than
/// [`Policy::interval_ms`] is allowed: a policy whose real counterpart only
/// evaluates every N seconds keeps returning its last decision in between, so
/// the caller never has to know each policy's cadence to stay faithful.
pub trait Policy {
    /// Short lowercase name for reports and metrics (`"hpa"`, `"kpa"`, ...).
    fn name(&self) -> &'static str;

    /// The replica bounds every decision stays within.
    fn bounds(&self) -> Bounds;

    /// How often the real counterpart evaluates, in milliseconds: the
    /// natural cadence for a caller. Calling more often changes nothing.
    fn interval_ms(&self) -> u64;

    /// Decide the desired replica count given what is observed at `now_ms`.
    fn decide(&mut self, now_ms: u64, obs: &Observation) -> Decision;

    /// Replicas the last decision wants parked (weights in host memory, GPU
    /// released) besides the [`Decision::replicas`] on GPUs. Policies that
    /// know no tiers park none: what they stop is released.
    fn parked(&self) -> u32 {
        0
    }

    /// Learn from a duration measured at `now_ms` (same clock as
    /// [`Policy::decide`]). The default ignores it: only policies whose
    /// rule depends on measured prefill or restore times (the tiered
    /// policy's queue tolerance) keep anything. Calling it is never needed
    /// for a decision to be valid; without it such a policy keeps its
    /// priors.
    fn record(&mut self, _now_ms: u64, _timing: Timing) {}
}

/// The answer of one [`Policy::decide`] call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// Desired total replicas (ready + starting), always within the policy's
    /// [`Bounds`].
    pub replicas: u32,
    /// Why, so "why did it scale" has an answer.
    pub reason: Reason,
}

impl Decision {
    /// A decision with its reason.
    pub const fn new(replicas: u32, reason: Reason) -> Self {
        Self { replicas, reason }
    }
}

/// Why a policy decided what it did. A closed set, like Nomad's named
/// rejection reasons, so reasons can be counted in metrics
/// ([`Reason::as_str`]) as well as shown to a person (`Display`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reason {
    /// Between two evaluations of the real counterpart: the last decision
    /// stands.
    NotDue,
    /// The metric asks for this many replicas (after tolerance and
    /// stabilisation), and nothing limited it.
    Metric,
    /// HPA: the usage ratio is within `1 ± tolerance`, so no change.
    WithinTolerance,
    /// HPA: not-ready replicas, counted at zero usage, cancel the scale-up.
    NotReadyHold,
    /// HPA: the scale-down stabilisation window still holds a higher
    /// recommendation.
    Stabilised,
    /// HPA: the scaling policies (pods or percent per period) cap the change.
    RateLimited,
    /// No usable metric this time: hold the current count.
    NoMetric,
    /// Kubernetes does not autoscale a target that sits at zero replicas;
    /// the bounds' minimum applies.
    DisabledAtZero,
    /// The policy wanted more or fewer replicas than the bounds allow.
    Bounded,
    /// KEDA: a trigger went active while at zero: scale to one (or min).
    Activated,
    /// KEDA: no trigger active for the cooldown period: scale to zero.
    Deactivated,
    /// KPA: stable mode, sized on the stable-window average.
    Stable,
    /// KPA: panic mode, sized on the panic-window average, never down.
    Panic,
    /// KPA: the last replica waits out the scale-to-zero grace period.
    ZeroGrace,
    /// Scaled to zero after the policy's idle rule was met.
    ScaledToZero,
    /// Ray Serve: the decision has not yet held for its upscale or downscale
    /// delay.
    DelayPending,
    /// Ray Serve: requests wait at zero replicas: start one at once.
    FromZero,
    /// Flotilla: sized to the arrival forecast over the cold-start horizon.
    Forecast,
    /// Flotilla: sized to the requests already in flight and queued.
    Backlog,
    /// Flotilla: one replica kept warm because the expected cold-start
    /// penalty outweighs its idle cost.
    KeepWarm,
    /// Flotilla: traffic too recent to consider scaling to zero.
    RecentTraffic,
}

impl Reason {
    /// Stable kebab-case code for metrics and logs.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::NotDue => "not-due",
            Self::Metric => "metric",
            Self::WithinTolerance => "within-tolerance",
            Self::NotReadyHold => "not-ready-hold",
            Self::Stabilised => "stabilised",
            Self::RateLimited => "rate-limited",
            Self::NoMetric => "no-metric",
            Self::DisabledAtZero => "disabled-at-zero",
            Self::Bounded => "bounded",
            Self::Activated => "activated",
            Self::Deactivated => "deactivated",
            Self::Stable => "stable",
            Self::Panic => "panic",
            Self::ZeroGrace => "zero-grace",
            Self::ScaledToZero => "scaled-to-zero",
            Self::DelayPending => "delay-pending",
            Self::FromZero => "from-zero",
            Self::Forecast => "forecast",
            Self::Backlog => "backlog",
            Self::KeepWarm => "keep-warm",
            Self::RecentTraffic => "recent-traffic",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Minimum and maximum replicas of one endpoint. `min == 0` allows scale to
/// zero; `max >= 1` always (an endpoint that may never run is not
/// autoscaled, it is disabled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawBounds", into = "RawBounds")]
pub struct Bounds {
    min: u32,
    max: u32,
}

/// The unchecked wire form of [`Bounds`]; deserialising goes through
/// [`Bounds::new`] so an invalid pair never exists.
#[derive(Serialize, Deserialize)]
struct RawBounds {
    min: u32,
    max: u32,
}

impl TryFrom<RawBounds> for Bounds {
    type Error = ScaleError;
    fn try_from(raw: RawBounds) -> Result<Self, Self::Error> {
        Self::new(raw.min, raw.max)
    }
}

impl From<Bounds> for RawBounds {
    fn from(b: Bounds) -> Self {
        Self {
            min: b.min,
            max: b.max,
        }
    }
}

impl Bounds {
    /// Bounds `min..=max`; rejects `min > max` and `max == 0`.
    pub fn new(min: u32, max: u32) -> Result<Self, ScaleError> {
        if max == 0 || min > max {
            return Err(ScaleError::InvalidBounds { min, max });
        }
        Ok(Self { min, max })
    }

    /// The lowest allowed replica count.
    pub const fn min(self) -> u32 {
        self.min
    }

    /// The highest allowed replica count.
    pub const fn max(self) -> u32 {
        self.max
    }

    /// Whether the endpoint may scale to zero.
    pub const fn allows_zero(self) -> bool {
        self.min == 0
    }

    /// `n` brought within the bounds.
    pub fn clamp(self, n: u32) -> u32 {
        n.clamp(self.min, self.max)
    }

    /// Bounds with the minimum raised to at least one: what a policy that
    /// cannot scale from zero (HPA under KEDA) works within.
    pub fn at_least_one(self) -> Self {
        Self {
            min: self.min.max(1),
            max: self.max,
        }
    }

    /// Clamp `d` to the bounds, marking it [`Reason::Bounded`] if that
    /// changed it.
    pub(crate) fn apply(self, d: Decision) -> Decision {
        let n = self.clamp(d.replicas);
        if n == d.replicas {
            d
        } else {
            Decision::new(n, Reason::Bounded)
        }
    }
}

/// Monotonic view of the caller's clock: a time that goes backwards reads as
/// the latest time already seen, so every elapsed-time computation is a
/// plain non-negative subtraction.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Monotonic {
    latest: Option<u64>,
}

impl Monotonic {
    /// Record `now_ms` and return the clamped time.
    pub(crate) fn advance(&mut self, now_ms: u64) -> u64 {
        let t = match self.latest {
            Some(prev) => prev.max(now_ms),
            None => now_ms,
        };
        self.latest = Some(t);
        t
    }
}

/// `ceil(x)` as a replica count: NaN and non-positive values give 0, huge
/// values saturate. Replica maths runs in `f64` because every published
/// algorithm is written with ratios; this is the one place it returns to
/// integers.
pub(crate) fn ceil_u32(x: f64) -> u32 {
    if x.is_nan() || x <= 0.0 {
        0
    } else if x >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        x.ceil() as u32
    }
}

/// `floor(x)` as a replica count, with the same guards as [`ceil_u32`].
pub(crate) fn floor_u32(x: f64) -> u32 {
    if x.is_nan() || x <= 0.0 {
        0
    } else if x >= f64::from(u32::MAX) {
        u32::MAX
    } else {
        x.floor() as u32
    }
}

/// Shared check for configuration numbers: finite and strictly positive.
pub(crate) fn positive(field: &'static str, x: f64) -> Result<(), ScaleError> {
    if x.is_finite() && x > 0.0 {
        Ok(())
    } else {
        Err(ScaleError::InvalidConfig {
            field,
            reason: "must be finite and greater than zero",
        })
    }
}

/// Shared check for durations that must be non-zero.
pub(crate) fn nonzero_ms(field: &'static str, ms: u64) -> Result<(), ScaleError> {
    if ms > 0 {
        Ok(())
    } else {
        Err(ScaleError::InvalidConfig {
            field,
            reason: "must be greater than zero",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_reject_inverted_and_zero_max() {
        assert!(Bounds::new(3, 2).is_err());
        assert!(Bounds::new(0, 0).is_err());
        let b = Bounds::new(0, 5).unwrap();
        assert!(b.allows_zero());
        assert_eq!(b.clamp(9), 5);
        assert_eq!(b.at_least_one().min(), 1);
    }

    #[test]
    fn monotonic_clock_ignores_steps_back() {
        let mut c = Monotonic::default();
        assert_eq!(c.advance(10), 10);
        assert_eq!(c.advance(5), 10);
        assert_eq!(c.advance(12), 12);
    }

    #[test]
    fn ceil_guards_nan_and_overflow() {
        assert_eq!(ceil_u32(f64::NAN), 0);
        assert_eq!(ceil_u32(-1.0), 0);
        assert_eq!(ceil_u32(1.01), 2);
        assert_eq!(ceil_u32(f64::INFINITY), u32::MAX);
        assert_eq!(floor_u32(2.9), 2);
    }
}
