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
use crate::local::{init_logging, Signals};

/// The engines a bridge can front.
#[derive(Debug, Subcommand)]
pub enum ExecutorCommand {
    /// Offer a Slurm cluster's nodes through slurmrestd: placed work runs
    /// as Slurm batch jobs pinned to the node and GPUs Flotilla chose.
    Slurm(SlurmArgs),
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
pub async fn run(server: Option<String>, command: ExecutorCommand) -> Result<ExitCode> {
    init_logging();
    let ExecutorCommand::Slurm(args) = command;
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
    let server_url = server
        .map(|s| {
            s.split(',')
                .filter(|u| !u.trim().is_empty())
                .map(config::normalize_server)
                .collect::<Vec<_>>()
                .join(",")
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| config::DEFAULT_SERVER.to_string());
    let mut slurm = SlurmConfig::new(args.slurmrestd.clone(), auth, args.output_dir);
    slurm.partitions = args.partitions;
    slurm.region = args.region;
    slurm.default_gpu_model = args.default_gpu_model;
    slurm.simulated = args.simulated_gpus;
    let executor = Arc::new(SlurmExecutor::new(slurm)?);
    let mut cfg = BridgeConfig::new(server_url.clone(), args.token.trim());
    cfg.sync_wait_ms = args.sync_wait_ms;
    cfg.inventory_interval = Duration::from_secs(30);
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
