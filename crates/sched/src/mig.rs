//! MIG (Multi-Instance GPU) profiles, mapped onto the engine's milli-GPU
//! shares.
//!
//! A MIG-capable GPU (A100, H100, H200, ...) splits into 7 compute slices; a
//! profile `Ng.Mgb` takes `N` of them and `M` GB of the GPU's memory. This
//! module places a profile as a share of `floor(N * 1000 / 7)` milli-GPU
//! (1g → 142, 2g → 285, 3g → 428, 4g → 571, 7g → 1000 = one whole GPU) on a
//! GPU of a MIG-capable model.
//!
//! Why round down, not up: any valid MIG layout uses at most 7 slices, and
//! the floors of slice counts summing to at most 7 sum to at most 1000, so
//! every real layout (7 × 1g, 3g + 4g, ...) fits on one GPU. Rounding up
//! would make 3g + 4g cost 1001 and refuse a layout the hardware accepts.
//! The price is at most 6 milli of "free" share per fully sliced GPU, too
//! little for any MIG profile.
//!
//! Simplifications, to be replaced by a slice-aware model (future work):
//! - Real MIG instances sit at fixed slice positions (a 4g instance must
//!   start at slice 0, a 3g at slice 4, ...), so some layouts that fit by
//!   count do not fit by position; this model checks counts only.
//! - The profile's memory (`Mgb`) is not checked: per-GPU memory is not in
//!   the snapshot yet. On current GPUs the memory follows the slice count.
//! - A GPU is not marked as "in MIG mode": a MIG profile and a time-sliced
//!   share could land on the same GPU. Callers that mix both should keep
//!   them on different models or pools.
//!
//! Because a profile becomes an ordinary [`GpuDemand::Share`] (or
//! [`GpuDemand::Whole`] for 7g), the existing capacity checks apply as they
//! are, and no GPU can exceed 1000 milli.

use std::fmt;
use std::str::FromStr;

use crate::request::{GpuDemand, ModelSet, Request};
use crate::snapshot::ModelTable;
use crate::{Error, MILLI};

/// Compute slices of a MIG-capable GPU.
pub const SLICES: u8 = 7;

/// A MIG profile such as `3g.40gb`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MigProfile {
    /// Compute slices, 1..=7.
    pub slices: u8,
    /// GPU memory in GB, as named by the profile (not checked, see module).
    pub mem_gb: u16,
}

impl MigProfile {
    /// A profile of `slices` compute slices (1..=7) and `mem_gb` GB.
    pub fn new(slices: u8, mem_gb: u16) -> Result<Self, Error> {
        if slices == 0 || slices > SLICES {
            return Err(Error::InvalidRequest(
                "a mig profile takes 1 to 7 compute slices",
            ));
        }
        Ok(MigProfile { slices, mem_gb })
    }

    /// The profile's share of one GPU in milli-GPU, rounded down (see the
    /// module for why).
    pub fn milli(self) -> u16 {
        // slices <= 7, so this is at most 1000.
        (u32::from(self.slices.min(SLICES)) * u32::from(MILLI) / u32::from(SLICES)) as u16
    }

    /// The GPU demand this profile is placed as.
    pub fn demand(self) -> GpuDemand {
        // milli() is in 142..=1000, which `share` always accepts.
        GpuDemand::share(self.milli()).unwrap_or(GpuDemand::Whole { count: 1 })
    }
}

impl fmt::Display for MigProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}g.{}gb", self.slices, self.mem_gb)
    }
}

impl FromStr for MigProfile {
    type Err = Error;

    /// Parses `Ng.Mgb` (case-insensitive), as NVIDIA names profiles.
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::InvalidRequest("a mig profile looks like 3g.40gb");
        let lower = s.trim().to_ascii_lowercase();
        let (g, m) = lower.split_once('.').ok_or_else(bad)?;
        let slices = g
            .strip_suffix('g')
            .and_then(|n| n.parse::<u8>().ok())
            .ok_or_else(bad)?;
        let mem_gb = m
            .strip_suffix("gb")
            .and_then(|n| n.parse::<u16>().ok())
            .ok_or_else(bad)?;
        MigProfile::new(slices, mem_gb)
    }
}

/// A request for one MIG instance of `profile`, restricted to the
/// MIG-capable models among `models`. If none of them is MIG-capable the
/// request fits nowhere and the explanation says "GPU model not allowed".
pub fn mig_request(
    profile: MigProfile,
    models: ModelSet,
    table: &ModelTable,
    cpu_milli: u32,
    mem_mib: u64,
) -> Request {
    let capable = table.mig_capable_mask();
    let allowed = match models {
        ModelSet::Any => ModelSet::Only(capable),
        ModelSet::Only(mask) => ModelSet::Only(mask & capable),
    };
    Request::new(profile.demand(), cpu_milli, mem_mib).with_models(allowed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_map_to_floored_shares() {
        let p = |s: &str| s.parse::<MigProfile>().unwrap();
        assert_eq!(p("1g.10gb").milli(), 142);
        assert_eq!(p("2g.20gb").milli(), 285);
        assert_eq!(p("3g.40gb").milli(), 428);
        assert_eq!(p("4g.40gb").milli(), 571);
        assert_eq!(p("7g.80gb").milli(), 1000);
        assert_eq!(p("7G.80GB").demand(), GpuDemand::Whole { count: 1 });
        assert_eq!(p("3g.40gb").demand(), GpuDemand::Share { milli: 428 });
        assert_eq!(p("1g.10gb").to_string(), "1g.10gb");
        for bad in ["0g.5gb", "8g.80gb", "3g", "g.40gb", "3g.40", "x"] {
            assert!(bad.parse::<MigProfile>().is_err(), "{bad}");
        }
    }

    #[test]
    fn every_valid_layout_fits_one_gpu() {
        // Any multiset of slice counts summing to <= 7 fits in 1000 milli.
        for layout in [[1u8; 7].as_slice(), &[3, 4], &[2, 2, 3], &[1, 2, 4], &[7]] {
            let total: u32 = layout
                .iter()
                .map(|&s| u32::from(MigProfile::new(s, 0).unwrap().milli()))
                .sum();
            assert!(total <= 1000, "{layout:?} -> {total}");
        }
    }

    #[test]
    fn only_mig_capable_models_are_allowed() {
        let mut t = ModelTable::default();
        let a100 = t.intern("A100").unwrap();
        let t4 = t.intern("T4").unwrap();
        t.set_mig_capable(a100, true).unwrap();
        assert!(t.set_mig_capable(9, true).is_err());
        let prof = MigProfile::new(1, 10).unwrap();
        let r = mig_request(prof, ModelSet::Any, &t, 0, 0);
        assert!(r.models.allows(Some(a100)) && !r.models.allows(Some(t4)));
        let r = mig_request(prof, ModelSet::of([t4]), &t, 0, 0);
        assert!(!r.models.allows(Some(a100)) && !r.models.allows(Some(t4)));
    }
}
