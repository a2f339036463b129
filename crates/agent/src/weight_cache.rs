//! The node's model-weight caches: weight files kept on local disk for the
//! next start (the *cached* readiness tier) and parked replicas' weights
//! kept in host memory with the GPU released (the *parked* tier), each
//! under a size limit with the least recently used entry evicted first.
//!
//! The disk side is real: [`WeightCache::store`] writes the weight file
//! under the cache directory, [`WeightCache::open`] finds it again (and
//! marks it used), and eviction deletes files. The order of use is kept in
//! a state file beside them, so a restarted agent evicts in the same order.
//! The host-memory side ([`ParkedSet`]) is the bookkeeping of what is
//! parked: the bytes themselves would live in the model server's process
//! (vLLM's sleep mode keeps them; the emulator, which has none, exits and
//! models the restore as a load time), and the agent decides which park is
//! dropped when memory runs out ([`crate::weights`] ties both to replicas).
//!
//! Eviction is the image cache's policy ([`crate::image_cache::evictions`]):
//! least recently used first, never an entry in use, no more than needed.
//! [`WeightCache::report`] and [`ParkedSet::report`] are what the agent
//! tells the server, so placement can prefer the node that holds a model.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::image_cache::{evictions, ImageUse};

/// The cache's record in its directory.
pub const STATE_FILE: &str = "weights.json";

/// Errors of the weight cache, naming the path or the model.
#[derive(Debug, thiserror::Error)]
pub enum WeightCacheError {
    /// A file of the cache could not be read or written.
    #[error("weight cache {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The state file is not the cache's.
    #[error("weight cache state {path}: {source}")]
    State {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    /// A model name that cannot be a file name.
    #[error("invalid model name {model:?}: use letters, digits, '.', '-' and '_'")]
    InvalidModel { model: String },
    /// One entry is larger than the whole cache.
    #[error("{model} is {size_bytes} bytes, over the cache's limit of {limit_bytes}")]
    TooLarge {
        model: String,
        size_bytes: u64,
        limit_bytes: u64,
    },
}

/// What a node holds of one model, as reported to the server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldWeights {
    /// The model (weights) name.
    pub model: String,
    /// Size of its weights, bytes.
    pub size_bytes: u64,
    /// When it was last used.
    pub last_used: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Entry {
    size_bytes: u64,
    last_used: DateTime<Utc>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Saved {
    entries: BTreeMap<String, Entry>,
}

/// Weight files on local disk, at most `limit_bytes` of them.
#[derive(Debug)]
pub struct WeightCache {
    dir: PathBuf,
    limit_bytes: u64,
    entries: BTreeMap<String, Entry>,
}

fn valid(model: &str) -> Result<(), WeightCacheError> {
    let ok = !model.is_empty()
        && model.len() <= 200
        && !model.starts_with('.')
        && model
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'));
    if ok {
        Ok(())
    } else {
        Err(WeightCacheError::InvalidModel {
            model: model.to_string(),
        })
    }
}

impl WeightCache {
    /// The cache in `dir` (created if missing), with what an earlier agent
    /// left there. Entries whose file is gone are forgotten.
    pub fn new(dir: impl Into<PathBuf>, limit_bytes: u64) -> Result<Self, WeightCacheError> {
        let dir = dir.into();
        let io = |path: &Path| {
            let path = path.display().to_string();
            move |source| WeightCacheError::Io { path, source }
        };
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let state = dir.join(STATE_FILE);
        let mut entries = match std::fs::read(&state) {
            Ok(bytes) => {
                serde_json::from_slice::<Saved>(&bytes)
                    .map_err(|source| WeightCacheError::State {
                        path: state.display().to_string(),
                        source,
                    })?
                    .entries
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(io(&state)(e)),
        };
        entries.retain(|model, _| dir.join(model).is_file());
        Ok(Self {
            dir,
            limit_bytes,
            entries,
        })
    }

    /// The path of `model`'s weight file, held or not.
    pub fn path(&self, model: &str) -> Result<PathBuf, WeightCacheError> {
        valid(model)?;
        Ok(self.dir.join(model))
    }

    /// The file of `model` if the cache holds it, marking it used at `now`.
    pub fn open(
        &mut self,
        model: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<PathBuf>, WeightCacheError> {
        let path = self.path(model)?;
        let Some(e) = self.entries.get_mut(model) else {
            return Ok(None);
        };
        e.last_used = now;
        self.save()?;
        Ok(Some(path))
    }

    /// Write `bytes` as `model`'s weights (a download landing), used at
    /// `now`, evicting the least recently used others until everything
    /// fits. `in_use` names models a running replica reads now: never
    /// evicted. Returns the models evicted.
    pub fn store(
        &mut self,
        model: &str,
        bytes: &[u8],
        now: DateTime<Utc>,
        in_use: &[&str],
    ) -> Result<Vec<String>, WeightCacheError> {
        self.insert(model, bytes.len() as u64, bytes, now, in_use)
    }

    /// Record that `model`'s weights of `size_bytes` landed on this node
    /// through the model server's own download (a server that fetches
    /// its weights itself, or the emulator, which has none): the file is
    /// a small manifest naming the size, and the cache counts, reports and
    /// evicts the declared size. Returns the models evicted.
    pub fn record_download(
        &mut self,
        model: &str,
        size_bytes: u64,
        now: DateTime<Utc>,
        in_use: &[&str],
    ) -> Result<Vec<String>, WeightCacheError> {
        let manifest = format!("{{\"size_bytes\":{size_bytes}}}\n");
        self.insert(model, size_bytes, manifest.as_bytes(), now, in_use)
    }

    fn insert(
        &mut self,
        model: &str,
        size: u64,
        bytes: &[u8],
        now: DateTime<Utc>,
        in_use: &[&str],
    ) -> Result<Vec<String>, WeightCacheError> {
        let path = self.path(model)?;
        if size > self.limit_bytes {
            return Err(WeightCacheError::TooLarge {
                model: model.to_string(),
                size_bytes: size,
                limit_bytes: self.limit_bytes,
            });
        }
        std::fs::write(&path, bytes).map_err(|source| WeightCacheError::Io {
            path: path.display().to_string(),
            source,
        })?;
        self.entries.insert(
            model.to_string(),
            Entry {
                size_bytes: size,
                last_used: now,
            },
        );
        let uses: Vec<ImageUse> = self
            .entries
            .iter()
            .map(|(m, e)| ImageUse {
                id: m.clone(),
                size_bytes: e.size_bytes,
                last_used: e.last_used,
                in_use: m == model || in_use.contains(&m.as_str()),
            })
            .collect();
        let victims = evictions(&uses, self.limit_bytes);
        for v in &victims {
            self.entries.remove(v);
            let p = self.dir.join(v);
            match std::fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(WeightCacheError::Io {
                        path: p.display().to_string(),
                        source,
                    })
                }
            }
        }
        self.save()?;
        Ok(victims)
    }

    /// Bytes held.
    pub fn used_bytes(&self) -> u64 {
        self.entries.values().map(|e| e.size_bytes).sum()
    }

    /// What the cache holds, most recently used first.
    pub fn report(&self) -> Vec<HeldWeights> {
        report(&self.entries)
    }

    fn save(&self) -> Result<(), WeightCacheError> {
        let state = self.dir.join(STATE_FILE);
        let tmp = self.dir.join(format!("{STATE_FILE}.tmp"));
        let saved = Saved {
            entries: self.entries.clone(),
        };
        let bytes = serde_json::to_vec(&saved).map_err(|source| WeightCacheError::State {
            path: state.display().to_string(),
            source,
        })?;
        let io = |path: &Path| {
            let path = path.display().to_string();
            move |source| WeightCacheError::Io { path, source }
        };
        std::fs::write(&tmp, bytes).map_err(io(&tmp))?;
        std::fs::rename(&tmp, &state).map_err(io(&state))
    }
}

fn report(entries: &BTreeMap<String, Entry>) -> Vec<HeldWeights> {
    let mut out: Vec<HeldWeights> = entries
        .iter()
        .map(|(m, e)| HeldWeights {
            model: m.clone(),
            size_bytes: e.size_bytes,
            last_used: e.last_used,
        })
        .collect();
    out.sort_by(|a, b| {
        b.last_used
            .cmp(&a.last_used)
            .then_with(|| a.model.cmp(&b.model))
    });
    out
}

/// Parked replicas' weights in host memory, at most `limit_bytes`: one
/// entry per parked replica (keyed by the replica), LRU by park time.
#[derive(Debug, Clone)]
pub struct ParkedSet {
    limit_bytes: u64,
    entries: BTreeMap<String, Entry>,
}

impl ParkedSet {
    /// An empty set with a limit.
    pub fn new(limit_bytes: u64) -> Self {
        Self {
            limit_bytes,
            entries: BTreeMap::new(),
        }
    }

    /// Park `replica` (`size_bytes` of weights) at `now`. Returns the
    /// replicas dropped to make room, least recently parked first; an
    /// entry larger than the limit is refused.
    pub fn park(
        &mut self,
        replica: &str,
        size_bytes: u64,
        now: DateTime<Utc>,
    ) -> Result<Vec<String>, WeightCacheError> {
        if size_bytes > self.limit_bytes {
            return Err(WeightCacheError::TooLarge {
                model: replica.to_string(),
                size_bytes,
                limit_bytes: self.limit_bytes,
            });
        }
        self.entries.insert(
            replica.to_string(),
            Entry {
                size_bytes,
                last_used: now,
            },
        );
        let uses: Vec<ImageUse> = self
            .entries
            .iter()
            .map(|(r, e)| ImageUse {
                id: r.clone(),
                size_bytes: e.size_bytes,
                last_used: e.last_used,
                in_use: r == replica,
            })
            .collect();
        let victims = evictions(&uses, self.limit_bytes);
        for v in &victims {
            self.entries.remove(v);
        }
        Ok(victims)
    }

    /// Take `replica` out (restored onto a GPU, or released). Whether it
    /// was parked.
    pub fn unpark(&mut self, replica: &str) -> bool {
        self.entries.remove(replica).is_some()
    }

    /// Bytes held.
    pub fn used_bytes(&self) -> u64 {
        self.entries.values().map(|e| e.size_bytes).sum()
    }

    /// What is parked, most recently first.
    pub fn report(&self) -> Vec<HeldWeights> {
        report(&self.entries)
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    fn t(s: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_700_000_000 + s, 0).single().unwrap()
    }

    #[test]
    fn a_full_disk_cache_evicts_the_least_recently_used_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = WeightCache::new(dir.path(), 2_500).unwrap();
        assert!(c.store("a", &[1; 1_000], t(0), &[]).unwrap().is_empty());
        assert!(c.store("b", &[2; 1_000], t(1), &[]).unwrap().is_empty());
        // a used again: b is now the least recently used.
        assert!(c.open("a", t(2)).unwrap().is_some());
        let evicted = c.store("c", &[3; 1_000], t(3), &[]).unwrap();
        assert_eq!(evicted, vec!["b".to_string()]);
        assert!(!dir.path().join("b").exists());
        assert_eq!(std::fs::read(dir.path().join("a")).unwrap(), vec![1; 1_000]);
        assert_eq!(c.used_bytes(), 2_000);
        let held: Vec<String> = c.report().into_iter().map(|h| h.model).collect();
        assert_eq!(held, vec!["c", "a"]);
        // A model a replica reads is kept even when least recently used.
        let evicted = c.store("d", &[4; 1_000], t(4), &["a"]).unwrap();
        assert_eq!(evicted, vec!["c".to_string()]);
        // A restarted agent finds the same entries, in the same order.
        drop(c);
        let mut again = WeightCache::new(dir.path(), 2_500).unwrap();
        let held: Vec<String> = again.report().into_iter().map(|h| h.model).collect();
        assert_eq!(held, vec!["d", "a"]);
        assert!(again.open("b", t(5)).unwrap().is_none());
    }

    #[test]
    fn bad_names_and_oversized_entries_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = WeightCache::new(dir.path(), 100).unwrap();
        for bad in ["", "../x", ".hidden", "a/b"] {
            assert!(matches!(
                c.store(bad, b"x", t(0), &[]),
                Err(WeightCacheError::InvalidModel { .. })
            ));
        }
        let e = c.store("big", &[0; 101], t(0), &[]).unwrap_err();
        assert!(e.to_string().contains("over the cache's limit"), "{e}");
        assert!(!dir.path().join("big").exists());
    }

    #[test]
    fn parking_past_host_memory_drops_the_oldest_park() {
        let mut p = ParkedSet::new(32);
        assert!(p.park("rep_1", 16, t(0)).unwrap().is_empty());
        assert!(p.park("rep_2", 16, t(1)).unwrap().is_empty());
        assert_eq!(
            p.park("rep_3", 16, t(2)).unwrap(),
            vec!["rep_1".to_string()]
        );
        assert!(p.unpark("rep_2"));
        assert!(!p.unpark("rep_1"));
        assert_eq!(p.used_bytes(), 16);
        assert!(p.park("huge", 33, t(3)).is_err());
    }
}
