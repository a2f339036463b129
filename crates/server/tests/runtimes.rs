//! Placement by node runtime over real HTTP with fake agents: an agent
//! registers as running processes or containers, `GET /v1/nodes` shows it,
//! and the scheduler sends work with an image only to container nodes and
//! a command only to process nodes. Work that no node's runtime can run
//! waits, and its reason says so.

use std::time::{Duration, Instant};

use flotilla_core::node::RuntimeKind;
use flotilla_testkit::server::{fast, start, TestServer};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

/// Long enough for the background scheduler on a loaded 2-core machine.
const DEADLINE: Duration = Duration::from_secs(60);

/// A tenant's member key and provider key.
async fn tenant(s: &TestServer, name: &str) -> (String, String) {
    let id = s.create_tenant(name).await;
    (
        s.key(&id, "tenant_member").await,
        s.key(&id, "provider").await,
    )
}

async fn create(s: &TestServer, key: &str, path: &str, body: Value) -> String {
    let (status, b) = s.call(key, Method::POST, path, Some(body)).await;
    assert_eq!(status, StatusCode::CREATED, "{b}");
    b["id"].as_str().expect("id").to_string()
}

/// Polls `path` until `pred` holds on it.
async fn wait_for(
    s: &TestServer,
    key: &str,
    path: &str,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    let start = Instant::now();
    loop {
        let v = s.ok(key, Method::GET, path, None).await;
        if pred(&v) {
            return v;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{path} never {what} within {DEADLINE:?}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_go_to_container_nodes_and_commands_to_process_nodes() {
    let s = start(fast()).await;
    let (member, provider) = tenant(&s, "mixed").await;
    let procs = s
        .register_node_running(&provider, "procs", &[("H100", 1)], RuntimeKind::Process)
        .await;
    let boxes = s
        .register_node_running(&provider, "boxes", &[("H100", 1)], RuntimeKind::Container)
        .await;

    let nodes = s.ok(&s.operator, Method::GET, "/v1/nodes", None).await;
    let runtime_of = |id: &str| {
        nodes["items"]
            .as_array()
            .expect("items")
            .iter()
            .find(|n| n["id"] == id)
            .map(|n| n["runtime"].clone())
    };
    assert_eq!(runtime_of(&procs), Some(json!("process")), "{nodes}");
    assert_eq!(runtime_of(&boxes), Some(json!("container")), "{nodes}");

    // Created image first: were runtimes ignored, it would take the first
    // node and leave the command only the container node.
    let image = create(
        &s,
        &member,
        "/v1/instances",
        json!({"gpus": 1, "image": "busybox", "command": ["sleep", "60"]}),
    )
    .await;
    let command = create(
        &s,
        &member,
        "/v1/instances",
        json!({"gpus": 1, "command": ["sleep", "60"]}),
    )
    .await;
    for (id, node) in [(&image, &boxes), (&command, &procs)] {
        let i = wait_for(
            &s,
            &member,
            &format!("/v1/instances/{id}"),
            "scheduled",
            |i| i["state"] == "scheduled",
        )
        .await;
        assert_eq!(i["node_id"], json!(node), "{i}");
    }

    // Re-registering as another runtime is recorded (an agent restarted
    // with `--runtime container`).
    s.register_node_running(&provider, "procs", &[("H100", 1)], RuntimeKind::Container)
        .await;
    let n = s
        .ok(
            &s.operator,
            Method::GET,
            &format!("/v1/nodes/{procs}"),
            None,
        )
        .await;
    assert_eq!(n["runtime"], "container", "{n}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_work_on_process_nodes_only_waits_and_says_why() {
    let s = start(fast()).await;
    let (member, provider) = tenant(&s, "procs-only").await;
    // Registered without a runtime, as agents before it did: processes.
    let a = s.register_node(&provider, "a", &[("H100", 2)]).await;
    s.register_node(&provider, "b", &[("H100", 2)]).await;

    let image = create(
        &s,
        &member,
        "/v1/instances",
        json!({"gpus": 1, "image": "busybox"}),
    )
    .await;
    let job = create(
        &s,
        &member,
        "/v1/jobs",
        json!({"gpus": 2, "nodes": 2, "image": "busybox", "command": ["train"]}),
    )
    .await;
    let command = create(
        &s,
        &member,
        "/v1/instances",
        json!({"gpus": 1, "command": ["sleep", "60"]}),
    )
    .await;
    let i = wait_for(
        &s,
        &member,
        &format!("/v1/instances/{image}"),
        "explained",
        |i| {
            i["state_reason"]
                .as_str()
                .is_some_and(|r| r.contains("0/2 nodes fit: 2 runs processes, not images"))
        },
    )
    .await;
    assert_eq!(i["state"], "pending", "{i}");
    let j = wait_for(&s, &member, &format!("/v1/jobs/{job}"), "explained", |j| {
        j["state_reason"]
            .as_str()
            .is_some_and(|r| r.contains("runs processes, not images"))
    })
    .await;
    assert_eq!(j["state"], "queued", "{j}");
    // Process work still runs there.
    let c = wait_for(
        &s,
        &member,
        &format!("/v1/instances/{command}"),
        "scheduled",
        |i| i["state"] == "scheduled",
    )
    .await;
    assert!(c["node_id"].is_string(), "{c}");

    // An unknown runtime is refused, naming the field; the node is unchanged.
    let (status, b) = s
        .call(
            &provider,
            Method::POST,
            "/v1/agent/register",
            Some(json!({
                "name": "a", "cpu_milli": 1000, "memory_mb": 1000, "simulated": true,
                "gpus": [], "runtime": "vm"
            })),
        )
        .await;
    assert!(status.is_client_error(), "{status}: {b}");
    assert!(b.to_string().contains("runtime"), "{b}");
    let n = s
        .ok(&s.operator, Method::GET, &format!("/v1/nodes/{a}"), None)
        .await;
    assert_eq!(n["runtime"], "process", "{n}");
}
