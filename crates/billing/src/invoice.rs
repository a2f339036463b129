//! Invoices: rating a tenant's usage for a period into line items, then
//! discounts and credits, `draft -> finalised`.
//!
//! Determinism is a design rule, not a test accident: events are collapsed
//! and sorted by key before any arithmetic ([`effective_events`]), GPU time
//! is summed as exact integers, lines are sorted by a total order, and the
//! only rounding happens once per line ([`Currency::round`]). So the same
//! events in any order and with any duplicates serialise to the same bytes.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Duration, Utc};
use flotilla_core::id::{InvoiceId, TenantId};
use flotilla_core::instance::BillingClass;
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

use crate::error::BillingError;
use crate::meter::{
    effective_events, GpuShare, Meter, SubjectKind, UsageEvent, UNIT_MS_PER_GPU_SECOND,
};
use crate::money::{self, Currency, Period};
use crate::price::{
    split_reserved, Commitment, CreditGrant, Discount, DiscountScope, Payment, PriceBook,
    RateInterval, SpotSeries,
};
use crate::Result;

/// What a line charges for. The declaration order is the order of lines on
/// an invoice: usage first, then discounts, then credits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LineKind {
    /// GPU time at the on-demand price (no commitment in force).
    OnDemand,
    /// Top-up to an on-demand subject's minimum billed seconds.
    Minimum,
    /// GPU time covered by a reserved commitment.
    ReservedUsed,
    /// Committed GPU time not used, billed anyway.
    ReservedUnused,
    /// A whole upfront-paid term, on the period where it starts.
    ReservedUpfront,
    /// GPU time above the committed capacity, at the on-demand price.
    Overage,
    /// Spot GPU time at the spot price in force.
    Spot,
    /// Serverless endpoint GPU time.
    ServerlessGpu,
    /// Serverless requests.
    ServerlessRequests,
    /// Serverless input tokens, in millions.
    ServerlessInputTokens,
    /// Serverless output tokens, in millions.
    ServerlessOutputTokens,
    /// Instance time.
    InstanceTime,
    /// Storage GB-seconds.
    Storage,
    /// Host memory of parked replicas, GB-seconds (priced per GB-hour in
    /// the catalog).
    ParkedMemory,
    /// A percentage discount (negative).
    Discount,
    /// Credit or prepaid balance drawn (negative).
    Credit,
}

impl LineKind {
    fn in_scope(self, scope: DiscountScope) -> bool {
        use LineKind::*;
        match scope {
            DiscountScope::All => !matches!(self, Discount | Credit),
            DiscountScope::OnDemand => matches!(self, OnDemand | Minimum | Overage),
            DiscountScope::Reserved => {
                matches!(self, ReservedUsed | ReservedUnused | ReservedUpfront)
            }
            DiscountScope::Spot => matches!(self, Spot),
            DiscountScope::Serverless => matches!(
                self,
                ServerlessGpu | ServerlessRequests | ServerlessInputTokens | ServerlessOutputTokens
            ),
        }
    }

    fn label(self) -> &'static str {
        use LineKind::*;
        match self {
            OnDemand => "on-demand",
            Minimum => "on-demand minimum top-up",
            ReservedUsed => "reserved, used",
            ReservedUnused => "reserved, unused",
            ReservedUpfront => "reserved, upfront term",
            Overage => "overage at on-demand",
            Spot => "spot",
            ServerlessGpu => "serverless GPU time",
            ServerlessRequests => "serverless requests",
            ServerlessInputTokens => "serverless input tokens",
            ServerlessOutputTokens => "serverless output tokens",
            InstanceTime => "instance time",
            Storage => "storage",
            ParkedMemory => "parked replica memory",
            Discount => "discount",
            Credit => "credit",
        }
    }
}

/// One line: `amount = round(quantity × unit_price)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InvoiceLine {
    /// What it charges for.
    pub kind: LineKind,
    /// Human-readable, derived from the other fields.
    pub description: String,
    /// GPU model, for GPU lines.
    pub model: Option<String>,
    /// The share of a GPU or the MIG profile the line bills (`0.5 × H100`,
    /// `H100 1g.10gb`); absent for whole GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<String>,
    /// Units charged (exact, never rounded).
    pub quantity: Decimal,
    /// `gpu_second`, `request`, `million_input_tokens`, the currency code
    /// (discounts), …
    pub unit: String,
    /// Price of one unit (exact).
    pub unit_price: Decimal,
    /// Rounded half-even to the currency's minor units.
    pub amount: Decimal,
    /// The catalog version that priced it.
    pub price_version: Option<u32>,
    /// For spot lines: the spot point in force.
    pub price_point_at: Option<DateTime<Utc>>,
    /// Commitment, discount or credit id.
    pub reference: Option<String>,
    /// Schedule tier index, for tiered serverless lines.
    pub tier: Option<usize>,
}

/// Where an invoice is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum InvoiceStatus {
    /// May still be recomputed from the ledger.
    Draft,
    /// Immutable; corrections go on a later invoice.
    Finalised {
        /// When it was finalised.
        at: DateTime<Utc>,
    },
}

/// A tenant's invoice for one period. Fields are private so that nothing
/// but [`build_invoice`] makes one and nothing but [`Invoice::finalise`]
/// changes one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Invoice {
    id: InvoiceId,
    tenant: TenantId,
    period: Period,
    currency: Currency,
    status: InvoiceStatus,
    lines: Vec<InvoiceLine>,
    subtotal: Decimal,
    total: Decimal,
}

impl Invoice {
    /// Its id.
    pub fn id(&self) -> &InvoiceId {
        &self.id
    }
    /// The tenant billed.
    pub fn tenant(&self) -> &TenantId {
        &self.tenant
    }
    /// The period billed.
    pub fn period(&self) -> Period {
        self.period
    }
    /// Its currency.
    pub fn currency(&self) -> &Currency {
        &self.currency
    }
    /// Draft or finalised.
    pub fn status(&self) -> InvoiceStatus {
        self.status
    }
    /// The lines, in invoice order.
    pub fn lines(&self) -> &[InvoiceLine] {
        &self.lines
    }
    /// Sum of usage lines, before discounts and credits.
    pub fn subtotal(&self) -> Decimal {
        self.subtotal
    }
    /// Sum of every line: what is owed.
    pub fn total(&self) -> Decimal {
        self.total
    }

    /// The serialised form, the bytes that determinism is about.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string(self).map_err(|e| BillingError::invalid("invoice", e.to_string()))
    }

    /// Finalises a draft. Refused while late events may still arrive
    /// (`now < period end + grace`), and for an invoice already final.
    pub fn finalise(mut self, now: DateTime<Utc>, grace: Duration) -> Result<Self> {
        if let InvoiceStatus::Finalised { .. } = self.status {
            return Err(BillingError::InvoiceFinalised {
                id: self.id.to_string(),
            });
        }
        let open_until = self.period.end + grace;
        if now < open_until {
            return Err(BillingError::GraceWindowOpen {
                id: self.id.to_string(),
                period_end: self.period.end,
                open_until,
            });
        }
        self.status = InvoiceStatus::Finalised { at: now };
        Ok(self)
    }
}

/// Everything an invoice is computed from.
#[derive(Debug, Clone, Copy)]
pub struct InvoiceInput<'a> {
    /// The invoice id to give it (ids are the caller's: this crate has no
    /// randomness and no clock).
    pub id: &'a InvoiceId,
    /// The tenant.
    pub tenant: &'a TenantId,
    /// The period.
    pub period: Period,
    /// Usage events; other tenants' events are ignored, duplicates
    /// collapsed and corrections applied.
    pub events: &'a [UsageEvent],
    /// The price catalog.
    pub book: &'a PriceBook,
    /// The spot price series.
    pub spot: &'a SpotSeries,
    /// Reserved commitments (other tenants' are ignored).
    pub commitments: &'a [Commitment],
    /// Discounts (other tenants' are ignored).
    pub discounts: &'a [Discount],
    /// Credit grants (other tenants' are ignored).
    pub credits: &'a [CreditGrant],
    /// How much of each grant earlier invoices used, by grant id.
    pub credit_used_before: &'a BTreeMap<String, Decimal>,
}

/// A draft invoice and what it drew from each credit grant (for the store
/// to record when the invoice is finalised).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Draft {
    /// The draft invoice.
    pub invoice: Invoice,
    /// Amount drawn per credit grant id.
    pub credits_applied: BTreeMap<String, Decimal>,
}

/// GPU time of one line, before pricing.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct LineKey {
    kind: LineKind,
    model: Option<String>,
    /// The GPU share or MIG profile the line is for (`0.5 × H100`,
    /// `H100 1g.10gb`); `None` for whole GPUs.
    share: Option<String>,
    price_version: Option<u32>,
    price_point_at: Option<DateTime<Utc>>,
    reference: Option<String>,
    tier: Option<usize>,
    unit_price: Decimal,
    unit: &'static str,
}

/// Accumulates quantities per line key: GPU lines in exact unit-ms, other
/// lines in decimal units.
#[derive(Default)]
struct Lines {
    gpu: BTreeMap<LineKey, i128>,
    other: BTreeMap<LineKey, Decimal>,
}

impl Lines {
    fn gpu(&mut self, key: LineKey, unit_ms: i128) {
        if unit_ms != 0 {
            *self.gpu.entry(key).or_insert(0) += unit_ms;
        }
    }

    fn other(&mut self, key: LineKey, qty: Decimal) -> Result<()> {
        if !qty.is_zero() {
            let e = self.other.entry(key).or_insert(Decimal::ZERO);
            *e = money::add(*e, qty, "line quantity")?;
        }
        Ok(())
    }
}

fn gpu_key(kind: LineKind, model: &str, version: u32, unit_price: Decimal) -> LineKey {
    LineKey {
        kind,
        model: Some(model.to_string()),
        share: None,
        price_version: Some(version),
        price_point_at: None,
        reference: None,
        tier: None,
        unit_price,
        unit: "gpu_second",
    }
}

/// A priced piece of one GPU event at list price (no commitments): what
/// spot and serverless lines are made of, and what providers are paid on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GpuPiece {
    pub kind: LineKind,
    pub model: String,
    pub unit_ms: i128,
    pub unit_price: Decimal,
    pub version: u32,
    pub point_at: Option<DateTime<Utc>>,
}

/// `[a, b)` cut at every instant of `cuts` inside it.
fn cut(
    a: DateTime<Utc>,
    b: DateTime<Utc>,
    cuts: &[DateTime<Utc>],
) -> Vec<(DateTime<Utc>, DateTime<Utc>)> {
    let mut pts: BTreeSet<DateTime<Utc>> =
        cuts.iter().copied().filter(|t| a < *t && *t < b).collect();
    pts.insert(a);
    pts.insert(b);
    let v: Vec<_> = pts.into_iter().collect();
    v.windows(2).map(|w| (w[0], w[1])).collect()
}

/// Prices a GPU event inside `[from, to)` at list price: spot class at the
/// spot point in force, endpoints at the serverless GPU-second price, the
/// rest at on-demand.
pub(crate) fn list_gpu_pieces(
    e: &UsageEvent,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    book: &PriceBook,
    spot: &SpotSeries,
) -> Result<Vec<GpuPiece>> {
    let (Meter::GpuSeconds { model, .. }, Some(units)) = (&e.meter, e.gpu_units()?) else {
        return Ok(Vec::new());
    };
    let a = e.start.max(from);
    let b = e.end.min(to);
    if a >= b {
        return Ok(Vec::new());
    }
    let is_spot = e.subject.kind != SubjectKind::Endpoint && e.billing_class == BillingClass::Spot;
    let cuts = if is_spot {
        spot.boundaries(model, a, b)
    } else {
        book.boundaries(a, b)
    };
    let mut out = Vec::new();
    for (p0, p1) in cut(a, b, &cuts) {
        let unit_ms = units * i128::from(money::millis(p0, p1));
        let piece = if is_spot {
            let pt = spot.in_force(model, p0)?;
            GpuPiece {
                kind: LineKind::Spot,
                model: model.clone(),
                unit_ms,
                unit_price: pt.per_gpu_second,
                version: pt.price_version,
                point_at: Some(pt.at),
            }
        } else {
            let v = book.in_force(p0)?;
            let (kind, unit_price) = if e.subject.kind == SubjectKind::Endpoint {
                (LineKind::ServerlessGpu, v.serverless_gpu_second(model)?)
            } else {
                (LineKind::OnDemand, v.on_demand(model)?.per_gpu_second)
            };
            GpuPiece {
                kind,
                model: model.clone(),
                unit_ms,
                unit_price,
                version: v.version,
                point_at: None,
            }
        };
        out.push(piece);
    }
    Ok(out)
}

/// Builds the draft invoice of `input.tenant` for `input.period`.
///
/// Rating rules, in order:
/// 1. Instance and job GPU time of class on-demand or reserved, per model,
///    fills the tenant's commitments of that model first (commitments in
///    order of start, then id) and the rest is overage at on-demand; with
///    no commitment in force it is plain on-demand. Unused commitment is
///    billed. Monthly commitments bill used and unused time at the locked
///    price; upfront ones bill the whole term once, on the period holding
///    its start, and show used/unused at price zero.
/// 2. On-demand-class subjects below the model's minimum seconds in the
///    period get a top-up line.
/// 3. Spot GPU time at the spot point in force at each instant.
/// 4. Endpoint GPU time at the serverless GPU-second price; requests and
///    tokens by the schedule of the version in force at each event's end,
///    tiers running over the whole period.
/// 5. Instance time (when priced) and storage at the version in force.
/// 6. Each line rounded half-even; discounts (each on its own scope's
///    usage, never below zero in total); then credits, soonest-expiring
///    first, never below zero.
pub fn build_invoice(input: InvoiceInput<'_>) -> Result<Draft> {
    let InvoiceInput {
        id,
        tenant,
        period,
        book,
        spot,
        ..
    } = input;
    let (from, to) = (period.start, period.end);
    let currency = book.currency().clone();
    let events = effective_events(input.events.iter().filter(|e| &e.key.tenant == tenant))?;
    let mut lines = Lines::default();

    // 1. Reserved split, per model. Shares of a model without commitments
    // get lines of their own, named by the share; a model under commitment
    // pools every share, as the commitment covers GPU time of any share.
    let mut commitments: Vec<&Commitment> = input
        .commitments
        .iter()
        .filter(|c| &c.tenant == tenant && c.start < to && c.end > from)
        .collect();
    commitments.sort_by(|a, b| (a.start, &a.id).cmp(&(b.start, &b.id)));
    let committed: BTreeSet<&str> = commitments.iter().map(|c| c.model.as_str()).collect();
    let mut pooled: BTreeMap<(String, Option<String>), Vec<RateInterval>> = BTreeMap::new();
    let mut minimum: BTreeMap<(String, String), (i128, DateTime<Utc>)> = BTreeMap::new();
    for e in &events {
        let Meter::GpuSeconds { model, share } = &e.meter else {
            continue;
        };
        if e.subject.kind == SubjectKind::Endpoint || e.billing_class == BillingClass::Spot {
            for p in list_gpu_pieces(e, from, to, book, spot)? {
                let mut k = gpu_key(p.kind, &p.model, p.version, p.unit_price);
                k.price_point_at = p.point_at;
                lines.gpu(k, p.unit_ms);
            }
            continue;
        }
        let units = e.gpu_units()?.unwrap_or(0);
        let label = if committed.contains(model.as_str()) {
            None
        } else {
            share_label(model, share)
        };
        pooled
            .entry((model.clone(), label))
            .or_default()
            .push(RateInterval {
                start: e.start,
                end: e.end,
                units,
            });
        let within = e.gpu_unit_ms_within(from, to)?;
        if e.billing_class == BillingClass::OnDemand && within > 0 {
            let m = minimum
                .entry((model.clone(), e.subject.id.clone()))
                .or_insert((0, e.start.max(from)));
            m.0 += within;
            m.1 = m.1.min(e.start.max(from));
        }
    }
    let mut models: BTreeSet<(String, Option<String>)> = pooled.keys().cloned().collect();
    models.extend(commitments.iter().map(|c| (c.model.clone(), None)));
    for key in models {
        let usage = pooled.get(&key).map(Vec::as_slice).unwrap_or(&[]);
        let (model, share) = key;
        // Labelled shares exist only for models without commitments.
        let mine: Vec<&Commitment> = commitments
            .iter()
            .copied()
            .filter(|c| c.model == model && share.is_none())
            .collect();
        let capacity: Vec<RateInterval> = mine
            .iter()
            .map(|c| RateInterval {
                start: c.start,
                end: c.end,
                units: i128::from(c.gpus) * crate::meter::SHARE_UNITS_PER_GPU,
            })
            .collect();
        let cuts = book.boundaries(from, to);
        for seg in split_reserved(usage, &capacity, from, to, &cuts) {
            let v = book.in_force(seg.start)?;
            let ms = i128::from(money::millis(seg.start, seg.end));
            if seg.overage_unit_ms > 0 {
                let kind = if seg.capacity_units > 0 {
                    LineKind::Overage
                } else {
                    LineKind::OnDemand
                };
                let price = v.on_demand(&model)?.per_gpu_second;
                let mut k = gpu_key(kind, &model, v.version, price);
                k.share = share.clone();
                lines.gpu(k, seg.overage_unit_ms);
            }
            // Share the covered usage among the commitments active here.
            let mut left = seg.usage_units;
            for c in mine
                .iter()
                .filter(|c| c.start <= seg.start && seg.end <= c.end)
            {
                let cap = i128::from(c.gpus) * crate::meter::SHARE_UNITS_PER_GPU;
                let used = left.min(cap);
                left -= used;
                let price = match c.payment {
                    Payment::Monthly => c.per_gpu_second,
                    Payment::Upfront => Decimal::ZERO,
                };
                for (kind, u) in [
                    (LineKind::ReservedUsed, used),
                    (LineKind::ReservedUnused, cap - used),
                ] {
                    let mut k = gpu_key(kind, &model, c.price_version, price);
                    k.reference = Some(c.id.clone());
                    lines.gpu(k, u * ms);
                }
            }
        }
        for c in &mine {
            if c.payment == Payment::Upfront && period.contains(c.start) {
                let mut k = gpu_key(
                    LineKind::ReservedUpfront,
                    &model,
                    c.price_version,
                    c.per_gpu_second,
                );
                k.reference = Some(c.id.clone());
                lines.gpu(k, c.term_unit_ms());
            }
        }
    }

    // 2. Minimum top-ups.
    for ((model, _subject), (unit_ms, first)) in &minimum {
        let v = book.in_force(*first)?;
        let p = v.on_demand(model)?;
        let min = i128::from(p.minimum_seconds) * UNIT_MS_PER_GPU_SECOND;
        if *unit_ms < min {
            lines.gpu(
                gpu_key(LineKind::Minimum, model, v.version, p.per_gpu_second),
                min - unit_ms,
            );
        }
    }

    // 4-5. Counted serverless usage, instance time, storage.
    let million = Decimal::from(1_000_000);
    let mut counted: BTreeMap<(LineKind, u32), Decimal> = BTreeMap::new();
    for e in &events {
        let (kind, per_million) = match e.meter {
            Meter::Requests => (LineKind::ServerlessRequests, false),
            Meter::InputTokens => (LineKind::ServerlessInputTokens, true),
            Meter::OutputTokens => (LineKind::ServerlessOutputTokens, true),
            Meter::InstanceSeconds | Meter::StorageGbSeconds | Meter::ParkedGbSeconds => {
                let a = e.start.max(from);
                let b = e.end.min(to);
                for (p0, p1) in if a < b {
                    cut(a, b, &book.boundaries(a, b))
                } else {
                    Vec::new()
                } {
                    let v = book.in_force(p0)?;
                    let (kind, price, unit) = match e.meter {
                        Meter::InstanceSeconds => (
                            LineKind::InstanceTime,
                            v.per_instance_second,
                            "instance_second",
                        ),
                        Meter::ParkedGbSeconds => (
                            LineKind::ParkedMemory,
                            v.parked_per_gb_second(),
                            "gb_second",
                        ),
                        _ => (LineKind::Storage, v.per_storage_gb_second, "gb_second"),
                    };
                    // Free instance time and free parking (the operator set
                    // the price to zero) add no line.
                    if matches!(kind, LineKind::InstanceTime | LineKind::ParkedMemory)
                        && price.is_zero()
                    {
                        continue;
                    }
                    let key = LineKey {
                        unit,
                        ..gpu_key(kind, "", v.version, price)
                    };
                    let key = LineKey { model: None, ..key };
                    lines.other(key, e.quantity_within(p0, p1)?)?;
                }
                continue;
            }
            Meter::GpuSeconds { .. } => continue,
        };
        if !period.contains(e.end) {
            continue;
        }
        let v = book.in_force(e.end)?;
        let q = if per_million {
            money::div(e.amount, million, "tokens")?
        } else {
            e.amount
        };
        let slot = counted.entry((kind, v.version)).or_insert(Decimal::ZERO);
        *slot = money::add(*slot, q, "serverless quantity")?;
    }
    for kind in [
        LineKind::ServerlessRequests,
        LineKind::ServerlessInputTokens,
        LineKind::ServerlessOutputTokens,
    ] {
        let per_version: Vec<(u32, Decimal)> = counted
            .iter()
            .filter(|((k, _), _)| *k == kind)
            .map(|((_, v), q)| (*v, *q))
            .collect();
        let total = money::sum(per_version.iter().map(|(_, q)| *q), "serverless quantity")?;
        let mut already = Decimal::ZERO;
        for (version, q) in per_version {
            let v = book
                .version(version)
                .ok_or_else(|| BillingError::invalid("price_version", "unknown"))?;
            let (schedule, unit) = match kind {
                LineKind::ServerlessRequests => (&v.serverless.per_request, "request"),
                LineKind::ServerlessInputTokens => (
                    &v.serverless.per_million_input_tokens,
                    "million_input_tokens",
                ),
                _ => (
                    &v.serverless.per_million_output_tokens,
                    "million_output_tokens",
                ),
            };
            for piece in schedule.price(already, q, total)? {
                let key = LineKey {
                    kind,
                    model: None,
                    share: None,
                    price_version: Some(version),
                    price_point_at: None,
                    reference: None,
                    tier: piece.tier,
                    unit_price: piece.unit_price,
                    unit,
                };
                lines.other(key, piece.quantity)?;
            }
            already = money::add(already, q, "serverless quantity")?;
        }
    }

    // 6. Price and round every usage line.
    let mut out: Vec<InvoiceLine> = Vec::new();
    let gpu_second = money::dec_i128(UNIT_MS_PER_GPU_SECOND, "gpu seconds")?;
    for (k, unit_ms) in lines.gpu {
        let raw = money::dec_i128(unit_ms, "gpu seconds")?;
        let quantity = money::div(raw, gpu_second, "gpu seconds")?;
        // Multiply before dividing so a MIG third of a second is not
        // rounded twice.
        let amount = money::div(
            money::mul(raw, k.unit_price, "amount")?,
            gpu_second,
            "amount",
        )?;
        out.push(make_line(&k, quantity, currency.round(amount)));
    }
    for (k, quantity) in lines.other {
        let amount = money::mul(quantity, k.unit_price, "amount")?;
        out.push(make_line(&k, quantity, currency.round(amount)));
    }
    let subtotal = money::sum(out.iter().map(|l| l.amount), "subtotal")?;

    // Discounts, each on its own scope, never taking the total below zero.
    let mut discounts: Vec<&Discount> = input
        .discounts
        .iter()
        .filter(|d| &d.tenant == tenant && d.applies(from))
        .collect();
    discounts.sort_by(|a, b| a.id.cmp(&b.id));
    let mut running = subtotal;
    let mut extra = Vec::new();
    for d in discounts {
        d.validate()?;
        let base = money::sum(
            out.iter()
                .filter(|l| l.kind.in_scope(d.scope))
                .map(|l| l.amount),
            "discount base",
        )?;
        let unit_price = -money::div(d.percent, Decimal::ONE_HUNDRED, "discount")?;
        let amount = currency
            .round(money::mul(base, unit_price, "discount")?)
            .max(-running);
        let amount = currency.round(amount);
        if amount.is_zero() {
            continue;
        }
        running = money::add(running, amount, "total")?;
        extra.push(InvoiceLine {
            kind: LineKind::Discount,
            description: format!(
                "discount {}: {}% off {:?} usage",
                d.id,
                money::tidy(d.percent),
                d.scope
            )
            .to_lowercase(),
            model: None,
            share: None,
            quantity: base,
            unit: currency.code.clone(),
            unit_price: money::tidy(unit_price),
            amount,
            price_version: None,
            price_point_at: None,
            reference: Some(d.id.clone()),
            tier: None,
        });
    }

    // Credits: soonest expiry first (never-expiring last), then oldest.
    let mut grants: Vec<&CreditGrant> = input
        .credits
        .iter()
        .filter(|g| &g.tenant == tenant && g.usable(from, to))
        .collect();
    grants.sort_by(|a, b| {
        (a.expires_at.is_none(), a.expires_at, a.granted_at, &a.id).cmp(&(
            b.expires_at.is_none(),
            b.expires_at,
            b.granted_at,
            &b.id,
        ))
    });
    let mut credits_applied = BTreeMap::new();
    for g in grants {
        if g.amount.is_sign_negative() || currency.round(g.amount) != g.amount {
            return Err(BillingError::invalid(
                format!("credits.{}.amount", g.id),
                format!(
                    "must be positive with at most {} decimals",
                    currency.minor_units
                ),
            ));
        }
        if running <= Decimal::ZERO {
            break;
        }
        let used = input
            .credit_used_before
            .get(&g.id)
            .copied()
            .unwrap_or_default();
        let balance = money::sub(g.amount, used, "credit balance")?;
        let take = currency.round(balance.min(running));
        if take <= Decimal::ZERO {
            continue;
        }
        running = money::sub(running, take, "total")?;
        credits_applied.insert(g.id.clone(), take);
        extra.push(InvoiceLine {
            kind: LineKind::Credit,
            description: format!("{:?} credit {} (balance before {})", g.kind, g.id, balance)
                .to_lowercase(),
            model: None,
            share: None,
            quantity: Decimal::ONE,
            unit: "credit".into(),
            unit_price: -take,
            amount: -take,
            price_version: None,
            price_point_at: None,
            reference: Some(g.id.clone()),
            tier: None,
        });
    }
    out.extend(extra);
    let total = money::sum(out.iter().map(|l| l.amount), "total")?;
    debug_assert_eq!(total, running, "total is the sum of the lines");
    Ok(Draft {
        invoice: Invoice {
            id: id.clone(),
            tenant: tenant.clone(),
            period,
            currency: currency.clone(),
            status: InvoiceStatus::Draft,
            lines: out,
            subtotal,
            total: currency.round(total),
        },
        credits_applied,
    })
}

/// How an invoice line names a share of `model`: `0.5 × H100`,
/// `H100 1g.10gb`; `None` for whole GPUs.
fn share_label(model: &str, share: &GpuShare) -> Option<String> {
    (*share != GpuShare::Whole).then(|| share.label(model))
}

fn make_line(k: &LineKey, quantity: Decimal, amount: Decimal) -> InvoiceLine {
    let mut description = match (&k.share, &k.model) {
        (Some(s), _) => format!("{s} {}", k.kind.label()),
        (None, Some(m)) => format!("{m} {}", k.kind.label()),
        (None, None) => k.kind.label().to_string(),
    };
    if let Some(r) = &k.reference {
        description.push_str(&format!(" ({r})"));
    }
    if let Some(t) = k.tier {
        description.push_str(&format!(", tier {}", t + 1));
    }
    if let Some(at) = k.price_point_at {
        description.push_str(&format!(
            ", spot price of {}",
            at.format("%Y-%m-%dT%H:%M:%SZ")
        ));
    }
    if let Some(v) = k.price_version {
        description.push_str(&format!(", price v{v}"));
    }
    InvoiceLine {
        kind: k.kind,
        description,
        model: k.model.clone(),
        share: k.share.clone(),
        quantity: money::tidy(quantity),
        unit: k.unit.to_string(),
        unit_price: money::tidy(k.unit_price),
        amount,
        price_version: k.price_version,
        price_point_at: k.price_point_at,
        reference: k.reference.clone(),
        tier: k.tier,
    }
}

/// Where invoices are kept. A draft may be replaced by a recomputed draft;
/// a finalised invoice never changes.
pub trait InvoiceBook {
    /// Stores or replaces a draft; refused if a finalised invoice has the id.
    fn put_draft(&mut self, invoice: Invoice) -> Result<()>;
    /// Finalises the stored draft `id` (see [`Invoice::finalise`]).
    fn finalise(&mut self, id: &InvoiceId, now: DateTime<Utc>, grace: Duration) -> Result<Invoice>;
    /// The invoice `id`.
    fn get(&self, id: &InvoiceId) -> Option<Invoice>;
}

/// Invoices in memory.
#[derive(Debug, Clone, Default)]
pub struct MemoryInvoiceBook {
    invoices: BTreeMap<InvoiceId, Invoice>,
}

impl InvoiceBook for MemoryInvoiceBook {
    fn put_draft(&mut self, invoice: Invoice) -> Result<()> {
        if let Some(old) = self.invoices.get(&invoice.id) {
            if matches!(old.status, InvoiceStatus::Finalised { .. }) {
                return Err(BillingError::InvoiceFinalised {
                    id: invoice.id.to_string(),
                });
            }
        }
        if matches!(invoice.status, InvoiceStatus::Finalised { .. }) {
            return Err(BillingError::invalid(
                "status",
                "only drafts can be stored with put_draft",
            ));
        }
        self.invoices.insert(invoice.id.clone(), invoice);
        Ok(())
    }

    fn finalise(&mut self, id: &InvoiceId, now: DateTime<Utc>, grace: Duration) -> Result<Invoice> {
        let inv = self
            .invoices
            .get(id)
            .cloned()
            .ok_or_else(|| BillingError::invalid("id", format!("no invoice {id}")))?;
        let fin = inv.finalise(now, grace)?;
        self.invoices.insert(id.clone(), fin.clone());
        Ok(fin)
    }

    fn get(&self, id: &InvoiceId) -> Option<Invoice> {
        self.invoices.get(id).cloned()
    }
}
