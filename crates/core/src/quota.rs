//! Per-tenant GPU quotas: a total and optional per-model limits.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::QuotaExceeded;

/// A tenant's limits. `None` means unlimited.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Quota {
    /// Most GPUs the tenant's live instances may hold at once.
    #[serde(default)]
    pub gpus_total: Option<u32>,
    /// Most GPUs of one model, keyed by catalog model name.
    #[serde(default)]
    pub gpus_per_model: BTreeMap<String, u32>,
    /// GPUs guaranteed to the tenant (at most `gpus_total`). Its work
    /// within the guarantee may take back, by preemption with the notice,
    /// capacity that other tenants borrowed: their preemptible work beyond
    /// their own guarantee. Absent: nothing is guaranteed, so everything
    /// the tenant holds is borrowed capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus_guaranteed: Option<u32>,
    /// Fair-share weight (1-1000, default 1): when tenants queue work, one
    /// of weight 2 is entitled to twice the recent GPU-time of one of
    /// weight 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

/// Largest fair-share weight.
pub const MAX_WEIGHT: u32 = 1000;

/// GPUs a tenant's live instances hold now.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Usage {
    /// All GPUs held.
    pub gpus_total: u32,
    /// GPUs held by model.
    pub gpus_per_model: BTreeMap<String, u32>,
}

impl Quota {
    /// Checks the guarantee and the weight; errors name the field.
    pub fn validate(&self) -> Result<(), crate::FieldError> {
        if let (Some(g), Some(t)) = (self.gpus_guaranteed, self.gpus_total) {
            if g > t {
                return Err(crate::FieldError::new(
                    "gpus_guaranteed",
                    format!("must be at most gpus_total ({t}), got {g}"),
                ));
            }
        }
        if let Some(w) = self.weight {
            if w == 0 || w > MAX_WEIGHT {
                return Err(crate::FieldError::new(
                    "weight",
                    format!("must be between 1 and {MAX_WEIGHT}, got {w}"),
                ));
            }
        }
        Ok(())
    }

    /// The fair-share weight, 1 when unset.
    pub fn weight_or_default(&self) -> u32 {
        self.weight.unwrap_or(1)
    }

    /// Whether `count` more GPUs on top of `usage` stay within the
    /// guarantee (such work may reclaim borrowed capacity).
    pub fn within_guarantee(&self, usage: &Usage, count: u32) -> bool {
        self.gpus_guaranteed
            .is_some_and(|g| usage.gpus_total.saturating_add(count) <= g)
    }

    /// Checks a request for `count` GPUs of any of `models` (empty: any
    /// model). The total must fit; of the per-model limits, at least one
    /// allowed model must still fit, otherwise the first blocking one is
    /// reported. Placement later only picks models that fit
    /// ([`Quota::model_fits`]).
    pub fn admit(&self, usage: &Usage, models: &[String], count: u32) -> Result<(), QuotaExceeded> {
        if let Some(limit) = self.gpus_total {
            if usage.gpus_total.saturating_add(count) > limit {
                return Err(QuotaExceeded {
                    quota: "gpus_total".into(),
                    limit,
                    in_use: usage.gpus_total,
                    requested: count,
                });
            }
        }
        if models.is_empty() {
            return Ok(());
        }
        let mut first_block = None;
        for m in models {
            match self.block(usage, m, count) {
                None => return Ok(()),
                Some(e) => {
                    first_block.get_or_insert(e);
                }
            }
        }
        first_block.map_or(Ok(()), Err)
    }

    /// Whether `count` more GPUs of `model` stay within its limit.
    pub fn model_fits(&self, usage: &Usage, model: &str, count: u32) -> bool {
        self.block(usage, model, count).is_none()
    }

    fn block(&self, usage: &Usage, model: &str, count: u32) -> Option<QuotaExceeded> {
        let limit = *self.gpus_per_model.get(model)?;
        let in_use = usage.gpus_per_model.get(model).copied().unwrap_or(0);
        (in_use.saturating_add(count) > limit).then(|| QuotaExceeded {
            quota: format!("gpus_per_model.{model}"),
            limit,
            in_use,
            requested: count,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(total: u32, per: &[(&str, u32)]) -> Usage {
        Usage {
            gpus_total: total,
            gpus_per_model: per.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        }
    }

    #[test]
    fn total_limit_names_quota_limit_and_use() {
        let q = Quota {
            gpus_total: Some(4),
            ..Default::default()
        };
        assert!(q.admit(&usage(2, &[]), &[], 2).is_ok());
        let e = q.admit(&usage(3, &[]), &[], 2).unwrap_err();
        assert_eq!(
            (e.quota.as_str(), e.limit, e.in_use, e.requested),
            ("gpus_total", 4, 3, 2)
        );
        assert!(e.to_string().contains("limit 4"));
    }

    #[test]
    fn per_model_limit_blocks_only_when_every_allowed_model_is_full() {
        let q = Quota {
            gpus_total: None,
            gpus_per_model: [("H100".to_string(), 2)].into(),
            ..Default::default()
        };
        let u = usage(2, &[("H100", 2)]);
        let e = q.admit(&u, &["H100".into()], 1).unwrap_err();
        assert_eq!(e.quota, "gpus_per_model.H100");
        assert!(q.admit(&u, &["H100".into(), "L40S".into()], 1).is_ok());
        assert!(!q.model_fits(&u, "H100", 1));
        assert!(q.model_fits(&u, "L40S", 8));
    }

    #[test]
    fn guarantee_and_weight_are_checked_and_applied() {
        let q = Quota {
            gpus_total: Some(8),
            gpus_guaranteed: Some(4),
            weight: Some(3),
            ..Default::default()
        };
        assert!(q.validate().is_ok());
        assert!(q.within_guarantee(&usage(2, &[]), 2));
        assert!(!q.within_guarantee(&usage(3, &[]), 2));
        assert!(!Quota::default().within_guarantee(&usage(0, &[]), 1));
        assert_eq!(
            (q.weight_or_default(), Quota::default().weight_or_default()),
            (3, 1)
        );
        let over = Quota {
            gpus_guaranteed: Some(9),
            ..q.clone()
        };
        assert_eq!(over.validate().unwrap_err().field, "gpus_guaranteed");
        let zero = Quota {
            weight: Some(0),
            ..q
        };
        assert_eq!(zero.validate().unwrap_err().field, "weight");
    }
}
