//! One scheduling pass as a pure function: a [`Snapshot`] in, a [`Plan`]
//! out. Nomad's scheduler is the model: the caller loads an immutable view
//! of the pool, the queue and the tenants, calls [`plan`], and applies the
//! plan with conditional writes (the server in one transaction; the
//! simulator to its own model). The planner never reads a clock or a
//! store, so a pass replayed with the same snapshot decides the same.
//!
//! What one pass decides, in queue order ([`crate::queue::order`]: priority,
//! then weighted fair share over recent GPU time, then FIFO):
//! - **placements**: every member of a work on a machine and GPUs, whole,
//!   as a milli-GPU share, or as a MIG slice, all members or none
//!   ([`crate::gang`]); members of a spread work on distinct machines;
//! - **preemptions**: when work fits nowhere, the cheapest set of running
//!   work it outranks ([`crate::preempt`]), each victim with its notice;
//!   the preemptor waits for them and their capacity is promised to it
//!   ([`Promise`]);
//! - **a reservation** for the first work that fits nowhere (the head):
//!   work behind it may start only where it cannot delay the head (EASY
//!   backfill, [`crate::queue::reserve`]);
//! - **a reason** ([`Wait`]) for every work left waiting.
//!
//! [`plan`] runs these as stages over one pass state: load the snapshot,
//! order the queue, then per work admit, place (backfill beside a blocked
//! head), preempt, or wait, the first work that waits for GPUs reserving.
//!
//! Machines with GPUs of several models become one engine node per model
//! sharing the machine's CPU and memory ([`crate::snapshot::Node::host`]).
//! A GPU in MIG mode is a GPU of a distinct engine model (`H100` in MIG
//! mode is the MIG-capable model `H100/mig`), so MIG profiles land only on
//! MIG-mode GPUs and whole GPUs and fractions only on the others.
//!
//! Quotas are one model, [`crate::quota`]: a guarantee and a limit in
//! milli-GPU per tenant, plus optional per-model limits. Work within its
//! tenant's guarantee may reclaim capacity other tenants borrowed; what a
//! tenant holds beyond its guarantee is borrowed ([`borrowed`]).

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::alloc::{Allocation, Resources, Tenant, Tier};
use crate::filter::{check, Explanation, Reason};
use crate::gang::{place_gang, Gang, GangDecision, Locality};
use crate::preempt::{self, GangPreemptDecision, PreemptConfig, Preemptor};
use crate::queue::{self, FairShareState, QueueItem, Reservation, Running};
use crate::quota::{self, Admission, Denial, QuotaUse};
use crate::request::{GpuDemand, ModelSet, Request};
use crate::select::{Engine, Placement};
use crate::snapshot::{Cluster, ModelId, ModelTable, NodeSpec};
use crate::{Error, TargetWorkload, MILLI};

pub use crate::input::{
    mig_milli, GpuAsk, GpuSnap, Hold, NodeSnap, Promise, QueuedWork, RunningWork, Snapshot,
    TenantPolicy, UsageSpan, WorkKey, MIG_SUFFIX,
};

/// Where one member goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberPlacement {
    /// Index into [`Snapshot::nodes`].
    pub node: usize,
    /// Catalog model of its GPUs.
    pub model: String,
    /// `(GPU index on the node, milli-GPU)`; empty for CPU-only work.
    pub gpus: Vec<(u16, u16)>,
}

/// A work placed by this pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    pub key: WorkKey,
    /// In member order.
    pub members: Vec<MemberPlacement>,
    /// Beyond its tenant's guarantee: may be reclaimed by preemption.
    pub borrowed: bool,
    /// Started ahead of a blocked head, where it cannot delay it.
    pub backfilled: bool,
}

/// A victim told to stop so that `by` can start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preemption {
    pub victim: WorkKey,
    pub by: WorkKey,
    /// SIGTERM now, SIGKILL after this.
    pub notice_ms: u64,
}

/// Why a work is still waiting after the pass. [`Wait::describe`] words it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wait {
    /// Its tenant's quota does not admit it now.
    OverQuota(Denial),
    /// It fits nowhere now; the text counts machines per reason.
    NoFit(String),
    /// Its victims were told to stop (this pass or before) and still hold
    /// the capacity promised to it.
    VictimsStopping(Vec<WorkKey>),
    /// It fits, but only where it would delay the head of the queue.
    BehindHead(WorkKey),
    /// It could never fit this pool, even empty (more distinct machines
    /// or GPUs than the pool has): waiting will not help until the pool
    /// grows. The text names the field at fault ([`crate::pool_fit`]).
    Unschedulable(String),
}

impl Wait {
    /// The reason as the API shows it, naming works through `name`.
    pub fn describe(&self, name: impl Fn(WorkKey) -> String) -> String {
        match self {
            Wait::OverQuota(d) => format!("over quota: {d}"),
            Wait::NoFit(why) => format!("waiting for GPUs: {why}"),
            Wait::Unschedulable(why) => format!("unschedulable in this pool: {why}"),
            Wait::VictimsStopping(v) => format!(
                "waiting for preempted instances to stop: {}",
                v.iter().map(|k| name(*k)).collect::<Vec<_>>().join(", ")
            ),
            Wait::BehindHead(h) => format!(
                "waiting behind {}: it is first in the queue and holds the nodes this would fit \
                 on until it can start (backfill only where it cannot delay it)",
                name(*h)
            ),
        }
    }

    /// A stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Wait::OverQuota(_) => "over_quota",
            Wait::NoFit(_) => "no_fit",
            Wait::VictimsStopping(_) => "victims_stopping",
            Wait::BehindHead(_) => "behind_head",
            Wait::Unschedulable(_) => "unschedulable",
        }
    }
}

/// The blocked head's reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadReservation {
    pub work: WorkKey,
    /// When it is expected to start; `None` when that depends on work of
    /// unknown length.
    pub start_ms: Option<u64>,
    /// Machines held for it (indices into [`Snapshot::nodes`]).
    pub nodes: Vec<usize>,
}

/// What one pass decided.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// The queue in the order it was tried.
    pub order: Vec<WorkKey>,
    pub placements: Vec<Placed>,
    pub preemptions: Vec<Preemption>,
    pub reservation: Option<HeadReservation>,
    /// Every queued work not placed, with its reason, in queue order.
    pub waiting: Vec<(WorkKey, Wait)>,
}

impl Plan {
    /// The reason `key` waits, if it does.
    pub fn wait_of(&self, key: WorkKey) -> Option<&Wait> {
        self.waiting.iter().find(|(k, _)| *k == key).map(|(_, w)| w)
    }
}

/// One engine node: the GPUs of one model (and MIG mode) of a machine.
#[derive(Debug, Clone)]
struct Slot {
    node: usize,
    model: String,
    /// Device index in the engine node -> GPU index on the machine.
    gpus: Vec<u16>,
}

/// The pass's model of the pool.
struct Pool {
    cluster: Cluster,
    slots: Vec<Slot>,
    /// (machine, GPU index) -> (slot, device index).
    device: HashMap<(usize, u16), (u32, u16)>,
    /// Engine models by catalog model name, plain and MIG.
    plain: BTreeMap<String, ModelId>,
    mig: BTreeMap<String, ModelId>,
    /// Each ready machine's first engine node.
    first_slot: HashMap<usize, u32>,
    /// Machines (ready or not), for explanations.
    machines: usize,
    unready: usize,
}

fn share_request(milli: u16) -> Request {
    if milli >= MILLI {
        Request::new(GpuDemand::whole(1), 0, 0)
    } else {
        // milli is 1..=999 here; share() accepts it.
        Request::new(
            GpuDemand::share(milli.max(1)).unwrap_or(GpuDemand::whole(1)),
            0,
            0,
        )
    }
}

/// Engine models by catalog model name.
type ModelIds = BTreeMap<String, ModelId>;

/// The engine's model table for `nodes`: each catalog model of a GPU not
/// in MIG mode as itself, and of a GPU in MIG mode as the MIG-capable
/// model `{model}/mig`. Returns the table and the ids, plain and MIG.
fn engine_models(nodes: &[NodeSnap]) -> Result<(ModelTable, ModelIds, ModelIds), Error> {
    let mut models = ModelTable::default();
    let mut plain = BTreeMap::new();
    let mut mig = BTreeMap::new();
    for g in nodes.iter().flat_map(|n| &n.gpus) {
        if g.mig {
            if !mig.contains_key(&g.model) {
                let id = models.intern(&format!("{}{MIG_SUFFIX}", g.model))?;
                models.set_mig_capable(id, true)?;
                mig.insert(g.model.clone(), id);
            }
        } else if !plain.contains_key(&g.model) {
            plain.insert(g.model.clone(), models.intern(&g.model)?);
        }
    }
    Ok((models, plain, mig))
}

impl Pool {
    /// The pool as the engine's model, with exactly the snapshot's free
    /// capacity: engine nodes for the ready machines, what running work
    /// holds committed, then whatever else is taken, and the machines'
    /// regions and pools as scopes.
    fn build(nodes: &[NodeSnap], running: &[RunningWork]) -> Result<Pool, Error> {
        let mut pool = Pool::empty(nodes)?;
        // What running work holds, then whatever else is taken (work the
        // caller did not list, capacity it keeps back), so the engine's free
        // capacity equals the snapshot's.
        pool.hold_running(running);
        pool.hold_rest(nodes)?;
        pool.number_scopes(nodes)?;
        Ok(pool)
    }

    /// Engine nodes for the ready machines, all capacity free.
    fn empty(nodes: &[NodeSnap]) -> Result<Pool, Error> {
        let (models, plain, mig) = engine_models(nodes)?;
        let mut pool = Pool {
            cluster: Cluster::new(models),
            slots: Vec::new(),
            device: HashMap::new(),
            plain,
            mig,
            first_slot: HashMap::new(),
            machines: nodes.len(),
            unready: 0,
        };
        for (i, n) in nodes.iter().enumerate() {
            if !n.ready {
                pool.unready += 1;
                continue;
            }
            pool.add_machine(i, n)?;
        }
        Ok(pool)
    }

    /// Machine `i` as one engine node per GPU model (and MIG mode), or one
    /// without GPUs for a machine that has none; all of them name the
    /// machine as their host, so that they share its CPU and memory.
    fn add_machine(&mut self, i: usize, n: &NodeSnap) -> Result<(), Error> {
        let mut groups: BTreeMap<(bool, &str), Vec<u16>> = BTreeMap::new();
        for (gi, g) in n.gpus.iter().enumerate() {
            let gi = u16::try_from(gi).map_err(|_| Error::InvalidRequest("too many gpus"))?;
            groups
                .entry((g.mig, g.model.as_str()))
                .or_default()
                .push(gi);
        }
        let host = u32::try_from(i + 1).map_err(|_| Error::InvalidRequest("too many nodes"))?;
        if groups.is_empty() {
            self.add_slot(i, n, host, None, Vec::new(), "")?;
        }
        for ((is_mig, model), gpus) in groups {
            let id = if is_mig {
                self.mig[model]
            } else {
                self.plain[model]
            };
            self.add_slot(i, n, host, Some(id), gpus, model)?;
        }
        Ok(())
    }

    /// One engine node of machine `i`: the machine's GPUs `gpus` (indices
    /// on the machine) of engine model `model`, catalog name `name`.
    fn add_slot(
        &mut self,
        i: usize,
        n: &NodeSnap,
        host: u32,
        model: Option<ModelId>,
        gpus: Vec<u16>,
        name: &str,
    ) -> Result<(), Error> {
        let spec = NodeSpec {
            model,
            gpus: u16::try_from(gpus.len()).unwrap_or(u16::MAX),
            cpu_milli: n.cpu_total_milli.max(n.cpu_free_milli),
            mem_mib: n.mem_total_mib.max(n.mem_free_mib),
        };
        let idx = self.cluster.add_node(spec)?;
        self.cluster.set_cordoned(idx, n.cordoned)?;
        self.cluster.set_runtime(idx, n.runtime)?;
        self.cluster.set_host(idx, host)?;
        self.first_slot.entry(i).or_insert(idx);
        for (d, &gi) in gpus.iter().enumerate() {
            self.device.insert((i, gi), (idx, d as u16));
        }
        self.slots.push(Slot {
            node: i,
            model: name.to_string(),
            gpus,
        });
        Ok(())
    }

    /// Commits what running work holds. A hold the engine cannot represent
    /// as one placement (several partial GPUs) is committed share by share,
    /// CPU and memory with the first.
    fn hold_running(&mut self, running: &[RunningWork]) {
        for m in running.iter().flat_map(|r| &r.members) {
            match self.hold(m) {
                Some((req, at)) => {
                    let _ = self.cluster.commit(&req, &at);
                }
                None => {
                    // Several partial GPUs: each share on its own, CPU and
                    // memory with the first.
                    for (k, &(g, milli)) in m.gpus.iter().enumerate() {
                        if let Some(&(s, d)) = self.device.get(&(m.node, g)) {
                            let mut req = share_request(milli);
                            if k == 0 {
                                req.cpu_milli = m.cpu_milli;
                                req.mem_mib = m.mem_mib;
                            }
                            let at = Placement {
                                node: s,
                                gpus: vec![d],
                            };
                            let _ = self.cluster.commit(&req, &at);
                        }
                    }
                }
            }
        }
    }

    /// Commits whatever else the snapshot counts as taken: per GPU, and per
    /// machine (on its first engine node) CPU and memory, down to the
    /// snapshot's free capacity. Walked in machine and GPU order, not the
    /// maps' (random) order: the order of these commits shapes the
    /// engine's node classes and so its tie-breaking, and the same
    /// snapshot must plan the same in every process (the simulator, the
    /// server and a replay compare plans).
    fn hold_rest(&mut self, nodes: &[NodeSnap]) -> Result<(), Error> {
        let mut devices: Vec<((usize, u16), (u32, u16))> =
            self.device.iter().map(|(&k, &v)| (k, v)).collect();
        devices.sort_unstable();
        let mut firsts: Vec<(usize, u32)> = self.first_slot.iter().map(|(&k, &v)| (k, v)).collect();
        firsts.sort_unstable();
        for ((i, gi), (s, d)) in devices {
            let want = nodes[i].gpus[usize::from(gi)].free_milli.min(MILLI);
            let have = self
                .cluster
                .node(s)
                .map_or(0, |n| n.gpu_free[usize::from(d)]);
            if have > want {
                self.cluster.commit(
                    &share_request(have - want),
                    &Placement {
                        node: s,
                        gpus: vec![d],
                    },
                )?;
            }
        }
        for (i, s) in firsts {
            let n = &nodes[i];
            let Some(e) = self.cluster.node(s) else {
                continue;
            };
            let cpu = e.cpu_free.saturating_sub(n.cpu_free_milli);
            let mem = e.mem_free.saturating_sub(n.mem_free_mib);
            if cpu > 0 || mem > 0 {
                self.cluster.commit(
                    &Request::new(GpuDemand::None, cpu, mem),
                    &Placement {
                        node: s,
                        gpus: Vec::new(),
                    },
                )?;
            }
        }
        Ok(())
    }

    /// Regions and pools as the engine's scope numbers, from 1, in slot
    /// order.
    fn number_scopes(&mut self, nodes: &[NodeSnap]) -> Result<(), Error> {
        let mut regions: BTreeMap<&str, u32> = BTreeMap::new();
        let mut pools: BTreeMap<&str, u32> = BTreeMap::new();
        for (si, s) in self.slots.iter().enumerate() {
            let n = &nodes[s.node];
            let next = regions.len() as u32 + 1;
            let r = *regions.entry(n.region.as_str()).or_insert(next);
            let next = pools.len() as u32 + 1;
            let p = *pools.entry(n.pool.as_str()).or_insert(next);
            self.cluster.set_region(si as u32, r)?;
            self.cluster.set_domain(si as u32, p)?;
        }
        Ok(())
    }

    /// Masks promised capacity for everyone but its preemptor: commits it
    /// now, and returns the commits per preemptor, to be released for it
    /// alone when its turn comes ([`PassState::take_promise`]).
    fn mask_promises(&mut self, promises: &[Promise]) -> BTreeMap<WorkKey, Promised> {
        let mut promised: BTreeMap<WorkKey, Promised> = BTreeMap::new();
        for p in promises {
            let Some(&(s, d)) = self.device.get(&(p.node, p.gpu)) else {
                continue;
            };
            let req = share_request(p.milli);
            let at = Placement {
                node: s,
                gpus: vec![d],
            };
            if self.cluster.commit(&req, &at).is_ok() {
                promised.entry(p.to).or_default().push((req, at));
            }
        }
        promised
    }

    /// The engine models `w` accepts given its tenant's per-model room.
    fn models_for(&self, w: &QueuedWork, room: impl Fn(&str) -> bool) -> ModelSet {
        let table = match w.gpu {
            GpuAsk::Mig(_) => &self.mig,
            _ => &self.plain,
        };
        ModelSet::of(
            table
                .iter()
                .filter(|(m, _)| w.models.is_empty() || w.models.iter().any(|a| a == *m))
                .filter(|(m, _)| room(m))
                .map(|(_, &id)| id),
        )
    }

    /// A machine-level placement of an engine placement.
    fn member(&self, p: &Placement, req: &Request) -> Option<MemberPlacement> {
        let slot = self.slots.get(p.node as usize)?;
        let per = req.gpu.per_gpu_milli();
        let gpus = p
            .gpus
            .iter()
            .map(|&d| slot.gpus.get(usize::from(d)).map(|&g| (g, per)))
            .collect::<Option<Vec<_>>>()?;
        Some(MemberPlacement {
            node: slot.node,
            model: slot.model.clone(),
            gpus,
        })
    }

    /// The engine placement and request of a hold, if the pool has its
    /// GPUs on one engine node (a hold of several partial GPUs is not
    /// representable and is left out: never a victim, never released).
    fn hold(&self, h: &Hold) -> Option<(Request, Placement)> {
        let mut slot = None;
        let mut devs = Vec::with_capacity(h.gpus.len());
        for &(g, _) in &h.gpus {
            let &(s, d) = self.device.get(&(h.node, g))?;
            if slot.is_some_and(|x| x != s) {
                return None;
            }
            slot = Some(s);
            devs.push(d);
        }
        if h.gpus.is_empty() {
            slot = self.first_slot.get(&h.node).copied();
        }
        let slot = slot?;
        let whole = h.gpus.iter().all(|&(_, m)| m >= MILLI);
        let gpu = match (whole, h.gpus.as_slice()) {
            (_, []) => GpuDemand::None,
            (true, _) => GpuDemand::whole(u16::try_from(h.gpus.len()).ok()?),
            (false, [(_, m)]) => GpuDemand::share(*m).ok()?,
            _ => return None,
        };
        Some((
            Request::new(gpu, h.cpu_milli, h.mem_mib),
            Placement {
                node: slot,
                gpus: devs,
            },
        ))
    }

    /// Why `req` fits on no machine, counting machines (not engine nodes):
    /// each machine reports the reason of its engine node that came
    /// closest to fitting.
    fn explain(&self, req: &Request) -> Explanation {
        let mut best: BTreeMap<usize, Reason> = BTreeMap::new();
        for (si, s) in self.slots.iter().enumerate() {
            let Some(state) = self.cluster.state_of(si as u32) else {
                continue;
            };
            let r = match check(state, req) {
                Ok(()) => continue,
                Err(r) => r,
            };
            let e = best.entry(s.node).or_insert(r);
            if (r as usize) > (*e as usize) {
                *e = r;
            }
        }
        let mut why = Explanation::default();
        for r in best.values() {
            why.add(*r, 1);
        }
        // Machines whose every engine node fits (possible when the work
        // failed only for a later member) are counted as short of share.
        let fitting = self
            .machines
            .saturating_sub(self.unready)
            .saturating_sub(best.len());
        if fitting > 0 {
            why.add(Reason::TooLittleGpuShare, fitting);
        }
        if self.unready > 0 {
            why.add(Reason::Unreachable, self.unready);
        }
        why
    }
}

/// Which of `running` hold borrowed capacity: per tenant, oldest first, the
/// work beyond the tenant's guarantee (everything, without a guarantee).
/// Returns a flag per entry of `running`.
pub fn borrowed(running: &[RunningWork], tenants: &BTreeMap<Tenant, TenantPolicy>) -> Vec<bool> {
    let mut by_tenant: BTreeMap<Tenant, Vec<usize>> = BTreeMap::new();
    for (i, r) in running.iter().enumerate() {
        by_tenant.entry(r.tenant).or_default().push(i);
    }
    let mut out = vec![false; running.len()];
    for (t, mut list) in by_tenant {
        list.sort_by_key(|&i| (running[i].started_ms, running[i].key));
        let guaranteed = tenants.get(&t).map_or(0, |p| p.quota.guaranteed_milli);
        let mut used = 0u64;
        for i in list {
            used = used.saturating_add(held_milli(&running[i]));
            out[i] = used > guaranteed;
        }
    }
    out
}

fn held_milli(r: &RunningWork) -> u64 {
    r.members
        .iter()
        .flat_map(|m| &m.gpus)
        .map(|&(_, m)| u64::from(m))
        .sum()
}

/// What each tenant holds: total and per model, milli-GPU.
#[derive(Debug, Default, Clone)]
struct Held {
    total: u64,
    guaranteed: u64,
    per_model: BTreeMap<String, u64>,
}

/// Plans one pass. Errors only on a snapshot the engine cannot model
/// (more than 64 GPU models, a GPU index past `u16`); a work that cannot
/// be placed is a [`Wait`], never an error.
///
/// The pass runs in stages over one `PassState`: it loads the snapshot
/// (`PassState::new`), orders the queue (`PassState::order`), and takes
/// each work in that order through `PassState::decide`: admit, place
/// (backfill beside a blocked head), preempt, or wait with a reason, the
/// first work that waits for GPUs reserving.
pub fn plan(snap: &Snapshot) -> Result<Plan, Error> {
    let mut pass = PassState::new(snap)?;
    let mut picker = pass.order()?;
    while let Some(qi) = picker.next(snap, &pass.held) {
        pass.decide(&snap.queue[qi]);
    }
    Ok(pass.finish())
}

/// Capacity promised to one preemptor, as the engine's commits.
type Promised = Vec<(Request, Placement)>;

/// What one pass carries from one work to the next. Within a pass the
/// pool only fills (a promise is released only during its preemptor's own
/// turn; victims keep their GPUs until they stop) and running work only
/// leaves the victims on offer: what the memos ([`Memo`]) rely on.
struct PassState<'s> {
    snap: &'s Snapshot,
    /// The engine's model of the pool: running work, promised capacity and
    /// this pass's placements committed.
    pool: Pool,
    /// Tie-breaking (and the Random policy), seeded by the snapshot, drawn
    /// in queue order: the same snapshot plans the same.
    rng: ChaCha8Rng,
    engines: Engines,
    /// Running work as the engine's allocations, for preemption.
    victims: Victims,
    /// What each tenant holds, this pass's placements included: quota
    /// admission and the picker read it.
    held: BTreeMap<Tenant, Held>,
    /// Work of known end (running, and placed this pass): a later head's
    /// reservation counts on its end.
    ending: Vec<Running>,
    /// Capacity promised to each preemptor, masked in the pool for
    /// everyone else.
    promised: BTreeMap<WorkKey, Promised>,
    /// Victims still holding their GPUs, per preemptor.
    stopping_for: BTreeMap<WorkKey, Vec<WorkKey>>,
    memo: Memo,
    /// The blocked head, once a work waits for GPUs and reserves.
    head: Option<Head>,
    out: Plan,
}

/// The scorer's cache is per cluster: one engine for the pool, one for
/// the pool outside the head's machines, one for scratch copies (gangs,
/// reservations), so that none of them flushes another's.
struct Engines {
    pool: Engine,
    outside: Engine,
    scratch: Engine,
}

impl Engines {
    /// Fragmentation-aware scorers measure against this pass's mix.
    fn new(snap: &Snapshot) -> Engines {
        let shapes: Vec<Request> = snap
            .queue
            .iter()
            .filter_map(|w| w.gpu.demand().ok().map(|d| Request::new(d, 0, 0)))
            .collect();
        let workload =
            TargetWorkload::from_gpu_requests(shapes.iter(), TargetWorkload::DEFAULT_COVERAGE);
        Engines {
            pool: Engine::new(snap.policy.scorer(&workload)),
            outside: Engine::new(snap.policy.scorer(&workload)),
            scratch: Engine::new(snap.policy.scorer(&workload)),
        }
    }
}

/// Within one pass the pool only fills (and victims only leave the
/// offers), so a shape that found no room, no room outside the head's
/// machines, or no victims, finds none later in the pass either.
#[derive(Default)]
struct Memo {
    /// Shapes that fit nowhere, with the reason in words.
    no_fit: HashMap<ShapeKey, String>,
    no_fit_outside: HashSet<ShapeKey>,
    /// By shape and preemptor rank (tier, priority, reclaiming tenant).
    no_victims: HashSet<(ShapeKey, Tier, i32, Option<Tenant>)>,
}

/// The blocked head: the first work that waits for GPUs (and could fit the
/// pool emptied). Work behind it starts only where it cannot delay it.
struct Head {
    work: WorkKey,
    reservation: Reservation,
    /// The pool with the head's machines cordoned, kept in step with it.
    outside: Cluster,
    /// Its tenant and ask (milli-GPU): the reservation holds its tenant's
    /// quota for it too.
    tenant: Tenant,
    ask: u64,
}

/// A work its tenant's quota admits, as the engine asks for it.
struct Ask {
    members: usize,
    /// One member's request (its models narrowed to the tenant's room).
    req: Request,
    gang: Gang,
    shape: ShapeKey,
    /// Milli-GPU of all members.
    milli: u64,
    /// Beyond its tenant's guarantee.
    borrowed: bool,
    /// Within a real guarantee, asking for GPUs: it may reclaim capacity
    /// other tenants borrowed.
    reclaiming: bool,
    /// Time to ready by engine node; empty when where it starts does not
    /// change when it is ready.
    ready: Vec<u64>,
}

/// Where the place stage found room for a work.
enum Fit {
    /// One placement per member; `true` when it starts ahead of a blocked
    /// head.
    At(Vec<Placement>, bool),
    /// Room only where it would delay the head.
    BehindHead(WorkKey),
    /// No room, now or (as a memo knows) for the rest of the pass.
    Nowhere,
}

impl<'s> PassState<'s> {
    /// **Load**: the pool with what running work holds, running work as
    /// the engine's allocations and as each tenant's quota use, promised
    /// capacity masked for everyone but its preemptor.
    fn new(snap: &'s Snapshot) -> Result<Self, Error> {
        let mut pool = Pool::build(&snap.nodes, &snap.running)?;
        let rng = ChaCha8Rng::seed_from_u64(snap.seed);
        let borrowed_flags = borrowed(&snap.running, &snap.tenants);
        let held = held_by_tenant(snap, &borrowed_flags);
        let (victims, ending) = Victims::load(snap, &pool, &borrowed_flags);
        let promised = pool.mask_promises(&snap.promises);
        // Victims still holding their GPUs, per preemptor.
        let mut stopping_for: BTreeMap<WorkKey, Vec<WorkKey>> = BTreeMap::new();
        for r in &snap.running {
            if let Some(by) = r.preempted_by {
                stopping_for.entry(by).or_default().push(r.key);
            }
        }
        Ok(PassState {
            snap,
            pool,
            rng,
            engines: Engines::new(snap),
            victims,
            held,
            ending,
            promised,
            stopping_for,
            memo: Memo::default(),
            head: None,
            out: Plan::default(),
        })
    }

    /// **Order**: the queue as [`crate::queue::order_with_running`] ranks
    /// it (priority, then weighted fair share over recent GPU time and
    /// what runs now, then FIFO), handed out by a [`Picker`] that puts
    /// guaranteed work of a level before borrowing work.
    fn order(&self) -> Result<Picker, Error> {
        let snap = self.snap;
        let share = fair_share(snap, self.pool.cluster.gpu_capacity_milli().max(1))?;
        let items = queued_items(snap);
        // Work running now counts as an item picked at its own rank for its
        // remaining time (see queue::order_with_running).
        let running = running_items(snap);
        let order = queue::order_with_running(&items, &running, &share, snap.now_ms);
        Ok(Picker::new(snap, &order))
    }

    /// One work, in queue order, through the stages: admitted by quota,
    /// then placed (beside a blocked head only where it cannot delay it),
    /// else waiting for its victims, or preempting, or waiting behind the
    /// head, or waiting for GPUs (the first such work reserving). Every
    /// work ends in [`Plan::placements`] or [`Plan::waiting`], once.
    fn decide(&mut self, w: &QueuedWork) {
        self.out.order.push(w.key);
        let Some(ask) = self.admit(w) else {
            return;
        };
        let promise = self.take_promise(w.key);
        let cached = if promise.is_empty() {
            self.memo.no_fit.get(&ask.shape).cloned()
        } else {
            None
        };
        let behind = match self.place(w, &ask, cached.is_some(), !promise.is_empty()) {
            Fit::At(at, backfilled) => {
                self.commit(w, &ask, &at, backfilled);
                return;
            }
            Fit::BehindHead(head) => Some(head),
            Fit::Nowhere => None,
        };
        // It fits nowhere now. Mask its promised capacity again: it waits
        // for the rest.
        let had_promise = !promise.is_empty();
        self.return_promise(w.key, promise);
        let waiting_on = self.stopping_for.get(&w.key).cloned().unwrap_or_default();
        if !waiting_on.is_empty() {
            self.out
                .waiting
                .push((w.key, Wait::VictimsStopping(waiting_on)));
            return;
        }
        if self.preempt(w, &ask) {
            return;
        }
        if let Some(head) = behind {
            self.out.waiting.push((w.key, Wait::BehindHead(head)));
            return;
        }
        let text = match cached {
            Some(t) => t,
            None => self.explain(w, &ask, had_promise),
        };
        if let Some(why) = crate::pool_fit::never_fits(&self.snap.nodes, w) {
            self.out.waiting.push((w.key, Wait::Unschedulable(why)));
            return;
        }
        self.out.waiting.push((w.key, Wait::NoFit(text)));
        if self.head.is_none() && could_fit_empty(&self.pool, &ask.gang) {
            self.reserve(w, &ask);
        }
    }

    /// **Admit**: whether the work's tenant's quota admits it now
    /// (guaranteed or borrowed), counting the quota the head's reservation
    /// holds; and the work as the engine's request, its models narrowed to
    /// those its tenant's per-model limits leave room on. A work not
    /// admitted waits ([`Wait::OverQuota`], or [`Wait::NoFit`] for a GPU
    /// request that is not valid).
    fn admit(&mut self, w: &QueuedWork) -> Option<Ask> {
        let members = usize::from(w.members.max(1));
        let Ok(demand) = w.gpu.demand() else {
            self.out
                .waiting
                .push((w.key, Wait::NoFit("the GPU request is not valid".into())));
            return None;
        };
        let unlimited = TenantPolicy::unlimited();
        let policy = self.snap.tenants.get(&w.tenant).unwrap_or(&unlimited);
        let empty = Held::default();
        let h = self.held.get(&w.tenant).unwrap_or(&empty);
        let ask = w.gpu.milli() * members as u64;
        // The head's reservation holds its tenant's quota for it too:
        // otherwise the tenant's later work could take the quota the head
        // waits with, and the head would lose its place on the next pass.
        let head_quota = match &self.head {
            Some(head) if head.tenant == w.tenant => head.ask,
            _ => 0,
        };
        let used = QuotaUse {
            guaranteed_milli: h.guaranteed,
            borrowed_milli: h
                .total
                .saturating_sub(h.guaranteed)
                .saturating_add(head_quota),
        };
        let admission = quota::admit(&policy.quota, &used, ask, u64::MAX);
        let borrowed = match admission {
            Admission::Denied(d) => {
                self.out.waiting.push((w.key, Wait::OverQuota(d)));
                return None;
            }
            Admission::Guaranteed => false,
            Admission::Borrowed => true,
        };
        let models = self.pool.models_for(w, |m| {
            policy.per_model_milli.get(m).is_none_or(|&limit| {
                h.per_model.get(m).copied().unwrap_or(0).saturating_add(ask) <= limit
            })
        });
        let req = Request::new(demand, w.cpu_milli, w.mem_mib)
            .with_models(models)
            .with_runtime(w.runtime);
        let mut gang = Gang::uniform(req, members, w.locality);
        gang.spread = w.spread && members > 1;
        let shape = ShapeKey {
            req,
            members,
            locality: w.locality,
            spread: gang.spread,
        };
        Some(Ask {
            members,
            req,
            gang,
            shape,
            milli: ask,
            borrowed,
            // Only a real guarantee, and only for GPUs, reclaims.
            reclaiming: matches!(admission, Admission::Guaranteed)
                && policy.quota.guaranteed_milli > 0
                && ask > 0,
            ready: self.ready_by_slot(w),
        })
    }

    /// Time to ready by engine node (slot), from the machine's; empty when
    /// the work gives none.
    fn ready_by_slot(&self, w: &QueuedWork) -> Vec<u64> {
        if w.ready_ms.is_empty() {
            return Vec::new();
        }
        self.pool
            .slots
            .iter()
            .map(|s| w.ready_ms.get(s.node).copied().unwrap_or(u64::MAX))
            .collect()
    }

    /// Its promised capacity is offered to it alone: released in the pool
    /// (and outside the head's machines) until it is placed or waits.
    fn take_promise(&mut self, key: WorkKey) -> Promised {
        let mine = self.promised.remove(&key).unwrap_or_default();
        for (r, p) in &mine {
            let _ = self.pool.cluster.release(r, p);
            if let Some(h) = self.head.as_mut() {
                let _ = h.outside.release(r, p);
            }
        }
        mine
    }

    /// A promise not used this pass is masked again, for the next.
    fn return_promise(&mut self, key: WorkKey, mine: Promised) {
        for (r, p) in &mine {
            let _ = self.pool.cluster.commit(r, p);
            if let Some(h) = self.head.as_mut() {
                let _ = h.outside.commit(r, p);
            }
        }
        if !mine.is_empty() {
            self.promised.insert(key, mine);
        }
    }

    /// **Place**: where the work goes now, every member or none, on the
    /// pool as it is (its promise included); `cached` when a memo already
    /// says its shape fits nowhere. Work with a promise takes it whatever
    /// the head; other work is then checked against the head ([`Self::backfill`]).
    fn place(&mut self, w: &QueuedWork, ask: &Ask, cached: bool, has_promise: bool) -> Fit {
        if cached {
            return Fit::Nowhere;
        }
        let engines = &mut self.engines;
        let Some(at) = place_on(
            &mut engines.pool,
            &mut engines.scratch,
            &self.pool.cluster,
            &ask.gang,
            &ask.ready,
            &mut self.rng,
        ) else {
            return Fit::Nowhere;
        };
        if has_promise {
            return Fit::At(at, false);
        }
        self.backfill(w, ask, at)
    }

    /// **Backfill**: with a head blocked, work that fits starts only where
    /// it cannot delay the head: where the reservation admits it beside
    /// the head (EASY backfill, [`Reservation::admit_backfill`]: it ends
    /// before the head's start or leaves the head's room), else off the
    /// head's machines. Otherwise, as far as the head allows, it fits
    /// nowhere (it may still preempt off the head's machines, as it would
    /// on the next pass).
    fn backfill(&mut self, w: &QueuedWork, ask: &Ask, at: Vec<Placement>) -> Fit {
        let Some(head) = self.head.as_mut() else {
            return Fit::At(at, false);
        };
        let ends = w.max_runtime_ms.map(|t| self.snap.now_ms.saturating_add(t));
        let mut trial = head.reservation.clone();
        if at.iter().all(|m| trial.admit_backfill(&ask.req, m, ends)) {
            head.reservation = trial;
            return Fit::At(at, true);
        }
        let around = if self.memo.no_fit_outside.contains(&ask.shape) {
            None
        } else {
            place_on(
                &mut self.engines.outside,
                &mut self.engines.scratch,
                &head.outside,
                &ask.gang,
                &ask.ready,
                &mut self.rng,
            )
        };
        match around {
            Some(q) => Fit::At(q, true),
            None => {
                self.memo.no_fit_outside.insert(ask.shape);
                Fit::BehindHead(head.work)
            }
        }
    }

    /// Commits a placement: the pool (and the pool outside the head's
    /// machines) fills, the tenant's use grows, and work of known length
    /// counts for a later head's reservation.
    fn commit(&mut self, w: &QueuedWork, ask: &Ask, at: &[Placement], backfilled: bool) {
        let mut placed = Vec::with_capacity(ask.members);
        let mut ok = true;
        let ends = w.max_runtime_ms.map(|t| self.snap.now_ms.saturating_add(t));
        for m in at {
            match (
                self.pool.cluster.commit(&ask.req, m),
                self.pool.member(m, &ask.req),
            ) {
                (Ok(()), Some(mp)) => placed.push(mp),
                _ => ok = false,
            }
            if let Some(h) = self.head.as_mut() {
                let _ = h.outside.commit(&ask.req, m);
            }
            // A later head's reservation counts on its end, as it
            // will once this runs.
            if ends.is_some() {
                self.ending.push(Running {
                    request: ask.req,
                    placement: m.clone(),
                    expected_end_ms: ends,
                });
            }
        }
        debug_assert!(ok, "the engine proposed a placement that does not fit");
        if !ok {
            self.out.waiting.push((
                w.key,
                Wait::NoFit("internal: inconsistent placement".into()),
            ));
            return;
        }
        let e = self.held.entry(w.tenant).or_default();
        e.total = e.total.saturating_add(ask.milli);
        if !ask.borrowed {
            e.guaranteed = e.guaranteed.saturating_add(ask.milli);
        }
        for m in &placed {
            let sum: u64 = m.gpus.iter().map(|&(_, x)| u64::from(x)).sum();
            *e.per_model.entry(m.model.clone()).or_default() += sum;
        }
        self.out.placements.push(Placed {
            key: w.key,
            members: placed,
            borrowed: ask.borrowed,
            backfilled,
        });
    }

    /// **Preempt**: work that fits nowhere may stop the cheapest set of
    /// running work it outranks, or, within its guarantee, borrowed work
    /// of other tenants ([`crate::preempt`]). Returns whether it did: the
    /// victims are told to stop and the work waits for them.
    fn preempt(&mut self, w: &QueuedWork, ask: &Ask) -> bool {
        let who = Preemptor {
            tenant: w.tenant,
            tier: w.tier,
            priority: w.priority,
            reclaiming: ask.reclaiming,
        };
        let memo_key = (
            ask.shape,
            w.tier,
            w.priority,
            who.reclaiming.then_some(w.tenant),
        );
        if !self.victims.may_preempt(&who) || self.memo.no_victims.contains(&memo_key) {
            return false;
        }
        let victims = self.find_victims(w, ask, &who);
        if victims.is_empty() {
            self.memo.no_victims.insert(memo_key);
            return false;
        }
        self.stop(w.key, &victims);
        true
    }

    /// The running work (indices into [`Snapshot::running`]) whose stopping
    /// lets `w` start; empty if none will do. Single-member work is tried
    /// first: preempting a gang's member stops the whole gang, on other
    /// machines too. Behind a blocked head, work may preempt only to start
    /// where it cannot delay the head: off its machines.
    fn find_victims(&mut self, w: &QueuedWork, ask: &Ask, who: &Preemptor) -> Vec<usize> {
        let snap = self.snap;
        let PassState {
            pool,
            rng,
            engines,
            victims,
            head,
            ..
        } = self;
        for singles_only in [true, false] {
            let (list, map) = victims.offered(who, singles_only);
            if list.is_empty() {
                continue;
            }
            let found = match (ask.members, head.as_mut()) {
                (1, Some(h)) if w.locality == Locality::Any => preempt_one(
                    &mut engines.outside,
                    &eligible(&list, &h.outside, &ask.req),
                    &mut h.outside,
                    &ask.req,
                    who,
                    &snap.preempt,
                    snap.now_ms,
                    rng,
                ),
                (1, None) if w.locality == Locality::Any => preempt_one(
                    &mut engines.pool,
                    &eligible(&list, &pool.cluster, &ask.req),
                    &mut pool.cluster,
                    &ask.req,
                    who,
                    &snap.preempt,
                    snap.now_ms,
                    rng,
                ),
                (_, h) => preempt_gang(
                    &mut engines.scratch,
                    h.map_or(&pool.cluster, |h| &h.outside),
                    &list,
                    &ask.gang,
                    who,
                    &snap.preempt,
                    snap.now_ms,
                    rng,
                ),
            };
            if let Some(ids) = found {
                let mut chosen: Vec<usize> = ids
                    .iter()
                    .filter_map(|&id| map.get(id as usize).copied())
                    .collect();
                chosen.sort_unstable();
                chosen.dedup();
                return chosen;
            }
        }
        Vec::new()
    }

    /// Tells `victims` to stop for `by`: they leave every offer (never
    /// chosen twice), and `by` waits for them.
    fn stop(&mut self, by: WorkKey, victims: &[usize]) {
        let keys: Vec<WorkKey> = victims.iter().map(|&v| self.snap.running[v].key).collect();
        self.stopping_for.insert(by, keys.clone());
        for &v in victims {
            self.victims.stopping[v] = true;
            self.out.preemptions.push(Preemption {
                victim: self.snap.running[v].key,
                by,
                notice_ms: self.snap.preempt.notice_ms,
            });
        }
        for o in self.victims.offers.values_mut() {
            o.remove(victims);
        }
        self.out.waiting.push((by, Wait::VictimsStopping(keys)));
    }

    /// Why the work fits nowhere, in words: per machine for one member,
    /// the gang's closest scope for several. Remembered for its shape,
    /// unless its promise was offered (then the verdict is its own).
    fn explain(&mut self, w: &QueuedWork, ask: &Ask, had_promise: bool) -> String {
        let t = if ask.members == 1 {
            self.pool.explain(&ask.req).to_string()
        } else {
            match place_gang(
                &mut self.engines.scratch,
                &self.pool.cluster,
                &ask.gang,
                &mut self.rng,
            ) {
                GangDecision::Unschedulable(why) => {
                    gang_text(&why, w.locality, &self.snap.nodes, &self.pool)
                }
                GangDecision::Placed(_) => "it fits only with its promised GPUs".into(),
            }
        };
        // With its promise offered, its shape's verdict is its own.
        if !had_promise {
            self.memo.no_fit.insert(ask.shape, t.clone());
        }
        t
    }

    /// **Reserve**: the work becomes the blocked head. Its reservation
    /// ([`crate::queue::reserve`]) holds the machines it will start on,
    /// when running work of known end has ended, whole (their engine nodes
    /// share CPU and memory), and its tenant's quota; from here on work
    /// behind it is placed against it ([`Self::backfill`]).
    fn reserve(&mut self, w: &QueuedWork, ask: &Ask) {
        let mut r = queue::reserve(
            &mut self.engines.scratch,
            &self.pool.cluster,
            &self.ending,
            &ask.gang,
            self.snap.now_ms,
            &mut self.rng,
        );
        // The engine nodes of a reserved machine share its CPU and
        // memory: hold the whole machine.
        let mut nodes: Vec<u32> = r
            .nodes
            .iter()
            .flat_map(|&n| self.pool.cluster.host_nodes(n))
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        r.nodes = nodes;
        let mut outside = self.pool.cluster.clone();
        for &n in &r.nodes {
            let _ = outside.set_cordoned(n, true);
        }
        self.head = Some(Head {
            work: w.key,
            reservation: r,
            outside,
            tenant: w.tenant,
            ask: ask.milli,
        });
    }

    /// The plan, with the head's reservation in machines.
    fn finish(mut self) -> Plan {
        let slots = &self.pool.slots;
        self.out.reservation = self.head.map(|h| {
            let nodes: BTreeSet<usize> = h
                .reservation
                .nodes
                .iter()
                .filter_map(|&n| slots.get(n as usize).map(|s| s.node))
                .collect();
            HeadReservation {
                work: h.work,
                start_ms: h.reservation.start_ms,
                nodes: nodes.into_iter().collect(),
            }
        });
        self.out
    }
}

/// What each tenant holds through running work: in all, within its
/// guarantee (work not [`borrowed`]), and per GPU model.
fn held_by_tenant(snap: &Snapshot, borrowed: &[bool]) -> BTreeMap<Tenant, Held> {
    let mut held: BTreeMap<Tenant, Held> = BTreeMap::new();
    for (wi, r) in snap.running.iter().enumerate() {
        let h = held.entry(r.tenant).or_default();
        let milli = held_milli(r);
        h.total = h.total.saturating_add(milli);
        if !borrowed[wi] {
            h.guaranteed = h.guaranteed.saturating_add(milli);
        }
        for m in &r.members {
            if let Some(g) = m.gpus.first() {
                if let Some(model) = snap
                    .nodes
                    .get(m.node)
                    .and_then(|n| n.gpus.get(usize::from(g.0)))
                {
                    let sum: u64 = m.gpus.iter().map(|&(_, x)| u64::from(x)).sum();
                    *h.per_model.entry(model.model.clone()).or_default() += sum;
                }
            }
        }
    }
    held
}

/// Fair share over recent GPU use ([`Snapshot::usage`]) against the pool's
/// `capacity` (milli-GPU), as of the pass's time, with tenants' weights.
fn fair_share(snap: &Snapshot, capacity: u64) -> Result<FairShareState, Error> {
    let mut share = FairShareState::new(
        snap.fair_share,
        Resources {
            gpu_milli: capacity,
            cpu_milli: 0,
            mem_mib: 0,
        },
    )?;
    let mut spans = snap.usage.clone();
    spans.sort_by_key(|u| (u.to_ms, u.from_ms, u.tenant));
    for u in &spans {
        share.charge(
            u.tenant,
            Resources {
                gpu_milli: u.gpu_milli,
                cpu_milli: 0,
                mem_mib: 0,
            },
            u.from_ms,
            u.to_ms.max(u.from_ms),
        );
    }
    share.advance(snap.now_ms);
    for (&t, p) in &snap.tenants {
        if p.weight > 0.0 && p.weight.is_finite() {
            let _ = share.set_weight(t, p.weight);
        }
    }
    Ok(share)
}

/// The queue as the order's items, all members' demand each.
fn queued_items(snap: &Snapshot) -> Vec<QueueItem> {
    snap.queue
        .iter()
        .map(|w| {
            let n = u64::from(w.members.max(1));
            QueueItem {
                tenant: w.tenant,
                tier: w.tier,
                priority: w.priority,
                submitted_ms: w.submitted_ms,
                demand: Resources {
                    gpu_milli: w.gpu.milli() * n,
                    cpu_milli: u64::from(w.cpu_milli) * n,
                    mem_mib: w.mem_mib * n,
                },
                expected_runtime_ms: w.max_runtime_ms,
            }
        })
        .collect()
}

/// Running work as the order's items: its GPUs for its remaining time
/// (the configured default when its end is unknown).
fn running_items(snap: &Snapshot) -> Vec<QueueItem> {
    snap.running
        .iter()
        .map(|r| QueueItem {
            tenant: r.tenant,
            tier: r.tier,
            priority: r.priority,
            submitted_ms: r.started_ms,
            demand: Resources {
                gpu_milli: held_milli(r),
                cpu_milli: 0,
                mem_mib: 0,
            },
            expected_runtime_ms: Some(
                r.ends_by_ms
                    .map_or(snap.fair_share.default_runtime_ms, |e| {
                        e.saturating_sub(snap.now_ms)
                    }),
            ),
        })
        .collect()
}

/// Running work as the engine's allocations (one per member the pool can
/// represent), and what preemption may take of it.
struct Victims {
    allocations: Vec<Allocation>,
    /// The running work (index into [`Snapshot::running`]) of each
    /// allocation.
    work: Vec<usize>,
    /// Per running work: told to stop, before or during this pass.
    stopping: Vec<bool>,
    /// Per running work: one member only.
    single: Vec<bool>,
    /// Offers of victims per preemptor rank (tier, priority, singles only),
    /// built on first use; victims chosen leave every offer.
    offers: HashMap<(Tier, i32, bool), Offer>,
    /// A fast bound for preemption: whether any victim could be evicted by
    /// anyone of a tier / priority, or by a reclaiming tenant.
    weakest_tier: Option<Tier>,
    lowest_priority: Option<i32>,
    any_borrowed: bool,
}

impl Victims {
    /// Running work's allocations, and those of known end (what a
    /// reservation plans the head's start with).
    fn load(snap: &Snapshot, pool: &Pool, borrowed: &[bool]) -> (Victims, Vec<Running>) {
        let mut allocations: Vec<Allocation> = Vec::new();
        let mut work: Vec<usize> = Vec::new();
        let mut ending: Vec<Running> = Vec::new();
        for (wi, r) in snap.running.iter().enumerate() {
            for m in &r.members {
                let Some((request, placement)) = pool.hold(m) else {
                    continue;
                };
                if let Some(end) = r.ends_by_ms {
                    ending.push(Running {
                        request,
                        placement: placement.clone(),
                        expected_end_ms: Some(end),
                    });
                }
                allocations.push(Allocation {
                    id: allocations.len() as u64,
                    tenant: r.tenant,
                    tier: r.tier,
                    priority: r.priority,
                    preemptible: r.preemptible,
                    borrowed: borrowed[wi],
                    request,
                    placement,
                    started_ms: r.started_ms,
                });
                work.push(wi);
            }
        }
        let evictable = || {
            allocations
                .iter()
                .filter(|a| a.preemptible && a.tier != Tier::Dedicated)
        };
        let victims = Victims {
            weakest_tier: evictable().map(|a| a.tier).max(),
            lowest_priority: evictable().map(|a| a.priority).min(),
            any_borrowed: evictable().any(|a| a.borrowed),
            stopping: snap.running.iter().map(|r| r.stopping).collect(),
            single: snap.running.iter().map(|r| r.members.len() == 1).collect(),
            offers: HashMap::new(),
            allocations,
            work,
        };
        (victims, ending)
    }

    /// Whether anything running could be a victim of `who` at all.
    fn may_preempt(&self, who: &Preemptor) -> bool {
        self.weakest_tier.is_some_and(|t| who.tier < t)
            || self.lowest_priority.is_some_and(|p| who.priority > p)
            || (who.reclaiming && self.any_borrowed)
    }

    /// The victims offered to `who` (allocations with ids equal to their
    /// position, and the running work of each): those its rank may evict,
    /// plus, when it reclaims, borrowed work of other tenants that the
    /// rank alone does not reach.
    fn offered(
        &mut self,
        who: &Preemptor,
        singles_only: bool,
    ) -> (Cow<'_, [Allocation]>, Cow<'_, [usize]>) {
        let (allocations, work) = (&self.allocations, &self.work);
        let (stopping, single) = (&self.stopping, &self.single);
        let offer: &Offer = self
            .offers
            .entry((who.tier, who.priority, singles_only))
            .or_insert_with(|| {
                Offer::build(allocations, work, |a, wi| {
                    !stopping[wi]
                        && (!singles_only || single[wi])
                        && Preemptor {
                            reclaiming: false,
                            ..*who
                        }
                        .may_evict(a)
                })
            });
        if !who.reclaiming {
            return (Cow::Borrowed(&offer.list), Cow::Borrowed(&offer.work));
        }
        let mut map = offer.work.clone();
        let mut list = offer.list.clone();
        for (a, &wi) in allocations.iter().zip(work.iter()) {
            if !stopping[wi] && (!singles_only || single[wi]) && who.may_evict(a) && !offer.has(wi)
            {
                list.push(Allocation {
                    id: list.len() as u64,
                    ..a.clone()
                });
                map.push(wi);
            }
        }
        (Cow::Owned(list), Cow::Owned(map))
    }
}

/// The victims in `list` on machines that could host `req` once emptied:
/// only those are worth a look.
fn eligible<'l>(list: &'l [Allocation], c: &Cluster, req: &Request) -> Vec<&'l Allocation> {
    let count = req.gpu.gpu_count();
    list.iter()
        .filter(|a| a.preemptible)
        .filter(|a| {
            c.node(a.placement.node).is_some_and(|n| {
                !n.cordoned
                    && (count == 0 || req.models.allows(n.spec.model))
                    && n.spec.gpus >= count
                    && n.spec.cpu_milli >= req.cpu_milli
                    && n.spec.mem_mib >= req.mem_mib
            })
        })
        .collect()
}

/// What makes two works the same to placement within one pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ShapeKey {
    req: Request,
    members: usize,
    locality: Locality,
    spread: bool,
}

/// Where a work goes on `cluster`, every member or none. One member
/// anywhere is one engine decision on the cluster itself (no copy), by
/// time to ready where `ready` (by engine node) is given; a gang is placed
/// on a scratch copy by the scratch engine.
fn place_on(
    engine: &mut Engine,
    scratch_engine: &mut Engine,
    cluster: &Cluster,
    gang: &Gang,
    ready: &[u64],
    rng: &mut ChaCha8Rng,
) -> Option<Vec<Placement>> {
    if gang.members.len() == 1 && gang.locality == Locality::Any {
        let decision = if ready.is_empty() {
            engine.decide(cluster, &gang.members[0], rng)
        } else {
            let ready = |n: u32| ready.get(n as usize).copied().unwrap_or(u64::MAX);
            engine.decide_startup(
                cluster,
                &gang.members[0],
                &ready,
                crate::startup::DEFAULT_QUANTUM_MS,
                rng,
            )
        };
        return match decision {
            crate::select::Decision::Placed(p) => Some(vec![p]),
            crate::select::Decision::Unschedulable(_) => None,
        };
    }
    match place_gang(scratch_engine, cluster, gang, rng) {
        GangDecision::Placed(p) => Some(p.members),
        GangDecision::Unschedulable(_) => None,
    }
}

/// The victims (ids into `offer`) whose eviction lets `req` start,
/// planned on `cluster` in place ([`preempt::plan_in_place`]).
#[allow(clippy::too_many_arguments)]
fn preempt_one(
    engine: &mut Engine,
    offer: &[&Allocation],
    cluster: &mut Cluster,
    req: &Request,
    who: &Preemptor,
    config: &PreemptConfig,
    now_ms: u64,
    rng: &mut ChaCha8Rng,
) -> Option<Vec<u64>> {
    match preempt::plan_in_place(engine, cluster, offer, req, who, config, now_ms, rng) {
        preempt::PreemptDecision::Preempt(p) => {
            Some(p.evictions.iter().map(|e| e.allocation).collect())
        }
        _ => None,
    }
}

/// The victims (ids into `offer`) whose eviction lets the gang start,
/// planned on a copy of `cluster` ([`preempt::plan_gang_unexplained`]).
#[allow(clippy::too_many_arguments)]
fn preempt_gang(
    engine: &mut Engine,
    cluster: &Cluster,
    offer: &[Allocation],
    gang: &Gang,
    who: &Preemptor,
    config: &PreemptConfig,
    now_ms: u64,
    rng: &mut ChaCha8Rng,
) -> Option<Vec<u64>> {
    match preempt::plan_gang_unexplained(engine, cluster, offer, gang, who, config, now_ms, rng) {
        GangPreemptDecision::Preempt(p) => Some(p.evictions.iter().map(|e| e.allocation).collect()),
        _ => None,
    }
}

/// Victims offered to preemptors of one rank: allocations with ids equal
/// to their position, and the running work each belongs to.
#[derive(Debug, Default)]
struct Offer {
    list: Vec<Allocation>,
    work: Vec<usize>,
    works: HashSet<usize>,
}

impl Offer {
    fn build(
        allocations: &[Allocation],
        alloc_work: &[usize],
        keep: impl Fn(&Allocation, usize) -> bool,
    ) -> Offer {
        let mut o = Offer::default();
        for (a, &wi) in allocations.iter().zip(alloc_work) {
            if keep(a, wi) {
                o.list.push(Allocation {
                    id: o.list.len() as u64,
                    ..a.clone()
                });
                o.work.push(wi);
                o.works.insert(wi);
            }
        }
        o
    }

    fn has(&self, wi: usize) -> bool {
        self.works.contains(&wi)
    }

    /// Takes the allocations of `works` (chosen as victims) out of the
    /// offer, in place: they stop being preemptible, which every
    /// preemption check reads first.
    fn remove(&mut self, works: &[usize]) {
        if !works.iter().any(|w| self.works.contains(w)) {
            return;
        }
        for w in works {
            self.works.remove(w);
        }
        for (a, wi) in self.list.iter_mut().zip(&self.work) {
            if works.contains(wi) {
                a.preemptible = false;
            }
        }
    }
}

/// Hands out the queue in order, one level (tier, priority) at a time,
/// and within a level the first work whose tenant's guarantee covers it
/// given what the tenant holds *now* (this pass's placements included)
/// before the rest: placed after borrowing work of its level, such work
/// would reclaim that capacity by preemption on the next pass. Only the
/// head of each guaranteed tenant is looked at, so a step costs the number
/// of tenants with a guarantee, not the queue's length.
struct Picker {
    /// Queue indices in fair-share order, per level, levels in order.
    levels: Vec<Vec<usize>>,
    level: usize,
    /// Positions (in the current level) not yet handed out.
    left: BTreeSet<usize>,
    /// Per tenant with a guarantee, its positions in the current level.
    guaranteed: BTreeMap<Tenant, std::collections::VecDeque<usize>>,
}

impl Picker {
    fn new(snap: &Snapshot, order: &[usize]) -> Picker {
        let mut levels: Vec<Vec<usize>> = Vec::new();
        let mut last = None;
        for &i in order {
            let w = &snap.queue[i];
            let key = (w.tier, w.priority);
            if last != Some(key) {
                levels.push(Vec::new());
                last = Some(key);
            }
            if let Some(l) = levels.last_mut() {
                l.push(i);
            }
        }
        let mut p = Picker {
            levels,
            level: 0,
            left: BTreeSet::new(),
            guaranteed: BTreeMap::new(),
        };
        p.enter(snap, 0);
        p
    }

    fn enter(&mut self, snap: &Snapshot, level: usize) {
        self.level = level;
        self.left.clear();
        self.guaranteed.clear();
        let Some(items) = self.levels.get(level) else {
            return;
        };
        for (pos, &i) in items.iter().enumerate() {
            self.left.insert(pos);
            let t = snap.queue[i].tenant;
            if snap
                .tenants
                .get(&t)
                .is_some_and(|p| p.quota.guaranteed_milli > 0)
            {
                self.guaranteed.entry(t).or_default().push_back(pos);
            }
        }
    }

    fn next(&mut self, snap: &Snapshot, held: &BTreeMap<Tenant, Held>) -> Option<usize> {
        while self.left.is_empty() {
            if self.level + 1 >= self.levels.len() {
                return None;
            }
            self.enter(snap, self.level + 1);
        }
        let items = &self.levels[self.level];
        let mut best: Option<usize> = None;
        for (t, q) in &mut self.guaranteed {
            while q.front().is_some_and(|p| !self.left.contains(p)) {
                q.pop_front();
            }
            let Some(&pos) = q.front() else { continue };
            let w = &snap.queue[items[pos]];
            let g = snap.tenants.get(t).map_or(0, |p| p.quota.guaranteed_milli);
            let h = held.get(t).map_or(0, |h| h.total);
            let ask = w.gpu.milli() * u64::from(w.members.max(1));
            if h.saturating_add(ask) <= g && best.is_none_or(|b| pos < b) {
                best = Some(pos);
            }
        }
        let pos = best.or_else(|| self.left.first().copied())?;
        self.left.remove(&pos);
        Some(items[pos])
    }
}

/// Whether the gang could be placed on an empty pool (its scope's ready,
/// uncordoned machines, emptied): work that never could is not allowed
/// to hold the queue behind it.
fn could_fit_empty(pool: &Pool, gang: &Gang) -> bool {
    let Some(req) = gang.members.first() else {
        return true;
    };
    let per_gpu = req.gpu.per_gpu_milli().max(1);
    let count = req.gpu.gpu_count().max(1);
    // Members that fit per scope (and per host when spread).
    let mut room: BTreeMap<u32, BTreeMap<u32, usize>> = BTreeMap::new();
    for (si, n) in pool.cluster.nodes().iter().enumerate() {
        if n.cordoned || (!req.models.allows(n.spec.model) && req.gpu.gpu_count() > 0) {
            continue;
        }
        if n.spec.cpu_milli < req.cpu_milli || n.spec.mem_mib < req.mem_mib {
            continue;
        }
        let per_node = if req.gpu.gpu_count() == 0 {
            usize::MAX / 4
        } else {
            let gpus_fit = usize::from(MILLI / per_gpu) * usize::from(n.spec.gpus);
            gpus_fit / usize::from(count)
        };
        let scope = gang.locality.scope_of(n);
        let host = pool.slots.get(si).map_or(si as u32, |s| s.node as u32);
        let e = room.entry(scope).or_default().entry(host).or_default();
        *e = e.saturating_add(per_node);
    }
    room.values().any(|hosts| {
        let total: usize = hosts
            .values()
            .map(|&k| if gang.spread { k.min(1) } else { k })
            .fold(0usize, |a, b| a.saturating_add(b));
        total >= gang.members.len()
    })
}

/// A gang's failure in words, with regions and pools by their names.
fn gang_text(
    why: &crate::gang::GangExplanation,
    locality: Locality,
    nodes: &[NodeSnap],
    pool: &Pool,
) -> String {
    let mut text = why.to_string();
    if let Some(scope) = why.best.as_ref().and_then(|b| b.scope) {
        // Scope numbers were given in slot order: find a slot with it.
        let name = pool
            .slots
            .iter()
            .enumerate()
            .find(|(si, _)| {
                pool.cluster
                    .node(*si as u32)
                    .is_some_and(|n| locality.scope_of(n) == scope)
            })
            .map(|(_, s)| match locality {
                Locality::SameRegion => nodes[s.node].region.clone(),
                _ => nodes[s.node].pool.clone(),
            });
        if let Some(name) = name {
            let noun = match locality {
                Locality::SameRegion => "region",
                _ => "domain",
            };
            text = text.replace(
                &format!("closest: {noun} {scope},"),
                &format!("closest: {noun} {name},"),
            );
        }
    }
    if locality == Locality::SameDomain {
        text = text.replace("domain", "pool");
    }
    format!("{text} (of {} machines)", nodes.len())
}

impl fmt::Display for GpuAsk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuAsk::None => f.write_str("no GPU"),
            GpuAsk::Whole(n) => write!(f, "{n} GPU"),
            GpuAsk::Fraction(m) => write!(f, "{}.{:03} GPU", m / 1000, m % 1000),
            GpuAsk::Mig(m) => write!(f, "MIG instance of {}.{:03} GPU", m / 1000, m % 1000),
        }
    }
}
