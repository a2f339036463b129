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
    /// Dense FP16 tensor throughput relative to an A100 (= 1.0), from the
    /// vendors' datasheets; the scheduler and the simulator use it to
    /// compare classes, never to bill.
    pub relative_performance: f64,
    /// List price per GPU-hour in USD; the billing issue makes prices
    /// versioned and editable.
    #[schema(value_type = String, example = "2.99")]
    pub list_price_per_hour: Decimal,
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
    mig: &[&str],
    perf: f64,
    price: &str,
) -> GpuModel {
    GpuModel {
        name: name.to_string(),
        vendor,
        memory_gib,
        mig_profiles: mig.iter().map(|s| s.to_string()).collect(),
        relative_performance: perf,
        list_price_per_hour: Decimal::from_str(price).unwrap_or_default(),
    }
}

impl Default for Catalog {
    /// The shipped catalog. MIG profiles follow NVIDIA's MIG user guide;
    /// prices are typical on-demand market rates, a starting point only.
    fn default() -> Self {
        use Vendor::*;
        let a100_80 = [
            "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
        ];
        Self {
            models: vec![
                model("T4", Nvidia, 16, &[], 0.21, "0.35"),
                model("A10", Nvidia, 24, &[], 0.40, "0.75"),
                model("L4", Nvidia, 24, &[], 0.39, "0.70"),
                model("L40S", Nvidia, 48, &[], 1.16, "1.50"),
                model(
                    "A100-40GB",
                    Nvidia,
                    40,
                    &["1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"],
                    1.0,
                    "1.60",
                ),
                model("A100-80GB", Nvidia, 80, &a100_80, 1.0, "2.00"),
                model("H100", Nvidia, 80, &a100_80, 3.17, "2.99"),
                model(
                    "H200",
                    Nvidia,
                    141,
                    &[
                        "1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb",
                    ],
                    3.17,
                    "3.79",
                ),
                model(
                    "B200",
                    Nvidia,
                    180,
                    &[
                        "1g.23gb", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb",
                    ],
                    7.21,
                    "5.99",
                ),
                model("MI300X", Amd, 192, &[], 4.19, "2.99"),
            ],
        }
    }
}

impl Catalog {
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
