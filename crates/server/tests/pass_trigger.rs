//! The leader's scheduling pass runs when something changed or when a
//! time it planned for arrives, never by the round's tick alone
//! (`reconcile::PassTrigger`): an idle leader (nothing waiting, nothing
//! changing) runs no pass through a hundred rounds; a change starts one
//! within a round; work placed through the pass needs no tick.

use std::time::{Duration, Instant};

use flotilla_testkit::server::{fast, TestServer};
use reqwest::{Method, StatusCode};
use serde_json::json;

/// `flotilla_placement_passes_total` from `/metrics`.
async fn passes(s: &TestServer) -> u64 {
    let r = s.raw(&s.operator, Method::GET, "/metrics", None, &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    let text = r.body.as_str().expect("the metrics text").to_string();
    text.lines()
        .find_map(|l| l.strip_prefix("flotilla_placement_passes_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .expect("the passes counter") as u64
}

/// Waits until `f` holds, up to `limit`.
async fn until<F: std::future::Future<Output = bool>>(
    what: &str,
    limit: Duration,
    mut f: impl FnMut() -> F,
) {
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < limit, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pass_runs_on_a_change_and_never_by_tick_alone() {
    // Rounds every 50 ms.
    let s = flotilla_testkit::server::start(fast()).await;
    // The first round passes once (nothing known yet); then the leader
    // is idle.
    until("the first pass", Duration::from_secs(60), || async {
        passes(&s).await >= 1
    })
    .await;
    let settled = passes(&s).await;
    // Reading (GET) is no change. A hundred rounds at least.
    for _ in 0..50 {
        let _ = s
            .call(&s.operator, Method::GET, "/v1/instances", None)
            .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(passes(&s).await, settled, "an idle leader ran a pass");

    // A change: a node registers; then work is submitted: each starts a
    // pass within a round (generously: the machine may be loaded), and the
    // work is placed.
    let t = s.create_tenant("lab").await;
    let provider = s.key(&t, "provider").await;
    let member = s.key(&t, "tenant_member").await;
    let before = passes(&s).await;
    s.register_node(&provider, "n1", &[("H100", 1)]).await;
    until(
        "a pass after the node registered",
        Duration::from_secs(30),
        || async { passes(&s).await > before },
    )
    .await;
    let (status, i) = s
        .call(
            &member,
            Method::POST,
            "/v1/instances",
            Some(json!({"gpus": 1, "command": ["x"]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{i}");
    let id = i["id"].as_str().unwrap().to_string();
    until("the instance placed", Duration::from_secs(30), || async {
        let i = s
            .ok(&member, Method::GET, &format!("/v1/instances/{id}"), None)
            .await;
        i["state"] == "scheduled"
    })
    .await;
    // Placed, nothing waits: idle again, no more passes.
    until(
        "the pass after placing settles",
        Duration::from_secs(30),
        || async {
            let a = passes(&s).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            passes(&s).await == a
        },
    )
    .await;
    let settled = passes(&s).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        passes(&s).await,
        settled,
        "no pass while nothing waits or changes"
    );
}
