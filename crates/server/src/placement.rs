//! The server's side of placement: it turns the store's view of the pool
//! into a `flotilla-sched` cluster, asks the placement engine, and maps the
//! answer back to node and GPU ids. The decision is the pure engine's, the
//! same code the benchmark and (later) the simulator run.
//!
//! The engine models one GPU model per node. A node with several models
//! (a simulated `4xH100,2xL40S`, or a mixed box) becomes one engine node per
//! model, each seeing the node's whole free CPU and memory; after a
//! placement on such a node the cluster is rebuilt, so CPU and memory are
//! never promised twice.
//!
//! GPU shares: each GPU enters the engine with its real free milli-GPU, and
//! a fraction is the engine's `GpuDemand::Share`, so fractions are placed by
//! the configured policy like any other request. GPUs in MIG mode become
//! engine nodes of their own, under a MIG-capable engine model `<model>/mig`
//! (`ModelTable::set_mig_capable`); a MIG profile is asked of those only
//! (`sched::mig::mig_request`) and whole or fractional work only of the
//! others, which is how a GPU never mixes the two. The engine counts MIG
//! compute as milli-GPU and not memory slices, so its choice is checked
//! against the GPU's MIG geometry and, where that fails, the pass falls
//! back to core's first fit.

use std::collections::{BTreeMap, HashSet};

use flotilla_core::catalog::Catalog;
use flotilla_core::id::{GpuId, NodeId};
use flotilla_core::job::Locality as JobLocality;
use flotilla_core::placement::{
    first_fit, GpuShare, GpuSlot, NodeSnapshot, Placement, PlacementRequest, MILLI_PER_GPU,
};
use flotilla_sched::gang::{place_gang, Gang, GangDecision, Locality};
use flotilla_sched::mig::{mig_request, MigProfile as EngineMigProfile};
use flotilla_sched::preempt::{
    self, GangPreemptDecision, PreemptConfig, PreemptDecision, Preemptor,
};
use flotilla_sched::queue::{self, Reservation, Running};
use flotilla_sched::{
    Allocation, Cluster, Decision, Engine, GpuDemand, ModelSet, ModelTable, NodeSpec, Policy,
    Request, TargetWorkload, Tier,
};
use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Whether every GPU of `plan` can still take its share in `snapshot`.
fn fits_snapshot(snapshot: &[NodeSnapshot], plan: &Placement) -> bool {
    snapshot
        .iter()
        .filter(|n| n.id == plan.node)
        .flat_map(|n| &n.gpus)
        .filter(|g| plan.gpus.contains(&g.id))
        .filter(|g| plan.share.fits(g))
        .count()
        == plan.gpus.len()
}

/// Parses a policy name as `flotilla server --placement-policy` takes it.
pub fn parse_policy(name: &str) -> Option<Policy> {
    Policy::ALL
        .into_iter()
        .find(|p| p.name().eq_ignore_ascii_case(name))
}

/// One engine node: a real node's GPUs of one model, all in MIG mode or
/// none.
#[derive(Debug, Clone)]
struct Slot {
    node: NodeId,
    model: String,
    /// The GPUs are in MIG mode (engine model `<model>/mig`).
    mig: bool,
    /// GPU ids by the engine's device index.
    gpus: Vec<GpuId>,
}

/// The engine's model name for GPUs of `model`, in MIG mode or not.
fn engine_model(model: &str, mig: bool) -> String {
    if mig {
        format!("{model}/mig")
    } else {
        model.to_string()
    }
}

/// What the engine may count as free on `g`: its free milli-GPU; for a GPU
/// in MIG mode no more than its scarcer kind of slice allows (compute of
/// 7, memory of 8), so a GPU whose memory slices are gone looks full.
fn engine_free(g: &GpuSlot) -> u16 {
    if !g.mig_mode {
        return g.available_milli();
    }
    let of = |free: u8, total: u8| (u32::from(free) * 1000 / u32::from(total.max(1))) as u16;
    g.available_milli()
        .min(of(
            g.mig_compute_free,
            flotilla_core::catalog::MIG_COMPUTE_SLICES,
        ))
        .min(of(
            g.mig_memory_free,
            flotilla_core::catalog::MIG_MEMORY_SLICES,
        ))
}

/// Work holding GPUs, as preemption sees it.
#[derive(Debug, Clone)]
pub struct Held {
    /// Node it runs on.
    pub node: NodeId,
    /// GPUs it holds there.
    pub gpus: Vec<GpuId>,
    /// Owner, as the pass's tenant index.
    pub tenant: u32,
    /// Tier.
    pub tier: Tier,
    /// Priority.
    pub priority: i32,
    /// Accepted being preempted.
    pub preemptible: bool,
    /// Runs on capacity borrowed beyond its tenant's guarantee.
    pub borrowed: bool,
    /// Run start (ms): the work a preemption throws away grows with it.
    pub started_ms: u64,
    /// Milli-GPU it holds of each GPU (1000: whole GPUs).
    pub milli_per_gpu: u16,
}

/// Running work that must end by a known time (a job past its time limit
/// is stopped): what lets a reservation know when the head can start.
#[derive(Debug, Clone)]
pub struct Ending {
    /// Node it runs on.
    pub node: NodeId,
    /// Model of its GPUs there.
    pub model: String,
    /// GPUs it holds there.
    pub gpus: Vec<GpuId>,
    /// When it ends at the latest (ms).
    pub end_ms: u64,
}

/// Plans one pass of the scheduler over a snapshot.
pub struct PassPlanner {
    policy: Policy,
    models: ModelTable,
    workload: TargetWorkload,
    cluster: Cluster,
    slots: Vec<Slot>,
    mixed: HashSet<NodeId>,
    engine: Engine,
    rng: ChaCha8Rng,
    /// Region and pool names as the engine's scope numbers (from 1; 0 is
    /// "none" to the engine).
    regions: BTreeMap<String, u32>,
    pools: BTreeMap<String, u32>,
}

/// A name's scope number in `names`, interned on first sight.
fn scope_of(names: &mut BTreeMap<String, u32>, name: &str) -> u32 {
    let next = u32::try_from(names.len() + 1).unwrap_or(u32::MAX);
    *names.entry(name.to_string()).or_insert(next)
}

/// The engine's gang locality for a job's.
fn locality(l: JobLocality) -> Locality {
    match l {
        JobLocality::Any => Locality::Any,
        JobLocality::SamePool => Locality::SameDomain,
        JobLocality::SameRegion => Locality::SameRegion,
    }
}

impl std::fmt::Debug for PassPlanner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PassPlanner")
            .field("policy", &self.policy.name())
            .field("slots", &self.slots.len())
            .finish()
    }
}

/// The engine's demand for `share` of `count` GPUs.
fn demand(count: u32, share: &GpuShare) -> GpuDemand {
    let count = u16::try_from(count).unwrap_or(u16::MAX);
    match share {
        GpuShare::Whole => GpuDemand::whole(count),
        // 1..=999 share, 142..=1000 profile: both accepted by `share`.
        other => GpuDemand::share(other.milli()).unwrap_or(GpuDemand::Whole { count: 1 }),
    }
}

fn sched_request(req: &PlacementRequest, models: ModelSet) -> Request {
    Request::new(
        demand(req.gpus, &req.share),
        u32::try_from(req.cpu_milli).unwrap_or(u32::MAX),
        req.memory_mb,
    )
    .with_models(models)
}

impl PassPlanner {
    /// A planner for `snapshot`. `expected` are the requests of this pass:
    /// fragmentation-aware policies measure against their mix.
    pub fn new(
        policy: Policy,
        catalog: &Catalog,
        snapshot: &[NodeSnapshot],
        expected: &[PlacementRequest],
        seed: u64,
    ) -> Self {
        let mut models = ModelTable::default();
        for m in catalog.models() {
            // The catalog is far below the engine's 64-model limit.
            let _ = models.intern(&m.name);
        }
        for m in catalog.models().iter().filter(|m| m.mig_geometry.is_some()) {
            if let Ok(id) = models.intern(&engine_model(&m.name, true)) {
                let _ = models.set_mig_capable(id, true);
            }
        }
        let shapes: Vec<Request> = expected
            .iter()
            .map(|r| sched_request(r, ModelSet::Any))
            .collect();
        let workload =
            TargetWorkload::from_gpu_requests(shapes.iter(), TargetWorkload::DEFAULT_COVERAGE);
        let engine = Engine::new(policy.scorer(&workload));
        let mut planner = Self {
            policy,
            cluster: Cluster::new(models.clone()),
            models,
            workload,
            slots: Vec::new(),
            mixed: HashSet::new(),
            engine,
            rng: ChaCha8Rng::seed_from_u64(seed),
            regions: BTreeMap::new(),
            pools: BTreeMap::new(),
        };
        planner.rebuild(snapshot);
        planner
    }

    /// Rebuilds the engine's cluster from `snapshot` (after a race, or a
    /// placement on a node with several models).
    pub fn rebuild(&mut self, snapshot: &[NodeSnapshot]) {
        let mut cluster = Cluster::new(self.models.clone());
        let mut slots = Vec::new();
        self.mixed.clear();
        for n in snapshot.iter().filter(|n| n.ready) {
            let mut by_model: BTreeMap<(&str, bool), Vec<&GpuSlot>> = BTreeMap::new();
            for g in &n.gpus {
                by_model
                    .entry((g.model.as_str(), g.mig_mode))
                    .or_default()
                    .push(g);
            }
            if by_model.len() > 1 {
                self.mixed.insert(n.id.clone());
            }
            for ((model, mig), mut gpus) in by_model {
                let Some(mid) = self.models.get(&engine_model(model, mig)) else {
                    continue;
                };
                gpus.sort_by_key(|g| g.index);
                let spec = NodeSpec {
                    model: Some(mid),
                    gpus: u16::try_from(gpus.len()).unwrap_or(u16::MAX),
                    cpu_milli: u32::try_from(n.cpu_milli_free).unwrap_or(u32::MAX),
                    mem_mib: n.memory_mb_free,
                };
                let Ok(idx) = cluster.add_node(spec) else {
                    continue;
                };
                if n.cordoned {
                    let _ = cluster.set_cordoned(idx, true);
                }
                let _ = cluster.set_region(idx, scope_of(&mut self.regions, &n.region));
                let _ = cluster.set_domain(idx, scope_of(&mut self.pools, &n.pool));
                for (d, g) in gpus.iter().enumerate() {
                    // A GPU some work holds all of is taken whole; one
                    // partly held keeps its free share for fractions.
                    let free = if g.free {
                        MILLI_PER_GPU
                    } else {
                        engine_free(g)
                    };
                    let used = MILLI_PER_GPU.saturating_sub(free);
                    if used == 0 {
                        continue;
                    }
                    let held = GpuDemand::share(used).unwrap_or(GpuDemand::Whole { count: 1 });
                    let taken = flotilla_sched::Placement {
                        node: idx,
                        gpus: vec![u16::try_from(d).unwrap_or(u16::MAX)],
                    };
                    let _ = cluster.commit(&Request::new(held, 0, 0), &taken);
                }
                slots.push(Slot {
                    node: n.id.clone(),
                    model: model.to_string(),
                    mig,
                    gpus: gpus.iter().map(|g| g.id.clone()).collect(),
                });
            }
        }
        self.cluster = cluster;
        self.slots = slots;
        // A new cluster invalidates the engine's score cache by itself.
        self.engine = Engine::new(self.policy.scorer(&self.workload));
    }

    /// Where `req` goes, or why it fits nowhere. `model_allowed` folds in
    /// quotas. The explanation counts real nodes (engine nodes are per
    /// model), so it is taken from core's per-node feasibility check.
    pub fn place(
        &mut self,
        snapshot: &[NodeSnapshot],
        req: &PlacementRequest,
        model_allowed: impl Fn(&str) -> bool,
    ) -> Result<Placement, String> {
        let sreq = self.engine_request(req, &model_allowed);
        match self.engine.decide(&self.cluster, &sreq, &mut self.rng) {
            Decision::Placed(p) => {
                let plan = self
                    .store_placement(&p, &req.share)
                    .ok_or_else(|| "internal: engine named an unknown node or gpu".to_string())?;
                if !req.share.is_mig() || fits_snapshot(snapshot, &plan) {
                    return Ok(plan);
                }
                // The engine does not see MIG memory slices: where its
                // choice has compute but not memory left, take the first
                // GPU that has both.
                first_fit(snapshot, req, model_allowed).map_err(|e| e.to_string())
            }
            Decision::Unschedulable(why) => match first_fit(snapshot, req, model_allowed) {
                Err(per_node) => Err(per_node.to_string()),
                // Only core's full check of a MIG geometry can see a fit
                // the engine's coarser model misses.
                Ok(plan) if req.share.is_mig() => Ok(plan),
                Ok(_) => Err(format!("0/{} node slots fit: {why}", self.slots.len())),
            },
        }
    }

    /// Where each of `members` identical members of a gang goes, all of
    /// them or none: `flotilla-sched`'s gang placement over this pass's
    /// cluster. Members may share a node that has room for both. The
    /// explanation names the member that fit nowhere and why.
    pub fn place_gang(
        &mut self,
        req: &PlacementRequest,
        members: usize,
        within: JobLocality,
        model_allowed: impl Fn(&str) -> bool,
    ) -> Result<Vec<Placement>, String> {
        let gang = Gang::uniform(
            self.engine_request(req, &model_allowed),
            members,
            locality(within),
        );
        match place_gang(&mut self.engine, &self.cluster, &gang, &mut self.rng) {
            GangDecision::Placed(plan) => plan
                .members
                .iter()
                .map(|p| {
                    self.store_placement(p, &req.share)
                        .ok_or_else(|| "internal: engine named an unknown node or gpu".to_string())
                })
                .collect(),
            GangDecision::Unschedulable(why) => {
                // The engine numbers regions and pools (its "domains");
                // say them as people named them.
                let (names, noun) = match within {
                    JobLocality::SameRegion => (&self.regions, "region"),
                    _ => (&self.pools, "domain"),
                };
                let mut text = why.to_string();
                if let Some(scope) = why.best.as_ref().and_then(|b| b.scope) {
                    if let Some((name, _)) = names.iter().find(|(_, &v)| v == scope) {
                        text = text.replace(
                            &format!("closest: {noun} {scope},"),
                            &format!("closest: {noun} {name},"),
                        );
                    }
                }
                if within == JobLocality::SamePool {
                    text = text.replace("domain", "pool");
                }
                Err(format!("{text} (of {} node slots)", self.slots.len()))
            }
        }
    }

    /// The reservation of a blocked queue head (`members` identical members
    /// of `req`), as `flotilla-sched` computes it: running work that must
    /// end by a known time (`ending`) is released in end order until the
    /// head fits; the head's start and nodes follow. When it needs capacity
    /// held by work of unknown length, every node that could ever host a
    /// member is held for it, and only work on other nodes may be
    /// backfilled ([`PassPlanner::backfill_allowed`]). `None` when the head could not
    /// fit even on an empty pool (too big, or no allowed model), so that
    /// an impossible request never blocks the queue behind it.
    #[allow(clippy::too_many_arguments)] // the head's shape, scope and quota, and the pool's state
    pub fn reserve(
        &mut self,
        snapshot: &[NodeSnapshot],
        req: &PlacementRequest,
        members: usize,
        within: JobLocality,
        model_allowed: impl Fn(&str) -> bool,
        ending: &[Ending],
        now_ms: u64,
    ) -> Option<Reservation> {
        let per = req.gpus.max(1) as usize;
        // Members that fit on an empty pool, per region or pool when the
        // gang must stay in one.
        let mut room: BTreeMap<&str, usize> = BTreeMap::new();
        for n in snapshot.iter().filter(|n| n.ready && !n.cordoned) {
            let mut by_model: BTreeMap<&str, usize> = BTreeMap::new();
            for g in &n.gpus {
                *by_model.entry(g.model.as_str()).or_default() += 1;
            }
            let scope = match within {
                JobLocality::Any => "",
                JobLocality::SamePool => n.pool.as_str(),
                JobLocality::SameRegion => n.region.as_str(),
            };
            *room.entry(scope).or_default() += by_model
                .into_iter()
                .filter(|(m, _)| req.models.is_empty() || req.models.iter().any(|a| a == m))
                .filter(|(m, _)| model_allowed(m))
                .map(|(_, count)| count / per)
                .sum::<usize>();
        }
        if !room.values().any(|&r| r >= members) {
            return None;
        }
        let gang = Gang::uniform(
            self.engine_request(req, &model_allowed),
            members,
            locality(within),
        );
        let running: Vec<Running> = ending
            .iter()
            .filter_map(|e| {
                let p = self.engine_placement(&Placement {
                    node: e.node.clone(),
                    model: e.model.clone(),
                    gpus: e.gpus.clone(),
                    share: GpuShare::Whole,
                })?;
                Some(Running {
                    request: Request::new(
                        GpuDemand::whole(u16::try_from(p.gpus.len()).unwrap_or(u16::MAX)),
                        0,
                        0,
                    ),
                    placement: p,
                    expected_end_ms: Some(e.end_ms),
                })
            })
            .collect();
        Some(queue::reserve(
            &mut self.engine,
            &self.cluster,
            &running,
            &gang,
            now_ms,
            &mut self.rng,
        ))
    }

    /// Whether `plan` for `req` may start now without delaying the head's
    /// `reservation`; if so, the reservation counts it from then on.
    pub fn backfill_allowed(
        &self,
        reservation: &mut Reservation,
        req: &PlacementRequest,
        plan: &Placement,
        ends_by_ms: Option<u64>,
    ) -> bool {
        match self.engine_placement(plan) {
            Some(p) => {
                reservation.admit_backfill(&sched_request(req, ModelSet::Any), &p, ends_by_ms)
            }
            None => false,
        }
    }

    /// Where `members` members of `req` go on the nodes `reservation` does
    /// not hold: backfill, decided by the same engine on a copy of the
    /// cluster with the held nodes cordoned. `None` when nothing fits there.
    pub fn place_outside(
        &mut self,
        req: &PlacementRequest,
        members: usize,
        within: JobLocality,
        model_allowed: impl Fn(&str) -> bool,
        reservation: &Reservation,
    ) -> Option<Vec<Placement>> {
        let mut outside = self.cluster.clone();
        for &n in &reservation.nodes {
            let _ = outside.set_cordoned(n, true);
        }
        let gang = Gang::uniform(
            self.engine_request(req, &model_allowed),
            members,
            locality(within),
        );
        let GangDecision::Placed(plan) =
            place_gang(&mut self.engine, &outside, &gang, &mut self.rng)
        else {
            return None;
        };
        plan.members
            .iter()
            .map(|p| self.store_placement(p, &req.share))
            .collect()
    }

    /// `plan` in the engine's terms (engine node, device indices).
    fn engine_placement(&self, plan: &Placement) -> Option<flotilla_sched::Placement> {
        self.slots.iter().enumerate().find_map(|(i, s)| {
            if s.node != plan.node || s.model != plan.model || s.mig != plan.share.is_mig() {
                return None;
            }
            let devs: Option<Vec<u16>> = plan
                .gpus
                .iter()
                .map(|g| {
                    s.gpus
                        .iter()
                        .position(|x| x == g)
                        .and_then(|d| u16::try_from(d).ok())
                })
                .collect();
            Some(flotilla_sched::Placement {
                node: u32::try_from(i).ok()?,
                gpus: devs?,
            })
        })
    }

    /// The engine's request for `req`: the models it accepts, narrowed to
    /// those `model_allowed` admits (quota) and the pass knows.
    fn engine_request(
        &self,
        req: &PlacementRequest,
        model_allowed: &impl Fn(&str) -> bool,
    ) -> Request {
        let mig = req.share.is_mig();
        let allowed = ModelSet::of(
            self.slots
                .iter()
                .filter(|s| s.mig == mig)
                .map(|s| s.model.as_str())
                .filter(|m| req.models.is_empty() || req.models.iter().any(|a| a == m))
                .filter(|m| model_allowed(m))
                .filter_map(|m| self.models.get(&engine_model(m, mig))),
        );
        match &req.share {
            GpuShare::Mig(p) => {
                let Ok(profile) = EngineMigProfile::new(
                    p.compute_slices,
                    u16::try_from(p.memory_mib / 1024).unwrap_or(u16::MAX),
                ) else {
                    return sched_request(req, ModelSet::Only(0));
                };
                mig_request(
                    profile,
                    allowed,
                    &self.models,
                    u32::try_from(req.cpu_milli).unwrap_or(u32::MAX),
                    req.memory_mb,
                )
            }
            _ => sched_request(req, allowed),
        }
    }

    /// An engine placement in the store's terms: the node and the GPU ids
    /// behind the engine's slot and device indices; `None` if the engine
    /// named a slot or device this pass does not have.
    fn store_placement(
        &self,
        p: &flotilla_sched::Placement,
        share: &GpuShare,
    ) -> Option<Placement> {
        let slot = self.slots.get(p.node as usize)?;
        let gpus = p
            .gpus
            .iter()
            .map(|&d| slot.gpus.get(usize::from(d)).cloned())
            .collect::<Option<Vec<GpuId>>>()?;
        Some(Placement {
            node: slot.node.clone(),
            model: slot.model.clone(),
            gpus,
            share: share.clone(),
        })
    }

    /// `held` as the engine's allocations (index = position in `held`);
    /// work on nodes the pass does not know is left out.
    fn allocations(&self, held: &[Held]) -> Vec<Allocation> {
        let mut allocations = Vec::new();
        for (i, h) in held.iter().enumerate() {
            let found = self.slots.iter().enumerate().find_map(|(si, s)| {
                if s.node != h.node {
                    return None;
                }
                let devs: Option<Vec<u16>> = h
                    .gpus
                    .iter()
                    .map(|g| {
                        s.gpus
                            .iter()
                            .position(|x| x == g)
                            .and_then(|d| u16::try_from(d).ok())
                    })
                    .collect();
                devs.filter(|d| !d.is_empty()).map(|d| (si, d))
            });
            let Some((si, devs)) = found else { continue };
            let count = u16::try_from(devs.len()).unwrap_or(u16::MAX);
            let held = if h.milli_per_gpu < MILLI_PER_GPU && count == 1 {
                GpuDemand::share(h.milli_per_gpu).unwrap_or(GpuDemand::whole(count))
            } else {
                GpuDemand::whole(count)
            };
            allocations.push(Allocation {
                id: i as u64,
                tenant: h.tenant,
                tier: h.tier,
                priority: h.priority,
                preemptible: h.preemptible,
                borrowed: h.borrowed,
                request: Request::new(held, 0, 0),
                placement: flotilla_sched::Placement {
                    node: u32::try_from(si).unwrap_or(u32::MAX),
                    gpus: devs,
                },
                started_ms: h.started_ms,
            });
        }
        allocations
    }

    /// Which of `held` to preempt so `req` fits, and where it will go once
    /// they are gone: `flotilla-sched`'s cheapest sufficient set on one
    /// node, which never names tier-1 or non-preemptible work and only work
    /// `who` outranks. `None` when no eviction makes room. Victims free
    /// their GPUs only (their CPU and memory are not counted back), which
    /// can only make the plan more conservative.
    pub fn preempt(
        &mut self,
        req: &PlacementRequest,
        model_allowed: impl Fn(&str) -> bool,
        held: &[Held],
        who: Preemptor,
        now_ms: u64,
    ) -> Option<(Vec<usize>, Placement)> {
        let allocations = self.allocations(held);
        if !allocations.iter().any(|a| who.may_evict(a)) {
            return None;
        }
        let sreq = self.engine_request(req, &model_allowed);
        let decision = preempt::plan(
            &mut self.engine,
            &self.cluster,
            &allocations,
            &sreq,
            &who,
            &PreemptConfig::default(),
            now_ms,
            &mut self.rng,
        );
        let (victims, p) = match decision {
            PreemptDecision::Preempt(plan) => (
                plan.evictions
                    .iter()
                    .map(|e| e.allocation as usize)
                    .collect::<Vec<_>>(),
                plan.placement,
            ),
            PreemptDecision::Fits(p) => (Vec::new(), p),
            PreemptDecision::Impossible(_) => return None,
        };
        Some((victims, self.store_placement(&p, &req.share)?))
    }

    /// [`PassPlanner::preempt`] for a gang: which of `held` to preempt so
    /// that every member fits (`flotilla-sched`'s gang preemption, within
    /// `within`), and where the members go once they are gone.
    #[allow(clippy::too_many_arguments)]
    pub fn preempt_gang(
        &mut self,
        req: &PlacementRequest,
        members: usize,
        within: JobLocality,
        model_allowed: impl Fn(&str) -> bool,
        held: &[Held],
        who: Preemptor,
        now_ms: u64,
    ) -> Option<(Vec<usize>, Vec<Placement>)> {
        let allocations = self.allocations(held);
        if !allocations.iter().any(|a| who.may_evict(a)) {
            return None;
        }
        let gang = Gang::uniform(
            self.engine_request(req, &model_allowed),
            members,
            locality(within),
        );
        let decision = preempt::plan_gang(
            &mut self.engine,
            &self.cluster,
            &allocations,
            &gang,
            &who,
            &PreemptConfig::default(),
            now_ms,
            &mut self.rng,
        );
        let (victims, plan) = match decision {
            GangPreemptDecision::Preempt(p) => (
                p.evictions
                    .iter()
                    .map(|e| e.allocation as usize)
                    .collect::<Vec<_>>(),
                p.placement,
            ),
            GangPreemptDecision::Fits(p) => (Vec::new(), p),
            GangPreemptDecision::Impossible(_) => return None,
        };
        let placements = plan
            .members
            .iter()
            .map(|p| self.store_placement(p, &req.share))
            .collect::<Option<Vec<_>>>()?;
        Some((victims, placements))
    }

    /// Records a committed placement so the rest of the pass sees it.
    /// `snapshot` must already reflect it.
    pub fn committed(
        &mut self,
        snapshot: &[NodeSnapshot],
        req: &PlacementRequest,
        plan: &Placement,
    ) {
        // A share changes a GPU's free milli (and MIG slices) in ways only
        // the snapshot states exactly: rebuild from it.
        if self.mixed.contains(&plan.node) || plan.share != GpuShare::Whole {
            return self.rebuild(snapshot);
        }
        let found = self.slots.iter().enumerate().find_map(|(i, s)| {
            (s.node == plan.node).then(|| {
                let devs: Option<Vec<u16>> = plan
                    .gpus
                    .iter()
                    .map(|g| {
                        s.gpus
                            .iter()
                            .position(|x| x == g)
                            .and_then(|d| u16::try_from(d).ok())
                    })
                    .collect();
                (i, devs)
            })
        });
        let ok = match found {
            Some((i, Some(devs))) => {
                let p = flotilla_sched::Placement {
                    node: u32::try_from(i).unwrap_or(u32::MAX),
                    gpus: devs,
                };
                self.cluster
                    .commit(&sched_request(req, ModelSet::Any), &p)
                    .is_ok()
            }
            _ => false,
        };
        if !ok {
            self.rebuild(snapshot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(n: u64, ready: bool, gpus: &[(&str, bool)]) -> NodeSnapshot {
        NodeSnapshot {
            id: NodeId::generate(n, u128::from(n)),
            ready,
            cordoned: false,
            region: "local".into(),
            pool: "default".into(),
            cpu_milli_free: 64_000,
            memory_mb_free: 512_000,
            gpus: gpus
                .iter()
                .enumerate()
                .map(|(i, (m, free))| {
                    GpuSlot::whole(
                        GpuId::generate(n, (u128::from(n) << 8) | i as u128),
                        i as u32,
                        *m,
                        *free,
                    )
                })
                .collect(),
        }
    }

    fn req(gpus: u32, models: &[&str]) -> PlacementRequest {
        PlacementRequest {
            gpus,
            models: models.iter().map(|s| s.to_string()).collect(),
            cpu_milli: 1000,
            memory_mb: 1024,
            share: GpuShare::Whole,
        }
    }

    #[test]
    fn mixed_nodes_map_back_to_the_right_gpus_and_never_overlap() {
        let mut snap = vec![node(
            1,
            true,
            &[
                ("H100", true),
                ("L40S", true),
                ("H100", true),
                ("L40S", false),
            ],
        )];
        let cat = Catalog::default();
        let mut p = PassPlanner::new(Policy::Flotilla, &cat, &snap, &[req(1, &[])], 7);
        let a = p.place(&snap, &req(2, &["H100"]), |_| true).unwrap();
        assert_eq!(a.model, "H100");
        assert_eq!(
            a.gpus,
            vec![snap[0].gpus[0].id.clone(), snap[0].gpus[2].id.clone()]
        );
        for g in snap[0].gpus.iter_mut().filter(|g| a.gpus.contains(&g.id)) {
            g.free = false;
        }
        p.committed(&snap, &req(2, &["H100"]), &a);
        let b = p.place(&snap, &req(1, &[]), |_| true).unwrap();
        assert_eq!(
            (b.model.as_str(), b.gpus.clone()),
            ("L40S", vec![snap[0].gpus[1].id.clone()])
        );
        let e = p.place(&snap, &req(1, &["H100"]), |_| true).unwrap_err();
        assert!(e.contains("too few free GPUs"), "{e}");
    }

    #[test]
    fn fractions_share_a_gpu_through_the_engine_and_mig_stays_on_mig_gpus() {
        let cat = Catalog::default();
        let mut snap = vec![node(1, true, &[("H100", true), ("H100", true)])];
        snap[0].gpus[1] = GpuSlot::mig(snap[0].gpus[1].id.clone(), 1, "H100");
        let (plain, mig_gpu) = (snap[0].gpus[0].id.clone(), snap[0].gpus[1].id.clone());
        let mut p = PassPlanner::new(Policy::Flotilla, &cat, &snap, &[], 3);
        let place = |p: &mut PassPlanner, snap: &mut Vec<NodeSnapshot>, r: &PlacementRequest| {
            let a = p.place(snap, r, |_| true)?;
            for g in snap[0].gpus.iter_mut().filter(|g| a.gpus.contains(&g.id)) {
                g.take(&a.share);
            }
            p.committed(snap, r, &a);
            Ok::<_, String>(a)
        };
        let half = PlacementRequest {
            share: GpuShare::Fraction { milli: 500 },
            ..req(1, &[])
        };
        for _ in 0..2 {
            let a = place(&mut p, &mut snap, &half).unwrap();
            assert_eq!(
                (a.gpus.clone(), a.share.clone()),
                (vec![plain.clone()], half.share.clone())
            );
        }
        let e = place(&mut p, &mut snap, &half).unwrap_err();
        assert!(e.contains("no GPU with room for the share"), "{e}");
        // 1g.20gb: compute for seven, memory for four.
        let prof = cat.mig_profile("1g.20gb").unwrap().0;
        let mig = PlacementRequest {
            share: GpuShare::Mig(prof),
            ..req(1, &[])
        };
        for _ in 0..4 {
            let a = place(&mut p, &mut snap, &mig).unwrap();
            assert_eq!(a.gpus, vec![mig_gpu.clone()]);
        }
        assert!(place(&mut p, &mut snap, &mig).is_err());
        assert!(
            place(&mut p, &mut snap, &req(1, &[])).is_err(),
            "no whole GPU is left"
        );
    }

    #[test]
    fn unreachable_nodes_and_quota_blocked_models_are_skipped() {
        let snap = vec![
            node(1, false, &[("H100", true)]),
            node(2, true, &[("H100", true)]),
            node(3, true, &[("L4", true)]),
        ];
        let mut p = PassPlanner::new(Policy::Flotilla, &Catalog::default(), &snap, &[], 1);
        let a = p.place(&snap, &req(1, &[]), |m| m != "H100").unwrap();
        assert_eq!(a.node, snap[2].id);
        let e = p
            .place(&snap, &req(1, &["H100"]), |m| m != "H100")
            .unwrap_err();
        assert_eq!(e, "0/3 nodes fit: 2 GPU model not allowed, 1 unreachable");
    }

    #[test]
    fn a_gang_is_placed_whole_across_nodes_or_not_at_all() {
        let snap = vec![
            node(1, true, &[("H100", true), ("H100", false)]),
            node(2, true, &[("H100", true), ("H100", false)]),
        ];
        let mut p = PassPlanner::new(Policy::Flotilla, &Catalog::default(), &snap, &[], 3);
        let plans = p
            .place_gang(&req(1, &[]), 2, JobLocality::Any, |_| true)
            .unwrap();
        let mut nodes: Vec<&NodeId> = plans.iter().map(|p| &p.node).collect();
        nodes.sort();
        assert_eq!(nodes, vec![&snap[0].id, &snap[1].id]);
        let e = p
            .place_gang(&req(1, &[]), 3, JobLocality::Any, |_| true)
            .unwrap_err();
        assert!(e.contains("member 3 fits nowhere after placing 2"), "{e}");
        assert!(p
            .place_gang(&req(2, &[]), 1, JobLocality::Any, |_| true)
            .is_err());
    }

    #[test]
    fn a_gang_kept_in_one_region_or_pool_stays_there() {
        let mut snap = vec![
            node(1, true, &[("H100", true)]),
            node(2, true, &[("H100", true)]),
            node(3, true, &[("H100", true), ("H100", true), ("H100", true)]),
        ];
        snap[0].region = "eu".into();
        snap[1].region = "us".into();
        snap[2].region = "us".into();
        snap[2].pool = "fast".into();
        let mut p = PassPlanner::new(Policy::Flotilla, &Catalog::default(), &snap, &[], 9);
        let plans = p
            .place_gang(&req(1, &[]), 4, JobLocality::SameRegion, |_| true)
            .unwrap();
        assert!(plans.iter().all(|x| x.node != snap[0].id), "{plans:?}");
        let e = p
            .place_gang(&req(1, &[]), 5, JobLocality::SameRegion, |_| true)
            .unwrap_err();
        assert!(e.contains("fits in no single region"), "{e}");
        let plans = p
            .place_gang(&req(1, &[]), 3, JobLocality::SamePool, |_| true)
            .unwrap();
        assert!(plans.iter().all(|x| x.node == snap[2].id), "{plans:?}");
        let e = p
            .place_gang(&req(1, &[]), 4, JobLocality::SamePool, |_| true)
            .unwrap_err();
        assert!(e.contains("fits in no single pool"), "{e}");
        assert!(p
            .place_gang(&req(1, &[]), 5, JobLocality::Any, |_| true)
            .is_ok());
    }

    #[test]
    fn a_blocked_head_holds_the_nodes_it_could_use_and_an_impossible_one_holds_none() {
        let snap = vec![
            node(1, true, &[("H100", false), ("H100", true)]),
            node(2, true, &[("L4", true)]),
        ];
        let mut p = PassPlanner::new(Policy::Flotilla, &Catalog::default(), &snap, &[], 5);
        // Two H100s fit on node 1 once it empties: it is held for the head.
        let mut r = p
            .reserve(
                &snap,
                &req(2, &["H100"]),
                1,
                JobLocality::Any,
                |_| true,
                &[],
                0,
            )
            .expect("could fit once work ends");
        let small = req(1, &[]);
        let on_h100 = Placement {
            node: snap[0].id.clone(),
            model: "H100".into(),
            gpus: vec![snap[0].gpus[1].id.clone()],
            share: GpuShare::Whole,
        };
        let on_l4 = Placement {
            node: snap[1].id.clone(),
            model: "L4".into(),
            gpus: vec![snap[1].gpus[0].id.clone()],
            share: GpuShare::Whole,
        };
        assert!(!p.backfill_allowed(&mut r, &small, &on_h100, None));
        assert!(p.backfill_allowed(&mut r, &small, &on_l4, None));
        let outside = p
            .place_outside(&small, 1, JobLocality::Any, |_| true, &r)
            .unwrap();
        assert_eq!(
            outside[0].node, snap[1].id,
            "backfill goes around the held node"
        );
        assert!(p
            .place_outside(&req(1, &["H100"]), 1, JobLocality::Any, |_| true, &r)
            .is_none());
        // Three H100s exist nowhere: no reservation, nothing held.
        assert!(p
            .reserve(
                &snap,
                &req(3, &["H100"]),
                1,
                JobLocality::Any,
                |_| true,
                &[],
                0
            )
            .is_none());
        assert!(p
            .reserve(
                &snap,
                &req(1, &["H100"]),
                3,
                JobLocality::Any,
                |_| true,
                &[],
                0
            )
            .is_none());
        assert!(p
            .reserve(
                &snap,
                &req(1, &["H100"]),
                2,
                JobLocality::Any,
                |m| m != "H100",
                &[],
                0
            )
            .is_none());
    }

    #[test]
    fn work_that_ends_before_the_head_starts_backfills_on_its_nodes() {
        // Node 1: 3 H100s, one held by a job ending at t=100 s.
        let snap = vec![node(
            1,
            true,
            &[("H100", false), ("H100", true), ("H100", true)],
        )];
        let mut p = PassPlanner::new(Policy::Flotilla, &Catalog::default(), &snap, &[], 5);
        let ending = [Ending {
            node: snap[0].id.clone(),
            model: "H100".into(),
            gpus: vec![snap[0].gpus[0].id.clone()],
            end_ms: 100_000,
        }];
        let mut r = p
            .reserve(
                &snap,
                &req(3, &[]),
                1,
                JobLocality::Any,
                |_| true,
                &ending,
                0,
            )
            .unwrap();
        assert_eq!(r.start_ms, Some(100_000));
        let one = Placement {
            node: snap[0].id.clone(),
            model: "H100".into(),
            gpus: vec![snap[0].gpus[1].id.clone()],
            share: GpuShare::Whole,
        };
        // Ends at 60 s, before the head's start: allowed.
        assert!(p.backfill_allowed(&mut r, &req(1, &[]), &one, Some(60_000)));
        // Unknown or later end: it would delay the head.
        assert!(!p.backfill_allowed(&mut r, &req(1, &[]), &one, None));
        assert!(!p.backfill_allowed(&mut r, &req(1, &[]), &one, Some(200_000)));
    }

    #[test]
    fn every_policy_name_parses() {
        for policy in Policy::ALL {
            assert_eq!(parse_policy(&policy.name().to_lowercase()), Some(policy));
        }
        assert_eq!(parse_policy("nope"), None);
    }
}
