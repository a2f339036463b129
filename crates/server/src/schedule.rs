//! The scheduling pass, the server's side of it, in three steps that never
//! climb back: [`gather`] reads one snapshot from the store, the pure
//! planner ([`flotilla_sched::pass::plan`], the code the simulator and the
//! benchmark also run) decides, and [`apply`] writes the plan through the
//! store's conditional writes. Nothing here decides: a placement, a victim,
//! a reservation or a reason comes out of the planner or nowhere.
//!
//! Every write is conditional (a GPU, share or MIG slice taken meanwhile
//! makes it a `Conflict`), so a pass may be cut at any line, lose a race
//! with another writer, or be replayed: what it failed to write is decided
//! again on the next pass, from the store as it then is.

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::{DateTime, Duration as ChronoDuration, Utc};
use flotilla_core::api::WeightTier;
use flotilla_core::endpoint::ReplicaWeights;
use flotilla_core::id::{GpuId, InstanceId, NodeId, TenantId, WorkId};
use flotilla_core::job::Locality as JobLocality;
use flotilla_core::node::RuntimeKind;
use flotilla_core::placement::{GpuShare, Placement};
use flotilla_core::quota::Quota;
use flotilla_scale::tiers::ReadinessTiers;
use flotilla_sched::gang::Locality;
use flotilla_sched::pass::{
    self, GpuAsk, GpuSnap, Hold, NodeSnap, Plan, Promise, QueuedWork, RunningWork, Snapshot,
    TenantPolicy, UsageSpan, Wait, WorkKey,
};
use flotilla_sched::preempt::PreemptConfig;
use flotilla_sched::queue::FairShareConfig;
use flotilla_sched::startup::NodeStartup;
use flotilla_sched::{Policy, Runtime, Tier};
use flotilla_store::waiting::PendingWork;
use flotilla_store::StoreError;

use crate::last_plan::{LastPlan, Unfit};
use crate::state::AppState;

/// How far back the queue's fair share looks at GPU usage.
const FAIR_SHARE_WINDOW_H: i64 = 24;

/// The most waiting works (pending instances and queued jobs together,
/// the oldest) one pass reads. The planner takes 10,000 works on 1,000
/// nodes in about a quarter of a second (`scripts/bench placement`).
const QUEUE_READ: u32 = 5_000;

fn ms_of(t: DateTime<Utc>) -> u64 {
    t.timestamp_millis().max(0) as u64
}

/// Parses a policy name as `flotilla server --placement-policy` takes it.
pub fn parse_policy(name: &str) -> Option<Policy> {
    Policy::ALL
        .into_iter()
        .find(|p| p.name().eq_ignore_ascii_case(name))
}

/// The tier of `w`'s weights on a node: parked or cached where the
/// node's agent reports them, else remote.
pub fn tier_on(
    held: &BTreeMap<NodeId, BTreeMap<String, WeightTier>>,
    node: &NodeId,
    w: &ReplicaWeights,
) -> WeightTier {
    held.get(node)
        .and_then(|k| k.get(&w.key))
        .copied()
        .unwrap_or(WeightTier::Remote)
}

/// Time until a replica of `w` started now would be ready on each machine,
/// ms, in snapshot order: its weights' tier there at that tier's speed
/// (`flotilla_scale::tiers` defaults; `flotilla_sched::startup` does the
/// arithmetic).
fn ready_on(
    nodes: &[(NodeId, Vec<GpuId>)],
    held: &BTreeMap<NodeId, BTreeMap<String, WeightTier>>,
    w: &ReplicaWeights,
    tiers: &ReadinessTiers,
) -> Vec<u64> {
    nodes
        .iter()
        .map(|(id, _)| {
            let speed = match tier_on(held, id, w) {
                WeightTier::Parked => tiers.parked,
                WeightTier::Cached => tiers.cached,
                WeightTier::Remote => tiers.remote,
            };
            NodeStartup {
                overhead_ms: speed.overhead_ms,
                bandwidth_gb_per_s: speed.bandwidth_gb_per_s,
                model_gb: w.model_gb,
                loading_gb: 0.0,
            }
            .time_to_ready_ms()
        })
        .collect()
}

/// What a planner key stands for.
#[derive(Debug, Clone)]
enum Work {
    Queued(Box<PendingWork>),
    /// Running work: its id (an instance, or the job whose members these
    /// are) and its member instances.
    Running(WorkId, Vec<InstanceId>),
}

/// A snapshot and the ids behind its indices.
#[derive(Debug)]
pub struct Gathered {
    /// The planner's input.
    pub input: Snapshot,
    /// By planner key.
    works: Vec<Work>,
    /// By snapshot node index: the node and its GPU ids by GPU index.
    nodes: Vec<(NodeId, Vec<GpuId>)>,
    /// When the first node kept out only by its provider's offer windows
    /// opens: a time waiting work may fit without anything changing.
    pub window_opens: Option<DateTime<Utc>>,
}

/// Dense tenant indices: the planner reasons in integers.
#[derive(Debug, Default)]
struct Tenants(BTreeMap<TenantId, u32>);

impl Tenants {
    fn index(&mut self, t: &TenantId) -> u32 {
        let next = u32::try_from(self.0.len()).unwrap_or(u32::MAX);
        *self.0.entry(t.clone()).or_insert(next)
    }
}

fn locality_of(l: JobLocality) -> Locality {
    match l {
        JobLocality::Any => Locality::Any,
        JobLocality::SamePool => Locality::SameDomain,
        JobLocality::SameRegion => Locality::SameRegion,
    }
}

/// A tenant's quota in the planner's terms (milli-GPU).
fn policy_of(q: &Quota) -> TenantPolicy {
    let guaranteed = u64::from(q.gpus_guaranteed.unwrap_or(0)) * 1000;
    let limit = q.gpus_total.map_or(u64::MAX, |t| u64::from(t) * 1000);
    TenantPolicy {
        quota: flotilla_sched::quota::Quota {
            guaranteed_milli: guaranteed,
            burst_milli: limit.saturating_sub(guaranteed),
        },
        per_model_milli: q
            .gpus_per_model
            .iter()
            .map(|(m, n)| (m.clone(), u64::from(*n) * 1000))
            .collect(),
        weight: f64::from(q.weight_or_default()),
    }
}

/// Reads everything one pass looks at.
pub async fn gather(st: &AppState) -> Result<Gathered, StoreError> {
    let store = st.store();
    let now = st.now();
    let now_ms = ms_of(now);
    let mut tenants = Tenants::default();
    let mut works: Vec<Work> = Vec::new();

    // One snapshot of the store (flotilla_store::pass says why).
    let since = now - ChronoDuration::hours(FAIR_SHARE_WINDOW_H);
    let inputs = store.pass_inputs(QUEUE_READ, since).await?;

    // Machines and their GPUs.
    let snapshot = inputs.nodes;
    let mut node_index: BTreeMap<NodeId, usize> = BTreeMap::new();
    let mut gpu_index: BTreeMap<GpuId, (usize, u16)> = BTreeMap::new();
    let mut nodes = Vec::with_capacity(snapshot.len());
    let mut snap_nodes = Vec::with_capacity(snapshot.len());
    let mut window_opens: Option<DateTime<Utc>> = None;
    for (i, n) in snapshot.iter().enumerate() {
        node_index.insert(n.id.clone(), i);
        let mut ids = Vec::with_capacity(n.gpus.len());
        let mut gpus = Vec::with_capacity(n.gpus.len());
        for (gi, g) in n.gpus.iter().enumerate() {
            gpu_index.insert(g.id.clone(), (i, u16::try_from(gi).unwrap_or(u16::MAX)));
            ids.push(g.id.clone());
            gpus.push(GpuSnap {
                model: g.model.clone(),
                mig: g.mig_mode,
                free_milli: if g.mig_mode {
                    pass::mig_milli(g.mig_compute_free, g.mig_memory_free).1
                } else {
                    g.free_milli
                },
            });
        }
        nodes.push((n.id.clone(), ids));
        if n.ready && !n.cordoned {
            if let Some(at) = n.offer.opens_after(now) {
                window_opens = Some(window_opens.map_or(at, |w| w.min(at)));
            }
        }
        let cpu = u32::try_from(n.cpu_milli_free).unwrap_or(u32::MAX);
        snap_nodes.push(NodeSnap {
            ready: n.ready,
            // Outside its provider's offer windows a node takes no new
            // work, as if cordoned.
            cordoned: n.cordoned || !n.offer.offered_at(now),
            region: n.region.clone(),
            pool: n.pool.clone(),
            runtime: Runtime::from(n.runtime),
            // Totals are the free capacity plus what running work holds,
            // added below.
            cpu_total_milli: cpu,
            mem_total_mib: n.memory_mb_free,
            cpu_free_milli: cpu,
            mem_free_mib: n.memory_mb_free,
            gpus,
        });
    }

    // Queued work.
    let queued = inputs.queue;
    // Replicas that declare their weights start where they are ready
    // soonest: what each node holds of them.
    let held_weights = inputs.weights;
    let tiers = ReadinessTiers::default();
    let mut queue = Vec::with_capacity(queued.len());
    let mut key_of: BTreeMap<WorkId, WorkKey> = BTreeMap::new();
    for q in queued {
        let key = works.len() as WorkKey;
        key_of.insert(q.id(), key);
        queue.push(match &q {
            PendingWork::Instance(p) => QueuedWork {
                key,
                tenant: tenants.index(&p.tenant_id),
                tier: Tier::from_number_or_dedicated(p.tier),
                priority: p.priority,
                submitted_ms: ms_of(p.created_at),
                members: 1,
                spread: false,
                locality: Locality::Any,
                gpu: GpuAsk::of(&p.share, p.gpus),
                models: p.gpu_types.clone(),
                cpu_milli: p.cpu_milli,
                mem_mib: p.memory_mb,
                runtime: Runtime::from(p.runtime),
                max_runtime_ms: None,
                ready_ms: p
                    .weights
                    .as_ref()
                    .map(|w| ready_on(&nodes, &held_weights, w, &tiers))
                    .unwrap_or_default(),
            },
            PendingWork::Job(j) => QueuedWork {
                key,
                tenant: tenants.index(&j.tenant_id),
                tier: Tier::from_number_or_dedicated(j.spec.tier),
                priority: j.spec.priority,
                submitted_ms: ms_of(j.created_at),
                members: u16::try_from(j.spec.nodes.max(1)).unwrap_or(u16::MAX),
                // `--nodes N`: N members on N machines, as Slurm's -N.
                spread: true,
                locality: locality_of(j.spec.locality),
                gpu: GpuAsk::of(&j.spec.share(st.catalog()), j.spec.gpus_per_member()),
                models: j.spec.gpu_types.clone(),
                cpu_milli: j.spec.cpu_milli,
                mem_mib: j.spec.memory_mb,
                // Members run from the job's image, if it has one.
                runtime: Runtime::from(RuntimeKind::for_work(j.spec.image.is_some())),
                max_runtime_ms: j.spec.time_limit_s.map(|s| s.saturating_mul(1000)),
                ready_ms: Vec::new(),
            },
        });
        works.push(Work::Queued(Box::new(q)));
    }

    // Running work: a job's members are one work.
    let held = inputs.held;
    let limits = inputs.time_limits;
    let mut running: Vec<RunningWork> = Vec::new();
    let mut running_of: BTreeMap<WorkId, usize> = BTreeMap::new();
    for h in &held {
        let Some(&node) = node_index.get(&h.node_id) else {
            continue;
        };
        let id = match &h.job_id {
            Some(j) => WorkId::Job(j.clone()),
            None => WorkId::Instance(h.id.clone()),
        };
        let gpus: Vec<(u16, u16)> = h
            .gpu_ids
            .iter()
            .filter_map(|g| gpu_index.get(g).map(|&(_, gi)| (gi, h.milli_per_gpu)))
            .collect();
        let n = &mut snap_nodes[node];
        n.cpu_total_milli = n.cpu_total_milli.saturating_add(h.cpu_milli);
        n.mem_total_mib = n.mem_total_mib.saturating_add(h.memory_mb);
        let hold = Hold {
            node,
            gpus,
            cpu_milli: h.cpu_milli,
            mem_mib: h.memory_mb,
        };
        let ends = h
            .job_id
            .as_ref()
            .and_then(|j| limits.get(j))
            .map(|s| ms_of(h.created_at).saturating_add(s.saturating_mul(1000)));
        match running_of.get(&id) {
            Some(&r) => {
                let w = &mut running[r];
                w.members.push(hold);
                w.stopping |= h.stop_requested;
                w.started_ms = w.started_ms.min(ms_of(h.since));
                if let Work::Running(_, members) = &mut works[w.key as usize] {
                    members.push(h.id.clone());
                }
            }
            None => {
                let key = works.len() as WorkKey;
                running_of.insert(id.clone(), running.len());
                running.push(RunningWork {
                    key,
                    tenant: tenants.index(&h.tenant_id),
                    tier: Tier::from_number_or_dedicated(h.tier),
                    priority: h.priority,
                    preemptible: h.preemptible,
                    started_ms: ms_of(h.since),
                    ends_by_ms: ends,
                    stopping: h.stop_requested,
                    preempted_by: h.preempted_by.as_ref().and_then(|b| key_of.get(b).copied()),
                    members: vec![hold],
                });
                works.push(Work::Running(id, vec![h.id.clone()]));
            }
        }
    }

    // Capacity its victims released, promised to a waiting preemptor.
    let mut promises = Vec::new();
    for (by, gpus) in inputs.promised {
        let Some(&to) = key_of.get(&by) else { continue };
        for g in gpus {
            let Some(&(node, gi)) = gpu_index.get(&g) else {
                continue;
            };
            let free = snap_nodes[node].gpus[usize::from(gi)].free_milli;
            if free > 0 {
                promises.push(Promise {
                    node,
                    gpu: gi,
                    milli: free,
                    to,
                });
            }
        }
    }

    // Quotas, weights and recent use.
    let policies: BTreeMap<u32, TenantPolicy> = inputs
        .quotas
        .iter()
        .map(|(t, q)| (tenants.index(t), policy_of(q)))
        .collect();
    let usage = inputs
        .usage
        .iter()
        .map(|u| UsageSpan {
            tenant: tenants.index(&u.tenant_id),
            gpu_milli: u64::from(u.gpus) * u64::from(u.milli_per_gpu),
            from_ms: ms_of(u.started_at.max(since)),
            to_ms: ms_of(u.finished_at.unwrap_or(now).min(now)),
        })
        .collect();

    Ok(Gathered {
        input: Snapshot {
            now_ms,
            // Seeded from the clock so ties spread over time, yet a pass
            // replayed with the same inputs and time decides the same.
            seed: now_ms,
            policy: st.config().placement_policy,
            nodes: snap_nodes,
            running,
            promises,
            queue,
            tenants: policies,
            usage,
            fair_share: FairShareConfig::default(),
            preempt: PreemptConfig::default(),
        },
        works,
        nodes,
        window_opens,
    })
}

impl Gathered {
    /// The id a key names, as reasons print it.
    fn name(&self, key: WorkKey) -> String {
        match self.works.get(key as usize) {
            Some(Work::Queued(q)) => q.id().to_string(),
            Some(Work::Running(id, _)) => id.to_string(),
            None => format!("work {key}"),
        }
    }

    fn placement(&self, m: &pass::MemberPlacement, share: &GpuShare) -> Option<Placement> {
        let (node, ids) = self.nodes.get(m.node)?;
        let gpus = m
            .gpus
            .iter()
            .map(|&(g, _)| ids.get(usize::from(g)).cloned())
            .collect::<Option<Vec<_>>>()?;
        Some(Placement {
            node: node.clone(),
            model: m.model.clone(),
            gpus,
            share: share.clone(),
        })
    }

    /// The queued work in the order the plan tried it.
    pub fn in_order(&self, plan: &Plan) -> Vec<PendingWork> {
        plan.order
            .iter()
            .filter_map(|&k| match self.works.get(k as usize) {
                Some(Work::Queued(q)) => Some((**q).clone()),
                _ => None,
            })
            .collect()
    }
}

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    /// Works placed (an instance, or a whole job).
    pub placed: usize,
    /// The nodes those placements went to: whose held syncs to wake.
    pub nodes: std::collections::BTreeSet<NodeId>,
    /// Victims told to stop.
    pub preempted: usize,
    /// Writes that lost a race and wait for the next pass.
    pub conflicts: usize,
}

/// How many placements share a commit. One commit per placement kept a
/// 2,000-node fleet's fill writing for 217 s (a WAL flush each, on a busy
/// database); one for a whole pass held the lease row's share lock
/// (taken by the fence check) long enough to time out a lease renewal.
/// A few dozen keeps a batch to milliseconds (docs/scale.md).
pub const PLACEMENTS_PER_COMMIT: usize = 32;

/// Writes `plan`: placements, preemptions, reasons. A write that lost a
/// race (`Conflict`, `NotFound`) is left for the next pass.
pub async fn apply(st: &AppState, g: &Gathered, plan: &Plan) -> Result<Applied, StoreError> {
    let store = st.store();
    let now = st.now();
    let mut done = Applied::default();
    // The placements that can be written: each work with its members'
    // placements, in the plan's order.
    let mut writable = Vec::with_capacity(plan.placements.len());
    for p in &plan.placements {
        let Some(Work::Queued(q)) = g.works.get(p.key as usize) else {
            continue;
        };
        let share = match &**q {
            PendingWork::Instance(i) => i.share.clone(),
            PendingWork::Job(j) => j.spec.share(st.catalog()),
        };
        let Some(at) = p
            .members
            .iter()
            .map(|m| g.placement(m, &share))
            .collect::<Option<Vec<_>>>()
        else {
            continue;
        };
        writable.push((&**q, at, p.backfilled));
    }
    // A job's members are new instances: their ids, as every id, come
    // from the server's clock and randomness.
    let new_member = || {
        let (t, r) = st.ids();
        InstanceId::generate(t, r)
    };
    for batch in writable.chunks(PLACEMENTS_PER_COMMIT) {
        let works: Vec<(&PendingWork, &[Placement])> =
            batch.iter().map(|(q, at, _)| (*q, at.as_slice())).collect();
        let written = store.schedule_works(&works, new_member, now).await?;
        let mut woken = std::collections::BTreeSet::new();
        for ((q, at, backfilled), one) in batch.iter().zip(written) {
            match one {
                Ok(members) => {
                    log_placed(q, at, &members, *backfilled);
                    done.placed += 1;
                    woken.extend(at.iter().map(|a| a.node.clone()));
                }
                Err(StoreError::Conflict(_) | StoreError::NotFound(_)) => {
                    tracing::debug!(work = %q.id(), "placement lost a race; retrying next pass");
                    done.conflicts += 1;
                }
                Err(StoreError::Quota(e)) => {
                    let reason = format!("over quota: {e}");
                    store.set_work_reason(&q.id(), &reason, now).await?;
                }
                Err(e) => return Err(e),
            }
        }
        // The placed nodes' held syncs learn of their work now, not at
        // the pass's end: the first agents start while the rest is written.
        st.notify_nodes(&woken);
        done.nodes.extend(woken);
    }
    for pre in &plan.preemptions {
        let Some(Work::Running(_, members)) = g.works.get(pre.victim as usize) else {
            continue;
        };
        let by = match g.works.get(pre.by as usize) {
            Some(Work::Queued(q)) => q.id(),
            _ => continue,
        };
        for m in members {
            if store.preempt(m, &by, now).await? {
                tracing::info!(victim = %m, %by, "preempted");
                done.preempted += 1;
            }
        }
    }
    for (key, wait) in &plan.waiting {
        let Some(Work::Queued(q)) = g.works.get(*key as usize) else {
            continue;
        };
        let reason = wait.describe(|k| g.name(k));
        if reason != q.state_reason() {
            store.set_work_reason(&q.id(), &reason, now).await?;
        }
    }
    Ok(done)
}

/// Logs a placement `apply` wrote: `members` are the instances now
/// scheduled, by rank.
fn log_placed(q: &PendingWork, at: &[Placement], members: &[InstanceId], backfill: bool) {
    match q {
        PendingWork::Instance(i) => {
            // Its one placement (the store refuses any other count).
            if let Some(a) = at.first() {
                tracing::info!(instance = %i.id, node = %a.node, gpus = a.gpus.len(), backfill,
                    "instance scheduled");
            }
        }
        PendingWork::Job(j) => {
            tracing::info!(job = %j.id, members = members.len(), attempt = j.attempt + 1,
                backfill, "job gang scheduled");
        }
    }
}

/// The plan the server's pass applies for what [`gather`] read: the pure
/// planner, the same call the simulator makes (`flotilla_sim::nodes::decide`;
/// `tests/same_plan.rs` hands both one gathered snapshot).
pub fn plan_of(g: &Gathered) -> Result<Plan, StoreError> {
    pass::plan(&g.input).map_err(|e| StoreError::Corrupt(format!("planner: {e}")))
}

/// What one pass found, for deciding when the next is due
/// ([`crate::reconcile`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PassOutcome {
    /// Works placed (an instance, or a whole job).
    pub placed: usize,
    /// Works left waiting.
    pub waiting: usize,
    /// When the queue's blocked head is expected to start (its
    /// reservation), if the plan knows: a time to plan again at even if
    /// nothing changes.
    pub head_due: Option<DateTime<Utc>>,
    /// When a node closed by its offer windows opens while work waits:
    /// another such time.
    pub window_opens: Option<DateTime<Utc>>,
}

impl PassOutcome {
    /// The first time the last plan named to plan again at, whatever
    /// else happens (a reservation's start, an offer window's opening).
    pub fn planned(&self) -> Option<DateTime<Utc>> {
        match (self.head_due, self.window_opens) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// One scheduling pass: gather, plan, apply. Returns how many works it
/// placed.
pub async fn schedule_pass(st: &AppState) -> Result<usize, StoreError> {
    Ok(run_pass(st).await?.placed)
}

/// [`schedule_pass`], with what the caller needs to know when to run the
/// next one.
pub async fn run_pass(st: &AppState) -> Result<PassOutcome, StoreError> {
    let started = tokio::time::Instant::now();
    st.ops().placement_passes.inc();
    let generation = st.change_generation();
    let g = gather(st).await?;
    st.ops().leader_pass("placement_gather", started.elapsed());
    if g.input.queue.is_empty() {
        keep(st, &g, &Plan::default(), generation);
        return Ok(PassOutcome::default());
    }
    let planning = tokio::time::Instant::now();
    let plan = plan_of(&g)?;
    st.ops()
        .placement_plan
        .observe(planning.elapsed().as_secs_f64());
    keep(st, &g, &plan, generation);
    let applying = tokio::time::Instant::now();
    let done = apply(st, &g, &plan).await?;
    st.ops().leader_pass("placement_apply", applying.elapsed());
    st.ops()
        .placement_pass
        .observe(started.elapsed().as_secs_f64());
    // Only the placed nodes' held syncs wake for a placement, batch by
    // batch as `apply` writes them (at a fleet of thousands, every sync
    // woken for every placement anywhere was a storm of reads that found
    // nothing); a preemption's victims' nodes are not at hand here, so it
    // wakes every sync.
    if done.preempted > 0 {
        st.notify_change();
    }
    let head_due = plan
        .reservation
        .as_ref()
        .and_then(|r| r.start_ms)
        .and_then(|ms| DateTime::<Utc>::from_timestamp_millis(i64::try_from(ms).ok()?));
    let waiting = plan.waiting.len();
    Ok(PassOutcome {
        placed: done.placed,
        waiting,
        head_due,
        window_opens: if waiting > 0 { g.window_opens } else { None },
    })
}

/// Keeps what `plan` decided for its readers ([`crate::last_plan`]).
fn keep(st: &AppState, g: &Gathered, plan: &Plan, generation: u64) -> Arc<LastPlan> {
    let unfit = plan
        .waiting
        .iter()
        .filter(|(_, w)| matches!(w, Wait::NoFit(_) | Wait::Unschedulable(_)))
        .filter_map(|(key, _)| g.input.queue.iter().find(|q| q.key == *key))
        .filter_map(|q| {
            let gpus = match q.gpu {
                GpuAsk::None => return None,
                GpuAsk::Whole(n) => u32::from(n),
                GpuAsk::Fraction(_) | GpuAsk::Mig(_) => 1,
            };
            Some(Unfit {
                members: u32::from(q.members),
                gpus,
                models: q.models.clone(),
                runtime: q.runtime,
            })
        })
        .collect();
    let order = g.in_order(plan).iter().map(PendingWork::id).collect();
    st.last_plan().keep(LastPlan {
        generation,
        at: st.now(),
        order,
        unfit,
    })
}

/// What the scheduler decides now: the last pass's plan while it is
/// current ([`crate::last_plan`]), else a plan made afresh from the store
/// (and kept). Read by the queue routes and the node pools.
pub async fn current_plan(st: &AppState) -> Result<Arc<LastPlan>, StoreError> {
    let generation = st.change_generation();
    if let Some(p) = st.last_plan().current(generation, st.now()) {
        return Ok(p);
    }
    let g = gather(st).await?;
    let plan = if g.input.queue.is_empty() {
        Plan::default()
    } else {
        plan_of(&g)?
    };
    Ok(keep(st, &g, &plan, generation))
}
