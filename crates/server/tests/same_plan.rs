//! One decision core: the snapshot the server's pass gathers from its store
//! is handed to the server's planner and to the simulator's placement call,
//! and both plan the same. The state is made to need every kind of
//! decision: whole GPUs, fractions and MIG slices, a gang on distinct
//! nodes, priorities and tiers across two tenants, a tier-1 ask that can
//! start only by preempting spot work, and work that fits nowhere.
//!
//! The simulator's node pool decides through the same call on snapshots
//! it builds from its own model (`flotilla_sim::nodes`); its unit tests
//! check that a pool's placement is the plan of the pool's snapshot.

use chrono::{TimeZone, Utc};
use flotilla_server::schedule::{gather, plan_of, schedule_pass};
use flotilla_testkit::server::OnClock;
use reqwest::StatusCode;
use serde_json::{json, Value};

async fn create(on: &OnClock, key: &str, path: &str, body: Value) {
    let (status, b) = on.call(key, "POST", path, Some(body)).await;
    assert_eq!(status, StatusCode::CREATED, "{path}: {b}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_and_the_simulator_plan_the_same_from_one_snapshot() {
    let on = OnClock::new(Utc.with_ymd_and_hms(2026, 12, 3, 9, 0, 0).unwrap()).await;
    let provider = on.tenant_key("owner", "provider").await;
    let spot = on.tenant_key("spotty", "tenant_member").await;
    let dedicated = on.tenant_key("steady", "tenant_member").await;
    on.register_node(&provider, "n1", &[("H100", 4)]).await;
    on.register_node(&provider, "n2", &[("H100", 2), ("L40S", 2)])
        .await;
    on.register_node(&provider, "n3", &[("H100:mig", 2)]).await;

    // Running work first: spot whole GPUs, a fraction, MIG slices.
    for body in [
        json!({"gpus": 2, "command": ["x"], "billing_class": "spot"}),
        json!({"gpus": 2, "command": ["x"], "billing_class": "spot"}),
        json!({"gpus": 1, "gpu_fraction": 0.25, "gpu_types": ["L40S"], "command": ["x"]}),
        json!({"gpus": 1, "mig_profile": "3g.40gb", "command": ["x"]}),
    ] {
        create(&on, &spot, "/v1/instances", body).await;
    }
    let placed = schedule_pass(&on.st).await.expect("a pass");
    assert_eq!(placed, 4, "the first pass places all four");

    // Then a queue that needs every kind of decision.
    for body in [
        // Fits only by preempting spot work (tier 1 outranks it).
        json!({"gpus": 4, "command": ["serve"], "gpu_types": ["H100"]}),
        // Fractions and slices beside what runs.
        json!({"gpus": 1, "gpu_fraction": 0.5, "gpu_types": ["L40S"], "command": ["x"]}),
        json!({"gpus": 1, "mig_profile": "1g.10gb", "command": ["x"]}),
        json!({"gpus": 1, "mig_profile": "4g.40gb", "command": ["x"], "priority": 10}),
        // Fits nowhere, ever: a reason, never a placement.
        json!({"gpus": 8, "command": ["x"]}),
    ] {
        create(&on, &dedicated, "/v1/instances", body).await;
    }
    // A gang of two members on distinct nodes, and a low-priority job.
    create(
        &on,
        &dedicated,
        "/v1/jobs",
        json!({"gpus": 2, "nodes": 2, "command": ["train"]}),
    )
    .await;
    create(
        &on,
        &spot,
        "/v1/jobs",
        json!({"gpus": 1, "command": ["train"], "priority": -5}),
    )
    .await;

    let g = gather(&on.st).await.expect("a gathered snapshot");
    assert_eq!(g.input.queue.len(), 7, "seven works wait");
    assert!(
        !g.input.running.is_empty(),
        "running work is in the snapshot"
    );

    let server = plan_of(&g).expect("the server's plan");
    let simulator = flotilla_sim::nodes::decide(&g.input).expect("the simulator's plan");
    assert_eq!(server, simulator, "one snapshot, one plan");

    // The snapshot is one a real decision was needed on: something is
    // placed, something preempted, something waits.
    assert!(!server.placements.is_empty(), "{server:?}");
    assert!(!server.preemptions.is_empty(), "{server:?}");
    assert!(!server.waiting.is_empty(), "{server:?}");

    // Planned again from the same snapshot, the same plan (no clock and
    // no store is read).
    assert_eq!(plan_of(&g).expect("again"), server);

    // And it is the plan the server applies: the pass places what it says.
    let applied = schedule_pass(&on.st).await.expect("the pass");
    assert_eq!(applied, server.placements.len());
}
