//! `--node-pool` on `flotilla server` and `flotilla up`: node pools the
//! server grows and shrinks through a capacity provider.
//!
//! A pool is one flag of `key=value` pairs:
//! `name=gpu,provider=local,type=2xH100,min=0,max=4,idle=300,boot=600`.
//! `provider=local` starts `flotilla agent` processes on this host with
//! simulated GPUs of the instance type (`2xH100`); `provider=openstack`
//! asks OpenStack Nova for servers of a flavor, with the standard
//! `OS_AUTH_URL`, `OS_USERNAME`, `OS_PASSWORD`, `OS_PROJECT_NAME`,
//! `OS_USER_DOMAIN_NAME`, `OS_PROJECT_DOMAIN_NAME` and `OS_REGION_NAME`
//! variables (an openrc file) and `--openstack-image`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use flotilla_backends::capacity::local::{LocalAgents, LocalAgentsConfig};
use flotilla_backends::capacity::openstack::{Nova, NovaConfig};
use flotilla_backends::capacity::CapacityProvider;
use flotilla_core::node::RuntimeKind;
use flotilla_scale::nodepool::PoolBounds;
use flotilla_server::nodepools::{NodePoolConfig, PoolStatus};

/// Node-pool options of `server` and `up`.
#[derive(Debug, Clone, Args)]
pub struct NodePoolArgs {
    /// A node pool grown and shrunk through a capacity provider
    /// (repeatable): `name=NAME,provider=local|openstack,type=INSTANCE_TYPE`
    /// and optionally `min=N` (0), `max=N` (4), `idle=SECONDS` (300),
    /// `boot=SECONDS` (600), `spot`, `region=R`, `gpu=MODEL` and `gpus=N`
    /// (default: read from the instance type).
    #[arg(long = "node-pool", value_name = "SPEC")]
    pub node_pools: Vec<String>,
    /// The URL new node-pool machines reach this server at; default: the
    /// URL it listens on.
    #[arg(long, value_name = "URL")]
    pub join_url: Option<String>,
    /// Minutes a node-pool machine's one-time join token stays good.
    #[arg(long, default_value_t = 30, value_name = "MINUTES", value_parser = clap::value_parser!(u64).range(1..=1440))]
    pub join_token_ttl: u64,
    /// Image (id) OpenStack node-pool machines boot; it must carry the
    /// `flotilla` binary.
    #[arg(long, value_name = "ID")]
    pub openstack_image: Option<String>,
    /// Network (id) OpenStack node-pool machines attach to; default: Nova
    /// allocates one (`auto`).
    #[arg(long, value_name = "ID")]
    pub openstack_network: Option<String>,
    /// A flavor's PCI alias and the GPU model it passes through
    /// (repeatable), e.g. `h100-sxm=H100`; default: the alias is the model.
    #[arg(long = "openstack-gpu-alias", value_name = "ALIAS=MODEL")]
    pub openstack_gpu_aliases: Vec<String>,
}

/// One `--node-pool` spec, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Spec {
    name: String,
    provider: String,
    instance_type: String,
    min: u32,
    max: u32,
    idle_s: u64,
    boot_s: u64,
    spot: bool,
    region: Option<String>,
    gpu: Option<String>,
    gpus: Option<u32>,
}

fn parse_spec(s: &str) -> Result<Spec> {
    let mut kv: BTreeMap<&str, &str> = BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part.split_once('=').unwrap_or((part, ""));
        if kv.insert(k, v).is_some() {
            bail!("--node-pool {s:?}: `{k}` given twice");
        }
    }
    let take = |k: &str| kv.get(k).map(|v| v.to_string());
    let num = |k: &str, default: u64| -> Result<u64> {
        match kv.get(k) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| anyhow!("--node-pool {s:?}: `{k}` must be a whole number, got {v:?}")),
        }
    };
    let need = |k: &str| {
        take(k)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| anyhow!("--node-pool {s:?}: `{k}=` is missing"))
    };
    let known = [
        "name", "provider", "type", "min", "max", "idle", "boot", "spot", "region", "gpu", "gpus",
    ];
    if let Some(k) = kv.keys().find(|k| !known.contains(k)) {
        bail!(
            "--node-pool {s:?}: unknown key `{k}`; known: {}",
            known.join(", ")
        );
    }
    let to_u32 = |k: &str, v: u64| {
        u32::try_from(v).map_err(|_| anyhow!("--node-pool {s:?}: `{k}` is too large"))
    };
    let spec = Spec {
        name: need("name")?,
        provider: need("provider")?,
        instance_type: need("type")?,
        min: to_u32("min", num("min", 0)?)?,
        max: to_u32("max", num("max", 4)?)?,
        idle_s: num("idle", 300)?,
        boot_s: num("boot", 600)?,
        spot: kv.contains_key("spot"),
        region: take("region").filter(|r| !r.is_empty()),
        gpu: take("gpu").filter(|g| !g.is_empty()),
        gpus: kv
            .get("gpus")
            .map(|_| num("gpus", 0).and_then(|n| to_u32("gpus", n)))
            .transpose()?,
    };
    flotilla_core::tenant::validate_name(&spec.name, "node pool name")
        .map_err(|e| anyhow!("--node-pool {s:?}: {}", e.message))?;
    Ok(spec)
}

/// `2xH100` -> (`H100`, 2).
fn parse_local_type(t: &str) -> Result<(String, u32)> {
    let (n, model) = t
        .split_once('x')
        .ok_or_else(|| anyhow!("a local instance type is COUNTxMODEL, e.g. 2xH100; got {t:?}"))?;
    let n: u32 = n
        .parse()
        .map_err(|_| anyhow!("a local instance type is COUNTxMODEL, e.g. 2xH100; got {t:?}"))?;
    if n == 0 || model.is_empty() {
        bail!("a local instance type needs at least one GPU and a model; got {t:?}");
    }
    Ok((model.to_string(), n))
}

fn env(name: &str) -> Result<String> {
    std::env::var(name).map_err(|_| {
        anyhow!("{name} is not set: an openstack node pool reads the project's openrc variables")
    })
}

fn openstack(args: &NodePoolArgs, spec: &Spec) -> Result<Arc<dyn CapacityProvider>> {
    let mut gpu_aliases = BTreeMap::new();
    for a in &args.openstack_gpu_aliases {
        let (alias, model) = a
            .split_once('=')
            .ok_or_else(|| anyhow!("--openstack-gpu-alias {a:?}: expected ALIAS=MODEL"))?;
        gpu_aliases.insert(alias.to_string(), model.to_string());
    }
    let region = match &spec.region {
        Some(r) => r.clone(),
        None => env("OS_REGION_NAME")?,
    };
    let cfg = NovaConfig {
        auth_url: env("OS_AUTH_URL")?,
        username: env("OS_USERNAME")?,
        password: env("OS_PASSWORD")?,
        user_domain: std::env::var("OS_USER_DOMAIN_NAME").unwrap_or_else(|_| "Default".into()),
        project: env("OS_PROJECT_NAME")?,
        project_domain: std::env::var("OS_PROJECT_DOMAIN_NAME")
            .unwrap_or_else(|_| "Default".into()),
        region,
        image: args
            .openstack_image
            .clone()
            .ok_or_else(|| anyhow!("an openstack node pool needs --openstack-image"))?,
        network: args.openstack_network.clone(),
        gpu_aliases,
    };
    Ok(Arc::new(Nova::new(cfg)?))
}

/// The node pools of `args`; `url` is the server's own URL (the default
/// join URL) and `pin` its self-signed certificate's fingerprint, which
/// joining machines are given; `data_dir` holds local machines' work
/// directories.
pub async fn build(
    args: &NodePoolArgs,
    url: &str,
    pin: Option<String>,
    data_dir: &Path,
) -> Result<Vec<NodePoolConfig>> {
    let mut out: Vec<NodePoolConfig> = Vec::new();
    for raw in &args.node_pools {
        let spec = parse_spec(raw)?;
        if out.iter().any(|p| p.name == spec.name) {
            bail!("--node-pool: two pools are named {}", spec.name);
        }
        let provider: Arc<dyn CapacityProvider> = match spec.provider.as_str() {
            "local" => {
                let (model, n) = parse_local_type(&spec.instance_type)?;
                let program = std::env::current_exe()
                    .context("cannot find this flotilla binary to start local machines")?;
                Arc::new(LocalAgents::new(LocalAgentsConfig {
                    program,
                    work_root: data_dir.join("machines"),
                    types: vec![(spec.instance_type.clone(), model, n)],
                    max_machines: spec.max,
                }))
            }
            "openstack" => openstack(args, &spec)?,
            other => bail!("--node-pool {raw:?}: unknown provider `{other}`; local or openstack"),
        };
        // The GPU model and count: given, or read from the instance type.
        let (gpu, gpus) = match (&spec.gpu, spec.gpus) {
            (Some(g), Some(n)) => (g.clone(), n),
            _ => {
                let types = provider.instance_types().await.map_err(|e| {
                    anyhow!("--node-pool {}: listing instance types: {e}", spec.name)
                })?;
                let t = types
                    .into_iter()
                    .find(|t| t.name == spec.instance_type)
                    .ok_or_else(|| {
                        anyhow!(
                            "--node-pool {}: the provider has no instance type {}",
                            spec.name,
                            spec.instance_type
                        )
                    })?;
                let model = spec.gpu.clone().or(t.gpu_model).ok_or_else(|| {
                    anyhow!(
                        "--node-pool {}: instance type {} has no GPU; pass gpu=MODEL,gpus=N",
                        spec.name,
                        spec.instance_type
                    )
                })?;
                (model, spec.gpus.unwrap_or(t.gpus))
            }
        };
        let bounds = PoolBounds {
            min: spec.min,
            max: spec.max,
            gpus_per_machine: gpus,
            idle_timeout_ms: spec.idle_s.saturating_mul(1000),
            boot_timeout_ms: spec.boot_s.saturating_mul(1000),
        };
        bounds
            .validate()
            .map_err(|e| anyhow!("--node-pool {}: {e}", spec.name))?;
        out.push(NodePoolConfig {
            name: spec.name,
            provider,
            instance_type: spec.instance_type,
            gpu_model: gpu,
            runtime: RuntimeKind::Process,
            bounds,
            spot: spec.spot,
            region: spec.region,
            join_url: args.join_url.clone().unwrap_or_else(|| url.to_string()),
            join_fingerprint: pin.clone(),
            join_ttl: Duration::from_secs(args.join_token_ttl.saturating_mul(60)),
            status: Arc::new(Mutex::new(PoolStatus::default())),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_with_defaults_and_name_their_errors() {
        let s = parse_spec("name=gpu,provider=local,type=2xH100,max=2,idle=5,spot").unwrap();
        assert_eq!(
            (s.min, s.max, s.idle_s, s.boot_s, s.spot),
            (0, 2, 5, 600, true)
        );
        let e = parse_spec("name=gpu,provider=local")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`type=` is missing"), "{e}");
        let e = parse_spec("name=gpu,provider=local,type=x,colour=red")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown key `colour`"), "{e}");
        let e = parse_spec("name=gpu,provider=local,type=x,max=lots")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`max` must be a whole number"), "{e}");
        assert_eq!(parse_local_type("2xH100").unwrap(), ("H100".into(), 2));
        assert!(parse_local_type("H100").is_err());
        assert!(parse_local_type("0xH100").is_err());
    }
}
