//! The control plane in-process, on an ephemeral port with a SQLite file,
//! and a small HTTP client for it (reqwest, not the code under test).

use std::time::Duration;

use flotilla_client::paths;
use flotilla_core::api::{
    CreateApiKey, CreateTenant, DiscoveredGpu, ObservedInstance, ObservedPhase, RegisterNode,
    SyncRequest,
};
use flotilla_core::catalog::Vendor;
use flotilla_core::id::{NodeId, TenantId};
use flotilla_core::node::RuntimeKind;
use flotilla_core::tenant::Role;
use flotilla_server::{bootstrap, open_store, serve, ServerConfig, Store};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

/// Settings for tests: fast loops, no rate limit in the way.
pub fn fast() -> ServerConfig {
    ServerConfig {
        heartbeat_timeout: Duration::from_secs(30),
        rate_limit_per_second: 10_000,
        anonymous_rate_limit_per_second: 10_000,
        protocol_rate_limit_per_second: 10_000,
        reconcile_tick: Duration::from_millis(50),
        ..ServerConfig::default()
    }
}

/// A running server; dropping it shuts it down.
#[derive(Debug)]
pub struct TestServer {
    /// Base URL, e.g. `http://127.0.0.1:41234`.
    pub url: String,
    /// The operator key bootstrap minted.
    pub operator: String,
    /// The server's store, for assertions on what it recorded.
    pub store: Store,
    _dir: tempfile::TempDir,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// An answer: status, headers and the body (JSON when it parses).
#[derive(Debug)]
pub struct Resp {
    /// HTTP status.
    pub status: StatusCode,
    /// Headers.
    pub headers: reqwest::header::HeaderMap,
    /// Body.
    pub body: Value,
}

/// Starts a server with `config` on a fresh SQLite file.
pub async fn start(config: ServerConfig) -> TestServer {
    let dir = tempfile::tempdir().expect("temporary directory");
    let url = format!("sqlite://{}/f.db?mode=rwc", dir.path().display());
    let store = open_store(&url, config.store_timeouts())
        .await
        .expect("store");
    let boot = bootstrap(&store, dir.path()).await.expect("bootstrap");
    let config = ServerConfig {
        secrets_key_file: config
            .secrets_key_file
            .or_else(|| Some(dir.path().join("secrets.key"))),
        ..config
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("local address");
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(serve(store.clone(), config, listener, async move {
        let _ = rx.await;
    }));
    TestServer {
        url: format!("http://{addr}"),
        operator: boot
            .operator_key
            .expect("a fresh store mints an operator key"),
        store,
        _dir: dir,
        stop: Some(tx),
    }
}

impl TestServer {
    /// `flotilla-client` for this server with `key`: for tests of the
    /// typed client against the real server, and for the setup helpers
    /// below (a tenant, a key, a node), which name no path. The raw
    /// helpers (`raw`, `request`, `call`, `ok`) use plain reqwest, so that
    /// a test of the wire tests the server, not the client.
    pub fn client(&self, key: &str) -> flotilla_client::Client {
        flotilla_client::Client::new(&self.url, key).expect("a client of the test server")
    }

    /// A request with a raw body and extra headers.
    pub async fn raw(
        &self,
        key: &str,
        method: Method,
        path: &str,
        body: Option<String>,
        headers: &[(&str, &str)],
    ) -> Resp {
        let mut req = reqwest::Client::new()
            .request(method, format!("{}{path}", self.url))
            .bearer_auth(key);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if let Some(b) = body {
            req = req.header("content-type", "application/json").body(b);
        }
        let r = req.send().await.expect("the server answers");
        let status = r.status();
        let headers = r.headers().clone();
        let text = r.text().await.expect("a body");
        Resp {
            status,
            headers,
            body: serde_json::from_str(&text).unwrap_or(Value::String(text)),
        }
    }

    /// A request with a JSON body.
    pub async fn request(
        &self,
        key: &str,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Resp {
        self.raw(key, method, path, body.map(|b| b.to_string()), &[])
            .await
    }

    /// A request with a JSON body; status and body.
    pub async fn call(
        &self,
        key: &str,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let r = self.request(key, method, path, body).await;
        (r.status, r.body)
    }

    /// A request that must succeed; its body.
    pub async fn ok(&self, key: &str, method: Method, path: &str, body: Option<Value>) -> Value {
        let r = self.request(key, method.clone(), path, body).await;
        assert!(
            r.status.is_success(),
            "{method} {path}: {} {}",
            r.status,
            r.body
        );
        r.body
    }

    /// Creates a tenant (as the operator); its id.
    pub async fn create_tenant(&self, name: &str) -> String {
        let req = CreateTenant { name: name.into() };
        let t = self.client(&self.operator).create_tenant(&req).await;
        t.unwrap_or_else(|e| panic!("creating tenant {name}: {e}"))
            .id
            .to_string()
    }

    /// Mints a key of `role` for `tenant` (as the operator); its secret.
    pub async fn key(&self, tenant: &str, role: &str) -> String {
        let req = CreateApiKey {
            tenant_id: Some(TenantId::parse(tenant, "tenant").expect("a tenant id")),
            role: Role::parse(role).expect("a role"),
            name: String::new(),
            endpoints: None,
        };
        let k = self.client(&self.operator).create_key(&req).await;
        k.unwrap_or_else(|e| panic!("minting a {role} key: {e}"))
            .secret
    }

    /// One agent sync of `node` reporting `observed` (instance id, phase),
    /// answered at once; the node's assignments.
    pub async fn sync(
        &self,
        key: &str,
        node: &str,
        observed: Vec<(String, ObservedPhase)>,
    ) -> Vec<Value> {
        let observed: Vec<ObservedInstance> = observed
            .into_iter()
            .map(|(id, phase)| ObservedInstance {
                instance_id: serde_json::from_value(json!(id)).expect("an instance id"),
                phase,
                at: chrono::Utc::now(),
                started_at: None,
                message: None,
                container: None,
                weights_tier: None,
                limit_exceeded: None,
            })
            .collect();
        let req = SyncRequest {
            observed,
            wait_ms: 0,
            gpus: Vec::new(),
            images: None,
            weights: None,
            parks_ended: vec![],
            busy_ok: false,
        };
        let node = NodeId::parse(node, "node").expect("a node id");
        let answer = self.client(key).sync_node(&node, &req).await;
        let answer = answer.unwrap_or_else(|e| panic!("syncing {node}: {e}"));
        answer
            .assignments
            .iter()
            .map(|a| serde_json::to_value(a).expect("an assignment as JSON"))
            .collect()
    }

    /// Registers a node with simulated GPUs (`[("H100", 4), ("L40S", 2)]`;
    /// `"H100:mig"` for GPUs in MIG mode) through the agent protocol; its id.
    pub async fn register_node(&self, key: &str, name: &str, gpus: &[(&str, u32)]) -> String {
        self.register_node_running(key, name, gpus, RuntimeKind::Process)
            .await
    }

    /// [`Self::register_node`] for an agent that runs workloads with
    /// `runtime` (processes or containers).
    pub async fn register_node_running(
        &self,
        key: &str,
        name: &str,
        gpus: &[(&str, u32)],
        runtime: RuntimeKind,
    ) -> String {
        let req = registration(name, gpus, runtime);
        let r = self.client(key).register_node(&req).await;
        r.unwrap_or_else(|e| panic!("registering {name}: {e}"))
            .node_id
            .to_string()
    }
}

/// An agent's registration of a node with simulated GPUs
/// (`[("H100", 4), ("L40S", 2)]`; `"H100:mig"` for GPUs in MIG mode),
/// 256 cores and about 2 TB of memory.
pub fn registration(name: &str, gpus: &[(&str, u32)], runtime: RuntimeKind) -> RegisterNode {
    let mut list = Vec::new();
    for (model, n) in gpus {
        let (model, mig) = match model.strip_suffix(":mig") {
            Some(m) => (m, true),
            None => (*model, false),
        };
        for _ in 0..*n {
            let index = list.len() as u32;
            list.push(DiscoveredGpu {
                index,
                model: model.to_string(),
                uuid: format!("GPU-{name}-{index}"),
                memory_mib: 81920,
                vendor: Vendor::Nvidia,
                mig_mode: mig,
            });
        }
    }
    RegisterNode {
        name: name.into(),
        region: None,
        pool: None,
        cpu_milli: 256_000,
        memory_mb: 2_000_000,
        simulated: true,
        gpus: list,
        agent_version: "test".into(),
        runtime,
        executor: Default::default(),
        running: Vec::new(),
        unenforced_limits: Vec::new(),
        network: None,
    }
}

/// The server's state on a manual clock, driven directly: no listener and
/// no background loops, so a test calls the router ([`OnClock::call`]) and
/// runs the control passes itself, moving time as it likes.
pub struct OnClock {
    /// The state the router and the control loops run on.
    pub st: flotilla_server::state::AppState,
    /// The clock `st` reads.
    pub clock: flotilla_core::clock::ManualClock,
    /// The operator key bootstrap minted.
    pub operator: String,
    _dir: tempfile::TempDir,
    _stop: tokio::sync::watch::Sender<bool>,
}

impl std::fmt::Debug for OnClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnClock").finish_non_exhaustive()
    }
}

impl OnClock {
    /// A fresh SQLite store, bootstrapped, on a clock standing at `start`.
    /// The rate limit (on the real clock) is set out of the way.
    pub async fn new(start: chrono::DateTime<chrono::Utc>) -> Self {
        Self::with_config(start, ServerConfig::default()).await
    }

    /// Like [`OnClock::new`], with `config` (its rate limit set out of
    /// the way likewise).
    pub async fn with_config(start: chrono::DateTime<chrono::Utc>, config: ServerConfig) -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let url = format!("sqlite://{}/f.db?mode=rwc", dir.path().display());
        let store = open_store(&url, config.store_timeouts())
            .await
            .expect("store");
        let boot = bootstrap(&store, dir.path()).await.expect("bootstrap");
        let clock = flotilla_core::clock::ManualClock::new(start);
        let (tx, rx) = tokio::sync::watch::channel(false);
        let config = ServerConfig {
            rate_limit_per_second: 10_000,
            ..config
        };
        let st = flotilla_server::state::AppState::new(
            store,
            config,
            std::sync::Arc::new(clock.clone()),
            rx,
        );
        Self {
            st,
            clock,
            operator: boot
                .operator_key
                .expect("a fresh store mints an operator key"),
            _dir: dir,
            _stop: tx,
        }
    }

    /// One request through the router with `key`: status and JSON body
    /// (`Null` when the body is not JSON).
    pub async fn call(
        &self,
        key: &str,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        use tower::ServiceExt;
        let req = axum::http::Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(body.map_or_else(axum::body::Body::empty, |b| {
                axum::body::Body::from(b.to_string())
            }))
            .expect("a request");
        let resp = flotilla_server::app(self.st.clone())
            .oneshot(req)
            .await
            .expect("the router answers");
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .expect("the body");
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    /// The agent of `node` reports `instance` in `phase` now, by this
    /// clock, through the agent protocol (one sync that waits for nothing);
    /// the sync's answer.
    pub async fn report(
        &self,
        key: &str,
        node: &str,
        instance: &str,
        phase: ObservedPhase,
    ) -> Value {
        let observed = ObservedInstance {
            instance_id: serde_json::from_value(json!(instance)).expect("an instance id"),
            phase,
            at: flotilla_core::clock::Clock::now(&self.clock),
            started_at: None,
            message: None,
            container: None,
            weights_tier: None,
            limit_exceeded: None,
        };
        self.ok(
            key,
            "POST",
            &paths::agent_sync(node),
            Some(json!({"observed": [observed], "wait_ms": 0})),
        )
        .await
    }

    /// One raw request through `app`: status, `Set-Cookie` values and the
    /// body as text.
    async fn raw(
        app: &axum::Router,
        method: &str,
        path: &str,
        cookie: Option<&str>,
        form: Option<String>,
    ) -> (StatusCode, Vec<String>, String) {
        use tower::ServiceExt;
        let mut req = axum::http::Request::builder().method(method).uri(path);
        if let Some(c) = cookie {
            req = req.header("cookie", c);
        }
        if form.is_some() {
            req = req.header("content-type", "application/x-www-form-urlencoded");
        }
        let req = req
            .body(form.map_or_else(axum::body::Body::empty, axum::body::Body::from))
            .expect("a request");
        let resp = app.clone().oneshot(req).await.expect("the router answers");
        let status = resp.status();
        let cookies = resp
            .headers()
            .get_all("set-cookie")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or_default().to_string())
            .collect();
        let bytes = axum::body::to_bytes(resp.into_body(), 16 << 20)
            .await
            .expect("the body");
        (
            status,
            cookies,
            String::from_utf8_lossy(&bytes).into_owned(),
        )
    }

    /// Signs in to the web console with `key` (its sign-in form, with the
    /// form's token) and reads the page at `path`: its status and HTML.
    pub async fn console_page(&self, key: &str, path: &str) -> (StatusCode, String) {
        // One app for the three requests: its console keeps the session.
        let app = flotilla_server::app(self.st.clone());
        let (_, cookies, login) = Self::raw(&app, "GET", "/login", None, None).await;
        let login_cookie = cookies
            .into_iter()
            .find(|c| c.starts_with("flotilla_login="))
            .expect("the sign-in page sets its cookie");
        let at = login.find("name=\"csrf\"").expect("a csrf field");
        let v = login[at..].find("value=\"").expect("its value") + at + 7;
        let token = &login[v..v + login[v..].find('"').expect("its end")];
        assert!(
            key.chars()
                .chain(token.chars())
                .all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "key and token need no form encoding"
        );
        let (status, cookies, body) = Self::raw(
            &app,
            "POST",
            "/login",
            Some(&login_cookie),
            Some(format!("csrf={token}&api_key={key}")),
        )
        .await;
        let session = cookies
            .into_iter()
            .find(|c| c.starts_with("flotilla_session="))
            .unwrap_or_else(|| panic!("signing in answered {status}: {body}"));
        let (status, _, html) = Self::raw(&app, "GET", path, Some(&session), None).await;
        (status, html)
    }

    /// [`OnClock::call`] that must succeed (2xx); the body.
    pub async fn ok(&self, key: &str, method: &str, path: &str, body: Option<Value>) -> Value {
        let (status, b) = self.call(key, method, path, body).await;
        assert!(status.is_success(), "{method} {path}: {status} {b}");
        b
    }

    /// Creates a tenant (as the operator) and mints a key of `role` for
    /// it; the key's secret.
    pub async fn tenant_key(&self, name: &str, role: &str) -> String {
        let op = self.operator.clone();
        let t = self
            .ok(&op, "POST", paths::TENANTS, Some(json!({ "name": name })))
            .await;
        self.key(&t["id"], role).await
    }

    /// Mints a key of `role` for `tenant` (as the operator); its secret.
    pub async fn key(&self, tenant: &Value, role: &str) -> String {
        let op = self.operator.clone();
        let k = self
            .ok(
                &op,
                "POST",
                paths::KEYS,
                Some(json!({ "tenant_id": tenant, "role": role })),
            )
            .await;
        k["secret"].as_str().expect("a key secret").to_string()
    }

    /// Registers a node with simulated GPUs ([`registration`]) through the
    /// agent protocol; its id.
    pub async fn register_node(&self, key: &str, name: &str, gpus: &[(&str, u32)]) -> String {
        let body = serde_json::to_value(registration(name, gpus, RuntimeKind::Process))
            .expect("register body");
        let r = self
            .ok(key, "POST", paths::AGENT_REGISTER, Some(body))
            .await;
        r["node_id"].as_str().expect("node id").to_string()
    }
}
