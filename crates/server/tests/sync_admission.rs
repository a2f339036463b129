//! Admission of agent sync reports (docs/scale.md): a replica at its limit
//! of reports in flight answers a sync that takes busy answers at once. It
//! renews the node's lease (the heartbeat is committed first) and takes
//! nothing else of the report; the agent sends it again later. A sync
//! that does not take busy answers (an older agent, the Slurm bridge)
//! waits for a slot instead, and its report is taken.

use axum::http::StatusCode;
use chrono::{Duration, TimeZone, Utc};
use flotilla_core::api::{ObservedInstance, ObservedPhase};
use flotilla_core::clock::Clock;
use flotilla_core::id::NodeId;
use flotilla_core::node::RuntimeKind;
use flotilla_server::schedule::schedule_pass;
use flotilla_server::ServerConfig;
use flotilla_testkit::server::{registration, OnClock};
use serde_json::{json, Value};

fn report(on: &OnClock, instance: &str, phase: ObservedPhase, busy_ok: bool) -> Value {
    let observed = ObservedInstance {
        instance_id: serde_json::from_value(json!(instance)).unwrap(),
        phase,
        at: on.clock.now(),
        started_at: None,
        message: None,
        container: None,
        weights_tier: None,
        limit_exceeded: None,
    };
    json!({"observed": [observed], "wait_ms": 0, "busy_ok": busy_ok})
}

async fn state_of(on: &OnClock, id: &str) -> String {
    let op = on.operator.clone();
    let i = on
        .ok(&op, "GET", &format!("/v1/instances/{id}"), None)
        .await;
    i["state"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_past_the_report_limit_renews_the_lease_and_takes_nothing_else() {
    let t0 = Utc.with_ymd_and_hms(2026, 6, 1, 0, 0, 0).unwrap();
    let on = OnClock::with_config(
        t0,
        ServerConfig {
            sync_reports_in_flight: 2,
            ..ServerConfig::default()
        },
    )
    .await;
    let op = on.operator.clone();
    let t = on
        .ok(&op, "POST", "/v1/tenants", Some(json!({"name": "lab"})))
        .await;
    let provider = on.key(&t["id"], "provider").await;
    let member = on.key(&t["id"], "tenant_member").await;

    // The registration answer says the server gives busy answers.
    let reg = on
        .ok(
            &provider,
            "POST",
            "/v1/agent/register",
            Some(json!(registration(
                "n1",
                &[("H100", 1)],
                RuntimeKind::Process
            ))),
        )
        .await;
    assert_eq!(reg["busy_answers"], json!(true), "{reg}");
    let node = reg["node_id"].as_str().unwrap().to_string();
    let node_id = NodeId::parse(&node, "node").unwrap();
    let sync_path = format!("/v1/agent/nodes/{node}/sync");

    let i = on
        .ok(
            &member,
            "POST",
            "/v1/instances",
            Some(json!({"gpus": 1, "command": ["train"]})),
        )
        .await;
    let id = i["id"].as_str().unwrap().to_string();
    schedule_pass(&on.st).await.expect("a placement pass");
    assert_eq!(state_of(&on, &id).await, "scheduled");

    // Every slot in use (two reports in flight elsewhere).
    let in_flight = on
        .st
        .sync_report_slots()
        .try_acquire_many(2)
        .expect("two free slots");
    on.clock.advance(Duration::seconds(10));
    let now = on.clock.now();
    let running = ObservedPhase::Running { pid: 7 };
    let (status, answer) = on
        .call(
            &provider,
            "POST",
            &sync_path,
            Some(report(&on, &id, running.clone(), true)),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    // Busy: come back in half a heartbeat interval (15 s lease).
    assert_eq!(answer["busy_retry_ms"], json!(2500), "{answer}");
    assert_eq!(answer["assignments"], json!([]), "{answer}");
    assert_eq!(answer["lease_ms"], json!(15_000), "{answer}");
    // The lease renewed, the report not taken.
    let n = on.st.store().node(&node_id).await.unwrap();
    assert_eq!(n.last_heartbeat_at, now);
    assert_eq!(state_of(&on, &id).await, "scheduled");
    assert_eq!(on.st.ops().agent_syncs_busy.get(), 1);

    // A sync that does not take busy answers waits for a slot: nothing
    // frees one, so it is still waiting after a while.
    let waiting = {
        let on_st = on.st.clone();
        let body = report(&on, &id, running.clone(), false);
        let provider = provider.clone();
        let path = sync_path.clone();
        tokio::spawn(async move {
            use tower::ServiceExt;
            let req = axum::http::Request::builder()
                .method("POST")
                .uri(path)
                .header("authorization", format!("Bearer {provider}"))
                .header("content-type", "application/json")
                .body(axum::body::Body::from(body.to_string()))
                .unwrap();
            flotilla_server::app(on_st)
                .oneshot(req)
                .await
                .unwrap()
                .status()
        })
    };
    let still = tokio::time::timeout(std::time::Duration::from_millis(500), async {
        while !waiting.is_finished() {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(
        still.is_err(),
        "a sync without busy_ok was not held for a slot"
    );
    assert_eq!(state_of(&on, &id).await, "scheduled");

    // A slot frees: the waiting report is taken.
    drop(in_flight);
    let status = tokio::time::timeout(std::time::Duration::from_secs(60), waiting)
        .await
        .expect("the waiting sync answered once a slot freed")
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(state_of(&on, &id).await, "running");

    // With slots free, a sync that takes busy answers is taken as usual.
    let (status, answer) = on
        .call(
            &provider,
            "POST",
            &sync_path,
            Some(report(&on, &id, running, true)),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert!(answer.get("busy_retry_ms").is_none(), "{answer}");
    assert_eq!(answer["assignments"][0]["instance_id"], json!(id));
    assert_eq!(on.st.ops().agent_syncs_busy.get(), 1);
}
