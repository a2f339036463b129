//! Select: score every feasible equivalence class, keep the best, break ties
//! uniformly at random over the tied *nodes*, and name the GPUs.

use std::collections::HashMap;

use rand::Rng;

use crate::filter::{check, Explanation};
use crate::request::{GpuDemand, Request};
use crate::score::{Scored, Scorer, TieBreak};
use crate::snapshot::Cluster;
pub use crate::snapshot::Placement;
use crate::MILLI;

/// The engine's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Placed(Placement),
    Unschedulable(Explanation),
}

/// At most this many cached verdicts (about 100 MiB).
const CACHE_BUDGET: usize = 4 << 20;

#[derive(Debug, Clone, Copy)]
enum Cached {
    Unknown,
    Infeasible,
    Feasible(Scored),
}

/// A scorer plus a cache of its verdicts per (request shape, node class).
///
/// The cache is sound because a class is defined by the full [`NodeState`](crate::snapshot::NodeState)
/// a scorer may look at, and a class id always names the same state in one
/// cluster; the engine drops the cache when it is handed a different cluster.
pub struct Engine {
    scorer: Box<dyn Scorer + Send>,
    cluster_uid: u64,
    /// Entries held across all shapes; the cache is dropped when it passes
    /// [`CACHE_BUDGET`], so a stream of all-distinct requests cannot grow it
    /// without bound (it then only costs speed).
    cached: usize,
    shapes: HashMap<Request, usize>,
    cache: Vec<Vec<Cached>>,
    /// Scratch for tied classes: (class id, member count).
    ties: Vec<(u32, usize)>,
    scored: Vec<(u32, Scored)>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("scorer", &self.scorer.name())
            .field("shapes", &self.shapes.len())
            .finish()
    }
}

impl Engine {
    pub fn new(scorer: Box<dyn Scorer + Send>) -> Self {
        Engine {
            scorer,
            cluster_uid: 0,
            cached: 0,
            shapes: HashMap::new(),
            cache: Vec::new(),
            ties: Vec::new(),
            scored: Vec::new(),
        }
    }

    pub fn scorer_name(&self) -> &'static str {
        self.scorer.name()
    }

    /// Decides where `req` goes in `cluster`. Does not change the cluster:
    /// commit the placement with [`Cluster::commit`].
    pub fn decide<R: Rng + ?Sized>(
        &mut self,
        cluster: &Cluster,
        req: &Request,
        rng: &mut R,
    ) -> Decision {
        if cluster.uid() != self.cluster_uid || self.cached > CACHE_BUDGET {
            self.cluster_uid = cluster.uid();
            self.shapes.clear();
            self.cache.clear();
            self.cached = 0;
        }
        let next = self.shapes.len();
        let shape = *self.shapes.entry(*req).or_insert(next);
        if shape == self.cache.len() {
            self.cache.push(Vec::new());
        }
        let cache = &mut self.cache[shape];
        self.scored.clear();
        for (id, class) in cluster.active_classes() {
            let i = id as usize;
            if cache.len() <= i {
                self.cached += i + 1 - cache.len();
                cache.resize(i + 1, Cached::Unknown);
            }
            if let Cached::Unknown = cache[i] {
                cache[i] = match check(&class.state, req) {
                    Ok(()) => Cached::Feasible(self.scorer.score(&class.state, req)),
                    Err(_) => Cached::Infeasible,
                };
            }
            if let Cached::Feasible(s) = cache[i] {
                self.scored.push((id, s));
            }
        }
        if self.scored.is_empty() {
            let mut why = Explanation::default();
            for (_, class) in cluster.active_classes() {
                if let Err(r) = check(&class.state, req) {
                    why.add(r, class.members.len());
                }
            }
            return Decision::Unschedulable(why);
        }
        if self.scorer.normalize() {
            normalize(&mut self.scored);
        }
        // Best score, then best tie-break; all classes equal on both tie.
        let mut best: Option<(f64, f64)> = None;
        self.ties.clear();
        for &(id, s) in &self.scored {
            let key = (s.score, s.tie);
            let members = cluster.class(id).members.len();
            match best {
                Some(b) if b.0 > key.0 || (b.0 == key.0 && b.1 > key.1) => {}
                Some(b) if b == key => self.ties.push((id, members)),
                _ => {
                    best = Some(key);
                    self.ties.clear();
                    self.ties.push((id, members));
                }
            }
        }
        let (chosen, node) = match self.scorer.tie_break() {
            TieBreak::LowestIndex => self
                .ties
                .iter()
                .filter_map(|&(id, _)| cluster.class(id).members.first().map(|&n| (id, n)))
                .min_by_key(|&(_, n)| n)
                .unwrap_or((self.ties[0].0, 0)),
            TieBreak::Uniform => {
                // Uniform over tied nodes: a class weighted by its size, then
                // a member uniformly.
                let total: usize = self.ties.iter().map(|t| t.1).sum();
                let mut pick = rng.gen_range(0..total.max(1));
                let mut chosen = self.ties[0].0;
                for &(id, n) in &self.ties {
                    if pick < n {
                        chosen = id;
                        break;
                    }
                    pick -= n;
                }
                let members = &cluster.class(chosen).members;
                let k = rng.gen_range(0..members.len().max(1));
                (chosen, members.iter().nth(k).copied().unwrap_or(0))
            }
        };
        let (share_from, share_ties) = self
            .scored
            .iter()
            .find(|(id, _)| *id == chosen)
            .map_or((None, 0), |(_, s)| (s.share_from, s.share_ties));
        let gpus = pick_gpus(cluster, node, req, share_from, share_ties, rng);
        Decision::Placed(Placement { node, gpus })
    }
}

impl Engine {
    /// The scorer's raw verdict on a node state (no normalisation across
    /// nodes): for callers that rank nodes on more than the score.
    pub(crate) fn score_state(&self, state: &crate::snapshot::NodeState, req: &Request) -> Scored {
        self.scorer.score(state, req)
    }

    /// Place `req` on `node`, which the caller checked is feasible, with
    /// the scorer's GPU choice for a share.
    pub(crate) fn place_on<R: Rng + ?Sized>(
        &mut self,
        cluster: &Cluster,
        req: &Request,
        node: u32,
        rng: &mut R,
    ) -> Decision {
        let Some(n) = cluster.node(node) else {
            return self.decide(cluster, req, rng);
        };
        let s = self.scorer.score(&n.state(), req);
        let gpus = pick_gpus(cluster, node, req, s.share_from, s.share_ties, rng);
        Decision::Placed(Placement { node, gpus })
    }
}

/// kube-scheduler's default min-max normalisation to integers in 0..=100
/// (all equal scores become 0).
fn normalize(scored: &mut [(u32, Scored)]) {
    let hi = scored.iter().map(|s| s.1.score as i64).max().unwrap_or(0);
    let lo = scored.iter().map(|s| s.1.score as i64).min().unwrap_or(0);
    let range = hi - lo;
    for (_, s) in scored.iter_mut() {
        s.score = if range == 0 {
            0.0
        } else {
            ((s.score as i64 - lo) * 100 / range) as f64
        };
    }
}

/// Names device indices on the chosen node: whole GPUs are the first fully
/// free ones (as the simulator does); a share takes the lowest-index GPU
/// among the scorer's tied ones, else a GPU with the free share the scorer
/// chose, or a random fitting one if it chose none.
fn pick_gpus<R: Rng + ?Sized>(
    cluster: &Cluster,
    node: u32,
    req: &Request,
    share_from: Option<u16>,
    share_ties: u64,
    rng: &mut R,
) -> Vec<u16> {
    let Some(n) = cluster.node(node) else {
        return Vec::new();
    };
    let indexed = n.gpu_free.iter().enumerate().map(|(i, &f)| (i as u16, f));
    match req.gpu {
        GpuDemand::None => Vec::new(),
        GpuDemand::Whole { count } => indexed
            .filter(|&(_, f)| f == MILLI)
            .take(usize::from(count))
            .map(|(i, _)| i)
            .collect(),
        GpuDemand::Share { milli } => {
            if share_ties != 0 {
                if let Some(state) = cluster.state_of(node) {
                    let tied = |f: u16| {
                        state
                            .gpu_free
                            .iter()
                            .take(64)
                            .enumerate()
                            .any(|(p, &v)| v == f && share_ties & (1u64 << p) != 0)
                    };
                    if let Some((i, _)) = indexed.clone().find(|&(_, f)| f >= milli && tied(f)) {
                        return vec![i];
                    }
                }
            }
            if let Some(v) = share_from {
                if let Some((i, _)) = indexed.clone().find(|&(_, f)| f == v && f >= milli) {
                    return vec![i];
                }
            }
            let fits: Vec<u16> = indexed
                .filter(|&(_, f)| f >= milli)
                .map(|(i, _)| i)
                .collect();
            if fits.is_empty() {
                Vec::new()
            } else {
                vec![fits[rng.gen_range(0..fits.len())]]
            }
        }
    }
}
