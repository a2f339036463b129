//! First-fit placement over an immutable snapshot. The placement issue
//! replaces the policy (crates/sched); the shape stays: a snapshot and a
//! request in, a plan or an explanation a person can act on out. Pure: the
//! caller commits the plan.

use std::collections::BTreeMap;

use crate::catalog::{MigProfile, MIG_COMPUTE_SLICES, MIG_MEMORY_SLICES};
use crate::id::{GpuId, NodeId};

/// One whole GPU in milli-GPU.
pub const MILLI_PER_GPU: u16 = 1000;

/// How much of one GPU a piece of work takes. Whole GPUs are the legacy
/// and default case; a fraction shares a GPU that is not in MIG mode with
/// other fractions (MPS, with a thread percentage and a memory cap); a MIG
/// profile takes one hardware instance of a GPU in MIG mode. A GPU never
/// mixes MIG instances with whole or fractional work.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum GpuShare {
    /// Whole GPUs, `gpus` of them.
    #[default]
    Whole,
    /// `milli` thousandths of one GPU, 1..=999.
    Fraction {
        /// Thousandths of one GPU.
        milli: u16,
    },
    /// One MIG instance of this profile.
    Mig(MigProfile),
}

impl GpuShare {
    /// Milli-GPU it takes of each GPU it is on (MIG: rounded down, see
    /// [`MigProfile::milli`]).
    pub fn milli(&self) -> u16 {
        match self {
            Self::Whole => MILLI_PER_GPU,
            Self::Fraction { milli } => *milli,
            Self::Mig(p) => p.milli(),
        }
    }

    /// Whether it needs a GPU in MIG mode.
    pub fn is_mig(&self) -> bool {
        matches!(self, Self::Mig(_))
    }

    /// Whether a GPU in the state `g` describes can take one of it now.
    pub fn fits(&self, g: &GpuSlot) -> bool {
        match self {
            Self::Whole => !g.mig_mode && g.free,
            Self::Fraction { milli } => !g.mig_mode && g.available_milli() >= *milli,
            Self::Mig(p) => {
                g.mig_mode
                    && g.mig_compute_free >= p.compute_slices
                    && g.mig_memory_free >= p.memory_slices
            }
        }
    }

    /// How it reads on an invoice line or a placement reason: `H100`,
    /// `0.5 × H100`, `H100 1g.10gb`.
    pub fn label(&self, model: &str) -> String {
        match self {
            Self::Whole => model.to_string(),
            Self::Fraction { milli } => {
                let whole = milli / MILLI_PER_GPU;
                let frac = format!("{:03}", milli % MILLI_PER_GPU);
                format!("{whole}.{} × {model}", frac.trim_end_matches('0'))
            }
            Self::Mig(p) => format!("{model} {}", p.name),
        }
    }
}

/// One GPU as placement sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSlot {
    /// The GPU.
    pub id: GpuId,
    /// Index on its node.
    pub index: u32,
    /// Catalog model name.
    pub model: String,
    /// Whether nothing holds any of it (a whole GPU may go here).
    pub free: bool,
    /// Milli-GPU not held by any work, 0..=1000.
    pub free_milli: u16,
    /// The GPU is in MIG mode: it takes MIG profiles only.
    pub mig_mode: bool,
    /// MIG compute slices not held (0 when not in MIG mode).
    pub mig_compute_free: u8,
    /// MIG memory slices not held (0 when not in MIG mode).
    pub mig_memory_free: u8,
}

impl GpuSlot {
    /// A GPU not in MIG mode, entirely free or entirely held.
    pub fn whole(id: GpuId, index: u32, model: impl Into<String>, free: bool) -> Self {
        Self {
            id,
            index,
            model: model.into(),
            free,
            free_milli: if free { MILLI_PER_GPU } else { 0 },
            mig_mode: false,
            mig_compute_free: 0,
            mig_memory_free: 0,
        }
    }

    /// A GPU in MIG mode with nothing on it.
    pub fn mig(id: GpuId, index: u32, model: impl Into<String>) -> Self {
        Self {
            mig_mode: true,
            mig_compute_free: MIG_COMPUTE_SLICES,
            mig_memory_free: MIG_MEMORY_SLICES,
            ..Self::whole(id, index, model, true)
        }
    }

    /// Milli-GPU that may still be placed here. A slot marked taken
    /// (`free` false) whose milli says otherwise was marked by a caller
    /// that only knows whole GPUs: it counts as full.
    pub fn available_milli(&self) -> u16 {
        if !self.free && self.free_milli >= MILLI_PER_GPU {
            0
        } else {
            self.free_milli
        }
    }

    /// This GPU after one `share` more is placed on it.
    pub fn take(&mut self, share: &GpuShare) {
        self.free = false;
        self.free_milli = self.free_milli.saturating_sub(share.milli());
        if let GpuShare::Mig(p) = share {
            self.mig_compute_free = self.mig_compute_free.saturating_sub(p.compute_slices);
            self.mig_memory_free = self.mig_memory_free.saturating_sub(p.memory_slices);
        }
    }
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
    /// Whole GPUs, or a share of one (then `gpus` is 1).
    pub share: GpuShare,
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
    /// What it takes of each of them.
    pub share: GpuShare,
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
    /// Has the model, but no GPU of it has room for the share asked for.
    pub const NO_ROOM_FOR_SHARE: &str = "no GPU with room for the share";
    /// A MIG profile was asked for and no GPU of the model is in MIG mode.
    pub const NO_MIG_GPU: &str = "no GPU in MIG mode";
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
    let mut any_mig = false;
    for g in &node.gpus {
        if allowed(&g.model) {
            any_allowed = true;
            any_mig |= g.mig_mode;
            if req.share.fits(g) {
                free_by_model.entry(&g.model).or_default().push(g);
            }
        }
    }
    if !any_allowed {
        return Err(reason::MODEL_NOT_ALLOWED);
    }
    let too_few = match req.share {
        GpuShare::Whole => reason::TOO_FEW_FREE_GPUS,
        GpuShare::Mig(_) if !any_mig => reason::NO_MIG_GPU,
        _ => reason::NO_ROOM_FOR_SHARE,
    };
    // Prefer the request's own order of models, then catalog order.
    let pick = req
        .models
        .iter()
        .filter_map(|m| free_by_model.get_key_value(m.as_str()))
        .chain(free_by_model.iter())
        .find(|(_, gpus)| gpus.len() >= req.gpus as usize);
    let Some((model, gpus)) = pick else {
        return Err(too_few);
    };
    if node.cpu_milli_free < req.cpu_milli {
        return Err(reason::CPU);
    }
    if node.memory_mb_free < req.memory_mb {
        return Err(reason::MEMORY);
    }
    let mut chosen: Vec<&GpuSlot> = gpus.clone();
    // Shares pack: the fullest GPU that still has room, so whole GPUs stay
    // free for whole-GPU work.
    match req.share {
        GpuShare::Whole => chosen.sort_by_key(|g| g.index),
        _ => chosen.sort_by_key(|g| (g.available_milli(), g.index)),
    }
    Ok(Placement {
        node: node.id.clone(),
        model: model.to_string(),
        gpus: chosen
            .into_iter()
            .take(req.gpus as usize)
            .map(|g| g.id.clone())
            .collect(),
        share: req.share.clone(),
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
                .map(|(i, (m, free))| {
                    GpuSlot::whole(
                        GpuId::generate(n, (n as u128) << 8 | i as u128),
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

    fn h100_profile(name: &str) -> MigProfile {
        crate::catalog::Catalog::default()
            .get("H100")
            .and_then(|m| m.mig_geometry.as_ref()?.profile(name).cloned())
            .unwrap()
    }

    #[test]
    fn fractions_pack_and_never_land_on_mig_gpus() {
        let mut nodes = vec![node(1, &[("H100", true), ("H100", true)])];
        nodes[0].gpus[0].mig_mode = true;
        let half = PlacementRequest {
            share: GpuShare::Fraction { milli: 500 },
            ..req(1, &[])
        };
        let p = first_fit(&nodes, &half, |_| true).unwrap();
        assert_eq!(p.gpus, vec![nodes[0].gpus[1].id.clone()]);
        nodes[0].gpus[1].take(&half.share);
        let q = first_fit(&nodes, &half, |_| true).unwrap();
        assert_eq!(q.gpus, p.gpus, "the second half shares the GPU");
        nodes[0].gpus[1].take(&half.share);
        let e = first_fit(&nodes, &half, |_| true).unwrap_err();
        assert_eq!(
            e.to_string(),
            "0/1 nodes fit: 1 no GPU with room for the share"
        );
        assert_eq!(half.share.label("H100"), "0.5 × H100");
        assert_eq!(GpuShare::Fraction { milli: 250 }.label("T4"), "0.25 × T4");
    }

    #[test]
    fn mig_profiles_go_to_mig_gpus_within_their_geometry() {
        let mut nodes = vec![node(1, &[("H100", true)])];
        let one = PlacementRequest {
            share: GpuShare::Mig(h100_profile("1g.20gb")),
            ..req(1, &[])
        };
        let e = first_fit(&nodes, &one, |_| true).unwrap_err();
        assert_eq!(e.to_string(), "0/1 nodes fit: 1 no GPU in MIG mode");
        nodes[0].gpus[0] = GpuSlot::mig(nodes[0].gpus[0].id.clone(), 0, "H100");
        // 1g.20gb takes 2 of 8 memory slices: four fit, not seven.
        for _ in 0..4 {
            let p = first_fit(&nodes, &one, |_| true).unwrap();
            nodes[0].gpus[0].take(&p.share);
        }
        assert!(first_fit(&nodes, &one, |_| true).is_err());
        let whole = req(1, &[]);
        assert!(first_fit(&nodes, &whole, |_| true).is_err());
        assert_eq!(one.share.label("H100"), "H100 1g.20gb");
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
