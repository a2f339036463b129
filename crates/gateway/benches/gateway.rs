//! The gateway benchmark (`scripts/bench gateway`): proxy overhead against
//! nginx, scale-from-zero latency, and prefix affinity against least
//! outstanding. Writes `gateway.json` and `gateway.table.md` into
//! `$FLOTILLA_BENCH_OUT` (default `bench/results`); the script wraps the
//! table with the run's details. Needs `wrk` and `nginx` on `PATH` and the
//! emulator binary (`$FLOTILLA_EMULATOR_BIN`, default
//! `$CARGO_TARGET_DIR/release/flotilla-emulator`); the script provides all
//! three.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use flotilla_core::gateway::{Balance, EndpointRoute, KeyGrant, ReplicaRoute, RouteTable};
use flotilla_core::id::{EndpointId, InstanceId, TenantId};
use flotilla_emulator::{Emulator, EmulatorConfig};
use flotilla_gateway::{GatewayConfig, GatewayHandle, StaticControl};
use futures::StreamExt;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpListener;
use tokio::process::{Child, Command};

const MODEL: &str = "bench-model";
const KEY: &str = "bench-key";

fn main() -> Result<()> {
    // `cargo bench` passes `--bench`; nothing to parse.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run())
}

async fn run() -> Result<()> {
    let out = PathBuf::from(
        std::env::var("FLOTILLA_BENCH_OUT").unwrap_or_else(|_| "bench/results".into()),
    );
    std::fs::create_dir_all(&out)?;
    let quick = std::env::var("FLOTILLA_BENCH_QUICK").is_ok();
    let proxy = proxy_overhead(quick).await.context("proxy overhead")?;
    eprintln!("proxy: {proxy}");
    if std::env::var("FLOTILLA_BENCH_ONLY").is_ok_and(|v| v == "proxy") {
        return Ok(());
    }
    let cold = scale_from_zero(if quick { 5 } else { 20 })
        .await
        .context("scale from zero")?;
    eprintln!("scale from zero: {cold}");
    let affinity = affinity(if quick { 200 } else { 600 })
        .await
        .context("affinity")?;
    eprintln!("affinity: {affinity}");
    let report = json!({"proxy": proxy, "scale_from_zero": cold, "affinity": affinity});
    std::fs::write(
        out.join("gateway.json"),
        serde_json::to_string_pretty(&report)? + "\n",
    )?;
    std::fs::write(out.join("gateway.table.md"), table(&report))?;
    Ok(())
}

fn tenant() -> TenantId {
    TenantId::generate(1, rand::random())
}

fn endpoint(tenant: &TenantId, balance: Balance, replicas: Vec<ReplicaRoute>) -> EndpointRoute {
    EndpointRoute {
        id: EndpointId::generate(1, rand::random()),
        tenant_id: tenant.clone(),
        name: "bench".into(),
        models: vec![MODEL.into()],
        balance,
        queue_limit: 10_000,
        queue_timeout_ms: 60_000,
        replica_concurrency: 0,
        rate_limit_rps: None,
        replicas,
    }
}

fn replica(url: String) -> ReplicaRoute {
    ReplicaRoute {
        instance_id: InstanceId::generate(1, rand::random()),
        url,
        revision: 1,
        draining: false,
    }
}

async fn gateway(control: &Arc<StaticControl>) -> Result<GatewayHandle> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let config = GatewayConfig {
        seed: 1,
        ..GatewayConfig::default()
    };
    Ok(flotilla_gateway::serve(listener, control.clone(), config).await?)
}

fn control_with(route: EndpointRoute) -> Arc<StaticControl> {
    let control = Arc::new(StaticControl::new());
    control.set_key(
        KEY,
        KeyGrant {
            tenant_id: route.tenant_id.clone(),
            endpoints: Vec::new(),
            over_hard_cap: false,
        },
    );
    control.set_routes(RouteTable {
        endpoints: vec![route],
    });
    control
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Starts the emulator binary with zero token delays; returns it and its URL.
async fn emulator_process() -> Result<(Child, String)> {
    let bin = std::env::var("FLOTILLA_EMULATOR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into()))
                .join("release/flotilla-emulator")
        });
    let mut child = Command::new(&bin)
        .args(["--model", MODEL, "--port", "0"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let stdout = child.stdout.take().context("emulator stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).await?;
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .with_context(|| format!("emulator said {line:?}"))?
        .to_string();
    Ok((child, format!("http://{addr}")))
}

struct Nginx {
    child: Child,
    url: String,
    conf: PathBuf,
    dir: tempfile::TempDir,
}

impl Nginx {
    /// Stops master and workers (killing only the master would leave the
    /// workers running).
    async fn stop(mut self) -> Result<()> {
        Command::new("nginx")
            .arg("-e")
            .arg(self.dir.path().join("error.log"))
            .arg("-p")
            .arg(self.dir.path())
            .arg("-c")
            .arg(&self.conf)
            .args(["-s", "stop"])
            .status()
            .await?;
        self.child.wait().await?;
        Ok(())
    }
}

async fn nginx(upstream: &str, workers: usize) -> Result<Nginx> {
    let dir = tempfile::tempdir()?;
    let port = free_port()?;
    let upstream = upstream.trim_start_matches("http://");
    let p = dir.path().display();
    let conf = format!(
        "worker_processes {workers};\ndaemon off;\npid {p}/nginx.pid;\nerror_log {p}/error.log warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {p}/body;\n  proxy_temp_path {p}/proxy;\n\
         fastcgi_temp_path {p}/fastcgi;\n  uwsgi_temp_path {p}/uwsgi;\n  scgi_temp_path {p}/scgi;\n\
         upstream emulator {{ server {upstream}; keepalive 256; }}\n\
         server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      proxy_pass http://emulator;\n\
         proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n"
    );
    let conf_path = dir.path().join("nginx.conf");
    std::fs::write(&conf_path, conf)?;
    let child = Command::new("nginx")
        .arg("-e")
        .arg(dir.path().join("error.log"))
        .arg("-p")
        .arg(dir.path())
        .arg("-c")
        .arg(&conf_path)
        .kill_on_drop(true)
        .spawn()
        .context("starting nginx (apt-get install nginx)")?;
    let url = format!("http://127.0.0.1:{port}");
    wait_for_port(port).await?;
    Ok(Nginx {
        child,
        url,
        conf: conf_path,
        dir,
    })
}

async fn wait_for_port(port: u16) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        if Instant::now() > deadline {
            bail!("nothing listens on port {port}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

struct WrkResult {
    rps: f64,
    p99_ms: f64,
    p50_ms: f64,
    errors: u64,
}

fn parse_latency(s: &str) -> Option<f64> {
    let (num, unit) = s.split_at(s.find(|c: char| c.is_ascii_alphabetic())?);
    let v: f64 = num.parse().ok()?;
    Some(match unit {
        "us" => v / 1000.0,
        "ms" => v,
        "s" => v * 1000.0,
        "m" => v * 60_000.0,
        _ => return None,
    })
}

async fn wrk(url: &str, script: &Path, connections: u32, seconds: u32) -> Result<WrkResult> {
    let threads = connections.min(2);
    let out = Command::new("wrk")
        .args([
            format!("-t{threads}"),
            format!("-c{connections}"),
            format!("-d{seconds}s"),
            "--latency".into(),
            "-s".into(),
            script.display().to_string(),
            format!("{url}/v1/chat/completions"),
        ])
        .output()
        .await
        .context("running wrk (apt-get install wrk)")?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut r = WrkResult {
        rps: 0.0,
        p99_ms: f64::NAN,
        p50_ms: f64::NAN,
        errors: 0,
    };
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["Requests/sec:", v] => r.rps = v.parse().unwrap_or(0.0),
            ["99%", v] => r.p99_ms = parse_latency(v).unwrap_or(f64::NAN),
            ["50%", v] => r.p50_ms = parse_latency(v).unwrap_or(f64::NAN),
            ["Non-2xx", "or", "3xx", "responses:", n] => r.errors += n.parse::<u64>().unwrap_or(0),
            ["Socket", "errors:", ..] => {
                r.errors += words
                    .iter()
                    .filter_map(|w| w.trim_end_matches(',').parse::<u64>().ok())
                    .sum::<u64>()
            }
            _ => {}
        }
    }
    if r.rps == 0.0 {
        bail!(
            "wrk gave no rate: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(r)
}

/// One wrk run per path and round.
struct Rounds {
    /// `runs[path][round]`.
    runs: Vec<Vec<WrkResult>>,
}

impl Rounds {
    fn median(&self, path: usize, f: impl Fn(&WrkResult) -> f64) -> f64 {
        percentile(&mut self.runs[path].iter().map(f).collect::<Vec<_>>(), 0.5)
    }

    /// Per round, `f(a's run, b's run)`: paired in time, so a burst of
    /// other work that hits one round hits both sides of the pair.
    fn paired(&self, a: usize, b: usize, f: impl Fn(&WrkResult, &WrkResult) -> f64) -> Vec<f64> {
        self.runs[a]
            .iter()
            .zip(&self.runs[b])
            .map(|(x, y)| f(x, y))
            .collect()
    }

    fn errors(&self) -> u64 {
        self.runs.iter().flatten().map(|r| r.errors).sum()
    }
}

/// `{median, min, max, rounds}` of per-round values.
fn spread(v: &[f64], digits: i32) -> Value {
    let mut sorted = v.to_vec();
    let median = percentile(&mut sorted, 0.5);
    json!({
        "median": round(median, digits),
        "min": round(sorted.first().copied().unwrap_or(f64::NAN), digits),
        "max": round(sorted.last().copied().unwrap_or(f64::NAN), digits),
        "rounds": v.iter().map(|x| round(*x, digits)).collect::<Vec<_>>(),
    })
}

/// Runs wrk on every target, `rounds` times over, starting each round at
/// the next path (so no path always runs first, right after a pause, or
/// last), back to back so that a burst of other work on the machine hits
/// neighbouring runs of different paths alike.
async fn rounds_of(
    targets: &[(&str, String)],
    script: &Path,
    connections: u32,
    secs: u32,
    rounds: usize,
) -> Result<Rounds> {
    let mut runs: Vec<Vec<WrkResult>> = targets.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for k in 0..targets.len() {
            let i = (round + k) % targets.len();
            let (name, url) = &targets[i];
            let r = wrk(url, script, connections, secs).await?;
            eprintln!(
                "round {round}, {connections} connections, {name}: {:.0} rps, p50 {:.3} ms, p99 {:.3} ms, errors {}",
                r.rps, r.p50_ms, r.p99_ms, r.errors
            );
            runs[i].push(r);
        }
    }
    Ok(Rounds { runs })
}

/// Worker threads of the gateway's runtime and nginx's worker processes:
/// `$FLOTILLA_BENCH_WORKERS`, default the machine's CPUs.
fn workers() -> usize {
    std::env::var("FLOTILLA_BENCH_WORKERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()))
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// wrk against the emulator directly, through nginx and through the
/// gateway, in this run, at a top load and at about half of it.
async fn proxy_overhead(quick: bool) -> Result<Value> {
    let (mut emu, upstream) = emulator_process().await?;
    let t = tenant();
    let control = control_with(endpoint(
        &t,
        Balance::LeastOutstanding,
        vec![replica(upstream.clone())],
    ));
    let n_workers = workers();
    // The gateway gets a runtime of its own with as many workers as nginx
    // has worker processes.
    let gw_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(n_workers)
        .thread_name("gateway")
        .enable_all()
        .build()?;
    let gw = {
        let control = control.clone();
        gw_rt
            .spawn(async move { gateway(&control).await })
            .await??
    };
    let ngx = nginx(&upstream, n_workers).await?;
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("post.lua");
    std::fs::write(
        &script,
        format!(
            "wrk.method = \"POST\"\nwrk.body = '{{\"model\":\"{MODEL}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}],\"max_tokens\":1}}'\n\
             wrk.headers[\"Content-Type\"] = \"application/json\"\nwrk.headers[\"Authorization\"] = \"Bearer {KEY}\"\n"
        ),
    )?;
    let secs = if quick { 2 } else { 4 };
    let rounds = if quick { 1 } else { 7 };
    let top_c = 64;
    let targets = [
        ("direct", upstream.clone()),
        ("nginx", ngx.url.clone()),
        ("gateway", gw.url()),
    ];
    let load_before = loadavg();
    // Warm-up: every path's connection pools and caches, at the top load.
    for (_, url) in &targets {
        wrk(url, &script, top_c, 2).await?;
    }
    let top = rounds_of(&targets, &script, top_c, secs, rounds).await?;
    // Half load: the connection count at which the gateway's closed-loop
    // rate is nearest half its top rate (wrk has no fixed-rate mode).
    let half_target = top.median(2, |r| r.rps) / 2.0;
    let mut half_c = 1;
    let mut best = f64::INFINITY;
    for c in [1, 2, 4, 8, 16, 32] {
        let r = wrk(&gw.url(), &script, c, 2).await?;
        let d = (r.rps - half_target).abs();
        if d < best {
            best = d;
            half_c = c;
        }
    }
    let half = rounds_of(&targets, &script, half_c, secs, rounds).await?;
    let load_after = loadavg();
    ngx.stop().await?;
    let _ = emu.kill().await;
    gw_rt.spawn(gw.shutdown()).await?;
    gw_rt.shutdown_background();
    let ratio = top.paired(2, 1, |g, n| g.rps / n.rps);
    let direct_ratio = top.paired(2, 0, |g, d| g.rps / d.rps);
    let nginx_direct_ratio = top.paired(1, 0, |n, d| n.rps / d.rps);
    let added = half.paired(2, 0, |g, d| g.p99_ms - d.p99_ms);
    let nginx_added = half.paired(1, 0, |n, d| n.p99_ms - d.p99_ms);
    let ratio_median = percentile(&mut ratio.clone(), 0.5);
    let added_median = percentile(&mut added.clone(), 0.5);
    Ok(json!({
        "workers": n_workers,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "top_connections": top_c,
        "seconds": secs,
        "rounds": rounds,
        "direct_rps": round(top.median(0, |r| r.rps), 0),
        "nginx_rps": round(top.median(1, |r| r.rps), 0),
        "gateway_rps": round(top.median(2, |r| r.rps), 0),
        "ratio": round(ratio_median, 3),
        "ratio_spread": spread(&ratio, 3),
        "gateway_direct_ratio": spread(&direct_ratio, 3),
        "nginx_direct_ratio": spread(&nginx_direct_ratio, 3),
        "direct_rps_rounds": top.runs[0].iter().map(|r| r.rps.round()).collect::<Vec<_>>(),
        "nginx_rps_rounds": top.runs[1].iter().map(|r| r.rps.round()).collect::<Vec<_>>(),
        "gateway_rps_rounds": top.runs[2].iter().map(|r| r.rps.round()).collect::<Vec<_>>(),
        "errors": top.errors() + half.errors(),
        "half_load_connections": half_c,
        "half_load_gateway_rps": round(half.median(2, |r| r.rps), 0),
        "half_load_nginx_rps": round(half.median(1, |r| r.rps), 0),
        "half_load_direct_rps": round(half.median(0, |r| r.rps), 0),
        "direct_p50_ms": round(half.median(0, |r| r.p50_ms), 3),
        "direct_p99_ms": round(half.median(0, |r| r.p99_ms), 3),
        "nginx_p50_ms": round(half.median(1, |r| r.p50_ms), 3),
        "nginx_p99_ms": round(half.median(1, |r| r.p99_ms), 3),
        "gateway_p50_ms": round(half.median(2, |r| r.p50_ms), 3),
        "gateway_p99_ms": round(half.median(2, |r| r.p99_ms), 3),
        "added_p99_ms": round(added_median, 3),
        "added_p99_spread": spread(&added, 3),
        "nginx_added_p99_ms": spread(&nginx_added, 3),
        "added_p50_ms": spread(&half.paired(2, 0, |g, d| g.p50_ms - d.p50_ms), 3),
        "ratio_target_met": ratio_median >= 0.9,
        "added_p99_target_met": added_median <= 1.0,
    }))
}

fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

/// Nearest rank, as the gateway's own signals; NaN for no samples.
fn percentile(v: &mut [f64], q: f64) -> f64 {
    flotilla_core::gateway::nearest_rank(v, q).unwrap_or(f64::NAN)
}

/// Time from the first request at zero replicas to its first byte, minus
/// the emulator's weight-load delay: the activator's report, the replica's
/// start and readiness probe, the route push and the dispatch.
async fn scale_from_zero(trials: usize) -> Result<Value> {
    const LOAD_DELAY_MS: u64 = 1000;
    let mut overheads = Vec::new();
    for _ in 0..trials {
        let t = tenant();
        let route = endpoint(&t, Balance::LeastOutstanding, Vec::new());
        let id = route.id.clone();
        let control = control_with(route);
        let gw = gateway(&control).await?;
        let mut reports = control.subscribe_reports();
        let scaler_control = control.clone();
        // The autoscaler's part: start a replica on the first queued demand,
        // probe its readiness every 10 ms, then route to it.
        let scaler = tokio::spawn(async move {
            loop {
                let s = reports.recv().await?;
                if s.iter().any(|s| s.endpoint_id == id && s.queued > 0) {
                    break;
                }
            }
            let emu = Emulator::start(EmulatorConfig {
                model: MODEL.into(),
                load_delay_ms: LOAD_DELAY_MS,
                ..EmulatorConfig::default()
            })
            .await?;
            let probe = reqwest::Client::new();
            loop {
                if probe
                    .get(format!("{}/health", emu.url()))
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200)
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            scaler_control.update_routes(|t| t.endpoints[0].replicas.push(replica(emu.url())));
            anyhow::Ok(emu)
        });
        let http = reqwest::Client::new();
        let started = Instant::now();
        let resp = http
            .post(format!("{}/v1/chat/completions", gw.url()))
            .bearer_auth(KEY)
            .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": true}))
            .send()
            .await?;
        if resp.status() != 200 {
            bail!("cold request answered {}", resp.status());
        }
        let mut body = resp.bytes_stream();
        body.next().await.context("no first byte")??;
        let first_byte = started.elapsed();
        while body.next().await.is_some() {}
        overheads.push(first_byte.as_secs_f64() * 1000.0 - LOAD_DELAY_MS as f64);
        let emu = scaler.await??;
        gw.shutdown().await;
        emu.shutdown().await;
    }
    let mut v = overheads.clone();
    Ok(json!({
        "trials": trials,
        "load_delay_ms": LOAD_DELAY_MS,
        "p50_ms": round(percentile(&mut v, 0.5), 1),
        "p99_ms": round(percentile(&mut v, 0.99), 1),
        "max_ms": round(percentile(&mut v, 1.0), 1),
        "p99_target_met": percentile(&mut v, 0.99) <= 1000.0,
    }))
}

/// One mix under one balance: fresh replicas (cold caches), closed-loop
/// clients, TTFT measured at the client from the stream's first byte.
async fn affinity_run(balance: Balance, shared: bool, requests: usize) -> Result<Value> {
    const REPLICAS: usize = 4;
    const WORKERS: usize = 8;
    const GROUPS: usize = 16;
    let emus: Vec<Emulator> = futures::future::try_join_all((0..REPLICAS).map(|_| {
        Emulator::start(EmulatorConfig {
            model: MODEL.into(),
            prefill_tokens_per_s: 20_000.0,
            decode_tokens_per_s: 0.0,
            max_concurrency: 4,
            prefix_cache_tokens: 12_000,
            ..EmulatorConfig::default()
        })
    }))
    .await?;
    let t = tenant();
    let control = control_with(endpoint(
        &t,
        balance,
        emus.iter().map(|e| replica(e.url())).collect(),
    ));
    let gw = gateway(&control).await?;
    let http = reqwest::Client::new();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let (http, url, next) = (http.clone(), gw.url(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(w as u64);
            let mut ttfts = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= requests {
                    break;
                }
                // About 1,000 tokens of system prompt, shared by a group or
                // unique to the request, then a short question.
                let system = if shared {
                    let g = rng.gen_range(0..GROUPS);
                    format!("group{g} ").repeat(1000)
                } else {
                    format!("req{i}x ").repeat(1000)
                };
                let question = format!("question {i} ").repeat(20);
                let body = json!({"model": MODEL, "stream": true, "max_tokens": 1, "messages": [
                    {"role": "system", "content": system}, {"role": "user", "content": question}]});
                let started = Instant::now();
                let resp = http
                    .post(format!("{url}/v1/chat/completions"))
                    .bearer_auth(KEY)
                    .json(&body)
                    .send()
                    .await?;
                if resp.status() != 200 {
                    bail!("affinity request answered {}", resp.status());
                }
                let mut stream = resp.bytes_stream();
                stream.next().await.context("no first byte")??;
                ttfts.push(started.elapsed().as_secs_f64() * 1000.0);
                while stream.next().await.is_some() {}
            }
            anyhow::Ok(ttfts)
        }));
    }
    let mut ttfts = Vec::new();
    for t in tasks {
        ttfts.extend(t.await??);
    }
    let prompt: u64 = emus
        .iter()
        .map(|e| {
            e.stats()
                .prompt_tokens
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum();
    let cached: u64 = emus
        .iter()
        .map(|e| {
            e.stats()
                .cached_prompt_tokens
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum();
    gw.shutdown().await;
    for e in emus {
        e.shutdown().await;
    }
    Ok(json!({
        "mix": if shared { "shared-prefix" } else { "no-shared-prefix" },
        "balance": match balance { Balance::PrefixAffinity => "prefix_affinity", _ => "least_outstanding" },
        "requests": requests,
        "ttft_p50_ms": round(percentile(&mut ttfts, 0.5), 2),
        "ttft_p99_ms": round(percentile(&mut ttfts, 0.99), 2),
        "prefix_hit_rate": round(cached as f64 / prompt.max(1) as f64, 3),
    }))
}

async fn affinity(requests: usize) -> Result<Value> {
    let mut rows = Vec::new();
    for shared in [true, false] {
        for balance in [Balance::LeastOutstanding, Balance::PrefixAffinity] {
            let row = affinity_run(balance, shared, requests).await?;
            eprintln!("{row}");
            rows.push(row);
        }
    }
    let f = |i: usize, k: &str| rows[i][k].as_f64().unwrap_or(f64::NAN);
    let shared_better =
        f(1, "ttft_p50_ms") < f(0, "ttft_p50_ms") && f(1, "ttft_p99_ms") < f(0, "ttft_p99_ms");
    let within = |k: &str| f(3, k) <= f(2, k) * 1.05;
    Ok(json!({
        "rows": rows,
        "shared_prefix_target_met": shared_better,
        "no_shared_prefix_target_met": within("ttft_p50_ms") && within("ttft_p99_ms"),
    }))
}

fn yes(v: &Value) -> &'static str {
    if v.as_bool() == Some(true) {
        "met"
    } else {
        "**missed**"
    }
}

fn table(r: &Value) -> String {
    let p = &r["proxy"];
    let c = &r["scale_from_zero"];
    let a = &r["affinity"];
    let mut s = String::new();
    s.push_str("## Proxy overhead: wrk through the gateway and through nginx\n\n");
    s.push_str(&format!(
        "| path | rps at {} connections | p50 at {} connections (ms) | p99 at {} connections (ms) |\n|---|---|---|---|\n",
        p["top_connections"], p["half_load_connections"], p["half_load_connections"]
    ));
    for (name, key) in [
        ("emulator directly", "direct"),
        ("nginx", "nginx"),
        ("gateway", "gateway"),
    ] {
        s.push_str(&format!(
            "| {name} | {} | {} | {} |\n",
            p[format!("{key}_rps")],
            p[format!("{key}_p50_ms")],
            p[format!("{key}_p99_ms")]
        ));
    }
    let sp = |v: &Value| {
        format!(
            "median **{}**, min {}, max {}, per round {}",
            v["median"], v["min"], v["max"], v["rounds"]
        )
    };
    s.push_str(&format!(
        "\nMedians over {} rounds of {} s per path; the gateway's runtime has {} worker threads and nginx {} worker processes; load average before {}, after {}.\n\n",
        p["rounds"],
        p["seconds"],
        p["workers"],
        p["workers"],
        p["loadavg_before"].as_str().unwrap_or("?"),
        p["loadavg_after"].as_str().unwrap_or("?")
    ));
    s.push_str(&format!(
        "- rps per round at {} connections: direct {}, nginx {}, gateway {}\n\
         - ratio gateway/nginx, paired per round: {} (target >= 0.9: {})\n\
         - gateway/direct: {}; nginx/direct: {}\n\
         - added p99 at half load (gateway minus direct, {} connections, gateway at {} rps), paired per round: {} ms (target <= 1 ms: {})\n\
         - nginx's added p99 the same way: {} ms\n\
         - gateway's added p50: {} ms\n\
         - non-2xx responses and socket errors over all runs: {}\n\n",
        p["top_connections"],
        p["direct_rps_rounds"],
        p["nginx_rps_rounds"],
        p["gateway_rps_rounds"],
        sp(&p["ratio_spread"]),
        yes(&p["ratio_target_met"]),
        sp(&p["gateway_direct_ratio"]),
        sp(&p["nginx_direct_ratio"]),
        p["half_load_connections"],
        p["half_load_gateway_rps"],
        sp(&p["added_p99_spread"]),
        yes(&p["added_p99_target_met"]),
        sp(&p["nginx_added_p99_ms"]),
        sp(&p["added_p50_ms"]),
        p["errors"]
    ));
    if p["added_p99_target_met"] == json!(false) {
        s.push_str(&format!(
            "The added p99 target is missed by {} ms. At this load every path's p99 is mostly the\n\
             machine's scheduling delay (processes outnumber the CPUs): the gateway's per-round\n\
             differences run from {} to {} ms, nginx's measured alike from {} to {} ms (median {}),\n\
             while the gateway's added p50, which scheduling hardly moves, is {} ms.\n\n",
            round(p["added_p99_ms"].as_f64().unwrap_or(f64::NAN) - 1.0, 3),
            p["added_p99_spread"]["min"],
            p["added_p99_spread"]["max"],
            p["nginx_added_p99_ms"]["min"],
            p["nginx_added_p99_ms"]["max"],
            p["nginx_added_p99_ms"]["median"],
            p["added_p50_ms"]["median"]
        ));
    }
    s.push_str("## Scale from zero\n\n");
    s.push_str(&format!(
        "First request to first byte minus the {} ms weight load, {} trials: p50 **{} ms**, p99 **{} ms**, max {} ms (target p99 <= 1 s: {})\n\n",
        c["load_delay_ms"],
        c["trials"],
        c["p50_ms"],
        c["p99_ms"],
        c["max_ms"],
        yes(&c["p99_target_met"])
    ));
    s.push_str("## Prefix affinity against least outstanding\n\n| mix | balance | TTFT p50 (ms) | TTFT p99 (ms) | prefix-hit rate |\n|---|---|---|---|---|\n");
    for row in a["rows"].as_array().into_iter().flatten() {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} |\n",
            row["mix"].as_str().unwrap_or(""),
            row["balance"].as_str().unwrap_or(""),
            row["ttft_p50_ms"],
            row["ttft_p99_ms"],
            row["prefix_hit_rate"]
        ));
    }
    s.push_str(&format!(
        "\n- shared prefix: affinity better at p50 and p99: {}\n- no shared prefix: affinity within 5 % at p50 and p99: {}\n",
        yes(&a["shared_prefix_target_met"]),
        yes(&a["no_shared_prefix_target_met"])
    ));
    s
}
