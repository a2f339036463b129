//! Shared state of the server: the store, the catalog, the clock, the rate
//! limiter and the change signal that wakes long-polls and log followers.

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use flotilla_core::api::GpuSample;
use flotilla_core::catalog::Catalog;
use flotilla_core::clock::Clock;
use flotilla_core::id::NodeId;
use flotilla_store::Store;
use governor::clock::{Clock as _, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use tokio::sync::watch;

use crate::config::ServerConfig;
use crate::error::ApiError;

/// The wall clock: the server's choice of [`Clock`].
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

struct Inner {
    catalog: Catalog,
    config: ServerConfig,
    clock: Arc<dyn Clock>,
    limiter: DefaultKeyedRateLimiter<String>,
    /// Machine protocol (agents, the gateway, usage batches), by key: a
    /// budget of its own, so a fleet's agents sharing one key neither
    /// starve nor are starved by that key's people.
    protocol: DefaultKeyedRateLimiter<String>,
    /// Requests without a valid key, by source address.
    anonymous: DefaultKeyedRateLimiter<Option<IpAddr>>,
    /// Bumped when any node's assignments may have changed: every held
    /// agent sync wakes to look.
    changes: watch::Sender<u64>,
    /// Bumped on a change that no node's assignments follow from until a
    /// control loop acts on it (work submitted, a node's report of its
    /// instances, its registration, its logs, a GPU fault or a cordon):
    /// the control loops and log followers look again, held syncs do not
    /// (at a fleet of thousands, waking every sync on every such change is
    /// a storm of reads that finds nothing new).
    control: watch::Sender<u64>,
    /// One signal per node whose sync is or was held here, bumped when
    /// that node's assignments changed ([`AppState::notify_nodes`]): a
    /// placement wakes the syncs of the nodes it placed on, not the
    /// fleet's. Never shrinks below the nodes that synced here (one small
    /// entry each).
    node_wakes: Mutex<HashMap<NodeId, watch::Sender<u64>>>,
    shutdown: watch::Receiver<bool>,
    started_at: DateTime<Utc>,
    billing: crate::billing_step::Runtime,
    /// The last GPU telemetry of each node. Observed state that the next
    /// sync replaces, so it lives in memory, not in the store: after a
    /// restart it is back within one sync interval.
    telemetry: Mutex<HashMap<NodeId, Telemetry>>,
    /// Whether this replica leads (runs the loops), and who does.
    leadership: watch::Sender<Leadership>,
    /// This replica's name in the leader lease.
    replica: String,
    /// Wakes the endpoint autoscaler before its tick: a request waiting at
    /// zero replicas must not wait for a policy window.
    endpoints_wake: Arc<tokio::sync::Notify>,
    /// The secrets key, loaded (or created) on first use; under a lock so
    /// that concurrent first uses load it once.
    secret_key: Mutex<Option<flotilla_store::secrets::SecretKey>>,
    /// Counters and histograms of what this replica did (`/metrics`).
    ops: crate::ops_metrics::OpsMetrics,
    /// The last scheduling plan, for readers of its outcome.
    last_plan: crate::last_plan::Kept,
    /// API requests that may have written, answered so far.
    writes: std::sync::atomic::AtomicU64,
    /// Each instance's GPU readings as its agents reported them, for its
    /// utilisation summary and right-sizing advice. In memory, like the
    /// latest telemetry: a restart starts the profile afresh.
    profiles: Mutex<HashMap<flotilla_core::id::InstanceId, Profile>>,
    /// Sessions into instances waiting for their agent to dial back.
    access: crate::access::Sessions,
    /// Agents' heartbeats, committed in groups.
    heartbeats: crate::heartbeats::Heartbeats,
    /// Sync reports in flight on this replica, at most
    /// `ServerConfig::sync_reports_in_flight` (see `routes::agent::sync`).
    sync_reports: tokio::sync::Semaphore,
}

/// An instance's recent GPU readings.
#[derive(Debug, Default)]
pub struct Profile {
    /// When the last reading came.
    pub last: Option<DateTime<Utc>>,
    /// Readings, oldest first, at most [`PROFILE_SAMPLES`].
    pub samples: std::collections::VecDeque<flotilla_core::advice::UsageSample>,
}

/// Readings kept per instance: a day of one GPU at the default 5 s sync.
pub const PROFILE_SAMPLES: usize = 17_280;
/// Profiles not fed for this long are forgotten (their instance ended).
const PROFILE_TTL_HOURS: i64 = 24;

/// This replica's part among the servers on one database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leadership {
    /// Runs the control loops, its writes fenced with `token`.
    Leader {
        /// The fencing token of its term.
        token: i64,
        /// Until when its lease is surely still valid by this process's
        /// monotonic clock (the lease's TTL counted from when the renewal
        /// that granted it was sent).
        valid_until: tokio::time::Instant,
    },
    /// Serves the API only; `leader` holds the lease (when known).
    Follower {
        /// The leader's replica id, while its lease is current.
        leader: Option<String>,
    },
}

/// One node's last GPU readings and when they arrived.
#[derive(Debug, Clone)]
pub struct Telemetry {
    /// When the sync carrying them arrived.
    pub at: DateTime<Utc>,
    /// One sample per GPU.
    pub gpus: Vec<GpuSample>,
}

/// Cheap to clone; shared by every handler and loop. The store is kept
/// beside the shared part so that the leader's loops can run on a clone
/// whose store is fenced with their term's token ([`AppState::fenced`]).
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
    store: Store,
}

/// A per-second rate and its burst (twice the rate), at least one each.
fn quota_of(per_second: u32) -> (NonZeroU32, NonZeroU32) {
    (
        NonZeroU32::new(per_second.max(1)).unwrap_or(NonZeroU32::MIN),
        NonZeroU32::new(per_second.saturating_mul(2).max(1)).unwrap_or(NonZeroU32::MIN),
    )
}

impl AppState {
    /// Builds the state. `shutdown` turns true when the server stops.
    pub fn new(
        store: Store,
        config: ServerConfig,
        clock: Arc<dyn Clock>,
        shutdown: watch::Receiver<bool>,
    ) -> Self {
        let per_s = NonZeroU32::new(config.rate_limit_per_second.max(1)).unwrap_or(NonZeroU32::MIN);
        let burst = NonZeroU32::new(config.rate_limit_per_second.saturating_mul(2).max(1))
            .unwrap_or(NonZeroU32::MIN);
        let anon_per_s = NonZeroU32::new(config.anonymous_rate_limit_per_second.max(1))
            .unwrap_or(NonZeroU32::MIN);
        let anon_burst = NonZeroU32::new(
            config
                .anonymous_rate_limit_per_second
                .saturating_mul(2)
                .max(1),
        )
        .unwrap_or(NonZeroU32::MIN);
        let (proto_per_s, proto_burst) = quota_of(config.protocol_rate_limit_per_second);
        let started_at = clock.now();
        let sync_reports = tokio::sync::Semaphore::new(config.sync_reports_in_flight.max(1));
        Self {
            store,
            inner: Arc::new(Inner {
                catalog: Catalog::default(),
                limiter: RateLimiter::keyed(Quota::per_second(per_s).allow_burst(burst)),
                protocol: RateLimiter::keyed(
                    Quota::per_second(proto_per_s).allow_burst(proto_burst),
                ),
                anonymous: RateLimiter::keyed(
                    Quota::per_second(anon_per_s).allow_burst(anon_burst),
                ),
                config,
                clock,
                changes: watch::channel(0).0,
                control: watch::channel(0).0,
                node_wakes: Mutex::default(),
                shutdown,
                started_at,
                billing: crate::billing_step::Runtime::default(),
                telemetry: Mutex::default(),
                leadership: watch::channel(Leadership::Follower { leader: None }).0,
                replica: replica_id(),
                endpoints_wake: Arc::default(),
                secret_key: Mutex::default(),
                ops: crate::ops_metrics::OpsMetrics::default(),
                last_plan: crate::last_plan::Kept::default(),
                writes: std::sync::atomic::AtomicU64::new(0),
                profiles: Mutex::default(),
                access: crate::access::Sessions::default(),
                heartbeats: crate::heartbeats::Heartbeats::default(),
                sync_reports,
            }),
        }
    }

    /// The same state, its store's writes fenced with the leader lease's
    /// `token`: what the leader's loops run on, so that once another
    /// replica took the lease their writes are refused.
    pub fn fenced(&self, token: i64) -> Self {
        Self {
            inner: self.inner.clone(),
            store: self.store.fenced(flotilla_store::leases::LEADER, token),
        }
    }

    /// Sessions into instances waiting for their agent (exec, shell,
    /// port-forward).
    pub fn access(&self) -> &crate::access::Sessions {
        &self.inner.access
    }

    /// Records that `node`'s agent was heard at `now`, committed with the
    /// other syncs' heartbeats waiting at the same time
    /// ([`crate::heartbeats`]); the node's state before it.
    pub async fn heartbeat(
        &self,
        node: &flotilla_core::id::NodeId,
        now: DateTime<Utc>,
    ) -> Result<flotilla_core::node::NodeState, flotilla_store::StoreError> {
        self.inner.heartbeats.beat(&self.store, node, now).await
    }

    /// The slots for agent sync reports in flight on this replica: a
    /// report holds one while it reads and writes the node's instances.
    pub fn sync_report_slots(&self) -> &tokio::sync::Semaphore {
        &self.inner.sync_reports
    }

    /// This replica's operational series.
    pub fn ops(&self) -> &crate::ops_metrics::OpsMetrics {
        &self.inner.ops
    }

    /// This replica's name in the leader lease.
    pub fn replica(&self) -> &str {
        &self.inner.replica
    }

    /// This replica's part now.
    pub fn leadership(&self) -> Leadership {
        self.inner.leadership.borrow().clone()
    }

    /// Records this replica's part (the election loop's).
    pub fn set_leadership(&self, l: Leadership) {
        self.inner.leadership.send_if_modified(|now| {
            let changed = *now != l;
            *now = l;
            changed
        });
    }

    /// Whether this replica leads under a lease still valid now: the loops
    /// skip a pass otherwise (their writes would be refused anyway).
    pub fn leads(&self) -> bool {
        matches!(self.leadership(), Leadership::Leader { valid_until, .. } if valid_until > tokio::time::Instant::now())
    }

    /// Keeps `gpus` as `node`'s latest telemetry.
    pub fn record_telemetry(&self, node: &NodeId, at: DateTime<Utc>, gpus: Vec<GpuSample>) {
        self.telemetry_map()
            .insert(node.clone(), Telemetry { at, gpus });
    }

    /// Adds readings of GPUs `instance` holds to its profile.
    pub fn record_profile(
        &self,
        instance: &flotilla_core::id::InstanceId,
        at: DateTime<Utc>,
        samples: impl IntoIterator<Item = flotilla_core::advice::UsageSample>,
    ) {
        // One push per reading: a poisoned lock still holds whole values.
        let mut map = self
            .inner
            .profiles
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if map.len() > 1000 {
            let cutoff = at - chrono::Duration::hours(PROFILE_TTL_HOURS);
            map.retain(|_, p| p.last.is_some_and(|l| l >= cutoff));
        }
        let p = map.entry(instance.clone()).or_default();
        p.last = Some(at);
        for s in samples {
            if p.samples.len() >= PROFILE_SAMPLES {
                p.samples.pop_front();
            }
            p.samples.push_back(s);
        }
    }

    /// The readings recorded for `instance`, oldest first.
    pub fn profile(
        &self,
        instance: &flotilla_core::id::InstanceId,
    ) -> Vec<flotilla_core::advice::UsageSample> {
        self.inner
            .profiles
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(instance)
            .map(|p| p.samples.iter().copied().collect())
            .unwrap_or_default()
    }

    /// The latest telemetry of every node that reported since `since`.
    pub fn telemetry_since(&self, since: DateTime<Utc>) -> HashMap<NodeId, Telemetry> {
        let mut map = self.telemetry_map();
        map.retain(|_, t| t.at >= since);
        map.clone()
    }

    /// The telemetry of every node heard from within the heartbeat
    /// timeout: an older reading describes a node that may be gone, and is
    /// dropped rather than shown as current.
    pub fn fresh_telemetry(&self) -> HashMap<NodeId, Telemetry> {
        let timeout = chrono::Duration::from_std(self.config().heartbeat_timeout)
            .unwrap_or(chrono::Duration::seconds(15));
        self.telemetry_since(self.now() - timeout)
    }

    fn telemetry_map(&self) -> std::sync::MutexGuard<'_, HashMap<NodeId, Telemetry>> {
        // A panic while holding the lock cannot leave the map half-written
        // (each update is one insert), so a poisoned lock is still usable.
        self.inner
            .telemetry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// State of the periodic billing step.
    pub fn billing(&self) -> &crate::billing_step::Runtime {
        &self.inner.billing
    }

    /// The GPU catalog.
    pub fn catalog(&self) -> &Catalog {
        &self.inner.catalog
    }

    /// The key that seals and opens stored secrets: `FLOTILLA_SECRETS_KEY`,
    /// else the configured key file (created on first use). Without either
    /// the features that store secrets answer 503.
    pub fn secret_key(&self) -> Result<flotilla_store::secrets::SecretKey, ApiError> {
        use flotilla_store::secrets::{SecretKey, KEY_ENV};
        let mut slot = self
            .inner
            .secret_key
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(k) = slot.as_ref() {
            return Ok(k.clone());
        }
        let key = match (SecretKey::from_env(), &self.inner.config.secrets_key_file) {
            (Some(from_env), _) => from_env,
            (None, Some(file)) => SecretKey::load_file(file),
            (None, None) => {
                return Err(ApiError::unavailable(format!(
                    "this server has no secrets key: set {KEY_ENV} or give it a data directory"
                )))
            }
        }
        .map_err(ApiError::internal)?;
        *slot = Some(key.clone());
        Ok(key)
    }

    /// Settings.
    pub fn config(&self) -> &ServerConfig {
        &self.inner.config
    }

    /// The clock every decision of this server reads: handed to the
    /// console, which shows times against the same `now`.
    pub fn clock(&self) -> Arc<dyn Clock> {
        self.inner.clock.clone()
    }

    /// Now, by the injected clock.
    pub fn now(&self) -> DateTime<Utc> {
        self.inner.clock.now()
    }

    /// When this process started serving.
    pub fn started_at(&self) -> DateTime<Utc> {
        self.inner.started_at
    }

    /// 429 when `key` has used up its requests: its machine-protocol
    /// budget for such a `path` (`routes::kinds::is_protocol`), its own
    /// otherwise.
    pub fn check_rate_for(&self, key: &str, path: &str) -> Result<(), ApiError> {
        let limiter = if crate::routes::kinds::is_protocol(path) {
            &self.inner.protocol
        } else {
            &self.inner.limiter
        };
        match limiter.check_key(&key.to_string()) {
            Ok(()) => Ok(()),
            Err(not_until) => {
                let wait = not_until.wait_time_from(DefaultClock::default().now());
                Err(ApiError::rate_limited(wait.as_secs_f64().ceil() as u64))
            }
        }
    }

    /// 429 when `key` has used up its requests.
    pub fn check_rate(&self, key: &str) -> Result<(), ApiError> {
        match self.inner.limiter.check_key(&key.to_string()) {
            Ok(()) => Ok(()),
            Err(not_until) => {
                let wait = not_until.wait_time_from(DefaultClock::default().now());
                Err(ApiError::rate_limited(wait.as_secs_f64().ceil() as u64))
            }
        }
    }

    /// 429 when requests without a valid key from `addr` (`None`: a
    /// connection whose peer is unknown, all counted together) used up
    /// theirs.
    pub fn check_anonymous_rate(&self, addr: Option<IpAddr>) -> Result<(), ApiError> {
        match self.inner.anonymous.check_key(&addr) {
            Ok(()) => Ok(()),
            Err(not_until) => {
                let wait = not_until.wait_time_from(DefaultClock::default().now());
                Err(ApiError::rate_limited_anonymous(
                    wait.as_secs_f64().ceil() as u64
                ))
            }
        }
    }

    /// Forgets rate-limit state of keys that have been idle long enough to
    /// be back at a full burst, so the limiter does not grow forever.
    pub fn prune_rate_limits(&self) {
        self.inner.limiter.retain_recent();
        self.inner.limiter.shrink_to_fit();
        self.inner.protocol.retain_recent();
        self.inner.protocol.shrink_to_fit();
        self.inner.anonymous.retain_recent();
        self.inner.anonymous.shrink_to_fit();
    }

    /// Signals that instances or assignments changed: wakes the control
    /// loops, log followers and every held agent sync.
    pub fn notify_change(&self) {
        self.inner.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Signals a change that no node's assignments follow from until a
    /// control loop acts on it (work submitted; a node's report of its
    /// instances' phases, its registration, its logs, a GPU fault; a
    /// cordon): wakes the control loops and log followers (see
    /// [`Self::subscribe_control`]), not the nodes' held syncs. What the
    /// loops then decide for a node (a placement, a stop) they signal with
    /// [`Self::notify_change`].
    pub fn notify_control(&self) {
        self.inner.control.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Signals that the assignments of `nodes` changed (a placement on
    /// them, a stop of their work): wakes those nodes' held syncs here,
    /// and the control loops and log followers as
    /// [`Self::notify_control`] does, but not other nodes' syncs. Use
    /// [`Self::notify_change`] when the nodes are not known.
    pub fn notify_nodes<'a>(&self, nodes: impl IntoIterator<Item = &'a NodeId>) {
        {
            let wakes = self.node_wakes();
            for node in nodes {
                if let Some(wake) = wakes.get(node) {
                    wake.send_modify(|n| *n = n.wrapping_add(1));
                }
            }
        }
        self.notify_control();
    }

    /// A receiver of [`Self::notify_nodes`]'s signal for `node`, marked
    /// seen: a held sync subscribes before it reads the assignments, so a
    /// change written after that read still wakes it.
    pub fn subscribe_node(&self, node: &NodeId) -> watch::Receiver<u64> {
        let mut wakes = self.node_wakes();
        let mut rx = match wakes.get(node) {
            Some(wake) => wake.subscribe(),
            None => {
                let (tx, rx) = watch::channel(0);
                wakes.insert(node.clone(), tx);
                rx
            }
        };
        rx.borrow_and_update();
        rx
    }

    fn node_wakes(&self) -> std::sync::MutexGuard<'_, HashMap<NodeId, watch::Sender<u64>>> {
        // Each update is one insert or one bump: a poisoned lock is usable.
        self.inner
            .node_wakes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Wakes the endpoint autoscaler now (see `crate::endpoints`).
    pub fn wake_endpoints(&self) {
        self.inner.endpoints_wake.notify_one();
    }

    /// What the endpoint autoscaler waits on between ticks.
    pub fn endpoints_wake(&self) -> Arc<tokio::sync::Notify> {
        self.inner.endpoints_wake.clone()
    }

    /// Grows with every change signalled ([`Self::notify_change`]) and
    /// every API request that may have written ([`Self::note_write`]):
    /// a kept plan made at another generation is stale.
    pub fn change_generation(&self) -> u64 {
        let writes = self.inner.writes.load(std::sync::atomic::Ordering::Acquire);
        (*self.inner.changes.borrow())
            .wrapping_add(*self.inner.control.borrow())
            .wrapping_add(writes)
    }

    /// Counts an API request that may have written.
    pub fn note_write(&self) {
        self.inner
            .writes
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    /// The last scheduling plan this replica made or read.
    pub fn last_plan(&self) -> &crate::last_plan::Kept {
        &self.inner.last_plan
    }

    /// A receiver of [`Self::notify_change`]'s signal: any node's
    /// assignments may have changed.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.changes.subscribe()
    }

    /// A receiver of [`Self::notify_control`]'s signal; the control
    /// loops and log followers wait on it beside [`Self::subscribe`].
    pub fn subscribe_control(&self) -> watch::Receiver<u64> {
        self.inner.control.subscribe()
    }

    /// A receiver that turns true when the server shuts down.
    pub fn shutdown_signal(&self) -> watch::Receiver<bool> {
        self.inner.shutdown.clone()
    }

    /// New ids: time from the injected clock, randomness from the OS.
    pub fn ids(&self) -> (u64, u128) {
        (
            self.now().timestamp_millis().max(0) as u64,
            rand::random::<u128>(),
        )
    }
}

/// A name for this replica, unique among the servers on one database:
/// the host, the process id and a random suffix (a restarted process on
/// the same host may get the same pid).
pub fn replica_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "server".to_string());
    format!(
        "{host}-{}-{:04x}",
        std::process::id(),
        rand::random::<u16>()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[tokio::test]
    async fn telemetry_older_than_the_cutoff_is_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/t.db?mode=rwc", dir.path().display());
        let store = flotilla_store::Store::connect(&url).await.unwrap();
        let (_tx, rx) = watch::channel(false);
        let st = AppState::new(store, ServerConfig::default(), Arc::new(SystemClock), rx);
        let t0 = Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0).unwrap();
        let (a, b) = (NodeId::generate(1, 1), NodeId::generate(2, 2));
        let sample = GpuSample {
            uuid: "GPU-a".into(),
            gpu_util_pct: Some(50),
            ..GpuSample::default()
        };
        st.record_telemetry(&a, t0, vec![sample.clone()]);
        st.record_telemetry(&b, t0 + chrono::Duration::seconds(20), vec![sample]);
        let fresh = st.telemetry_since(t0 + chrono::Duration::seconds(10));
        assert_eq!(fresh.keys().collect::<Vec<_>>(), vec![&b]);
        // Forgotten, not only hidden: a later, earlier cutoff finds no `a`.
        assert!(!st.telemetry_since(t0).contains_key(&a));
    }
}
