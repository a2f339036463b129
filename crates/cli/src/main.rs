//! `flotilla`: the one binary of Flotilla. It runs the platform (`up`,
//! `server`, `agent`) and is its command-line client (`run`, `ps`, `logs`,
//! `gpus`, `nodes`, `tenants`, `keys`, `quota`, …).
//!
//! This file holds the command-line grammar, dispatch and exit codes. Every
//! error ends the process with one line on stderr, `error: …`, and exit
//! code 1; `flotilla run` exits with the instance's own exit code. The CLI
//! holds no platform logic: it talks to the API like any other client.

mod access;
mod billing;
mod client;
mod commands;
mod config;
mod ctx;
mod daemon;
mod demo;
mod endpoints;
mod executor;
mod follow;
mod gateway;
mod jobs;
mod limits;
mod local;
mod nodepools;
mod nodes;
mod output;
mod preflight;
mod queue;
mod queue_worker;
mod registries;
mod simulate;
mod ssh;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use flotilla_core::tenant::Role;

/// mimalloc instead of glibc's malloc. The server's hot paths allocate per
/// row and per value (sqlx's rows, serde's JSON), on every runtime worker
/// and every SQLite connection's thread at once; glibc's arenas spent a
/// quarter of the server's CPU in `malloc`, `free` and their locks under a
/// list load (perf; docs/operations.md, bench/results/api.md). Only the
/// binary sets it: libraries and tests keep the system allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use crate::commands::{Ctx, Limit, PsArgs, RunArgs};
use crate::local::{AgentArgs, ServerArgs, UpArgs};

/// Flotilla: a GPU cloud on your own machines.
#[derive(Debug, Parser)]
#[command(name = "flotilla", version, propagate_version = true)]
struct Cli {
    /// API server URL, or several replicas' URLs comma-separated (requests
    /// fail over between them); default: the saved credentials', else
    /// http://127.0.0.1:7420.
    #[arg(
        long,
        global = true,
        env = "FLOTILLA_SERVER",
        value_name = "URL[,URL…]"
    )]
    server: Option<String>,
    /// API key (default: the saved credentials').
    #[arg(
        long,
        global = true,
        env = "FLOTILLA_API_KEY",
        hide_env_values = true,
        value_name = "KEY"
    )]
    api_key: Option<String>,
    /// For an https:// server: trust exactly the certificate with this
    /// SHA-256 fingerprint (`sha256:…`, printed by a server with
    /// `--tls self-signed`) instead of the system's root certificates.
    #[arg(
        long,
        global = true,
        env = "FLOTILLA_TLS_FINGERPRINT",
        value_name = "sha256:HEX",
        conflicts_with = "ca_cert"
    )]
    tls_fingerprint: Option<String>,
    /// For an https:// server: trust certificates signed by the CA
    /// certificate(s) in this PEM file instead of the system's roots.
    #[arg(long, global = true, env = "FLOTILLA_CA_CERT", value_name = "FILE")]
    ca_cert: Option<std::path::PathBuf>,
    /// Print the API's JSON answer instead of a table.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the control plane and a local agent in this process.
    Up(UpArgs),
    /// Run the control plane only.
    Server(ServerArgs),
    /// Replay a request trace through the autoscaling policies in the
    /// simulator and write a report folder (runs locally, no server).
    Simulate(simulate::SimulateArgs),
    /// Run a node agent that offers this machine's GPUs to a server.
    Agent(AgentArgs),
    /// Run the inference gateway against a server (`--server URL`).
    Gateway(gateway::GatewayArgs),
    /// Offer a cluster engine's nodes (Slurm, Kubernetes) to a server: a bridge that
    /// registers each engine node and runs placed work there.
    Executor {
        #[command(subcommand)]
        command: executor::ExecutorCommand,
    },
    /// Run the OpenAI-compatible model-server emulator (the same as the
    /// `flotilla-emulator` binary): a replica command for endpoint demos
    /// and tests on machines without GPUs, e.g.
    /// `sh -c 'exec flotilla emulator --port "$PORT" --load-delay-ms 2000'`.
    Emulator(flotilla_emulator::EmulatorConfig),
    /// The node lease's fence, started by `flotilla agent` beside itself:
    /// stops the agent's work when the lease runs out while the agent
    /// cannot (paused, wedged, killed).
    /// A batch replica that drains a RabbitMQ queue or a NATS JetStream
    /// consumer, acknowledging each message (tests and demos of queue
    /// triggers).
    #[command(name = "queue-worker", hide = true)]
    QueueWorker(queue_worker::QueueWorkerArgs),
    #[command(name = "agent-fence", hide = true)]
    AgentFence {
        /// The file the agent writes after every renewal.
        #[arg(long)]
        file: std::path::PathBuf,
        /// The agent it guards.
        #[arg(long)]
        agent_pid: u32,
    },
    /// Relays a workload's output stream into its file, holding it back
    /// while the agent has not shipped enough (started by the agent's
    /// process runtime beside each workload).
    #[command(name = "agent-log-relay", hide = true)]
    AgentLogRelay {
        /// The workload's state directory.
        #[arg(long)]
        dir: std::path::PathBuf,
        /// `stdout` or `stderr`.
        #[arg(long, value_parser = ["stdout", "stderr"])]
        stream: String,
    },
    /// Check an API key against a server and save both.
    Login,
    /// List GPU models with the pool's total and free capacity.
    Gpus,
    /// List nodes and their GPUs, or show one with its image cache.
    Nodes {
        #[command(subcommand)]
        command: Option<NodesCommand>,
    },
    /// Your tenant's logins to private container registries.
    Registries {
        #[command(subcommand)]
        command: Option<registries::RegistriesCommand>,
    },
    /// Rent GPUs and run a command on them, following its output.
    Run(RunArgs),
    /// List instances.
    Ps(PsArgs),
    /// List waiting instances and jobs in queue order, with position and
    /// reason.
    Queue,
    /// Run a command inside a running instance, as its workload's user,
    /// in its working directory, with its environment; prints its output
    /// and exits with its exit code.
    Exec {
        /// Instance id.
        id: String,
        /// Pass this standard input to the command.
        #[arg(long, short = 'i')]
        stdin: bool,
        /// Run it on a terminal of its own (with -i: interactive).
        #[arg(long, short = 't')]
        tty: bool,
        /// The program and its arguments (after `--`).
        #[arg(last = true, required = true, value_name = "CMD")]
        command: Vec<String>,
    },
    /// Open an interactive terminal inside a running instance (bash, else
    /// sh; or the command after `--`).
    Shell {
        /// Instance id.
        id: String,
        /// The program to run instead of the shell.
        #[arg(last = true, value_name = "CMD")]
        command: Vec<String>,
    },
    /// Forward a port on 127.0.0.1 to a port inside a running instance
    /// (`LOCAL:REMOTE`, or `PORT` for the same on both), until stopped.
    PortForward {
        /// Instance id.
        id: String,
        /// `LOCAL:REMOTE` or `PORT`.
        ports: String,
    },
    /// Reach a running instance over SSH: an SSH `ProxyCommand` (`ssh -o
    /// ProxyCommand='flotilla ssh %h' inst_…`, then `scp`, `sftp` and VS
    /// Code Remote work too) that logs in with a key registered with
    /// `flotilla ssh-keys add`. `--config` prints an ssh_config block so
    /// that `ssh inst_…` works by itself.
    Ssh {
        /// Instance id (`%h` in the ProxyCommand).
        #[arg(required_unless_present = "config", conflicts_with = "config")]
        id: Option<String>,
        /// Print an ssh_config block for `ssh inst_…` instead.
        #[arg(long)]
        config: bool,
    },
    /// Your tenant's SSH public keys, which `flotilla ssh` logs in with.
    SshKeys {
        #[command(subcommand)]
        command: Option<ssh::SshKeysCommand>,
    },
    /// Print an instance's output.
    Logs {
        /// Instance id.
        id: String,
        /// Keep printing until the instance ends.
        #[arg(long, short = 'f')]
        follow: bool,
    },
    /// Show what an instance's GPUs are doing: utilisation, memory,
    /// temperature, power (read through NVML by its node's agent).
    Top {
        /// Instance id.
        id: String,
    },
    /// How much of its GPUs an instance or an endpoint's replicas used
    /// (mean and p95 utilisation, peak memory, idle share) and the
    /// cheapest catalog class that would serve the same load.
    Advise {
        /// Instance id (`inst_…`) or endpoint id (`ep_…`).
        id: String,
    },
    /// Stop an instance.
    Stop {
        /// Instance id.
        id: String,
    },
    /// Metered usage of your tenant (default: this month so far).
    Usage {
        /// Start of the range (RFC 3339).
        #[arg(long)]
        from: Option<String>,
        /// End of the range (RFC 3339).
        #[arg(long)]
        to: Option<String>,
        /// Print every event of the range as CSV.
        #[arg(long)]
        csv: bool,
    },
    /// Finalised invoices (`show ID`, `--csv`), a month's draft
    /// (`preview`), finalising a month (`finalise`, operators).
    Invoices {
        #[command(subcommand)]
        command: Option<billing::InvoicesCommand>,
    },
    /// The price catalog: versions, the one in force, spot prices;
    /// `set --file` publishes a version (operators).
    Prices {
        #[command(subcommand)]
        command: Option<billing::PricesCommand>,
    },
    /// Your budget, this month's spend, alerts and webhook deliveries;
    /// `set` changes it.
    Budget {
        /// Tenant id (operators; default: your own).
        #[arg(long)]
        tenant: Option<String>,
        #[command(subcommand)]
        command: Option<billing::BudgetCommand>,
    },
    /// What a workload would cost a month under each billing model and
    /// GPU model, and the cheapest that meets it.
    Estimate(billing::EstimateArgs),
    /// A tenant's reserved commitments, discounts and credits; `commitment`,
    /// `discount` or `credit` adds one (operators).
    Terms {
        /// Tenant id (default: your own).
        #[arg(long)]
        tenant: Option<String>,
        #[command(subcommand)]
        command: Option<billing::TermsCommand>,
    },
    /// Billing checks (operators): `reconcile` compares the ledger with
    /// what the executors saw run.
    Billing {
        #[command(subcommand)]
        command: billing::BillingCommand,
    },
    /// Provider payout statements of a month.
    Payouts {
        /// Month, `YYYY-MM` (default: this month).
        #[arg(long)]
        period: Option<String>,
    },
    /// Say why an instance or a job is where it is: what it asked for, why
    /// it is pending or where it was placed, and every transition with its
    /// reason.
    Explain {
        /// Instance id or job id.
        id: String,
    },
    /// Deploy an emulated model, drive a viral traffic spike through the
    /// gateway and watch replicas follow demand, latency against the SLO
    /// and the running bill; the endpoint is deleted at the end.
    Demo(demo::DemoArgs),
    /// Serverless endpoints: deploy, list, show, update, delete, logs.
    Endpoints {
        #[command(subcommand)]
        command: endpoints::EndpointsCommand,
    },
    /// Batch and training jobs: submit, list, show, queue, cancel, logs.
    Jobs {
        #[command(subcommand)]
        command: jobs::JobsCommand,
    },
    /// List tenants, or create one.
    Tenants {
        #[command(subcommand)]
        command: Option<TenantsCommand>,
    },
    /// List API keys, create or revoke one.
    Keys {
        #[command(subcommand)]
        command: Option<KeysCommand>,
    },
    /// The audit log: who changed what and when, newest first (operators:
    /// every tenant's; tenant admins: their own).
    Audit {
        /// Only this tenant's calls (id or name; operators).
        #[arg(long)]
        tenant: Option<String>,
        /// How many entries to show.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=100_000))]
        limit: u64,
    },
    /// Show a tenant's GPU quota and use, or change it.
    Quota {
        /// Tenant id or name (default: your own).
        #[arg(long)]
        tenant: Option<String>,
        #[command(subcommand)]
        command: Option<QuotaCommand>,
    },
}

#[derive(Debug, Subcommand)]
enum NodesCommand {
    /// List nodes and their GPUs.
    List,
    /// Show one node: its GPUs and the images its agent has cached.
    Show {
        /// Node id.
        id: String,
    },
    /// Take a node out of placement; what runs keeps running.
    Cordon {
        /// Node id.
        id: String,
    },
    /// Put a cordoned node back into placement.
    Uncordon {
        /// Node id.
        id: String,
    },
    /// Cordon a node and stop its work; jobs restart elsewhere as their
    /// restart policy says.
    Drain {
        /// Node id.
        id: String,
    },
    /// What happened to a node: GPU faults and resets, cordons, drains,
    /// unreachability.
    Events {
        /// Node id.
        id: String,
    },
    /// Put a GPU taken out by a fault back into placement (operators).
    ResetGpu {
        /// Node id.
        id: String,
        /// GPU id.
        gpu: String,
    },
}

#[derive(Debug, Subcommand)]
enum TenantsCommand {
    /// List tenants.
    List,
    /// Create a tenant.
    Create {
        /// Name: lowercase letters, digits and `-`.
        name: String,
    },
}

#[derive(Debug, Subcommand)]
enum KeysCommand {
    /// List API keys.
    List,
    /// Create an API key; its secret is printed once.
    Create {
        /// Role of the new key: operator, tenant_admin, tenant_member,
        /// provider.
        #[arg(long, value_parser = commands::parse_role)]
        role: Role,
        /// Tenant id or name the key acts for (default: your own).
        #[arg(long)]
        tenant: Option<String>,
        /// Label.
        #[arg(long)]
        name: Option<String>,
    },
    /// Revoke an API key.
    Revoke {
        /// Key id.
        id: String,
    },
}

#[derive(Debug, Subcommand)]
enum QuotaCommand {
    /// Change limits; the others stay as they are.
    Set {
        /// Tenant id or name (default: your own).
        #[arg(long)]
        tenant: Option<String>,
        /// Most GPUs at once, or `none` for no limit.
        #[arg(long, value_parser = commands::parse_limit, value_name = "N|none")]
        gpus_total: Option<Limit>,
        /// Most GPUs of one model, or `MODEL=none` to drop that limit
        /// (repeatable).
        #[arg(long = "gpu", value_parser = commands::parse_model_limit, value_name = "MODEL=N")]
        gpu: Vec<(String, Limit)>,
        /// GPUs guaranteed to the tenant (its work within them may reclaim
        /// capacity others borrowed), or `none`.
        #[arg(long, value_parser = commands::parse_limit, value_name = "N|none")]
        guaranteed: Option<Limit>,
        /// Fair-share weight (1-1000), or `none` for the default 1.
        #[arg(long, value_parser = commands::parse_limit, value_name = "N|none")]
        weight: Option<Limit>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(&anyhow::anyhow!("cannot start the async runtime: {e}")),
    };
    let result = runtime.block_on(dispatch(cli));
    // Don't let a task stuck in a blocking call hold the exit.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(code) => code,
        Err(e) => fail(&e),
    }
}

/// Prints the error chain on one line and returns exit code 1; a reader
/// that closed our stdout gets the shell's SIGPIPE status (141) silently.
fn fail(e: &anyhow::Error) -> ExitCode {
    if output::is_broken_pipe(e) {
        return ExitCode::from(141);
    }
    eprintln!("error: {}", error_line(e));
    ExitCode::FAILURE
}

/// The anyhow chain joined with ": ", on one line, without repeating a
/// cause whose text its context already contains.
pub(crate) fn error_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = match cause.downcast_ref::<client::ClientError>() {
            Some(ce) => output::one_line(&client::describe(ce)),
            None => output::one_line(&cause.to_string()),
        };
        if parts.last().is_some_and(|p| p.contains(&text)) || text.is_empty() {
            continue;
        }
        parts.push(text);
    }
    parts.join(": ")
}

async fn dispatch(cli: Cli) -> Result<ExitCode> {
    let Cli {
        server,
        api_key,
        tls_fingerprint,
        ca_cert,
        json,
        command,
    } = cli;
    let tls = config::TlsFlags {
        fingerprint: tls_fingerprint.as_deref(),
        ca_cert: ca_cert.as_deref(),
    };
    match command {
        Command::Up(args) => return local::up(args).await,
        Command::Server(args) => return local::server(args).await,
        Command::Agent(args) => return local::agent(server, tls, args).await,
        Command::Gateway(args) => return gateway::run(server, tls, args).await,
        Command::Executor { command } => return executor::run(server, tls, command).await,
        Command::Emulator(config) => return gateway::emulator(config).await,
        Command::QueueWorker(args) => return queue_worker::run(args).await,
        Command::AgentFence { file, agent_pid } => {
            tokio::task::spawn_blocking(move || flotilla_agent::fence::watch(&file, agent_pid))
                .await?;
            return Ok(ExitCode::SUCCESS);
        }
        Command::AgentLogRelay { dir, stream } => {
            let stream = if stream == "stderr" {
                flotilla_core::api::LogStream::Stderr
            } else {
                flotilla_core::api::LogStream::Stdout
            };
            let relayed = tokio::task::spawn_blocking(move || {
                flotilla_agent::runtime::relay::relay(
                    std::io::stdin().lock(),
                    &dir,
                    stream,
                    flotilla_agent::runtime::relay::MAX_BACKLOG_BYTES,
                )
            })
            .await?;
            relayed.map_err(|e| anyhow::anyhow!("relaying workload output: {e}"))?;
            return Ok(ExitCode::SUCCESS);
        }
        Command::Login => return commands::login(server, api_key, tls).await,
        Command::Simulate(args) if !simulate::needs_server(&args) => return simulate::run(args),
        Command::Ssh { config: true, .. } => {
            let exe = std::env::current_exe()
                .ok()
                .and_then(|p| p.to_str().map(str::to_string))
                .unwrap_or_else(|| "flotilla".to_string());
            output::outln!("{}", ssh::config_snippet(&exe, server.as_deref()))?;
            return Ok(ExitCode::SUCCESS);
        }
        _ => {}
    }
    if std::env::var_os("RUST_LOG").is_some() {
        local::init_logging();
    }
    let creds = config::resolve(server.as_deref(), api_key.as_deref(), tls)?;
    let trust = creds.trust()?;
    let ctx = Ctx {
        client: client::connect(&creds.server, &creds.api_key, trust.clone())?,
        trust,
        json,
    };
    match command {
        Command::Gpus => commands::gpus(&ctx).await,
        Command::Nodes { command } => match command {
            None | Some(NodesCommand::List) => commands::nodes(&ctx).await,
            Some(NodesCommand::Show { id }) => registries::node_show(&ctx, &id).await,
            Some(NodesCommand::Cordon { id }) => nodes::cordon(&ctx, &id, true).await,
            Some(NodesCommand::Uncordon { id }) => nodes::cordon(&ctx, &id, false).await,
            Some(NodesCommand::Drain { id }) => nodes::drain(&ctx, &id).await,
            Some(NodesCommand::Events { id }) => nodes::events(&ctx, &id).await,
            Some(NodesCommand::ResetGpu { id, gpu }) => nodes::reset_gpu(&ctx, &id, &gpu).await,
        },
        Command::Registries { command } => registries::dispatch(&ctx, command).await,
        Command::Run(args) => commands::run(&ctx, args).await,
        Command::Ps(args) => commands::ps(&ctx, args).await,
        Command::Queue => commands::queue(&ctx).await,
        Command::Logs { id, follow } => commands::logs(&ctx, &id, follow).await,
        Command::Exec {
            id,
            stdin,
            tty,
            command,
        } => access::exec(&ctx, &id, command, stdin, tty).await,
        Command::Shell { id, command } => access::shell(&ctx, &id, command).await,
        Command::PortForward { id, ports } => access::port_forward(&ctx, &id, &ports).await,
        Command::Ssh { id, .. } => ssh::proxy(&ctx, id.as_deref().unwrap_or_default()).await,
        Command::SshKeys { command } => ssh::keys(&ctx, command).await,
        Command::Stop { id } => commands::stop(&ctx, &id).await,
        Command::Explain { id } if id.trim().starts_with("job_") => jobs::explain(&ctx, &id).await,
        Command::Top { id } => commands::top(&ctx, &id).await,
        Command::Advise { id } => nodes::advise(&ctx, &id).await,
        Command::Explain { id } => commands::explain(&ctx, &id).await,
        Command::Jobs { command } => jobs::dispatch(&ctx, command).await,
        Command::Endpoints { command } => endpoints::dispatch(&ctx, command).await,
        Command::Demo(args) => demo::run(&ctx, &creds.api_key, args).await,
        Command::Usage { from, to, csv } => commands::usage(&ctx, from, to, csv).await,
        Command::Invoices { command } => billing::invoices(&ctx, command).await,
        Command::Prices { command } => billing::prices(&ctx, command).await,
        Command::Budget { tenant, command } => billing::budget(&ctx, tenant, command).await,
        Command::Estimate(args) => billing::estimate(&ctx, args).await,
        Command::Payouts { period } => billing::payouts(&ctx, period).await,
        Command::Billing { command } => billing::billing(&ctx, command).await,
        Command::Terms { tenant, command } => billing::terms(&ctx, tenant, command).await,
        Command::Tenants { command } => match command {
            None | Some(TenantsCommand::List) => commands::tenants_list(&ctx).await,
            Some(TenantsCommand::Create { name }) => commands::tenants_create(&ctx, name).await,
        },
        Command::Keys { command } => match command {
            None | Some(KeysCommand::List) => commands::keys_list(&ctx).await,
            Some(KeysCommand::Create { role, tenant, name }) => {
                commands::keys_create(&ctx, role, tenant, name).await
            }
            Some(KeysCommand::Revoke { id }) => commands::keys_revoke(&ctx, &id).await,
        },
        Command::Audit { tenant, limit } => commands::audit(&ctx, tenant, limit).await,
        Command::Quota { tenant, command } => match command {
            None => commands::quota_show(&ctx, tenant).await,
            Some(QuotaCommand::Set {
                tenant: set_tenant,
                gpus_total,
                gpu,
                guaranteed,
                weight,
            }) => {
                commands::quota_set(
                    &ctx,
                    set_tenant.or(tenant),
                    gpus_total,
                    gpu,
                    guaranteed,
                    weight,
                )
                .await
            }
        },
        Command::Up(_)
        | Command::Server(_)
        | Command::Agent(_)
        | Command::Gateway(_)
        | Command::Executor { .. }
        | Command::Emulator(_)
        | Command::QueueWorker(_)
        | Command::AgentFence { .. }
        | Command::AgentLogRelay { .. }
        | Command::Login => {
            unreachable!("handled above")
        }
        Command::Simulate(args) => simulate::from_history(&ctx, args).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_grammar_is_consistent() {
        Cli::command().debug_assert();
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("flotilla").chain(args.iter().copied()))
    }

    #[test]
    fn run_takes_the_command_after_its_flags() {
        let cli = parse(&[
            "run",
            "--gpus",
            "2",
            "--gpu-type",
            "H100,A100-80GB",
            "-e",
            "A=1",
            "--json",
            "--",
            "python",
            "-c",
            "print(1)",
        ])
        .unwrap();
        assert!(cli.json);
        let Command::Run(r) = cli.command else {
            panic!("not run")
        };
        assert_eq!(r.work.gpus, 2);
        assert_eq!(r.work.gpu_types, ["H100", "A100-80GB"]);
        assert_eq!(r.work.env, [("A".to_string(), "1".to_string())]);
        assert_eq!(r.work.command, ["python", "-c", "print(1)"]);

        // Without `--`, flags after the program belong to the program.
        let cli = parse(&["run", "nvidia-smi", "-L", "--gpus", "3"]).unwrap();
        let Command::Run(r) = cli.command else {
            panic!("not run")
        };
        assert_eq!((r.work.gpus, r.work.command.len()), (1, 4));
    }

    #[test]
    fn jobs_submit_takes_the_issue_s_flags() {
        let cli = parse(&[
            "jobs",
            "submit",
            "--gpus",
            "8",
            "--nodes",
            "2",
            "--tier",
            "2",
            "--preemptible",
            "--restart",
            "on-failure",
            "--max-retries",
            "3",
            "--",
            "torchrun",
            "train.py",
        ])
        .unwrap();
        let Command::Jobs {
            command: jobs::JobsCommand::Submit(a),
        } = cli.command
        else {
            panic!("not jobs submit")
        };
        assert_eq!(
            (a.work.gpus, a.nodes, a.work.tier, a.work.preemptible),
            (8, 2, Some(2), true)
        );
        assert_eq!(
            (a.restart, a.max_retries),
            (flotilla_core::job::RestartPolicy::OnFailure, Some(3))
        );
        assert_eq!(a.work.command, ["torchrun", "train.py"]);
        assert!(parse(&["jobs", "submit", "--restart", "always", "--", "x"]).is_err());
        assert!(matches!(
            parse(&["jobs", "logs", "job_x", "--rank", "1", "-f"])
                .unwrap()
                .command,
            Command::Jobs {
                command: jobs::JobsCommand::Logs {
                    rank: 1,
                    follow: true,
                    ..
                }
            }
        ));
    }

    #[test]
    fn bad_flag_values_are_usage_errors() {
        let e = parse(&["run", "--env", "NOEQUALS", "--", "true"]).unwrap_err();
        assert!(e.to_string().contains("expected K=V"), "{e}");
        let e = parse(&["quota", "set", "--gpu", "H100"]).unwrap_err();
        assert!(e.to_string().contains("expected MODEL=N"), "{e}");
        assert!(parse(&["run"]).is_err(), "a command is required");
        assert!(parse(&["jobs", "submit"]).is_err(), "a command is required");
        assert!(parse(&["run", "--image", "busybox"]).is_ok(), "or an image");
        assert!(
            parse(&["run", "-p", "80", "--", "x"]).is_err(),
            "ports need an image"
        );
        let run = parse(&[
            "run", "--image", "b", "-p", "80", "-p", "8080", "--memory", "512M", "--cpus", "0.5",
            "--", "x",
        ])
        .unwrap();
        match run.command {
            Command::Run(r) => {
                assert_eq!(r.work.ports, vec![80, 8080]);
                assert_eq!(r.work.memory, Some(512));
                assert_eq!(r.work.cpus, Some(500));
            }
            _ => panic!("not run"),
        }
        assert!(parse(&["run", "--memory", "lots", "--", "x"]).is_err());
        assert!(parse(&["keys", "create", "--role", "boss"]).is_err());
        assert!(parse(&["ps", "--state", "done"]).is_err());
    }

    #[test]
    fn billing_flags_of_the_server_are_validated() {
        let cli = parse(&[
            "server",
            "--billing-every",
            "5",
            "--operator-fee-percent",
            "12.50",
            "--webhook-allow-private",
        ])
        .unwrap();
        let Command::Server(a) = cli.command else {
            panic!("not server")
        };
        assert_eq!(a.billing_every, 5);
        assert_eq!(a.operator_fee_percent.to_string(), "12.5");
        assert!(a.webhook_allow_private);
        let Command::Up(a) = parse(&["up"]).unwrap().command else {
            panic!("not up")
        };
        assert_eq!(
            (
                a.server.billing_every,
                a.server.operator_fee_percent.to_string()
            ),
            (30, "15".to_string())
        );
        assert!(!a.server.webhook_allow_private, "refused unless asked for");
        assert!(
            a.server.allow_egress.is_empty(),
            "public only unless asked for"
        );
        let Command::Up(a) = parse(&[
            "up",
            "--allow-egress",
            "10.2.0.0/16:5672",
            "--allow-egress",
            "127.0.0.1",
            "--gateway-anonymous-rate-limit",
            "50",
        ])
        .unwrap()
        .command
        else {
            panic!("not up")
        };
        let rules: Vec<String> = a
            .server
            .allow_egress
            .iter()
            .map(|r| r.to_string())
            .collect();
        assert_eq!(rules, ["10.2.0.0/16:5672", "127.0.0.1/32"]);
        assert_eq!(a.gateway_anonymous_rate_limit, 50);
        for (flag, value, says) in [
            ("--operator-fee-percent", "101", "between 0 and 100"),
            ("--operator-fee-percent", "-1", "between 0 and 100"),
            ("--operator-fee-percent", "ten", "not a decimal"),
            ("--billing-every", "0", "0"),
            ("--billing-every", "3601", "3601"),
            ("--allow-egress", "10.0.0.1:0", "expected CIDR"),
            ("--allow-egress", "nowhere", "expected CIDR"),
        ] {
            let arg = format!("{flag}={value}");
            let e = parse(&["server", &arg]).unwrap_err().to_string();
            assert!(e.contains(flag) && e.contains(says), "{flag} {value}: {e}");
        }
    }

    #[test]
    fn subcommands_with_optional_actions() {
        let cli = parse(&["quota", "set", "--gpus-total", "none", "--gpu", "H100=2"]).unwrap();
        let Command::Quota {
            command: Some(QuotaCommand::Set {
                gpus_total, gpu, ..
            }),
            ..
        } = cli.command
        else {
            panic!("not quota set")
        };
        assert_eq!(gpus_total, Some(Limit::Unlimited));
        assert_eq!(gpu, [("H100".to_string(), Limit::Max(2))]);
        assert!(matches!(
            parse(&["tenants"]).unwrap().command,
            Command::Tenants { command: None }
        ));
        assert!(matches!(
            parse(&["nodes"]).unwrap().command,
            Command::Nodes { command: None }
        ));
        assert!(matches!(
            parse(&["nodes", "show", "node_x"]).unwrap().command,
            Command::Nodes {
                command: Some(NodesCommand::Show { .. })
            }
        ));
        assert!(matches!(
            parse(&["registries", "add", "ghcr.io", "-u", "me", "--secret-stdin"])
                .unwrap()
                .command,
            Command::Registries {
                command: Some(registries::RegistriesCommand::Add {
                    secret_stdin: true,
                    ..
                })
            }
        ));
        assert!(parse(&["registries", "add", "ghcr.io", "--secret", "x"]).is_err());
        assert!(matches!(
            parse(&["keys", "revoke", "key_x"]).unwrap().command,
            Command::Keys {
                command: Some(KeysCommand::Revoke { .. })
            }
        ));
    }

    #[test]
    fn billing_commands_parse_and_refuse_contradictions() {
        assert!(matches!(
            parse(&["invoices"]).unwrap().command,
            Command::Invoices { command: None }
        ));
        assert!(matches!(
            parse(&["invoices", "show", "inv_x", "--csv"])
                .unwrap()
                .command,
            Command::Invoices {
                command: Some(billing::InvoicesCommand::Show { csv: true, .. })
            }
        ));
        assert!(matches!(
            parse(&["usage", "--csv"]).unwrap().command,
            Command::Usage { csv: true, .. }
        ));
        parse(&["prices", "set", "--file", "book.json"]).unwrap();
        parse(&["payouts", "--period", "2025-01"]).unwrap();
        parse(&[
            "estimate",
            "--gpu",
            "H100",
            "--count",
            "8",
            "--hours-per-day",
            "10",
        ])
        .unwrap();
        // Dedicated and serverless at once, or serverless flags without a rate.
        assert!(parse(&["estimate", "--count", "1", "--rps", "2"]).is_err());
        assert!(parse(&["estimate", "--input-tokens", "5"]).is_err());
        assert!(parse(&["budget", "set", "--limit", "ten"]).is_err());
        assert!(
            parse(&["invoices", "finalise"]).is_err(),
            "--period is required"
        );
    }

    #[test]
    fn error_lines_join_the_chain_once() {
        let e = anyhow::anyhow!("connection refused").context("opening the database");
        assert_eq!(error_line(&e), "opening the database: connection refused");
        let e = anyhow::anyhow!("boom\nsecond line");
        assert_eq!(error_line(&e), "boom second line");
    }
}
