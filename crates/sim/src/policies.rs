//! The policies under test, configured the same way for every trace: the
//! kinds, the endpoint settings and the builder are `flotilla-scale`'s
//! ([`flotilla_scale::builder`]), the same the live server builds a replica
//! pool's policy with, so a setting tried here runs live unchanged. This
//! module only names the builder's errors in the simulator's terms.

pub use flotilla_scale::builder::{replay, Endpoint, PolicyKind, TARGET_UTILIZATION};
use flotilla_scale::{Policy, ScaleError, TierEconomics};

use crate::SimError;

/// Build `kind` for `ep` (see [`flotilla_scale::builder::build`]).
pub fn build(kind: PolicyKind, ep: &Endpoint) -> Result<Box<dyn Policy + Send>, SimError> {
    flotilla_scale::builder::build(kind, ep).map_err(|e| named(kind.as_str(), e))
}

/// Build Flotilla's tiered policy for `ep` and `econ` (see
/// [`flotilla_scale::builder::build_tiered`]), its queue tolerance fixed
/// at `fixed_tolerance_ms` when that is `Some` (for comparisons; `None`:
/// learned from measured prefill and restore times).
pub fn build_tiered(
    ep: &Endpoint,
    econ: TierEconomics,
    fixed_tolerance_ms: Option<u64>,
) -> Result<Box<dyn Policy + Send>, SimError> {
    match flotilla_scale::builder::build_tiered(ep, econ) {
        Ok(p) => Ok(match fixed_tolerance_ms {
            Some(ms) => Box::new(p.with_fixed_queue_tolerance(ms)),
            None => Box::new(p),
        }),
        Err(e) => Err(named("flotilla-tiered", e)),
    }
}

fn named(policy: &'static str, e: ScaleError) -> SimError {
    match e {
        ScaleError::InvalidConfig { field, reason } => SimError::invalid(field, reason),
        ScaleError::Policy { policy, source } => SimError::Policy {
            policy,
            source: *source,
        },
        other => SimError::Policy {
            policy,
            source: other,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_a_policy_rejects_name_it() {
        let ep = Endpoint {
            max_concurrency: 32,
            mean_service_ms: 2_000.0,
            cold_start_ms: 60_000,
            slo_ms: 2_000,
            max_replicas: 0,
        };
        let e = build(PolicyKind::Hpa, &ep).err().unwrap().to_string();
        assert!(e.starts_with("policy hpa:"), "{e}");
        let ep = Endpoint {
            mean_service_ms: 0.0,
            max_replicas: 10,
            ..ep
        };
        let e = build(PolicyKind::Flotilla, &ep).err().unwrap().to_string();
        assert!(e.contains("mean_service_ms"), "{e}");
    }
}
