//! Nodes and their GPUs, as the control plane sees them.

use serde::{Deserialize, Serialize};

/// Whether a node can take work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    /// Heartbeats arrive; the node takes work unless cordoned.
    Ready,
    /// Heartbeats stopped; its instances are `lost` until the agent returns.
    Unreachable,
}

impl NodeState {
    /// Stable lowercase name, as stored and sent.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ready => "ready",
            Self::Unreachable => "unreachable",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "ready" => Some(Self::Ready),
            "unreachable" => Some(Self::Unreachable),
            _ => None,
        }
    }
}

/// Which engine runs a node's work: Flotilla's own agent, or a cluster
/// engine the fleet already runs (Slurm, Kubernetes) reached through an
/// executor bridge. Placement never looks at it (the decision core never
/// names a backend); operators see it in `flotilla nodes`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ExecutorKind {
    /// Flotilla's node agent.
    #[default]
    Agent,
    /// A Slurm cluster, through `slurmrestd`.
    Slurm,
    /// A Kubernetes cluster, through its API server.
    Kubernetes,
}

impl ExecutorKind {
    /// The name used in configuration, the API and the store.
    pub fn as_str(self) -> &'static str {
        match self {
            ExecutorKind::Agent => "agent",
            ExecutorKind::Slurm => "slurm",
            ExecutorKind::Kubernetes => "kubernetes",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "agent" => Some(ExecutorKind::Agent),
            "slurm" => Some(ExecutorKind::Slurm),
            "kubernetes" => Some(ExecutorKind::Kubernetes),
            _ => None,
        }
    }

    /// Whether this is the default (lets the wire form leave it out).
    pub fn is_agent(&self) -> bool {
        *self == ExecutorKind::Agent
    }
}

impl std::fmt::Display for ExecutorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ExecutorKind::Agent => "the agent",
            ExecutorKind::Slurm => "Slurm",
            ExecutorKind::Kubernetes => "Kubernetes",
        })
    }
}

/// How a node runs workloads: as sandboxed processes or in containers. An
/// agent runs one of the two, so placement sends work with an image only
/// to container nodes and a command only to process nodes.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum RuntimeKind {
    /// Sandboxed processes (the agent's default).
    #[default]
    Process,
    /// Containers through the Docker Engine API.
    Container,
}

impl RuntimeKind {
    /// The name used in configuration, the API and the store.
    pub fn as_str(self) -> &'static str {
        match self {
            RuntimeKind::Process => "process",
            RuntimeKind::Container => "container",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "process" => Some(RuntimeKind::Process),
            "container" => Some(RuntimeKind::Container),
            _ => None,
        }
    }

    /// The runtime that work runs in: a container when it has an image,
    /// else a process.
    pub fn for_work(has_image: bool) -> Self {
        if has_image {
            RuntimeKind::Container
        } else {
            RuntimeKind::Process
        }
    }

    /// Whether this is the default (what an old agent that does not say
    /// registers as); lets the wire form leave it out.
    pub fn is_process(&self) -> bool {
        *self == RuntimeKind::Process
    }
}

impl std::fmt::Display for RuntimeKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for RuntimeKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
            .ok_or_else(|| format!("unknown runtime `{s}` (expected `process` or `container`)"))
    }
}

/// The name of the cgroup (below `flotilla/` of each cgroup tree) that
/// holds the workloads of the agent of node `node` working in `work_dir`:
/// the node's name and a hash of the directory, so that two agents on one
/// host (tests, several nodes) never share one, while a restarted agent
/// (same name, same directory) finds its own. FNV-1a, stable across
/// releases.
pub fn workload_cgroup(node: &str, work_dir: &std::path::Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in work_dir.as_os_str().as_bytes() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{node}-{:08x}", hash & 0xffff_ffff)
}

/// One entry of a simulated inventory: `count` GPUs of `model`, in MIG
/// mode or not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimulatedGpus {
    /// How many.
    pub count: u32,
    /// Canonical catalog model.
    pub model: String,
    /// In MIG mode (`:mig` after the model).
    pub mig: bool,
}

/// Parses a simulated inventory such as `4xH100,2xL40S` or `1xH100:mig`
/// (GPUs in MIG mode; only models with a MIG geometry in the catalog).
pub fn parse_simulated_gpus(
    spec: &str,
    catalog: &crate::catalog::Catalog,
) -> Result<Vec<SimulatedGpus>, crate::FieldError> {
    let field = "simulate_gpus";
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (gpus, mig) = match part.rsplit_once(':') {
            Some((g, mode)) if mode.trim().eq_ignore_ascii_case("mig") => (g.trim(), true),
            Some((_, mode)) => {
                return Err(crate::FieldError::new(
                    field,
                    format!("unknown mode `{mode}` in `{part}`; the only mode is `mig`"),
                ))
            }
            None => (part, false),
        };
        let (count, model) = match gpus.split_once(['x', 'X']) {
            Some((n, m)) if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => {
                let n: u32 = n
                    .parse()
                    .map_err(|_| crate::FieldError::new(field, format!("bad count in `{part}`")))?;
                (n, m)
            }
            _ => (1, gpus),
        };
        if count == 0 || count > 64 {
            return Err(crate::FieldError::new(
                field,
                format!("count in `{part}` must be between 1 and 64"),
            ));
        }
        let model = catalog.resolve(model, field)?;
        if mig
            && catalog
                .get(&model)
                .is_some_and(|m| m.mig_geometry.is_none())
        {
            return Err(crate::FieldError::new(
                field,
                format!("{model} has no MIG geometry in the catalog: `:mig` is not possible"),
            ));
        }
        out.push(SimulatedGpus { count, model, mig });
    }
    if out.is_empty() {
        return Err(crate::FieldError::new(
            field,
            "expected e.g. 4xH100,2xL40S or 1xH100:mig",
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_cgroups_differ_per_work_dir_and_stay_stable() {
        let a = workload_cgroup("n0", std::path::Path::new("/tmp/home-a/agent"));
        assert_eq!(
            a,
            workload_cgroup("n0", std::path::Path::new("/tmp/home-a/agent"))
        );
        assert_ne!(
            a,
            workload_cgroup("n0", std::path::Path::new("/tmp/home-b/agent"))
        );
        assert_eq!(
            workload_cgroup("gpu-01", std::path::Path::new("")),
            "gpu-01-84222325"
        );
        assert!(a.starts_with("n0-") && a.len() == "n0-".len() + 8, "{a}");
    }
    use crate::catalog::Catalog;

    #[test]
    fn simulated_inventory_parses() {
        let c = Catalog::default();
        let g = |count, model: &str, mig| SimulatedGpus {
            count,
            model: model.into(),
            mig,
        };
        assert_eq!(
            parse_simulated_gpus("4xH100, 2xl40s,T4", &c).unwrap(),
            vec![g(4, "H100", false), g(2, "L40S", false), g(1, "T4", false)]
        );
        assert_eq!(
            parse_simulated_gpus("1xH100:mig,2xA100-40GB:MIG,H200", &c).unwrap(),
            vec![
                g(1, "H100", true),
                g(2, "A100-40GB", true),
                g(1, "H200", false)
            ]
        );
        assert!(parse_simulated_gpus("1xL40S:mig", &c).is_err());
        assert!(parse_simulated_gpus("1xH100:fast", &c).is_err());
        assert!(parse_simulated_gpus("0xH100", &c).is_err());
        assert!(parse_simulated_gpus("4xNOPE", &c).is_err());
        assert!(parse_simulated_gpus("", &c).is_err());
    }

    /// Agents from before executors existed send no `executor` and still
    /// register as agents; agents leave it out, so older servers (whose
    /// registration refuses unknown fields) still take them; a bridge's
    /// node says which engine it is.
    #[test]
    fn registrations_without_an_executor_are_agents() {
        use crate::api::RegisterNode;
        let old = serde_json::json!({
            "name": "n1", "cpu_milli": 1000, "memory_mb": 1024,
            "simulated": true, "gpus": []
        });
        let r: RegisterNode = serde_json::from_value(old).unwrap();
        assert_eq!(r.executor, ExecutorKind::Agent);
        let back = serde_json::to_value(&r).unwrap();
        assert!(back.get("executor").is_none(), "{back}");
        let slurm = RegisterNode {
            executor: ExecutorKind::Slurm,
            ..r
        };
        let v = serde_json::to_value(&slurm).unwrap();
        assert_eq!(v["executor"], "slurm");
        let bad = serde_json::json!({
            "name": "n1", "cpu_milli": 1, "memory_mb": 1, "simulated": true,
            "gpus": [], "executor": "nomad"
        });
        assert!(serde_json::from_value::<RegisterNode>(bad).is_err());
        for k in [
            ExecutorKind::Agent,
            ExecutorKind::Slurm,
            ExecutorKind::Kubernetes,
        ] {
            assert_eq!(ExecutorKind::parse(k.as_str()), Some(k));
        }
    }
}
