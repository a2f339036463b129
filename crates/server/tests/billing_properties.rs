//! Property: a finalised, stored invoice equals the sum of its lines and is
//! byte-identical whatever order (and with whatever duplicates) its usage
//! was ingested in, and identical to flotilla-billing's reference computed
//! from the raw events. It runs the server's own rating path (stored
//! catalog, rollup, terms) on real SQLite stores.

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, Utc};
use flotilla_billing::invoice::{build_invoice, InvoiceInput};
use flotilla_billing::meter::UsageEvent;
use flotilla_billing::price::{
    Commitment, CreditGrant, CreditKind, Discount, DiscountScope, Payment,
};
use flotilla_billing::Period;
use flotilla_core::catalog::Catalog;
use flotilla_core::id::{InvoiceId, TenantId};
use flotilla_server::pricing::{finalise_invoice, price_book, spot_series};
use flotilla_store::Store;
use proptest::prelude::*;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rust_decimal::Decimal;

fn jan(s: i64) -> DateTime<Utc> {
    // 2025-01-01T00:00:00Z + s seconds.
    DateTime::from_timestamp(1_735_689_600 + s, 0).unwrap()
}

#[derive(Debug, Clone)]
struct Spec {
    model: usize,
    class: usize,
    start: i64,
    secs: i64,
    amount: u32,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        0usize..2,
        0usize..3,
        0i64..(30 * 86_400),
        1i64..20_000,
        1u32..5,
    )
        .prop_map(|(model, class, start, secs, amount)| Spec {
            model,
            class,
            start,
            secs,
            amount,
        })
}

fn event(tenant: &TenantId, i: usize, s: &Spec) -> UsageEvent {
    let model = ["H100", "A100-80GB"][s.model];
    let class = ["on_demand", "spot", "reserved"][s.class];
    serde_json::from_value(serde_json::json!({
        "key": {"tenant": tenant, "source": "prop", "id": format!("e{i}")},
        "subject": {"kind": "instance", "id": format!("inst_{}", i % 7)},
        "meter": {"meter": "gpu_seconds", "model": model,
                  "share": {"kind": "whole"}},
        "billing_class": class,
        "start": jan(s.start).to_rfc3339(),
        "end": jan(s.start + s.secs).to_rfc3339(),
        "amount": s.amount.to_string(),
    }))
    .unwrap()
}

async fn store_with_terms(tenant: &TenantId, now: DateTime<Utc>) -> flotilla_testkit::db::TestDb {
    let db = flotilla_testkit::db::sqlite().await;
    let s = &db.store;
    s.create_tenant(tenant, "acme", jan(-86_400)).await.unwrap();
    let book = price_book(s, &Catalog::default(), now).await.unwrap();
    let c = Commitment::sign(
        "res-1",
        tenant.clone(),
        "H100",
        2,
        jan(86_400),
        30,
        Payment::Monthly,
        Decimal::new(3, 1),
        &book,
    )
    .unwrap();
    s.add_commitment(&c, now).await.unwrap();
    s.add_discount(
        &Discount {
            id: "d5".into(),
            tenant: tenant.clone(),
            percent: Decimal::from(5),
            scope: DiscountScope::All,
            from: jan(0),
            until: None,
        },
        now,
    )
    .await
    .unwrap();
    s.add_credit(
        &CreditGrant {
            id: "promo".into(),
            tenant: tenant.clone(),
            kind: CreditKind::Promotional,
            amount: Decimal::from(7),
            granted_at: jan(0),
            expires_at: None,
        },
        now,
    )
    .await
    .unwrap();
    db
}

/// Ingests `events` in `order`, in chunks of `chunk`, re-sending each
/// chunk's first event again in the next chunk (duplicates), and returns
/// the stored finalised invoice's bytes.
async fn finalised_bytes(
    store: &Store,
    tenant: &TenantId,
    events: &[UsageEvent],
    order: &[usize],
    chunk: usize,
    now: DateTime<Utc>,
) -> String {
    let mut prev_first: Option<UsageEvent> = None;
    for part in order.chunks(chunk.max(1)) {
        let mut batch: Vec<UsageEvent> = part.iter().map(|i| events[*i].clone()).collect();
        if let Some(d) = prev_first.take() {
            batch.push(d);
        }
        prev_first = batch.first().cloned();
        let out = store
            .append_usage(&batch, Duration::days(100_000), now)
            .await
            .unwrap();
        assert!(out.rejected.is_empty());
    }
    let inv = finalise_invoice(
        store,
        &Catalog::default(),
        tenant,
        Period::month(2025, 1).unwrap(),
        &InvoiceId::generate(7, 7),
        now,
        Duration::hours(72),
    )
    .await
    .unwrap();
    let (_, body) = store.invoice_json(inv.id()).await.unwrap();
    body
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn finalised_invoices_sum_their_lines_and_ignore_ingestion_order(
        specs in prop::collection::vec(spec(), 1..60),
        seed_a in any::<u64>(),
        seed_b in any::<u64>(),
        chunk_a in 1usize..20,
        chunk_b in 1usize..20,
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let tenant = TenantId::generate(1, 1);
            let now = DateTime::parse_from_rfc3339("2025-03-01T00:00:00Z").unwrap().with_timezone(&Utc);
            let events: Vec<UsageEvent> = specs.iter().enumerate().map(|(i, s)| event(&tenant, i, s)).collect();
            let mut a: Vec<usize> = (0..events.len()).collect();
            let mut b = a.clone();
            a.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed_a));
            b.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed_b));

            let da = store_with_terms(&tenant, now).await;
            let db = store_with_terms(&tenant, now).await;
            let bytes_a = finalised_bytes(&da.store, &tenant, &events, &a, chunk_a, now).await;
            let bytes_b = finalised_bytes(&db.store, &tenant, &events, &b, chunk_b, now).await;
            prop_assert_eq!(&bytes_a, &bytes_b);

            // The reference: the pure rules over the raw events.
            let book = price_book(&da.store, &Catalog::default(), now).await.unwrap();
            let spot = spot_series(&da.store, &book, Period::month(2025, 1).unwrap().end).await.unwrap();
            let reference = build_invoice(InvoiceInput {
                id: &InvoiceId::generate(7, 7),
                tenant: &tenant,
                period: Period::month(2025, 1).unwrap(),
                events: &events,
                book: &book,
                spot: &spot,
                commitments: &da.store.commitments(&tenant).await.unwrap(),
                discounts: &da.store.discounts(&tenant).await.unwrap(),
                credits: &da.store.credits(&tenant).await.unwrap(),
                credit_used_before: &BTreeMap::new(),
            })
            .unwrap()
            .invoice
            .finalise(now, Duration::hours(72))
            .unwrap()
            .to_json()
            .unwrap();
            prop_assert_eq!(&bytes_a, &reference);

            let inv: serde_json::Value = serde_json::from_str(&bytes_a).unwrap();
            let sum: Decimal = inv["lines"].as_array().unwrap().iter()
                .map(|l| l["amount"].as_str().unwrap().parse::<Decimal>().unwrap())
                .sum();
            prop_assert_eq!(sum, inv["total"].as_str().unwrap().parse::<Decimal>().unwrap());
            Ok(())
        })?;
    }
}
