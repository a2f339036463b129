//! The control plane's outbound calls for tenants, as deployed: the real
//! `flotilla server` binary, real HTTP, real sockets.
//!
//! A queue trigger (RabbitMQ and NATS), a budget webhook and a registry
//! login aimed at the host itself (127.0.0.1), the private network
//! (10.0.0.1) or the cloud metadata address (169.254.169.254) are refused
//! with 422 naming the field, on create and on update, before any
//! connection: listeners the test owns at 127.0.0.1 and at
//! 169.254.169.254 (on a dummy interface of this test, so that a leak
//! stays on this machine) are reachable, and see no connection from the
//! server. 10.0.0.1 is never contacted by anyone. What the operator
//! allows (`--allow-egress 127.0.0.1:PORT`) is accepted, and a trigger's
//! broker that cannot be read says `broker unreachable` whether its port
//! is closed, answers garbage or never answers.

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flotilla_testkit::process::{free_port, http, wait_until, Home};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
const LONG: Duration = Duration::from_secs(120);

/// A listener counting the connections it accepts; `garbage` answers each
/// with bytes no broker sends, otherwise it holds them silently.
struct Counting {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
}

impl Counting {
    fn start(at: &str, garbage: bool) -> Self {
        let l = TcpListener::bind(at).expect("bind the listener");
        let addr = l.local_addr().expect("address");
        let accepted = Arc::new(AtomicUsize::new(0));
        let n = accepted.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for s in l.incoming() {
                let Ok(mut s) = s else { continue };
                n.fetch_add(1, Ordering::SeqCst);
                if garbage {
                    let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\nnot a broker\n");
                } else {
                    held.push(s);
                }
            }
        });
        Self { addr, accepted }
    }

    fn count(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Connects as a client would: the precondition that the target is
    /// there and reachable.
    fn reachable(&self) -> bool {
        let before = self.count();
        let ok = std::net::TcpStream::connect_timeout(&self.addr, Duration::from_secs(5)).is_ok();
        wait_until("the listener counts the probe", LONG, || {
            self.count() > before
        });
        ok
    }
}

/// A link of this test holding 169.254.169.254, removed when dropped:
/// the metadata address answered by this machine, not the wire.
struct Metadata {
    link: String,
}

impl Metadata {
    fn add() -> Option<Self> {
        let link = format!("flmd{}", std::process::id() % 100_000);
        let ip = |args: &[&str]| {
            std::process::Command::new("ip")
                .args(args)
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        let _ = ip(&["link", "del", &link]);
        // A dummy link, or a bridge without ports where the kernel has no
        // dummy driver: either way a local address and nothing on a wire.
        if !ip(&["link", "add", &link, "type", "dummy"])
            && !ip(&["link", "add", &link, "type", "bridge"])
        {
            return None;
        }
        let me = Self { link };
        (ip(&["addr", "add", "169.254.169.254/32", "dev", &me.link])
            && ip(&["link", "set", &me.link, "up"]))
        .then_some(me)
    }
}

impl Drop for Metadata {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.link])
            .status();
    }
}

fn call(home: &Home, key: &str, method: &str, path: &str, body: Value) -> (u16, Value) {
    http(
        method,
        &format!("{}{path}", home.url()),
        Some(key),
        Some(&body.to_string()),
    )
    .expect("the server answers")
}

fn refused(what: &str, (status, body): (u16, Value), field: &str) {
    assert_eq!(status, 422, "{what}: {body}");
    assert_eq!(body["error"]["details"]["field"], field, "{what}: {body}");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("address"), "{what}: {msg}");
    assert!(msg.contains("--allow-egress"), "{what}: {msg}");
}

#[test]
fn inward_destinations_are_refused_naming_the_field_and_allowed_ones_work() {
    let Some(metadata) = Metadata::add() else {
        eprintln!("skipped: cannot add a dummy interface (needs root and iproute2)");
        return;
    };
    let loopback = Counting::start("127.0.0.1:0", false);
    let meta = Counting::start("169.254.169.254:0", false);
    assert!(
        loopback.reachable() && meta.reachable(),
        "the targets exist"
    );
    // Allowed by the operator: a port answering garbage, a closed port,
    // a port that never answers.
    let garbage = Counting::start("127.0.0.1:0", true);
    let silent = Counting::start("127.0.0.1:0", false);
    let closed = free_port();

    let mut home = Home::new(BIN);
    for p in [garbage.addr.port(), silent.addr.port(), closed] {
        home.server_args
            .extend(["--allow-egress".to_string(), format!("127.0.0.1:{p}")]);
    }
    let _server = home.server();
    let (_, key) = home.tenant("acme");
    let before = (loopback.count(), meta.count());

    let inward = [
        loopback.addr.to_string(),
        "10.0.0.1:5672".to_string(),
        meta.addr.to_string(),
    ];
    for hostport in &inward {
        // Queue triggers, both kinds, on create.
        let rabbit = json!({"kind": "rabbitmq", "url": format!("amqp://guest:guest@{hostport}/%2f"), "queue": "q"});
        let nats = json!({"kind": "nats", "url": format!("nats://{hostport}"), "stream": "S", "consumer": "C"});
        for t in [&rabbit, &nats] {
            let body =
                json!({"name": "jobs", "command": ["x"], "max_replicas": 2, "queue_triggers": [t]});
            refused(
                &format!("trigger {t}"),
                call(&home, &key, "POST", "/v1/endpoints", body),
                "queue_triggers[0].url",
            );
        }
        // A budget webhook.
        let body = json!({"limit": "10", "webhook_url": format!("http://{hostport}/hook"),
                          "webhook_secret": "whsec-0123456789abcdef"});
        refused(
            &format!("webhook at {hostport}"),
            call(&home, &key, "PUT", "/v1/budget", body),
            "webhook_url",
        );
        // A registry login.
        let body = json!({"registry": hostport, "username": "u", "secret": "s"});
        refused(
            &format!("registry {hostport}"),
            call(&home, &key, "POST", "/v1/registry-credentials", body),
            "registry",
        );
    }
    // On update too, at the second trigger's index.
    let (st, ep) = call(
        &home,
        &key,
        "POST",
        "/v1/endpoints",
        json!({"name": "later", "command": ["x"], "max_replicas": 2}),
    );
    assert_eq!(st, 201, "{ep}");
    let id = ep["id"].as_str().expect("id").to_string();
    let ok =
        json!({"kind": "rabbitmq", "url": format!("amqp://{}/%2f", garbage.addr), "queue": "q"});
    let bad = json!({"kind": "rabbitmq", "url": format!("amqp://{}/%2f", meta.addr), "queue": "q"});
    refused(
        "update",
        call(
            &home,
            &key,
            "PATCH",
            &format!("/v1/endpoints/{id}"),
            json!({"queue_triggers": [ok, bad]}),
        ),
        "queue_triggers[1].url",
    );
    // A name that resolves to loopback is judged by its address.
    refused(
        "localhost",
        call(
            &home,
            &key,
            "PUT",
            "/v1/budget",
            json!({"limit": "10", "webhook_url": format!("http://localhost:{}/hook", loopback.addr.port()),
                   "webhook_secret": "whsec-0123456789abcdef"}),
        ),
        "webhook_url",
    );

    // Allowed destinations are accepted, for all three.
    let url_of = |a: SocketAddr| format!("amqp://guest:guest@{a}/%2f");
    let closed_addr: SocketAddr = ([127, 0, 0, 1], closed).into();
    let (st, ep) = call(
        &home,
        &key,
        "POST",
        "/v1/endpoints",
        json!({"name": "probe", "command": ["x"], "max_replicas": 2, "queue_triggers": [
            {"kind": "rabbitmq", "url": url_of(garbage.addr), "queue": "a"},
            {"kind": "rabbitmq", "url": url_of(closed_addr), "queue": "b"},
            {"kind": "nats", "url": format!("nats://{}", silent.addr), "stream": "S", "consumer": "C"},
        ]}),
    );
    assert_eq!(st, 201, "{ep}");
    let (st, b) = call(
        &home,
        &key,
        "PUT",
        "/v1/budget",
        json!({"limit": "10", "webhook_url": format!("http://{}/hook", garbage.addr),
               "webhook_secret": "whsec-0123456789abcdef"}),
    );
    assert_eq!(st, 200, "{b}");
    let (st, b) = call(
        &home,
        &key,
        "POST",
        "/v1/registry-credentials",
        json!({"registry": garbage.addr.to_string(), "username": "u", "secret": "s"}),
    );
    assert_eq!(st, 201, "{b}");

    // The server reads the allowed brokers: garbage, refused and silent
    // all read `broker unreachable`, nothing more.
    let name = ep["name"].as_str().unwrap_or("probe").to_string();
    let mut last = Value::Null;
    wait_until("every trigger shows its error", LONG, || {
        last = home.get(
            &key,
            &format!("/v1/endpoints/{}", ep["id"].as_str().unwrap_or("")),
        );
        last["triggers"]
            .as_array()
            .is_some_and(|t| t.len() == 3 && t.iter().all(|t| t["error"].is_string()))
    });
    for t in last["triggers"].as_array().into_iter().flatten() {
        assert_eq!(t["error"], "broker unreachable", "{name}: {last}");
    }
    assert!(garbage.count() >= 1, "the garbage port was connected to");
    assert!(silent.count() >= 1, "the silent port was connected to");

    // Nothing ever connected to the refused targets.
    assert_eq!(
        (loopback.count(), meta.count()),
        before,
        "the server connected to a refused destination"
    );
    drop(metadata);
}
