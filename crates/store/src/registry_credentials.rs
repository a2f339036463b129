//! A tenant's registry credentials. The secret is sealed with the
//! server's [`SecretKey`] before it is written and opened only by
//! [`Store::registry_auth`], which the server calls when it builds the
//! assignment of an instance whose image is on that registry.

use chrono::{DateTime, Utc};
use flotilla_core::id::{RegistryCredentialId, TenantId};
use flotilla_core::registry::{CreateRegistryCredential, RegistryAuth, RegistryCredential};
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::secrets::SecretKey;
use crate::{at, ms, Result, Store};

fn credential(row: &AnyRow) -> Result<RegistryCredential> {
    Ok(RegistryCredential {
        id: RegistryCredentialId::from_trusted(row.try_get("id")?),
        registry: row.try_get("registry")?,
        username: row.try_get("username")?,
        created_at: at(row.try_get("created_at")?),
    })
}

/// What a sealed secret is bound to: the row's identity, so that a sealed
/// value copied into another row (another tenant's) does not open.
fn context(id: &str, tenant: &str, registry: &str, username: &str) -> String {
    format!("registry-credential\n{id}\n{tenant}\n{registry}\n{username}")
}

impl Store {
    /// Stores `req` (validated) for `tenant`, its secret sealed with `key`.
    /// A second credential for the same registry is `AlreadyExists`.
    pub async fn add_registry_credential(
        &self,
        id: &RegistryCredentialId,
        tenant: &TenantId,
        req: &CreateRegistryCredential,
        key: &SecretKey,
        now: DateTime<Utc>,
    ) -> Result<RegistryCredential> {
        let sealed = key.seal(
            &req.secret,
            &context(id.as_str(), tenant.as_str(), &req.registry, &req.username),
        );
        let mut tx = self.begin().await?;
        let taken = sqlx::query(
            "SELECT 1 AS one FROM registry_credentials WHERE tenant_id = $1 AND registry = $2",
        )
        .bind(tenant.as_str())
        .bind(&req.registry)
        .fetch_optional(&mut *tx)
        .await?;
        if taken.is_some() {
            return Err(crate::StoreError::AlreadyExists(format!(
                "a credential for registry `{}`",
                req.registry
            )));
        }
        sqlx::query(
            "INSERT INTO registry_credentials (id, tenant_id, registry, username, secret_sealed, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(id.as_str())
        .bind(tenant.as_str())
        .bind(&req.registry)
        .bind(&req.username)
        .bind(&sealed)
        .bind(ms(now))
        .execute(&mut *tx)
        .await?;
        crate::txn::commit(tx).await?;
        Ok(RegistryCredential {
            id: id.clone(),
            registry: req.registry.clone(),
            username: req.username.clone(),
            created_at: at(ms(now)),
        })
    }

    /// The stored, sealed form of a credential's secret, as it lies in the
    /// database: for audits of what is at rest (it must never contain the
    /// secret), never for use.
    pub async fn sealed_registry_secret(&self, id: &RegistryCredentialId) -> Result<String> {
        let row = sqlx::query("SELECT secret_sealed FROM registry_credentials WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(self.pool())
            .await?
            .ok_or(crate::StoreError::NotFound("registry credential"))?;
        Ok(row.try_get("secret_sealed")?)
    }

    /// The tenant's credentials, by registry, without their secrets.
    pub async fn registry_credentials(&self, tenant: &TenantId) -> Result<Vec<RegistryCredential>> {
        let rows = sqlx::query(
            "SELECT id, registry, username, created_at FROM registry_credentials \
             WHERE tenant_id = $1 ORDER BY registry",
        )
        .bind(tenant.as_str())
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(credential).collect()
    }

    /// Deletes one of the tenant's credentials; another tenant's is
    /// `NotFound`, like a missing one.
    pub async fn delete_registry_credential(
        &self,
        tenant: &TenantId,
        id: &RegistryCredentialId,
    ) -> Result<()> {
        self.delete_tenant_row(
            "registry_credentials",
            tenant,
            id.as_str(),
            "registry credential",
        )
        .await
    }

    /// The tenant's login for `registry`, its secret opened with `key`;
    /// `None` when the tenant stored none for it. A secret that does not
    /// open (another key, an altered row) is an error, never a silent
    /// anonymous pull.
    pub async fn registry_auth(
        &self,
        tenant: &TenantId,
        registry: &str,
        key: &SecretKey,
    ) -> Result<Option<RegistryAuth>> {
        let row = sqlx::query(
            "SELECT id, registry, username, secret_sealed FROM registry_credentials \
             WHERE tenant_id = $1 AND registry = $2",
        )
        .bind(tenant.as_str())
        .bind(registry)
        .fetch_optional(self.pool())
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let id: String = row.try_get("id")?;
        let registry: String = row.try_get("registry")?;
        let username: String = row.try_get("username")?;
        let sealed: String = row.try_get("secret_sealed")?;
        let secret = key.open(
            &sealed,
            &context(&id, tenant.as_str(), &registry, &username),
        )?;
        Ok(Some(RegistryAuth {
            registry,
            username,
            secret,
        }))
    }
}
