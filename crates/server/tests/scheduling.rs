//! Priorities, tiers and preemption over real HTTP with a fake agent: a
//! tier-1 instance preempts a spot instance that fills the only node, the
//! spot work is requeued once its exit is reported, and tier-1 work is
//! never a victim.

use std::time::Duration;

use flotilla_core::api::ObservedPhase;
use flotilla_testkit::server::{fast, TestServer};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

/// The in-process server, with this file's helpers on top.
struct Server(TestServer);

impl std::ops::Deref for Server {
    type Target = TestServer;
    fn deref(&self) -> &TestServer {
        &self.0
    }
}

async fn start() -> Server {
    Server(flotilla_testkit::server::start(fast()).await)
}

impl Server {
    /// A tenant and a member key of it.
    /// A tenant and a member key of it.
    async fn tenant(&self, name: &str) -> (String, String) {
        let id = self.create_tenant(name).await;
        let key = self.key(&id, "tenant_member").await;
        (id, key)
    }

    /// A node of `gpus` H100s.
    async fn node(&self, key: &str, name: &str, gpus: u32) -> String {
        self.register_node(key, name, &[("H100", gpus)]).await
    }

    async fn instance(&self, key: &str, id: &str) -> Value {
        self.ok(key, Method::GET, &format!("/v1/instances/{id}"), None)
            .await
    }

    /// Polls `id` until `pred` holds (the scheduler runs in the background).
    async fn wait_for(
        &self,
        key: &str,
        id: &str,
        what: &str,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        for _ in 0..200 {
            let i = self.instance(key, id).await;
            if pred(&i) {
                return i;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("{id} never {what}: {}", self.instance(key, id).await);
    }

    async fn create(&self, key: &str, body: Value) -> String {
        let (status, b) = self
            .call(key, Method::POST, "/v1/instances", Some(body))
            .await;
        assert_eq!(status, StatusCode::CREATED, "{b}");
        b["id"].as_str().unwrap().to_string()
    }
}

fn running() -> ObservedPhase {
    ObservedPhase::Running { pid: 4242 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tier_one_preempts_spot_which_is_requeued_and_tier_one_is_never_a_victim() {
    let s = start().await;
    let (spot_tenant, spot) = s.tenant("spotty").await;
    let (_, dedicated) = s.tenant("dedicated").await;
    let provider = s.key(&spot_tenant, "provider").await;
    let node = s.node(&provider, "n1", 2).await;

    // Validation names the field.
    for (body, field) in [
        (json!({"gpus": 1, "command": ["x"], "tier": 4}), "tier"),
        (
            json!({"gpus": 1, "command": ["x"], "priority": 5000}),
            "priority",
        ),
        (
            json!({"gpus": 1, "command": ["x"], "tier": 1, "preemptible": true}),
            "preemptible",
        ),
    ] {
        let (status, b) = s
            .call(&spot, Method::POST, "/v1/instances", Some(body))
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
        assert_eq!(b["error"]["details"]["field"], field, "{b}");
    }

    // A spot instance fills the node.
    let victim = s
        .create(
            &spot,
            json!({"gpus": 2, "command": ["train"], "billing_class": "spot"}),
        )
        .await;
    let v = s
        .wait_for(&spot, &victim, "scheduled", |i| i["state"] == "scheduled")
        .await;
    assert_eq!(
        (v["tier"].as_u64(), v["preemptible"].as_bool()),
        (Some(2), Some(true))
    );
    s.sync(&provider, &node, vec![(victim.clone(), running())])
        .await;
    s.wait_for(&spot, &victim, "running", |i| i["state"] == "running")
        .await;

    // A tier-1 instance of another tenant arrives: the spot one is preempted.
    let first = s
        .create(&dedicated, json!({"gpus": 2, "command": ["serve"]}))
        .await;
    let v = s
        .wait_for(&spot, &victim, "preempted", |i| i["stop_requested"] == true)
        .await;
    assert_eq!(
        v["state"], "running",
        "the victim runs on through its notice"
    );
    assert_eq!(v["preempted_by"], first.as_str());
    let reason = v["state_reason"].as_str().unwrap();
    assert!(
        reason.contains(&format!("preempted by {first}")) && reason.contains("notice 30 s"),
        "{reason}"
    );
    let last = v["events"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["state"], "running");
    assert!(
        last["reason"].as_str().unwrap().starts_with("preempted"),
        "{last}"
    );
    let f = s.instance(&dedicated, &first).await;
    assert_eq!(f["state"], "pending");
    assert!(f["state_reason"].as_str().unwrap().contains(&victim), "{f}");
    // The agent is told to stop it with the preemption notice as grace.
    let a = s.sync(&provider, &node, vec![]).await;
    let va = a
        .iter()
        .find(|a| a["instance_id"] == victim.as_str())
        .unwrap();
    assert_eq!(
        (va["stop"].as_bool(), va["stop_grace_ms"].as_u64()),
        (Some(true), Some(30_000))
    );

    // Its exit is reported: it ends stopped ("preempted") and is requeued.
    s.sync(
        &provider,
        &node,
        vec![(
            victim.clone(),
            ObservedPhase::Exited {
                code: 143,
                stopped: true,
            },
        )],
    )
    .await;
    let v = s
        .wait_for(&spot, &victim, "stopped", |i| i["state"] == "stopped")
        .await;
    assert!(
        v["state_reason"].as_str().unwrap().contains("preempted"),
        "{v}"
    );
    s.wait_for(&dedicated, &first, "scheduled", |i| {
        i["state"] == "scheduled"
    })
    .await;
    let list = s
        .ok(&spot, Method::GET, "/v1/instances?state=pending", None)
        .await;
    let requeued: Vec<&Value> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["requeued_from"] == victim.as_str())
        .collect();
    assert_eq!(requeued.len(), 1, "{list}");
    let requeued = requeued[0]["id"].as_str().unwrap().to_string();
    assert_eq!(
        requeued_spec(&s.instance(&spot, &requeued).await),
        requeued_spec(&v)
    );

    // The queue shows it, to its tenant, with a position and a reason.
    let q = s.ok(&spot, Method::GET, "/v1/queue", None).await;
    let items = q["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{q}");
    assert_eq!(items[0]["position"], 1);
    assert_eq!(items[0]["instance"]["id"], requeued.as_str());
    assert!(
        s.ok(&dedicated, Method::GET, "/v1/queue", None).await["items"]
            .as_array()
            .unwrap()
            .is_empty()
    );

    // Tier-1 work is never a victim, whatever the priority of the asker.
    s.sync(&provider, &node, vec![(first.clone(), running())])
        .await;
    s.wait_for(&dedicated, &first, "running", |i| i["state"] == "running")
        .await;
    let urgent = s
        .create(
            &dedicated,
            json!({"gpus": 1, "command": ["x"], "priority": 1000}),
        )
        .await;
    let urgent_spot = s
        .create(
            &spot,
            json!({"gpus": 1, "command": ["x"], "billing_class": "spot", "priority": 1000}),
        )
        .await;
    s.wait_for(&dedicated, &urgent, "explained", |i| {
        i["state_reason"]
            .as_str()
            .unwrap_or("")
            .contains("waiting for GPUs")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let f = s.instance(&dedicated, &first).await;
    assert_eq!(
        (f["state"].as_str(), f["stop_requested"].as_bool()),
        (Some("running"), Some(false)),
        "{f}"
    );
    assert_eq!(s.instance(&spot, &urgent_spot).await["state"], "pending");
    // Queue order: priority first; the operator sees every tenant.
    let q = s.ok(&s.operator, Method::GET, "/v1/queue", None).await;
    let ids: Vec<&str> = q["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["instance"]["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 3, "{q}");
    assert_eq!(ids[2], requeued.as_str(), "priority 0 goes last: {q}");
}

fn requeued_spec(i: &Value) -> Value {
    json!([
        i["gpus"],
        i["command"],
        i["billing_class"],
        i["tier"],
        i["priority"],
        i["preemptible"],
        i["tenant_id"]
    ])
}
