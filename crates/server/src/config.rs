//! The server's settings: what `flotilla server` and `flotilla up` set
//! from their flags, read by every loop and route through
//! [`crate::state::AppState::config`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use flotilla_backends::capacity::CapacityProvider;
use flotilla_core::node::RuntimeKind;
use flotilla_scale::nodepool::PoolBounds;

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Time without a sync after which a node is unreachable and its
    /// instances lost.
    pub heartbeat_timeout: Duration,
    /// Sustained requests per second per API key (bursts of twice that).
    pub rate_limit_per_second: u32,
    /// Sustained machine-protocol requests per second per API key (agent
    /// syncs and logs, gateway reports, usage batches; bursts of twice
    /// that): apart from the key's own budget, and large, because one key
    /// often serves a whole fleet of agents (an idle agent syncs about
    /// every heartbeat interval; 2,000/s is some 5,000 nodes).
    pub protocol_rate_limit_per_second: u32,
    /// Sustained requests per second per source address that carry no
    /// valid key (none, unknown or revoked) to a route that needs one
    /// (bursts of twice that). Low: such a request can only be a mistake or
    /// a guess at a key.
    pub anonymous_rate_limit_per_second: u32,
    /// Agent sync reports this replica works on at once (the part of a
    /// sync that reads and writes the node's instances). A sync from an
    /// agent that takes busy answers, arriving while this many are in
    /// flight, gets its lease renewed and is asked to come back
    /// (`SyncResponse::busy_retry_ms`) instead of queueing for a database
    /// connection until its agent gives up. Half the database pool by
    /// default, so the API and the leader keep the other half.
    pub sync_reports_in_flight: usize,
    /// Longest pause of the reconcile loop when nothing signals a change.
    pub reconcile_tick: Duration,
    /// While work waits and nothing changes, the scheduling pass still
    /// runs this often (`reconcile::PassTrigger`): fair share decays with
    /// time alone. A change, or a time the last plan named, runs it at
    /// once.
    pub pass_at_least_every: Duration,
    /// The placement policy (`flotilla-sched`); Flotilla's own by default.
    pub placement_policy: flotilla_sched::Policy,
    /// How often spot prices are recorded, budgets checked and webhooks
    /// delivered.
    pub billing_every: Duration,
    /// Percent of a provider's gross revenue the operator keeps.
    pub operator_fee_percent: rust_decimal::Decimal,
    /// Whether budget webhooks may reach loopback, private, link-local,
    /// unique-local and unspecified addresses (see `webhook_target`); off
    /// so that a tenant cannot make the server call into the operator's
    /// network.
    pub webhook_allow_private: bool,
    /// Inward destinations (loopback, private, link-local, …) the
    /// control plane may reach on a tenant's behalf: queue-trigger
    /// brokers, budget webhooks, registry logins. Empty: public addresses
    /// only (see `flotilla-egress`).
    pub allow_egress: Vec<flotilla_egress::AllowRule>,
    /// The file holding the key that seals stored secrets (tenants'
    /// registry passwords), created with mode 0600 on first use;
    /// `FLOTILLA_SECRETS_KEY` overrides it (replicas must share one key).
    /// `flotilla server` uses `<data dir>/secrets.key`.
    pub secrets_key_file: Option<std::path::PathBuf>,
    /// Which GPU readings take a GPU out of placement (XID and ECC errors,
    /// a temperature limit): the agent reports, the server decides.
    pub gpu_health: flotilla_core::health::HealthPolicy,
    /// Node pools grown and shrunk through a capacity provider by the
    /// leader's node-pool loop ([`nodepools`]); empty: none.
    pub node_pools: Vec<NodePoolConfig>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            heartbeat_timeout: Duration::from_secs(15),
            rate_limit_per_second: 100,
            protocol_rate_limit_per_second: 2_000,
            anonymous_rate_limit_per_second: 10,
            sync_reports_in_flight: 8,
            reconcile_tick: Duration::from_secs(1),
            pass_at_least_every: Duration::from_secs(5),
            placement_policy: flotilla_sched::Policy::Flotilla,
            billing_every: Duration::from_secs(30),
            operator_fee_percent: rust_decimal::Decimal::from(15),
            webhook_allow_private: false,
            allow_egress: Vec::new(),
            secrets_key_file: None,
            gpu_health: flotilla_core::health::HealthPolicy::default(),
            node_pools: Vec::new(),
        }
    }
}

impl ServerConfig {
    /// Where tenant-chosen outbound calls (queue triggers, registry
    /// logins) may go: public addresses and the operator's rules.
    pub fn egress(&self) -> flotilla_egress::EgressPolicy {
        flotilla_egress::EgressPolicy::new(self.allow_egress.clone())
    }

    /// Where budget webhooks may go: as [`Self::egress`], or anywhere with
    /// `webhook_allow_private`.
    pub fn webhook_egress(&self) -> flotilla_egress::EgressPolicy {
        if self.webhook_allow_private {
            flotilla_egress::EgressPolicy::allow_all()
        } else {
            self.egress()
        }
    }

    /// How often agents sync at least: a third of the heartbeat timeout,
    /// so a node misses two syncs before it is given up.
    pub fn heartbeat_interval(&self) -> Duration {
        (self.heartbeat_timeout / 3).max(Duration::from_millis(200))
    }

    /// The leader lease's time to live: one heartbeat interval. Renewed
    /// every third of it, and tried for by followers as often, so a lost
    /// leader is replaced within 4/3 of an interval (under two).
    pub fn leader_lease(&self) -> Duration {
        self.heartbeat_interval()
    }

    /// How long the database lets a session idle in a transaction or wait
    /// for a lock, for this leader lease: a replica stalled holding the
    /// lease row does not stall the others (see
    /// [`flotilla_store::leases`]).
    pub fn store_timeouts(&self) -> flotilla_store::leases::Timeouts {
        flotilla_store::leases::Timeouts::for_lease(self.leader_lease())
    }

    /// A node's lease: an agent that has not synced for this long stops
    /// its work itself. It is the heartbeat timeout.
    pub fn node_lease(&self) -> Duration {
        self.heartbeat_timeout
    }

    /// How long past a node's lease the server waits before it declares
    /// the node's work lost and lets it run elsewhere: one heartbeat
    /// interval, for the agent's kill to land and for clock skew between
    /// replicas.
    pub fn node_lease_margin(&self) -> Duration {
        self.heartbeat_interval()
    }
}

/// One node pool the server grows and shrinks.
#[derive(Clone)]
pub struct NodePoolConfig {
    /// Pool name: the nodes' `pool`.
    pub name: String,
    /// Where machines come from.
    pub provider: Arc<dyn CapacityProvider>,
    /// The instance type to ask for.
    pub instance_type: String,
    /// Its GPU model, catalog spelling.
    pub gpu_model: String,
    /// How the machines' agents run work.
    pub runtime: RuntimeKind,
    /// Sizes and timeouts.
    pub bounds: PoolBounds,
    /// Ask for spot machines.
    pub spot: bool,
    /// Region to ask in; `None`: the provider's choice.
    pub region: Option<String>,
    /// The URL new machines reach this control plane at.
    pub join_url: String,
    /// The certificate fingerprint new machines pin the control plane by
    /// (a self-signed certificate); `None`: their system roots.
    pub join_fingerprint: Option<String>,
    /// How long a join token stays good.
    pub join_ttl: Duration,
    /// The last decision and the provisioning back-off, shared with the
    /// API's view.
    pub status: Arc<Mutex<PoolStatus>>,
}

/// What the loop remembers of a pool between passes (lost on restart:
/// only the reason shown and a back-off).
#[derive(Debug, Clone, Default)]
pub struct PoolStatus {
    /// The last decision's reason.
    pub last_decision: Option<String>,
    /// No machine is asked for before this.
    pub backoff_until: Option<DateTime<Utc>>,
}

impl std::fmt::Debug for NodePoolConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodePoolConfig")
            .field("name", &self.name)
            .field("provider", &self.provider.kind())
            .field("instance_type", &self.instance_type)
            .field("gpu_model", &self.gpu_model)
            .field("bounds", &self.bounds)
            .field("spot", &self.spot)
            .field("join_url", &self.join_url)
            .field("join_fingerprint", &self.join_fingerprint)
            .finish()
    }
}
