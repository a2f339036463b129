//! Flotilla's inference gateway: the data plane in front of endpoint
//! replicas.
//!
//! A request is authorised by its inference key, routed to an endpoint (by
//! the `/e/{name}/` path prefix, the `{name}.{domain}` host, or the body's
//! `model` on the OpenAI paths), checked against the tenant's hard cap and
//! the key's rate limit, given a replica (least outstanding of two random
//! choices, or bounded-load consistent hashing on the prompt prefix or a
//! session id) and proxied there; the response streams back unbuffered.
//! When no replica can take it — none started yet, or all saturated — the
//! request waits in a bounded per-endpoint queue (the activator) until one
//! can or its deadline passes, and the wait is reported to the control
//! plane at once so scaling from zero starts with the first request.
//!
//! The gateway never touches the database: everything it knows comes from
//! a [`Control`] (the route table, key grants) and everything it learns
//! goes back there (demand signals, per-request usage). It keeps no state
//! that matters across restarts except usage not yet delivered, which it
//! retries until the control plane takes it. See `docs/gateway.md`.

mod api_control;
mod body;
mod control;
mod error;
mod meter;
mod pool;
mod proxy;
mod signals;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use flotilla_core::gateway::{KeyGrant, RouteTable};
use flotilla_core::id::{EndpointId, TenantId};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub use api_control::ApiControl;
pub use body::GatewayBody;
pub use control::{Control, ControlError, ControlFuture, StaticControl};
pub use error::{GatewayError, Refusal};

use crate::meter::MeterQueue;
use crate::pool::{BalanceConfig, Endpoint};
use crate::signals::Metrics;

/// How the gateway behaves. [`Default`] suits production; tests shorten
/// the intervals.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// How often the route table is re-read (besides pushes through
    /// [`Control::route_changes`] and [`GatewayHandle::notify_routes`]).
    pub route_poll_interval: Duration,
    /// How often demand is reported (besides at once on a wait at zero).
    pub report_interval: Duration,
    /// How often buffered usage is delivered (besides when a batch is full).
    pub meter_interval: Duration,
    /// Usage records per `meter` call at most.
    pub meter_batch: usize,
    /// Usage records kept while the control plane does not take them.
    pub meter_buffer: usize,
    /// How long a key's grant (or its absence) is trusted before asking
    /// again: a revoked key or a reached hard cap takes effect within it.
    pub auth_cache_ttl: Duration,
    /// The gateway's domain: a request for host `{name}.{domain}` goes to
    /// the caller's endpoint `name`. Without one, the host's first label is
    /// tried when the host has at least three labels and is not an IP.
    pub domain: Option<String>,
    /// Request bodies over this are answered 413 (bodies are buffered to
    /// read `model` and to retry).
    pub max_body_bytes: usize,
    /// Characters of the prompt that make its affinity key.
    pub affinity_prefix_chars: usize,
    /// Bounded-load factor: an affine request goes to its replica while
    /// that replica's load stays within this multiple of the mean.
    pub affinity_load_factor: f64,
    /// Seed of the balancer's random choices.
    pub seed: u64,
    /// Connecting to a replica longer than this counts as a failed connect
    /// (the request is retried on another replica).
    pub connect_timeout: Duration,
    /// A replica that refused a connection gets nothing new for this long.
    pub eject_for: Duration,
    /// Replicas tried per request at most (failed connects only).
    pub max_attempts: u32,
    /// How long shutdown waits for requests in flight and undelivered usage.
    pub shutdown_timeout: Duration,
    /// Serve HTTPS with this certificate; `None`: plain HTTP.
    pub tls: Option<flotilla_tls::ServerTls>,
    /// Sustained requests per second per source address that carry no
    /// valid key (none, unknown, revoked), in bursts of twice that; more
    /// are answered 429 with `Retry-After`, without asking the control
    /// plane. Keys the gateway has seen valid are never held back by it.
    pub anonymous_rate_limit_per_second: u32,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            route_poll_interval: Duration::from_millis(200),
            report_interval: Duration::from_secs(1),
            meter_interval: Duration::from_millis(250),
            meter_batch: 500,
            meter_buffer: 100_000,
            auth_cache_ttl: Duration::from_secs(1),
            domain: None,
            max_body_bytes: 16 << 20,
            affinity_prefix_chars: 512,
            affinity_load_factor: 1.25,
            seed: rand::random(),
            connect_timeout: Duration::from_secs(1),
            eject_for: Duration::from_secs(2),
            max_attempts: 3,
            shutdown_timeout: Duration::from_secs(30),
            tls: None,
            anonymous_rate_limit_per_second: 10,
        }
    }
}

impl GatewayConfig {
    fn validate(&self) -> Result<(), GatewayError> {
        let bad = |field, message: &str| {
            Err(GatewayError::Config {
                field,
                message: message.to_string(),
            })
        };
        if !(self.affinity_load_factor.is_finite() && self.affinity_load_factor >= 1.0) {
            return bad("affinity_load_factor", "must be a number >= 1");
        }
        if self.max_attempts == 0 {
            return bad("max_attempts", "must be at least 1");
        }
        if self.anonymous_rate_limit_per_second == 0 {
            return bad("anonymous_rate_limit_per_second", "must be at least 1");
        }
        for (field, d) in [
            ("route_poll_interval", self.route_poll_interval),
            ("report_interval", self.report_interval),
            ("meter_interval", self.meter_interval),
        ] {
            if d.is_zero() {
                return bad(field, "must be more than 0");
            }
        }
        Ok(())
    }
}

/// Endpoints as the current route table names them. Keyed by tenant, then
/// by name or model, so that a request looks its endpoint up with the
/// borrowed strings it carries (a `(TenantId, String)` key would cost two
/// allocations per request).
#[derive(Default)]
struct RouteIndex {
    by_name: HashMap<TenantId, HashMap<String, Arc<Endpoint>>>,
    by_model: HashMap<TenantId, HashMap<String, Arc<Endpoint>>>,
    by_tenant: HashMap<TenantId, Vec<Arc<Endpoint>>>,
}

impl RouteIndex {
    fn named(&self, tenant: &TenantId, name: &str) -> Option<&Arc<Endpoint>> {
        self.by_name.get(tenant)?.get(name)
    }

    fn serving(&self, tenant: &TenantId, model: &str) -> Option<&Arc<Endpoint>> {
        self.by_model.get(tenant)?.get(model)
    }
}

type Limiter = DefaultKeyedRateLimiter<String>;

/// A quota of `per_s` per second in bursts of twice that.
fn anonymous_quota(per_s: u32) -> Quota {
    let per_s = NonZeroU32::new(per_s.max(1)).unwrap_or(NonZeroU32::MIN);
    let burst = per_s.saturating_mul(NonZeroU32::MIN.saturating_add(1));
    Quota::per_second(per_s).allow_burst(burst)
}

/// A key's grant (`None`: no such key) and when it was asked for.
type CachedGrant = (Instant, Option<Arc<KeyGrant>>);

/// What the control plane said about a key.
#[derive(Debug, Clone)]
enum AuthAnswer {
    /// Its grant, or `None`: no such key.
    Grant(Option<Arc<KeyGrant>>),
    /// The control plane could not be asked.
    Unavailable,
}

/// The gateway's shared state.
pub(crate) struct Inner {
    control: Arc<dyn Control>,
    config: GatewayConfig,
    index: RwLock<Arc<RouteIndex>>,
    /// Every endpoint runtime, by id; kept across refreshes.
    runtimes: Mutex<HashMap<EndpointId, Arc<Endpoint>>>,
    last_table: Mutex<Option<RouteTable>>,
    auth: Mutex<HashMap<String, CachedGrant>>,
    /// Keys being asked about now: requests that find their key here wait
    /// for that one answer instead of asking again (an expired hot key
    /// costs one control-plane call, not one per request in flight).
    auth_pending: Mutex<HashMap<String, watch::Receiver<Option<AuthAnswer>>>>,
    limiters: Mutex<HashMap<EndpointId, (u32, Arc<Limiter>)>>,
    /// Requests without a valid key, per source address.
    anonymous: DefaultKeyedRateLimiter<IpAddr>,
    /// Addresses past that limit, and until when: their requests with a
    /// key not seen valid are refused without asking the control plane.
    held: Mutex<HashMap<IpAddr, Instant>>,
    /// Keys asked about for `/metrics`: whether each is an operator's,
    /// and when that was asked.
    operators: Mutex<HashMap<String, (Instant, bool)>>,
    client: Client<HttpConnector, Full<Bytes>>,
    meter: MeterQueue,
    metrics: Metrics,
    urgent: Arc<Notify>,
    refresh: Notify,
    epoch: Instant,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Grants cached at most; past it the cache is cleared (a flood of random
/// keys must not grow memory without bound).
const AUTH_CACHE_MAX: usize = 100_000;

impl Inner {
    fn live_endpoints(&self) -> Vec<Arc<Endpoint>> {
        lock(&self.runtimes).values().cloned().collect()
    }

    /// Every live endpoint's counters, for the metrics' scrape.
    fn live_counts(&self) -> Vec<signals::LiveCounts> {
        self.live_endpoints()
            .iter()
            .map(|e| signals::LiveCounts {
                endpoint: e.id.to_string(),
                in_flight: e.stats.in_flight.load(std::sync::atomic::Ordering::Relaxed),
                queued: e.queued(),
                requests_total: e
                    .stats
                    .requests_total
                    .load(std::sync::atomic::Ordering::Relaxed),
            })
            .collect()
    }

    fn index(&self) -> Arc<RouteIndex> {
        self.index.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Takes a new route table: endpoints keep their runtime (counters,
    /// queue, in-flight replicas), replicas are matched by instance.
    fn apply(&self, table: RouteTable) {
        {
            let mut last = lock(&self.last_table);
            if last.as_ref() == Some(&table) {
                return;
            }
            *last = Some(table.clone());
        }
        let mut index = RouteIndex::default();
        let mut runtimes = lock(&self.runtimes);
        let mut next = HashMap::new();
        for route in table.endpoints {
            let endpoint = match runtimes.remove(&route.id) {
                Some(e) => {
                    e.update(route.clone());
                    e
                }
                None => Arc::new(Endpoint::new(
                    route.clone(),
                    self.urgent.clone(),
                    BalanceConfig {
                        load_factor: self.config.affinity_load_factor,
                    },
                    self.config.seed,
                    self.epoch,
                )),
            };
            index
                .by_name
                .entry(route.tenant_id.clone())
                .or_default()
                .insert(route.name.clone(), endpoint.clone());
            let models = index.by_model.entry(route.tenant_id.clone()).or_default();
            for m in &route.models {
                models.insert(m.clone(), endpoint.clone());
            }
            index
                .by_tenant
                .entry(route.tenant_id.clone())
                .or_default()
                .push(endpoint.clone());
            next.insert(route.id.clone(), endpoint);
        }
        *runtimes = next;
        drop(runtimes);
        *self.index.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(index);
    }

    async fn refresh_routes(&self) {
        match tokio::time::timeout(Duration::from_secs(10), self.control.routes()).await {
            Ok(Ok(table)) => self.apply(table),
            Ok(Err(e)) => {
                // With its cause: a certificate the gateway does not
                // trust (a wrong pin) reads as such here, not as an outage.
                let cause = e.source.as_ref().map(ToString::to_string);
                tracing::warn!(error = %e, cause = cause.as_deref().unwrap_or(""), "route table refresh failed, keeping the last one")
            }
            Err(_) => tracing::warn!("route table refresh timed out, keeping the last one"),
        }
    }

    /// The key's grant, from the cache or the control plane. One call per
    /// key at a time: concurrent requests with the same uncached key share
    /// its answer. The call runs in a task of its own, so a caller that
    /// goes away does not cancel it for the others.
    async fn authorize(self: &Arc<Self>, key: &str) -> Result<Arc<KeyGrant>, Refusal> {
        let now = Instant::now();
        if let Some((at, grant)) = lock(&self.auth).get(key) {
            if now.duration_since(*at) < self.config.auth_cache_ttl {
                return grant.clone().ok_or(Refusal::InvalidKey);
            }
        }
        let mut answer = {
            let mut pending = lock(&self.auth_pending);
            match pending.get(key) {
                Some(rx) => rx.clone(),
                None => {
                    let (tx, rx) = watch::channel(None);
                    pending.insert(key.to_string(), rx.clone());
                    tokio::spawn(self.clone().ask_grant(key.to_string(), tx));
                    rx
                }
            }
        };
        let answer = match answer.wait_for(Option::is_some).await {
            Ok(a) => a.clone(),
            // The asking task ended without an answer (the runtime is
            // shutting down).
            Err(_) => None,
        };
        match answer {
            Some(AuthAnswer::Grant(Some(grant))) => Ok(grant),
            Some(AuthAnswer::Grant(None)) => Err(Refusal::InvalidKey),
            Some(AuthAnswer::Unavailable) | None => Err(Refusal::ControlUnavailable),
        }
    }

    /// Asks the control plane about `key`, caches the grant and hands the
    /// answer to every request waiting for it.
    async fn ask_grant(self: Arc<Self>, key: String, tx: watch::Sender<Option<AuthAnswer>>) {
        let asked = Instant::now();
        let answer =
            tokio::time::timeout(Duration::from_secs(10), self.control.authorize(&key)).await;
        let answer = match answer {
            Ok(Ok(grant)) => {
                let grant = grant.map(Arc::new);
                let mut cache = lock(&self.auth);
                if cache.len() >= AUTH_CACHE_MAX {
                    cache.clear();
                }
                cache.insert(key.clone(), (asked, grant.clone()));
                AuthAnswer::Grant(grant)
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "key authorisation failed");
                AuthAnswer::Unavailable
            }
            Err(_) => AuthAnswer::Unavailable,
        };
        // Out of the pending set before the answer goes out: a request
        // arriving after it reads the cache (or asks anew after a failure).
        lock(&self.auth_pending).remove(&key);
        let _ = tx.send(Some(answer));
    }

    /// `key`'s grant when the cache holds one younger than its time to
    /// live.
    fn fresh_grant(&self, key: &str) -> Option<Arc<KeyGrant>> {
        match lock(&self.auth).get(key) {
            Some((at, Some(grant))) if at.elapsed() < self.config.auth_cache_ttl => {
                Some(grant.clone())
            }
            _ => None,
        }
    }

    /// Whether the gateway has seen `key` valid (even if that answer is
    /// older than the cache's time to live): such a key is never held
    /// back by the per-address limit on requests without a valid key.
    fn known_valid(&self, key: &str) -> bool {
        matches!(lock(&self.auth).get(key), Some((_, Some(_))))
    }

    /// Counts one request without a valid key from `peer`: 429 past the
    /// per-address quota, and the address is held until it has one again.
    fn check_anonymous(&self, peer: IpAddr) -> Result<(), Refusal> {
        self.anonymous.check_key(&peer).map_err(|not_until| {
            use governor::clock::Clock;
            let wait = not_until.wait_time_from(governor::clock::DefaultClock::default().now());
            lock(&self.held).insert(peer, Instant::now() + wait);
            Refusal::TooManyUnauthenticated {
                retry_after_s: wait.as_secs() + u64::from(wait.subsec_nanos() > 0),
            }
        })
    }

    /// 429 while `peer` is held (past its quota a moment ago).
    fn check_held(&self, peer: IpAddr) -> Result<(), Refusal> {
        let now = Instant::now();
        let mut held = lock(&self.held);
        match held.get(&peer) {
            Some(until) if *until > now => {
                let wait = *until - now;
                Err(Refusal::TooManyUnauthenticated {
                    retry_after_s: wait.as_secs() + u64::from(wait.subsec_nanos() > 0),
                })
            }
            Some(_) => {
                held.remove(&peer);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// The grant of the request's key from `peer`. A request whose key
    /// turns out missing, unknown or revoked counts against the address's
    /// quota; past it the address is held, and while it is, a key the
    /// gateway has not seen valid is answered 429 without asking the
    /// control plane: a flood of guesses then costs the control plane
    /// nothing and its answers tell no key from another. A key seen valid
    /// is asked about as usual and never held back.
    async fn authorize_from(
        self: &Arc<Self>,
        peer: IpAddr,
        key: Result<&str, Refusal>,
    ) -> Result<Arc<KeyGrant>, Refusal> {
        let key = match key {
            Ok(k) => k,
            Err(missing) => {
                self.check_held(peer)?;
                self.check_anonymous(peer)?;
                return Err(missing);
            }
        };
        // The common case with one lookup: a key seen valid within the
        // cache's time to live (below, a miss looks twice).
        if let Some(grant) = self.fresh_grant(key) {
            return Ok(grant);
        }
        if !self.known_valid(key) {
            self.check_held(peer)?;
        }
        match self.authorize(key).await {
            Err(Refusal::InvalidKey) => {
                self.check_anonymous(peer)?;
                Err(Refusal::InvalidKey)
            }
            r => r,
        }
    }

    /// Whether `key` may read `/metrics`: an operator's key, asked of the
    /// control plane and cached like grants.
    async fn operator(&self, key: &str) -> Result<bool, Refusal> {
        let now = Instant::now();
        if let Some((at, ok)) = lock(&self.operators).get(key) {
            if now.duration_since(*at) < self.config.auth_cache_ttl {
                return Ok(*ok);
            }
        }
        let ok = match tokio::time::timeout(Duration::from_secs(10), self.control.is_operator(key))
            .await
        {
            Ok(Ok(ok)) => ok,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "checking a metrics key failed");
                return Err(Refusal::ControlUnavailable);
            }
            Err(_) => return Err(Refusal::ControlUnavailable),
        };
        let mut cache = lock(&self.operators);
        if cache.len() >= AUTH_CACHE_MAX {
            cache.clear();
        }
        cache.insert(key.to_string(), (now, ok));
        Ok(ok)
    }

    /// Applies the endpoint's per-key rate limit.
    fn check_rate(&self, endpoint: &Endpoint, rps: Option<u32>, key: &str) -> Result<(), Refusal> {
        let Some(rps) = rps.and_then(NonZeroU32::new) else {
            return Ok(());
        };
        let limiter = {
            let mut limiters = lock(&self.limiters);
            match limiters.get(&endpoint.id) {
                Some((r, l)) if *r == rps.get() => l.clone(),
                _ => {
                    let l = Arc::new(RateLimiter::keyed(Quota::per_second(rps)));
                    limiters.insert(endpoint.id.clone(), (rps.get(), l.clone()));
                    l
                }
            }
        };
        let key = key.to_string();
        limiter.check_key(&key).map_err(|not_until| {
            use governor::clock::Clock;
            let wait = not_until.wait_time_from(governor::clock::DefaultClock::default().now());
            Refusal::RateLimited {
                rps: rps.get(),
                retry_after_s: wait.as_secs() + u64::from(wait.subsec_nanos() > 0),
            }
        })
    }

    fn report_now(&self) -> Vec<flotilla_core::gateway::EndpointSignals> {
        let now = Instant::now();
        self.live_endpoints()
            .iter()
            .map(|e| e.stats.signals(&e.id, e.queued(), now))
            .collect()
    }
}

/// The gateway; see the crate doc.
#[derive(Debug, Clone, Copy)]
pub struct Gateway;

impl Gateway {
    /// Serves on `listener` until [`GatewayHandle::shutdown`]; the same as
    /// [`serve`].
    pub async fn serve(
        listener: TcpListener,
        control: Arc<dyn Control>,
        config: GatewayConfig,
    ) -> Result<GatewayHandle, GatewayError> {
        serve(listener, control, config).await
    }
}

/// A running gateway.
pub struct GatewayHandle {
    addr: SocketAddr,
    https: bool,
    inner: Arc<Inner>,
    stop: watch::Sender<bool>,
    stop_meter: watch::Sender<bool>,
    accept: JoinHandle<()>,
    tasks: Vec<JoinHandle<()>>,
}

impl GatewayHandle {
    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://{addr}`, or `https://{addr}` when it serves TLS.
    pub fn url(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// Makes the gateway re-read the route table now.
    pub fn notify_routes(&self) {
        self.inner.refresh.notify_one();
    }

    /// Usage records not yet delivered.
    pub fn pending_usage(&self) -> usize {
        self.inner.meter.pending()
    }

    /// Stops accepting, lets requests in flight finish (up to the
    /// configured timeout), delivers the usage still buffered, then stops.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.accept.await;
        // Usage stops being produced only once the connections are done.
        let _ = self.stop_meter.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Starts the gateway on `listener` with `control` as its control plane.
/// The route table is read once before the first request is accepted.
pub async fn serve(
    listener: TcpListener,
    control: Arc<dyn Control>,
    config: GatewayConfig,
) -> Result<GatewayHandle, GatewayError> {
    config.validate()?;
    let addr = listener.local_addr().map_err(GatewayError::Listener)?;
    let https = config.tls.is_some();
    let listener = match &config.tls {
        Some(tls) => Accept::Https(tls.listen(listener).map_err(GatewayError::Listener)?),
        None => Accept::Http(listener),
    };
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(config.connect_timeout));
    let client = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_timer(TokioTimer::new())
        .build(connector);
    let inner = Arc::new_cyclic(|weak| {
        let metrics = Metrics::new(weak.clone());
        Inner {
            meter: MeterQueue::new(
                config.meter_buffer,
                config.meter_batch,
                metrics.usage_dropped.clone(),
            ),
            metrics,
            control,
            index: RwLock::new(Arc::new(RouteIndex::default())),
            runtimes: Mutex::new(HashMap::new()),
            last_table: Mutex::new(None),
            auth: Mutex::new(HashMap::new()),
            auth_pending: Mutex::new(HashMap::new()),
            limiters: Mutex::new(HashMap::new()),
            anonymous: RateLimiter::keyed(anonymous_quota(config.anonymous_rate_limit_per_second)),
            held: Mutex::new(HashMap::new()),
            operators: Mutex::new(HashMap::new()),
            client,
            urgent: Arc::new(Notify::new()),
            refresh: Notify::new(),
            epoch: Instant::now(),
            config,
        }
    });
    inner.refresh_routes().await;
    let (stop, stopped) = watch::channel(false);
    let (stop_meter, meter_stopped) = watch::channel(false);
    let tasks = vec![
        tokio::spawn(route_loop(inner.clone(), stopped.clone())),
        tokio::spawn(report_loop(inner.clone(), stopped.clone())),
        tokio::spawn(meter_loop(inner.clone(), meter_stopped)),
    ];
    let accept = tokio::spawn(accept_loop(listener, inner.clone(), stopped));
    Ok(GatewayHandle {
        addr,
        https,
        inner,
        stop,
        stop_meter,
        accept,
        tasks,
    })
}

/// The gateway's listener: plain TCP, or TLS with handshakes completed
/// off the accept loop ([`flotilla_tls::TlsListener`]).
enum Accept {
    Http(TcpListener),
    Https(flotilla_tls::TlsListener),
}

/// A connection ready for HTTP.
enum Conn {
    Plain(tokio::net::TcpStream),
    Tls(Box<flotilla_tls::TlsStream<tokio::net::TcpStream>>),
}

/// Where a connection comes from, for the per-address limit.
type Peer = IpAddr;

impl Accept {
    /// The next connection; `None` after a failed accept (backed off).
    async fn next(&mut self) -> Option<(Conn, Peer)> {
        match self {
            Self::Http(listener) => match listener.accept().await {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    Some((Conn::Plain(stream), peer.ip()))
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off
                    // instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    None
                }
            },
            Self::Https(listener) => {
                let (stream, peer) = listener.accept().await;
                Some((Conn::Tls(Box::new(stream)), peer.ip()))
            }
        }
    }
}

async fn accept_loop(mut listener: Accept, inner: Arc<Inner>, mut stopped: watch::Receiver<bool>) {
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new());
    loop {
        tokio::select! {
            conn = listener.next() => match conn {
                Some((Conn::Plain(stream), peer)) => serve_connection(stream, peer, &inner, &builder, &graceful),
                Some((Conn::Tls(stream), peer)) => serve_connection(stream, peer, &inner, &builder, &graceful),
                None => {}
            },
            _ = stopped.changed() => break,
        }
    }
    drop(listener);
    if tokio::time::timeout(inner.config.shutdown_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("requests still in flight at the shutdown timeout were cut");
    }
}

/// Serves one connection's requests in a task of its own, watched by
/// `graceful`.
fn serve_connection<I>(
    io: I,
    peer: Peer,
    inner: &Arc<Inner>,
    builder: &hyper::server::conn::http1::Builder,
    graceful: &GracefulShutdown,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let inner = inner.clone();
    let service = hyper::service::service_fn(move |req| {
        let inner = inner.clone();
        async move { Ok::<_, std::convert::Infallible>(proxy::handle(inner, peer, req).await) }
    });
    let conn = graceful.watch(builder.serve_connection(TokioIo::new(io), service));
    tokio::spawn(async move {
        let _ = conn.await;
    });
}

async fn route_loop(inner: Arc<Inner>, mut stopped: watch::Receiver<bool>) {
    let pushed = inner.control.route_changes();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(inner.config.route_poll_interval) => {}
            _ = inner.refresh.notified() => {}
            _ = async { match &pushed { Some(n) => n.notified().await, None => std::future::pending().await } } => {}
            _ = stopped.changed() => return,
        }
        inner.refresh_routes().await;
    }
}

/// The least time between two demand reports: a queue that forms and
/// drains many times a second is reported at this pace, not at its own.
const URGENT_REPORT_GAP: Duration = Duration::from_millis(100);

async fn report_loop(inner: Arc<Inner>, mut stopped: watch::Receiver<bool>) {
    let mut last = Instant::now();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(inner.config.report_interval) => {
                for (_, l) in lock(&inner.limiters).values() {
                    l.retain_recent();
                }
                inner.anonymous.retain_recent();
                let now = Instant::now();
                lock(&inner.held).retain(|_, until| *until > now);
            }
            _ = inner.urgent.notified() => {
                tokio::time::sleep_until(last + URGENT_REPORT_GAP).await;
            }
            _ = stopped.changed() => return,
        }
        last = Instant::now();
        let signals = inner.report_now();
        if signals.is_empty() {
            continue;
        }
        match tokio::time::timeout(Duration::from_secs(5), inner.control.report(signals)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "demand report failed"),
            Err(_) => tracing::warn!("demand report timed out"),
        }
    }
}

async fn meter_loop(inner: Arc<Inner>, mut stopped: watch::Receiver<bool>) {
    let mut failures = 0u32;
    loop {
        let wait = if failures > 0 {
            meter::backoff(failures)
        } else {
            inner.config.meter_interval
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = inner.meter.wake.notified(), if failures == 0 => {}
            _ = stopped.changed() => break,
        }
        loop {
            match inner.meter.flush_once(inner.control.as_ref()).await {
                Ok(true) => failures = 0,
                Ok(false) => break,
                Err(e) => {
                    failures = failures.saturating_add(1);
                    tracing::warn!(error = %e, pending = inner.meter.pending(), "usage delivery failed, retrying");
                    break;
                }
            }
        }
    }
    // Shutdown stops this loop only after the connections are drained:
    // deliver what is left, retrying until the timeout.
    let deadline = Instant::now() + inner.config.shutdown_timeout;
    let mut failures = 0u32;
    while inner.meter.pending() > 0 && Instant::now() < deadline {
        if let Err(e) = inner.meter.flush_once(inner.control.as_ref()).await {
            failures = failures.saturating_add(1);
            tracing::warn!(error = %e, "usage delivery at shutdown failed, retrying");
            tokio::time::sleep(meter::backoff(failures)).await;
        }
    }
    let left = inner.meter.pending();
    if left > 0 {
        tracing::error!(left, "usage records not delivered at shutdown");
    }
}
