//! Flotilla's metering and billing core: the append-only usage ledger and
//! its idempotency rules, the versioned price catalog (on-demand, reserved,
//! spot, serverless, credits, discounts), invoices, cost estimates, budgets
//! with signed alerts, and provider payouts.
//!
//! This crate must never do I/O: no network, no disk, no threads and no
//! reading of the wall clock. Every function that needs the time takes it as
//! a `DateTime<Utc>` argument, and persistence sits behind the [`Ledger`]
//! and [`InvoiceBook`] traits (in-memory implementations here; SQL ones in
//! `flotilla-store`). That keeps rating deterministic: the same events, in
//! any order and with any duplicates, give a byte-identical invoice, so the
//! server and the simulator bill exactly alike.
//!
//! Money is always [`rust_decimal::Decimal`], never a float. Amounts are
//! rounded once, at the invoice line, half-even to the currency's minor
//! units ([`Currency::round`]); totals are exact sums of rounded lines.

pub mod api;
pub mod budget;
pub mod error;
pub mod estimate;
pub mod export;
pub mod invoice;
pub mod meter;
pub mod money;
pub mod payout;
pub mod price;
pub mod reconcile;

pub use error::BillingError;
pub use invoice::{Invoice, InvoiceBook, InvoiceLine, LineKind, MemoryInvoiceBook};
pub use meter::{Ledger, MemoryLedger, Meter, UsageEvent};
pub use money::{Currency, Period};

/// Results of this crate.
pub type Result<T, E = BillingError> = std::result::Result<T, E>;
