//! `flotilla demo`: on a running platform (`flotilla up`, or any server
//! and gateway), deploys an endpoint whose replicas are the model-server
//! emulator, drives a viral spike through the gateway (a quiet start, a
//! steep ramp to `--peak-rps`, a hold, an exponential decay) and prints,
//! every second, the offered rate against the replicas serving it, the
//! latency against the endpoint's SLO and the bill so far; a summary
//! closes it. Ctrl-C stops the load and deletes the endpoint (unless
//! `--keep`), as does the end of the run.
//!
//! Like every client command it talks only to the API (deploy, watch,
//! invoice preview) and to the gateway (the requests, with the caller's
//! key as the inference key).

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use flotilla_client::paths;
use flotilla_core::api::{CreateApiKey, CreatedApiKey};
use flotilla_core::endpoint::{CreateEndpoint, Endpoint};
use flotilla_core::gateway::nearest_rank;
use flotilla_core::tenant::Role;
use rust_decimal::Decimal;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::ctx::Ctx;
use crate::gateway::DEFAULT_GATEWAY_BIND;
use crate::output::{outln, say};

/// Options of `flotilla demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// The gateway's URL (default: where `flotilla up` starts it).
    #[arg(long, env = "FLOTILLA_GATEWAY_URL", value_name = "URL")]
    pub gateway: Option<String>,
    /// Length of the load, seconds.
    #[arg(long, default_value_t = 60, value_name = "SECONDS",
          value_parser = clap::value_parser!(u64).range(5..=3600))]
    pub duration: u64,
    /// Requests per second at the top of the spike.
    #[arg(long, default_value_t = 20.0, value_name = "RPS", value_parser = parse_rps)]
    pub peak_rps: f64,
    /// Requests per second before and after the spike.
    #[arg(long, default_value_t = 1.0, value_name = "RPS", value_parser = parse_rps)]
    pub base_rps: f64,
    /// Name (and model) of the demo endpoint.
    #[arg(long, default_value = "demo", value_name = "NAME")]
    pub name: String,
    /// Most replicas.
    #[arg(long = "max", default_value_t = 4, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=100))]
    pub max_replicas: u32,
    /// p95 latency objective of the endpoint, ms.
    #[arg(long = "slo-ms", default_value_t = 1000, value_name = "MS",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub slo_ms: u64,
    /// Autoscaling policy: flotilla, hpa, keda, kpa or ray.
    #[arg(long, default_value = "flotilla")]
    pub policy: String,
    /// The emulated model's weight-load time, ms (a replica's cold start).
    /// 1 s by default: with 2 s, the replicas the peak needs started too
    /// late for the default policy to meet the SLO on a two-core `up`.
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub load_delay_ms: u64,
    /// Leave the endpoint deployed at the end.
    #[arg(long)]
    pub keep: bool,
}

fn parse_rps(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 10_000.0 => Ok(v),
        _ => Err(format!("`{s}` is not a rate between 0 and 10000")),
    }
}

/// Tokens each demo request asks for; with [`DECODE_TOKENS_PER_S`] a
/// request takes about 300 ms on a replica.
const MAX_TOKENS: u32 = 16;
const DECODE_TOKENS_PER_S: u32 = 50;
/// Requests one replica takes at once: small, so the spike needs several.
const REPLICA_CONCURRENCY: u32 = 2;
/// How long a request may wait for a replica (a cold start included).
const QUEUE_TIMEOUT_MS: u64 = 120_000;
/// Latencies that make the live percentiles: the last few seconds.
const LIVE_WINDOW: Duration = Duration::from_secs(5);

/// The phase of the load at `t` seconds into a run of `duration`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Quiet,
    Ramp,
    Peak,
    Decay,
}

impl Phase {
    fn as_str(self) -> &'static str {
        match self {
            Phase::Quiet => "quiet",
            Phase::Ramp => "ramp",
            Phase::Peak => "peak",
            Phase::Decay => "decay",
        }
    }
}

/// The offered rate at `t` seconds: `base` for the first 15 % of the run,
/// a linear ramp to `peak` over the next 10 %, `peak` for 25 %, then an
/// exponential decay back towards `base` (a viral spike's shape).
pub fn offered_rps(t: f64, duration: f64, base: f64, peak: f64) -> (Phase, f64) {
    let x = (t / duration).clamp(0.0, 1.0);
    let peak = peak.max(base);
    if x < 0.15 {
        (Phase::Quiet, base)
    } else if x < 0.25 {
        (Phase::Ramp, base + (peak - base) * (x - 0.15) / 0.10)
    } else if x < 0.5 {
        (Phase::Peak, peak)
    } else {
        // A time constant of a tenth of the run: down to ~8 % of the
        // excess by the end.
        let k = (x - 0.5) / 0.10;
        (Phase::Decay, base + (peak - base) * (-k).exp())
    }
}

/// What the load generator has seen, shared with the view.
#[derive(Default)]
struct Tally {
    sent: AtomicU64,
    ok: AtomicU64,
    failed: AtomicU64,
    in_flight: AtomicU64,
    /// `(finished, latency ms)` of every successful request.
    latencies: Mutex<Vec<(Instant, f64)>>,
    first_failure: Mutex<Option<String>>,
}

impl Tally {
    fn fail(&self, why: String) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        let mut first = self.first_failure.lock().unwrap_or_else(|p| p.into_inner());
        if first.is_none() {
            *first = Some(why);
        }
    }

    /// Latencies of the requests sent at or after `warm` (the first ready
    /// replica): what the endpoint serves once the first cold start is
    /// behind it.
    fn latencies_sent_after(&self, warm: Instant) -> Vec<f64> {
        let l = self.latencies.lock().unwrap_or_else(|p| p.into_inner());
        l.iter()
            .filter(|(at, ms)| {
                at.checked_sub(Duration::from_secs_f64(ms / 1000.0))
                    .is_some_and(|sent| sent >= warm)
            })
            .map(|(_, ms)| *ms)
            .collect()
    }

    fn latencies_since(&self, since: Option<Instant>) -> Vec<f64> {
        let l = self.latencies.lock().unwrap_or_else(|p| p.into_inner());
        l.iter()
            .filter(|(at, _)| since.is_none_or(|s| *at >= s))
            .map(|(_, ms)| *ms)
            .collect()
    }
}

/// One chat completion through the gateway.
async fn one_request(
    http: reqwest::Client,
    url: String,
    key: Arc<str>,
    body: Arc<str>,
    tally: Arc<Tally>,
) {
    let started = Instant::now();
    tally.in_flight.fetch_add(1, Ordering::Relaxed);
    let answer = http
        .post(&url)
        .bearer_auth(&*key)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await;
    let result = match answer {
        Ok(r) => {
            let status = r.status();
            match r.bytes().await {
                Ok(_) if status.is_success() => Ok(()),
                Ok(b) => Err(format!("{status}: {}", String::from_utf8_lossy(&b))),
                Err(e) => Err(format!("reading the answer: {e}")),
            }
        }
        Err(e) => Err(format!("{e}")),
    };
    tally.in_flight.fetch_sub(1, Ordering::Relaxed);
    match result {
        Ok(()) => {
            tally.ok.fetch_add(1, Ordering::Relaxed);
            let now = Instant::now();
            let ms = (now - started).as_secs_f64() * 1000.0;
            tally
                .latencies
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((now, ms));
        }
        Err(why) => tally.fail(why),
    }
}

/// Sends requests at the offered rate (evenly spaced) until `duration`.
async fn drive(
    http: reqwest::Client,
    args: Arc<DemoArgs>,
    url: String,
    key: Arc<str>,
    tally: Arc<Tally>,
    start: Instant,
) -> Vec<tokio::task::JoinHandle<()>> {
    let body: Arc<str> = json!({
        "model": args.name,
        "messages": [{"role": "user", "content": "Say something about GPUs."}],
        "max_tokens": MAX_TOKENS,
    })
    .to_string()
    .into();
    let duration = args.duration as f64;
    let mut tasks = Vec::new();
    let mut due = 0.0f64;
    loop {
        let t = start.elapsed().as_secs_f64();
        if t >= duration {
            break;
        }
        if t >= due {
            tally.sent.fetch_add(1, Ordering::Relaxed);
            tasks.push(tokio::spawn(one_request(
                http.clone(),
                url.clone(),
                key.clone(),
                body.clone(),
                tally.clone(),
            )));
            let (_, rps) = offered_rps(t, duration, args.base_rps, args.peak_rps);
            due += 1.0 / rps;
            // After a stall (a loaded machine) catch up without a burst.
            due = due.max(t - 1.0);
            tasks.retain(|h| !h.is_finished());
            continue;
        }
        tokio::time::sleep(Duration::from_secs_f64((due - t).min(0.05))).await;
    }
    tasks
}

/// What the API says, polled beside the load.
#[derive(Default, Clone)]
struct Seen {
    ready: usize,
    starting: usize,
    peak_ready: usize,
    /// When a replica was first seen ready: the first cold start is over.
    first_ready: Option<Instant>,
    desired: Option<u32>,
    cost: Option<Decimal>,
    currency: String,
}

fn replicas_of(e: &Endpoint) -> (usize, usize) {
    let live = e.replicas.iter().filter(|r| !r.draining);
    let ready = live.clone().filter(|r| r.ready).count();
    (ready, live.count() - ready)
}

/// This month's draft invoice, unrounded (the sum of its lines' quantity
/// times unit price: a few seconds of GPU time are worth less than a cent),
/// and its currency.
async fn bill(ctx: &Ctx) -> Result<(Decimal, String)> {
    let inv = ctx
        .client
        .invoice_preview(&crate::billing::this_month())
        .await?;
    let exact = inv
        .lines()
        .iter()
        .map(|l| l.quantity * l.unit_price)
        .sum::<Decimal>();
    Ok((exact, inv.currency().code.to_string()))
}

/// The cost the demo added: the draft invoice now less at its start.
async fn watch(ctx: &Ctx, id: &str, baseline: Decimal, seen: &Mutex<Seen>) {
    if let Ok(e) = ctx.client.endpoint(id).await {
        let (ready, starting) = replicas_of(&e);
        let mut s = seen.lock().unwrap_or_else(|p| p.into_inner());
        s.ready = ready;
        s.starting = starting;
        s.peak_ready = s.peak_ready.max(ready);
        if ready > 0 && s.first_ready.is_none() {
            s.first_ready = Some(Instant::now());
        }
        s.desired = e.desired_replicas;
    }
    if let Ok((total, currency)) = bill(ctx).await {
        let mut s = seen.lock().unwrap_or_else(|p| p.into_inner());
        s.cost = Some((total - baseline).max(Decimal::ZERO));
        s.currency = currency;
    }
}

/// Waits until the gateway routes the model: it reads the route table
/// every fraction of a second, and a request before that would be a 404.
async fn wait_for_route(
    http: &reqwest::Client,
    gateway: &str,
    key: &str,
    model: &str,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let listed = match http
            .get(format!("{gateway}{}", paths::openai::MODELS))
            .bearer_auth(key)
            .send()
            .await
        {
            Ok(r) if r.status().is_success() => r.json::<Value>().await.ok().is_some_and(|v| {
                v["data"]
                    .as_array()
                    .is_some_and(|d| d.iter().any(|m| m["id"] == model))
            }),
            Ok(r) if r.status() == reqwest::StatusCode::UNAUTHORIZED => {
                bail!("the gateway at {gateway} does not accept this API key (is it this server's gateway?)")
            }
            _ => false,
        };
        if listed {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the gateway at {gateway} did not route `{model}` within 60 s: is it running against this server (`flotilla up` starts one)?");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.0}"))
}

fn money(cost: Option<Decimal>, currency: &str) -> String {
    match cost {
        Some(c) => format!("{} {currency}", c.round_dp(4)),
        None => "-".into(),
    }
}

/// Where a view line goes: a progress bar on a terminal, plain lines
/// otherwise (a pipe, a log, a test).
enum View {
    Bar(indicatif::ProgressBar),
    Plain,
}

impl View {
    fn new(duration: u64) -> Self {
        use std::io::IsTerminal;
        if !std::io::stdout().is_terminal() {
            return View::Plain;
        }
        let bar = indicatif::ProgressBar::new(duration);
        if let Ok(style) =
            indicatif::ProgressStyle::with_template("{bar:40.cyan/blue} {pos:>4}/{len}s {msg}")
        {
            bar.set_style(style);
        }
        View::Bar(bar)
    }

    fn line(&self, s: &str) {
        match self {
            View::Bar(b) => b.println(s),
            View::Plain => say!("{s}"),
        }
    }

    fn tick(&self, t: u64, msg: String) {
        if let View::Bar(b) = self {
            b.set_position(t);
            b.set_message(msg);
        }
    }

    fn done(&self) {
        if let View::Bar(b) = self {
            b.finish_and_clear();
        }
    }
}

/// The HTTP client of the gateway. Over HTTPS it trusts the gateway as
/// the CLI trusts the server (`flotilla up` serves both with one
/// certificate).
fn gateway_client(gateway: &str, trust: &flotilla_client::Trust) -> Result<reqwest::Client> {
    let mut builder =
        reqwest::Client::builder().timeout(Duration::from_millis(QUEUE_TIMEOUT_MS + 30_000));
    if gateway.starts_with("https://") {
        builder = builder.use_preconfigured_tls(
            trust
                .client_config()
                .map_err(|e| anyhow!("the gateway's TLS: {e}"))?,
        );
    }
    builder
        .build()
        .context("setting up the gateway's HTTP client")
}

/// `flotilla demo`.
pub async fn run(ctx: &Ctx, api_key: &str, args: DemoArgs) -> Result<ExitCode> {
    // `flotilla up` serves its gateway over HTTPS when it serves the API so.
    let scheme = if ctx.client.current_server().starts_with("https://") {
        "https"
    } else {
        "http"
    };
    let gateway = args
        .gateway
        .clone()
        .unwrap_or_else(|| format!("{scheme}://{DEFAULT_GATEWAY_BIND}"));
    let gateway = gateway.trim_end_matches('/').to_string();
    if !gateway.starts_with("http://") && !gateway.starts_with("https://") {
        bail!("--gateway: `{gateway}` is not an http:// or https:// URL");
    }
    if args.peak_rps < args.base_rps {
        bail!("--peak-rps must be at least --base-rps");
    }
    if ctx
        .client
        .endpoints()
        .await?
        .iter()
        .any(|e| e.name == args.name)
    {
        bail!(
            "an endpoint named `{}` exists already: delete it (`flotilla endpoints delete {}`) or pick another with --name",
            args.name,
            args.name
        );
    }
    let exe = std::env::current_exe().context("finding the flotilla binary for the replicas")?;
    let replica = format!(
        "exec '{}' emulator --port \"$PORT\" --model '{}' --load-delay-ms {} --decode-tokens-per-s {DECODE_TOKENS_PER_S}",
        exe.display(),
        args.name,
        args.load_delay_ms
    );
    let req = CreateEndpoint {
        name: args.name.clone(),
        command: vec!["sh".into(), "-c".into(), replica],
        models: vec![args.name.clone()],
        max_replicas: Some(args.max_replicas),
        slo_p95_ms: Some(args.slo_ms),
        policy: Some(args.policy.clone()),
        idle_window_s: Some(30),
        queue_limit: Some(100_000),
        queue_timeout_ms: Some(QUEUE_TIMEOUT_MS),
        replica_concurrency: Some(REPLICA_CONCURRENCY),
        drain_grace_ms: Some(2000),
        ..CreateEndpoint::default()
    };
    let (baseline, currency) = bill(ctx).await.unwrap_or((Decimal::ZERO, String::new()));
    let ep = ctx.client.create_endpoint(&req).await?;
    let id = ep.id.to_string();
    say!(
        "deployed {} ({id}): emulated model `{}`, up to {} replicas of {REPLICA_CONCURRENCY} requests, p95 SLO {} ms, policy {}",
        args.name,
        args.name,
        args.max_replicas,
        args.slo_ms,
        args.policy
    );
    say!(
        "driving {} s of load through {gateway}: {} rps, a spike to {} rps, decay (Ctrl-C stops and cleans up)",
        args.duration,
        args.base_rps,
        args.peak_rps
    );
    let keep = args.keep;
    let deleted = AtomicBool::new(false);
    let minted = inference_key(ctx, &ep).await;
    let key = minted.as_ref().map_or(api_key, |k| k.secret.as_str());
    let outcome = tokio::select! {
        r = show(ctx, key, &gateway, &id, Arc::new(args), (baseline, currency), &deleted) => Some(r),
        _ = tokio::signal::ctrl_c() => None,
    };
    if let Some(k) = &minted {
        if let Err(e) = ctx.client.revoke_key(&k.key.id).await {
            eprintln!(
                "could not revoke the demo's inference key {}: {e}",
                k.key.id
            );
        }
    }
    Ok(match outcome {
        Some(Ok(true)) => ExitCode::SUCCESS,
        Some(Ok(false)) => ExitCode::FAILURE,
        Some(Err(e)) => {
            let _ = clean_up(ctx, &id, keep, &deleted).await;
            return Err(e);
        }
        None => {
            eprintln!("interrupted: the load stops");
            clean_up(ctx, &id, keep, &deleted).await?;
            ExitCode::from(130)
        }
    })
}

/// An inference key for the demo's endpoint alone, revoked when the demo
/// ends. The gateway takes only tenant keys, and the key `flotilla up`
/// saves is the operator's: without this the demo would fail on a fresh
/// `up`. `None` (the caller's own key is used) when the caller may not
/// create keys, a tenant member.
async fn inference_key(ctx: &Ctx, ep: &Endpoint) -> Option<CreatedApiKey> {
    let req = CreateApiKey {
        tenant_id: Some(ep.tenant_id.clone()),
        role: Role::TenantMember,
        name: "flotilla demo".into(),
        endpoints: Some(vec![ep.id.clone()]),
    };
    ctx.client.create_key(&req).await.ok()
}

/// Deletes the demo endpoint unless `keep`, once (`deleted` says whether
/// it was; an interrupt during the summary's wait finds it so).
async fn clean_up(ctx: &Ctx, id: &str, keep: bool, deleted: &AtomicBool) -> Result<()> {
    if keep {
        say!("kept the endpoint {id} (`flotilla endpoints delete {id}` removes it)");
        return Ok(());
    }
    if deleted.swap(true, Ordering::SeqCst) {
        return Ok(());
    }
    ctx.client
        .delete_endpoint(id)
        .await
        .map_err(|e| anyhow!("deleting the demo endpoint {id}: {e}"))?;
    say!("deleted the demo endpoint {id}; its replicas drain, then stop");
    Ok(())
}

/// Runs the load with the live view and prints the summary; whether no
/// request failed.
async fn show(
    ctx: &Ctx,
    api_key: &str,
    gateway: &str,
    id: &str,
    args: Arc<DemoArgs>,
    (baseline, currency): (Decimal, String),
    deleted: &AtomicBool,
) -> Result<bool> {
    let tally = Arc::new(Tally::default());
    let seen = Mutex::new(Seen {
        currency,
        ..Seen::default()
    });
    let http = gateway_client(gateway, &ctx.trust)?;
    wait_for_route(&http, gateway, api_key, &args.name).await?;
    let start = Instant::now();
    let url = format!("{gateway}{}", paths::openai::CHAT_COMPLETIONS);
    let key: Arc<str> = api_key.into();
    let mut load = tokio::spawn(drive(http, args.clone(), url, key, tally.clone(), start));
    let view = View::new(args.duration);
    view.line(&format!(
        "{:>5} {:>6} {:>8} {:>6} {:>9} {:>8} {:>7} {:>7} {:>8} {:>12}",
        "t(s)",
        "phase",
        "offered",
        "ok/s",
        "in-flight",
        "replicas",
        "p50 ms",
        "p99 ms",
        "SLO",
        "cost"
    ));
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    let mut last_ok = 0;
    let tasks = loop {
        tokio::select! {
            tasks = &mut load => break tasks.context("the load generator")?,
            _ = ticker.tick() => {}
        }
        watch(ctx, id, baseline, &seen).await;
        let t = start.elapsed().as_secs_f64();
        let (phase, offered) = offered_rps(t, args.duration as f64, args.base_rps, args.peak_rps);
        let ok = tally.ok.load(Ordering::Relaxed);
        let recent = tally.latencies_since(Instant::now().checked_sub(LIVE_WINDOW));
        let mut v = recent.clone();
        let (p50, p95, p99) = (
            nearest_rank(&mut v, 0.5),
            nearest_rank(&mut v, 0.95),
            nearest_rank(&mut v, 0.99),
        );
        let slo = match p95 {
            Some(p) if p <= args.slo_ms as f64 => "met",
            Some(_) => "missed",
            None => "-",
        };
        let s = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let line = format!(
            "{:>5.0} {:>6} {:>8.1} {:>6} {:>9} {:>8} {:>7} {:>7} {:>8} {:>12}",
            t,
            phase.as_str(),
            offered,
            ok - last_ok,
            tally.in_flight.load(Ordering::Relaxed),
            format!("{}/{}", s.ready, s.starting),
            ms(p50),
            ms(p99),
            slo,
            money(s.cost, &s.currency)
        );
        last_ok = ok;
        view.line(&line);
        view.tick(
            t as u64,
            format!(
                "{} rps offered, {} replicas ready",
                offered.round(),
                s.ready
            ),
        );
    };
    view.done();
    say!(
        "load done; waiting for the {} requests in flight",
        tally.in_flight.load(Ordering::Relaxed)
    );
    for t in tasks {
        let _ = t.await;
    }
    // GPU time is metered in whole minutes while a replica runs, and the
    // rest when it stops: delete the endpoint, wait for its replicas to
    // stop, and let the metering catch up before the summary.
    let before = seen.lock().unwrap_or_else(|p| p.into_inner()).cost;
    clean_up(ctx, id, args.keep, deleted).await?;
    if !args.keep {
        let stopping = Instant::now();
        while stopping.elapsed() < Duration::from_secs(60) {
            match ctx.client.endpoint(id).await {
                Ok(e) if !e.replicas.is_empty() => {}
                _ => break,
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let settle = Instant::now();
        while settle.elapsed() < Duration::from_secs(30) {
            watch(ctx, id, baseline, &seen).await;
            let cost = seen.lock().unwrap_or_else(|p| p.into_inner()).cost;
            if cost.is_some_and(|c| c > before.unwrap_or(Decimal::ZERO)) {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    let s = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut all = tally.latencies_since(None);
    let sent = tally.sent.load(Ordering::Relaxed);
    let ok = tally.ok.load(Ordering::Relaxed);
    let failed = tally.failed.load(Ordering::Relaxed);
    let p95 = nearest_rank(&mut all, 0.95);
    outln!("summary:")?;
    outln!("  requests: {sent} sent, {ok} ok, {failed} failed")?;
    if let Some(why) = tally
        .first_failure
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
    {
        outln!("  first failure: {why}")?;
    }
    outln!(
        "  latency: p50 {} ms, p95 {} ms, p99 {} ms (SLO p95 {} ms: {})",
        ms(nearest_rank(&mut all, 0.5)),
        ms(p95),
        ms(nearest_rank(&mut all, 0.99)),
        args.slo_ms,
        match p95 {
            Some(p) if p <= args.slo_ms as f64 => "met",
            Some(_) => "missed (cold starts count)",
            None => "-",
        }
    )?;
    if let Some(warm) = s.first_ready {
        let mut after = tally.latencies_sent_after(warm);
        let p95 = nearest_rank(&mut after, 0.95);
        outln!(
            "  after warm-up: p95 {} ms over {} requests sent once a replica was ready (SLO p95 {} ms: {})",
            ms(p95),
            after.len(),
            args.slo_ms,
            match p95 {
                Some(p) if p <= args.slo_ms as f64 => "met",
                Some(_) => "missed",
                None => "-",
            }
        )?;
    }
    outln!(
        "  replicas: peak {} ready (max {})",
        s.peak_ready,
        args.max_replicas
    )?;
    outln!(
        "  cost: {}{}",
        money(s.cost, &s.currency),
        if args.keep {
            " so far (GPU time is metered in whole minutes while replicas run)"
        } else {
            " (the draft invoice's growth, unrounded)"
        }
    )?;
    Ok(failed == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_load_is_a_spike_that_decays() {
        let (d, base, peak) = (100.0, 1.0, 20.0);
        assert_eq!(offered_rps(0.0, d, base, peak), (Phase::Quiet, 1.0));
        let (p, r) = offered_rps(20.0, d, base, peak);
        assert_eq!(p, Phase::Ramp);
        assert!((r - 10.5).abs() < 1e-9, "{r}");
        assert_eq!(offered_rps(30.0, d, base, peak), (Phase::Peak, 20.0));
        let (p, r) = offered_rps(60.0, d, base, peak);
        assert_eq!(p, Phase::Decay);
        assert!(r < 20.0 && r > 1.0, "{r}");
        let (_, end) = offered_rps(100.0, d, base, peak);
        assert!(end < 3.0, "{end}");
        // Never below base, never above peak.
        for t in 0..=100 {
            let (_, r) = offered_rps(t as f64, d, base, peak);
            assert!((base..=peak).contains(&r), "{t}: {r}");
        }
    }
}
