//! The versioned price catalog and the recorded spot price series.
//!
//! Both are append-only: a price version is inserted once and never
//! changed (a new price is a new version with a later `effective_from`),
//! and a spot point is inserted once per model and instant. So every
//! charge on an invoice can be traced to the row that priced it, whenever
//! the invoice is recomputed.

use std::collections::BTreeMap;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use flotilla_billing::price::{PriceVersion, SpotPoint};
use rust_decimal::Decimal;
use sqlx::Row;

use crate::{at, json, ms, to_json, Result, Store, StoreError};

/// GPUs of one model in the pool: how many ready GPUs there are and how
/// many of them an instance holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelUse {
    /// GPU model.
    pub model: String,
    /// GPUs on ready, uncordoned nodes.
    pub total: u64,
    /// Of those, GPUs held by an instance.
    pub used: u64,
}

pub(crate) fn decimal(s: &str, what: &str) -> Result<Decimal> {
    Decimal::from_str(s).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

impl Store {
    /// Every published price version, oldest first.
    pub async fn price_versions(&self) -> Result<Vec<PriceVersion>> {
        let rows = sqlx::query("SELECT body FROM price_versions ORDER BY version")
            .fetch_all(self.pool())
            .await?;
        rows.iter()
            .map(|r| json(&r.try_get::<String, _>("body")?, "price version"))
            .collect()
    }

    /// Inserts a price version; `Conflict` when its number is taken (two
    /// operators published at once: the second must re-read and retry).
    /// The caller has checked it with `PriceBook::publish`.
    pub async fn insert_price_version(&self, v: &PriceVersion, now: DateTime<Utc>) -> Result<()> {
        sqlx::query(
            "INSERT INTO price_versions (version, effective_from, body, created_at) \
             VALUES ($1, $2, $3, $4)",
        )
        .bind(i64::from(v.version))
        .bind(ms(v.effective_from))
        .bind(to_json(v))
        .bind(ms(now))
        .execute(self.writer())
        .await
        .map_err(|e| match StoreError::from(e) {
            StoreError::AlreadyExists(_) => StoreError::Conflict(format!(
                "price version {} was published meanwhile; read the catalog again",
                v.version
            )),
            other => other,
        })?;
        Ok(())
    }

    /// Stores `v` as the first version unless a first version exists;
    /// true when it was stored. Several servers starting at once agree on
    /// one first version.
    pub async fn seed_price_version(&self, v: &PriceVersion, now: DateTime<Utc>) -> Result<bool> {
        let n = sqlx::query(
            "INSERT INTO price_versions (version, effective_from, body, created_at) \
             VALUES ($1, $2, $3, $4) ON CONFLICT (version) DO NOTHING",
        )
        .bind(i64::from(v.version))
        .bind(ms(v.effective_from))
        .bind(to_json(v))
        .bind(ms(now))
        .execute(self.writer())
        .await?
        .rows_affected();
        Ok(n == 1)
    }

    /// Every recorded spot point in force before `until`, in time order per
    /// model.
    pub async fn spot_points(&self, until: DateTime<Utc>) -> Result<Vec<SpotPoint>> {
        let rows = sqlx::query(
            "SELECT model, at_ms, utilisation, per_gpu_second, price_version FROM spot_points \
             WHERE at_ms < $1 ORDER BY model, at_ms",
        )
        .bind(ms(until))
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(spot_point).collect()
    }

    /// Recorded points of `model` in force from `[from, to)`, oldest first,
    /// at most `limit` (clamped to 1..=1000), and whether more follow.
    pub async fn spot_history(
        &self,
        model: &str,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        limit: u32,
    ) -> Result<(Vec<SpotPoint>, bool)> {
        let limit = limit.clamp(1, 1000);
        let rows = sqlx::query(
            "SELECT model, at_ms, utilisation, per_gpu_second, price_version FROM spot_points \
             WHERE model = $1 AND at_ms >= $2 AND at_ms < $3 ORDER BY at_ms LIMIT $4",
        )
        .bind(model)
        .bind(ms(from))
        .bind(ms(to))
        .bind(i64::from(limit) + 1)
        .fetch_all(self.pool())
        .await?;
        let mut out = rows.iter().map(spot_point).collect::<Result<Vec<_>>>()?;
        let more = out.len() > limit as usize;
        out.truncate(limit as usize);
        Ok((out, more))
    }

    /// The latest recorded point of each model.
    pub async fn latest_spot_points(&self) -> Result<BTreeMap<String, SpotPoint>> {
        let rows = sqlx::query(
            "SELECT p.model, p.at_ms, p.utilisation, p.per_gpu_second, p.price_version \
             FROM spot_points p JOIN (SELECT model, MAX(at_ms) AS m FROM spot_points GROUP BY model) l \
             ON p.model = l.model AND p.at_ms = l.m",
        )
        .fetch_all(self.pool())
        .await?;
        let mut out = BTreeMap::new();
        for r in &rows {
            let p = spot_point(r)?;
            out.insert(p.model.clone(), p);
        }
        Ok(out)
    }

    /// Records a spot point; false when the model already has one at that
    /// instant (a replica recorded it first).
    pub async fn record_spot_point(&self, p: &SpotPoint) -> Result<bool> {
        let n = sqlx::query(
            "INSERT INTO spot_points (model, at_ms, utilisation, per_gpu_second, price_version) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (model, at_ms) DO NOTHING",
        )
        .bind(&p.model)
        .bind(ms(p.at))
        .bind(p.utilisation.to_string())
        .bind(p.per_gpu_second.to_string())
        .bind(i64::from(p.price_version))
        .execute(self.writer())
        .await?
        .rows_affected();
        Ok(n == 1)
    }

    /// GPUs per model on ready, uncordoned nodes, and how many are held:
    /// the utilisation spot prices are derived from.
    pub async fn gpu_pool_use(&self) -> Result<Vec<ModelUse>> {
        let rows = sqlx::query(
            "SELECT g.model, COUNT(*) AS total, \
               CAST(SUM(CASE WHEN g.instance_id IS NULL AND g.used_milli = 0 THEN 0 ELSE 1 END) AS BIGINT) AS used \
             FROM gpus g JOIN nodes n ON n.id = g.node_id \
             WHERE n.state = 'ready' AND n.cordoned = 0 GROUP BY g.model ORDER BY g.model",
        )
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(ModelUse {
                    model: r.try_get("model")?,
                    total: r.try_get::<i64, _>("total")?.max(0) as u64,
                    used: r.try_get::<i64, _>("used")?.max(0) as u64,
                })
            })
            .collect()
    }
}

fn spot_point(r: &sqlx::any::AnyRow) -> Result<SpotPoint> {
    let version: i64 = r.try_get("price_version")?;
    Ok(SpotPoint {
        model: r.try_get("model")?,
        at: at(r.try_get("at_ms")?),
        utilisation: decimal(&r.try_get::<String, _>("utilisation")?, "spot utilisation")?,
        per_gpu_second: decimal(&r.try_get::<String, _>("per_gpu_second")?, "spot price")?,
        price_version: u32::try_from(version)
            .map_err(|_| StoreError::Corrupt(format!("spot price version {version}")))?,
    })
}
