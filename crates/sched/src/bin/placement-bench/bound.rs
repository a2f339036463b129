//! How much GPU *any* placement could allocate from one arrival sequence:
//! an upper bound (offline, knowing every pod) and a feasible packing found
//! with hindsight, so the online policies can be read as a share of what
//! was possible rather than of raw capacity.
//!
//! # The packing bound and why it is an upper bound
//!
//! Group the nodes into classes of identical empty nodes `j` (model, GPU
//! count, CPU, memory), and the arrived GPU pods into types `t` (identical
//! requests, `k_t` of them, each worth `v_t` GPUs). A pod of type `t` is
//! *compatible* with class `j` when it fits an empty node of `j` (model
//! allowed, enough GPUs, CPU and memory); no placement can put it anywhere
//! else. Each class offers six resources `r`, with capacity `cap_jr` and a
//! use `a_tr` per pod:
//!
//! * GPU share: the class's milli-GPU; a pod uses its milli-GPU.
//! * CPU and memory: the class's total; a pod uses its request.
//! * Twelve *GPU slot* resources, one per dual-feasible function `f` of
//!   Fekete and Schepers ([`SLOTS`]): the class's GPU count; a pod asking
//!   `q` of one GPU uses `f(q)`, a pod asking `n` whole GPUs uses `n`.
//!   Shares that fit on one GPU (sum at most 1) have `f` summing to at most
//!   1 (`dual_feasible_functions_of_fekete_and_schepers` checks every
//!   multiset of up to six shares on a 10-milli grid), so per class the
//!   slots used never exceed the GPU count. `u_1` says two shares above a
//!   half never share a GPU; `U^(0.2)` says a 0.81-GPU pod's GPU can take
//!   only shares below 0.2, the trace's rare smallest ones: this is what
//!   its 0.81- and 0.65-GPU pods strand.
//!
//! For any prices `y_jr >= 0`, let `z_t = max(0, max over compatible j of
//! (v_t - sum_r y_jr a_tr))`. Every placed pod `p` on class `j` then has
//! `v_p <= sum_r y_jr a_pr + z_t`, and summing over the placed pods of a
//! feasible placement:
//!
//! ```text
//! allocated = sum_p v_p <= sum_jr y_jr used_jr + sum_t placed_t z_t
//!                       <= sum_jr y_jr cap_jr  + sum_t k_t z_t  =: B(y)
//! ```
//!
//! because `used_jr <= cap_jr` and at most `k_t` pods of type `t` arrived.
//! So `B(y)` bounds the allocation of *every* placement, online or not, for
//! *any* prices: the search below only makes it tighter, never invalid.
//! `y = (1 on GPU share, 0 elsewhere)` gives total capacity and `y = 0` the
//! total arrived demand, so the bound is never looser than
//! `min(arrived, capacity)`. Minimising `B` over `y` is the dual of the
//! linear relaxation that packs fractional pods into each class's pooled
//! resources; it ignores only how a class's pool is split between its
//! nodes and GPUs (beyond the slot inequalities).
//!
//! # Hindsight
//!
//! A feasible placement, so a lower bound on the optimum: the same pods,
//! known in advance, placed largest first (first-fit decreasing) by the
//! real engine under several scorers, pods that fit nowhere rejected; the
//! best of those and of the online runs.

use std::collections::HashMap;

use flotilla_sched::filter::check;
use flotilla_sched::{Cluster, GpuDemand, Request, MILLI};

/// The dual-feasible functions the slot resources use.
#[derive(Debug, Clone, Copy)]
enum Dff {
    /// `u_k` of Fekete and Schepers.
    U(u32),
    /// Their `U^(e)`, `e` in milli-GPU (at most 500): 1 above `1 - e`,
    /// 0 below `e`, the share itself in between. Valid because a share
    /// above `1 - e` leaves room only for shares below `e`.
    Eps(u16),
}

const SLOTS: [Dff; 12] = [
    Dff::U(1),
    Dff::U(2),
    Dff::U(3),
    Dff::U(4),
    Dff::Eps(100),
    Dff::Eps(150),
    Dff::Eps(200),
    Dff::Eps(250),
    Dff::Eps(300),
    Dff::Eps(350),
    Dff::Eps(400),
    Dff::Eps(450),
];

/// GPU share, CPU, memory, then one slot resource per [`SLOTS`] entry.
const R: usize = 3 + SLOTS.len();

/// The function's value for a share of `q` milli-GPU (1000: a whole GPU).
fn dual_feasible(f: Dff, q: u16) -> f64 {
    let x = f64::from(q) / f64::from(MILLI);
    match f {
        Dff::U(k) => {
            let q = u32::from(q);
            let m = (k + 1) * q;
            if m % u32::from(MILLI) == 0 {
                x
            } else {
                f64::from(m / u32::from(MILLI)) / f64::from(k)
            }
        }
        Dff::Eps(e) if q > MILLI - e => 1.0,
        Dff::Eps(e) if q < e => 0.0,
        Dff::Eps(_) => x,
    }
}

struct Type {
    count: f64,
    /// In GPUs.
    value: f64,
    /// Compatible classes and the pod's use of each of their resources, in
    /// units of the class's capacity per GPU (so every capacity reads as the
    /// class's GPU count and prices are of the order of one).
    options: Vec<(usize, [f64; R])>,
}

/// The pricing problem of one arrival sequence.
pub struct Instance {
    /// GPUs per node class.
    gpus: Vec<f64>,
    types: Vec<Type>,
}

impl Instance {
    pub fn new(cluster: &Cluster, seq: &[Request]) -> Instance {
        let classes: Vec<_> = cluster
            .active_classes()
            .filter(|(_, c)| c.state.gpu_count() > 0)
            .map(|(_, c)| {
                let n = c.members.len() as f64;
                let g = c.state.gpu_count() as f64;
                let per_gpu: [f64; R] = std::array::from_fn(|i| match i {
                    0 => f64::from(MILLI),
                    1 => f64::from(c.state.cpu_free) / g,
                    2 => c.state.mem_free as f64 / g,
                    _ => 1.0,
                });
                (c.state.clone(), n * g, per_gpu)
            })
            .collect();
        let mut counts: HashMap<Request, u32> = HashMap::new();
        for r in seq.iter().filter(|r| r.gpu.gpu_count() > 0) {
            *counts.entry(*r).or_default() += 1;
        }
        let mut reqs: Vec<(Request, u32)> = counts.into_iter().collect();
        // Hash order is random per process; the search is deterministic
        // only over a fixed order.
        reqs.sort_by_key(|(r, _)| {
            (
                r.gpu.gpu_count(),
                r.gpu.per_gpu_milli(),
                r.cpu_milli,
                r.mem_mib,
                format!("{:?}", r.models),
            )
        });
        let types = reqs
            .into_iter()
            .map(|(r, n)| {
                let raw: [f64; R] = std::array::from_fn(|i| match i {
                    0 => f64::from(r.gpu.total_milli()),
                    1 => f64::from(r.cpu_milli),
                    2 => r.mem_mib as f64,
                    _ => match r.gpu {
                        GpuDemand::Share { milli } => dual_feasible(SLOTS[i - 3], milli),
                        _ => f64::from(r.gpu.gpu_count()),
                    },
                });
                let options = classes
                    .iter()
                    .enumerate()
                    .filter(|(_, (state, _, _))| check(state, &r).is_ok())
                    .map(|(j, (_, _, per_gpu))| (j, std::array::from_fn(|i| raw[i] / per_gpu[i])))
                    .collect();
                Type {
                    count: f64::from(n),
                    value: f64::from(r.gpu.total_milli()) / f64::from(MILLI),
                    options,
                }
            })
            .collect();
        Instance {
            gpus: classes.iter().map(|c| c.1).collect(),
            types,
        }
    }

    /// `B(y)` in GPUs and a subgradient.
    fn eval(&self, y: &[[f64; R]], grad: &mut [[f64; R]]) -> f64 {
        let mut b = 0.0;
        for (j, g) in self.gpus.iter().enumerate() {
            b += g * y[j].iter().sum::<f64>();
            grad[j] = [*g; R];
        }
        for t in &self.types {
            let mut best = 0.0;
            let mut arg = None;
            for (j, a) in &t.options {
                let s = t.value - (0..R).map(|r| y[*j][r] * a[r]).sum::<f64>();
                if s > best {
                    best = s;
                    arg = Some((*j, a));
                }
            }
            b += t.count * best;
            if let Some((j, a)) = arg {
                for r in 0..R {
                    grad[j][r] -= t.count * a[r];
                }
            }
        }
        b
    }

    fn value(&self, y: &[[f64; R]]) -> f64 {
        let mut scratch = vec![[0.0; R]; self.gpus.len()];
        self.eval(y, &mut scratch)
    }

    /// The packing bound in milli-GPU: the least `B(y)` a projected
    /// subgradient descent (Adam steps) and then coordinate-wise golden
    /// section searches find. Any `y` gives a valid bound (see the module
    /// doc); the search decides only how tight it is.
    pub fn packing_bound_milli(&self) -> f64 {
        let n = self.gpus.len();
        let mut y = vec![[0.0; R]; n];
        for c in &mut y {
            c[0] = 1.0;
        }
        let mut best_y = y.clone();
        let mut best = self.value(&y);
        // Demand alone is a bound too (y = 0).
        best = best.min(self.value(&vec![[0.0; R]; n]));
        let mut grad = vec![[0.0; R]; n];
        let (mut m1, mut m2) = (vec![[0.0; R]; n], vec![[0.0; R]; n]);
        let steps = 4000;
        for it in 0..steps {
            let b = self.eval(&y, &mut grad);
            if b < best {
                best = b;
                best_y.clone_from(&y);
            }
            let lr = 0.02 * (1.0 - it as f64 / steps as f64) + 1e-4;
            let t = (it + 1) as f64;
            for j in 0..n {
                for r in 0..R {
                    let g = grad[j][r] / self.gpus[j].max(1.0);
                    m1[j][r] = 0.9 * m1[j][r] + 0.1 * g;
                    m2[j][r] = 0.999 * m2[j][r] + 0.001 * g * g;
                    let mh = m1[j][r] / (1.0 - 0.9f64.powf(t));
                    let vh = m2[j][r] / (1.0 - 0.999f64.powf(t));
                    y[j][r] = (y[j][r] - lr * mh / (vh.sqrt() + 1e-9)).max(0.0);
                }
            }
        }
        // Polish: B is convex and piecewise linear in each price, so a
        // golden-section search per coordinate only ever lowers it.
        let mut y = best_y;
        for _ in 0..3 {
            for j in 0..n {
                for r in 0..R {
                    let (mut lo, mut hi) = (0.0f64, (2.0 * y[j][r]).max(2.0));
                    let phi = 0.618_033_988_75;
                    let at = |v: f64, y: &mut Vec<[f64; R]>| {
                        y[j][r] = v;
                        self.value(y)
                    };
                    for _ in 0..40 {
                        let a = hi - phi * (hi - lo);
                        let b = lo + phi * (hi - lo);
                        if at(a, &mut y) <= at(b, &mut y) {
                            hi = b;
                        } else {
                            lo = a;
                        }
                    }
                    let old = y[j][r];
                    let cand = 0.5 * (lo + hi);
                    let keep = at(old, &mut y);
                    if at(cand, &mut y) < keep {
                        y[j][r] = cand;
                        best = best.min(self.value(&y));
                    } else {
                        y[j][r] = old;
                    }
                }
            }
        }
        best * f64::from(MILLI)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_sched::{ModelTable, NodeSpec};

    fn cluster(nodes: &[(u16, u32)]) -> Cluster {
        let mut models = ModelTable::default();
        let m = models.intern("G").ok();
        let mut c = Cluster::new(models);
        for &(gpus, cpu_milli) in nodes {
            c.add_node(NodeSpec {
                model: m,
                gpus,
                cpu_milli,
                mem_mib: 1 << 20,
            })
            .expect("node");
        }
        c
    }

    #[test]
    fn dual_feasible_functions_of_fekete_and_schepers() {
        assert_eq!(dual_feasible(Dff::U(1), 810), 1.0);
        assert_eq!(dual_feasible(Dff::U(1), 500), 0.5);
        assert_eq!(dual_feasible(Dff::U(1), 470), 0.0);
        assert_eq!(dual_feasible(Dff::U(2), 470), 0.5);
        assert_eq!(dual_feasible(Dff::U(2), 1000), 1.0);
        assert_eq!(dual_feasible(Dff::Eps(200), 810), 1.0);
        assert_eq!(dual_feasible(Dff::Eps(200), 160), 0.0);
        assert_eq!(dual_feasible(Dff::Eps(200), 470), 0.47);
        assert_eq!(dual_feasible(Dff::Eps(200), 1000), 1.0);
        // Any shares that fit one GPU sum to at most 1 under every
        // function: every multiset of up to six shares in steps of 10 milli.
        fn walk(f: Dff, min: u16, left: u16, depth: u32, sum: f64) {
            assert!(sum <= 1.0 + 1e-12, "{f:?}: {sum}");
            if depth == 6 {
                return;
            }
            for q in (min..=left).step_by(10) {
                walk(f, q, left - q, depth + 1, sum + dual_feasible(f, q));
            }
        }
        for f in SLOTS {
            walk(f, 10, 1000, 0, 0.0);
        }
    }

    #[test]
    fn bound_sees_shares_above_a_half_strand_the_rest() {
        // Two GPUs, five 0.6-GPU pods: at most one per GPU, 1.2 GPUs, though
        // 3 GPUs were asked for and 2 exist.
        let c = cluster(&[(2, 64_000)]);
        let seq = vec![Request::new(GpuDemand::Share { milli: 600 }, 1000, 1); 5];
        let b = Instance::new(&c, &seq).packing_bound_milli();
        assert!((b - 1200.0).abs() < 5.0, "{b}");
    }

    #[test]
    fn bound_sees_cpu_per_node_class() {
        // One 8-GPU node with 16 CPUs; one-GPU pods ask 4 CPUs: four fit.
        let c = cluster(&[(8, 16_000)]);
        let seq = vec![Request::new(GpuDemand::Whole { count: 1 }, 4000, 1); 10];
        let b = Instance::new(&c, &seq).packing_bound_milli();
        assert!((b - 4000.0).abs() < 5.0, "{b}");
        // A pod that fits no node is worth nothing to the bound.
        let big = vec![Request::new(GpuDemand::Whole { count: 1 }, 32_000, 1); 3];
        assert!(Instance::new(&c, &big).packing_bound_milli() < 1e-6);
    }
}
