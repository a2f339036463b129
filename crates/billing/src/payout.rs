//! Marketplace payouts: a provider owns nodes; for each period it is paid
//! for the usage its GPUs carried, less the operator's fee.
//!
//! Providers are paid on the *list value* of that usage: on-demand and
//! reserved instance time at the on-demand price in force, spot time at the
//! spot price in force, endpoint time at the serverless GPU-second price.
//! Tenant discounts, credits, reserved discounts and unused commitments are
//! the operator's commercial choices, so they neither raise nor lower what a
//! provider earns, and a provider's statement does not depend on who rented
//! its GPUs.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use flotilla_core::id::{NodeId, ProviderId};
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

use crate::error::BillingError;
use crate::invoice::{list_gpu_pieces, LineKind};
use crate::meter::{effective_events, UsageEvent, UNIT_MS_PER_GPU_SECOND};
use crate::money::{self, Currency, Period};
use crate::price::{PriceBook, SpotSeries};
use crate::Result;

/// Model, kind, price version, spot point and unit price of a line.
type PieceKey = (String, LineKind, u32, Option<DateTime<Utc>>, Decimal);

/// The operator's cut.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PayoutPolicy {
    /// Percent of gross revenue kept by the operator, 0..=100.
    pub operator_fee_percent: Decimal,
}

/// Revenue of one model, pricing kind and price.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PayoutLine {
    /// GPU model.
    pub model: String,
    /// `on_demand`, `spot` or `serverless_gpu`.
    pub kind: LineKind,
    /// Whole-GPU-seconds carried.
    pub gpu_seconds: Decimal,
    /// List price per GPU-second.
    pub unit_price: Decimal,
    /// `gpu_seconds × unit_price`, rounded half-even.
    pub gross: Decimal,
    /// Catalog version of the price.
    pub price_version: u32,
    /// Spot point, for spot lines.
    pub price_point_at: Option<DateTime<Utc>>,
}

/// A provider's statement for one period.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PayoutStatement {
    /// The provider.
    pub provider: ProviderId,
    /// The period.
    pub period: Period,
    /// Currency.
    pub currency: Currency,
    /// Revenue lines.
    pub lines: Vec<PayoutLine>,
    /// Sum of line gross amounts.
    pub gross: Decimal,
    /// Operator's fee, `round(gross × fee%)`.
    pub operator_fee: Decimal,
    /// What the provider is paid: `gross - operator_fee`.
    pub payout: Decimal,
}

/// Computes `provider`'s statement for `period` from every tenant's usage
/// events; `node_owners` maps nodes to providers (nodes not in it belong to
/// the operator).
pub fn payout_statement(
    provider: &ProviderId,
    period: Period,
    node_owners: &BTreeMap<NodeId, ProviderId>,
    events: &[UsageEvent],
    book: &PriceBook,
    spot: &SpotSeries,
    policy: &PayoutPolicy,
) -> Result<PayoutStatement> {
    if policy.operator_fee_percent.is_sign_negative()
        || policy.operator_fee_percent > Decimal::ONE_HUNDRED
    {
        return Err(BillingError::invalid(
            "operator_fee_percent",
            "must be between 0 and 100",
        ));
    }
    let currency = book.currency().clone();
    let mine = events
        .iter()
        .filter(|e| e.node.as_ref().and_then(|n| node_owners.get(n)) == Some(provider));
    let mut acc: BTreeMap<PieceKey, i128> = BTreeMap::new();
    for e in effective_events(mine)? {
        for p in list_gpu_pieces(&e, period.start, period.end, book, spot)? {
            *acc.entry((p.model, p.kind, p.version, p.point_at, p.unit_price))
                .or_insert(0) += p.unit_ms;
        }
    }
    let per = money::dec_i128(UNIT_MS_PER_GPU_SECOND, "gpu seconds")?;
    let mut lines = Vec::new();
    for ((model, kind, version, point_at, unit_price), unit_ms) in acc {
        let raw = money::dec_i128(unit_ms, "gpu seconds")?;
        let gross = currency.round(money::div(
            money::mul(raw, unit_price, "gross")?,
            per,
            "gross",
        )?);
        lines.push(PayoutLine {
            model,
            kind,
            gpu_seconds: money::tidy(money::div(raw, per, "gpu seconds")?),
            unit_price: money::tidy(unit_price),
            gross,
            price_version: version,
            price_point_at: point_at,
        });
    }
    let gross = money::sum(lines.iter().map(|l| l.gross), "gross")?;
    let operator_fee = currency.round(money::div(
        money::mul(gross, policy.operator_fee_percent, "fee")?,
        Decimal::ONE_HUNDRED,
        "fee",
    )?);
    let payout = currency.round(money::sub(gross, operator_fee, "payout")?);
    Ok(PayoutStatement {
        provider: provider.clone(),
        period,
        currency: currency.clone(),
        lines,
        gross: currency.round(gross),
        operator_fee,
        payout,
    })
}
