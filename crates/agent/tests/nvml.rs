//! Discovery through a real NVIDIA driver.
//!
//! CI machines have no GPU, so this test skips (with a message) when NVML
//! does not answer. Set `FLOTILLA_REQUIRE_NVML=1` on a GPU machine to turn
//! the skip into a failure, so a run there cannot pass by skipping.

use flotilla_agent::{discover, nvml_available};
use flotilla_core::catalog::Catalog;

fn nvml_required() -> bool {
    std::env::var("FLOTILLA_REQUIRE_NVML").is_ok_and(|v| v == "1")
}

#[test]
fn real_gpus_are_discovered_and_matched_to_the_catalog() {
    if !nvml_available() {
        assert!(
            !nvml_required(),
            "FLOTILLA_REQUIRE_NVML=1 but no NVIDIA driver answers through NVML"
        );
        eprintln!("skipping: no NVIDIA driver answers through NVML on this machine");
        return;
    }
    let catalog = Catalog::default();
    let gpus = discover(None, "nvml-test-node", &catalog).expect("NVML discovery");
    assert!(!gpus.is_empty(), "NVML answers but no GPU was matched");
    for (i, gpu) in gpus.iter().enumerate() {
        eprintln!(
            "gpu {}: {} {} MiB {} mig_mode={}",
            gpu.index, gpu.model, gpu.memory_mib, gpu.uuid, gpu.mig_mode
        );
        let model = catalog
            .get(&gpu.model)
            .unwrap_or_else(|| panic!("gpu {i}: model {} not in the catalog", gpu.model));
        assert!(
            gpu.memory_mib > 0,
            "gpu {i}: memory must be read from the device"
        );
        // The driver reports a little less than the marketing size (ECC and
        // reserved memory), never more than 10% off it.
        let nominal = u64::from(model.memory_gib) * 1024;
        assert!(
            gpu.memory_mib * 10 >= nominal * 9 && gpu.memory_mib <= nominal + nominal / 10,
            "gpu {i}: {} MiB is far from the catalog's {nominal} MiB for {}",
            gpu.memory_mib,
            gpu.model
        );
        // MIG mode is reported only where the catalog knows how the model
        // partitions, or placement could not use it.
        assert!(
            !gpu.mig_mode || model.mig_geometry.is_some(),
            "gpu {i}: {} reports MIG mode but the catalog has no MIG geometry for it",
            gpu.model
        );
        assert!(
            gpu.uuid.starts_with("GPU-") || gpu.uuid.starts_with("MIG-"),
            "gpu {i}: uuid {} is not an NVML uuid",
            gpu.uuid
        );
    }
    let mut indices: Vec<u32> = gpus.iter().map(|g| g.index).collect();
    indices.dedup();
    assert_eq!(indices.len(), gpus.len(), "indices must be distinct");
}
