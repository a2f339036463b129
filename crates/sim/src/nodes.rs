//! Node pools: the GPUs replicas run on, grown and shrunk through a
//! [`CapacityProvider`].
//!
//! A provider is whatever hands out machines; the trait and the simulated
//! cloud live in `flotilla-backends` (the server runs node pools on the same
//! ones), and the simulator drives the [`SimulatedCloud`] from its virtual
//! clock. The pool asks it for a node when no node has a free GPU, removes
//! a node once it has been idle for a grace period, and never removes a
//! node that runs tier-1 work. Tier-1 replicas run on on-demand nodes only;
//! other tiers try spot first and fall back to on-demand.
//!
//! **Where a replica goes is decided by the server's scheduling pass**,
//! [`flotilla_sched::pass::plan`], on a [`Snapshot`] of the pool
//! ([`NodePool::snapshot`]): the pool's nodes as machines (spot and
//! on-demand GPUs as two catalog models, so a tier-1 replica can ask for
//! on-demand ones only), the replicas on them as running work, and the new
//! replica as the one queued work. The simulator has no placement code of
//! its own, so what it reports about placement is about the code the server
//! runs ([`decide`] is the one call, and the server's tests hand it the
//! snapshot the server gathers to show it plans the same).
//!
//! Everything here is pure: the provider's randomness comes from a seeded
//! generator and its clock is the `now_ms` it is given (its futures are
//! ready at once, so `block_on` never waits).

use futures::executor::block_on;

pub use flotilla_backends::capacity::{
    CapacityError, CapacityProvider, Machine, ProvisionRequest, RegionLimit, SimulatedCloud,
};
use flotilla_backends::capacity::{ProvisionDelay, SimulatedCloudConfig};
use flotilla_sched::gang::Locality;
use flotilla_sched::pass::{
    self, GpuAsk, GpuSnap, Hold, NodeSnap, Plan, QueuedWork, RunningWork, Snapshot, WorkKey,
};
use flotilla_sched::{Policy, Runtime, Tier};

use crate::coldstart::ColdStartModel;

/// Why the pool could not place a replica.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The provider had no machine to give.
    #[error(transparent)]
    Capacity(#[from] CapacityError),
    /// The scheduling pass could not model the pool's snapshot (a bug,
    /// reported rather than a panic).
    #[error("placement: {0}")]
    Placement(String),
}

/// Settings of the simulator's cloud (the [`SimulatedCloud`] with the
/// simulator's cold-start model as its provisioning delay).
#[derive(Debug, Clone, PartialEq)]
pub struct ProviderConfig {
    /// Capacity per region and GPU type, tried in this order.
    pub limits: Vec<RegionLimit>,
    /// GPUs per node.
    pub gpus_per_node: u32,
    /// Time from request to a ready node.
    pub provision_delay: ColdStartModel,
    /// Probability that a spot request finds capacity.
    pub spot_availability: f64,
    /// Mean lifetime of a spot node before preemption (exponential).
    pub spot_mean_lifetime_ms: u64,
}

impl ProviderConfig {
    /// A cloud-like default for `gpu`: two regions of 16 nodes of 8 GPUs,
    /// provisioning median 90 s (log-normal), 80 % spot availability, spot
    /// nodes living 2 h on average.
    pub fn cloud(gpu: &str) -> Self {
        let limits = ["region-a", "region-b"]
            .iter()
            .map(|r| RegionLimit {
                region: (*r).to_string(),
                gpu: gpu.to_string(),
                max_nodes: 16,
            })
            .collect();
        Self {
            limits,
            gpus_per_node: 8,
            provision_delay: ColdStartModel::lognormal(90_000),
            spot_availability: 0.8,
            spot_mean_lifetime_ms: 2 * 3_600_000,
        }
    }

    /// The simulated cloud these settings describe, seeded with `seed`.
    /// The simulator acts on preemptions when they happen, so the cloud
    /// gives no advance notice.
    pub fn cloud_with_seed(&self, seed: u64) -> SimulatedCloud {
        SimulatedCloud::new(
            SimulatedCloudConfig {
                limits: self.limits.clone(),
                gpus_per_node: self.gpus_per_node,
                provision_delay: ProvisionDelay::from_samples(
                    self.provision_delay.samples().to_vec(),
                ),
                spot_availability: self.spot_availability,
                spot_mean_lifetime_ms: self.spot_mean_lifetime_ms,
                spot_notice_ms: 0,
            },
            seed,
        )
    }
}

/// One node of the pool.
#[derive(Debug, Clone)]
pub struct Node {
    /// The provider's machine.
    pub grant: Machine,
    /// When the pool asked for it (GPU time is billed from here).
    pub requested_ms: u64,
    /// GPUs in use by replicas.
    pub used: u32,
    /// Tier-1 replicas on it.
    pub tier1: u32,
    /// Since when it has had no replica.
    pub idle_since_ms: Option<u64>,
    /// Released or preempted at.
    pub gone_ms: Option<u64>,
}

/// The pool: nodes for one GPU type, a provider behind them.
#[derive(Debug)]
pub struct NodePool<P> {
    provider: P,
    gpu: String,
    /// Idle time after which an empty node is released.
    pub idle_grace_ms: u64,
    nodes: Vec<Node>,
    /// The replicas on each node, by pool index: `(GPU index, tier)` each
    /// (every replica takes one whole GPU). What the snapshot's running
    /// work and free GPUs are made of.
    held: Vec<Vec<(u16, u8)>>,
    /// The placement policy the pass scores with.
    policy: Policy,
    /// Passes planned so far: each pass's tie-breaking seed.
    passes: u64,
}

/// The one placement call of the simulator: the server's planner, on a
/// snapshot. Kept as a named function so that a test can hand it the
/// snapshot the server gathers and compare plans.
pub fn decide(snap: &Snapshot) -> Result<Plan, flotilla_sched::Error> {
    pass::plan(snap)
}

/// The key of the replica being placed in a pool's snapshot; running
/// replicas are keyed from 1 up.
const NEW_REPLICA: WorkKey = 0;

/// The simulator's one tenant.
const TENANT: flotilla_sched::Tenant = 1;

impl<P: CapacityProvider> NodePool<P> {
    /// An empty pool of `gpu` nodes, placing with the best-fit policy (the
    /// fullest node that still has room, so whole nodes free up to be
    /// removed).
    pub fn new(provider: P, gpu: impl Into<String>, idle_grace_ms: u64) -> Self {
        Self {
            provider,
            gpu: gpu.into(),
            idle_grace_ms,
            nodes: Vec::new(),
            held: Vec::new(),
            policy: Policy::BestFit,
            passes: 0,
        }
    }

    /// Place with `policy` instead of best fit.
    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    /// The catalog model of node `n`'s GPUs as the snapshot names them:
    /// spot GPUs are a model of their own.
    fn model_of(&self, n: &Node) -> String {
        if n.grant.spot {
            format!("{} (spot)", self.gpu)
        } else {
            self.gpu.clone()
        }
    }

    /// The pool as the scheduling pass sees it at `now_ms`, with one
    /// replica of `tier` queued (key [`NEW_REPLICA`]): live nodes are
    /// ready machines (a node still provisioning takes replicas, which
    /// start when it is ready), gone ones are cordoned, and every replica
    /// is running work that is never preempted (the simulator's replicas
    /// leave by scale-down or with their spot node only).
    pub fn snapshot(&self, now_ms: u64, tier: u8) -> Snapshot {
        let mut nodes = Vec::with_capacity(self.nodes.len());
        let mut running = Vec::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let model = self.model_of(n);
            let held = self.held.get(i).map(Vec::as_slice).unwrap_or_default();
            let gpus = (0..n.grant.gpus)
                .map(|g| GpuSnap {
                    model: model.clone(),
                    mig: false,
                    free_milli: if held.iter().any(|&(h, _)| u32::from(h) == g) {
                        0
                    } else {
                        1000
                    },
                })
                .collect();
            nodes.push(NodeSnap {
                ready: n.gone_ms.is_none(),
                cordoned: n.gone_ms.is_some(),
                region: n.grant.region.clone(),
                pool: self.gpu.clone(),
                runtime: Runtime::Process,
                cpu_total_milli: 0,
                mem_total_mib: 0,
                cpu_free_milli: 0,
                mem_free_mib: 0,
                gpus,
            });
            if n.gone_ms.is_some() {
                continue;
            }
            for &(gpu, t) in held {
                running.push(RunningWork {
                    key: running.len() as WorkKey + 1,
                    tenant: TENANT,
                    tier: Tier::from_number_or_dedicated(t),
                    priority: 0,
                    preemptible: false,
                    started_ms: n.requested_ms,
                    ends_by_ms: None,
                    stopping: false,
                    preempted_by: None,
                    members: vec![Hold {
                        node: i,
                        gpus: vec![(gpu, 1000)],
                        cpu_milli: 0,
                        mem_mib: 0,
                    }],
                });
            }
        }
        let models = if tier <= 1 {
            vec![self.gpu.clone()]
        } else {
            Vec::new()
        };
        let queue = vec![QueuedWork {
            key: NEW_REPLICA,
            tenant: TENANT,
            tier: Tier::from_number_or_dedicated(tier),
            priority: 0,
            submitted_ms: now_ms,
            members: 1,
            spread: false,
            locality: Locality::Any,
            gpu: GpuAsk::Whole(1),
            models,
            cpu_milli: 0,
            mem_mib: 0,
            runtime: Runtime::Process,
            max_runtime_ms: None,
            ready_ms: Vec::new(),
        }];
        Snapshot::unlimited(
            now_ms,
            0x5eed_b1a5 ^ self.passes,
            self.policy,
            nodes,
            running,
            queue,
        )
    }

    /// Plan one replica of `tier` with the scheduling pass: the node and
    /// GPU it goes to, or `None` when no live node has room for it.
    fn decide(&mut self, now_ms: u64, tier: u8) -> Result<Option<(usize, u16)>, PoolError> {
        let snap = self.snapshot(now_ms, tier);
        self.passes += 1;
        let plan = decide(&snap).map_err(|e| PoolError::Placement(e.to_string()))?;
        Ok(plan
            .placements
            .iter()
            .find(|p| p.key == NEW_REPLICA)
            .and_then(|p| p.members.first())
            .and_then(|m| Some((m.node, m.gpus.first()?.0))))
    }

    /// Give machine `id` back. The simulated cloud cannot fail a
    /// termination; another provider's failure leaves the machine to it.
    fn release(provider: &P, now_ms: u64, id: &str) {
        let _ = block_on(provider.terminate(now_ms, id));
    }

    /// All nodes ever granted, by pool index.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// What to ask the provider for.
    fn request(&self, spot: bool) -> ProvisionRequest {
        ProvisionRequest {
            name: format!("{}-{}", self.gpu, self.nodes.len()),
            instance_type: self.gpu.clone(),
            region: None,
            spot,
            join: None,
        }
    }

    /// Place one replica of `tier`: where the scheduling pass puts it on
    /// a live node (on-demand only for tier 1), else on a new node from the
    /// provider. Returns the pool index of the node and when it is (or
    /// was) ready.
    pub fn place(&mut self, now_ms: u64, tier: u8) -> Result<(usize, u64), PoolError> {
        let tier1 = tier <= 1;
        let (i, gpu) = match self.decide(now_ms, tier)? {
            Some(at) => at,
            None => {
                let mut grant = Err(CapacityError::NoCapacity {
                    instance_type: self.gpu.clone(),
                    message: "no spot asked".to_string(),
                });
                if !tier1 {
                    let want = self.request(true);
                    grant = block_on(self.provider.provision(now_ms, &want));
                }
                if grant.is_err() {
                    let want = self.request(false);
                    grant = block_on(self.provider.provision(now_ms, &want));
                }
                let grant = grant?;
                self.nodes.push(Node {
                    grant,
                    requested_ms: now_ms,
                    used: 0,
                    tier1: 0,
                    idle_since_ms: None,
                    gone_ms: None,
                });
                self.held.push(Vec::new());
                self.decide(now_ms, tier)?
                    .ok_or_else(|| CapacityError::NoCapacity {
                        instance_type: self.gpu.clone(),
                        message: "a new node did not fit one GPU".to_string(),
                    })?
            }
        };
        if let Some(h) = self.held.get_mut(i) {
            h.push((gpu, tier));
        }
        let n = &mut self.nodes[i];
        n.used += 1;
        n.tier1 += u32::from(tier1);
        n.idle_since_ms = None;
        Ok((i, n.grant.ready_at_ms.unwrap_or(now_ms).max(now_ms)))
    }

    /// A replica of `tier` left node `i`.
    pub fn free(&mut self, now_ms: u64, i: usize, tier: u8) {
        if let Some(h) = self.held.get_mut(i) {
            // Replicas of one tier are interchangeable whole GPUs: free
            // the last one placed.
            if let Some(at) = h.iter().rposition(|&(_, t)| t == tier) {
                h.remove(at);
            } else {
                h.pop();
            }
        }
        if let Some(n) = self.nodes.get_mut(i) {
            n.used = n.used.saturating_sub(1);
            if tier <= 1 {
                n.tier1 = n.tier1.saturating_sub(1);
            }
            if n.used == 0 && n.gone_ms.is_none() {
                n.idle_since_ms = Some(now_ms);
            }
        }
    }

    /// Release nodes idle for the grace period; never one with tier-1
    /// work. Returns how many were released.
    pub fn reap(&mut self, now_ms: u64) -> usize {
        let mut gone = Vec::new();
        for (i, n) in self.nodes.iter_mut().enumerate() {
            let idle_long = n
                .idle_since_ms
                .is_some_and(|t| now_ms.saturating_sub(t) >= self.idle_grace_ms);
            if n.gone_ms.is_none() && n.used == 0 && n.tier1 == 0 && idle_long {
                Self::release(&self.provider, now_ms, &n.grant.id);
                n.gone_ms = Some(now_ms);
                gone.push(i);
            }
        }
        for &i in &gone {
            self.held[i].clear();
        }
        gone.len()
    }

    /// The provider took node `i` back (spot preemption).
    pub fn preempted(&mut self, now_ms: u64, i: usize) {
        if let Some(n) = self.nodes.get_mut(i) {
            if n.gone_ms.is_none() {
                Self::release(&self.provider, now_ms, &n.grant.id);
                n.gone_ms = Some(now_ms);
                n.used = 0;
                n.tier1 = 0;
                self.held[i].clear();
            }
        }
    }

    /// Close every node at `end_ms`.
    pub fn close(&mut self, end_ms: u64) {
        let mut gone = Vec::new();
        for (i, n) in self.nodes.iter_mut().enumerate() {
            if n.gone_ms.is_none() {
                Self::release(&self.provider, end_ms, &n.grant.id);
                n.gone_ms = Some(end_ms);
                gone.push(i);
            }
        }
        for i in gone {
            self.held[i].clear();
        }
    }

    /// GPU-milliseconds held so far, `(on-demand, spot)`, nodes counted
    /// from request to release (closed nodes) or `now_ms`.
    pub fn gpu_ms(&self, now_ms: u64) -> (u64, u64) {
        let (mut od, mut spot) = (0, 0);
        for n in &self.nodes {
            let end = n.gone_ms.unwrap_or(now_ms);
            let ms = end.saturating_sub(n.requested_ms) * u64::from(n.grant.gpus);
            if n.grant.spot {
                spot += ms;
            } else {
                od += ms;
            }
        }
        (od, spot)
    }

    /// Live nodes.
    pub fn live(&self) -> usize {
        self.nodes.iter().filter(|n| n.gone_ms.is_none()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(max_nodes: u32, spot: f64) -> ProviderConfig {
        ProviderConfig {
            limits: vec![
                RegionLimit {
                    region: "a".into(),
                    gpu: "H100".into(),
                    max_nodes,
                },
                RegionLimit {
                    region: "b".into(),
                    gpu: "H100".into(),
                    max_nodes,
                },
            ],
            gpus_per_node: 2,
            provision_delay: ColdStartModel::fixed(1_000),
            spot_availability: spot,
            spot_mean_lifetime_ms: 60_000,
        }
    }

    #[test]
    fn pool_bin_packs_and_reaps_idle_nodes_after_grace() {
        let mut pool = NodePool::new(cfg(10, 1.0).cloud_with_seed(1), "H100", 30_000);
        let (n0, ready) = pool.place(0, 2).unwrap();
        assert_eq!(ready, 1_000);
        let (n1, _) = pool.place(0, 2).unwrap();
        assert_eq!(n0, n1, "second replica fills the same node");
        let (n2, _) = pool.place(0, 2).unwrap();
        assert_ne!(n2, n0);
        pool.free(10_000, n2, 2);
        assert_eq!(pool.reap(39_999), 0);
        assert_eq!(pool.reap(40_000), 1);
        assert_eq!(pool.live(), 1);
        // Spot first for tier 2.
        assert!(pool.nodes()[0].grant.spot);
    }

    #[test]
    fn tier1_runs_on_demand_and_its_node_is_never_reaped() {
        let mut pool = NodePool::new(cfg(10, 1.0).cloud_with_seed(1), "H100", 0);
        let (spot_node, _) = pool.place(0, 3).unwrap();
        let (n, _) = pool.place(0, 1).unwrap();
        assert_ne!(n, spot_node, "tier 1 does not share the spot node");
        assert!(!pool.nodes()[n].grant.spot);
        pool.free(0, spot_node, 3);
        assert_eq!(pool.reap(1_000_000), 1);
        // The tier-1 node is busy: never reaped, however long.
        assert_eq!(pool.reap(u64::MAX), 0);
        assert_eq!(pool.live(), 1);
        pool.free(2_000_000, n, 1);
        assert_eq!(pool.reap(2_000_000), 1);
    }

    #[test]
    fn full_provider_refuses_placement() {
        let mut pool = NodePool::new(cfg(1, 0.0).cloud_with_seed(1), "H100", 0);
        for _ in 0..4 {
            pool.place(0, 2).unwrap(); // spot unavailable: on-demand fallback
        }
        assert!(pool.nodes().iter().all(|n| !n.grant.spot));
        assert!(matches!(
            pool.place(0, 2),
            Err(PoolError::Capacity(CapacityError::NoCapacity { .. }))
        ));
        let (od, spot) = pool.gpu_ms(10);
        assert_eq!((od, spot), (2 * 2 * 10, 0));
    }

    /// Whole GPUs free on node `i` as the scheduling pass sees them.
    fn engine_free(pool: &NodePool<SimulatedCloud>, i: usize) -> usize {
        let snap = pool.snapshot(0, 2);
        snap.nodes[i]
            .gpus
            .iter()
            .filter(|g| g.free_milli == 1000)
            .count()
    }

    #[test]
    fn the_engine_snapshot_follows_the_pool() {
        let mut pool = NodePool::new(cfg(10, 1.0).cloud_with_seed(1), "H100", 0);
        let (a, _) = pool.place(0, 2).unwrap();
        let (b, _) = pool.place(0, 2).unwrap();
        assert_eq!(a, b);
        assert_eq!(engine_free(&pool, a), 0);
        // A freed GPU is placed on again before a new node is asked for.
        pool.free(1_000, a, 2);
        assert_eq!(engine_free(&pool, a), 1);
        assert_eq!(pool.place(2_000, 2).unwrap().0, a);
        assert_eq!(pool.nodes().len(), 1);
        // A preempted node is cordoned: the next replica gets a new node.
        pool.preempted(3_000, a);
        assert!(pool.snapshot(3_000, 2).nodes[a].cordoned);
        let (c, _) = pool.place(3_000, 2).unwrap();
        assert_ne!(c, a);
        assert_eq!(engine_free(&pool, c), 1);
        // Frees on the gone node do not touch the snapshot.
        pool.free(4_000, a, 2);
        assert_eq!(pool.place(4_000, 2).unwrap().0, c);
    }

    #[test]
    fn a_pools_placement_is_the_plan_of_its_snapshot() {
        let mut pool = NodePool::new(cfg(10, 0.5).cloud_with_seed(7), "H100", 0);
        for step in 0..40u64 {
            let tier = if step % 3 == 0 { 1 } else { 2 };
            if step % 5 == 4 {
                // Free one replica somewhere, so holes open up.
                if let Some(i) = pool.nodes().iter().position(|n| n.used > 0) {
                    pool.free(step, i, pool.held[i].last().map_or(2, |h| h.1));
                }
                continue;
            }
            let snap = pool.snapshot(step, tier);
            let plan = decide(&snap).unwrap();
            let planned = plan.placements.first().map(|p| p.members[0].node);
            let (node, _) = pool.place(step, tier).unwrap();
            if let Some(planned) = planned {
                assert_eq!(
                    node, planned,
                    "step {step}: the pool went where the plan said"
                );
            } else {
                assert_eq!(node + 1, pool.nodes().len(), "no room: a new node");
            }
            if tier == 1 {
                assert!(!pool.nodes()[node].grant.spot, "tier 1 on on-demand only");
            }
        }
    }
}
