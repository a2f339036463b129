//! How the scheduler shares the pool, over real HTTP with fake agents: the
//! GPUs a preemption frees go to the preemptor and to no one else, even a
//! more urgent third party that arrives during the notice.

use std::time::Duration;

use flotilla_core::api::ObservedPhase;
use flotilla_testkit::server::{fast, TestServer};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

async fn create(s: &TestServer, key: &str, body: Value) -> String {
    let (status, b) = s.call(key, Method::POST, "/v1/instances", Some(body)).await;
    assert_eq!(status, StatusCode::CREATED, "{b}");
    b["id"].as_str().unwrap().to_string()
}

async fn instance(s: &TestServer, key: &str, id: &str) -> Value {
    s.ok(key, Method::GET, &format!("/v1/instances/{id}"), None)
        .await
}

async fn wait_for(
    s: &TestServer,
    key: &str,
    id: &str,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    for _ in 0..200 {
        let i = instance(s, key, id).await;
        if pred(&i) {
            return i;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{id} never {what}: {}", instance(s, key, id).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpus_freed_by_a_preemption_go_to_the_preemptor_not_a_third_party() {
    let s = flotilla_testkit::server::start(fast()).await;
    let owner = s.create_tenant("owner").await;
    let provider = s.key(&owner, "provider").await;
    let node = s.register_node(&provider, "n1", &[("H100", 2)]).await;
    let spot_t = s.create_tenant("spot").await;
    let spot = s.key(&spot_t, "tenant_member").await;
    let ded_t = s.create_tenant("dedicated").await;
    let ded = s.key(&ded_t, "tenant_member").await;
    let third_t = s.create_tenant("third").await;
    let third = s.key(&third_t, "tenant_member").await;

    let victim = create(
        &s,
        &spot,
        json!({"gpus": 2, "command": ["x"], "billing_class": "spot"}),
    )
    .await;
    wait_for(&s, &spot, &victim, "scheduled", |i| {
        i["state"] == "scheduled"
    })
    .await;
    s.sync(
        &provider,
        &node,
        vec![(victim.clone(), ObservedPhase::Running { pid: 1 })],
    )
    .await;
    let preemptor = create(&s, &ded, json!({"gpus": 2, "command": ["serve"]})).await;
    wait_for(&s, &spot, &victim, "preempted", |i| {
        i["stop_requested"] == true
    })
    .await;

    // During the notice a more urgent instance arrives that needs one GPU:
    // it comes first in the queue, yet must not take what the preemption
    // frees.
    let urgent = create(
        &s,
        &third,
        json!({"gpus": 1, "command": ["y"], "priority": 500}),
    )
    .await;
    let q = s.ok(&s.operator, Method::GET, "/v1/queue", None).await;
    assert_eq!(q["items"][0]["instance"]["id"], urgent.as_str(), "{q}");
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
    let p = wait_for(&s, &ded, &preemptor, "scheduled", |i| {
        i["state"] == "scheduled"
    })
    .await;
    assert_eq!(p["gpu_ids"].as_array().unwrap().len(), 2);
    let u = instance(&s, &third, &urgent).await;
    assert_eq!(u["state"], "pending", "{u}");
}

async fn set_quota(s: &TestServer, tenant: &str, body: Value) -> Value {
    let (status, b) = s
        .call(
            &s.operator,
            Method::PUT,
            &format!("/v1/tenants/{tenant}/quota"),
            Some(body),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{b}");
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_weights_tilt_the_fair_share_order() {
    let s = flotilla_testkit::server::start(fast()).await;
    let a_t = s.create_tenant("heavy").await;
    let a = s.key(&a_t, "tenant_member").await;
    let b_t = s.create_tenant("light").await;
    let b = s.key(&b_t, "tenant_member").await;
    // No node: everything stays queued, in the scheduler's order.
    let mut ids = Vec::new();
    for key in [&a, &a, &a, &a, &b, &b, &b, &b] {
        ids.push(create(&s, key, json!({"gpus": 1, "command": ["x"]})).await);
    }
    let order = |q: Value| -> String {
        q["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let id = e["instance"]["id"].as_str().unwrap();
                if ids[..4].iter().any(|x| x == id) {
                    'a'
                } else {
                    'b'
                }
            })
            .collect()
    };
    let q = s.ok(&s.operator, Method::GET, "/v1/queue", None).await;
    assert_eq!(order(q), "abababab", "equal weights alternate");
    let (status, e) = s
        .call(
            &s.operator,
            Method::PUT,
            &format!("/v1/tenants/{a_t}/quota"),
            Some(json!({"weight": 0})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{e}");
    assert_eq!(e["error"]["details"]["field"], "weight");
    let v = set_quota(&s, &a_t, json!({"weight": 3})).await;
    assert_eq!(v["quota"]["weight"], 3);
    let q = s.ok(&s.operator, Method::GET, "/v1/queue", None).await;
    assert_eq!(order(q), "abaaabbb", "weight 3 earns three turns for one");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_within_its_guarantee_reclaims_borrowed_capacity() {
    let s = flotilla_testkit::server::start(fast()).await;
    let owner = s.create_tenant("owner").await;
    let provider = s.key(&owner, "provider").await;
    let node = s.register_node(&provider, "n1", &[("H100", 2)]).await;
    let borrower_t = s.create_tenant("borrower").await;
    let borrower = s.key(&borrower_t, "tenant_member").await;
    let owner_t = s.create_tenant("guaranteed").await;
    let guaranteed = s.key(&owner_t, "tenant_member").await;

    // The borrower's preemptible work fills the pool.
    let lent = create(
        &s,
        &borrower,
        json!({"gpus": 2, "command": ["x"], "billing_class": "spot"}),
    )
    .await;
    wait_for(&s, &borrower, &lent, "scheduled", |i| {
        i["state"] == "scheduled"
    })
    .await;
    s.sync(
        &provider,
        &node,
        vec![(lent.clone(), ObservedPhase::Running { pid: 1 })],
    )
    .await;

    // Work of the same tier and priority may not preempt it...
    let mine = create(
        &s,
        &guaranteed,
        json!({"gpus": 2, "command": ["y"], "billing_class": "spot"}),
    )
    .await;
    wait_for(&s, &guaranteed, &mine, "explained", |i| {
        i["state_reason"]
            .as_str()
            .unwrap_or("")
            .contains("waiting for GPUs")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        instance(&s, &borrower, &lent).await["stop_requested"],
        false
    );

    // ...until the operator guarantees its tenant 2 GPUs: then the borrowed
    // capacity is reclaimed, with the notice.
    let (status, e) = s
        .call(
            &s.operator,
            Method::PUT,
            &format!("/v1/tenants/{owner_t}/quota"),
            Some(json!({"gpus_total": 2, "gpus_guaranteed": 3})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{e}");
    assert_eq!(e["error"]["details"]["field"], "gpus_guaranteed");
    set_quota(&s, &owner_t, json!({"gpus_total": 4, "gpus_guaranteed": 2})).await;
    let v = wait_for(&s, &borrower, &lent, "reclaimed", |i| {
        i["stop_requested"] == true
    })
    .await;
    assert_eq!(v["preempted_by"], mine.as_str());
    s.sync(
        &provider,
        &node,
        vec![(
            lent.clone(),
            ObservedPhase::Exited {
                code: 143,
                stopped: true,
            },
        )],
    )
    .await;
    wait_for(&s, &guaranteed, &mine, "scheduled", |i| {
        i["state"] == "scheduled"
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfill_goes_around_the_blocked_head_and_never_delays_it() {
    let s = flotilla_testkit::server::start(fast()).await;
    let owner = s.create_tenant("owner").await;
    let provider = s.key(&owner, "provider").await;
    let big = s.register_node(&provider, "big", &[("H100", 2)]).await;
    let _small = s.register_node(&provider, "small", &[("L4", 1)]).await;
    let t = s.create_tenant("users").await;
    let key = s.key(&t, "tenant_member").await;

    let running = create(
        &s,
        &key,
        json!({"gpus": 1, "gpu_types": ["H100"], "command": ["x"]}),
    )
    .await;
    wait_for(&s, &key, &running, "scheduled", |i| {
        i["state"] == "scheduled"
    })
    .await;
    s.sync(
        &provider,
        &big,
        vec![(running.clone(), ObservedPhase::Running { pid: 1 })],
    )
    .await;

    // The head needs both H100s: it waits, and holds the H100 node.
    let head = create(
        &s,
        &key,
        json!({"gpus": 2, "gpu_types": ["H100"], "command": ["h"]}),
    )
    .await;
    wait_for(&s, &key, &head, "explained", |i| {
        i["state_reason"]
            .as_str()
            .unwrap_or("")
            .contains("waiting for GPUs")
    })
    .await;
    // Smaller work behind it fits on either node: it goes to the L4 node...
    let first = create(&s, &key, json!({"gpus": 1, "command": ["a"]})).await;
    let f = wait_for(&s, &key, &first, "scheduled", |i| i["state"] == "scheduled").await;
    assert_eq!(f["gpu_model"], "L4", "{f}");
    // ...and once that is full, it waits rather than take the head's H100.
    let second = create(&s, &key, json!({"gpus": 1, "command": ["b"]})).await;
    let w = wait_for(&s, &key, &second, "held back", |i| {
        i["state_reason"]
            .as_str()
            .unwrap_or("")
            .contains("waiting behind")
    })
    .await;
    assert!(w["state_reason"].as_str().unwrap().contains(&head), "{w}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(instance(&s, &key, &second).await["state"], "pending");

    // The running work ends: the head starts at once on the freed node.
    s.sync(
        &provider,
        &big,
        vec![(
            running.clone(),
            ObservedPhase::Exited {
                code: 0,
                stopped: false,
            },
        )],
    )
    .await;
    let h = wait_for(&s, &key, &head, "scheduled", |i| i["state"] == "scheduled").await;
    assert_eq!(h["node_id"], big.as_str());
}
