//! The GPU catalog: which GPU models Flotilla knows, what they offer and
//! what they list at. The default catalog ships the models of a modern GPU
//! cloud; operators may replace it later (prices become versioned with the
//! billing work).

use std::str::FromStr;

use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

use crate::error::FieldError;

/// Who makes a GPU; it decides the runtime (CUDA or ROCm) and the env
/// variables that select devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Vendor {
    /// NVIDIA (CUDA, NVML, MIG).
    Nvidia,
    /// AMD (ROCm).
    Amd,
}

/// One GPU model of the catalog.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GpuModel {
    /// Canonical name, e.g. `H100`, `A100-80GB`.
    pub name: String,
    /// The maker.
    pub vendor: Vendor,
    /// Memory per GPU in GiB.
    pub memory_gib: u32,
    /// MIG profiles the model can be partitioned into (empty: no MIG).
    pub mig_profiles: Vec<String>,
    /// How a GPU of this model partitions in MIG mode: the slices it has
    /// and what each profile takes of them. Absent for models without MIG.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_geometry: Option<MigGeometry>,
    /// Dense FP16 tensor throughput relative to an A100 (= 1.0), from the
    /// vendors' datasheets; the scheduler and the simulator use it to
    /// compare classes, never to bill.
    pub relative_performance: f64,
    /// List price per GPU-hour in USD; the billing issue makes prices
    /// versioned and editable.
    #[schema(value_type = String, example = "2.99")]
    pub list_price_per_hour: Decimal,
}

/// One MIG profile of a model: what one instance of it takes of a GPU.
/// Ordered and hashed so that a share of it can key a ledger's meter
/// (`crate::placement::GpuShare`).
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema,
)]
pub struct MigProfile {
    /// NVIDIA's name, e.g. `1g.10gb`.
    pub name: String,
    /// Compute slices (GPCs) it takes, of the GPU's `compute_slices`.
    pub compute_slices: u8,
    /// Memory slices it takes, of the GPU's `memory_slices`.
    pub memory_slices: u8,
    /// Its GPU memory in MiB (what the workload sees).
    pub memory_mib: u64,
}

impl MigProfile {
    /// Its share of the GPU in milli-GPU, rounded down: `compute_slices /
    /// 7` of 1000 (`1g` = 142, `3g` = 428, `7g` = 1000). Rounding down keeps
    /// every layout the hardware accepts within 1000 (the floors of slice
    /// counts summing to at most 7 sum to at most 1000), which is what the
    /// store's capacity check and the placement engine count.
    pub fn milli(&self) -> u16 {
        let c = u32::from(self.compute_slices.min(MIG_COMPUTE_SLICES));
        // At most 7 * 1000 / 7 = 1000: fits a u16.
        (c * 1000 / u32::from(MIG_COMPUTE_SLICES)) as u16
    }
}

/// Compute slices of every MIG-capable NVIDIA GPU (A100, H100, H200, B200).
pub const MIG_COMPUTE_SLICES: u8 = 7;
/// Memory slices of every MIG-capable NVIDIA GPU: memory is cut in eighths.
pub const MIG_MEMORY_SLICES: u8 = 8;

/// How one GPU model partitions in MIG mode. A set of MIG instances fits
/// one GPU when their compute slices sum to at most `compute_slices` and
/// their memory slices to at most `memory_slices`; with NVIDIA's tables this
/// reproduces each profile's maximum instance count (7 × `1g.10gb`, 4 ×
/// `1g.20gb`, 3 × `2g.20gb`, 2 × `3g.40gb`, 1 × `4g.40gb`, 1 × `7g.80gb` on
/// an H100). Placement positions within the GPU (a `4g` must start at slice
/// 0) are not modelled: the driver places instances, this only counts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MigGeometry {
    /// Compute slices of one GPU (7).
    pub compute_slices: u8,
    /// Memory slices of one GPU (8).
    pub memory_slices: u8,
    /// The profiles, smallest first.
    pub profiles: Vec<MigProfile>,
}

impl MigGeometry {
    /// The geometry of a GPU with `memory_gib` of memory and the given
    /// profiles as `(name, compute slices, memory slices)`; each profile's
    /// memory is its eighths of the GPU's.
    fn nvidia(memory_gib: u32, profiles: &[(&str, u8, u8)]) -> Self {
        let eighth_mib = u64::from(memory_gib) * 1024 / u64::from(MIG_MEMORY_SLICES);
        Self {
            compute_slices: MIG_COMPUTE_SLICES,
            memory_slices: MIG_MEMORY_SLICES,
            profiles: profiles
                .iter()
                .map(|&(name, c, m)| MigProfile {
                    name: name.to_string(),
                    compute_slices: c,
                    memory_slices: m,
                    memory_mib: eighth_mib * u64::from(m),
                })
                .collect(),
        }
    }

    /// The profile called `name`, case-insensitively.
    pub fn profile(&self, name: &str) -> Option<&MigProfile> {
        self.profiles
            .iter()
            .find(|p| p.name.eq_ignore_ascii_case(name.trim()))
    }

    /// How many instances of `profile` fit on an empty GPU.
    pub fn max_instances(&self, profile: &MigProfile) -> u8 {
        let by_compute = self.compute_slices / profile.compute_slices.max(1);
        let by_memory = self.memory_slices / profile.memory_slices.max(1);
        by_compute.min(by_memory)
    }
}

/// The set of GPU models a deployment knows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Catalog {
    models: Vec<GpuModel>,
}

fn model(
    name: &str,
    vendor: Vendor,
    memory_gib: u32,
    mig: &[(&str, u8, u8)],
    perf: f64,
    price: &str,
) -> GpuModel {
    GpuModel {
        name: name.to_string(),
        vendor,
        memory_gib,
        mig_profiles: mig.iter().map(|(s, _, _)| s.to_string()).collect(),
        mig_geometry: (!mig.is_empty()).then(|| MigGeometry::nvidia(memory_gib, mig)),
        relative_performance: perf,
        list_price_per_hour: Decimal::from_str(price).unwrap_or_default(),
    }
}

impl Default for Catalog {
    /// The shipped catalog. MIG profiles and their slices follow NVIDIA's
    /// MIG user guide ("Supported MIG Profiles": compute slices of 7 and
    /// memory slices of 8 per profile); prices are typical on-demand market
    /// rates, a starting point only.
    fn default() -> Self {
        use Vendor::*;
        // (profile, compute slices, memory slices)
        let a100_40 = [
            ("1g.5gb", 1, 1),
            ("2g.10gb", 2, 2),
            ("3g.20gb", 3, 4),
            ("4g.20gb", 4, 4),
            ("7g.40gb", 7, 8),
        ];
        let a100_80 = [
            ("1g.10gb", 1, 1),
            ("1g.20gb", 1, 2),
            ("2g.20gb", 2, 2),
            ("3g.40gb", 3, 4),
            ("4g.40gb", 4, 4),
            ("7g.80gb", 7, 8),
        ];
        let h200 = [
            ("1g.18gb", 1, 1),
            ("1g.35gb", 1, 2),
            ("2g.35gb", 2, 2),
            ("3g.71gb", 3, 4),
            ("4g.71gb", 4, 4),
            ("7g.141gb", 7, 8),
        ];
        let b200 = [
            ("1g.23gb", 1, 1),
            ("1g.45gb", 1, 2),
            ("2g.45gb", 2, 2),
            ("3g.90gb", 3, 4),
            ("4g.90gb", 4, 4),
            ("7g.180gb", 7, 8),
        ];
        Self {
            models: vec![
                model("T4", Nvidia, 16, &[], 0.21, "0.35"),
                model("A10", Nvidia, 24, &[], 0.40, "0.75"),
                model("L4", Nvidia, 24, &[], 0.39, "0.70"),
                model("L40S", Nvidia, 48, &[], 1.16, "1.50"),
                model("A100-40GB", Nvidia, 40, &a100_40, 1.0, "1.60"),
                model("A100-80GB", Nvidia, 80, &a100_80, 1.0, "2.00"),
                model("H100", Nvidia, 80, &a100_80, 3.17, "2.99"),
                model("H200", Nvidia, 141, &h200, 3.17, "3.79"),
                model("B200", Nvidia, 180, &b200, 7.21, "5.99"),
                model("MI300X", Amd, 192, &[], 4.19, "2.99"),
            ],
        }
    }
}

impl Catalog {
    /// The MIG profile called `name` and the models that offer it, in
    /// catalog order. A profile name means the same slices on every model
    /// of the shipped catalog (NVIDIA names profiles by their memory), so
    /// one profile serves them all.
    pub fn mig_profile(&self, name: &str) -> Option<(MigProfile, Vec<&GpuModel>)> {
        let mut found: Option<MigProfile> = None;
        let mut models = Vec::new();
        for m in &self.models {
            if let Some(p) = m.mig_geometry.as_ref().and_then(|g| g.profile(name)) {
                found.get_or_insert_with(|| p.clone());
                models.push(m);
            }
        }
        found.map(|p| (p, models))
    }

    /// Every model, in catalog order.
    pub fn models(&self) -> &[GpuModel] {
        &self.models
    }

    /// The model called `name`, case-insensitively.
    pub fn get(&self, name: &str) -> Option<&GpuModel> {
        self.models
            .iter()
            .find(|m| m.name.eq_ignore_ascii_case(name.trim()))
    }

    /// Resolves a user-given model name to its canonical spelling, or an
    /// error for `field` that lists the known models.
    pub fn resolve(&self, name: &str, field: &str) -> Result<String, FieldError> {
        self.get(name).map(|m| m.name.clone()).ok_or_else(|| {
            let known: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
            FieldError::new(
                field,
                format!("unknown GPU model `{name}`; known: {}", known.join(", ")),
            )
        })
    }

    /// Maps a device name as a driver reports it (NVML: `NVIDIA H100 80GB
    /// HBM3`, `NVIDIA A100-SXM4-40GB`) to a catalog model. Memory breaks the
    /// tie between the A100 sizes.
    pub fn match_device(&self, device_name: &str, memory_mib: u64) -> Option<&GpuModel> {
        let upper = device_name.to_ascii_uppercase();
        if upper.contains("A100") {
            let name = if memory_mib > 48 * 1024 {
                "A100-80GB"
            } else {
                "A100-40GB"
            };
            return self.get(name);
        }
        // Longest name first so that `L40S` wins over `L4`.
        let mut models: Vec<&GpuModel> = self.models.iter().collect();
        models.sort_by_key(|m| std::cmp::Reverse(m.name.len()));
        models.into_iter().find(|m| {
            upper
                .split(|c: char| !c.is_ascii_alphanumeric())
                .any(|word| word == m.name.to_ascii_uppercase())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_catalog_has_the_promised_models() {
        let c = Catalog::default();
        for name in [
            "T4",
            "A10",
            "L4",
            "L40S",
            "A100-40GB",
            "A100-80GB",
            "H100",
            "H200",
            "B200",
            "MI300X",
        ] {
            assert!(c.get(name).is_some(), "{name} missing");
        }
        assert_eq!(c.resolve("h100", "gpu_type").unwrap(), "H100");
        let e = c.resolve("Z9000", "gpu_type").unwrap_err();
        assert_eq!(e.field, "gpu_type");
        assert!(e.message.contains("Z9000"));
    }

    #[test]
    fn mig_geometries_follow_nvidia_tables() {
        let c = Catalog::default();
        let geo = |m: &str| c.get(m).and_then(|m| m.mig_geometry.clone());
        let h100 = geo("H100").unwrap();
        let max = |g: &MigGeometry, p: &str| g.max_instances(g.profile(p).unwrap());
        // NVIDIA's "instances available" column for the H100 80GB.
        for (p, n) in [
            ("1g.10gb", 7),
            ("1g.20gb", 4),
            ("2g.20gb", 3),
            ("3g.40gb", 2),
            ("4g.40gb", 1),
            ("7g.80gb", 1),
        ] {
            assert_eq!(max(&h100, p), n, "{p}");
        }
        assert_eq!(h100.profile("1G.10GB").unwrap().memory_mib, 10 * 1024);
        assert_eq!(h100.profile("1g.10gb").unwrap().milli(), 142);
        assert_eq!(h100.profile("7g.80gb").unwrap().milli(), 1000);
        let a100 = geo("A100-40GB").unwrap();
        assert_eq!(max(&a100, "1g.5gb"), 7);
        assert_eq!(max(&a100, "3g.20gb"), 2);
        let h200 = geo("H200").unwrap();
        assert_eq!(max(&h200, "1g.18gb"), 7);
        assert_eq!(max(&h200, "1g.35gb"), 4);
        assert!(h200.profile("1g.10gb").is_none());
        for m in ["T4", "L40S", "MI300X"] {
            assert!(geo(m).is_none(), "{m}");
        }
        // A profile name means the same slices on every model that has it
        // (what lets a request name a profile before a model is chosen).
        let mut seen: std::collections::BTreeMap<String, (u8, u8, u64)> = Default::default();
        for g in c.models().iter().filter_map(|m| m.mig_geometry.as_ref()) {
            for p in &g.profiles {
                let v = (p.compute_slices, p.memory_slices, p.memory_mib);
                assert_eq!(*seen.entry(p.name.clone()).or_insert(v), v, "{}", p.name);
            }
        }
        // The names listed and the geometry agree.
        for m in c.models() {
            let names: Vec<String> = m
                .mig_geometry
                .iter()
                .flat_map(|g| g.profiles.iter().map(|p| p.name.clone()))
                .collect();
            assert_eq!(names, m.mig_profiles, "{}", m.name);
        }
    }

    #[test]
    fn device_names_match_catalog_models() {
        let c = Catalog::default();
        let m = |n, mem| c.match_device(n, mem).map(|m| m.name.as_str());
        assert_eq!(m("NVIDIA H100 80GB HBM3", 81_559), Some("H100"));
        assert_eq!(m("NVIDIA A100-SXM4-40GB", 40_960), Some("A100-40GB"));
        assert_eq!(m("NVIDIA A100 80GB PCIe", 81_920), Some("A100-80GB"));
        assert_eq!(m("NVIDIA L40S", 46_068), Some("L40S"));
        assert_eq!(m("NVIDIA L4", 23_034), Some("L4"));
        assert_eq!(m("Tesla T4", 15_360), Some("T4"));
        assert_eq!(m("NVIDIA H200", 143_771), Some("H200"));
        assert_eq!(m("Some GPU", 1), None);
    }
}
