//! Preemption: when a request fits nowhere, which running work to evict.
//!
//! Only work that agreed to it may be evicted: an allocation is a candidate
//! victim only if it is `preemptible` and not tier 1 ([`Tier::Dedicated`]);
//! nothing else is ever chosen, whatever the requester. Among candidates, the
//! requester must also outrank the victim ([`Preemptor::may_evict`]): a
//! better tier, a higher priority, or reclaiming its guaranteed quota from
//! work another tenant borrowed. Equals never preempt each other, so two
//! spot jobs cannot evict each other in a loop.
//!
//! The victims are the cheapest sufficient set on one node (for a gang: one
//! such set per member that does not fit, greedily, member by member). The
//! [`Cost`] of a set is compared lexicographically:
//! 1. the sum of the victims' priority weights, `2^priority` (clamped): one
//!    victim of priority p+1 costs as much as two of priority p, so low
//!    priority work goes first;
//! 2. the milli-GPU-milliseconds the victims have run, the work lost if
//!    they do not checkpoint in their notice period;
//! 3. the number of victims, each a disruption to someone.
//!
//! On one node the search is exact over all subsets of candidates when there
//! are at most [`EXACT_LIMIT`] of them (a node has at most a few dozen
//! allocations and usually a handful), and otherwise greedy (cheapest first
//! until it fits, then drop the ones no longer needed).
//!
//! The answer is data for the server: [`Eviction`]s with a notice period
//! (default 30 s) during which the victim gets SIGTERM and may checkpoint,
//! and the placement the request gets once they are gone. The server starts
//! the request only after the victims have released their GPUs, and requeues
//! the victims.

use std::collections::BTreeMap;
use std::fmt;

use rand::Rng;

use crate::alloc::{Allocation, AllocationId, Tenant, Tier};
use crate::filter::{check, Explanation};
use crate::gang::{
    close_host, place_gang, restricted, scope_nodes, scopes_by_free, Gang, GangDecision,
    GangPlacement, Locality,
};
use crate::request::Request;
use crate::select::{Decision, Engine, Placement};
use crate::snapshot::{Cluster, Node, NodeState};
use crate::MILLI;

/// Default notice a victim gets before it is killed.
pub const DEFAULT_NOTICE_MS: u64 = 30_000;

/// Candidates on one node up to which the search is exact (2^12 subsets).
pub const EXACT_LIMIT: usize = 12;

/// Who wants the capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preemptor {
    pub tenant: Tenant,
    pub tier: Tier,
    pub priority: i32,
    /// The request is within the tenant's guaranteed quota
    /// ([`crate::quota::Admission::Guaranteed`]): it may take back capacity
    /// other tenants borrowed.
    pub reclaiming: bool,
}

impl Preemptor {
    /// Whether this requester may evict `victim`. Never tier-1 or
    /// non-preemptible work.
    pub fn may_evict(&self, victim: &Allocation) -> bool {
        if victim.tier == Tier::Dedicated || !victim.preemptible {
            return false;
        }
        // Lexicographic, as the queue orders work (crate::queue::order):
        // were "a better tier or a higher priority" enough, a tier-2 work
        // of priority 0 and a tier-3 work of priority 5 could each evict
        // the other, and whichever the queue placed first would be
        // preempted by the other on the next pass.
        // Reclaiming a guarantee takes borrowed capacity back from work
        // that does not outrank the reclaimer (Kueue's "lower or equal
        // priority" reclaim): the same rank order again, so that work
        // the queue placed first is never reclaimed by work behind it.
        let outranks = self.tier < victim.tier
            || (self.tier == victim.tier && self.priority > victim.priority);
        let not_outranked = self.tier < victim.tier
            || (self.tier == victim.tier && self.priority >= victim.priority);
        outranks
            || (self.reclaiming && not_outranked && victim.borrowed && victim.tenant != self.tenant)
    }
}

/// Preemption settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreemptConfig {
    /// Notice each victim gets, in ms.
    pub notice_ms: u64,
}

impl Default for PreemptConfig {
    fn default() -> Self {
        PreemptConfig {
            notice_ms: DEFAULT_NOTICE_MS,
        }
    }
}

/// The cost of evicting a set of allocations; lower is cheaper, compared
/// field by field (see the module).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Cost {
    pub priority_weight: u128,
    pub gpu_milli_ms: u128,
    pub victims: u32,
}

impl Cost {
    /// The cost of evicting one allocation at `now_ms`.
    pub fn of(a: &Allocation, now_ms: u64) -> Cost {
        // 2^(p + 32) for p in -32..=63: positive, monotone, fits in u128
        // with room for sums.
        let exp = (i64::from(a.priority).clamp(-32, 63) + 32) as u32;
        Cost {
            priority_weight: 1u128 << exp,
            gpu_milli_ms: a.gpu_milli_ms_run(now_ms),
            victims: 1,
        }
    }

    fn add(self, o: Cost) -> Cost {
        Cost {
            priority_weight: self.priority_weight.saturating_add(o.priority_weight),
            gpu_milli_ms: self.gpu_milli_ms.saturating_add(o.gpu_milli_ms),
            victims: self.victims.saturating_add(o.victims),
        }
    }
}

/// An instruction to the server: tell the allocation's workload to stop
/// (SIGTERM, an API event) and kill it after `notice_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Eviction {
    pub allocation: AllocationId,
    pub notice_ms: u64,
}

/// Evict these, then place the request here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreemptionPlan {
    pub evictions: Vec<Eviction>,
    pub placement: Placement,
    pub cost: Cost,
}

/// Evict these, then place the gang here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangPreemptionPlan {
    pub evictions: Vec<Eviction>,
    pub placement: GangPlacement,
    pub cost: Cost,
}

/// Why no eviction makes room.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PreemptExplanation {
    /// Nodes that would fit only if work this requester may not evict
    /// (tier 1, non-preemptible, or not outranked) were gone.
    pub protected: usize,
    /// The other nodes, and why the request does not fit them even with all
    /// their known allocations gone.
    pub why: Explanation,
}

impl fmt::Display for PreemptExplanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes = self.protected + self.why.nodes;
        write!(
            f,
            "no eviction this request may make frees room on any of {nodes} nodes: \
             {} held by protected or equal-or-higher-ranked work",
            self.protected
        )?;
        for (r, n) in self.why.reasons() {
            write!(f, ", {n} {}", r.label())?;
        }
        Ok(())
    }
}

/// The answer for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PreemptDecision {
    /// It fits without evicting anything.
    Fits(Placement),
    Preempt(PreemptionPlan),
    Impossible(PreemptExplanation),
}

/// The answer for a gang.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GangPreemptDecision {
    Fits(GangPlacement),
    Preempt(GangPreemptionPlan),
    /// The explanation of the member that failed in the closest attempt.
    Impossible(PreemptExplanation),
}

/// Plans the cheapest eviction that lets `req` fit. `allocations` are the
/// work running on `cluster` (their placements are committed in it). Does
/// not change `cluster`.
#[allow(clippy::too_many_arguments)]
pub fn plan<R: Rng + ?Sized>(
    engine: &mut Engine,
    cluster: &Cluster,
    allocations: &[Allocation],
    req: &Request,
    who: &Preemptor,
    config: &PreemptConfig,
    now_ms: u64,
    rng: &mut R,
) -> PreemptDecision {
    if let Decision::Placed(p) = engine.decide(cluster, req, rng) {
        return PreemptDecision::Fits(p);
    }
    let all: Vec<&Allocation> = allocations.iter().collect();
    let (victims, cost) = match cheapest(cluster, &all, req, who, now_ms) {
        Ok(found) => found,
        Err(e) => return PreemptDecision::Impossible(e),
    };
    let mut scratch = cluster.clone();
    match evict_and_place(engine, &mut scratch, &all, &victims, req, rng) {
        Some(placement) => PreemptDecision::Preempt(PreemptionPlan {
            evictions: notices(&all, &victims, config),
            placement,
            cost,
        }),
        None => PreemptDecision::Impossible(explain(cluster, &all, req)),
    }
}

/// [`plan`] without copying the cluster: the victims' capacity is released
/// on `cluster` for the placement attempt and committed back before this
/// returns, so on return `cluster` is as it was. For callers that plan many
/// preemptions over a large cluster (the pass planner, [`crate::pass`]),
/// where a copy per attempt would dominate.
#[allow(clippy::too_many_arguments)]
pub fn plan_in_place<R: Rng + ?Sized>(
    engine: &mut Engine,
    cluster: &mut Cluster,
    all: &[&Allocation],
    req: &Request,
    who: &Preemptor,
    config: &PreemptConfig,
    now_ms: u64,
    rng: &mut R,
) -> PreemptDecision {
    if let Decision::Placed(p) = engine.decide(cluster, req, rng) {
        return PreemptDecision::Fits(p);
    }
    let Some((victims, cost)) = cheapest_set(cluster, all, req, who, now_ms) else {
        return PreemptDecision::Impossible(PreemptExplanation::default());
    };
    let mut released = Vec::with_capacity(victims.len());
    let mut ok = true;
    for &v in &victims {
        match all.get(v) {
            Some(a) if cluster.release(&a.request, &a.placement).is_ok() => released.push(*a),
            _ => {
                ok = false;
                break;
            }
        }
    }
    let placed = if ok {
        match engine.decide(cluster, req, rng) {
            Decision::Placed(p) => Some(p),
            Decision::Unschedulable(_) => None,
        }
    } else {
        None
    };
    for a in released.iter().rev() {
        // Undoes the release above: it cannot fail.
        let _ = cluster.commit(&a.request, &a.placement);
    }
    match placed {
        Some(placement) => PreemptDecision::Preempt(PreemptionPlan {
            evictions: notices(all, &victims, config),
            placement,
            cost,
        }),
        // No explanation: the caller planning many preemptions explains
        // with its own counts, and this one would cost a pass over the
        // cluster per failed attempt.
        None => PreemptDecision::Impossible(PreemptExplanation::default()),
    }
}

/// Plans evictions that let a whole gang fit: members are placed in order,
/// each without eviction if it can be, else with the cheapest eviction on
/// one node. For a domain or region constraint every domain is tried and the
/// cheapest plan kept (lowest domain id on ties). Does not change `cluster`.
#[allow(clippy::too_many_arguments)]
pub fn plan_gang<R: Rng + ?Sized>(
    engine: &mut Engine,
    cluster: &Cluster,
    allocations: &[Allocation],
    gang: &Gang,
    who: &Preemptor,
    config: &PreemptConfig,
    now_ms: u64,
    rng: &mut R,
) -> GangPreemptDecision {
    if let GangDecision::Placed(p) = place_gang(engine, cluster, gang, rng) {
        return GangPreemptDecision::Fits(p);
    }
    gang_evictions(
        engine,
        cluster,
        allocations,
        gang,
        who,
        config,
        now_ms,
        rng,
        true,
    )
}

/// [`plan_gang`] for a caller that already knows the gang does not fit as
/// things stand and has no use for the explanation of a failure (the pass
/// planner, [`crate::pass`], which explains with its own counts): neither
/// is computed, which saves a placement attempt and a pass over the
/// cluster per call.
#[allow(clippy::too_many_arguments)]
pub fn plan_gang_unexplained<R: Rng + ?Sized>(
    engine: &mut Engine,
    cluster: &Cluster,
    allocations: &[Allocation],
    gang: &Gang,
    who: &Preemptor,
    config: &PreemptConfig,
    now_ms: u64,
    rng: &mut R,
) -> GangPreemptDecision {
    gang_evictions(
        engine,
        cluster,
        allocations,
        gang,
        who,
        config,
        now_ms,
        rng,
        false,
    )
}

#[allow(clippy::too_many_arguments)]
fn gang_evictions<R: Rng + ?Sized>(
    engine: &mut Engine,
    cluster: &Cluster,
    allocations: &[Allocation],
    gang: &Gang,
    who: &Preemptor,
    config: &PreemptConfig,
    now_ms: u64,
    rng: &mut R,
    explained: bool,
) -> GangPreemptDecision {
    let all: Vec<&Allocation> = allocations.iter().collect();
    let mut scopes: Vec<Option<u32>> = match gang.locality {
        Locality::Any => vec![None],
        l => scopes_by_free(cluster, l)
            .into_iter()
            .map(|(s, _)| Some(s))
            .collect(),
    };
    scopes.sort_unstable();
    let mut best: Option<GangPreemptionPlan> = None;
    let mut closest: Option<(usize, PreemptExplanation)> = None;
    for scope in scopes {
        let (mut scratch, nodes) = match scope {
            None => (cluster.clone(), None),
            Some(s) => (
                restricted(cluster, gang.locality, s),
                Some(scope_nodes(cluster, gang.locality, s)),
            ),
        };
        let mut evicted: Vec<usize> = Vec::new();
        let mut cost = Cost::default();
        let mut members = Vec::with_capacity(gang.members.len());
        let mut failed = None;
        for (i, req) in gang.members.iter().enumerate() {
            if let Decision::Placed(p) = engine.decide(&scratch, req, rng) {
                if scratch.commit(req, &p).is_ok() {
                    if gang.spread {
                        close_host(&mut scratch, p.node);
                    }
                    members.push(p);
                    continue;
                }
            }
            let left: Vec<&Allocation> = all
                .iter()
                .enumerate()
                .filter(|(k, _)| !evicted.contains(k))
                .map(|(_, a)| *a)
                .collect();
            let left_idx: Vec<usize> = (0..all.len()).filter(|k| !evicted.contains(k)).collect();
            let found = if explained {
                cheapest(&scratch, &left, req, who, now_ms)
            } else {
                cheapest_set(&scratch, &left, req, who, now_ms)
                    .ok_or_else(PreemptExplanation::default)
            };
            match found {
                Ok((victims, c)) => {
                    match evict_and_place(engine, &mut scratch, &left, &victims, req, rng) {
                        Some(p) if scratch.commit(req, &p).is_ok() => {
                            if gang.spread {
                                close_host(&mut scratch, p.node);
                            }
                            evicted.extend(victims.iter().map(|&v| left_idx[v]));
                            cost = cost.add(c);
                            members.push(p);
                        }
                        _ => {
                            let why = if explained {
                                explain(&scratch, &left, req)
                            } else {
                                PreemptExplanation::default()
                            };
                            failed = Some((i, why));
                            break;
                        }
                    }
                }
                Err(mut e) => {
                    if let (Some(nodes), true) = (&nodes, explained) {
                        // Count only the scope's nodes, not the cordoned rest.
                        e = explain_nodes(&scratch, &left, req, Some(nodes));
                    }
                    failed = Some((i, e));
                    break;
                }
            }
        }
        match failed {
            None => {
                if best.as_ref().is_none_or(|b| cost < b.cost) {
                    evicted.sort_unstable();
                    best = Some(GangPreemptionPlan {
                        evictions: notices(&all, &evicted, config),
                        placement: GangPlacement { members, scope },
                        cost,
                    });
                }
            }
            Some((i, e)) => {
                if closest.as_ref().is_none_or(|c| i > c.0) {
                    closest = Some((i, e));
                }
            }
        }
    }
    match best {
        Some(p) => GangPreemptDecision::Preempt(p),
        None => GangPreemptDecision::Impossible(closest.map(|c| c.1).unwrap_or_default()),
    }
}

fn notices(all: &[&Allocation], victims: &[usize], config: &PreemptConfig) -> Vec<Eviction> {
    victims
        .iter()
        .filter_map(|&v| all.get(v))
        .map(|a| Eviction {
            allocation: a.id,
            notice_ms: config.notice_ms,
        })
        .collect()
}

/// Releases `victims` (indices into `all`) on `scratch` and places `req`.
fn evict_and_place<R: Rng + ?Sized>(
    engine: &mut Engine,
    scratch: &mut Cluster,
    all: &[&Allocation],
    victims: &[usize],
    req: &Request,
    rng: &mut R,
) -> Option<Placement> {
    for &v in victims {
        let a = all.get(v)?;
        scratch.release(&a.request, &a.placement).ok()?;
    }
    match engine.decide(scratch, req, rng) {
        Decision::Placed(p) => Some(p),
        Decision::Unschedulable(_) => None,
    }
}

/// Allocations (indices into `all`) by node.
fn by_node(all: &[&Allocation]) -> BTreeMap<u32, Vec<usize>> {
    let mut m: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, a) in all.iter().enumerate() {
        m.entry(a.placement.node).or_default().push(i);
    }
    m
}

/// The node's state once `gone` (indices into `all`) have released their
/// capacity. `None` when a release would free more than the node has (an
/// allocation list inconsistent with the cluster): such a set never counts
/// as making room, so an inconsistent input can never push a GPU past 1000.
fn state_without(node: &Node, all: &[&Allocation], gone: &[usize]) -> Option<NodeState> {
    let mut state = node.state();
    let mut gpus = node.gpu_free.clone();
    let mut cpu = u64::from(node.cpu_free);
    let mut mem = node.mem_free;
    for &g in gone {
        let a = all.get(g)?;
        cpu += u64::from(a.request.cpu_milli);
        mem = mem.saturating_add(a.request.mem_mib);
        let per = a.request.gpu.per_gpu_milli();
        for &d in &a.placement.gpus {
            let f = gpus.get_mut(usize::from(d))?;
            *f = f.saturating_add(per);
            if *f > MILLI {
                return None;
            }
        }
    }
    if cpu > u64::from(node.spec.cpu_milli) || mem > node.spec.mem_mib {
        return None;
    }
    state.cpu_free = u32::try_from(cpu).ok()?;
    state.mem_free = mem;
    gpus.sort_unstable_by(|a, b| b.cmp(a));
    state.gpu_free = gpus;
    Some(state)
}

/// Whether `req` fits on `node` once `gone` have left: [`check`] on
/// [`state_without`], computed on the stack for nodes of up to 16 GPUs
/// (every real server), since the victim search asks it for every subset
/// of candidates it tries.
fn fits_without(node: &Node, all: &[&Allocation], gone: &[usize], req: &Request) -> bool {
    const STACK: usize = 16;
    let n = node.gpu_free.len();
    if n > STACK {
        return state_without(node, all, gone).is_some_and(|s| check(&s, req).is_ok());
    }
    if node.cordoned {
        return false;
    }
    let count = usize::from(req.gpu.gpu_count());
    if count > 0
        && (node.spec.model.is_none() || n == 0 || !req.models.allows(node.spec.model) || n < count)
    {
        return false;
    }
    let mut gpus = [0u16; STACK];
    gpus[..n].copy_from_slice(&node.gpu_free);
    let mut cpu = u64::from(node.cpu_free);
    let mut mem = node.mem_free;
    for &g in gone {
        let Some(a) = all.get(g) else { return false };
        cpu += u64::from(a.request.cpu_milli);
        mem = mem.saturating_add(a.request.mem_mib);
        let per = a.request.gpu.per_gpu_milli();
        for &d in &a.placement.gpus {
            let Some(f) = gpus[..n].get_mut(usize::from(d)) else {
                return false;
            };
            *f = f.saturating_add(per);
            if *f > MILLI {
                return false;
            }
        }
    }
    if cpu > u64::from(node.spec.cpu_milli) || mem > node.spec.mem_mib {
        return false;
    }
    if cpu < u64::from(req.cpu_milli) || mem < req.mem_mib {
        return false;
    }
    let per = req.gpu.per_gpu_milli();
    count == 0 || gpus[..n].iter().filter(|&&f| f >= per).count() >= count
}

/// The cheapest sufficient victim set on any one node: victims as indices
/// into `all`, and their cost. Ties go to the lowest node index.
fn cheapest(
    cluster: &Cluster,
    all: &[&Allocation],
    req: &Request,
    who: &Preemptor,
    now_ms: u64,
) -> Result<(Vec<usize>, Cost), PreemptExplanation> {
    cheapest_set(cluster, all, req, who, now_ms).ok_or_else(|| explain(cluster, all, req))
}

/// [`cheapest`] without the explanation of a failure.
fn cheapest_set(
    cluster: &Cluster,
    all: &[&Allocation],
    req: &Request,
    who: &Preemptor,
    now_ms: u64,
) -> Option<(Vec<usize>, Cost)> {
    let mut best: Option<(Cost, u32, Vec<usize>)> = None;
    // Grouped by node with one sort (a map per call would allocate a
    // vector per node).
    let mut order: Vec<(u32, usize)> = all
        .iter()
        .enumerate()
        .map(|(i, a)| (a.placement.node, i))
        .collect();
    order.sort_unstable();
    let mut on_node: Vec<usize> = Vec::new();
    let mut k = 0;
    while k < order.len() {
        let node_idx = order[k].0;
        on_node.clear();
        while k < order.len() && order[k].0 == node_idx {
            on_node.push(order[k].1);
            k += 1;
        }
        let Some(node) = cluster.node(node_idx) else {
            continue;
        };
        let mut cands: Vec<(Cost, usize)> = on_node
            .iter()
            .filter(|&&i| who.may_evict(all[i]))
            .map(|&i| (Cost::of(all[i], now_ms), i))
            .collect();
        if cands.is_empty() {
            continue;
        }
        cands.sort_unstable();
        let every: Vec<usize> = cands.iter().map(|c| c.1).collect();
        if !fits_without(node, all, &every, req) {
            continue;
        }
        let bound = best.as_ref().map(|b| b.0);
        if let Some((cost, set)) = search_node(node, all, &cands, req, bound) {
            if best.as_ref().is_none_or(|b| cost < b.0) {
                best = Some((cost, node_idx, set));
            }
        }
    }
    best.map(|(cost, _, mut set)| {
        set.sort_unstable();
        (set, cost)
    })
}

/// The cheapest subset of `cands` (sorted by cost) after whose eviction
/// `req` fits on `node`, if cheaper than `bound`. The full set is known to
/// fit.
fn search_node(
    node: &Node,
    all: &[&Allocation],
    cands: &[(Cost, usize)],
    req: &Request,
    bound: Option<Cost>,
) -> Option<(Cost, Vec<usize>)> {
    let mut best: Option<(Cost, Vec<usize>)> = None;
    let beats = |c: Cost, best: &Option<(Cost, Vec<usize>)>| {
        bound.is_none_or(|b| c < b) && best.as_ref().is_none_or(|b| c < b.0)
    };
    if cands.len() <= EXACT_LIMIT {
        let mut set = Vec::with_capacity(cands.len());
        for mask in 1u32..(1u32 << cands.len()) {
            let cost = cands
                .iter()
                .enumerate()
                .filter(|(k, _)| mask & (1 << k) != 0)
                .fold(Cost::default(), |acc, (_, c)| acc.add(c.0));
            if !beats(cost, &best) {
                continue;
            }
            set.clear();
            set.extend(
                cands
                    .iter()
                    .enumerate()
                    .filter(|(k, _)| mask & (1 << k) != 0)
                    .map(|(_, c)| c.1),
            );
            if fits_without(node, all, &set, req) {
                best = Some((cost, set.clone()));
            }
        }
        return best;
    }
    // Greedy: cheapest first until it fits, then drop the most expensive
    // ones that turned out unnecessary.
    let mut set: Vec<(Cost, usize)> = Vec::new();
    for &c in cands {
        set.push(c);
        let idx: Vec<usize> = set.iter().map(|c| c.1).collect();
        if fits_without(node, all, &idx, req) {
            break;
        }
    }
    let mut k = set.len();
    while k > 0 {
        k -= 1;
        let trial: Vec<usize> = set
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != k)
            .map(|(_, c)| c.1)
            .collect();
        if fits_without(node, all, &trial, req) {
            set.remove(k);
        }
    }
    let cost = set.iter().fold(Cost::default(), |acc, c| acc.add(c.0));
    let idx: Vec<usize> = set.iter().map(|c| c.1).collect();
    (fits_without(node, all, &idx, req) && beats(cost, &best)).then_some((cost, idx))
}

fn explain(cluster: &Cluster, all: &[&Allocation], req: &Request) -> PreemptExplanation {
    explain_nodes(cluster, all, req, None)
}

/// Per node: would it fit with every known allocation gone? Then the
/// obstacle is work this requester may not evict. If not, why not, judged on
/// the node emptied of what we know, so the reason is about the node
/// (cordoned, model, size) rather than its transient load.
fn explain_nodes(
    cluster: &Cluster,
    all: &[&Allocation],
    req: &Request,
    nodes: Option<&[u32]>,
) -> PreemptExplanation {
    let on = by_node(all);
    let mut e = PreemptExplanation::default();
    let mut visit = |idx: u32| {
        let Some(node) = cluster.node(idx) else {
            return;
        };
        let everything = on.get(&idx).map_or(&[][..], Vec::as_slice);
        let state = state_without(node, all, everything).unwrap_or_else(|| node.state());
        match check(&state, req) {
            Ok(()) => e.protected += 1,
            Err(r) => e.why.add(r, 1),
        }
    };
    match nodes {
        Some(ns) => ns.iter().copied().for_each(&mut visit),
        None => (0..cluster.len() as u32).for_each(&mut visit),
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::GpuDemand;
    use crate::snapshot::{ModelTable, NodeSpec};
    use crate::{Policy, TargetWorkload};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

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
        Request::new(GpuDemand::Whole { count: n }, 1000, 0)
    }

    /// An allocation of `gpus` on `node`, committed to `c`.
    #[allow(clippy::too_many_arguments)]
    fn run(
        c: &mut Cluster,
        id: u64,
        node: u32,
        gpus: &[u16],
        tier: Tier,
        priority: i32,
        preemptible: bool,
        started_ms: u64,
    ) -> Allocation {
        let request = whole(gpus.len() as u16);
        let placement = Placement {
            node,
            gpus: gpus.to_vec(),
        };
        c.commit(&request, &placement).unwrap();
        Allocation {
            id,
            tenant: 1,
            tier,
            priority,
            preemptible,
            borrowed: false,
            request,
            placement,
            started_ms,
        }
    }

    const DEDICATED: Preemptor = Preemptor {
        tenant: 9,
        tier: Tier::Dedicated,
        priority: 0,
        reclaiming: false,
    };

    fn decide(
        c: &Cluster,
        allocs: &[Allocation],
        req: &Request,
        who: &Preemptor,
    ) -> PreemptDecision {
        let mut e = Engine::new(Policy::Flotilla.scorer(&TargetWorkload::default()));
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        plan(
            &mut e,
            c,
            allocs,
            req,
            who,
            &PreemptConfig::default(),
            100_000,
            &mut rng,
        )
    }

    fn evicted(d: &PreemptDecision) -> Vec<u64> {
        match d {
            PreemptDecision::Preempt(p) => p.evictions.iter().map(|e| e.allocation).collect(),
            other => panic!("expected a preemption, got {other:?}"),
        }
    }

    #[test]
    fn evicts_the_spot_job_that_loses_least_work() {
        let mut c = cluster(2);
        let allocs = vec![
            run(&mut c, 1, 0, &[0, 1], Tier::Dedicated, 0, false, 0),
            run(&mut c, 2, 0, &[2, 3], Tier::Shared, 0, true, 0),
            run(&mut c, 3, 1, &[0, 1], Tier::Shared, 0, true, 90_000),
            run(&mut c, 4, 1, &[2, 3], Tier::Shared, 0, false, 0),
        ];
        let d = decide(&c, &allocs, &whole(2), &DEDICATED);
        assert_eq!(evicted(&d), vec![3]);
        let PreemptDecision::Preempt(p) = d else {
            unreachable!()
        };
        assert_eq!(
            p.placement,
            Placement {
                node: 1,
                gpus: vec![0, 1]
            }
        );
        assert_eq!(p.evictions[0].notice_ms, 30_000);
        // 2000 milli-GPU for 10 s.
        assert_eq!(p.cost.gpu_milli_ms, 2000 * 10_000);
        assert_eq!(p.cost.victims, 1);
    }

    #[test]
    fn priority_outweighs_lost_work_and_two_cheap_victims_beat_one_dear() {
        let mut c = cluster(2);
        let allocs = vec![
            run(&mut c, 1, 0, &[0, 1], Tier::Dedicated, 0, false, 0),
            run(&mut c, 2, 0, &[2, 3], Tier::Shared, 0, true, 0),
            run(&mut c, 3, 1, &[0, 1], Tier::Shared, 3, true, 90_000),
            run(&mut c, 4, 1, &[2, 3], Tier::Shared, 3, false, 0),
        ];
        assert_eq!(
            evicted(&decide(&c, &allocs, &whole(2), &DEDICATED)),
            vec![2]
        );

        let mut c = cluster(1);
        let allocs = vec![
            run(&mut c, 1, 0, &[0], Tier::Shared, 0, true, 0),
            run(&mut c, 2, 0, &[1], Tier::Shared, 0, true, 0),
            run(&mut c, 3, 0, &[2, 3], Tier::Shared, 5, true, 99_000),
        ];
        assert_eq!(
            evicted(&decide(&c, &allocs, &whole(2), &DEDICATED)),
            vec![1, 2]
        );
    }

    #[test]
    fn never_tier_one_non_preemptible_or_equals() {
        let mut c = cluster(2);
        let allocs = vec![
            run(&mut c, 1, 0, &[0, 1, 2, 3], Tier::Dedicated, -5, true, 0),
            run(&mut c, 2, 1, &[0, 1, 2, 3], Tier::Queued, -5, false, 0),
        ];
        let PreemptDecision::Impossible(e) = decide(&c, &allocs, &whole(1), &DEDICATED) else {
            panic!("nothing may be evicted");
        };
        assert_eq!(e.protected, 2);
        assert_eq!(
            e.to_string(),
            "no eviction this request may make frees room on any of 2 nodes: \
             2 held by protected or equal-or-higher-ranked work"
        );
        // A spot request does not evict spot work of the same priority.
        let mut c = cluster(1);
        let allocs = vec![run(&mut c, 1, 0, &[0, 1, 2, 3], Tier::Shared, 0, true, 0)];
        let spot = Preemptor {
            tier: Tier::Shared,
            ..DEDICATED
        };
        assert!(matches!(
            decide(&c, &allocs, &whole(1), &spot),
            PreemptDecision::Impossible(_)
        ));
        // Too big for any node is said so.
        let PreemptDecision::Impossible(e) = decide(&c, &allocs, &whole(8), &DEDICATED) else {
            panic!("8 GPUs fit no 4-GPU node");
        };
        assert_eq!(e.why.count(crate::Reason::TooFewGpus), 1);
    }

    #[test]
    fn guarantees_reclaim_borrowed_capacity_only() {
        let mut c = cluster(1);
        let mut a = run(&mut c, 7, 0, &[0, 1, 2, 3], Tier::Shared, 0, true, 0);
        a.borrowed = true;
        let owner = Preemptor {
            tenant: 2,
            tier: Tier::Shared,
            priority: 0,
            reclaiming: true,
        };
        let allocs = vec![a];
        assert_eq!(evicted(&decide(&c, &allocs, &whole(4), &owner)), vec![7]);
        let not_reclaiming = Preemptor {
            reclaiming: false,
            ..owner
        };
        assert!(matches!(
            decide(&c, &allocs, &whole(4), &not_reclaiming),
            PreemptDecision::Impossible(_)
        ));
    }

    #[test]
    fn a_request_that_fits_evicts_nothing() {
        let c = cluster(1);
        assert!(matches!(
            decide(&c, &[], &whole(1), &DEDICATED),
            PreemptDecision::Fits(_)
        ));
    }

    #[test]
    fn a_gang_evicts_across_nodes() {
        let mut c = cluster(3);
        let allocs = vec![
            run(&mut c, 1, 0, &[0, 1, 2, 3], Tier::Shared, 0, true, 0),
            run(&mut c, 2, 1, &[0, 1, 2, 3], Tier::Shared, 0, true, 50_000),
            run(&mut c, 3, 2, &[0, 1, 2, 3], Tier::Dedicated, 0, false, 0),
        ];
        let gang = Gang::uniform(whole(4), 2, Locality::Any);
        let mut e = Engine::new(Policy::Flotilla.scorer(&TargetWorkload::default()));
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let cfg = PreemptConfig { notice_ms: 5_000 };
        let d = plan_gang(
            &mut e, &c, &allocs, &gang, &DEDICATED, &cfg, 100_000, &mut rng,
        );
        let GangPreemptDecision::Preempt(p) = d else {
            panic!("two spot nodes can be freed: {d:?}");
        };
        let ids: Vec<u64> = p.evictions.iter().map(|e| e.allocation).collect();
        assert_eq!(ids, vec![1, 2]);
        assert!(p.evictions.iter().all(|e| e.notice_ms == 5_000));
        let mut nodes: Vec<u32> = p.placement.members.iter().map(|m| m.node).collect();
        nodes.sort_unstable();
        assert_eq!(nodes, vec![0, 1]);
        // Three members cannot: the third node is tier 1.
        let gang = Gang::uniform(whole(4), 3, Locality::Any);
        let d = plan_gang(
            &mut e, &c, &allocs, &gang, &DEDICATED, &cfg, 100_000, &mut rng,
        );
        assert!(matches!(d, GangPreemptDecision::Impossible(_)), "{d:?}");
    }
}
