//! Quotas: a guaranteed and a borrowable (burst) GPU quota per tenant.
//!
//! - Within its guarantee a tenant is always admitted, and if the capacity is
//!   held by others' borrowed work it gets it back by preemption
//!   ([`crate::preempt`], with [`crate::preempt::Preemptor::reclaiming`]).
//! - Beyond its guarantee, up to guarantee + burst, a tenant may borrow
//!   capacity that is idle right now. Such an allocation is **borrowed**: the
//!   server records it with `borrowed = true` and `preemptible = true`
//!   ([`crate::alloc::Allocation`]) so it can be reclaimed.
//! - Beyond guarantee + burst it is refused.
//!
//! Quotas count GPU share (milli-GPU), the scarce resource; CPU and memory
//! are bounded by the nodes. A request that straddles the guarantee (2 GPUs
//! left of it, 4 asked) is borrowed as a whole: an allocation is preempted
//! whole, so it cannot be half protected.

use std::fmt;

use crate::alloc::{Allocation, Tenant};

/// One tenant's GPU quota in milli-GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Quota {
    /// Always available to the tenant; reclaimed from borrowers if needed.
    pub guaranteed_milli: u64,
    /// How much more the tenant may borrow while it is idle elsewhere.
    pub burst_milli: u64,
}

impl Quota {
    pub fn limit_milli(&self) -> u64 {
        self.guaranteed_milli.saturating_add(self.burst_milli)
    }
}

/// What a tenant holds now, in milli-GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QuotaUse {
    pub guaranteed_milli: u64,
    pub borrowed_milli: u64,
}

impl QuotaUse {
    /// Sums `tenant`'s allocations.
    pub fn of<'a>(tenant: Tenant, allocations: impl IntoIterator<Item = &'a Allocation>) -> Self {
        let mut u = QuotaUse::default();
        for a in allocations.into_iter().filter(|a| a.tenant == tenant) {
            let m = u64::from(a.request.gpu.total_milli());
            if a.borrowed {
                u.borrowed_milli = u.borrowed_milli.saturating_add(m);
            } else {
                u.guaranteed_milli = u.guaranteed_milli.saturating_add(m);
            }
        }
        u
    }

    pub fn total_milli(&self) -> u64 {
        self.guaranteed_milli.saturating_add(self.borrowed_milli)
    }
}

/// The verdict on one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Within the guarantee: admit; may reclaim borrowed capacity.
    Guaranteed,
    /// Beyond the guarantee, on idle capacity: admit as borrowed and
    /// preemptible.
    Borrowed,
    Denied(Denial),
}

/// Why a request was refused, with the numbers a person needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denial {
    /// It would take the tenant past guarantee + burst.
    OverQuota {
        used_milli: u64,
        requested_milli: u64,
        limit_milli: u64,
    },
    /// It is within burst but there is not enough idle capacity to borrow.
    NoIdleCapacity {
        requested_milli: u64,
        idle_milli: u64,
    },
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gpus = |m: u64| m as f64 / 1000.0;
        match *self {
            Denial::OverQuota {
                used_milli,
                requested_milli,
                limit_milli,
            } => write!(
                f,
                "quota exceeded: {} GPUs in use + {} requested > {} allowed (guaranteed + burst)",
                gpus(used_milli),
                gpus(requested_milli),
                gpus(limit_milli)
            ),
            Denial::NoIdleCapacity {
                requested_milli,
                idle_milli,
            } => write!(
                f,
                "beyond guaranteed quota and only {} GPUs idle to borrow, {} requested",
                gpus(idle_milli),
                gpus(requested_milli)
            ),
        }
    }
}

/// Admits a request of `requested_milli` from a tenant with `quota` that
/// holds `used`. `idle_milli` is the cluster's unallocated GPU share that the
/// request could borrow (for a model-restricted request, of those models).
pub fn admit(quota: &Quota, used: &QuotaUse, requested_milli: u64, idle_milli: u64) -> Admission {
    let after = used.total_milli().saturating_add(requested_milli);
    if after <= quota.guaranteed_milli {
        return Admission::Guaranteed;
    }
    if after > quota.limit_milli() {
        return Admission::Denied(Denial::OverQuota {
            used_milli: used.total_milli(),
            requested_milli,
            limit_milli: quota.limit_milli(),
        });
    }
    if requested_milli > idle_milli {
        return Admission::Denied(Denial::NoIdleCapacity {
            requested_milli,
            idle_milli,
        });
    }
    Admission::Borrowed
}

#[cfg(test)]
mod tests {
    use super::*;

    const Q: Quota = Quota {
        guaranteed_milli: 4000,
        burst_milli: 2000,
    };

    fn used(g: u64, b: u64) -> QuotaUse {
        QuotaUse {
            guaranteed_milli: g,
            borrowed_milli: b,
        }
    }

    #[test]
    fn within_guarantee_is_admitted_even_on_a_full_cluster() {
        assert_eq!(admit(&Q, &used(3000, 0), 1000, 0), Admission::Guaranteed);
    }

    #[test]
    fn beyond_guarantee_borrows_only_idle_capacity() {
        assert_eq!(admit(&Q, &used(4000, 0), 2000, 2000), Admission::Borrowed);
        // Straddling the guarantee borrows the whole request.
        assert_eq!(admit(&Q, &used(3000, 0), 2000, 8000), Admission::Borrowed);
        let d = admit(&Q, &used(4000, 0), 2000, 1500);
        assert_eq!(
            d,
            Admission::Denied(Denial::NoIdleCapacity {
                requested_milli: 2000,
                idle_milli: 1500
            })
        );
    }

    #[test]
    fn beyond_burst_is_refused_with_numbers() {
        let Admission::Denied(d) = admit(&Q, &used(4000, 1500), 1000, 9000) else {
            panic!("over quota");
        };
        assert_eq!(
            d.to_string(),
            "quota exceeded: 5.5 GPUs in use + 1 requested > 6 allowed (guaranteed + burst)"
        );
    }
}
