//! Provider offer windows over real HTTP with a fake agent: only the
//! node's owner sets them (another tenant gets 404) and errors name the
//! field; outside its windows a node takes no new work (the waiting
//! instance counts it as cordoned) and takes it once offered again; work
//! running when a window closes is asked to stop, saying why.

use std::time::Duration;

use flotilla_core::api::ObservedPhase;
use flotilla_testkit::server::{fast, TestServer};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

async fn instance(s: &TestServer, key: &str, id: &str) -> Value {
    s.ok(key, Method::GET, &format!("/v1/instances/{id}"), None)
        .await
}

/// Polls `id` until `pred` holds (the loops run in the background).
async fn wait_for(
    s: &TestServer,
    key: &str,
    id: &str,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    for _ in 0..800 {
        let i = instance(s, key, id).await;
        if pred(&i) {
            return i;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{id} never {what}: {}", instance(s, key, id).await);
}

/// A window that is closed now: it opens in two hours, for one hour.
fn closed_now() -> Value {
    let at = chrono::Utc::now() + chrono::Duration::hours(2);
    let end = at + chrono::Duration::hours(1);
    json!({"windows": [{"start": at.format("%H:%M").to_string(), "end": end.format("%H:%M").to_string()}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_outside_its_offer_window_takes_no_new_work_and_its_work_is_stopped() {
    let s = flotilla_testkit::server::start(fast()).await;
    let owner = s.create_tenant("owner").await;
    let provider = s.key(&owner, "provider").await;
    let renter = s.create_tenant("renter").await;
    let tenant = s.key(&renter, "tenant_member").await;
    let node = s.register_node(&provider, "n1", &[("H100", 2)]).await;
    let offer = format!("/v1/nodes/{node}/offer");

    // Offered always until its owner says otherwise.
    let o = s.ok(&provider, Method::GET, &offer, None).await;
    assert_eq!(o["windows"], json!([]));
    // Another tenant neither reads nor sets it.
    for m in [Method::GET, Method::PUT] {
        let (status, b) = s.call(&tenant, m, &offer, Some(closed_now())).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{b}");
    }
    let (status, b) = s
        .call(
            &provider,
            Method::PUT,
            &offer,
            Some(json!({"windows": [{"start": "9:00", "end": "17:00"}]})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
    assert_eq!(b["error"]["details"]["field"], "windows[0].start", "{b}");

    // Outside the window: new work waits, the node counted as cordoned.
    s.ok(&provider, Method::PUT, &offer, Some(closed_now()))
        .await;
    let (status, b) = s
        .call(
            &tenant,
            Method::POST,
            "/v1/instances",
            Some(json!({"gpus": 1, "command": ["train"]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{b}");
    let id = b["id"].as_str().unwrap().to_string();
    let i = wait_for(&s, &tenant, &id, "waited for the window", |i| {
        i["state_reason"]
            .as_str()
            .unwrap_or("")
            .contains("cordoned")
    })
    .await;
    assert_eq!(i["state"], "pending", "{i}");

    // Offered again: the work is placed there.
    s.ok(&provider, Method::PUT, &offer, Some(json!({"windows": []})))
        .await;
    wait_for(&s, &tenant, &id, "was placed", |i| {
        i["state"] == "scheduled"
    })
    .await;
    s.sync(
        &provider,
        &node,
        vec![(id.clone(), ObservedPhase::Running { pid: 4242 })],
    )
    .await;
    wait_for(&s, &tenant, &id, "ran", |i| i["state"] == "running").await;

    // The window closes: the running work is asked to stop, and says why.
    s.ok(&provider, Method::PUT, &offer, Some(closed_now()))
        .await;
    let i = wait_for(&s, &tenant, &id, "was asked to stop", |i| {
        i["stop_requested"] == true
    })
    .await;
    let reason = i["state_reason"].as_str().unwrap_or("");
    assert!(
        reason.contains("offer window") && reason.contains(&node),
        "{i}"
    );
}
