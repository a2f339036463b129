//! Crash safety of the usage ledger (issue 5's must-show): the real
//! `flotilla server` is killed with SIGKILL while 100,000 usage events
//! stream in, restarted on the same database, and every event is sent
//! again. The ledger must then hold each event exactly once, and its GPU
//! time must be exactly what was generated.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_testkit::process::{http, Home};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
const EVENTS: usize = 100_000;
const BATCH: usize = 5_000;

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

/// Events and amount summed in the rollup table (maintained at ingestion,
/// in each batch's transaction).
fn rollup_totals(env: &Home) -> (i64, i64) {
    use sqlx::Row;
    let url = format!(
        "sqlite://{}?mode=ro",
        env.data().join("flotilla.db").display()
    );
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
        let r = sqlx::query(
            "SELECT CAST(COALESCE(SUM(n), 0) AS BIGINT) AS n, \
             CAST(COALESCE(SUM(total), 0) AS BIGINT) AS total FROM usage_rollup",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        let t = (r.get("n"), r.get("total"));
        pool.close().await;
        t
    })
}

fn totals(env: &Home) -> (i64, i128) {
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
    let mut env = Home::new(BIN);
    env.log_level = "warn";
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
    // The rollup rating reads is exactly-once too: one event of amount 1
    // per event sent.
    assert_eq!(rollup_totals(&env), (EVENTS as i64, EVENTS as i64));
}
