//! Crash safety of the usage ledger (issue 5's must-show): the real
//! `flotilla server` is killed with SIGKILL while 100,000 usage events
//! stream in, restarted on the same database, and every event is sent
//! again. The ledger must then hold each event exactly once, and its GPU
//! time must be exactly what was generated.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
const EVENTS: usize = 100_000;
const BATCH: usize = 5_000;

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Env {
    dir: tempfile::TempDir,
    port: u16,
}

impl Env {
    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn server(&self) -> Proc {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("server.log"))
            .unwrap();
        let child = Command::new(BIN)
            .env("FLOTILLA_CONFIG_DIR", self.dir.path().join("config"))
            .env("FLOTILLA_DATA_DIR", self.data())
            .env_remove("FLOTILLA_API_KEY")
            .env_remove("FLOTILLA_SERVER")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .args([
                "server",
                "--bind",
                &format!("127.0.0.1:{}", self.port),
                "--data-dir",
            ])
            .arg(self.data())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let start = Instant::now();
        while http("GET", &format!("{}/healthz", self.url()), None, None)
            .map(|(s, _)| s != 200)
            .unwrap_or(true)
        {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the server never answered"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Proc(child)
    }

    fn operator_key(&self) -> String {
        let creds: Value = serde_json::from_slice(
            &std::fs::read(self.dir.path().join("config/credentials.json")).unwrap(),
        )
        .unwrap();
        creds["api_key"].as_str().unwrap().to_string()
    }
}

/// Minimal blocking HTTP/1.1 over std, independent of the code under test.
fn http(
    method: &str,
    url: &str,
    key: Option<&str>,
    body: Option<&str>,
) -> std::io::Result<(u16, Value)> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_at(rest.find('/').unwrap());
    let mut s = std::net::TcpStream::connect(host)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let body = body.unwrap_or("");
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    s.write_all(body.as_bytes())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let status: u16 = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    if status == 0 {
        return Err(std::io::Error::other("no answer"));
    }
    let (_, payload) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    Ok((
        status,
        serde_json::from_str(payload).unwrap_or(Value::String(payload.into())),
    ))
}

/// The bodies of every batch: one-minute 1×H100 events ending an hour ago.
fn batches(tenant: &str) -> Vec<String> {
    let end = chrono::Utc::now().timestamp() - 3600;
    let (start, end) = (
        chrono::DateTime::from_timestamp(end - 60, 0)
            .unwrap()
            .to_rfc3339(),
        chrono::DateTime::from_timestamp(end, 0)
            .unwrap()
            .to_rfc3339(),
    );
    (0..EVENTS)
        .collect::<Vec<_>>()
        .chunks(BATCH)
        .map(|ids| {
            let events: Vec<Value> = ids
                .iter()
                .map(|i| {
                    json!({
                        "key": {"tenant": tenant, "source": "agent:crash", "id": format!("e{i}")},
                        "subject": {"kind": "instance", "id": format!("inst_{}", i % 100)},
                        "meter": {"meter": "gpu_seconds", "model": "H100", "share": {"kind": "whole"}},
                        "billing_class": "on_demand",
                        "start": start, "end": end, "amount": "1"
                    })
                })
                .collect();
            json!({ "events": events }).to_string()
        })
        .collect()
}

fn totals(env: &Env) -> (i64, i128) {
    let url = format!(
        "sqlite://{}?mode=rw",
        env.data().join("flotilla.db").display()
    );
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store = flotilla_server::Store::connect(&url).await.unwrap();
        let t = store.usage_totals().await.unwrap();
        store.close().await;
        t
    })
}

#[test]
fn kill_9_mid_stream_then_resend_everything_is_exactly_once() {
    let env = Env {
        dir: tempfile::tempdir().unwrap(),
        port: std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port(),
    };
    let server = env.server();
    let op = env.operator_key();
    let (status, t) = http(
        "POST",
        &format!("{}/v1/tenants", env.url()),
        Some(&op),
        Some(r#"{"name":"acme"}"#),
    )
    .unwrap();
    assert_eq!(status, 201, "{t}");
    let tenant = t["id"].as_str().unwrap().to_string();
    let bodies = Arc::new(batches(&tenant));

    // Stream from a thread; kill -9 the server once a few batches landed.
    let acked = Arc::new(AtomicUsize::new(0));
    let sender = {
        let (bodies, acked, url, op) = (bodies.clone(), acked.clone(), env.url(), op.clone());
        std::thread::spawn(move || {
            let mut accepted = 0u64;
            for b in bodies.iter() {
                match http(
                    "POST",
                    &format!("{url}/v1/usage/events"),
                    Some(&op),
                    Some(b),
                ) {
                    Ok((200, r)) => {
                        accepted += r["accepted"].as_u64().unwrap();
                        acked.fetch_add(1, Ordering::SeqCst);
                    }
                    // The server died under this request.
                    _ => break,
                }
            }
            accepted
        })
    };
    let start = Instant::now();
    while acked.load(Ordering::SeqCst) < 3 {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "no batch was acknowledged"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(server); // SIGKILL, mid-stream
    let first_accepted = sender.join().unwrap();
    let acked_batches = acked.load(Ordering::SeqCst);
    assert!(
        acked_batches < EVENTS / BATCH,
        "the kill came after the stream ended"
    );

    // Everything acknowledged survived; nothing is there twice.
    let (stored, _) = totals(&env);
    assert!(
        stored as u64 >= first_accepted,
        "acknowledged events were lost"
    );
    assert_eq!(stored as usize % BATCH, 0, "a batch was half committed");

    // Restart on the same database and re-send every event.
    let _server = env.server();
    let (mut accepted, mut duplicates) = (0u64, 0u64);
    for b in bodies.iter() {
        let (status, r) = http(
            "POST",
            &format!("{}/v1/usage/events", env.url()),
            Some(&op),
            Some(b),
        )
        .unwrap();
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["rejected"], json!([]));
        accepted += r["accepted"].as_u64().unwrap();
        duplicates += r["duplicates"].as_u64().unwrap();
    }
    assert_eq!(accepted + duplicates, EVENTS as u64);
    assert_eq!(
        duplicates, stored as u64,
        "every stored event was recognised"
    );

    let (count, unit_ms) = totals(&env);
    assert_eq!(count, EVENTS as i64);
    // 100,000 events × 60 s × 1 whole GPU (7000 share units) in unit-ms.
    assert_eq!(unit_ms, EVENTS as i128 * 60_000 * 7_000);
}
