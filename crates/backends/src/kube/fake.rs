//! A fake Kubernetes API server for tests (feature `testing`): a real local
//! HTTP port that kube-rs, and so the executor and `flotilla executor
//! kubernetes`, talk to as to kube-apiserver, because no API server can run
//! on the machines these tests run on.
//!
//! It has two modes, which combine:
//!
//! - **Scripted** ([`FakeKube::start`]): every answer is queued by the test
//!   ([`FakeKube::on`], [`FakeKube::on_watch`]), usually a recorded body
//!   from `crates/backends/tests/fixtures/kube/`; anything unscripted is a
//!   `404 NotFound` (a watch hangs). For tests of exact answers: errors,
//!   watches that end, `410 Gone`.
//! - **Stateful** ([`FakeKube::stateful`]): a small cluster that runs work.
//!   Nodes are given ([`FakeNode`]: allocatable `nvidia.com/gpu` and GPU
//!   feature discovery's labels); a pod created by `POST` is `Pending`,
//!   then `ContainerCreating`, then `Running`, and ends `Succeeded` or
//!   `Failed` when its command ends, or stays `Running` until deleted; a
//!   `DELETE` with a grace period marks it terminating, signals it (SIGTERM,
//!   SIGKILL after the grace) and then removes it; watches deliver every
//!   transition from the resource version asked; logs return the command's
//!   output with the kubelet's timestamps; namespaces, ResourceQuotas,
//!   NetworkPolicies and Secrets are accepted by server-side apply and
//!   kept. Scripted answers still take precedence, so a test can inject a
//!   failure into a running cluster.
//!
//! The fake kubelet runs each pod's container command (`command` then
//! `args`) as a local process in a scratch directory, with the pod's
//! environment, ignoring the image: the command really runs, its output is
//! really the log and its exit code really the container's. A container
//! without a command (the image's own entrypoint, unknown here) runs until
//! deleted. Like the device plugin, it admits a pod only if the GPUs it
//! asks for are free on its node, and fails it at admission otherwise
//! (`UnexpectedAdmissionError`).
//!
//! Every object keeps the API's real shapes (those of the fixtures): the
//! `kind`/`apiVersion`/`metadata` envelope, `resourceVersion`s that only
//! grow, `Status` bodies for errors, newline-delimited watch events.
//!
//! This module must never be built into a shipped binary: it runs
//! commands it is sent. It exists only under the `testing` feature.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::Response;
use chrono::{DateTime, SecondsFormat, Utc};
use futures::channel::mpsc;
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};

/// One request the fake received.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// `GET`, `POST`, ...
    pub method: String,
    /// The path.
    pub path: String,
    /// The raw query string.
    pub query: String,
    /// The body, parsed as JSON when it is.
    pub body: Option<Value>,
}

impl Recorded {
    /// Whether the query has `key=value` (values compared URL-decoded).
    pub fn has_param(&self, key: &str, value: &str) -> bool {
        self.params().iter().any(|(k, v)| k == key && v == value)
    }

    /// The decoded query parameters.
    pub fn params(&self) -> Vec<(String, String)> {
        params(&self.query)
    }

    /// The first value of a query parameter.
    pub fn param(&self, key: &str) -> Option<String> {
        self.params()
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    }

    /// Whether this is a watch.
    pub fn is_watch(&self) -> bool {
        self.has_param("watch", "true") || self.has_param("watch", "1")
    }
}

fn params(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// How a scripted watch connection goes on after its recorded events.
pub enum Then {
    /// The server closes it (as at `timeoutSeconds`).
    End,
    /// It stays open with nothing more to say.
    Hang,
    /// The test sends more lines through the channel; closing it ends
    /// the watch.
    Feed(mpsc::UnboundedReceiver<String>),
}

/// One scripted answer.
pub enum Reply {
    /// A status code and a JSON body (a fixture).
    Json(u16, String),
    /// A status code and a plain-text body (pod logs).
    Text(u16, String),
    /// A watch: these NDJSON lines, then `Then`.
    Watch(String, Then),
}

/// A node of the stateful cluster, with the labels GPU feature discovery
/// writes and the device plugin's allocatable `nvidia.com/gpu`.
#[derive(Debug, Clone)]
pub struct FakeNode {
    /// `metadata.name` (and `kubernetes.io/hostname`).
    pub name: String,
    /// GFD's `nvidia.com/gpu.product`, e.g. `NVIDIA-A100-SXM4-80GB`.
    pub product: String,
    /// GFD's `nvidia.com/gpu.memory`, MiB.
    pub memory_mib: u64,
    /// Allocatable `nvidia.com/gpu`.
    pub gpus: u32,
    /// Extra labels (the Flotilla pool label, a region).
    pub labels: BTreeMap<String, String>,
    /// Allocatable CPU, cores.
    pub cpus: u32,
    /// Allocatable memory, GiB.
    pub memory_gib: u32,
}

impl FakeNode {
    /// A Ready GPU node with `gpus` GPUs of `product`, 32 cores and
    /// 256 GiB.
    pub fn gpu(name: &str, product: &str, memory_mib: u64, gpus: u32) -> Self {
        Self {
            name: name.into(),
            product: product.into(),
            memory_mib,
            gpus,
            labels: BTreeMap::new(),
            cpus: 32,
            memory_gib: 256,
        }
    }

    /// Adds a label.
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// The Node object, in the shape the API server returns.
    pub fn object(&self, resource_version: u64, created: DateTime<Utc>) -> Value {
        let mut labels: BTreeMap<String, String> = BTreeMap::from(
            [
                ("beta.kubernetes.io/arch", "amd64"),
                ("beta.kubernetes.io/os", "linux"),
                ("kubernetes.io/arch", "amd64"),
                ("kubernetes.io/os", "linux"),
                ("feature.node.kubernetes.io/pci-10de.present", "true"),
                ("nvidia.com/gpu.present", "true"),
                ("nvidia.com/gpu.deploy.device-plugin", "true"),
                ("nvidia.com/gpu.deploy.gpu-feature-discovery", "true"),
                ("nvidia.com/gpu.mode", "compute"),
                ("nvidia.com/gpu.replicas", "1"),
                ("nvidia.com/gpu.sharing-strategy", "none"),
                ("nvidia.com/mig.strategy", "single"),
                ("nvidia.com/cuda.driver-version.full", "550.90.07"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string())),
        );
        labels.insert("kubernetes.io/hostname".into(), self.name.clone());
        labels.insert("nvidia.com/gpu.product".into(), self.product.clone());
        labels.insert("nvidia.com/gpu.count".into(), self.gpus.to_string());
        labels.insert("nvidia.com/gpu.memory".into(), self.memory_mib.to_string());
        labels.extend(self.labels.clone());
        let at = time(created);
        let resources = json!({
            "cpu": self.cpus.to_string(),
            "memory": format!("{}Ki", u64::from(self.memory_gib) * 1024 * 1024),
            "nvidia.com/gpu": self.gpus.to_string(),
            "pods": "110",
        });
        let condition = |t: &str, s: &str, reason: &str, message: &str| {
            json!({"type": t, "status": s, "lastHeartbeatTime": at, "lastTransitionTime": at,
                   "reason": reason, "message": message})
        };
        json!({
            "metadata": {
                "name": self.name,
                "uid": uid(&format!("node/{}", self.name)),
                "resourceVersion": resource_version.to_string(),
                "creationTimestamp": at,
                "labels": labels,
                "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": {
                "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
            },
            "status": {
                "capacity": resources,
                "allocatable": resources,
                "conditions": [
                    condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                    condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                    condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
                    condition("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
                ],
                "addresses": [{"type": "Hostname", "address": self.name}],
                "nodeInfo": {
                    "containerRuntimeVersion": "containerd://1.7.22",
                    "kubeletVersion": "v1.33.4",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
            },
        })
    }
}

/// How fast the fake kubelet moves a pod along.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Created → `ContainerCreating` (the kubelet picked it up).
    pub admit: Duration,
    /// `ContainerCreating` → `Running` (the image pull and the start).
    pub pull: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            admit: Duration::from_millis(200),
            pull: Duration::from_millis(500),
        }
    }
}

type Key = (String, String, bool);

/// One pod of the stateful cluster.
#[derive(Debug)]
struct FakePod {
    object: Value,
    /// The container's output: (time, line).
    log: Vec<(DateTime<Utc>, String)>,
    /// The process group of its command, while it runs.
    pgid: Option<i32>,
    /// The container ended (set with its terminated state).
    exited: tokio::sync::watch::Sender<bool>,
}

#[derive(Default)]
struct Inner {
    routes: HashMap<Key, VecDeque<Reply>>,
    requests: Vec<Recorded>,
    stateful: bool,
    timing: Timing,
    /// The last resource version handed out.
    rv: u64,
    nodes: Vec<Value>,
    /// Namespaces, quotas, policies, secrets: (plural, namespace, name).
    objects: BTreeMap<(String, String, String), Value>,
    pods: BTreeMap<(String, String), FakePod>,
    /// Every pod event, in resource-version order: (rv, type, object).
    events: Vec<(u64, &'static str, Value)>,
}

struct Shared {
    inner: Mutex<Inner>,
    /// The last resource version, for watches to wait on.
    changed: tokio::sync::watch::Sender<u64>,
    work_dir: PathBuf,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The fake API server.
pub struct FakeKube {
    /// Its base URL.
    pub url: String,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        self.task.abort();
        let g = self.shared.lock();
        for p in g.pods.values() {
            if let Some(pgid) = p.pgid {
                signal_group(pgid, "KILL");
            }
        }
        drop(g);
        let _ = std::fs::remove_dir_all(&self.shared.work_dir);
    }
}

const NOT_FOUND: &str = r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"the server could not find the requested resource","reason":"NotFound","details":{},"code":404}"#;

fn status(code: u16, reason: &str, message: &str, details: Value) -> (u16, Value) {
    (
        code,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": message, "reason": reason, "details": details, "code": code}),
    )
}

fn not_found(kind: &str, name: &str) -> (u16, Value) {
    status(
        404,
        "NotFound",
        &format!("{kind} \"{name}\" not found"),
        json!({"name": name, "kind": kind}),
    )
}

fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// A stable UUID-shaped id for an object.
fn uid(seed: &str) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    seed.hash(&mut h);
    let a = h.finish();
    (seed, 1u8).hash(&mut h);
    let b = h.finish();
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        b >> 52,
        b & 0xffff_ffff_ffff
    )
}

/// Sends `signal` (`TERM`, `KILL`) to a process group.
fn signal_group(pgid: i32, signal: &str) {
    let _ = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(format!("-{pgid}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
}

/// Whether `labels` match a label selector (`k=v`, `k==v`, `k!=v`, `k`,
/// `!k`, comma-separated: what kube-rs sends).
fn selects(selector: &str, labels: Option<&Value>) -> bool {
    let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    selector
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .all(|term| {
            if let Some((k, v)) = term.split_once("!=") {
                get(k.trim()) != Some(v.trim())
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                get(k.trim()) == Some(v.trim())
            } else if let Some(k) = term.strip_prefix('!') {
                get(k).is_none()
            } else {
                get(term).is_some()
            }
        })
}

/// GPUs a pod's containers ask for.
fn gpu_limit(pod: &Value) -> u64 {
    pod["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| {
            c["resources"]["limits"]["nvidia.com/gpu"]
                .as_str()
                .and_then(|q| q.parse::<u64>().ok())
        })
        .sum()
}

fn pod_ended(pod: &Value) -> bool {
    matches!(
        pod["status"]["phase"].as_str(),
        Some("Succeeded" | "Failed")
    )
}

type Answer = (u16, Value);

impl FakeKube {
    /// Starts a scripted fake on a free local port.
    pub async fn start() -> Self {
        Self::launch(Inner::default()).await
    }

    /// Starts a stateful cluster of `nodes` with the default [`Timing`].
    pub async fn stateful(nodes: Vec<FakeNode>) -> Self {
        Self::stateful_with(nodes, Timing::default()).await
    }

    /// Starts a stateful cluster of `nodes`.
    pub async fn stateful_with(nodes: Vec<FakeNode>, timing: Timing) -> Self {
        let now = Utc::now();
        let objects = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| n.object(i as u64 + 1, now))
            .collect::<Vec<_>>();
        Self::launch(Inner {
            stateful: true,
            timing,
            rv: objects.len() as u64 + 1,
            nodes: objects,
            ..Inner::default()
        })
        .await
    }

    async fn launch(inner: Inner) -> Self {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let work_dir = std::env::temp_dir().join(format!(
            "flotilla-fake-kube-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let (changed, _) = tokio::sync::watch::channel(inner.rv);
        let shared = Arc::new(Shared {
            inner: Mutex::new(inner),
            changed,
            work_dir,
        });
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a local port for the fake API server");
        let url = format!(
            "http://{}",
            listener.local_addr().expect("the fake's local address")
        );
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { url, shared, task }
    }

    /// A kube client configuration for the fake.
    pub fn config(&self) -> kube::Config {
        kube::Config::new(self.url.parse().expect("the fake's URL"))
    }

    /// A kube client for the fake, set up as the executor sets up its own
    /// ([`super::client`]).
    pub fn client(&self) -> kube::Client {
        super::client(self.config()).expect("a client for the fake API server")
    }

    /// A kubeconfig file's text (JSON, which is YAML) whose current context
    /// is the fake: what `KUBECONFIG` points a separate process at.
    pub fn kubeconfig(&self) -> String {
        json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        })
        .to_string()
    }

    /// Queues a scripted answer to `method path`.
    pub fn on(&self, method: &str, path: &str, reply: Reply) {
        let watch = matches!(reply, Reply::Watch(..));
        self.shared
            .lock()
            .routes
            .entry((method.into(), path.into(), watch))
            .or_default()
            .push_back(reply);
    }

    /// Queues a scripted answer to a watch on `path`.
    pub fn on_watch(&self, path: &str, lines: String, then: Then) {
        self.on("GET", path, Reply::Watch(lines, then));
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.lock().requests.clone()
    }

    /// The requests with this method and path.
    pub fn requests_to(&self, method: &str, path: &str) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.method == method && r.path == path)
            .collect()
    }

    /// The pods the cluster has now (stateful mode).
    pub fn pods(&self) -> Vec<Value> {
        self.shared
            .lock()
            .pods
            .values()
            .map(|p| p.object.clone())
            .collect()
    }

    /// Every watch event of pods so far: (type, object), in order.
    pub fn pod_events(&self) -> Vec<(String, Value)> {
        self.shared
            .lock()
            .events
            .iter()
            .map(|(_, t, o)| (t.to_string(), o.clone()))
            .collect()
    }

    /// An object applied to the cluster: `plural` is the resource
    /// (`namespaces`, `resourcequotas`, `networkpolicies`, `secrets`),
    /// `namespace` empty for cluster-scoped ones.
    pub fn object(&self, plural: &str, namespace: &str, name: &str) -> Option<Value> {
        self.shared
            .lock()
            .objects
            .get(&(plural.into(), namespace.into(), name.into()))
            .cloned()
    }
}

async fn handle(State(shared): State<Arc<Shared>>, req: Request<Body>) -> Response {
    let method = req.method().as_str().to_string();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let bytes: Bytes = axum::body::to_bytes(req.into_body(), 16 << 20)
        .await
        .unwrap_or_default();
    let body: Option<Value> = serde_json::from_slice(&bytes).ok();
    let rec = Recorded {
        method: method.clone(),
        path: path.clone(),
        query: query.clone(),
        body: body.clone(),
    };
    let watch = rec.is_watch();
    let (scripted, stateful) = {
        let mut g = shared.lock();
        g.requests.push(rec);
        let scripted = match g.routes.get_mut(&(method.clone(), path.clone(), watch)) {
            // The last answer of a route repeats; a watch answer cannot
            // (its feed is consumed), so a watch with none left hangs.
            Some(q) if q.len() > 1 => q.pop_front(),
            Some(q) if watch => q.pop_front(),
            Some(q) => q.front().map(|r| match r {
                Reply::Json(s, b) => Reply::Json(*s, b.clone()),
                Reply::Text(s, b) => Reply::Text(*s, b.clone()),
                Reply::Watch(..) => Reply::Watch(String::new(), Then::Hang),
            }),
            None => None,
        };
        (scripted, g.stateful)
    };
    let reply = match scripted {
        Some(r) => r,
        None if stateful => {
            return serve_state(&shared, &method, &path, &query, body).await;
        }
        None if watch => Reply::Watch(String::new(), Then::Hang),
        None => Reply::Json(404, NOT_FOUND.into()),
    };
    match reply {
        Reply::Json(code, body) => respond(code, "application/json", Body::from(body)),
        Reply::Text(code, body) => respond(code, "text/plain", Body::from(body)),
        Reply::Watch(lines, then) => {
            // One chunk per event line, as the API server flushes them.
            let first: Vec<Result<Bytes, std::io::Error>> = lines
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| Ok(Bytes::from(format!("{l}\n"))))
                .collect();
            let head = futures::stream::iter(first);
            let stream = match then {
                Then::End => head.boxed(),
                Then::Hang => head.chain(futures::stream::pending()).boxed(),
                Then::Feed(rx) => head
                    .chain(rx.map(|l| Ok(Bytes::from(format!("{}\n", l.trim_end())))))
                    .boxed(),
            };
            respond(200, "application/json", Body::from_stream(stream))
        }
    }
}

fn respond(code: u16, content_type: &str, body: Body) -> Response {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header("content-type", content_type)
        .body(body)
        .unwrap_or_default()
}

fn json_response((code, body): Answer) -> Response {
    respond(code, "application/json", Body::from(body.to_string()))
}

/// The stateful cluster's answer.
async fn serve_state(
    shared: &Arc<Shared>,
    method: &str,
    path: &str,
    query: &str,
    body: Option<Value>,
) -> Response {
    let q = params(query);
    let param = |k: &str| q.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let watch = matches!(param("watch").as_deref(), Some("true" | "1"));
    let selector = param("labelSelector").unwrap_or_default();
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (method, segs.as_slice()) {
        ("GET", ["api", "v1", "nodes"]) => {
            let g = shared.lock();
            let items: Vec<Value> = g
                .nodes
                .iter()
                .filter(|n| selects(&selector, n["metadata"].get("labels")))
                .cloned()
                .collect();
            json_response((200, list("NodeList", g.rv, items)))
        }
        ("GET", ["api", "v1", "nodes", name]) => {
            let g = shared.lock();
            json_response(
                g.nodes
                    .iter()
                    .find(|n| n["metadata"]["name"] == *name)
                    .map(|n| (200, with_kind(n.clone(), "Node", "v1")))
                    .unwrap_or_else(|| not_found("nodes", name)),
            )
        }
        ("GET", ["api", "v1", "pods"]) if watch => watch_pods(shared, None, selector, &param),
        ("GET", ["api", "v1", "namespaces", ns, "pods"]) if watch => {
            watch_pods(shared, Some(ns.to_string()), selector, &param)
        }
        ("GET", ["api", "v1", "pods"]) => json_response(list_pods(shared, None, &selector)),
        ("GET", ["api", "v1", "namespaces", ns, "pods"]) => {
            json_response(list_pods(shared, Some(ns), &selector))
        }
        ("POST", ["api", "v1", "namespaces", ns, "pods"]) => {
            json_response(create_pod(shared, ns, body))
        }
        ("GET", ["api", "v1", "namespaces", ns, "pods", name]) => {
            let g = shared.lock();
            json_response(
                g.pods
                    .get(&(ns.to_string(), name.to_string()))
                    .map(|p| (200, p.object.clone()))
                    .unwrap_or_else(|| not_found("pods", name)),
            )
        }
        ("DELETE", ["api", "v1", "namespaces", ns, "pods", name]) => {
            let grace = param("gracePeriodSeconds")
                .and_then(|g| g.parse::<i64>().ok())
                .or_else(|| body.as_ref().and_then(|b| b["gracePeriodSeconds"].as_i64()));
            json_response(delete_pod(shared, ns, name, grace))
        }
        ("GET", ["api", "v1", "namespaces", ns, "pods", name, "log"]) => {
            pod_log(shared, ns, name, param("sinceTime"))
        }
        ("PATCH", ["api", "v1", "namespaces", name]) => json_response(apply(
            shared,
            "namespaces",
            "",
            name,
            "Namespace",
            "v1",
            body,
        )),
        ("PATCH", ["api", "v1", "namespaces", ns, plural, name]) => {
            let kind = match *plural {
                "resourcequotas" => "ResourceQuota",
                "secrets" => "Secret",
                _ => return json_response(not_found(plural, name)),
            };
            json_response(apply(shared, plural, ns, name, kind, "v1", body))
        }
        (
            "PATCH",
            ["apis", "networking.k8s.io", "v1", "namespaces", ns, "networkpolicies", name],
        ) => json_response(apply(
            shared,
            "networkpolicies",
            ns,
            name,
            "NetworkPolicy",
            "networking.k8s.io/v1",
            body,
        )),
        ("DELETE", ["api", "v1", "namespaces", ns, "secrets", name]) => {
            let removed = shared.lock().objects.remove(&(
                "secrets".to_string(),
                ns.to_string(),
                name.to_string(),
            ));
            json_response(match removed {
                Some(o) => (200, o),
                None => not_found("secrets", name),
            })
        }
        _ => json_response((404, serde_json::from_str(NOT_FOUND).unwrap_or_default())),
    }
}

fn list(kind: &str, rv: u64, items: Vec<Value>) -> Value {
    json!({"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": rv.to_string()}, "items": items})
}

fn with_kind(mut o: Value, kind: &str, api_version: &str) -> Value {
    o["kind"] = json!(kind);
    o["apiVersion"] = json!(api_version);
    o
}

fn list_pods(shared: &Shared, ns: Option<&str>, selector: &str) -> Answer {
    let g = shared.lock();
    let items: Vec<Value> = g
        .pods
        .iter()
        .filter(|((pns, _), _)| ns.is_none_or(|n| n == pns))
        .filter(|(_, p)| selects(selector, p.object["metadata"].get("labels")))
        .map(|(_, p)| {
            let mut o = p.object.clone();
            // List items carry no kind of their own.
            if let Some(m) = o.as_object_mut() {
                m.remove("kind");
                m.remove("apiVersion");
            }
            o
        })
        .collect();
    (200, list("PodList", g.rv, items))
}

/// A watch from `resourceVersion` on (all current pods as `ADDED` first
/// when it is absent or 0, as the API server does), then every change.
fn watch_pods(
    shared: &Arc<Shared>,
    ns: Option<String>,
    selector: String,
    param: &dyn Fn(&str) -> Option<String>,
) -> Response {
    let from = param("resourceVersion")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    let mut initial: Vec<Value> = Vec::new();
    let start = {
        let g = shared.lock();
        if from == 0 {
            initial = g
                .pods
                .values()
                .map(|p| json!({"type": "ADDED", "object": p.object}))
                .collect();
            g.rv
        } else {
            from
        }
    };
    let rx = shared.changed.subscribe();
    let matches = {
        let ns = ns.clone();
        move |o: &Value| {
            ns.as_deref()
                .is_none_or(|n| o["metadata"]["namespace"] == n)
                && selects(&selector, o["metadata"].get("labels"))
        }
    };
    let initial: Vec<Value> = initial
        .into_iter()
        .filter(|e| matches(&e["object"]))
        .collect();
    let head = futures::stream::iter(
        initial
            .into_iter()
            .map(|e| Ok::<_, std::io::Error>(Bytes::from(format!("{e}\n")))),
    );
    let shared = shared.clone();
    let tail = futures::stream::unfold((start, rx), move |(mut last, mut rx)| {
        let shared = shared.clone();
        let matches = matches.clone();
        async move {
            loop {
                let batch: Vec<String> = {
                    let g = shared.lock();
                    let out = g
                        .events
                        .iter()
                        .filter(|(rv, _, _)| *rv > last)
                        .filter(|(_, _, o)| matches(o))
                        .map(|(_, t, o)| json!({"type": t, "object": o}).to_string())
                        .collect();
                    last = g.events.last().map_or(last, |(rv, _, _)| (*rv).max(last));
                    out
                };
                if !batch.is_empty() {
                    let mut text = batch.join("\n");
                    text.push('\n');
                    return Some((Ok(Bytes::from(text)), (last, rx)));
                }
                rx.changed().await.ok()?;
            }
        }
    });
    respond(200, "application/json", Body::from_stream(head.chain(tail)))
}

impl Inner {
    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    /// Records a change of a pod: a new resource version and an event.
    fn emit(&mut self, kind: &'static str, ns: &str, name: &str) {
        let rv = self.next_rv();
        let Some(p) = self.pods.get_mut(&(ns.to_string(), name.to_string())) else {
            return;
        };
        p.object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let o = p.object.clone();
        self.events.push((rv, kind, o));
    }
}

impl Shared {
    /// Changes a pod and tells the watches; false when it is gone.
    fn update(&self, ns: &str, name: &str, f: impl FnOnce(&mut FakePod)) -> bool {
        let rv = {
            let mut g = self.lock();
            let Some(p) = g.pods.get_mut(&(ns.to_string(), name.to_string())) else {
                return false;
            };
            f(p);
            g.emit("MODIFIED", ns, name);
            g.rv
        };
        self.changed.send_replace(rv);
        true
    }

    fn remove(&self, ns: &str, name: &str) {
        let rv = {
            let mut g = self.lock();
            let key = (ns.to_string(), name.to_string());
            if !g.pods.contains_key(&key) {
                return;
            }
            g.emit("DELETED", ns, name);
            g.pods.remove(&key);
            g.rv
        };
        self.changed.send_replace(rv);
    }
}

fn apply(
    shared: &Shared,
    plural: &str,
    ns: &str,
    name: &str,
    kind: &str,
    api_version: &str,
    body: Option<Value>,
) -> Answer {
    let Some(mut o) = body.filter(Value::is_object) else {
        return status(
            400,
            "BadRequest",
            "the body of the request was in an unknown format",
            json!({}),
        );
    };
    let mut g = shared.lock();
    let rv = g.next_rv();
    let key = (plural.to_string(), ns.to_string(), name.to_string());
    let created = g
        .objects
        .get(&key)
        .and_then(|e| {
            e["metadata"]["creationTimestamp"]
                .as_str()
                .map(String::from)
        })
        .unwrap_or_else(|| time(Utc::now()));
    o["kind"] = json!(kind);
    o["apiVersion"] = json!(api_version);
    let m = &mut o["metadata"];
    m["name"] = json!(name);
    if !ns.is_empty() {
        m["namespace"] = json!(ns);
    }
    m["uid"] = json!(uid(&format!("{plural}/{ns}/{name}")));
    m["resourceVersion"] = json!(rv.to_string());
    m["creationTimestamp"] = json!(created);
    if plural == "namespaces" {
        m["labels"]["kubernetes.io/metadata.name"] = json!(name);
        o["spec"] = json!({"finalizers": ["kubernetes"]});
        o["status"] = json!({"phase": "Active"});
    }
    if plural == "secrets" {
        // The API server stores `stringData` as base64 `data`.
        use base64::Engine as _;
        if let Some(sd) = o
            .as_object_mut()
            .and_then(|m| m.remove("stringData"))
            .and_then(|v| v.as_object().cloned())
        {
            let data: serde_json::Map<String, Value> = sd
                .into_iter()
                .map(|(k, v)| {
                    let text = v.as_str().unwrap_or_default().to_string();
                    (
                        k,
                        json!(base64::engine::general_purpose::STANDARD.encode(text)),
                    )
                })
                .collect();
            o["data"] = Value::Object(data);
        }
    }
    g.objects.insert(key, o.clone());
    (200, o)
}

fn create_pod(shared: &Arc<Shared>, ns: &str, body: Option<Value>) -> Answer {
    let Some(mut pod) = body.filter(Value::is_object) else {
        return status(
            400,
            "BadRequest",
            "the body of the request was in an unknown format",
            json!({}),
        );
    };
    let Some(name) = pod["metadata"]["name"].as_str().map(String::from) else {
        return status(
            422,
            "Invalid",
            "Pod \"\" is invalid: metadata.name: Required value: name or generateName is required",
            json!({"kind": "Pod"}),
        );
    };
    let now = Utc::now();
    let rv = {
        let mut g = shared.lock();
        if !g
            .objects
            .contains_key(&("namespaces".into(), String::new(), ns.to_string()))
        {
            return not_found("namespaces", ns);
        }
        if g.pods.contains_key(&(ns.to_string(), name.clone())) {
            return status(
                409,
                "AlreadyExists",
                &format!("pods \"{name}\" already exists"),
                json!({"name": name, "kind": "pods"}),
            );
        }
        // What the API server defaults and sets.
        let m = &mut pod["metadata"];
        m["namespace"] = json!(ns);
        m["uid"] = json!(uid(&format!("pod/{ns}/{name}/{now}")));
        m["creationTimestamp"] = json!(time(now));
        let spec = &mut pod["spec"];
        for (k, v) in [
            ("dnsPolicy", json!("ClusterFirst")),
            ("schedulerName", json!("default-scheduler")),
            ("serviceAccountName", json!("default")),
            ("priority", json!(0)),
            ("preemptionPolicy", json!("PreemptLowerPriority")),
        ] {
            if spec.get(k).is_none() {
                spec[k] = v;
            }
        }
        if spec.get("terminationGracePeriodSeconds").is_none() {
            spec["terminationGracePeriodSeconds"] = json!(30);
        }
        if let Some(cs) = spec["containers"].as_array_mut() {
            for c in cs {
                c["terminationMessagePath"] = json!("/dev/termination-log");
                c["terminationMessagePolicy"] = json!("File");
                if c.get("imagePullPolicy").is_none() {
                    c["imagePullPolicy"] = json!("IfNotPresent");
                }
            }
        }
        // A hostname selector goes through the scheduler, which binds the
        // pod to that node when it exists.
        if spec["nodeName"].as_str().is_none() {
            if let Some(host) = spec["nodeSelector"]["kubernetes.io/hostname"].as_str() {
                let host = host.to_string();
                if g.nodes
                    .iter()
                    .any(|n| n["metadata"]["name"] == host.as_str())
                {
                    pod["spec"]["nodeName"] = json!(host);
                }
            }
        }
        pod["status"] = json!({"phase": "Pending", "qosClass": "Guaranteed"});
        pod["kind"] = json!("Pod");
        pod["apiVersion"] = json!("v1");
        let (exited, _) = tokio::sync::watch::channel(false);
        g.pods.insert(
            (ns.to_string(), name.clone()),
            FakePod {
                object: pod,
                log: Vec::new(),
                pgid: None,
                exited,
            },
        );
        g.emit("ADDED", ns, &name);
        g.rv
    };
    shared.changed.send_replace(rv);
    let created = shared
        .lock()
        .pods
        .get(&(ns.to_string(), name.clone()))
        .map(|p| p.object.clone())
        .unwrap_or_default();
    tokio::spawn(kubelet(shared.clone(), ns.to_string(), name));
    (201, created)
}

fn condition(t: &str, s: &str, at: &str) -> Value {
    json!({"type": t, "status": s, "lastProbeTime": null, "lastTransitionTime": at})
}

fn node_allocatable_gpus(g: &Inner, node: &str) -> Option<u64> {
    g.nodes
        .iter()
        .find(|n| n["metadata"]["name"] == node)
        .and_then(|n| n["status"]["allocatable"]["nvidia.com/gpu"].as_str())
        .map(|q| q.parse::<u64>().unwrap_or(0))
}

/// The fake kubelet of one pod: admission, `ContainerCreating`, start,
/// output, exit.
async fn kubelet(shared: Arc<Shared>, ns: String, name: String) {
    let timing = shared.lock().timing;
    tokio::time::sleep(timing.admit).await;
    let key = (ns.clone(), name.clone());
    // Admission (bound to an existing node, its GPUs free) and the
    // container's creation, in one step so two pods cannot both take the
    // last GPU.
    let admitted = {
        let mut g = shared.lock();
        let Some(p) = g.pods.get(&key) else { return };
        if p.object["metadata"]["deletionTimestamp"].is_string() {
            return;
        }
        let Some(node) = p.object["spec"]["nodeName"].as_str().map(String::from) else {
            // Unschedulable: stays Pending, as with a real scheduler.
            return;
        };
        let Some(allocatable) = node_allocatable_gpus(&g, &node) else {
            return;
        };
        let want = gpu_limit(&p.object);
        let used: u64 = g
            .pods
            .iter()
            .filter(|(k, o)| {
                **k != key
                    && o.object["spec"]["nodeName"] == node.as_str()
                    && !pod_ended(&o.object)
                    && o.object["status"]["startTime"].is_string()
            })
            .map(|(_, o)| gpu_limit(&o.object))
            .sum();
        let now = time(Utc::now());
        let Some(p) = g.pods.get_mut(&key) else {
            return;
        };
        let admitted = !(want > 0 && used + want > allocatable);
        if admitted {
            let img = p.object["spec"]["containers"][0]["image"].clone();
            p.object["status"] = json!({
                "phase": "Pending",
                "conditions": [
                    // The sandbox is up; the image pull begins.
                    condition("PodReadyToStartContainers", "True", &now),
                    condition("Initialized", "True", &now),
                    {"type": "Ready", "status": "False", "lastProbeTime": null, "lastTransitionTime": now,
                     "reason": "ContainersNotReady", "message": "containers with unready status: [main]"},
                    {"type": "ContainersReady", "status": "False", "lastProbeTime": null, "lastTransitionTime": now,
                     "reason": "ContainersNotReady", "message": "containers with unready status: [main]"},
                    condition("PodScheduled", "True", &now),
                ],
                "hostIP": "10.0.0.1",
                "startTime": now,
                "containerStatuses": [{"name": "main", "state": {"waiting": {"reason": "ContainerCreating"}},
                    "lastState": {}, "ready": false, "restartCount": 0, "image": img, "imageID": "", "started": false}],
                "qosClass": "Guaranteed",
            });
        } else {
            p.object["status"] = json!({
                "phase": "Failed",
                "reason": "UnexpectedAdmissionError",
                "message": format!(
                    "Allocate failed due to requested number of devices unavailable for nvidia.com/gpu. Requested: {want}, Available: {}, which is unexpected",
                    allocatable.saturating_sub(used)
                ),
                "startTime": now,
            });
        }
        g.emit("MODIFIED", &ns, &name);
        shared.changed.send_replace(g.rv);
        admitted
    };
    if !admitted {
        return;
    }
    let image = |p: &FakePod| p.object["spec"]["containers"][0]["image"].clone();
    tokio::time::sleep(timing.pull).await;
    // Start the container's command.
    let (argv, env, deleting) = {
        let g = shared.lock();
        let Some(p) = g.pods.get(&key) else { return };
        let c = &p.object["spec"]["containers"][0];
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        };
        let mut argv = strings(&c["command"]);
        argv.extend(strings(&c["args"]));
        let env: Vec<(String, String)> = c["env"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| Some((e["name"].as_str()?.into(), e["value"].as_str()?.into())))
            .collect();
        (
            argv,
            env,
            p.object["metadata"]["deletionTimestamp"].is_string(),
        )
    };
    if deleting {
        return;
    }
    let dir = shared.work_dir.join(&ns).join(&name);
    let _ = std::fs::create_dir_all(&dir);
    let mut child = None;
    let mut start_error = None;
    if let Some((program, args)) = argv.split_first() {
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(env)
            .env("HOSTNAME", &name)
            .current_dir(&dir)
            .process_group(0)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        match cmd.spawn() {
            Ok(c) => child = Some(c),
            Err(e) => start_error = Some(e.to_string()),
        }
    }
    let started = Utc::now();
    let container_id = format!(
        "containerd://{}",
        uid(&format!("{ns}/{name}/{started}")).replace('-', "")
    );
    let node_ip = "10.0.0.1";
    let pod_ip = format!("10.244.0.{}", (started.timestamp_subsec_micros() % 250) + 2);
    if let Some(message) = start_error {
        let at = time(started);
        shared.update(&ns, &name, |p| {
            p.object["status"]["containerStatuses"][0]["state"] = json!({"waiting": {
                "reason": "RunContainerError", "message": message}});
            p.object["status"]["conditions"][0] =
                condition("PodReadyToStartContainers", "True", &at);
        });
        return;
    }
    let pgid = child
        .as_ref()
        .and_then(|c| c.id())
        .and_then(|p| i32::try_from(p).ok());
    let at = time(started);
    let alive = shared.update(&ns, &name, |p| {
        p.pgid = pgid;
        let img = image(p);
        let s = &mut p.object["status"];
        let sandbox = s["startTime"].as_str().unwrap_or(&at).to_string();
        s["phase"] = json!("Running");
        s["conditions"] = json!([
            condition("PodReadyToStartContainers", "True", &sandbox),
            condition("Initialized", "True", &at),
            condition("Ready", "True", &at),
            condition("ContainersReady", "True", &at),
            condition("PodScheduled", "True", &at),
        ]);
        s["hostIP"] = json!(node_ip);
        s["podIP"] = json!(pod_ip);
        s["podIPs"] = json!([{"ip": pod_ip}]);
        s["containerStatuses"] = json!([{"name": "main", "state": {"running": {"startedAt": at}},
            "lastState": {}, "ready": true, "restartCount": 0, "image": img,
            "imageID": format!("{}@sha256:{}", img.as_str().unwrap_or_default(), "0".repeat(64)),
            "started": true, "containerID": container_id}]);
    });
    if !alive {
        if let Some(pgid) = pgid {
            signal_group(pgid, "KILL");
        }
        return;
    }
    let Some(mut child) = child else {
        // The image's own entrypoint: runs until deleted.
        return;
    };
    let mut readers = Vec::new();
    if let Some(out) = child.stdout.take() {
        readers.push(tokio::spawn(read_lines(
            shared.clone(),
            key.clone(),
            BufReader::new(out),
        )));
    }
    if let Some(err) = child.stderr.take() {
        readers.push(tokio::spawn(read_lines(
            shared.clone(),
            key.clone(),
            BufReader::new(err),
        )));
    }
    let exit = child.wait().await;
    for r in readers {
        let _ = r.await;
    }
    let code = match exit {
        Ok(s) => {
            use std::os::unix::process::ExitStatusExt;
            s.code()
                .or_else(|| s.signal().map(|sig| 128 + sig))
                .unwrap_or(1)
        }
        Err(_) => 1,
    };
    let finished = time(Utc::now());
    shared.update(&ns, &name, |p| {
        p.pgid = None;
        let img = image(p);
        let reason = if code == 0 { "Completed" } else { "Error" };
        let s = &mut p.object["status"];
        s["phase"] = json!(if code == 0 { "Succeeded" } else { "Failed" });
        let ended = if code == 0 { "PodCompleted" } else { "PodFailed" };
        s["conditions"] = json!([
            condition("PodReadyToStartContainers", "False", &finished),
            condition("Initialized", "True", &at),
            {"type": "Ready", "status": "False", "lastProbeTime": null, "lastTransitionTime": finished, "reason": ended},
            {"type": "ContainersReady", "status": "False", "lastProbeTime": null, "lastTransitionTime": finished, "reason": ended},
            condition("PodScheduled", "True", &at),
        ]);
        s["containerStatuses"] = json!([{"name": "main", "state": {"terminated": {
                "exitCode": code, "reason": reason, "startedAt": at, "finishedAt": finished,
                "containerID": container_id}},
            "lastState": {}, "ready": false, "restartCount": 0, "image": img,
            "imageID": format!("{}@sha256:{}", img.as_str().unwrap_or_default(), "0".repeat(64)),
            "started": false, "containerID": container_id}]);
        let _ = p.exited.send_replace(true);
    });
}

async fn read_lines<R: tokio::io::AsyncRead + Unpin>(
    shared: Arc<Shared>,
    key: (String, String),
    reader: BufReader<R>,
) {
    let mut lines = reader.lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let mut g = shared.lock();
        if let Some(p) = g.pods.get_mut(&key) {
            p.log.push((Utc::now(), line));
        }
    }
}

fn delete_pod(shared: &Arc<Shared>, ns: &str, name: &str, grace: Option<i64>) -> Answer {
    let key = (ns.to_string(), name.to_string());
    let (grace, pgid, running, exited) = {
        let g = shared.lock();
        let Some(p) = g.pods.get(&key) else {
            return not_found("pods", name);
        };
        if p.object["metadata"]["deletionTimestamp"].is_string() {
            // Deleting already: the same answer again.
            return (200, p.object.clone());
        }
        let grace = grace
            .or_else(|| p.object["spec"]["terminationGracePeriodSeconds"].as_i64())
            .unwrap_or(30)
            .max(0);
        let running = p.object["status"]["phase"] == "Running";
        (grace, p.pgid, running, p.exited.subscribe())
    };
    let now = Utc::now();
    if grace == 0 || !running {
        // Nothing runs (or no grace): gone at once.
        if let Some(pgid) = pgid {
            signal_group(pgid, "KILL");
        }
        shared.update(ns, name, |p| {
            p.object["metadata"]["deletionTimestamp"] = json!(time(now));
            p.object["metadata"]["deletionGracePeriodSeconds"] = json!(0);
        });
        let last = shared
            .lock()
            .pods
            .get(&key)
            .map(|p| p.object.clone())
            .unwrap_or_default();
        shared.remove(ns, name);
        return (200, last);
    }
    let deadline = now + chrono::Duration::seconds(grace);
    shared.update(ns, name, |p| {
        p.object["metadata"]["deletionTimestamp"] = json!(time(deadline));
        p.object["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
    });
    let answer = shared
        .lock()
        .pods
        .get(&key)
        .map(|p| p.object.clone())
        .unwrap_or_default();
    let shared = shared.clone();
    let (ns, name) = (ns.to_string(), name.to_string());
    tokio::spawn(async move {
        let mut exited = exited;
        match pgid {
            Some(pgid) => {
                signal_group(pgid, "TERM");
                let grace = Duration::from_secs(u64::try_from(grace).unwrap_or(0));
                if tokio::time::timeout(grace, exited.wait_for(|e| *e))
                    .await
                    .is_err()
                {
                    signal_group(pgid, "KILL");
                    let _ = tokio::time::timeout(Duration::from_secs(10), exited.wait_for(|e| *e))
                        .await;
                }
            }
            None => {
                // A container without a command ends on SIGTERM at once.
                let finished = time(Utc::now());
                shared.update(&ns, &name, |p| {
                    let cs = &mut p.object["status"]["containerStatuses"][0];
                    let started = cs["state"]["running"]["startedAt"].clone();
                    let id = cs["containerID"].clone();
                    cs["state"] = json!({"terminated": {"exitCode": 143, "reason": "Error",
                        "startedAt": started, "finishedAt": finished, "containerID": id}});
                    cs["ready"] = json!(false);
                    cs["started"] = json!(false);
                    p.object["status"]["phase"] = json!("Failed");
                });
            }
        }
        shared.remove(&ns, &name);
    });
    (200, answer)
}

fn pod_log(shared: &Shared, ns: &str, name: &str, since: Option<String>) -> Response {
    let g = shared.lock();
    let Some(p) = g.pods.get(&(ns.to_string(), name.to_string())) else {
        return json_response(not_found("pods", name));
    };
    let state = &p.object["status"]["containerStatuses"][0]["state"];
    if state.get("running").is_none() && state.get("terminated").is_none() {
        let reason = state["waiting"]["reason"]
            .as_str()
            .unwrap_or("PodInitializing");
        return json_response(status(
            400,
            "BadRequest",
            &format!("container \"main\" in pod \"{name}\" is waiting to start: {reason}"),
            json!({}),
        ));
    }
    let since = since
        .and_then(|s| DateTime::parse_from_rfc3339(&s).ok())
        .map(|t| t.with_timezone(&Utc));
    let mut text = String::new();
    for (at, line) in &p.log {
        // sinceTime has second precision.
        if since.is_some_and(|s| at.timestamp() < s.timestamp()) {
            continue;
        }
        text.push_str(&at.to_rfc3339_opts(SecondsFormat::Nanos, true));
        text.push(' ');
        text.push_str(line);
        text.push('\n');
    }
    respond(200, "text/plain", Body::from(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_match_as_the_api_server_does() {
        let labels = json!({"app.kubernetes.io/managed-by": "flotilla", "tier": "a"});
        assert!(selects(
            "app.kubernetes.io/managed-by=flotilla",
            Some(&labels)
        ));
        assert!(selects(
            "tier==a,app.kubernetes.io/managed-by",
            Some(&labels)
        ));
        assert!(!selects("tier!=a", Some(&labels)));
        assert!(selects("!missing", Some(&labels)));
        assert!(!selects("tier=b", Some(&labels)));
        assert!(selects("", None));
    }

    #[test]
    fn a_fake_node_reads_back_as_the_inventory_expects() {
        let n = FakeNode::gpu("k1", "NVIDIA-A100-SXM4-80GB", 81920, 2)
            .label("flotilla.dev/pool", "kube");
        let node: k8s_openapi::api::core::v1::Node =
            serde_json::from_value(n.object(7, Utc::now())).unwrap();
        let r = super::super::inventory::register(
            &node,
            &super::super::KubeConfig::default(),
            &flotilla_core::catalog::Catalog::default(),
        )
        .unwrap();
        assert_eq!(r.name, "k1");
        assert_eq!(r.pool.as_deref(), Some("kube"));
        assert_eq!(r.gpus.len(), 2);
        assert_eq!(r.gpus[0].model, "A100-80GB");
    }
}
