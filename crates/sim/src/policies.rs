//! The policies under test, configured the same way for every trace.
//!
//! Every baseline targets the same per-replica load, 70 % of the replica's
//! maximum concurrency (Knative's default target utilisation; HPA, KEDA
//! and Ray Serve get the same number so the comparison is of algorithms,
//! not of targets), on the concurrency signal (in flight + queued), which
//! is what all four recommend for request-serving workloads. Minimums
//! follow each system's default: HPA 1 (it cannot scale to zero), Ray
//! Serve 1 (`min_replicas` default), KEDA and Knative 0. Everything else is
//! the published default, as implemented in `flotilla-scale`.
//!
//! Flotilla's policy gets what an operator knows about the endpoint: its
//! SLO, the median cold start, the maximum concurrency and the mean
//! service time of a request (from the endpoint's profile; the simulator
//! passes the trace's mean).

use std::str::FromStr;

use flotilla_scale::{
    Bounds, ColdStart, Flotilla, FlotillaConfig, Hpa, HpaConfig, Keda, KedaConfig, Kpa, KpaConfig,
    MetricTarget, Policy, RayServe, RayServeConfig, ServiceModel as ScaleService, Signal,
};

use crate::SimError;

/// Target utilisation of the baselines' concurrency target.
pub const TARGET_UTILIZATION: f64 = 0.7;

/// One of the policies the simulator compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PolicyKind {
    Flotilla,
    Hpa,
    Keda,
    Kpa,
    Ray,
}

impl PolicyKind {
    /// All, in report order.
    pub const ALL: [Self; 5] = [Self::Flotilla, Self::Hpa, Self::Keda, Self::Kpa, Self::Ray];

    /// Name used on the command line and in reports.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Flotilla => "flotilla",
            Self::Hpa => "hpa",
            Self::Keda => "keda",
            Self::Kpa => "kpa",
            Self::Ray => "ray",
        }
    }

    /// A comma-separated list (`flotilla,hpa`), duplicates removed, order
    /// kept.
    pub fn parse_list(s: &str) -> Result<Vec<Self>, SimError> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let k = part.parse()?;
            if !out.contains(&k) {
                out.push(k);
            }
        }
        if out.is_empty() {
            return Err(SimError::invalid("policy", "no policy named"));
        }
        Ok(out)
    }
}

impl FromStr for PolicyKind {
    type Err = SimError;
    fn from_str(s: &str) -> Result<Self, SimError> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                SimError::invalid(
                    "policy",
                    format!("unknown policy {s:?}; expected flotilla, hpa, keda, kpa or ray"),
                )
            })
    }
}

/// What the policies are configured from.
#[derive(Debug, Clone, PartialEq)]
pub struct Endpoint {
    /// Sequences per replica.
    pub max_concurrency: u32,
    /// Mean time a request holds a slot, ms.
    pub mean_service_ms: f64,
    /// Median cold start, ms.
    pub cold_start_ms: u64,
    /// Time-to-first-token objective, ms.
    pub slo_ms: u64,
    /// Most replicas any policy may ask for.
    pub max_replicas: u32,
}

/// Feed `policy` a recorded sequence of `(now_ms, observation)` and
/// collect its decisions: the simulator's adapter for replaying metrics
/// outside a simulation (the live server's loop makes the same calls).
pub fn replay(
    policy: &mut dyn Policy,
    steps: &[(u64, flotilla_scale::Observation)],
) -> Vec<flotilla_scale::Decision> {
    steps
        .iter()
        .map(|(now, obs)| policy.decide(*now, obs))
        .collect()
}

/// Build `kind` for `ep` (the server builds a replica pool's policy with
/// this too, so a setting tried in the simulator runs live unchanged).
pub fn build(kind: PolicyKind, ep: &Endpoint) -> Result<Box<dyn Policy + Send>, SimError> {
    let c = f64::from(ep.max_concurrency.max(1));
    let target = TARGET_UTILIZATION * c;
    let err = |source| SimError::Policy {
        policy: kind.as_str(),
        source,
    };
    let bounds = |min| Bounds::new(min, ep.max_replicas).map_err(err);
    Ok(match kind {
        PolicyKind::Flotilla => {
            if !(ep.mean_service_ms.is_finite() && ep.mean_service_ms > 0.0) {
                return Err(SimError::invalid("mean_service_ms", "must be positive"));
            }
            let cfg = FlotillaConfig::new(
                ColdStart {
                    provision_ms: 0,
                    pull_ms: 0,
                    load_ms: ep.cold_start_ms,
                },
                ScaleService {
                    service_rate: c * 1000.0 / ep.mean_service_ms,
                    max_concurrency: ep.max_concurrency,
                },
                ep.slo_ms as f64,
            );
            Box::new(Flotilla::new(cfg, bounds(0)?).map_err(err)?)
        }
        PolicyKind::Hpa => {
            let cfg = HpaConfig::new(vec![MetricTarget::per_replica(Signal::Concurrency, target)]);
            Box::new(Hpa::new(cfg, bounds(1)?).map_err(err)?)
        }
        PolicyKind::Keda => Box::new(
            Keda::new(KedaConfig::new(Signal::Concurrency, target), bounds(0)?).map_err(err)?,
        ),
        PolicyKind::Kpa => {
            let cfg = KpaConfig {
                target_concurrency: c,
                target_utilization: TARGET_UTILIZATION,
                ..KpaConfig::default()
            };
            Box::new(Kpa::new(cfg, bounds(0)?).map_err(err)?)
        }
        PolicyKind::Ray => {
            let cfg = RayServeConfig {
                target_ongoing_requests: target,
                ..RayServeConfig::default()
            };
            Box::new(RayServe::new(cfg, bounds(1)?).map_err(err)?)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lists_and_names_the_field() {
        let l = PolicyKind::parse_list("flotilla, HPA,kpa,hpa").unwrap();
        assert_eq!(
            l,
            vec![PolicyKind::Flotilla, PolicyKind::Hpa, PolicyKind::Kpa]
        );
        let e = PolicyKind::parse_list("hpa,vpa").unwrap_err().to_string();
        assert!(e.contains("policy") && e.contains("vpa"), "{e}");
        assert!(PolicyKind::parse_list(" , ").is_err());
    }

    #[test]
    fn every_policy_builds_with_its_default_minimum() {
        let ep = Endpoint {
            max_concurrency: 32,
            mean_service_ms: 2_000.0,
            cold_start_ms: 60_000,
            slo_ms: 2_000,
            max_replicas: 100,
        };
        let mins: Vec<u32> = PolicyKind::ALL
            .iter()
            .map(|&k| build(k, &ep).unwrap().bounds().min())
            .collect();
        assert_eq!(mins, vec![0, 1, 0, 0, 1]);
        let names: Vec<&str> = PolicyKind::ALL
            .iter()
            .map(|&k| build(k, &ep).unwrap().name())
            .collect();
        assert_eq!(names, PolicyKind::ALL.map(PolicyKind::as_str).to_vec());
    }
}
