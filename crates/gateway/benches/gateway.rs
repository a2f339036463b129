//! The gateway benchmark (`scripts/bench gateway`): proxy overhead against
//! nginx, scale-from-zero latency, and prefix affinity against least
//! outstanding. Writes `gateway.json` and `gateway.table.md` into
//! `$FLOTILLA_BENCH_OUT` (default `bench/results`); the script wraps the
//! table with the run's details. Needs `wrk` and `nginx` on `PATH`, the
//! emulator binary (`$FLOTILLA_EMULATOR_BIN`, default
//! `$CARGO_TARGET_DIR/release/flotilla-emulator`) and the gateway as a
//! process (`$FLOTILLA_GATEWAY_BIN`, default
//! `$CARGO_TARGET_DIR/release/examples/bench-gateway`); the script provides
//! all four. `$FLOTILLA_BENCH_GATEWAY_BASELINE` names a second gateway
//! binary (say, of an earlier commit) measured in the same rounds.
//!
//! Latency is measured where it can resolve a millisecond: at a paced load
//! that leaves the CPUs room (a closed loop at any concurrency keeps them
//! saturated, and p99 is then the run queue's), in many short rounds where
//! each proxy runs right next to its upstream alone, and beside a control —
//! nginx in front of an nginx that answers from memory — whose added p99 is
//! the machine's jitter plus nginx's own cost, so that the gateway's added
//! p99 minus the control's is what the gateway adds over nginx.

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
    let bin = binary("FLOTILLA_EMULATOR_BIN", "flotilla-emulator");
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

/// An nginx of this run, in a prefix directory of its own.
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

/// Starts nginx with `workers` worker processes, `http_extra` in its `http`
/// block and `location` as the body of its one `location /`. Connections
/// from clients are kept for any number of requests (nginx's default closes
/// one after 1,000; the gateway never does).
async fn nginx_with(workers: usize, http_extra: &str, location: &str) -> Result<Nginx> {
    let dir = tempfile::tempdir()?;
    let port = free_port()?;
    let p = dir.path().display();
    let conf = format!(
        "worker_processes {workers};\ndaemon off;\npid {p}/nginx.pid;\nerror_log {p}/error.log warn;\n\
         events {{ worker_connections 4096; }}\n\
         http {{\n  access_log off;\n  keepalive_requests 1000000;\n  client_body_temp_path {p}/body;\n  proxy_temp_path {p}/proxy;\n\
         fastcgi_temp_path {p}/fastcgi;\n  uwsgi_temp_path {p}/uwsgi;\n  scgi_temp_path {p}/scgi;\n\
         {http_extra}\n\
         server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      {location}\n    }}\n  }}\n}}\n"
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

/// nginx as a reverse proxy of `upstream`: keep-alive connections to it
/// (as the gateway pools them), unbuffered (as the gateway streams).
async fn nginx_proxy(upstream: &str, workers: usize) -> Result<Nginx> {
    let upstream = upstream.trim_start_matches("http://");
    nginx_with(
        workers,
        &format!(
            "upstream backend {{ server {upstream}; keepalive 256; keepalive_requests 1000000; }}"
        ),
        "proxy_pass http://backend;\n      proxy_http_version 1.1;\n      \
         proxy_set_header Connection \"\";\n      proxy_buffering off;",
    )
    .await
}

/// nginx answering every request with `body` as `content_type`: the
/// control's upstream, a server whose own time is next to nothing.
async fn nginx_static(body: &str, content_type: &str, workers: usize) -> Result<Nginx> {
    // The body goes into the configuration as a quoted string, where these
    // would end it or be read as variables.
    if body.contains(['\'', '\\', '$']) || content_type.contains([';', '\'', '"']) {
        bail!(
            "the upstream's answer cannot be written into nginx.conf as is: {content_type} {body}"
        );
    }
    nginx_with(
        workers,
        "",
        &format!("default_type \"{content_type}\";\n      return 200 '{body}';"),
    )
    .await
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

/// The gateway as a process (`examples/bench-gateway.rs`): one endpoint,
/// one replica, `upstream`. It serves until its stdin closes.
struct GatewayProcess {
    child: Child,
    stdin: Option<tokio::process::ChildStdin>,
    url: String,
}

impl GatewayProcess {
    async fn start(bin: &Path, upstream: &str, workers: usize) -> Result<Self> {
        let mut child = Command::new(bin)
            .args(["--upstream", upstream, "--model", MODEL, "--key", KEY])
            .args(["--workers", &workers.to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().context("gateway stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).await?;
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .with_context(|| format!("{} said {line:?}", bin.display()))?
            .to_string();
        Ok(Self {
            child,
            stdin,
            url: format!("http://{addr}"),
        })
    }

    /// Closes its stdin: it drains, delivers its usage and exits.
    async fn stop(mut self) -> Result<()> {
        drop(self.stdin.take());
        if tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .is_err()
        {
            self.child.kill().await?;
            bail!("the gateway did not stop within 60 s of its stdin closing");
        }
        Ok(())
    }
}

/// `$var`, or `$CARGO_TARGET_DIR/release/{default}`.
fn binary(var: &str, default: &str) -> PathBuf {
    std::env::var(var).map(PathBuf::from).unwrap_or_else(|_| {
        PathBuf::from(std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into()))
            .join("release")
            .join(default)
    })
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

    /// Per round, path `a`'s p99 minus path `b`'s.
    fn added_p99(&self, a: usize, b: usize) -> Vec<f64> {
        self.paired(a, b, |x, y| x.p99_ms - y.p99_ms)
    }

    fn errors(&self) -> u64 {
        self.runs.iter().flatten().map(|r| r.errors).sum()
    }
}

/// A distribution-free 95 % interval for the median of `sorted` (n ≥ 6):
/// the k-th smallest and k-th largest values, k the largest rank with
/// P(Binomial(n, 1/2) < k) ≤ 2.5 %. Its width says what difference the
/// rounds can resolve. `None` for fewer than 6 values.
fn median_ci95(sorted: &[f64]) -> Option<(f64, f64)> {
    let n = sorted.len();
    let tail = |k: usize| -> f64 {
        // P(X <= k - 1), X ~ Binomial(n, 1/2).
        let mut p = 0.0;
        let mut c = 1.0f64;
        for i in 0..k {
            if i > 0 {
                c = c * (n - i + 1) as f64 / i as f64;
            }
            p += c;
        }
        p / 2f64.powi(n as i32)
    };
    let k = (1..=n / 2).take_while(|&k| tail(k) <= 0.025).last()?;
    Some((sorted[k - 1], sorted[n - k]))
}

/// `{median, min, max, median_ci95, rounds}` of per-round values.
fn spread(v: &[f64], digits: i32) -> Value {
    let mut sorted = v.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = percentile(&mut sorted.clone(), 0.5);
    let ci = median_ci95(&sorted)
        .map(|(lo, hi)| json!([round(lo, digits), round(hi, digits)]))
        .unwrap_or(Value::Null);
    json!({
        "median": round(median, digits),
        "min": round(sorted.first().copied().unwrap_or(f64::NAN), digits),
        "max": round(sorted.last().copied().unwrap_or(f64::NAN), digits),
        "median_ci95": ci,
        "rounds": v.iter().map(|x| round(*x, digits)).collect::<Vec<_>>(),
    })
}

/// Runs wrk on every target, `rounds` times over, in the order `order`
/// gives for each round, back to back so that a burst of other work on the
/// machine hits neighbouring runs of different paths alike.
async fn rounds_of(
    targets: &[(&str, String)],
    script: &Path,
    connections: u32,
    secs: u32,
    rounds: usize,
    order: impl Fn(usize) -> Vec<usize>,
) -> Result<Rounds> {
    let mut runs: Vec<Vec<WrkResult>> = targets.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for i in order(round) {
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

/// Each round starts at the next path, so no path always runs first, right
/// after a pause, or last.
fn rotation(n: usize) -> impl Fn(usize) -> Vec<usize> {
    move |round| (0..n).map(|k| (round + k) % n).collect()
}

/// Paths in blocks whose neighbours are compared: odd rounds run the
/// blocks in the other order, and rounds 2-3 of every four run each block
/// backwards, so that over four rounds every path runs as often before its
/// partner as after it, always right next to it.
fn paired_order(blocks: Vec<Vec<usize>>) -> impl Fn(usize) -> Vec<usize> {
    move |round| {
        let mut b = blocks.clone();
        if round % 2 == 1 {
            b.reverse();
        }
        if (round / 2) % 2 == 1 {
            for block in &mut b {
                block.reverse();
            }
        }
        b.concat()
    }
}

/// Worker threads of the gateway's runtime and nginx's worker processes:
/// `$FLOTILLA_BENCH_WORKERS`, default the machine's CPUs.
fn workers() -> usize {
    env_count("FLOTILLA_BENCH_WORKERS")
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()))
}

fn env_count(var: &str) -> Option<usize> {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// The request every wrk run sends.
fn request_body() -> String {
    format!(
        "{{\"model\":\"{MODEL}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}],\"max_tokens\":1}}"
    )
}

/// The emulator's answer to [`request_body`]: its content type and body,
/// what the control's upstream nginx answers every request with.
async fn sample_answer(upstream: &str) -> Result<(String, String)> {
    let resp = reqwest::Client::new()
        .post(format!("{upstream}/v1/chat/completions"))
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body(request_body())
        .send()
        .await?;
    if resp.status() != 200 {
        bail!("the emulator answered {}", resp.status());
    }
    let ct = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .context("the emulator's answer has no content type")?
        .to_string();
    Ok((ct, resp.text().await?))
}

/// Indices of the paced rounds' paths.
const STATIC: usize = 0;
const CONTROL: usize = 1;
const DIRECT: usize = 2;
const GATEWAY: usize = 3;
const NGINX: usize = 4;
const BASELINE: usize = 5;

/// Throughput at a top load (the emulator directly, through nginx, through
/// the gateway) and latency at a paced load, where every proxy path is
/// paired with its upstream alone and the gateway's added p99 is set
/// against nginx's added p99 in front of a static nginx (the control).
async fn proxy_overhead(quick: bool) -> Result<Value> {
    let (mut emu, upstream) = emulator_process().await?;
    let n_workers = workers();
    let gw = GatewayProcess::start(
        &binary("FLOTILLA_GATEWAY_BIN", "examples/bench-gateway"),
        &upstream,
        n_workers,
    )
    .await?;
    // A gateway built from another commit, measured beside this one.
    let baseline = match std::env::var("FLOTILLA_BENCH_GATEWAY_BASELINE") {
        Ok(bin) => Some(GatewayProcess::start(Path::new(&bin), &upstream, n_workers).await?),
        Err(_) => None,
    };
    let (content_type, answer) = sample_answer(&upstream).await?;
    let ngx = nginx_proxy(&upstream, n_workers).await?;
    let ngx_static = nginx_static(&answer, &content_type, n_workers).await?;
    let ngx_control = nginx_proxy(&ngx_static.url, n_workers).await?;
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("post.lua");
    let request = format!(
        "wrk.method = \"POST\"\nwrk.body = '{}'\n\
         wrk.headers[\"Content-Type\"] = \"application/json\"\nwrk.headers[\"Authorization\"] = \"Bearer {KEY}\"\n",
        request_body()
    );
    std::fs::write(&script, &request)?;
    // Paced: each connection waits this long after an answer before its
    // next request; wrk times a request from its sending, so the wait is
    // not in the latency.
    let think_ms = env_count("FLOTILLA_BENCH_THINK_MS").unwrap_or(2);
    let paced = dir.path().join("paced.lua");
    std::fs::write(
        &paced,
        format!("{request}function delay()\n  return {think_ms}\nend\n"),
    )?;
    let secs = if quick { 2 } else { 4 };
    let top_rounds = if quick { 1 } else { 7 };
    let paced_rounds = env_count("FLOTILLA_BENCH_ROUNDS").unwrap_or(if quick { 4 } else { 16 });
    let paced_c = env_count("FLOTILLA_BENCH_PACED_CONNECTIONS").unwrap_or(16) as u32;
    let top_c = 64;
    let top_targets = [
        ("direct", upstream.clone()),
        ("nginx", ngx.url.clone()),
        ("gateway", gw.url.clone()),
    ];
    let mut paced_targets = vec![
        ("static nginx", ngx_static.url.clone()),
        ("nginx -> static nginx", ngx_control.url.clone()),
        ("direct", upstream.clone()),
        ("gateway", gw.url.clone()),
        ("nginx", ngx.url.clone()),
    ];
    let mut emulator_block = vec![GATEWAY, DIRECT, NGINX];
    if let Some(b) = &baseline {
        paced_targets.push(("baseline gateway", b.url.clone()));
        emulator_block.insert(0, BASELINE);
    }
    let load_before = loadavg();
    // Warm-up: every path's connection pools and caches, at the top load.
    for (_, url) in &paced_targets {
        wrk(url, &script, top_c, 2).await?;
    }
    let top = rounds_of(
        &top_targets,
        &script,
        top_c,
        secs,
        top_rounds,
        rotation(top_targets.len()),
    )
    .await?;
    let lat = rounds_of(
        &paced_targets,
        &paced,
        paced_c,
        secs,
        paced_rounds,
        paired_order(vec![emulator_block, vec![STATIC, CONTROL]]),
    )
    .await?;
    let load_after = loadavg();
    ngx.stop().await?;
    ngx_control.stop().await?;
    ngx_static.stop().await?;
    gw.stop().await?;
    if let Some(b) = baseline {
        b.stop().await?;
    }
    let _ = emu.kill().await;
    let ratio = top.paired(2, 1, |g, n| g.rps / n.rps);
    let direct_ratio = top.paired(2, 0, |g, d| g.rps / d.rps);
    let nginx_direct_ratio = top.paired(1, 0, |n, d| n.rps / d.rps);
    let ratio_median = percentile(&mut ratio.clone(), 0.5);
    let gateway_added = lat.added_p99(GATEWAY, DIRECT);
    let control_added = lat.added_p99(CONTROL, STATIC);
    let net: Vec<f64> = gateway_added
        .iter()
        .zip(&control_added)
        .map(|(g, c)| g - c)
        .collect();
    let net_median = percentile(&mut net.clone(), 0.5);
    let path = |i: usize| {
        json!({
            "name": paced_targets[i].0,
            "rps": round(lat.median(i, |r| r.rps), 0),
            "p50_ms": round(lat.median(i, |r| r.p50_ms), 3),
            "p99_ms": round(lat.median(i, |r| r.p99_ms), 3),
            "p99_rounds": lat.runs[i].iter().map(|r| round(r.p99_ms, 3)).collect::<Vec<_>>(),
        })
    };
    let baseline_json = if paced_targets.len() > BASELINE {
        let added = lat.added_p99(BASELINE, DIRECT);
        let net_baseline: Vec<f64> = added
            .iter()
            .zip(&control_added)
            .map(|(b, c)| b - c)
            .collect();
        json!({
            "path": path(BASELINE),
            "added_p99_ms": spread(&added, 3),
            "added_p99_minus_control_ms": spread(&net_baseline, 3),
            "added_p50_ms": spread(&lat.paired(BASELINE, DIRECT, |b, d| b.p50_ms - d.p50_ms), 3),
            "p99_gateway_minus_baseline_ms": spread(&lat.added_p99(GATEWAY, BASELINE), 3),
            "p50_gateway_minus_baseline_ms": spread(&lat.paired(GATEWAY, BASELINE, |g, b| g.p50_ms - b.p50_ms), 3),
        })
    } else {
        Value::Null
    };
    Ok(json!({
        "workers": n_workers,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "seconds": secs,
        "top_connections": top_c,
        "top_rounds": top_rounds,
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
        "ratio_target_met": ratio_median >= 0.9,
        "paced_connections": paced_c,
        "paced_think_ms": think_ms,
        "paced_rounds": paced_rounds,
        "paths": (0..paced_targets.len()).map(path).collect::<Vec<_>>(),
        "gateway_added_p99_ms": spread(&gateway_added, 3),
        "control_added_p99_ms": spread(&control_added, 3),
        "nginx_added_p99_ms": spread(&lat.added_p99(NGINX, DIRECT), 3),
        "added_p99_minus_control_ms": spread(&net, 3),
        "gateway_added_p50_ms": spread(&lat.paired(GATEWAY, DIRECT, |g, d| g.p50_ms - d.p50_ms), 3),
        "control_added_p50_ms": spread(&lat.paired(CONTROL, STATIC, |c, s| c.p50_ms - s.p50_ms), 3),
        "nginx_added_p50_ms": spread(&lat.paired(NGINX, DIRECT, |n, d| n.p50_ms - d.p50_ms), 3),
        "baseline": baseline_json,
        "errors": top.errors() + lat.errors(),
        "added_p99_target_met": net_median <= 1.0,
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

fn spread_text(v: &Value) -> String {
    let ci = match v["median_ci95"].as_array().map(Vec::as_slice) {
        Some([lo, hi]) => format!(" (95 % interval of the median {lo} to {hi})"),
        _ => String::new(),
    };
    format!(
        "median **{}**{ci}, min {}, max {}, per round {}",
        v["median"], v["min"], v["max"], v["rounds"]
    )
}

fn proxy_table(p: &Value) -> String {
    let mut s = String::new();
    s.push_str("## Proxy overhead: wrk through the gateway and through nginx\n\n");
    s.push_str(&format!(
        "Throughput, {} connections, closed loop, medians over {} rounds of {} s per path:\n\n\
         | path | rps |\n|---|---|\n| emulator directly | {} |\n| nginx -> emulator | {} |\n| gateway -> emulator | {} |\n\n",
        p["top_connections"],
        p["top_rounds"],
        p["seconds"],
        p["direct_rps"],
        p["nginx_rps"],
        p["gateway_rps"]
    ));
    s.push_str(&format!(
        "- rps per round: direct {}, nginx {}, gateway {}\n\
         - ratio gateway/nginx, paired per round: {} (target >= 0.9: {})\n\
         - gateway/direct: {}; nginx/direct: {}\n\n",
        p["direct_rps_rounds"],
        p["nginx_rps_rounds"],
        p["gateway_rps_rounds"],
        spread_text(&p["ratio_spread"]),
        yes(&p["ratio_target_met"]),
        spread_text(&p["gateway_direct_ratio"]),
        spread_text(&p["nginx_direct_ratio"]),
    ));
    s.push_str(&format!(
        "Latency, {} connections each waiting {} ms between an answer and its next request, medians over {} rounds of {} s per path:\n\n\
         | path | rps | p50 (ms) | p99 (ms) |\n|---|---|---|---|\n",
        p["paced_connections"], p["paced_think_ms"], p["paced_rounds"], p["seconds"]
    ));
    for path in p["paths"].as_array().into_iter().flatten() {
        s.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            path["name"].as_str().unwrap_or("?"),
            path["rps"],
            path["p50_ms"],
            path["p99_ms"]
        ));
    }
    s.push_str(&format!(
        "\nAdded p99, each proxy's p99 minus its upstream's alone, paired per round (ms):\n\n\
         - **gateway's added p99 minus the control's**: {} (target <= 1 ms: {})\n\
         - gateway -> emulator minus emulator: {}\n\
         - control, nginx -> static nginx minus static nginx: {}\n\
         - nginx -> emulator minus emulator: {}\n\
         - added p50: gateway {}; control {}; nginx -> emulator {}\n",
        spread_text(&p["added_p99_minus_control_ms"]),
        yes(&p["added_p99_target_met"]),
        spread_text(&p["gateway_added_p99_ms"]),
        spread_text(&p["control_added_p99_ms"]),
        spread_text(&p["nginx_added_p99_ms"]),
        spread_text(&p["gateway_added_p50_ms"]),
        spread_text(&p["control_added_p50_ms"]),
        spread_text(&p["nginx_added_p50_ms"]),
    ));
    let b = &p["baseline"];
    if !b.is_null() {
        s.push_str(&format!(
            "- baseline gateway (`FLOTILLA_BENCH_GATEWAY_BASELINE`), added p99 minus the control's: {}; \
             this gateway's p99 minus the baseline's: {}; p50: {}\n",
            spread_text(&b["added_p99_minus_control_ms"]),
            spread_text(&b["p99_gateway_minus_baseline_ms"]),
            spread_text(&b["p50_gateway_minus_baseline_ms"]),
        ));
    }
    s.push_str(&format!(
        "- non-2xx responses and socket errors over all runs: {}\n\n\
         The gateway's runtime has {} worker threads and each nginx {} worker processes; load average before {}, after {}.\n\n",
        p["errors"],
        p["workers"],
        p["workers"],
        p["loadavg_before"].as_str().unwrap_or("?"),
        p["loadavg_after"].as_str().unwrap_or("?")
    ));
    s
}

fn table(r: &Value) -> String {
    let p = &r["proxy"];
    let c = &r["scale_from_zero"];
    let a = &r["affinity"];
    let mut s = proxy_table(p);
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
