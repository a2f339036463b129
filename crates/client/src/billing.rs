//! Typed methods of the billing routes: prices, invoices, usage, budgets,
//! estimates, payouts and a tenant's terms. Requests and answers are
//! billing's own wire types (`flotilla_billing::api`, its invoices, price
//! versions and estimates), the ones the server serialises.

use flotilla_billing::api::{
    AddedTerm, BudgetView, FinalizeRequest, NewTerm, Payouts, PriceCatalog, ReconcileReport,
    SetBudget, SpotPrices, Terms,
};
use flotilla_billing::estimate::{Estimate, Workload};
use flotilla_billing::price::PriceVersion;
use flotilla_billing::{Invoice, UsageEvent};
use serde::de::DeserializeOwned;

use crate::client::Client;
use crate::error::Error;
use crate::Result;

/// The time range of usage events to read. The bounds are RFC 3339 text
/// as given, so that the server judges them and names the bad one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRange {
    /// Start, inclusive.
    pub from: String,
    /// End, exclusive.
    pub to: String,
}

impl UsageRange {
    fn query(&self) -> [(&'static str, String); 2] {
        [("from", self.from.clone()), ("to", self.to.clone())]
    }
}

/// The window and threshold of a billing reconciliation; `None` is the
/// server's default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReconcileQuery {
    /// Start (RFC 3339), inclusive.
    pub since: Option<String>,
    /// End (RFC 3339), exclusive.
    pub until: Option<String>,
    /// Seconds per instance a difference may reach unreported.
    pub threshold_s: Option<String>,
}

impl Client {
    /// `GET /v1/prices`: every catalog version and the one in force.
    pub async fn prices(&self) -> Result<PriceCatalog> {
        self.get("/v1/prices", &[]).await
    }

    /// `POST /v1/prices`: publishes the next catalog version (operators).
    /// The body is a version as [`Client::prices`] lists one, its
    /// `version` left out or not: no type says "a version without its
    /// number", so it is the JSON the caller has.
    pub async fn publish_prices(&self, version: &serde_json::Value) -> Result<PriceVersion> {
        self.post("/v1/prices", version).await
    }

    /// `GET /v1/prices/spot`: the latest spot point of each model.
    pub async fn spot_prices(&self) -> Result<SpotPrices> {
        self.get("/v1/prices/spot", &[]).await
    }

    /// `POST /v1/estimates`: a workload priced under every billing model.
    pub async fn estimate(&self, workload: &Workload) -> Result<Estimate> {
        self.post("/v1/estimates", workload).await
    }

    /// Every finalised invoice the key sees (`GET /v1/invoices`, all
    /// pages).
    pub async fn invoices(&self) -> Result<Vec<Invoice>> {
        self.list("/v1/invoices", &[], None).await
    }

    /// [`Client::invoices`] as CSV, one row per invoice line.
    pub async fn invoices_csv(&self) -> Result<String> {
        self.list_csv("/v1/invoices", &[]).await
    }

    /// `GET /v1/invoices/{id}`: a finalised invoice.
    pub async fn invoice(&self, id: &str) -> Result<Invoice> {
        self.get(&format!("/v1/invoices/{id}"), &[]).await
    }

    /// [`Client::invoice`]'s lines as CSV.
    pub async fn invoice_csv(&self, id: &str) -> Result<String> {
        let (csv, _) = self.get_csv(&format!("/v1/invoices/{id}"), &[]).await?;
        Ok(csv)
    }

    /// `GET /v1/invoices/preview`: the draft invoice of `period`
    /// (`YYYY-MM`), rated from the ledger now.
    pub async fn invoice_preview(&self, period: &str) -> Result<Invoice> {
        self.get("/v1/invoices/preview", &[("period", period.to_string())])
            .await
    }

    /// `POST /v1/invoices/finalise` (operators).
    pub async fn finalise_invoices(
        &self,
        req: &FinalizeRequest,
    ) -> Result<flotilla_billing::api::Finalized> {
        self.post("/v1/invoices/finalise", req).await
    }

    /// The key's metered usage events in `range` (`GET /v1/usage`, all
    /// pages).
    pub async fn usage(&self, range: &UsageRange) -> Result<Vec<UsageEvent>> {
        self.list("/v1/usage", &range.query(), None).await
    }

    /// [`Client::usage`] as CSV, one row per event.
    pub async fn usage_csv(&self, range: &UsageRange) -> Result<String> {
        self.list_csv("/v1/usage", &range.query()).await
    }

    /// `GET /v1/budget`: the budget of the key's tenant, or of `tenant`
    /// (operators); not found ([`Error::is_not_found`]) when none is set.
    pub async fn budget(&self, tenant: Option<&str>) -> Result<BudgetView> {
        let q: Vec<(&str, String)> = tenant.iter().map(|t| ("tenant", t.to_string())).collect();
        self.get("/v1/budget", &q).await
    }

    /// `PUT /v1/budget`: sets or replaces a budget.
    pub async fn set_budget(&self, req: &SetBudget) -> Result<BudgetView> {
        self.put("/v1/budget", req).await
    }

    /// `GET /v1/payouts`: provider payout statements of `period`
    /// (`YYYY-MM`).
    pub async fn payouts(&self, period: &str) -> Result<Payouts> {
        self.get("/v1/payouts", &[("period", period.to_string())])
            .await
    }

    /// `GET /v1/billing/reconcile` (operators): the instances whose billed
    /// time and observed run differ beyond the threshold over the window.
    /// Unset bounds take the server's defaults (the hour up to two minutes
    /// ago, 2 s); times are RFC 3339 text as given, so that the server
    /// judges them and names the bad one.
    pub async fn billing_reconcile(&self, q: &ReconcileQuery) -> Result<ReconcileReport> {
        let mut params = Vec::new();
        for (name, v) in [
            ("since", &q.since),
            ("until", &q.until),
            ("threshold_s", &q.threshold_s),
        ] {
            if let Some(v) = v {
                params.push((name, v.clone()));
            }
        }
        self.get("/v1/billing/reconcile", &params).await
    }

    /// `GET /v1/tenants/{tenant}/terms`: commitments, discounts, credits.
    pub async fn terms(&self, tenant: &str) -> Result<Terms> {
        self.get(&format!("/v1/tenants/{tenant}/terms"), &[]).await
    }

    /// `POST /v1/tenants/{tenant}/terms` (operators): the term stored, read
    /// as the kind asked for.
    pub async fn add_term(&self, tenant: &str, term: &NewTerm) -> Result<AddedTerm> {
        let raw: serde_json::Value = self
            .post(&format!("/v1/tenants/{tenant}/terms"), term)
            .await?;
        Ok(match term {
            NewTerm::Commitment { .. } => AddedTerm::Commitment(read(raw)?),
            NewTerm::Discount { .. } => AddedTerm::Discount(read(raw)?),
            NewTerm::Credit { .. } => AddedTerm::Credit(read(raw)?),
        })
    }
}

fn read<T: DeserializeOwned>(raw: serde_json::Value) -> Result<T> {
    serde_json::from_value(raw).map_err(|source| Error::Decode { source })
}
