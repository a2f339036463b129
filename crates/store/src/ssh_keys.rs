//! A tenant's registered SSH public keys. The server parses a key before
//! it is stored (the store keeps its canonical form and fingerprint) and
//! reads the tenant's keys at every SSH login, so a removed key stops
//! letting anyone in at once.

use flotilla_core::id::{SshKeyId, TenantId};
use flotilla_core::ssh_key::SshKey;
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{at, ms, Result, Store, StoreError};

fn ssh_key(row: &AnyRow) -> Result<SshKey> {
    Ok(SshKey {
        id: SshKeyId::from_trusted(row.try_get("id")?),
        name: row.try_get("name")?,
        algorithm: row.try_get("algorithm")?,
        fingerprint: row.try_get("fingerprint")?,
        public_key: row.try_get("public_key")?,
        created_at: at(row.try_get("created_at")?),
    })
}

const COLUMNS: &str = "id, name, algorithm, fingerprint, public_key, created_at";

impl Store {
    /// Stores `key` (parsed by the caller: its fingerprint and canonical
    /// form) for `tenant`. A key whose fingerprint the tenant registered
    /// already is `AlreadyExists`.
    pub async fn add_ssh_key(&self, tenant: &TenantId, key: &SshKey) -> Result<SshKey> {
        let mut tx = self.begin().await?;
        let inserted = sqlx::query(
            "INSERT INTO ssh_keys (id, tenant_id, name, algorithm, fingerprint, public_key, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(key.id.as_str())
        .bind(tenant.as_str())
        .bind(&key.name)
        .bind(&key.algorithm)
        .bind(&key.fingerprint)
        .bind(&key.public_key)
        .bind(ms(key.created_at))
        .execute(&mut *tx)
        .await;
        if let Err(e) = inserted {
            return Err(match StoreError::from(e) {
                StoreError::AlreadyExists(_) => {
                    StoreError::AlreadyExists(format!("the SSH key {}", key.fingerprint))
                }
                other => other,
            });
        }
        crate::txn::commit(tx).await?;
        Ok(SshKey {
            created_at: at(ms(key.created_at)),
            ..key.clone()
        })
    }

    /// The tenant's keys, oldest first.
    pub async fn ssh_keys(&self, tenant: &TenantId) -> Result<Vec<SshKey>> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM ssh_keys WHERE tenant_id = $1 ORDER BY created_at, id"
        ))
        .bind(tenant.as_str())
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(ssh_key).collect()
    }

    /// The tenant's key with this fingerprint (`SHA256:…`), if it has one:
    /// what an SSH login checks the key it was offered against.
    pub async fn ssh_key_by_fingerprint(
        &self,
        tenant: &TenantId,
        fingerprint: &str,
    ) -> Result<Option<SshKey>> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM ssh_keys WHERE tenant_id = $1 AND fingerprint = $2"
        ))
        .bind(tenant.as_str())
        .bind(fingerprint)
        .fetch_optional(self.pool())
        .await?;
        row.as_ref().map(ssh_key).transpose()
    }

    /// Removes one of the tenant's keys; another tenant's is `NotFound`,
    /// like a missing one.
    pub async fn delete_ssh_key(&self, tenant: &TenantId, id: &SshKeyId) -> Result<()> {
        self.delete_tenant_row("ssh_keys", tenant, id.as_str(), "SSH key")
            .await
    }
}
