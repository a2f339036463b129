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

/// A time the plan named, with nothing changing: work waits for a node
/// whose provider offers it from 12:00; at 11:59:30 the pass finds it
/// closed and names the opening, the trigger stays quiet through the 30 s
/// (the periodic pass set an hour apart, so only the planned time can
/// run it) and is due at 12:00:00 exactly; that pass places the work. Then
/// the leader, with nothing waiting, runs no pass for a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_window_due_in_30_s_is_acted_on_at_its_time_without_a_change() {
    use chrono::{Duration as Chrono, TimeZone, Utc};
    use flotilla_core::clock::Clock;
    use flotilla_server::reconcile::{scheduling_round, PassTrigger};
    use flotilla_testkit::server::OnClock;

    // A Monday, 30 s before noon.
    let start = Utc.with_ymd_and_hms(2026, 11, 30, 11, 59, 30).unwrap();
    let on = OnClock::with_config(
        start,
        flotilla_server::ServerConfig {
            pass_at_least_every: Duration::from_secs(3600),
            ..Default::default()
        },
    )
    .await;
    let provider = on.tenant_key("owner", "provider").await;
    let member = on.tenant_key("lab", "tenant_member").await;
    let node = on.register_node(&provider, "n1", &[("H100", 1)]).await;
    on.ok(
        &provider,
        "PUT",
        &format!("/v1/nodes/{node}/offer"),
        Some(json!({"windows": [{"start": "12:00", "end": "13:00"}]})),
    )
    .await;
    let i = on
        .ok(
            &member,
            "POST",
            "/v1/instances",
            Some(json!({"gpus": 1, "command": ["x"]})),
        )
        .await;
    let id = i["id"].as_str().unwrap().to_string();

    let mut trigger = PassTrigger::new(Chrono::hours(1));
    let outcome = scheduling_round(&on.st, &mut trigger)
        .await
        .expect("a round")
        .expect("the first round passes");
    assert_eq!((outcome.placed, outcome.waiting), (0, 1), "{outcome:?}");
    let noon = Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0).unwrap();
    assert_eq!(outcome.window_opens, Some(noon), "{outcome:?}");
    // 29 rounds a second apart: no pass.
    for _ in 0..29 {
        on.clock.advance(Chrono::seconds(1));
        let ran = scheduling_round(&on.st, &mut trigger)
            .await
            .expect("a round");
        assert!(
            ran.is_none(),
            "a pass at {} with nothing changed",
            on.clock.now()
        );
    }
    on.clock.advance(Chrono::seconds(1));
    assert_eq!(on.clock.now(), noon);
    let ran = scheduling_round(&on.st, &mut trigger)
        .await
        .expect("a round")
        .expect("the pass planned for noon");
    assert_eq!(ran.placed, 1, "{ran:?}");
    let i = on
        .ok(&member, "GET", &format!("/v1/instances/{id}"), None)
        .await;
    assert_eq!(i["state"], "scheduled", "{i}");
    assert_eq!(i["node_id"], node.as_str(), "{i}");
    // The placing pass signalled its own change: one more pass sees it.
    on.clock.advance(Chrono::seconds(1));
    scheduling_round(&on.st, &mut trigger)
        .await
        .expect("a round");
    // Idle: a minute of rounds, no pass.
    for _ in 0..60 {
        on.clock.advance(Chrono::seconds(1));
        let ran = scheduling_round(&on.st, &mut trigger)
            .await
            .expect("a round");
        assert!(ran.is_none(), "an idle leader passed at {}", on.clock.now());
    }
}
