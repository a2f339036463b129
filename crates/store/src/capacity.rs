//! Node pools' machines and their one-time join tokens (migration 0021).
//!
//! The node-pool loop records a machine (`booting`) with its join token
//! before it asks the provider for it, so a crash between the two leaves a
//! row the next pass sees and gives back after the boot timeout, never a
//! machine nobody knows about. The token is redeemed once, atomically: two
//! agents racing with the same token get one key between them.

use chrono::{DateTime, Utc};
use flotilla_core::id::{NodeId, TenantId};
use sqlx::any::AnyRow;
use sqlx::Row;

use crate::keys::NewKey;
use crate::{at, ms, Result, Store, StoreError};

/// Where a pool's machine is (the `state` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MachineState {
    /// Asked for; its node has not joined.
    Booting,
    /// Its node joined and serves.
    Joined,
    /// Cordoned, being given back.
    Draining,
    /// Given back.
    Terminated,
    /// The provider could not build it, or it died.
    Failed,
}

impl MachineState {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Booting => "booting",
            Self::Joined => "joined",
            Self::Draining => "draining",
            Self::Terminated => "terminated",
            Self::Failed => "failed",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "booting" => Self::Booting,
            "joined" => Self::Joined,
            "draining" => Self::Draining,
            "terminated" => Self::Terminated,
            "failed" => Self::Failed,
            _ => return None,
        })
    }
}

/// A machine of a node pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolMachine {
    /// The node name its agent registers under (unique).
    pub name: String,
    /// Its pool.
    pub pool: String,
    /// The provider's kind (`openstack`, `simulated`, `local`).
    pub provider: String,
    /// The instance type asked for.
    pub instance_type: String,
    /// The provider's id, once it answered.
    pub machine_id: Option<String>,
    /// Where it is.
    pub state: MachineState,
    /// Why it is there (failure, termination), for people.
    pub reason: Option<String>,
    /// Its node, once joined.
    pub node_id: Option<NodeId>,
    /// When it was asked for.
    pub created_at: DateTime<Utc>,
    /// When its node joined.
    pub joined_at: Option<DateTime<Utc>>,
    /// Since when its node has run nothing.
    pub idle_since: Option<DateTime<Utc>>,
}

/// A new machine and its join token.
#[derive(Debug, Clone)]
pub struct NewMachine {
    pub name: String,
    pub pool: String,
    pub provider: String,
    pub instance_type: String,
    /// Hex SHA-256 of the join token.
    pub token_hash: String,
    /// The tenant the joining node's agent key belongs to (the operator's).
    pub tenant_id: TenantId,
    /// The token is refused after this.
    pub expires_at: DateTime<Utc>,
}

/// What a redeemed join token grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinGrant {
    /// The pool the node joins.
    pub pool: String,
    /// The node name it must register under.
    pub machine: String,
}

/// Why a join token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JoinRefusal {
    /// No such token.
    #[error("unknown join token")]
    Unknown,
    /// Redeemed before.
    #[error("join token already used at {at}")]
    Used { at: DateTime<Utc> },
    /// Past its expiry.
    #[error("join token expired at {at}")]
    Expired { at: DateTime<Utc> },
}

fn machine(row: &AnyRow) -> Result<PoolMachine> {
    let state: String = row.try_get("state")?;
    let opt_at = |col: &str| -> Result<Option<DateTime<Utc>>> {
        Ok(row.try_get::<Option<i64>, _>(col)?.map(at))
    };
    Ok(PoolMachine {
        name: row.try_get("name")?,
        pool: row.try_get("pool")?,
        provider: row.try_get("provider")?,
        instance_type: row.try_get("instance_type")?,
        machine_id: row.try_get("machine_id")?,
        state: MachineState::parse(&state)
            .ok_or_else(|| StoreError::Corrupt(format!("pool machine state {state:?}")))?,
        reason: row.try_get("reason")?,
        node_id: row
            .try_get::<Option<String>, _>("node_id")?
            .map(NodeId::from_trusted),
        created_at: at(row.try_get("created_at")?),
        joined_at: opt_at("joined_at")?,
        idle_since: opt_at("idle_since")?,
    })
}

impl Store {
    /// Records a new `booting` machine and its join token, in one
    /// transaction.
    pub async fn add_pool_machine(&self, m: &NewMachine, now: DateTime<Utc>) -> Result<()> {
        let mut tx = crate::txn::begin(self.writer()).await?;
        sqlx::query(
            "INSERT INTO pool_machines (name, pool, provider, instance_type, state, created_at) \
             VALUES ($1, $2, $3, $4, 'booting', $5)",
        )
        .bind(&m.name)
        .bind(&m.pool)
        .bind(&m.provider)
        .bind(&m.instance_type)
        .bind(ms(now))
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO join_tokens (token_hash, pool, machine, tenant_id, created_at, expires_at) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&m.token_hash)
        .bind(&m.pool)
        .bind(&m.name)
        .bind(m.tenant_id.as_str())
        .bind(ms(now))
        .bind(ms(m.expires_at))
        .execute(&mut *tx)
        .await?;
        crate::txn::commit(tx).await?;
        Ok(())
    }

    /// A machine by name.
    pub async fn pool_machine(&self, name: &str) -> Result<PoolMachine> {
        let row = sqlx::query("SELECT * FROM pool_machines WHERE name = $1")
            .bind(name)
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::NotFound("pool machine"))?;
        machine(&row)
    }

    /// The pool's machines that are not given back yet (booting, joined,
    /// draining, failed), oldest first.
    pub async fn pool_machines(&self, pool: &str) -> Result<Vec<PoolMachine>> {
        let rows = sqlx::query(
            "SELECT * FROM pool_machines WHERE pool = $1 AND state <> 'terminated' \
             ORDER BY created_at, name",
        )
        .bind(pool)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(machine).collect()
    }

    /// Every machine of the pool, given back ones too, oldest first.
    pub async fn pool_machine_history(&self, pool: &str) -> Result<Vec<PoolMachine>> {
        let rows =
            sqlx::query("SELECT * FROM pool_machines WHERE pool = $1 ORDER BY created_at, name")
                .bind(pool)
                .fetch_all(self.pool())
                .await?;
        rows.iter().map(machine).collect()
    }

    /// The provider's id for the machine.
    pub async fn set_machine_id(&self, name: &str, machine_id: &str) -> Result<()> {
        let n = sqlx::query("UPDATE pool_machines SET machine_id = $1 WHERE name = $2")
            .bind(machine_id)
            .bind(name)
            .execute(self.writer())
            .await?
            .rows_affected();
        crate::touched(n, "pool machine")
    }

    /// Its node joined: `joined`, idle from now.
    pub async fn mark_machine_joined(
        &self,
        name: &str,
        node: &NodeId,
        now: DateTime<Utc>,
    ) -> Result<()> {
        sqlx::query(
            "UPDATE pool_machines SET state = 'joined', node_id = $1, joined_at = $2, \
             idle_since = $2 WHERE name = $3 AND state = 'booting'",
        )
        .bind(node.as_str())
        .bind(ms(now))
        .bind(name)
        .execute(self.writer())
        .await?;
        Ok(())
    }

    /// Since when the machine's node has run nothing (`None`: busy).
    pub async fn set_machine_idle_since(
        &self,
        name: &str,
        since: Option<DateTime<Utc>>,
    ) -> Result<()> {
        sqlx::query("UPDATE pool_machines SET idle_since = $1 WHERE name = $2")
            .bind(since.map(ms))
            .bind(name)
            .execute(self.writer())
            .await?;
        Ok(())
    }

    /// Moves the machine to `state` with a reason; `terminated` and
    /// `failed` also stamp when it ended.
    pub async fn set_machine_state(
        &self,
        name: &str,
        state: MachineState,
        reason: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<()> {
        let ended = matches!(state, MachineState::Terminated | MachineState::Failed);
        let n = sqlx::query(
            "UPDATE pool_machines SET state = $1, reason = COALESCE($2, reason), \
             ended_at = CASE WHEN $3 = 1 THEN $4 ELSE ended_at END WHERE name = $5",
        )
        .bind(state.as_str())
        .bind(reason)
        .bind(i64::from(ended))
        .bind(ms(now))
        .bind(name)
        .execute(self.writer())
        .await?
        .rows_affected();
        crate::touched(n, "pool machine")
    }

    /// Redeems a join token: once, before it expires. On success the agent
    /// key `key` is created in the same transaction and the token marked
    /// used; a refused token changes nothing.
    pub async fn redeem_join_token(
        &self,
        token_hash: &str,
        key: &NewKey,
        now: DateTime<Utc>,
    ) -> Result<std::result::Result<JoinGrant, JoinRefusal>> {
        let mut tx = crate::txn::begin(self.writer()).await?;
        let n = sqlx::query(
            "UPDATE join_tokens SET used_at = $1, key_id = $2 \
             WHERE token_hash = $3 AND used_at IS NULL AND expires_at > $1",
        )
        .bind(ms(now))
        .bind(key.id.as_str())
        .bind(token_hash)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        let row = sqlx::query(
            "SELECT pool, machine, tenant_id, expires_at, used_at, key_id \
             FROM join_tokens WHERE token_hash = $1",
        )
        .bind(token_hash)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Ok(Err(JoinRefusal::Unknown));
        };
        if n == 0 {
            let used: Option<i64> = row.try_get("used_at")?;
            return Ok(Err(match used {
                Some(u) => JoinRefusal::Used { at: at(u) },
                None => JoinRefusal::Expired {
                    at: at(row.try_get("expires_at")?),
                },
            }));
        }
        let tenant: String = row.try_get("tenant_id")?;
        if tenant != key.tenant_id.as_str() {
            return Err(StoreError::Conflict(
                "join token: the key must belong to the token's tenant".to_string(),
            ));
        }
        sqlx::query(
            "INSERT INTO api_keys (id, tenant_id, role, name, prefix, secret_hash, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(key.id.as_str())
        .bind(key.tenant_id.as_str())
        .bind(key.role.as_str())
        .bind(&key.name)
        .bind(&key.prefix)
        .bind(&key.secret_hash)
        .bind(ms(now))
        .execute(&mut *tx)
        .await?;
        let grant = JoinGrant {
            pool: row.try_get("pool")?,
            machine: row.try_get("machine")?,
        };
        crate::txn::commit(tx).await?;
        Ok(Ok(grant))
    }

    /// The tenant a join token belongs to, if the token exists (the join
    /// route mints the agent key under it).
    pub async fn join_token_tenant(&self, token_hash: &str) -> Result<Option<TenantId>> {
        let row = sqlx::query("SELECT tenant_id FROM join_tokens WHERE token_hash = $1")
            .bind(token_hash)
            .fetch_optional(self.pool())
            .await?;
        row.map(|r| Ok(TenantId::from_trusted(r.try_get("tenant_id")?)))
            .transpose()
    }

    /// Revokes the agent key a machine's join token was traded for (the
    /// machine is gone: its credential must not outlive it).
    pub async fn revoke_machine_key(&self, machine: &str, now: DateTime<Utc>) -> Result<()> {
        sqlx::query(
            "UPDATE api_keys SET revoked_at = $1 WHERE revoked_at IS NULL AND id IN \
             (SELECT key_id FROM join_tokens WHERE machine = $2 AND key_id IS NOT NULL)",
        )
        .bind(ms(now))
        .bind(machine)
        .execute(self.writer())
        .await?;
        Ok(())
    }

    /// The nodes registered in `pool`: `(id, name)`.
    pub async fn nodes_in_pool(&self, pool: &str) -> Result<Vec<(NodeId, String)>> {
        let rows = sqlx::query("SELECT id, name FROM nodes WHERE pool = $1 ORDER BY name")
            .bind(pool)
            .fetch_all(self.pool())
            .await?;
        rows.iter()
            .map(|r| Ok((NodeId::from_trusted(r.try_get("id")?), r.try_get("name")?)))
            .collect()
    }

    /// Instances on `node` that have not ended (scheduled, starting,
    /// running, stopping, lost).
    pub async fn live_instances_on(&self, node: &NodeId) -> Result<u64> {
        let row = sqlx::query(
            "SELECT COUNT(*) AS n FROM instances WHERE node_id = $1 \
             AND state NOT IN ('succeeded', 'failed', 'stopped')",
        )
        .bind(node.as_str())
        .fetch_one(self.pool())
        .await?;
        let n: i64 = row.try_get("n")?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Takes `node` out of scheduling (`true`) or puts it back.
    pub async fn set_node_cordoned(&self, node: &NodeId, cordoned: bool) -> Result<()> {
        let n = sqlx::query("UPDATE nodes SET cordoned = $1 WHERE id = $2")
            .bind(i64::from(cordoned))
            .bind(node.as_str())
            .execute(self.writer())
            .await?
            .rows_affected();
        crate::touched(n, "node")
    }
}
