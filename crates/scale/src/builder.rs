//! The policy builder: which policies there are ([`PolicyKind`]), what an
//! operator configures them from ([`Endpoint`]), and [`build`], which turns
//! the two into a ready [`Policy`].
//!
//! It lives here, beside the policies, so that the live server and the
//! simulator build a pool's policy with the same function: a setting tried
//! in `flotilla simulate` runs live unchanged, and neither of the two
//! needs the other to get it.
//!
//! Every baseline targets the same per-replica load, 70 % of the replica's
//! maximum concurrency (Knative's default target utilisation; HPA, KEDA
//! and Ray Serve get the same number so a comparison is of algorithms, not
//! of targets), on the concurrency signal (in flight + queued), which is
//! what all four recommend for request-serving workloads. Minimums follow
//! each system's default: HPA 1 (it cannot scale to zero), Ray Serve 1
//! (`min_replicas` default), KEDA and Knative 0. Everything else is the
//! published default, as implemented in this crate.
//!
//! Flotilla's policy gets what an operator knows about the endpoint: its
//! SLO, the median cold start, the maximum concurrency and the mean service
//! time of a request.

use std::str::FromStr;

use crate::{
    Bounds, ColdStart, Decision, Flotilla, FlotillaConfig, Hpa, HpaConfig, Keda, KedaConfig, Kpa,
    KpaConfig, MetricTarget, Observation, Policy, RayServe, RayServeConfig, ScaleError,
    ServiceModel, Signal, TierEconomics, TieredFlotilla,
};

/// Target utilisation of the baselines' concurrency target.
pub const TARGET_UTILIZATION: f64 = 0.7;

/// One of the policies Flotilla can run (and the simulator compares).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PolicyKind {
    /// Flotilla's cold-start-aware policy.
    Flotilla,
    /// Kubernetes' Horizontal Pod Autoscaler.
    Hpa,
    /// KEDA.
    Keda,
    /// Knative's Pod Autoscaler.
    Kpa,
    /// Ray Serve's autoscaler.
    Ray,
}

impl PolicyKind {
    /// All, in report order.
    pub const ALL: [Self; 5] = [Self::Flotilla, Self::Hpa, Self::Keda, Self::Kpa, Self::Ray];

    /// Name used on the command line, in the API and in reports.
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
    pub fn parse_list(s: &str) -> Result<Vec<Self>, ScaleError> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let k = part.parse()?;
            if !out.contains(&k) {
                out.push(k);
            }
        }
        if out.is_empty() {
            return Err(ScaleError::NoPolicy);
        }
        Ok(out)
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyKind {
    type Err = ScaleError;
    fn from_str(s: &str) -> Result<Self, ScaleError> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| ScaleError::UnknownPolicy {
                name: s.to_string(),
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
/// collect its decisions: replaying metrics outside a live loop or a
/// simulation (both make the same calls).
pub fn replay(policy: &mut dyn Policy, steps: &[(u64, Observation)]) -> Vec<Decision> {
    steps
        .iter()
        .map(|(now, obs)| policy.decide(*now, obs))
        .collect()
}

/// Flotilla's configuration for `ep`: its cold start, its service model
/// (rate from the mean service time) and its SLO; the rest defaults.
fn flotilla_config(ep: &Endpoint) -> Result<FlotillaConfig, ScaleError> {
    if !(ep.mean_service_ms.is_finite() && ep.mean_service_ms > 0.0) {
        return Err(ScaleError::InvalidConfig {
            field: "mean_service_ms",
            reason: "must be positive",
        });
    }
    let c = f64::from(ep.max_concurrency.max(1));
    Ok(FlotillaConfig::new(
        ColdStart {
            provision_ms: 0,
            pull_ms: 0,
            load_ms: ep.cold_start_ms,
        },
        ServiceModel {
            service_rate: c * 1000.0 / ep.mean_service_ms,
            max_concurrency: ep.max_concurrency,
        },
        ep.slo_ms as f64,
    ))
}

/// Shortest peak window of the tiered policy's warm side: one second, the
/// untiered policy's decision cadence, so demand is never forgotten
/// between two decisions of the policy it replaces.
pub const TIERED_MIN_PEAK_WINDOW_MS: u64 = 1_000;

/// Flotilla's tiered policy for `ep` (`ep.cold_start_ms` is the cold start
/// of a replica that comes from neither host memory nor disk) with the
/// tiers of `econ`; scale to zero allowed.
pub fn build_tiered(ep: &Endpoint, econ: TierEconomics) -> Result<TieredFlotilla, ScaleError> {
    let err = |source| ScaleError::Policy {
        policy: "flotilla-tiered",
        source: Box::new(source),
    };
    let bounds = Bounds::new(0, ep.max_replicas).map_err(err)?;
    TieredFlotilla::new(
        flotilla_config(ep)?,
        econ,
        TIERED_MIN_PEAK_WINDOW_MS,
        bounds,
    )
    .map_err(err)
}

/// Build `kind` for `ep`. A configuration a policy rejects comes back as
/// [`ScaleError::Policy`] naming the policy.
pub fn build(kind: PolicyKind, ep: &Endpoint) -> Result<Box<dyn Policy + Send>, ScaleError> {
    let c = f64::from(ep.max_concurrency.max(1));
    let target = TARGET_UTILIZATION * c;
    let err = |source| ScaleError::Policy {
        policy: kind.as_str(),
        source: Box::new(source),
    };
    let bounds = |min| Bounds::new(min, ep.max_replicas).map_err(err);
    Ok(match kind {
        PolicyKind::Flotilla => {
            Box::new(Flotilla::new(flotilla_config(ep)?, bounds(0)?).map_err(err)?)
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

    fn endpoint() -> Endpoint {
        Endpoint {
            max_concurrency: 32,
            mean_service_ms: 2_000.0,
            cold_start_ms: 60_000,
            slo_ms: 2_000,
            max_replicas: 100,
        }
    }

    #[test]
    fn parses_lists_and_names_the_field() {
        let l = PolicyKind::parse_list("flotilla, HPA,kpa,hpa").unwrap();
        assert_eq!(
            l,
            vec![PolicyKind::Flotilla, PolicyKind::Hpa, PolicyKind::Kpa]
        );
        let e = PolicyKind::parse_list("hpa,vpa").unwrap_err().to_string();
        assert!(e.contains("policy") && e.contains("vpa"), "{e}");
        assert_eq!(PolicyKind::parse_list(" , "), Err(ScaleError::NoPolicy));
    }

    #[test]
    fn every_policy_builds_with_its_default_minimum() {
        let ep = endpoint();
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

    #[test]
    fn bad_settings_name_the_policy_or_the_field() {
        let zero_max = Endpoint {
            max_replicas: 0,
            ..endpoint()
        };
        match build(PolicyKind::Kpa, &zero_max) {
            Err(ScaleError::Policy { policy, source }) => {
                assert_eq!(policy, "kpa");
                assert!(matches!(*source, ScaleError::InvalidBounds { .. }));
            }
            other => panic!("expected a policy error, got {:?}", other.map(|p| p.name())),
        }
        let no_service = Endpoint {
            mean_service_ms: f64::NAN,
            ..endpoint()
        };
        let e = build(PolicyKind::Flotilla, &no_service).err().unwrap();
        assert!(e.to_string().contains("mean_service_ms"), "{e}");
    }

    #[test]
    fn replay_decides_once_per_step() {
        let mut p = build(PolicyKind::Hpa, &endpoint()).unwrap();
        let obs = Observation {
            ready: 1,
            starting: 0,
            in_flight: 40,
            queued: 0,
            requests_total: 0,
            gpu_utilization: 0.5,
            latency: None,
            slo_ms: None,
            custom: None,
        };
        let d = replay(p.as_mut(), &[(0, obs), (15_000, obs)]);
        assert_eq!(d.len(), 2);
        assert!(d.iter().all(|d| d.replicas >= 1));
    }
}
