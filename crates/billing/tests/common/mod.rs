//! The price book and helpers shared by the worked examples (which
//! `docs/billing.md` quotes) and the property tests.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::collections::BTreeMap;
use std::str::FromStr;

use chrono::{DateTime, TimeZone, Utc};
use flotilla_billing::meter::{EventKey, GpuShare, Meter, Subject, SubjectKind, UsageEvent};
use flotilla_billing::price::{
    OnDemandPrice, PriceBook, PriceVersion, ReservedOffer, Schedule, ServerlessPrices, SpotBand,
    Tier,
};
use flotilla_billing::Currency;
use flotilla_core::id::TenantId;
use flotilla_core::instance::BillingClass;
use rust_decimal::Decimal;

pub fn d(s: &str) -> Decimal {
    Decimal::from_str(s).unwrap()
}

/// 2025-01-10 at `h:m:s` UTC, the day every example happens on.
pub fn at(h: u32, m: u32, s: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2025, 1, 10, h, m, s).unwrap()
}

pub fn tenant(n: u64) -> TenantId {
    TenantId::generate(1_700_000_000_000 + n, u128::from(n))
}

/// Price version 1, in force from 2025-01-01, as printed in docs/billing.md.
pub fn version1() -> PriceVersion {
    PriceVersion {
        version: 1,
        effective_from: Utc.with_ymd_and_hms(2025, 1, 1, 0, 0, 0).unwrap(),
        currency: Currency::usd(),
        on_demand: BTreeMap::from([
            (
                "H100".to_string(),
                OnDemandPrice {
                    per_gpu_second: d("0.001"),
                    minimum_seconds: 60,
                },
            ),
            (
                "A100-80GB".to_string(),
                OnDemandPrice {
                    per_gpu_second: d("0.0005"),
                    minimum_seconds: 0,
                },
            ),
        ]),
        spot: BTreeMap::from([(
            "H100".to_string(),
            SpotBand {
                floor: d("0.0004"),
                ceiling: d("0.0008"),
            },
        )]),
        serverless: ServerlessPrices {
            per_request: Schedule::Graduated {
                tiers: vec![
                    Tier {
                        up_to: Some(d("1000")),
                        unit_price: d("0.001"),
                    },
                    Tier {
                        up_to: None,
                        unit_price: d("0.0005"),
                    },
                ],
            },
            per_million_input_tokens: Schedule::Volume {
                tiers: vec![
                    Tier {
                        up_to: Some(d("10")),
                        unit_price: d("0.50"),
                    },
                    Tier {
                        up_to: None,
                        unit_price: d("0.40"),
                    },
                ],
            },
            per_million_output_tokens: Schedule::Flat {
                unit_price: d("1.50"),
            },
            per_gpu_second: BTreeMap::from([("H100".to_string(), d("0.0012"))]),
        },
        reserved_offers: vec![
            ReservedOffer {
                term_days: 30,
                discount: d("0.30"),
            },
            ReservedOffer {
                term_days: 365,
                discount: d("0.40"),
            },
        ],
        per_instance_second: Decimal::ZERO,
        per_storage_gb_second: d("0.0000001"),
        per_parked_gb_hour: Decimal::ZERO,
    }
}

pub fn book() -> PriceBook {
    PriceBook::new(version1()).unwrap()
}

/// A usage event with a fresh key.
#[allow(
    clippy::too_many_arguments,
    reason = "test helper mirroring the event's fields"
)]
pub fn event(
    tenant: &TenantId,
    id: &str,
    subject: (SubjectKind, &str),
    meter: Meter,
    class: BillingClass,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
    amount: u64,
) -> UsageEvent {
    UsageEvent {
        key: EventKey {
            tenant: tenant.clone(),
            source: "test".into(),
            id: id.into(),
        },
        subject: Subject {
            kind: subject.0,
            id: subject.1.into(),
        },
        meter,
        billing_class: class,
        start,
        end,
        amount: Decimal::from(amount),
        node: None,
        corrects: None,
    }
}

pub fn h100() -> Meter {
    Meter::GpuSeconds {
        model: "H100".into(),
        share: GpuShare::Whole,
    }
}
