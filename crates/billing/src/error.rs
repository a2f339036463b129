//! The one error type of the billing core. Every variant names the value at
//! fault (a field, an event key, a model, a version) so that the API can
//! turn it into a 400/409/422 body that tells the caller what to fix.

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;

/// Everything that can go wrong in metering, rating and billing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BillingError {
    /// An input value breaks a rule; `field` is its path, e.g. `amount` or
    /// `tiers[2].up_to`.
    #[error("{field}: {message}")]
    Invalid {
        /// Path of the offending value.
        field: String,
        /// What is wrong, lowercase, no trailing punctuation.
        message: String,
    },
    /// An idempotency key was reused for a different event. The same key
    /// with the same payload is a harmless duplicate; a different payload
    /// is a client bug, and a correction must be a new event.
    #[error("event key {key}: already recorded with a different payload; send a correction as a new event")]
    KeyConflict {
        /// The key, as `tenant/source/id`.
        key: String,
    },
    /// An event arrived after its grace window closed.
    #[error(
        "event key {key}: ended at {end}, past the grace window of {grace_secs} s (now {now})"
    )]
    LateEvent {
        /// The key, as `tenant/source/id`.
        key: String,
        /// When the usage ended.
        end: DateTime<Utc>,
        /// The ledger's grace window.
        grace_secs: i64,
        /// The time of the append.
        now: DateTime<Utc>,
    },
    /// No price version was in force at `at` (before the first version).
    #[error("price catalog: no version in force at {at}")]
    NoPriceInForce {
        /// The instant that needed a price.
        at: DateTime<Utc>,
    },
    /// The price version in force has no price for this model and kind.
    #[error("price version {version}: no {kind} price for model `{model}`")]
    NoPriceForModel {
        /// The version consulted.
        version: u32,
        /// `on_demand`, `spot` or `serverless`.
        kind: &'static str,
        /// The GPU model.
        model: String,
    },
    /// Spot usage before the first recorded spot price of its model.
    #[error("spot series for `{model}`: no price recorded at or before {at}")]
    NoSpotPrice {
        /// The GPU model.
        model: String,
        /// The instant that needed a price.
        at: DateTime<Utc>,
    },
    /// A finalised invoice cannot change; a correction goes on a later one.
    #[error("invoice {id}: finalised, it can no longer change")]
    InvoiceFinalised {
        /// The invoice id.
        id: String,
    },
    /// The period is still inside the ledger's grace window, so late events
    /// may still arrive and the invoice must stay a draft.
    #[error("invoice {id}: period ends {period_end}, late events are accepted until {open_until}")]
    GraceWindowOpen {
        /// The invoice id.
        id: String,
        /// End of the invoiced period.
        period_end: DateTime<Utc>,
        /// When the grace window closes.
        open_until: DateTime<Utc>,
    },
    /// A hard budget cap refused new capacity.
    #[error("budget of tenant {tenant}: hard cap reached (spend {spend} of {limit} {currency}); new {kind} capacity is refused, tier 1 work is unaffected")]
    BudgetCapReached {
        /// The tenant.
        tenant: String,
        /// Spend so far this period.
        spend: Decimal,
        /// The budget limit.
        limit: Decimal,
        /// ISO currency code.
        currency: String,
        /// The capacity kind refused (`spot` or `serverless`).
        kind: &'static str,
    },
    /// A webhook signature header did not verify.
    #[error("webhook signature: {reason}")]
    BadSignature {
        /// Why: malformed header, stale timestamp or mismatch.
        reason: &'static str,
    },
    /// A computation left the range of `Decimal` (about 7.9e28); inputs are
    /// bounded so this means absurd input, never a silent wrap.
    #[error("{what}: amount out of range")]
    Overflow {
        /// What was being computed.
        what: &'static str,
    },
}

impl BillingError {
    /// Shorthand for [`BillingError::Invalid`].
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl From<flotilla_core::FieldError> for BillingError {
    fn from(e: flotilla_core::FieldError) -> Self {
        Self::Invalid {
            field: e.field,
            message: e.message,
        }
    }
}
