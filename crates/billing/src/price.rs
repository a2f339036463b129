//! Prices: the operator-editable, versioned catalog and the pricing rules
//! that read it — on-demand, reserved commitments (and the split of usage
//! between reserved capacity and on-demand), spot prices derived from pool
//! utilisation, serverless schedules (flat, graduated tiers, volume), plus
//! per-tenant discounts and credits.
//!
//! Every charge is traceable: a price version is immutable once published
//! and has an `effective_from`; a new price is a new version, never an edit.
//! Spot prices are recorded as a series of points, each naming the version
//! whose band produced it.

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, Utc};
use flotilla_core::catalog::Catalog;
use flotilla_core::id::TenantId;
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

use crate::error::BillingError;
use crate::money::{self, millis, Currency};
use crate::Result;

/// On-demand price of one model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OnDemandPrice {
    /// Price of one whole-GPU-second.
    pub per_gpu_second: Decimal,
    /// Least GPU-seconds billed per on-demand subject and model in a period
    /// (0: none). It covers the cost of placing and starting short work.
    #[serde(default)]
    pub minimum_seconds: u32,
}

/// Spot band of one model, per whole-GPU-second.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpotBand {
    /// Price at an idle pool.
    pub floor: Decimal,
    /// Price at a full pool.
    pub ceiling: Decimal,
}

/// One tier of a schedule: units up to `up_to` (cumulative; `None` for the
/// last, open tier) at `unit_price`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tier {
    /// Upper bound of the tier in units, inclusive; `None`: no bound.
    pub up_to: Option<Decimal>,
    /// Price of one unit in this tier.
    pub unit_price: Decimal,
}

/// How a count meter is priced over a period.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Schedule {
    /// One price for every unit.
    Flat {
        /// Price of one unit.
        unit_price: Decimal,
    },
    /// Graduated: each unit pays the price of the tier it falls in.
    Graduated {
        /// Tiers in increasing `up_to`, the last open.
        tiers: Vec<Tier>,
    },
    /// Volume: every unit pays the price of the tier the period's total
    /// falls in.
    Volume {
        /// Tiers in increasing `up_to`, the last open.
        tiers: Vec<Tier>,
    },
}

/// Units priced at one unit price by a schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulePiece {
    /// Units.
    pub quantity: Decimal,
    /// Price of one unit.
    pub unit_price: Decimal,
    /// Index of the tier (none for flat).
    pub tier: Option<usize>,
}

impl Schedule {
    /// Checks prices and tier bounds; `field` prefixes error paths.
    pub fn validate(&self, field: &str) -> Result<()> {
        let tiers = match self {
            Self::Flat { unit_price } => {
                return non_negative(*unit_price, &format!("{field}.unit_price"))
            }
            Self::Graduated { tiers } | Self::Volume { tiers } => tiers,
        };
        if tiers.is_empty() {
            return Err(BillingError::invalid(
                format!("{field}.tiers"),
                "must have at least one tier",
            ));
        }
        let mut prev = Decimal::ZERO;
        for (i, t) in tiers.iter().enumerate() {
            non_negative(t.unit_price, &format!("{field}.tiers[{i}].unit_price"))?;
            let last = i + 1 == tiers.len();
            match (t.up_to, last) {
                (None, true) => {}
                (None, false) => {
                    return Err(BillingError::invalid(
                        format!("{field}.tiers[{i}].up_to"),
                        "only the last tier may be open",
                    ))
                }
                (Some(_), true) => {
                    return Err(BillingError::invalid(
                        format!("{field}.tiers[{i}].up_to"),
                        "the last tier must be open (no up_to)",
                    ))
                }
                (Some(u), false) if u <= prev => {
                    return Err(BillingError::invalid(
                        format!("{field}.tiers[{i}].up_to"),
                        "must be greater than the previous tier's",
                    ))
                }
                (Some(u), false) => prev = u,
            }
        }
        Ok(())
    }

    /// Prices `quantity` units that come after `already` units of the same
    /// period; `period_total` (all units of the period) picks the volume
    /// tier. Graduated tiers continue across calls, so a price change
    /// mid-period does not restart the tiers.
    pub fn price(
        &self,
        already: Decimal,
        quantity: Decimal,
        period_total: Decimal,
    ) -> Result<Vec<SchedulePiece>> {
        match self {
            Self::Flat { unit_price } => Ok(vec![SchedulePiece {
                quantity,
                unit_price: *unit_price,
                tier: None,
            }]),
            Self::Volume { tiers } => {
                let i = tiers
                    .iter()
                    .position(|t| t.up_to.is_none_or(|u| period_total <= u))
                    .unwrap_or(tiers.len().saturating_sub(1));
                let unit_price = tiers.get(i).map(|t| t.unit_price).unwrap_or_default();
                Ok(vec![SchedulePiece {
                    quantity,
                    unit_price,
                    tier: Some(i),
                }])
            }
            Self::Graduated { tiers } => {
                let lo_q = already;
                let hi_q = money::add(already, quantity, "tiered quantity")?;
                let mut out = Vec::new();
                let mut lo = Decimal::ZERO;
                for (i, t) in tiers.iter().enumerate() {
                    let a = lo.max(lo_q);
                    let b = match t.up_to {
                        Some(u) => u.min(hi_q),
                        None => hi_q,
                    };
                    if b > a {
                        out.push(SchedulePiece {
                            quantity: money::sub(b, a, "tiered quantity")?,
                            unit_price: t.unit_price,
                            tier: Some(i),
                        });
                    }
                    match t.up_to {
                        Some(u) => lo = u,
                        None => break,
                    }
                }
                Ok(out)
            }
        }
    }
}

fn non_negative(d: Decimal, field: &str) -> Result<()> {
    if d.is_sign_negative() && !d.is_zero() {
        return Err(BillingError::invalid(field, "must not be negative"));
    }
    Ok(())
}

/// Serverless prices: per request, per million input and output tokens
/// (schedules over the period), and per GPU-second of active compute.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerlessPrices {
    /// Per request.
    pub per_request: Schedule,
    /// Per million input tokens.
    pub per_million_input_tokens: Schedule,
    /// Per million output tokens.
    pub per_million_output_tokens: Schedule,
    /// Per whole-GPU-second of an endpoint's active replicas, by model.
    pub per_gpu_second: BTreeMap<String, Decimal>,
}

/// A reserved term the operator offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservedOffer {
    /// Length of the term in days.
    pub term_days: u32,
    /// Discount off on-demand, as a fraction (0.30 = 30 %).
    pub discount: Decimal,
}

/// One immutable version of the price catalog.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PriceVersion {
    /// 1, 2, 3, …: the id every charge records.
    pub version: u32,
    /// From when it applies; it applies until the next version's.
    pub effective_from: DateTime<Utc>,
    /// Currency of every price in it.
    pub currency: Currency,
    /// On-demand prices by model.
    pub on_demand: BTreeMap<String, OnDemandPrice>,
    /// Spot bands by model.
    pub spot: BTreeMap<String, SpotBand>,
    /// Serverless prices.
    pub serverless: ServerlessPrices,
    /// Reserved terms on offer.
    pub reserved_offers: Vec<ReservedOffer>,
    /// Per instance-second (often zero: GPU time carries the price).
    pub per_instance_second: Decimal,
    /// Per GB-second of storage.
    pub per_storage_gb_second: Decimal,
    /// Per GB-hour of host memory held by a parked endpoint replica
    /// (weights in host memory, GPU released). Per hour, as memory is
    /// quoted; the operator may set it to zero. Absent in versions written
    /// before parking existed: zero.
    #[serde(default)]
    pub per_parked_gb_hour: Decimal,
}

/// The list price of one GB-hour of host memory: Google Cloud's N2
/// custom-machine memory price, us-central1 on-demand (USD 0.004237 per
/// GB-hour), the published price of memory alone. A 16 GB parked replica
/// costs 0.068 per hour, 2.3 % of an H100's 2.99.
pub const LIST_PARKED_GB_HOUR: Decimal = Decimal::from_parts(4237, 0, 0, false, 6);

impl PriceVersion {
    /// Checks every price; the error names the field.
    pub fn validate(&self) -> Result<()> {
        Currency::new(&self.currency.code, self.currency.minor_units)?;
        for (m, p) in &self.on_demand {
            non_negative(p.per_gpu_second, &format!("on_demand.{m}.per_gpu_second"))?;
        }
        for (m, b) in &self.spot {
            non_negative(b.floor, &format!("spot.{m}.floor"))?;
            if b.ceiling < b.floor {
                return Err(BillingError::invalid(
                    format!("spot.{m}.ceiling"),
                    "must not be below the floor",
                ));
            }
        }
        self.serverless
            .per_request
            .validate("serverless.per_request")?;
        self.serverless
            .per_million_input_tokens
            .validate("serverless.per_million_input_tokens")?;
        self.serverless
            .per_million_output_tokens
            .validate("serverless.per_million_output_tokens")?;
        for (m, p) in &self.serverless.per_gpu_second {
            non_negative(*p, &format!("serverless.per_gpu_second.{m}"))?;
        }
        for (i, o) in self.reserved_offers.iter().enumerate() {
            if o.term_days == 0 {
                return Err(BillingError::invalid(
                    format!("reserved_offers[{i}].term_days"),
                    "must be positive",
                ));
            }
            check_fraction(o.discount, &format!("reserved_offers[{i}].discount"))?;
        }
        non_negative(self.per_instance_second, "per_instance_second")?;
        non_negative(self.per_storage_gb_second, "per_storage_gb_second")?;
        non_negative(self.per_parked_gb_hour, "per_parked_gb_hour")
    }

    /// The price of one GB-second of parked host memory.
    pub fn parked_per_gb_second(&self) -> Decimal {
        self.per_parked_gb_hour / Decimal::from(3600)
    }

    /// The on-demand price of `model`.
    pub fn on_demand(&self, model: &str) -> Result<&OnDemandPrice> {
        self.on_demand
            .get(model)
            .ok_or_else(|| BillingError::NoPriceForModel {
                version: self.version,
                kind: "on_demand",
                model: model.to_string(),
            })
    }

    /// The serverless GPU-second price of `model`.
    pub fn serverless_gpu_second(&self, model: &str) -> Result<Decimal> {
        self.serverless
            .per_gpu_second
            .get(model)
            .copied()
            .ok_or_else(|| BillingError::NoPriceForModel {
                version: self.version,
                kind: "serverless",
                model: model.to_string(),
            })
    }
}

fn check_fraction(d: Decimal, field: &str) -> Result<()> {
    if d.is_sign_negative() || d >= Decimal::ONE {
        return Err(BillingError::invalid(
            field,
            "must be a fraction from 0 up to (not including) 1",
        ));
    }
    Ok(())
}

/// The versioned catalog: versions in order of `effective_from`, all in one
/// currency (an invoice never mixes currencies).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PriceBook {
    versions: Vec<PriceVersion>,
}

impl PriceBook {
    /// A catalog starting with `first`, which must be version 1.
    pub fn new(first: PriceVersion) -> Result<Self> {
        if first.version != 1 {
            return Err(BillingError::invalid(
                "version",
                "the first version must be 1",
            ));
        }
        first.validate()?;
        Ok(Self {
            versions: vec![first],
        })
    }

    /// Publishes the next version. It must be numbered one above the last,
    /// take effect strictly after it and use the same currency; `now` keeps
    /// the past immutable: a version cannot take effect before it is
    /// published, or charges already made would change.
    pub fn publish(&mut self, next: PriceVersion, now: DateTime<Utc>) -> Result<()> {
        next.validate()?;
        let last = self.latest();
        if next.version != last.version + 1 {
            return Err(BillingError::invalid(
                "version",
                format!("must be {}, got {}", last.version + 1, next.version),
            ));
        }
        if next.effective_from <= last.effective_from || next.effective_from < now {
            return Err(BillingError::invalid(
                "effective_from",
                format!(
                    "must be after version {} ({}) and not in the past ({now})",
                    last.version, last.effective_from
                ),
            ));
        }
        if next.currency != last.currency {
            return Err(BillingError::invalid(
                "currency",
                format!("must stay {}", last.currency.code),
            ));
        }
        self.versions.push(next);
        Ok(())
    }

    /// Every version, oldest first.
    pub fn versions(&self) -> &[PriceVersion] {
        &self.versions
    }

    /// The newest version.
    pub fn latest(&self) -> &PriceVersion {
        // `new` guarantees one version and nothing removes versions.
        &self.versions[self.versions.len() - 1]
    }

    /// The catalog's currency.
    pub fn currency(&self) -> &Currency {
        &self.versions[0].currency
    }

    /// Version number `v`.
    pub fn version(&self, v: u32) -> Option<&PriceVersion> {
        self.versions.iter().find(|p| p.version == v)
    }

    /// The version in force at `at`.
    pub fn in_force(&self, at: DateTime<Utc>) -> Result<&PriceVersion> {
        self.versions
            .iter()
            .rev()
            .find(|v| v.effective_from <= at)
            .ok_or(BillingError::NoPriceInForce { at })
    }

    /// Instants strictly inside `(from, to)` where a new version starts.
    pub fn boundaries(&self, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<DateTime<Utc>> {
        self.versions
            .iter()
            .map(|v| v.effective_from)
            .filter(|t| from < *t && *t < to)
            .collect()
    }
}

/// The price book of a GPU catalog's list prices (what the server uses
/// until the operator-editable catalog lands, and what the autoscaling
/// simulator prices GPU time with): version
/// 1, in force since the epoch, USD, on-demand and serverless GPU time at
/// the catalog's list price per hour / 3600 (exact to 28 digits), no
/// minimum, spot bands from 30% (idle pool) to 90% (full pool) of
/// on-demand, parked host memory at [`LIST_PARKED_GB_HOUR`], reserved
/// terms of 30 days at 30 % off and 365 days at 40 % off, requests,
/// tokens, instance time and storage free.
pub fn list_price_book(catalog: &Catalog) -> Result<PriceBook> {
    let hour = Decimal::from(3600);
    let mut on_demand = BTreeMap::new();
    let mut serverless = BTreeMap::new();
    let mut spot = BTreeMap::new();
    for m in catalog.models() {
        let per_second = m
            .list_price_per_hour
            .checked_div(hour)
            .ok_or(BillingError::Overflow { what: "price" })?;
        on_demand.insert(
            m.name.clone(),
            OnDemandPrice {
                per_gpu_second: per_second,
                minimum_seconds: 0,
            },
        );
        serverless.insert(m.name.clone(), per_second);
        // Spot trades between 30% and 90% of on-demand with pool use.
        spot.insert(
            m.name.clone(),
            SpotBand {
                floor: per_second * Decimal::new(3, 1),
                ceiling: per_second * Decimal::new(9, 1),
            },
        );
    }
    let free = || Schedule::Flat {
        unit_price: Decimal::ZERO,
    };
    PriceBook::new(PriceVersion {
        version: 1,
        effective_from: DateTime::<Utc>::UNIX_EPOCH,
        currency: Currency::usd(),
        on_demand,
        spot,
        serverless: ServerlessPrices {
            per_request: free(),
            per_million_input_tokens: free(),
            per_million_output_tokens: free(),
            per_gpu_second: serverless,
        },
        // Commitments are what a newcomer compares first (`flotilla
        // estimate`): list terms, editable in a new version.
        reserved_offers: vec![
            ReservedOffer {
                term_days: 30,
                discount: Decimal::new(30, 2),
            },
            ReservedOffer {
                term_days: 365,
                discount: Decimal::new(40, 2),
            },
        ],
        per_instance_second: Decimal::ZERO,
        per_storage_gb_second: Decimal::ZERO,
        per_parked_gb_hour: LIST_PARKED_GB_HOUR,
    })
}

/// The spot price at pool utilisation `u` (0 = idle, 1 = full): linear
/// between floor and ceiling. Linear keeps it explainable on an invoice.
pub fn spot_price(band: &SpotBand, utilisation: Decimal) -> Result<Decimal> {
    if utilisation.is_sign_negative() && !utilisation.is_zero() || utilisation > Decimal::ONE {
        return Err(BillingError::invalid(
            "utilisation",
            "must be between 0 and 1",
        ));
    }
    let span = money::sub(band.ceiling, band.floor, "spot price")?;
    money::add(
        band.floor,
        money::mul(span, utilisation, "spot price")?,
        "spot price",
    )
}

/// One recorded spot price: in force from `at` until the model's next point.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpotPoint {
    /// GPU model.
    pub model: String,
    /// From when it applies.
    pub at: DateTime<Utc>,
    /// Pool utilisation it was derived from.
    pub utilisation: Decimal,
    /// Price of one whole-GPU-second.
    pub per_gpu_second: Decimal,
    /// The catalog version whose band produced it.
    pub price_version: u32,
}

/// The recorded spot price series of every model, append-only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpotSeries {
    points: BTreeMap<String, Vec<SpotPoint>>,
}

impl SpotSeries {
    /// An empty series.
    pub fn new() -> Self {
        Self::default()
    }

    /// Derives and records the spot price of `model` at `at` from the pool's
    /// utilisation and the band in force. Points of a model are strictly
    /// increasing in time.
    pub fn record(
        &mut self,
        book: &PriceBook,
        model: &str,
        at: DateTime<Utc>,
        utilisation: Decimal,
    ) -> Result<SpotPoint> {
        let v = book.in_force(at)?;
        let band = v
            .spot
            .get(model)
            .ok_or_else(|| BillingError::NoPriceForModel {
                version: v.version,
                kind: "spot",
                model: model.to_string(),
            })?;
        let point = SpotPoint {
            model: model.to_string(),
            at,
            utilisation,
            per_gpu_second: spot_price(band, utilisation)?,
            price_version: v.version,
        };
        let series = self.points.entry(model.to_string()).or_default();
        if series.last().is_some_and(|p| p.at >= at) {
            return Err(BillingError::invalid(
                "at",
                "spot points of a model must be recorded in time order",
            ));
        }
        series.push(point.clone());
        Ok(point)
    }

    /// The point of `model` in force at `at`.
    pub fn in_force(&self, model: &str, at: DateTime<Utc>) -> Result<&SpotPoint> {
        self.points
            .get(model)
            .and_then(|s| s.iter().rev().find(|p| p.at <= at))
            .ok_or_else(|| BillingError::NoSpotPrice {
                model: model.to_string(),
                at,
            })
    }

    /// The latest point of `model`, if any.
    pub fn latest(&self, model: &str) -> Option<&SpotPoint> {
        self.points.get(model).and_then(|s| s.last())
    }

    /// Instants strictly inside `(from, to)` where `model`'s price changes.
    pub fn boundaries(
        &self,
        model: &str,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Vec<DateTime<Utc>> {
        self.points
            .get(model)
            .map(|s| {
                s.iter()
                    .map(|p| p.at)
                    .filter(|t| from < *t && *t < to)
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// How a reserved commitment is paid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Payment {
    /// The whole term on the invoice of the period where it starts.
    Upfront,
    /// Each period pays the committed GPU-seconds that fall in it.
    Monthly,
}

/// A reserved commitment: `gpus` whole GPUs of `model` for a term, at a
/// discount on the on-demand price locked when it was signed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Commitment {
    /// Operator-given id, e.g. `res-2025-acme-1`.
    pub id: String,
    /// The committed tenant.
    pub tenant: TenantId,
    /// GPU model.
    pub model: String,
    /// Whole GPUs committed.
    pub gpus: u32,
    /// Start of the term.
    pub start: DateTime<Utc>,
    /// End of the term.
    pub end: DateTime<Utc>,
    /// Upfront or monthly.
    pub payment: Payment,
    /// Discount off on-demand, as a fraction.
    pub discount: Decimal,
    /// The catalog version whose on-demand price was discounted.
    pub price_version: u32,
    /// Locked price of one committed GPU-second.
    pub per_gpu_second: Decimal,
}

impl Commitment {
    /// Signs a commitment: locks `on-demand × (1 - discount)` of the
    /// version in force at `start`.
    #[allow(
        clippy::too_many_arguments,
        reason = "a commitment has this many terms; a builder would only hide them"
    )]
    pub fn sign(
        id: &str,
        tenant: TenantId,
        model: &str,
        gpus: u32,
        start: DateTime<Utc>,
        term_days: u32,
        payment: Payment,
        discount: Decimal,
        book: &PriceBook,
    ) -> Result<Self> {
        if id.is_empty() {
            return Err(BillingError::invalid("id", "must not be empty"));
        }
        if gpus == 0 || gpus > crate::meter::MAX_UNITS {
            return Err(BillingError::invalid(
                "gpus",
                "must be between 1 and 1000000",
            ));
        }
        if term_days == 0 || term_days > 3660 {
            return Err(BillingError::invalid(
                "term_days",
                "must be between 1 and 3660",
            ));
        }
        check_fraction(discount, "discount")?;
        let v = book.in_force(start)?;
        let od = v.on_demand(model)?.per_gpu_second;
        let per_gpu_second = money::mul(
            od,
            money::sub(Decimal::ONE, discount, "discount")?,
            "reserved price",
        )?;
        Ok(Self {
            id: id.to_string(),
            tenant,
            model: model.to_string(),
            gpus,
            start,
            end: start + Duration::days(i64::from(term_days)),
            payment,
            discount,
            price_version: v.version,
            per_gpu_second,
        })
    }

    /// Committed GPU-time over the whole term, in unit-milliseconds.
    pub fn term_unit_ms(&self) -> i128 {
        i128::from(self.gpus)
            * crate::meter::SHARE_UNITS_PER_GPU
            * i128::from(millis(self.start, self.end))
    }
}

/// A constant rate (share units) over `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateInterval {
    /// Start.
    pub start: DateTime<Utc>,
    /// End.
    pub end: DateTime<Utc>,
    /// Share units (7000 per GPU) held throughout.
    pub units: i128,
}

/// One elementary segment of the reserved split: over `[start, end)` usage
/// and capacity are constant; GPU-time is in unit-milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitSegment {
    /// Start.
    pub start: DateTime<Utc>,
    /// End.
    pub end: DateTime<Utc>,
    /// Units in use.
    pub usage_units: i128,
    /// Units committed.
    pub capacity_units: i128,
    /// Usage covered by the commitment.
    pub reserved_unit_ms: i128,
    /// Usage above the commitment, billed on-demand.
    pub overage_unit_ms: i128,
    /// Commitment left idle, billed anyway.
    pub unused_unit_ms: i128,
}

/// Splits usage between reserved capacity and overage over `[from, to)`,
/// also cutting at `cuts` (price changes). At every instant usage fills the
/// commitment first: `reserved = min(usage, capacity)`, `overage = usage -
/// reserved`, `unused = capacity - reserved`. Each instant of usage thus
/// lands in exactly one of reserved or overage, never both, and each instant
/// of capacity in exactly one of reserved or unused. Integer arithmetic
/// keeps the identities exact.
pub fn split_reserved(
    usage: &[RateInterval],
    capacity: &[RateInterval],
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    cuts: &[DateTime<Utc>],
) -> Vec<SplitSegment> {
    let mut deltas: BTreeMap<DateTime<Utc>, (i128, i128)> = BTreeMap::new();
    deltas.insert(from, (0, 0));
    deltas.insert(to, (0, 0));
    for c in cuts.iter().filter(|c| from < **c && **c < to) {
        deltas.entry(*c).or_insert((0, 0));
    }
    for (list, is_cap) in [(usage, false), (capacity, true)] {
        for r in list {
            let a = r.start.max(from);
            let b = r.end.min(to);
            if a >= b || r.units == 0 {
                continue;
            }
            for (t, d) in [(a, r.units), (b, -r.units)] {
                let e = deltas.entry(t).or_insert((0, 0));
                if is_cap {
                    e.1 += d;
                } else {
                    e.0 += d;
                }
            }
        }
    }
    let points: Vec<(DateTime<Utc>, (i128, i128))> = deltas.into_iter().collect();
    let (mut u, mut c) = (0i128, 0i128);
    let mut out = Vec::new();
    for w in points.windows(2) {
        let (t0, (du, dc)) = w[0];
        let t1 = w[1].0;
        u += du;
        c += dc;
        if u == 0 && c == 0 {
            continue;
        }
        let ms = i128::from(millis(t0, t1));
        let reserved = u.min(c);
        out.push(SplitSegment {
            start: t0,
            end: t1,
            usage_units: u,
            capacity_units: c,
            reserved_unit_ms: reserved * ms,
            overage_unit_ms: (u - reserved) * ms,
            unused_unit_ms: (c - reserved) * ms,
        });
    }
    out
}

/// What a discount applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DiscountScope {
    /// Every usage line.
    All,
    /// On-demand and overage lines.
    OnDemand,
    /// Reserved lines.
    Reserved,
    /// Spot lines.
    Spot,
    /// Serverless lines.
    Serverless,
}

/// A per-tenant discount, a percentage off the lines in its scope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Discount {
    /// Operator-given id.
    pub id: String,
    /// The tenant.
    pub tenant: TenantId,
    /// Percent off, 0 < percent <= 100.
    pub percent: Decimal,
    /// Lines it applies to.
    pub scope: DiscountScope,
    /// Applies to periods starting at or after this.
    pub from: DateTime<Utc>,
    /// Applies to periods starting before this; `None`: no end.
    pub until: Option<DateTime<Utc>>,
}

impl Discount {
    /// Whether it applies to the period starting at `period_start`.
    pub fn applies(&self, period_start: DateTime<Utc>) -> bool {
        self.from <= period_start && self.until.is_none_or(|u| period_start < u)
    }

    /// Checks the percentage.
    pub fn validate(&self) -> Result<()> {
        if self.percent <= Decimal::ZERO || self.percent > Decimal::ONE_HUNDRED {
            return Err(BillingError::invalid(
                "percent",
                "must be above 0 and at most 100",
            ));
        }
        Ok(())
    }
}

/// Where a credit came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CreditKind {
    /// Granted by the operator (promotion, apology, trial).
    Promotional,
    /// Paid in advance by the tenant.
    Prepaid,
}

/// A credit or prepaid balance that invoices draw down.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreditGrant {
    /// Operator-given id.
    pub id: String,
    /// The tenant.
    pub tenant: TenantId,
    /// Promotional or prepaid.
    pub kind: CreditKind,
    /// Amount granted, in the catalog currency.
    pub amount: Decimal,
    /// When it was granted; usable by periods ending after it.
    pub granted_at: DateTime<Utc>,
    /// Usable by periods starting before it; `None`: never expires.
    pub expires_at: Option<DateTime<Utc>>,
}

impl CreditGrant {
    /// Whether an invoice for `[start, end)` may draw on it.
    pub fn usable(&self, start: DateTime<Utc>, end: DateTime<Utc>) -> bool {
        self.granted_at < end && self.expires_at.is_none_or(|e| start < e)
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_list_price_book_prices_every_catalog_model() {
        let c = Catalog::default();
        let book = list_price_book(&c).unwrap();
        let v = book.latest();
        assert_eq!(v.on_demand.len(), c.models().len());
        for m in c.models() {
            let od = v.on_demand(&m.name).unwrap().per_gpu_second;
            let back = od * Decimal::from(3600);
            assert!((back - m.list_price_per_hour).abs() < Decimal::new(1, 20));
            assert_eq!(v.spot[&m.name].floor, od * Decimal::new(3, 1));
            assert_eq!(v.serverless_gpu_second(&m.name).unwrap(), od);
        }
    }

    use super::*;
    use std::str::FromStr;

    fn d(s: &str) -> Decimal {
        Decimal::from_str(s).unwrap()
    }

    #[test]
    fn graduated_and_volume_schedules() {
        let tiers = vec![
            Tier {
                up_to: Some(d("10")),
                unit_price: d("2"),
            },
            Tier {
                up_to: None,
                unit_price: d("1"),
            },
        ];
        let g = Schedule::Graduated {
            tiers: tiers.clone(),
        };
        g.validate("s").unwrap();
        let p = g.price(d("8"), d("5"), d("13")).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].quantity, p[0].unit_price), (d("2"), d("2")));
        assert_eq!((p[1].quantity, p[1].unit_price), (d("3"), d("1")));
        let v = Schedule::Volume { tiers };
        let p = v.price(d("0"), d("13"), d("13")).unwrap();
        assert_eq!(p[0].unit_price, d("1"));
        let bad = Schedule::Graduated {
            tiers: vec![Tier {
                up_to: Some(d("1")),
                unit_price: d("1"),
            }],
        };
        assert!(
            matches!(bad.validate("s"), Err(BillingError::Invalid { field, .. }) if field == "s.tiers[0].up_to")
        );
    }

    #[test]
    fn split_never_counts_twice() {
        let t = |s| DateTime::from_timestamp(s, 0).unwrap();
        let usage = [RateInterval {
            start: t(0),
            end: t(100),
            units: 3 * 7000,
        }];
        let cap = [RateInterval {
            start: t(50),
            end: t(200),
            units: 2 * 7000,
        }];
        let segs = split_reserved(&usage, &cap, t(0), t(300), &[]);
        let r: i128 = segs.iter().map(|s| s.reserved_unit_ms).sum();
        let o: i128 = segs.iter().map(|s| s.overage_unit_ms).sum();
        let un: i128 = segs.iter().map(|s| s.unused_unit_ms).sum();
        assert_eq!(r, 2 * 7000 * 50_000);
        assert_eq!(o, 3 * 7000 * 50_000 + 7000 * 50_000);
        assert_eq!(un, 2 * 7000 * 100_000);
    }
}
