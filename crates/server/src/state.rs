//! Shared state of the server: the store, the catalog, the clock, the rate
//! limiter and the change signal that wakes long-polls and log followers.

use std::num::NonZeroU32;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use flotilla_core::catalog::Catalog;
use flotilla_core::clock::Clock;
use flotilla_store::Store;
use governor::clock::{Clock as _, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use tokio::sync::watch;

use crate::error::ApiError;
use crate::ServerConfig;

/// The wall clock: the server's choice of [`Clock`].
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

struct Inner {
    store: Store,
    catalog: Catalog,
    config: ServerConfig,
    clock: Arc<dyn Clock>,
    limiter: DefaultKeyedRateLimiter<String>,
    changes: watch::Sender<u64>,
    shutdown: watch::Receiver<bool>,
    started_at: DateTime<Utc>,
    billing: crate::pricing::Runtime,
}

/// Cheap to clone; shared by every handler and loop.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

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
        let started_at = clock.now();
        Self(Arc::new(Inner {
            store,
            catalog: Catalog::default(),
            limiter: RateLimiter::keyed(Quota::per_second(per_s).allow_burst(burst)),
            config,
            clock,
            changes: watch::channel(0).0,
            shutdown,
            started_at,
            billing: crate::pricing::Runtime::default(),
        }))
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.0.store
    }

    /// State of the periodic billing step.
    pub fn billing(&self) -> &crate::pricing::Runtime {
        &self.0.billing
    }

    /// The GPU catalog.
    pub fn catalog(&self) -> &Catalog {
        &self.0.catalog
    }

    /// Settings.
    pub fn config(&self) -> &ServerConfig {
        &self.0.config
    }

    /// Now, by the injected clock.
    pub fn now(&self) -> DateTime<Utc> {
        self.0.clock.now()
    }

    /// When this process started serving.
    pub fn started_at(&self) -> DateTime<Utc> {
        self.0.started_at
    }

    /// 429 when `key` has used up its requests.
    pub fn check_rate(&self, key: &str) -> Result<(), ApiError> {
        match self.0.limiter.check_key(&key.to_string()) {
            Ok(()) => Ok(()),
            Err(not_until) => {
                let wait = not_until.wait_time_from(DefaultClock::default().now());
                Err(ApiError::rate_limited(wait.as_secs_f64().ceil() as u64))
            }
        }
    }

    /// Forgets rate-limit state of keys that have been idle long enough to
    /// be back at a full burst, so the limiter does not grow forever.
    pub fn prune_rate_limits(&self) {
        self.0.limiter.retain_recent();
        self.0.limiter.shrink_to_fit();
    }

    /// Signals that instances, assignments or logs changed.
    pub fn notify_change(&self) {
        self.0.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver of change signals.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.0.changes.subscribe()
    }

    /// A receiver that turns true when the server shuts down.
    pub fn shutdown_signal(&self) -> watch::Receiver<bool> {
        self.0.shutdown.clone()
    }

    /// New ids: time from the injected clock, randomness from the OS.
    pub fn ids(&self) -> (u64, u128) {
        (
            self.now().timestamp_millis().max(0) as u64,
            rand::random::<u128>(),
        )
    }
}
