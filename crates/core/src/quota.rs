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
}

/// GPUs a tenant's live instances hold now.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Usage {
    /// All GPUs held.
    pub gpus_total: u32,
    /// GPUs held by model.
    pub gpus_per_model: BTreeMap<String, u32>,
}

impl Quota {
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
        };
        let u = usage(2, &[("H100", 2)]);
        let e = q.admit(&u, &["H100".into()], 1).unwrap_err();
        assert_eq!(e.quota, "gpus_per_model.H100");
        assert!(q.admit(&u, &["H100".into(), "L40S".into()], 1).is_ok());
        assert!(!q.model_fits(&u, "H100", 1));
        assert!(q.model_fits(&u, "L40S", 8));
    }
}
