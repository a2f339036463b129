//! Node pools: the GPUs replicas run on, grown and shrunk through a
//! [`CapacityProvider`].
//!
//! A provider is whatever hands out machines; the trait and the simulated
//! cloud live in `flotilla-backends` (the server runs node pools on the same
//! ones), and the simulator drives the [`SimulatedCloud`] from its virtual
//! clock. The pool asks it for a node when no node has a free GPU, places
//! replicas onto nodes through the real placement engine
//! (`flotilla-sched`, best-fit scorer: the fullest node that still has
//! room, so whole nodes free up to be removed; the pool's nodes are a
//! `sched` cluster snapshot kept in step with grants, releases and
//! preemptions), removes a node once it has been idle for a grace period,
//! and never removes a node that runs tier-1 work. Tier-1 replicas run on
//! on-demand nodes only; other tiers try spot first and fall back to
//! on-demand. Everything here is pure: the provider's randomness comes from
//! a seeded generator and its clock is the `now_ms` it is given (its
//! futures are ready at once, so `block_on` never waits).

use futures::executor::block_on;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

pub use flotilla_backends::capacity::{
    CapacityError, CapacityProvider, Machine, ProvisionRequest, RegionLimit, SimulatedCloud,
};
use flotilla_backends::capacity::{ProvisionDelay, SimulatedCloudConfig};
use flotilla_sched::score::BestFit;
use flotilla_sched::{
    Cluster, Decision, Engine, GpuDemand, ModelId, ModelSet, ModelTable, NodeSpec, Placement,
    Request as SchedRequest,
};

use crate::coldstart::ColdStartModel;

/// Why the pool could not place a replica.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The provider had no machine to give.
    #[error(transparent)]
    Capacity(#[from] CapacityError),
    /// The placement engine refused a step the pool's bookkeeping expected
    /// to succeed (a bug, reported rather than a panic).
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
    /// The same nodes as the placement engine sees them (cluster index =
    /// pool index; gone nodes are cordoned). On-demand and spot nodes are
    /// two models of the snapshot so that tier-1 replicas can ask for
    /// on-demand ones only.
    cluster: Cluster,
    engine: Engine,
    on_demand: ModelId,
    spot: ModelId,
    /// Devices in use per node (every replica takes one whole GPU).
    devices: Vec<Vec<u16>>,
    /// Tie-breaking of the placement engine.
    rng: ChaCha8Rng,
}

fn placement_error(e: flotilla_sched::Error) -> PoolError {
    PoolError::Placement(e.to_string())
}

/// One replica's demand: one whole GPU.
fn replica() -> SchedRequest {
    SchedRequest::new(GpuDemand::whole(1), 0, 0)
}

impl<P: CapacityProvider> NodePool<P> {
    /// An empty pool of `gpu` nodes.
    pub fn new(provider: P, gpu: impl Into<String>, idle_grace_ms: u64) -> Self {
        let gpu = gpu.into();
        let mut models = ModelTable::default();
        // Two names cannot fail to intern in an empty table.
        let on_demand = models.intern(&gpu).unwrap_or_default();
        let spot = models.intern(&format!("{gpu} (spot)")).unwrap_or(1);
        Self {
            provider,
            gpu,
            idle_grace_ms,
            nodes: Vec::new(),
            cluster: Cluster::new(models),
            engine: Engine::new(Box::new(BestFit)),
            on_demand,
            spot,
            devices: Vec::new(),
            rng: ChaCha8Rng::seed_from_u64(0x5eed_b1a5),
        }
    }

    /// Ask the placement engine for a GPU for one replica of `tier`.
    fn decide(&mut self, tier1: bool) -> Option<Placement> {
        let mut req = replica();
        if tier1 {
            req = req.with_models(ModelSet::of([self.on_demand]));
        }
        match self.engine.decide(&self.cluster, &req, &mut self.rng) {
            Decision::Placed(p) => Some(p),
            Decision::Unschedulable(_) => None,
        }
    }

    /// Node `i` is gone: the engine must not place on it any more.
    fn cordon(&mut self, i: usize) {
        if let Ok(idx) = u32::try_from(i) {
            // Every pool node is in the cluster; nothing to report otherwise.
            let _ = self.cluster.set_cordoned(idx, true);
        }
        if let Some(d) = self.devices.get_mut(i) {
            d.clear();
        }
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

    /// Place one replica of `tier`: best fit on a live node with a free
    /// GPU (on-demand only for tier 1), else a new node from the provider.
    /// Returns the pool index of the node and when it is (or was) ready.
    pub fn place(&mut self, now_ms: u64, tier: u8) -> Result<(usize, u64), PoolError> {
        let tier1 = tier <= 1;
        let placement = match self.decide(tier1) {
            Some(p) => p,
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
                let spec = NodeSpec {
                    model: Some(if grant.spot {
                        self.spot
                    } else {
                        self.on_demand
                    }),
                    gpus: u16::try_from(grant.gpus).unwrap_or(u16::MAX),
                    cpu_milli: 0,
                    mem_mib: 0,
                };
                self.cluster.add_node(spec).map_err(placement_error)?;
                self.nodes.push(Node {
                    grant,
                    requested_ms: now_ms,
                    used: 0,
                    tier1: 0,
                    idle_since_ms: None,
                    gone_ms: None,
                });
                self.devices.push(Vec::new());
                self.decide(tier1)
                    .ok_or_else(|| CapacityError::NoCapacity {
                        instance_type: self.gpu.clone(),
                        message: "a new node did not fit one GPU".to_string(),
                    })?
            }
        };
        self.cluster
            .commit(&replica(), &placement)
            .map_err(placement_error)?;
        let i = placement.node as usize;
        if let (Some(d), Some(&gpu)) = (self.devices.get_mut(i), placement.gpus.first()) {
            d.push(gpu);
        }
        let n = &mut self.nodes[i];
        n.used += 1;
        n.tier1 += u32::from(tier1);
        n.idle_since_ms = None;
        Ok((i, n.grant.ready_at_ms.unwrap_or(now_ms).max(now_ms)))
    }

    /// A replica of `tier` left node `i`.
    pub fn free(&mut self, now_ms: u64, i: usize, tier: u8) {
        // Replicas are interchangeable whole GPUs: free any device in use.
        if let Some(gpu) = self.devices.get_mut(i).and_then(Vec::pop) {
            let p = Placement {
                node: u32::try_from(i).unwrap_or(u32::MAX),
                gpus: vec![gpu],
            };
            // The device was committed by `place`; the release cannot fail.
            let _ = self.cluster.release(&replica(), &p);
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
            self.cordon(i);
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
                self.cordon(i);
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
            self.cordon(i);
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

    /// Whole GPUs free on node `i` as the placement engine sees them.
    fn engine_free(pool: &NodePool<SimulatedCloud>, i: usize) -> usize {
        let state = pool.cluster.state_of(i as u32).unwrap();
        state.gpus_with_at_least(1_000)
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
        assert!(pool.cluster.state_of(a as u32).unwrap().cordoned);
        let (c, _) = pool.place(3_000, 2).unwrap();
        assert_ne!(c, a);
        assert_eq!(engine_free(&pool, c), 1);
        // Frees on the gone node do not touch the snapshot.
        pool.free(4_000, a, 2);
        assert_eq!(pool.place(4_000, 2).unwrap().0, c);
    }
}
