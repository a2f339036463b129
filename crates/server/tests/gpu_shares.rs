//! GPU sharing over real HTTP with fake agents and a real SQLite store:
//! fractions share a GPU up to its capacity, MIG instances fill a GPU in
//! MIG mode within its geometry, bad share requests are refused naming the
//! field, and a half share is billed half a GPU-second per second.

use std::time::Duration;

use flotilla_core::api::ObservedPhase;
use flotilla_testkit::server::{fast, TestServer};
use reqwest::{Method, StatusCode};
use rust_decimal::Decimal;
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

/// Polls `id` until `pred` holds (generous deadline for a loaded machine).
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

/// A provider with one node of `gpus`, and a tenant member's key.
async fn pool(s: &TestServer, gpus: &[(&str, u32)]) -> (String, String, String) {
    let owner = s.create_tenant("owner").await;
    let provider = s.key(&owner, "provider").await;
    let node = s.register_node(&provider, "n1", gpus).await;
    let t = s.create_tenant("renter").await;
    let member = s.key(&t, "tenant_member").await;
    (provider, node, member)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_half_shares_share_one_gpu_and_a_third_waits() {
    let s = flotilla_testkit::server::start(fast()).await;
    let (provider, node, member) = pool(&s, &[("H100", 1)]).await;
    let half = json!({"gpus": 1, "gpu_fraction": 0.5, "command": ["train"]});
    let a = create(&s, &member, half.clone()).await;
    let b = create(&s, &member, half.clone()).await;
    let mut placed = Vec::new();
    for id in [&a, &b] {
        placed.push(wait_for(&s, &member, id, "scheduled", |i| i["state"] == "scheduled").await);
    }
    let c = create(&s, &member, half).await;
    let waiting = wait_for(&s, &member, &c, "told why it waits", |i| {
        i["state_reason"]
            .as_str()
            .is_some_and(|r| r.contains("too little free GPU share"))
    })
    .await;
    assert_eq!(waiting["state"], "pending", "{waiting}");
    // Both halves hold the same GPU, each its 500 milli and half its memory.
    assert_eq!(placed[0]["gpu_ids"], placed[1]["gpu_ids"]);
    for p in &placed {
        assert_eq!(p["gpu_fraction"], 0.5);
        assert_eq!(p["gpu_slices"][0]["milli"], 500, "{p}");
        assert_eq!(p["gpu_slices"][0]["memory_limit_mib"], 40960, "{p}");
        assert!(p["state_reason"].as_str().unwrap().contains("0.5 × H100"));
    }
    let n = s
        .ok(&s.operator, Method::GET, &format!("/v1/nodes/{node}"), None)
        .await;
    assert_eq!(n["gpus"][0]["used_milli"], 1000, "{n}");
    // The agent is told each one's share.
    let assigned = s.sync(&provider, &node, vec![]).await;
    assert_eq!(assigned.len(), 2);
    for x in &assigned {
        assert_eq!(x["gpu_indices"], json!([0]));
        assert_eq!(x["gpu_slices"][0]["milli"], 500, "{x}");
    }
    // One half ends: the third takes its place.
    s.sync(
        &provider,
        &node,
        vec![(
            a.clone(),
            ObservedPhase::FailedToStart {
                reason: "no such program".into(),
            },
        )],
    )
    .await;
    let third = wait_for(&s, &member, &c, "scheduled", |i| i["state"] == "scheduled").await;
    assert_eq!(third["gpu_ids"], placed[0]["gpu_ids"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_1g_10gb_slices_fill_one_h100_in_mig_mode() {
    let s = flotilla_testkit::server::start(fast()).await;
    let (provider, node, member) = pool(&s, &[("H100:mig", 1), ("H100", 1)]).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let body = json!({"gpus": 1, "mig_profile": "1g.10gb", "command": ["infer"]});
        ids.push(create(&s, &member, body).await);
    }
    let mut devices = Vec::new();
    let mut gpus = Vec::new();
    for id in &ids {
        let i = wait_for(&s, &member, id, "scheduled", |i| i["state"] == "scheduled").await;
        assert_eq!(i["mig_profile"], "1g.10gb");
        assert!(i["state_reason"].as_str().unwrap().contains("H100 1g.10gb"));
        let slice = &i["gpu_slices"][0];
        assert_eq!(slice["mig_profile"], "1g.10gb");
        assert_eq!(slice["memory_limit_mib"], 10240);
        devices.push(slice["mig_device"].as_str().unwrap().to_string());
        gpus.push(i["gpu_ids"][0].clone());
    }
    let n = s
        .ok(&s.operator, Method::GET, &format!("/v1/nodes/{node}"), None)
        .await;
    let mig_gpu = &n["gpus"][0];
    assert_eq!(mig_gpu["mig_mode"], true, "{n}");
    assert!(
        gpus.iter().all(|g| *g == mig_gpu["id"]),
        "all on the MIG GPU"
    );
    assert_eq!(mig_gpu["used_milli"], 3 * 142);
    assert_eq!(
        n["gpus"][1]["used_milli"], 0,
        "the GPU out of MIG mode is untouched"
    );
    devices.sort();
    let uuid = mig_gpu["uuid"].as_str().unwrap();
    let want: Vec<String> = (1..=3).map(|gi| format!("MIG-{uuid}/{gi}/0")).collect();
    assert_eq!(devices, want);
    // The agent gets the MIG devices to put in CUDA_VISIBLE_DEVICES.
    let assigned = s.sync(&provider, &node, vec![]).await;
    let mut told: Vec<String> = assigned
        .iter()
        .map(|a| {
            a["gpu_slices"][0]["mig_device"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    told.sort();
    assert_eq!(told, want);
    // A whole GPU goes to the GPU out of MIG mode, never the MIG one.
    let whole = create(&s, &member, json!({"gpus": 1, "command": ["x"]})).await;
    let w = wait_for(&s, &member, &whole, "scheduled", |i| {
        i["state"] == "scheduled"
    })
    .await;
    assert_eq!(w["gpu_ids"][0], n["gpus"][1]["id"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_share_requests_are_refused_naming_the_field() {
    let s = flotilla_testkit::server::start(fast()).await;
    let (_, _, member) = pool(&s, &[("H100", 1), ("L40S", 1)]).await;
    for (body, field) in [
        // No GPU is in MIG mode: the profile could never be placed.
        (json!({"gpus": 1, "mig_profile": "1g.10gb"}), "mig_profile"),
        // L40S has no MIG geometry at all.
        (
            json!({"gpus": 1, "gpu_types": ["L40S"], "mig_profile": "1g.10gb"}),
            "mig_profile",
        ),
        (json!({"gpus": 1, "mig_profile": "5g.1tb"}), "mig_profile"),
        (json!({"gpus": 1, "gpu_fraction": 1.5}), "gpu_fraction"),
        (json!({"gpus": 1, "gpu_fraction": 0.0001}), "gpu_fraction"),
        (json!({"gpus": 2, "gpu_fraction": 0.5}), "gpus"),
        (
            json!({"gpus": 1, "gpu_fraction": 0.5, "env": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}}),
            "env.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        ),
    ] {
        let mut body = body;
        body["command"] = json!(["x"]);
        let (status, e) = s
            .call(&member, Method::POST, "/v1/instances", Some(body.clone()))
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}: {e}");
        assert_eq!(e["error"]["details"]["field"], field, "{body}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_share_is_invoiced_at_half_a_gpu_second_per_second() {
    let s = flotilla_testkit::server::start(fast()).await;
    let (provider, node, member) = pool(&s, &[("H100", 1)]).await;
    let id = create(
        &s,
        &member,
        json!({"gpus": 1, "gpu_fraction": 0.5, "command": ["train"]}),
    )
    .await;
    wait_for(&s, &member, &id, "scheduled", |i| i["state"] == "scheduled").await;
    s.sync(
        &provider,
        &node,
        vec![(id.clone(), ObservedPhase::Running { pid: 7 })],
    )
    .await;
    wait_for(&s, &member, &id, "running", |i| i["state"] == "running").await;
    // Run for a little while of wall time, then exit.
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_millis(1500) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.sync(
        &provider,
        &node,
        vec![(
            id.clone(),
            ObservedPhase::Exited {
                code: 0,
                stopped: false,
            },
        )],
    )
    .await;
    let done = wait_for(&s, &member, &id, "succeeded", |i| i["state"] == "succeeded").await;
    let at = |k: &str| {
        chrono::DateTime::parse_from_rfc3339(done[k].as_str().unwrap())
            .unwrap()
            .with_timezone(&chrono::Utc)
    };
    // Billing is to the millisecond from the start to the stop.
    let ms = flotilla_billing::meter::to_millisecond;
    let millis = (ms(at("finished_at")) - ms(at("started_at"))).num_milliseconds();
    assert!(millis >= 1500, "{done}");
    let period = at("started_at").format("%Y-%m").to_string();
    // The metering loop turns the run into usage (in one-minute slices, the
    // last when it ends); the preview prices it. Half a GPU-second for
    // every second it ran.
    let want = Decimal::new(millis, 3) / Decimal::from(2);
    let mut last = Value::Null;
    for _ in 0..400 {
        let inv = s
            .ok(
                &member,
                Method::GET,
                &format!("/v1/invoices/preview?period={period}"),
                None,
            )
            .await;
        let found = inv["lines"].as_array().and_then(|ls| {
            ls.iter()
                .find(|l| l["share"] == "0.5 × H100" && l["kind"] == "on_demand")
                .cloned()
        });
        if let Some(l) = found {
            let q: Decimal = l["quantity"].as_str().unwrap().parse().unwrap();
            assert!(
                l["description"]
                    .as_str()
                    .unwrap()
                    .starts_with("0.5 × H100 on-demand"),
                "{l}"
            );
            if q == want {
                return;
            }
            last = l;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no line of {want} GPU-seconds for the half share; last: {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_count_a_share_by_its_share() {
    let s = flotilla_testkit::server::start(fast()).await;
    let t = s.create_tenant("small").await;
    let member = s.key(&t, "tenant_member").await;
    let (status, b) = s
        .call(
            &s.operator,
            Method::PUT,
            &format!("/v1/tenants/{t}/quota"),
            Some(json!({"gpus_total": 1})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{b}");
    let half = json!({"gpus": 1, "gpu_fraction": 0.5, "command": ["x"]});
    create(&s, &member, half.clone()).await;
    create(&s, &member, half.clone()).await;
    let (status, e) = s
        .call(&member, Method::POST, "/v1/instances", Some(half))
        .await;
    assert!(
        status.is_client_error(),
        "a third half exceeds one GPU: {e}"
    );
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("gpus_total"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gang_of_half_shares_takes_a_half_on_each_of_its_nodes() {
    let s = flotilla_testkit::server::start(fast()).await;
    let (provider, _, member) = pool(&s, &[("H100", 1)]).await;
    // `nodes: 2` means two machines, even where one GPU has room for both.
    s.register_node(&provider, "n2", &[("H100", 1)]).await;
    let (status, job) = s
        .call(
            &member,
            Method::POST,
            "/v1/jobs",
            Some(json!({"gpus": 2, "nodes": 2, "gpu_fraction": 0.5, "command": ["train"]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{job}");
    assert_eq!(job["spec"]["gpu_fraction"], 0.5, "{job}");
    let id = job["id"].as_str().unwrap().to_string();
    let mut members = Vec::new();
    for _ in 0..800 {
        let j = s
            .ok(&member, Method::GET, &format!("/v1/jobs/{id}"), None)
            .await;
        let m = j["members"].as_array().cloned().unwrap_or_default();
        if m.len() == 2 {
            members = m;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(members.len(), 2, "both members placed");
    let mut gpus = Vec::new();
    for m in &members {
        let i = instance(&s, &member, m["instance_id"].as_str().unwrap()).await;
        assert_eq!(i["gpu_fraction"], 0.5, "{i}");
        assert_eq!(i["gpu_slices"][0]["milli"], 500, "{i}");
        gpus.push((i["node_id"].clone(), i["gpu_ids"][0].clone()));
    }
    assert_ne!(gpus[0].0, gpus[1].0, "one member per node: {gpus:?}");
    // A MIG job with no GPU in MIG mode is refused like an instance.
    let (status, e) = s
        .call(
            &member,
            Method::POST,
            "/v1/jobs",
            Some(json!({"gpus": 1, "mig_profile": "1g.10gb", "command": ["x"]})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{e}");
    assert_eq!(e["error"]["details"]["field"], "mig_profile");
}
