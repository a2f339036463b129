//! GPU and host discovery: what this node offers. GPUs come from NVML when
//! an NVIDIA driver answers, or from a simulated inventory such as
//! `4xH100,2xL40S` so that Flotilla runs on machines without GPUs.
//!
//! This module only reads: it must never change device settings (clocks,
//! MIG mode, persistence), never talk to the server and never spawn
//! processes. Simulated inventories are deterministic (no randomness) so a
//! node that re-registers presents the same GPUs.

use flotilla_core::api::DiscoveredGpu;
use flotilla_core::catalog::Catalog;
use flotilla_core::node::parse_simulated_gpus;
use flotilla_core::FieldError;
use nvml_wrapper::error::NvmlError;

/// Memory assumed when `/proc/meminfo` cannot be read, in MiB.
const FALLBACK_MEMORY_MIB: u64 = 16 * 1024;

/// Why the GPUs of this node could not be discovered.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The simulated inventory does not parse or names an unknown model.
    #[error("invalid simulated GPU inventory: {0}")]
    InvalidSpec(#[source] FieldError),
    /// NVML could not be loaded or initialised: no NVIDIA driver here.
    #[error(
        "no NVIDIA driver answers through NVML ({0}); pass --simulate-gpus, e.g. --simulate-gpus 4xH100, to run without real GPUs"
    )]
    NvmlUnavailable(#[source] NvmlError),
    /// NVML answered but a query failed.
    #[error("NVML query failed while {what}: {source}")]
    Nvml {
        /// What was being asked.
        what: String,
        /// NVML's error.
        #[source]
        source: NvmlError,
    },
}

/// Discovers the GPUs of this node: the simulated inventory `simulate` when
/// given, else the devices NVML reports.
pub fn discover(
    simulate: Option<&str>,
    node_name: &str,
    catalog: &Catalog,
) -> Result<Vec<DiscoveredGpu>, DiscoveryError> {
    match simulate {
        Some(spec) => simulated_gpus(spec, node_name, catalog),
        None => nvml_gpus(catalog),
    }
}

/// True when an NVIDIA driver answers through NVML.
pub fn nvml_available() -> bool {
    nvml_wrapper::Nvml::init().is_ok()
}

/// The GPUs of a simulated inventory: indices `0..n` across the whole spec
/// in order, memory and vendor from the catalog, UUIDs derived from the node
/// name and the index.
pub fn simulated_gpus(
    spec: &str,
    node_name: &str,
    catalog: &Catalog,
) -> Result<Vec<DiscoveredGpu>, DiscoveryError> {
    let parsed = parse_simulated_gpus(spec, catalog).map_err(DiscoveryError::InvalidSpec)?;
    let mut gpus = Vec::new();
    let mut index = 0u32;
    for entry in parsed {
        let model = catalog.get(&entry.model).ok_or_else(|| {
            DiscoveryError::InvalidSpec(FieldError::new(
                "simulate_gpus",
                format!("unknown GPU model `{}`", entry.model),
            ))
        })?;
        for _ in 0..entry.count {
            gpus.push(DiscoveredGpu {
                index,
                model: model.name.clone(),
                uuid: simulated_uuid(node_name, index),
                memory_mib: u64::from(model.memory_gib) * 1024,
                vendor: model.vendor,
                // Parsing allowed `:mig` only on models with a MIG geometry,
                // so the simulated GPU offers that model's profiles.
                mig_mode: entry.mig,
            });
            index += 1;
        }
    }
    Ok(gpus)
}

/// A stable, UUID-shaped device id for simulated GPU `index` of `node_name`
/// (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`).
pub fn simulated_uuid(node_name: &str, index: u32) -> String {
    let key = format!("flotilla-simulated-gpu/{node_name}/{index}");
    let hi = fnv1a64(key.as_bytes(), 0xcbf2_9ce4_8422_2325);
    let lo = fnv1a64(key.as_bytes(), 0x84222325_cbf29ce4);
    let hex = format!("{hi:016x}{lo:016x}");
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// FNV-1a with a caller-chosen offset basis, finished with a mixing step so
/// that near-identical keys spread over all bits. Stable across Rust
/// releases, unlike `DefaultHasher`.
fn fnv1a64(bytes: &[u8], basis: u64) -> u64 {
    let mut h = basis;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // splitmix64 finaliser.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// Maps an NVML error to [`DiscoveryError::Nvml`] naming what was asked.
fn query(what: impl Into<String>) -> impl FnOnce(NvmlError) -> DiscoveryError {
    let what = what.into();
    move |source| DiscoveryError::Nvml { what, source }
}

fn nvml_gpus(catalog: &Catalog) -> Result<Vec<DiscoveredGpu>, DiscoveryError> {
    let nvml = nvml_wrapper::Nvml::init().map_err(DiscoveryError::NvmlUnavailable)?;
    let count = nvml.device_count().map_err(query("counting devices"))?;
    let mut gpus = Vec::new();
    for index in 0..count {
        let device = nvml
            .device_by_index(index)
            .map_err(query(format!("opening device {index}")))?;
        let name = device
            .name()
            .map_err(query(format!("reading the name of device {index}")))?;
        let uuid = device
            .uuid()
            .map_err(query(format!("reading the uuid of device {index}")))?;
        let memory_mib = device
            .memory_info()
            .map_err(query(format!("reading the memory of device {index}")))?
            .total
            / (1024 * 1024);
        let (mig_mode, mig_devices) = nvml_mig(&device);
        if mig_mode {
            tracing::info!(
                index,
                mig_devices = ?mig_devices,
                "gpu is in MIG mode: it takes MIG profiles only"
            );
        }
        match catalog.match_device(&name, memory_mib) {
            Some(model) => gpus.push(DiscoveredGpu {
                index,
                model: model.name.clone(),
                uuid,
                memory_mib,
                vendor: model.vendor,
                mig_mode,
            }),
            None => tracing::warn!(
                index,
                device = %name,
                memory_mib,
                "skipping gpu of a model the catalog does not know"
            ),
        }
    }
    if gpus.is_empty() {
        tracing::warn!(devices = count, "nvml reports no usable gpu on this node");
    }
    Ok(gpus)
}

/// NVML's value of a current MIG mode that is on (`NVML_DEVICE_MIG_ENABLE`).
const NVML_MIG_ENABLED: u32 = 1;

/// A GPU's MIG state as NVML reports it: whether MIG mode is on now (not
/// merely pending a reset), and the UUIDs of the MIG devices that exist on
/// it. A GPU or driver without MIG support reports off and none; reading
/// never changes the mode.
fn nvml_mig(device: &nvml_wrapper::Device<'_>) -> (bool, Vec<String>) {
    let on = device
        .mig_mode()
        .is_ok_and(|m| m.current == NVML_MIG_ENABLED);
    if !on {
        return (false, Vec::new());
    }
    let slots = device.mig_device_count().unwrap_or(0);
    let devices = (0..slots)
        .filter_map(|i| device.mig_device_by_index(i).ok())
        .filter_map(|d| d.uuid().ok())
        .collect();
    (true, devices)
}

/// CPU capacity of this host in milli-cores.
pub fn host_cpu_milli() -> u64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    u64::try_from(cores).unwrap_or(1).saturating_mul(1000)
}

/// Memory capacity of this host in MiB (`MemTotal` of `/proc/meminfo`,
/// 16 GiB when it cannot be read).
pub fn host_memory_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| parse_mem_total_mib(&text))
        .unwrap_or(FALLBACK_MEMORY_MIB)
}

fn parse_mem_total_mib(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line["MemTotal:".len()..].split_whitespace();
    let value: u64 = words.next()?.parse().ok()?;
    let factor_kib = match words.next().map(str::to_ascii_lowercase).as_deref() {
        Some("kb") | None => 1,
        Some("mb") => 1024,
        Some("gb") => 1024 * 1024,
        Some(_) => return None,
    };
    Some(value.saturating_mul(factor_kib) / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_core::catalog::Vendor;

    #[test]
    fn simulated_spec_numbers_gpus_across_the_whole_spec() {
        let c = Catalog::default();
        let gpus = discover(Some("2xH100, 1xMI300X,l40s"), "node-a", &c).unwrap();
        let summary: Vec<(u32, &str, u64, Vendor)> = gpus
            .iter()
            .map(|g| (g.index, g.model.as_str(), g.memory_mib, g.vendor))
            .collect();
        assert_eq!(
            summary,
            vec![
                (0, "H100", 80 * 1024, Vendor::Nvidia),
                (1, "H100", 80 * 1024, Vendor::Nvidia),
                (2, "MI300X", 192 * 1024, Vendor::Amd),
                (3, "L40S", 48 * 1024, Vendor::Nvidia),
            ]
        );
    }

    #[test]
    fn simulated_uuids_are_stable_distinct_and_well_formed() {
        let c = Catalog::default();
        let a = simulated_gpus("4xH100", "node-a", &c).unwrap();
        let again = simulated_gpus("4xH100", "node-a", &c).unwrap();
        let b = simulated_gpus("4xH100", "node-b", &c).unwrap();
        assert_eq!(a, again, "same node, same uuids");
        let mut all: Vec<&str> = a.iter().chain(&b).map(|g| g.uuid.as_str()).collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 8, "uuids differ across indices and nodes");
        for g in &a {
            let parts: Vec<&str> = g.uuid.split('-').collect();
            assert_eq!(parts[0], "GPU");
            let lens: Vec<usize> = parts[1..].iter().map(|p| p.len()).collect();
            assert_eq!(lens, vec![8, 4, 4, 4, 12], "{}", g.uuid);
            assert!(parts[1..].iter().all(|p| p
                .chars()
                .all(|ch| ch.is_ascii_hexdigit() && !ch.is_ascii_uppercase())));
        }
    }

    #[test]
    fn simulated_mig_mode_is_per_entry() {
        let c = Catalog::default();
        let gpus = discover(Some("1xH100:mig,1xH100"), "node-a", &c).unwrap();
        let modes: Vec<(u32, bool)> = gpus.iter().map(|g| (g.index, g.mig_mode)).collect();
        assert_eq!(modes, vec![(0, true), (1, false)]);
    }

    #[test]
    fn bad_specs_are_rejected_with_the_field() {
        let c = Catalog::default();
        for spec in ["", "0xH100", "4xNOPE", "99xH100", "1xL40S:mig"] {
            match discover(Some(spec), "n", &c) {
                Err(DiscoveryError::InvalidSpec(e)) => assert_eq!(e.field, "simulate_gpus"),
                other => panic!("{spec:?}: expected InvalidSpec, got {other:?}"),
            }
        }
    }

    #[test]
    fn meminfo_parses() {
        let text = "MemTotal:       32768000 kB\nMemFree: 1 kB\n";
        assert_eq!(parse_mem_total_mib(text), Some(32_000));
        assert_eq!(parse_mem_total_mib("nothing here"), None);
        assert!(host_memory_mib() > 0);
        assert!(host_cpu_milli() >= 1000);
    }
}
