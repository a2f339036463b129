//! Estimates against price version 1 (see `common::version1`).

mod common;

use common::*;
use flotilla_billing::estimate::{
    estimate, BillingModel, GpuWorkload, ServerlessWorkload, Workload,
};
use flotilla_billing::price::SpotSeries;

fn gpu(hours: &str, tier: u8) -> Workload {
    Workload::Gpu(GpuWorkload {
        model: Some("H100".into()),
        gpus: 2,
        hours_per_day: d(hours),
        duty_cycle: d("0.5"),
        tier,
        serves_requests: false,
    })
}

fn costs(w: &Workload) -> Vec<(BillingModel, String, bool)> {
    estimate(w, &book(), &SpotSeries::new(), at(0, 0, 0))
        .unwrap()
        .options
        .into_iter()
        .map(|o| (o.billing_model, o.monthly_cost.to_string(), o.meets))
        .collect()
}

#[test]
fn part_time_gpus_compare_every_billing_model() {
    // 2 GPUs x 8 h x 30 days = 1,728,000 GPU-seconds held.
    let r = |t, d: &str| BillingModel::Reserved {
        term_days: t,
        discount: common::d(d),
    };
    assert_eq!(
        costs(&gpu("8", 2)),
        vec![
            (BillingModel::OnDemand, "1728.00".into(), true),
            (r(30, "0.30"), "3628.80".into(), true),
            (r(365, "0.40"), "3110.40".into(), true),
            (BillingModel::Spot, "1036.80".into(), true),
            (BillingModel::Serverless, "1036.80".into(), false),
        ]
    );
    let e = estimate(&gpu("8", 2), &book(), &SpotSeries::new(), at(0, 0, 0)).unwrap();
    assert_eq!(e.cheapest.unwrap().billing_model, BillingModel::Spot);
    // Tier 1 may not run on spot: on-demand is the cheapest that meets it.
    let e = estimate(&gpu("8", 1), &book(), &SpotSeries::new(), at(0, 0, 0)).unwrap();
    assert_eq!(e.cheapest.unwrap().monthly_cost.to_string(), "1728.00");
    // Around the clock, the one-year commitment wins.
    let e = estimate(&gpu("24", 1), &book(), &SpotSeries::new(), at(0, 0, 0)).unwrap();
    let c = e.cheapest.unwrap();
    assert_eq!(
        (c.monthly_cost.to_string(), c.billing_model),
        ("3110.40".into(), r(365, "0.40"))
    );
}

#[test]
fn serverless_workload_against_dedicated_replicas() {
    // 0.1 req/s x 2,592,000 s = 259,200 requests a month.
    let w = Workload::Serverless(ServerlessWorkload {
        model: Some("H100".into()),
        requests_per_second: d("0.1"),
        input_tokens_per_request: d("100"),
        output_tokens_per_request: d("50"),
        gpu_seconds_per_request: d("0.5"),
        tier: 1,
        parked_gb: d("0"),
    });
    let e = estimate(&w, &book(), &SpotSeries::new(), at(0, 0, 0)).unwrap();
    // Requests: 1000 x 0.001 + 258,200 x 0.0005 = 130.10; input 25.92 M x 0.40
    // = 10.368; output 12.96 M x 1.50 = 19.44; GPU 129,600 s x 0.0012 =
    // 155.52; total 315.428 -> 315.43. One dedicated H100 all month: 2592.00.
    let s = &e.options[0];
    assert_eq!(
        (s.billing_model.clone(), s.monthly_cost.to_string()),
        (BillingModel::Serverless, "315.43".into())
    );
    assert_eq!(e.options[1].monthly_cost.to_string(), "2592.00");
    assert_eq!(e.cheapest.unwrap().billing_model, BillingModel::Serverless);
    assert!(estimate(
        &Workload::Gpu(GpuWorkload {
            model: None,
            gpus: 1,
            hours_per_day: d("25"),
            duty_cycle: d("1"),
            tier: 1,
            serves_requests: true,
        }),
        &book(),
        &SpotSeries::new(),
        at(0, 0, 0)
    )
    .is_err());
}

#[test]
fn parked_memory_is_added_to_the_serverless_option_all_month() {
    let mut v = version1();
    v.per_parked_gb_hour = d("0.0036");
    let book = flotilla_billing::price::PriceBook::new(v).unwrap();
    let w = |parked: &str| {
        Workload::Serverless(ServerlessWorkload {
            model: Some("H100".into()),
            requests_per_second: d("0.1"),
            input_tokens_per_request: d("100"),
            output_tokens_per_request: d("50"),
            gpu_seconds_per_request: d("0.5"),
            tier: 1,
            parked_gb: d(parked),
        })
    };
    let cost = |parked: &str| {
        estimate(&w(parked), &book, &SpotSeries::new(), at(0, 0, 0))
            .unwrap()
            .options[0]
            .monthly_cost
    };
    // 16 GB x 720 h x 0.0036 = 41.472 on top of 315.428: 356.90.
    assert_eq!(cost("0").to_string(), "315.43");
    assert_eq!(cost("16").to_string(), "356.90");
    assert!(estimate(&w("-1"), &book, &SpotSeries::new(), at(0, 0, 0)).is_err());
}
