//! Startup-aware placement: a replica goes where it is ready soonest, and
//! among nodes equally soon, where it fragments least.
//!
//! A node's time to ready for a replica of a model is the start-up of the
//! fastest source that holds the model's weights there — host memory
//! (parked), local disk (cached) or nothing (remote: pulled and
//! downloaded) — plus the weights at that source's bandwidth, behind the
//! bytes already being loaded through the same path on that node (loads
//! through one PCIe link, one disk or one network interface share it, so a
//! node already restoring two replicas is slower for a third)
//! ([`NodeStartup::time_to_ready_ms`]). The caller — the server from the
//! caches its agents report, the simulator from its own model — turns what
//! each node holds into a [`NodeStartup`]; this module only does the
//! arithmetic and the choice, so it stays pure and knows no tiers.
//!
//! [`Engine::decide_startup`] combines the two criteria lexicographically:
//! time to ready, rounded to a quantum (1 s by default: differences below
//! it are noise next to an SLO of seconds), first, then the engine's
//! scorer (fragmentation for Flotilla's), then the scorer's tie-break,
//! then the lowest node index. Unlike [`Engine::decide`], it looks at every
//! feasible node rather than one per equivalence class: what a node caches
//! is not part of its class, and start-up matters for the few placements a
//! scale-up makes, not the millions a trace replay does.

use rand::Rng;

use crate::filter::check;
use crate::request::Request;
use crate::select::{Decision, Engine};
use crate::snapshot::Cluster;

/// Rounding of times to ready before they are compared, ms.
pub const DEFAULT_QUANTUM_MS: u64 = 1_000;

/// How a node would load a model's weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NodeStartup {
    /// Start-up that does not depend on the size (engine or container
    /// start, image pull for a remote start), ms.
    pub overhead_ms: u64,
    /// Bandwidth of the path the weights take to the GPU, GB/s.
    pub bandwidth_gb_per_s: f64,
    /// Size of the weights, GB.
    pub model_gb: f64,
    /// GB already being loaded through the same path on this node.
    pub loading_gb: f64,
}

impl NodeStartup {
    /// Time until a replica started now would be ready, ms: the overhead
    /// plus the bytes ahead of it and its own at the path's bandwidth. A
    /// bandwidth that is not a positive number reads as unusable
    /// (`u64::MAX`), never as instant.
    pub fn time_to_ready_ms(&self) -> u64 {
        if !(self.bandwidth_gb_per_s.is_finite() && self.bandwidth_gb_per_s > 0.0) {
            return u64::MAX;
        }
        let gb = self.model_gb.max(0.0) + self.loading_gb.max(0.0);
        let ms = if gb.is_finite() {
            (gb / self.bandwidth_gb_per_s * 1_000.0).ceil()
        } else {
            f64::MAX
        };
        self.overhead_ms
            .saturating_add(ms.min(u64::MAX as f64) as u64)
    }
}

impl Engine {
    /// Decide where `req` goes, preferring the node whose
    /// `time_to_ready(node)` (ms) is least, rounded to `quantum_ms`, then
    /// the scorer's verdict (module documentation). Does not change the
    /// cluster.
    pub fn decide_startup<R: Rng + ?Sized>(
        &mut self,
        cluster: &Cluster,
        req: &Request,
        time_to_ready: &dyn Fn(u32) -> u64,
        quantum_ms: u64,
        rng: &mut R,
    ) -> Decision {
        let q = quantum_ms.max(1);
        // (rounded time, score, tie, node)
        let mut best: Option<(u64, f64, f64, u32)> = None;
        for (_, class) in cluster.active_classes() {
            if check(&class.state, req).is_err() {
                continue;
            }
            let s = self.score_state(&class.state, req);
            for &node in &class.members {
                let t = time_to_ready(node).div_ceil(q);
                let better = match best {
                    None => true,
                    Some((bt, bs, btie, bn)) => (t, -s.score, -s.tie, node) < (bt, -bs, -btie, bn),
                };
                if better {
                    best = Some((t, s.score, s.tie, node));
                }
            }
        }
        match best {
            // Place on that node with the engine's own GPU choice: restrict
            // the cluster view to it by deciding over its class alone.
            Some((_, _, _, node)) => self.place_on(cluster, req, node, rng),
            None => self.decide(cluster, req, rng),
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::request::GpuDemand;
    use crate::score::Policy;
    use crate::snapshot::{ModelTable, NodeSpec};
    use crate::TargetWorkload;

    fn two_nodes() -> Cluster {
        let mut models = ModelTable::default();
        let h100 = models.intern("H100").unwrap();
        let spec = NodeSpec {
            model: Some(h100),
            gpus: 8,
            cpu_milli: 128_000,
            mem_mib: 1 << 20,
        };
        let mut c = Cluster::new(models);
        c.add_node(spec.clone()).unwrap();
        c.add_node(spec).unwrap();
        c
    }

    fn startup(overhead_ms: u64, bw: f64, loading_gb: f64) -> NodeStartup {
        NodeStartup {
            overhead_ms,
            bandwidth_gb_per_s: bw,
            model_gb: 16.0,
            loading_gb,
        }
    }

    #[test]
    fn time_to_ready_adds_what_is_already_loading() {
        assert_eq!(startup(10_000, 6.5, 0.0).time_to_ready_ms(), 10_000 + 2_462);
        assert_eq!(startup(500, 50.0, 32.0).time_to_ready_ms(), 500 + 960);
        assert_eq!(startup(0, 0.0, 0.0).time_to_ready_ms(), u64::MAX);
        assert_eq!(startup(0, f64::NAN, 0.0).time_to_ready_ms(), u64::MAX);
    }

    #[test]
    fn the_node_with_cached_weights_gets_the_replica() {
        let cluster = two_nodes();
        let mut engine = Engine::new(Policy::Flotilla.scorer(&TargetWorkload::default()));
        let one = Request::new(GpuDemand::Whole { count: 1 }, 4_000, 1_024);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        // Equal nodes, nothing cached: the scorer's choice (lowest index).
        let Decision::Placed(p) = engine.decide(&cluster, &one, &mut rng) else {
            panic!("unplaced")
        };
        assert_eq!(p.node, 0);
        // Node 1 holds the weights on disk; node 0 would pull them.
        let remote = startup(30_000, 0.5, 0.0).time_to_ready_ms();
        let cached = startup(10_000, 6.5, 0.0).time_to_ready_ms();
        let ready = |n: u32| if n == 1 { cached } else { remote };
        let Decision::Placed(p) =
            engine.decide_startup(&cluster, &one, &ready, DEFAULT_QUANTUM_MS, &mut rng)
        else {
            panic!("unplaced")
        };
        assert_eq!(p.node, 1);
        assert_eq!(p.gpus.len(), 1);
        // Both cache it, but node 1's disk is busy loading two copies:
        // node 0 is ready sooner.
        let busy = startup(10_000, 6.5, 32.0).time_to_ready_ms();
        let ready = |n: u32| if n == 1 { busy } else { cached };
        let Decision::Placed(p) =
            engine.decide_startup(&cluster, &one, &ready, DEFAULT_QUANTUM_MS, &mut rng)
        else {
            panic!("unplaced")
        };
        assert_eq!(p.node, 0);
    }

    #[test]
    fn equal_times_fall_back_to_fragmentation() {
        // Node 0 half used, node 1 empty: Flotilla's scorer packs onto
        // node 0; with equal times to ready (within the quantum) it still
        // does, and a full node is never chosen however fast.
        let mut cluster = two_nodes();
        let four = Request::new(GpuDemand::Whole { count: 4 }, 4_000, 1_024);
        let one = Request::new(GpuDemand::Whole { count: 1 }, 4_000, 1_024);
        let mut engine = Engine::new(Policy::Flotilla.scorer(&TargetWorkload::default()));
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let Decision::Placed(p) = engine.decide(&cluster, &four, &mut rng) else {
            panic!("unplaced")
        };
        cluster.commit(&four, &p).unwrap();
        let first = p.node;
        let ready = |n: u32| if n == first { 1_200 } else { 1_100 };
        let Decision::Placed(p) =
            engine.decide_startup(&cluster, &one, &ready, DEFAULT_QUANTUM_MS, &mut rng)
        else {
            panic!("unplaced")
        };
        assert_eq!(p.node, first);
        let Decision::Placed(p) = engine.decide(&cluster, &four, &mut rng) else {
            panic!("unplaced")
        };
        cluster.commit(&four, &p).unwrap();
        let full = first;
        let ready = |n: u32| if n == full { 0 } else { 60_000 };
        let Decision::Placed(p) =
            engine.decide_startup(&cluster, &four, &ready, DEFAULT_QUANTUM_MS, &mut rng)
        else {
            panic!("unplaced")
        };
        assert_ne!(p.node, full);
    }
}
