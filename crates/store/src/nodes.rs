//! Nodes and their GPUs.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use flotilla_core::api::{DiscoveredGpu, Gpu, Node, NodeEvent, NodeImage, RegisterNode};
use flotilla_core::catalog::{MIG_COMPUTE_SLICES, MIG_MEMORY_SLICES};
use flotilla_core::id::{GpuId, InstanceId, NodeId, TenantId};
use flotilla_core::node::{ExecutorKind, NodeState, RuntimeKind};
use flotilla_core::offer::NodeOffer;
use flotilla_core::placement::{GpuSlot, NodeSnapshot, MILLI_PER_GPU};
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::instances::opt_json;
use crate::{at, ms, to_json, PageOf, PageReq, Result, Store, StoreError};

fn gpu(row: &AnyRow) -> Result<(NodeId, Gpu)> {
    let idx: i64 = row.try_get("idx")?;
    let inst: Option<String> = row.try_get("instance_id")?;
    Ok((
        NodeId::from_trusted(row.try_get("node_id")?),
        Gpu {
            id: GpuId::from_trusted(row.try_get("id")?),
            index: idx.clamp(0, u32::MAX as i64) as u32,
            model: row.try_get("model")?,
            uuid: row.try_get("uuid")?,
            memory_mib: row.try_get::<i64, _>("memory_mib")?.max(0) as u64,
            instance_id: inst.map(InstanceId::from_trusted),
            mig_mode: row.try_get::<i64, _>("mig_mode")? != 0,
            used_milli: row.try_get::<i64, _>("used_milli")?.clamp(0, 1000) as u32,
            fault: row.try_get("fault")?,
        },
    ))
}

fn node(row: &AnyRow) -> Result<Node> {
    let state: String = row.try_get("state")?;
    let runtime: String = row.try_get("runtime")?;
    let executor: String = row.try_get("executor")?;
    Ok(Node {
        id: NodeId::from_trusted(row.try_get("id")?),
        name: row.try_get("name")?,
        owner_tenant_id: TenantId::from_trusted(row.try_get("owner_tenant_id")?),
        region: row.try_get("region")?,
        pool: row.try_get("pool")?,
        state: NodeState::parse(&state)
            .ok_or_else(|| StoreError::Corrupt(format!("node state `{state}`")))?,
        cordoned: row.try_get::<i64, _>("cordoned")? != 0,
        simulated: row.try_get::<i64, _>("simulated")? != 0,
        cpu_milli: row.try_get::<i64, _>("cpu_milli")?.max(0) as u64,
        memory_mb: row.try_get::<i64, _>("memory_mb")?.max(0) as u64,
        runtime: RuntimeKind::parse(&runtime)
            .ok_or_else(|| StoreError::Corrupt(format!("node runtime `{runtime}`")))?,
        executor: ExecutorKind::parse(&executor)
            .ok_or_else(|| StoreError::Corrupt(format!("node executor `{executor}`")))?,
        last_heartbeat_at: at(row.try_get("last_heartbeat_at")?),
        created_at: at(row.try_get("created_at")?),
        gpus: Vec::new(),
        images: Vec::new(),
        weights: Vec::new(),
        unenforced_limits: opt_json(row, "unenforced_limits")?.unwrap_or_default(),
        // Read where the query selected it (the node's own page); a value
        // that does not parse is shown as unknown rather than failing.
        network: row
            .try_get::<Option<String>, _>("network")
            .ok()
            .flatten()
            .and_then(|j| serde_json::from_str(&j).ok()),
    })
}

/// The network column of a registration: its JSON, NULL when the agent
/// did not say.
fn network_json(req: &RegisterNode) -> Option<String> {
    req.network
        .as_ref()
        .and_then(|n| serde_json::to_string(n).ok())
}

/// The offer column: its JSON, or offered always when NULL.
fn offer_of(row: &AnyRow) -> Result<NodeOffer> {
    match row.try_get::<Option<String>, _>("offer")? {
        None => Ok(NodeOffer::default()),
        Some(j) => {
            serde_json::from_str(&j).map_err(|e| StoreError::Corrupt(format!("node offer: {e}")))
        }
    }
}

/// The node a registration created or re-attached to.
#[derive(Debug, Clone)]
pub struct RegisteredNode {
    /// Its id.
    pub id: NodeId,
    /// Whether the name was new.
    pub created: bool,
}

/// Binds the facts a node registers with, in the order both the insert
/// of a new node and the update of a known one name their columns
/// (region to network).
fn bind_registration<'q>(
    q: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>,
    req: &'q RegisterNode,
    region: &'q str,
    pool: &'q str,
    now: DateTime<Utc>,
) -> sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>> {
    q.bind(region)
        .bind(pool)
        .bind(i64::from(req.simulated))
        .bind(req.cpu_milli as i64)
        .bind(req.memory_mb as i64)
        .bind(&req.agent_version)
        .bind(ms(now))
        .bind(req.runtime.as_str())
        .bind(req.executor.as_str())
        .bind(network_json(req))
}

impl Store {
    /// Registers a node by name, or re-attaches to the node of that name:
    /// updates its facts, marks it ready and reconciles its GPUs by index
    /// (a GPU that vanished is removed only when no instance holds it).
    /// `new_ids` supplies ids for rows that must be created.
    pub async fn register_node(
        &self,
        owner: &TenantId,
        req: &RegisterNode,
        mut new_ids: impl FnMut() -> (NodeId, Vec<GpuId>),
        now: DateTime<Utc>,
    ) -> Result<RegisteredNode> {
        let mut tx = self.begin().await?;
        let existing = sqlx::query("SELECT id, owner_tenant_id FROM nodes WHERE name = $1")
            .bind(&req.name)
            .fetch_optional(&mut *tx)
            .await?;
        let region = req.region.clone().unwrap_or_else(|| "local".into());
        let pool = req.pool.clone().unwrap_or_else(|| "default".into());
        let (ids, created) = match existing {
            Some(row) => {
                let id = NodeId::from_trusted(row.try_get("id")?);
                let node_owner: String = row.try_get("owner_tenant_id")?;
                if node_owner != owner.as_str() {
                    return Err(StoreError::Conflict(format!(
                        "node name `{}` is registered by another tenant",
                        req.name
                    )));
                }
                let q = sqlx::query(
                    "UPDATE nodes SET region = $1, pool = $2, state = 'ready', simulated = $3, cpu_milli = $4, \
                     memory_mb = $5, agent_version = $6, last_heartbeat_at = $7, runtime = $8, \
                     executor = $9, network = $10 WHERE id = $11",
                );
                bind_registration(q, req, &region, &pool, now)
                    .bind(id.as_str())
                    .execute(&mut *tx)
                    .await?;
                let (_, gpu_ids) = new_ids();
                ((id, gpu_ids), false)
            }
            None => {
                let (id, gpu_ids) = new_ids();
                let q = sqlx::query(
                    "INSERT INTO nodes (id, name, owner_tenant_id, region, pool, state, simulated, cpu_milli, \
                     memory_mb, agent_version, last_heartbeat_at, created_at, runtime, executor, network) \
                     VALUES ($1, $2, $3, $4, $5, 'ready', $6, $7, $8, $9, $10, $10, $11, $12, $13)",
                )
                .bind(id.as_str())
                .bind(&req.name)
                .bind(owner.as_str());
                bind_registration(q, req, &region, &pool, now)
                    .execute(&mut *tx)
                    .await?;
                ((id, gpu_ids), true)
            }
        };
        let (id, mut fresh_gpu_ids) = ids;
        sqlx::query("UPDATE nodes SET unenforced_limits = $1 WHERE id = $2")
            .bind((!req.unenforced_limits.is_empty()).then(|| to_json(&req.unenforced_limits)))
            .bind(id.as_str())
            .execute(&mut *tx)
            .await?;
        let rows = sqlx::query("SELECT * FROM gpus WHERE node_id = $1")
            .bind(id.as_str())
            .fetch_all(&mut *tx)
            .await?;
        let mut have: BTreeMap<u32, Gpu> = BTreeMap::new();
        for r in &rows {
            let (_, g) = gpu(r)?;
            have.insert(g.index, g);
        }
        let wanted: BTreeMap<u32, &DiscoveredGpu> = req.gpus.iter().map(|g| (g.index, g)).collect();
        for (idx, g) in &have {
            if !wanted.contains_key(idx) && g.instance_id.is_none() && g.used_milli == 0 {
                sqlx::query("DELETE FROM gpus WHERE id = $1")
                    .bind(g.id.as_str())
                    .execute(&mut *tx)
                    .await?;
            }
        }
        for (idx, d) in wanted {
            if let Some(g) = have.get(&idx) {
                // The MIG mode changes only on an idle GPU: work placed for
                // one mode never finds itself on a GPU of the other.
                sqlx::query(
                    "UPDATE gpus SET model = $1, uuid = $2, memory_mib = $3, \
                     mig_mode = CASE WHEN used_milli = 0 THEN $4 ELSE mig_mode END WHERE id = $5",
                )
                .bind(&d.model)
                .bind(&d.uuid)
                .bind(d.memory_mib as i64)
                .bind(i64::from(d.mig_mode))
                .bind(g.id.as_str())
                .execute(&mut *tx)
                .await?;
            } else {
                let gid = fresh_gpu_ids
                    .pop()
                    .ok_or_else(|| StoreError::Conflict("not enough gpu ids supplied".into()))?;
                sqlx::query(
                    "INSERT INTO gpus (id, node_id, idx, model, uuid, memory_mib, mig_mode) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7)",
                )
                .bind(gid.as_str())
                .bind(id.as_str())
                .bind(i64::from(idx))
                .bind(&d.model)
                .bind(&d.uuid)
                .bind(d.memory_mib as i64)
                .bind(i64::from(d.mig_mode))
                .execute(&mut *tx)
                .await?;
            }
        }
        crate::txn::commit(tx).await?;
        Ok(RegisteredNode { id, created })
    }

    /// Records a heartbeat and returns the node's state as it was, or
    /// `NotFound`: one statement, because every agent sync makes it.
    pub async fn heartbeat(&self, id: &NodeId, now: DateTime<Utc>) -> Result<NodeState> {
        let row =
            sqlx::query("UPDATE nodes SET last_heartbeat_at = $1 WHERE id = $2 RETURNING state")
                .bind(ms(now))
                .bind(id.as_str())
                .fetch_optional(self.writer())
                .await?
                .ok_or(StoreError::NotFound("node"))?;
        let s: String = row.try_get("state")?;
        NodeState::parse(&s).ok_or_else(|| StoreError::Corrupt(format!("node state `{s}`")))
    }

    /// [`Store::heartbeat`] for many nodes in one statement (one commit):
    /// each node's last heartbeat set to its time, and its state before,
    /// for every node that exists (an unknown id is simply absent). The
    /// server's syncs group their heartbeats through it, so a fleet's
    /// hundreds of syncs a second cost a few commits, not hundreds.
    pub async fn heartbeat_many(
        &self,
        beats: &[(NodeId, DateTime<Utc>)],
    ) -> Result<std::collections::HashMap<NodeId, NodeState>> {
        let mut out = std::collections::HashMap::with_capacity(beats.len());
        // A node named twice keeps its latest time (one CASE arm each).
        let mut latest: BTreeMap<&NodeId, DateTime<Utc>> = BTreeMap::new();
        for (id, at) in beats {
            let t = latest.entry(id).or_insert(*at);
            *t = (*t).max(*at);
        }
        let latest: Vec<_> = latest.into_iter().collect();
        for chunk in latest.chunks(500) {
            let sql = format!(
                "{} RETURNING id, state",
                crate::keyed_bigint_update("nodes", "last_heartbeat_at", chunk.len())
            );
            let mut q = sqlx::query(&sql);
            for (id, at) in chunk {
                q = q.bind(id.as_str()).bind(ms(*at));
            }
            for row in q.fetch_all(self.writer()).await? {
                let s: String = row.try_get("state")?;
                let state = NodeState::parse(&s)
                    .ok_or_else(|| StoreError::Corrupt(format!("node state `{s}`")))?;
                out.insert(NodeId::from_trusted(row.try_get("id")?), state);
            }
        }
        Ok(out)
    }

    /// The tenant that owns node `id`, or `NotFound`: what an agent's
    /// call needs to be authorised, without loading the node's GPUs,
    /// images and weights.
    pub async fn node_owner(&self, id: &NodeId) -> Result<TenantId> {
        let row = sqlx::query("SELECT owner_tenant_id FROM nodes WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::NotFound("node"))?;
        Ok(TenantId::from_trusted(row.try_get("owner_tenant_id")?))
    }

    /// The GPUs of node `id`, by index (none for an unknown node).
    pub async fn node_gpus(&self, id: &NodeId) -> Result<Vec<Gpu>> {
        Ok(self
            .gpus_of(std::slice::from_ref(id))
            .await?
            .remove(id)
            .unwrap_or_default())
    }

    /// Marks a node ready again (its agent synced).
    pub async fn mark_node_ready(&self, id: &NodeId, now: DateTime<Utc>) -> Result<()> {
        sqlx::query("UPDATE nodes SET state = 'ready', last_heartbeat_at = $1 WHERE id = $2")
            .bind(ms(now))
            .bind(id.as_str())
            .execute(self.writer())
            .await?;
        Ok(())
    }

    /// Ready nodes whose last heartbeat is older than `cutoff`.
    pub async fn stale_nodes(&self, cutoff: DateTime<Utc>) -> Result<Vec<NodeId>> {
        let rows =
            sqlx::query("SELECT id FROM nodes WHERE state = 'ready' AND last_heartbeat_at < $1")
                .bind(ms(cutoff))
                .fetch_all(self.pool())
                .await?;
        rows.iter()
            .map(|r| Ok(NodeId::from_trusted(r.try_get("id")?)))
            .collect()
    }

    /// Stale nodes (last heartbeat older than `cutoff`) with their last
    /// heartbeat: ready ones, and unreachable ones still holding live
    /// work (a leader deposed between marking a node unreachable and its
    /// work lost leaves those for the next).
    pub async fn stale_nodes_since(
        &self,
        cutoff: DateTime<Utc>,
    ) -> Result<Vec<(NodeId, DateTime<Utc>)>> {
        let rows = sqlx::query(
            "SELECT id, last_heartbeat_at FROM nodes WHERE last_heartbeat_at < $1 AND (state = 'ready' \
             OR (state = 'unreachable' AND EXISTS (SELECT 1 FROM instances i WHERE i.node_id = nodes.id \
             AND i.state IN ('scheduled', 'starting', 'running'))))",
        )
        .bind(ms(cutoff))
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    NodeId::from_trusted(r.try_get("id")?),
                    at(r.try_get("last_heartbeat_at")?),
                ))
            })
            .collect()
    }

    /// Sets a node unreachable if it is still stale; true when it is (it
    /// was ready, or unreachable already), false when it synced meanwhile.
    /// In a transaction of its own so that, on a fenced store, a deposed
    /// leader cannot mark a node it would then fail to declare lost.
    pub async fn mark_node_unreachable(&self, id: &NodeId, cutoff: DateTime<Utc>) -> Result<bool> {
        let mut tx = self.begin().await?;
        let n = sqlx::query(
            "UPDATE nodes SET state = 'unreachable' WHERE id = $1 AND state IN ('ready', 'unreachable') AND last_heartbeat_at < $2",
        )
        .bind(id.as_str())
        .bind(ms(cutoff))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        crate::txn::commit(tx).await?;
        Ok(n > 0)
    }

    /// Sets when a node's GPUs are offered (its provider's windows).
    pub async fn set_node_offer(&self, id: &NodeId, offer: &NodeOffer) -> Result<()> {
        let json = serde_json::to_string(offer)
            .map_err(|e| StoreError::Corrupt(format!("node offer: {e}")))?;
        let n = sqlx::query("UPDATE nodes SET offer = $1 WHERE id = $2")
            .bind(json)
            .bind(id.as_str())
            .execute(self.writer())
            .await?
            .rows_affected();
        crate::touched(n, "node")
    }

    /// When a node's GPUs are offered.
    pub async fn node_offer(&self, id: &NodeId) -> Result<NodeOffer> {
        let row = sqlx::query("SELECT offer FROM nodes WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::NotFound("node"))?;
        offer_of(&row)
    }

    /// Every node with an offer, for the reconciler that stops work when
    /// a window closes.
    pub async fn node_offers(&self) -> Result<Vec<(NodeId, NodeOffer)>> {
        let rows = sqlx::query("SELECT id, offer FROM nodes WHERE offer IS NOT NULL ORDER BY id")
            .fetch_all(self.pool())
            .await?;
        rows.iter()
            .map(|r| Ok((NodeId::from_trusted(r.try_get("id")?), offer_of(r)?)))
            .collect()
    }

    /// One node with its GPUs.
    pub async fn node(&self, id: &NodeId) -> Result<Node> {
        let row = sqlx::query("SELECT * FROM nodes WHERE id = $1")
            .bind(id.as_str())
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::NotFound("node"))?;
        let mut n = node(&row)?;
        n.gpus = self
            .gpus_of(std::slice::from_ref(&n.id))
            .await?
            .remove(&n.id)
            .unwrap_or_default();
        n.images = self.node_images(&n.id).await?;
        n.weights = self.node_weights(&n.id).await?;
        Ok(n)
    }

    /// The node's image cache as its agent last reported it, most recently
    /// used first (never used last), then by reference.
    pub async fn node_images(&self, id: &NodeId) -> Result<Vec<NodeImage>> {
        let rows = sqlx::query(
            "SELECT image, image_id, size_bytes, last_used_at FROM node_images WHERE node_id = $1",
        )
        .bind(id.as_str())
        .fetch_all(self.pool())
        .await?;
        let mut images = rows
            .iter()
            .map(|r| {
                Ok(NodeImage {
                    image: r.try_get("image")?,
                    id: r.try_get("image_id")?,
                    size_bytes: r.try_get::<i64, _>("size_bytes")?.max(0) as u64,
                    last_used: r.try_get::<Option<i64>, _>("last_used_at")?.map(at),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        images.sort_by(|a, b| {
            b.last_used
                .cmp(&a.last_used)
                .then_with(|| a.image.cmp(&b.image))
        });
        Ok(images)
    }

    /// Replaces the node's image cache with what its agent reported, when
    /// it differs from what is stored (agents report it on every sync).
    /// Returns whether anything changed.
    pub async fn set_node_images(
        &self,
        id: &NodeId,
        images: &[NodeImage],
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let mut wanted: Vec<NodeImage> = images.to_vec();
        // Stored to the millisecond: compare at that precision.
        for i in &mut wanted {
            i.last_used = i.last_used.map(|t| at(ms(t)));
        }
        wanted.sort_by(|a, b| a.image.cmp(&b.image));
        let mut have = self.node_images(id).await?;
        have.sort_by(|a, b| a.image.cmp(&b.image));
        if have == wanted {
            return Ok(false);
        }
        let mut tx = self.begin().await?;
        sqlx::query("DELETE FROM node_images WHERE node_id = $1")
            .bind(id.as_str())
            .execute(&mut *tx)
            .await?;
        for i in &wanted {
            sqlx::query(
                "INSERT INTO node_images (node_id, image, image_id, size_bytes, last_used_at, reported_at) \
                 VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(id.as_str())
            .bind(&i.image)
            .bind(&i.id)
            .bind(i64::try_from(i.size_bytes).unwrap_or(i64::MAX))
            .bind(i.last_used.map(ms))
            .bind(ms(now))
            .execute(&mut *tx)
            .await?;
        }
        crate::txn::commit(tx).await?;
        Ok(true)
    }

    async fn gpus_of(&self, nodes: &[NodeId]) -> Result<BTreeMap<NodeId, Vec<Gpu>>> {
        let mut out: BTreeMap<NodeId, Vec<Gpu>> = BTreeMap::new();
        if nodes.is_empty() {
            return Ok(out);
        }
        let (lo, hi) = (nodes[0].as_str(), nodes[nodes.len() - 1].as_str());
        let rows = sqlx::query(
            "SELECT * FROM gpus WHERE node_id >= $1 AND node_id <= $2 ORDER BY node_id, idx",
        )
        .bind(lo)
        .bind(hi)
        .fetch_all(self.pool())
        .await?;
        for r in &rows {
            let (nid, g) = gpu(r)?;
            out.entry(nid).or_default().push(g);
        }
        Ok(out)
    }

    /// Nodes with their GPUs, by id.
    pub async fn list_nodes(&self, page: &PageReq) -> Result<PageOf<Node>> {
        let rows = sqlx::query("SELECT * FROM nodes WHERE id > $1 ORDER BY id LIMIT $2")
            .bind(page.after_or_empty())
            .bind(page.fetch())
            .fetch_all(self.pool())
            .await?;
        let nodes = rows.iter().map(node).collect::<Result<Vec<_>>>()?;
        let mut page = PageOf::from_overfetch(nodes, page, |n| n.id.to_string());
        let ids: Vec<NodeId> = page.items.iter().map(|n| n.id.clone()).collect();
        let mut gpus = self.gpus_of(&ids).await?;
        for n in &mut page.items {
            n.gpus = gpus.remove(&n.id).unwrap_or_default();
        }
        Ok(page)
    }

    /// Every node as placement sees it: free GPUs, and CPU and memory not
    /// reserved by instances holding GPUs there.
    pub async fn placement_snapshot(&self) -> Result<Vec<NodeSnapshot>> {
        placement_snapshot_in(&mut *self.pool().acquire().await?).await
    }
}

/// [`Store::placement_snapshot`] on `conn` (a pass reads it inside its
/// snapshot transaction, [`crate::pass`]).
pub(crate) async fn placement_snapshot_in(
    conn: &mut sqlx::AnyConnection,
) -> Result<Vec<NodeSnapshot>> {
    let nodes = sqlx::query("SELECT * FROM nodes ORDER BY id")
        .fetch_all(&mut *conn)
        .await?;
    let reserved = sqlx::query(
            "SELECT node_id, CAST(SUM(cpu_milli) AS BIGINT) AS cpu, CAST(SUM(memory_mb) AS BIGINT) AS mem \
             FROM instances WHERE state IN ('scheduled', 'starting', 'running') AND node_id IS NOT NULL \
             GROUP BY node_id",
        )
        .fetch_all(&mut *conn)
        .await?;
    let mut used: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for r in &reserved {
        used.insert(
            r.try_get("node_id")?,
            (r.try_get("cpu")?, r.try_get("mem")?),
        );
    }
    let gpu_rows = sqlx::query("SELECT * FROM gpus ORDER BY node_id, idx")
        .fetch_all(&mut *conn)
        .await?;
    let mut gpus: BTreeMap<NodeId, Vec<GpuSlot>> = BTreeMap::new();
    for r in &gpu_rows {
        let (nid, g) = gpu(r)?;
        let slices = |col: &str, of: u8| -> Result<u8> {
            let used = r.try_get::<i64, _>(col)?.clamp(0, i64::from(of));
            // Clamped to 0..=of above.
            Ok(if g.mig_mode { of - used as u8 } else { 0 })
        };
        // A faulty GPU offers nothing: placement sees it as full, so
        // no new work lands there while its work runs on.
        let healthy = g.fault.is_none();
        gpus.entry(nid).or_default().push(GpuSlot {
            free: healthy && g.instance_id.is_none() && g.used_milli == 0,
            // used_milli is clamped to 0..=1000 when read.
            free_milli: if healthy {
                MILLI_PER_GPU - g.used_milli as u16
            } else {
                0
            },
            mig_mode: g.mig_mode,
            mig_compute_free: if healthy {
                slices("used_mig_compute", MIG_COMPUTE_SLICES)?
            } else {
                0
            },
            mig_memory_free: if healthy {
                slices("used_mig_memory", MIG_MEMORY_SLICES)?
            } else {
                0
            },
            id: g.id,
            index: g.index,
            model: g.model,
        });
    }
    nodes
        .iter()
        .map(|r| {
            let n = node(r)?;
            let (cpu, mem) = used.get(n.id.as_str()).copied().unwrap_or((0, 0));
            Ok(NodeSnapshot {
                ready: n.state == NodeState::Ready,
                cordoned: n.cordoned,
                offer: offer_of(r)?,
                region: n.region.clone(),
                pool: n.pool.clone(),
                runtime: n.runtime,
                cpu_milli_free: n.cpu_milli.saturating_sub(cpu.max(0) as u64),
                memory_mb_free: n.memory_mb.saturating_sub(mem.max(0) as u64),
                gpus: gpus.remove(&n.id).unwrap_or_default(),
                id: n.id,
            })
        })
        .collect()
}

impl Store {
    /// Drains a node: cordons it and asks every instance it holds to stop
    /// (its agent stops them with their grace period; a job whose member
    /// was stopped restarts elsewhere as its restart policy says). Records
    /// a `drained` event. Returns the instances asked to stop.
    pub async fn drain_node(&self, id: &NodeId, now: DateTime<Utc>) -> Result<Vec<InstanceId>> {
        let mut tx = self.begin().await?;
        let n = sqlx::query("UPDATE nodes SET cordoned = 1 WHERE id = $1")
            .bind(id.as_str())
            .execute(&mut *tx)
            .await?
            .rows_affected();
        crate::touched(n, "node")?;
        let rows = sqlx::query(
            "SELECT id FROM instances WHERE node_id = $1 AND state IN ('scheduled', 'starting', 'running') \
             AND stop_requested = 0 ORDER BY id",
        )
        .bind(id.as_str())
        .fetch_all(&mut *tx)
        .await?;
        let ids = rows
            .iter()
            .map(|r| Ok(InstanceId::from_trusted(r.try_get("id")?)))
            .collect::<Result<Vec<_>>>()?;
        for i in &ids {
            sqlx::query(
                "UPDATE instances SET stop_requested = 1, state_reason = $1, updated_at = $2 \
                 WHERE id = $3 AND state IN ('scheduled', 'starting', 'running')",
            )
            .bind("stopping: its node is drained")
            .bind(ms(now))
            .bind(i.as_str())
            .execute(&mut *tx)
            .await?;
        }
        let message = format!("drained: cordoned, {} instance(s) asked to stop", ids.len());
        insert_node_event(&mut tx, id, "drained", None, &message, now).await?;
        crate::txn::commit(tx).await?;
        Ok(ids)
    }

    /// Sets (`Some`) or clears (`None`) a GPU's fault and records the
    /// matching event (`gpu_fault`, `gpu_reset`), unless the GPU is
    /// already in that condition (a fault is kept as first seen). Returns
    /// whether anything changed.
    pub async fn set_gpu_fault(
        &self,
        node: &NodeId,
        gpu: &GpuId,
        fault: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<bool> {
        let mut tx = self.begin().await?;
        let changed = match fault {
            Some(f) => sqlx::query(
                "UPDATE gpus SET fault = $1, fault_at = $2 WHERE id = $3 AND node_id = $4 AND fault IS NULL",
            )
            .bind(f)
            .bind(ms(now))
            .bind(gpu.as_str())
            .bind(node.as_str()),
            None => sqlx::query(
                "UPDATE gpus SET fault = NULL, fault_at = NULL WHERE id = $1 AND node_id = $2 AND fault IS NOT NULL",
            )
            .bind(gpu.as_str())
            .bind(node.as_str()),
        }
        .execute(&mut *tx)
        .await?
        .rows_affected()
            > 0;
        if changed {
            let (kind, message) = match fault {
                Some(f) => ("gpu_fault", format!("gpu {gpu} out of placement: {f}")),
                None => ("gpu_reset", format!("gpu {gpu} reset: back in placement")),
            };
            insert_node_event(&mut tx, node, kind, Some(gpu), &message, now).await?;
        }
        crate::txn::commit(tx).await?;
        Ok(changed)
    }

    /// Records an event of `node`.
    pub async fn add_node_event(
        &self,
        node: &NodeId,
        kind: &str,
        message: &str,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let mut tx = self.begin().await?;
        insert_node_event(&mut tx, node, kind, None, message, now).await?;
        crate::txn::commit(tx).await?;
        Ok(())
    }

    /// A node's events after `after_seq`, oldest first, at most `limit`.
    pub async fn node_events(
        &self,
        node: &NodeId,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<NodeEvent>> {
        let rows = sqlx::query(
            "SELECT * FROM node_events WHERE node_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
        )
        .bind(node.as_str())
        .bind(i64::try_from(after_seq).unwrap_or(i64::MAX))
        .bind(i64::from(limit))
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(NodeEvent {
                    node_id: NodeId::from_trusted(r.try_get("node_id")?),
                    seq: r.try_get::<i64, _>("seq")?.max(0) as u64,
                    kind: r.try_get("kind")?,
                    gpu_id: r
                        .try_get::<Option<String>, _>("gpu_id")?
                        .map(GpuId::from_trusted),
                    message: r.try_get("message")?,
                    at: at(r.try_get("at")?),
                })
            })
            .collect()
    }
}

/// Appends an event to `node`'s, numbered after its last.
async fn insert_node_event(
    tx: &mut sqlx::Transaction<'static, sqlx::Any>,
    node: &NodeId,
    kind: &str,
    gpu: Option<&GpuId>,
    message: &str,
    now: DateTime<Utc>,
) -> Result<()> {
    let seq: i64 = sqlx::query_scalar(
        "SELECT CAST(COALESCE(MAX(seq), 0) + 1 AS BIGINT) FROM node_events WHERE node_id = $1",
    )
    .bind(node.as_str())
    .fetch_one(&mut **tx)
    .await?;
    sqlx::query(
        "INSERT INTO node_events (node_id, seq, kind, gpu_id, message, at) VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(node.as_str())
    .bind(seq)
    .bind(kind)
    .bind(gpu.map(GpuId::as_str))
    .bind(message)
    .bind(ms(now))
    .execute(&mut **tx)
    .await?;
    Ok(())
}
