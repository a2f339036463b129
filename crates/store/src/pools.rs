//! Replica pools for the autoscaling loop: the pool (its spec as JSON, the
//! last reported metrics, the last decision) and the instances it started.

use chrono::{DateTime, Utc};
use flotilla_core::api::{CreateReplicaPool, PoolMetrics, ReplicaPool};
use flotilla_core::id::{InstanceId, ReplicaPoolId, TenantId};
use flotilla_core::instance::InstanceState;
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{at, ms, Result, Store, StoreError};

/// A pool's replica: its instance and the instance's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolMember {
    /// The instance.
    pub instance_id: InstanceId,
    /// Its state.
    pub state: InstanceState,
    /// A stop was asked for (it is on its way out).
    pub stop_requested: bool,
}

impl PoolMember {
    /// Counts as a replica: not ended and not being stopped.
    pub fn is_live(&self) -> bool {
        !self.state.is_terminal() && !self.stop_requested
    }
}

fn corrupt(what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("{what}: {e}"))
}

impl Store {
    fn pool_row(&self, row: &AnyRow, replicas: Vec<InstanceId>) -> Result<ReplicaPool> {
        let spec: String = row.try_get("spec")?;
        let spec: CreateReplicaPool =
            serde_json::from_str(&spec).map_err(|e| corrupt("replica pool spec", e))?;
        let metrics: Option<String> = row.try_get("metrics")?;
        let metrics = metrics
            .map(|m| serde_json::from_str::<PoolMetrics>(&m))
            .transpose()
            .map_err(|e| corrupt("replica pool metrics", e))?;
        let desired: Option<i64> = row.try_get("desired")?;
        let metrics_at: Option<i64> = row.try_get("metrics_at")?;
        Ok(ReplicaPool {
            id: ReplicaPoolId::from_trusted(row.try_get("id")?),
            tenant_id: TenantId::from_trusted(row.try_get("tenant_id")?),
            name: spec.name,
            policy: spec.policy,
            max_replicas: spec.max_replicas,
            replica: spec.replica,
            desired_replicas: desired.and_then(|d| u32::try_from(d).ok()),
            reason: row.try_get("reason")?,
            metrics,
            metrics_at: metrics_at.map(at),
            replicas,
            created_at: at(row.try_get("created_at")?),
        })
    }

    /// Stores a new pool.
    pub async fn create_replica_pool(
        &self,
        id: &ReplicaPoolId,
        tenant: &TenantId,
        spec: &CreateReplicaPool,
        now: DateTime<Utc>,
    ) -> Result<ReplicaPool> {
        let json = serde_json::to_string(spec).map_err(|e| corrupt("replica pool spec", e))?;
        sqlx::query(
            "INSERT INTO replica_pools (id, tenant_id, name, spec, created_at) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(id.as_str())
        .bind(tenant.as_str())
        .bind(&spec.name)
        .bind(json)
        .bind(ms(now))
        .execute(self.writer())
        .await?;
        self.replica_pool(id).await
    }

    /// A pool by id, with its live replicas.
    pub async fn replica_pool(&self, id: &ReplicaPoolId) -> Result<ReplicaPool> {
        let row = sqlx::query("SELECT * FROM replica_pools WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::NotFound("replica pool"))?;
        let live = self
            .pool_members(id)
            .await?
            .into_iter()
            .filter(PoolMember::is_live)
            .map(|m| m.instance_id)
            .collect();
        self.pool_row(&row, live)
    }

    /// Every pool's id, oldest first (the autoscaling loop's work list).
    pub async fn replica_pool_ids(&self) -> Result<Vec<ReplicaPoolId>> {
        let rows = sqlx::query("SELECT id FROM replica_pools ORDER BY created_at, id")
            .fetch_all(self.pool())
            .await?;
        rows.iter()
            .map(|r| Ok(ReplicaPoolId::from_trusted(r.try_get("id")?)))
            .collect()
    }

    /// Record a metrics report.
    pub async fn set_pool_metrics(
        &self,
        id: &ReplicaPoolId,
        metrics: &PoolMetrics,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let json = serde_json::to_string(metrics).map_err(|e| corrupt("pool metrics", e))?;
        let done =
            sqlx::query("UPDATE replica_pools SET metrics = $1, metrics_at = $2 WHERE id = $3")
                .bind(json)
                .bind(ms(now))
                .bind(id.as_str())
                .execute(self.writer())
                .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound("replica pool"));
        }
        Ok(())
    }

    /// Record the policy's decision.
    pub async fn set_pool_decision(
        &self,
        id: &ReplicaPoolId,
        desired: u32,
        reason: &str,
    ) -> Result<()> {
        sqlx::query("UPDATE replica_pools SET desired = $1, reason = $2 WHERE id = $3")
            .bind(i64::from(desired))
            .bind(reason)
            .bind(id.as_str())
            .execute(self.writer())
            .await?;
        Ok(())
    }

    /// Record that `instance` is a replica of `pool`.
    pub async fn add_pool_member(
        &self,
        pool: &ReplicaPoolId,
        instance: &InstanceId,
        now: DateTime<Utc>,
    ) -> Result<()> {
        sqlx::query(
            "INSERT INTO replica_pool_members (pool_id, instance_id, created_at) VALUES ($1, $2, $3)",
        )
        .bind(pool.as_str())
        .bind(instance.as_str())
        .bind(ms(now))
        .execute(self.writer())
        .await?;
        Ok(())
    }

    /// The pool's replicas with their states, oldest first.
    pub async fn pool_members(&self, pool: &ReplicaPoolId) -> Result<Vec<PoolMember>> {
        let rows = sqlx::query(
            "SELECT m.instance_id AS instance_id, i.state AS state, \
             i.stop_requested AS stop_requested \
             FROM replica_pool_members m JOIN instances i ON i.id = m.instance_id \
             WHERE m.pool_id = $1 ORDER BY m.created_at, m.instance_id",
        )
        .bind(pool.as_str())
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                let state: String = r.try_get("state")?;
                let stop: i64 = r.try_get("stop_requested")?;
                Ok(PoolMember {
                    stop_requested: stop != 0,
                    instance_id: InstanceId::from_trusted(r.try_get("instance_id")?),
                    state: InstanceState::parse(&state)
                        .ok_or_else(|| corrupt("instance state", &state))?,
                })
            })
            .collect()
    }
}
