//! Parked replicas and endpoint deletion, on a manual clock through the
//! agent protocol and the real endpoint controller (issue 26): a
//! scale-down of a live endpoint parks its replica, billed its host
//! memory for as long as it stays parked; a deleted endpoint parks
//! nothing: its replicas stop outright, a replica it had parked is
//! released, and no parked GB-second is billed past the deletion. A park
//! the agent reports ended is billed to the instant it ended on the
//! agent's clock, to the millisecond, once however often it is resent.

use chrono::{DateTime, Duration, TimeZone, Utc};
use flotilla_core::api::{ObservedInstance, ObservedPhase};
use flotilla_core::clock::Clock;
use flotilla_server::endpoints::Controller;
use flotilla_server::schedule::schedule_pass;
use flotilla_testkit::server::OnClock;
use serde_json::{json, Value};

/// 16 GB of weights (GB = 10^9 bytes, as the price book reads it).
const WEIGHTS_BYTES: u64 = 16_000_000_000;

/// The server, its controller, a tenant's keys and one node.
struct Live {
    on: OnClock,
    ctl: Controller,
    key: String,
    provider: String,
    node: String,
}

impl Live {
    async fn new(start: DateTime<Utc>) -> Self {
        let on = OnClock::new(start).await;
        let op = on.operator.clone();
        let t = on
            .ok(&op, "POST", "/v1/tenants", Some(json!({"name": "serve"})))
            .await;
        let key = on.key(&t["id"], "tenant_admin").await;
        let provider = on.key(&t["id"], "provider").await;
        let node = on.register_node(&provider, "n0", &[("H100", 4)]).await;
        let ctl = Controller::new(on.st.config().egress());
        Self {
            on,
            ctl,
            key,
            provider,
            node,
        }
    }

    /// One sync of the node's agent reporting `observed` and the parks
    /// `weights`; the server's answer.
    async fn sync(&self, observed: Vec<ObservedInstance>, weights: Value) -> Value {
        self.on
            .ok(
                &self.provider,
                "POST",
                &format!("/v1/agent/nodes/{}/sync", self.node),
                Some(json!({"observed": observed, "wait_ms": 0, "weights": weights})),
            )
            .await
    }

    /// One sync that also reports `ended` parks (`parks_ended`).
    async fn sync_ended(
        &self,
        observed: Vec<ObservedInstance>,
        weights: Value,
        ended: Value,
    ) -> Value {
        self.on
            .ok(
                &self.provider,
                "POST",
                &format!("/v1/agent/nodes/{}/sync", self.node),
                Some(
                    json!({"observed": observed, "wait_ms": 0, "weights": weights,
                            "parks_ended": ended}),
                ),
            )
            .await
    }

    fn observed(&self, instance: &str, phase: ObservedPhase) -> ObservedInstance {
        ObservedInstance {
            instance_id: serde_json::from_value(json!(instance)).unwrap(),
            phase,
            at: self.on.clock.now(),
            started_at: None,
            message: None,
            container: None,
            weights_tier: None,
            limit_exceeded: None,
        }
    }

    /// A parked entry of `replica` of endpoint `ep`, parked at `since`.
    fn park(ep: &str, replica: &str, since: DateTime<Utc>) -> Value {
        json!({"key": format!("{ep}-r1"), "tier": "parked", "size_bytes": WEIGHTS_BYTES,
               "since": since, "replica": replica, "endpoint_id": ep})
    }

    /// The end of the park of `replica` of `ep` parked at `since`, as the
    /// agent reports it: ended at `ended_at` on its clock.
    fn ended(ep: &str, replica: &str, since: DateTime<Utc>, ended_at: DateTime<Utc>) -> Value {
        json!({"key": format!("{ep}-r1"), "size_bytes": WEIGHTS_BYTES, "since": since,
               "replica": replica, "endpoint_id": ep, "ended_at": ended_at})
    }

    /// Runs the endpoint controller and the scheduler.
    async fn passes(&mut self) {
        self.ctl.pass(&self.on.st).await.expect("an endpoint pass");
        schedule_pass(&self.on.st).await.expect("a scheduling pass");
    }

    /// An endpoint with 16 GB of weights and two replicas running on the
    /// node; its id and its replicas.
    async fn endpoint_of_two(&mut self, name: &str) -> (String, Vec<String>) {
        let ep = self
            .on
            .ok(
                &self.key,
                "POST",
                "/v1/endpoints",
                Some(json!({"name": name, "command": ["x"], "model_gb": 16,
                            "min_replicas": 2, "max_replicas": 2})),
            )
            .await;
        let id = ep["id"].as_str().unwrap().to_string();
        self.passes().await;
        let ep = self
            .on
            .ok(&self.key, "GET", &format!("/v1/endpoints/{id}"), None)
            .await;
        let replicas: Vec<String> = ep["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["instance_id"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(replicas.len(), 2, "{ep}");
        let running = replicas
            .iter()
            .map(|r| self.observed(r, ObservedPhase::Running { pid: 7 }))
            .collect();
        self.sync(running, json!([])).await;
        (id, replicas)
    }

    /// Scales `ep` down to one replica; the replica the controller stopped
    /// (the agent is told to stop it, and not told to release it).
    async fn scale_to_one(&mut self, ep: &str, replicas: &[String]) -> String {
        self.on
            .ok(
                &self.key,
                "PATCH",
                &format!("/v1/endpoints/{ep}"),
                Some(json!({"min_replicas": 1, "max_replicas": 1})),
            )
            .await;
        self.passes().await;
        let answer = self.sync(vec![], json!([])).await;
        let stopped: Vec<String> = stops(&answer)
            .into_iter()
            .filter(|s| replicas.contains(s))
            .collect();
        assert_eq!(stopped.len(), 1, "{answer}");
        assert_eq!(unparks(&answer), Vec::<String>::new(), "{answer}");
        stopped[0].clone()
    }

    /// The tenant's parked-memory usage events of endpoint `ep`.
    async fn parked_usage(&self, ep: &str) -> Vec<Value> {
        let now = self.on.clock.now();
        let path = format!(
            "/v1/usage?limit=100&from={}&to={}",
            (now - Duration::hours(2)).to_rfc3339().replace('+', "%2B"),
            (now + Duration::hours(1)).to_rfc3339().replace('+', "%2B"),
        );
        let usage = self.on.ok(&self.key, "GET", &path, None).await;
        usage["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| {
                (e["meter"] == "parked_gb_seconds" || e["meter"]["meter"] == "parked_gb_seconds")
                    && e["subject"]["id"] == ep
            })
            .cloned()
            .collect()
    }
}

/// The instances an answer asks the agent to stop.
fn stops(answer: &Value) -> Vec<String> {
    answer["assignments"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["stop"] == true)
        .map(|a| a["instance_id"].as_str().unwrap().to_string())
        .collect()
}

/// The replicas an answer tells the agent not to park or to release.
fn unparks(answer: &Value) -> Vec<String> {
    answer["unpark"]
        .as_array()
        .map(|u| u.iter().map(|r| r.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

fn instant(v: &Value) -> DateTime<Utc> {
    v.as_str().unwrap().parse().unwrap()
}

/// GB-seconds an event bills within `[from, ∞)`.
fn gb_seconds_from(e: &Value, from: DateTime<Utc>) -> f64 {
    let (start, end) = (instant(&e["start"]).max(from), instant(&e["end"]));
    let secs = (end - start).num_milliseconds().max(0) as f64 / 1000.0;
    secs * e["amount"].as_str().unwrap().parse::<f64>().unwrap()
}

#[tokio::test]
async fn a_scale_down_parks_and_bills_but_a_deleted_endpoint_parks_nothing() {
    let t0 = Utc.with_ymd_and_hms(2026, 6, 1, 12, 0, 0).unwrap();
    let mut live = Live::new(t0).await;

    // (1) The control: a live endpoint scaled down parks its replica for
    // a minute, then the park ends (say a new replica took it back):
    // 16 GB for 60 s is billed.
    let (a, a_replicas) = live.endpoint_of_two("chat").await;
    let a_stopped = live.scale_to_one(&a, &a_replicas).await;
    let parked_at = live.on.clock.now();
    live.sync(
        vec![live.observed(
            &a_stopped,
            ObservedPhase::Exited {
                code: 0,
                stopped: true,
            },
        )],
        json!([Live::park(&a, &a_stopped, parked_at)]),
    )
    .await;
    live.on.clock.advance(Duration::seconds(60));
    live.sync(vec![], json!([])).await;
    let billed = live.parked_usage(&a).await;
    assert_eq!(billed.len(), 1, "{billed:?}");
    let control = gb_seconds_from(&billed[0], t0);
    assert_eq!(control, 960.0, "{billed:?}");

    // (2) Another endpoint parks a replica on a scale-down, and is
    // deleted 30 s later with one replica still running.
    let (b, b_replicas) = live.endpoint_of_two("embed").await;
    let b_parked = live.scale_to_one(&b, &b_replicas).await;
    let b_running = b_replicas.iter().find(|r| **r != b_parked).unwrap().clone();
    let b_parked_at = live.on.clock.now();
    let parked = json!([Live::park(&b, &b_parked, b_parked_at)]);
    let answer = live
        .sync(
            vec![live.observed(
                &b_parked,
                ObservedPhase::Exited {
                    code: 0,
                    stopped: true,
                },
            )],
            parked.clone(),
        )
        .await;
    assert_eq!(unparks(&answer), Vec::<String>::new(), "{answer}");
    live.on.clock.advance(Duration::seconds(30));
    let deleted_at = live.on.clock.now();
    live.on
        .ok(&live.key, "DELETE", &format!("/v1/endpoints/{b}"), None)
        .await;
    live.passes().await;
    // The running replica is stopped, and the agent is told neither to
    // park it nor to keep the parked one.
    let answer = live.sync(vec![], parked.clone()).await;
    assert!(stops(&answer).contains(&b_running), "{answer}");
    let mut told = unparks(&answer);
    told.sort();
    let mut want = vec![b_parked.clone(), b_running.clone()];
    want.sort();
    assert_eq!(told, want, "{answer}");
    // The agent releases the park late (45 s on), and an agent that
    // parked the stopped replica anyway reports that park too: the first
    // is billed up to the deletion only, the second not at all.
    live.on.clock.advance(Duration::seconds(45));
    let late = live.on.clock.now();
    live.sync(
        vec![live.observed(
            &b_running,
            ObservedPhase::Exited {
                code: 0,
                stopped: true,
            },
        )],
        json!([Live::park(&b, &b_running, late)]),
    )
    .await;
    live.on.clock.advance(Duration::seconds(60));
    let answer = live.sync(vec![], json!([])).await;
    assert_eq!(unparks(&answer), Vec::<String>::new(), "{answer}");

    let billed = live.parked_usage(&b).await;
    assert_eq!(billed.len(), 1, "{billed:?}");
    assert_eq!(instant(&billed[0]["end"]), deleted_at, "{billed:?}");
    let before = gb_seconds_from(&billed[0], t0);
    let after: f64 = billed.iter().map(|e| gb_seconds_from(e, deleted_at)).sum();
    assert_eq!(before, 480.0, "16 GB for the 30 s before the deletion");
    assert_eq!(after, 0.0, "nothing billed past the deletion");
    // The control's bill stands.
    assert_eq!(
        gb_seconds_from(&live.parked_usage(&a).await[0], t0),
        control
    );
    println!("parked GB-s: scale-down {control}; deleted endpoint before deletion {before}, after {after}");
}

#[tokio::test]
async fn a_park_is_billed_to_the_instant_its_agent_saw_it_end() {
    let t0 = Utc.with_ymd_and_hms(2026, 6, 1, 12, 0, 0).unwrap();
    let mut live = Live::new(t0).await;
    let exited = |live: &Live, r: &str| {
        live.observed(
            r,
            ObservedPhase::Exited {
                code: 0,
                stopped: true,
            },
        )
    };

    // (1) A scale-down parks a replica at 250 ms past a second on the
    // agent's clock; the agent reports it on two syncs 30 s apart, then
    // restores it onto a GPU 41.789 s after it parked, between the second
    // sync and the third (at 60 s): billed 16 GB for exactly 41.789 s.
    let (a, a_replicas) = live.endpoint_of_two("chat").await;
    let a_parked = live.scale_to_one(&a, &a_replicas).await;
    let parked_at = live.on.clock.now() + Duration::milliseconds(250);
    let park = json!([Live::park(&a, &a_parked, parked_at)]);
    live.sync(vec![exited(&live, &a_parked)], park.clone())
        .await;
    live.on.clock.advance(Duration::seconds(30));
    live.sync(vec![], park.clone()).await;
    live.on.clock.advance(Duration::seconds(30));
    let restored_at = parked_at + Duration::milliseconds(41_789);
    assert!(restored_at < live.on.clock.now());
    let ended = json!([Live::ended(&a, &a_parked, parked_at, restored_at)]);
    live.sync_ended(vec![], json!([]), ended.clone()).await;
    let billed = live.parked_usage(&a).await;
    assert_eq!(billed.len(), 1, "{billed:?}");
    assert_eq!(instant(&billed[0]["start"]), parked_at, "{billed:?}");
    assert_eq!(instant(&billed[0]["end"]), restored_at, "{billed:?}");
    let gb: f64 = billed[0]["amount"].as_str().unwrap().parse().unwrap();
    assert_eq!(gb, 16.0, "{billed:?}");
    let exact = gb_seconds_from(&billed[0], t0);
    assert_eq!(exact, 16.0 * 41.789, "{billed:?}");

    // The agent was not sure the sync arrived and resends the end, twice,
    // later: nothing is added and the bill stands.
    for _ in 0..2 {
        live.on.clock.advance(Duration::seconds(7));
        live.sync_ended(vec![], json!([]), ended.clone()).await;
    }
    assert_eq!(live.parked_usage(&a).await, billed);

    // (2) A park that began and ended between two syncs (never in a
    // report): billed from its start to its end all the same.
    let short_since = live.on.clock.now() + Duration::milliseconds(1_500);
    let short_end = short_since + Duration::milliseconds(2_345);
    live.on.clock.advance(Duration::seconds(5));
    let other = a_replicas.iter().find(|r| **r != a_parked).unwrap();
    live.sync_ended(
        vec![],
        json!([]),
        json!([Live::ended(&a, other, short_since, short_end)]),
    )
    .await;
    let billed = live.parked_usage(&a).await;
    assert_eq!(billed.len(), 2, "{billed:?}");
    let short = billed
        .iter()
        .find(|e| instant(&e["start"]) == short_since)
        .unwrap_or_else(|| panic!("the short park is billed: {billed:?}"));
    assert_eq!(instant(&short["end"]), short_end, "{short}");

    // (3) An endpoint deleted while a replica was parked: the agent
    // releases the park 2.5 s after the deletion, when a sync tells it;
    // the bill ends at the deletion, not at the agent's end.
    let (b, b_replicas) = live.endpoint_of_two("embed").await;
    let b_parked = live.scale_to_one(&b, &b_replicas).await;
    let b_since = live.on.clock.now();
    let b_park = json!([Live::park(&b, &b_parked, b_since)]);
    live.sync(vec![exited(&live, &b_parked)], b_park.clone())
        .await;
    live.on.clock.advance(Duration::seconds(20));
    let deleted_at = live.on.clock.now();
    live.on
        .ok(&live.key, "DELETE", &format!("/v1/endpoints/{b}"), None)
        .await;
    live.passes().await;
    let answer = live.sync(vec![], b_park.clone()).await;
    assert!(unparks(&answer).contains(&b_parked), "{answer}");
    live.on.clock.advance(Duration::seconds(10));
    let released_at = deleted_at + Duration::milliseconds(2_500);
    let b_running = b_replicas.iter().find(|r| **r != b_parked).unwrap();
    live.sync_ended(
        vec![exited(&live, b_running)],
        json!([]),
        json!([Live::ended(&b, &b_parked, b_since, released_at)]),
    )
    .await;
    let billed = live.parked_usage(&b).await;
    assert_eq!(billed.len(), 1, "{billed:?}");
    assert_eq!(instant(&billed[0]["end"]), deleted_at, "{billed:?}");

    // (4) An agent whose clock runs ahead of the server's reports an end
    // after the sync: never billed past the sync that reports it.
    let (c, c_replicas) = live.endpoint_of_two("rank").await;
    let c_parked = live.scale_to_one(&c, &c_replicas).await;
    let c_since = live.on.clock.now();
    live.sync(
        vec![exited(&live, &c_parked)],
        json!([Live::park(&c, &c_parked, c_since)]),
    )
    .await;
    live.on.clock.advance(Duration::seconds(10));
    let synced_at = live.on.clock.now();
    live.sync_ended(
        vec![],
        json!([]),
        json!([Live::ended(
            &c,
            &c_parked,
            c_since,
            synced_at + Duration::seconds(90)
        )]),
    )
    .await;
    let billed = live.parked_usage(&c).await;
    assert_eq!(billed.len(), 1, "{billed:?}");
    assert_eq!(instant(&billed[0]["end"]), synced_at, "{billed:?}");
    println!("parked GB-s to the agent's end: {exact} (16 GB x 41.789 s)");
}

#[tokio::test]
async fn a_bad_ended_park_is_refused_naming_its_field() {
    let t0 = Utc.with_ymd_and_hms(2026, 6, 1, 12, 0, 0).unwrap();
    let live = Live::new(t0).await;
    let ep = "ep_01hzzzzzzzzzzzzzzzzzzzzzzz";
    let replica = "inst_01hzzzzzzzzzzzzzzzzzzzzz01";
    let mut bad = Live::ended(ep, replica, t0, t0 + Duration::seconds(1));
    bad["key"] = json!("");
    let good = Live::ended(ep, replica, t0, t0 + Duration::seconds(1));
    let (status, body) = live
        .on
        .call(
            &live.provider,
            "POST",
            &format!("/v1/agent/nodes/{}/sync", live.node),
            Some(json!({"observed": [], "weights": [], "parks_ended": [good, bad]})),
        )
        .await;
    assert_eq!(status.as_u16(), 422, "{body}");
    assert_eq!(
        body["error"]["details"]["field"], "parks_ended[1].key",
        "{body}"
    );
}
