//! Serverless endpoints end to end, as a user runs them: the real
//! `flotilla` binary as server, agent (simulated GPUs), gateway
//! (`flotilla gateway`) and CLI; the replica is `flotilla emulator` with a
//! weight-load delay. An endpoint at zero replicas takes 200 concurrent
//! requests through the gateway: all succeed, replicas scale up, then back
//! to zero after the idle window, and 200 requests are metered. Another
//! tenant's key gets 404, a rate limit 429, and a budget's hard cap, once
//! the replicas' GPU time has reached it, 402.

use std::sync::Arc;
use std::time::Duration;

use flotilla_testkit::process::{free_port, http, wait_until, Home};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
/// Generous: a loaded two-core CI machine.
const LONG: Duration = Duration::from_secs(120);

fn tenant(home: &Home, op: &str, name: &str) -> String {
    let t = home.cli_json(Some(op), &["tenants", "create", name]);
    let id = t["id"].as_str().unwrap().to_string();
    let k = home.cli_json(
        Some(op),
        &["keys", "create", "--role", "tenant_admin", "--tenant", &id],
    );
    k["secret"].as_str().unwrap().to_string()
}

fn chat(gw: &str, key: &str, model: &str) -> (u16, Value) {
    let body = json!({"model": model, "messages": [{"role": "user", "content": "hello there"}],
                      "max_tokens": 4})
    .to_string();
    http(
        "POST",
        &format!("{gw}/v1/chat/completions"),
        Some(key),
        Some(&body),
    )
    .unwrap_or((0, Value::Null))
}

fn endpoint(home: &Home, key: &str, name: &str) -> Value {
    home.cli_json(Some(key), &["endpoints", "show", name])
}

fn requests_metered(home: &Home, key: &str) -> u64 {
    let from = (chrono::Utc::now() - chrono::Duration::hours(1)).to_rfc3339();
    let to = (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339();
    let mut n = 0;
    let mut cursor: Option<String> = None;
    loop {
        let mut path = format!(
            "/v1/usage?limit=1000&from={}&to={}",
            from.replace('+', "%2B"),
            to.replace('+', "%2B")
        );
        if let Some(c) = &cursor {
            path.push_str(&format!("&cursor={c}"));
        }
        let page = home.get(key, &path);
        for e in page["items"].as_array().unwrap() {
            if e["meter"]["meter"] == "requests" || e["meter"] == "requests" {
                n += e["amount"]
                    .as_str()
                    .and_then(|a| a.parse::<f64>().ok())
                    .or_else(|| e["amount"].as_f64())
                    .unwrap_or(0.0) as u64;
            }
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => return n,
        }
    }
}

#[test]
fn an_endpoint_scales_from_zero_serves_200_requests_and_returns_to_zero() {
    let home = Home::new(BIN);
    let _server = home.server();
    let _agent = home.agent("n0", "4xH100");
    let op = home.operator_key();
    let key = tenant(&home, &op, "acme");
    let other = tenant(&home, &op, "rival");
    let port = free_port();
    let _gw = home.gateway(port);
    let gw = format!("http://127.0.0.1:{port}");

    let replica = format!(
        "exec {BIN} emulator --port \"$PORT\" --model chat --load-delay-ms 1500 --decode-tokens-per-s 200"
    );
    let out = home.cli(
        Some(&key),
        &[
            "endpoints",
            "deploy",
            "chat",
            "--model",
            "chat",
            "--max",
            "3",
            "--idle-window",
            "4",
            "--concurrency",
            "64",
            "--queue-limit",
            "1000",
            "--queue-timeout-ms",
            "90000",
            "--drain-grace-ms",
            "500",
            "--policy",
            "kpa",
            "--",
            "sh",
            "-c",
            &replica,
        ],
    );
    assert!(
        out.status.success(),
        "deploy: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Knative's policy starts with one replica (its initial scale); idle
    // past the window, the endpoint is at zero.
    wait_until("zero replicas before any request", LONG, || {
        let ep = endpoint(&home, &key, "chat");
        ep["replicas"] == json!([]) && ep["desired_replicas"] == 0
    });

    // 200 concurrent requests at zero replicas.
    let results = Arc::new(std::sync::Mutex::new(Vec::new()));
    let threads: Vec<_> = (0..200)
        .map(|_| {
            let (gw, key, results) = (gw.clone(), key.clone(), results.clone());
            std::thread::spawn(move || {
                let r = chat(&gw, &key, "chat");
                results.lock().unwrap().push(r);
            })
        })
        .collect();
    let mut peak = 0;
    while threads.iter().any(|t| !t.is_finished()) {
        let ep = endpoint(&home, &key, "chat");
        peak = peak.max(ep["replicas"].as_array().map_or(0, Vec::len));
        std::thread::sleep(Duration::from_millis(200));
    }
    for t in threads {
        t.join().unwrap();
    }
    let results = results.lock().unwrap();
    let failed: Vec<&(u16, Value)> = results.iter().filter(|(s, _)| *s != 200).collect();
    assert!(
        failed.is_empty(),
        "{} of 200 failed: {:?}",
        failed.len(),
        failed.first()
    );
    assert!(peak >= 1, "no replica was ever started");

    // Another tenant's key: the model is not theirs.
    let (status, body) = chat(&gw, &other, "chat");
    assert_eq!(status, 404, "{body}");

    // Back to zero after the idle window.
    wait_until("scale to zero", LONG, || {
        let ep = endpoint(&home, &key, "chat");
        ep["replicas"] == json!([]) && ep["desired_replicas"] == 0
    });
    // Every request metered once.
    wait_until("200 requests metered", LONG, || {
        requests_metered(&home, &key) == 200
    });

    // A rate limit of 1 request per second per key: a burst gets 429.
    let out = home.cli(
        Some(&key),
        &["endpoints", "update", "chat", "--rate-limit", "1"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::thread::sleep(Duration::from_millis(1500));
    let statuses: Vec<u16> = (0..5).map(|_| raw_status(&gw, &key)).collect();
    assert!(statuses.contains(&429), "{statuses:?}");

    // A hard cap below what the replicas' GPU time already cost: the
    // gateway refuses with 402 (it is checked before the rate limit) once
    // its cached grant for the key is renewed.
    let (status, body) = http(
        "PUT",
        &format!("{}/v1/budget", home.url()),
        Some(&key),
        Some(&json!({"limit": "0.000001", "hard_cap": true}).to_string()),
    )
    .unwrap();
    assert_eq!(status, 200, "{body}");
    wait_until("402 over the hard cap", LONG, || {
        raw_status(&gw, &key) == 402
    });
    let (status, body) = chat(&gw, &key, "chat");
    assert_eq!(status, 402, "{body}");
    assert_eq!(body["error"]["code"], "insufficient_quota", "{body}");
}

/// The status of a request that is not waited for beyond its head: a
/// rate-limited one is answered at once, an admitted one may wait for a
/// cold start, which this test does not need.
fn raw_status(gw: &str, key: &str) -> u16 {
    use std::io::{Read, Write};
    let host = gw.trim_start_matches("http://");
    let Ok(mut s) = std::net::TcpStream::connect(host) else {
        return 0;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let body =
        json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let _ = write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Ok(n) if n > 12 => String::from_utf8_lossy(&buf[..n])
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0),
        _ => 0,
    }
}
