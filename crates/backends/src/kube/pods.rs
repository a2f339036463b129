//! What the executor writes to Kubernetes, built without I/O: a Pod for an
//! assignment (pinned to the placed node, GPU limits, the tenant's image,
//! command and environment) and each tenant's namespace with its
//! ResourceQuota and NetworkPolicy.

use std::collections::BTreeMap;

use flotilla_core::api::Assignment;
use flotilla_core::id::{InstanceId, TenantId};
use flotilla_core::instance::SCRATCH_DIR;
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, LocalObjectReference,
    Namespace, Pod, PodSecurityContext, PodSpec, ResourceQuota, ResourceQuotaSpec,
    ResourceRequirements, SeccompProfile, Secret, SecurityContext, Toleration, Volume, VolumeMount,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    LabelSelector, LabelSelectorRequirement, ObjectMeta,
};

use super::inventory::{GPU_RESOURCE, MIG_RESOURCE_PREFIX};
use super::{KubeConfig, Pinning};

/// Label on everything the executor creates; the watch selects on it.
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// Value of [`LABEL_MANAGED_BY`].
pub const MANAGED_BY: &str = "flotilla";
/// The instance a pod runs (ids are valid label values: lowercase, `_`).
pub const LABEL_INSTANCE: &str = "flotilla.dev/instance";
/// The tenant that owns a pod or namespace.
pub const LABEL_TENANT: &str = "flotilla.dev/tenant";
/// The job a member pod belongs to.
pub const LABEL_JOB: &str = "flotilla.dev/job";
/// The job member's rank.
pub const LABEL_RANK: &str = "flotilla.dev/rank";
/// The job attempt a member pod was started for.
pub const LABEL_ATTEMPT: &str = "flotilla.dev/attempt";
/// The one container of a Flotilla pod.
pub const CONTAINER: &str = "main";
/// Name of each tenant namespace's quota and network policy.
pub const TENANCY_OBJECT: &str = "flotilla-tenant";
/// The selector the executor's watch uses.
pub fn managed_selector() -> String {
    format!("{LABEL_MANAGED_BY}={MANAGED_BY}")
}

/// The pod of an instance: `flotilla-inst-…` (a DNS label: ids are
/// lowercase ULIDs with one `_`).
pub fn pod_name(id: &InstanceId) -> String {
    format!("flotilla-{}", id.as_str().replace('_', "-"))
}

/// The namespace of a tenant's work; work without a tenant (from servers
/// that do not send one) goes to the configured shared namespace.
pub fn namespace_for(tenant: Option<&TenantId>, config: &KubeConfig) -> String {
    match tenant {
        Some(t) => format!(
            "{}{}",
            config.namespace_prefix,
            t.as_str().replace('_', "-")
        ),
        None => config.shared_namespace.clone(),
    }
}

/// Why an assignment cannot become a pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PodError {
    /// Kubernetes runs images; the assignment has none.
    #[error("assignment has no image: Kubernetes nodes run containers only")]
    NoImage,
}

/// The pod for `a` on `node` in `namespace`.
///
/// Placement chose the node and how much of its GPUs: the pod is pinned
/// there (`nodeName`, bypassing the Kubernetes scheduler so Flotilla's
/// decision stands, or a hostname `nodeSelector` when configured) and asks
/// the device plugin for that many GPUs (`nvidia.com/gpu`) or MIG devices
/// (`nvidia.com/mig-<profile>`). Which physical devices it gets is the
/// device plugin's choice: Kubernetes has no way to name them.
pub fn pod_for(
    a: &Assignment,
    node: &str,
    namespace: &str,
    config: &KubeConfig,
) -> Result<Pod, PodError> {
    let image = a.image.as_ref().ok_or(PodError::NoImage)?;
    let mut labels = BTreeMap::from([
        (LABEL_MANAGED_BY.to_string(), MANAGED_BY.to_string()),
        (
            LABEL_INSTANCE.to_string(),
            a.instance_id.as_str().to_string(),
        ),
    ]);
    if let Some(t) = &a.tenant_id {
        labels.insert(LABEL_TENANT.into(), t.as_str().into());
    }
    if let Some(job) = a.env.get("FLOTILLA_JOB_ID") {
        labels.insert(LABEL_JOB.into(), job.clone());
    }
    if let Some(rank) = a.env.get("FLOTILLA_JOB_RANK") {
        labels.insert(LABEL_RANK.into(), rank.clone());
    }
    if let Some(attempt) = a.env.get("FLOTILLA_JOB_ATTEMPT") {
        labels.insert(LABEL_ATTEMPT.into(), attempt.clone());
    }

    let mut limits: BTreeMap<String, Quantity> = BTreeMap::new();
    let mut requests: BTreeMap<String, Quantity> = BTreeMap::new();
    let mig: Vec<&str> = a
        .gpu_slices
        .iter()
        .filter_map(|s| s.mig_profile.as_deref())
        .collect();
    if !mig.is_empty() {
        for profile in mig {
            let key = format!("{MIG_RESOURCE_PREFIX}{profile}");
            let n = limits
                .get(&key)
                .and_then(|q| q.0.parse::<u64>().ok())
                .unwrap_or(0);
            limits.insert(key, Quantity((n + 1).to_string()));
        }
    } else if !a.gpu_indices.is_empty() {
        // A fraction of a GPU asks for one device-plugin GPU: under
        // time-slicing that is one replica, a share of a physical GPU.
        limits.insert(
            GPU_RESOURCE.into(),
            Quantity(a.gpu_indices.len().to_string()),
        );
    }
    if let Some(cpu) = a.cpu_milli {
        limits.insert("cpu".into(), Quantity(format!("{cpu}m")));
        requests.insert("cpu".into(), Quantity(format!("{cpu}m")));
    }
    if let Some(mem) = a.memory_mb {
        limits.insert("memory".into(), Quantity(format!("{mem}Mi")));
        requests.insert("memory".into(), Quantity(format!("{mem}Mi")));
    }

    let mut env: Vec<EnvVar> = a
        .env
        .iter()
        .map(|(k, v)| EnvVar {
            name: k.clone(),
            value: Some(v.clone()),
            ..Default::default()
        })
        .collect();
    for (k, v) in [
        ("FLOTILLA_INSTANCE_ID", a.instance_id.as_str()),
        ("HOME", SCRATCH_DIR),
    ] {
        if !a.env.contains_key(k) {
            env.push(EnvVar {
                name: k.into(),
                value: Some(v.into()),
                ..Default::default()
            });
        }
    }

    let container = Container {
        name: CONTAINER.into(),
        image: Some(image.image.clone()),
        // Like the agent's `Cmd`: the command replaces the image's
        // arguments, its entrypoint stays.
        args: (!a.command.is_empty()).then(|| a.command.clone()),
        env: Some(env),
        working_dir: Some(a.workdir.clone().unwrap_or_else(|| SCRATCH_DIR.into())),
        ports: (!image.ports.is_empty()).then(|| {
            image
                .ports
                .iter()
                .map(|p| ContainerPort {
                    container_port: i32::from(*p),
                    protocol: Some("TCP".into()),
                    ..Default::default()
                })
                .collect()
        }),
        resources: Some(ResourceRequirements {
            limits: Some(limits),
            requests: (!requests.is_empty()).then_some(requests),
            ..Default::default()
        }),
        volume_mounts: Some(vec![VolumeMount {
            name: "scratch".into(),
            mount_path: SCRATCH_DIR.into(),
            ..Default::default()
        }]),
        // What the agent's sandbox grants: nothing beyond the image's user.
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };

    let (node_name, node_selector) = match config.pinning {
        Pinning::NodeName => (Some(node.to_string()), None),
        Pinning::HostnameSelector => (
            None,
            Some(BTreeMap::from([(
                "kubernetes.io/hostname".to_string(),
                node.to_string(),
            )])),
        ),
    };
    let grace_s = i64::try_from(a.stop_grace_ms.div_ceil(1000)).unwrap_or(i64::MAX);
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(pod_name(&a.instance_id)),
            namespace: Some(namespace.into()),
            labels: Some(labels),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![container],
            node_name,
            node_selector,
            // Flotilla decides restarts (a job's attempt, an endpoint's
            // replica): the kubelet must not restart behind its back.
            restart_policy: Some("Never".into()),
            termination_grace_period_seconds: Some(grace_s),
            // Tenant work gets no Kubernetes API credentials.
            automount_service_account_token: Some(false),
            security_context: Some(PodSecurityContext {
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            enable_service_links: Some(false),
            image_pull_secrets: a.registry_auth.as_ref().map(|_| {
                vec![LocalObjectReference {
                    name: pod_name(&a.instance_id),
                }]
            }),
            // GPU nodes are usually tainted so that only GPU work lands
            // there; this is GPU work.
            tolerations: Some(vec![Toleration {
                key: Some(GPU_RESOURCE.into()),
                operator: Some("Exists".into()),
                effect: Some("NoSchedule".into()),
                ..Default::default()
            }]),
            volumes: Some(vec![Volume {
                name: "scratch".into(),
                empty_dir: Some(EmptyDirVolumeSource {
                    size_limit: image.scratch_mb.map(|mb| Quantity(format!("{mb}Mi"))),
                    ..Default::default()
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    })
}

/// The image pull secret of an instance whose tenant stored a registry
/// login: a `kubernetes.io/dockerconfigjson` secret named like its pod.
/// The kubelet reads `username` and `password` directly, so no `auth`
/// field (and no base64 of our own) is needed.
pub fn pull_secret(a: &Assignment, namespace: &str) -> Option<Secret> {
    let auth = a.registry_auth.as_ref()?;
    let config = serde_json::json!({
        "auths": { auth.registry.clone(): { "username": auth.username, "password": auth.secret } }
    });
    Some(Secret {
        metadata: ObjectMeta {
            name: Some(pod_name(&a.instance_id)),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([
                (LABEL_MANAGED_BY.to_string(), MANAGED_BY.to_string()),
                (
                    LABEL_INSTANCE.to_string(),
                    a.instance_id.as_str().to_string(),
                ),
            ])),
            ..Default::default()
        },
        type_: Some("kubernetes.io/dockerconfigjson".into()),
        string_data: Some(BTreeMap::from([(
            ".dockerconfigjson".to_string(),
            config.to_string(),
        )])),
        ..Default::default()
    })
}

/// A tenant's namespace, labelled so that policies can select it, and
/// under Pod Security admission's `baseline` level: whatever creates pods
/// there (a bug, a person with access), none may be privileged, share the
/// host's namespaces or mount its paths. Flotilla's pods meet it.
pub fn namespace(name: &str, tenant: Option<&TenantId>) -> Namespace {
    let mut labels = BTreeMap::from([
        (LABEL_MANAGED_BY.to_string(), MANAGED_BY.to_string()),
        (
            "pod-security.kubernetes.io/enforce".to_string(),
            "baseline".to_string(),
        ),
    ]);
    if let Some(t) = tenant {
        labels.insert(LABEL_TENANT.into(), t.as_str().into());
    }
    Namespace {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(labels),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Metadata of the objects that fence a tenant's namespace (its quota and
/// network policy): one name, marked as Flotilla's so that it is found
/// and replaced rather than duplicated.
fn tenancy_meta(namespace: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(TENANCY_OBJECT.into()),
        namespace: Some(namespace.into()),
        labels: Some(BTreeMap::from([(
            LABEL_MANAGED_BY.to_string(),
            MANAGED_BY.to_string(),
        )])),
        ..Default::default()
    }
}

/// The namespace's ResourceQuota: a backstop behind Flotilla's own tenant
/// quotas, so that a bug or a hand-made pod cannot take the cluster.
pub fn quota(namespace: &str, config: &KubeConfig) -> ResourceQuota {
    ResourceQuota {
        metadata: tenancy_meta(namespace),
        spec: Some(ResourceQuotaSpec {
            hard: Some(
                config
                    .tenant_quota
                    .iter()
                    .map(|(k, v)| (k.clone(), Quantity(v.clone())))
                    .collect(),
            ),
            ..Default::default()
        }),
        status: None,
    }
}

/// The namespace's NetworkPolicy: ingress to its pods only from pods of
/// the same namespace and from the namespaces the operator lists (where
/// Flotilla's gateway runs); every other namespace, other tenants
/// included, is denied. Egress is left alone (images, datasets).
pub fn network_policy(namespace: &str, config: &KubeConfig) -> NetworkPolicy {
    let mut from = vec![NetworkPolicyPeer {
        pod_selector: Some(LabelSelector::default()),
        ..Default::default()
    }];
    if !config.ingress_from_namespaces.is_empty() {
        from.push(NetworkPolicyPeer {
            namespace_selector: Some(LabelSelector {
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: "kubernetes.io/metadata.name".into(),
                    operator: "In".into(),
                    values: Some(config.ingress_from_namespaces.clone()),
                }]),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    NetworkPolicy {
        metadata: tenancy_meta(namespace),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector::default()),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: Some(from),
                ..Default::default()
            }]),
            ..Default::default()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_core::api::GpuSlice;
    use flotilla_core::id::GpuId;
    use flotilla_core::instance::ImageSpec;

    fn assignment() -> Assignment {
        Assignment {
            instance_id: InstanceId::parse("inst_01jd3x7k2q9v8m4n6p5r0s1t2w", "id").unwrap(),
            tenant_id: Some(TenantId::parse("ten_01jd3x7k2q9v8m4n6p5r0s1t2w", "t").unwrap()),
            command: vec!["python".into(), "train.py".into()],
            env: BTreeMap::from([("A".to_string(), "1".to_string())]),
            workdir: None,
            gpu_indices: vec![0, 1],
            gpu_uuids: vec!["k8s-n-gpu0".into(), "k8s-n-gpu1".into()],
            gpu_slices: vec![],
            stop: false,
            stop_grace_ms: 10_500,
            image: Some(ImageSpec {
                image: "nvcr.io/nvidia/pytorch:24.05-py3".into(),
                ports: vec![8000],
                scratch_mb: Some(2048),
            }),
            cpu_milli: Some(4000),
            memory_mb: Some(16384),
            registry_auth: None,
            disk_mb: None,
        }
    }

    #[test]
    fn a_pod_asks_for_the_placed_gpus_on_the_placed_node() {
        let p = pod_for(
            &assignment(),
            "gpu-a",
            "flotilla-ten-x",
            &KubeConfig::default(),
        )
        .unwrap();
        let spec = p.spec.unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("gpu-a"));
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(spec.termination_grace_period_seconds, Some(11));
        let c = &spec.containers[0];
        let limits = c.resources.as_ref().unwrap().limits.as_ref().unwrap();
        assert_eq!(limits[GPU_RESOURCE].0, "2");
        assert_eq!(limits["cpu"].0, "4000m");
        assert_eq!(limits["memory"].0, "16384Mi");
        assert_eq!(c.args.as_ref().unwrap(), &["python", "train.py"]);
        assert_eq!(
            p.metadata.labels.unwrap()[LABEL_INSTANCE],
            "inst_01jd3x7k2q9v8m4n6p5r0s1t2w"
        );
    }

    #[test]
    fn mig_slices_become_mig_resources_and_selector_pinning_works() {
        let mut a = assignment();
        a.gpu_indices = vec![0, 0];
        a.gpu_slices = (0..2)
            .map(|_| GpuSlice {
                gpu_id: GpuId::parse("gpu_01jd3x7k2q9v8m4n6p5r0s1t2w", "g").unwrap(),
                milli: 142,
                mig_profile: Some("1g.10gb".into()),
                mig_device: None,
                memory_limit_mib: Some(9856),
            })
            .collect();
        let config = KubeConfig {
            pinning: Pinning::HostnameSelector,
            ..KubeConfig::default()
        };
        let p = pod_for(&a, "gpu-b", "ns", &config).unwrap();
        let spec = p.spec.unwrap();
        assert_eq!(spec.node_name, None);
        assert_eq!(
            spec.node_selector.unwrap()["kubernetes.io/hostname"],
            "gpu-b"
        );
        let limits = spec.containers[0]
            .resources
            .clone()
            .unwrap()
            .limits
            .unwrap();
        assert_eq!(limits["nvidia.com/mig-1g.10gb"].0, "2");
        assert!(!limits.contains_key(GPU_RESOURCE));
    }

    #[test]
    fn no_image_is_refused() {
        let mut a = assignment();
        a.image = None;
        assert_eq!(
            pod_for(&a, "n", "ns", &KubeConfig::default()).unwrap_err(),
            PodError::NoImage
        );
    }

    #[test]
    fn the_policy_admits_only_its_namespace_and_the_listed_ones() {
        let config = KubeConfig {
            ingress_from_namespaces: vec!["flotilla".into()],
            ..KubeConfig::default()
        };
        let np = network_policy("flotilla-ten-x", &config);
        let spec = np.spec.unwrap();
        assert_eq!(spec.policy_types.unwrap(), vec!["Ingress"]);
        let from = spec.ingress.unwrap()[0].from.clone().unwrap();
        assert_eq!(from.len(), 2);
        assert!(from[0].namespace_selector.is_none());
        assert_eq!(
            from[1]
                .namespace_selector
                .as_ref()
                .unwrap()
                .match_expressions
                .as_ref()
                .unwrap()[0]
                .values
                .as_ref()
                .unwrap(),
            &vec!["flotilla".to_string()]
        );
    }
}
