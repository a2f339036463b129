//! What the gateway needs from the control plane, and an in-memory control
//! for tests, benchmarks and single-process setups.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use flotilla_core::gateway::{EndpointSignals, KeyGrant, RequestUsage, RouteTable};
use tokio::sync::{broadcast, Notify};

/// The future every [`Control`] method returns. Boxed so that the trait
/// stays object-safe: the gateway holds an `Arc<dyn Control>`, and the
/// control plane's HTTP client and [`StaticControl`] are interchangeable at
/// run time.
pub type ControlFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, ControlError>> + Send + 'a>>;

/// A control-plane call that failed. The gateway keeps serving on what it
/// last knew, retries reports on the next tick and keeps usage until
/// [`Control::meter`] succeeds.
#[derive(Debug, thiserror::Error)]
#[error("control plane: {message}")]
pub struct ControlError {
    /// What failed.
    pub message: String,
    /// The underlying cause, when there is one.
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl ControlError {
    /// An error with a message and no cause.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            source: None,
        }
    }

    /// An error caused by `source`.
    pub fn with_source(
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self {
            message: message.into(),
            source: Some(Box::new(source)),
        }
    }
}

/// The gateway's view of the control plane. The gateway never reads the
/// database: it polls [`routes`](Control::routes), asks
/// [`authorize`](Control::authorize) about keys it has not seen recently
/// (answers are cached briefly), pushes demand through
/// [`report`](Control::report) and usage through [`meter`](Control::meter).
pub trait Control: Send + Sync + 'static {
    /// Every endpoint with its ready replicas.
    fn routes(&self) -> ControlFuture<'_, RouteTable>;

    /// What an inference key may call; `None` for an unknown key.
    fn authorize<'a>(&'a self, key: &'a str) -> ControlFuture<'a, Option<KeyGrant>>;

    /// Demand per endpoint: at least every second, and at once (at most
    /// every 100 ms) when a request starts waiting at zero replicas or a
    /// queue forms behind busy ones.
    fn report(&self, signals: Vec<EndpointSignals>) -> ControlFuture<'_, ()>;

    /// Usage of finished requests. An error keeps the batch for a retry, so
    /// the receiver must be idempotent on `request_id`.
    fn meter(&self, usage: Vec<RequestUsage>) -> ControlFuture<'_, ()>;

    /// Whether `key` is an operator's key: it may read the gateway's
    /// `/metrics` (which names every endpoint). `false` for every other
    /// key, known or not.
    /// The default: no key (a control that knows no operators).
    fn is_operator<'a>(&'a self, key: &'a str) -> ControlFuture<'a, bool> {
        let _ = key;
        Box::pin(async { Ok(false) })
    }

    /// A notification the control fires when the route table changed, so
    /// the gateway re-reads it at once instead of at its next poll. `None`
    /// (the default) means poll only.
    fn route_changes(&self) -> Option<Arc<Notify>> {
        None
    }
}

/// An in-memory [`Control`]: a route table and keys set by the caller,
/// reports and usage recorded for inspection. Used by the tests and the
/// benchmark; also a way to run the gateway without a server.
pub struct StaticControl {
    routes: Mutex<RouteTable>,
    keys: Mutex<HashMap<String, KeyGrant>>,
    operator_keys: Mutex<Vec<String>>,
    reports: Mutex<Vec<EndpointSignals>>,
    usage: Mutex<Vec<RequestUsage>>,
    fail_meter: AtomicBool,
    changed: Arc<Notify>,
    report_tx: broadcast::Sender<Vec<EndpointSignals>>,
}

impl Default for StaticControl {
    fn default() -> Self {
        Self::new()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere while holding one of these plain-data locks leaves
    // the data usable: keep going rather than poison every later call.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl StaticControl {
    /// An empty control: no endpoints, no keys.
    pub fn new() -> Self {
        Self {
            routes: Mutex::new(RouteTable::default()),
            keys: Mutex::new(HashMap::new()),
            operator_keys: Mutex::new(Vec::new()),
            reports: Mutex::new(Vec::new()),
            usage: Mutex::new(Vec::new()),
            fail_meter: AtomicBool::new(false),
            changed: Arc::new(Notify::new()),
            report_tx: broadcast::channel(1024).0,
        }
    }

    /// Replaces the route table and tells the gateway.
    pub fn set_routes(&self, table: RouteTable) {
        *lock(&self.routes) = table;
        self.changed.notify_one();
    }

    /// Changes the route table in place and tells the gateway.
    pub fn update_routes(&self, f: impl FnOnce(&mut RouteTable)) {
        f(&mut lock(&self.routes));
        self.changed.notify_one();
    }

    /// The current route table.
    pub fn route_table(&self) -> RouteTable {
        lock(&self.routes).clone()
    }

    /// Lets `key` call with `grant` (replacing an earlier grant).
    pub fn set_key(&self, key: impl Into<String>, grant: KeyGrant) {
        lock(&self.keys).insert(key.into(), grant);
    }

    /// Makes `key` an operator's key (it may read `/metrics`).
    pub fn set_operator_key(&self, key: impl Into<String>) {
        lock(&self.operator_keys).push(key.into());
    }

    /// Forgets `key`.
    pub fn remove_key(&self, key: &str) {
        lock(&self.keys).remove(key);
    }

    /// Every report received, oldest first.
    pub fn reports(&self) -> Vec<EndpointSignals> {
        lock(&self.reports).clone()
    }

    /// Reports as they arrive.
    pub fn subscribe_reports(&self) -> broadcast::Receiver<Vec<EndpointSignals>> {
        self.report_tx.subscribe()
    }

    /// Every usage record received, in arrival order.
    pub fn usage(&self) -> Vec<RequestUsage> {
        lock(&self.usage).clone()
    }

    /// Makes [`Control::meter`] fail (true) or succeed again (false), to
    /// exercise the gateway's retry.
    pub fn fail_meter(&self, fail: bool) {
        self.fail_meter.store(fail, Ordering::SeqCst);
    }
}

impl Control for StaticControl {
    fn routes(&self) -> ControlFuture<'_, RouteTable> {
        let table = self.route_table();
        Box::pin(async move { Ok(table) })
    }

    fn authorize<'a>(&'a self, key: &'a str) -> ControlFuture<'a, Option<KeyGrant>> {
        let grant = lock(&self.keys).get(key).cloned();
        Box::pin(async move { Ok(grant) })
    }

    fn is_operator<'a>(&'a self, key: &'a str) -> ControlFuture<'a, bool> {
        let known = lock(&self.operator_keys).iter().any(|k| k == key);
        Box::pin(async move { Ok(known) })
    }

    fn report(&self, signals: Vec<EndpointSignals>) -> ControlFuture<'_, ()> {
        lock(&self.reports).extend(signals.iter().cloned());
        let _ = self.report_tx.send(signals);
        Box::pin(async { Ok(()) })
    }

    fn meter(&self, usage: Vec<RequestUsage>) -> ControlFuture<'_, ()> {
        let result = if self.fail_meter.load(Ordering::SeqCst) {
            Err(ControlError::new(
                "metering is failing (StaticControl::fail_meter)",
            ))
        } else {
            lock(&self.usage).extend(usage);
            Ok(())
        };
        Box::pin(async move { result })
    }

    fn route_changes(&self) -> Option<Arc<Notify>> {
        Some(self.changed.clone())
    }
}
