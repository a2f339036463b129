//! `flotilla endpoints …`: deploy, list, show, update, delete, logs of
//! serverless endpoints. Like every client command, these only call the
//! API (through the typed client); scaling is the server's.

use std::process::ExitCode;

use anyhow::{anyhow, Result};
use chrono::Utc;
use clap::Subcommand;
use flotilla_core::advice::VerticalOptIn;
use flotilla_core::endpoint::{CreateEndpoint, Endpoint, UpdateEndpoint};
use flotilla_core::gateway::Balance;
use flotilla_core::queue_trigger::{redact_url, QueueTrigger, DEFAULT_MESSAGES_PER_REPLICA};

use crate::commands::parse_env;
use crate::ctx::Ctx;
use crate::output::{age, outln, print_json, print_table, table};

/// `flotilla endpoints` actions.
#[derive(Debug, Subcommand)]
pub enum EndpointsCommand {
    /// Deploy an endpoint: replicas run the command with `PORT` set and
    /// serve HTTP there; the gateway routes to them once their readiness
    /// path answers.
    Deploy(Box<DeployArgs>),
    /// List endpoints.
    List,
    /// An endpoint's spec, replicas and last decision.
    Show {
        /// Endpoint id or name.
        endpoint: String,
    },
    /// Change an endpoint; a new command, environment or resources roll
    /// out a new revision without dropping traffic.
    Update(Box<UpdateArgs>),
    /// Delete an endpoint: its replicas drain, then stop.
    Delete {
        /// Endpoint id or name.
        endpoint: String,
    },
    /// Print the replicas' output.
    Logs {
        /// Endpoint id or name.
        endpoint: String,
        /// Only this replica (instance id).
        #[arg(long)]
        replica: Option<String>,
    },
    /// Show or set the endpoint's automatic vertical moves: with
    /// `--classes` it opts in (the replicas may move between those GPU
    /// models when a recommendation holds for `--sustain-s`, each move a
    /// new revision); without, it prints the opt-in and the last move.
    Vertical {
        /// Endpoint id or name.
        endpoint: String,
        /// GPU models the replicas may run on, comma-separated (2 to 16,
        /// the current one among them).
        #[arg(long, value_delimiter = ',', value_name = "MODELS")]
        classes: Vec<String>,
        /// How long a recommendation must hold before it is a move,
        /// seconds (default 600).
        #[arg(long = "sustain-s", value_name = "S", requires = "classes")]
        sustain_s: Option<u64>,
    },
}

/// Scaling and serving settings shared by deploy and update.
#[derive(Debug, Default, clap::Args)]
pub struct Settings {
    /// Model names served (repeatable; default: the endpoint's name).
    #[arg(long = "model", value_name = "NAME")]
    pub models: Vec<String>,
    /// Fewest replicas (0: scale to zero when idle).
    #[arg(long = "min", value_name = "N")]
    pub min_replicas: Option<u32>,
    /// Most replicas.
    #[arg(long = "max", value_name = "N")]
    pub max_replicas: Option<u32>,
    /// Autoscaling policy: flotilla, hpa, keda, kpa or ray.
    #[arg(long)]
    pub policy: Option<String>,
    /// p95 latency objective, ms.
    #[arg(long = "slo-ms", value_name = "MS")]
    pub slo_p95_ms: Option<u64>,
    /// Seconds without a request before scaling to zero.
    #[arg(long = "idle-window", value_name = "SECONDS")]
    pub idle_window_s: Option<u64>,
    /// Path probed for readiness (default /health).
    #[arg(long, value_name = "PATH")]
    pub readiness_path: Option<String>,
    /// Requests one replica takes at once.
    #[arg(long = "concurrency", value_name = "N")]
    pub replica_concurrency: Option<u32>,
    /// Requests per second per inference key.
    #[arg(long = "rate-limit", value_name = "RPS")]
    pub rate_limit_rps: Option<u32>,
    /// Requests that may wait for a replica.
    #[arg(long, value_name = "N")]
    pub queue_limit: Option<u32>,
    /// How long a request may wait for a replica, ms.
    #[arg(long = "queue-timeout-ms", value_name = "MS")]
    pub queue_timeout_ms: Option<u64>,
    /// least-outstanding, prefix-affinity or session-affinity.
    #[arg(long, value_parser = parse_balance)]
    pub balance: Option<Balance>,
    /// Whole GPUs per replica.
    #[arg(long, value_name = "N")]
    pub gpus: Option<u32>,
    /// Acceptable GPU models, comma-separated.
    #[arg(long = "gpu-type", value_delimiter = ',', value_name = "MODEL[,MODEL]")]
    pub gpu_types: Vec<String>,
    /// A share of one GPU per replica (0.001-1).
    #[arg(long, value_name = "SHARE")]
    pub gpu_fraction: Option<f64>,
    /// How long a replica leaving rotation finishes its requests before it
    /// is stopped, ms.
    #[arg(long = "drain-grace-ms", value_name = "MS")]
    pub drain_grace_ms: Option<u64>,
    /// Size of a replica's model weights, GB: nodes cache them, scaled-down
    /// replicas park in host memory, and replicas start where they are
    /// ready soonest.
    #[arg(long = "model-gb", value_name = "GB")]
    pub model_gb: Option<f64>,
    /// How long a scaled-down replica stays parked, s (0: never parked;
    /// default 600 with --model-gb).
    #[arg(long = "keep-parked-s", value_name = "S")]
    pub keep_parked_s: Option<u64>,
    /// Environment variable of the replicas (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_env)]
    pub env: Vec<(String, String)>,
    /// Scale on a RabbitMQ queue's depth (repeatable), e.g.
    /// `amqp://user:pass@host:5672/%2f#jobs`.
    #[arg(long = "rabbitmq-queue", value_name = "URL#QUEUE")]
    pub rabbitmq_queues: Vec<String>,
    /// Scale on a NATS JetStream durable consumer's pending messages
    /// (repeatable), e.g. `nats://host:4222#JOBS/workers`.
    #[arg(long = "nats-consumer", value_name = "URL#STREAM/CONSUMER")]
    pub nats_consumers: Vec<String>,
    /// Target messages per replica for the queue triggers (default 10).
    #[arg(long = "messages-per-replica", value_name = "N")]
    pub messages_per_replica: Option<u32>,
    /// Remove every queue trigger (update only).
    #[arg(long = "no-queue-triggers", conflicts_with_all = ["rabbitmq_queues", "nats_consumers"])]
    pub no_queue_triggers: bool,
    /// Run the replicas from this OCI image in containers (on nodes whose
    /// agent runs the container runtime); on update, `""` goes back to
    /// the command on the node.
    #[arg(long, value_name = "IMAGE")]
    pub image: Option<String>,
    /// With `--image`: a container port to publish (repeatable); the
    /// replica serves on the first (its `PORT`, default 8080).
    #[arg(long = "port", short = 'p', value_name = "PORT")]
    pub ports: Vec<u16>,
}

impl Settings {
    /// The queue triggers the flags name, if any (the server validates
    /// them and names the field at fault).
    fn queue_triggers(&self) -> Result<Option<Vec<QueueTrigger>>> {
        if self.rabbitmq_queues.is_empty() && self.nats_consumers.is_empty() {
            if self.no_queue_triggers {
                return Ok(Some(Vec::new()));
            }
            if self.messages_per_replica.is_some() {
                return Err(anyhow!(
                    "--messages-per-replica needs --rabbitmq-queue or --nats-consumer"
                ));
            }
            return Ok(None);
        }
        let per = self
            .messages_per_replica
            .unwrap_or(DEFAULT_MESSAGES_PER_REPLICA);
        let mut out = Vec::new();
        for v in &self.rabbitmq_queues {
            let (url, queue) = v.rsplit_once('#').ok_or_else(|| {
                anyhow!("--rabbitmq-queue wants URL#QUEUE, got `{}`", redact_url(v))
            })?;
            out.push(QueueTrigger {
                messages_per_replica: per,
                ..QueueTrigger::rabbitmq(url, queue)
            });
        }
        for v in &self.nats_consumers {
            let parsed = v
                .rsplit_once('#')
                .and_then(|(url, sc)| sc.split_once('/').map(|(s, c)| (url, s, c)));
            let Some((url, stream, consumer)) = parsed else {
                return Err(anyhow!(
                    "--nats-consumer wants URL#STREAM/CONSUMER, got `{}`",
                    redact_url(v)
                ));
            };
            out.push(QueueTrigger {
                messages_per_replica: per,
                ..QueueTrigger::nats(url, stream, consumer)
            });
        }
        Ok(Some(out))
    }
}

/// `flotilla endpoints deploy` options.
#[derive(Debug, clap::Args)]
pub struct DeployArgs {
    /// Name (a DNS label, unique among your endpoints).
    pub name: String,
    #[command(flatten)]
    pub settings: Settings,
    /// Tier of the replicas: 1 dedicated, 2 or 3 preemptible.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=3))]
    pub tier: Option<u8>,
    /// The replica's program and arguments (after `--`); with `--image`,
    /// it replaces the image's command and may be left out.
    #[arg(
        required_unless_present = "image",
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub command: Vec<String>,
}

/// `flotilla endpoints update` options.
#[derive(Debug, clap::Args)]
pub struct UpdateArgs {
    /// Endpoint id or name.
    pub endpoint: String,
    #[command(flatten)]
    pub settings: Settings,
    /// A new command (after `--`): a new revision.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub command: Vec<String>,
}

fn parse_balance(s: &str) -> std::result::Result<Balance, String> {
    match s.trim() {
        "least-outstanding" => Ok(Balance::LeastOutstanding),
        "prefix-affinity" => Ok(Balance::PrefixAffinity),
        "session-affinity" => Ok(Balance::SessionAffinity),
        _ => Err(format!(
            "expected least-outstanding, prefix-affinity or session-affinity, got `{s}`"
        )),
    }
}

/// Runs one `flotilla endpoints` action.
pub async fn dispatch(ctx: &Ctx, command: EndpointsCommand) -> Result<ExitCode> {
    match command {
        EndpointsCommand::Deploy(a) => deploy(ctx, *a).await,
        EndpointsCommand::List => list(ctx).await,
        EndpointsCommand::Show { endpoint } => {
            let ep = find(ctx, &endpoint).await?;
            show(ctx, &ep)
        }
        EndpointsCommand::Update(a) => update(ctx, *a).await,
        EndpointsCommand::Delete { endpoint } => {
            let ep = find(ctx, &endpoint).await?;
            let ep = ctx.client.delete_endpoint(ep.id.as_str()).await?;
            if ctx.json {
                print_json(&ep)?;
            } else {
                outln!("{} deleted; its replicas drain, then stop", ep.id)?;
            }
            Ok(ExitCode::SUCCESS)
        }
        EndpointsCommand::Logs { endpoint, replica } => {
            let ep = find(ctx, &endpoint).await?;
            let lines = ctx
                .client
                .endpoint_logs(ep.id.as_str(), replica.as_deref())
                .await?;
            if ctx.json {
                print_json(&lines)?;
            } else {
                for l in lines {
                    outln!(
                        "[{} r{}] {}",
                        l.instance_id,
                        l.revision,
                        flotilla_core::text::escape_controls(&l.line.line)
                    )?;
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        EndpointsCommand::Vertical {
            endpoint,
            classes,
            sustain_s,
        } => {
            let ep = find(ctx, &endpoint).await?;
            let status = if classes.is_empty() {
                ctx.client.endpoint_vertical(ep.id.as_str()).await?
            } else {
                let opt_in = VerticalOptIn {
                    classes,
                    sustain_s: sustain_s.unwrap_or(600),
                };
                ctx.client
                    .set_endpoint_vertical(ep.id.as_str(), &opt_in)
                    .await?
            };
            if ctx.json {
                print_json(&status)?;
            } else {
                outln!(
                    "{}: may move between {} after {} s sustained (opted in {})",
                    ep.name,
                    status.opt_in.classes.join(", "),
                    status.opt_in.sustain_s,
                    status.opted_at.format("%Y-%m-%d %H:%M:%SZ")
                )?;
                match (&status.last_move, status.moved_at) {
                    (Some(why), Some(at)) => {
                        outln!("last move {}: {why}", at.format("%Y-%m-%d %H:%M:%SZ"))?
                    }
                    _ => outln!("no move yet")?,
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// An endpoint by id (`ep_…`) or by name.
async fn find(ctx: &Ctx, key: &str) -> Result<Endpoint> {
    let key = key.trim();
    if key.starts_with("ep_") {
        return Ok(ctx.client.endpoint(key).await?);
    }
    ctx.client
        .endpoints()
        .await?
        .into_iter()
        .find(|e| e.name == key)
        .ok_or_else(|| anyhow!("no endpoint named `{key}`"))
}

async fn deploy(ctx: &Ctx, a: DeployArgs) -> Result<ExitCode> {
    let s = a.settings;
    let queue_triggers = s.queue_triggers()?.unwrap_or_default();
    let req = CreateEndpoint {
        name: a.name,
        command: a.command,
        env: s.env.into_iter().collect(),
        image: s.image,
        ports: s.ports,
        models: s.models,
        gpus: s.gpus,
        gpu_types: s.gpu_types,
        gpu_fraction: s.gpu_fraction,
        min_replicas: s.min_replicas,
        max_replicas: s.max_replicas,
        slo_p95_ms: s.slo_p95_ms,
        tier: a.tier,
        policy: s.policy,
        readiness_path: s.readiness_path,
        idle_window_s: s.idle_window_s,
        queue_limit: s.queue_limit,
        queue_timeout_ms: s.queue_timeout_ms,
        replica_concurrency: s.replica_concurrency,
        balance: s.balance,
        rate_limit_rps: s.rate_limit_rps,
        drain_grace_ms: s.drain_grace_ms,
        model_gb: s.model_gb,
        keep_parked_s: s.keep_parked_s,
        queue_triggers,
        ..CreateEndpoint::default()
    };
    let ep = ctx.client.create_endpoint(&req).await?;
    if ctx.json {
        print_json(&ep)?;
    } else {
        outln!("{}", ep.id)?;
    }
    Ok(ExitCode::SUCCESS)
}

async fn update(ctx: &Ctx, a: UpdateArgs) -> Result<ExitCode> {
    let ep = find(ctx, &a.endpoint).await?;
    let s = a.settings;
    let queue_triggers = s.queue_triggers()?;
    let req = UpdateEndpoint {
        command: (!a.command.is_empty()).then_some(a.command),
        env: (!s.env.is_empty()).then(|| s.env.into_iter().collect()),
        image: s.image,
        ports: (!s.ports.is_empty()).then_some(s.ports),
        models: (!s.models.is_empty()).then_some(s.models),
        gpus: s.gpus,
        gpu_types: (!s.gpu_types.is_empty()).then_some(s.gpu_types),
        gpu_fraction: s.gpu_fraction,
        min_replicas: s.min_replicas,
        max_replicas: s.max_replicas,
        slo_p95_ms: s.slo_p95_ms,
        policy: s.policy,
        readiness_path: s.readiness_path,
        idle_window_s: s.idle_window_s,
        queue_limit: s.queue_limit,
        queue_timeout_ms: s.queue_timeout_ms,
        replica_concurrency: s.replica_concurrency,
        balance: s.balance,
        rate_limit_rps: s.rate_limit_rps,
        drain_grace_ms: s.drain_grace_ms,
        model_gb: s.model_gb,
        keep_parked_s: s.keep_parked_s,
        queue_triggers,
        ..UpdateEndpoint::default()
    };
    let ep = ctx.client.update_endpoint(ep.id.as_str(), &req).await?;
    if ctx.json {
        print_json(&ep)?;
    } else {
        outln!("{} at revision {}", ep.id, ep.revision)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `ready/live` replicas.
fn replicas(e: &Endpoint) -> String {
    let ready = e.replicas.iter().filter(|r| r.ready && !r.draining).count();
    format!("{ready}/{}", e.replicas.len())
}

async fn list(ctx: &Ctx) -> Result<ExitCode> {
    let eps = ctx.client.endpoints().await?;
    if ctx.json {
        print_json(&eps)?;
        return Ok(ExitCode::SUCCESS);
    }
    let now = Utc::now();
    let mut t = table([
        "ID", "NAME", "REV", "MODELS", "READY", "DESIRED", "POLICY", "REASON", "AGE",
    ]);
    for e in eps {
        t.add_row([
            e.id.to_string(),
            e.name.clone(),
            e.revision.to_string(),
            e.spec.models.join(","),
            replicas(&e),
            e.desired_replicas
                .map_or_else(|| "-".into(), |d| d.to_string()),
            e.spec.policy.clone(),
            e.reason.clone().unwrap_or_else(|| "-".into()),
            age(now, e.created_at),
        ]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}

fn show(ctx: &Ctx, e: &Endpoint) -> Result<ExitCode> {
    if ctx.json {
        print_json(e)?;
        return Ok(ExitCode::SUCCESS);
    }
    let s = &e.spec;
    outln!(
        "{} {} revision {}{}",
        e.id,
        e.name,
        e.revision,
        if e.deleting { " (deleting)" } else { "" }
    )?;
    outln!("command: {}", s.command.join(" "))?;
    outln!("models: {}", s.models.join(", "))?;
    outln!(
        "replicas: {} ready of {} live, {}-{} allowed, desired {} ({})",
        e.replicas.iter().filter(|r| r.ready && !r.draining).count(),
        e.replicas.len(),
        s.min_replicas,
        s.max_replicas,
        e.desired_replicas
            .map_or_else(|| "-".into(), |d| d.to_string()),
        e.reason.as_deref().unwrap_or("-")
    )?;
    outln!(
        "policy {}, p95 SLO {} ms, idle window {} s, readiness {}",
        s.policy,
        s.slo_p95_ms,
        s.idle_window_s,
        s.readiness_path
    )?;
    for (t, st) in s
        .queue_triggers
        .iter()
        .zip(e.triggers.iter().map(Some).chain(std::iter::repeat(None)))
    {
        let read = match st {
            Some(st) => match (&st.depth, &st.error) {
                (Some(d), _) => format!("depth {d}, wants {}", st.wants),
                (None, Some(err)) => format!("error: {err}"),
                (None, None) => "not read".into(),
            },
            None => "not read yet".into(),
        };
        outln!(
            "queue trigger {} ({}, {} messages per replica): {read}",
            t.label(),
            t.url,
            t.messages_per_replica
        )?;
    }
    for r in &e.replicas {
        outln!(
            "  {} r{} {} {}{}",
            r.instance_id,
            r.revision,
            r.state.as_str(),
            r.url,
            if r.draining {
                " draining"
            } else if r.ready {
                " ready"
            } else {
                ""
            }
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_core::queue_trigger::QueueKind;

    #[test]
    fn queue_trigger_flags_parse_into_triggers() {
        let s = Settings {
            rabbitmq_queues: vec!["amqp://u:p@h:5672/%2f#jobs".into()],
            nats_consumers: vec!["nats://h:4222#JOBS/workers".into()],
            messages_per_replica: Some(20),
            ..Settings::default()
        };
        let t = s.queue_triggers().unwrap().unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(
            (t[0].kind, t[0].url.as_str(), t[0].queue.as_deref()),
            (QueueKind::Rabbitmq, "amqp://u:p@h:5672/%2f", Some("jobs"))
        );
        assert_eq!(
            (t[1].stream.as_deref(), t[1].consumer.as_deref()),
            (Some("JOBS"), Some("workers"))
        );
        assert!(t.iter().all(|t| t.messages_per_replica == 20));
        assert_eq!(Settings::default().queue_triggers().unwrap(), None);
        let clear = Settings {
            no_queue_triggers: true,
            ..Settings::default()
        };
        assert_eq!(clear.queue_triggers().unwrap(), Some(Vec::new()));
        // A malformed flag is refused without echoing its password.
        let bad = Settings {
            nats_consumers: vec!["nats://tok@h#JOBS".into()],
            ..Settings::default()
        };
        let e = bad.queue_triggers().unwrap_err().to_string();
        assert!(
            e.contains("URL#STREAM/CONSUMER") && !e.contains("tok@"),
            "{e}"
        );
        let lonely = Settings {
            messages_per_replica: Some(5),
            ..Settings::default()
        };
        assert!(lonely.queue_triggers().is_err());
    }
}
