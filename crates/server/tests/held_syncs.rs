//! A held agent sync (a long poll) wakes for what changes its own node's
//! assignments, not for every change anywhere: another node's reports
//! (its instances' phases, its log lines) and new work not yet placed
//! reach the control loops only (`AppState::notify_control`). At a fleet
//! of thousands of nodes, waking every held sync on each of them was a
//! storm of reads that found nothing new (docs/scale.md).

use std::time::{Duration, Instant};

use flotilla_core::api::{LogLine, LogStream, ObservedInstance, ObservedPhase, SyncRequest};
use flotilla_core::id::{InstanceId, NodeId};
use flotilla_testkit::server::fast;
use reqwest::Method;
use serde_json::json;

/// How long a held sync waits when nothing wakes it.
const HOLD: Duration = Duration::from_secs(4);

/// One held sync of `node` reporting nothing; how long it took and the
/// instances it was told to run.
async fn held_sync(client: flotilla_client::Client, node: NodeId) -> (Duration, Vec<String>) {
    held_sync_running(client, node, Vec::new()).await
}

/// One held sync of `node` reporting `running` as running; how long it
/// took and the instances it was told to run (those told to stop with a
/// `stop:` prefix).
async fn held_sync_running(
    client: flotilla_client::Client,
    node: NodeId,
    running: Vec<String>,
) -> (Duration, Vec<String>) {
    let observed = running
        .iter()
        .map(|id| ObservedInstance {
            instance_id: InstanceId::parse(id, "instance").unwrap(),
            phase: ObservedPhase::Running { pid: 7 },
            at: chrono::Utc::now(),
            started_at: None,
            message: None,
            container: None,
            weights_tier: None,
            limit_exceeded: None,
        })
        .collect();
    let req = SyncRequest {
        observed,
        wait_ms: HOLD.as_millis() as u64,
        gpus: Vec::new(),
        images: None,
        weights: None,
        parks_ended: Vec::new(),
        busy_ok: false,
    };
    let start = Instant::now();
    let answer = client
        .sync_node(&node, &req)
        .await
        .unwrap_or_else(|e| panic!("syncing {node}: {e}"));
    let ids = answer
        .assignments
        .iter()
        .map(|a| {
            if a.stop {
                format!("stop:{}", a.instance_id)
            } else {
                a.instance_id.to_string()
            }
        })
        .collect();
    (start.elapsed(), ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_sync_wakes_for_its_own_node_not_for_others_reports() {
    let s = flotilla_testkit::server::start(fast()).await;
    let t = s.create_tenant("lab").await;
    let provider = s.key(&t, "provider").await;
    let member = s.key(&t, "tenant_member").await;
    let a = s.register_node(&provider, "a", &[("H100", 1)]).await;
    let b = s.register_node(&provider, "b", &[("H100", 1)]).await;

    // Work placed on one of them: the busy node; the other is idle.
    let i = s
        .ok(
            &member,
            Method::POST,
            "/v1/instances",
            Some(json!({"gpus": 1, "command": ["x"]})),
        )
        .await;
    let busy_inst = i["id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(60);
    let busy = loop {
        let i = s
            .ok(
                &member,
                Method::GET,
                &format!("/v1/instances/{busy_inst}"),
                None,
            )
            .await;
        if let Some(n) = i["node_id"].as_str() {
            break n.to_string();
        }
        assert!(Instant::now() < deadline, "the instance placed: {i}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let idle = if busy == a { b.clone() } else { a.clone() };
    let idle_id = NodeId::parse(&idle, "node").unwrap();
    s.sync(
        &provider,
        &busy,
        vec![(busy_inst.clone(), ObservedPhase::Running { pid: 7 })],
    )
    .await;

    // The idle node's sync is held while the busy node streams log lines
    // and reports, every 50 ms, until the held sync answers: not one of
    // them wakes it.
    let holder = tokio::spawn(held_sync(s.client(&provider), idle_id.clone()));
    let client = s.client(&provider);
    let inst = InstanceId::parse(&busy_inst, "instance").unwrap();
    let mut seq = 0u64;
    while !holder.is_finished() {
        client
            .push_logs(
                &inst,
                vec![LogLine {
                    seq,
                    stream: LogStream::Stdout,
                    at: chrono::Utc::now(),
                    line: format!("step {seq}"),
                }],
            )
            .await
            .expect("log lines pushed");
        seq += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (took, told) = holder.await.expect("the held sync");
    assert!(
        seq >= 10,
        "the busy node pushed lines while the sync was held ({seq})"
    );
    assert!(
        took >= HOLD,
        "the idle node's held sync answered after {took:?}, woken by another node's log lines"
    );
    assert!(told.is_empty(), "{told:?}");

    // New work that only the idle node can take: its held sync answers
    // as soon as the pass places it there, well before the hold ends.
    let holder = tokio::spawn(held_sync(s.client(&provider), idle_id.clone()));
    let i = s
        .ok(
            &member,
            Method::POST,
            "/v1/instances",
            Some(json!({"gpus": 1, "command": ["y"]})),
        )
        .await;
    let placed = i["id"].as_str().unwrap().to_string();
    let (took, told) = holder.await.expect("the held sync");
    // The create may land before the sync is held, in which case the
    // sync answers at once with it, also in time.
    assert!(told.contains(&placed), "told {told:?} after {took:?}");
    assert!(
        took < HOLD,
        "the idle node's held sync answered its own placement after {took:?}"
    );

    s.sync(
        &provider,
        &idle,
        vec![(placed.clone(), ObservedPhase::Running { pid: 8 })],
    )
    .await;
    let busy_id = NodeId::parse(&busy, "node").unwrap();

    // A stop wakes the held sync of the node that runs the work, and
    // only that one: the other node's held sync sleeps its whole hold.
    let other = tokio::spawn(held_sync_running(
        s.client(&provider),
        idle_id.clone(),
        vec![placed.clone()],
    ));
    let holder = tokio::spawn(held_sync_running(
        s.client(&provider),
        busy_id.clone(),
        vec![busy_inst.clone()],
    ));
    // Both held before the stop (a sync answered before it would not
    // show whether the stop woke it).
    tokio::time::sleep(Duration::from_millis(300)).await;
    s.ok(
        &member,
        Method::POST,
        &format!("/v1/instances/{busy_inst}/stop"),
        None,
    )
    .await;
    let (took, told) = holder.await.expect("the held sync");
    assert!(
        told.contains(&format!("stop:{busy_inst}")),
        "told {told:?} after {took:?}"
    );
    assert!(took < HOLD, "the stop reached its node after {took:?}");
    let (took, told) = other.await.expect("the other held sync");
    assert!(
        took >= HOLD,
        "the other node's held sync answered after {took:?}, woken by a stop of work it does not run"
    );
    assert_eq!(told, vec![placed.clone()]);

    // The stopped work exits; new work can go only to the node it left.
    // Its placement wakes that node's held sync, not the full node's.
    s.sync(
        &provider,
        &busy,
        vec![(
            busy_inst.clone(),
            ObservedPhase::Exited {
                code: 143,
                stopped: true,
            },
        )],
    )
    .await;
    let other = tokio::spawn(held_sync_running(
        s.client(&provider),
        idle_id.clone(),
        vec![placed.clone()],
    ));
    let holder = tokio::spawn(held_sync(s.client(&provider), busy_id.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let i = s
        .ok(
            &member,
            Method::POST,
            "/v1/instances",
            Some(json!({"gpus": 1, "command": ["z"]})),
        )
        .await;
    let third = i["id"].as_str().unwrap().to_string();
    let (took, told) = holder.await.expect("the held sync");
    assert!(told.contains(&third), "told {told:?} after {took:?}");
    assert!(took < HOLD, "the placement reached its node after {took:?}");
    let (took, told) = other.await.expect("the other held sync");
    assert!(
        took >= HOLD,
        "the full node's held sync answered after {took:?}, woken by a placement on another node"
    );
    assert_eq!(told, vec![placed]);
}
