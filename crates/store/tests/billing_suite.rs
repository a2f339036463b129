//! The billing tables, run against every backend: SQLite always,
//! PostgreSQL when `FLOTILLA_TEST_DATABASE_URL` is set. Price versions and
//! spot points are append-only, final invoices are written once with their
//! credit draws, budget alerts fire once per threshold and period, and the
//! webhook delivery log keeps every attempt.

use std::collections::BTreeMap;
use std::str::FromStr;

use chrono::{DateTime, Duration, Utc};
use flotilla_billing::budget::{Budget, BudgetAlert};
use flotilla_billing::invoice::{build_invoice, InvoiceInput};
use flotilla_billing::price::{
    CreditGrant, CreditKind, Discount, DiscountScope, OnDemandPrice, PriceBook, PriceVersion,
    Schedule, ServerlessPrices, SpotBand, SpotPoint, SpotSeries,
};
use flotilla_billing::{Currency, Period};
use flotilla_core::api::{DiscoveredGpu, RegisterNode};
use flotilla_core::catalog::Vendor;
use flotilla_core::id::{GpuId, InvoiceId, NodeId, ProviderId, TenantId};
use flotilla_store::budgets::{DeliveryState, StoredBudget};
use flotilla_store::{PageReq, Store, StoreError};
use flotilla_testdb::rnd;
use rust_decimal::Decimal;

fn d(s: &str) -> Decimal {
    Decimal::from_str(s).unwrap()
}

/// 2025-01-10T00:00:00Z.
fn day() -> DateTime<Utc> {
    DateTime::from_timestamp(1_736_467_200, 0).unwrap()
}

flotilla_testdb::backend_suite!(
    "billing":
    price_versions_and_spot_points_are_append_only,
    final_invoices_are_written_once_with_their_credit_draws,
    budget_alerts_fire_once_and_deliveries_log_attempts,
    providers_own_nodes,
);

async fn tenant(s: &Store) -> TenantId {
    let id = TenantId::generate(1, rnd());
    s.create_tenant(&id, &format!("t{}", rnd()), day())
        .await
        .unwrap();
    id
}

fn version(n: u32, from: DateTime<Utc>, h100: &str) -> PriceVersion {
    let free = || Schedule::Flat {
        unit_price: Decimal::ZERO,
    };
    PriceVersion {
        version: n,
        effective_from: from,
        currency: Currency::usd(),
        on_demand: [(
            "H100".to_string(),
            OnDemandPrice {
                per_gpu_second: d(h100),
                minimum_seconds: 0,
            },
        )]
        .into(),
        spot: [(
            "H100".to_string(),
            SpotBand {
                floor: d("0.0004"),
                ceiling: d("0.0008"),
            },
        )]
        .into(),
        serverless: ServerlessPrices {
            per_request: free(),
            per_million_input_tokens: free(),
            per_million_output_tokens: free(),
            per_gpu_second: BTreeMap::new(),
        },
        reserved_offers: Vec::new(),
        per_instance_second: Decimal::ZERO,
        per_storage_gb_second: Decimal::ZERO,
        per_parked_gb_hour: Decimal::ZERO,
    }
}

async fn price_versions_and_spot_points_are_append_only(s: &Store) {
    assert!(s.price_versions().await.unwrap().is_empty());
    let v1 = version(1, DateTime::<Utc>::UNIX_EPOCH, "0.001");
    assert!(s.seed_price_version(&v1, day()).await.unwrap());
    // A second seed (another replica starting) changes nothing.
    assert!(!s
        .seed_price_version(&version(1, day(), "9"), day())
        .await
        .unwrap());
    let v2 = version(2, day() + Duration::days(1), "0.002");
    s.insert_price_version(&v2, day()).await.unwrap();
    // Two publishers of version 2: the second is a conflict, not a copy.
    assert!(matches!(
        s.insert_price_version(&version(2, day() + Duration::days(2), "0.003"), day())
            .await,
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(s.price_versions().await.unwrap(), vec![v1, v2]);

    let p = |at: DateTime<Utc>, u: &str, price: &str| SpotPoint {
        model: "H100".into(),
        at,
        utilisation: d(u),
        per_gpu_second: d(price),
        price_version: 1,
    };
    assert!(s
        .record_spot_point(&p(day(), "0.25", "0.0005"))
        .await
        .unwrap());
    assert!(
        !s.record_spot_point(&p(day(), "0.9", "0.0007"))
            .await
            .unwrap(),
        "a recorded point is never replaced"
    );
    let later = p(day() + Duration::hours(2), "0.75", "0.0007");
    assert!(s.record_spot_point(&later).await.unwrap());
    let all = s.spot_points(day() + Duration::days(1)).await.unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!(all[0].utilisation, d("0.25"));
    assert_eq!(
        s.spot_points(day()).await.unwrap().len(),
        0,
        "until is exclusive"
    );
    assert_eq!(s.latest_spot_points().await.unwrap()["H100"], later);
    let (page, more) = s
        .spot_history("H100", day(), day() + Duration::days(1), 1)
        .await
        .unwrap();
    assert_eq!((page.len(), more), (1, true));
    let (page, more) = s
        .spot_history(
            "H100",
            page[0].at + Duration::milliseconds(1),
            day() + Duration::days(1),
            1,
        )
        .await
        .unwrap();
    assert_eq!((page, more), (vec![later.clone()], false));
}

async fn final_invoices_are_written_once_with_their_credit_draws(s: &Store) {
    let t = tenant(s).await;
    let other = tenant(s).await;
    let book = PriceBook::new(version(1, DateTime::<Utc>::UNIX_EPOCH, "0.001")).unwrap();
    let discount = Discount {
        id: "d10".into(),
        tenant: t.clone(),
        percent: d("10"),
        scope: DiscountScope::All,
        from: day() - Duration::days(30),
        until: None,
    };
    let credit = CreditGrant {
        id: "promo".into(),
        tenant: t.clone(),
        kind: CreditKind::Promotional,
        amount: d("3"),
        granted_at: day() - Duration::days(30),
        expires_at: None,
    };
    s.add_discount(&discount, day()).await.unwrap();
    s.add_credit(&credit, day()).await.unwrap();
    assert!(matches!(
        s.add_credit(&credit, day()).await,
        Err(StoreError::AlreadyExists(_))
    ));
    assert_eq!(s.discounts(&t).await.unwrap(), vec![discount.clone()]);
    assert_eq!(s.credits(&t).await.unwrap(), vec![credit.clone()]);
    assert!(s.credits(&other).await.unwrap().is_empty());

    let e: flotilla_billing::meter::UsageEvent = serde_json::from_value(serde_json::json!({
        "key": {"tenant": t, "source": "s", "id": "e1"},
        "subject": {"kind": "instance", "id": "inst_1"},
        "meter": {"meter": "gpu_seconds", "model": "H100", "share": {"kind": "whole"}},
        "billing_class": "on_demand",
        "start": day().to_rfc3339(), "end": (day() + Duration::hours(1)).to_rfc3339(),
        "amount": "2"
    }))
    .unwrap();
    let period = Period::month(2025, 1).unwrap();
    let draft = build_invoice(InvoiceInput {
        id: &InvoiceId::generate(1, rnd()),
        tenant: &t,
        period,
        events: &[e],
        book: &book,
        spot: &SpotSeries::new(),
        commitments: &[],
        discounts: &[discount],
        credits: &[credit],
        credit_used_before: &BTreeMap::new(),
    })
    .unwrap();
    // 7,200 GPU-s × 0.001 = 7.20; 10 % off: −0.72; credit −3.00 → 3.48.
    assert_eq!(draft.invoice.total(), d("3.48"));
    // A draft is never stored.
    assert!(matches!(
        s.insert_final_invoice(&draft.invoice, &draft.credits_applied)
            .await,
        Err(StoreError::Conflict(_))
    ));
    let fin = draft
        .invoice
        .clone()
        .finalise(day() + Duration::days(60), Duration::hours(72))
        .unwrap();
    s.insert_final_invoice(&fin, &draft.credits_applied)
        .await
        .unwrap();
    let (owner, body) = s.invoice_json(fin.id()).await.unwrap();
    assert_eq!(owner, t);
    assert_eq!(body, fin.to_json().unwrap(), "stored byte for byte");
    assert_eq!(s.invoice(fin.id()).await.unwrap(), fin);
    assert_eq!(s.credit_drawn(&t).await.unwrap()["promo"], d("3"));
    assert_eq!(
        s.final_invoice_of(&t, period.start).await.unwrap(),
        Some(fin.id().clone())
    );
    // The period is final: another invoice for it is refused, and nothing
    // of the first changes.
    let again = draft
        .invoice
        .finalise(day() + Duration::days(61), Duration::hours(72))
        .unwrap();
    let second = serde_json::to_string(&again)
        .unwrap()
        .replace(fin.id().as_str(), InvoiceId::generate(2, rnd()).as_str());
    let second: flotilla_billing::Invoice = serde_json::from_str(&second).unwrap();
    assert!(matches!(
        s.insert_final_invoice(&second, &BTreeMap::new()).await,
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(s.invoice_json(fin.id()).await.unwrap().1, body);
    let page = s
        .list_invoices(Some(&t), &PageReq::new(None, 10))
        .await
        .unwrap();
    assert_eq!(page.items, vec![fin]);
    assert!(s
        .list_invoices(Some(&other), &PageReq::new(None, 10))
        .await
        .unwrap()
        .items
        .is_empty());
}

async fn budget_alerts_fire_once_and_deliveries_log_attempts(s: &Store) {
    let t = tenant(s).await;
    assert!(s.budget(&t).await.unwrap().is_none());
    let b = StoredBudget {
        budget: Budget {
            tenant: t.clone(),
            limit: d("100"),
            currency: "USD".into(),
            thresholds: vec![50, 80, 100],
            hard_cap: true,
        },
        webhook_url: Some("http://127.0.0.1:9/hook".into()),
        webhook_secret: Some("0123456789abcdef".into()),
        updated_at: day(),
    };
    s.set_budget(&b).await.unwrap();
    let mut changed = b.clone();
    changed.budget.limit = d("200");
    s.set_budget(&changed).await.unwrap();
    assert_eq!(s.budget(&t).await.unwrap(), Some(changed.clone()));
    assert_eq!(s.budgets().await.unwrap(), vec![changed]);

    let alert = BudgetAlert {
        tenant: t.clone(),
        period_start: day(),
        threshold_percent: 50,
        spend: d("120"),
        limit: d("200"),
        currency: "USD".into(),
        at: day(),
    };
    let url = Some("http://127.0.0.1:9/hook");
    assert!(s
        .record_budget_alert(&alert, url, "whd_1", day())
        .await
        .unwrap());
    assert!(
        !s.record_budget_alert(&alert, url, "whd_2", day())
            .await
            .unwrap(),
        "once per threshold and period"
    );
    assert_eq!(s.budget_alerts(&t, day()).await.unwrap(), vec![alert]);
    let due = s.due_deliveries(day(), 10).await.unwrap();
    assert_eq!(due.len(), 1, "the duplicate queued no delivery");
    assert_eq!((due[0].id.as_str(), due[0].attempts), ("whd_1", 0));
    s.record_delivery_attempt(
        "whd_1",
        false,
        Some(500),
        Some("receiver answered 500"),
        Some(day() + Duration::seconds(1)),
        day(),
    )
    .await
    .unwrap();
    assert!(s.due_deliveries(day(), 10).await.unwrap().is_empty());
    let due = s
        .due_deliveries(day() + Duration::seconds(1), 10)
        .await
        .unwrap();
    assert_eq!((due[0].attempts, due[0].last_status), (1, Some(500)));
    s.record_delivery_attempt(
        "whd_1",
        true,
        Some(204),
        None,
        None,
        day() + Duration::seconds(2),
    )
    .await
    .unwrap();
    let log = s.deliveries(&t, 10).await.unwrap();
    assert_eq!(log.len(), 1);
    assert_eq!(log[0].state, DeliveryState::Delivered);
    assert_eq!(log[0].attempts, 2);
    assert_eq!(log[0].delivered_at, Some(day() + Duration::seconds(2)));
    // A delivered one is never attempted again.
    s.record_delivery_attempt("whd_1", false, None, Some("x"), None, day())
        .await
        .unwrap();
    assert_eq!(
        s.deliveries(&t, 10).await.unwrap()[0].state,
        DeliveryState::Delivered
    );
}

async fn providers_own_nodes(s: &Store) {
    let t = tenant(s).await;
    let p = s
        .provider_for_tenant(&t, &ProviderId::generate(1, rnd()), day())
        .await
        .unwrap();
    // The same tenant is the same provider, whatever id is offered.
    assert_eq!(
        s.provider_for_tenant(&t, &ProviderId::generate(2, rnd()), day())
            .await
            .unwrap(),
        p
    );
    assert_eq!(s.provider_of_tenant(&t).await.unwrap(), Some(p.clone()));
    let req = RegisterNode {
        name: format!("n{}", rnd()),
        region: None,
        pool: None,
        cpu_milli: 1000,
        memory_mb: 1024,
        simulated: true,
        gpus: vec![DiscoveredGpu {
            index: 0,
            model: "H100".into(),
            uuid: "GPU-0".into(),
            memory_mib: 81920,
            vendor: Vendor::Nvidia,
            mig_mode: false,
        }],
        agent_version: "t".into(),
        runtime: Default::default(),
        executor: Default::default(),
        running: Vec::new(),
        unenforced_limits: Vec::new(),
        network: None,
    };
    let node = s
        .register_node(
            &t,
            &req,
            || (NodeId::generate(1, rnd()), vec![GpuId::generate(1, rnd())]),
            day(),
        )
        .await
        .unwrap();
    assert!(s.node_providers().await.unwrap().is_empty());
    s.set_node_provider(&node.id, Some(&p)).await.unwrap();
    assert_eq!(s.node_providers().await.unwrap()[&node.id], p);
    assert!(matches!(
        s.set_node_provider(&NodeId::generate(9, rnd()), Some(&p))
            .await,
        Err(StoreError::NotFound(_))
    ));
    let use_ = s.gpu_pool_use().await.unwrap();
    assert_eq!(
        use_.iter()
            .find(|m| m.model == "H100")
            .map(|m| (m.total, m.used)),
        Some((1, 0))
    );
}
