//! API keys. Only a SHA-256 hash of the secret is stored: the secrets
//! are 32 random bytes, so a fast hash is as safe as a slow one and keeps
//! authentication cheap on every request.

use chrono::{DateTime, Utc};
use flotilla_core::api::ApiKey;
use flotilla_core::id::{KeyId, TenantId};
use flotilla_core::tenant::Role;
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{at, ms, PageOf, PageReq, Result, Store, StoreError};

/// A key to insert.
#[derive(Debug, Clone)]
pub struct NewKey {
    /// Id.
    pub id: KeyId,
    /// Owner.
    pub tenant_id: TenantId,
    /// Role.
    pub role: Role,
    /// Label.
    pub name: String,
    /// First characters of the secret.
    pub prefix: String,
    /// Hex SHA-256 of the secret.
    pub secret_hash: String,
}

fn key(row: &AnyRow) -> Result<ApiKey> {
    let role: String = row.try_get("role")?;
    let revoked: Option<i64> = row.try_get("revoked_at")?;
    Ok(ApiKey {
        id: KeyId::from_trusted(row.try_get("id")?),
        tenant_id: TenantId::from_trusted(row.try_get("tenant_id")?),
        role: Role::parse(&role).ok_or_else(|| StoreError::Corrupt(format!("role `{role}`")))?,
        name: row.try_get("name")?,
        prefix: row.try_get("prefix")?,
        created_at: at(row.try_get("created_at")?),
        revoked_at: revoked.map(at),
        endpoints: row
            .try_get::<Option<String>, _>("endpoints")?
            .map(|e| crate::json(&e, "key endpoints"))
            .transpose()?,
    })
}

impl Store {
    /// Stores a new key.
    pub async fn create_key(&self, k: &NewKey, now: DateTime<Utc>) -> Result<ApiKey> {
        sqlx::query(
            "INSERT INTO api_keys (id, tenant_id, role, name, prefix, secret_hash, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(k.id.as_str())
        .bind(k.tenant_id.as_str())
        .bind(k.role.as_str())
        .bind(&k.name)
        .bind(&k.prefix)
        .bind(&k.secret_hash)
        .bind(ms(now))
        .execute(self.writer())
        .await?;
        self.key(&k.id).await
    }

    /// Makes `id` an inference key limited to `endpoints` (empty: all of
    /// its tenant's).
    pub async fn set_key_endpoints(
        &self,
        id: &KeyId,
        endpoints: &[flotilla_core::id::EndpointId],
    ) -> Result<ApiKey> {
        sqlx::query("UPDATE api_keys SET endpoints = $1 WHERE id = $2")
            .bind(crate::to_json(&endpoints))
            .bind(id.as_str())
            .execute(self.writer())
            .await?;
        self.key(id).await
    }

    /// A key by id.
    pub async fn key(&self, id: &KeyId) -> Result<ApiKey> {
        let row = sqlx::query("SELECT * FROM api_keys WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::NotFound("key"))?;
        key(&row)
    }

    /// The live (not revoked) key whose secret hashes to `hash`.
    pub async fn key_by_hash(&self, hash: &str) -> Result<Option<ApiKey>> {
        let row =
            sqlx::query("SELECT * FROM api_keys WHERE secret_hash = $1 AND revoked_at IS NULL")
                .bind(hash)
                .fetch_optional(self.pool())
                .await?;
        row.as_ref().map(key).transpose()
    }

    /// Keys, optionally of one tenant.
    pub async fn list_keys(
        &self,
        only: Option<&TenantId>,
        page: &PageReq,
    ) -> Result<PageOf<ApiKey>> {
        let rows = self
            .page_rows(
                "SELECT * FROM api_keys WHERE id > $1 AND ($2 = '' OR tenant_id = $2) \
                 ORDER BY id LIMIT $3",
                only,
                page,
            )
            .await?;
        let items = rows.iter().map(key).collect::<Result<Vec<_>>>()?;
        Ok(PageOf::from_overfetch(items, page, |k| k.id.to_string()))
    }

    /// Revokes a key; revoking twice is a no-op. Refuses ([`StoreError::Conflict`])
    /// to revoke the last live operator key: nobody could then manage
    /// tenants or mint an operator key again short of editing the database.
    /// The count and the update share one transaction that holds SQLite's
    /// write lock, or on PostgreSQL locks every live operator key's row, so
    /// two operators revoking each other's keys at once cannot both win.
    pub async fn revoke_key(&self, id: &KeyId, now: DateTime<Utc>) -> Result<ApiKey> {
        let mut tx = self.begin().await?;
        let lock = match self.backend() {
            crate::Backend::Postgres => {
                "SELECT id FROM api_keys WHERE role = 'operator' AND revoked_at IS NULL FOR UPDATE"
            }
            crate::Backend::Sqlite => {
                "SELECT id FROM api_keys WHERE role = 'operator' AND revoked_at IS NULL"
            }
        };
        let live_operators: Vec<String> = sqlx::query_scalar(lock).fetch_all(&mut *tx).await?;
        if live_operators.len() == 1 && live_operators[0] == id.as_str() {
            return Err(StoreError::Conflict(
                "this is the last operator key: mint another operator key before revoking it"
                    .into(),
            ));
        }
        sqlx::query("UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL")
            .bind(ms(now))
            .bind(id.as_str())
            .execute(&mut *tx)
            .await?;
        crate::txn::commit(tx).await?;
        self.key(id).await
    }

    /// Whether any live operator key exists (bootstrap runs once).
    pub async fn has_operator_key(&self) -> Result<bool> {
        let row = sqlx::query(
            "SELECT COUNT(*) AS n FROM api_keys WHERE role = 'operator' AND revoked_at IS NULL",
        )
        .fetch_one(self.pool())
        .await?;
        Ok(row.try_get::<i64, _>("n")? > 0)
    }
}
