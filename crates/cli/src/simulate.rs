//! `flotilla simulate`: replay a request trace (or a built-in scenario)
//! through the autoscaling policies in the simulator and write a report
//! folder: `report.md` (the comparison table and the setting),
//! `results.json` (the same rows), and one SVG per policy of arrivals
//! against replicas over time. Runs locally; needs no server.
//!
//! `flotilla simulate --from-history FROM..TO` instead replays this
//! cluster's recorded demand (read from the server, operators only)
//! through the scheduling pass the server runs, once with the recorded
//! settings and once with the ones given (`--placement-policy`,
//! `--node-scale`), and reports both beside what actually happened.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use chrono::{DateTime, NaiveDate, Utc};
use clap::Args;
use flotilla_sched::Policy;
use flotilla_sim::engine::{NodePoolConfig, SimResult, TierSetting};
use flotilla_sim::history;
use flotilla_sim::nodes::ProviderConfig;
use flotilla_sim::report::{compare, json, markdown_table, tiered_markdown_table};
use flotilla_sim::scenario::{scale_to_peak, Scenario};
use flotilla_sim::{
    trace, ColdStartModel, PolicyKind, ReadinessTiers, ServiceModel, SimConfig, Tier,
};
use indicatif::{ProgressBar, ProgressStyle};

use crate::ctx::Ctx;

/// Options of `flotilla simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// Request trace: Azure LLM 2023 CSV, GenTD26 `lora_request_trace.csv`,
    /// or the generic `arrival_ms,input_tokens,output_tokens` CSV / JSONL.
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present_any = ["scenario", "from_history"]
    )]
    trace: Option<PathBuf>,
    /// A built-in scenario instead of a trace: `viral-spike` (100 → 10,000
    /// requests/hour), `black-friday` (a 10× step), `on-off` (30 s bursts
    /// between lulls of 20 s to 5 min) or `diurnal` (a 24-hour cycle).
    #[arg(long, value_name = "NAME", conflicts_with = "trace")]
    scenario: Option<String>,
    /// Replay this cluster's own recorded demand of a window instead:
    /// `FROM..TO`, RFC 3339 times or dates (`2026-12-01..2026-12-02`, UTC
    /// midnights). Reads the server's demand history with an operator key.
    #[arg(long, value_name = "FROM..TO", conflicts_with_all = ["trace", "scenario"])]
    from_history: Option<String>,
    /// With --from-history: the placement policy of the changed replay
    /// (BestFit, DotProd, Fgd, Flotilla, GpuClustering, GpuPacking, Random);
    /// default: the server's.
    #[arg(long, value_name = "NAME", requires = "from_history")]
    placement_policy: Option<String>,
    /// With --from-history: scale each kind of machine by this factor in
    /// the changed replay (0.5: half the nodes; 2: twice as many).
    #[arg(long, value_name = "FACTOR", requires = "from_history")]
    node_scale: Option<f64>,
    /// Policies to compare, comma-separated: flotilla,hpa,keda,kpa,ray.
    #[arg(long, default_value = "flotilla,hpa,keda,kpa,ray")]
    policy: String,
    /// Time-to-first-token objective, milliseconds.
    #[arg(long, default_value_t = 2_000)]
    slo_ms: u64,
    /// GPU type of the replicas (catalog name).
    #[arg(long, default_value = "H100")]
    gpu: String,
    /// Seed of the run: same inputs and seed, same report, byte for byte.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Report folder (created if missing).
    #[arg(long, value_name = "DIR", default_value = "simulate-report")]
    out: PathBuf,
    /// Cold-start shape: GenTD26's `basemodel_update_latency_anon.tar.gz`
    /// (or its CSV); default: a log-normal stand-in (σ 0.5).
    #[arg(long, value_name = "FILE")]
    cold_start: Option<PathBuf>,
    /// Median cold start the shape is scaled to, seconds.
    #[arg(long, default_value_t = 60)]
    cold_start_median_s: u64,
    /// Multiply the arrival rate so the peak needs at least this many
    /// replicas (0: replay the trace as it is).
    #[arg(long, default_value_t = 20)]
    peak_replicas: u32,
    /// Most replicas any policy may ask for.
    #[arg(long, default_value_t = 1_000)]
    max_replicas: u32,
    /// Run replicas on a simulated node pool (8-GPU nodes in two regions,
    /// provisioning delays, spot capacity and preemption).
    #[arg(long)]
    node_pool: bool,
    /// Replay the trace's first this-many seconds once before it,
    /// unmeasured, so policies meet it warm (0: start cold and empty).
    #[arg(long, default_value_t = 600)]
    warmup_s: u64,
    /// Endpoint tier: 1 runs on on-demand nodes only.
    #[arg(long, default_value_t = 2)]
    tier: u8,
    /// Readiness tiers: stopped replicas may be parked in host memory or
    /// leave their weights on local disk, and come back at those tiers'
    /// speeds (docs/autoscaling.md); Flotilla's policy runs tiered.
    #[arg(long)]
    tiered: bool,
    /// With --tiered: size of the model's weights, GB (8B in BF16: 16).
    #[arg(long, default_value_t = 16.0, requires = "tiered")]
    model_gb: f64,
    /// With --tiered: nodes the replicas run on.
    #[arg(long, default_value_t = 8, requires = "tiered")]
    tier_nodes: u32,
    /// With --tiered: host memory per node set aside for parked replicas, GB.
    #[arg(long, default_value_t = 512.0, requires = "tiered")]
    parked_gb_per_node: f64,
    /// With --tiered: local disk per node set aside for cached weights, GB.
    #[arg(long, default_value_t = 0.0, requires = "tiered")]
    cache_gb_per_node: f64,
}

/// Whether these arguments replay the cluster's history (which needs the
/// server) rather than a trace (which does not).
pub fn needs_server(args: &SimulateArgs) -> bool {
    args.from_history.is_some()
}

/// Parses one end of `FROM..TO`: an RFC 3339 time or a date (UTC midnight).
fn instant(raw: &str, which: &str) -> Result<DateTime<Utc>> {
    let raw = raw.trim();
    if let Ok(t) = DateTime::parse_from_rfc3339(raw) {
        return Ok(t.with_timezone(&Utc));
    }
    if let Ok(d) = NaiveDate::parse_from_str(raw, "%Y-%m-%d") {
        if let Some(t) = d.and_hms_opt(0, 0, 0) {
            return Ok(t.and_utc());
        }
    }
    bail!("--from-history: {which} `{raw}` is neither an RFC 3339 time nor a YYYY-MM-DD date")
}

/// Parses `FROM..TO`.
fn window(raw: &str) -> Result<(DateTime<Utc>, DateTime<Utc>)> {
    let Some((a, b)) = raw.split_once("..") else {
        bail!("--from-history must be FROM..TO, e.g. 2026-12-01..2026-12-02");
    };
    let (from, to) = (instant(a, "FROM")?, instant(b, "TO")?);
    if from >= to {
        bail!("--from-history: TO must be after FROM");
    }
    Ok((from, to))
}

fn outcome_table(columns: &[(&str, &history::Outcome)]) -> String {
    let mut t = String::from("| |");
    for (name, _) in columns {
        t.push_str(&format!(" {name} |"));
    }
    t.push_str("\n|---|");
    for _ in columns {
        t.push_str("---:|");
    }
    t.push('\n');
    type Cell = fn(&history::Outcome) -> String;
    let rows: [(&str, Cell); 9] = [
        ("works (ran in the record)", |o| o.works.to_string()),
        ("ran", |o| o.ran.to_string()),
        ("never ran", |o| o.never_ran.to_string()),
        ("GPU-hours", |o| format!("{:.3}", o.gpu_hours)),
        ("mean wait (s)", |o| format!("{:.1}", o.mean_wait_s)),
        ("p95 wait (s)", |o| format!("{:.1}", o.p95_wait_s)),
        ("longest wait (s)", |o| format!("{:.1}", o.max_wait_s)),
        ("preemptions", |o| o.preemptions.to_string()),
        ("cost to tenants (list price)", |o| {
            format!("{} {}", o.cost, o.currency)
        }),
    ];
    for (label, cell) in rows {
        t.push_str(&format!("| {label} |"));
        for (_, o) in columns {
            t.push_str(&format!(" {} |", cell(o)));
        }
        t.push('\n');
    }
    t
}

/// `flotilla simulate --from-history`: replay the recorded demand.
pub async fn from_history(ctx: &Ctx, args: SimulateArgs) -> Result<ExitCode> {
    let raw = args.from_history.as_deref().unwrap_or_default();
    let (from, to) = window(raw)?;
    let h = ctx
        .client
        .demand_history(from, to)
        .await
        .context("reading the cluster's demand history")?;
    let server_policy = history::parse_policy(&h.placement_policy).unwrap_or(Policy::Flotilla);
    let policy = match args.placement_policy.as_deref() {
        None => server_policy,
        Some(name) => history::parse_policy(name).ok_or_else(|| {
            anyhow::anyhow!(
                "--placement-policy: unknown policy `{name}`; one of {}",
                Policy::ALL.map(|p| p.name()).join(", ")
            )
        })?,
    };
    let scale = args.node_scale.unwrap_or(1.0);
    if !(scale.is_finite() && scale > 0.0) {
        bail!("--node-scale must be a positive number, e.g. 0.5 for half the nodes");
    }
    let recorded = history::recorded(&h);
    let same = history::replay(
        &h,
        &history::ReplaySettings {
            policy: server_policy,
            nodes: h.nodes.clone(),
        },
    )?;
    let changed_nodes = history::scale_nodes(&h.nodes, scale);
    let changed_name = format!("replay: {}, {} nodes", policy.name(), changed_nodes.len());
    let changed = (policy != server_policy || scale != 1.0)
        .then(|| {
            history::replay(
                &h,
                &history::ReplaySettings {
                    policy,
                    nodes: changed_nodes.clone(),
                },
            )
        })
        .transpose()?;
    let same_name = format!("replay: {}, {} nodes", server_policy.name(), h.nodes.len());
    let mut columns = vec![("recorded", &recorded), (same_name.as_str(), &same)];
    if let Some(c) = &changed {
        columns.push((changed_name.as_str(), c));
    }
    let table = outcome_table(&columns);
    let mut said = Vec::new();
    if let Some(c) = &changed {
        for line in history::differences(&recorded, c) {
            said.push(format!("- {changed_name} against the record: {line}"));
        }
    }
    let gpu_gap = if recorded.gpu_hours > 0.0 {
        (same.gpu_hours - recorded.gpu_hours) / recorded.gpu_hours * 100.0
    } else {
        0.0
    };
    let mut md = format!(
        "# Replay of this cluster's demand, {} .. {}\n\n",
        from.to_rfc3339(),
        to.to_rfc3339()
    );
    md.push_str(&format!(
        "- {} works submitted, {} of them ran in the record (the demand replayed); {} machines; the server schedules with {}\n",
        h.works.len(),
        recorded.works,
        h.nodes.len(),
        server_policy.name()
    ));
    md.push_str(&format!(
        "- the replay with the recorded settings holds {:.3} GPU-hours against {:.3} recorded ({:+.2} %)\n",
        same.gpu_hours, recorded.gpu_hours, gpu_gap
    ));
    md.push_str("- cost: GPU time at the list on-demand price of the model each work ran on (flotilla-billing's list book); the server's own price versions, spot prices and owners' payouts are not replayed yet\n");
    md.push_str("- not replayed yet: quotas and fair-share history (every tenant unlimited), endpoints' request rates through the autoscaler (their replicas replay as the instances they were)\n\n");
    md.push_str(&table);
    if !said.is_empty() {
        md.push('\n');
        md.push_str(&said.join("\n"));
        md.push('\n');
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    write(&args.out.join("report.md"), &md)?;
    let results = serde_json::json!({
        "from": from,
        "to": to,
        "recorded": recorded,
        "replay_recorded_settings": {"policy": server_policy.name(), "nodes": h.nodes.len(), "outcome": same},
        "replay_changed": changed.as_ref().map(|c| serde_json::json!({"policy": policy.name(), "nodes": changed_nodes.len(), "outcome": c})),
    });
    write(
        &args.out.join("results.json"),
        &serde_json::to_string_pretty(&results)?,
    )?;
    if ctx.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        print!("{table}");
        for line in &said {
            println!("{line}");
        }
        println!("report: {}", args.out.join("report.md").display());
    }
    Ok(ExitCode::SUCCESS)
}

/// Run the simulation and write the report.
pub fn run(args: SimulateArgs) -> Result<ExitCode> {
    let policies = PolicyKind::parse_list(&args.policy)?;
    if args.slo_ms == 0 {
        bail!("--slo-ms must be greater than zero");
    }
    if args.cold_start_median_s == 0 {
        bail!("--cold-start-median-s must be greater than zero");
    }
    let service = ServiceModel::for_gpu(&args.gpu)?;
    let original = match (&args.trace, &args.scenario) {
        (Some(path), _) => trace::load(path)?,
        (None, Some(name)) => name.parse::<Scenario>()?.trace(args.seed)?,
        (None, None) => bail!("give --trace FILE or --scenario NAME"),
    };
    let median_ms = args.cold_start_median_s * 1_000;
    let cold = match &args.cold_start {
        Some(path) => ColdStartModel::load_gentd26(path, median_ms)?,
        None => ColdStartModel::lognormal(median_ms),
    };
    let (trace, k) = if args.peak_replicas > 0 {
        scale_to_peak(
            &original,
            &service,
            f64::from(args.peak_replicas),
            args.seed,
        )?
    } else {
        (original.clone(), 1)
    };
    let mut cfg = SimConfig::new(service.clone(), cold.clone(), args.slo_ms);
    cfg.seed = args.seed;
    cfg.tier = args.tier;
    cfg.warmup_ms = args.warmup_s.saturating_mul(1_000);
    if args.tiered {
        if args.node_pool {
            bail!("--tiered with --node-pool is not modelled yet: give one of them");
        }
        if !(args.model_gb.is_finite() && args.model_gb > 0.0) {
            bail!("--model-gb must be a positive number");
        }
        for (flag, x) in [
            ("--parked-gb-per-node", args.parked_gb_per_node),
            ("--cache-gb-per-node", args.cache_gb_per_node),
        ] {
            if !(x.is_finite() && x >= 0.0) {
                bail!("{flag} must be a number of GB, not negative");
            }
        }
        cfg.tiers = Some(TierSetting {
            tiers: ReadinessTiers::default(),
            model_gb: args.model_gb,
            nodes: args.tier_nodes,
            host_memory_gb_per_node: args.parked_gb_per_node,
            disk_gb_per_node: args.cache_gb_per_node,
        });
    }
    if args.node_pool {
        cfg.node_pool = Some(NodePoolConfig {
            provider: ProviderConfig::cloud(&service.gpu),
            idle_grace_ms: 300_000,
        });
    }

    let bar = ProgressBar::new(trace.len() as u64 * policies.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg:>9} [{bar:40}] {percent:>3}% {elapsed_precise}")
            .context("progress bar template")?
            .progress_chars("=> "),
    );
    let n = trace.len() as u64;
    let mut offset = 0u64;
    let mut current = String::new();
    let cmp = compare(
        &trace,
        &policies,
        &cfg,
        args.max_replicas,
        &mut |policy, done, _| {
            if current != policy {
                if !current.is_empty() {
                    offset += n;
                }
                current = policy.to_string();
                bar.set_message(current.clone());
            }
            bar.set_position(offset + done);
        },
    )?;
    bar.finish_and_clear();

    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    for r in &cmp.results {
        let path = args.out.join(format!("{}.svg", r.policy));
        plot(&path, &trace.name, r)?;
    }
    let table = markdown_table(&cmp.rows);
    let mut md = format!("# Autoscaling simulation: {}\n\n", trace.name);
    md.push_str(&format!(
        "- trace: `{}`, {} requests{}, {:.2} h\n",
        trace.name,
        original.len(),
        if k > 1 {
            format!(
                " with the arrival rate multiplied by {k} to {} (peak ≥ {} replicas)",
                trace.len(),
                args.peak_replicas
            )
        } else {
            String::new()
        },
        trace.duration_ms() as f64 / 3_600_000.0,
    ));
    md.push_str(&format!(
        "- replica: one {} serving an 8B-class model: prefill {:.0} tokens/s, decode {:.0} tokens/s per sequence, {} sequences at once\n",
        service.gpu, service.prefill_tokens_per_s, service.decode_tokens_per_s, service.max_concurrency
    ));
    md.push_str(&format!(
        "- cold start: {} (median {} s, shortest {} s, p99 {} s)\n",
        cold.source,
        cold.median_ms() / 1000,
        cold.min_ms() / 1000,
        cold.quantile_ms(0.99) / 1000
    ));
    md.push_str(&format!(
        "- SLO: time to first token ≤ {} ms; requests waiting over {} s are dropped; warm-up {} s; seed {}{}\n",
        args.slo_ms,
        cfg.timeout_ms / 1000,
        args.warmup_s,
        args.seed,
        if args.node_pool {
            "; simulated node pool"
        } else {
            ""
        }
    ));
    md.push_str(&format!(
        "- oracle (perfect-foresight lower bound, see docs/autoscaling.md): {:.1} GPU-s for a cold start fixed at {} s (the ratio column); strict bound {:.1} GPU-s for the shortest cold start ({} s); peak {} replicas\n",
        cmp.oracle.gpu_ms as f64 / 1000.0,
        cmp.oracle.cold_start_ms / 1000,
        cmp.strict_oracle.gpu_ms as f64 / 1000.0,
        cmp.strict_oracle.cold_start_ms / 1000,
        cmp.oracle.peak_replicas
    ));
    let pr = &cmp.pricing;
    md.push_str(&format!(
        "- costs: billing price book version {}, {} {} per GPU-second on demand, {} spot (band floor)\n\n",
        pr.version,
        pr.currency,
        pr.on_demand_per_gpu_second.round_dp(6),
        pr.spot_per_gpu_second.round_dp(6)
    ));
    md.push_str(&table);
    md.push('\n');
    if let Some(t) = &cfg.tiers {
        md.push_str(&format!(
            "Readiness tiers: {:.0} GB of weights; restore from host memory {} ms, from disk {} ms, remote from the cold-start shape; {} nodes with {:.0} GB for parking ({} replicas) and {:.0} GB of disk cache ({} copies) each; parked memory at {} {} per GB-hour. The ratio in money is (GPU cost + memory cost) / the fixed-delay oracle's GPU time at the same price.\n\n",
            t.model_gb,
            t.tiers.restore_ms(Tier::Parked, t.model_gb),
            t.tiers.restore_ms(Tier::Cached, t.model_gb),
            t.nodes,
            t.host_memory_gb_per_node,
            t.parked_capacity(),
            t.disk_gb_per_node,
            t.cached_capacity(),
            pr.currency,
            (pr.parked_per_gb_second * rust_decimal::Decimal::from(3600))
                .round_dp(6)
                .normalize(),
        ));
        md.push_str(&tiered_markdown_table(&cmp.rows));
        md.push('\n');
    }
    if args.node_pool {
        md.push_str(
            "Node pool (8-GPU nodes; GPU-seconds of whole nodes, from request to release):\n\n",
        );
        md.push_str("| policy | on-demand node GPU-s | spot node GPU-s | node cost | spot preemptions |\n|---|---:|---:|---:|---:|\n");
        for (r, row) in cmp.results.iter().zip(&cmp.rows) {
            let (od, spot) = r.node_gpu_ms.unwrap_or((0, 0));
            md.push_str(&format!(
                "| {} | {:.1} | {:.1} | {} | {} |\n",
                r.policy,
                od as f64 / 1000.0,
                spot as f64 / 1000.0,
                row.node_cost.unwrap_or_default(),
                r.preemptions
            ));
        }
        md.push('\n');
    }
    for r in &cmp.results {
        md.push_str(&format!("![{0}]({0}.svg)\n", r.policy));
    }
    write(&args.out.join("report.md"), &md)?;
    write(&args.out.join("results.json"), &json(&cmp.rows))?;
    print!("{table}");
    if cfg.tiers.is_some() {
        print!("{}", tiered_markdown_table(&cmp.rows));
    }
    println!("report: {}", args.out.join("report.md").display());
    Ok(ExitCode::SUCCESS)
}

fn write(path: &Path, s: &str) -> Result<()> {
    std::fs::write(path, s).with_context(|| format!("writing {}", path.display()))
}

/// One SVG: arrivals per second (right axis) and replicas (left axis:
/// asked for, and ready) over time.
fn plot(path: &Path, trace: &str, r: &SimResult) -> Result<()> {
    use plotters::prelude::*;

    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("plotting {}: {e}", path.display());
    let hours = |t: u64| t as f64 / 3_600_000.0;
    let x_max = hours(r.end_ms).max(1.0 / 60.0);
    let y_max = r
        .series
        .iter()
        .map(|s| s.replicas)
        .max()
        .unwrap_or(1)
        .max(1) as f64
        * 1.1;
    let a_max = r
        .series
        .iter()
        .map(|s| s.arrivals_per_s)
        .fold(0.0, f64::max)
        .max(1.0)
        * 1.1;
    let root = SVGBackend::new(path, (900, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{trace}: {}", r.policy), ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(50)
        .right_y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(|e| err(&e))?
        .set_secondary_coord(0.0..x_max, 0.0..a_max);
    chart
        .configure_mesh()
        .x_desc("hours")
        .y_desc("replicas")
        .draw()
        .map_err(|e| err(&e))?;
    chart
        .configure_secondary_axes()
        .y_desc("arrivals / s")
        .draw()
        .map_err(|e| err(&e))?;
    chart
        .draw_secondary_series(LineSeries::new(
            r.series.iter().map(|s| (hours(s.t_ms), s.arrivals_per_s)),
            RGBColor(160, 160, 160),
        ))
        .map_err(|e| err(&e))?
        .label("arrivals / s (right)")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 15, y)], RGBColor(160, 160, 160)));
    chart
        .draw_series(LineSeries::new(
            r.series
                .iter()
                .map(|s| (hours(s.t_ms), f64::from(s.replicas))),
            BLUE,
        ))
        .map_err(|e| err(&e))?
        .label("replicas")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 15, y)], BLUE));
    chart
        .draw_series(LineSeries::new(
            r.series.iter().map(|s| (hours(s.t_ms), f64::from(s.ready))),
            GREEN,
        ))
        .map_err(|e| err(&e))?
        .label("ready")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 15, y)], GREEN));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
