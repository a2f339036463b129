//! `flotilla-client` against the real server over HTTP: the typed
//! answers decode, refusals come back as one decoded error naming the
//! field, and the agent protocol round-trips, so the client and the server
//! cannot drift apart unnoticed.

use std::time::{Duration, Instant};

use flotilla_billing::api::PriceCatalog;
use flotilla_client::Error;
use flotilla_core::api::{Instance, LogLine, LogStream, RegisterNode, SyncRequest};
use flotilla_core::instance::CreateInstance;
use flotilla_testkit::server::{fast, start};
use serde_json::json;

fn create(gpus: u32) -> CreateInstance {
    serde_json::from_value(json!({"gpus": gpus, "command": ["sleep", "100"]})).unwrap()
}

#[tokio::test]
async fn typed_answers_and_decoded_refusals() {
    let s = start(fast()).await;
    let tenant = s.create_tenant("acme").await;
    let c = s.client(&s.key(&tenant, "tenant_admin").await);

    let me = c.me().await.unwrap();
    assert_eq!(me.tenant.id.as_str(), tenant);

    match c.create_instance(&create(0)).await.unwrap_err() {
        Error::Api {
            status,
            field,
            message,
            ..
        } => {
            assert!((400..500).contains(&status), "{status}");
            assert_eq!(field.as_deref(), Some("gpus"), "{message}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }

    let inst = c.create_instance(&create(1)).await.unwrap();
    assert_eq!(c.instance(inst.id.as_str()).await.unwrap().id, inst.id);
    let listed: Vec<Instance> = c.list("/v1/instances", &[], None).await.unwrap();
    assert!(listed.iter().any(|i| i.id == inst.id));
    let stopped = c.stop_instance(inst.id.as_str()).await.unwrap();
    assert_eq!(stopped.id, inst.id);
    assert!(
        stopped.stop_requested || stopped.state.is_terminal(),
        "{:?}",
        stopped.state
    );

    let missing = c
        .instance("inst_00000000000000000000000000")
        .await
        .unwrap_err();
    assert!(missing.is_not_found(), "{missing}");

    let prices: PriceCatalog = c.get("/v1/prices", &[]).await.unwrap();
    assert!(prices.versions.iter().any(|v| v.version == prices.in_force));
}

#[tokio::test]
async fn the_agent_protocol_round_trips() {
    let s = start(fast()).await;
    let tenant = s.create_tenant("acme").await;
    let user = s.client(&s.key(&tenant, "tenant_admin").await);
    let agent = s.client(&s.key(&tenant, "provider").await);

    let node: RegisterNode = serde_json::from_value(json!({
        "name": "n1", "cpu_milli": 64000, "memory_mb": 512000, "simulated": true,
        "gpus": [{"index": 0, "model": "H100", "uuid": "GPU-n1-0", "memory_mib": 81920, "vendor": "nvidia"}],
    }))
    .unwrap();
    let registered = agent.register_node(&node).await.unwrap();
    let inst = user.create_instance(&create(1)).await.unwrap();

    let deadline = Instant::now() + Duration::from_secs(30);
    let report: SyncRequest =
        serde_json::from_value(json!({"observed": [], "wait_ms": 0})).unwrap();
    loop {
        let resp = agent.sync_node(&registered.node_id, &report).await.unwrap();
        if resp.assignments.iter().any(|a| a.instance_id == inst.id) {
            break;
        }
        assert!(Instant::now() < deadline, "the instance was never assigned");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let running: SyncRequest = serde_json::from_value(json!({
        "observed": [{"instance_id": inst.id, "phase": "running", "pid": 42, "at": chrono::Utc::now()}],
        "wait_ms": 0,
    }))
    .unwrap();
    agent
        .sync_node(&registered.node_id, &running)
        .await
        .unwrap();

    let line = LogLine {
        seq: 0,
        stream: LogStream::Stdout,
        at: chrono::Utc::now(),
        line: "hello from the agent".into(),
    };
    agent.push_logs(&inst.id, vec![line.clone()]).await.unwrap();
    // Resending is harmless.
    agent.push_logs(&inst.id, vec![line]).await.unwrap();
    let lines = user.logs_all(inst.id.as_str(), 0).await.unwrap();
    assert_eq!(
        lines.iter().map(|l| l.line.as_str()).collect::<Vec<_>>(),
        ["hello from the agent"]
    );
}
