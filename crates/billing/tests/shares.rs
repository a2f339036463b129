//! GPU shares on invoices: a fraction bills its share of GPU time and a
//! MIG instance its slices of 7, each on a line that names the share.

mod common;

use std::collections::BTreeMap;

use chrono::Duration;
use common::*;
use flotilla_billing::invoice::{build_invoice, InvoiceInput};
use flotilla_billing::meter::{lifecycle_usage, GpuShare, Lifecycle, Subject, SubjectKind};
use flotilla_billing::price::SpotSeries;
use flotilla_billing::{LineKind, Period};
use flotilla_core::id::InvoiceId;
use flotilla_core::instance::BillingClass;

#[test]
fn shares_bill_their_part_of_each_second_on_lines_that_name_them() {
    let t = tenant(7);
    let run = |id: &str, share: GpuShare, hours: i64| Lifecycle {
        tenant: t.clone(),
        source: "lifecycle".into(),
        subject: Subject {
            kind: SubjectKind::Instance,
            id: id.into(),
        },
        model: "H100".into(),
        share,
        gpus: 1,
        billing_class: BillingClass::OnDemand,
        start: at(1, 0, 0),
        end: Some(at(1, 0, 0) + Duration::hours(hours)),
        preempted_at: None,
        node: None,
    };
    let mut events = Vec::new();
    for l in [
        run("inst_half", GpuShare::Fraction { milli: 500 }, 1),
        run("inst_mig", GpuShare::mig_named("1g.10gb").unwrap(), 7),
        run("inst_whole", GpuShare::Whole, 1),
    ] {
        events.extend(lifecycle_usage(&l, at(23, 0, 0), 60).unwrap());
    }
    let (spot, used) = (SpotSeries::new(), BTreeMap::new());
    let inv = build_invoice(InvoiceInput {
        id: &InvoiceId::generate(1, 1),
        tenant: &t,
        period: Period::new(at(0, 0, 0), at(0, 0, 0) + Duration::days(1)).unwrap(),
        events: &events,
        book: &book(),
        spot: &spot,
        commitments: &[],
        discounts: &[],
        credits: &[],
        credit_used_before: &used,
    })
    .unwrap()
    .invoice;
    let lines: Vec<(LineKind, &str, String, Option<&str>)> = inv
        .lines()
        .iter()
        .map(|l| {
            (
                l.kind,
                l.description.as_str(),
                l.quantity.to_string(),
                l.share.as_deref(),
            )
        })
        .collect();
    // An hour at half a GPU is 1800 GPU-seconds; seven hours of one slice
    // of seven is 3600.
    assert_eq!(
        lines,
        vec![
            (
                LineKind::OnDemand,
                "H100 on-demand, price v1",
                "3600".to_string(),
                None
            ),
            (
                LineKind::OnDemand,
                "0.5 × H100 on-demand, price v1",
                "1800".to_string(),
                Some("0.5 × H100")
            ),
            (
                LineKind::OnDemand,
                "H100 1g.10gb on-demand, price v1",
                "3600".to_string(),
                Some("H100 1g.10gb")
            ),
        ]
    );
}
