//! Fleet-wide counts for `/metrics`: the queue, work by tenant, endpoints'
//! replica targets, budget alerts. Aggregates read in one query each, so a
//! scrape costs a few indexed scans whatever the fleet's size.

use chrono::{DateTime, Utc};
use flotilla_core::id::{EndpointId, TenantId};
use sqlx::Row;

use crate::{at, Result, Store};

/// Waiting work of one kind.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueStat {
    /// `instance` (pending) or `job` (queued).
    pub kind: &'static str,
    /// How many wait.
    pub depth: u64,
    /// When the longest-waiting one was created.
    pub oldest: Option<DateTime<Utc>>,
}

/// Live instances of one tenant in one state, and the GPUs they hold.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantWork {
    /// The tenant.
    pub tenant: TenantId,
    /// `pending`, `scheduled`, `starting`, `running` or `lost`.
    pub state: String,
    /// Instances.
    pub instances: u64,
    /// GPUs they asked for.
    pub gpus: u64,
}

impl Store {
    /// Pending instances and queued jobs: how many, and since when the
    /// oldest waits.
    pub async fn queue_stats(&self) -> Result<Vec<QueueStat>> {
        let mut out = Vec::new();
        for (kind, sql) in [
            (
                "instance",
                "SELECT COUNT(*) AS n, MIN(created_at) AS oldest FROM instances WHERE state = 'pending'",
            ),
            (
                "job",
                "SELECT COUNT(*) AS n, MIN(created_at) AS oldest FROM jobs WHERE state = 'queued'",
            ),
        ] {
            let row = sqlx::query(sql).fetch_one(self.pool()).await?;
            out.push(QueueStat {
                kind,
                depth: row.try_get::<i64, _>("n")?.max(0) as u64,
                oldest: row.try_get::<Option<i64>, _>("oldest")?.map(at),
            });
        }
        Ok(out)
    }

    /// Live (not final) instances by tenant and state.
    pub async fn tenant_work(&self) -> Result<Vec<TenantWork>> {
        let rows = sqlx::query(
            "SELECT tenant_id, state, COUNT(*) AS n, CAST(SUM(gpus) AS BIGINT) AS g FROM instances \
             WHERE state IN ('pending', 'scheduled', 'starting', 'running', 'lost') \
             GROUP BY tenant_id, state ORDER BY tenant_id, state",
        )
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(TenantWork {
                    tenant: TenantId::from_trusted(r.try_get("tenant_id")?),
                    state: r.try_get("state")?,
                    instances: r.try_get::<i64, _>("n")?.max(0) as u64,
                    gpus: r.try_get::<Option<i64>, _>("g")?.unwrap_or(0).max(0) as u64,
                })
            })
            .collect()
    }

    /// Every live endpoint's replica target as its autoscaler last decided
    /// (`None` before its first decision).
    pub async fn endpoint_targets(&self) -> Result<Vec<(EndpointId, String, Option<u32>)>> {
        let rows = sqlx::query(
            "SELECT id, tenant_id, desired FROM endpoints WHERE deleted_at IS NULL ORDER BY id",
        )
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    EndpointId::from_trusted(r.try_get("id")?),
                    r.try_get("tenant_id")?,
                    r.try_get::<Option<i64>, _>("desired")?
                        .and_then(|d| u32::try_from(d).ok()),
                ))
            })
            .collect()
    }

    /// For each tenant with budget alerts, the highest threshold (percent
    /// of its limit) alerted in its latest period: 100 or more means the
    /// budget is spent.
    pub async fn budget_alert_levels(&self) -> Result<Vec<(TenantId, u32)>> {
        let rows = sqlx::query(
            "SELECT a.tenant_id AS tenant_id, CAST(MAX(a.threshold) AS BIGINT) AS t FROM budget_alerts a \
             WHERE a.period_start = (SELECT MAX(b.period_start) FROM budget_alerts b WHERE b.tenant_id = a.tenant_id) \
             GROUP BY a.tenant_id ORDER BY a.tenant_id",
        )
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    TenantId::from_trusted(r.try_get("tenant_id")?),
                    u32::try_from(r.try_get::<i64, _>("t")?.max(0)).unwrap_or(u32::MAX),
                ))
            })
            .collect()
    }
}
