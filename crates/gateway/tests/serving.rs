//! Serving under change: scale from zero with 200 waiting requests, a
//! replica killed under load, a revision rolled out under load, streams
//! passed through token by token, usage delivered despite a failing control
//! plane, and prefix affinity keeping a prefix on one replica.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use flotilla_core::gateway::{Balance, RouteTable};
use flotilla_emulator::Emulator;
use flotilla_gateway::StaticControl;
use futures::StreamExt;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_requests_at_zero_replicas_all_succeed_once_a_replica_starts() {
    let control = Arc::new(StaticControl::new());
    let alice = tenant();
    let ep = route(&alice, "cold", Vec::new());
    let ep_id = ep.id.clone();
    control.set_routes(RouteTable {
        endpoints: vec![ep.clone()],
    });
    control.set_key("k", grant(&alice));
    // Report demand with a long regular interval: only the immediate report
    // on the first wait at zero can start the replica quickly.
    let mut cfg = config();
    cfg.report_interval = Duration::from_secs(30);
    let gw = gateway(&control, cfg).await;

    // The "autoscaler": on the first report of queued demand, start a
    // replica (500 ms weight load), wait for its readiness, route to it.
    let mut reports = control.subscribe_reports();
    let scaler_control = control.clone();
    let first_demand = Arc::new(Mutex::new(None::<Instant>));
    let seen = first_demand.clone();
    let scaler = tokio::spawn(async move {
        loop {
            let signals = reports.recv().await.expect("reports");
            if signals
                .iter()
                .any(|s| s.endpoint_id == ep_id && s.queued > 0)
            {
                break;
            }
        }
        *seen.lock().unwrap() = Some(Instant::now());
        let emu = emulator(|c| {
            c.load_delay_ms = 500;
            c.decode_tokens_per_s = 200.0;
        })
        .await;
        let health = reqwest::Client::new();
        loop {
            let r = health.get(format!("{}/health", emu.url())).send().await;
            if r.is_ok_and(|r| r.status() == 200) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        scaler_control.update_routes(|t| t.endpoints[0].replicas.push(replica(&emu, 1)));
        emu
    });

    let http = client();
    let started = Instant::now();
    let mut requests = Vec::new();
    for i in 0..200 {
        let http = http.clone();
        let url = gw.url();
        requests.push(tokio::spawn(async move {
            let r = http
                .post(format!("{url}/v1/chat/completions"))
                .bearer_auth("k")
                .json(&chat(&format!("request {i}"), 4, i % 2 == 0))
                .send()
                .await
                .expect("sent");
            let status = r.status().as_u16();
            let _ = r.bytes().await;
            status
        }));
    }
    let statuses: Vec<u16> = futures::future::join_all(requests)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let all_done = started.elapsed();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let demand_seen = first_demand.lock().unwrap().expect("demand reported") - started;
    assert!(
        demand_seen < Duration::from_secs(2),
        "queued demand is reported at once, not at the next tick: {demand_seen:?}"
    );
    assert!(all_done < Duration::from_secs(25), "{all_done:?}");
    wait_until("200 usage records", Duration::from_secs(10), || {
        control.usage().len() == 200
    })
    .await;
    let usage = control.usage();
    assert!(usage
        .iter()
        .all(|u| u.status == 200 && u.instance_id.is_some()));
    assert!(
        usage
            .iter()
            .all(|u| u.output_tokens == 4 && u.input_tokens > 0),
        "streams included"
    );
    let emu = scaler.await.unwrap();
    gw.shutdown().await;
    emu.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_arrives_token_by_token() {
    let emu = emulator(|c| c.decode_tokens_per_s = 20.0).await;
    let control = Arc::new(StaticControl::new());
    let alice = tenant();
    control.set_routes(RouteTable {
        endpoints: vec![route(&alice, "chat", vec![replica(&emu, 1)])],
    });
    control.set_key("k", grant(&alice));
    let gw = gateway(&control, config()).await;
    let started = Instant::now();
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .bearer_auth("k")
        .json(&chat("tell me a story", 10, true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let mut stream = r.bytes_stream();
    let mut text = String::new();
    let mut first = None;
    let mut chunks = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        first.get_or_insert_with(|| started.elapsed());
        chunks += 1;
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let last = started.elapsed();
    let first = first.unwrap();
    // 10 tokens at 20/s: the last ~450 ms after the first.
    assert!(
        last - first >= Duration::from_millis(350),
        "first {first:?}, last {last:?}"
    );
    assert!(chunks >= 5, "{chunks} chunks: the stream was buffered");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    wait_until("usage", Duration::from_secs(10), || {
        control.usage().len() == 1
    })
    .await;
    let u = &control.usage()[0];
    // "user tell me a stor y": 6 prompt tokens.
    assert_eq!(
        (u.input_tokens, u.output_tokens),
        (6, 10),
        "usage from the last chunk"
    );
    gw.shutdown().await;
}

/// Sends requests from `workers` loops until `stop`; records each one's
/// start (since `t0`), duration and status.
async fn steady_load(
    url: String,
    workers: usize,
    max_tokens: u32,
    stop: Arc<AtomicBool>,
    t0: Instant,
) -> Vec<(Duration, Duration, u16)> {
    let http = client();
    let results = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (http, url, stop, results) = (http.clone(), url.clone(), stop.clone(), results.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let start = Instant::now();
                let r = http
                    .post(format!("{url}/v1/chat/completions"))
                    .bearer_auth("k")
                    .json(&chat(
                        &format!("worker {w} request {i}"),
                        max_tokens,
                        w % 2 == 0,
                    ))
                    .send()
                    .await;
                let status = match r {
                    Ok(r) => {
                        let s = r.status().as_u16();
                        // A body cut mid-stream counts as a failure.
                        if r.bytes().await.is_err() {
                            599
                        } else {
                            s
                        }
                    }
                    Err(_) => 598,
                };
                results
                    .lock()
                    .unwrap()
                    .push((start - t0, start.elapsed(), status));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    Arc::try_unwrap(results).unwrap().into_inner().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_under_load_fails_only_what_it_held_and_nothing_hangs() {
    let a = emulator(|c| c.decode_tokens_per_s = 100.0).await;
    let b = emulator(|c| c.decode_tokens_per_s = 100.0).await;
    let control = Arc::new(StaticControl::new());
    let alice = tenant();
    let mut ep = route(&alice, "chat", vec![replica(&a, 1), replica(&b, 1)]);
    ep.queue_timeout_ms = 5_000;
    ep.replica_concurrency = 8;
    control.set_routes(RouteTable {
        endpoints: vec![ep],
    });
    control.set_key("k", grant(&alice));
    let gw = gateway(&control, config()).await;
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let load = tokio::spawn(steady_load(gw.url(), 8, 5, stop.clone(), t0));
    tokio::time::sleep(Duration::from_millis(800)).await;
    let held = a.stats().in_flight.load(Ordering::Relaxed);
    let killed_at = t0.elapsed();
    // Killed, and still in the route table: the control plane has not
    // noticed yet, so the gateway meets refused connections.
    a.kill();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, Ordering::Relaxed);
    let results = load.await.unwrap();
    let failed: Vec<_> = results.iter().filter(|r| r.2 != 200).collect();
    let after: Vec<_> = results
        .iter()
        .filter(|r| r.0 > killed_at + Duration::from_millis(50))
        .collect();
    assert!(
        after.len() > 20,
        "load continued after the kill: {}",
        after.len()
    );
    assert!(
        after.iter().all(|r| r.2 == 200),
        "requests sent after the kill are retried on the live replica: {failed:?}"
    );
    assert!(
        failed.len() as u64 <= held + 8,
        "only requests the killed replica held fail ({} held): {failed:?}",
        held
    );
    let slowest = results.iter().map(|r| r.1).max().unwrap();
    assert!(
        slowest < Duration::from_secs(5),
        "no request hangs: slowest {slowest:?}"
    );
    gw.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revision_rolled_out_under_steady_load_fails_nothing() {
    let old = emulator(|c| c.decode_tokens_per_s = 50.0).await;
    let control = Arc::new(StaticControl::new());
    let alice = tenant();
    let ep = route(&alice, "chat", vec![replica(&old, 1)]);
    control.set_routes(RouteTable {
        endpoints: vec![ep],
    });
    control.set_key("k", grant(&alice));
    let gw = gateway(&control, config()).await;
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let load = tokio::spawn(steady_load(gw.url(), 6, 10, stop.clone(), t0));
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Revision 2 starts and becomes ready; revision 1 drains, then goes.
    let new = emulator(|c| c.decode_tokens_per_s = 50.0).await;
    control.update_routes(|t| t.endpoints[0].replicas.push(replica(&new, 2)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    control.update_routes(|t| t.endpoints[0].replicas[0].draining = true);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let old_served_by_drain = old.stats().requests.load(Ordering::Relaxed);
    control.update_routes(|t| {
        t.endpoints[0].replicas.remove(0);
    });
    // Removed from the table while requests may still run there: they
    // finish (the old replica is shut down gracefully, as the agent would).
    wait_until("old replica idle", Duration::from_secs(10), || {
        old.stats().in_flight.load(Ordering::Relaxed) == 0
    })
    .await;
    let old_total = old.stats().requests.load(Ordering::Relaxed);
    old.shutdown().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let results = load.await.unwrap();
    let failed: Vec<_> = results.iter().filter(|r| r.2 != 200).collect();
    assert!(failed.is_empty(), "{failed:?}");
    assert!(results.len() > 30, "{} requests", results.len());
    assert_eq!(
        old_total, old_served_by_drain,
        "a draining replica gets nothing new"
    );
    assert!(new.stats().requests.load(Ordering::Relaxed) > 0);
    gw.shutdown().await;
    new.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_survives_a_failing_control_plane() {
    let emu = emulator(|_| {}).await;
    let control = Arc::new(StaticControl::new());
    let alice = tenant();
    control.set_routes(RouteTable {
        endpoints: vec![route(&alice, "chat", vec![replica(&emu, 1)])],
    });
    control.set_key("k", grant(&alice));
    control.fail_meter(true);
    let gw = gateway(&control, config()).await;
    let http = client();
    for _ in 0..5 {
        let r = http
            .post(format!("{}/v1/completions", gw.url()))
            .bearer_auth("k")
            .json(&serde_json::json!({"model": MODEL, "prompt": "one two", "max_tokens": 3}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["usage"]["total_tokens"], 5);
    }
    wait_until("5 pending", Duration::from_secs(10), || {
        gw.pending_usage() == 5
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(control.usage().is_empty());
    control.fail_meter(false);
    wait_until("5 delivered", Duration::from_secs(15), || {
        control.usage().len() == 5
    })
    .await;
    let usage = control.usage();
    assert!(usage
        .iter()
        .all(|u| u.input_tokens == 2 && u.output_tokens == 3));
    let mut ids: Vec<_> = usage.iter().map(|u| u.request_id.clone()).collect();
    ids.dedup();
    assert_eq!(ids.len(), 5);
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_affinity_keeps_a_prefix_on_one_replica() {
    let emus: Vec<Emulator> =
        futures::future::join_all((0..3).map(|_| emulator(|c| c.prefix_cache_tokens = 100_000)))
            .await;
    let control = Arc::new(StaticControl::new());
    let alice = tenant();
    let mut ep = route(&alice, "chat", emus.iter().map(|e| replica(e, 1)).collect());
    ep.balance = Balance::PrefixAffinity;
    control.set_routes(RouteTable {
        endpoints: vec![ep],
    });
    control.set_key("k", grant(&alice));
    let mut cfg = config();
    cfg.affinity_prefix_chars = 64;
    let gw = gateway(&control, cfg).await;
    let http = client();
    let mut served: HashMap<usize, Vec<u64>> = HashMap::new();
    for group in 0..4 {
        let before: Vec<u64> = emus
            .iter()
            .map(|e| e.stats().requests.load(Ordering::Relaxed))
            .collect();
        let system = format!("group {group} system prompt ").repeat(8);
        for i in 0..5 {
            let body = serde_json::json!({"model": MODEL, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("question {i}")}], "max_tokens": 1});
            let r = http
                .post(format!("{}/v1/chat/completions", gw.url()))
                .bearer_auth("k")
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        }
        let after: Vec<u64> = emus
            .iter()
            .map(|e| e.stats().requests.load(Ordering::Relaxed))
            .collect();
        served.insert(
            group,
            after.iter().zip(&before).map(|(a, b)| a - b).collect(),
        );
    }
    for (group, counts) in &served {
        assert_eq!(
            counts.iter().filter(|c| **c > 0).count(),
            1,
            "group {group}: {counts:?}"
        );
    }
    let hits: u64 = emus
        .iter()
        .map(|e| e.stats().cached_prompt_tokens.load(Ordering::Relaxed))
        .sum();
    assert!(hits > 0);
    gw.shutdown().await;
}
