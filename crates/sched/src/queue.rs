//! The queue: in what order pending work is tried, and when smaller work
//! may jump ahead of a blocked head (backfill).
//!
//! Order ([`order`]): tier first (tier 1 first), then priority (higher
//! first), the lexicographic rank preemption also uses; within a level,
//! weighted fair share across tenants; then FIFO by submission time.
//!
//! Fair share is dominant-resource fairness (DRF) over *recent* usage: each
//! tenant's GPU, CPU and memory usage (resource × time) decays exponentially
//! with a configurable half-life, so last week's burst does not starve a
//! tenant today but last hour's does count. A tenant's dominant share is its
//! largest usage fraction across the three resources, divided by its weight
//! (tenant weight × the weight of the item's tier; within one level every
//! item has the same tier, so the tier weight scales all tenants alike and
//! only matters to callers comparing shares across tiers). Within a level the
//! queue interleaves tenants by progressive filling: it repeatedly takes the
//! oldest item of the tenant with the lowest dominant share, then charges
//! that tenant the item's projected usage (demand × expected runtime, or a
//! configurable default), so a tenant with a long backlog does not take
//! every front position.
//!
//! Backfill ([`reserve`], [`backfill_allowed`]) is EASY backfilling: the
//! blocked head gets a reservation, the earliest time it fits given the
//! expected end times of running work, on particular nodes. Other work may
//! start now on any other node, or on a reserved node only if it is expected
//! to end by the reservation or leaves room for the head there. Work whose
//! end is unknown never counts as ending: if the head's start cannot be
//! known, every node that could ever host it is reserved.
//!
//! Everything is pure: time is passed in (ms), nothing is read from a clock.

use std::collections::BTreeMap;

use rand::Rng;

use crate::alloc::{Resources, Tenant, Tier};
use crate::filter::check;
use crate::gang::{place_gang, Gang, GangDecision, GangExplanation, GangPlacement, Locality};
use crate::request::{GpuDemand, Request};
use crate::select::{Decision, Engine, Placement};
use crate::snapshot::{Cluster, Node, NodeState};
use crate::{Error, MILLI};

/// Fair-share settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FairShareConfig {
    /// Usage halves in value every this many ms; 0 means it never decays.
    pub half_life_ms: u64,
    /// Weight of an item by tier (tier 1, 2, 3), multiplying the tenant's
    /// weight: a larger weight means a larger fair share.
    pub tier_weights: [f64; 3],
    /// Runtime assumed for an item without an expected runtime when
    /// projecting its usage while ordering.
    pub default_runtime_ms: u64,
}

impl Default for FairShareConfig {
    /// A 24 h half-life (yesterday counts half), equal tier weights, and one
    /// hour for work of unknown length.
    fn default() -> Self {
        FairShareConfig {
            half_life_ms: 24 * 3_600_000,
            tier_weights: [1.0; 3],
            default_runtime_ms: 3_600_000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct TenantUsage {
    weight: f64,
    /// Decayed resource-milliseconds (GPU milli·ms, CPU milli·ms, MiB·ms)
    /// as of the state's `as_of_ms`.
    usage: [f64; 3],
}

/// Recent usage per tenant, decayed to `as_of_ms`.
#[derive(Debug, Clone, PartialEq)]
pub struct FairShareState {
    config: FairShareConfig,
    capacity: [f64; 3],
    as_of_ms: u64,
    tenants: BTreeMap<Tenant, TenantUsage>,
}

fn valid_weight(w: f64) -> bool {
    w.is_finite() && w > 0.0
}

impl FairShareState {
    /// Empty usage for a cluster of `capacity` (the denominators of the
    /// dominant share; a zero capacity makes that resource not count).
    pub fn new(config: FairShareConfig, capacity: Resources) -> Result<Self, Error> {
        if !config.tier_weights.iter().all(|&w| valid_weight(w)) {
            return Err(Error::InvalidRequest("tier weights must be positive"));
        }
        Ok(FairShareState {
            config,
            capacity: capacity.as_array().map(|c| c as f64),
            as_of_ms: 0,
            tenants: BTreeMap::new(),
        })
    }

    pub fn config(&self) -> &FairShareConfig {
        &self.config
    }

    /// Sets a tenant's weight (default 1). Must be positive and finite.
    pub fn set_weight(&mut self, tenant: Tenant, weight: f64) -> Result<(), Error> {
        if !valid_weight(weight) {
            return Err(Error::InvalidRequest("a tenant weight must be positive"));
        }
        self.entry(tenant).weight = weight;
        Ok(())
    }

    pub fn weight(&self, tenant: Tenant) -> f64 {
        self.tenants.get(&tenant).map_or(1.0, |t| t.weight)
    }

    fn entry(&mut self, tenant: Tenant) -> &mut TenantUsage {
        self.tenants.entry(tenant).or_insert(TenantUsage {
            weight: 1.0,
            usage: [0.0; 3],
        })
    }

    /// The factor usage loses over `dt_ms`.
    fn decay(&self, dt_ms: u64) -> f64 {
        if self.config.half_life_ms == 0 {
            return 1.0;
        }
        0.5f64.powf(dt_ms as f64 / self.config.half_life_ms as f64)
    }

    /// Decays every tenant's usage to `now_ms`. Earlier times are ignored:
    /// the state never runs backwards.
    pub fn advance(&mut self, now_ms: u64) {
        if now_ms <= self.as_of_ms {
            return;
        }
        let f = self.decay(now_ms - self.as_of_ms);
        for t in self.tenants.values_mut() {
            for u in &mut t.usage {
                *u *= f;
            }
        }
        self.as_of_ms = now_ms;
    }

    /// Charges `tenant` for holding `held` from `from_ms` to `to_ms`,
    /// exactly: the integral of the decayed rate over the interval. Charge
    /// running work incrementally (each pass, up to now) or once when it
    /// ends; both give the same result.
    pub fn charge(&mut self, tenant: Tenant, held: Resources, from_ms: u64, to_ms: u64) {
        self.advance(to_ms);
        let dt = to_ms.saturating_sub(from_ms) as f64;
        let h = self.config.half_life_ms as f64;
        // ∫ e^{-λ(to - t)} dt over [from, to] with λ = ln 2 / h.
        let weight = if h == 0.0 {
            dt
        } else {
            let lambda = std::f64::consts::LN_2 / h;
            -(-lambda * dt).exp_m1() / lambda
        };
        let late = self.decay(self.as_of_ms.saturating_sub(to_ms));
        let amount = held.as_array().map(|r| r as f64 * weight * late);
        let t = self.entry(tenant);
        for (u, a) in t.usage.iter_mut().zip(amount) {
            *u += a;
        }
    }

    /// `tenant`'s decayed usage at `now_ms` (resource·ms).
    fn usage_at(&self, tenant: Tenant, now_ms: u64) -> [f64; 3] {
        let f = self.decay(now_ms.saturating_sub(self.as_of_ms));
        self.tenants
            .get(&tenant)
            .map_or([0.0; 3], |t| t.usage.map(|u| u * f))
    }

    /// `tenant`'s decayed GPU usage at `now_ms`, in GPU-seconds.
    pub fn gpu_seconds(&self, tenant: Tenant, now_ms: u64) -> f64 {
        self.usage_at(tenant, now_ms)[0] / f64::from(MILLI) / 1000.0
    }

    fn dominant(&self, usage: &[f64; 3]) -> f64 {
        usage
            .iter()
            .zip(self.capacity)
            .filter(|(_, c)| *c > 0.0)
            .map(|(u, c)| u / c)
            .fold(0.0, f64::max)
    }

    /// `tenant`'s dominant share at `now_ms` divided by its weight: lower is
    /// served first.
    pub fn weighted_share(&self, tenant: Tenant, now_ms: u64) -> f64 {
        self.dominant(&self.usage_at(tenant, now_ms)) / self.weight(tenant)
    }
}

/// One pending piece of work (a job, an instance, a whole gang).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueItem {
    pub tenant: Tenant,
    pub tier: Tier,
    /// Higher first.
    pub priority: i32,
    pub submitted_ms: u64,
    /// What it holds while running (for a gang: all members).
    pub demand: Resources,
    pub expected_runtime_ms: Option<u64>,
}

/// The order in which to try `pending`: indices into it. Deterministic:
/// equal keys fall back to submission time, then index.
pub fn order(pending: &[QueueItem], usage: &FairShareState, now_ms: u64) -> Vec<usize> {
    order_with_running(pending, &[], usage, now_ms)
}

/// [`order`], with the work running now (`running`, as items: its demand
/// and its remaining runtime) counted in each tenant's projected usage from
/// the level of its own rank on, as if the queue had just picked it there.
/// Why: placing work moves it from the queue to `running`; counted this way
/// it weighs on exactly the same items on the next pass as it did when it
/// was picked, so a plan applied and planned again keeps its order (the
/// pass planner, [`crate::pass`]). Running work of a lower rank does not
/// weigh on a higher level, as queued work of a lower rank does not either.
pub fn order_with_running(
    pending: &[QueueItem],
    running: &[QueueItem],
    usage: &FairShareState,
    now_ms: u64,
) -> Vec<usize> {
    let mut held: Vec<&QueueItem> = running.iter().collect();
    held.sort_by_key(|r| (r.tier, std::cmp::Reverse(r.priority)));
    let mut next_held = 0;
    let mut idx: Vec<usize> = (0..pending.len()).collect();
    // Levels: tier (1 first), then priority (higher first), the same
    // lexicographic rank preemption uses (crate::preempt::Preemptor), so
    // the queue never places work ahead of work that would then evict it.
    idx.sort_by(|&a, &b| {
        let (x, y) = (&pending[a], &pending[b]);
        x.tier
            .cmp(&y.tier)
            .then(y.priority.cmp(&x.priority))
            .then(x.submitted_ms.cmp(&y.submitted_ms))
            .then(a.cmp(&b))
    });
    let mut projected: BTreeMap<Tenant, [f64; 3]> = BTreeMap::new();
    let mut out = Vec::with_capacity(pending.len());
    let mut start = 0;
    while start < idx.len() {
        let level = (pending[idx[start]].tier, pending[idx[start]].priority);
        let rank = (level.0, std::cmp::Reverse(level.1));
        while let Some(r) = held.get(next_held) {
            if (r.tier, std::cmp::Reverse(r.priority)) > rank {
                break;
            }
            let run = r
                .expected_runtime_ms
                .unwrap_or(usage.config.default_runtime_ms) as f64;
            let u = projected
                .entry(r.tenant)
                .or_insert_with(|| usage.usage_at(r.tenant, now_ms));
            for (x, d) in u.iter_mut().zip(r.demand.as_array()) {
                *x += d as f64 * run;
            }
            next_held += 1;
        }
        let end = idx[start..]
            .iter()
            .position(|&i| (pending[i].tier, pending[i].priority) != level)
            .map_or(idx.len(), |p| start + p);
        // Per tenant, FIFO (idx is already in submission order).
        let mut queues: BTreeMap<Tenant, std::collections::VecDeque<usize>> = BTreeMap::new();
        for &i in &idx[start..end] {
            queues.entry(pending[i].tenant).or_default().push_back(i);
        }
        loop {
            let mut best: Option<(f64, u64, usize, Tenant)> = None;
            for (&t, q) in &queues {
                let Some(&head) = q.front() else { continue };
                let item = &pending[head];
                let u = *projected
                    .entry(t)
                    .or_insert_with(|| usage.usage_at(t, now_ms));
                let w = usage.weight(t) * usage.config.tier_weights[item.tier.index()];
                let key = (usage.dominant(&u) / w, item.submitted_ms, head, t);
                let better = best.is_none_or(|b| {
                    key.0
                        .total_cmp(&b.0)
                        .then(key.1.cmp(&b.1))
                        .then(key.2.cmp(&b.2))
                        .is_lt()
                });
                if better {
                    best = Some(key);
                }
            }
            let Some((_, _, head, t)) = best else { break };
            if let Some(q) = queues.get_mut(&t) {
                q.pop_front();
            }
            out.push(head);
            let item = &pending[head];
            let run = item
                .expected_runtime_ms
                .unwrap_or(usage.config.default_runtime_ms) as f64;
            if let Some(u) = projected.get_mut(&t) {
                for (x, r) in u.iter_mut().zip(item.demand.as_array()) {
                    *x += r as f64 * run;
                }
            }
        }
        start = end;
    }
    out
}

/// Running work as backfill sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Running {
    pub request: Request,
    pub placement: Placement,
    /// When it is expected to end (ms); `None`: unknown, assumed never.
    pub expected_end_ms: Option<u64>,
}

/// Free capacity of one node at the reservation's start, before the head.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Projected {
    cpu: u32,
    mem: u64,
    gpus: Vec<u16>,
}

/// The blocked head's reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    /// When the head is expected to start; `None` when that cannot be known
    /// (it needs capacity held by work of unknown length).
    pub start_ms: Option<u64>,
    /// Where its members go at `start_ms` (empty when `start_ms` is None).
    pub plan: Vec<Placement>,
    /// Nodes reserved for it, ascending: the plan's nodes, or every node that
    /// could ever host a member when the start is unknown.
    pub nodes: Vec<u32>,
    /// The head's members, parallel to `plan`.
    requests: Vec<Request>,
    projected: BTreeMap<u32, Projected>,
}

/// Computes the head's reservation: releases running work in order of
/// expected end on a scratch copy of `cluster` until the head fits. Costs a
/// placement attempt per distinct end time (each O(nodes)). Does not change
/// `cluster`.
pub fn reserve<R: Rng + ?Sized>(
    engine: &mut Engine,
    cluster: &Cluster,
    running: &[Running],
    head: &Gang,
    now_ms: u64,
    rng: &mut R,
) -> Reservation {
    let mut ending: Vec<(u64, &Running)> = running
        .iter()
        .filter_map(|r| r.expected_end_ms.map(|e| (e.max(now_ms), r)))
        .collect();
    ending.sort_by_key(|e| e.0);
    let mut scratch = cluster.clone();
    let mut k = 0;
    let mut at = now_ms;
    loop {
        while k < ending.len() && ending[k].0 <= at {
            let r = ending[k].1;
            // A running entry inconsistent with the cluster frees nothing.
            let _ = scratch.release(&r.request, &r.placement);
            k += 1;
        }
        // One member anywhere needs no scratch copy per attempt: a
        // decision on `scratch` itself (a reservation may try once per
        // distinct end time, thousands of times).
        let attempt = match head.members.as_slice() {
            [one] if head.locality == Locality::Any => match engine.decide(&scratch, one, rng) {
                Decision::Placed(p) => GangDecision::Placed(GangPlacement {
                    members: vec![p],
                    scope: None,
                }),
                Decision::Unschedulable(_) => GangDecision::Unschedulable(GangExplanation {
                    locality: Locality::Any,
                    members: 1,
                    scopes_tried: 0,
                    scopes_too_small: 0,
                    best: None,
                }),
            },
            _ => place_gang(engine, &scratch, head, rng),
        };
        if let GangDecision::Placed(p) = attempt {
            let mut nodes: Vec<u32> = p.members.iter().map(|m| m.node).collect();
            nodes.sort_unstable();
            nodes.dedup();
            let projected = nodes
                .iter()
                .filter_map(|&n| {
                    scratch.node(n).map(|node| {
                        (
                            n,
                            Projected {
                                cpu: node.cpu_free,
                                mem: node.mem_free,
                                gpus: node.gpu_free.clone(),
                            },
                        )
                    })
                })
                .collect();
            return Reservation {
                start_ms: Some(at),
                plan: p.members,
                nodes,
                requests: head.members.clone(),
                projected,
            };
        }
        match ending.get(k) {
            Some(e) => at = e.0,
            None => break,
        }
    }
    let nodes = cluster
        .nodes()
        .iter()
        .enumerate()
        .filter(|(_, n)| head.members.iter().any(|m| could_ever_host(n, m)))
        .map(|(i, _)| i as u32)
        .collect();
    Reservation {
        start_ms: None,
        plan: Vec::new(),
        nodes,
        requests: head.members.clone(),
        projected: BTreeMap::new(),
    }
}

/// Whether `node`, emptied, could host `req` (uncordoned, right model, big
/// enough).
fn could_ever_host(node: &Node, req: &Request) -> bool {
    let gpus = if node.spec.model.is_some() {
        node.spec.gpus
    } else {
        0
    };
    let empty = NodeState {
        model: node.spec.model,
        runtime: node.runtime,
        cordoned: node.cordoned,
        cpu_free: node.spec.cpu_milli,
        mem_free: node.spec.mem_mib,
        gpu_free: vec![MILLI; usize::from(gpus)],
        tags: 0,
    };
    check(&empty, req).is_ok()
}

/// Takes `req` out of `free` at the given GPUs, or anywhere it fits when
/// `gpus` is `None` (whole GPUs: the first fully free; a share: the fullest
/// GPU that fits). False, with `free` unspecified, if it does not fit.
fn take(free: &mut Projected, req: &Request, gpus: Option<&[u16]>) -> bool {
    let (Some(cpu), Some(mem)) = (
        free.cpu.checked_sub(req.cpu_milli),
        free.mem.checked_sub(req.mem_mib),
    ) else {
        return false;
    };
    free.cpu = cpu;
    free.mem = mem;
    let per = req.gpu.per_gpu_milli();
    let chosen: Vec<usize> = match gpus {
        Some(g) => g.iter().map(|&d| usize::from(d)).collect(),
        None => match req.gpu {
            GpuDemand::None => Vec::new(),
            GpuDemand::Whole { count } => free
                .gpus
                .iter()
                .enumerate()
                .filter(|(_, &f)| f == MILLI)
                .take(usize::from(count))
                .map(|(i, _)| i)
                .collect(),
            GpuDemand::Share { milli } => free
                .gpus
                .iter()
                .enumerate()
                .filter(|(_, &f)| f >= milli)
                .min_by_key(|(i, &f)| (f, *i))
                .map(|(i, _)| i)
                .into_iter()
                .collect(),
        },
    };
    if chosen.len() != usize::from(req.gpu.gpu_count()) {
        return false;
    }
    for (k, &i) in chosen.iter().enumerate() {
        if chosen[..k].contains(&i) {
            return false;
        }
        match free.gpus.get_mut(i).and_then(|f| f.checked_sub(per)) {
            Some(v) => free.gpus[i] = v,
            None => return false,
        }
    }
    true
}

/// Whether `candidate`, placed at `placement` now and expected to end at
/// `expected_end_ms`, may start ahead of the head without delaying its
/// reservation.
pub fn backfill_allowed(
    reservation: &Reservation,
    candidate: &Request,
    placement: &Placement,
    expected_end_ms: Option<u64>,
) -> bool {
    if reservation.nodes.binary_search(&placement.node).is_err() {
        return true;
    }
    let Some(start) = reservation.start_ms else {
        return false;
    };
    if expected_end_ms.is_some_and(|e| e <= start) {
        return true;
    }
    let Some(proj) = reservation.projected.get(&placement.node) else {
        return false;
    };
    let mut free = proj.clone();
    if !take(&mut free, candidate, Some(&placement.gpus)) {
        return false;
    }
    // The head's members planned on this node must still fit beside it
    // (on any GPUs that fit: the plan's own indices may be the ones taken).
    members_fit(reservation, &mut free, placement.node)
}

impl Reservation {
    /// [`backfill_allowed`], and if allowed, records the candidate in the
    /// projection so that the next candidate is judged with it in place.
    /// Returns whether it was allowed.
    pub fn admit_backfill(
        &mut self,
        candidate: &Request,
        placement: &Placement,
        expected_end_ms: Option<u64>,
    ) -> bool {
        if !backfill_allowed(self, candidate, placement, expected_end_ms) {
            return false;
        }
        let ends_first = matches!((self.start_ms, expected_end_ms), (Some(s), Some(e)) if e <= s);
        if !ends_first {
            if let Some(p) = self.projected.get_mut(&placement.node) {
                // Checked by backfill_allowed; a no-op if the node is not
                // reserved.
                let mut next = p.clone();
                if take(&mut next, candidate, Some(&placement.gpus)) {
                    *p = next;
                }
            }
        }
        true
    }
}

fn members_fit(res: &Reservation, free: &mut Projected, node: u32) -> bool {
    res.plan
        .iter()
        .zip(&res.requests)
        .filter(|(p, _)| p.node == node)
        .all(|(_, r)| take(free, r, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gang::Locality;
    use crate::snapshot::{ModelTable, NodeSpec};
    use crate::{Policy, TargetWorkload};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    const HOUR: u64 = 3_600_000;
    const ONE_GPU: Resources = Resources {
        gpu_milli: 1000,
        cpu_milli: 0,
        mem_mib: 0,
    };

    fn state(half_life_ms: u64) -> FairShareState {
        let cfg = FairShareConfig {
            half_life_ms,
            ..FairShareConfig::default()
        };
        FairShareState::new(
            cfg,
            Resources {
                gpu_milli: 8000,
                cpu_milli: 64_000,
                mem_mib: 1 << 20,
            },
        )
        .unwrap()
    }

    fn item(tenant: Tenant, priority: i32, submitted_ms: u64) -> QueueItem {
        QueueItem {
            tenant,
            tier: Tier::Shared,
            priority,
            submitted_ms,
            demand: ONE_GPU,
            expected_runtime_ms: Some(HOUR),
        }
    }

    #[test]
    fn usage_decays_with_the_half_life_and_charging_is_exact() {
        let mut s = state(HOUR);
        s.charge(1, ONE_GPU, 0, HOUR);
        // ∫_0^h 2^{-(h-t)/h} dt = h / (2 ln 2) GPU-ms.
        let want = 3600.0 / (2.0 * std::f64::consts::LN_2);
        assert!((s.gpu_seconds(1, HOUR) - want).abs() < 1e-6);
        assert!((s.gpu_seconds(1, 2 * HOUR) - want / 2.0).abs() < 1e-6);
        // In pieces, or reported late, it is the same.
        let mut t = state(HOUR);
        t.charge(1, ONE_GPU, 0, HOUR / 3);
        t.charge(1, ONE_GPU, HOUR / 3, HOUR);
        assert!((t.gpu_seconds(1, 2 * HOUR) - want / 2.0).abs() < 1e-6);
        let mut late = state(HOUR);
        late.advance(2 * HOUR);
        late.charge(1, ONE_GPU, 0, HOUR);
        assert!((late.gpu_seconds(1, 2 * HOUR) - want / 2.0).abs() < 1e-6);
        // Without decay it is plain GPU-seconds.
        let mut n = state(0);
        n.charge(1, ONE_GPU, 0, HOUR);
        assert_eq!(n.gpu_seconds(1, 100 * HOUR), 3600.0);
        assert!(s.set_weight(1, 0.0).is_err() && s.set_weight(1, f64::NAN).is_err());
    }

    #[test]
    fn priority_then_fair_share_then_fifo() {
        let mut s = state(HOUR);
        s.charge(1, ONE_GPU, 0, HOUR);
        let pending = [
            item(1, 0, 0),  // busy tenant, oldest
            item(2, 0, 10), // idle tenant
            item(1, 5, 20), // high priority beats everything
            item(2, 0, 5),  // idle tenant's older item goes first
        ];
        assert_eq!(order(&pending, &s, HOUR), vec![2, 3, 1, 0]);
    }

    #[test]
    fn tenants_interleave_and_weights_skew_the_interleaving() {
        let s = state(HOUR);
        let pending: Vec<QueueItem> = (0..3)
            .map(|i| item(1, 0, i))
            .chain((0..3).map(|i| item(2, 0, 100 + i)))
            .collect();
        assert_eq!(order(&pending, &s, 0), vec![0, 3, 1, 4, 2, 5]);
        let mut w = state(HOUR);
        w.set_weight(2, 3.0).unwrap();
        let pending: Vec<QueueItem> = (0..4)
            .map(|i| item(1, 0, i))
            .chain((0..4).map(|i| item(2, 0, 100 + i)))
            .collect();
        let first4: Vec<Tenant> = order(&pending, &w, 0)[..4]
            .iter()
            .map(|&i| pending[i].tenant)
            .collect();
        // Tenant 2 has three times the weight: three of the first four.
        assert_eq!(first4.iter().filter(|&&t| t == 2).count(), 3);
    }

    fn cluster(nodes: usize) -> Cluster {
        let mut m = ModelTable::default();
        let a = m.intern("A").unwrap();
        let mut c = Cluster::new(m);
        for _ in 0..nodes {
            c.add_node(NodeSpec {
                model: Some(a),
                gpus: 4,
                cpu_milli: 32_000,
                mem_mib: 1 << 20,
            })
            .unwrap();
        }
        c
    }

    fn whole(n: u16) -> Request {
        Request::new(GpuDemand::Whole { count: n }, 0, 0)
    }

    fn running(c: &mut Cluster, node: u32, gpus: &[u16], end: Option<u64>) -> Running {
        let r = Running {
            request: whole(gpus.len() as u16),
            placement: Placement {
                node,
                gpus: gpus.to_vec(),
            },
            expected_end_ms: end,
        };
        c.commit(&r.request, &r.placement).unwrap();
        r
    }

    fn reserve_for(c: &Cluster, run: &[Running], head: Request) -> Reservation {
        let mut e = Engine::new(Policy::Flotilla.scorer(&TargetWorkload::default()));
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let gang = Gang::uniform(head, 1, Locality::Any);
        reserve(&mut e, c, run, &gang, 0, &mut rng)
    }

    fn at(node: u32, gpus: &[u16]) -> Placement {
        Placement {
            node,
            gpus: gpus.to_vec(),
        }
    }

    #[test]
    fn backfill_only_where_it_does_not_delay_the_head() {
        let mut c = cluster(2);
        let run = vec![
            running(&mut c, 0, &[0, 1, 2], Some(100)),
            running(&mut c, 1, &[0, 1, 2, 3], Some(200)),
        ];
        let res = reserve_for(&c, &run, whole(4));
        assert_eq!((res.start_ms, res.nodes.clone()), (Some(100), vec![0]));
        let one = whole(1);
        assert!(backfill_allowed(&res, &one, &at(0, &[3]), Some(50)));
        assert!(backfill_allowed(&res, &one, &at(0, &[3]), Some(100)));
        assert!(!backfill_allowed(&res, &one, &at(0, &[3]), Some(150)));
        assert!(!backfill_allowed(&res, &one, &at(0, &[3]), None));
        // Node 1 is not reserved: anything goes there.
        assert!(backfill_allowed(&res, &one, &at(1, &[0]), None));
    }

    #[test]
    fn backfill_may_share_a_reserved_node_that_has_room_for_both() {
        let mut c = cluster(2);
        let run = vec![
            running(&mut c, 0, &[0, 1, 2], Some(100)),
            running(&mut c, 1, &[0, 1, 2, 3], Some(200)),
        ];
        let mut res = reserve_for(&c, &run, whole(2));
        assert_eq!((res.start_ms, res.nodes.clone()), (Some(100), vec![0]));
        // At 100 node 0 has 4 free: two long 1-GPU jobs leave 2 for the head.
        assert!(res.admit_backfill(&whole(1), &at(0, &[3]), None));
        assert!(res.admit_backfill(&whole(1), &at(0, &[0]), None));
        assert!(!res.admit_backfill(&whole(1), &at(0, &[1]), None));
        // One that ends in time still may.
        assert!(res.admit_backfill(&whole(1), &at(0, &[1]), Some(90)));
    }

    #[test]
    fn unknown_end_times_reserve_every_node_that_could_host_the_head() {
        let mut c = cluster(2);
        let run = vec![
            running(&mut c, 0, &[0, 1], None),
            running(&mut c, 1, &[0, 1, 2], Some(10)),
        ];
        // 4 GPUs: node 1 frees at 10 -> start 10 on node 1.
        let res = reserve_for(&c, &run, whole(4));
        assert_eq!((res.start_ms, res.nodes.clone()), (Some(10), vec![1]));
        // 8 GPUs on one node: never; nothing of the cluster is reserved,
        // because no node could ever host it.
        let res = reserve_for(&c, &run, whole(8));
        assert_eq!((res.start_ms, res.nodes.clone()), (None, vec![]));
        // With node 1's end unknown too, a 4-GPU head reserves both nodes.
        let mut c = cluster(2);
        let run = vec![
            running(&mut c, 0, &[0, 1], None),
            running(&mut c, 1, &[0, 1, 2], None),
        ];
        let res = reserve_for(&c, &run, whole(4));
        assert_eq!((res.start_ms, res.nodes.clone()), (None, vec![0, 1]));
        assert!(!backfill_allowed(&res, &whole(1), &at(1, &[3]), Some(1)));
    }
}
