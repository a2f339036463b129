//! One endpoint's replicas and its activator queue: which replica a request
//! goes to, and where it waits when none can take it.
//!
//! Picking and reserving a slot happen under the endpoint's lock, so a
//! replica never gets more than `replica_concurrency` requests at once.
//! A request that finds no free replica — none ready, or all saturated —
//! waits in a FIFO queue (bounded by `queue_limit`) until a slot frees or
//! the route table brings a replica, and is answered 503 at its deadline.
//! Replicas leaving the table or marked draining get nothing new, but the
//! [`Lease`]s of their in-flight requests keep them alive until done.

use std::collections::VecDeque;
use std::hash::Hasher;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};

use flotilla_core::gateway::{Balance, EndpointRoute};
use flotilla_core::id::{EndpointId, InstanceId};
use http::uri::{Authority, Scheme};
use http::Uri;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

use crate::signals::{EndpointSeries, EndpointStats};

/// Points per replica on the hash ring: enough that keys spread evenly over
/// a handful of replicas.
const VNODES: u32 = 64;

/// One replica as the gateway tracks it.
#[derive(Debug)]
pub(crate) struct Replica {
    pub instance_id: InstanceId,
    /// `scheme://authority`, no trailing slash.
    pub base: String,
    /// `base` parsed once: the scheme and authority of every request sent
    /// there; `None` when `base` is not an absolute URL without a path.
    pub origin: Option<(Scheme, Authority)>,
    pub revision: u32,
    outstanding: AtomicU32,
    draining: AtomicBool,
    /// Milliseconds since the gateway's epoch until which a replica that
    /// refused a connection gets nothing new.
    ejected_until_ms: AtomicU64,
}

impl Replica {
    fn new(instance_id: InstanceId, url: &str, revision: u32, draining: bool) -> Self {
        let base = url.trim_end_matches('/').to_string();
        let origin = base.parse::<Uri>().ok().and_then(|u| {
            let parts = u.into_parts();
            let bare = parts
                .path_and_query
                .as_ref()
                .is_none_or(|p| p.as_str() == "/");
            bare.then_some((parts.scheme?, parts.authority?))
        });
        Self {
            instance_id,
            origin,
            base,
            revision,
            outstanding: AtomicU32::new(0),
            draining: AtomicBool::new(draining),
            ejected_until_ms: AtomicU64::new(0),
        }
    }

    /// Requests sent to it and not finished.
    pub fn outstanding(&self) -> u32 {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Keeps new requests away until `until_ms` (gateway epoch).
    pub fn eject(&self, until_ms: u64) {
        self.ejected_until_ms.fetch_max(until_ms, Ordering::Relaxed);
    }

    fn usable(&self, now_ms: u64) -> bool {
        !self.draining.load(Ordering::Relaxed)
            && self.ejected_until_ms.load(Ordering::Relaxed) <= now_ms
    }
}

/// A reserved slot on a replica; dropping it frees the slot and lets the
/// next waiting request in.
pub(crate) struct Lease {
    pub endpoint: Arc<Endpoint>,
    pub replica: Arc<Replica>,
    armed: bool,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.armed {
            self.replica.outstanding.fetch_sub(1, Ordering::Relaxed);
            self.endpoint.pump();
        }
    }
}

struct Waiter {
    key: Option<u64>,
    exclude: Vec<InstanceId>,
    tx: oneshot::Sender<Lease>,
}

/// The mutable part of an endpoint, under one lock.
struct Pool {
    replicas: Vec<Arc<Replica>>,
    /// `(point, index into replicas)`, sorted; only non-draining replicas.
    ring: Vec<(u64, usize)>,
    queue: VecDeque<Waiter>,
    rng: ChaCha8Rng,
}

/// Why a request got no replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NoReplica {
    QueueFull,
    Timeout,
}

/// Settings of the balancer that come from the gateway's configuration.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BalanceConfig {
    /// A replica takes an affine request while its load is at most this
    /// factor times the mean (bounded-load consistent hashing).
    pub load_factor: f64,
}

/// One endpoint's runtime: its latest route, replicas, queue and counters.
/// Lives across route-table refreshes, so counters and in-flight requests
/// survive them.
pub(crate) struct Endpoint {
    pub id: EndpointId,
    route: RwLock<Arc<EndpointRoute>>,
    pool: Mutex<Pool>,
    pub stats: EndpointStats,
    /// Its Prometheus series, made on its first finished request.
    pub series: OnceLock<EndpointSeries>,
    /// Fired when a request waits with no replica at all: the reporter
    /// sends demand at once.
    urgent: Arc<Notify>,
    balance: BalanceConfig,
    epoch: Instant,
}

fn hash_str(s: &str, salt: u32) -> u64 {
    let mut h = fnv::FnvHasher::default();
    h.write(s.as_bytes());
    h.write_u32(salt);
    // FNV's low bits mix poorly; a finaliser spreads ring points evenly.
    mix(h.finish())
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// The affinity key of a prompt prefix or session id: a stable hash, the
/// same in every gateway, so several gateways send a prefix to one replica.
pub(crate) fn affinity_key(s: &str) -> u64 {
    hash_str(s, 0)
}

impl Endpoint {
    pub fn new(
        route: EndpointRoute,
        urgent: Arc<Notify>,
        balance: BalanceConfig,
        seed: u64,
        epoch: Instant,
    ) -> Self {
        let endpoint_seed = seed ^ affinity_key(route.id.as_str());
        let this = Self {
            id: route.id.clone(),
            route: RwLock::new(Arc::new(route.clone())),
            pool: Mutex::new(Pool {
                replicas: Vec::new(),
                ring: Vec::new(),
                queue: VecDeque::new(),
                rng: ChaCha8Rng::seed_from_u64(endpoint_seed),
            }),
            stats: EndpointStats::default(),
            series: OnceLock::new(),
            urgent,
            balance,
            epoch,
        };
        this.apply_replicas(&route);
        this
    }

    fn lock(&self) -> MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The route as last read.
    pub fn route(&self) -> Arc<EndpointRoute> {
        self.route.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Takes a new route: settings and replica set. Replicas are matched by
    /// instance and URL, so one that stays keeps its in-flight count.
    pub fn update(self: &Arc<Self>, route: EndpointRoute) {
        let changed = {
            let current = self.route();
            *current != route
        };
        if !changed {
            return;
        }
        self.apply_replicas(&route);
        *self.route.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(route);
        self.pump();
    }

    fn apply_replicas(&self, route: &EndpointRoute) {
        let mut pool = self.lock();
        let old = std::mem::take(&mut pool.replicas);
        for r in &route.replicas {
            let base = r.url.trim_end_matches('/');
            let kept = old.iter().find(|o| {
                o.instance_id == r.instance_id && o.base == base && o.revision == r.revision
            });
            let replica = match kept {
                Some(o) => {
                    o.draining.store(r.draining, Ordering::Relaxed);
                    o.clone()
                }
                None => Arc::new(Replica::new(
                    r.instance_id.clone(),
                    &r.url,
                    r.revision,
                    r.draining,
                )),
            };
            pool.replicas.push(replica);
        }
        let mut ring = Vec::new();
        for (i, r) in pool.replicas.iter().enumerate() {
            if !r.draining.load(Ordering::Relaxed) {
                for v in 0..VNODES {
                    ring.push((hash_str(r.instance_id.as_str(), v), i));
                }
            }
        }
        ring.sort_unstable();
        pool.ring = ring;
    }

    /// Requests waiting in the queue now (those whose caller gave up are
    /// not counted).
    pub fn queued(&self) -> u32 {
        let pool = self.lock();
        pool.queue.iter().filter(|w| !w.tx.is_closed()).count() as u32
    }

    /// Reserves a slot on a replica, waiting in the queue until `deadline`
    /// if none is free. `key` is the affinity key; `exclude` lists replicas
    /// this request already failed on.
    pub async fn acquire(
        self: &Arc<Self>,
        key: Option<u64>,
        exclude: &[InstanceId],
        deadline: Instant,
    ) -> Result<Lease, NoReplica> {
        let route = self.route();
        let rx = {
            let mut pool = self.lock();
            while pool.queue.front().is_some_and(|w| w.tx.is_closed()) {
                pool.queue.pop_front();
            }
            // Arrivals queue behind waiting requests: dispatch is in order.
            if pool.queue.is_empty() {
                if let Some(replica) = self.pick(&mut pool, &route, key, exclude) {
                    return Ok(self.lease(replica));
                }
            }
            if pool.queue.len() >= route.queue_limit as usize {
                pool.queue.retain(|w| !w.tx.is_closed());
                if pool.queue.len() >= route.queue_limit as usize {
                    return Err(NoReplica::QueueFull);
                }
            }
            let (tx, rx) = oneshot::channel();
            pool.queue.push_back(Waiter {
                key,
                exclude: exclude.to_vec(),
                tx,
            });
            // A request waiting at zero replicas, or the first to wait
            // behind busy ones, is reported at once rather than within
            // the report interval: it is the autoscaler's cue to start a
            // replica (a cold start at zero, a scale-up at saturation),
            // and every queued request pays for a late one.
            let now = self.now_ms();
            let at_zero = !pool.replicas.iter().any(|r| r.usable(now));
            if at_zero || pool.queue.len() == 1 {
                self.urgent.notify_one();
            }
            rx
        };
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(lease)) => Ok(lease),
            _ => Err(NoReplica::Timeout),
        }
    }

    fn lease(self: &Arc<Self>, replica: Arc<Replica>) -> Lease {
        Lease {
            endpoint: self.clone(),
            replica,
            armed: true,
        }
    }

    /// Hands free slots to waiting requests, oldest first.
    pub fn pump(self: &Arc<Self>) {
        let route = self.route();
        let mut pool = self.lock();
        loop {
            while pool.queue.front().is_some_and(|w| w.tx.is_closed()) {
                pool.queue.pop_front();
            }
            let Some(front) = pool.queue.front() else {
                break;
            };
            let key = front.key;
            let exclude = front.exclude.clone();
            let Some(replica) = self.pick(&mut pool, &route, key, &exclude) else {
                break;
            };
            let Some(waiter) = pool.queue.pop_front() else {
                break;
            };
            let lease = self.lease(replica);
            if let Err(mut lease) = waiter.tx.send(lease) {
                // The caller gave up between the check and the send: undo
                // the reservation here, under the lock, without re-pumping.
                lease.armed = false;
                lease.replica.outstanding.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// Picks and reserves a replica, or `None` when none can take more.
    fn pick(
        &self,
        pool: &mut Pool,
        route: &EndpointRoute,
        key: Option<u64>,
        exclude: &[InstanceId],
    ) -> Option<Arc<Replica>> {
        let now = self.now_ms();
        let limit = if route.replica_concurrency == 0 {
            u32::MAX
        } else {
            route.replica_concurrency
        };
        let free = |r: &Replica| {
            r.usable(now) && r.outstanding() < limit && !exclude.contains(&r.instance_id)
        };
        let chosen = match (key, route.balance) {
            (Some(key), Balance::PrefixAffinity | Balance::SessionAffinity) => {
                self.pick_affine(pool, key, now, &free)
            }
            _ => None,
        };
        let chosen = match chosen {
            Some(i) => Some(i),
            None => pick_p2c(pool, &free),
        }?;
        let replica = pool.replicas[chosen].clone();
        replica.outstanding.fetch_add(1, Ordering::Relaxed);
        Some(replica)
    }

    /// Bounded-load consistent hashing: the first replica clockwise from
    /// the key whose load stays within `load_factor` times the mean.
    fn pick_affine(
        &self,
        pool: &Pool,
        key: u64,
        now: u64,
        free: &dyn Fn(&Replica) -> bool,
    ) -> Option<usize> {
        if pool.ring.is_empty() {
            return None;
        }
        let usable: Vec<&Arc<Replica>> = pool.replicas.iter().filter(|r| r.usable(now)).collect();
        if usable.is_empty() {
            return None;
        }
        let total: u64 = usable
            .iter()
            .map(|r| u64::from(r.outstanding()))
            .sum::<u64>()
            + 1;
        let bound = (self.balance.load_factor * total as f64 / usable.len() as f64).ceil() as u64;
        let start = pool.ring.partition_point(|(p, _)| *p < key);
        let mut seen = Vec::with_capacity(pool.replicas.len());
        for step in 0..pool.ring.len() {
            let (_, i) = pool.ring[(start + step) % pool.ring.len()];
            if seen.contains(&i) {
                continue;
            }
            seen.push(i);
            let r = &pool.replicas[i];
            if free(r) && u64::from(r.outstanding()) < bound {
                return Some(i);
            }
            if seen.len() == pool.replicas.len() {
                break;
            }
        }
        None
    }
}

/// Least outstanding of two random free replicas.
fn pick_p2c(pool: &mut Pool, free: &dyn Fn(&Replica) -> bool) -> Option<usize> {
    let candidates: Vec<usize> = (0..pool.replicas.len())
        .filter(|&i| free(&pool.replicas[i]))
        .collect();
    match candidates.len() {
        0 => None,
        1 => Some(candidates[0]),
        n => {
            let a = pool.rng.gen_range(0..n);
            let mut b = pool.rng.gen_range(0..n - 1);
            if b >= a {
                b += 1;
            }
            let (a, b) = (candidates[a], candidates[b]);
            if pool.replicas[b].outstanding() < pool.replicas[a].outstanding() {
                Some(b)
            } else {
                Some(a)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use flotilla_core::gateway::ReplicaRoute;
    use flotilla_core::id::TenantId;

    use super::*;

    fn endpoint(replicas: usize, concurrency: u32, balance: Balance) -> Arc<Endpoint> {
        let route = EndpointRoute {
            id: EndpointId::generate(1, 1),
            tenant_id: TenantId::generate(1, 2),
            name: "e".into(),
            models: vec![],
            balance,
            queue_limit: 10,
            queue_timeout_ms: 1000,
            replica_concurrency: concurrency,
            rate_limit_rps: None,
            replicas: (0..replicas)
                .map(|i| ReplicaRoute {
                    instance_id: InstanceId::generate(1, 100 + i as u128),
                    url: format!("http://127.0.0.1:{}", 1000 + i),
                    revision: 1,
                    draining: false,
                })
                .collect(),
        };
        Arc::new(Endpoint::new(
            route,
            Arc::new(Notify::new()),
            BalanceConfig { load_factor: 1.25 },
            3,
            Instant::now(),
        ))
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[tokio::test]
    async fn a_freed_slot_goes_to_the_oldest_waiter() {
        let e = endpoint(1, 1, Balance::LeastOutstanding);
        let first = e.acquire(None, &[], soon()).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for n in [2, 3] {
            let (waiter, tx) = (e.clone(), tx.clone());
            tokio::spawn(async move {
                let lease = waiter.acquire(None, &[], soon()).await.unwrap();
                tx.send(n).unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
                drop(lease);
            });
            // Let it enqueue before the next one.
            while e.queued() < n - 1 {
                tokio::task::yield_now().await;
            }
        }
        assert_eq!(e.queued(), 2);
        drop(first);
        assert_eq!(rx.recv().await, Some(2));
        assert_eq!(rx.recv().await, Some(3));
        assert_eq!(e.queued(), 0);
    }

    #[tokio::test]
    async fn a_full_queue_and_a_deadline_refuse() {
        let e = endpoint(0, 1, Balance::LeastOutstanding);
        let short = Instant::now() + Duration::from_millis(50);
        assert_eq!(
            e.acquire(None, &[], short).await.err(),
            Some(NoReplica::Timeout)
        );
        let e = endpoint(1, 1, Balance::LeastOutstanding);
        let _held = e.acquire(None, &[], soon()).await.unwrap();
        let mut waiters = Vec::new();
        for _ in 0..10 {
            let e = e.clone();
            waiters.push(tokio::spawn(async move {
                e.acquire(None, &[], soon()).await.is_ok()
            }));
        }
        while e.queued() < 10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            e.acquire(None, &[], soon()).await.err(),
            Some(NoReplica::QueueFull)
        );
    }

    #[tokio::test]
    async fn affinity_keeps_a_key_on_one_replica_until_its_load_bound() {
        let e = endpoint(4, 100, Balance::PrefixAffinity);
        let key = affinity_key("a shared system prompt");
        let mut leases = Vec::new();
        let mut replicas = Vec::new();
        for _ in 0..8 {
            let l = e.acquire(Some(key), &[], soon()).await.unwrap();
            replicas.push(l.replica.instance_id.clone());
            leases.push(l);
        }
        // Alone, the key's replica takes it (bound ceil(1.25 * 1 / 4) = 1);
        // with load spread the bound grows and the key spills clockwise,
        // never past 1.25x the mean.
        let home = replicas[0].clone();
        let at_home = replicas.iter().filter(|r| **r == home).count();
        assert!(at_home >= 2, "{replicas:?}");
        let max = replicas
            .iter()
            .map(|r| replicas.iter().filter(|x| *x == r).count())
            .max()
            .unwrap();
        assert!(max <= (1.25f64 * 8.0 / 4.0).ceil() as usize, "{replicas:?}");
        drop(leases);
        // Idle again: the same key lands on the same replica.
        let again = e.acquire(Some(key), &[], soon()).await.unwrap();
        assert_eq!(again.replica.instance_id, home);
    }

    #[tokio::test]
    async fn draining_and_excluded_replicas_get_nothing_new() {
        let e = endpoint(2, 10, Balance::LeastOutstanding);
        let mut route = (*e.route()).clone();
        route.replicas[0].draining = true;
        let draining = route.replicas[0].instance_id.clone();
        e.update(route);
        for _ in 0..5 {
            let l = e.acquire(None, &[], soon()).await.unwrap();
            assert_ne!(l.replica.instance_id, draining);
        }
        let other = e.route().replicas[1].instance_id.clone();
        let short = Instant::now() + Duration::from_millis(50);
        assert!(e.acquire(None, &[other], short).await.is_err());
    }
}
