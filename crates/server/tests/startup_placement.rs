//! Startup-aware placement in the server: of two otherwise equal nodes,
//! the one whose agent reports an endpoint's weights (on its disk, or a
//! replica parked in host memory) gets the endpoint's next replica, and
//! the replica's assignment carries the weights it will load. A parked
//! replica the node no longer reports is billed its host memory.

use std::time::{Duration, Instant};

use flotilla_testkit::server::{fast, TestServer};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

/// Generous: a loaded two-core CI machine.
const DEADLINE: Duration = Duration::from_secs(20);

/// One agent sync of `node` reporting the weights it holds; its
/// assignments.
async fn report(s: &TestServer, key: &str, node: &str, weights: Value) -> Vec<Value> {
    s.ok(
        key,
        Method::POST,
        &format!("/v1/agent/nodes/{node}/sync"),
        Some(json!({"observed": [], "wait_ms": 0, "weights": weights})),
    )
    .await["assignments"]
        .as_array()
        .expect("assignments")
        .clone()
}

/// What [`place_one`] set up and saw.
struct Placed {
    s: TestServer,
    key: String,
    provider: String,
    /// The node that got the replica, and its assignment.
    got: String,
    assignment: Value,
    first: String,
    second: String,
}

/// Deploys an endpoint at zero replicas (Flotilla's policy starts none
/// without traffic), lets the second node report what `held(weights key,
/// endpoint id)` says, asks for one replica and returns the node that got
/// it.
async fn place_one(held: impl Fn(&str, &str) -> Value) -> Placed {
    let s = flotilla_testkit::server::start(fast()).await;
    let tenant = s.create_tenant("serve").await;
    let key = s.key(&tenant, "tenant_admin").await;
    let provider = s.key(&tenant, "provider").await;
    // Registered first: the placement policy's choice between equals.
    let first = s.register_node(&provider, "n0", &[("H100", 4)]).await;
    let second = s.register_node(&provider, "n1", &[("H100", 4)]).await;
    let (st, ep) = s
        .call(
            &key,
            Method::POST,
            "/v1/endpoints",
            Some(json!({"name": "chat", "command": ["x"], "model_gb": 16,
                        "max_replicas": 1})),
        )
        .await;
    assert_eq!(st, StatusCode::CREATED, "{ep}");
    let id = ep["id"].as_str().unwrap().to_string();
    let weights_key = format!("{id}-r1");
    report(&s, &provider, &second, held(&weights_key, &id)).await;
    report(&s, &provider, &first, json!([])).await;
    let shown = s
        .ok(
            &s.operator,
            Method::GET,
            &format!("/v1/nodes/{second}"),
            None,
        )
        .await;
    assert_eq!(shown["weights"][0]["key"], weights_key, "{shown}");
    // Nothing placed yet: what the nodes hold is known before the
    // placement.
    let now = s
        .ok(&key, Method::GET, &format!("/v1/endpoints/{id}"), None)
        .await;
    assert_eq!(now["replicas"], json!([]), "{now}");
    s.ok(
        &key,
        Method::PATCH,
        &format!("/v1/endpoints/{id}"),
        Some(json!({"min_replicas": 1})),
    )
    .await;
    let start = Instant::now();
    loop {
        for (node, holds) in [(&first, json!([])), (&second, held(&weights_key, &id))] {
            let got = report(&s, &provider, node, holds).await;
            if let Some(a) = got.first() {
                return Placed {
                    got: node.clone(),
                    assignment: a.clone(),
                    s,
                    key,
                    provider,
                    first: first.clone(),
                    second: second.clone(),
                };
            }
        }
        if start.elapsed() > DEADLINE {
            let ep = s
                .ok(&key, Method::GET, &format!("/v1/endpoints/{id}"), None)
                .await;
            let q = s.ok(&s.operator, Method::GET, "/v1/queue", None).await;
            panic!("the replica was never placed: {ep} {q}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The tenant's usage of the last and next hour.
fn usage_path() -> String {
    let from = (chrono::Utc::now() - chrono::Duration::hours(1)).to_rfc3339();
    let to = (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339();
    format!(
        "/v1/usage?limit=100&from={}&to={}",
        from.replace('+', "%2B"),
        to.replace('+', "%2B")
    )
}

#[tokio::test]
async fn the_node_holding_the_weights_on_disk_gets_the_replica() {
    let p = place_one(|key, _| {
        json!([{"key": key, "tier": "cached", "size_bytes": 16_000_000_000u64,
                "since": chrono::Utc::now()}])
    })
    .await;
    assert_ne!(
        p.got, p.first,
        "the policy's default choice won over the cache"
    );
    assert_eq!(p.got, p.second);
    let a = &p.assignment;
    // The replica is told its weights; the agent adds the tier.
    assert_eq!(a["env"]["FLOTILLA_MODEL_GB"], "16", "{a}");
    assert_eq!(a["env"]["FLOTILLA_KEEP_PARKED_S"], "600", "{a}");
}

#[tokio::test]
async fn a_parked_replica_wins_its_node_the_next_one_and_is_billed_when_it_ends() {
    // A parked replica of the same weights on the second node.
    let replica = "inst_01hzzzzzzzzzzzzzzzzzzzzzzz";
    let parked_at = chrono::Utc::now() - chrono::Duration::seconds(120);
    let p = place_one(|key, ep| {
        json!([{"key": key, "tier": "parked", "size_bytes": 16_000_000_000u64,
                "since": parked_at, "replica": replica, "endpoint_id": ep}])
    })
    .await;
    assert_eq!(p.got, p.second);
    // The new replica took the park back onto a GPU: the node reports it
    // no more, and its 16 GB for about two minutes are billed once.
    report(&p.s, &p.provider, &p.second, json!([])).await;
    report(&p.s, &p.provider, &p.second, json!([])).await;
    let usage = p.s.ok(&p.key, Method::GET, &usage_path(), None).await;
    let parked: Vec<&Value> = usage["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["meter"] == "parked_gb_seconds" || e["meter"]["meter"] == "parked_gb_seconds")
        .collect();
    assert_eq!(parked.len(), 1, "{usage}");
    assert_eq!(parked[0]["amount"], "16", "{usage}");
    let secs = (chrono::DateTime::parse_from_rfc3339(parked[0]["end"].as_str().unwrap()).unwrap()
        - chrono::DateTime::parse_from_rfc3339(parked[0]["start"].as_str().unwrap()).unwrap())
    .num_seconds();
    assert!((120..600).contains(&secs), "{secs} s parked");
}

#[tokio::test]
async fn weight_reports_are_validated_naming_the_entry() {
    let s = flotilla_testkit::server::start(fast()).await;
    let tenant = s.create_tenant("serve").await;
    let provider = s.key(&tenant, "provider").await;
    let node = s.register_node(&provider, "n0", &[("H100", 1)]).await;
    for (weights, field) in [
        (
            json!([{"key": "k", "tier": "remote", "size_bytes": 1, "since": chrono::Utc::now()}]),
            "weights[0].tier",
        ),
        (
            json!([{"key": "k", "tier": "parked", "size_bytes": 1, "since": chrono::Utc::now()}]),
            "weights[0].replica",
        ),
        (
            json!([{"key": "", "tier": "cached", "size_bytes": 1, "since": chrono::Utc::now()}]),
            "weights[0].key",
        ),
    ] {
        let (st, b) = s
            .call(
                &provider,
                Method::POST,
                &format!("/v1/agent/nodes/{node}/sync"),
                Some(json!({"observed": [], "wait_ms": 0, "weights": weights})),
            )
            .await;
        assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
        assert_eq!(b["error"]["details"]["field"], field, "{b}");
    }
}
