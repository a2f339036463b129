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
//! Every park that ends is remembered with when it ended on this clock
//! ([`NodeWeightsState::ended`]) and sent with each sync until one is
//! answered ([`NodeWeightsState::acknowledge`]): the server bills the park
//! up to that instant, not to the sync that first misses it.
//!
//! Decisions take `now`: the agent passes the wall clock, tests a fixed one.

use std::collections::BTreeMap;
use std::path::PathBuf;

use chrono::{DateTime, Duration, Utc};
use flotilla_core::api::{EndedPark, NodeWeights, SyncRequest, WeightTier};
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
    /// Parks that ended and the server has not acknowledged, oldest first.
    ended: Vec<EndedPark>,
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
            ended: Vec::new(),
        }
    }

    /// Records that `replica`'s park ended at `at`, for the next syncs.
    fn ended_at(&mut self, replica: InstanceId, park: Park, at: DateTime<Utc>) {
        // A server that keeps refusing syncs must not grow this without
        // bound: past what one sync may carry the oldest go, and the
        // server bills those to the sync that no longer lists them.
        if self.ended.len() >= SyncRequest::MAX_PARKS_ENDED {
            let gone = self.ended.remove(0);
            tracing::warn!(instance_id = %gone.replica, "ended park not reported: too many unacknowledged");
        }
        self.ended.push(EndedPark {
            replica,
            endpoint_id: park.endpoint_id,
            key: park.key,
            size_bytes: park.size_bytes,
            since: park.since,
            ended_at: at,
        });
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
            self.parked.unpark(replica.as_str());
            if let Some(p) = self.parks.remove(&replica) {
                self.ended_at(replica, p, now);
            }
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
                let dropped: Vec<InstanceId> = self
                    .parks
                    .keys()
                    .filter(|r| dropped.iter().any(|d| d == r.as_str()))
                    .cloned()
                    .collect();
                for r in dropped {
                    if let Some(p) = self.parks.remove(&r) {
                        self.ended_at(r, p, now);
                    }
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

    /// Drops the parks whose time ran out; returns them. Each ended when
    /// its time ran out, not when this noticed: the endpoint's tenant
    /// asked for `keep_parked_s` and pays for no more.
    pub fn expire(&mut self, now: DateTime<Utc>) -> Vec<InstanceId> {
        let gone: Vec<InstanceId> = self
            .parks
            .iter()
            .filter(|(_, p)| p.until <= now)
            .map(|(r, _)| r.clone())
            .collect();
        for r in &gone {
            self.parked.unpark(r.as_str());
            if let Some(p) = self.parks.remove(r) {
                let until = p.until;
                self.ended_at(r.clone(), p, until);
            }
        }
        gone
    }

    /// Ends the park of `replica` at `now` (its endpoint was deleted:
    /// nothing will restore it). Whether it was parked.
    pub fn release(&mut self, replica: &InstanceId, now: DateTime<Utc>) -> bool {
        self.parked.unpark(replica.as_str());
        match self.parks.remove(replica) {
            Some(p) => {
                self.ended_at(replica.clone(), p, now);
                true
            }
            None => false,
        }
    }

    /// Ends every park at `now` (the agent stops: a restarted one holds
    /// none); returns them.
    pub fn release_all(&mut self, now: DateTime<Utc>) -> Vec<InstanceId> {
        let all: Vec<InstanceId> = self.parks.keys().cloned().collect();
        for r in &all {
            self.release(r, now);
        }
        all
    }

    /// The parks that ended and the server has not acknowledged, oldest
    /// first: what the next sync reports.
    pub fn ended(&self) -> Vec<EndedPark> {
        self.ended.clone()
    }

    /// Forgets the ended parks a sync the server answered carried (those
    /// that ended since stay, for the next).
    pub fn acknowledge(&mut self, sent: &[EndedPark]) {
        self.ended.retain(|e| !sent.contains(e));
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
        assert!(n.release(&replica(4), t(250)));
        assert!(!n.release(&replica(4), t(260)));
        assert_eq!(n.parked_bytes(), 0);
        assert!(n.report().iter().all(|e| e.tier != WeightTier::Parked));
        // Not parked at all: 0 s to keep, or larger than host memory.
        assert!(!n.park(&replica(4), &weights("ep_a-r1", 16.0, 0), t(90)));
        assert!(!n.park(&replica(5), &weights("ep_a-r1", 50.0, 60), t(90)));
    }

    #[test]
    fn every_park_that_ends_is_reported_with_its_end_until_acknowledged() {
        let dir = tempfile::tempdir().unwrap();
        let mut n = NodeWeightsState::new(dir.path(), 100_000_000_000, 40_000_000_000);
        let w = weights("ep_a-r1", 16.0, 60);
        let ms = |s: i64, ms: i64| t(s) + Duration::milliseconds(ms);
        assert!(n.park(&replica(1), &w, ms(0, 250)));
        assert!(n.park(&replica(2), &w, ms(1, 0)));
        assert!(n.ended().is_empty());
        // Restored onto a GPU at 12.345 s: the oldest park, replica 1.
        assert_eq!(n.start(&w, ms(12, 345)), WeightTier::Parked);
        // Two more 16 GB parks do not fit in 40 GB with replica 2's:
        // it is dropped when the second lands, at 21.5 s.
        assert!(n.park(&replica(3), &w, ms(20, 0)));
        assert!(n.park(&replica(4), &w, ms(21, 500)));
        // Replica 3 runs out at 80 s, noticed at 80.9 s: ended at 80 s.
        assert_eq!(n.expire(ms(80, 900)), vec![replica(3)]);
        // Replica 4's endpoint deleted, released at 81 s.
        assert!(n.release(&replica(4), ms(81, 0)));
        let ended: Vec<_> = n
            .ended()
            .into_iter()
            .map(|e| (e.replica, e.since, e.ended_at))
            .collect();
        assert_eq!(
            ended,
            vec![
                (replica(1), ms(0, 250), ms(12, 345)),
                (replica(2), ms(1, 0), ms(21, 500)),
                (replica(3), ms(20, 0), ms(80, 0)),
                (replica(4), ms(21, 500), ms(81, 0)),
            ]
        );
        let e = &n.ended()[0];
        assert_eq!((e.size_bytes, e.key.as_str()), (16_000_000_000, "ep_a-r1"));
        // A sync carried the first two and was answered: the rest stay,
        // and so does one that ended after the sync was built.
        let sent = n.ended()[..2].to_vec();
        assert!(n.park(&replica(5), &w, ms(100, 0)));
        assert_eq!(n.start(&w, ms(101, 0)), WeightTier::Parked);
        n.acknowledge(&sent);
        let left: Vec<_> = n.ended().into_iter().map(|e| e.replica).collect();
        assert_eq!(left, vec![replica(3), replica(4), replica(5)]);
        n.acknowledge(&n.ended());
        assert!(n.ended().is_empty());
        // The agent stops: every park ends then.
        assert!(n.park(&replica(6), &w, ms(110, 0)));
        assert_eq!(n.release_all(ms(115, 42)), vec![replica(6)]);
        let ended: Vec<_> = n
            .ended()
            .into_iter()
            .map(|e| (e.replica, e.ended_at))
            .collect();
        assert_eq!(ended, vec![(replica(6), ms(115, 42))]);
        assert!(n.report().iter().all(|e| e.tier != WeightTier::Parked));
        assert_eq!(n.parked_bytes(), 0);
    }
}
