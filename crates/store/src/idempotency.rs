//! Stored answers of create requests, so that a client retrying with the
//! same `Idempotency-Key` gets the first answer instead of a second
//! resource.

use chrono::{DateTime, Utc};
use sqlx::Row;

use crate::{ms, Result, Store, StoreError};

/// What a key is known for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// First use: the caller handles the request, then completes or
    /// releases the key.
    New,
    /// Another request with this key is being handled now.
    InFlight,
    /// Seen before with the same request: replay this answer.
    Done {
        /// HTTP status.
        status: u16,
        /// Body.
        body: String,
    },
    /// Seen before with a different request body.
    Mismatch,
}

impl Store {
    /// Claims `key` within `scope` for a request whose hash is `hash`.
    pub async fn claim_idempotency_key(
        &self,
        scope: &str,
        key: &str,
        hash: &str,
        now: DateTime<Utc>,
    ) -> Result<Claim> {
        let inserted = sqlx::query(
            "INSERT INTO idempotency_keys (scope, idem_key, request_hash, created_at) VALUES ($1, $2, $3, $4)",
        )
        .bind(scope)
        .bind(key)
        .bind(hash)
        .bind(ms(now))
        .execute(self.writer())
        .await;
        match inserted {
            Ok(_) => return Ok(Claim::New),
            Err(e) => match StoreError::from(e) {
                StoreError::AlreadyExists(_) => {}
                other => return Err(other),
            },
        }
        let row = sqlx::query(
            "SELECT request_hash, status, response FROM idempotency_keys WHERE scope = $1 AND idem_key = $2",
        )
        .bind(scope)
        .bind(key)
        .fetch_one(self.pool())
        .await?;
        let stored: String = row.try_get("request_hash")?;
        if stored != hash {
            return Ok(Claim::Mismatch);
        }
        let status: Option<i64> = row.try_get("status")?;
        let body: Option<String> = row.try_get("response")?;
        Ok(match (status, body) {
            (Some(s), Some(b)) => Claim::Done {
                status: s.clamp(0, 999) as u16,
                body: b,
            },
            _ => Claim::InFlight,
        })
    }

    /// Records the answer of a claimed key.
    pub async fn complete_idempotency_key(
        &self,
        scope: &str,
        key: &str,
        status: u16,
        body: &str,
    ) -> Result<()> {
        sqlx::query("UPDATE idempotency_keys SET status = $1, response = $2 WHERE scope = $3 AND idem_key = $4")
            .bind(i64::from(status))
            .bind(body)
            .bind(scope)
            .bind(key)
            .execute(self.writer())
            .await?;
        Ok(())
    }

    /// Forgets a claimed key (the request failed; a retry may succeed).
    pub async fn release_idempotency_key(&self, scope: &str, key: &str) -> Result<()> {
        sqlx::query("DELETE FROM idempotency_keys WHERE scope = $1 AND idem_key = $2")
            .bind(scope)
            .bind(key)
            .execute(self.writer())
            .await?;
        Ok(())
    }

    /// Drops keys older than `before` (kept 24 h by the server).
    pub async fn expire_idempotency_keys(&self, before: DateTime<Utc>) -> Result<u64> {
        Ok(
            sqlx::query("DELETE FROM idempotency_keys WHERE created_at < $1")
                .bind(ms(before))
                .execute(self.writer())
                .await?
                .rows_affected(),
        )
    }
}
