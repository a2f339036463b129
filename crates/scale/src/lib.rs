//! Flotilla's autoscaling policies for endpoint replicas: faithful
//! re-implementations of the baselines operators already know (Kubernetes
//! HPA in [`hpa`], KEDA in [`keda`], Knative's KPA in [`kpa`], Ray Serve in
//! [`ray`]) and Flotilla's own cold-start-aware policy in [`flotilla`], all
//! behind one [`Policy`] trait so the live server and the simulator run the
//! same code.
//!
//! This crate is pure and must stay so: no I/O, no clock reads, no threads,
//! no global state. Every decision takes the time as an argument —
//! `now_ms: u64`, milliseconds since an origin the caller picks (the server
//! uses the wall clock, the simulator its virtual clock); only differences
//! are used, and a time that goes backwards counts as no time passing — and
//! an [`Observation`] of the endpoint. Each policy is a state machine that
//! holds only what its real counterpart holds (HPA its recommendation
//! history, KPA its windows and panic time, ...), so the same inputs always
//! give the same decisions. Bad readings (NaN, negative) never panic and
//! never scale past the [`Bounds`].
//!
//! [`nodepool`] decides the size of a node pool (machines from a capacity
//! provider) from the work that fits no node, on the same terms.
//!
//! Each baseline module cites the published algorithm and defaults it
//! follows and lists what it simplifies.

pub mod builder;
pub mod flotilla;
pub mod hpa;
pub mod keda;
pub mod kpa;
pub mod nodepool;
pub mod observe;
pub mod policy;
pub mod ray;
pub mod tiers;
pub mod tolerance;
pub mod vertical;

pub use builder::{Endpoint, PolicyKind};
pub use flotilla::{ColdStart, Flotilla, FlotillaConfig, ServiceModel};
pub use hpa::{
    Hpa, HpaConfig, MetricSource, MetricTarget, ScalingPolicy, ScalingRules, SelectPolicy,
};
pub use keda::{Keda, KedaConfig};
pub use kpa::{Kpa, KpaConfig};
pub use observe::{Aggregation, Latency, Observation, Signal, Timing};
pub use policy::{Bounds, Decision, Policy, Reason};
pub use ray::{RayServe, RayServeConfig};
pub use tiers::{ReadinessTiers, Tier, TierEconomics, TierPlan, TierSpeed, TieredFlotilla};
pub use tolerance::{DecayingQuantile, QueueTolerance};
pub use vertical::{GpuClass, Move, Vertical, VerticalConfig, VerticalSignals};

/// Errors of this crate: all are invalid configuration, caught when a
/// policy is built so that deciding never fails.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScaleError {
    /// `min` above `max`, or `max` of zero.
    #[error("invalid replica bounds: min {min}, max {max}")]
    InvalidBounds { min: u32, max: u32 },
    /// A configuration value out of its range.
    #[error("invalid autoscaling config {field}: {reason}")]
    InvalidConfig {
        field: &'static str,
        reason: &'static str,
    },
    /// A policy name that is none of [`PolicyKind::ALL`].
    #[error("unknown policy {name:?}; expected flotilla, hpa, keda, kpa or ray")]
    UnknownPolicy { name: String },
    /// A list of policies that names none.
    #[error("no policy named")]
    NoPolicy,
    /// A policy rejected the configuration it was built from.
    #[error("policy {policy}: {source}")]
    Policy {
        policy: &'static str,
        #[source]
        source: Box<ScaleError>,
    },
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Every policy, built with default settings within `bounds`.
    fn all(bounds: Bounds) -> Vec<Box<dyn Policy>> {
        let flotilla = FlotillaConfig::new(
            ColdStart {
                provision_ms: 30_000,
                pull_ms: 10_000,
                load_ms: 20_000,
            },
            ServiceModel {
                service_rate: 3.0,
                max_concurrency: 16,
            },
            2_000.0,
        );
        let hpa = HpaConfig::new(vec![
            MetricTarget::per_replica(Signal::GpuUtilization, 0.7),
            MetricTarget::per_replica(Signal::Concurrency, 8.0),
            MetricTarget::per_replica(Signal::SloPressure, 1.0),
            MetricTarget::external(Signal::Custom, 5.0),
        ]);
        vec![
            Box::new(Hpa::new(hpa, bounds).unwrap()),
            Box::new(Keda::new(KedaConfig::new(Signal::Queued, 4.0), bounds).unwrap()),
            Box::new(Kpa::new(KpaConfig::default(), bounds).unwrap()),
            Box::new(RayServe::new(RayServeConfig::default(), bounds).unwrap()),
            Box::new(Flotilla::new(flotilla, bounds).unwrap()),
        ]
    }

    fn reading() -> impl Strategy<Value = f64> {
        prop_oneof![
            4 => 0.0..2.0f64,
            1 => proptest::num::f64::ANY,
        ]
    }

    prop_compose! {
        fn observation()(
            ready in 0u32..300,
            starting in 0u32..50,
            in_flight in prop_oneof![0u32..2_000, Just(u32::MAX)],
            queued in 0u32..5_000,
            arrivals in 0u64..10_000,
            util in reading(),
            p95 in reading(),
            slo in proptest::option::of(reading()),
            custom in proptest::option::of(reading()),
        ) -> (Observation, u64) {
            let o = Observation {
                ready,
                starting,
                in_flight,
                queued,
                requests_total: 0,
                gpu_utilization: util,
                latency: Some(Latency { p50_ms: p95 * 500.0, p95_ms: p95 * 1000.0, p99_ms: p95 * 2000.0 }),
                slo_ms: slo.map(|s| s * 1000.0),
                custom: custom.map(|c| c * 100.0),
            };
            (o, arrivals)
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn decisions_stay_within_bounds(
            min in 0u32..5,
            span in 0u32..40,
            steps in proptest::collection::vec((0u64..120_000, observation(), any::<bool>()), 1..80),
        ) {
            let bounds = Bounds::new(min, (min + span).max(1)).unwrap();
            for mut p in all(bounds) {
                let (mut now, mut total) = (0u64, 0u64);
                for (dt, (obs, arrivals), reset) in &steps {
                    now += dt;
                    // Occasionally step the clock back or reset the counter.
                    let t = if *reset { now.saturating_sub(5_000) } else { now };
                    total = if *reset { *arrivals } else { total + arrivals };
                    let o = Observation { requests_total: total, ..*obs };
                    let d = p.decide(t, &o);
                    prop_assert!(
                        d.replicas >= bounds.min() && d.replicas <= bounds.max(),
                        "{} decided {} outside {:?}", p.name(), d.replicas, bounds
                    );
                }
            }
        }
    }
}
