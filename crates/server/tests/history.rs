//! A day of this cluster's own activity, replayed: the server runs a day
//! on a manual clock (instances of whole GPUs and fractions arriving every
//! half hour and running one to three hours, a two-node training job, and
//! an inference endpoint that the autoscaler scales up under four hours of
//! load reported by the gateway and back to zero after it), played through
//! the agent protocol; `GET /v1/history/demand` reads it
//! back; the simulator's replay (`flotilla_sim::history`, what
//! `flotilla simulate --from-history` runs) gives the recorded GPU-hours
//! back within 2 % under the recorded settings, and with another placement
//! policy on half the machines the waits grow and the comparison says so.
//! The day is metered as it runs, and reconciling it (`flotilla billing
//! reconcile` over the day) finds no difference at all: every instance,
//! job member and replica billed to the millisecond it ran.

use std::collections::BTreeMap;

use chrono::{Duration, TimeZone, Utc};
use flotilla_core::api::ObservedPhase;
use flotilla_core::clock::Clock;
use flotilla_core::history::DemandHistory;
use flotilla_sched::Policy;
use flotilla_server::endpoints::Controller;
use flotilla_server::schedule::schedule_pass;
use flotilla_sim::history::{differences, recorded, replay, scale_nodes, ReplaySettings};
use flotilla_testkit::server::OnClock;
use reqwest::StatusCode;
use serde_json::json;

/// Instances placed and not yet started: started now by their agent, to
/// end `run` later. `ends` maps an instance to (node, end time).
async fn start_placed(
    on: &OnClock,
    provider: &str,
    ids: &[(String, Duration)],
    ends: &mut BTreeMap<String, (String, chrono::DateTime<Utc>)>,
) {
    for (id, run) in ids {
        if ends.contains_key(id) {
            continue;
        }
        let i = on
            .ok(&on.operator, "GET", &format!("/v1/instances/{id}"), None)
            .await;
        if i["state"] != "scheduled" {
            continue;
        }
        let node = i["node_id"].as_str().unwrap().to_string();
        on.report(provider, &node, id, ObservedPhase::Running { pid: 7 })
            .await;
        ends.insert(id.clone(), (node, on.clock.now() + *run));
    }
}

/// A replica's readiness answer on the port its URL names, so that the
/// endpoint controller's probe finds it ready (as a real server would
/// once loaded).
async fn serve_ready(url: &str) -> tokio::sync::oneshot::Sender<()> {
    let addr = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .unwrap_or_else(|e| panic!("the replica's address {addr} is free: {e}"));
    let app = axum::Router::new().fallback(|| async { "ok" });
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx.await;
            })
            .await;
    });
    tx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_day_replays_to_its_gpu_hours_and_half_the_nodes_make_waits() {
    let day = Utc.with_ymd_and_hms(2026, 12, 1, 0, 0, 0).unwrap();
    let on = OnClock::new(day).await;
    let op = on.operator.clone();
    let t = on
        .ok(&op, "POST", "/v1/tenants", Some(json!({"name": "lab"})))
        .await;
    let member = on.key(&t["id"], "tenant_member").await;
    let provider = on.key(&t["id"], "provider").await;
    for n in ["n1", "n2", "n3", "n4"] {
        on.register_node(&provider, n, &[("H100", 2)]).await;
    }

    // An inference endpoint, scaled to zero when idle.
    let ep = on
        .ok(
            &member,
            "POST",
            "/v1/endpoints",
            Some(json!({
                "name": "chat", "command": ["serve"], "gpus": 1,
                "min_replicas": 0, "max_replicas": 3, "idle_window_s": 600,
                "replica_concurrency": 4
            })),
        )
        .await;
    let ep_id = ep["id"].as_str().unwrap().to_string();
    let mut ctl = Controller::new(on.st.config().egress());
    let mut requests_total = 0u64;
    let mut replicas: BTreeMap<String, Option<tokio::sync::oneshot::Sender<()>>> = BTreeMap::new();

    // Work of the day: (instance or job member id, how long it runs).
    let mut works: Vec<(String, Duration)> = Vec::new();
    let mut ends: BTreeMap<String, (String, chrono::DateTime<Utc>)> = BTreeMap::new();
    let mut job = None;
    let step = Duration::minutes(10);
    let (from, to) = (day, day + Duration::days(1));
    for s in 0..(24 * 6) {
        // Runs that are due end first.
        let now = on.clock.now();
        let due: Vec<(String, String)> = ends
            .iter()
            .filter(|(_, (_, end))| *end <= now)
            .map(|(id, (node, _))| (id.clone(), node.clone()))
            .collect();
        for (id, node) in due {
            on.report(
                &provider,
                &node,
                &id,
                ObservedPhase::Exited {
                    code: 0,
                    stopped: false,
                },
            )
            .await;
            ends.remove(&id);
            works.retain(|(w, _)| *w != id);
        }
        // An arrival every half hour until evening: 1 or 2 GPUs, or a
        // half GPU, for one to three hours.
        if s % 3 == 0 && s < 18 * 6 {
            let k = s / 3;
            let body = match k % 4 {
                0 | 2 => json!({"gpus": 1, "command": ["train"]}),
                1 => json!({"gpus": 2, "command": ["train"]}),
                _ => json!({"gpus": 1, "gpu_fraction": 0.5, "command": ["infer"]}),
            };
            let i = on.ok(&member, "POST", "/v1/instances", Some(body)).await;
            let run = Duration::minutes(60 + 60 * i64::from(k % 3));
            works.push((i["id"].as_str().unwrap().to_string(), run));
        }
        // A two-node training job at 05:00, two hours.
        if s == 30 {
            let j = on
                .ok(
                    &member,
                    "POST",
                    "/v1/jobs",
                    Some(json!({"gpus": 2, "nodes": 2, "command": ["train"]})),
                )
                .await;
            job = Some(j["id"].as_str().unwrap().to_string());
        }
        // The gateway's reading of the endpoint: 09:00 to 13:00 under
        // load (12 in flight, 4 queued), idle otherwise.
        let busy = (9 * 6..13 * 6).contains(&s);
        requests_total += if busy { 600 } else { 0 };
        let (in_flight, queued) = if busy { (12, 4) } else { (0, 0) };
        on.ok(
            &provider,
            "POST",
            "/v1/gateway/signals",
            Some(json!({"signals": [{
                "endpoint_id": ep_id, "at": on.clock.now(), "in_flight": in_flight,
                "queued": queued, "requests_total": requests_total
            }]})),
        )
        .await;
        ctl.pass(&on.st).await.expect("an endpoint pass");
        flotilla_server::jobs::jobs_pass(&on.st)
            .await
            .expect("a jobs pass");
        schedule_pass(&on.st).await.expect("a pass");
        if let Some(j) = &job {
            let jv = on.ok(&member, "GET", &format!("/v1/jobs/{j}"), None).await;
            for m in jv["members"].as_array().cloned().unwrap_or_default() {
                let id = m["instance_id"].as_str().unwrap().to_string();
                if !works.iter().any(|(w, _)| *w == id) && !ends.contains_key(&id) {
                    works.push((id, Duration::hours(2)));
                }
            }
        }
        // The endpoint's replicas: new ones run until the autoscaler stops
        // them; a running one answers its readiness probe; a stopped one's
        // agent reports its exit.
        let epv = on
            .ok(&member, "GET", &format!("/v1/endpoints/{ep_id}"), None)
            .await;
        for r in epv["replicas"].as_array().cloned().unwrap_or_default() {
            let id = r["instance_id"].as_str().unwrap().to_string();
            if !replicas.contains_key(&id) {
                replicas.insert(id.clone(), None);
                works.push((id.clone(), Duration::days(2)));
            }
            if r["state"] == "running" && replicas[&id].is_none() {
                let stop = serve_ready(r["url"].as_str().unwrap()).await;
                replicas.insert(id, Some(stop));
            }
        }
        for id in replicas.keys() {
            let Some((node, _)) = ends.get(id).cloned() else {
                continue;
            };
            let i = on
                .ok(&op, "GET", &format!("/v1/instances/{id}"), None)
                .await;
            if i["stop_requested"] == true {
                let stopped = ObservedPhase::Exited {
                    code: 0,
                    stopped: true,
                };
                on.report(&provider, &node, id, stopped).await;
                ends.remove(id);
                works.retain(|(w, _)| w != id);
            }
        }
        start_placed(&on, &provider, &works, &mut ends).await;
        flotilla_server::metering::metering_pass(&on.st)
            .await
            .expect("a metering pass");
        on.clock.advance(step);
    }
    // The day's bill against the day's runs, at threshold 0: the ledger
    // bills, to the millisecond, what the agents reported running.
    flotilla_server::metering::metering_pass(&on.st)
        .await
        .expect("a metering pass");
    let check = flotilla_server::reconciliation::reconcile_window(&on.st, from, to, 0)
        .await
        .expect("a reconciliation");
    assert!(check.differences.is_empty(), "{check:?}");
    assert_eq!(check.billed_seconds, check.observed_seconds, "{check:?}");
    assert!(
        check.instances >= 37 && check.billed_seconds > rust_decimal::Decimal::from(40 * 3600),
        "a day's work was compared: {check:?}"
    );

    let (status, body) = on
        .call(
            &op,
            "GET",
            &format!(
                "/v1/history/demand?from={}&to={}",
                from.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                to.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            ),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let h: DemandHistory = serde_json::from_value(body).expect("a demand history");
    assert_eq!(h.nodes.len(), 4);
    assert!(
        replicas.len() >= 2,
        "the load scaled the endpoint to at least two replicas: {replicas:?}"
    );
    assert!(
        replicas.keys().all(|id| !ends.contains_key(id)),
        "every replica was stopped once the load was gone"
    );
    assert_eq!(
        h.works.len(),
        36 + 1 + replicas.len(),
        "36 instances, the job and the endpoint's replicas"
    );
    let replica_ms: u64 = h
        .works
        .iter()
        .filter(|w| replicas.contains_key(w.id.as_str()))
        .filter_map(|w| w.ran_ms(to))
        .sum();
    assert!(
        replica_ms >= 4 * 3_600_000,
        "the replicas served the four hours of load: {replica_ms} ms"
    );
    let job_work = h
        .works
        .iter()
        .find(|w| w.members == 2)
        .expect("the job, as one work of two members");
    assert!(job_work.finished_at.is_some(), "{job_work:?}");

    let rec = recorded(&h);
    assert_eq!(rec.works, 37 + replicas.len(), "{rec:?}");
    // 36 arrivals: 9 of each shape; 1 GPU for 1-3 h (18 of them), 2 GPUs,
    // half GPUs; plus the job's 4 GPU-hours... all measured by the record.
    assert!(rec.gpu_hours > 40.0, "{rec:?}");

    let same = replay(
        &h,
        &ReplaySettings {
            policy: Policy::Flotilla,
            nodes: h.nodes.clone(),
        },
    )
    .expect("the replay");
    assert_eq!(same.ran, rec.works, "{same:?}");
    let gap = (same.gpu_hours - rec.gpu_hours).abs() / rec.gpu_hours;
    assert!(
        gap <= 0.02,
        "replayed {} GPU-hours against {} recorded",
        same.gpu_hours,
        rec.gpu_hours
    );

    assert_eq!(same.cost, rec.cost, "the same GPU time costs the same");
    assert!(rec.cost > rust_decimal::Decimal::ZERO, "{rec:?}");

    let half = replay(
        &h,
        &ReplaySettings {
            policy: Policy::BestFit,
            nodes: scale_nodes(&h.nodes, 0.5),
        },
    )
    .expect("the changed replay");
    assert!(
        half.mean_wait_s > same.mean_wait_s && half.mean_wait_s > rec.mean_wait_s,
        "record {rec:?}\nsame {same:?}\nhalf {half:?}"
    );
    let said = differences(&rec, &half).join("; ");
    assert!(said.contains("waits grow"), "{said}");
    eprintln!("record {rec:?}\nsame settings {same:?}\nBestFit, half the nodes {half:?}\n{said}");

    // The operator's console page shows the same comparison.
    let stamp = |t: chrono::DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let (status, html) = on
        .console_page(
            &op,
            &format!(
                "/replay?from={}&to={}&policy=BestFit&node_scale=0.5",
                stamp(from),
                stamp(to)
            ),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{html}");
    for shown in [
        "Replay: Flotilla, 4 nodes",
        "Replay: BestFit, 2 nodes",
        &format!("{:.2}", rec.gpu_hours),
        "waits grow",
    ] {
        assert!(
            html.contains(shown),
            "the replay page shows {shown}: {html}"
        );
    }
    // Not a tenant's page.
    let (status, _) = on.console_page(&member, "/replay").await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // An unknown window is a clear error, naming the field.
    let (status, body) = on
        .call(
            &op,
            "GET",
            "/v1/history/demand?from=2026-12-02T00:00:00Z&to=2026-12-01T00:00:00Z",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["details"]["field"], "to", "{body}");
    // Tenants may not read every tenant's demand.
    let (status, _) = on
        .call(
            &member,
            "GET",
            "/v1/history/demand?from=2026-12-01T00:00:00Z&to=2026-12-02T00:00:00Z",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
}
