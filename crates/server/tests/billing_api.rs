//! Billing over real HTTP with a real SQLite store: the versioned price
//! catalog and the spot series, billing terms and finalised invoices,
//! budgets (signed webhooks to a real local receiver, the hard cap),
//! estimates, provider payouts and CSV export.

use std::sync::{Arc, Mutex};
use std::time::Duration as StdDuration;

use chrono::{DateTime, Duration, SubsecRound, Utc};
use flotilla_billing::meter::UsageEvent;
use flotilla_server::ServerConfig;
use flotilla_testkit::server::{fast, start, TestServer};
use reqwest::{Method, StatusCode};
use rust_decimal::Decimal;
use serde_json::{json, Value};

/// Billing steps every 100 ms instead of 30 s; webhooks may reach the
/// receiver on 127.0.0.1.
fn quick() -> ServerConfig {
    ServerConfig {
        billing_every: StdDuration::from_millis(100),
        webhook_allow_private: true,
        ..fast()
    }
}

fn dec(v: &Value) -> Decimal {
    v.as_str()
        .unwrap_or_else(|| panic!("not a decimal string: {v}"))
        .parse()
        .unwrap()
}

/// `gpus`×`model` of `tenant` over `[start, end)`, class `class`.
#[allow(clippy::too_many_arguments, reason = "one event's fields")]
fn gpu_event(
    tenant: &str,
    id: &str,
    model: &str,
    gpus: u32,
    class: &str,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
    node: Option<&str>,
) -> UsageEvent {
    serde_json::from_value(json!({
        "key": {"tenant": tenant, "source": "test", "id": id},
        "subject": {"kind": "instance", "id": format!("inst_{id}")},
        "meter": {"meter": "gpu_seconds", "model": model, "share": {"kind": "whole"}},
        "billing_class": class,
        "start": start.to_rfc3339(), "end": end.to_rfc3339(),
        "amount": gpus.to_string(),
        "node": node,
    }))
    .unwrap()
}

/// Appends events straight to the ledger with a window wide enough for old
/// months (the API's 72 h grace would refuse them).
async fn ingest(s: &TestServer, events: &[UsageEvent]) {
    let out = s
        .store
        .append_usage(events, Duration::days(100_000), Utc::now())
        .await
        .unwrap();
    assert!(out.rejected.is_empty(), "{:?}", out.rejected);
}

fn t(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
}

async fn wait_until<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..200 {
        if f().await {
            return;
        }
        tokio::time::sleep(StdDuration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

fn lines_sum(inv: &Value) -> Decimal {
    inv["lines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| dec(&l["amount"]))
        .sum()
}

#[tokio::test]
async fn price_versions_are_published_by_operators_and_name_every_line() {
    let s = start(fast()).await;
    let acme = s.create_tenant("acme").await;
    let member = s.key(&acme, "tenant_member").await;

    let cat = s.ok(&member, Method::GET, "/v1/prices", None).await;
    assert_eq!(cat["in_force"], 1, "{cat}");
    assert_eq!(cat["currency"], "USD");
    let mut next = cat["versions"][0].clone();
    next.as_object_mut().unwrap().remove("version");
    let effective = (Utc::now() + Duration::seconds(4)).trunc_subsecs(3);
    next["effective_from"] = json!(effective.to_rfc3339());
    next["on_demand"]["H100"]["per_gpu_second"] = json!("0.002");

    // Members may read prices, not publish them.
    let (st, _) = s
        .call(&member, Method::POST, "/v1/prices", Some(next.clone()))
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    // Bad versions are refused naming the field, and change nothing.
    let mut past = next.clone();
    past["effective_from"] = json!("2020-01-01T00:00:00Z");
    let mut negative = next.clone();
    negative["on_demand"]["H100"]["per_gpu_second"] = json!("-1");
    let mut euro = next.clone();
    euro["currency"]["code"] = json!("EUR");
    let mut wrong_number = next.clone();
    wrong_number["version"] = json!(7);
    for (body, field) in [
        (past, "effective_from"),
        (negative, "on_demand.H100.per_gpu_second"),
        (euro, "currency"),
        (wrong_number, "version"),
        (json!({"effective_from": 3}), "effective_from"),
    ] {
        let (st, b) = s
            .call(&s.operator, Method::POST, "/v1/prices", Some(body))
            .await;
        assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
        assert_eq!(b["error"]["details"]["field"], field, "{b}");
    }
    let v2 = s
        .ok(&s.operator, Method::POST, "/v1/prices", Some(next))
        .await;
    assert_eq!(v2["version"], 2);
    let cat = s.ok(&member, Method::GET, "/v1/prices", None).await;
    assert_eq!(cat["versions"].as_array().unwrap().len(), 2);
    assert_eq!(cat["in_force"], 1, "version 2 is scheduled, not in force");

    // One minute of H100 on each side of the change: two lines, each
    // naming its version.
    ingest(
        &s,
        &[gpu_event(
            &acme,
            "e1",
            "H100",
            1,
            "on_demand",
            effective - Duration::seconds(60),
            effective + Duration::seconds(60),
            None,
        )],
    )
    .await;
    wait_until("version 2 in force", || async {
        s.ok(&member, Method::GET, "/v1/prices", None).await["in_force"] == 2
    })
    .await;
    let period = effective.format("%Y-%m").to_string();
    let inv = s
        .ok(
            &member,
            Method::GET,
            &format!("/v1/invoices/preview?period={period}"),
            None,
        )
        .await;
    let lines = inv["lines"].as_array().unwrap();
    assert_eq!(lines.len(), 2, "{inv}");
    let v1 = lines.iter().find(|l| l["price_version"] == 1).unwrap();
    let v2 = lines.iter().find(|l| l["price_version"] == 2).unwrap();
    assert_eq!(
        (dec(&v1["quantity"]), dec(&v2["quantity"])),
        (60.into(), 60.into())
    );
    assert_eq!(v2["unit_price"], "0.002");
    assert_eq!(v2["amount"], "0.12");
    // 60 s at $2.99/h = 0.049833… → 0.05 (half-even at the line).
    assert_eq!(v1["amount"], "0.05");
    assert_eq!(dec(&inv["total"]), lines_sum(&inv));
}

#[tokio::test]
async fn spot_prices_are_recorded_from_pool_use_and_price_spot_usage() {
    let s = start(quick()).await;
    let acme = s.create_tenant("acme").await;
    let member = s.key(&acme, "tenant_member").await;
    let owner = s.create_tenant("owner").await;
    let provider = s.key(&owner, "provider").await;
    s.register_node(&provider, "spot-box", &[("H100", 2)]).await;
    let cat = s.ok(&member, Method::GET, "/v1/prices", None).await;
    let band = &cat["versions"][0]["spot"]["H100"];
    let (floor, ceiling) = (dec(&band["floor"]), dec(&band["ceiling"]));

    // An idle pool: the floor.
    wait_until("a point at an idle pool", || async {
        let sp = s.ok(&member, Method::GET, "/v1/prices/spot", None).await;
        sp["latest"].as_array().unwrap().iter().any(|p| {
            p["model"] == "H100" && p["utilisation"] == "0" && p["at"] != "1970-01-01T00:00:00Z"
        })
    })
    .await;
    // One of two GPUs taken: half-way up the band.
    s.ok(
        &member,
        Method::POST,
        "/v1/instances",
        Some(json!({"gpus": 1, "gpu_types": ["H100"], "command": ["sleep", "60"], "billing_class": "spot"})),
    )
    .await;
    let half_point = || async {
        let sp = s.ok(&member, Method::GET, "/v1/prices/spot", None).await;
        sp["latest"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["model"] == "H100" && p["utilisation"] == "0.5")
            .cloned()
    };
    wait_until("a point at half use", || async {
        half_point().await.is_some()
    })
    .await;
    let point = half_point().await.unwrap();
    let half = floor + (ceiling - floor) * Decimal::new(5, 1);
    // The history holds both points, oldest first, a page at a time.
    let h = s
        .ok(
            &member,
            Method::GET,
            "/v1/prices/spot?model=H100&limit=1",
            None,
        )
        .await;
    assert_eq!(h["history"].as_array().unwrap().len(), 1, "{h}");
    assert_eq!(h["history"][0]["utilisation"], "0");
    let next = h["next_from"].as_str().unwrap().to_string();
    let h = s
        .ok(
            &member,
            Method::GET,
            &format!(
                "/v1/prices/spot?model=H100&from={}",
                next.replace('+', "%2B")
            ),
            None,
        )
        .await;
    assert_eq!(h["history"][0]["utilisation"], "0.5", "{h}");
    let (st, b) = s
        .call(&member, Method::GET, "/v1/prices/spot?model=Z9", None)
        .await;
    assert_eq!(
        (st, &b["error"]["details"]["field"]),
        (StatusCode::BAD_REQUEST, &json!("model"))
    );
    assert_eq!(dec(&point["per_gpu_second"]), half);
    assert_eq!(point["price_version"], 1);

    // Spot usage after the point is charged at it, and the line says so.
    let at = t(point["at"].as_str().unwrap());
    ingest(
        &s,
        &[gpu_event(
            &acme,
            "s1",
            "H100",
            2,
            "spot",
            at.trunc_subsecs(0) + Duration::seconds(1),
            at.trunc_subsecs(0) + Duration::seconds(101),
            None,
        )],
    )
    .await;
    let period = at.format("%Y-%m").to_string();
    let inv = s
        .ok(
            &member,
            Method::GET,
            &format!("/v1/invoices/preview?period={period}"),
            None,
        )
        .await;
    let spot: Vec<&Value> = inv["lines"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["kind"] == "spot")
        .collect();
    assert_eq!(spot.len(), 1, "{inv}");
    assert_eq!(t(spot[0]["price_point_at"].as_str().unwrap()), at);
    assert_eq!(dec(&spot[0]["unit_price"]), half);
    assert_eq!(dec(&spot[0]["quantity"]), Decimal::from(200));
}

#[tokio::test]
async fn months_finalise_into_immutable_invoices_with_terms_applied() {
    let s = start(fast()).await;
    let acme = s.create_tenant("acme").await;
    let other = s.create_tenant("other").await;
    let member = s.key(&acme, "tenant_member").await;
    let admin = s.key(&acme, "tenant_admin").await;
    let outsider = s.key(&other, "tenant_admin").await;
    let terms = format!("/v1/tenants/{acme}/terms");

    // Terms: operators only, each validated naming its field.
    let commitment = json!({"kind": "commitment", "id": "res-1", "model": "H100", "gpus": 1,
        "start": "2025-01-01T00:00:00Z", "term_days": 30, "payment": "monthly", "discount": "0.3"});
    let (st, _) = s
        .call(&admin, Method::POST, &terms, Some(commitment.clone()))
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    for (body, field) in [
        (
            json!({"kind": "commitment", "id": "r", "model": "H100", "gpus": 0,
            "start": "2025-01-01T00:00:00Z", "term_days": 30, "payment": "monthly", "discount": "0.3"}),
            "gpus",
        ),
        (
            json!({"kind": "commitment", "id": "r", "model": "Z9", "gpus": 1,
            "start": "2025-01-01T00:00:00Z", "term_days": 30, "payment": "monthly"}),
            "model",
        ),
        (
            // No list offer has a 90-day term: its discount must be given.
            json!({"kind": "commitment", "id": "r", "model": "H100", "gpus": 1,
            "start": "2025-01-01T00:00:00Z", "term_days": 90, "payment": "monthly"}),
            "discount",
        ),
        (
            json!({"kind": "discount", "id": "d", "percent": "150", "scope": "all",
            "from": "2025-01-01T00:00:00Z"}),
            "percent",
        ),
        (
            json!({"kind": "credit", "id": "c", "credit_kind": "prepaid", "amount": "-1"}),
            "amount",
        ),
        (
            json!({"kind": "credit", "id": "c c", "credit_kind": "prepaid", "amount": "1"}),
            "id",
        ),
        (
            json!({"kind": "credit", "id": "c", "credit_kind": "prepaid", "amount": "1", "x": 1}),
            "x",
        ),
    ] {
        let (st, b) = s.call(&s.operator, Method::POST, &terms, Some(body)).await;
        assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
        assert_eq!(b["error"]["details"]["field"], field, "{b}");
    }
    let c = s
        .ok(&s.operator, Method::POST, &terms, Some(commitment.clone()))
        .await;
    assert_eq!(c["price_version"], 1);
    let (st, _) = s
        .call(&s.operator, Method::POST, &terms, Some(commitment))
        .await;
    assert_eq!(st, StatusCode::CONFLICT, "ids are unique");
    s.ok(
        &s.operator,
        Method::POST,
        &terms,
        Some(
            json!({"kind": "discount", "id": "d10", "percent": "10", "scope": "on_demand",
            "from": "2025-01-01T00:00:00Z"}),
        ),
    )
    .await;
    s.ok(
        &s.operator,
        Method::POST,
        &terms,
        Some(
            json!({"kind": "credit", "id": "promo", "credit_kind": "promotional",
            "amount": "5", "granted_at": "2024-12-01T00:00:00Z"}),
        ),
    )
    .await;

    // 2×H100 for an hour: one in the commitment, one above it.
    ingest(
        &s,
        &[gpu_event(
            &acme,
            "u1",
            "H100",
            2,
            "on_demand",
            t("2025-01-10T08:00:00Z"),
            t("2025-01-10T09:00:00Z"),
            None,
        )],
    )
    .await;

    // Finalising: operators only, a closed month only, a real month.
    let fin = "/v1/invoices/finalise";
    let (st, _) = s
        .call(
            &admin,
            Method::POST,
            fin,
            Some(json!({"period": "2025-01"})),
        )
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    let (st, b) = s
        .call(
            &s.operator,
            Method::POST,
            fin,
            Some(json!({"period": "2025-13"})),
        )
        .await;
    assert_eq!(
        (st, &b["error"]["details"]["field"]),
        (StatusCode::UNPROCESSABLE_ENTITY, &json!("period"))
    );
    let this_month = Utc::now().format("%Y-%m").to_string();
    let (st, b) = s
        .call(
            &s.operator,
            Method::POST,
            fin,
            Some(json!({"period": this_month})),
        )
        .await;
    assert_eq!(st, StatusCode::CONFLICT, "grace window open: {b}");

    let out = s
        .ok(
            &s.operator,
            Method::POST,
            fin,
            Some(json!({"period": "2025-01"})),
        )
        .await;
    let finalised = out["finalised"].as_array().unwrap();
    assert_eq!(finalised.len(), 1, "{out}");
    let inv = &finalised[0];
    assert_eq!(inv["tenant"], acme.as_str());
    assert_eq!(inv["status"]["state"], "finalised");
    assert!(out["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .any(|k| k["tenant"] == other.as_str() && k["reason"] == "nothing_to_bill"));
    let kinds: Vec<&str> = inv["lines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["kind"].as_str().unwrap())
        .collect();
    for k in [
        "reserved_used",
        "reserved_unused",
        "overage",
        "discount",
        "credit",
    ] {
        assert!(kinds.contains(&k), "{k} missing: {inv}");
    }
    let used = inv["lines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "reserved_used")
        .unwrap();
    assert_eq!(dec(&used["quantity"]), Decimal::from(3600));
    assert_eq!(used["reference"], "res-1");
    let credit = inv["lines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "credit")
        .unwrap();
    assert_eq!(dec(&credit["amount"]), Decimal::from(-5));
    assert_eq!(dec(&inv["total"]), lines_sum(inv), "total = sum of lines");
    let id = inv["id"].as_str().unwrap().to_string();
    let drawn = s.ok(&member, Method::GET, &terms, None).await;
    assert_eq!(dec(&drawn["credit_drawn"]["promo"]), Decimal::from(5));

    // Final means final: finalising again is 409 (or skipped), and late
    // usage changes the preview, never the stored invoice.
    let (st, b) = s
        .call(
            &s.operator,
            Method::POST,
            fin,
            Some(json!({"period": "2025-01", "tenant": acme})),
        )
        .await;
    assert_eq!(st, StatusCode::CONFLICT, "{b}");
    let again = s
        .ok(
            &s.operator,
            Method::POST,
            fin,
            Some(json!({"period": "2025-01"})),
        )
        .await;
    assert!(again["finalised"].as_array().unwrap().is_empty());
    assert!(again["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .any(|k| k["tenant"] == acme.as_str() && k["reason"] == "already_final"));
    let before = s
        .raw(
            &member,
            Method::GET,
            &format!("/v1/invoices/{id}"),
            None,
            &[],
        )
        .await;
    assert_eq!(before.status, StatusCode::OK);
    ingest(
        &s,
        &[gpu_event(
            &acme,
            "late",
            "H100",
            1,
            "on_demand",
            t("2025-01-20T08:00:00Z"),
            t("2025-01-20T09:00:00Z"),
            None,
        )],
    )
    .await;
    let after = s
        .raw(
            &member,
            Method::GET,
            &format!("/v1/invoices/{id}"),
            None,
            &[],
        )
        .await;
    assert_eq!(before.body, after.body, "a final invoice never changes");
    assert_eq!(&after.body, inv);
    let preview = s
        .ok(
            &member,
            Method::GET,
            "/v1/invoices/preview?period=2025-01",
            None,
        )
        .await;
    assert_ne!(preview["total"], inv["total"]);

    // Lists and reads are per tenant.
    let mine = s.ok(&member, Method::GET, "/v1/invoices", None).await;
    assert_eq!(mine["items"].as_array().unwrap().len(), 1);
    let theirs = s.ok(&outsider, Method::GET, "/v1/invoices", None).await;
    assert!(theirs["items"].as_array().unwrap().is_empty());
    let (st, _) = s
        .call(&outsider, Method::GET, &format!("/v1/invoices/{id}"), None)
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (st, b) = s
        .call(&member, Method::GET, "/v1/invoices/inv_nope", None)
        .await;
    assert_eq!(
        (st, &b["error"]["details"]["field"]),
        (StatusCode::BAD_REQUEST, &json!("invoice_id"))
    );

    // CSV: one row per line, with a header, quoted by the csv crate.
    let csv = s
        .raw(&member, Method::GET, "/v1/invoices?format=csv", None, &[])
        .await;
    assert_eq!(csv.status, StatusCode::OK);
    assert!(csv.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/csv"));
    let text = csv.body.as_str().unwrap().to_string();
    let mut r = csv::Reader::from_reader(text.as_bytes());
    let rows: Vec<csv::StringRecord> = r.records().map(|r| r.unwrap()).collect();
    assert_eq!(rows.len(), inv["lines"].as_array().unwrap().len());
    let total: Decimal = rows.iter().map(|r| r[13].parse::<Decimal>().unwrap()).sum();
    assert_eq!(total, dec(&inv["total"]));
    let one = s
        .raw(
            &member,
            Method::GET,
            &format!("/v1/invoices/{id}"),
            None,
            &[("accept", "text/csv")],
        )
        .await;
    assert_eq!(one.body.as_str().unwrap(), text);
    let usage = s
        .raw(
            &member,
            Method::GET,
            "/v1/usage?from=2025-01-01T00:00:00Z&to=2025-02-01T00:00:00Z&format=csv&limit=1",
            None,
            &[],
        )
        .await;
    assert_eq!(usage.status, StatusCode::OK);
    let text = usage.body.as_str().unwrap();
    assert_eq!(text.lines().count(), 2, "a header and one event: {text}");
    assert!(text.starts_with("tenant,source,id,"));
    assert!(
        usage.headers.contains_key("x-next-cursor"),
        "a second page follows"
    );
    let (st, b) = s
        .call(
            &member,
            Method::GET,
            "/v1/usage?from=2025-01-01T00:00:00Z&to=2025-02-01T00:00:00Z&format=xml",
            None,
        )
        .await;
    assert_eq!(
        (st, &b["error"]["details"]["field"]),
        (StatusCode::BAD_REQUEST, &json!("format"))
    );
}

/// What the local webhook receiver got: signature header and body.
type Received = Arc<Mutex<Vec<(String, String)>>>;

/// A real HTTP receiver on an ephemeral port that fails its first
/// request with 500 (to exercise retries) and accepts the rest.
async fn receiver() -> (String, Received) {
    let (url, got, _) = counting_receiver().await;
    (url, got)
}

/// [`receiver`], also counting every request it got (the first, refused,
/// included).
async fn counting_receiver() -> (String, Received, Arc<std::sync::atomic::AtomicUsize>) {
    let got: Received = Arc::default();
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = calls.clone();
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post({
            let got = got.clone();
            move |headers: axum::http::HeaderMap, body: String| {
                let got = got.clone();
                let calls = calls.clone();
                async move {
                    if calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                        return StatusCode::INTERNAL_SERVER_ERROR;
                    }
                    let sig = headers
                        .get("flotilla-signature")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_string();
                    got.lock().unwrap().push((sig, body));
                    StatusCode::NO_CONTENT
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/hook"), got, counter)
}

#[tokio::test]
async fn budgets_alert_by_signed_webhook_and_the_hard_cap_spares_tier_one() {
    let s = start(quick()).await;
    let acme = s.create_tenant("acme").await;
    let admin = s.key(&acme, "tenant_admin").await;
    let member = s.key(&acme, "tenant_member").await;
    let (url, got) = receiver().await;
    let secret = "whsec-0123456789abcdef";

    let (st, _) = s.call(&member, Method::GET, "/v1/budget", None).await;
    assert_eq!(st, StatusCode::NOT_FOUND, "no budget yet");
    for (body, field) in [
        (json!({"limit": "0"}), "limit"),
        (json!({"limit": "1", "webhook_url": url}), "webhook_secret"),
        (
            json!({"limit": "1", "webhook_url": "ftp://x", "webhook_secret": secret}),
            "webhook_url",
        ),
        (
            json!({"limit": "1", "webhook_url": url, "webhook_secret": "short"}),
            "webhook_secret",
        ),
        (json!({"limit": "1", "thresholds": [0]}), "thresholds"),
        (json!({"limit": "ten"}), "limit"),
    ] {
        let (st, b) = s.call(&admin, Method::PUT, "/v1/budget", Some(body)).await;
        assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
        assert_eq!(b["error"]["details"]["field"], field, "{b}");
    }
    let body =
        json!({"limit": "1", "hard_cap": true, "webhook_url": url, "webhook_secret": secret});
    let (st, _) = s
        .call(&member, Method::PUT, "/v1/budget", Some(body.clone()))
        .await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    let b = s.ok(&admin, Method::PUT, "/v1/budget", Some(body)).await;
    assert_eq!(b["hard_cap"], true);
    assert!(
        b.get("webhook_secret").is_none(),
        "the secret is never shown"
    );

    // Under the cap: spot work starts.
    let spot = json!({"gpus": 1, "command": ["true"], "billing_class": "spot"});
    s.ok(&member, Method::POST, "/v1/instances", Some(spot.clone()))
        .await;

    // An hour of H100 this month ($2.99) crosses 50, 80 and 100 % of $1.
    let end = Utc::now().trunc_subsecs(0) - Duration::seconds(5);
    ingest(
        &s,
        &[gpu_event(
            &acme,
            "b1",
            "H100",
            1,
            "on_demand",
            end - Duration::hours(1),
            end,
            None,
        )],
    )
    .await;
    wait_until("three delivered alerts", || async {
        got.lock().unwrap().len() >= 3
    })
    .await;
    let received = got.lock().unwrap().clone();
    assert_eq!(received.len(), 3, "each threshold once");
    let mut thresholds = Vec::new();
    for (sig, body) in &received {
        flotilla_billing::budget::verify_webhook(
            secret.as_bytes(),
            sig,
            body.as_bytes(),
            Utc::now(),
            300,
        )
        .unwrap_or_else(|e| panic!("signature of {body} does not verify: {e}"));
        assert!(flotilla_billing::budget::verify_webhook(
            b"wrong-secret-123",
            sig,
            body.as_bytes(),
            Utc::now(),
            300
        )
        .is_err());
        let alert: Value = serde_json::from_str(body).unwrap();
        assert_eq!(alert["tenant"], acme.as_str());
        thresholds.push(alert["threshold_percent"].as_u64().unwrap());
    }
    thresholds.sort_unstable();
    assert_eq!(thresholds, [50, 80, 100]);
    wait_until("the delivery log to show three deliveries", || async {
        let view = s.ok(&member, Method::GET, "/v1/budget", None).await;
        view["deliveries"]
            .as_array()
            .is_some_and(|d| d.iter().filter(|d| d["state"] == "delivered").count() == 3)
    })
    .await;
    let view = s.ok(&member, Method::GET, "/v1/budget", None).await;
    assert_eq!(view["alerts"].as_array().unwrap().len(), 3);
    assert!(dec(&view["spend"]) >= Decimal::ONE);
    let attempts: u64 = view["deliveries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["attempts"].as_u64().unwrap())
        .sum();
    assert_eq!(
        attempts, 4,
        "the first attempt failed (500) and was retried: {view}"
    );

    // Over the cap: spot and preemptible tier 2-3 are refused with a clear
    // error; tier 1 and on-demand still start.
    for (body, field) in [
        (spot.clone(), "billing_class"),
        (
            json!({"gpus": 1, "command": ["true"], "preemptible": true, "tier": 3}),
            "preemptible",
        ),
    ] {
        let (st, b) = s
            .call(&member, Method::POST, "/v1/instances", Some(body))
            .await;
        assert_eq!(st, StatusCode::PAYMENT_REQUIRED, "{b}");
        assert_eq!(b["error"]["code"], "budget_exceeded");
        assert_eq!(b["error"]["details"]["field"], field);
    }
    s.ok(
        &member,
        Method::POST,
        "/v1/instances",
        Some(json!({"gpus": 1, "command": ["true"], "billing_class": "spot", "tier": 1, "preemptible": false})),
    )
    .await;
    s.ok(
        &member,
        Method::POST,
        "/v1/instances",
        Some(json!({"gpus": 1, "command": ["true"]})),
    )
    .await;
    // Nothing already running was stopped.
    let list = s.ok(&member, Method::GET, "/v1/instances", None).await;
    assert!(list["items"]
        .as_array()
        .unwrap()
        .iter()
        .all(|i| i["state"] != "stopped" && i["state"] != "preempted"));
}

#[tokio::test]
async fn webhooks_never_reach_the_operators_network_unless_allowed() {
    let s = start(ServerConfig {
        webhook_allow_private: false,
        ..quick()
    })
    .await;
    let acme = s.create_tenant("acme").await;
    let admin = s.key(&acme, "tenant_admin").await;
    let secret = "whsec-0123456789abcdef";
    // Refused when the budget is set, naming the field.
    for url in [
        "http://127.0.0.1:8080/hook",
        "http://[::1]/hook",
        "http://10.0.0.7/hook",
        "http://172.20.1.1/hook",
        "http://192.168.0.1/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://[fd12::1]/hook",
        "http://[fe80::1]/hook",
        "http://0.0.0.0:7420/hook",
        "http://[::ffff:127.0.0.1]/hook",
        "http://0x7f.1/hook",
        "http://localhost:7420/hook",
    ] {
        let body = json!({"limit": "1", "webhook_url": url, "webhook_secret": secret});
        let (st, b) = s.call(&admin, Method::PUT, "/v1/budget", Some(body)).await;
        assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{url}: {b}");
        assert_eq!(b["error"]["details"]["field"], "webhook_url", "{b}");
        assert!(
            b["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--allow-egress"),
            "{b}"
        );
    }

    // A budget stored before the rule (or a name that resolved elsewhere
    // when it was set): delivery resolves the name again, finds loopback,
    // never connects, and marks the delivery failed.
    let (url, _, calls) = counting_receiver().await;
    let port = url.rsplit(':').next().unwrap().trim_end_matches("/hook");
    let by_name = format!("http://localhost:{port}/hook");
    s.store
        .set_budget(&flotilla_store::budgets::StoredBudget {
            budget: flotilla_billing::budget::Budget {
                tenant: flotilla_core::id::TenantId::parse(&acme, "tenant").unwrap(),
                limit: Decimal::ONE,
                currency: "USD".into(),
                thresholds: vec![50],
                hard_cap: false,
            },
            webhook_url: Some(by_name),
            webhook_secret: Some(secret.into()),
            updated_at: Utc::now(),
        })
        .await
        .unwrap();
    let end = Utc::now().trunc_subsecs(0) - Duration::seconds(5);
    ingest(
        &s,
        &[gpu_event(
            &acme,
            "p1",
            "H100",
            1,
            "on_demand",
            end - Duration::hours(1),
            end,
            None,
        )],
    )
    .await;
    let member = s.key(&acme, "tenant_member").await;
    wait_until("the delivery to be refused", || async {
        let view = s.ok(&member, Method::GET, "/v1/budget", None).await;
        view["deliveries"]
            .as_array()
            .is_some_and(|d| d.len() == 1 && d[0]["state"] == "failed")
    })
    .await;
    let view = s.ok(&member, Method::GET, "/v1/budget", None).await;
    let d = &view["deliveries"][0];
    assert_eq!(d["attempts"], 1, "refused for good, not retried: {d}");
    assert!(
        d["last_error"].as_str().unwrap().contains("a loopback"),
        "{d}"
    );
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the receiver was never called"
    );
}

#[tokio::test]
async fn estimates_compare_models_and_name_the_cheapest_that_meets_the_workload() {
    let s = start(fast()).await;
    let acme = s.create_tenant("acme").await;
    let member = s.key(&acme, "tenant_member").await;
    let est = s
        .ok(
            &member,
            Method::POST,
            "/v1/estimates",
            Some(
                json!({"kind": "gpu", "model": "h100", "gpus": 8, "hours_per_day": "10",
                "duty_cycle": "0.6", "tier": 2, "serves_requests": false}),
            ),
        )
        .await;
    let options = est["options"].as_array().unwrap();
    assert!(options.len() >= 3, "{est}");
    assert!(options.iter().all(|o| o["model"] == "H100"));
    let cheapest = &est["cheapest"];
    assert_eq!(cheapest["meets"], true);
    let min = options
        .iter()
        .filter(|o| o["meets"] == true)
        .map(|o| dec(&o["monthly_cost"]))
        .min()
        .unwrap();
    assert_eq!(dec(&cheapest["monthly_cost"]), min);
    // Tier 1 never runs on spot.
    let est = s
        .ok(
            &member,
            Method::POST,
            "/v1/estimates",
            Some(json!({"kind": "gpu", "gpus": 1, "hours_per_day": "24",
                "duty_cycle": "1", "tier": 1, "serves_requests": false})),
        )
        .await;
    assert_ne!(est["cheapest"]["billing_model"]["kind"], "spot", "{est}");
    let est = s
        .ok(
            &member,
            Method::POST,
            "/v1/estimates",
            Some(json!({"kind": "serverless", "requests_per_second": "2",
                "input_tokens_per_request": "500", "output_tokens_per_request": "200",
                "gpu_seconds_per_request": "0.5", "tier": 2})),
        )
        .await;
    assert!(!est["options"].as_array().unwrap().is_empty(), "{est}");
    for (body, field) in [
        (
            json!({"kind": "gpu", "gpus": 1, "hours_per_day": "10", "duty_cycle": "1.5",
            "tier": 2, "serves_requests": false}),
            "duty_cycle",
        ),
        (
            json!({"kind": "gpu", "model": "Z9", "gpus": 1, "hours_per_day": "10",
            "duty_cycle": "1", "tier": 2, "serves_requests": false}),
            "model",
        ),
        (
            json!({"kind": "gpu", "gpus": 1, "hours_per_day": "10", "duty_cycle": "1",
            "tier": 7, "serves_requests": false}),
            "tier",
        ),
        (json!({"kind": "tpu"}), "kind"),
    ] {
        let (st, b) = s
            .call(&member, Method::POST, "/v1/estimates", Some(body))
            .await;
        assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
        assert!(
            b["error"]["details"]["field"]
                .as_str()
                .unwrap()
                .ends_with(field),
            "{field}: {b}"
        );
    }
}

#[tokio::test]
async fn providers_are_paid_for_the_usage_their_nodes_carried() {
    let s = start(fast()).await;
    let acme = s.create_tenant("acme").await;
    let member = s.key(&acme, "tenant_member").await;
    let p_tenant = s.create_tenant("gpu-owner").await;
    let q_tenant = s.create_tenant("gpu-owner-2").await;
    let p = s.key(&p_tenant, "provider").await;
    let q = s.key(&q_tenant, "provider").await;
    let n1 = s.register_node(&p, "p-box", &[("H100", 2)]).await;
    let n2 = s.register_node(&q, "q-box", &[("H100", 8)]).await;
    // 10 h of one H100 on P's node, 2 h of 8 on Q's.
    ingest(
        &s,
        &[
            gpu_event(
                &acme,
                "x1",
                "H100",
                1,
                "on_demand",
                t("2025-01-10T08:00:00Z"),
                t("2025-01-10T18:00:00Z"),
                Some(&n1),
            ),
            gpu_event(
                &acme,
                "x2",
                "H100",
                8,
                "on_demand",
                t("2025-01-10T00:00:00Z"),
                t("2025-01-10T02:00:00Z"),
                Some(&n2),
            ),
        ],
    )
    .await;
    let mine = s
        .ok(&p, Method::GET, "/v1/payouts?period=2025-01", None)
        .await;
    let items = mine["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{mine}");
    let st = &items[0];
    assert!(st["provider"].as_str().unwrap().starts_with("prov_"));
    // 36,000 GPU-s at $2.99/h = $29.90; 15 % fee = 4.485 → 4.48 (half-even).
    assert_eq!(dec(&st["gross"]), Decimal::new(2990, 2));
    assert_eq!(dec(&st["operator_fee"]), Decimal::new(448, 2));
    assert_eq!(dec(&st["payout"]), Decimal::new(2542, 2));
    let theirs = s
        .ok(&q, Method::GET, "/v1/payouts?period=2025-01", None)
        .await;
    // 57,600 GPU-s at $2.99/h = $47.84.
    assert_eq!(dec(&theirs["items"][0]["gross"]), Decimal::new(4784, 2));
    let all = s
        .ok(&s.operator, Method::GET, "/v1/payouts?period=2025-01", None)
        .await;
    assert_eq!(all["items"].as_array().unwrap().len(), 2);
    let (code, _) = s
        .call(&member, Method::GET, "/v1/payouts?period=2025-01", None)
        .await;
    assert_eq!(code, StatusCode::FORBIDDEN);
    let (code, b) = s
        .call(&p, Method::GET, "/v1/payouts?period=jan", None)
        .await;
    assert_eq!(
        (code, &b["error"]["details"]["field"]),
        (StatusCode::BAD_REQUEST, &json!("period"))
    );
    let other = theirs["items"][0]["provider"].as_str().unwrap();
    let (code, _) = s
        .call(
            &p,
            Method::GET,
            &format!("/v1/payouts?period=2025-01&provider={other}"),
            None,
        )
        .await;
    assert_eq!(code, StatusCode::NOT_FOUND, "another provider's statement");
}

#[tokio::test]
async fn a_webhook_the_operator_allows_is_delivered_and_an_unreachable_one_says_only_that() {
    // Not every address: only this machine's loopback, by the general
    // rule (`--allow-egress 127.0.0.1`).
    let s = start(ServerConfig {
        webhook_allow_private: false,
        allow_egress: vec!["127.0.0.1".parse().unwrap()],
        ..quick()
    })
    .await;
    let secret = "whsec-0123456789abcdef";
    let (url, _, calls) = counting_receiver().await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap();
    let end = Utc::now().trunc_subsecs(0) - Duration::seconds(5);
    let mut tenants = Vec::new();
    for (name, hook) in [
        ("acme", url.clone()),
        ("initech", format!("http://{closed}/hook")),
    ] {
        let t = s.create_tenant(name).await;
        let admin = s.key(&t, "tenant_admin").await;
        let body = json!({"limit": "1", "webhook_url": hook, "webhook_secret": secret});
        let (st, b) = s.call(&admin, Method::PUT, "/v1/budget", Some(body)).await;
        assert_eq!(st, StatusCode::OK, "{name}: {b}");
        // Still refused: what the rule does not name.
        let body =
            json!({"limit": "1", "webhook_url": "http://[::1]/hook", "webhook_secret": secret});
        let (st, b) = s.call(&admin, Method::PUT, "/v1/budget", Some(body)).await;
        assert_eq!(st, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
        ingest(
            &s,
            &[gpu_event(
                &t,
                &format!("{name}-p1"),
                "H100",
                1,
                "on_demand",
                end - Duration::hours(1),
                end,
                None,
            )],
        )
        .await;
        let member = s.key(&t, "tenant_member").await;
        tenants.push((t, member));
    }
    let (_, acme) = &tenants[0];
    wait_until("the allowed receiver gets the alert", || async {
        let view = s.ok(acme, Method::GET, "/v1/budget", None).await;
        view["deliveries"]
            .as_array()
            .is_some_and(|d| !d.is_empty() && d.iter().all(|d| d["state"] == "delivered"))
    })
    .await;
    assert!(calls.load(std::sync::atomic::Ordering::SeqCst) >= 2);
    let (_, initech) = &tenants[1];
    wait_until("the closed port's delivery records its error", || async {
        let view = s.ok(initech, Method::GET, "/v1/budget", None).await;
        view["deliveries"][0]["last_error"].is_string()
    })
    .await;
    let last = s.ok(initech, Method::GET, "/v1/budget", None).await;
    assert_eq!(
        last["deliveries"][0]["last_error"], "receiver unreachable",
        "refused, reset and timed out read alike: {last}"
    );
}
