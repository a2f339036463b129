//! Invariants of rating, checked on random inputs:
//! - an invoice equals the sum of its lines (and every amount is in minor units);
//! - the same events in any order and with duplicates give byte-identical invoices;
//! - GPU usage summed over every tenant's invoice equals the metered GPU-seconds;
//! - reserved, overage and on-demand never count the same interval twice.

mod common;

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, Utc};
use common::*;
use flotilla_billing::invoice::{build_invoice, Draft, InvoiceInput};
use flotilla_billing::meter::{GpuShare, Ledger, MemoryLedger, Meter, SubjectKind, UsageEvent};
use flotilla_billing::price::{
    split_reserved, Commitment, CreditGrant, CreditKind, Discount, DiscountScope, Payment,
    PriceBook, RateInterval, SpotSeries,
};
use flotilla_billing::{LineKind, Period};
use flotilla_core::id::{InvoiceId, TenantId};
use flotilla_core::instance::BillingClass;
use proptest::prelude::*;
use rust_decimal::Decimal;

const TENANTS: u64 = 3;

fn period() -> Period {
    Period::new(at(0, 0, 0), at(0, 0, 0) + Duration::days(1)).unwrap()
}

/// A random event: tenant, meter kind, class, start offset from an hour
/// before the period, duration, amount, share. Shares are whole or milli so
/// GPU-seconds are exact decimals (MIG thirds are covered by unit tests).
fn arb_event() -> impl Strategy<Value = (u64, u8, u8, i64, i64, u64, u32)> {
    (
        0..TENANTS,
        0u8..8,
        0u8..3,
        -3600i64..90_000,
        1i64..30_000,
        1u64..6,
        0u32..4,
    )
}

fn make(
    i: usize,
    (t, kind, class, off, dur, amount, share): (u64, u8, u8, i64, i64, u64, u32),
) -> UsageEvent {
    let start = at(0, 0, 0) + Duration::seconds(off);
    let end = start + Duration::seconds(dur);
    let class = [
        BillingClass::OnDemand,
        BillingClass::Spot,
        BillingClass::Reserved,
    ][class as usize];
    let share = match share {
        0 | 1 => GpuShare::Whole,
        2 => GpuShare::Fraction { milli: 250 },
        _ => GpuShare::Fraction { milli: 500 },
    };
    let gpu = Meter::GpuSeconds {
        model: "H100".into(),
        share,
    };
    let (subject, meter, amount) = match kind {
        0..=2 => ((SubjectKind::Instance, "inst_a"), gpu, amount),
        3 => ((SubjectKind::Job, "job_b"), gpu, amount),
        4 => ((SubjectKind::Endpoint, "ep_c"), gpu, amount),
        5 => (
            (SubjectKind::Endpoint, "ep_c"),
            Meter::Requests,
            amount * 377,
        ),
        6 => (
            (SubjectKind::Endpoint, "ep_c"),
            Meter::InputTokens,
            amount * 3_333_333,
        ),
        _ => (
            (SubjectKind::Instance, "inst_a"),
            Meter::StorageGbSeconds,
            amount * 10,
        ),
    };
    event(
        &tenant(t),
        &format!("e{i}"),
        subject,
        meter,
        class,
        start,
        end,
        amount,
    )
}

struct World {
    book: PriceBook,
    spot: SpotSeries,
    commitments: Vec<Commitment>,
    discounts: Vec<Discount>,
    credits: Vec<CreditGrant>,
}

fn world() -> World {
    let book = book();
    let mut spot = SpotSeries::new();
    spot.record(&book, "H100", at(0, 0, 0) - Duration::days(1), d("0.1"))
        .unwrap();
    spot.record(&book, "H100", at(6, 0, 0), d("0.9")).unwrap();
    spot.record(&book, "H100", at(13, 30, 0), d("0.333"))
        .unwrap();
    let mut commitments = Vec::new();
    let mut discounts = Vec::new();
    let mut credits = Vec::new();
    for n in 0..TENANTS {
        let t = tenant(n);
        commitments.push(
            Commitment::sign(
                &format!("res-{n}"),
                t.clone(),
                "H100",
                1 + n as u32,
                at(0, 0, 0) - Duration::days(3) + Duration::hours(7 * n as i64),
                3 + n as u32,
                if n == 1 {
                    Payment::Upfront
                } else {
                    Payment::Monthly
                },
                d("0.3"),
                &book,
            )
            .unwrap(),
        );
        discounts.push(Discount {
            id: format!("disc-{n}"),
            tenant: t.clone(),
            percent: d("12.5"),
            scope: [
                DiscountScope::All,
                DiscountScope::Spot,
                DiscountScope::Serverless,
            ][n as usize],
            from: at(0, 0, 0),
            until: None,
        });
        credits.push(CreditGrant {
            id: format!("credit-{n}"),
            tenant: t,
            kind: CreditKind::Prepaid,
            amount: d("3.33"),
            granted_at: at(0, 0, 0),
            expires_at: None,
        });
    }
    World {
        book,
        spot,
        commitments,
        discounts,
        credits,
    }
}

fn bill(w: &World, t: &TenantId, events: &[UsageEvent], with_commercials: bool) -> Draft {
    let used = BTreeMap::new();
    build_invoice(InvoiceInput {
        id: &InvoiceId::generate(7, 7),
        tenant: t,
        period: period(),
        events,
        book: &w.book,
        spot: &w.spot,
        commitments: if with_commercials {
            &w.commitments
        } else {
            &[]
        },
        discounts: if with_commercials { &w.discounts } else { &[] },
        credits: if with_commercials { &w.credits } else { &[] },
        credit_used_before: &used,
    })
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn invoice_equals_the_sum_of_its_lines(raw in prop::collection::vec(arb_event(), 0..40)) {
        let w = world();
        let events: Vec<UsageEvent> = raw.into_iter().enumerate().map(|(i, r)| make(i, r)).collect();
        for n in 0..TENANTS {
            let inv = bill(&w, &tenant(n), &events, true).invoice;
            let sum: Decimal = inv.lines().iter().map(|l| l.amount).sum();
            prop_assert_eq!(inv.total(), sum);
            prop_assert!(inv.total() >= Decimal::ZERO);
            for l in inv.lines() {
                prop_assert_eq!(l.amount.scale(), 2, "amount {} of {:?}", l.amount, l.kind);
            }
        }
    }

    #[test]
    fn any_order_with_duplicates_gives_identical_bytes(
        raw in prop::collection::vec(arb_event(), 1..40),
        seed in any::<u64>(),
        dups in prop::collection::vec(any::<prop::sample::Index>(), 0..20),
    ) {
        let w = world();
        let events: Vec<UsageEvent> = raw.into_iter().enumerate().map(|(i, r)| make(i, r)).collect();
        // A shuffled copy with duplicates, sent through the ledger too.
        let mut noisy = events.clone();
        for ix in &dups {
            noisy.push(events[ix.index(events.len())].clone());
        }
        let mut state = seed | 1;
        for i in (1..noisy.len()).rev() {
            state ^= state << 13; state ^= state >> 7; state ^= state << 17;
            noisy.swap(i, (state % (i as u64 + 1)) as usize);
        }
        let mut ledger = MemoryLedger::new(Duration::days(2));
        for e in &noisy {
            ledger.append(e.clone(), at(23, 0, 0)).unwrap();
        }
        for n in 0..TENANTS {
            let t = tenant(n);
            let a = bill(&w, &t, &events, true).invoice.to_json().unwrap();
            let b = bill(&w, &t, &noisy, true).invoice.to_json().unwrap();
            let stored = ledger.events(&t, period().start, period().end);
            let c = bill(&w, &t, &stored, true).invoice.to_json().unwrap();
            prop_assert_eq!(&a, &b);
            prop_assert_eq!(&a, &c);
        }
    }

    #[test]
    fn usage_across_tenants_equals_metered_gpu_seconds(raw in prop::collection::vec(arb_event(), 0..40)) {
        let w = world();
        let events: Vec<UsageEvent> = raw.into_iter().enumerate().map(|(i, r)| make(i, r)).collect();
        let p = period();
        let metered: Decimal = events
            .iter()
            .filter(|e| matches!(e.meter, Meter::GpuSeconds { .. }))
            .map(|e| e.quantity_within(p.start, p.end).unwrap())
            .sum();
        let mut billed = Decimal::ZERO;
        for n in 0..TENANTS {
            let inv = bill(&w, &tenant(n), &events, true).invoice;
            billed += inv
                .lines()
                .iter()
                .filter(|l| matches!(
                    l.kind,
                    LineKind::OnDemand | LineKind::Overage | LineKind::ReservedUsed | LineKind::Spot | LineKind::ServerlessGpu
                ))
                .map(|l| l.quantity)
                .sum::<Decimal>();
        }
        prop_assert_eq!(billed, metered);
    }

    #[test]
    fn reserved_overage_and_on_demand_never_count_twice(
        usage in prop::collection::vec((0i64..1000, 1i64..500, 1i128..20_000), 0..20),
        capacity in prop::collection::vec((0i64..1000, 1i64..500, 1i128..4), 0..5),
        cuts in prop::collection::vec(0i64..1000, 0..5),
    ) {
        let t = |s: i64| DateTime::<Utc>::from_timestamp(1_736_467_200 + s, 0).unwrap();
        let (from, to) = (t(100), t(900));
        let iv = |&(s, len, u): &(i64, i64, i128), scale: i128| RateInterval { start: t(s), end: t(s + len), units: u * scale };
        let usage: Vec<RateInterval> = usage.iter().map(|x| iv(x, 1)).collect();
        let capacity: Vec<RateInterval> = capacity.iter().map(|x| iv(x, 7000)).collect();
        let cuts: Vec<DateTime<Utc>> = cuts.into_iter().map(t).collect();
        let segs = split_reserved(&usage, &capacity, from, to, &cuts);
        let within = |list: &[RateInterval]| -> i128 {
            list.iter().map(|r| {
                let (a, b) = (r.start.max(from), r.end.min(to));
                if a < b { r.units * i128::from((b - a).num_milliseconds()) } else { 0 }
            }).sum()
        };
        let mut last_end = from;
        for s in &segs {
            // Segments are disjoint, ordered and inside the window.
            prop_assert!(s.start >= last_end && s.start < s.end && s.end <= to);
            last_end = s.end;
            let ms = i128::from((s.end - s.start).num_milliseconds());
            prop_assert_eq!(s.reserved_unit_ms + s.overage_unit_ms, s.usage_units * ms);
            prop_assert_eq!(s.reserved_unit_ms + s.unused_unit_ms, s.capacity_units * ms);
            prop_assert!(s.reserved_unit_ms.min(s.overage_unit_ms).min(s.unused_unit_ms) >= 0);
            prop_assert!(s.overage_unit_ms == 0 || s.unused_unit_ms == 0, "idle capacity while paying overage");
        }
        let sum = |f: fn(&flotilla_billing::price::SplitSegment) -> i128| segs.iter().map(f).sum::<i128>();
        prop_assert_eq!(sum(|s| s.reserved_unit_ms) + sum(|s| s.overage_unit_ms), within(&usage));
        prop_assert_eq!(sum(|s| s.reserved_unit_ms) + sum(|s| s.unused_unit_ms), within(&capacity));
    }
}

#[test]
fn corrections_and_finalisation() {
    let w = world();
    let t = tenant(0);
    let first = event(
        &t,
        "x",
        (SubjectKind::Instance, "inst_x"),
        h100(),
        BillingClass::OnDemand,
        at(1, 0, 0),
        at(2, 0, 0),
        4,
    );
    let mut fix = event(
        &t,
        "x-fix",
        (SubjectKind::Instance, "inst_x"),
        h100(),
        BillingClass::OnDemand,
        at(1, 0, 0),
        at(2, 0, 0),
        2,
    );
    fix.corrects = Some(first.key.clone());
    let inv = bill(&w, &t, &[fix.clone(), first.clone()], false).invoice;
    assert_eq!(inv.lines()[0].quantity, Decimal::from(7200));
    let grace = Duration::hours(6);
    assert!(
        inv.clone().finalise(period().end, grace).is_err(),
        "grace window still open"
    );
    let fin = inv.finalise(period().end + grace, grace).unwrap();
    assert!(
        fin.clone().finalise(period().end + grace, grace).is_err(),
        "finalised is final"
    );
    use flotilla_billing::InvoiceBook;
    let mut books = flotilla_billing::MemoryInvoiceBook::default();
    let draft = bill(&w, &t, &[first], false).invoice;
    books.put_draft(draft.clone()).unwrap();
    books
        .finalise(draft.id(), period().end + grace, grace)
        .unwrap();
    assert!(books.put_draft(draft).is_err());
}

#[test]
fn mig_shares_bill_as_sevenths() {
    let w = world();
    let t = tenant(0);
    let mig = Meter::GpuSeconds {
        model: "H100".into(),
        share: GpuShare::mig_named("3g.40gb").unwrap(),
    };
    // 2 x 3g slices for 7000 s = 6000 whole-GPU-seconds.
    let e = event(
        &t,
        "m",
        (SubjectKind::Instance, "inst_m"),
        mig,
        BillingClass::OnDemand,
        at(1, 0, 0),
        at(1, 0, 0) + Duration::seconds(7000),
        2,
    );
    let inv = bill(&w, &t, &[e], false).invoice;
    assert_eq!(inv.lines()[0].quantity, Decimal::from(6000));
    assert_eq!(inv.total().to_string(), "6.00");
}
