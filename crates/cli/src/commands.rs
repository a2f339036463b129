//! The client commands: each calls the API through [`Client`] and prints
//! either a table (people) or the raw JSON answer (`--json`, lists as one
//! array of every item). Status messages go to stderr so stdout stays
//! parseable.

use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context, Result};
use chrono::Utc;
use flotilla_billing::meter::Meter;
use flotilla_client::UsageRange;
use flotilla_core::api::{CreateApiKey, CreateTenant, Instance, Me, QuotaView};
use flotilla_core::catalog::Catalog;
use flotilla_core::id::{InstanceId, KeyId, TenantId};
use flotilla_core::instance::{BillingClass, CreateInstance, InstanceState};
use flotilla_core::tenant::Role;

use crate::client::Client;
use crate::config::{self, Credentials};
pub use crate::ctx::Ctx;
use crate::daemon::Signals;
use crate::follow::{self, FollowOptions, Followed};
use crate::limits::parse_memory;
use crate::output::{self, age, one_line, outln, print_answer, print_json, print_table, table};

/// Validates an id argument locally: a typo is caught before it becomes
/// part of a URL path.
fn instance_id(s: &str) -> Result<InstanceId> {
    InstanceId::parse(s.trim(), "instance id").map_err(|e| anyhow!("{e}"))
}

/// `flotilla login`.
pub async fn login(
    server: Option<String>,
    api_key: Option<String>,
    tls: config::TlsFlags<'_>,
) -> Result<ExitCode> {
    let server = config::normalize_server(server.as_deref().unwrap_or(config::DEFAULT_SERVER));
    let api_key = api_key
        .map(|k| k.trim().to_string())
        .filter(|k| !k.is_empty())
        .ok_or_else(|| anyhow!("login needs --api-key KEY (or FLOTILLA_API_KEY)"))?;
    let creds = Credentials {
        tls_fingerprint: tls
            .fingerprint
            .map(|f| f.trim().to_string())
            .filter(|f| !f.is_empty()),
        // Saved absolute: later commands may run from another directory.
        ca_cert: tls
            .ca_cert
            .map(std::path::absolute)
            .transpose()
            .context("resolving --ca-cert")?,
        ..Credentials::new(server.clone(), api_key.clone())
    };
    let client = crate::client::connect(&server, &api_key, creds.trust()?)?;
    let me: Me = client.me().await?;
    let path = config::credentials_path()?;
    config::save(&path, &creds)?;
    outln!(
        "logged in to {server} as {} of tenant {}",
        me.key.role.as_str(),
        me.tenant.name
    )?;
    eprintln!("credentials saved to {}", path.display());
    Ok(ExitCode::SUCCESS)
}

/// `flotilla gpus`.
pub async fn gpus(ctx: &Ctx) -> Result<ExitCode> {
    let gpus = ctx.client.gpu_types().await?;
    if ctx.json {
        print_answer(&gpus)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut t = table([
        "MODEL", "VENDOR", "MEMORY", "MIG", "PERF", "PRICE/H", "TOTAL", "FREE",
    ]);
    for g in gpus {
        let vendor = serde_json::to_value(g.model.vendor)?;
        t.add_row([
            g.model.name.clone(),
            vendor.as_str().unwrap_or("-").to_string(),
            format!("{} GiB", g.model.memory_gib),
            if g.model.mig_profiles.is_empty() {
                "-".into()
            } else {
                "yes".into()
            },
            format!("{:.2}x", g.model.relative_performance),
            format!("${}", g.model.list_price_per_hour),
            g.total.to_string(),
            g.free.to_string(),
        ]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}

/// `flotilla nodes`.
pub async fn nodes(ctx: &Ctx) -> Result<ExitCode> {
    let nodes = ctx.client.nodes().await?;
    if ctx.json {
        print_answer(&nodes)?;
        return Ok(ExitCode::SUCCESS);
    }
    let now = Utc::now();
    let mut t = table([
        "ID",
        "NAME",
        "REGION",
        "POOL",
        "EXECUTOR",
        "RUNTIME",
        "STATE",
        "GPUS",
        "HEARTBEAT",
    ]);
    for n in nodes {
        t.add_row([
            n.id.to_string(),
            n.name.clone(),
            n.region.clone(),
            n.pool.clone(),
            n.executor.as_str().to_string(),
            n.runtime.to_string(),
            output::node_state(&n),
            output::node_gpus(&n),
            age(now, n.last_heartbeat_at),
        ]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}

/// Billing classes as typed on the command line.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Billing {
    /// Pay per second at the on-demand price.
    #[value(alias = "on_demand")]
    OnDemand,
    /// Cheaper, may be preempted.
    Spot,
    /// Drawn from a reserved commitment.
    Reserved,
}

impl From<Billing> for BillingClass {
    fn from(b: Billing) -> Self {
        match b {
            Billing::OnDemand => BillingClass::OnDemand,
            Billing::Spot => BillingClass::Spot,
            Billing::Reserved => BillingClass::Reserved,
        }
    }
}

/// What any work asks for: the arguments `flotilla run` (a work of one
/// member, an instance) and `flotilla jobs submit` (a gang of `--nodes`
/// members) share. One set, so the two commands cannot drift apart.
#[derive(Debug, clap::Args)]
pub struct WorkArgs {
    /// Whole GPUs, all of one model, on one node; for a job, of the whole
    /// job, divided evenly among its members.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub gpus: u32,
    /// Acceptable GPU models, comma-separated (default: any).
    #[arg(long = "gpu-type", value_delimiter = ',', value_name = "MODEL[,MODEL]")]
    pub gpu_types: Vec<String>,
    /// A share of one GPU instead of whole GPUs (0.001-1, e.g. 0.25): a
    /// thread percentage and a memory cap of that share, billed by share
    /// (for a job, per member; --gpus must then equal --nodes).
    #[arg(long, value_name = "SHARE", conflicts_with = "mig")]
    pub gpu_fraction: Option<f64>,
    /// One MIG instance of this profile (e.g. 1g.10gb) on a GPU in MIG mode
    /// (for a job, per member).
    #[arg(long, value_name = "PROFILE")]
    pub mig: Option<String>,
    /// CPU in thousandths of a core, per member (default: a GPU's share of
    /// the node's CPUs, times the GPUs asked; a fraction scaled down).
    #[arg(long, value_name = "MILLI", conflicts_with = "cpus")]
    pub cpu: Option<u32>,
    /// CPU in cores, per member (e.g. 1 or 0.5); the same as --cpu in
    /// thousandths. A container is held to it.
    #[arg(long, value_name = "CORES", value_parser = parse_cpus)]
    pub cpus: Option<u32>,
    /// Memory per member: MiB, or with a unit (512M, 2G; default: a GPU's
    /// share of the node's memory, as for CPU). A
    /// container is held to it and killed (out of memory) above it.
    #[arg(long, value_name = "SIZE", value_parser = parse_memory)]
    pub memory: Option<u64>,
    /// Environment variable for the command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_env)]
    pub env: Vec<(String, String)>,
    /// Working directory on the node (absolute).
    #[arg(long, value_name = "DIR")]
    pub workdir: Option<String>,
    /// Display name (a DNS label).
    #[arg(long)]
    pub name: Option<String>,
    /// Billing class.
    #[arg(long, value_enum, default_value = "on-demand")]
    pub billing: Billing,
    /// Queue priority, higher first (-1000..=1000, default 0). Within a
    /// tier, higher priority work may preempt preemptible work of lower
    /// priority.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub priority: Option<i32>,
    /// Service tier: 1 dedicated (never preempted), 2 shared/spot, 3
    /// queued (default: 2 for spot, 1 otherwise).
    #[arg(long, value_name = "1|2|3", value_parser = clap::value_parser!(u8).range(1..=3))]
    pub tier: Option<u8>,
    /// Allow the scheduler to preempt this work (with a 30 s notice, then
    /// requeue it whole) for more important work (default: only for spot).
    #[arg(long)]
    pub preemptible: bool,
    /// Run this OCI image in a container (on nodes whose agent runs the
    /// container runtime) instead of the command on the node.
    #[arg(long, value_name = "IMAGE")]
    pub image: Option<String>,
    /// A container port to publish (repeatable); the node picks the host
    /// port, shown with its URL in `ps` and `explain`.
    #[arg(long = "port", short = 'p', value_name = "PORT", requires = "image")]
    pub ports: Vec<u16>,
    /// Disk limit of the instance's working directory on a process node
    /// (`512M`, `20G`): past it the instance is stopped ("disk limit
    /// exceeded"); default: the node's (`--default-disk`).
    #[arg(long, value_name = "SIZE", value_parser = parse_memory)]
    pub disk: Option<u64>,
    /// Size of the container's scratch space at /scratch, MiB (default 1024).
    #[arg(long, value_name = "MB", requires = "image")]
    pub scratch: Option<u64>,
    /// The program and its arguments (after `--`); with `--image`, it
    /// replaces the image's default command and may be left out.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub command: Vec<String>,
}

impl WorkArgs {
    /// The GPU models, trimmed, empty entries dropped.
    pub fn models(&self) -> Vec<String> {
        self.gpu_types
            .iter()
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .collect()
    }

    /// What these options ask for, as one member's request (an instance;
    /// a job's members each ask for this).
    pub fn into_request(self) -> CreateInstance {
        CreateInstance {
            gpu_types: self.models(),
            name: self.name,
            gpus: self.gpus,
            cpu_milli: self.cpu.or(self.cpus),
            memory_mb: self.memory,
            command: self.command,
            env: self.env.into_iter().collect(),
            workdir: self.workdir,
            billing_class: self.billing.into(),
            priority: self.priority,
            tier: self.tier,
            preemptible: self.preemptible.then_some(true),
            gpu_fraction: self.gpu_fraction,
            mig_profile: self.mig,
            image: self.image,
            ports: self.ports,
            scratch_mb: self.scratch,
            disk_mb: self.disk,
        }
    }
}

/// `flotilla run` options: the work, and how to follow it.
#[derive(Debug, clap::Args)]
#[command(group = clap::ArgGroup::new("what").required(true).args(["image", "command"]).multiple(true))]
pub struct RunArgs {
    #[command(flatten)]
    pub work: WorkArgs,
    /// Print the instance id and return instead of following it.
    #[arg(long, short = 'd')]
    pub detach: bool,
}

/// Parses `--cpus 1.5` into milli-cores.
pub fn parse_cpus(s: &str) -> std::result::Result<u32, String> {
    let cores: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("expected a number of cores such as 1 or 0.5, got `{s}`"))?;
    let milli = (cores * 1000.0).round();
    if !cores.is_finite() || !(1.0..=1_024_000.0).contains(&milli) {
        return Err(format!("expected between 0.001 and 1024 cores, got `{s}`"));
    }
    Ok(milli as u32)
}

/// Parses `--env K=V`.
pub fn parse_env(s: &str) -> std::result::Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        Some(_) => Err(format!(
            "expected K=V with a variable name before `=`, got `{s}`"
        )),
        None => Err(format!("expected K=V, got `{s}`")),
    }
}

/// `flotilla queue`: instances and jobs waiting, in the scheduler's order
/// ([`crate::queue`]).
pub async fn queue(ctx: &Ctx) -> Result<ExitCode> {
    crate::queue::all(ctx).await
}

/// `flotilla run`.
pub async fn run(ctx: &Ctx, args: RunArgs) -> Result<ExitCode> {
    let req = args.work.into_request();
    // Take over Ctrl-C before the instance exists, so an interrupt right
    // after the create still stops it.
    let signals = if args.detach {
        None
    } else {
        Some(Signals::new()?)
    };
    let inst = ctx.client.create_instance(&req).await?;
    eprintln!("instance {} created", inst.id);
    if args.detach {
        if ctx.json {
            print_answer(&inst)?;
        } else {
            outln!("{}", inst.id)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let opts = FollowOptions {
        progress: true,
        json: false,
        signals,
    };
    match follow::follow(&ctx.client, inst, 0, opts).await? {
        Followed::Final(inst) => {
            eprintln!(
                "{}",
                output::state_line(&inst, inst.state, &inst.state_reason)
            );
            Ok(ExitCode::from(follow::exit_code_for(&inst)))
        }
        Followed::Abandoned => Ok(ExitCode::from(130)),
    }
}

/// `flotilla ps` options.
#[derive(Debug, clap::Args)]
pub struct PsArgs {
    /// Include finished instances (succeeded, failed, stopped).
    #[arg(long, short = 'a')]
    pub all: bool,
    /// Only instances in this state.
    #[arg(long, value_parser = parse_state)]
    pub state: Option<InstanceState>,
    /// Show at most this many.
    #[arg(long)]
    pub limit: Option<usize>,
}

fn parse_state(s: &str) -> std::result::Result<InstanceState, String> {
    InstanceState::parse(&s.trim().to_ascii_lowercase()).ok_or_else(|| {
        let all: Vec<&str> = InstanceState::ALL.iter().map(|s| s.as_str()).collect();
        format!("unknown state `{s}`; one of: {}", all.join(", "))
    })
}

/// `flotilla ps`.
pub async fn ps(ctx: &Ctx, args: PsArgs) -> Result<ExitCode> {
    // Finished instances are hidden unless asked for by --all or --state.
    let hide_final = !args.all && args.state.is_none();
    let server_limit = if hide_final { None } else { args.limit };
    let mut shown = ctx.client.instances(args.state, server_limit).await?;
    if hide_final {
        shown.retain(|i| !i.state.is_terminal());
    }
    if let Some(l) = args.limit {
        shown.truncate(l);
    }
    if ctx.json {
        print_answer(&shown)?;
        return Ok(ExitCode::SUCCESS);
    }
    let now = Utc::now();
    let mut t = table([
        "ID", "NAME", "STATE", "GPUS", "NODE", "AGE", "URLS", "REASON",
    ]);
    for i in shown {
        t.add_row([
            i.id.to_string(),
            i.name.clone().unwrap_or_else(|| "-".into()),
            i.state.as_str().to_string(),
            output::instance_gpus(&i),
            i.node_id.as_ref().map_or("-".into(), |n| n.to_string()),
            age(now, i.created_at),
            output::instance_urls(&i),
            one_line(&i.state_reason),
        ]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}

/// `flotilla top`: the latest readings of an instance's GPUs.
pub async fn top(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    let id = instance_id(id)?;
    let t = ctx.client.instance_telemetry(&id).await?;
    if ctx.json {
        print_answer(&t)?;
        return Ok(ExitCode::SUCCESS);
    }
    if t.gpus.is_empty() {
        outln!(
            "{id}: no GPU readings (it holds no GPU now, its GPUs are simulated, \
             or its node has not reported recently)"
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    let dash = || "-".to_string();
    let mut table_ = table([
        "GPU", "DEVICE", "UTIL", "MEM UTIL", "MEMORY", "TEMP", "POWER", "SM CLOCK",
    ]);
    for g in &t.gpus {
        let memory = match (g.fb_used_mib, g.fb_free_mib) {
            (Some(used), Some(free)) => format!("{used} / {} MiB", used + free),
            (Some(used), None) => format!("{used} MiB"),
            _ => dash(),
        };
        table_.add_row([
            g.index.to_string(),
            g.device_name.clone(),
            g.gpu_util_pct.map_or_else(dash, |v| format!("{v}%")),
            g.mem_copy_util_pct.map_or_else(dash, |v| format!("{v}%")),
            memory,
            g.temperature_c.map_or_else(dash, |v| format!("{v} C")),
            g.power_w.map_or_else(dash, |v| format!("{v:.0} W")),
            g.sm_clock_mhz.map_or_else(dash, |v| format!("{v} MHz")),
        ]);
    }
    print_table(&table_)?;
    if let Some(at) = t.at {
        outln!("read {} ago", age(Utc::now(), at))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `flotilla logs`.
pub async fn logs(ctx: &Ctx, id: &str, follow_it: bool) -> Result<ExitCode> {
    let id = instance_id(id)?;
    instance_logs(ctx, id.as_str(), follow_it).await
}

/// Prints an instance's output: what it has written so far, or with
/// `follow_it` everything until it ends. A job member's output is its
/// instance's, so `jobs logs` comes here too.
pub(crate) async fn instance_logs(ctx: &Ctx, id: &str, follow_it: bool) -> Result<ExitCode> {
    if follow_it {
        let inst: Instance = ctx.client.instance(id).await?;
        let opts = FollowOptions {
            progress: false,
            json: ctx.json,
            signals: None,
        };
        follow::follow(&ctx.client, inst, 0, opts).await?;
        return Ok(ExitCode::SUCCESS);
    }
    let lines = ctx.client.logs_all(id, 0).await?;
    if ctx.json {
        print_json(&lines)?;
    } else {
        for l in &lines {
            follow::write_line(l, false)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `flotilla stop`.
pub async fn stop(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    let id = instance_id(id)?;
    let inst = ctx.client.stop_instance(id.as_str()).await?;
    end_work(ctx, &inst, "stopping", |i: &Instance| {
        (i.id.to_string(), i.state.as_str(), i.state.is_terminal())
    })
}

/// Says where work asked to end (an instance's stop, a job's cancel)
/// stands, from the server's answer to the ask: `ID STATE`, with
/// `(still_note)` while it is still being stopped; the answer itself with
/// `--json`.
pub(crate) fn end_work<W: serde::Serialize>(
    ctx: &Ctx,
    answer: &W,
    still_note: &str,
    state: impl Fn(&W) -> (String, &'static str, bool),
) -> Result<ExitCode> {
    if ctx.json {
        print_answer(answer)?;
        return Ok(ExitCode::SUCCESS);
    }
    let (id, name, ended) = state(answer);
    if ended {
        outln!("{id} {name}")?;
    } else {
        outln!("{id} {name} ({still_note})")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `flotilla explain ID`.
pub async fn explain(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    let id = instance_id(id)?;
    let inst = ctx.client.instance(id.as_str()).await?;
    if ctx.json {
        print_answer(&inst)?;
        return Ok(ExitCode::SUCCESS);
    }
    for line in explanation(&inst) {
        outln!("{line}")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The lines `flotilla explain` prints.
fn explanation(inst: &Instance) -> Vec<String> {
    let models = if inst.gpu_types.is_empty() {
        "any model".to_string()
    } else {
        inst.gpu_types.join(" or ")
    };
    let mut out = vec![
        format!(
            "{} is {}: {}",
            inst.id,
            inst.state.as_str(),
            inst.state_reason
        ),
        format!(
            "asked for: {} GPU(s) of {models}, {} milli-CPU, {} MiB, billed {}",
            inst.gpus,
            inst.cpu_milli,
            inst.memory_mb,
            inst.billing_class.as_str()
        ),
    ];
    match (&inst.node_id, &inst.gpu_model) {
        (Some(node), Some(model)) => {
            let gpus: Vec<&str> = inst.gpu_ids.iter().map(|g| g.as_str()).collect();
            out.push(format!(
                "placed on: {node}, {}x{model}: {}",
                gpus.len(),
                gpus.join(", ")
            ));
        }
        _ if inst.state == flotilla_core::instance::InstanceState::Pending => {
            out.push("placed on: nowhere yet; the reason above says what no node offers".into());
        }
        _ => {}
    }
    if let Some(image) = &inst.image {
        let ports: Vec<String> = image.ports.iter().map(u16::to_string).collect();
        out.push(format!(
            "image: {} (ports: {}, scratch: {} MiB)",
            image.image,
            if ports.is_empty() {
                "none".into()
            } else {
                ports.join(", ")
            },
            image.scratch_mb.unwrap_or(1024)
        ));
    }
    for p in &inst.published_ports {
        out.push(format!("port {}: {}", p.container_port, p.url));
    }
    if let Some(c) = &inst.cold_start {
        let ms = |v: Option<u64>| v.map_or("-".to_string(), |v| format!("{v} ms"));
        out.push(format!(
            "cold start: queued {}, pulling {}{}, starting {}",
            ms(c.queued_ms),
            ms(c.pulling_ms),
            if c.image_cached {
                " (image cached on the node)"
            } else {
                ""
            },
            ms(c.starting_ms)
        ));
    }
    if let Some(code) = inst.exit_code {
        out.push(format!("exit code: {code}"));
    }
    if let Some(j) = &inst.job {
        out.push(format!(
            "member: rank {} of {}, attempt {} (flotilla explain {} for the gang)",
            j.rank, j.job_id, j.attempt, j.job_id
        ));
    }
    output::history(
        &mut out,
        inst.events
            .iter()
            .map(|e| (e.at, e.state.as_str(), &*e.reason)),
    );
    out
}

/// `flotilla usage`: the caller's metered usage events in a time range
/// (default: the current month).
pub async fn usage(
    ctx: &Ctx,
    from: Option<String>,
    to: Option<String>,
    csv: bool,
) -> Result<ExitCode> {
    let now = Utc::now();
    let month_start = format!("{}-01T00:00:00Z", now.format("%Y-%m"));
    let range = UsageRange {
        from: from.unwrap_or(month_start),
        to: to.unwrap_or_else(|| now.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
    };
    if csv {
        return crate::billing::usage_csv(ctx, &range).await;
    }
    let events = ctx.client.usage(&range).await?;
    if ctx.json {
        print_answer(&events)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut t = table(["END", "SUBJECT", "METER", "CLASS", "AMOUNT", "SECONDS"]);
    for e in events {
        let meter = match &e.meter {
            Meter::GpuSeconds { model, share } => {
                format!("gpu {}", output::metered_gpu(model, share))
            }
            Meter::InstanceSeconds => "instance seconds".to_string(),
            Meter::StorageGbSeconds => "storage gb seconds".to_string(),
            Meter::ParkedGbSeconds => "parked gb seconds".to_string(),
            Meter::Requests => "requests".to_string(),
            Meter::InputTokens => "input tokens".to_string(),
            Meter::OutputTokens => "output tokens".to_string(),
        };
        t.add_row([
            output::wire(&e.end),
            e.subject.id.clone(),
            meter,
            output::wire(&e.billing_class),
            output::wire(&e.amount),
            (e.end - e.start).num_seconds().to_string(),
        ]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}

/// `flotilla tenants`.
pub async fn tenants_list(ctx: &Ctx) -> Result<ExitCode> {
    let tenants = ctx.client.tenants().await?;
    if ctx.json {
        print_answer(&tenants)?;
        return Ok(ExitCode::SUCCESS);
    }
    let now = Utc::now();
    let mut t = table(["ID", "NAME", "AGE"]);
    for tn in tenants {
        t.add_row([tn.id.to_string(), tn.name.clone(), age(now, tn.created_at)]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}

/// `flotilla tenants create`.
pub async fn tenants_create(ctx: &Ctx, name: String) -> Result<ExitCode> {
    let tn = ctx.client.create_tenant(&CreateTenant { name }).await?;
    if ctx.json {
        print_answer(&tn)?;
        return Ok(ExitCode::SUCCESS);
    }
    outln!("tenant {} created: {}", tn.name, tn.id)?;
    Ok(ExitCode::SUCCESS)
}

/// A tenant given by id (`ten_…`) or by name; `None` is the caller's own.
async fn resolve_tenant(client: &Client, given: Option<&str>) -> Result<TenantId> {
    let Some(given) = given.map(str::trim) else {
        let me: Me = client.me().await?;
        return Ok(me.tenant.id);
    };
    if given.starts_with(TenantId::PREFIX) {
        return TenantId::parse(given, "--tenant").map_err(|e| anyhow!("{e}"));
    }
    let tenants = client.tenants().await?;
    tenants
        .into_iter()
        .find(|t| t.name == given)
        .map(|t| t.id)
        .ok_or_else(|| anyhow!("no tenant named `{given}`"))
}

/// `flotilla keys`.
pub async fn keys_list(ctx: &Ctx) -> Result<ExitCode> {
    let keys = ctx.client.keys().await?;
    if ctx.json {
        print_answer(&keys)?;
        return Ok(ExitCode::SUCCESS);
    }
    let now = Utc::now();
    let mut t = table(["ID", "NAME", "ROLE", "TENANT", "PREFIX", "AGE", "STATUS"]);
    for k in keys {
        let status = match k.revoked_at {
            Some(at) => format!("revoked {} ago", age(now, at)),
            None => "active".into(),
        };
        t.add_row([
            k.id.to_string(),
            if k.name.is_empty() {
                "-".into()
            } else {
                k.name.clone()
            },
            k.role.as_str().to_string(),
            k.tenant_id.to_string(),
            k.prefix.clone(),
            age(now, k.created_at),
            status,
        ]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}

/// `flotilla audit`: the newest `limit` entries of the audit log.
pub async fn audit(ctx: &Ctx, tenant: Option<String>, limit: u64) -> Result<ExitCode> {
    let tenant = match tenant {
        Some(t) => Some(resolve_tenant(&ctx.client, Some(&t)).await?),
        None => None,
    };
    let limit = Some(usize::try_from(limit).unwrap_or(usize::MAX));
    let entries = ctx.client.audit(tenant.as_ref(), limit).await?;
    if ctx.json {
        print_answer(&entries)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut t = table(["AT", "TENANT", "KEY", "CALL", "OBJECT", "STATUS"]);
    for e in entries {
        t.add_row([
            e.at.format("%Y-%m-%d %H:%M:%S").to_string(),
            e.tenant_id.to_string(),
            e.key_id.to_string(),
            format!("{} {}", e.method, e.route),
            e.object_id.unwrap_or_else(|| "-".into()),
            e.status.to_string(),
        ]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}

/// Parses a role name.
pub fn parse_role(s: &str) -> std::result::Result<Role, String> {
    Role::parse(s.trim()).ok_or_else(|| {
        format!("unknown role `{s}`; one of: operator, tenant_admin, tenant_member, provider")
    })
}

/// `flotilla keys create`.
pub async fn keys_create(
    ctx: &Ctx,
    role: Role,
    tenant: Option<String>,
    name: Option<String>,
) -> Result<ExitCode> {
    let tenant_id = match tenant {
        Some(t) => Some(resolve_tenant(&ctx.client, Some(&t)).await?),
        None => None,
    };
    let req = CreateApiKey {
        tenant_id,
        role,
        name: name.unwrap_or_default(),
        endpoints: None,
    };
    let created = ctx.client.create_key(&req).await?;
    eprintln!("warning: the secret is shown only this once; store it now");
    if ctx.json {
        print_answer(&created)?;
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!(
        "key {} created: {} of tenant {}",
        created.key.id,
        created.key.role.as_str(),
        created.key.tenant_id
    );
    outln!("{}", created.secret)?;
    Ok(ExitCode::SUCCESS)
}

/// `flotilla keys revoke`.
pub async fn keys_revoke(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    let id = KeyId::parse(id.trim(), "key id").map_err(|e| anyhow!("{e}"))?;
    ctx.client.revoke_key(&id).await?;
    if ctx.json {
        print_json(&serde_json::json!({ "id": id, "revoked": true }))?;
    } else {
        outln!("key {id} revoked")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// A limit given on the command line: a number, or `none` for unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// At most this many GPUs.
    Max(u32),
    /// No limit.
    Unlimited,
}

impl Limit {
    fn as_option(self) -> Option<u32> {
        match self {
            Limit::Max(n) => Some(n),
            Limit::Unlimited => None,
        }
    }
}

/// Parses `N` or `none`.
pub fn parse_limit(s: &str) -> std::result::Result<Limit, String> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("none") {
        return Ok(Limit::Unlimited);
    }
    s.parse::<u32>()
        .map(Limit::Max)
        .map_err(|_| format!("expected a whole number of GPUs or `none`, got `{s}`"))
}

/// Parses `--gpu MODEL=N` (`MODEL=none` removes the model's limit).
pub fn parse_model_limit(s: &str) -> std::result::Result<(String, Limit), String> {
    let Some((model, n)) = s.split_once('=') else {
        return Err(format!("expected MODEL=N, got `{s}`"));
    };
    let model = model.trim();
    if model.is_empty() {
        return Err(format!(
            "expected MODEL=N with a model before `=`, got `{s}`"
        ));
    }
    Ok((model.to_string(), parse_limit(n)?))
}

/// `flotilla quota`.
pub async fn quota_show(ctx: &Ctx, tenant: Option<String>) -> Result<ExitCode> {
    let tenant_id = resolve_tenant(&ctx.client, tenant.as_deref()).await?;
    let view = ctx.client.quota(&tenant_id).await?;
    print_quota(ctx, view)
}

fn print_quota(ctx: &Ctx, view: QuotaView) -> Result<ExitCode> {
    if ctx.json {
        print_answer(&view)?;
        return Ok(ExitCode::SUCCESS);
    }
    let fmt = |l: Option<u32>| l.map_or("unlimited".to_string(), |n| n.to_string());
    outln!("tenant {}", view.tenant_id)?;
    let mut t = table(["QUOTA", "LIMIT", "IN USE"]);
    t.add_row([
        "gpus_total".to_string(),
        fmt(view.quota.gpus_total),
        view.usage.gpus_total.to_string(),
    ]);
    let models: BTreeSet<&String> = view
        .quota
        .gpus_per_model
        .keys()
        .chain(view.usage.gpus_per_model.keys())
        .collect();
    for m in models {
        t.add_row([
            m.clone(),
            fmt(view.quota.gpus_per_model.get(m).copied()),
            view.usage
                .gpus_per_model
                .get(m)
                .copied()
                .unwrap_or(0)
                .to_string(),
        ]);
    }
    print_table(&t)?;
    outln!(
        "guaranteed GPUs: {}; fair-share weight: {}",
        view.quota
            .gpus_guaranteed
            .map_or("none".to_string(), |n| n.to_string()),
        view.quota.weight_or_default()
    )?;
    Ok(ExitCode::SUCCESS)
}

/// `flotilla quota set`.
pub async fn quota_set(
    ctx: &Ctx,
    tenant: Option<String>,
    gpus_total: Option<Limit>,
    per_model: Vec<(String, Limit)>,
    guaranteed: Option<Limit>,
    weight: Option<Limit>,
) -> Result<ExitCode> {
    if gpus_total.is_none() && per_model.is_empty() && guaranteed.is_none() && weight.is_none() {
        bail!(
            "nothing to change: pass --gpus-total N|none, --gpu MODEL=N, --guaranteed N|none or --weight N|none"
        );
    }
    let tenant_id = resolve_tenant(&ctx.client, tenant.as_deref()).await?;
    let view = ctx.client.quota(&tenant_id).await?;
    let mut quota = view.quota;
    if let Some(l) = gpus_total {
        quota.gpus_total = l.as_option();
    }
    if let Some(l) = guaranteed {
        quota.gpus_guaranteed = l.as_option();
    }
    if let Some(l) = weight {
        quota.weight = l.as_option();
    }
    let catalog = Catalog::default();
    let mut per: BTreeMap<String, u32> = quota.gpus_per_model;
    for (model, limit) in per_model {
        // Canonical spelling where the shipped catalog knows the model; the
        // server judges any other name.
        let model = catalog.resolve(&model, "gpu").unwrap_or(model);
        match limit {
            Limit::Max(n) => {
                per.insert(model, n);
            }
            Limit::Unlimited => {
                per.remove(&model);
            }
        }
    }
    quota.gpus_per_model = per;
    let view = ctx.client.set_quota(&tenant_id, &quota).await?;
    print_quota(ctx, view)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_flags_need_a_name_and_an_equals_sign() {
        assert_eq!(parse_env("A=b=c").unwrap(), ("A".into(), "b=c".into()));
        assert_eq!(
            parse_env("EMPTY=").unwrap(),
            ("EMPTY".into(), String::new())
        );
        assert_eq!(
            parse_env("NOVALUE").unwrap_err(),
            "expected K=V, got `NOVALUE`"
        );
        assert!(parse_env("=v").unwrap_err().contains("variable name"));
    }

    #[test]
    fn gpu_limits_parse_numbers_and_none() {
        assert_eq!(
            parse_model_limit("H100=4").unwrap(),
            ("H100".into(), Limit::Max(4))
        );
        assert_eq!(
            parse_model_limit("l40s=none").unwrap(),
            ("l40s".into(), Limit::Unlimited)
        );
        assert_eq!(
            parse_model_limit("H100").unwrap_err(),
            "expected MODEL=N, got `H100`"
        );
        assert!(parse_model_limit("=3")
            .unwrap_err()
            .contains("model before"));
        assert_eq!(
            parse_model_limit("H100=-1").unwrap_err(),
            "expected a whole number of GPUs or `none`, got `-1`"
        );
        assert!(parse_model_limit("H100=lots").is_err());
        assert_eq!(parse_limit("None").unwrap(), Limit::Unlimited);
    }

    #[test]
    fn states_and_roles_parse_with_helpful_errors() {
        assert_eq!(parse_state("Running").unwrap(), InstanceState::Running);
        assert!(parse_state("done")
            .unwrap_err()
            .contains("pending, scheduled"));
        assert_eq!(parse_role("tenant_member").unwrap(), Role::TenantMember);
        assert!(parse_role("admin").unwrap_err().contains("tenant_admin"));
    }

    #[test]
    fn ids_are_checked_before_they_reach_a_url() {
        assert!(instance_id("inst_01jd3x7k2q9v8m4n6p5r0s1t2w").is_ok());
        let e = instance_id("../keys").unwrap_err().to_string();
        assert!(e.contains("inst_"), "{e}");
    }
}

#[cfg(test)]
mod explain_tests {
    use super::*;

    #[test]
    fn explanation_says_why_and_where() {
        let raw = serde_json::json!({
            "id": "inst_01jd3x7k2q9v8m4n6p5r0s1t2w", "tenant_id": "ten_01jd3x7k2q9v8m4n6p5r0s1t2w",
            "state": "pending", "state_reason": "waiting for GPUs: 0/2 nodes fit: 2 too few free GPUs",
            "gpus": 4, "gpu_types": ["H100", "H200"], "cpu_milli": 1000, "memory_mb": 1024,
            "command": ["x"], "env": {}, "billing_class": "spot", "gpu_ids": [], "stop_requested": false,
            "created_at": "2026-11-29T10:00:00Z",
            "events": [{"state": "pending", "reason": "waiting for placement", "at": "2026-11-29T10:00:00Z"}]
        });
        let inst: Instance = serde_json::from_value(raw).unwrap();
        let lines = explanation(&inst);
        assert!(
            lines[0].ends_with("is pending: waiting for GPUs: 0/2 nodes fit: 2 too few free GPUs")
        );
        assert!(lines[1].contains("4 GPU(s) of H100 or H200") && lines[1].contains("billed spot"));
        assert!(lines[2].starts_with("placed on: nowhere yet"));
        assert_eq!(
            lines.last().unwrap(),
            "  2026-11-29 10:00:00.000Z  pending    waiting for placement"
        );
    }
}
