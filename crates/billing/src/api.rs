//! Wire types of the billing API (`/v1/prices`, `/v1/budget`,
//! `/v1/invoices`, `/v1/tenants/{id}/terms`, `/v1/payouts`) that are not
//! billing's domain types themselves: the server answers with them (and
//! reads the requests) and the client sends and reads them, so the two
//! cannot drift apart. They live here rather than in `flotilla_core::api`
//! because they carry billing's types (invoices, price versions, terms),
//! which core cannot name.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use flotilla_core::id::TenantId;
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

use crate::budget::{BudgetAlert, Delivery};
use crate::invoice::Invoice;
use crate::payout::PayoutStatement;
use crate::price::{
    Commitment, CreditGrant, CreditKind, Discount, DiscountScope, Payment, PriceVersion, SpotPoint,
};

/// The catalog: every version, and which is in force now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PriceCatalog {
    /// The version in force now.
    pub in_force: u32,
    /// ISO currency of every price.
    pub currency: String,
    /// Every version, oldest first: `version`, `effective_from`,
    /// `currency`, `on_demand` (per model: `per_gpu_second`,
    /// `minimum_seconds`), `spot` (per model: `floor`, `ceiling`),
    /// `serverless` (`per_request`, `per_million_input_tokens`,
    /// `per_million_output_tokens` schedules, `per_gpu_second` per model),
    /// `reserved_offers` (`term_days`, `discount`), `per_instance_second`,
    /// `per_storage_gb_second`, `per_parked_gb_hour`. Prices are decimal
    /// strings.
    #[schema(value_type = Vec<Object>)]
    pub versions: Vec<PriceVersion>,
}

/// The latest recorded spot point of each model, and a model's history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SpotPrices {
    /// Per model: `model`, `at` (in force from), `utilisation` of the
    /// pool it was derived from, `per_gpu_second`, `price_version` (whose
    /// band produced it).
    #[schema(value_type = Vec<Object>)]
    pub latest: Vec<SpotPoint>,
    /// With `model`: its recorded points from `from` to `to`, oldest first.
    #[schema(value_type = Vec<Object>)]
    pub history: Vec<SpotPoint>,
    /// With `model`, when more points follow: pass it as `from`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_from: Option<String>,
}

/// A budget as the API shows it (the webhook secret is never shown).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BudgetView {
    /// The tenant.
    #[schema(value_type = String)]
    pub tenant: TenantId,
    /// Spend limit per month.
    #[schema(value_type = String)]
    pub limit: Decimal,
    /// ISO currency of the limit (the catalog's).
    pub currency: String,
    /// Alert thresholds, percent of the limit.
    pub thresholds: Vec<u32>,
    /// Whether reaching the limit refuses new spot and preemptible work
    /// (tier 2 and 3).
    pub hard_cap: bool,
    /// Where alerts are POSTed, signed with `Flotilla-Signature`.
    pub webhook_url: Option<String>,
    /// Start of this month (UTC).
    #[schema(value_type = String)]
    pub period_start: DateTime<Utc>,
    /// What the tenant owes for this month so far (the draft invoice's
    /// total).
    #[schema(value_type = String)]
    pub spend: Decimal,
    /// Thresholds crossed this month, each recorded once.
    #[schema(value_type = Vec<Object>)]
    pub alerts: Vec<BudgetAlert>,
    /// The newest webhook deliveries (at most 20) with their attempts,
    /// state, last status or error.
    #[schema(value_type = Vec<Object>)]
    pub deliveries: Vec<Delivery>,
}

/// A tenant not finalised, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Skipped {
    /// The tenant.
    #[schema(value_type = String)]
    pub tenant: TenantId,
    /// `already_final` or `nothing_to_bill`.
    pub reason: String,
}

/// What a finalisation did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Finalized {
    /// Invoices finalised now.
    #[schema(value_type = Vec<Object>)]
    pub finalised: Vec<Invoice>,
    /// Tenants left as they were.
    pub skipped: Vec<Skipped>,
}

/// A tenant's billing terms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Terms {
    /// Reserved commitments: id, model, gpus, start, end, payment,
    /// discount, price_version, per_gpu_second (locked).
    #[schema(value_type = Vec<Object>)]
    pub commitments: Vec<Commitment>,
    /// Discounts: id, percent, scope, from, until.
    #[schema(value_type = Vec<Object>)]
    pub discounts: Vec<Discount>,
    /// Credit grants: id, kind, amount, granted_at, expires_at.
    #[schema(value_type = Vec<Object>)]
    pub credits: Vec<CreditGrant>,
    /// What finalised invoices drew from each grant, by grant id.
    #[schema(value_type = Object)]
    pub credit_drawn: BTreeMap<String, Decimal>,
}

/// Payout statements of a month.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Payouts {
    /// One per provider: `provider`, `period`, `currency`, `lines` (model,
    /// kind, gpu_seconds, unit_price, gross, price_version,
    /// price_point_at), `gross`, `operator_fee`, `payout`.
    #[schema(value_type = Vec<Object>)]
    pub items: Vec<PayoutStatement>,
}

/// A budget to set (`PUT /v1/budget`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetBudget {
    /// Operators only: whose budget (default: the caller's tenant).
    #[schema(value_type = Option<String>)]
    pub tenant: Option<String>,
    /// Spend limit per month, in the catalog currency; positive.
    #[schema(value_type = String)]
    pub limit: Decimal,
    /// Alert thresholds in percent (default 50, 80, 100).
    pub thresholds: Option<Vec<u32>>,
    /// Refuse new spot and preemptible work of tier 2 and 3 once spend
    /// reaches the limit (default false). Tier-1 and on-demand work is
    /// never refused, and running work is never stopped.
    #[serde(default)]
    pub hard_cap: bool,
    /// `http://` or `https://` URL alerts are POSTed to. It must reach a
    /// public address: loopback, private, link-local, shared, unique-local,
    /// multicast and unspecified addresses (literal, or what the name
    /// resolves to) are refused unless the operator allows them
    /// (`--allow-egress CIDR[:PORTS]`, or `--webhook-allow-private`).
    pub webhook_url: Option<String>,
    /// The HMAC-SHA256 key that signs deliveries (16 to 256 characters);
    /// required with `webhook_url`.
    pub webhook_secret: Option<String>,
}

/// What to finalise (`POST /v1/invoices/finalise`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FinalizeRequest {
    /// The month, `YYYY-MM` (UTC).
    pub period: String,
    /// One tenant; default: every tenant with something to bill.
    #[schema(value_type = Option<String>)]
    pub tenant: Option<TenantId>,
}

/// A new term for a tenant, by `kind` (`POST /v1/tenants/{id}/terms`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum NewTerm {
    /// A reserved commitment, priced at the on-demand price in force at
    /// `start` less `discount` (default: the catalog's offer for the term).
    Commitment {
        /// Operator-given id.
        id: String,
        /// GPU model.
        model: String,
        /// Whole GPUs.
        gpus: u32,
        /// Start of the term.
        #[schema(value_type = String)]
        start: DateTime<Utc>,
        /// Term in days.
        term_days: u32,
        /// `upfront` or `monthly`.
        #[schema(value_type = String)]
        payment: Payment,
        /// Discount fraction (0.3 = 30 %); default: the catalog's offer.
        #[schema(value_type = Option<String>)]
        discount: Option<Decimal>,
    },
    /// A percentage off the lines in scope.
    Discount {
        /// Operator-given id.
        id: String,
        /// Percent off, above 0 and at most 100.
        #[schema(value_type = String)]
        percent: Decimal,
        /// `all`, `on_demand`, `reserved`, `spot` or `serverless`.
        #[schema(value_type = String)]
        scope: DiscountScope,
        /// First period it applies to (its start).
        #[schema(value_type = String)]
        from: DateTime<Utc>,
        /// Periods starting before this; default: no end.
        #[schema(value_type = Option<String>)]
        until: Option<DateTime<Utc>>,
    },
    /// A credit or prepaid balance.
    Credit {
        /// Operator-given id.
        id: String,
        /// `promotional` or `prepaid`.
        #[schema(value_type = String)]
        credit_kind: CreditKind,
        /// Amount in the catalog currency.
        #[schema(value_type = String)]
        amount: Decimal,
        /// When it was granted (default: now).
        #[schema(value_type = Option<String>)]
        granted_at: Option<DateTime<Utc>>,
        /// Usable by periods starting before this; default: never expires.
        #[schema(value_type = Option<String>)]
        expires_at: Option<DateTime<Utc>>,
    },
}

/// The term `POST /v1/tenants/{id}/terms` stored, of the kind asked for:
/// on the wire the bare commitment, discount or credit. Only serialised:
/// a reader knows the kind it asked for and reads that type, since the
/// three cannot be told apart by their fields alone without guessing.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum AddedTerm {
    /// A commitment, its price locked.
    Commitment(Commitment),
    /// A discount.
    Discount(Discount),
    /// A credit grant.
    Credit(CreditGrant),
}

impl AddedTerm {
    /// Its id (unique per kind within the tenant).
    pub fn id(&self) -> &str {
        match self {
            AddedTerm::Commitment(c) => &c.id,
            AddedTerm::Discount(d) => &d.id,
            AddedTerm::Credit(c) => &c.id,
        }
    }

    /// `commitment`, `discount` or `credit`.
    pub fn kind(&self) -> &'static str {
        match self {
            AddedTerm::Commitment(_) => "commitment",
            AddedTerm::Discount(_) => "discount",
            AddedTerm::Credit(_) => "credit",
        }
    }
}

impl NewTerm {
    /// `commitment`, `discount` or `credit`: the `kind` on the wire.
    pub fn kind(&self) -> &'static str {
        match self {
            NewTerm::Commitment { .. } => "commitment",
            NewTerm::Discount { .. } => "discount",
            NewTerm::Credit { .. } => "credit",
        }
    }
}

/// `GET /v1/billing/reconcile`: what the ledger bills against what the
/// executors saw run, per instance, over `[since, until)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReconcileReport {
    /// Start of the window compared.
    #[schema(value_type = String)]
    pub since: DateTime<Utc>,
    /// End of the window: a little before now, so that metering (one-minute
    /// slices, written every few seconds) has caught up with it.
    #[schema(value_type = String)]
    pub until: DateTime<Utc>,
    /// Differences at most this many seconds per instance are not reported.
    #[schema(value_type = String)]
    pub threshold_seconds: Decimal,
    /// Instances billed or running in the window.
    pub instances: u64,
    /// Instance-seconds the ledger bills in the window, in all.
    #[schema(value_type = String)]
    pub billed_seconds: Decimal,
    /// Seconds the executors saw running in the window, in all.
    #[schema(value_type = String)]
    pub observed_seconds: Decimal,
    /// Every instance whose bill and run differ beyond the threshold, with
    /// its cause, by instance id.
    pub differences: Vec<crate::reconcile::Difference>,
}
