//! Budgets, the alerts they raised and the webhook delivery log.
//!
//! An alert is keyed by (tenant, period, threshold) and inserted together
//! with its delivery in one transaction, so a threshold alerts once per
//! period whatever the number of passes, restarts or server replicas, and
//! an alert recorded always has its delivery queued.

use chrono::{DateTime, Utc};
use flotilla_billing::budget::{Budget, BudgetAlert};
use flotilla_core::id::TenantId;

use sqlx::Row;

use crate::{at, json, ms, to_json, Result, Store};

/// A budget and where its alerts go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredBudget {
    /// The budget.
    pub budget: Budget,
    /// Where alerts are POSTed, if anywhere.
    pub webhook_url: Option<String>,
    /// The key that signs them.
    pub webhook_secret: Option<String>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
}

/// The delivery log's types live in billing, beside the budget alerts they
/// deliver, so the API's answer can carry them without naming the store.
pub use flotilla_billing::budget::{Delivery, DeliveryState};

fn state_str(state: DeliveryState) -> &'static str {
    match state {
        DeliveryState::Pending => "pending",
        DeliveryState::Delivered => "delivered",
        DeliveryState::Failed => "failed",
    }
}

fn parse_state(s: &str) -> DeliveryState {
    match s {
        "delivered" => DeliveryState::Delivered,
        "failed" => DeliveryState::Failed,
        _ => DeliveryState::Pending,
    }
}

fn delivery(r: &sqlx::any::AnyRow) -> Result<Delivery> {
    let attempts: i64 = r.try_get("attempts")?;
    let status: Option<i64> = r.try_get("last_status")?;
    let delivered: Option<i64> = r.try_get("delivered_at")?;
    Ok(Delivery {
        id: r.try_get("id")?,
        tenant: TenantId::from_trusted(r.try_get("tenant_id")?),
        url: r.try_get("url")?,
        body: r.try_get("body")?,
        state: parse_state(&r.try_get::<String, _>("state")?),
        attempts: attempts.clamp(0, i64::from(u32::MAX)) as u32,
        next_attempt_at: at(r.try_get("next_attempt_at")?),
        last_status: status.and_then(|s| u16::try_from(s).ok()),
        last_error: r.try_get("last_error")?,
        delivered_at: delivered.map(at),
        created_at: at(r.try_get("created_at")?),
    })
}

impl Store {
    /// Sets (or replaces) the tenant's budget.
    pub async fn set_budget(&self, b: &StoredBudget) -> Result<()> {
        sqlx::query(
            "INSERT INTO budgets (tenant_id, body, webhook_url, webhook_secret, updated_at) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (tenant_id) DO UPDATE SET body = $2, \
             webhook_url = $3, webhook_secret = $4, updated_at = $5",
        )
        .bind(b.budget.tenant.as_str())
        .bind(to_json(&b.budget))
        .bind(b.webhook_url.as_deref())
        .bind(b.webhook_secret.as_deref())
        .bind(ms(b.updated_at))
        .execute(self.writer())
        .await?;
        Ok(())
    }

    /// The tenant's budget, if it has one.
    pub async fn budget(&self, tenant: &TenantId) -> Result<Option<StoredBudget>> {
        let row = sqlx::query("SELECT * FROM budgets WHERE tenant_id = $1")
            .bind(tenant.as_str())
            .fetch_optional(self.pool())
            .await?;
        row.as_ref().map(stored_budget).transpose()
    }

    /// Every budget.
    pub async fn budgets(&self) -> Result<Vec<StoredBudget>> {
        let rows = sqlx::query("SELECT * FROM budgets ORDER BY tenant_id")
            .fetch_all(self.pool())
            .await?;
        rows.iter().map(stored_budget).collect()
    }

    /// Records an alert and, when the budget has a webhook, queues its
    /// delivery (`delivery_id`, due now), in one transaction. False when
    /// the alert was already recorded: nothing changes.
    pub async fn record_budget_alert(
        &self,
        alert: &BudgetAlert,
        webhook_url: Option<&str>,
        delivery_id: &str,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let body = to_json(alert);
        let mut tx = self.begin().await?;
        let n = sqlx::query(
            "INSERT INTO budget_alerts (tenant_id, period_start, threshold, body, created_at) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (tenant_id, period_start, threshold) DO NOTHING",
        )
        .bind(alert.tenant.as_str())
        .bind(ms(alert.period_start))
        .bind(i64::from(alert.threshold_percent))
        .bind(&body)
        .bind(ms(now))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if n == 0 {
            return Ok(false);
        }
        if let Some(url) = webhook_url {
            sqlx::query(
                "INSERT INTO webhook_deliveries (id, tenant_id, url, body, state, attempts, \
                 next_attempt_at, created_at) VALUES ($1, $2, $3, $4, 'pending', 0, $5, $5)",
            )
            .bind(delivery_id)
            .bind(alert.tenant.as_str())
            .bind(url)
            .bind(&body)
            .bind(ms(now))
            .execute(&mut *tx)
            .await?;
        }
        crate::txn::commit(tx).await?;
        Ok(true)
    }

    /// The tenant's alerts of the period starting at `period_start`,
    /// lowest threshold first.
    pub async fn budget_alerts(
        &self,
        tenant: &TenantId,
        period_start: DateTime<Utc>,
    ) -> Result<Vec<BudgetAlert>> {
        let rows = sqlx::query(
            "SELECT body FROM budget_alerts WHERE tenant_id = $1 AND period_start = $2 \
             ORDER BY threshold",
        )
        .bind(tenant.as_str())
        .bind(ms(period_start))
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| json(&r.try_get::<String, _>("body")?, "budget alert"))
            .collect()
    }

    /// Pending deliveries due at `now`, oldest first, at most `limit`.
    pub async fn due_deliveries(&self, now: DateTime<Utc>, limit: u32) -> Result<Vec<Delivery>> {
        let rows = sqlx::query(
            "SELECT * FROM webhook_deliveries WHERE state = 'pending' AND next_attempt_at <= $1 \
             ORDER BY next_attempt_at, id LIMIT $2",
        )
        .bind(ms(now))
        .bind(i64::from(limit))
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(delivery).collect()
    }

    /// Records an attempt: `next` is when to try again (`None`: no more
    /// attempts); `delivered` when the receiver accepted it.
    #[allow(
        clippy::too_many_arguments,
        reason = "one attempt's outcome; a struct would only be unpacked here"
    )]
    pub async fn record_delivery_attempt(
        &self,
        id: &str,
        delivered: bool,
        status: Option<u16>,
        error: Option<&str>,
        next: Option<DateTime<Utc>>,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let state = match (delivered, next) {
            (true, _) => DeliveryState::Delivered,
            (false, Some(_)) => DeliveryState::Pending,
            (false, None) => DeliveryState::Failed,
        };
        sqlx::query(
            "UPDATE webhook_deliveries SET state = $1, attempts = attempts + 1, \
             next_attempt_at = $2, last_status = $3, last_error = $4, delivered_at = $5 \
             WHERE id = $6 AND state = 'pending'",
        )
        .bind(state_str(state))
        .bind(ms(next.unwrap_or(now)))
        .bind(status.map(i64::from))
        .bind(error)
        .bind(delivered.then(|| ms(now)))
        .bind(id)
        .execute(self.writer())
        .await?;
        Ok(())
    }

    /// The tenant's deliveries, newest first, at most `limit`.
    pub async fn deliveries(&self, tenant: &TenantId, limit: u32) -> Result<Vec<Delivery>> {
        let rows = sqlx::query(
            "SELECT * FROM webhook_deliveries WHERE tenant_id = $1 ORDER BY id DESC LIMIT $2",
        )
        .bind(tenant.as_str())
        .bind(i64::from(limit))
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(delivery).collect()
    }
}

fn stored_budget(r: &sqlx::any::AnyRow) -> Result<StoredBudget> {
    Ok(StoredBudget {
        budget: json(&r.try_get::<String, _>("body")?, "budget")?,
        webhook_url: r.try_get("webhook_url")?,
        webhook_secret: r.try_get("webhook_secret")?,
        updated_at: at(r.try_get("updated_at")?),
    })
}
