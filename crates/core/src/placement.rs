//! The store's view of placement: nodes and GPUs as the scheduler reads
//! them (with their free shares and MIG slices), what a work asks of GPUs
//! ([`GpuShare`]) and where it goes ([`Placement`]). Deciding is
//! `flotilla-sched`'s (the pass planner); these are the types the store
//! writes and checks.

use std::sync::LazyLock;

use serde::{Deserialize, Serialize};

use crate::catalog::{Catalog, MigProfile, MIG_COMPUTE_SLICES, MIG_MEMORY_SLICES};
use crate::id::{GpuId, NodeId};

/// One whole GPU in milli-GPU.
pub const MILLI_PER_GPU: u16 = 1000;

/// How much of one GPU a piece of work takes. Whole GPUs are the legacy
/// and default case; a fraction shares a GPU that is not in MIG mode with
/// other fractions (MPS, with a thread percentage and a memory cap); a MIG
/// profile takes one hardware instance of a GPU in MIG mode. A GPU never
/// mixes MIG instances with whole or fractional work.
///
/// The one share type: the store places it, the scheduler's asks are made
/// from it (`flotilla_sched::GpuAsk::of`), and the ledger's GPU meter is
/// keyed by it. Its serialised form is the ledger's, which stored events
/// keep forever: `{"kind":"whole"}`, `{"kind":"milli","milli":250}`,
/// `{"kind":"mig","profile":"3g.40gb"}` (a MIG profile is known by its
/// name, see [`GpuShare::mig_named`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(try_from = "ShareWire", into = "ShareWire")]
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

/// [`GpuShare`] as the ledger stores it.
#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum ShareWire {
    Whole,
    Milli { milli: u32 },
    Mig { profile: String },
}

impl From<GpuShare> for ShareWire {
    fn from(s: GpuShare) -> Self {
        match s {
            GpuShare::Whole => ShareWire::Whole,
            GpuShare::Fraction { milli } => ShareWire::Milli {
                milli: u32::from(milli),
            },
            GpuShare::Mig(p) => ShareWire::Mig { profile: p.name },
        }
    }
}

impl TryFrom<ShareWire> for GpuShare {
    type Error = String;

    fn try_from(w: ShareWire) -> Result<Self, String> {
        match w {
            ShareWire::Whole => Ok(GpuShare::Whole),
            ShareWire::Milli { milli } => GpuShare::from_milli(milli),
            ShareWire::Mig { profile } => GpuShare::mig_named(&profile),
        }
    }
}

/// The shipped catalog, for naming MIG profiles when a share is read back.
static SHIPPED: LazyLock<Catalog> = LazyLock::new(Catalog::default);

impl GpuShare {
    /// A share of `milli` thousandths of a GPU: 1..=999 a fraction, 1000
    /// the whole GPU.
    pub fn from_milli(milli: u32) -> Result<Self, String> {
        match milli {
            1000 => Ok(GpuShare::Whole),
            // 1..=999: fits u16.
            m @ 1..=999 => Ok(GpuShare::Fraction { milli: m as u16 }),
            m => Err(format!("a GPU share must be 1 to 1000 milli, got {m}")),
        }
    }

    /// One instance of the MIG profile called `name`. The shipped catalog's
    /// profile where it has one (a profile name means the same slices on
    /// every model that offers it); otherwise read from the name itself,
    /// `<compute slices>g.<memory>gb`, counting memory in eighths of a GPU
    /// of 8 × that memory's slice.
    pub fn mig_named(name: &str) -> Result<Self, String> {
        if let Some((p, _)) = SHIPPED.mig_profile(name) {
            return Ok(GpuShare::Mig(p));
        }
        let parsed = name.split_once("g.").and_then(|(g, mem)| {
            let compute = g
                .parse::<u8>()
                .ok()
                .filter(|c| (1..=MIG_COMPUTE_SLICES).contains(c))?;
            let gb = mem.strip_suffix("gb")?.parse::<u64>().ok()?;
            Some(MigProfile {
                name: name.to_string(),
                compute_slices: compute,
                memory_slices: compute.min(MIG_MEMORY_SLICES),
                memory_mib: gb * 1024,
            })
        });
        parsed
            .map(GpuShare::Mig)
            .ok_or_else(|| format!("`{name}` is not a MIG profile like `3g.40gb`"))
    }

    /// The request fields that ask for this share: `(gpu_fraction,
    /// mig_profile)`, both absent for whole GPUs.
    pub fn as_request(&self) -> (Option<f64>, Option<String>) {
        match self {
            GpuShare::Whole => (None, None),
            GpuShare::Fraction { milli } => (Some(f64::from(*milli) / 1000.0), None),
            GpuShare::Mig(p) => (None, Some(p.name.clone())),
        }
    }

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
    /// When its provider offers it; the pass treats it as unavailable
    /// outside those windows.
    pub offer: crate::offer::NodeOffer,
    /// Region (gangs may be kept within one).
    pub region: String,
    /// Node pool, the topology domain a gang may be kept within.
    pub pool: String,
    /// How its agent runs workloads (processes or containers).
    pub runtime: crate::node::RuntimeKind,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn h100_profile(name: &str) -> MigProfile {
        crate::catalog::Catalog::default()
            .get("H100")
            .and_then(|m| m.mig_geometry.as_ref()?.profile(name).cloned())
            .unwrap()
    }

    fn gpu() -> GpuId {
        GpuId::generate(1, 1)
    }

    #[test]
    fn fractions_share_a_gpu_and_never_a_mig_one() {
        let mut g = GpuSlot::whole(gpu(), 0, "H100", true);
        let half = GpuShare::Fraction { milli: 500 };
        assert!(half.fits(&g));
        g.take(&half);
        assert!(half.fits(&g), "the second half shares the GPU");
        assert!(!GpuShare::Whole.fits(&g));
        g.take(&half);
        assert!(!half.fits(&g));
        let m = GpuSlot::mig(gpu(), 0, "H100");
        assert!(!half.fits(&m) && !GpuShare::Whole.fits(&m));
        assert_eq!(half.label("H100"), "0.5 × H100");
        assert_eq!(GpuShare::Fraction { milli: 250 }.label("T4"), "0.25 × T4");
    }

    #[test]
    fn mig_profiles_fit_within_the_geometry() {
        let one = GpuShare::Mig(h100_profile("1g.20gb"));
        assert!(!one.fits(&GpuSlot::whole(gpu(), 0, "H100", true)));
        let mut g = GpuSlot::mig(gpu(), 0, "H100");
        // 1g.20gb takes 2 of 8 memory slices: four fit, not seven.
        for _ in 0..4 {
            assert!(one.fits(&g));
            g.take(&one);
        }
        assert!(!one.fits(&g));
        assert_eq!(one.label("H100"), "H100 1g.20gb");
        let small = GpuShare::Mig(h100_profile("1g.10gb"));
        let mut g = GpuSlot::mig(gpu(), 0, "H100");
        for _ in 0..7 {
            assert!(small.fits(&g));
            g.take(&small);
        }
        assert!(!small.fits(&g), "seven compute slices at most");
    }
}
