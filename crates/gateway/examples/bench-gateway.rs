//! The gateway as a process of its own, for the proxy benchmark
//! (`crates/gateway/benches/gateway.rs`): one endpoint with one replica
//! (`--upstream`), serving `--model` to `--key`, least outstanding, on a
//! runtime of `--workers` threads. Prints `listening on {addr}` once it
//! serves.
//!
//! A process rather than a task in the benchmark's own runtime so that it
//! stands beside nginx on equal terms (its own threads, nothing else on
//! them), and so that a gateway built from an earlier commit can be
//! measured in the same run as this one (`FLOTILLA_BENCH_GATEWAY_BASELINE`).
//!
//! The control plane is in memory, as in every gateway test, except for
//! usage: [`StaticControl`] keeps every record, which over a benchmark's
//! millions of requests grows a vector whose reallocations copy hundreds of
//! megabytes on the gateway's threads. The real control ([`ApiControl`])
//! serialises each batch and sends it away; this one serialises it and
//! counts it, so the gateway pays for delivery what it pays in production
//! short of the network.
//!
//! [`ApiControl`]: flotilla_gateway::ApiControl

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use flotilla_core::gateway::{
    Balance, EndpointRoute, EndpointSignals, KeyGrant, ReplicaRoute, RequestUsage, RouteTable,
};
use flotilla_core::id::{EndpointId, InstanceId, TenantId};
use flotilla_gateway::{Control, ControlFuture, GatewayConfig, StaticControl};
use tokio::sync::Notify;

/// [`StaticControl`] for routes and keys; usage serialised and counted.
struct BenchControl {
    inner: StaticControl,
    metered: AtomicU64,
    metered_bytes: AtomicU64,
}

impl Control for BenchControl {
    fn routes(&self) -> ControlFuture<'_, RouteTable> {
        self.inner.routes()
    }

    fn authorize<'a>(&'a self, key: &'a str) -> ControlFuture<'a, Option<KeyGrant>> {
        self.inner.authorize(key)
    }

    fn report(&self, signals: Vec<EndpointSignals>) -> ControlFuture<'_, ()> {
        // Not kept: one a second for the whole run adds up too.
        let _ = signals;
        Box::pin(async { Ok(()) })
    }

    fn meter(&self, usage: Vec<RequestUsage>) -> ControlFuture<'_, ()> {
        let result = serde_json::to_vec(&usage)
            .map(|body| {
                self.metered
                    .fetch_add(usage.len() as u64, Ordering::Relaxed);
                self.metered_bytes
                    .fetch_add(body.len() as u64, Ordering::Relaxed);
            })
            .map_err(|e| flotilla_gateway::ControlError::with_source("serialising usage", e));
        Box::pin(async move { result })
    }

    fn route_changes(&self) -> Option<Arc<Notify>> {
        self.inner.route_changes()
    }
}

struct Args {
    upstream: String,
    model: String,
    key: String,
    workers: usize,
}

fn args() -> Result<Args> {
    let mut upstream = None;
    let mut model = None;
    let mut key = None;
    let mut workers = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--upstream" => upstream = Some(value),
            "--model" => model = Some(value),
            "--key" => key = Some(value),
            "--workers" => {
                workers = Some(
                    value
                        .parse::<usize>()
                        .ok()
                        .filter(|n| *n > 0)
                        .with_context(|| format!("--workers: not a positive count: {value}"))?,
                )
            }
            _ => {
                bail!("unknown argument {flag} (--upstream URL --model NAME --key KEY --workers N)")
            }
        }
    }
    Ok(Args {
        upstream: upstream.context("--upstream is required")?,
        model: model.context("--model is required")?,
        key: key.context("--key is required")?,
        workers: workers.context("--workers is required")?,
    })
}

fn main() -> Result<()> {
    let args = args()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.workers)
        .thread_name("gateway")
        .enable_all()
        .build()?;
    runtime.block_on(serve(args))
}

async fn serve(args: Args) -> Result<()> {
    let tenant = TenantId::generate(1, 1);
    let control = Arc::new(BenchControl {
        inner: StaticControl::new(),
        metered: AtomicU64::new(0),
        metered_bytes: AtomicU64::new(0),
    });
    control.inner.set_key(
        args.key,
        KeyGrant {
            tenant_id: tenant.clone(),
            endpoints: Vec::new(),
            over_hard_cap: false,
        },
    );
    control.inner.set_routes(RouteTable {
        endpoints: vec![EndpointRoute {
            id: EndpointId::generate(1, 2),
            tenant_id: tenant,
            name: "bench".into(),
            models: vec![args.model],
            balance: Balance::LeastOutstanding,
            queue_limit: 10_000,
            queue_timeout_ms: 60_000,
            replica_concurrency: 0,
            rate_limit_rps: None,
            replicas: vec![ReplicaRoute {
                instance_id: InstanceId::generate(1, 3),
                url: args.upstream,
                revision: 1,
                draining: false,
            }],
        }],
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let config = GatewayConfig {
        seed: 1,
        ..GatewayConfig::default()
    };
    let gw = flotilla_gateway::serve(listener, control.clone(), config).await?;
    println!("listening on {}", gw.local_addr());
    // Until stdin closes (the benchmark holds it open) or a signal.
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = tokio::task::spawn_blocking(|| {
            let mut sink = Vec::new();
            let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
        }) => {}
    }
    gw.shutdown().await;
    eprintln!(
        "usage records delivered: {} ({} bytes of JSON)",
        control.metered.load(Ordering::Relaxed),
        control.metered_bytes.load(Ordering::Relaxed)
    );
    Ok(())
}
