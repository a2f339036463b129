//! Usage ingestion and invoice preview over real HTTP with a real SQLite
//! store: roles, batch limits, duplicates on re-send, tenant isolation, and
//! an invoice whose total is the sum of its lines.

use chrono::{Datelike, SubsecRound, Utc};
use flotilla_testkit::server::{fast, TestServer};
use reqwest::{Method, StatusCode};
use rust_decimal::Decimal;
use serde_json::{json, Value};

async fn start() -> TestServer {
    flotilla_testkit::server::start(fast()).await
}

/// `n` one-minute H100 events of `tenant`, ending a minute before the
/// test started (so every call builds the same events).
fn batch(tenant: &str, n: usize, node: &str) -> (Vec<Value>, chrono::DateTime<Utc>) {
    static END: std::sync::OnceLock<chrono::DateTime<Utc>> = std::sync::OnceLock::new();
    let end = *END.get_or_init(|| Utc::now().trunc_subsecs(0) - chrono::Duration::seconds(60));
    let start = end - chrono::Duration::seconds(60);
    let events = (0..n)
        .map(|i| {
            json!({
                "key": {"tenant": tenant, "source": "agent:n1", "id": format!("e{i}")},
                "subject": {"kind": "instance", "id": format!("inst_{}", i % 10)},
                "meter": {"meter": "gpu_seconds", "model": "H100", "share": {"kind": "whole"}},
                "billing_class": "on_demand",
                "start": start.to_rfc3339(),
                "end": end.to_rfc3339(),
                "amount": "1",
                "node": node
            })
        })
        .collect();
    (events, start)
}

#[tokio::test]
async fn providers_send_usage_tenants_read_it_and_invoices_add_up() {
    let s = start().await;
    let acme = s.create_tenant("acme").await;
    let other = s.create_tenant("other").await;
    let provider_tenant = s.create_tenant("gpu-owner").await;
    let provider = s.key(&provider_tenant, "provider").await;
    let member = s.key(&acme, "tenant_member").await;
    let admin = s.key(&acme, "tenant_admin").await;
    let outsider = s.key(&other, "tenant_member").await;
    let node = s
        .ok(
            &provider,
            Method::POST,
            "/v1/agent/register",
            Some(json!({"name": "gpu-box", "cpu_milli": 1000, "memory_mb": 1024, "simulated": true,
                        "gpus": [{"index": 0, "model": "H100", "uuid": "GPU-0", "memory_mib": 81920, "vendor": "nvidia"}]})),
        )
        .await["node_id"]
        .as_str()
        .unwrap()
        .to_string();

    let (events, start) = batch(&acme, 2_000, &node);
    let body = json!({ "events": events });
    let r = s
        .ok(
            &provider,
            Method::POST,
            "/v1/usage/events",
            Some(body.clone()),
        )
        .await;
    assert_eq!(
        (r["accepted"].as_u64(), r["duplicates"].as_u64()),
        (Some(2_000), Some(0)),
        "{r}"
    );
    // The same batch again, as after a lost answer: all duplicates.
    let r = s
        .ok(
            &provider,
            Method::POST,
            "/v1/usage/events",
            Some(body.clone()),
        )
        .await;
    assert_eq!(
        (r["accepted"].as_u64(), r["duplicates"].as_u64()),
        (Some(0), Some(2_000))
    );
    assert_eq!(r["rejected"], json!([]));
    // With an Idempotency-Key header too (the usage route is exempt from
    // the generic replay store, which buffers at most 1 MiB).
    let big = reqwest::Client::new()
        .post(format!("{}/v1/usage/events", s.url))
        .bearer_auth(&provider)
        .header("idempotency-key", "k1")
        .json(&json!({ "events": batch(&acme, 8_000, &node).0 }))
        .send()
        .await
        .unwrap();
    assert_eq!(big.status(), StatusCode::OK);
    let big: Value = big.json().await.unwrap();
    assert_eq!(
        (big["accepted"].as_u64(), big["duplicates"].as_u64()),
        (Some(6_000), Some(2_000))
    );

    // A provider reports usage of its own nodes only: not without a node,
    // and not on another provider's node.
    let rival = s.key(&other, "provider").await;
    let (mut nameless, _) = batch(&acme, 2, &node);
    nameless[1].as_object_mut().unwrap().remove("node");
    for (key, events, field) in [
        (&provider, json!(nameless), "events[1].node"),
        (&rival, json!(batch(&acme, 2, &node).0), "events[0].node"),
    ] {
        let (status, b) = s
            .call(
                key,
                Method::POST,
                "/v1/usage/events",
                Some(json!({ "events": events })),
            )
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
        assert_eq!(b["error"]["details"]["field"], field);
    }

    // Tenants may not send usage.
    for key in [&member, &admin] {
        let (status, _) = s
            .call(key, Method::POST, "/v1/usage/events", Some(body.clone()))
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN);
    }
    // Edge validation names the field; nothing of the batch is stored.
    let (mut bad, _) = batch(&acme, 3, &node);
    bad[1]["amount"] = json!("0");
    let (status, b) = s
        .call(
            &provider,
            Method::POST,
            "/v1/usage/events",
            Some(json!({"events": bad})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
    assert_eq!(b["error"]["details"]["field"], "events[1].amount");
    let (status, b) = s
        .call(
            &provider,
            Method::POST,
            "/v1/usage/events",
            Some(json!({"events": batch(&acme, 10_001, &node).0})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
    assert_eq!(b["error"]["details"]["field"], "events");
    let (status, b) = s
        .call(
            &provider,
            Method::POST,
            "/v1/usage/events",
            Some(json!({"events": [{"key": 1}]})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{b}");

    // The tenant's member walks its usage page by page.
    let from = (start - chrono::Duration::hours(1)).to_rfc3339();
    let to = (Utc::now() + chrono::Duration::hours(1)).to_rfc3339();
    let q = format!("from={}&to={}", urlencode(&from), urlencode(&to));
    let mut seen = 0;
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/usage?{q}&limit=1000&cursor={c}"),
            None => format!("/v1/usage?{q}&limit=1000"),
        };
        let page = s.ok(&member, Method::GET, &path, None).await;
        seen += page["items"].as_array().unwrap().len();
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    assert_eq!(seen, 8_000);
    // Another tenant sees none of it and cannot name it.
    let page = s
        .ok(&outsider, Method::GET, &format!("/v1/usage?{q}"), None)
        .await;
    assert_eq!(page["items"], json!([]));
    let (status, _) = s
        .call(
            &outsider,
            Method::GET,
            &format!("/v1/usage?{q}&tenant={acme}"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, b) = s
        .call(&member, Method::GET, "/v1/usage?from=yesterday", None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(b["error"]["details"]["field"], "from");

    // The invoice preview: the total is the sum of its lines, and for
    // 8,000 H100-minutes at $2.99/h it is 8,000 × 60 × 2.99 / 3600.
    let period = format!("{:04}-{:02}", start.year(), start.month());
    let inv = s
        .ok(
            &member,
            Method::GET,
            &format!("/v1/invoices/preview?period={period}"),
            None,
        )
        .await;
    let dec = |v: &Value| v.as_str().unwrap().parse::<Decimal>().unwrap();
    let lines = inv["lines"].as_array().unwrap();
    let sum: Decimal = lines.iter().map(|l| dec(&l["amount"])).sum();
    assert_eq!(sum, dec(&inv["total"]), "{inv}");
    let month_start = chrono::NaiveDate::from_ymd_opt(start.year(), start.month(), 1)
        .unwrap()
        .and_hms_opt(0, 0, 0)
        .unwrap()
        .and_utc();
    if start >= month_start {
        assert_eq!(
            dec(&inv["total"]),
            "398.67".parse::<Decimal>().unwrap(),
            "{inv}"
        );
    }
    // The operator may preview any tenant; the outsider may not.
    let op = s
        .ok(
            &s.operator,
            Method::GET,
            &format!("/v1/invoices/preview?period={period}&tenant={acme}"),
            None,
        )
        .await;
    assert_eq!(op["total"], inv["total"]);
    let (status, _) = s
        .call(
            &outsider,
            Method::GET,
            &format!("/v1/invoices/preview?period={period}&tenant={acme}"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, b) = s
        .call(
            &member,
            Method::GET,
            "/v1/invoices/preview?period=2025-13",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(b["error"]["details"]["field"], "period");

    // Documented.
    let doc = s.ok(&member, Method::GET, "/v1/openapi.json", None).await;
    for p in ["/v1/usage/events", "/v1/usage", "/v1/invoices/preview"] {
        assert!(doc["paths"].get(p).is_some(), "{p} missing from openapi");
    }
}

fn urlencode(s: &str) -> String {
    s.replace('+', "%2B").replace(':', "%3A")
}
