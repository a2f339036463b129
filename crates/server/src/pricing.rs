//! Prices in the server: the stored, versioned catalog, the spot price
//! series recorded from pool utilisation, and rating a tenant's period
//! with both (plus its commitments, discounts and credits) into a draft or
//! a finalised invoice.
//!
//! The rules are flotilla-billing's; this module only reads what they need
//! from the store and writes back what they decided. The periodic step
//! ([`billing_pass`], one call from the reconcile loop) records spot
//! prices, checks budgets and delivers their webhooks, on its own task so
//! that a slow webhook receiver never delays placement.

use chrono::{DateTime, Duration, Utc};
use flotilla_billing::invoice::{build_invoice, Draft, Invoice, InvoiceInput};
use flotilla_billing::price::{PriceBook, PriceVersion, SpotSeries};
use flotilla_billing::{BillingError, Period};
use flotilla_core::catalog::Catalog;
use flotilla_core::id::{InvoiceId, TenantId};
use flotilla_store::{Store, StoreError};
use rust_decimal::Decimal;

use crate::error::ApiError;

/// Why a period could not be rated.
#[derive(Debug, thiserror::Error)]
pub enum RatingError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The billing rules refused (no price for a model, an invalid stored
    /// price, a final invoice, …).
    #[error(transparent)]
    Billing(#[from] BillingError),
    /// The webhook HTTP client could not be set up.
    #[error("webhook client: {0}")]
    Client(#[from] reqwest::Error),
}

impl From<RatingError> for ApiError {
    fn from(e: RatingError) -> Self {
        match e {
            RatingError::Store(s) => s.into(),
            // Usage the catalog has no price for: the operator must publish
            // one; the request itself is fine.
            RatingError::Billing(
                b @ (BillingError::NoPriceForModel { .. }
                | BillingError::NoPriceInForce { .. }
                | BillingError::NoSpotPrice { .. }
                | BillingError::InvoiceFinalised { .. }
                | BillingError::GraceWindowOpen { .. }),
            ) => ApiError::conflict(b.to_string()),
            RatingError::Billing(b) => ApiError::internal(b),
            RatingError::Client(c) => ApiError::internal(c),
        }
    }
}

/// The catalog used until an operator publishes one: version 1, in force
/// since the epoch, USD, on-demand and serverless GPU time at the GPU
/// catalog's list price per hour / 3600 (exact to 28 digits), no minimum,
/// spot bands from 30% (idle pool) to 90% (full pool) of on-demand;
/// requests, tokens, instance time and storage free. It is stored as
/// version 1 the first time prices are read, so later versions follow it.
pub fn default_price_book(catalog: &Catalog) -> Result<PriceBook, BillingError> {
    flotilla_billing::price::list_price_book(catalog)
}

/// The stored catalog, every version; the default one is stored first as
/// version 1 when none is (several servers doing it at once agree on one).
pub async fn price_book(
    store: &Store,
    catalog: &Catalog,
    now: DateTime<Utc>,
) -> Result<PriceBook, RatingError> {
    let mut versions = store.price_versions().await?;
    if versions.is_empty() {
        let first = default_price_book(catalog)?.latest().clone();
        store.seed_price_version(&first, now).await?;
        versions = store.price_versions().await?;
    }
    book_of(versions)
}

/// A book from stored versions. They were checked when published, so the
/// `now` given to `publish` is the earliest instant: the past-effect rule
/// held when each was published and must not refuse them now.
pub fn book_of(versions: Vec<PriceVersion>) -> Result<PriceBook, RatingError> {
    let mut it = versions.into_iter();
    let first = it.next().ok_or_else(|| {
        StoreError::Corrupt("no price version stored after seeding version 1".into())
    })?;
    let mut book = PriceBook::new(first)?;
    for v in it {
        book.publish(v, DateTime::<Utc>::MIN_UTC)?;
    }
    Ok(book)
}

/// The spot series in force before `until`: each model of version 1's spot
/// bands starts at its floor from the epoch (what spot costs before any
/// utilisation was recorded), followed by the recorded points. Points are
/// re-derived from their utilisation and the band in force, which versions
/// being immutable makes the recorded price; a mismatch means a hand-edited
/// row and is refused rather than billed.
pub async fn spot_series(
    store: &Store,
    book: &PriceBook,
    until: DateTime<Utc>,
) -> Result<SpotSeries, RatingError> {
    let mut series = SpotSeries::new();
    let epoch = DateTime::<Utc>::UNIX_EPOCH;
    let first = book.in_force(epoch)?;
    for model in first.spot.keys() {
        series.record(book, model, epoch, Decimal::ZERO)?;
    }
    for p in store.spot_points(until).await? {
        if p.at <= epoch {
            continue;
        }
        let derived = series.record(book, &p.model, p.at, p.utilisation)?;
        if derived.per_gpu_second != p.per_gpu_second {
            return Err(StoreError::Corrupt(format!(
                "spot point {} at {}: stored price {} differs from its band's {}",
                p.model, p.at, p.per_gpu_second, derived.per_gpu_second
            ))
            .into());
        }
    }
    Ok(series)
}

/// Rates `tenant`'s `period` into a draft invoice named `id`: usage from the
/// ledger (summed rows that rate exactly like the events), the stored
/// catalog and spot series, the tenant's commitments, discounts and
/// credits, less what finalised invoices already drew from each credit.
pub async fn draft_invoice(
    store: &Store,
    catalog: &Catalog,
    tenant: &TenantId,
    period: Period,
    id: &InvoiceId,
    now: DateTime<Utc>,
) -> Result<Draft, RatingError> {
    let book = price_book(store, catalog, now).await?;
    let spot = spot_series(store, &book, period.end).await?;
    let per_subject = book
        .versions()
        .iter()
        .any(|v| v.on_demand.values().any(|p| p.minimum_seconds > 0));
    let rollup = store.usage_rollup(tenant, period, per_subject).await?;
    let commitments = store.commitments(tenant).await?;
    let discounts = store.discounts(tenant).await?;
    let credits = store.credits(tenant).await?;
    let drawn = store.credit_drawn(tenant).await?;
    Ok(build_invoice(InvoiceInput {
        id,
        tenant,
        period,
        events: &rollup.events,
        book: &book,
        spot: &spot,
        commitments: &commitments,
        discounts: &discounts,
        credits: &credits,
        credit_used_before: &drawn,
    })?)
}

/// Finalises `tenant`'s `period`: rates it, marks it final (refused while
/// late events may still arrive, `now < period end + grace`) and stores it
/// with its credit draws. A period already final is a conflict: final
/// invoices never change.
pub async fn finalise_invoice(
    store: &Store,
    catalog: &Catalog,
    tenant: &TenantId,
    period: Period,
    id: &InvoiceId,
    now: DateTime<Utc>,
    grace: Duration,
) -> Result<Invoice, RatingError> {
    if let Some(existing) = store.final_invoice_of(tenant, period.start).await? {
        return Err(BillingError::InvoiceFinalised {
            id: existing.to_string(),
        }
        .into());
    }
    let draft = draft_invoice(store, catalog, tenant, period, id, now).await?;
    store_final(store, draft, now, grace).await
}

/// Marks a draft final and stores it with its credit draws; the store
/// refuses a second final invoice for the same tenant and period, so two
/// operators finalising at once get one invoice and one conflict.
pub async fn store_final(
    store: &Store,
    draft: Draft,
    now: DateTime<Utc>,
    grace: Duration,
) -> Result<Invoice, RatingError> {
    let fin = draft.invoice.finalise(now, grace)?;
    store
        .insert_final_invoice(&fin, &draft.credits_applied)
        .await?;
    Ok(fin)
}

/// Records the spot price of every model with a band in force, derived
/// from the share of its ready GPUs that instances hold, when it differs
/// from the model's latest point (a series of changes, not of ticks).
/// Returns the points recorded.
pub async fn record_spot_prices(
    store: &Store,
    book: &PriceBook,
    now: DateTime<Utc>,
) -> Result<usize, RatingError> {
    let v = book.in_force(now)?;
    let latest = store.latest_spot_points().await?;
    let mut recorded = 0;
    for m in store.gpu_pool_use().await? {
        let Some(band) = v.spot.get(&m.model) else {
            continue;
        };
        if m.total == 0 {
            continue;
        }
        // Four decimals: a readable utilisation on an invoice; the price is
        // derived from exactly this value.
        let u = (Decimal::from(m.used.min(m.total)) / Decimal::from(m.total))
            .round_dp(4)
            .normalize();
        let price = flotilla_billing::price::spot_price(band, u)?;
        if let Some(last) = latest.get(&m.model) {
            if last.at >= now || (last.per_gpu_second == price && last.price_version == v.version) {
                continue;
            }
        }
        let point = flotilla_billing::price::SpotPoint {
            model: m.model.clone(),
            at: now,
            utilisation: u,
            per_gpu_second: price,
            price_version: v.version,
        };
        if store.record_spot_point(&point).await? {
            tracing::info!(model = %m.model, utilisation = %u, price = %price, version = v.version, "spot price recorded");
            recorded += 1;
        }
    }
    Ok(recorded)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use flotilla_billing::meter::UsageEvent;

    #[test]
    fn the_default_book_prices_every_catalog_model() {
        let c = Catalog::default();
        let b = default_price_book(&c).unwrap();
        let h100 = b.latest().on_demand("H100").unwrap();
        // 2.99 / 3600 is a repeating decimal, exact to Decimal's 28 digits.
        let back = h100.per_gpu_second * Decimal::from(3600);
        assert!(
            (back - Decimal::new(299, 2)).abs() < Decimal::new(1, 20),
            "{back}"
        );
        assert_eq!(b.latest().on_demand.len(), c.models().len());
    }

    #[test]
    fn spot_is_rated_at_the_band_floor_before_any_point_is_recorded() {
        let catalog = Catalog::default();
        let book = default_price_book(&catalog).unwrap();
        let mut series = SpotSeries::new();
        for m in book.latest().spot.keys() {
            series
                .record(&book, m, DateTime::<Utc>::UNIX_EPOCH, Decimal::ZERO)
                .unwrap();
        }
        let tenant = TenantId::generate(1, 1);
        let e: UsageEvent = serde_json::from_value(serde_json::json!({
            "key": {"tenant": tenant, "source": "lifecycle", "id": "s1"},
            "subject": {"kind": "instance", "id": "inst_1"},
            "meter": {"meter": "gpu_seconds", "model": "H100", "share": {"kind": "whole"}},
            "billing_class": "spot",
            "start": "2025-01-01T00:00:00Z", "end": "2025-01-01T01:00:00Z",
            "amount": "10"
        }))
        .unwrap();
        let inv = build_invoice(InvoiceInput {
            id: &InvoiceId::generate(1, 2),
            tenant: &tenant,
            period: Period::month(2025, 1).unwrap(),
            events: &[e],
            book: &book,
            spot: &series,
            commitments: &[],
            discounts: &[],
            credits: &[],
            credit_used_before: &BTreeMap::new(),
        })
        .unwrap();
        // 10 H100 for an hour at 30% of $2.99: $8.97.
        assert_eq!(inv.invoice.total().to_string(), "8.97");
    }
}
