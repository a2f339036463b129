//! Kubernetes nodes as Flotilla registers them: allocatable CPU, memory and
//! GPUs (the NVIDIA device plugin's `nvidia.com/gpu` and, under its mixed
//! MIG strategy, `nvidia.com/mig-<profile>`), read with the labels GPU
//! feature discovery puts on each node (`nvidia.com/gpu.product`,
//! `nvidia.com/gpu.memory`, `nvidia.com/gpu.count`, `nvidia.com/mig.strategy`).
//! Pure: a `Node` object in, a `RegisterNode` out.

use std::collections::BTreeMap;

use flotilla_core::api::{DiscoveredGpu, RegisterNode};
use flotilla_core::catalog::{Catalog, Vendor};
use flotilla_core::node::{ExecutorKind, RuntimeKind};
use k8s_openapi::api::core::v1::Node;

use super::quantity;
use super::KubeConfig;

/// The device plugin's whole-GPU resource.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// Prefix of the device plugin's MIG resources (mixed strategy).
pub const MIG_RESOURCE_PREFIX: &str = "nvidia.com/mig-";
/// GFD: the GPU's product name (`NVIDIA-H100-80GB-HBM3`).
pub const LABEL_PRODUCT: &str = "nvidia.com/gpu.product";
/// GFD: memory of one GPU in MiB.
pub const LABEL_MEMORY: &str = "nvidia.com/gpu.memory";
/// GFD: number of physical GPUs (of MIG devices under the single strategy).
pub const LABEL_COUNT: &str = "nvidia.com/gpu.count";
/// GFD: the MIG strategy (`single` or `mixed`).
pub const LABEL_MIG_STRATEGY: &str = "nvidia.com/mig.strategy";
/// GFD: replicas of each GPU under time-slicing.
pub const LABEL_REPLICAS: &str = "nvidia.com/gpu.replicas";
/// Where a node's region comes from when the pool does not say.
pub const LABEL_REGION: &str = "topology.kubernetes.io/region";

/// The version Flotilla registers engine nodes with: it names the bridge,
/// not an agent binary.
pub const AGENT_VERSION: &str = concat!("kubernetes-executor/", env!("CARGO_PKG_VERSION"));

/// Why a node is left out of the inventory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// Its `Ready` condition is not `True`: the kubelet does not run pods.
    NotReady,
    /// It has no name (never happens with a real API server).
    Unnamed,
}

/// The node as Flotilla registers it, or why it is left out.
pub fn register(node: &Node, config: &KubeConfig, catalog: &Catalog) -> Result<RegisterNode, Skip> {
    let name = node.metadata.name.clone().ok_or(Skip::Unnamed)?;
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "True");
    if !ready {
        return Err(Skip::NotReady);
    }
    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    let allocatable: BTreeMap<&str, &str> = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .map(|a| a.iter().map(|(k, v)| (k.as_str(), v.0.as_str())).collect())
        .unwrap_or_default();
    let cpu_milli = allocatable
        .get("cpu")
        .and_then(|q| quantity::milli(q))
        .and_then(|m| u64::try_from(m).ok())
        .unwrap_or(0);
    let memory_mb = allocatable
        .get("memory")
        .and_then(|q| quantity::milli(q))
        .map(|m| m / 1000 / (1 << 20))
        .and_then(|m| u64::try_from(m).ok())
        .unwrap_or(0);
    let pool = labels
        .get(&config.pool_label)
        .cloned()
        .or_else(|| config.default_pool.clone());
    let region = config
        .region
        .clone()
        .or_else(|| labels.get(LABEL_REGION).cloned());
    Ok(RegisterNode {
        gpus: gpus(&name, labels, &allocatable, catalog),
        name,
        region,
        pool,
        cpu_milli,
        memory_mb,
        simulated: false,
        agent_version: AGENT_VERSION.to_string(),
        runtime: RuntimeKind::Container,
        executor: ExecutorKind::Kubernetes,
        running: vec![],
        unenforced_limits: Vec::new(),
        network: None,
    })
}

/// The node's physical GPUs. Kubernetes does not say which device is which
/// (the device plugin picks devices when a pod starts), so the UUIDs are
/// stable names made of the node and an index, and placement's choice of
/// indices becomes a count in the pod's limits.
///
/// - No MIG (or the `none` strategy): `nvidia.com/gpu` allocatable GPUs,
///   divided by `nvidia.com/gpu.replicas` under time-slicing (each replica
///   is a share of one physical GPU).
/// - Mixed strategy: `nvidia.com/gpu` counts the GPUs outside MIG mode;
///   the rest of `nvidia.com/gpu.count` are in MIG mode (their slices are
///   the `nvidia.com/mig-<profile>` resources).
/// - Single strategy: every GPU is in MIG mode; `nvidia.com/gpu` counts
///   MIG devices of the one profile named at the end of the product label
///   (`A100-SXM4-40GB-MIG-1g.5gb`), so the GPUs are that count divided by
///   how many of the profile fit one GPU.
fn gpus(
    node: &str,
    labels: &BTreeMap<String, String>,
    allocatable: &BTreeMap<&str, &str>,
    catalog: &Catalog,
) -> Vec<DiscoveredGpu> {
    let allocatable_gpus = allocatable
        .get(GPU_RESOURCE)
        .and_then(|q| quantity::count(q))
        .unwrap_or(0);
    let mig_devices: u64 = allocatable
        .iter()
        .filter(|(k, _)| k.starts_with(MIG_RESOURCE_PREFIX))
        .filter_map(|(_, q)| quantity::count(q))
        .sum();
    if allocatable_gpus == 0 && mig_devices == 0 {
        return vec![];
    }
    let Some(product) = labels.get(LABEL_PRODUCT) else {
        tracing::warn!(node, "GPUs without the nvidia.com/gpu.product label (is GPU feature discovery running?): left out");
        return vec![];
    };
    let label_count = labels.get(LABEL_COUNT).and_then(|c| c.parse::<u64>().ok());
    let label_memory = labels.get(LABEL_MEMORY).and_then(|c| c.parse::<u64>().ok());

    // The product without a single-strategy MIG suffix names the model.
    let (base_product, single_profile) = match product.split_once("-MIG-") {
        Some((base, profile)) => (base, Some(profile)),
        None => (product.as_str(), None),
    };
    // Under the single strategy the memory label is one MIG device's, so
    // the size in the product name (`A100-SXM4-80GB`) breaks the A100 tie.
    let named_memory = base_product
        .split('-')
        .find_map(|w| w.strip_suffix("GB").and_then(|n| n.parse::<u64>().ok()))
        .map(|gb| gb * 1024);
    let memory_hint = match single_profile {
        Some(_) => named_memory.unwrap_or(0),
        None => label_memory.or(named_memory).unwrap_or(0),
    };
    let Some(model) = catalog.match_device(base_product, memory_hint) else {
        tracing::warn!(node, product = %product, "GPU model not in the catalog: left out");
        return vec![];
    };
    let memory_mib = match (single_profile, label_memory) {
        (None, Some(m)) if m > 0 => m,
        _ => u64::from(model.memory_gib) * 1024,
    };

    // `nvidia.com/mig.strategy=single` is set cluster-wide by the GPU
    // operator, also on nodes whose GPUs are not in MIG mode: only the
    // product's MIG suffix says the node's GPUs are partitioned.
    let (whole, mig): (u64, u64) = if single_profile.is_some() {
        let per_gpu = single_profile
            .and_then(|p| {
                let g = model.mig_geometry.as_ref()?;
                g.profile(p).map(|prof| u64::from(g.max_instances(prof)))
            })
            .filter(|n| *n > 0)
            .unwrap_or(1);
        (0, allocatable_gpus.div_ceil(per_gpu))
    } else if mig_devices > 0 {
        // At least as many GPUs as the slices on offer fill (7 compute
        // slices each), more when GFD counts more.
        let slices: u64 = allocatable
            .iter()
            .filter_map(|(k, q)| {
                let profile = k.strip_prefix(MIG_RESOURCE_PREFIX)?;
                let g = model.mig_geometry.as_ref()?;
                let p = g.profile(profile)?;
                Some(u64::from(p.compute_slices) * quantity::count(q)?)
            })
            .sum();
        let by_slices = slices
            .div_ceil(u64::from(flotilla_core::catalog::MIG_COMPUTE_SLICES))
            .max(1);
        let by_label = label_count.unwrap_or(0).saturating_sub(allocatable_gpus);
        (allocatable_gpus, by_slices.max(by_label))
    } else {
        let replicas = labels
            .get(LABEL_REPLICAS)
            .and_then(|r| r.parse::<u64>().ok())
            .filter(|r| *r > 0)
            .unwrap_or(1);
        (allocatable_gpus / replicas, 0)
    };

    (0..whole + mig)
        .map(|i| DiscoveredGpu {
            index: u32::try_from(i).unwrap_or(u32::MAX),
            model: model.name.clone(),
            uuid: format!("k8s-{node}-gpu{i}"),
            memory_mib,
            vendor: Vendor::Nvidia,
            mig_mode: i >= whole,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeCondition, NodeStatus};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn node(labels: &[(&str, &str)], alloc: &[(&str, &str)], ready: &str) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some("n1".into());
        n.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        n.status = Some(NodeStatus {
            allocatable: Some(
                alloc
                    .iter()
                    .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
                    .collect(),
            ),
            conditions: Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: ready.into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        n
    }

    #[test]
    fn time_sliced_replicas_count_once() {
        let n = node(
            &[
                (LABEL_PRODUCT, "NVIDIA-L4"),
                (LABEL_MEMORY, "23034"),
                (LABEL_REPLICAS, "4"),
                (LABEL_COUNT, "2"),
            ],
            &[("cpu", "16"), ("memory", "64Gi"), (GPU_RESOURCE, "8")],
            "True",
        );
        let r = register(&n, &KubeConfig::default(), &Catalog::default()).unwrap();
        assert_eq!(r.gpus.len(), 2);
        assert_eq!(r.gpus[0].model, "L4");
        assert_eq!(r.cpu_milli, 16_000);
        assert_eq!(r.memory_mb, 64 * 1024);
    }

    #[test]
    fn single_strategy_counts_gpus_from_mig_devices() {
        let n = node(
            &[
                (LABEL_PRODUCT, "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"),
                (LABEL_MEMORY, "4864"),
                (LABEL_COUNT, "14"),
                (LABEL_MIG_STRATEGY, "single"),
            ],
            &[(GPU_RESOURCE, "14")],
            "True",
        );
        let r = register(&n, &KubeConfig::default(), &Catalog::default()).unwrap();
        assert_eq!(r.gpus.len(), 2, "14 x 1g.5gb = 2 A100s");
        assert!(r.gpus.iter().all(|g| g.mig_mode && g.model == "A100-40GB"));
        assert_eq!(r.gpus[0].memory_mib, 40 * 1024);
    }

    #[test]
    fn not_ready_and_unknown_models_are_left_out() {
        let n = node(&[], &[("cpu", "4")], "Unknown");
        assert_eq!(
            register(&n, &KubeConfig::default(), &Catalog::default()).unwrap_err(),
            Skip::NotReady
        );
        let n = node(
            &[(LABEL_PRODUCT, "Quadro-RTX-8000")],
            &[(GPU_RESOURCE, "2")],
            "True",
        );
        let r = register(&n, &KubeConfig::default(), &Catalog::default()).unwrap();
        assert!(r.gpus.is_empty());
    }
}
