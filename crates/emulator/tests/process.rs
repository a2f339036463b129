//! The emulator binary as a parent starts it: `--port 0`, the address read
//! from its first line, readiness after the load delay, then OpenAI-style
//! answers, the prefix cache and the concurrency limit.

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

#[tokio::test]
async fn the_binary_loads_then_serves_caches_prefixes_and_refuses_beyond_its_queue() {
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_flotilla-emulator"))
        .args([
            "--port",
            "0",
            "--model",
            "m",
            "--load-delay-ms",
            "400",
            "--prefix-cache-tokens",
            "1000",
            "--max-concurrency",
            "1",
            "--max-queue",
            "0",
            "--decode-tokens-per-s",
            "10",
        ])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("emulator starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .await
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .expect("first line names the address");
    let url = format!("http://{addr}");
    let http = reqwest::Client::new();

    // Loading: 503 on /health and on requests; then ready.
    let mut saw_loading = false;
    loop {
        let status = http
            .get(format!("{url}/health"))
            .send()
            .await
            .unwrap()
            .status();
        if status == 200 {
            break;
        }
        assert_eq!(status, 503);
        saw_loading = true;
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "never became ready"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(saw_loading || started.elapsed() >= Duration::from_millis(400));

    let prompt = "word ".repeat(40);
    let ask = |prompt: String, max_tokens: u32| {
        let http = http.clone();
        let url = url.clone();
        async move {
            http.post(format!("{url}/v1/completions"))
                .json(&json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens}))
                .send()
                .await
                .unwrap()
        }
    };
    let first: Value = ask(prompt.clone(), 2).await.json().await.unwrap();
    assert_eq!(first["usage"]["prompt_tokens"], 40);
    assert_eq!(first["usage"]["completion_tokens"], 2);
    assert_eq!(first["usage"]["total_tokens"], 42);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let second: Value = ask(format!("{prompt} more"), 2).await.json().await.unwrap();
    // Two whole blocks of 16 tokens are shared.
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        32
    );

    // One slot, no queue: a second request while one runs gets 429.
    let slow = tokio::spawn(ask("slow".into(), 20));
    loop {
        let m = http
            .get(format!("{url}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if m.contains("emulator_in_flight 1") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let busy = ask("busy".into(), 1).await;
    assert_eq!(busy.status(), 429);
    assert!(busy.headers().contains_key("retry-after"));
    assert_eq!(slow.await.unwrap().status(), 200);

    // Another model: 404 naming the field.
    let r = http
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"model": "other", "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().starts_with("model"));
    // A malformed body: 400.
    let r = http
        .post(format!("{url}/v1/embeddings"))
        .json(&json!({"model": "m", "input": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let models: Value = http
        .get(format!("{url}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "m");
    let metrics = http
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("emulator_prefix_cache_hit_tokens_total 32"),
        "{metrics}"
    );
    child.kill().await.unwrap();
}
