//! A fake Kubernetes API server on a real local HTTP port: it answers
//! kube-rs's requests with the recorded bodies under
//! `tests/fixtures/kube/` and records every request, so a test checks
//! what the executor sent (paths, query parameters, bodies) as well as
//! what it made of the answers. Watch requests (`watch=true`) get
//! newline-delimited JSON event streams, chunked as the API server sends
//! them, that a test can end, keep open, or feed event by event.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::Response;
use futures::channel::mpsc;
use futures::StreamExt;

/// A fixture's text.
pub fn fixture(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/kube")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

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
    pub body: Option<serde_json::Value>,
}

impl Recorded {
    /// Whether the query has `key=value` (values compared URL-decoded).
    pub fn has_param(&self, key: &str, value: &str) -> bool {
        self.params().iter().any(|(k, v)| k == key && v == value)
    }

    /// The decoded query parameters.
    pub fn params(&self) -> Vec<(String, String)> {
        self.query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                (decode(k), decode(v))
            })
            .collect()
    }

    /// Whether this is a watch.
    pub fn is_watch(&self) -> bool {
        self.has_param("watch", "true") || self.has_param("watch", "1")
    }
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

/// How a watch connection goes on after its recorded events.
pub enum Then {
    /// The server closes it (as at `timeoutSeconds`).
    End,
    /// It stays open with nothing more to say.
    Hang,
    /// The test sends more lines through the channel; closing it ends
    /// the watch.
    Feed(mpsc::UnboundedReceiver<String>),
}

/// One answer.
pub enum Reply {
    /// A status code and a JSON body (a fixture).
    Json(u16, String),
    /// A status code and a plain-text body (pod logs).
    Text(u16, String),
    /// A watch: these NDJSON lines, then `Then`.
    Watch(String, Then),
}

type Key = (String, String, bool);

#[derive(Default)]
struct Inner {
    routes: HashMap<Key, VecDeque<Reply>>,
    requests: Vec<Recorded>,
}

/// The fake API server.
pub struct FakeKube {
    /// Its base URL.
    pub url: String,
    inner: Arc<Mutex<Inner>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        self.task.abort();
    }
}

const NOT_FOUND: &str = r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"the server could not find the requested resource","reason":"NotFound","details":{},"code":404}"#;

async fn handle(State(inner): State<Arc<Mutex<Inner>>>, req: Request<Body>) -> Response {
    let method = req.method().as_str().to_string();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let bytes: Bytes = axum::body::to_bytes(req.into_body(), 16 << 20)
        .await
        .unwrap_or_default();
    let body = serde_json::from_slice(&bytes).ok();
    let rec = Recorded {
        method: method.clone(),
        path: path.clone(),
        query,
        body,
    };
    let watch = rec.is_watch();
    let reply = {
        let mut g = inner.lock().unwrap();
        g.requests.push(rec);
        match g.routes.get_mut(&(method, path, watch)) {
            // The last answer of a route repeats; a watch answer cannot
            // (its feed is consumed), so a watch with none left hangs.
            Some(q) if q.len() > 1 => q.pop_front(),
            Some(q) if watch => q.pop_front(),
            Some(q) => q.front().map(|r| match r {
                Reply::Json(s, b) => Reply::Json(*s, b.clone()),
                Reply::Text(s, b) => Reply::Text(*s, b.clone()),
                Reply::Watch(..) => Reply::Watch(String::new(), Then::Hang),
            }),
            None if watch => Some(Reply::Watch(String::new(), Then::Hang)),
            None => None,
        }
    };
    let reply = reply.unwrap_or_else(|| Reply::Json(404, NOT_FOUND.into()));
    match reply {
        Reply::Json(status, body) => Response::builder()
            .status(StatusCode::from_u16(status).unwrap())
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap(),
        Reply::Text(status, body) => Response::builder()
            .status(StatusCode::from_u16(status).unwrap())
            .header("content-type", "text/plain")
            .body(Body::from(body))
            .unwrap(),
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
            Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "application/json")
                .body(Body::from_stream(stream))
                .unwrap()
        }
    }
}

impl FakeKube {
    /// Starts the fake on a free local port.
    pub async fn start() -> Self {
        let inner = Arc::new(Mutex::new(Inner::default()));
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(inner.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { url, inner, task }
    }

    /// A kube client for it, set up as the executor sets up its own.
    pub fn client(&self) -> kube::Client {
        flotilla_backends::kube::client(kube::Config::new(self.url.parse().unwrap())).unwrap()
    }

    /// Queues an answer to `method path` (not a watch).
    pub fn on(&self, method: &str, path: &str, reply: Reply) {
        let watch = matches!(reply, Reply::Watch(..));
        self.inner
            .lock()
            .unwrap()
            .routes
            .entry((method.into(), path.into(), watch))
            .or_default()
            .push_back(reply);
    }

    /// Queues an answer to a watch on `path`.
    pub fn on_watch(&self, path: &str, lines: String, then: Then) {
        self.on("GET", path, Reply::Watch(lines, then));
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.inner.lock().unwrap().requests.clone()
    }

    /// The requests with this method and path.
    pub fn requests_to(&self, method: &str, path: &str) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.method == method && r.path == path)
            .collect()
    }
}

/// Polls `check` until it gives `Some`, for up to a generous deadline (the
/// machine may be loaded); panics with `what` when it never does.
pub async fn wait_for<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
