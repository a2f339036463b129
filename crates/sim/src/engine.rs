//! The discrete-event core: one endpoint, one policy, one trace, on a
//! virtual clock.
//!
//! Events live in a binary heap keyed by `(time, sequence)`; arrivals are
//! read in order from the sorted trace and merged with the heap, so the
//! heap only holds completions, replica readiness, preemptions and policy
//! ticks. At equal times heap events run before arrivals, and heap events
//! in the order they were scheduled, so a run is a pure function of its
//! inputs and seed.
//!
//! The model:
//!
//! - **Routing.** An arriving request goes to the least-loaded ready
//!   replica with a free slot (ties: the oldest replica); with none, it
//!   waits in one FIFO queue. A freed slot takes the queue's head.
//! - **Latency.** Time to first token = queue wait (including any wait for
//!   a cold start) + prefill; end-to-end adds decode. A request that waits
//!   longer than `timeout_ms` is dropped, counts as an SLO miss, and enters
//!   the percentiles at the timeout.
//! - **Replicas.** A new replica is ready after a cold start drawn from the
//!   [`ColdStartModel`] (on a node pool: after its node is ready, too). It
//!   is paid for from the moment it is asked for until it stops. Scaling
//!   down cancels replicas still starting first (newest first), then stops
//!   the least-loaded ready ones: idle at once, busy ones drain (no new
//!   requests, stop when empty).
//! - **Policy.** The policy is called every `interval_ms()` of its own
//!   with an [`Observation`] of the endpoint; its decision is applied at
//!   once. Latency percentiles in the observation are those of requests
//!   that got their first token since the previous call.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use flotilla_scale::{Latency, Observation, Policy, ReadinessTiers, Tier, Timing};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::coldstart::ColdStartModel;
use crate::nodes::{NodePool, ProviderConfig, SimulatedCloud};
use crate::service::ServiceModel;
use crate::trace::{Request, Trace};

/// A node pool under the endpoint's replicas.
#[derive(Debug, Clone, PartialEq)]
pub struct NodePoolConfig {
    /// The simulated provider's settings.
    pub provider: ProviderConfig,
    /// Idle time before an empty node is released.
    pub idle_grace_ms: u64,
}

/// Readiness tiers under the endpoint's replicas: where a replica the
/// policy stops waits, and how fast it comes back.
///
/// A replica the policy stops is **parked** (weights kept in host memory,
/// GPU released and no longer paid) while the policy's
/// [`Policy::parked`] wants more parked than there are and host memory has
/// room; otherwise it is released, leaving its weights on a local disk
/// (**cached**) while the disks have room, the least recently used copy
/// evicted first. A new replica comes back from the fastest tier that
/// holds one: parked (restore time from the host-to-GPU bandwidth),
/// cached (from the disk bandwidth), else remote (a cold start drawn from
/// the [`ColdStartModel`]). Parked replicas cost host memory by the
/// GB-second; the report prices it from the price book.
///
/// Capacities are stated per node over a number of nodes: without a node
/// pool the replicas' GPUs are not tied to nodes, so the budgets are the
/// fleet's (nodes × per-node size); a node pool with tiers is not modelled.
#[derive(Debug, Clone, PartialEq)]
pub struct TierSetting {
    /// Tier speeds.
    pub tiers: ReadinessTiers,
    /// Size of the model's weights, GB.
    pub model_gb: f64,
    /// Nodes the endpoint's replicas run on.
    pub nodes: u32,
    /// Host memory one node sets aside for parked replicas, GB.
    pub host_memory_gb_per_node: f64,
    /// Local disk one node sets aside for cached weights, GB.
    pub disk_gb_per_node: f64,
}

impl TierSetting {
    /// Replicas the nodes' host memory holds parked.
    pub fn parked_capacity(&self) -> u32 {
        self.copies(self.host_memory_gb_per_node)
    }

    /// Weight copies the nodes' disks hold.
    pub fn cached_capacity(&self) -> u32 {
        self.copies(self.disk_gb_per_node)
    }

    fn copies(&self, per_node_gb: f64) -> u32 {
        if !(self.model_gb > 0.0 && per_node_gb.is_finite() && per_node_gb > 0.0) {
            return 0;
        }
        let per_node = (per_node_gb / self.model_gb)
            .floor()
            .min(f64::from(u32::MAX)) as u32;
        per_node.saturating_mul(self.nodes)
    }
}

/// Cold starts by the tier they came from, and the parked time.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct TierStats {
    /// Restores from host memory.
    pub parked_starts: u64,
    /// Starts from a local disk copy.
    pub cached_starts: u64,
    /// Starts from nothing local.
    pub remote_starts: u64,
    /// Loads into host memory (no GPU) from a disk copy.
    pub cached_fills: u64,
    /// Loads into host memory (no GPU) from remote.
    pub remote_fills: u64,
    /// Replica-milliseconds spent parked.
    pub parked_replica_ms: u64,
    /// GB-seconds of host memory parked replicas held.
    pub parked_gb_seconds: f64,
}

/// Everything a run needs besides the trace and the policy.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Per-replica service rates.
    pub service: ServiceModel,
    /// Replica cold starts (on top of node provisioning when there is a
    /// node pool).
    pub cold_start: ColdStartModel,
    /// Time-to-first-token objective.
    pub slo_ms: u64,
    /// Queue wait after which a request is dropped.
    pub timeout_ms: u64,
    /// Seed of the run's generator.
    pub seed: u64,
    /// Spacing of the recorded time series.
    pub sample_ms: u64,
    /// The endpoint's tier (1 = on-demand only, never on a reaped node).
    pub tier: u8,
    /// `None`: GPUs are always available and the cold start is the whole
    /// start-up; `Some`: replicas need a node of the pool.
    pub node_pool: Option<NodePoolConfig>,
    /// Warm-up: the trace's first `warmup_ms` are replayed once before it
    /// starts, unmeasured, so that every policy meets the trace as a live
    /// endpoint would — already serving that traffic — rather than from a
    /// cold, empty start. Latency, GPU time and the series count from the
    /// trace's start only. 0 disables it.
    pub warmup_ms: u64,
    /// The price version GPU time is costed from; `None`: the billing
    /// crate's list-price book of the built-in catalog.
    pub prices: Option<flotilla_billing::price::PriceVersion>,
    /// Readiness tiers; `None`: every stopped replica is released and every
    /// start is a cold start from the [`ColdStartModel`].
    pub tiers: Option<TierSetting>,
}

impl SimConfig {
    /// Defaults around a service model, cold-start model and SLO: timeout
    /// 60 s, seed 1, samples every 10 s, tier 2, no node pool.
    pub fn new(service: ServiceModel, cold_start: ColdStartModel, slo_ms: u64) -> Self {
        Self {
            service,
            cold_start,
            slo_ms,
            timeout_ms: 60_000,
            seed: 1,
            sample_ms: 10_000,
            tier: 2,
            node_pool: None,
            warmup_ms: 0,
            prices: None,
            tiers: None,
        }
    }
}

/// Latency percentiles, milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Percentiles {
    pub p50: u64,
    pub p95: u64,
    pub p99: u64,
}

/// One point of the recorded time series.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Sample {
    /// Start of the interval, ms.
    pub t_ms: u64,
    /// Arrivals per second over the interval.
    pub arrivals_per_s: f64,
    /// Replicas asked for (ready + starting) at its end.
    pub replicas: u32,
    /// Of which ready.
    pub ready: u32,
}

/// The outcome of one run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimResult {
    /// Policy name.
    pub policy: String,
    /// Requests in the trace.
    pub requests: u64,
    /// Requests whose first token came within the SLO.
    pub slo_met: u64,
    /// Requests dropped: waited past the timeout, or lost with a preempted
    /// node.
    pub dropped: u64,
    /// Time to first token.
    pub ttft: Percentiles,
    /// End-to-end latency.
    pub e2e: Percentiles,
    /// Replica GPU-milliseconds, cold starts included.
    pub gpu_ms: u64,
    /// Node GPU-milliseconds `(on-demand, spot)` with a node pool.
    pub node_gpu_ms: Option<(u64, u64)>,
    /// Replicas started (from any tier).
    pub cold_starts: u64,
    /// With readiness tiers: starts by tier and parked time.
    pub tiers: Option<TierStats>,
    /// Policy decisions that changed the replica target.
    pub scaling_actions: u64,
    /// Nodes preempted.
    pub preemptions: u64,
    /// Virtual time at which the run ended (last request done).
    pub end_ms: u64,
    /// Arrivals against replicas over time.
    pub series: Vec<Sample>,
}

impl SimResult {
    /// SLO attainment in percent.
    pub fn slo_attainment_pct(&self) -> f64 {
        if self.requests == 0 {
            100.0
        } else {
            100.0 * self.slo_met as f64 / self.requests as f64
        }
    }

    /// Replica GPU-seconds.
    pub fn gpu_seconds(&self) -> f64 {
        self.gpu_ms as f64 / 1000.0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A request finished on a replica.
    Done { replica: u32, request: u32 },
    /// A replica's cold start ended.
    Ready { replica: u32 },
    /// A node of the pool was preempted.
    Preempt { node: u32 },
    /// A replica's weights finished loading into host memory.
    Filled { replica: u32 },
    /// The policy's next call.
    Tick,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Asked for, no node could be had yet.
    Unplaced,
    Starting,
    Ready,
    Draining,
    /// Weights in host memory, GPU released.
    Parked,
    /// Weights being loaded into host memory (from disk or remote), no
    /// GPU: becomes parked.
    Filling,
    Gone,
}

#[derive(Debug)]
struct Replica {
    state: State,
    /// When it was asked for (or placed, when it had to wait for a node).
    since_ms: u64,
    ready_at_ms: u64,
    node: Option<usize>,
    in_flight: Vec<u32>,
    /// With tiers: host memory held from then until `since_ms`, while its
    /// weights are staged into host memory before it takes a GPU.
    mem_from_ms: Option<u64>,
    /// When the last request it started will be done.
    busy_until_ms: u64,
    /// Its start is a restore from host memory (parked, or a load into
    /// host memory it waited for): its start-up is a measured restore.
    restoring: bool,
}

/// Dropped-request marker in the per-request latency arrays.
const DROPPED: u32 = u32::MAX;

struct Sim<'a> {
    /// The warm-up copy followed by the trace, shifted by the warm-up.
    requests: Vec<Request>,
    /// Index of the first measured request.
    first: usize,
    /// Virtual time at which measuring starts (the warm-up's length).
    origin: u64,
    cfg: &'a SimConfig,
    rng: ChaCha8Rng,
    now: u64,
    seq: u64,
    heap: BinaryHeap<Reverse<(u64, u64, Event)>>,
    queue: VecDeque<u32>,
    replicas: Vec<Replica>,
    /// Ready, not draining, in start order.
    ready: Vec<u32>,
    /// Unplaced or starting.
    starting: Vec<u32>,
    in_flight: u32,
    arrived: u64,
    ttft: Vec<u32>,
    e2e: Vec<u32>,
    recent_ttft: Vec<u32>,
    gpu_ms: u64,
    cold_starts: u64,
    scaling_actions: u64,
    preemptions: u64,
    last_target: Option<u32>,
    pool: Option<NodePool<SimulatedCloud>>,
    series: Vec<Sample>,
    sample_from: (u64, u64),
    /// Node GPU time spent during the warm-up, subtracted at the end.
    pool_gpu_before: Option<(u64, u64)>,
    /// Parked replicas, least recently parked first.
    parked: VecDeque<u32>,
    /// Free weight copies on local disks (their GPUs run nothing of this
    /// endpoint).
    cached: u32,
    /// Replicas filling host memory.
    filling: Vec<u32>,
    /// Draining replicas (told to stop, finishing their requests).
    draining: Vec<u32>,
    /// What the policy last asked to keep parked.
    want_parked: u32,
    tier_stats: TierStats,
    /// Durations measured and not yet told to the policy, with the time
    /// each becomes known (a prefill at its first token): the policy hears
    /// of them at its next call, never before they happen.
    timings: Vec<(u64, Timing)>,
}

/// Run `policy` over `trace`. `progress(done, total)` is called now and
/// then with the number of requests that have arrived, for a progress bar.
pub fn simulate(
    trace: &Trace,
    policy: &mut dyn Policy,
    cfg: &SimConfig,
    progress: &mut dyn FnMut(u64, u64),
) -> SimResult {
    let warm: Vec<Request> = trace
        .requests()
        .iter()
        .take_while(|r| r.arrival_ms < cfg.warmup_ms)
        .copied()
        .collect();
    let origin = if warm.is_empty() { 0 } else { cfg.warmup_ms };
    let first = warm.len();
    let mut all = warm;
    all.extend(trace.requests().iter().map(|r| Request {
        arrival_ms: r.arrival_ms + origin,
        ..*r
    }));
    let n = all.len();
    let mut sim = Sim {
        requests: all,
        first,
        origin,
        cfg,
        rng: ChaCha8Rng::seed_from_u64(cfg.seed),
        now: 0,
        seq: 0,
        heap: BinaryHeap::new(),
        queue: VecDeque::new(),
        replicas: Vec::new(),
        ready: Vec::new(),
        starting: Vec::new(),
        in_flight: 0,
        arrived: 0,
        ttft: vec![DROPPED; n],
        e2e: vec![DROPPED; n],
        recent_ttft: Vec::new(),
        gpu_ms: 0,
        cold_starts: 0,
        scaling_actions: 0,
        preemptions: 0,
        last_target: None,
        pool: cfg.node_pool.as_ref().map(|p| {
            NodePool::new(
                p.provider.cloud_with_seed(cfg.seed ^ 0x9e37_79b9_7f4a_7c15),
                cfg.service.gpu.clone(),
                p.idle_grace_ms,
            )
        }),
        series: Vec::new(),
        sample_from: (0, 0),
        pool_gpu_before: None,
        parked: VecDeque::new(),
        cached: 0,
        filling: Vec::new(),
        draining: Vec::new(),
        want_parked: 0,
        tier_stats: TierStats::default(),
        timings: Vec::new(),
    };
    // Start at the policy's minimum, ready: the endpoint existed before
    // the trace began.
    let min = policy.bounds().min();
    for _ in 0..min {
        sim.add_replica(true);
    }
    sim.last_target = Some(min);
    sim.push(0, Event::Tick);
    let interval = policy.interval_ms().max(1);
    let mut next = 0usize;
    let report_every = (n / 200).max(1);
    loop {
        let heap_t = sim.heap.peek().map(|Reverse((t, _, _))| *t);
        let arrival_t = sim.requests.get(next).map(|r| r.arrival_ms);
        let take_arrival = match (heap_t, arrival_t) {
            (_, None) => false,
            (None, Some(_)) => true,
            (Some(h), Some(a)) => a < h,
        };
        if take_arrival {
            sim.now = arrival_t.unwrap_or(sim.now);
            if next == sim.first && sim.origin > 0 {
                sim.start_measuring();
            }
            sim.arrive(next as u32);
            next += 1;
            if next.is_multiple_of(report_every) {
                progress(next as u64, n as u64);
            }
            continue;
        }
        let Some(Reverse((t, _, ev))) = sim.heap.pop() else {
            break;
        };
        sim.now = t;
        match ev {
            Event::Done { replica, request } => sim.done(replica, request),
            Event::Ready { replica } => sim.replica_ready(replica),
            Event::Preempt { node } => sim.preempt(node as usize),
            Event::Filled { replica } => sim.filled(replica),
            Event::Tick => {
                let finished = next == n && sim.queue.is_empty() && sim.in_flight == 0;
                if finished {
                    break;
                }
                sim.tick(policy);
                sim.push(t + interval, Event::Tick);
            }
        }
    }
    progress(n as u64, n as u64);
    sim.finish(policy.name())
}

impl Sim<'_> {
    /// The warm-up is over: forget what it cost and start the series.
    fn start_measuring(&mut self) {
        self.gpu_ms = 0;
        for rep in &mut self.replicas {
            if !matches!(rep.state, State::Gone | State::Unplaced) {
                // A start still staging weights takes its GPU later.
                rep.since_ms = rep.since_ms.max(self.now);
                rep.mem_from_ms = rep.mem_from_ms.map(|m| m.max(self.now));
            }
        }
        self.pool_gpu_before = self.pool.as_ref().map(|p| p.gpu_ms(self.now));
        self.cold_starts = 0;
        self.tier_stats = TierStats::default();
        self.scaling_actions = 0;
        self.preemptions = 0;
        self.series.clear();
        self.sample_from = (self.now, self.arrived);
    }

    fn push(&mut self, t: u64, ev: Event) {
        self.seq += 1;
        self.heap.push(Reverse((t, self.seq, ev)));
    }

    fn c(&self) -> usize {
        self.cfg.service.max_concurrency as usize
    }

    fn arrive(&mut self, i: u32) {
        self.arrived += 1;
        // Least-loaded ready replica with a free slot; ties to the oldest.
        let c = self.c();
        let mut best: Option<(usize, u32)> = None;
        for &r in &self.ready {
            let load = self.replicas[r as usize].in_flight.len();
            if load < c && best.is_none_or(|(l, _)| load < l) {
                best = Some((load, r));
                if load == 0 {
                    break;
                }
            }
        }
        match best {
            Some((_, r)) => self.start(r, i),
            None => self.queue.push_back(i),
        }
    }

    /// Begin serving request `i` on replica `r` now.
    fn start(&mut self, r: u32, i: u32) {
        let req = &self.requests[i as usize];
        let wait = self.now - req.arrival_ms;
        let prefill = self.cfg.service.prefill_ms(req);
        let service = self.cfg.service.service_ms(req);
        let ttft = sat32(wait + prefill);
        self.ttft[i as usize] = ttft;
        self.e2e[i as usize] = sat32(wait + service);
        self.recent_ttft.push(ttft);
        self.timings
            .push((self.now + prefill, Timing::Prefill { ms: prefill }));
        let rep = &mut self.replicas[r as usize];
        rep.in_flight.push(i);
        rep.busy_until_ms = rep.busy_until_ms.max(self.now + service);
        self.in_flight += 1;
        self.push(
            self.now + service,
            Event::Done {
                replica: r,
                request: i,
            },
        );
    }

    /// The queue's head that has not timed out, dropping those that have.
    fn next_queued(&mut self) -> Option<u32> {
        while let Some(i) = self.queue.pop_front() {
            let a = self.requests[i as usize].arrival_ms;
            if self.now - a <= self.cfg.timeout_ms {
                return Some(i);
            }
        }
        None
    }

    fn expire_queue(&mut self) {
        while let Some(&i) = self.queue.front() {
            let a = self.requests[i as usize].arrival_ms;
            if self.now - a > self.cfg.timeout_ms {
                self.queue.pop_front();
            } else {
                break;
            }
        }
    }

    fn fill(&mut self, r: u32) {
        while self.replicas[r as usize].in_flight.len() < self.c() {
            match self.next_queued() {
                Some(i) => self.start(r, i),
                None => break,
            }
        }
    }

    fn done(&mut self, r: u32, i: u32) {
        let rep = &mut self.replicas[r as usize];
        let Some(pos) = rep.in_flight.iter().position(|&x| x == i) else {
            return; // lost with a preempted node
        };
        rep.in_flight.swap_remove(pos);
        self.in_flight -= 1;
        match rep.state {
            State::Draining if rep.in_flight.is_empty() => self.stop(r),
            State::Ready => self.fill(r),
            _ => {}
        }
    }

    fn replica_ready(&mut self, r: u32) {
        let rep = &mut self.replicas[r as usize];
        if rep.state != State::Starting || rep.ready_at_ms != self.now {
            return; // cancelled, or re-placed with a later time
        }
        rep.state = State::Ready;
        if rep.restoring {
            let ms = self.now.saturating_sub(rep.since_ms);
            self.timings.push((self.now, Timing::Restore { ms }));
        }
        self.starting.retain(|&x| x != r);
        self.ready.push(r);
        self.fill(r);
    }

    /// Ask for one replica; `warm` ones are ready at once (initial
    /// minimum).
    fn add_replica(&mut self, warm: bool) {
        let r = self.replicas.len() as u32;
        self.replicas.push(Replica {
            state: State::Unplaced,
            since_ms: self.now,
            ready_at_ms: 0,
            node: None,
            in_flight: Vec::new(),
            mem_from_ms: None,
            busy_until_ms: 0,
            restoring: false,
        });
        if warm {
            let rep = &mut self.replicas[r as usize];
            rep.state = State::Ready;
            rep.ready_at_ms = self.now;
            self.ready.push(r);
            if let Some((node, _)) = self.pool_place() {
                self.replicas[r as usize].node = Some(node);
            }
            return;
        }
        self.cold_starts += 1;
        self.starting.push(r);
        self.place(r);
    }

    /// How a new replica starts: `(staging, start-up)` ms — the time its
    /// weights take to reach host memory before it takes a GPU (with
    /// tiers, nothing else is loaded with a GPU held), then the start-up
    /// on the GPU, from the fastest tier that holds it. Tiers off: no
    /// staging, a cold start from the model.
    fn restore_ms(&mut self) -> (u64, u64, bool) {
        let Some(t) = &self.cfg.tiers else {
            return (0, self.cfg.cold_start.sample(&mut self.rng), false);
        };
        if let Some(p) = self.parked.pop_back() {
            // The most recently parked: any parked copy is as good, and
            // the oldest are the first to be released.
            self.unpark(p);
            self.tier_stats.parked_starts += 1;
            return (0, t.tiers.restore_ms(Tier::Parked, t.model_gb), true);
        }
        // Weights on their way into host memory: restore once they are
        // there, if that is sooner than from disk.
        let parked_ms = t.tiers.restore_ms(Tier::Parked, t.model_gb);
        let cached_ms = t.tiers.restore_ms(Tier::Cached, t.model_gb);
        let reps = &self.replicas;
        let soonest = self
            .filling
            .iter()
            .enumerate()
            .min_by_key(|(_, &r)| (reps[r as usize].ready_at_ms, r))
            .map(|(i, &r)| (i, reps[r as usize].ready_at_ms));
        if let Some((i, at)) = soonest {
            let staging = at.saturating_sub(self.now);
            if self.cached == 0 || staging + parked_ms < cached_ms {
                let r = self.filling.swap_remove(i);
                self.unpark(r);
                self.tier_stats.parked_starts += 1;
                return (staging, parked_ms, true);
            }
        }
        if self.cached > 0 {
            self.cached -= 1;
            self.tier_stats.cached_starts += 1;
            return (0, cached_ms, false);
        }
        // Remote: the download lands in host memory first (a GPU held
        // through a minute of download is a minute of GPU paid for
        // nothing), then the replica restores from there.
        self.tier_stats.remote_starts += 1;
        (self.cfg.cold_start.sample(&mut self.rng), parked_ms, false)
    }

    /// A parked replica leaves host memory: pay its parked time.
    fn unpark(&mut self, r: u32) {
        let rep = &mut self.replicas[r as usize];
        self.tier_stats.parked_replica_ms += self.now.saturating_sub(rep.since_ms);
        rep.state = State::Gone;
    }

    /// A replica stopped on a GPU: park it when the policy wants more
    /// parked and host memory has room, else release it to the disk cache.
    fn park_or_release(&mut self, r: u32) {
        let Some(t) = &self.cfg.tiers else { return };
        let cap = t.parked_capacity();
        if (self.parked.len() as u32) < self.want_parked.min(cap) {
            let rep = &mut self.replicas[r as usize];
            rep.state = State::Parked;
            rep.since_ms = self.now;
            self.parked.push_back(r);
        } else {
            self.release_to_cache();
        }
    }

    /// One more free weight copy on disk, unless the disks are full (the
    /// least recently used copy goes: copies are alike, so the count
    /// stays).
    fn release_to_cache(&mut self) {
        let cap = self
            .cfg
            .tiers
            .as_ref()
            .map_or(0, TierSetting::cached_capacity);
        self.cached = (self.cached + 1).min(cap);
    }

    /// Match host memory to what the policy wants parked: release what is
    /// beyond it (loads under way first, the latest first; then the least
    /// recently parked), and load weights into host memory for what is
    /// missing, from a disk copy when there is one, else remote. A load
    /// holds its host memory (and is paid) from its start; it uses no GPU.
    fn trim_parked(&mut self) {
        let Some(t) = self.cfg.tiers.clone() else {
            return;
        };
        let want = self.want_parked.min(t.parked_capacity()) as usize;
        while self.parked.len() + self.filling.len() > want {
            let reps = &self.replicas;
            let latest = self
                .filling
                .iter()
                .enumerate()
                .max_by_key(|(_, &r)| (reps[r as usize].ready_at_ms, r))
                .map(|(i, _)| i);
            if let Some(i) = latest {
                let r = self.filling.swap_remove(i);
                self.unpark(r);
                continue;
            }
            let Some(r) = self.parked.pop_front() else {
                break;
            };
            self.unpark(r);
            self.release_to_cache();
        }
        while self.parked.len() + self.filling.len() < want {
            let load_ms = if self.cached > 0 {
                self.cached -= 1;
                self.tier_stats.cached_fills += 1;
                t.tiers.cached.restore_ms(t.model_gb) - t.tiers.cached.overhead_ms
            } else {
                self.tier_stats.remote_fills += 1;
                self.cfg.cold_start.sample(&mut self.rng)
            };
            let r = self.replicas.len() as u32;
            self.replicas.push(Replica {
                state: State::Filling,
                since_ms: self.now,
                ready_at_ms: self.now + load_ms,
                node: None,
                in_flight: Vec::new(),
                mem_from_ms: None,
                busy_until_ms: 0,
                restoring: false,
            });
            self.filling.push(r);
            self.push(self.now + load_ms, Event::Filled { replica: r });
        }
    }

    /// A load into host memory finished: the replica is parked.
    fn filled(&mut self, r: u32) {
        let rep = &mut self.replicas[r as usize];
        if rep.state != State::Filling || rep.ready_at_ms != self.now {
            return; // taken or cancelled
        }
        rep.state = State::Parked;
        self.filling.retain(|&x| x != r);
        self.parked.push_back(r);
    }

    /// Give an unplaced replica a GPU and schedule its readiness.
    fn place(&mut self, r: u32) {
        let (staging, cold, restoring) = self.restore_ms();
        let from = if self.pool.is_none() {
            self.now
        } else {
            match self.pool_place() {
                Some((node, ready_at)) => {
                    self.replicas[r as usize].node = Some(node);
                    ready_at
                }
                None => return, // stays unplaced; retried next tick
            }
        };
        let rep = &mut self.replicas[r as usize];
        rep.state = State::Starting;
        rep.restoring = restoring;
        rep.since_ms = from + staging;
        rep.mem_from_ms = (staging > 0).then_some(self.now);
        rep.ready_at_ms = from + staging + cold;
        let t = rep.ready_at_ms;
        self.push(t, Event::Ready { replica: r });
    }

    /// A GPU from the pool: `(node, ready at)`, scheduling the
    /// preemption of a node the pool had to ask for. `None` when the pool
    /// is full or there is no pool.
    fn pool_place(&mut self) -> Option<(usize, u64)> {
        let pool = self.pool.as_mut()?;
        let before = pool.nodes().len();
        let (node, ready_at) = pool.place(self.now, self.cfg.tier).ok()?;
        let preempt = if node >= before {
            pool.nodes()[node].grant.preempt_at_ms
        } else {
            None
        };
        if let Some(t) = preempt {
            self.push(t, Event::Preempt { node: node as u32 });
        }
        Some((node, ready_at))
    }

    /// Stop replica `r` now, paying for its time; with tiers it is parked
    /// or released to the disk cache.
    fn stop(&mut self, r: u32) {
        let rep = &mut self.replicas[r as usize];
        let was_running = rep.state != State::Unplaced;
        if rep.state == State::Draining {
            self.draining.retain(|&x| x != r);
        }
        let rep = &mut self.replicas[r as usize];
        if was_running {
            self.gpu_ms += self.now.saturating_sub(rep.since_ms);
            if let Some(m) = rep.mem_from_ms {
                self.tier_stats.parked_replica_ms += self.now.min(rep.since_ms).saturating_sub(m);
            }
        }
        rep.state = State::Gone;
        let node = rep.node;
        // One cancelled while starting goes back the same way: its weights
        // are in host memory or on disk already.
        if was_running {
            self.park_or_release(r);
        }
        if let Some(node) = node {
            if let Some(pool) = &mut self.pool {
                pool.free(self.now, node, self.cfg.tier);
            }
        }
    }

    fn preempt(&mut self, node: usize) {
        let Some(pool) = &mut self.pool else { return };
        if pool.nodes()[node].gone_ms.is_some() {
            return;
        }
        pool.preempted(self.now, node);
        self.preemptions += 1;
        for r in 0..self.replicas.len() {
            let rep = &mut self.replicas[r];
            if rep.node == Some(node)
                && !matches!(rep.state, State::Gone | State::Parked | State::Filling)
            {
                for i in rep.in_flight.drain(..) {
                    self.ttft[i as usize] = DROPPED;
                    self.e2e[i as usize] = DROPPED;
                    self.in_flight -= 1;
                }
                if rep.state != State::Unplaced {
                    self.gpu_ms += self.now - rep.since_ms;
                }
                rep.state = State::Gone;
                rep.node = None;
            }
        }
        let reps = &self.replicas;
        self.ready
            .retain(|&r| reps[r as usize].state != State::Gone);
        self.starting
            .retain(|&r| reps[r as usize].state != State::Gone);
    }

    fn observe(&mut self) -> Observation {
        let c = f64::from(self.cfg.service.max_concurrency);
        let ready = self.ready.len() as u32;
        let latency = if self.recent_ttft.is_empty() {
            None
        } else {
            let p = |q: f64, v: &mut Vec<u32>| {
                let k = ((v.len() - 1) as f64 * q).round() as usize;
                f64::from(*v.select_nth_unstable(k).1)
            };
            let mut v = std::mem::take(&mut self.recent_ttft);
            let l = Latency {
                p50_ms: p(0.50, &mut v),
                p95_ms: p(0.95, &mut v),
                p99_ms: p(0.99, &mut v),
            };
            v.clear();
            self.recent_ttft = v;
            Some(l)
        };
        Observation {
            ready,
            starting: self.starting.len() as u32,
            in_flight: self.in_flight,
            queued: self.queue.len() as u32,
            requests_total: self.arrived,
            gpu_utilization: if ready == 0 {
                0.0
            } else {
                (f64::from(self.in_flight) / (f64::from(ready) * c)).min(1.0)
            },
            latency,
            slo_ms: Some(self.cfg.slo_ms as f64),
            custom: None,
        }
    }

    fn tick(&mut self, policy: &mut dyn Policy) {
        self.expire_queue();
        // Replicas that could not get a node retry first.
        let unplaced: Vec<u32> = self
            .starting
            .iter()
            .copied()
            .filter(|&r| self.replicas[r as usize].state == State::Unplaced)
            .collect();
        for r in unplaced {
            self.place(r);
        }
        self.tell_timings(policy);
        let obs = self.observe();
        let want = policy.decide(self.now, &obs).replicas;
        if self.cfg.tiers.is_some() {
            self.want_parked = policy.parked();
        }
        if self.last_target != Some(want) {
            self.scaling_actions += 1;
            self.last_target = Some(want);
        }
        let current = (self.ready.len() + self.starting.len()) as u32;
        if want > current {
            let mut current = current;
            if self.cfg.tiers.is_some() {
                // A replica still draining is warm: take it back before
                // restoring another (the most loaded first: it would drain
                // longest).
                while current < want && !self.draining.is_empty() {
                    let reps = &self.replicas;
                    let (i, _) = self
                        .draining
                        .iter()
                        .enumerate()
                        .max_by_key(|(_, &r)| (reps[r as usize].in_flight.len(), r))
                        .unwrap_or((0, &0));
                    let r = self.draining.swap_remove(i);
                    self.replicas[r as usize].state = State::Ready;
                    self.ready.push(r);
                    self.fill(r);
                    current += 1;
                }
            }
            for _ in current..want {
                self.add_replica(false);
            }
        } else if want < current {
            self.remove(current - want);
        }
        // Host memory follows the plan once the GPUs have: a scale-up
        // restores from what is parked before the plan's new parked count
        // releases any, and what is missing then starts loading.
        self.trim_parked();

        if let Some(pool) = &mut self.pool {
            pool.reap(self.now);
        }
        self.record();
    }

    /// Tell the policy the durations measured by now, in time order.
    fn tell_timings(&mut self, policy: &mut dyn Policy) {
        let now = self.now;
        let mut known: Vec<(u64, Timing)> = Vec::new();
        self.timings.retain(|&(t, x)| {
            if t <= now {
                known.push((t, x));
                false
            } else {
                true
            }
        });
        known.sort_by_key(|&(t, _)| t);
        for (t, x) in known {
            policy.record(t, x);
        }
    }

    /// Remove `k` replicas: starting ones first (latest ready time first),
    /// then the least-loaded ready ones.
    fn remove(&mut self, mut k: u32) {
        while k > 0 {
            let reps = &self.replicas;
            let latest = self
                .starting
                .iter()
                .enumerate()
                .max_by_key(|(_, &r)| {
                    let rep = &reps[r as usize];
                    (rep.state == State::Unplaced, rep.ready_at_ms, r)
                })
                .map(|(i, _)| i);
            let Some(i) = latest else { break };
            let r = self.starting.swap_remove(i);
            self.stop(r);
            k -= 1;
        }
        while k > 0 {
            let reps = &self.replicas;
            let least = self
                .ready
                .iter()
                .enumerate()
                .min_by_key(|(_, &r)| (reps[r as usize].in_flight.len(), Reverse(r)))
                .map(|(i, _)| i);
            // With tiers, the replica free soonest (its requests' ends are
            // known from their token counts): it parks soonest, instead of
            // holding its GPU through a long drain.
            let soonest = if self.cfg.tiers.is_some() {
                self.ready
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, &r)| {
                        let rep = &reps[r as usize];
                        let until = if rep.in_flight.is_empty() {
                            0
                        } else {
                            rep.busy_until_ms
                        };
                        (until, Reverse(r))
                    })
                    .map(|(i, _)| i)
            } else {
                least
            };
            let Some(i) = soonest else { break };
            let r = self.ready.remove(i);
            if self.replicas[r as usize].in_flight.is_empty() {
                self.stop(r);
            } else {
                self.replicas[r as usize].state = State::Draining;
                self.draining.push(r);
            }
            k -= 1;
        }
    }

    fn record(&mut self) {
        let (from, arrived_then) = self.sample_from;
        if self.now < from + self.cfg.sample_ms {
            return;
        }
        let dt = (self.now - from).max(1) as f64 / 1000.0;
        self.series.push(Sample {
            t_ms: from.saturating_sub(self.origin),
            arrivals_per_s: (self.arrived - arrived_then) as f64 / dt,
            replicas: (self.ready.len() + self.starting.len()) as u32,
            ready: self.ready.len() as u32,
        });
        self.sample_from = (self.now, self.arrived);
    }

    fn finish(mut self, name: &str) -> SimResult {
        let end = self.now;
        self.want_parked = 0;
        for r in 0..self.replicas.len() as u32 {
            match self.replicas[r as usize].state {
                State::Gone => {}
                State::Parked | State::Filling => self.unpark(r),
                _ => self.stop(r),
            }
        }
        let tiers = self.cfg.tiers.as_ref().map(|t| TierStats {
            parked_gb_seconds: self.tier_stats.parked_replica_ms as f64 / 1000.0 * t.model_gb,
            ..self.tier_stats
        });
        let before = self.pool_gpu_before.unwrap_or((0, 0));
        let node_gpu_ms = self.pool.as_mut().map(|p| {
            p.close(end);
            let (od, spot) = p.gpu_ms(end);
            (od.saturating_sub(before.0), spot.saturating_sub(before.1))
        });
        let first = self.first;
        let timeout = sat32(self.cfg.timeout_ms);
        let slo = self.cfg.slo_ms;
        let dropped = self.ttft[first..].iter().filter(|&&t| t == DROPPED).count() as u64;
        let slo_met = self.ttft[first..]
            .iter()
            .filter(|&&t| t != DROPPED && u64::from(t) <= slo)
            .count() as u64;
        let pct = |mut v: Vec<u32>| {
            for x in &mut v {
                if *x == DROPPED {
                    *x = timeout;
                }
            }
            v.sort_unstable();
            let at = |q: f64| {
                let k = ((v.len().saturating_sub(1)) as f64 * q).round() as usize;
                v.get(k).map_or(0, |&x| u64::from(x))
            };
            Percentiles {
                p50: at(0.50),
                p95: at(0.95),
                p99: at(0.99),
            }
        };
        let ttft = pct(self.ttft.split_off(first));
        let e2e = pct(self.e2e.split_off(first));
        SimResult {
            policy: name.to_string(),
            requests: (self.requests.len() - first) as u64,
            slo_met,
            dropped,
            ttft,
            e2e,
            gpu_ms: self.gpu_ms,
            node_gpu_ms,
            cold_starts: self.cold_starts,
            tiers,
            scaling_actions: self.scaling_actions,
            preemptions: self.preemptions,
            end_ms: end - self.origin,
            series: self.series,
        }
    }
}

fn sat32(x: u64) -> u32 {
    u32::try_from(x).unwrap_or(DROPPED - 1).min(DROPPED - 1)
}
