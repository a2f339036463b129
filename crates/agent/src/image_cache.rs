//! The node's image cache: the images instances started from stay on the
//! node for the next start (no pull), up to a size limit, past which the
//! least recently used are removed from the engine.
//!
//! [`evictions`] is the policy and is pure: given the images, their sizes,
//! last uses and whether a container uses them, and the limit, it names
//! what to remove. [`ImageCache`] is the engine side: it records each use
//! (persisted in the agent's state directory, so a restarted agent keeps
//! the order), lists what the engine holds, and removes the victims.
//!
//! Only images an instance of this node started from are managed: images
//! the operator put on the node are neither counted nor removed. An image
//! any container uses (running or stopped) is never removed, nor one that a
//! start has just pulled or found and not yet created its container from.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bollard::container::ListContainersOptions;
use bollard::image::{ListImagesOptions, RemoveImageOptions};
use bollard::Docker;
use chrono::{DateTime, Utc};
use flotilla_core::api::NodeImage;
use serde::{Deserialize, Serialize};

use crate::container_error::ContainerError;

/// The cache's record in the agent's state directory.
pub const STATE_FILE: &str = "image-cache.json";
/// The limit `flotilla agent` uses unless `--image-cache-gb` says
/// otherwise: room for a handful of CUDA framework images (10–20 GB each)
/// on a node's usual local disk.
pub const DEFAULT_IMAGE_CACHE_GB: u64 = 100;
/// How often the limit is enforced besides after every start: images
/// pulled by hand or a failed removal are caught up with.
pub const ENFORCE_EVERY: Duration = Duration::from_secs(300);

/// One image as the eviction policy sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageUse {
    /// The engine's image id.
    pub id: String,
    /// Its size in bytes.
    pub size_bytes: u64,
    /// When an instance last started from it.
    pub last_used: DateTime<Utc>,
    /// A container uses it (or a start is about to create one from it).
    pub in_use: bool,
}

/// The images to remove so that the rest fit in `limit_bytes`: the least
/// recently used first (ties by id, so the answer is stable), never one in
/// use, and no more than needed. When the images in use alone exceed the
/// limit, every image not in use is removed and the cache stays over it
/// until they are released.
pub fn evictions(images: &[ImageUse], limit_bytes: u64) -> Vec<String> {
    let mut total: u64 = images.iter().map(|i| i.size_bytes).sum();
    if total <= limit_bytes {
        return Vec::new();
    }
    let mut candidates: Vec<&ImageUse> = images.iter().filter(|i| !i.in_use).collect();
    candidates.sort_by(|a, b| a.last_used.cmp(&b.last_used).then_with(|| a.id.cmp(&b.id)));
    let mut out = Vec::new();
    for c in candidates {
        if total <= limit_bytes {
            break;
        }
        total -= c.size_bytes;
        out.push(c.id.clone());
    }
    out
}

/// What the cache knows of one image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedImage {
    /// The reference an instance asked for.
    pub image: String,
    /// The engine's image id it resolved to (without `sha256:`).
    pub id: String,
    /// Its size in bytes, as the engine reports it.
    pub size_bytes: u64,
    /// When an instance last started from it.
    pub last_used: DateTime<Utc>,
    /// How many times this node pulled it.
    pub pulls: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    id: String,
    size_bytes: u64,
    last_used: DateTime<Utc>,
    pulls: u32,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Saved {
    images: BTreeMap<String, Record>,
}

#[derive(Debug, Default)]
struct Inner {
    /// By image reference.
    records: BTreeMap<String, Record>,
    /// Images a start found or pulled and has not created its container
    /// from yet, and references being pulled, with how many starts hold
    /// each.
    pinned: HashMap<Pinned, usize>,
}

/// What a start keeps from eviction.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Pinned {
    /// An image, by engine id.
    Id(String),
    /// Whatever image a reference names: held while it is pulled, when
    /// its id is not known yet.
    Reference(String),
}

/// The engine side of the image cache. Shared by the container runtime's
/// clones.
#[derive(Debug)]
pub struct ImageCache {
    limit_bytes: Option<u64>,
    state_file: Option<PathBuf>,
    inner: Mutex<Inner>,
    /// Starts hold it shared from an image check to its pin (never
    /// across a pull); enforcement holds it alone, so it never removes an
    /// image a start has just found present and not yet pinned.
    gate: tokio::sync::RwLock<()>,
}

/// Keeps an image from eviction while a start pulls it or creates its
/// container.
#[derive(Debug)]
pub struct ImagePin {
    cache: Arc<ImageCache>,
    what: Pinned,
}

impl ImagePin {
    fn new(cache: &Arc<ImageCache>, inner: &mut Inner, what: Pinned) -> Self {
        *inner.pinned.entry(what.clone()).or_default() += 1;
        Self {
            cache: cache.clone(),
            what,
        }
    }
}

impl Drop for ImagePin {
    fn drop(&mut self) {
        let mut inner = self.cache.lock();
        if let Some(n) = inner.pinned.get_mut(&self.what) {
            *n -= 1;
            if *n == 0 {
                inner.pinned.remove(&self.what);
            }
        }
    }
}

/// The engine's ids come as `sha256:<hex>` from some calls and bare from
/// others (Podman): compared bare.
pub fn bare_id(id: &str) -> &str {
    id.strip_prefix("sha256:").unwrap_or(id)
}

impl ImageCache {
    /// A cache with `limit_bytes` (`None`: never evicts) recording its
    /// uses in `state_dir/`[`STATE_FILE`] when a directory is given, and
    /// reading back what an earlier agent recorded there. A record that
    /// does not parse is set aside with a warning: the cache then starts
    /// empty, which only delays evictions.
    pub fn open(limit_bytes: Option<u64>, state_dir: Option<&Path>) -> Self {
        let state_file = state_dir.map(|d| d.join(STATE_FILE));
        let mut records = BTreeMap::new();
        if let Some(f) = &state_file {
            match std::fs::read(f) {
                Ok(bytes) => match serde_json::from_slice::<Saved>(&bytes) {
                    Ok(saved) => records = saved.images,
                    Err(error) => {
                        tracing::warn!(file = %f.display(), %error, "image cache record unreadable, starting empty")
                    }
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => {
                    tracing::warn!(file = %f.display(), %error, "cannot read the image cache record")
                }
            }
        }
        Self {
            limit_bytes,
            state_file,
            inner: Mutex::new(Inner {
                records,
                pinned: HashMap::new(),
            }),
            gate: tokio::sync::RwLock::new(()),
        }
    }

    /// The size limit in bytes, if any.
    pub fn limit_bytes(&self) -> Option<u64> {
        self.limit_bytes
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Held shared by a start from its image check until it pinned the
    /// image.
    pub async fn starting(&self) -> tokio::sync::RwLockReadGuard<'_, ()> {
        self.gate.read().await
    }

    /// Records that an instance starts from `image` (engine id `id`) at
    /// `at`, pulled for it or not, and keeps it from eviction until the
    /// returned pin is dropped.
    pub fn record_use(
        self: &Arc<Self>,
        image: &str,
        id: &str,
        size_bytes: u64,
        at: DateTime<Utc>,
        pulled: bool,
    ) -> ImagePin {
        let id = bare_id(id).to_string();
        let mut inner = self.lock();
        let pulls = inner.records.get(image).map_or(0, |r| r.pulls) + u32::from(pulled);
        inner.records.insert(
            image.to_string(),
            Record {
                id: id.clone(),
                size_bytes,
                last_used: at,
                pulls,
            },
        );
        self.persist(&inner);
        ImagePin::new(self, &mut inner, Pinned::Id(id))
    }

    /// Keeps whatever image `reference` names from eviction while a start
    /// pulls it: a pull may take minutes and holds no lock, and the
    /// reference may have a record from before.
    pub fn pulling(self: &Arc<Self>, reference: &str) -> ImagePin {
        let mut inner = self.lock();
        ImagePin::new(self, &mut inner, Pinned::Reference(reference.to_string()))
    }

    /// Every image reference the cache holds.
    pub fn images(&self) -> Vec<CachedImage> {
        self.lock()
            .records
            .iter()
            .map(|(image, r)| CachedImage {
                image: image.clone(),
                id: r.id.clone(),
                size_bytes: r.size_bytes,
                last_used: r.last_used,
                pulls: r.pulls,
            })
            .collect()
    }

    /// What the agent reports to the server, most recently used first.
    pub fn report(&self) -> Vec<NodeImage> {
        let mut out: Vec<NodeImage> = self
            .images()
            .into_iter()
            .map(|c| NodeImage {
                image: c.image,
                id: format!("sha256:{}", c.id),
                size_bytes: c.size_bytes,
                last_used: Some(c.last_used),
            })
            .collect();
        out.sort_by(|a, b| {
            b.last_used
                .cmp(&a.last_used)
                .then_with(|| a.image.cmp(&b.image))
        });
        out
    }

    /// Writes the records to the state file (a temporary file renamed
    /// over it, so a crash leaves the old or the new one). A failure is
    /// logged: the cache works on, only its order is not kept over a
    /// restart.
    fn persist(&self, inner: &Inner) {
        let Some(file) = &self.state_file else {
            return;
        };
        let saved = Saved {
            images: inner.records.clone(),
        };
        let tmp = file.with_extension("json.tmp");
        let result = serde_json::to_vec_pretty(&saved)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(&tmp, bytes))
            .and_then(|()| std::fs::rename(&tmp, file));
        if let Err(error) = result {
            tracing::warn!(file = %file.display(), %error, "cannot save the image cache record");
        }
    }

    /// Brings the cache within its limit: lists the engine's images and
    /// containers, forgets records of images that are gone, and removes
    /// the images [`evictions`] names. Returns the references removed.
    /// Without a limit it does nothing.
    pub async fn enforce(&self, docker: &Docker) -> Result<Vec<String>, ContainerError> {
        let Some(limit) = self.limit_bytes else {
            return Ok(Vec::new());
        };
        let _alone = self.gate.write().await;
        let engine = |what: &'static str| move |source| ContainerError::Engine { what, source };
        let present: HashMap<String, u64> = docker
            .list_images(Some(ListImagesOptions::<String> {
                all: false,
                ..Default::default()
            }))
            .await
            .map_err(engine("list images"))?
            .into_iter()
            .map(|i| {
                (
                    bare_id(&i.id).to_string(),
                    u64::try_from(i.size).unwrap_or(0),
                )
            })
            .collect();
        let used: BTreeSet<String> = docker
            .list_containers(Some(ListContainersOptions::<String> {
                all: true,
                ..Default::default()
            }))
            .await
            .map_err(engine("list containers"))?
            .into_iter()
            .filter_map(|c| c.image_id.map(|i| bare_id(&i).to_string()))
            .collect();
        let (victims, refs) = {
            let mut inner = self.lock();
            let before = inner.records.len();
            inner.records.retain(|_, r| present.contains_key(&r.id));
            if inner.records.len() != before {
                self.persist(&inner);
            }
            let mut by_id: BTreeMap<String, ImageUse> = BTreeMap::new();
            for (image, r) in &inner.records {
                let e = by_id.entry(r.id.clone()).or_insert_with(|| ImageUse {
                    id: r.id.clone(),
                    size_bytes: present.get(&r.id).copied().unwrap_or(r.size_bytes),
                    last_used: r.last_used,
                    in_use: used.contains(&r.id)
                        || inner.pinned.contains_key(&Pinned::Id(r.id.clone())),
                });
                e.last_used = e.last_used.max(r.last_used);
                e.in_use |= inner.pinned.contains_key(&Pinned::Reference(image.clone()));
            }
            let uses: Vec<ImageUse> = by_id.into_values().collect();
            let victims = evictions(&uses, limit);
            let refs: Vec<(String, String)> = inner
                .records
                .iter()
                .filter(|(_, r)| victims.contains(&r.id))
                .map(|(image, r)| (image.clone(), r.id.clone()))
                .collect();
            (victims, refs)
        };
        let mut removed = Vec::new();
        for (image, id) in refs {
            // Never forced: an image a container was created from since
            // the listing is refused by the engine (409) and kept.
            match docker
                .remove_image(
                    &image,
                    Some(RemoveImageOptions {
                        force: false,
                        noprune: false,
                    }),
                    None,
                )
                .await
            {
                Ok(_) => {}
                Err(bollard::errors::Error::DockerResponseServerError {
                    status_code: 404, ..
                }) => {}
                Err(error) => {
                    tracing::warn!(%image, %error, "cannot evict image");
                    continue;
                }
            }
            tracing::info!(%image, id = %id, limit_bytes = limit, "image evicted from the cache");
            let mut inner = self.lock();
            inner.records.remove(&image);
            self.persist(&inner);
            removed.push(image);
        }
        if !victims.is_empty() && removed.is_empty() {
            tracing::debug!(?victims, "no image could be evicted");
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use proptest::prelude::*;

    fn img(id: &str, size: u64, t: i64, in_use: bool) -> ImageUse {
        ImageUse {
            id: id.into(),
            size_bytes: size,
            last_used: Utc.timestamp_opt(t, 0).unwrap(),
            in_use,
        }
    }

    #[test]
    fn the_least_recently_used_go_first_and_only_as_many_as_needed() {
        let images = [
            img("a", 40, 3, false),
            img("b", 40, 1, false),
            img("c", 40, 2, false),
        ];
        assert_eq!(evictions(&images, 120), Vec::<String>::new());
        assert_eq!(evictions(&images, 80), vec!["b"]);
        assert_eq!(evictions(&images, 79), vec!["b", "c"]);
        assert_eq!(evictions(&images, 0), vec!["b", "c", "a"]);
    }

    #[test]
    fn an_image_in_use_is_never_removed_even_over_the_limit() {
        let images = [img("old", 50, 1, true), img("new", 50, 2, false)];
        assert_eq!(evictions(&images, 60), vec!["new"]);
        let images = [img("old", 50, 1, true), img("new", 50, 2, true)];
        assert!(evictions(&images, 10).is_empty());
    }

    #[test]
    fn the_record_survives_a_restart_and_reports_most_recent_first() {
        let dir = tempfile::tempdir().unwrap();
        let t = |s| Utc.timestamp_opt(s, 0).unwrap();
        {
            let c = Arc::new(ImageCache::open(Some(10), Some(dir.path())));
            drop(c.record_use("a:1", "sha256:aaa", 5, t(10), true));
            drop(c.record_use("b:1", "bbb", 6, t(20), false));
            drop(c.record_use("a:1", "aaa", 5, t(30), false));
        }
        let c = ImageCache::open(Some(10), Some(dir.path()));
        let r = c.report();
        assert_eq!(
            r.iter().map(|i| i.image.as_str()).collect::<Vec<_>>(),
            ["a:1", "b:1"]
        );
        assert_eq!(r[0].id, "sha256:aaa");
        assert_eq!(r[0].last_used, Some(t(30)));
        let a = c.images().into_iter().find(|i| i.image == "a:1").unwrap();
        assert_eq!(a.pulls, 1);
        std::fs::write(dir.path().join(STATE_FILE), "{not json").unwrap();
        assert!(ImageCache::open(None, Some(dir.path())).images().is_empty());
    }

    #[test]
    fn a_pin_holds_until_dropped() {
        let c = Arc::new(ImageCache::open(Some(1), None));
        let p1 = c.record_use("a", "x", 1, Utc::now(), false);
        let p2 = c.record_use("b", "x", 1, Utc::now(), false);
        let p3 = c.pulling("a");
        drop(p1);
        assert!(c.lock().pinned.contains_key(&Pinned::Id("x".into())));
        drop(p2);
        assert!(!c.lock().pinned.contains_key(&Pinned::Id("x".into())));
        drop(p3);
        assert!(c.lock().pinned.is_empty());
    }

    fn images() -> impl Strategy<Value = Vec<ImageUse>> {
        proptest::collection::vec((0u64..1000, 0i64..50, any::<bool>()), 0..20).prop_map(|v| {
            v.into_iter()
                .enumerate()
                .map(|(i, (size, t, in_use))| img(&format!("i{i:02}"), size, t, in_use))
                .collect()
        })
    }

    proptest! {
        #[test]
        fn evictions_respect_use_limit_order_and_need(images in images(), limit in 0u64..20_000) {
            let out = evictions(&images, limit);
            let by_id = |id: &str| images.iter().find(|i| i.id == id).unwrap();
            // Never an image in use, never twice.
            prop_assert!(out.iter().all(|id| !by_id(id).in_use));
            let set: BTreeSet<&String> = out.iter().collect();
            prop_assert_eq!(set.len(), out.len());
            let kept: u64 = images.iter().filter(|i| !set.contains(&i.id)).map(|i| i.size_bytes).sum();
            let evictable_kept = images.iter().any(|i| !i.in_use && !set.contains(&i.id));
            // Within the limit, or nothing left that may go.
            prop_assert!(kept <= limit || !evictable_kept);
            // Least recently used first: every victim is no newer than any
            // image kept that could have gone.
            for v in &out {
                for k in images.iter().filter(|i| !i.in_use && !set.contains(&i.id)) {
                    prop_assert!(by_id(v).last_used <= k.last_used);
                }
            }
            // No more than needed: without the last victim the rest would
            // not have fit.
            if let Some(last) = out.last() {
                prop_assert!(kept + by_id(last).size_bytes > limit);
            }
            let total: u64 = images.iter().map(|i| i.size_bytes).sum();
            if total <= limit {
                prop_assert!(out.is_empty());
            }
        }
    }
}
