//! Who holds what: the running allocations that quotas, fair share and
//! preemption reason about, and the small vocabulary they share (tenants,
//! tiers, resource vectors).
//!
//! Identifiers are plain integers: the server keeps its own ids (`ten_...`,
//! `job_...`) and hands this crate dense indices, as it already does for
//! nodes and GPU models, so that nothing here allocates strings on the hot
//! path and decisions stay reproducible.

use crate::request::Request;
use crate::select::Placement;

/// A tenant, as an index the caller assigns.
pub type Tenant = u32;

/// A running allocation, as an id the caller assigns.
pub type AllocationId = u64;

/// Service tier of a request or allocation (the 1, 2, 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// Tier 1: dedicated capacity. Never preempted.
    Dedicated,
    /// Tier 2: shared or spot capacity, preemptible when so flagged.
    Shared,
    /// Tier 3: queued batch work.
    Queued,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Dedicated, Tier::Shared, Tier::Queued];

    /// The number for the tier: 1, 2 or 3.
    pub fn number(self) -> u8 {
        match self {
            Tier::Dedicated => 1,
            Tier::Shared => 2,
            Tier::Queued => 3,
        }
    }

    /// The tier with the number, if any.
    pub fn from_number(n: u8) -> Option<Tier> {
        Tier::ALL.into_iter().find(|t| t.number() == n)
    }

    /// The tier numbered `n`, dedicated for a number outside 1..=3 (which
    /// the API's validation rules out): the tier that nothing preempts, so
    /// a bad record can never make work preemptible.
    pub fn from_number_or_dedicated(n: u8) -> Tier {
        Tier::from_number(n).unwrap_or(Tier::Dedicated)
    }

    pub(crate) fn index(self) -> usize {
        usize::from(self.number() - 1)
    }
}

/// An amount of each resource the engine tracks, for fair share and quotas.
/// Integers so that sums are exact; GPU in milli-GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Resources {
    pub gpu_milli: u64,
    pub cpu_milli: u64,
    pub mem_mib: u64,
}

impl Resources {
    /// What one request holds.
    pub fn of(req: &Request) -> Resources {
        Resources {
            gpu_milli: u64::from(req.gpu.total_milli()),
            cpu_milli: u64::from(req.cpu_milli),
            mem_mib: req.mem_mib,
        }
    }

    /// What a gang (or any set of requests) holds together.
    pub fn sum<'a>(reqs: impl IntoIterator<Item = &'a Request>) -> Resources {
        reqs.into_iter()
            .map(Resources::of)
            .fold(Resources::default(), Resources::saturating_add)
    }

    pub fn saturating_add(self, o: Resources) -> Resources {
        Resources {
            gpu_milli: self.gpu_milli.saturating_add(o.gpu_milli),
            cpu_milli: self.cpu_milli.saturating_add(o.cpu_milli),
            mem_mib: self.mem_mib.saturating_add(o.mem_mib),
        }
    }

    pub(crate) fn as_array(self) -> [u64; 3] {
        [self.gpu_milli, self.cpu_milli, self.mem_mib]
    }
}

/// One running (or starting) allocation: a request placed on a node, with
/// the facts quotas and preemption need about its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub id: AllocationId,
    pub tenant: Tenant,
    pub tier: Tier,
    /// Higher is more important.
    pub priority: i32,
    /// Whether the workload accepted being preempted (spot, or borrowed).
    pub preemptible: bool,
    /// Placed on capacity borrowed beyond the tenant's guaranteed quota
    /// ([`crate::quota`]); the server must also set `preemptible` for it.
    pub borrowed: bool,
    pub request: Request,
    pub placement: Placement,
    /// When it started, on the caller's clock (ms).
    pub started_ms: u64,
}

impl Allocation {
    /// Milli-GPU-milliseconds it has run by `now_ms`: the work a preemption
    /// would throw away if the workload never checkpointed.
    pub fn gpu_milli_ms_run(&self, now_ms: u64) -> u128 {
        u128::from(self.request.gpu.total_milli())
            * u128::from(now_ms.saturating_sub(self.started_ms))
    }
}
