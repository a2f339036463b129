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
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use flotilla_core::gateway::{Balance, EndpointRoute};
use flotilla_core::id::{EndpointId, InstanceId};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

use crate::signals::EndpointStats;

/// Points per replica on the hash ring: enough that keys spread evenly over
/// a handful of replicas.
const VNODES: u32 = 64;

/// One replica as the gateway tracks it.
#[derive(Debug)]
pub(crate) struct Replica {
    pub instance_id: InstanceId,
    /// `scheme://authority`, no trailing slash.
    pub base: String,
    pub revision: u32,
    outstanding: AtomicU32,
    draining: AtomicBool,
    /// Milliseconds since the gateway's epoch until which a replica that
    /// refused a connection gets nothing new.
    ejected_until_ms: AtomicU64,
}

impl Replica {
    fn new(instance_id: InstanceId, url: &str, revision: u32, draining: bool) -> Self {
        Self {
            instance_id,
            base: url.trim_end_matches('/').to_string(),
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
            let now = self.now_ms();
            let at_zero = !pool.replicas.iter().any(|r| r.usable(now));
            if at_zero {
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
