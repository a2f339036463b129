//! What the node holds of endpoint replicas' model weights, and the tier a
//! new replica loads from: the disk cache ([`WeightCache`]) and the parked
//! replicas in host memory ([`ParkedSet`]) kept together with what each
//! park is for (its weights key, its endpoint, until when it is kept).
//!
//! A replica's weights are the [`ReplicaWeights`] the server put in its
//! environment. Starting one takes the fastest tier the node has for its
//! key: a parked copy (taken out of host memory: it goes back onto a
//! GPU), else the disk cache, else a remote download, whose weights then
//! land in the disk cache. A replica the server stopped (a scale-down)
//! that exited cleanly is parked for its endpoint's `keep_parked_s`: the
//! process and its GPU are gone, the host memory stays accounted and
//! reported (and billed by the server) until a new replica takes it, the
//! time runs out or a newer park needs the room. With the emulator, which
//! has no weights, the park is this bookkeeping alone; a model server
//! with a sleep mode (vLLM's) keeps the bytes in its process.
//!
//! Decisions take `now`: the agent passes the wall clock, tests a fixed one.

use std::collections::BTreeMap;
use std::path::PathBuf;

use chrono::{DateTime, Duration, Utc};
use flotilla_core::api::{NodeWeights, WeightTier};
use flotilla_core::endpoint::ReplicaWeights;
use flotilla_core::id::{EndpointId, InstanceId};

use crate::weight_cache::{ParkedSet, WeightCache};

/// Default size of the disk cache of weights, GB.
pub const DEFAULT_WEIGHT_CACHE_GB: u64 = 500;

/// One parked replica.
#[derive(Debug, Clone, PartialEq)]
struct Park {
    key: String,
    endpoint_id: EndpointId,
    size_bytes: u64,
    since: DateTime<Utc>,
    until: DateTime<Utc>,
}

/// The node's weights: disk cache, parked set and what each park is for.
#[derive(Debug)]
pub struct NodeWeightsState {
    cache: Option<WeightCache>,
    parked: ParkedSet,
    parks: BTreeMap<InstanceId, Park>,
}

impl NodeWeightsState {
    /// The disk cache under `dir` (at most `cache_bytes`; one that cannot
    /// be opened is logged and left out: every start is then remote) and
    /// a parked set of at most `parked_bytes` of host memory.
    pub fn new(dir: impl Into<PathBuf>, cache_bytes: u64, parked_bytes: u64) -> Self {
        let dir = dir.into();
        let cache = match WeightCache::new(&dir, cache_bytes) {
            Ok(c) => Some(c),
            Err(error) => {
                tracing::warn!(%error, dir = %dir.display(), "weight cache unavailable; replicas load remote");
                None
            }
        };
        Self {
            cache,
            parked: ParkedSet::new(parked_bytes),
            parks: BTreeMap::new(),
        }
    }

    /// The tier a replica of `w` starting now loads from, taking what it
    /// uses: a parked copy leaves host memory, a cached one is marked
    /// used, a remote download is recorded in the disk cache.
    pub fn start(&mut self, w: &ReplicaWeights, now: DateTime<Utc>) -> WeightTier {
        // The oldest park of these weights: the one closest to its end.
        let parked = self
            .parks
            .iter()
            .filter(|(_, p)| p.key == w.key)
            .min_by_key(|(_, p)| p.since)
            .map(|(r, _)| r.clone());
        if let Some(replica) = parked {
            self.parks.remove(&replica);
            self.parked.unpark(replica.as_str());
            return WeightTier::Parked;
        }
        let Some(cache) = self.cache.as_mut() else {
            return WeightTier::Remote;
        };
        match cache.open(&w.key, now) {
            Ok(Some(_)) => WeightTier::Cached,
            Ok(None) => {
                if let Err(error) = cache.record_download(&w.key, w.size_bytes(), now, &[]) {
                    tracing::warn!(%error, key = %w.key, "weights not cached");
                }
                WeightTier::Remote
            }
            Err(error) => {
                tracing::warn!(%error, key = %w.key, "weight cache unreadable");
                WeightTier::Remote
            }
        }
    }

    /// Parks `replica` (stopped by the server, exited cleanly) for its
    /// endpoint's `keep_parked_s`; older parks are dropped when host
    /// memory runs out. Whether it was parked.
    pub fn park(&mut self, replica: &InstanceId, w: &ReplicaWeights, now: DateTime<Utc>) -> bool {
        if w.keep_parked_s == 0 {
            return false;
        }
        match self.parked.park(replica.as_str(), w.size_bytes(), now) {
            Ok(dropped) => {
                for d in dropped {
                    self.parks.retain(|r, _| r.as_str() != d);
                }
                let keep = i64::try_from(w.keep_parked_s).unwrap_or(i64::MAX);
                self.parks.insert(
                    replica.clone(),
                    Park {
                        key: w.key.clone(),
                        endpoint_id: w.endpoint_id.clone(),
                        size_bytes: w.size_bytes(),
                        since: now,
                        until: now + Duration::seconds(keep),
                    },
                );
                true
            }
            Err(error) => {
                tracing::info!(%error, instance_id = %replica, "replica not parked");
                false
            }
        }
    }

    /// Drops the parks whose time ran out; returns them.
    pub fn expire(&mut self, now: DateTime<Utc>) -> Vec<InstanceId> {
        let gone: Vec<InstanceId> = self
            .parks
            .iter()
            .filter(|(_, p)| p.until <= now)
            .map(|(r, _)| r.clone())
            .collect();
        for r in &gone {
            self.parks.remove(r);
            self.parked.unpark(r.as_str());
        }
        gone
    }

    /// Ends the park of `replica` (its endpoint was deleted: nothing will
    /// restore it). Whether it was parked.
    pub fn release(&mut self, replica: &InstanceId) -> bool {
        let held = self.parks.remove(replica).is_some();
        self.parked.unpark(replica.as_str());
        held
    }

    /// Host memory held by parked replicas, bytes.
    pub fn parked_bytes(&self) -> u64 {
        self.parked.used_bytes()
    }

    /// What the node holds, as the server is told: parked replicas, then
    /// the disk cache.
    pub fn report(&self) -> Vec<NodeWeights> {
        let mut out: Vec<NodeWeights> = self
            .parks
            .iter()
            .map(|(r, p)| NodeWeights {
                key: p.key.clone(),
                tier: WeightTier::Parked,
                size_bytes: p.size_bytes,
                since: p.since,
                replica: Some(r.clone()),
                endpoint_id: Some(p.endpoint_id.clone()),
            })
            .collect();
        if let Some(c) = &self.cache {
            out.extend(c.report().into_iter().map(|h| NodeWeights {
                key: h.model,
                tier: WeightTier::Cached,
                size_bytes: h.size_bytes,
                since: h.last_used,
                replica: None,
                endpoint_id: None,
            }));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    fn t(s: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_700_000_000 + s, 0).single().unwrap()
    }

    fn weights(key: &str, gb: f64, keep: u64) -> ReplicaWeights {
        ReplicaWeights {
            key: key.into(),
            endpoint_id: EndpointId::parse("ep_01hzzzzzzzzzzzzzzzzzzzzzzz", "id").unwrap(),
            model_gb: gb,
            keep_parked_s: keep,
        }
    }

    fn replica(n: u32) -> InstanceId {
        InstanceId::parse(&format!("inst_01hzzzzzzzzzzzzzzzzzzzzz{n:02}"), "id").unwrap()
    }

    #[test]
    fn remote_then_cached_then_parked_then_cached_again() {
        let dir = tempfile::tempdir().unwrap();
        let mut n = NodeWeightsState::new(dir.path(), 100_000_000_000, 40_000_000_000);
        let w = weights("ep_a-r1", 16.0, 60);
        assert_eq!(n.start(&w, t(0)), WeightTier::Remote);
        assert_eq!(n.start(&w, t(1)), WeightTier::Cached);
        assert!(n.park(&replica(1), &w, t(10)));
        assert_eq!(n.parked_bytes(), 16_000_000_000);
        let r = n.report();
        assert_eq!(r[0].tier, WeightTier::Parked);
        assert_eq!(r[0].replica, Some(replica(1)));
        assert_eq!(r[1].tier, WeightTier::Cached);
        // The next start takes the park out of host memory.
        assert_eq!(n.start(&w, t(20)), WeightTier::Parked);
        assert_eq!(n.parked_bytes(), 0);
        assert_eq!(n.start(&w, t(21)), WeightTier::Cached);
        // Other weights are not served by this park.
        assert!(n.park(&replica(2), &w, t(30)));
        assert_eq!(
            n.start(&weights("ep_b-r1", 1.0, 0), t(31)),
            WeightTier::Remote
        );
    }

    #[test]
    fn parks_expire_and_memory_drops_the_oldest() {
        let dir = tempfile::tempdir().unwrap();
        let mut n = NodeWeightsState::new(dir.path(), 100_000_000_000, 40_000_000_000);
        let w = weights("ep_a-r1", 16.0, 60);
        assert!(n.park(&replica(1), &w, t(0)));
        assert!(n.park(&replica(2), &w, t(10)));
        // A third 16 GB park does not fit in 40 GB: the oldest goes.
        assert!(n.park(&replica(3), &w, t(20)));
        let held: Vec<_> = n.report().into_iter().filter_map(|w| w.replica).collect();
        assert_eq!(held, vec![replica(2), replica(3)]);
        assert_eq!(n.expire(t(69)), vec![]);
        assert_eq!(n.expire(t(70)), vec![replica(2)]);
        assert_eq!(n.expire(t(80)), vec![replica(3)]);
        assert_eq!(n.parked_bytes(), 0);
        // Released (its endpoint deleted): gone from memory and the report.
        assert!(n.park(&replica(4), &w, t(200)));
        assert!(n.release(&replica(4)));
        assert!(!n.release(&replica(4)));
        assert_eq!(n.parked_bytes(), 0);
        assert!(n.report().iter().all(|e| e.tier != WeightTier::Parked));
        // Not parked at all: 0 s to keep, or larger than host memory.
        assert!(!n.park(&replica(4), &weights("ep_a-r1", 16.0, 0), t(90)));
        assert!(!n.park(&replica(5), &weights("ep_a-r1", 50.0, 60), t(90)));
    }
}
