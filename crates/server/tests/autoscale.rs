//! The live autoscaling loop runs the simulator's policies: one metric
//! sequence, reported through the API and decided by the server's loop on
//! its (manual) clock, gives the same decisions as the simulator's replay
//! adapter fed the same observations.

use axum::http::StatusCode;
use chrono::{Duration, TimeZone, Utc};
use flotilla_core::api::PoolPolicy;
use flotilla_core::clock::Clock;
use flotilla_core::id::ReplicaPoolId;
use flotilla_scale::{Decision, Observation};
use flotilla_server::autoscale::{policy_for, Autoscaler};
use flotilla_testkit::server::OnClock;
use serde_json::json;

fn policy(kind: &str) -> PoolPolicy {
    PoolPolicy {
        kind: kind.to_string(),
        max_concurrency: 8,
        mean_service_ms: 2_000.0,
        cold_start_ms: 60_000,
        slo_ms: 2_000,
    }
}

/// Second-by-second metrics: quiet, a ramp to a burst, quiet again.
fn metrics() -> Vec<(u32, u32, u64)> {
    let mut total = 0u64;
    (0..400u64)
        .map(|s| {
            let rate = match s {
                0..=59 => 1,
                60..=179 => 1 + (s - 60) / 4,
                180..=239 => 40,
                _ => 0,
            };
            total += rate;
            let in_flight = (rate * 2).min(64) as u32;
            let queued = (rate * 2).saturating_sub(64) as u32;
            (in_flight, queued, total)
        })
        .collect()
}

async fn same_decisions(kind: &str) {
    let live = OnClock::new(Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap()).await;
    let (status, pool) = live
        .call(
            &live.operator,
            "POST",
            "/v1/pools",
            Some(json!({
                "name": "chat",
                "policy": policy(kind),
                "max_replicas": 50,
                "replica": {"gpus": 1, "command": ["sleep", "3600"]}
            })),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{pool}");
    let id = ReplicaPoolId::parse(pool["id"].as_str().unwrap(), "id").unwrap();

    let mut scaler = Autoscaler::new();
    let mut reference = policy_for(&policy(kind), 50).unwrap();
    let t0 = u64::try_from(live.clock.now().timestamp_millis()).unwrap();
    let mut starting = 0u32;
    let (mut server, mut sim) = (Vec::new(), Vec::new());
    for (i, (in_flight, queued, total)) in metrics().into_iter().enumerate() {
        if i > 0 {
            live.clock.advance(Duration::seconds(1));
        }
        let (status, body) = live
            .call(
                &live.operator,
                "POST",
                &format!("/v1/pools/{id}/metrics"),
                Some(json!({"in_flight": in_flight, "queued": queued, "requests_total": total})),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let decided = scaler.pass(&live.st).await.unwrap();
        let d = decided.iter().find(|(p, _)| *p == id).unwrap().1;
        server.push(d);

        // The simulator's adapter, fed the same observation: no agent runs
        // the replicas, so every replica asked for is still starting.
        let obs = Observation {
            ready: 0,
            starting,
            in_flight,
            queued,
            requests_total: total,
            gpu_utilization: 0.0,
            latency: None,
            slo_ms: Some(2_000.0),
            custom: None,
        };
        let now = t0 + i as u64 * 1_000;
        let mut one: Vec<Decision> =
            flotilla_scale::builder::replay(reference.as_mut(), &[(now, obs)]);
        sim.push(one.remove(0));
        starting = d.replicas;
    }
    assert_eq!(server, sim, "{kind}: server and simulator disagree");
    // Flotilla and Knative size on arrivals and concurrency and scale up
    // for the burst; HPA, KEDA's HPA and Ray Serve average over ready
    // replicas, and none is ever ready here (no agent), so they hold.
    if kind == "flotilla" || kind == "kpa" {
        let top = server.iter().map(|d| d.replicas).max().unwrap_or(0);
        assert!(top > 1, "{kind}: the burst should scale up, top {top}");
    }
    // The loop acted on its decisions: live replicas match the last one.
    let (_, pool) = live
        .call(&live.operator, "GET", &format!("/v1/pools/{id}"), None)
        .await;
    let last = server.last().unwrap().replicas as usize;
    assert_eq!(pool["replicas"].as_array().unwrap().len(), last, "{pool}");
    assert_eq!(pool["desired_replicas"].as_u64(), Some(last as u64));
}

#[tokio::test]
async fn server_loop_and_simulator_decide_alike_for_every_policy() {
    for kind in ["flotilla", "hpa", "keda", "kpa", "ray"] {
        same_decisions(kind).await;
    }
}

#[tokio::test]
async fn bad_pools_and_metrics_name_the_field() {
    let live = OnClock::new(Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap()).await;
    let good = json!({
        "name": "chat",
        "policy": policy("kpa"),
        "max_replicas": 5,
        "replica": {"gpus": 1, "command": ["true"]}
    });
    let cases = [
        ("/policy/kind", json!("vpa"), "policy.kind"),
        (
            "/policy/max_concurrency",
            json!(0),
            "policy.max_concurrency",
        ),
        ("/max_replicas", json!(0), "max_replicas"),
        ("/replica/gpus", json!(0), "replica.gpus"),
    ];
    for (pointer, value, field) in cases {
        let mut body = good.clone();
        *body.pointer_mut(pointer).unwrap() = value;
        let (status, err) = live
            .call(&live.operator, "POST", "/v1/pools", Some(body))
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{err}");
        assert_eq!(err["error"]["details"]["field"], field, "{err}");
    }
    let (_, pool) = live
        .call(&live.operator, "POST", "/v1/pools", Some(good))
        .await;
    let id = pool["id"].as_str().unwrap();
    let (status, err) = live
        .call(
            &live.operator,
            "POST",
            &format!("/v1/pools/{id}/metrics"),
            Some(json!({"in_flight": 1, "queued": 0, "requests_total": 1, "gpu_utilization": 2.0})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{err}");
    assert_eq!(err["error"]["details"]["field"], "gpu_utilization");
    let (status, _) = live
        .call(
            &live.operator,
            "GET",
            "/v1/pools/rpool_01ARZ3NDEKTSV4RRFFQ69G5FAV",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}
