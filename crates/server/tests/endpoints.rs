//! Serverless endpoints over real HTTP, with a fake agent (syncs through
//! the agent protocol) and real replica servers on the ports the server
//! gives them: a request waiting at zero replicas starts one at once; a
//! replica enters the gateway's route table only once its readiness path
//! answers; idle past the window it drains and stops (scale to zero); a
//! new revision keeps the old replicas in rotation until new ones are
//! ready; inference keys, the gateway routes' auth and idempotent usage
//! metering.

use std::time::{Duration, Instant};

use flotilla_core::api::ObservedPhase;
use flotilla_testkit::server::{fast, TestServer};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

/// Generous: a loaded two-core CI machine.
const DEADLINE: Duration = Duration::from_secs(60);

struct Env {
    s: TestServer,
    tenant: String,
    key: String,
    provider: String,
    node: String,
}

async fn setup() -> Env {
    let s = flotilla_testkit::server::start(fast()).await;
    let tenant = s.create_tenant("serve").await;
    let key = s.key(&tenant, "tenant_member").await;
    let provider = s.key(&tenant, "provider").await;
    let node = s.register_node(&provider, "n0", &[("H100", 4)]).await;
    Env {
        s,
        tenant,
        key,
        provider,
        node,
    }
}

/// A replica: answers its readiness path with 200 once `ready` is set.
struct Replica {
    ready: std::sync::Arc<std::sync::atomic::AtomicBool>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn replica(port: u16, ready_now: bool) -> Replica {
    use std::sync::atomic::{AtomicBool, Ordering};
    let ready = std::sync::Arc::new(AtomicBool::new(ready_now));
    let r = ready.clone();
    let app = axum::Router::new().route(
        "/health",
        axum::routing::get(move || {
            let r = r.clone();
            async move {
                if r.load(Ordering::SeqCst) {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("the replica's port is free");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx.await;
            })
            .await;
    });
    Replica { ready, _stop: tx }
}

impl Env {
    async fn create(&self, body: Value) -> Value {
        let (st, b) = self
            .s
            .call(&self.key, Method::POST, "/v1/endpoints", Some(body))
            .await;
        assert_eq!(st, StatusCode::CREATED, "{b}");
        b
    }

    async fn get(&self, id: &str) -> Value {
        self.s
            .ok(&self.key, Method::GET, &format!("/v1/endpoints/{id}"), None)
            .await
    }

    async fn routes(&self) -> Value {
        self.s
            .ok(&self.provider, Method::GET, "/v1/gateway/routes", None)
            .await
    }

    async fn route_of(&self, id: &str) -> Value {
        let r = self.routes().await;
        r["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["id"] == id)
            .cloned()
            .unwrap_or(Value::Null)
    }

    async fn signal(&self, id: &str, in_flight: u32, queued: u32, total: u64) {
        let body = json!({"signals": [{
            "endpoint_id": id, "at": chrono::Utc::now(), "in_flight": in_flight,
            "queued": queued, "requests_total": total
        }]});
        self.s
            .ok(
                &self.provider,
                Method::POST,
                "/v1/gateway/signals",
                Some(body),
            )
            .await;
    }

    /// One agent sync reporting `observed`; the assignments.
    async fn sync(&self, observed: Vec<(String, ObservedPhase)>) -> Vec<Value> {
        self.s.sync(&self.provider, &self.node, observed).await
    }

    /// Polls `f` on the endpoint until it holds.
    async fn wait_for(&self, id: &str, what: &str, f: impl Fn(&Value) -> bool) -> Value {
        let start = Instant::now();
        loop {
            let ep = self.get(id).await;
            if f(&ep) {
                return ep;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "timed out waiting for {what}: {ep}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Syncs until `inst` is assigned to the node; its assignment.
    async fn assignment(&self, inst: &str, observed: &[(String, ObservedPhase)]) -> Value {
        let start = Instant::now();
        loop {
            let a = self.sync(observed.to_vec()).await;
            if let Some(x) = a.iter().find(|x| x["instance_id"] == inst) {
                return x.clone();
            }
            assert!(start.elapsed() < DEADLINE, "{inst} never assigned");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn running() -> ObservedPhase {
    ObservedPhase::Running { pid: 4242 }
}

fn port_of(a: &Value) -> u16 {
    a["env"]["PORT"]
        .as_str()
        .expect("PORT in the replica's env")
        .parse()
        .expect("a port")
}

#[tokio::test]
async fn bad_bodies_name_the_field_and_names_are_unique_per_tenant() {
    let e = setup().await;
    for (body, field) in [
        (json!({"name": "Chat", "command": ["x"]}), "name"),
        (json!({"name": "chat", "command": []}), "command"),
        (
            json!({"name": "chat", "command": ["x"], "policy": "vpa"}),
            "policy",
        ),
        (
            json!({"name": "chat", "command": ["x"], "min_replicas": 3, "max_replicas": 1}),
            "min_replicas",
        ),
        (
            json!({"name": "chat", "command": ["x"], "gpu_types": ["Z80"]}),
            "gpu_types[0]",
        ),
        (
            json!({"name": "chat", "command": ["x"], "env": {"PORT": "1"}}),
            "env.PORT",
        ),
    ] {
        let (st, b) =
            e.s.call(&e.key, Method::POST, "/v1/endpoints", Some(body))
                .await;
        assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
        assert_eq!(b["error"]["details"]["field"], field, "{b}");
    }
    let ep = e.create(json!({"name": "chat", "command": ["x"]})).await;
    assert_eq!(ep["revision"], 1);
    assert_eq!(ep["spec"]["models"], json!(["chat"]));
    let (st, _) =
        e.s.call(
            &e.key,
            Method::POST,
            "/v1/endpoints",
            Some(json!({"name": "chat", "command": ["y"]})),
        )
        .await;
    assert_eq!(st, StatusCode::CONFLICT);
    // Another tenant sees nothing of it.
    let other = e.s.create_tenant("other").await;
    let okey = e.s.key(&other, "tenant_member").await;
    let id = ep["id"].as_str().unwrap();
    let (st, _) =
        e.s.call(&okey, Method::GET, &format!("/v1/endpoints/{id}"), None)
            .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (st, _) =
        e.s.call(
            &okey,
            Method::PATCH,
            &format!("/v1/endpoints/{id}"),
            Some(json!({"max_replicas": 2})),
        )
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    // Pages.
    e.create(json!({"name": "embed", "command": ["x"]})).await;
    let p =
        e.s.ok(&e.key, Method::GET, "/v1/endpoints?limit=1", None)
            .await;
    assert_eq!(p["items"].as_array().unwrap().len(), 1);
    let cursor = p["next_cursor"].as_str().expect("a second page");
    let p2 =
        e.s.ok(
            &e.key,
            Method::GET,
            &format!("/v1/endpoints?limit=1&cursor={cursor}"),
            None,
        )
        .await;
    assert_ne!(p2["items"][0]["id"], p["items"][0]["id"]);
    // A tenant key may not read the gateway's routes.
    let (st, _) =
        e.s.call(&e.key, Method::GET, "/v1/gateway/routes", None)
            .await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    let _ = &e.tenant;
}

#[tokio::test]
async fn scales_from_zero_on_a_waiting_request_and_back_to_zero_when_idle() {
    let e = setup().await;
    let ep = e
        .create(json!({
            "name": "chat", "command": ["serve"], "gpus": 1, "max_replicas": 2,
            "idle_window_s": 2, "drain_grace_ms": 300
        }))
        .await;
    let id = ep["id"].as_str().unwrap().to_string();
    // Nothing asked for: no replica, an empty route.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(e.get(&id).await["replicas"], json!([]));
    assert_eq!(e.route_of(&id).await["replicas"], json!([]));

    // A request waits at zero: a replica is started at once.
    e.signal(&id, 0, 1, 1).await;
    let ep = e
        .wait_for(&id, "a replica", |ep| {
            ep["replicas"].as_array().is_some_and(|r| r.len() == 1)
        })
        .await;
    let inst = ep["replicas"][0]["instance_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(ep["reason"], "activator", "{ep}");
    let a = e.assignment(&inst, &[]).await;
    let port = port_of(&a);
    assert_eq!(a["env"]["FLOTILLA_ENDPOINT_ID"], id.as_str());

    // Running but not answering its readiness path: not routed.
    let rep = replica(port, false).await;
    e.sync(vec![(inst.clone(), running())]).await;
    e.signal(&id, 0, 1, 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(e.route_of(&id).await["replicas"], json!([]));
    // Ready: routed.
    rep.ready.store(true, std::sync::atomic::Ordering::SeqCst);
    let start = Instant::now();
    loop {
        let r = e.route_of(&id).await;
        if r["replicas"].as_array().is_some_and(|r| r.len() == 1) {
            assert_eq!(r["replicas"][0]["url"], format!("http://127.0.0.1:{port}"));
            assert_eq!(r["replicas"][0]["draining"], false);
            break;
        }
        assert!(start.elapsed() < DEADLINE, "never routed: {r}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Served, then idle past the window: drained first, then stopped.
    e.signal(&id, 1, 0, 2).await;
    e.signal(&id, 0, 0, 2).await;
    let mut saw_draining = false;
    let start = Instant::now();
    loop {
        let r = e.route_of(&id).await;
        if r["replicas"][0]["draining"] == true {
            saw_draining = true;
        }
        let a = e.sync(vec![(inst.clone(), running())]).await;
        if a.iter()
            .any(|x| x["instance_id"] == inst.as_str() && x["stop"] == true)
        {
            break;
        }
        assert!(start.elapsed() < DEADLINE, "never stopped: {r}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        saw_draining,
        "the replica left rotation before it was stopped"
    );
    e.sync(vec![(
        inst.clone(),
        ObservedPhase::Exited {
            code: 143,
            stopped: true,
        },
    )])
    .await;
    let ep = e
        .wait_for(&id, "zero replicas", |ep| ep["replicas"] == json!([]))
        .await;
    assert_eq!(ep["desired_replicas"], 0);
    assert_eq!(ep["reason"], "idle");
    drop(rep);
}

#[tokio::test]
async fn a_new_revision_replaces_replicas_only_once_they_are_ready() {
    let e = setup().await;
    let ep = e
        .create(json!({
            "name": "chat", "command": ["serve", "--v1"], "min_replicas": 1, "max_replicas": 1,
            "drain_grace_ms": 300
        }))
        .await;
    let id = ep["id"].as_str().unwrap().to_string();
    let ep = e
        .wait_for(&id, "the minimum replica", |ep| {
            ep["replicas"].as_array().is_some_and(|r| r.len() == 1)
        })
        .await;
    let old = ep["replicas"][0]["instance_id"]
        .as_str()
        .unwrap()
        .to_string();
    let a = e.assignment(&old, &[]).await;
    let _old_rep = replica(port_of(&a), true).await;
    e.sync(vec![(old.clone(), running())]).await;
    e.wait_for(&id, "the old replica ready", |ep| {
        ep["replicas"][0]["ready"] == true
    })
    .await;

    // A non-revision change keeps the revision.
    let ep =
        e.s.ok(
            &e.key,
            Method::PATCH,
            &format!("/v1/endpoints/{id}"),
            Some(json!({"queue_limit": 5})),
        )
        .await;
    assert_eq!(ep["revision"], 1);
    let ep =
        e.s.ok(
            &e.key,
            Method::PATCH,
            &format!("/v1/endpoints/{id}"),
            Some(json!({"command": ["serve", "--v2"]})),
        )
        .await;
    assert_eq!(ep["revision"], 2);
    let ep = e
        .wait_for(&id, "a revision-2 replica", |ep| {
            ep["replicas"]
                .as_array()
                .is_some_and(|r| r.iter().any(|x| x["revision"] == 2))
        })
        .await;
    let new = ep["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["revision"] == 2)
        .unwrap()["instance_id"]
        .as_str()
        .unwrap()
        .to_string();
    let a = e.assignment(&new, &[(old.clone(), running())]).await;
    assert_eq!(a["command"], json!(["serve", "--v2"]));
    let new_rep = replica(port_of(&a), false).await;
    e.sync(vec![(old.clone(), running()), (new.clone(), running())])
        .await;
    // While the new one is not ready, the old one serves, not draining.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = e.route_of(&id).await;
    assert_eq!(r["replicas"].as_array().unwrap().len(), 1, "{r}");
    assert_eq!(r["replicas"][0]["instance_id"], old.as_str());
    assert_eq!(r["replicas"][0]["draining"], false);
    // Ready: the new one serves, the old one drains, then is stopped.
    new_rep
        .ready
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let start = Instant::now();
    loop {
        let r = e.route_of(&id).await;
        let reps = r["replicas"].as_array().unwrap().clone();
        // Never a moment without a replica taking traffic.
        assert!(
            reps.iter().any(|x| x["draining"] == false),
            "no replica in rotation: {r}"
        );
        let a = e
            .sync(vec![(old.clone(), running()), (new.clone(), running())])
            .await;
        if a.iter()
            .any(|x| x["instance_id"] == old.as_str() && x["stop"] == true)
        {
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "the old replica never stopped: {r}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = e.route_of(&id).await;
    assert!(r["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .all(|x| x["revision"] == 2));
}

#[tokio::test]
async fn inference_keys_the_gateway_authorizes_and_meters_once() {
    let e = setup().await;
    let ep = e.create(json!({"name": "chat", "command": ["x"]})).await;
    let id = ep["id"].as_str().unwrap().to_string();
    let other = e.s.create_tenant("other").await;
    let other_admin = e.s.key(&other, "tenant_admin").await;
    // An inference key of another tenant cannot name this endpoint.
    let (st, b) =
        e.s.call(
            &other_admin,
            Method::POST,
            "/v1/keys",
            Some(json!({"role": "tenant_member", "endpoints": [id]})),
        )
        .await;
    assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
    assert_eq!(b["error"]["details"]["field"], "endpoints[0]");
    let admin = e.s.key(&e.tenant, "tenant_admin").await;
    let created =
        e.s.ok(
            &admin,
            Method::POST,
            "/v1/keys",
            Some(json!({"role": "tenant_member", "endpoints": [id]})),
        )
        .await;
    let inference = created["secret"].as_str().unwrap().to_string();
    assert_eq!(created["key"]["endpoints"], json!([id]));
    // It calls the gateway only.
    let (st, _) =
        e.s.call(&inference, Method::GET, "/v1/endpoints", None)
            .await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    let grant =
        e.s.ok(
            &e.provider,
            Method::POST,
            "/v1/gateway/authorize",
            Some(json!({"key": inference})),
        )
        .await;
    assert_eq!(grant["tenant_id"], e.tenant.as_str());
    assert_eq!(grant["endpoints"], json!([id]));
    assert_eq!(grant["over_hard_cap"], false);
    // A plain member key may call every endpoint of its tenant.
    let grant =
        e.s.ok(
            &e.provider,
            Method::POST,
            "/v1/gateway/authorize",
            Some(json!({"key": e.key})),
        )
        .await;
    assert_eq!(grant["endpoints"], json!([]));
    for k in [e.s.operator.clone(), e.provider.clone(), "flt_nope".into()] {
        let (st, _) =
            e.s.call(
                &e.provider,
                Method::POST,
                "/v1/gateway/authorize",
                Some(json!({ "key": k })),
            )
            .await;
        assert_eq!(st, StatusCode::NOT_FOUND);
    }

    // Usage: three requests, sent twice, metered once.
    let now = chrono::Utc::now();
    let usage: Vec<Value> = (0..3)
        .map(|i| {
            json!({
                "request_id": format!("req_01J0000000000000000000000{i}"),
                "endpoint_id": id, "instance_id": "inst_01J00000000000000000000000",
                "started_at": now - chrono::Duration::seconds(2), "finished_at": now,
                "status": 200, "input_tokens": 10, "output_tokens": 20
            })
        })
        .collect();
    let a =
        e.s.ok(
            &e.provider,
            Method::POST,
            "/v1/gateway/usage",
            Some(json!({ "requests": usage })),
        )
        .await;
    assert_eq!(
        (a["accepted"].as_u64(), a["duplicates"].as_u64()),
        (Some(9), Some(0)),
        "{a}"
    );
    let a =
        e.s.ok(
            &e.provider,
            Method::POST,
            "/v1/gateway/usage",
            Some(json!({ "requests": usage })),
        )
        .await;
    assert_eq!(
        (a["accepted"].as_u64(), a["duplicates"].as_u64()),
        (Some(0), Some(9))
    );
    let (st, b) = e
        .s
        .call(
            &e.provider,
            Method::POST,
            "/v1/gateway/usage",
            Some(json!({"requests": [{
                "request_id": "req_01J00000000000000000000009", "endpoint_id": "ep_01J00000000000000000000000",
                "instance_id": "inst_01J00000000000000000000000",
                "started_at": now, "finished_at": now, "status": 200
            }]})),
        )
        .await;
    assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
    assert_eq!(b["error"]["details"]["field"], "requests[0].endpoint_id");
}

/// Gateway usage is priced as serverless requests and tokens on the
/// invoice, and a hard-capped budget the spend reached turns the key
/// grant's `over_hard_cap` on (the gateway's 402).
#[tokio::test]
async fn metered_requests_are_invoiced_and_reach_the_hard_cap() {
    let e = setup().await;
    let ep = e.create(json!({"name": "chat", "command": ["x"]})).await;
    let id = ep["id"].as_str().unwrap().to_string();
    let cat = e.s.ok(&e.key, Method::GET, "/v1/prices", None).await;
    let mut next = cat["versions"][0].clone();
    next.as_object_mut().unwrap().remove("version");
    let effective =
        chrono::SubsecRound::trunc_subsecs(chrono::Utc::now() + chrono::Duration::seconds(2), 3);
    next["effective_from"] = json!(effective.to_rfc3339());
    next["serverless"]["per_request"] = json!({"kind": "flat", "unit_price": "0.01"});
    next["serverless"]["per_million_output_tokens"] = json!({"kind": "flat", "unit_price": "1000"});
    e.s.ok(&e.s.operator, Method::POST, "/v1/prices", Some(next))
        .await;
    let start = Instant::now();
    while e.s.ok(&e.key, Method::GET, "/v1/prices", None).await["in_force"] != 2 {
        assert!(
            start.elapsed() < DEADLINE,
            "the price version never took force"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let admin = e.s.key(&e.tenant, "tenant_admin").await;
    e.s.ok(
        &admin,
        Method::PUT,
        "/v1/budget",
        Some(json!({"limit": "0.05", "hard_cap": true})),
    )
    .await;
    let grant = |k: String| {
        let e = &e;
        async move {
            e.s.ok(
                &e.provider,
                Method::POST,
                "/v1/gateway/authorize",
                Some(json!({ "key": k })),
            )
            .await
        }
    };
    assert_eq!(grant(e.key.clone()).await["over_hard_cap"], false);

    let now = chrono::Utc::now();
    let usage: Vec<Value> = (0..4)
        .map(|i| {
            json!({
                "request_id": format!("req_01J1000000000000000000000{i}"),
                "endpoint_id": id, "instance_id": "inst_01J00000000000000000000000",
                "started_at": now - chrono::Duration::milliseconds(500), "finished_at": now,
                "status": 200, "input_tokens": 7, "output_tokens": 10
            })
        })
        .collect();
    e.s.ok(
        &e.provider,
        Method::POST,
        "/v1/gateway/usage",
        Some(json!({ "requests": usage })),
    )
    .await;
    let period = now.format("%Y-%m").to_string();
    let inv =
        e.s.ok(
            &e.key,
            Method::GET,
            &format!("/v1/invoices/preview?period={period}"),
            None,
        )
        .await;
    let lines = inv["lines"].as_array().unwrap();
    let amount = |kind: &str| {
        lines
            .iter()
            .find(|l| l["kind"] == kind)
            .map(|l| l["amount"].as_str().unwrap_or("").to_string())
    };
    // 4 requests at 0.01; 40 output tokens at 1000 per million.
    assert_eq!(
        amount("serverless_requests").as_deref(),
        Some("0.04"),
        "{inv}"
    );
    assert_eq!(
        amount("serverless_output_tokens").as_deref(),
        Some("0.04"),
        "{inv}"
    );
    // 0.08 spent of a 0.05 hard cap: the gateway is told to refuse.
    assert_eq!(grant(e.key.clone()).await["over_hard_cap"], true);
}

/// A schedule window open now raises the minimum: replicas start with no
/// traffic at all (`reason: schedule`).
#[tokio::test]
async fn an_open_schedule_window_raises_the_minimum() {
    let e = setup().await;
    let now = chrono::Utc::now();
    let hm = |t: chrono::DateTime<chrono::Utc>| t.format("%H:%M").to_string();
    let ep = e
        .create(json!({
            "name": "batch", "command": ["x"], "max_replicas": 3, "timezone": "UTC",
            "schedules": [{
                "start": hm(now - chrono::Duration::minutes(2)),
                "end": hm(now + chrono::Duration::minutes(30)),
                "min_replicas": 2
            }]
        }))
        .await;
    let id = ep["id"].as_str().unwrap().to_string();
    let ep = e
        .wait_for(&id, "the scheduled replicas", |ep| {
            ep["replicas"].as_array().is_some_and(|r| r.len() == 2)
        })
        .await;
    assert_eq!(ep["reason"], "schedule", "{ep}");
    let (st, b) =
        e.s.call(
            &e.key,
            Method::PATCH,
            &format!("/v1/endpoints/{id}"),
            Some(json!({"timezone": "Atlantis/Nowhere"})),
        )
        .await;
    assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
    assert_eq!(b["error"]["details"]["field"], "timezone");
}
