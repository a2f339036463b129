//! First-fit placement over an immutable snapshot. The placement issue
//! replaces the policy (crates/sched); the shape stays: a snapshot and a
//! request in, a plan or an explanation a person can act on out. Pure: the
//! caller commits the plan.

use std::collections::BTreeMap;

use crate::id::{GpuId, NodeId};

/// One GPU as placement sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSlot {
    /// The GPU.
    pub id: GpuId,
    /// Index on its node.
    pub index: u32,
    /// Catalog model name.
    pub model: String,
    /// Whether no instance holds it.
    pub free: bool,
}

/// One node as placement sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeSnapshot {
    /// The node.
    pub id: NodeId,
    /// Heartbeats arrive.
    pub ready: bool,
    /// Taken out of scheduling by an operator.
    pub cordoned: bool,
    /// Region (gangs may be kept within one).
    pub region: String,
    /// Node pool, the topology domain a gang may be kept within.
    pub pool: String,
    /// CPU not yet reserved, in milli-cores.
    pub cpu_milli_free: u64,
    /// Memory not yet reserved, in MiB.
    pub memory_mb_free: u64,
    /// Its GPUs.
    pub gpus: Vec<GpuSlot>,
}

/// What the instance needs.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacementRequest {
    /// Whole GPUs, all of one model.
    pub gpus: u32,
    /// Acceptable models; empty: any.
    pub models: Vec<String>,
    /// CPU in milli-cores.
    pub cpu_milli: u64,
    /// Memory in MiB.
    pub memory_mb: u64,
}

/// Where the instance goes.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// The chosen node.
    pub node: NodeId,
    /// The chosen model.
    pub model: String,
    /// The chosen GPUs, by ascending index.
    pub gpus: Vec<GpuId>,
}

/// Why no node fits, as counts per reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unplaceable {
    /// Nodes considered.
    pub nodes: usize,
    /// Reason → number of nodes rejected for it (the first reason that
    /// applied to each node).
    pub reasons: BTreeMap<&'static str, usize>,
}

impl std::fmt::Display for Unplaceable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.nodes == 0 {
            return f.write_str("no nodes registered");
        }
        write!(f, "0/{} nodes fit", self.nodes)?;
        let mut sep = ": ";
        for (reason, n) in &self.reasons {
            write!(f, "{sep}{n} {reason}")?;
            sep = ", ";
        }
        Ok(())
    }
}

/// Reasons, cheapest check first (Nomad's feasibility order).
pub mod reason {
    /// Heartbeats stopped.
    pub const UNREACHABLE: &str = "unreachable";
    /// Cordoned by an operator.
    pub const CORDONED: &str = "cordoned";
    /// No GPU of an allowed model.
    pub const MODEL_NOT_ALLOWED: &str = "GPU model not allowed";
    /// Has the model but not enough of it free.
    pub const TOO_FEW_FREE_GPUS: &str = "too few free GPUs";
    /// Not enough CPU left.
    pub const CPU: &str = "too little free CPU";
    /// Not enough memory left.
    pub const MEMORY: &str = "too little free memory";
}

/// Picks the first node, in snapshot order, with `gpus` free GPUs of one
/// allowed model and the CPU and memory; takes its lowest-index free GPUs.
/// `model_allowed` lets the caller fold in quotas.
pub fn first_fit(
    nodes: &[NodeSnapshot],
    req: &PlacementRequest,
    model_allowed: impl Fn(&str) -> bool,
) -> Result<Placement, Unplaceable> {
    let mut reasons: BTreeMap<&'static str, usize> = BTreeMap::new();
    let allowed =
        |m: &str| (req.models.is_empty() || req.models.iter().any(|a| a == m)) && model_allowed(m);
    for node in nodes {
        let verdict = check_node(node, req, &allowed);
        match verdict {
            Ok(p) => return Ok(p),
            Err(r) => *reasons.entry(r).or_default() += 1,
        }
    }
    Err(Unplaceable {
        nodes: nodes.len(),
        reasons,
    })
}

fn check_node(
    node: &NodeSnapshot,
    req: &PlacementRequest,
    allowed: &impl Fn(&str) -> bool,
) -> Result<Placement, &'static str> {
    if !node.ready {
        return Err(reason::UNREACHABLE);
    }
    if node.cordoned {
        return Err(reason::CORDONED);
    }
    let mut free_by_model: BTreeMap<&str, Vec<&GpuSlot>> = BTreeMap::new();
    let mut any_allowed = false;
    for g in &node.gpus {
        if allowed(&g.model) {
            any_allowed = true;
            if g.free {
                free_by_model.entry(&g.model).or_default().push(g);
            }
        }
    }
    if !any_allowed {
        return Err(reason::MODEL_NOT_ALLOWED);
    }
    // Prefer the request's own order of models, then catalog order.
    let pick = req
        .models
        .iter()
        .filter_map(|m| free_by_model.get_key_value(m.as_str()))
        .chain(free_by_model.iter())
        .find(|(_, gpus)| gpus.len() >= req.gpus as usize);
    let Some((model, gpus)) = pick else {
        return Err(reason::TOO_FEW_FREE_GPUS);
    };
    if node.cpu_milli_free < req.cpu_milli {
        return Err(reason::CPU);
    }
    if node.memory_mb_free < req.memory_mb {
        return Err(reason::MEMORY);
    }
    let mut chosen: Vec<&GpuSlot> = gpus.clone();
    chosen.sort_by_key(|g| g.index);
    Ok(Placement {
        node: node.id.clone(),
        model: model.to_string(),
        gpus: chosen
            .into_iter()
            .take(req.gpus as usize)
            .map(|g| g.id.clone())
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn node(n: u64, models: &[(&str, bool)]) -> NodeSnapshot {
        NodeSnapshot {
            id: NodeId::generate(n, n as u128),
            ready: true,
            cordoned: false,
            region: "local".into(),
            pool: "default".into(),
            cpu_milli_free: 64_000,
            memory_mb_free: 512_000,
            gpus: models
                .iter()
                .enumerate()
                .map(|(i, (m, free))| GpuSlot {
                    id: GpuId::generate(n, (n as u128) << 8 | i as u128),
                    index: i as u32,
                    model: m.to_string(),
                    free: *free,
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
        }
    }

    #[test]
    fn takes_first_node_with_enough_free_gpus_of_an_allowed_model() {
        let nodes = vec![
            node(1, &[("H100", false), ("H100", true)]),
            node(2, &[("L40S", true), ("L40S", true)]),
            node(3, &[("H100", true), ("H100", true), ("H100", true)]),
        ];
        let p = first_fit(&nodes, &req(2, &["H100"]), |_| true).unwrap();
        assert_eq!(p.node, nodes[2].id);
        assert_eq!(
            p.gpus,
            vec![nodes[2].gpus[0].id.clone(), nodes[2].gpus[1].id.clone()]
        );
        let p = first_fit(&nodes, &req(2, &[]), |_| true).unwrap();
        assert_eq!(
            (p.node.clone(), p.model.as_str()),
            (nodes[1].id.clone(), "L40S")
        );
    }

    #[test]
    fn explains_why_nothing_fits() {
        let mut down = node(4, &[("H100", true)]);
        down.ready = false;
        let nodes = vec![node(1, &[("H100", false)]), node(2, &[("T4", true)]), down];
        let e = first_fit(&nodes, &req(1, &["H100"]), |_| true).unwrap_err();
        assert_eq!(
            e.to_string(),
            "0/3 nodes fit: 1 GPU model not allowed, 1 too few free GPUs, 1 unreachable"
        );
        let e = first_fit(&[], &req(1, &[]), |_| true).unwrap_err();
        assert_eq!(e.to_string(), "no nodes registered");
    }

    #[test]
    fn quota_filter_removes_models() {
        let nodes = vec![node(1, &[("H100", true)]), node(2, &[("L4", true)])];
        let p = first_fit(&nodes, &req(1, &[]), |m| m != "H100").unwrap();
        assert_eq!(p.model, "L4");
    }

    proptest! {
        /// Placing requests one after another and committing each plan never
        /// hands out a GPU twice and never a GPU of a disallowed model.
        #[test]
        fn sequential_placements_never_share_a_gpu(
            layout in prop::collection::vec(prop::collection::vec(0..3usize, 1..9), 1..12),
            reqs in prop::collection::vec((1..5u32, 0..4usize), 1..60),
        ) {
            let models = ["H100", "L40S", "T4"];
            let mut nodes: Vec<NodeSnapshot> = layout.iter().enumerate().map(|(n, gpus)| {
                let m: Vec<(&str, bool)> = gpus.iter().map(|&g| (models[g], true)).collect();
                node(n as u64 + 1, &m)
            }).collect();
            let mut taken = std::collections::HashSet::new();
            for (count, model) in reqs {
                let allowed: Vec<&str> = if model == 3 { vec![] } else { vec![models[model]] };
                if let Ok(p) = first_fit(&nodes, &req(count, &allowed), |_| true) {
                    prop_assert_eq!(p.gpus.len(), count as usize);
                    let node = nodes.iter_mut().find(|n| n.id == p.node).unwrap();
                    for g in &p.gpus {
                        prop_assert!(taken.insert(g.clone()), "gpu {} handed out twice", g);
                        let slot = node.gpus.iter_mut().find(|s| &s.id == g).unwrap();
                        prop_assert!(slot.free);
                        prop_assert!(allowed.is_empty() || allowed.contains(&slot.model.as_str()));
                        slot.free = false;
                    }
                }
            }
        }
    }
}
