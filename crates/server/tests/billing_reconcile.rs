//! Billing reconciliation on a manual clock, driven through the agent
//! protocol and the server's own passes: a normal period (instances that
//! start, run, end and are metered by the metering pass, on times off the
//! whole second) reconciles with no difference, even at a zero threshold; injected discrepancies
//! (usage with no workload, a workload whose usage was never metered,
//! usage sent twice) are each reported with their cause and numbers, by
//! `GET /v1/billing/reconcile` and by the leader's pass in
//! `flotilla_billing_reconcile_differences`.

use chrono::{Duration, TimeZone, Utc};
use flotilla_billing::api::ReconcileReport;
use flotilla_billing::reconcile::Cause;
use flotilla_core::api::ObservedPhase;
use flotilla_core::clock::Clock;
use flotilla_server::metering::metering_pass;
use flotilla_server::reconciliation::reconcile_pass;
use flotilla_server::schedule::schedule_pass;
use flotilla_testkit::server::OnClock;
use reqwest::StatusCode;
use rust_decimal::Decimal;
use serde_json::{json, Value};

fn exited() -> ObservedPhase {
    ObservedPhase::Exited {
        code: 0,
        stopped: false,
    }
}

struct Fixture {
    on: OnClock,
    tenant: String,
    member: String,
    provider: String,
    node: String,
}

async fn fixture() -> Fixture {
    let start = Utc.with_ymd_and_hms(2026, 12, 3, 9, 0, 0).unwrap();
    let on = OnClock::new(start).await;
    let op = on.operator.clone();
    let t = on
        .ok(&op, "POST", "/v1/tenants", Some(json!({"name": "lab"})))
        .await;
    let member = on.key(&t["id"], "tenant_member").await;
    let provider = on.key(&t["id"], "provider").await;
    let node = on.register_node(&provider, "n1", &[("H100", 4)]).await;
    Fixture {
        tenant: t["id"].as_str().unwrap().to_string(),
        on,
        member,
        provider,
        node,
    }
}

impl Fixture {
    /// `n` one-GPU instances, placed.
    async fn placed(&self, n: usize) -> Vec<String> {
        let mut ids = Vec::new();
        for _ in 0..n {
            let i = self
                .on
                .ok(
                    &self.member,
                    "POST",
                    "/v1/instances",
                    Some(json!({"gpus": 1, "command": ["train"]})),
                )
                .await;
            ids.push(i["id"].as_str().unwrap().to_string());
        }
        schedule_pass(&self.on.st).await.expect("a pass");
        ids
    }

    async fn report(&self, instance: &str, phase: ObservedPhase) {
        self.on
            .report(&self.provider, &self.node, instance, phase)
            .await;
    }

    /// The agent's sync reporting `observed` (a JSON list) as it stands.
    async fn sync(&self, observed: Value) -> Value {
        let path = format!("/v1/agent/nodes/{}/sync", self.node);
        let body = json!({"observed": observed, "wait_ms": 0});
        self.on.ok(&self.provider, "POST", &path, Some(body)).await
    }

    fn advance_ms(&self, ms: i64) {
        self.on.clock.advance(Duration::milliseconds(ms));
    }

    /// Moves on to January 2027, finalises the tenant's December and
    /// returns its invoice's id.
    async fn finalise_december(&self) -> String {
        let now = self.on.clock.now();
        let jan = Utc.with_ymd_and_hms(2027, 1, 5, 0, 0, 0).unwrap();
        self.on.clock.advance(jan - now);
        let r = self
            .on
            .ok(
                &self.on.operator,
                "POST",
                "/v1/invoices/finalise",
                Some(json!({"period": "2026-12", "tenant": self.tenant})),
            )
            .await;
        r["finalised"][0]["id"]
            .as_str()
            .unwrap_or_else(|| panic!("December finalised: {r}"))
            .to_string()
    }

    /// The invoice's console page as `key` sees it.
    async fn invoice_page(&self, key: &str, invoice: &str) -> String {
        let (status, html) = self
            .on
            .console_page(key, &format!("/invoices/{invoice}"))
            .await;
        assert_eq!(status, StatusCode::OK, "{html}");
        html
    }

    /// Reconciliation from the fixture's start to just past now, at a
    /// zero threshold: every millisecond of difference reported.
    async fn reconcile_to_now_exactly(&self) -> ReconcileReport {
        let until = (self.on.clock.now() + Duration::seconds(1)).to_rfc3339();
        self.reconcile(&format!(
            "{SINCE}&until={}&threshold_s=0",
            until.replace('+', "%2B")
        ))
        .await
    }

    async fn reconcile(&self, query: &str) -> ReconcileReport {
        let (status, body) = self
            .on
            .call(
                &self.on.operator,
                "GET",
                &format!("/v1/billing/reconcile?{query}"),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        serde_json::from_value(body).expect("a reconcile report")
    }
}

/// The window from the fixture's start.
const SINCE: &str = "since=2026-12-03T09:00:00Z";

#[tokio::test]
async fn a_metered_period_reconciles_with_no_difference() {
    let f = fixture().await;
    let ids = f.placed(2).await;
    f.advance_ms(1_300);
    f.report(&ids[0], ObservedPhase::Running { pid: 1 }).await;
    f.advance_ms(2_400);
    f.report(&ids[1], ObservedPhase::Running { pid: 2 }).await;
    // Ten minutes in steps off the second and the slice, metering as the
    // leader does; the first ends after about 3 minutes 20 s.
    for step in 0..80 {
        f.advance_ms(7_700);
        if step == 25 {
            f.report(&ids[0], exited()).await;
        }
        metering_pass(&f.on.st).await.expect("a metering pass");
    }
    let r = f.reconcile(SINCE).await;
    assert_eq!(r.differences, vec![], "{r:?}");
    assert_eq!(r.instances, 2, "{r:?}");
    assert_eq!(
        r.until,
        f.on.clock.now() - Duration::minutes(2),
        "metering's lag"
    );
    assert_eq!(r.threshold_seconds, Decimal::from(1));
    // The ledger bills each run to the millisecond: exactly what it ran.
    assert_eq!(r.billed_seconds, r.observed_seconds, "{r:?}");
    // So even with no threshold at all there is no difference.
    let exact = f.reconcile(&format!("{SINCE}&threshold_s=0")).await;
    assert_eq!(exact.differences, vec![], "{exact:?}");
    // The leader's pass agrees, and exports it.
    assert_eq!(reconcile_pass(&f.on.st).await.expect("a pass"), 0);
    assert_eq!(f.on.st.ops().billing_reconcile_differences.get(), 0);

    // The month's invoice carries the mark on the operator's console.
    f.report(&ids[1], exited()).await;
    metering_pass(&f.on.st).await.expect("a metering pass");
    let invoice = f.finalise_december().await;
    let page = f.invoice_page(&f.on.operator, &invoice).await;
    assert!(page.contains("id=\"reconciled\""), "{page}");
    assert!(page.contains("✓ Reconciled"), "{page}");
    // A tenant's console shows no reconciliation (operators' alone).
    let page = f.invoice_page(&f.member, &invoice).await;
    assert!(!page.contains("Reconciliation"), "{page}");
}

/// A usage event posted by the operator: instance time of `subject` over
/// `[start, end)` seconds after the fixture's start.
fn usage(tenant: &str, id: &str, subject: &str, start: i64, end: i64) -> Value {
    let at = |s: i64| {
        (Utc.with_ymd_and_hms(2026, 12, 3, 9, 0, 0).unwrap() + Duration::seconds(s)).to_rfc3339()
    };
    json!({
        "key": {"tenant": tenant, "source": "operator:test", "id": id},
        "subject": {"kind": "instance", "id": subject},
        "meter": {"meter": "instance_seconds"},
        "billing_class": "on_demand",
        "start": at(start),
        "end": at(end),
        "amount": "1"
    })
}

#[tokio::test]
async fn injected_discrepancies_are_reported_with_their_causes() {
    let f = fixture().await;
    let ids = f.placed(2).await;
    let (metered, unmetered) = (&ids[0], &ids[1]);
    // The first runs 60.5 s and is metered by the server's pass.
    f.advance_ms(1_000);
    f.report(metered, ObservedPhase::Running { pid: 1 }).await;
    f.advance_ms(60_500);
    f.report(metered, exited()).await;
    metering_pass(&f.on.st).await.expect("a metering pass");
    // The second runs after it; no metering pass sees it.
    f.advance_ms(8_700);
    f.report(unmetered, ObservedPhase::Running { pid: 2 }).await;
    f.advance_ms(60_700);
    f.report(unmetered, exited()).await;
    // Usage with no workload behind it, and the first one's minute billed
    // a second time under another source.
    let r =
        f.on.ok(
            &f.on.operator,
            "POST",
            "/v1/usage/events",
            Some(json!({"events": [
                usage(&f.tenant, "ghost-1", "inst_ghost", 10, 40),
                usage(&f.tenant, "again-1", metered, 1, 61),
            ]})),
        )
        .await;
    assert_eq!(r["accepted"], 2, "{r}");
    f.advance_ms(300_000);

    let r = f.reconcile(SINCE).await;
    let of = |id: &str| {
        r.differences
            .iter()
            .find(|d| d.instance == id)
            .unwrap_or_else(|| panic!("{id} is reported: {r:?}"))
    };
    let ghost = of("inst_ghost");
    assert_eq!(ghost.cause, Cause::BilledWithoutRun);
    assert_eq!(
        (ghost.billed_seconds, ghost.observed_seconds),
        (Decimal::from(30), Decimal::ZERO)
    );
    assert_eq!(ghost.tenant.as_str(), f.tenant);
    let unbilled = of(unmetered);
    assert_eq!(unbilled.cause, Cause::RanWithoutBill);
    assert_eq!(
        (unbilled.billed_seconds, unbilled.observed_seconds),
        (Decimal::ZERO, Decimal::new(607, 1))
    );
    let twice = of(metered);
    assert_eq!(twice.cause, Cause::OverBilled);
    // Metered to the millisecond (60.5 s), plus 60 s again.
    assert_eq!(
        (twice.billed_seconds, twice.observed_seconds),
        (Decimal::new(1205, 1), Decimal::new(605, 1))
    );
    assert_eq!(twice.difference_seconds, Decimal::from(60));
    assert_eq!(r.differences.len(), 3, "{r:?}");
    assert_eq!(r.instances, 3);

    // The leader's pass counts them into the exported gauge.
    assert_eq!(reconcile_pass(&f.on.st).await.expect("a pass"), 3);
    assert_eq!(f.on.st.ops().billing_reconcile_differences.get(), 3);

    // The month's invoice, on the operator's console: no mark, the three
    // differences with their causes.
    let invoice = f.finalise_december().await;
    let page = f.invoice_page(&f.on.operator, &invoice).await;
    assert!(page.contains("3 difference(s)"), "{page}");
    assert!(!page.contains("✓ Reconciled"), "{page}");
    for id in ["inst_ghost", metered.as_str(), unmetered.as_str()] {
        assert!(page.contains(id), "{id} on the page: {page}");
    }

    // The route is in the OpenAPI document, with its answer's schema.
    let doc =
        f.on.ok(&f.on.operator, "GET", "/v1/openapi.json", None)
            .await;
    assert!(
        doc["paths"]["/v1/billing/reconcile"]["get"].is_object(),
        "the route is documented"
    );
    assert!(doc["components"]["schemas"]["ReconcileReport"].is_object());

    // Tenants may not reconcile; a window must be one.
    let (status, _) =
        f.on.call(&f.member, "GET", "/v1/billing/reconcile", None)
            .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, body) =
        f.on.call(
            &f.on.operator,
            "GET",
            "/v1/billing/reconcile?since=2026-12-04T00:00:00Z&until=2026-12-03T00:00:00Z",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["details"]["field"], "since", "{body}");
}

/// Milliseconds of `instance_seconds` the ledger bills `instance`, as
/// rating counts them (corrections void what they correct), read through
/// `GET /v1/usage`.
async fn billed_ms(f: &Fixture, instance: &str) -> i64 {
    let page =
        f.on.ok(
            &f.member,
            "GET",
            "/v1/usage?limit=1000&from=2026-12-01T00:00:00Z&to=2027-01-01T00:00:00Z",
            None,
        )
        .await;
    assert!(page["next_cursor"].is_null(), "one page: {page}");
    let events: Vec<flotilla_billing::meter::UsageEvent> =
        serde_json::from_value(page["items"].clone()).expect("usage events");
    flotilla_billing::meter::effective_events(&events)
        .expect("a consistent ledger")
        .iter()
        .filter(|e| {
            e.subject.id == instance && e.meter == flotilla_billing::meter::Meter::InstanceSeconds
        })
        .map(|e| (e.end - e.start).num_milliseconds())
        .sum()
}

/// Issue 26: a fenced copy is billed to the kill time its agent reports.
/// The node goes silent, its lease runs out (the fence kills the work a
/// little before), the liveness pass declares the copy lost and metering
/// bills it to its lease's end. The agent comes back: its first sync does
/// not report the killed work (it has not reaped it yet), so the server
/// fails it; its next sync reports the exit at the kill. The instance
/// then ends at the kill without being reopened, its GPU stays free, the
/// ledger is corrected by new events to exactly the kill (to the
/// millisecond), and reconciliation at a zero threshold finds nothing. A
/// resent report adds nothing. Run twice: silent before the minute of the
/// kill ends (the loss bills that minute's start to the lease's end, the
/// kill restates it), and silent across a minute's end (metering, while
/// the copy seems to run, bills the minute past the kill and the lease's
/// end; the loss restates it to the lease's end, the kill restates that).
#[tokio::test]
async fn a_fenced_copy_reported_after_the_server_ended_it_is_billed_to_its_kill() {
    assert!(!fenced_copy(10).await, "the loss restated nothing");
    assert!(
        fenced_copy(13).await,
        "the kill restated the loss's restatement"
    );
}

/// One run of the case above, running `steps` syncs of 7.7 s before the
/// node goes silent. Returns whether the ledger holds a correction of a
/// correction.
async fn fenced_copy(steps: usize) -> bool {
    let f = fixture().await;
    let id = f.placed(1).await.remove(0);
    f.advance_ms(1_300);
    f.report(&id, ObservedPhase::Running { pid: 1 }).await;
    let started = f.on.clock.now();
    // Runs for a while, syncing and metered, on times off the second.
    for _ in 0..steps {
        f.advance_ms(7_700);
        f.report(&id, ObservedPhase::Running { pid: 1 }).await;
        metering_pass(&f.on.st).await.expect("a metering pass");
    }
    let last_sync = f.on.clock.now();
    let lease = Duration::from_std(f.on.st.config().node_lease()).unwrap();
    // The fence's kill, before the lease's end (its kill lead), seen by
    // the fence to the millisecond.
    let killed = last_sync + lease - Duration::milliseconds(1_237);
    // Silent: the leader's passes go on (metering while it seems to run,
    // into the minute past the kill) until the copy is lost.
    let op = f.on.operator.clone();
    let path = format!("/v1/instances/{id}");
    let mut steps = 0;
    while f.on.ok(&op, "GET", &path, None).await["state"] != "lost" {
        steps += 1;
        assert!(steps < 100, "never lost");
        f.advance_ms(900);
        metering_pass(&f.on.st).await.expect("a metering pass");
        flotilla_server::reconcile::liveness_pass(&f.on.st)
            .await
            .expect("a liveness pass");
    }
    f.advance_ms(4_100);
    // Back, not reporting the killed work yet: it fails, billed to the
    // lease's end.
    f.sync(json!([])).await;
    let inst = f.on.ok(&op, "GET", &path, None).await;
    assert_eq!(inst["state"], "failed", "{inst}");
    assert!(inst["exit_code"].is_null(), "{inst}");
    metering_pass(&f.on.st).await.expect("a metering pass");
    assert_eq!(
        billed_ms(&f, &id).await,
        (last_sync + lease - started).num_milliseconds(),
        "billed to the lease's end"
    );

    // Its next sync reports the exit at the kill.
    f.advance_ms(2_300);
    let exit = json!([flotilla_core::api::ObservedInstance {
        instance_id: serde_json::from_value(json!(id)).unwrap(),
        phase: ObservedPhase::Exited {
            code: 143,
            stopped: false,
        },
        at: killed,
        started_at: None,
        message: None,
        container: None,
        weights_tier: None,
        limit_exceeded: None,
    }]);
    f.sync(exit.clone()).await;
    let inst = f.on.ok(&op, "GET", &path, None).await;
    assert_eq!(inst["state"], "failed", "not reopened: {inst}");
    assert_eq!(inst["exit_code"], 143, "{inst}");
    let finished: chrono::DateTime<Utc> =
        serde_json::from_value(inst["finished_at"].clone()).expect("a finish");
    assert_eq!(finished, killed, "{inst}");
    let events: Vec<&str> = inst["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["state"].as_str().unwrap())
        .collect();
    assert_eq!(
        events.iter().rev().take(2).collect::<Vec<_>>(),
        [&"failed", &"lost"],
        "{inst}"
    );
    let gpus =
        f.on.st
            .store()
            .node_gpus(&serde_json::from_value(json!(f.node)).unwrap())
            .await
            .expect("the node's GPUs");
    assert!(
        gpus.iter().all(|g| g.instance_id.is_none()),
        "GPUs free: {gpus:?}"
    );

    assert!(metering_pass(&f.on.st).await.expect("a metering pass") > 0);
    let want = (killed - started).num_milliseconds();
    assert_eq!(billed_ms(&f, &id).await, want, "billed to the kill");
    // A resent report, and more passes, add nothing.
    f.sync(exit).await;
    assert_eq!(metering_pass(&f.on.st).await.expect("a metering pass"), 0);
    assert_eq!(billed_ms(&f, &id).await, want);

    let r = f.reconcile_to_now_exactly().await;
    assert_eq!(r.differences, vec![], "{r:?}");
    assert_eq!(r.instances, 1, "{r:?}");
    assert_eq!(r.billed_seconds, r.observed_seconds, "{r:?}");
    assert_eq!(r.billed_seconds, Decimal::new(want, 3), "{r:?}");
    let page =
        f.on.ok(
            &f.member,
            "GET",
            "/v1/usage?limit=1000&from=2026-12-01T00:00:00Z&to=2027-01-01T00:00:00Z",
            None,
        )
        .await;
    page["items"].as_array().unwrap().iter().any(|e| {
        e["corrects"]["id"]
            .as_str()
            .is_some_and(|c| c.ends_with("/exit"))
    })
}

/// A metering pass cut between its events and the record of how far it
/// got (its leader killed there, or that last write failing under load),
/// then an exit the agent reports late, inside the minute the cut pass
/// billed whole. The next pass's final slice reuses that minute's key
/// with a shorter end, so the ledger refuses it; the minute must then be
/// restated to the exit by a correction, not left billed whole. Found by
/// the fleet bench: a leader paused at a minute's end while fenced work
/// was reported late left thousands of instances billed past their exits.
#[tokio::test]
async fn a_pass_cut_before_recording_its_reach_still_bills_a_late_exit_to_the_exit() {
    let f = fixture().await;
    let id = f.placed(1).await.remove(0);
    f.advance_ms(1_300);
    f.report(&id, ObservedPhase::Running { pid: 1 }).await;
    let started = f.on.clock.now();
    // Metered through its first minute (09:01:00), then, at 09:02:05,
    // through its second: the pass whose record is lost.
    f.advance_ms(60_000);
    metering_pass(&f.on.st).await.expect("a metering pass");
    let first_minute = Utc.with_ymd_and_hms(2026, 12, 3, 9, 1, 0).unwrap();
    f.advance_ms(63_700);
    assert!(metering_pass(&f.on.st).await.expect("a metering pass") > 0);
    let instance: flotilla_core::id::InstanceId = serde_json::from_value(json!(id)).unwrap();
    f.on.st
        .store()
        .set_metered_until_many(&[(instance, first_minute)])
        .await
        .expect("the cut pass's record undone");
    // The work had ended at 09:01:50.123, inside the minute billed whole;
    // its agent says so only now.
    let exited_at = first_minute + Duration::milliseconds(50_123);
    f.sync(json!([flotilla_core::api::ObservedInstance {
        instance_id: serde_json::from_value(json!(id)).unwrap(),
        phase: exited(),
        at: exited_at,
        started_at: None,
        message: None,
        container: None,
        weights_tier: None,
        limit_exceeded: None,
    }]))
    .await;
    let op = f.on.operator.clone();
    let inst =
        f.on.ok(&op, "GET", &format!("/v1/instances/{id}"), None)
            .await;
    assert_eq!(inst["state"], "succeeded", "{inst}");
    metering_pass(&f.on.st).await.expect("a metering pass");
    let want = (exited_at - started).num_milliseconds();
    assert_eq!(billed_ms(&f, &id).await, want, "billed to the exit");
    // Settled: more passes add nothing, and reconcile finds nothing.
    assert_eq!(metering_pass(&f.on.st).await.expect("a metering pass"), 0);
    assert_eq!(billed_ms(&f, &id).await, want);
    let r = f.reconcile_to_now_exactly().await;
    assert_eq!(r.differences, vec![], "{r:?}");
    assert_eq!(r.billed_seconds, Decimal::new(want, 3), "{r:?}");
}
