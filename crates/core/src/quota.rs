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
    /// All GPUs held (shares summed, rounded up to whole GPUs).
    pub gpus_total: u32,
    /// GPUs held by model (likewise).
    pub gpus_per_model: BTreeMap<String, u32>,
    /// Milli-GPU held, a share counted by its share (a 0.25 share is 250):
    /// what the limits are checked against, so two half shares fit a
    /// one-GPU quota. Kept by [`Usage::add`].
    #[serde(default)]
    pub gpu_milli_total: u64,
    /// Milli-GPU held by model.
    #[serde(default)]
    pub gpu_milli_per_model: BTreeMap<String, u64>,
}

fn whole_gpus(milli: u64) -> u32 {
    u32::try_from(milli.div_ceil(1000)).unwrap_or(u32::MAX)
}

impl Usage {
    /// Counts `count` GPUs of `milli_per_gpu` each (1000: whole GPUs) of
    /// `model` (`None`: not known yet, only the total counts).
    pub fn add(&mut self, model: Option<&str>, count: u32, milli_per_gpu: u16) {
        let milli = u64::from(count) * u64::from(milli_per_gpu);
        self.gpu_milli_total = self.total_milli() + milli;
        self.gpus_total = whole_gpus(self.gpu_milli_total);
        if let Some(m) = model {
            let held = self.model_milli(m) + milli;
            self.gpu_milli_per_model.insert(m.to_string(), held);
            self.gpus_per_model.insert(m.to_string(), whole_gpus(held));
        }
    }

    /// Milli-GPU held in total. A usage written with whole GPUs only (no
    /// milli recorded) counts 1000 per GPU.
    pub fn total_milli(&self) -> u64 {
        if self.gpu_milli_total == 0 {
            u64::from(self.gpus_total) * 1000
        } else {
            self.gpu_milli_total
        }
    }

    /// Milli-GPU of `model` held, with the same rule.
    pub fn model_milli(&self, model: &str) -> u64 {
        match self.gpu_milli_per_model.get(model) {
            Some(&m) if m > 0 => m,
            _ => u64::from(self.gpus_per_model.get(model).copied().unwrap_or(0)) * 1000,
        }
    }
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

    /// Whether no limit is set (no total, no per-model limit): then every
    /// request is admitted whatever is in use, so admission need not count
    /// what the tenant holds, a read that grows with its queue.
    pub fn limits_nothing(&self) -> bool {
        self.gpus_total.is_none() && self.gpus_per_model.is_empty()
    }

    /// The fair-share weight, 1 when unset.
    pub fn weight_or_default(&self) -> u32 {
        self.weight.unwrap_or(1)
    }

    /// Whether `count` more GPUs on top of `usage` stay within the
    /// guarantee (such work may reclaim borrowed capacity).
    pub fn within_guarantee(&self, usage: &Usage, count: u32) -> bool {
        self.within_guarantee_milli(usage, u64::from(count) * 1000)
    }

    /// [`Quota::within_guarantee`] for `milli` more milli-GPU (a share).
    pub fn within_guarantee_milli(&self, usage: &Usage, milli: u64) -> bool {
        self.gpus_guaranteed
            .is_some_and(|g| usage.total_milli() + milli <= u64::from(g) * 1000)
    }

    /// Checks a request for `count` GPUs of any of `models` (empty: any
    /// model). The total must fit; of the per-model limits, at least one
    /// allowed model must still fit, otherwise the first blocking one is
    /// reported. Placement later only picks models that fit
    /// ([`Quota::model_fits`]).
    pub fn admit(&self, usage: &Usage, models: &[String], count: u32) -> Result<(), QuotaExceeded> {
        self.admit_milli(usage, models, u64::from(count) * 1000)
    }

    /// [`Quota::admit`] for `milli` milli-GPU: a share counts its share, so
    /// four 0.25 shares fit a quota of one GPU and a fifth does not.
    pub fn admit_milli(
        &self,
        usage: &Usage,
        models: &[String],
        milli: u64,
    ) -> Result<(), QuotaExceeded> {
        if let Some(limit) = self.gpus_total {
            if usage.total_milli() + milli > u64::from(limit) * 1000 {
                return Err(QuotaExceeded {
                    quota: "gpus_total".into(),
                    limit,
                    in_use: whole_gpus(usage.total_milli()),
                    requested: whole_gpus(milli),
                });
            }
        }
        if models.is_empty() {
            return Ok(());
        }
        let mut first_block = None;
        for m in models {
            match self.block(usage, m, milli) {
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
        self.model_fits_milli(usage, model, u64::from(count) * 1000)
    }

    /// [`Quota::model_fits`] for `milli` milli-GPU (a share).
    pub fn model_fits_milli(&self, usage: &Usage, model: &str, milli: u64) -> bool {
        self.block(usage, model, milli).is_none()
    }

    fn block(&self, usage: &Usage, model: &str, milli: u64) -> Option<QuotaExceeded> {
        let limit = *self.gpus_per_model.get(model)?;
        let in_use = usage.model_milli(model);
        (in_use + milli > u64::from(limit) * 1000).then(|| QuotaExceeded {
            quota: format!("gpus_per_model.{model}"),
            limit,
            in_use: whole_gpus(in_use),
            requested: whole_gpus(milli),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quota_without_limits_admits_anything_and_says_so() {
        let huge = Usage {
            gpus_total: u32::MAX,
            gpu_milli_total: u64::from(u32::MAX) * 1000,
            ..Usage::default()
        };
        let open = Quota {
            gpus_guaranteed: Some(2),
            weight: Some(5),
            ..Quota::default()
        };
        assert!(open.limits_nothing());
        assert!(open
            .admit_milli(&huge, &["H100".to_string()], 1_000_000)
            .is_ok());
        let total = Quota {
            gpus_total: Some(8),
            ..Quota::default()
        };
        assert!(!total.limits_nothing());
        let per_model = Quota {
            gpus_per_model: [("H100".to_string(), 1)].into(),
            ..Quota::default()
        };
        assert!(!per_model.limits_nothing());
        assert!(per_model
            .admit(&usage(0, &[("H100", 1)]), &["H100".to_string()], 1)
            .is_err());
    }

    fn usage(total: u32, per: &[(&str, u32)]) -> Usage {
        Usage {
            gpus_total: total,
            gpus_per_model: per.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn shares_count_by_their_share() {
        let q = Quota {
            gpus_total: Some(1),
            gpus_per_model: [("H100".to_string(), 1)].into(),
            gpus_guaranteed: Some(1),
            ..Default::default()
        };
        let mut u = Usage::default();
        let h100 = ["H100".to_string()];
        for _ in 0..3 {
            assert!(q.admit_milli(&u, &h100, 250).is_ok());
            u.add(Some("H100"), 1, 250);
        }
        assert_eq!((u.gpus_total, u.gpus_per_model["H100"]), (1, 1));
        assert!(q.model_fits_milli(&u, "H100", 250));
        assert!(q.within_guarantee_milli(&u, 250));
        u.add(None, 1, 250);
        let e = q.admit_milli(&u, &h100, 1).unwrap_err();
        assert_eq!(
            (e.quota.as_str(), e.in_use, e.requested),
            ("gpus_total", 1, 1)
        );
        assert!(
            q.model_fits_milli(&u, "H100", 250),
            "the fourth is not yet an H100"
        );
        u.add(Some("H100"), 1, 1000);
        assert_eq!((u.gpus_total, u.gpus_per_model["H100"]), (2, 2), "{u:?}");
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
