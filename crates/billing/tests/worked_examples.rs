//! The worked examples of `docs/billing.md`, computed by the real code.
//! Keep the two in step: same inputs, same numbers. Each example bills one
//! day, 2025-01-10, with price version 1 (see `common::version1`).

mod common;

use std::collections::BTreeMap;

use chrono::Duration;
use common::*;
use flotilla_billing::invoice::{build_invoice, InvoiceInput};
use flotilla_billing::meter::{
    lifecycle_usage, GpuShare, Lifecycle, Meter, Subject, SubjectKind, UsageEvent,
};
use flotilla_billing::payout::{payout_statement, PayoutPolicy};
use flotilla_billing::price::{
    Commitment, CreditGrant, CreditKind, Discount, DiscountScope, Payment, PriceBook, SpotSeries,
};
use flotilla_billing::{Invoice, LineKind, Period};
use flotilla_core::id::{InvoiceId, NodeId, ProviderId, TenantId};
use flotilla_core::instance::BillingClass;

fn day() -> Period {
    Period::new(at(0, 0, 0), at(0, 0, 0) + Duration::days(1)).unwrap()
}

struct Extra<'a> {
    spot: &'a SpotSeries,
    commitments: &'a [Commitment],
    discounts: &'a [Discount],
    credits: &'a [CreditGrant],
    used: &'a BTreeMap<String, rust_decimal::Decimal>,
}

fn invoice(t: &TenantId, events: &[UsageEvent], book: &PriceBook, x: Extra<'_>) -> Invoice {
    build_invoice(InvoiceInput {
        id: &InvoiceId::generate(1, 1),
        tenant: t,
        period: day(),
        events,
        book,
        spot: x.spot,
        commitments: x.commitments,
        discounts: x.discounts,
        credits: x.credits,
        credit_used_before: x.used,
    })
    .unwrap()
    .invoice
}

fn plain<'a>(spot: &'a SpotSeries, used: &'a BTreeMap<String, rust_decimal::Decimal>) -> Extra<'a> {
    Extra {
        spot,
        commitments: &[],
        discounts: &[],
        credits: &[],
        used,
    }
}

/// (kind, quantity, unit price, amount) of every line.
fn rows(inv: &Invoice) -> Vec<(LineKind, String, String, String)> {
    inv.lines()
        .iter()
        .map(|l| {
            (
                l.kind,
                l.quantity.to_string(),
                l.unit_price.to_string(),
                l.amount.to_string(),
            )
        })
        .collect()
}

fn row(k: LineKind, q: &str, p: &str, a: &str) -> (LineKind, String, String, String) {
    (k, q.into(), p.into(), a.into())
}

fn lifecycle(t: &TenantId, id: &str, gpus: u32, class: BillingClass) -> Lifecycle {
    Lifecycle {
        tenant: t.clone(),
        source: "lifecycle".into(),
        subject: Subject {
            kind: SubjectKind::Instance,
            id: id.into(),
        },
        model: "H100".into(),
        share: GpuShare::Whole,
        gpus,
        billing_class: class,
        start: at(0, 0, 0),
        end: None,
        preempted_at: None,
        node: None,
    }
}

#[test]
fn example_1_on_demand_per_second_with_minimum() {
    let t = tenant(1);
    let now = at(23, 0, 0);
    let a1 = Lifecycle {
        end: Some(at(2, 30, 0) + Duration::milliseconds(400)),
        ..lifecycle(&t, "inst_a1", 2, BillingClass::OnDemand)
    };
    let a2 = Lifecycle {
        start: at(5, 0, 0),
        end: Some(at(5, 0, 22) + Duration::milliseconds(500)),
        ..lifecycle(&t, "inst_a2", 1, BillingClass::OnDemand)
    };
    let mut events = lifecycle_usage(&a1, now, 3600).unwrap();
    events.extend(lifecycle_usage(&a2, now, 3600).unwrap());
    let (spot, used) = (SpotSeries::new(), BTreeMap::new());
    let inv = invoice(&t, &events, &book(), plain(&spot, &used));
    assert_eq!(
        rows(&inv),
        vec![
            // Metered to the millisecond: 2 x 9000.4 s + 1 x 22.5 s =
            // 18023.3 GPU-s; 18.0233 rounds half-even, once, to 18.02.
            row(LineKind::OnDemand, "18023.3", "0.001", "18.02"),
            // inst_a2 ran 22.5 s of a 60 s minimum: 37.5 GPU-s; 0.0375 -> 0.04.
            row(LineKind::Minimum, "37.5", "0.001", "0.04"),
        ]
    );
    assert_eq!(inv.total().to_string(), "18.06");
    assert_eq!(inv.lines()[0].price_version, Some(1));
}

#[test]
fn example_2_reserved_with_overage_and_unused_commitment() {
    let t = tenant(2);
    let b = book();
    let c = Commitment::sign(
        "res-b-1",
        t.clone(),
        "H100",
        2,
        at(0, 0, 0) - Duration::days(9),
        30,
        Payment::Monthly,
        d("0.30"),
        &b,
    )
    .unwrap();
    assert_eq!(c.per_gpu_second.to_string(), "0.00070");
    let events = vec![
        event(
            &t,
            "b1",
            (SubjectKind::Instance, "inst_b1"),
            h100(),
            BillingClass::Reserved,
            at(8, 0, 0),
            at(12, 0, 0),
            3,
        ),
        event(
            &t,
            "b2",
            (SubjectKind::Instance, "inst_b2"),
            h100(),
            BillingClass::OnDemand,
            at(20, 0, 0),
            at(22, 0, 0),
            1,
        ),
    ];
    let (spot, used) = (SpotSeries::new(), BTreeMap::new());
    let commitments = [c];
    let inv = invoice(
        &t,
        &events,
        &b,
        Extra {
            commitments: &commitments,
            ..plain(&spot, &used)
        },
    );
    assert_eq!(
        rows(&inv),
        vec![
            // 2 GPUs x 4 h + 1 GPU x 2 h inside the commitment = 36000 GPU-s.
            row(LineKind::ReservedUsed, "36000", "0.0007", "25.20"),
            // 2 x 86400 committed - 36000 used = 136800 GPU-s.
            row(LineKind::ReservedUnused, "136800", "0.0007", "95.76"),
            // The third GPU of inst_b1, 4 h above the commitment.
            row(LineKind::Overage, "14400", "0.001", "14.40"),
        ]
    );
    assert_eq!(inv.total().to_string(), "135.36");
}

#[test]
fn example_3_spot_with_a_price_change_mid_run() {
    let t = tenant(3);
    let b = book();
    let mut spot = SpotSeries::new();
    assert_eq!(
        spot.record(&b, "H100", at(0, 0, 0), d("0.25"))
            .unwrap()
            .per_gpu_second
            .to_string(),
        "0.000500"
    );
    assert_eq!(
        spot.record(&b, "H100", at(2, 0, 0), d("0.75"))
            .unwrap()
            .per_gpu_second
            .to_string(),
        "0.000700"
    );
    let run = Lifecycle {
        start: at(1, 0, 0),
        end: Some(at(4, 0, 0)),
        preempted_at: Some(at(3, 0, 0)),
        ..lifecycle(&t, "inst_c1", 4, BillingClass::Spot)
    };
    let events = lifecycle_usage(&run, at(23, 0, 0), 3600).unwrap();
    let used = BTreeMap::new();
    let inv = invoice(&t, &events, &b, plain(&spot, &used));
    assert_eq!(
        rows(&inv),
        vec![
            row(LineKind::Spot, "14400", "0.0005", "7.20"),
            row(LineKind::Spot, "14400", "0.0007", "10.08"),
        ]
    );
    assert_eq!(inv.lines()[1].price_point_at, Some(at(2, 0, 0)));
    assert_eq!(inv.total().to_string(), "17.28");
}

#[test]
fn example_4_serverless_requests_tokens_and_gpu_time_with_tiers() {
    let t = tenant(4);
    let ep = (SubjectKind::Endpoint, "ep_d1");
    let c = BillingClass::OnDemand;
    let events = vec![
        event(
            &t,
            "r1",
            ep,
            Meter::Requests,
            c,
            at(9, 0, 0),
            at(10, 0, 0),
            1000,
        ),
        event(
            &t,
            "r2",
            ep,
            Meter::Requests,
            c,
            at(10, 0, 0),
            at(11, 0, 0),
            500,
        ),
        event(
            &t,
            "i1",
            ep,
            Meter::InputTokens,
            c,
            at(9, 0, 0),
            at(11, 0, 0),
            12_000_000,
        ),
        event(
            &t,
            "o1",
            ep,
            Meter::OutputTokens,
            c,
            at(9, 0, 0),
            at(11, 0, 0),
            3_000_000,
        ),
        event(&t, "g1", ep, h100(), c, at(9, 0, 0), at(9, 10, 0), 1),
    ];
    let (spot, used) = (SpotSeries::new(), BTreeMap::new());
    let inv = invoice(&t, &events, &book(), plain(&spot, &used));
    assert_eq!(
        rows(&inv),
        vec![
            row(LineKind::ServerlessGpu, "600", "0.0012", "0.72"),
            row(LineKind::ServerlessRequests, "1000", "0.001", "1.00"),
            row(LineKind::ServerlessRequests, "500", "0.0005", "0.25"),
            // 12 M in the period: the volume tier above 10 M prices all 12 M.
            row(LineKind::ServerlessInputTokens, "12", "0.4", "4.80"),
            row(LineKind::ServerlessOutputTokens, "3", "1.5", "4.50"),
        ]
    );
    assert_eq!(inv.total().to_string(), "11.27");
}

#[test]
fn example_5_a_discount_then_a_credit() {
    let t = tenant(5);
    let a100 = Meter::GpuSeconds {
        model: "A100-80GB".into(),
        share: GpuShare::Whole,
    };
    let events = vec![event(
        &t,
        "e1",
        (SubjectKind::Instance, "inst_e1"),
        a100,
        BillingClass::OnDemand,
        at(8, 0, 0),
        at(18, 0, 0),
        1,
    )];
    let discounts = [Discount {
        id: "disc-e".into(),
        tenant: t.clone(),
        percent: d("10"),
        scope: DiscountScope::All,
        from: at(0, 0, 0) - Duration::days(30),
        until: None,
    }];
    let credits = [CreditGrant {
        id: "promo-e".into(),
        tenant: t.clone(),
        kind: CreditKind::Promotional,
        amount: d("25.00"),
        granted_at: at(0, 0, 0) - Duration::days(20),
        expires_at: None,
    }];
    let used = BTreeMap::from([("promo-e".to_string(), d("20.00"))]);
    let spot = SpotSeries::new();
    let draft = build_invoice(InvoiceInput {
        id: &InvoiceId::generate(1, 1),
        tenant: &t,
        period: day(),
        events: &events,
        book: &book(),
        spot: &spot,
        commitments: &[],
        discounts: &discounts,
        credits: &credits,
        credit_used_before: &used,
    })
    .unwrap();
    let inv = draft.invoice;
    assert_eq!(
        rows(&inv),
        vec![
            row(LineKind::OnDemand, "36000", "0.0005", "18.00"),
            row(LineKind::Discount, "18.00", "-0.1", "-1.80"),
            row(LineKind::Credit, "1", "-5.00", "-5.00"),
        ]
    );
    assert_eq!(inv.subtotal().to_string(), "18.00");
    assert_eq!(inv.total().to_string(), "11.20");
    assert_eq!(draft.credits_applied.get("promo-e"), Some(&d("5.00")));
}

#[test]
fn example_6_provider_payout() {
    let (x, y) = (tenant(6), tenant(7));
    let b = book();
    let mut spot = SpotSeries::new();
    spot.record(&b, "H100", at(0, 0, 0), d("0.25")).unwrap();
    let n1 = NodeId::generate(1, 1);
    let n2 = NodeId::generate(1, 2);
    let prov = ProviderId::generate(1, 1);
    let other = ProviderId::generate(1, 2);
    let owners = BTreeMap::from([(n1.clone(), prov.clone()), (n2.clone(), other)]);
    let on = |mut e: UsageEvent, n: &NodeId| {
        e.node = Some(n.clone());
        e
    };
    let events = vec![
        on(
            event(
                &x,
                "x1",
                (SubjectKind::Instance, "inst_x1"),
                h100(),
                BillingClass::OnDemand,
                at(8, 0, 0),
                at(18, 0, 0),
                1,
            ),
            &n1,
        ),
        on(
            event(
                &y,
                "y1",
                (SubjectKind::Job, "job_y1"),
                h100(),
                BillingClass::Spot,
                at(0, 0, 0),
                at(2, 0, 0),
                2,
            ),
            &n1,
        ),
        // Another provider's node: not on this statement.
        on(
            event(
                &y,
                "y2",
                (SubjectKind::Job, "job_y2"),
                h100(),
                BillingClass::OnDemand,
                at(0, 0, 0),
                at(5, 0, 0),
                8,
            ),
            &n2,
        ),
    ];
    let s = payout_statement(
        &prov,
        day(),
        &owners,
        &events,
        &b,
        &spot,
        &PayoutPolicy {
            operator_fee_percent: d("15"),
        },
    )
    .unwrap();
    let lines: Vec<(LineKind, String, String, String)> = s
        .lines
        .iter()
        .map(|l| {
            (
                l.kind,
                l.gpu_seconds.to_string(),
                l.unit_price.to_string(),
                l.gross.to_string(),
            )
        })
        .collect();
    assert_eq!(
        lines,
        vec![
            row(LineKind::OnDemand, "36000", "0.001", "36.00"),
            row(LineKind::Spot, "14400", "0.0005", "7.20"),
        ]
    );
    assert_eq!(
        (
            s.gross.to_string(),
            s.operator_fee.to_string(),
            s.payout.to_string()
        ),
        ("43.20".into(), "6.48".into(), "36.72".into())
    );
}

#[test]
fn parked_replica_memory_is_billed_per_gb_hour() {
    // An endpoint's replica parked 16 GB of weights in host memory for
    // 90 minutes; the catalog prices parked memory at 0.0036 per GB-hour
    // (0.000001 per GB-second).
    let t = tenant(1);
    let mut v = version1();
    v.per_parked_gb_hour = d("0.0036");
    let book = PriceBook::new(v.clone()).unwrap();
    let parked = event(
        &t,
        "park-1",
        (SubjectKind::Endpoint, "ep_1"),
        Meter::ParkedGbSeconds,
        BillingClass::OnDemand,
        at(1, 0, 0),
        at(2, 30, 0),
        16,
    );
    let (spot, used) = (SpotSeries::new(), BTreeMap::new());
    let inv = invoice(
        &t,
        std::slice::from_ref(&parked),
        &book,
        plain(&spot, &used),
    );
    // 16 GB x 5400 s = 86400 GB-s x 0.000001 = 0.0864 -> 0.09.
    let lines = rows(&inv);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0].0, LineKind::ParkedMemory);
    assert_eq!(lines[0].1, "86400");
    assert_eq!(lines[0].3, "0.09");
    assert!(
        inv.lines()[0].description.contains("parked"),
        "{:?}",
        inv.lines()[0].description
    );
    // The operator may give parking away: no line at all.
    v.per_parked_gb_hour = d("0");
    let free = PriceBook::new(v).unwrap();
    let inv = invoice(&t, &[parked], &free, plain(&spot, &used));
    assert!(inv.lines().is_empty(), "{:?}", rows(&inv));
}
