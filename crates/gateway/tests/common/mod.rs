//! Shared fixtures: in-process emulators on real sockets, a gateway over a
//! [`StaticControl`], and route builders.

#![allow(dead_code, reason = "each test file uses a different part")]

use std::sync::Arc;
use std::time::Duration;

use flotilla_core::gateway::{Balance, EndpointRoute, KeyGrant, ReplicaRoute};
use flotilla_core::id::{EndpointId, InstanceId, TenantId};
use flotilla_emulator::{Emulator, EmulatorConfig};
use flotilla_gateway::{GatewayConfig, GatewayHandle, StaticControl};
use tokio::net::TcpListener;

pub const MODEL: &str = "emu-model";

pub fn tenant() -> TenantId {
    TenantId::generate(1, rand::random())
}

pub fn endpoint_id() -> EndpointId {
    EndpointId::generate(1, rand::random())
}

pub fn instance_id() -> InstanceId {
    InstanceId::generate(1, rand::random())
}

/// An emulator serving [`MODEL`] with `f` applied to its defaults.
pub async fn emulator(f: impl FnOnce(&mut EmulatorConfig)) -> Emulator {
    let mut c = EmulatorConfig {
        model: MODEL.into(),
        ..EmulatorConfig::default()
    };
    f(&mut c);
    Emulator::start(c).await.expect("emulator starts")
}

pub fn replica(e: &Emulator, revision: u32) -> ReplicaRoute {
    ReplicaRoute {
        instance_id: instance_id(),
        url: e.url(),
        revision,
        draining: false,
    }
}

pub fn route(tenant: &TenantId, name: &str, replicas: Vec<ReplicaRoute>) -> EndpointRoute {
    EndpointRoute {
        id: endpoint_id(),
        tenant_id: tenant.clone(),
        name: name.into(),
        models: vec![MODEL.into()],
        balance: Balance::LeastOutstanding,
        queue_limit: 1000,
        queue_timeout_ms: 30_000,
        replica_concurrency: 64,
        rate_limit_rps: None,
        replicas,
    }
}

pub fn grant(tenant: &TenantId) -> KeyGrant {
    KeyGrant {
        tenant_id: tenant.clone(),
        endpoints: Vec::new(),
        over_hard_cap: false,
    }
}

/// Short intervals so tests see reports, routes and usage quickly.
pub fn config() -> GatewayConfig {
    GatewayConfig {
        route_poll_interval: Duration::from_millis(50),
        report_interval: Duration::from_millis(200),
        meter_interval: Duration::from_millis(50),
        auth_cache_ttl: Duration::ZERO,
        seed: 7,
        ..GatewayConfig::default()
    }
}

pub async fn gateway(control: &Arc<StaticControl>, config: GatewayConfig) -> GatewayHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    flotilla_gateway::serve(listener, control.clone(), config)
        .await
        .expect("gateway starts")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .expect("client")
}

pub fn chat(prompt: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

/// Waits until `f` holds, polling; panics with `what` after `timeout`.
pub async fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + timeout;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// POSTs `body` as JSON with a bearer key.
pub async fn post(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    body: &serde_json::Value,
) -> reqwest::Response {
    http.post(url)
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .expect("sent")
}

/// The same with a `Host` header.
pub async fn post_host(
    http: &reqwest::Client,
    url: &str,
    host: &str,
    key: &str,
    body: &serde_json::Value,
) -> reqwest::Response {
    http.post(url)
        .header("host", host)
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .expect("sent")
}
