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
