//! `flotilla executor …`: bridges a cluster engine's nodes into a Flotilla
//! server (see `flotilla_backends::bridge`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use clap::{Args, Subcommand};
use flotilla_backends::bridge::{self, BridgeConfig};
use flotilla_backends::slurm::{Auth, SlurmConfig, SlurmExecutor};

use crate::config;
use crate::daemon::{init_logging, Signals};

/// The engines a bridge can front.
#[derive(Debug, Subcommand)]
pub enum ExecutorCommand {
    /// Offer a Slurm cluster's nodes through slurmrestd: placed work runs
    /// as Slurm batch jobs pinned to the node and GPUs Flotilla chose.
    Slurm(SlurmArgs),
    /// Offer a Kubernetes cluster's GPU nodes through its API server:
    /// placed work runs as Pods pinned to the node Flotilla chose, in one
    /// namespace per tenant (needs the `kubernetes` build feature, on by
    /// default).
    Kubernetes(KubernetesArgs),
}

/// `flotilla executor kubernetes`.
#[derive(Debug, Args)]
pub struct KubernetesArgs {
    /// Provider or operator key the nodes register with (the server's
    /// `agent.token`, as for agents).
    #[arg(long, env = "FLOTILLA_AGENT_TOKEN", hide_env_values = true)]
    pub token: String,
    /// The executor's configuration: a JSON file with the fields of
    /// `KubeConfig` (node selector, pool label, tenant quota, pinning; see
    /// docs/executors.md); every field has a default, unknown ones are
    /// refused. The cluster itself is found as kubectl finds it
    /// (`KUBECONFIG`, `~/.kube/config`, then the pod's service account).
    #[arg(long, env = "FLOTILLA_KUBE_CONFIG", value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Long-poll wait of each node's sync, in milliseconds.
    #[arg(long, default_value_t = 2_000)]
    pub sync_wait_ms: u64,
}

/// `flotilla executor slurm`.
#[derive(Debug, Args)]
pub struct SlurmArgs {
    /// Provider or operator key the nodes register with (the server's
    /// `agent.token`, as for agents).
    #[arg(long, env = "FLOTILLA_AGENT_TOKEN", hide_env_values = true)]
    pub token: String,
    /// slurmrestd's address: `http://host:6820`, or `unix:/path/to/socket`
    /// (with `rest_auth/local`, the bridge must then run as slurmrestd's
    /// user).
    #[arg(long, env = "FLOTILLA_SLURMRESTD", value_name = "URL|unix:PATH")]
    pub slurmrestd: String,
    /// The Slurm user jobs are submitted as (`rest_auth/jwt`); with
    /// `--slurm-token`.
    #[arg(long, env = "FLOTILLA_SLURM_USER")]
    pub slurm_user: Option<String>,
    /// A JWT for `--slurm-user` (`scontrol token username=… lifespan=…`).
    #[arg(long, env = "FLOTILLA_SLURM_TOKEN", hide_env_values = true)]
    pub slurm_token: Option<String>,
    /// Where jobs write their output, read back here as the instances'
    /// logs: a directory on a filesystem shared by the compute nodes and
    /// this host, writable by the Slurm user.
    #[arg(long, env = "FLOTILLA_SLURM_OUTPUT_DIR", value_name = "DIR")]
    pub output_dir: PathBuf,
    /// Offer only the nodes of these partitions (comma-separated; default:
    /// every node).
    #[arg(long, value_delimiter = ',')]
    pub partitions: Vec<String>,
    /// Region of the nodes (default `local`).
    #[arg(long)]
    pub region: Option<String>,
    /// Catalog model of GPUs whose GRES has no type (`gpu:4`).
    #[arg(long, value_name = "MODEL")]
    pub default_gpu_model: Option<String>,
    /// The cluster's GPUs are simulated (device files, no driver), as in
    /// `scripts/slurm-cluster`.
    #[arg(long)]
    pub simulated_gpus: bool,
    /// Long-poll wait of each node's sync, in milliseconds.
    #[arg(long, default_value_t = 2_000)]
    pub sync_wait_ms: u64,
}

/// Runs the bridge until SIGINT or SIGTERM.
pub async fn run(
    server: Option<String>,
    tls: config::TlsFlags<'_>,
    command: ExecutorCommand,
) -> Result<ExitCode> {
    init_logging();
    let server_url = config::server_urls(server);
    let trust = config::trust(tls.fingerprint, tls.ca_cert)?;
    let args = match command {
        ExecutorCommand::Slurm(args) => args,
        ExecutorCommand::Kubernetes(args) => return run_kubernetes(server_url, trust, args).await,
    };
    if args.token.trim().is_empty() {
        bail!("--token is empty: pass the server's agent token");
    }
    let auth = match (args.slurm_user, args.slurm_token) {
        (Some(user), Some(token)) if !user.trim().is_empty() && !token.trim().is_empty() => {
            Auth::Jwt {
                user: user.trim().to_string(),
                token: token.trim().to_string(),
            }
        }
        (None, None) => Auth::Local,
        _ => bail!("--slurm-user and --slurm-token go together (rest_auth/jwt); leave both out for rest_auth/local"),
    };
    std::fs::create_dir_all(&args.output_dir).with_context(|| {
        format!(
            "cannot create the output directory {}",
            args.output_dir.display()
        )
    })?;
    let mut slurm = SlurmConfig::new(args.slurmrestd.clone(), auth, args.output_dir);
    slurm.partitions = args.partitions;
    slurm.region = args.region;
    slurm.default_gpu_model = args.default_gpu_model;
    slurm.simulated = args.simulated_gpus;
    let executor = Arc::new(SlurmExecutor::new(slurm)?);
    let mut cfg = BridgeConfig::new(server_url.clone(), args.token.trim());
    cfg.sync_wait_ms = args.sync_wait_ms;
    cfg.inventory_interval = Duration::from_secs(30);
    cfg.trust = trust;
    let mut signals = Signals::new()?;
    eprintln!(
        "bridging Slurm ({}) to {server_url}; press Ctrl-C to stop",
        args.slurmrestd
    );
    tokio::select! {
        r = bridge::run(executor, cfg, std::future::pending::<()>()) => {
            r.context("the Slurm bridge stopped")?;
        }
        () = signals.recv() => {}
    }
    eprintln!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// The Kubernetes executor's configuration from `path` (defaults when
/// absent), with the file and the field named when it does not parse.
#[cfg(feature = "kubernetes")]
fn kube_config(path: Option<&std::path::Path>) -> Result<flotilla_backends::kube::KubeConfig> {
    let Some(path) = path else {
        return Ok(flotilla_backends::kube::KubeConfig::default());
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the executor configuration {}", path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("invalid executor configuration {}", path.display()))
}

#[cfg(feature = "kubernetes")]
async fn run_kubernetes(
    server_url: String,
    trust: flotilla_client::Trust,
    args: KubernetesArgs,
) -> Result<ExitCode> {
    use flotilla_backends::kube::KubeExecutor;

    if args.token.trim().is_empty() {
        bail!("--token is empty: pass the server's agent token");
    }
    let kube = kube_config(args.config.as_deref())?;
    let executor = Arc::new(
        KubeExecutor::connect(kube)
            .await
            .context("cannot reach the Kubernetes API server")?,
    );
    let mut cfg = BridgeConfig::new(server_url.clone(), args.token.trim());
    cfg.sync_wait_ms = args.sync_wait_ms;
    cfg.inventory_interval = Duration::from_secs(30);
    cfg.trust = trust;
    let mut signals = Signals::new()?;
    eprintln!("bridging Kubernetes to {server_url}; press Ctrl-C to stop");
    tokio::select! {
        r = bridge::run(executor, cfg, std::future::pending::<()>()) => {
            r.context("the Kubernetes bridge stopped")?;
        }
        () = signals.recv() => {}
    }
    eprintln!("stopped");
    Ok(ExitCode::SUCCESS)
}

#[cfg(not(feature = "kubernetes"))]
async fn run_kubernetes(
    _server_url: String,
    _trust: flotilla_client::Trust,
    _args: KubernetesArgs,
) -> Result<ExitCode> {
    bail!("this flotilla was built without the `kubernetes` feature; rebuild with `--features kubernetes`")
}

#[cfg(all(test, feature = "kubernetes"))]
mod tests {
    use super::*;

    #[test]
    fn kube_config_defaults_without_a_file_and_names_a_bad_field() {
        let d = kube_config(None).unwrap();
        assert_eq!(d.pool_label, "flotilla.dev/pool");
        let dir = std::env::temp_dir().join(format!("flotilla-kcfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.json");
        std::fs::write(
            &good,
            r#"{"pool_label": "pool", "pinning": "hostname_selector"}"#,
        )
        .unwrap();
        let c = kube_config(Some(&good)).unwrap();
        assert_eq!(c.pool_label, "pool");
        let bad = dir.join("bad.json");
        std::fs::write(&bad, r#"{"pool_lable": "pool"}"#).unwrap();
        let err = format!("{:#}", kube_config(Some(&bad)).unwrap_err());
        assert!(err.contains("pool_lable"), "{err}");
        assert!(err.contains("bad.json"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
