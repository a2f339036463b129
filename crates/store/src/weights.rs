//! The model weights nodes hold for endpoint replicas (`node_weights`):
//! what each agent last reported of its disk cache and its parked
//! replicas. Placement reads it; a replacement returns the parks that
//! ended, for metering their host memory.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use flotilla_core::api::{NodeWeights, WeightTier};
use flotilla_core::id::{EndpointId, InstanceId, NodeId};
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{at, ms, Result, Store, StoreError};

fn tier_of(s: &str) -> Result<WeightTier> {
    match s {
        "parked" => Ok(WeightTier::Parked),
        "cached" => Ok(WeightTier::Cached),
        other => Err(StoreError::Corrupt(format!("node_weights.tier `{other}`"))),
    }
}

fn row_of(r: &AnyRow) -> Result<NodeWeights> {
    let replica: String = r.try_get("replica")?;
    let endpoint: Option<String> = r.try_get("endpoint_id")?;
    Ok(NodeWeights {
        key: r.try_get("weights_key")?,
        tier: tier_of(&r.try_get::<String, _>("tier")?)?,
        size_bytes: r.try_get::<i64, _>("size_bytes")?.max(0) as u64,
        since: at(r.try_get("since")?),
        replica: if replica.is_empty() {
            None
        } else {
            Some(
                InstanceId::parse(&replica, "replica")
                    .map_err(|e| StoreError::Corrupt(e.to_string()))?,
            )
        },
        endpoint_id: endpoint
            .map(|e| EndpointId::parse(&e, "endpoint_id"))
            .transpose()
            .map_err(|e| StoreError::Corrupt(e.to_string()))?,
    })
}

/// Order of a node's report, so two reports compare equal when they hold
/// the same.
fn sorted(mut w: Vec<NodeWeights>) -> Vec<NodeWeights> {
    w.sort_by(|a, b| (a.tier, &a.key, &a.replica).cmp(&(b.tier, &b.key, &b.replica)));
    w
}

impl Store {
    /// What `node` holds, as last reported.
    pub async fn node_weights(&self, node: &NodeId) -> Result<Vec<NodeWeights>> {
        let rows = sqlx::query("SELECT * FROM node_weights WHERE node_id = $1")
            .bind(node.as_str())
            .fetch_all(self.pool())
            .await?;
        Ok(sorted(rows.iter().map(row_of).collect::<Result<_>>()?))
    }

    /// The tier of each weights key on each node that holds it (the
    /// fastest when it is both parked and cached), for placement.
    pub async fn weights_by_node(&self) -> Result<BTreeMap<NodeId, BTreeMap<String, WeightTier>>> {
        weights_by_node_in(&mut *self.pool().acquire().await?).await
    }

    /// The parked entries `node` held that `report` no longer has: parks
    /// that ended (restored onto a GPU, released or dropped) since the
    /// last report. Read before [`Store::set_node_weights`] so they are
    /// metered before they are forgotten.
    pub async fn parks_ended(
        &self,
        node: &NodeId,
        report: &[NodeWeights],
    ) -> Result<Vec<NodeWeights>> {
        Ok(parks_ended_of(&self.node_weights(node).await?, report))
    }

    /// The replicas of deleted endpoints on `node` that must not stay
    /// parked: live ones (not to be parked when they stop) and the parks
    /// its agent last reported. A deleted endpoint never restores them.
    pub async fn replicas_to_unpark(&self, node: &NodeId) -> Result<Vec<InstanceId>> {
        let rows = sqlx::query(
            "SELECT r.instance_id AS id FROM endpoint_replicas r \
             JOIN endpoints e ON e.id = r.endpoint_id JOIN instances i ON i.id = r.instance_id \
             WHERE i.node_id = $1 AND e.deleted_at IS NOT NULL \
             AND i.state IN ('scheduled', 'starting', 'running') \
             UNION SELECT w.replica AS id FROM node_weights w JOIN endpoints e ON e.id = w.endpoint_id \
             WHERE w.node_id = $1 AND w.tier = 'parked' AND e.deleted_at IS NOT NULL \
             ORDER BY id",
        )
        .bind(node.as_str())
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                InstanceId::parse(&r.try_get::<String, _>("id")?, "replica")
                    .map_err(|e| StoreError::Corrupt(e.to_string()))
            })
            .collect()
    }

    /// Replaces what `node` holds with its agent's report, when it
    /// differs (agents report on every sync). Returns whether it changed.
    pub async fn set_node_weights(
        &self,
        node: &NodeId,
        weights: &[NodeWeights],
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let stored = self.node_weights(node).await?;
        self.set_node_weights_over(node, &stored, weights, now)
            .await
    }

    /// [`Store::set_node_weights`] given what the store held (`stored`, as
    /// [`Store::node_weights`] read it just before): a sync reads it once
    /// for both this and [`parks_ended_of`].
    pub async fn set_node_weights_over(
        &self,
        node: &NodeId,
        stored: &[NodeWeights],
        weights: &[NodeWeights],
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let mut wanted = weights.to_vec();
        // Stored to the millisecond: compare at that precision.
        for w in &mut wanted {
            w.since = at(ms(w.since));
        }
        let wanted = sorted(wanted);
        if stored == wanted.as_slice() {
            return Ok(false);
        }
        let mut tx = self.begin().await?;
        sqlx::query("DELETE FROM node_weights WHERE node_id = $1")
            .bind(node.as_str())
            .execute(&mut *tx)
            .await?;
        for w in &wanted {
            sqlx::query(
                "INSERT INTO node_weights (node_id, tier, weights_key, replica, endpoint_id, \
                 size_bytes, since, reported_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            )
            .bind(node.as_str())
            .bind(w.tier.as_str())
            .bind(&w.key)
            .bind(w.replica.as_ref().map_or("", |r| r.as_str()))
            .bind(w.endpoint_id.as_ref().map(|e| e.as_str().to_string()))
            .bind(i64::try_from(w.size_bytes).unwrap_or(i64::MAX))
            .bind(ms(w.since))
            .bind(ms(now))
            .execute(&mut *tx)
            .await?;
        }
        crate::txn::commit(tx).await?;
        Ok(true)
    }
}

/// The parked entries of `stored` (what a node held, as last reported)
/// that `report` no longer has: see [`Store::parks_ended`].
pub fn parks_ended_of(stored: &[NodeWeights], report: &[NodeWeights]) -> Vec<NodeWeights> {
    stored
        .iter()
        .filter(|h| {
            h.tier == WeightTier::Parked
                && !report
                    .iter()
                    .any(|w| w.tier == h.tier && w.key == h.key && w.replica == h.replica)
        })
        .cloned()
        .collect()
}

/// [`Store::weights_by_node`] on `conn`: a scheduling pass reads it inside its
/// one snapshot transaction ([`Store::pass_inputs`]).
pub(crate) async fn weights_by_node_in(
    conn: &mut sqlx::AnyConnection,
) -> Result<BTreeMap<NodeId, BTreeMap<String, WeightTier>>> {
    let rows = sqlx::query("SELECT node_id, weights_key, tier FROM node_weights")
        .fetch_all(&mut *conn)
        .await?;
    let mut out: BTreeMap<NodeId, BTreeMap<String, WeightTier>> = BTreeMap::new();
    for r in &rows {
        let node = NodeId::parse(&r.try_get::<String, _>("node_id")?, "node_id")
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let tier = tier_of(&r.try_get::<String, _>("tier")?)?;
        let slot = out
            .entry(node)
            .or_default()
            .entry(r.try_get("weights_key")?)
            .or_insert(tier);
        *slot = (*slot).min(tier);
    }
    Ok(out)
}
