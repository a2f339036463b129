//! Endpoints' opt-ins to automatic vertical moves, and their last move.

use chrono::{DateTime, Utc};
use flotilla_core::advice::{VerticalOptIn, VerticalStatus};
use flotilla_core::id::EndpointId;
use sqlx::Row;

use crate::{at, ms, Result, Store, StoreError};

impl Store {
    /// Opts `endpoint` in (or changes its opt-in); a change forgets the
    /// last move.
    pub async fn set_vertical(
        &self,
        endpoint: &EndpointId,
        opt_in: &VerticalOptIn,
        now: DateTime<Utc>,
    ) -> Result<VerticalStatus> {
        let classes = serde_json::to_string(&opt_in.classes)
            .map_err(|e| StoreError::Corrupt(format!("vertical classes: {e}")))?;
        let sustain = i64::try_from(opt_in.sustain_s.saturating_mul(1000)).unwrap_or(i64::MAX);
        let mut tx = self.begin().await?;
        sqlx::query("DELETE FROM endpoint_vertical WHERE endpoint_id = $1")
            .bind(endpoint.as_str())
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO endpoint_vertical (endpoint_id, classes, sustain_ms, opted_at) VALUES ($1, $2, $3, $4)",
        )
        .bind(endpoint.as_str())
        .bind(&classes)
        .bind(sustain)
        .bind(ms(now))
        .execute(&mut *tx)
        .await?;
        crate::txn::commit(tx).await?;
        self.vertical(endpoint)
            .await?
            .ok_or(StoreError::NotFound("vertical opt-in"))
    }

    /// The endpoint's opt-in, if any.
    pub async fn vertical(&self, endpoint: &EndpointId) -> Result<Option<VerticalStatus>> {
        let row = sqlx::query("SELECT * FROM endpoint_vertical WHERE endpoint_id = $1")
            .bind(endpoint.as_str())
            .fetch_optional(self.pool())
            .await?;
        let Some(r) = row else { return Ok(None) };
        let classes: String = r.try_get("classes")?;
        let classes: Vec<String> = serde_json::from_str(&classes)
            .map_err(|e| StoreError::Corrupt(format!("vertical classes: {e}")))?;
        Ok(Some(VerticalStatus {
            opt_in: VerticalOptIn {
                classes,
                sustain_s: (r.try_get::<i64, _>("sustain_ms")?.max(0) / 1000) as u64,
            },
            opted_at: at(r.try_get("opted_at")?),
            last_move: r.try_get("last_move")?,
            moved_at: r.try_get::<Option<i64>, _>("moved_at")?.map(at),
        }))
    }

    /// Records a move of `endpoint` (the caller rolled it out).
    pub async fn record_vertical_move(
        &self,
        endpoint: &EndpointId,
        what: &str,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let mut tx = self.begin().await?;
        sqlx::query(
            "UPDATE endpoint_vertical SET last_move = $1, moved_at = $2 WHERE endpoint_id = $3",
        )
        .bind(what)
        .bind(ms(now))
        .bind(endpoint.as_str())
        .execute(&mut *tx)
        .await?;
        crate::txn::commit(tx).await?;
        Ok(())
    }
}
