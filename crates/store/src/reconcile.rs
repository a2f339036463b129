//! The inputs of billing's reconciliation (`flotilla_billing::reconcile`)
//! over a window: the ledger's time meters and the instances that ran.
//! Reads only; the comparison is billing's.

use chrono::{DateTime, Utc};
use flotilla_billing::meter::UsageEvent;
use flotilla_core::api::Instance;
use flotilla_core::id::InstanceId;
use sqlx::Row;

use crate::instances::instance;
use crate::usage::{decode, EVENT_COLUMNS};
use crate::{ms, Result, Store};

impl Store {
    /// Every tenant's GPU-second and instance-second events whose usage
    /// touches `[from, to)`, corrections included. Read tenant by tenant,
    /// so that each read walks the ledger's `(tenant_id, end_ms)` index
    /// from `from` on rather than the whole table.
    pub async fn time_usage_between(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<Vec<UsageEvent>> {
        let tenants = sqlx::query("SELECT id FROM tenants ORDER BY id")
            .fetch_all(self.pool())
            .await?;
        let sql = format!(
            "SELECT {EVENT_COLUMNS} FROM usage_events WHERE tenant_id = $1 AND end_ms > $2 \
             AND start_ms < $3 AND meter IN ('gpu_seconds', 'instance_seconds')"
        );
        let mut out = Vec::new();
        for t in &tenants {
            let tenant: String = t.try_get("id")?;
            let rows = sqlx::query(&sql)
                .bind(&tenant)
                .bind(ms(from))
                .bind(ms(to))
                .fetch_all(self.pool())
                .await?;
            for r in &rows {
                out.push(decode(r)?);
            }
        }
        Ok(out)
    }

    /// Every instance that was running at some time in `[from, to)` (it
    /// started before `to` and had not finished by `from`), with its
    /// events, by id.
    pub async fn instances_ran_between(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<Vec<Instance>> {
        let rows = sqlx::query(
            "SELECT * FROM instances WHERE started_at IS NOT NULL AND started_at < $1 \
             AND (finished_at IS NULL OR finished_at > $2) ORDER BY id",
        )
        .bind(ms(to))
        .bind(ms(from))
        .fetch_all(self.pool())
        .await?;
        let mut items = rows.iter().map(instance).collect::<Result<Vec<_>>>()?;
        // Events in batches, as listings read them.
        for chunk in items.chunks_mut(500) {
            let ids: Vec<InstanceId> = chunk.iter().map(|i| i.id.clone()).collect();
            let mut events = self.events(&ids).await?;
            for i in chunk {
                i.events = events.remove(&i.id).unwrap_or_default();
            }
        }
        Ok(items)
    }
}
