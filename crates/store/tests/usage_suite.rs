//! The usage ledger suite, run against every backend: SQLite always,
//! PostgreSQL when `FLOTILLA_TEST_DATABASE_URL` is set. Each test gets a
//! fresh database. The rules checked are flotilla-billing's ledger rules
//! (`check_append`), so the SQL ledger cannot drift from the reference.

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, Utc};
use flotilla_billing::invoice::{build_invoice, InvoiceInput};
use flotilla_billing::meter::effective_events;
use flotilla_billing::meter::{
    EventKey, GpuShare, MemoryLedger, Meter, Subject, SubjectKind, UsageEvent,
};
use flotilla_billing::payout::{payout_statement, PayoutPolicy};
use flotilla_billing::price::{PriceBook, PriceVersion, SpotSeries};
use flotilla_billing::{Ledger, Period};
use flotilla_core::api::{DiscoveredGpu, RegisterNode};
use flotilla_core::catalog::Vendor;
use flotilla_core::id::{GpuId, InvoiceId, NodeId, ProviderId, TenantId};
use flotilla_core::instance::BillingClass;
use flotilla_store::Store;
use flotilla_testdb::rnd;
use rust_decimal::Decimal;

/// 2025-01-10T00:00:00Z.
fn day() -> DateTime<Utc> {
    DateTime::from_timestamp(1_736_467_200, 0).unwrap()
}

fn grace() -> Duration {
    Duration::hours(1)
}

/// A window wide enough that nothing in a test is late.
fn long() -> Duration {
    Duration::days(3)
}

flotilla_testdb::backend_suite!(
    "usage":
    duplicates_conflicts_and_late_events_follow_the_ledger_rules,
    a_ten_thousand_event_batch_is_counted_exactly,
    rollup_rates_to_the_same_invoice_as_every_event,
    resent_duplicates_leave_the_rollup_unchanged,
    listing_walks_every_event_once,
    node_rollup_pays_providers_like_every_event,
    usage_marks_move_only_with_new_events,
    overlapping_batches_at_once_record_every_event_once,
    a_steady_fleet_is_read_as_stretches_split_where_corrected,
);

async fn tenant(s: &Store) -> TenantId {
    let id = TenantId::generate(1, rnd());
    s.create_tenant(&id, &format!("t{}", rnd()), day())
        .await
        .unwrap();
    id
}

/// `gpus`×H100 of `subject` over `[start, end)` seconds after `day()`.
fn gpu(t: &TenantId, id: &str, subject: &str, start: i64, end: i64, gpus: u32) -> UsageEvent {
    UsageEvent {
        key: EventKey {
            tenant: t.clone(),
            source: "agent:n1".into(),
            id: id.into(),
        },
        subject: Subject {
            kind: SubjectKind::Instance,
            id: subject.into(),
        },
        meter: Meter::GpuSeconds {
            model: "H100".into(),
            share: GpuShare::Whole,
        },
        billing_class: BillingClass::OnDemand,
        start: day() + Duration::seconds(start),
        end: day() + Duration::seconds(end),
        amount: Decimal::from(gpus),
        node: None,
        corrects: None,
    }
}

async fn duplicates_conflicts_and_late_events_follow_the_ledger_rules(s: &Store) {
    let t = tenant(s).await;
    let now = day() + Duration::seconds(7200);
    let a = gpu(&t, "a", "inst_1", 0, 3600, 2);
    let b = gpu(&t, "b", "inst_1", 3600, 7200, 2);
    let r = s
        .append_usage(&[a.clone(), b.clone()], grace(), now)
        .await
        .unwrap();
    assert_eq!((r.accepted, r.duplicates, r.rejected.len()), (2, 0, 0));

    // Re-sent long after the grace window: still a duplicate, never late.
    let much_later = now + Duration::days(30);
    let r = s
        .append_usage(&[a.clone(), b.clone()], grace(), much_later)
        .await
        .unwrap();
    assert_eq!((r.accepted, r.duplicates, r.rejected.len()), (0, 2, 0));

    // Same key, other payload: refused, and the stored one is unchanged.
    let mut a2 = a.clone();
    a2.amount = Decimal::from(3);
    // A new event past its grace window: refused as late.
    let late = gpu(&t, "late", "inst_1", 0, 10, 1);
    // Within a batch: a repeat is a duplicate, a changed repeat a conflict.
    let c = gpu(&t, "c", "inst_2", 3600, 7200, 1);
    let mut c2 = c.clone();
    c2.subject.id = "inst_3".into();
    // Invalid: zero amount; and a tenant that does not exist.
    let mut bad = gpu(&t, "bad", "inst_1", 0, 10, 1);
    bad.amount = Decimal::ZERO;
    let ghost = gpu(&TenantId::generate(1, rnd()), "g", "inst_1", 3600, 7200, 1);
    let mut sub_ms = gpu(&t, "sub", "inst_1", 3600, 7200, 1);
    sub_ms.end += Duration::microseconds(5);
    let batch = [
        a2.clone(),
        late,
        c.clone(),
        c.clone(),
        c2,
        bad,
        ghost,
        sub_ms,
    ];
    let r = s.append_usage(&batch, grace(), now).await.unwrap();
    assert_eq!((r.accepted, r.duplicates), (1, 1), "{r:?}");
    let codes: Vec<(usize, &str, Option<&str>)> = r
        .rejected
        .iter()
        .map(|x| (x.index, x.code, x.field.as_deref()))
        .collect();
    assert_eq!(
        codes,
        vec![
            (0, "key_conflict", None),
            (1, "late", Some("end")),
            (4, "key_conflict", None),
            (5, "invalid", Some("amount")),
            (6, "unknown_tenant", Some("key.tenant")),
            (7, "invalid", Some("end")),
        ]
    );
    let period = Period::new(day(), day() + Duration::days(1)).unwrap();
    let stored = s.usage_for(&t, period).await.unwrap();
    assert_eq!(stored.len(), 3);
    assert!(stored.contains(&a) && stored.contains(&b) && stored.contains(&c));

    // The reference ledger decides the same batch the same way.
    let mut mem = MemoryLedger::new(grace());
    for e in [&a, &b] {
        mem.append((*e).clone(), now).unwrap();
    }
    let mut ok = 0;
    let mut dup = 0;
    for e in &batch {
        match mem.append(e.clone(), now) {
            Ok(flotilla_billing::meter::Appended::New) => ok += 1,
            Ok(flotilla_billing::meter::Appended::Duplicate) => dup += 1,
            Err(_) => {}
        }
    }
    // The reference has no tenant registry and keeps sub-ms times, so it
    // takes `ghost` and `sub_ms`; the rest agree.
    assert_eq!((ok - 2, dup), (1, 1));
}

async fn a_ten_thousand_event_batch_is_counted_exactly(s: &Store) {
    let t = tenant(s).await;
    let now = day() + Duration::days(1);
    let batch: Vec<UsageEvent> = (0..10_000)
        .map(|i| {
            gpu(
                &t,
                &format!("e{i:05}"),
                &format!("inst_{}", i % 37),
                i * 8,
                i * 8 + 8,
                1,
            )
        })
        .collect();
    let r = s.append_usage(&batch, long(), now).await.unwrap();
    assert_eq!((r.accepted, r.duplicates, r.rejected.len()), (10_000, 0, 0));
    let r = s.append_usage(&batch, long(), now).await.unwrap();
    assert_eq!((r.accepted, r.duplicates, r.rejected.len()), (0, 10_000, 0));
    // Half stored, half new, in one batch: chunks mixing both are counted.
    let mixed: Vec<UsageEvent> = (5_000..15_000)
        .map(|i| {
            gpu(
                &t,
                &format!("e{i:05}"),
                &format!("inst_{}", i % 37),
                i * 8,
                i * 8 + 8,
                1,
            )
        })
        .collect();
    let mut mixed = mixed;
    mixed[0].amount = Decimal::from(2); // conflicts with stored e05000
    let r = s.append_usage(&mixed, long(), now).await.unwrap();
    assert_eq!(
        (r.accepted, r.duplicates, r.rejected.len()),
        (5_000, 4_999, 1)
    );
    let (n, unit_ms) = s.usage_totals().await.unwrap();
    assert_eq!(n, 15_000);
    assert_eq!(unit_ms, 15_000 * 8_000 * 7_000);
}

fn book(minimum: u32) -> PriceBook {
    let v: PriceVersion = serde_json::from_value(serde_json::json!({
        "version": 1,
        "effective_from": "2025-01-01T00:00:00Z",
        "currency": {"code": "USD", "minor_units": 2},
        "on_demand": {
            "H100": {"per_gpu_second": "0.001", "minimum_seconds": minimum},
            "A100-80GB": {"per_gpu_second": "0.0005"}
        },
        "spot": {},
        "serverless": {
            "per_request": {"kind": "graduated", "tiers": [
                {"up_to": "1000", "unit_price": "0.001"}, {"up_to": null, "unit_price": "0.0005"}]},
            "per_million_input_tokens": {"kind": "flat", "unit_price": "0.50"},
            "per_million_output_tokens": {"kind": "flat", "unit_price": "1.50"},
            "per_gpu_second": {"H100": "0.0012"}
        },
        "reserved_offers": [],
        "per_instance_second": "0.00001",
        "per_storage_gb_second": "0.000001"
    }))
    .unwrap();
    PriceBook::new(v).unwrap()
}

async fn rollup_rates_to_the_same_invoice_as_every_event(s: &Store) {
    let t = tenant(s).await;
    let now = day() + Duration::hours(23);
    let mut evs = Vec::new();
    // Many subjects, aligned one-minute slices, some MIG shares.
    for sub in 0..20 {
        for m in 0..30 {
            let mut e = gpu(
                &t,
                &format!("g{sub}-{m}"),
                &format!("inst_{sub}"),
                m * 60,
                m * 60 + 60,
                1 + (sub % 3) as u32,
            );
            if sub % 5 == 0 {
                e.meter = Meter::GpuSeconds {
                    model: "H100".into(),
                    share: GpuShare::mig_named("3g.40gb").unwrap(),
                };
            }
            evs.push(e);
        }
    }
    // A short subject below the minimum, and one crossing midnight before the day.
    evs.push(gpu(&t, "short", "inst_short", 5000, 5023, 1));
    evs.push(gpu(&t, "early", "inst_early", -600, 600, 2));
    // Endpoint GPU time, requests with a tier crossing, tokens, storage with a fraction.
    let mut ep = gpu(&t, "ep-gpu", "ep_1", 100, 700, 1);
    ep.subject.kind = SubjectKind::Endpoint;
    evs.push(ep);
    for (i, (meter, amount)) in [
        (Meter::Requests, "700"),
        (Meter::Requests, "600"),
        (Meter::InputTokens, "1234567"),
        (Meter::OutputTokens, "765432"),
        (Meter::StorageGbSeconds, "12.5"),
        (Meter::InstanceSeconds, "1"),
    ]
    .into_iter()
    .enumerate()
    {
        let mut e = gpu(
            &t,
            &format!("c{i}"),
            "ep_1",
            1000 + i as i64,
            2000 + i as i64,
            1,
        );
        e.subject.kind = SubjectKind::Endpoint;
        e.meter = meter;
        e.amount = amount.parse().unwrap();
        evs.push(e);
    }
    // A correction voiding one slice and restating half of it.
    let mut fix = gpu(&t, "fix-1", "inst_1", 0, 30, 2);
    fix.corrects = Some(evs[30].key.clone());
    evs.push(fix);
    // One restating nothing (an empty interval): the slice is voided
    // whole, as the metering pass does for a minute after the exit.
    let mut void = evs[31].clone();
    void.key.id = "void-1".into();
    void.end = void.start;
    void.corrects = Some(evs[31].key.clone());
    evs.push(void);
    // Another tenant's usage is never counted.
    let other = tenant(s).await;
    evs.push(gpu(&other, "x", "inst_x", 0, 60, 8));
    let r = s.append_usage(&evs, long(), now).await.unwrap();
    assert_eq!(r.rejected, vec![]);

    let period = Period::new(day(), day() + Duration::days(1)).unwrap();
    let id = InvoiceId::generate(1, 1);
    for minimum in [0, 60] {
        let book = book(minimum);
        let spot = SpotSeries::new();
        let credits = BTreeMap::new();
        let rate = |events: &[UsageEvent]| {
            build_invoice(InvoiceInput {
                id: &id,
                tenant: &t,
                period,
                events,
                book: &book,
                spot: &spot,
                commitments: &[],
                discounts: &[],
                credits: &[],
                credit_used_before: &credits,
            })
            .unwrap()
            .invoice
        };
        let full = rate(&s.usage_for(&t, period).await.unwrap());
        let rollup = s.usage_rollup(&t, period, minimum > 0).await.unwrap();
        assert_eq!(rollup.stored_events as usize, evs.len() - 1);
        if minimum == 0 {
            // Without a minimum, subjects are not kept apart: the 600
            // one-minute slices fold into one row per (share, minute).
            assert!(
                rollup.events.len() < evs.len() / 4,
                "{}",
                rollup.events.len()
            );
        }
        let rolled = rate(&rollup.events);
        assert_eq!(full.to_json().unwrap(), rolled.to_json().unwrap());
        assert!(full.total() > Decimal::ZERO);
        let sum: Decimal = full.lines().iter().map(|l| l.amount).sum();
        assert_eq!(sum, full.total());
    }
}

/// The rollup is maintained at ingestion: re-sending what is stored (whole
/// batches, or mixed with new events in the same chunk) adds nothing, and
/// the rollup keeps rating like every stored event.
async fn resent_duplicates_leave_the_rollup_unchanged(s: &Store) {
    let t = tenant(s).await;
    let now = day() + Duration::hours(23);
    let period = Period::new(day(), day() + Duration::days(1)).unwrap();
    let id = InvoiceId::generate(1, 1);
    // 2,400 slices over several statement chunks (1,000 on SQLite, 500 on
    // PostgreSQL), plus count meters, one of them too large to be summed.
    let mut evs = Vec::new();
    for sub in 0..8 {
        for m in 0..300 {
            evs.push(gpu(
                &t,
                &format!("g{sub}-{m}"),
                &format!("inst_{sub}"),
                m * 60,
                m * 60 + 60,
                1 + (sub % 2) as u32,
            ));
        }
    }
    for (i, (meter, amount)) in [
        (Meter::Requests, "700"),
        (Meter::InputTokens, "5000000000000"),
        (Meter::StorageGbSeconds, "2.5"),
    ]
    .into_iter()
    .enumerate()
    {
        let mut e = gpu(&t, &format!("c{i}"), "ep_1", 100, 200, 1);
        e.subject.kind = SubjectKind::Endpoint;
        e.meter = meter;
        e.amount = amount.parse().unwrap();
        evs.push(e);
    }
    let (id, t) = (&id, &t);
    let check = |stored: usize| async move {
        let mut rolled = Vec::new();
        for minimum in [0, 60] {
            let book = book(minimum);
            let spot = SpotSeries::new();
            let credits = BTreeMap::new();
            let rate = |events: &[UsageEvent]| {
                build_invoice(InvoiceInput {
                    id,
                    tenant: t,
                    period,
                    events,
                    book: &book,
                    spot: &spot,
                    commitments: &[],
                    discounts: &[],
                    credits: &[],
                    credit_used_before: &credits,
                })
                .unwrap()
                .invoice
                .to_json()
                .unwrap()
            };
            let rollup = s.usage_rollup(t, period, minimum > 0).await.unwrap();
            assert_eq!(rollup.stored_events as usize, stored);
            let full = rate(&s.usage_for(t, period).await.unwrap());
            assert_eq!(full, rate(&rollup.events));
            rolled.push(rollup.events);
        }
        rolled
    };
    // The first half, then everything: the first half comes back as
    // duplicates in chunks that also insert new events.
    let half = evs.len() / 2 + 7;
    let r = s.append_usage(&evs[..half], long(), now).await.unwrap();
    assert_eq!((r.accepted as usize, r.duplicates), (half, 0));
    check(half).await;
    let r = s.append_usage(&evs, long(), now).await.unwrap();
    assert_eq!(r.rejected, vec![]);
    assert_eq!(
        (r.accepted as usize, r.duplicates as usize),
        (evs.len() - half, half)
    );
    let before = check(evs.len()).await;
    // Whole re-sends, in another order and with in-batch repeats, change
    // nothing.
    let mut again: Vec<UsageEvent> = evs.iter().rev().cloned().collect();
    again.extend(evs[..100].iter().cloned());
    for _ in 0..2 {
        let r = s.append_usage(&again, long(), now).await.unwrap();
        assert_eq!((r.accepted, r.duplicates as usize), (0, again.len()));
        assert_eq!(check(evs.len()).await, before);
    }
}

async fn listing_walks_every_event_once(s: &Store) {
    let t = tenant(s).await;
    let now = day() + Duration::days(1);
    let evs: Vec<UsageEvent> = (0..250)
        .map(|i| {
            gpu(
                &t,
                &format!("k{i}"),
                "inst_1",
                (i % 7) * 10,
                (i % 7) * 10 + 10,
                1,
            )
        })
        .collect();
    s.append_usage(&evs, long(), now).await.unwrap();
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let (page, more) = s
            .list_usage(&t, day(), day() + Duration::days(1), after.clone(), 40)
            .await
            .unwrap();
        let last = page.last().cloned();
        seen.extend(page);
        if !more {
            break;
        }
        let l = last.unwrap();
        after = Some((l.end, l.key.source, l.key.id));
    }
    assert_eq!(seen.len(), 250);
    let mut ids: Vec<String> = seen.iter().map(|e| e.key.id.clone()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 250);
    // Outside the window: nothing.
    let (none, _) = s
        .list_usage(
            &t,
            day() + Duration::hours(2),
            day() + Duration::hours(3),
            None,
            10,
        )
        .await
        .unwrap();
    assert!(none.is_empty());
}

/// A node registered by `owner` (a provider tenant) with one H100.
async fn node_of(s: &Store, owner: &TenantId) -> NodeId {
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
    s.register_node(
        owner,
        &req,
        || (NodeId::generate(1, rnd()), vec![GpuId::generate(1, rnd())]),
        day(),
    )
    .await
    .unwrap()
    .id
}

/// Payouts read `usage_node_rollup` (summed at ingestion) and give the
/// statements that every tenant's effective events would: across
/// tenants, shares, models, endpoints, nodes of two providers and of the
/// operator, and corrections (one that names no node voids an event on a
/// provider's node all the same), also after whole re-sends.
async fn node_rollup_pays_providers_like_every_event(s: &Store) {
    let now = day() + Duration::hours(23);
    let (pa, pb) = (tenant(s).await, tenant(s).await);
    let prov_a = s
        .provider_for_tenant(&pa, &ProviderId::generate(1, rnd()), day())
        .await
        .unwrap();
    let prov_b = s
        .provider_for_tenant(&pb, &ProviderId::generate(1, rnd()), day())
        .await
        .unwrap();
    let (a1, a2, b1, own) = (
        node_of(s, &pa).await,
        node_of(s, &pa).await,
        node_of(s, &pb).await,
        node_of(s, &pa).await,
    );
    for (n, p) in [(&a1, &prov_a), (&a2, &prov_a), (&b1, &prov_b)] {
        s.set_node_provider(n, Some(p)).await.unwrap();
    }
    let tenants = [tenant(s).await, tenant(s).await, tenant(s).await];
    let nodes = [Some(&a1), Some(&a2), Some(&b1), Some(&own), None];
    let mut evs = Vec::new();
    for (ti, t) in tenants.iter().enumerate() {
        for sub in 0..6 {
            for m in 0..40 {
                let mut e = gpu(
                    t,
                    &format!("g{sub}-{m}"),
                    &format!("inst_{sub}"),
                    m * 60 - 120,
                    m * 60 - 60,
                    1 + ((sub + ti) % 3) as u32,
                );
                // Tenants share nodes, so slices sum across tenants.
                let at = [0, 1, 2, 3, 2, 0][sub];
                e.node = if ti == 2 && sub == 1 {
                    nodes[4]
                } else {
                    nodes[at]
                }
                .cloned();
                if sub % 3 == 0 {
                    e.meter = Meter::GpuSeconds {
                        model: "H100".into(),
                        share: GpuShare::mig_named("3g.40gb").unwrap(),
                    };
                }
                if sub == 4 {
                    e.meter = Meter::GpuSeconds {
                        model: "A100-80GB".into(),
                        share: GpuShare::Whole,
                    };
                }
                if sub == 5 {
                    e.subject.kind = SubjectKind::Endpoint;
                }
                evs.push(e);
            }
        }
        // Non-GPU usage on a provider's node pays nothing.
        let mut req = gpu(t, "req", "ep_1", 10, 20, 1);
        req.meter = Meter::Requests;
        req.amount = Decimal::from(500);
        req.node = Some(a1.clone());
        evs.push(req);
    }
    // Corrections: one on the same node restating half a slice, one that
    // names no node voiding a slice on a provider's node.
    let on_node = evs
        .iter()
        .position(|e| e.node.as_ref() == Some(&a1))
        .unwrap();
    let mut fix = evs[on_node].clone();
    fix.key.id = "fix-1".into();
    fix.end = fix.start + Duration::seconds(30);
    fix.corrects = Some(evs[on_node].key.clone());
    let on_b = evs
        .iter()
        .position(|e| e.node.as_ref() == Some(&b1))
        .unwrap();
    let mut void = evs[on_b].clone();
    void.key.id = "fix-2".into();
    void.node = None;
    void.amount = Decimal::ONE;
    void.corrects = Some(evs[on_b].key.clone());
    // And one restating nothing (an empty interval) on the same node.
    let other_on_node = evs
        .iter()
        .rposition(|e| e.node.as_ref() == Some(&a1) && matches!(e.meter, Meter::GpuSeconds { .. }))
        .unwrap();
    assert_ne!(other_on_node, on_node);
    let mut empty = evs[other_on_node].clone();
    empty.key.id = "fix-3".into();
    empty.end = empty.start;
    empty.corrects = Some(evs[other_on_node].key.clone());
    evs.push(fix);
    evs.push(void);
    evs.push(empty);
    let r = s.append_usage(&evs, long(), now).await.unwrap();
    assert_eq!(r.rejected, vec![]);

    let period = Period::new(day(), day() + Duration::days(1)).unwrap();
    let book = book(0);
    let spot = SpotSeries::new();
    let owners = s.node_providers().await.unwrap();
    let policy = PayoutPolicy {
        operator_fee_percent: Decimal::from(15),
    };
    // The reference: every tenant's events, corrections applied per
    // tenant, then paid out.
    let mut every = Vec::new();
    for t in &tenants {
        every.extend(effective_events(&s.usage_for(t, period).await.unwrap()).unwrap());
    }
    let check = || async {
        let rolled = s.usage_on_nodes(period).await.unwrap();
        let on_provider_gpu = evs
            .iter()
            .filter(|e| {
                matches!(e.meter, Meter::GpuSeconds { .. })
                    && e.node.as_ref().is_some_and(|n| owners.contains_key(n))
                    && e.start < period.end
                    && e.end >= period.start
            })
            .count();
        assert_eq!(rolled.stored_events as usize, on_provider_gpu);
        assert!(rolled.events.len() < on_provider_gpu / 2, "summed");
        let mut gross = Decimal::ZERO;
        for p in [&prov_a, &prov_b] {
            let want = payout_statement(p, period, &owners, &every, &book, &spot, &policy).unwrap();
            let got = payout_statement(p, period, &owners, &rolled.events, &book, &spot, &policy)
                .unwrap();
            assert_eq!(got, want);
            assert!(want.gross > Decimal::ZERO);
            gross += want.gross;
        }
        gross
    };
    let gross = check().await;
    // Re-sending everything (reversed) adds nothing.
    let again: Vec<UsageEvent> = evs.iter().rev().cloned().collect();
    let r = s.append_usage(&again, long(), now).await.unwrap();
    assert_eq!(r.accepted, 0);
    assert_eq!(check().await, gross);
}

/// Budget checks rate only tenants whose mark moved: a batch with new
/// events bumps each of its tenants' marks once; re-sends and refused
/// events move nothing.
async fn usage_marks_move_only_with_new_events(s: &Store) {
    let now = day() + Duration::hours(23);
    let (a, b) = (tenant(s).await, tenant(s).await);
    let mark = |m: &std::collections::HashMap<TenantId, i64>, t: &TenantId| m.get(t).copied();
    assert_eq!(mark(&s.usage_marks().await.unwrap(), &a), None);
    let batch = vec![
        gpu(&a, "m1", "inst_1", 0, 60, 1),
        gpu(&a, "m2", "inst_1", 60, 120, 1),
        gpu(&b, "m1", "inst_2", 0, 60, 1),
    ];
    s.append_usage(&batch, long(), now).await.unwrap();
    let m = s.usage_marks().await.unwrap();
    assert_eq!((mark(&m, &a), mark(&m, &b)), (Some(1), Some(1)));
    // The same batch again: duplicates only.
    let r = s.append_usage(&batch, long(), now).await.unwrap();
    assert_eq!(r.accepted, 0);
    assert_eq!(s.usage_marks().await.unwrap(), m);
    // A conflicting re-send is refused and moves nothing either.
    let mut conflict = batch[0].clone();
    conflict.amount = Decimal::from(7);
    let r = s.append_usage(&[conflict], long(), now).await.unwrap();
    assert_eq!(r.rejected.len(), 1);
    assert_eq!(s.usage_marks().await.unwrap(), m);
    // New usage of a, mixed with b's duplicate in the same chunk.
    let r = s
        .append_usage(
            &[batch[2].clone(), gpu(&a, "m3", "inst_1", 120, 180, 1)],
            long(),
            now,
        )
        .await
        .unwrap();
    assert_eq!((r.accepted, r.duplicates), (1, 1));
    let m2 = s.usage_marks().await.unwrap();
    assert_eq!((mark(&m2, &a), mark(&m2, &b)), (Some(2), Some(1)));
}

/// Two batches sharing keys, appended at the same time (two transactions
/// at once on PostgreSQL; SQLite's writer takes them in turn): whichever
/// commits first records the shared keys, the other finds them stored
/// (its plain INSERT fails on the key and it is redone with `ON CONFLICT`)
/// and counts them as duplicates, or refuses the one it changed; every
/// event is recorded once and the rollup sums exactly what is stored.
async fn overlapping_batches_at_once_record_every_event_once(s: &Store) {
    let t = tenant(s).await;
    let now = day() + Duration::hours(23);
    let ev = |i: i64| {
        gpu(
            &t,
            &format!("o{i:05}"),
            &format!("inst_{}", i % 11),
            i,
            i + 1,
            1,
        )
    };
    let a: Vec<UsageEvent> = (0..3_000).map(ev).collect();
    let mut b: Vec<UsageEvent> = (1_500..4_500).map(ev).collect();
    // Shared with `a`, with another amount: refused by whichever is second.
    b[500].amount = Decimal::from(2);
    let (ra, rb) = tokio::join!(
        s.append_usage(&a, long(), now),
        s.append_usage(&b, long(), now)
    );
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(ra.accepted + rb.accepted, 4_500, "{ra:?} {rb:?}");
    assert_eq!(ra.duplicates + rb.duplicates, 1_499);
    let rejected: Vec<_> = ra.rejected.iter().chain(&rb.rejected).collect();
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert_eq!(rejected[0].code, "key_conflict");
    assert_eq!(rejected[0].key, format!("{t}/agent:n1/o02000"));
    // The first to commit recorded all of its batch.
    assert!(
        ra.accepted == 3_000 || rb.accepted == 3_000,
        "{ra:?} {rb:?}"
    );
    let (n, unit_ms) = s.usage_totals().await.unwrap();
    assert_eq!(n, 4_500);
    let stored = s
        .usage_for(&t, Period::new(day(), day() + Duration::days(1)).unwrap())
        .await
        .unwrap();
    let doubled = stored
        .iter()
        .filter(|e| e.amount == Decimal::from(2))
        .count();
    // `o02000` holds the amount of the batch that committed first.
    assert_eq!(doubled, usize::from(rb.accepted == 3_000));
    assert_eq!(unit_ms, (4_500 + doubled as i128) * 1_000 * 7_000);
    let period = Period::new(day(), day() + Duration::days(1)).unwrap();
    let rollup = s.usage_rollup(&t, period, false).await.unwrap();
    assert_eq!(rollup.stored_events, 4_500);
    // GPU-milliseconds (the rollup joins equal neighbours into one event).
    let gpu_ms = |evs: &[UsageEvent]| -> Decimal {
        evs.iter()
            .map(|e| e.amount * Decimal::from((e.end - e.start).num_milliseconds()))
            .sum()
    };
    assert_eq!(gpu_ms(&rollup.events), gpu_ms(&stored));
    assert_eq!(
        gpu_ms(&stored),
        Decimal::from((4_500 + doubled as i64) * 1_000)
    );
}

/// A steady fleet metered in one-minute slices comes back from the rollup
/// as one event per steady stretch, and a correction voiding one slice
/// splits its stretch exactly there: three subjects at 1 GPU for two
/// hours, one slice of minute 60 voided, read as 3 GPUs over
/// `[0, 60 min)`, 2 over `[60, 61 min)` and 3 over `[61, 120 min)`.
async fn a_steady_fleet_is_read_as_stretches_split_where_corrected(s: &Store) {
    let t = tenant(s).await;
    let now = day() + Duration::hours(23);
    let mut evs = Vec::new();
    for sub in 0..3 {
        for m in 0..120 {
            evs.push(gpu(
                &t,
                &format!("g{sub}-{m}"),
                &format!("inst_{sub}"),
                m * 60,
                m * 60 + 60,
                1,
            ));
        }
    }
    let mut void = gpu(&t, "void-g0-60", "inst_0", 3600, 3600, 1);
    void.corrects = Some(evs[60].key.clone());
    evs.push(void);
    let r = s.append_usage(&evs, long(), now).await.unwrap();
    assert_eq!(r.rejected, vec![]);
    let period = Period::new(day(), day() + Duration::days(1)).unwrap();
    let rollup = s.usage_rollup(&t, period, false).await.unwrap();
    assert_eq!(rollup.stored_events as usize, evs.len());
    let spans: Vec<(i64, i64, Decimal)> = rollup
        .events
        .iter()
        .map(|e| {
            (
                (e.start - day()).num_seconds(),
                (e.end - day()).num_seconds(),
                e.amount,
            )
        })
        .collect();
    assert_eq!(
        spans,
        vec![
            (0, 3600, Decimal::from(3)),
            (3600, 3660, Decimal::from(2)),
            (3660, 7200, Decimal::from(3)),
        ]
    );
}
