//! Marketplace providers: a provider is a tenant offering machines. Nodes
//! it registers carry its id, so the usage they carry can be paid out to
//! it.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use flotilla_core::id::{NodeId, ProviderId, TenantId};
use sqlx::Row;

use crate::{ms, Result, Store, StoreError};

impl Store {
    /// The provider of `tenant`, created with `new_id` on first use.
    pub async fn provider_for_tenant(
        &self,
        tenant: &TenantId,
        new_id: &ProviderId,
        now: DateTime<Utc>,
    ) -> Result<ProviderId> {
        sqlx::query(
            "INSERT INTO providers (id, tenant_id, created_at) VALUES ($1, $2, $3) \
             ON CONFLICT (tenant_id) DO NOTHING",
        )
        .bind(new_id.as_str())
        .bind(tenant.as_str())
        .bind(ms(now))
        .execute(self.writer())
        .await?;
        self.provider_of_tenant(tenant)
            .await?
            .ok_or(StoreError::NotFound("provider"))
    }

    /// The provider of `tenant`, if it is one.
    pub async fn provider_of_tenant(&self, tenant: &TenantId) -> Result<Option<ProviderId>> {
        let row = sqlx::query("SELECT id FROM providers WHERE tenant_id = $1")
            .bind(tenant.as_str())
            .fetch_optional(self.pool())
            .await?;
        row.map(|r| Ok(ProviderId::from_trusted(r.try_get("id")?)))
            .transpose()
    }

    /// Every provider and its tenant, by provider id.
    pub async fn providers(&self) -> Result<Vec<(ProviderId, TenantId)>> {
        let rows = sqlx::query("SELECT id, tenant_id FROM providers ORDER BY id")
            .fetch_all(self.pool())
            .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    ProviderId::from_trusted(r.try_get("id")?),
                    TenantId::from_trusted(r.try_get("tenant_id")?),
                ))
            })
            .collect()
    }

    /// Marks `node` as offered by `provider` (`None`: the operator's own).
    pub async fn set_node_provider(
        &self,
        node: &NodeId,
        provider: Option<&ProviderId>,
    ) -> Result<()> {
        let n = sqlx::query("UPDATE nodes SET provider_id = $1 WHERE id = $2")
            .bind(provider.map(|p| p.as_str().to_string()))
            .bind(node.as_str())
            .execute(self.writer())
            .await?
            .rows_affected();
        crate::touched(n, "node")
    }

    /// The provider of every node that has one.
    pub async fn node_providers(&self) -> Result<BTreeMap<NodeId, ProviderId>> {
        let rows = sqlx::query("SELECT id, provider_id FROM nodes WHERE provider_id IS NOT NULL")
            .fetch_all(self.pool())
            .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    NodeId::from_trusted(r.try_get("id")?),
                    ProviderId::from_trusted(r.try_get("provider_id")?),
                ))
            })
            .collect()
    }
}
