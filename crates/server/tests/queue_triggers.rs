//! Endpoint triggers beyond traffic, through the real router and the real
//! endpoint controller on a manual clock: a schedule raises the minimum at
//! its window's start (not a minute before) and lets go at its end; queue
//! triggers are validated at the edge in create and update (the error
//! names the field), their broker password is never shown (and a change
//! that sends the shown URL back keeps it), and a broker that does not
//! answer is an error on the endpoint that asks for no replicas.

use axum::http::StatusCode;
use chrono::{Duration, TimeZone, Utc};
use flotilla_core::id::EndpointId;
use flotilla_server::endpoints::Controller;
use flotilla_testkit::server::OnClock;
use serde_json::{json, Value};

/// The server on a manual clock, with a tenant member key.
struct Live {
    on: OnClock,
    key: String,
}

impl std::ops::Deref for Live {
    type Target = OnClock;
    fn deref(&self) -> &OnClock {
        &self.on
    }
}

impl Live {
    async fn new(start: chrono::DateTime<Utc>) -> Self {
        Self::with_config(start, flotilla_server::ServerConfig::default()).await
    }

    async fn with_config(
        start: chrono::DateTime<Utc>,
        config: flotilla_server::ServerConfig,
    ) -> Self {
        let on = OnClock::with_config(start, config).await;
        let op = on.operator.clone();
        let (_, t) = on
            .call(&op, "POST", "/v1/tenants", Some(json!({"name": "batch"})))
            .await;
        let (_, k) = on
            .call(
                &op,
                "POST",
                "/v1/keys",
                Some(json!({"tenant_id": t["id"], "role": "tenant_member"})),
            )
            .await;
        let key = k["secret"].as_str().expect("a key").to_string();
        Self { on, key }
    }

    async fn req(&self, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        self.on.call(&self.key, method, path, body).await
    }

    async fn create(&self, body: Value) -> Value {
        let (st, b) = self.req("POST", "/v1/endpoints", Some(body)).await;
        assert_eq!(st, StatusCode::CREATED, "{b}");
        b
    }

    async fn get(&self, id: &str) -> Value {
        let (st, b) = self.req("GET", &format!("/v1/endpoints/{id}"), None).await;
        assert_eq!(st, StatusCode::OK, "{b}");
        b
    }
}

#[tokio::test]
async fn a_schedule_raises_the_minimum_at_its_windows_start_and_lets_go_at_its_end() {
    // Monday 2026-06-01, 08:59 in Paris (06:59 UTC, CEST).
    let live = Live::new(Utc.with_ymd_and_hms(2026, 6, 1, 6, 59, 0).unwrap()).await;
    let ep = live
        .create(json!({
            "name": "batch", "command": ["x"], "max_replicas": 4, "idle_window_s": 60,
            "timezone": "Europe/Paris",
            "schedules": [{"days": ["mon"], "start": "09:00", "end": "09:30", "min_replicas": 2}]
        }))
        .await;
    let id = ep["id"].as_str().unwrap().to_string();
    let mut ctl = Controller::new(live.st.config().egress());
    // A second before the window: nothing.
    live.clock.advance(Duration::seconds(59));
    ctl.pass(&live.st).await.unwrap();
    let ep = live.get(&id).await;
    assert_eq!(ep["desired_replicas"], 0, "{ep}");
    assert_eq!(ep["replicas"], json!([]), "{ep}");
    // At 09:00:00 the minimum is 2: two replicas start with no traffic.
    live.clock.advance(Duration::seconds(1));
    let out = ctl.pass(&live.st).await.unwrap();
    let o = out.iter().find(|o| o.endpoint.as_str() == id).unwrap();
    assert_eq!(
        (o.desired, o.reason.as_str(), o.started),
        (2, "schedule", 2)
    );
    let ep = live.get(&id).await;
    assert_eq!(ep["replicas"].as_array().unwrap().len(), 2, "{ep}");
    // At 09:30 the window shuts: idle for longer than its window, the
    // endpoint goes back to zero.
    live.clock.advance(Duration::minutes(30));
    let out = ctl.pass(&live.st).await.unwrap();
    let o = out.iter().find(|o| o.endpoint.as_str() == id).unwrap();
    assert_eq!((o.desired, o.reason.as_str()), (0, "idle"));
}

#[tokio::test]
async fn queue_triggers_are_validated_redacted_and_a_dead_broker_asks_for_nothing() {
    // The operator lets triggers reach this machine's loopback (where the
    // dead broker below is); nothing else inward.
    let live = Live::with_config(
        Utc.with_ymd_and_hms(2026, 6, 1, 12, 0, 0).unwrap(),
        flotilla_server::ServerConfig {
            allow_egress: vec!["127.0.0.0/8".parse().unwrap()],
            ..Default::default()
        },
    )
    .await;
    let base = json!({"name": "jobs", "command": ["x"], "max_replicas": 3});
    let with = |triggers: Value| {
        let mut b = base.clone();
        b["queue_triggers"] = triggers;
        b
    };
    for (triggers, field) in [
        (
            json!([{"kind": "rabbitmq", "url": "http://h", "queue": "q"}]),
            "queue_triggers[0].url",
        ),
        (
            json!([{"kind": "rabbitmq", "url": "amqp://h"}]),
            "queue_triggers[0].queue",
        ),
        (
            json!([{"kind": "nats", "url": "nats://h", "stream": "S"}]),
            "queue_triggers[0].consumer",
        ),
        (
            json!([{"kind": "nats", "url": "nats://h", "stream": "S", "consumer": "C",
                    "messages_per_replica": 0}]),
            "queue_triggers[0].messages_per_replica",
        ),
    ] {
        let (st, b) = live
            .req("POST", "/v1/endpoints", Some(with(triggers)))
            .await;
        assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
        assert_eq!(b["error"]["details"]["field"], field, "{b}");
    }
    let (st, b) = live
        .req(
            "POST",
            "/v1/endpoints",
            Some(with(json!([{"kind": "kafka", "url": "x"}]))),
        )
        .await;
    assert!(st.is_client_error(), "{st} {b}");

    // A port nothing listens on: the broker is down.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap();
    let url = format!("amqp://worker:s3cr3t-pw@127.0.0.1:{port}/%2f");
    let ep = live
        .create(with(
            json!([{"kind": "rabbitmq", "url": url, "queue": "jobs"}]),
        ))
        .await;
    let id = ep["id"].as_str().unwrap().to_string();
    assert!(!ep.to_string().contains("s3cr3t-pw"), "{ep}");
    let shown = format!("amqp://worker:***@127.0.0.1:{port}/%2f");
    assert_eq!(ep["spec"]["queue_triggers"][0]["url"], shown);
    assert_eq!(ep["spec"]["queue_triggers"][0]["messages_per_replica"], 10);

    let mut ctl = Controller::new(live.st.config().egress());
    let out = ctl.pass(&live.st).await.unwrap();
    let o = out.iter().find(|o| o.endpoint.as_str() == id).unwrap();
    assert_eq!(o.desired, 0);
    let ep = live.get(&id).await;
    let t = &ep["triggers"][0];
    assert_eq!(t["trigger"], "rabbitmq:jobs", "{ep}");
    assert!(
        t["error"].as_str() == Some("broker unreachable"),
        "refused, reset and timed out read alike: {ep}"
    );
    assert_eq!(t["wants"], 0);
    assert!(t.get("depth").is_none(), "{ep}");
    assert!(!ep.to_string().contains("s3cr3t-pw"), "{ep}");
    let (_, list) = live.req("GET", "/v1/endpoints", None).await;
    assert!(!list.to_string().contains("s3cr3t-pw"), "{list}");

    // Sending the shown trigger back (a read-modify-write) keeps the
    // stored password; the answer still hides it.
    let mut back = ep["spec"]["queue_triggers"].clone();
    back[0]["messages_per_replica"] = json!(25);
    let (st, b) = live
        .req(
            "PATCH",
            &format!("/v1/endpoints/{id}"),
            Some(json!({"queue_triggers": back})),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{b}");
    assert!(!b.to_string().contains("s3cr3t-pw"), "{b}");
    let stored = live
        .st
        .store()
        .endpoint(&EndpointId::parse(&id, "id").unwrap())
        .await
        .unwrap();
    assert_eq!(stored.spec.queue_triggers[0].url, url);
    assert_eq!(stored.spec.queue_triggers[0].messages_per_replica, 25);
    // An update is validated like a create.
    let (st, b) = live
        .req(
            "PATCH",
            &format!("/v1/endpoints/{id}"),
            Some(
                json!({"queue_triggers": [{"kind": "nats", "url": "amqp://h",
                        "stream": "S", "consumer": "C"}]}),
            ),
        )
        .await;
    assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
    assert_eq!(b["error"]["details"]["field"], "queue_triggers[0].url");
    // `[]` removes the triggers, and the next pass forgets their reads.
    let (st, b) = live
        .req(
            "PATCH",
            &format!("/v1/endpoints/{id}"),
            Some(json!({"queue_triggers": []})),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{b}");
    ctl.pass(&live.st).await.unwrap();
    let ep = live.get(&id).await;
    assert!(ep.get("triggers").is_none(), "{ep}");
}

#[tokio::test]
async fn a_trigger_the_rule_no_longer_allows_is_refused_at_every_read_without_connecting() {
    // A listener standing in for a broker: it exists and is reachable
    // (the test connects to it first), so only the rule keeps the server
    // out.
    let broker = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = broker.local_addr().unwrap().port();
    broker.set_nonblocking(true).unwrap();
    drop(std::net::TcpStream::connect(("127.0.0.1", port)).unwrap());
    let (probe, _) = broker.accept().expect("the test's own probe");
    drop(probe);

    let live = Live::with_config(
        Utc.with_ymd_and_hms(2026, 6, 1, 12, 0, 0).unwrap(),
        flotilla_server::ServerConfig {
            allow_egress: vec![format!("127.0.0.1:{port}").parse().unwrap()],
            ..Default::default()
        },
    )
    .await;
    let ep = live
        .create(json!({"name": "jobs", "command": ["x"], "max_replicas": 3,
            "queue_triggers": [{"kind": "rabbitmq", "queue": "jobs",
                "url": format!("amqp://worker:pw@127.0.0.1:{port}/%2f")}]}))
        .await;
    let id = ep["id"].as_str().unwrap().to_string();
    // The operator drops the rule (a restart without it): every read
    // checks again and refuses before connecting.
    let mut ctl = Controller::new(flotilla_egress::EgressPolicy::default());
    ctl.pass(&live.st).await.unwrap();
    let ep = live.get(&id).await;
    let error = ep["triggers"][0]["error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with("broker unreachable: 127.0.0.1") && error.contains("loopback"),
        "{ep}"
    );
    assert_eq!(ep["triggers"][0]["wants"], 0, "{ep}");
    assert!(
        matches!(broker.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the server connected to a refused broker"
    );
}
