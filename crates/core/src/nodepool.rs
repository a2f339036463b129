//! Node pools grown through a capacity provider: the join handshake a new
//! machine's agent makes, and what the API shows of a pool.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// `POST /v1/agent/join`: a new machine's agent trades its one-time join
/// token for an agent key.
#[derive(Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JoinNode {
    /// The join token the machine was booted with.
    pub token: String,
}

impl std::fmt::Debug for JoinNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinNode").field("token", &"***").finish()
    }
}

/// The answer to a join: the agent registers as `name` in `pool` with
/// `agent_token` from now on (the join token is spent).
#[derive(Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Joined {
    /// An agent key for this machine only; revoked when the machine is
    /// given back.
    pub agent_token: String,
    /// The node name to register under.
    pub name: String,
    /// The node pool to register in.
    pub pool: String,
}

impl std::fmt::Debug for Joined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Joined")
            .field("agent_token", &"***")
            .field("name", &self.name)
            .field("pool", &self.pool)
            .finish()
    }
}

/// One machine of a node pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PoolMachineView {
    /// Node name.
    pub name: String,
    /// `booting`, `joined`, `draining`, `terminated` or `failed`.
    pub state: String,
    /// The provider's id for it.
    pub machine_id: Option<String>,
    /// Why it is in that state.
    pub reason: Option<String>,
    /// When it was asked for.
    pub created_at: DateTime<Utc>,
    /// Since when it has run nothing.
    pub idle_since: Option<DateTime<Utc>>,
}

/// A node pool as `GET /v1/node-pools` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodePoolView {
    /// Pool name (the nodes' `pool`).
    pub name: String,
    /// Capacity provider kind.
    pub provider: String,
    /// Instance type its machines are.
    pub instance_type: String,
    /// Fewest machines kept.
    pub min: u32,
    /// Most machines at once.
    pub max: u32,
    /// The last decision, in words.
    pub last_decision: Option<String>,
    /// Its machines not yet given back.
    pub machines: Vec<PoolMachineView>,
}
