//! Tenants and their quotas.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use flotilla_core::api::Tenant;
use flotilla_core::id::TenantId;
use flotilla_core::quota::{Quota, Usage};
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{at, json, ms, to_json, PageOf, PageReq, Result, Store, StoreError};

fn tenant(row: &AnyRow) -> Result<Tenant> {
    Ok(Tenant {
        id: TenantId::from_trusted(row.try_get("id")?),
        name: row.try_get("name")?,
        created_at: at(row.try_get("created_at")?),
    })
}

pub(crate) fn quota(row: &AnyRow) -> Result<Quota> {
    let total: Option<i64> = row.try_get("quota_gpus_total")?;
    let per: String = row.try_get("quota_gpus_per_model")?;
    let small = |v: Option<i64>| v.map(|t| t.clamp(0, u32::MAX as i64) as u32);
    Ok(Quota {
        gpus_total: small(total),
        gpus_per_model: json(&per, "tenant quota")?,
        gpus_guaranteed: small(row.try_get("quota_gpus_guaranteed")?),
        weight: small(row.try_get("fair_share_weight")?),
    })
}

/// Milli-GPU one GPU of an instance row takes: a MIG profile its compute
/// slices of 7 (rounded down, as placement counts them), a fraction its
/// share, whole GPUs 1000. Quotas count shares by their share.
const MILLI_PER_GPU_SQL: &str = "(CASE WHEN mig_compute IS NOT NULL THEN (mig_compute * 1000) / 7 \
     WHEN share_milli IS NOT NULL THEN share_milli ELSE 1000 END)";

/// GPUs held by a tenant's live instances. Usable inside a transaction.
pub(crate) async fn usage_in<'c, E>(exec: E, tenant: &TenantId) -> Result<Usage>
where
    E: sqlx::Executor<'c, Database = sqlx::Any>,
{
    let rows = sqlx::query(&format!(
        "SELECT gpu_model, CAST(SUM(gpus * {MILLI_PER_GPU_SQL}) AS BIGINT) AS milli FROM instances \
         WHERE tenant_id = $1 AND state IN ('scheduled', 'starting', 'running') \
         GROUP BY gpu_model",
    ))
    .bind(tenant.as_str())
    .fetch_all(exec)
    .await?;
    let mut usage = Usage::default();
    for r in rows {
        let model: Option<String> = r.try_get("gpu_model")?;
        let milli: i64 = r.try_get("milli")?;
        // Counted as that many thousandths of one GPU.
        let milli = milli.clamp(0, u32::MAX as i64) as u32;
        usage.add(model.as_deref(), milli, 1);
    }
    Ok(usage)
}

/// Also counts GPUs that pending instances and queued jobs will need, so admission at
/// create time cannot be raced past by a burst of requests. Summed in the
/// database by shape (model, allowed models, share), so the answer is a
/// few rows however long the tenant's queue is.
pub(crate) async fn committed_in<'c, E>(exec: E, tenant: &TenantId) -> Result<Usage>
where
    E: sqlx::Executor<'c, Database = sqlx::Any>,
{
    let rows = sqlx::query(&format!(
        "SELECT gpu_model, gpu_types, milli, CAST(SUM(gpus) AS BIGINT) AS gpus FROM (\
         SELECT gpu_model, gpu_types, gpus, {MILLI_PER_GPU_SQL} AS milli FROM instances \
         WHERE tenant_id = $1 AND state IN ('pending', 'scheduled', 'starting', 'running') \
         UNION ALL SELECT CAST(NULL AS TEXT) AS gpu_model, gpu_types, gpus, 1000 AS milli FROM jobs \
         WHERE tenant_id = $1 AND state = 'queued') live \
         GROUP BY gpu_model, gpu_types, milli",
    ))
    .bind(tenant.as_str())
    .fetch_all(exec)
    .await?;
    let mut usage = Usage::default();
    for r in rows {
        let n: i64 = r.try_get("gpus")?;
        let n = n.clamp(0, u32::MAX as i64) as u32;
        let milli: i64 = r.try_get("milli")?;
        let milli = milli.clamp(1, 1000) as u16;
        let model: Option<String> = r.try_get("gpu_model")?;
        let model = match model {
            Some(m) => Some(m),
            None => {
                // A pending request pinned to exactly one model will take it.
                let types: Vec<String> = json(&r.try_get::<String, _>("gpu_types")?, "gpu_types")?;
                (types.len() == 1).then(|| types[0].clone())
            }
        };
        usage.add(model.as_deref(), n, milli);
    }
    Ok(usage)
}

/// Admission of `milli` more milli-GPU of any of `models` for `tenant`
/// under `quota`, inside the transaction that locked the tenant row.
/// A quota without limits admits without counting what the tenant holds:
/// that count reads every live work of the tenant, queued ones included,
/// so it would make each create slower the longer the queue, for an
/// answer that cannot be no.
pub(crate) async fn admit_in(
    conn: &mut sqlx::AnyConnection,
    tenant: &TenantId,
    quota: &Quota,
    models: &[String],
    milli: u64,
) -> Result<()> {
    if quota.limits_nothing() {
        return Ok(());
    }
    let committed = committed_in(conn, tenant).await?;
    quota.admit_milli(&committed, models, milli)?;
    Ok(())
}

impl Store {
    /// Deletes row `id` of `table` if `tenant` owns it; another tenant's
    /// row is `NotFound` (naming `what`) like a missing one, so a caller
    /// learns nothing about ids it does not own.
    pub(crate) async fn delete_tenant_row(
        &self,
        table: &'static str,
        tenant: &TenantId,
        id: &str,
        what: &'static str,
    ) -> Result<()> {
        let mut tx = self.begin().await?;
        let n = sqlx::query(&format!(
            "DELETE FROM {table} WHERE id = $1 AND tenant_id = $2"
        ))
        .bind(id)
        .bind(tenant.as_str())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        crate::txn::commit(tx).await?;
        crate::touched(n, what)
    }

    /// Creates a tenant; `AlreadyExists` when the name is taken.
    pub async fn create_tenant(
        &self,
        id: &TenantId,
        name: &str,
        now: DateTime<Utc>,
    ) -> Result<Tenant> {
        sqlx::query(
            "INSERT INTO tenants (id, name, created_at, updated_at) VALUES ($1, $2, $3, $3)",
        )
        .bind(id.as_str())
        .bind(name)
        .bind(ms(now))
        .execute(self.writer())
        .await
        .map_err(|e| match StoreError::from(e) {
            StoreError::AlreadyExists(_) => StoreError::AlreadyExists(format!("tenant `{name}`")),
            other => other,
        })?;
        Ok(Tenant {
            id: id.clone(),
            name: name.to_string(),
            created_at: crate::at(ms(now)),
        })
    }

    /// A tenant by id.
    pub async fn tenant(&self, id: &TenantId) -> Result<Tenant> {
        let row = sqlx::query("SELECT * FROM tenants WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::NotFound("tenant"))?;
        tenant(&row)
    }

    /// A tenant by name.
    pub async fn tenant_by_name(&self, name: &str) -> Result<Option<Tenant>> {
        let row = sqlx::query("SELECT * FROM tenants WHERE name = $1")
            .bind(name)
            .fetch_optional(self.pool())
            .await?;
        row.as_ref().map(tenant).transpose()
    }

    /// Tenants by id; `only` restricts to one tenant (non-operators).
    pub async fn list_tenants(
        &self,
        only: Option<&TenantId>,
        page: &PageReq,
    ) -> Result<PageOf<Tenant>> {
        let rows = self
            .page_rows(
                "SELECT * FROM tenants WHERE id > $1 AND ($2 = '' OR id = $2) ORDER BY id LIMIT $3",
                only,
                page,
            )
            .await?;
        let items = rows.iter().map(tenant).collect::<Result<Vec<_>>>()?;
        Ok(PageOf::from_overfetch(items, page, |t| t.id.to_string()))
    }

    /// A tenant's quota.
    pub async fn quota(&self, id: &TenantId) -> Result<Quota> {
        let row =
            sqlx::query(
                "SELECT quota_gpus_total, quota_gpus_per_model, quota_gpus_guaranteed, fair_share_weight \
                 FROM tenants WHERE id = $1",
            )
                .bind(id.as_str())
                .fetch_optional(self.pool())
                .await?
                .ok_or(StoreError::NotFound("tenant"))?;
        quota(&row)
    }

    /// Every tenant's quota that sets a guarantee or a weight: what fair
    /// share and reclaiming need, in one read per scheduling pass.
    pub async fn sharing_quotas(&self) -> Result<BTreeMap<TenantId, Quota>> {
        let rows = sqlx::query(
            "SELECT id, quota_gpus_total, quota_gpus_per_model, quota_gpus_guaranteed, fair_share_weight \
             FROM tenants WHERE quota_gpus_guaranteed IS NOT NULL OR fair_share_weight IS NOT NULL",
        )
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| Ok((TenantId::from_trusted(r.try_get("id")?), quota(r)?)))
            .collect()
    }

    /// Every tenant's quota that sets anything (a limit, a guarantee or a
    /// weight): what one scheduling pass needs, in one read. Tenants absent
    /// from the map have no quota.
    pub async fn quotas(&self) -> Result<BTreeMap<TenantId, Quota>> {
        quotas_in(&mut *self.pool().acquire().await?).await
    }

    /// Replaces a tenant's quota.
    pub async fn set_quota(&self, id: &TenantId, q: &Quota, now: DateTime<Utc>) -> Result<()> {
        let per: BTreeMap<&String, &u32> = q.gpus_per_model.iter().collect();
        let n = sqlx::query(
            "UPDATE tenants SET quota_gpus_total = $1, quota_gpus_per_model = $2, updated_at = $3, \
             quota_gpus_guaranteed = $5, fair_share_weight = $6 WHERE id = $4",
        )
        .bind(q.gpus_total.map(i64::from))
        .bind(to_json(&per))
        .bind(ms(now))
        .bind(id.as_str())
        .bind(q.gpus_guaranteed.map(i64::from))
        .bind(q.weight.map(i64::from))
        .execute(self.writer())
        .await?
        .rows_affected();
        crate::touched(n, "tenant")
    }

    /// GPUs a tenant's live instances hold.
    pub async fn usage(&self, id: &TenantId) -> Result<Usage> {
        usage_in(self.pool(), id).await
    }
}

/// [`Store::quotas`] on `conn`: a scheduling pass reads it inside its
/// one snapshot transaction ([`Store::pass_inputs`]).
pub(crate) async fn quotas_in(conn: &mut sqlx::AnyConnection) -> Result<BTreeMap<TenantId, Quota>> {
    let rows = sqlx::query(
            "SELECT id, quota_gpus_total, quota_gpus_per_model, quota_gpus_guaranteed, fair_share_weight \
             FROM tenants WHERE quota_gpus_total IS NOT NULL OR quota_gpus_per_model <> '{}' \
             OR quota_gpus_guaranteed IS NOT NULL OR fair_share_weight IS NOT NULL",
        )
        .fetch_all(&mut *conn)
        .await?;
    rows.iter()
        .map(|r| Ok((TenantId::from_trusted(r.try_get("id")?), quota(r)?)))
        .collect()
}
