//! Finalised invoices and what rating reads beside the ledger: a tenant's
//! reserved commitments, discounts and credit grants, and what earlier
//! invoices drew from each grant.
//!
//! A finalised invoice is written once, with its credit draws, in one
//! transaction, and no statement here updates or deletes it: "immutable
//! once final" is a property of the store, not only of the API.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use flotilla_billing::invoice::{Invoice, InvoiceStatus};
use flotilla_billing::price::{Commitment, CreditGrant, Discount};
use flotilla_core::id::{InvoiceId, TenantId};
use rust_decimal::Decimal;
use serde::de::DeserializeOwned;
use sqlx::Row;

use crate::prices::decimal;
use crate::{json, ms, to_json, PageOf, PageReq, Result, Store, StoreError};

/// The per-tenant terms rating applies: which table, and what it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Terms {
    /// Reserved commitments.
    Commitments,
    /// Percentage discounts.
    Discounts,
    /// Credit grants and prepaid balances.
    Credits,
}

impl Terms {
    fn table(self) -> &'static str {
        match self {
            Self::Commitments => "commitments",
            Self::Discounts => "discounts",
            Self::Credits => "credit_grants",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Self::Commitments => "commitment",
            Self::Discounts => "discount",
            Self::Credits => "credit grant",
        }
    }
}

impl Store {
    async fn add_terms<T: serde::Serialize>(
        &self,
        kind: Terms,
        id: &str,
        tenant: &TenantId,
        body: &T,
        now: DateTime<Utc>,
    ) -> Result<()> {
        sqlx::query(&format!(
            "INSERT INTO {} (id, tenant_id, body, created_at) VALUES ($1, $2, $3, $4)",
            kind.table()
        ))
        .bind(id)
        .bind(tenant.as_str())
        .bind(to_json(body))
        .bind(ms(now))
        .execute(self.writer())
        .await
        .map_err(|e| match StoreError::from(e) {
            StoreError::AlreadyExists(_) => {
                StoreError::AlreadyExists(format!("{} `{id}`", kind.what()))
            }
            other => other,
        })?;
        Ok(())
    }

    async fn terms<T: DeserializeOwned>(&self, kind: Terms, tenant: &TenantId) -> Result<Vec<T>> {
        let rows = sqlx::query(&format!(
            "SELECT body FROM {} WHERE tenant_id = $1 ORDER BY id",
            kind.table()
        ))
        .bind(tenant.as_str())
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| json(&r.try_get::<String, _>("body")?, kind.what()))
            .collect()
    }

    /// Records a signed commitment; `AlreadyExists` when its id is taken.
    /// Commitments are never edited: their price is locked when signed.
    pub async fn add_commitment(&self, c: &Commitment, now: DateTime<Utc>) -> Result<()> {
        self.add_terms(Terms::Commitments, &c.id, &c.tenant, c, now)
            .await
    }

    /// Records a discount; `AlreadyExists` when its id is taken.
    pub async fn add_discount(&self, d: &Discount, now: DateTime<Utc>) -> Result<()> {
        self.add_terms(Terms::Discounts, &d.id, &d.tenant, d, now)
            .await
    }

    /// Records a credit grant; `AlreadyExists` when its id is taken.
    pub async fn add_credit(&self, c: &CreditGrant, now: DateTime<Utc>) -> Result<()> {
        self.add_terms(Terms::Credits, &c.id, &c.tenant, c, now)
            .await
    }

    /// The tenant's commitments.
    pub async fn commitments(&self, tenant: &TenantId) -> Result<Vec<Commitment>> {
        self.terms(Terms::Commitments, tenant).await
    }

    /// The tenant's discounts.
    pub async fn discounts(&self, tenant: &TenantId) -> Result<Vec<Discount>> {
        self.terms(Terms::Discounts, tenant).await
    }

    /// The tenant's credit grants.
    pub async fn credits(&self, tenant: &TenantId) -> Result<Vec<CreditGrant>> {
        self.terms(Terms::Credits, tenant).await
    }

    /// How much finalised invoices of the tenant drew from each grant.
    pub async fn credit_drawn(&self, tenant: &TenantId) -> Result<BTreeMap<String, Decimal>> {
        let rows = sqlx::query(
            "SELECT d.grant_id, d.amount FROM credit_draws d JOIN invoices i ON i.id = d.invoice_id \
             WHERE i.tenant_id = $1",
        )
        .bind(tenant.as_str())
        .fetch_all(self.pool())
        .await?;
        let mut out: BTreeMap<String, Decimal> = BTreeMap::new();
        for r in &rows {
            let amount = decimal(&r.try_get::<String, _>("amount")?, "credit draw")?;
            let e = out.entry(r.try_get("grant_id")?).or_default();
            *e = e
                .checked_add(amount)
                .ok_or_else(|| StoreError::Corrupt("credit draws overflow".into()))?;
        }
        Ok(out)
    }

    /// Stores a finalised invoice and its credit draws in one transaction.
    /// `Conflict` when the tenant already has a final invoice for the
    /// period: a final invoice is never replaced.
    pub async fn insert_final_invoice(
        &self,
        inv: &Invoice,
        draws: &BTreeMap<String, Decimal>,
    ) -> Result<()> {
        let InvoiceStatus::Finalised { at: finalised_at } = inv.status() else {
            return Err(StoreError::Conflict(format!(
                "invoice {} is a draft; only final invoices are stored",
                inv.id()
            )));
        };
        let body = inv
            .to_json()
            .map_err(|e| StoreError::Corrupt(format!("invoice: {e}")))?;
        let mut tx = self.begin().await?;
        sqlx::query(
            "INSERT INTO invoices (id, tenant_id, period_start, period_end, total, currency, body, \
             finalised_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(inv.id().as_str())
        .bind(inv.tenant().as_str())
        .bind(ms(inv.period().start))
        .bind(ms(inv.period().end))
        .bind(inv.total().to_string())
        .bind(&inv.currency().code)
        .bind(body)
        .bind(ms(finalised_at))
        .execute(&mut *tx)
        .await
        .map_err(|e| match StoreError::from(e) {
            StoreError::AlreadyExists(_) => StoreError::Conflict(format!(
                "the invoice of tenant {} for the period starting {} is final and cannot change",
                inv.tenant(),
                inv.period().start.format("%Y-%m-%d")
            )),
            other => other,
        })?;
        for (grant, amount) in draws {
            if amount.is_zero() {
                continue;
            }
            sqlx::query(
                "INSERT INTO credit_draws (invoice_id, grant_id, amount) VALUES ($1, $2, $3)",
            )
            .bind(inv.id().as_str())
            .bind(grant)
            .bind(amount.to_string())
            .execute(&mut *tx)
            .await?;
        }
        crate::txn::commit(tx).await?;
        Ok(())
    }

    /// A finalised invoice by id, as stored (the exact bytes written).
    pub async fn invoice_json(&self, id: &InvoiceId) -> Result<(TenantId, String)> {
        let row = sqlx::query("SELECT tenant_id, body FROM invoices WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::NotFound("invoice"))?;
        Ok((
            TenantId::from_trusted(row.try_get("tenant_id")?),
            row.try_get("body")?,
        ))
    }

    /// A finalised invoice by id.
    pub async fn invoice(&self, id: &InvoiceId) -> Result<Invoice> {
        let (_, body) = self.invoice_json(id).await?;
        json(&body, "invoice")
    }

    /// Whether the tenant has a final invoice for the period starting at
    /// `period_start`.
    pub async fn final_invoice_of(
        &self,
        tenant: &TenantId,
        period_start: DateTime<Utc>,
    ) -> Result<Option<InvoiceId>> {
        let row = sqlx::query("SELECT id FROM invoices WHERE tenant_id = $1 AND period_start = $2")
            .bind(tenant.as_str())
            .bind(ms(period_start))
            .fetch_optional(self.pool())
            .await?;
        row.map(|r| Ok(InvoiceId::from_trusted(r.try_get("id")?)))
            .transpose()
    }

    /// Finalised invoices by id (ids sort by creation); `only` restricts to
    /// one tenant.
    pub async fn list_invoices(
        &self,
        only: Option<&TenantId>,
        page: &PageReq,
    ) -> Result<PageOf<Invoice>> {
        let rows = self
            .page_rows(
                "SELECT body FROM invoices WHERE id > $1 AND ($2 = '' OR tenant_id = $2) \
             ORDER BY id LIMIT $3",
                only,
                page,
            )
            .await?;
        let items = rows
            .iter()
            .map(|r| json(&r.try_get::<String, _>("body")?, "invoice"))
            .collect::<Result<Vec<Invoice>>>()?;
        Ok(PageOf::from_overfetch(items, page, |i| i.id().to_string()))
    }
}
