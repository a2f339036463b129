//! Placement benchmark: the ATC'23 *Beware of Fragmentation* method on the
//! Alibaba openb trace, plus decision throughput on synthetic clusters.
//!
//! For each pod list and seed: shuffle the pods, resample uniformly with
//! replacement until the summed GPU request reaches 130% of the cluster's GPU
//! capacity, place them one by one (pods never leave; a pod that fits nowhere
//! fails), and record the GPU allocation at 100% and 130% arrived demand and
//! the fragmentation at 90%.
//!
//! Each sequence also gets an offline packing bound (no placement of those
//! pods can allocate more GPU) and a hindsight packing (a feasible one found
//! knowing every pod), see [`bound`]; the policies are reported as a share of
//! the bound too.
//!
//! This binary is the I/O edge (files, threads, wall clock); the placement
//! code it drives is the pure `flotilla_sched` library. Run it through
//! `scripts/bench placement`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use flotilla_sched::{
    Cluster, Decision, Engine, GpuDemand, ModelSet, ModelTable, NodeSpec, Policy, Request, Runtime,
    TargetWorkload,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod bound;

const DEFAULT_TRACE_DIR: &str = "../shared/data/alibaba-gpu-2023";
const PUBLISHED_DEFAULT_130: [(&str, f64); 6] = [
    ("Random", 87.5),
    ("DotProd", 90.9),
    ("GpuClustering", 91.9),
    ("GpuPacking", 92.0),
    ("BestFit", 93.1),
    ("FGD", 95.4),
];

struct Args {
    seeds: u64,
    /// Compute the packing bound and the hindsight packing per sequence.
    bound: bool,
    jobs: usize,
    traces: Option<Vec<String>>,
    policies: Vec<Policy>,
    json: Option<PathBuf>,
    table: Option<PathBuf>,
    throughput: bool,
    pass_only: bool,
    trace_dir: PathBuf,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        seeds: 10,
        bound: true,
        jobs: std::thread::available_parallelism().map_or(1, |n| n.get()),
        traces: None,
        policies: Policy::ALL.to_vec(),
        json: None,
        table: None,
        throughput: true,
        pass_only: false,
        trace_dir: std::env::var_os("FLOTILLA_TRACE_DIR")
            .map_or_else(|| PathBuf::from(DEFAULT_TRACE_DIR), PathBuf::from),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--seeds" => a.seeds = val()?.parse().map_err(|e| format!("--seeds: {e}"))?,
            "--jobs" => a.jobs = val()?.parse().map_err(|e| format!("--jobs: {e}"))?,
            "--traces" => a.traces = Some(val()?.split(',').map(str::to_owned).collect()),
            "--policies" => {
                a.policies = val()?
                    .split(',')
                    .map(|p| Policy::from_name(p).ok_or_else(|| format!("unknown policy {p}")))
                    .collect::<Result<_, _>>()?
            }
            "--json" => a.json = Some(PathBuf::from(val()?)),
            "--table" => a.table = Some(PathBuf::from(val()?)),
            "--no-throughput" => a.throughput = false,
            "--no-bound" => a.bound = false,
            "--pass-only" => a.pass_only = true,
            "--trace-dir" => a.trace_dir = PathBuf::from(val()?),
            "-h" | "--help" => {
                return Err("usage: placement-bench [--seeds N] [--jobs N] [--traces default,gpushare40] \
                            [--policies FGD,Flotilla] [--json PATH] [--table PATH] [--no-throughput] [--no-bound] [--pass-only] [--trace-dir DIR]"
                    .into())
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    a.jobs = a.jobs.max(1);
    Ok(a)
}

struct Trace {
    name: String,
    pods: Vec<Request>,
}

fn parse_nodes(path: &Path) -> Result<Cluster, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut rows = Vec::new();
    let mut models = ModelTable::default();
    for (n, line) in text.lines().enumerate().skip(1) {
        let f: Vec<&str> = line.trim().split(',').collect();
        if f.len() < 5 {
            continue;
        }
        let bad = |what| format!("{} line {}: bad {what}", path.display(), n + 1);
        let cpu: u32 = f[1].parse().map_err(|_| bad("cpu_milli"))?;
        let mem: u64 = f[2].parse().map_err(|_| bad("memory_mib"))?;
        let gpus: u16 = f[3].parse().map_err(|_| bad("gpu"))?;
        let model = if gpus > 0 && !f[4].is_empty() && f[4] != "nan" {
            Some(models.intern(f[4]).map_err(|e| e.to_string())?)
        } else {
            None
        };
        rows.push(NodeSpec {
            model,
            gpus,
            cpu_milli: cpu,
            mem_mib: mem,
        });
    }
    let mut c = Cluster::new(models);
    for r in rows {
        c.add_node(r).map_err(|e| e.to_string())?;
    }
    Ok(c)
}

fn parse_pods(path: &Path, models: &ModelTable) -> Result<Vec<Request>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut pods = Vec::new();
    for (n, line) in text.lines().enumerate().skip(1) {
        let f: Vec<&str> = line.trim().split(',').collect();
        // The multigpu lists stop after gpu_milli (no gpu_spec column).
        if f.len() < 5 {
            continue;
        }
        let bad = |what| format!("{} line {}: bad {what}", path.display(), n + 1);
        let cpu: u32 = f[1].parse().map_err(|_| bad("cpu_milli"))?;
        let mem: u64 = f[2].parse().map_err(|_| bad("memory_mib"))?;
        let num: u16 = f[3].parse().map_err(|_| bad("num_gpu"))?;
        let milli: u16 = f[4].parse().map_err(|_| bad("gpu_milli"))?;
        let gpu = GpuDemand::from_trace(num, milli)
            .map_err(|e| format!("{}: {e}", bad("gpu request")))?;
        let spec = f.get(5).map_or("", |s| s.trim());
        let allowed = if spec.is_empty() || spec == "nan" {
            ModelSet::Any
        } else {
            // Models the cluster lacks are dropped; if none is left the set
            // is empty and the pod fits nowhere, which is the truth.
            ModelSet::of(spec.split('|').filter_map(|m| models.get(m)))
        };
        pods.push(Request::new(gpu, cpu, mem).with_models(allowed));
    }
    Ok(pods)
}

#[derive(Clone, Debug)]
struct RunResult {
    seed: u64,
    alloc_100: f64,
    alloc_130: f64,
    frag_90: f64,
    decisions: usize,
    secs: f64,
}

/// The pod sequence for one seed: the shuffled list, then uniform resamples
/// with replacement, cut where the arrived GPU request reaches 130%.
fn arrivals(pods: &[Request], capacity_milli: u64, seed: u64) -> Vec<Request> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut order: Vec<usize> = (0..pods.len()).collect();
    order.shuffle(&mut rng);
    let target = capacity_milli * 13 / 10;
    let mut out = Vec::new();
    let mut arrived = 0u64;
    let mut k = 0;
    while arrived < target && !pods.is_empty() {
        let p = if k < order.len() {
            pods[order[k]]
        } else {
            pods[rng.gen_range(0..pods.len())]
        };
        k += 1;
        arrived += u64::from(p.gpu.total_milli());
        out.push(p);
    }
    out
}

/// One unit of work for the thread pool.
#[derive(Clone, Copy)]
enum Job {
    /// A policy on the arrival order.
    Online { t: usize, p: Policy, s: u64 },
    /// A policy on the same pods largest first (hindsight).
    Decreasing { t: usize, p: Policy, s: u64 },
    /// The packing bound of a sequence.
    Bound { t: usize, s: u64 },
}

/// Scorers the hindsight packing tries on the largest-first order.
const HINDSIGHT_POLICIES: [Policy; 3] = [Policy::BestFit, Policy::Fgd, Policy::Flotilla];
const BOUND_ROW: &str = "packing bound";
const HINDSIGHT_ROW: &str = "hindsight";

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The same pods, knowing them all: largest GPU demand first (then most
/// CPU), the first-fit-decreasing order of bin packing. Stable, so equal
/// pods keep their arrival order.
fn largest_first(seq: &[Request]) -> Vec<Request> {
    let mut v = seq.to_vec();
    v.sort_by_key(|r| {
        (
            std::cmp::Reverse(r.gpu.total_milli()),
            std::cmp::Reverse(r.cpu_milli),
        )
    });
    v
}

fn replay(
    base: &Cluster,
    wl: &TargetWorkload,
    seq: &[Request],
    policy: Policy,
    seed: u64,
) -> RunResult {
    let mut cluster = base.clone();
    let cap = cluster.gpu_capacity_milli() as f64;
    let mut engine = Engine::new(policy.scorer(wl));
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_f107_111a);
    let (mut arrived, mut alloc_100, mut frag_90) = (0u64, None, None);
    // Fragmentation is reported against the GPU shapes of the mix only:
    // CPU-only shapes would count every idle GPU as fragment.
    let report_wl = wl.gpu_only();
    let start = Instant::now();
    for req in seq {
        if let Decision::Placed(p) = engine.decide(&cluster, req, &mut rng) {
            if let Err(e) = cluster.commit(req, &p) {
                panic!("engine produced an invalid placement: {e}");
            }
        }
        arrived += u64::from(req.gpu.total_milli());
        if frag_90.is_none() && arrived as f64 >= 0.9 * cap {
            let frag: f64 = cluster
                .active_classes()
                .map(|(_, c)| report_wl.node_frag(&c.state) * c.members.len() as f64)
                .sum();
            frag_90 = Some(100.0 * frag / cap);
        }
        if alloc_100.is_none() && arrived as f64 >= cap {
            alloc_100 = Some(100.0 * cluster.gpu_allocated_milli() as f64 / cap);
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let alloc_130 = 100.0 * cluster.gpu_allocated_milli() as f64 / cap;
    RunResult {
        seed,
        alloc_100: alloc_100.unwrap_or(alloc_130),
        alloc_130,
        frag_90: frag_90.unwrap_or(f64::NAN),
        decisions: seq.len(),
        secs,
    }
}

struct Row {
    trace: String,
    policy: String,
    seeds: u64,
    alloc_100: Option<f64>,
    alloc_130: Option<f64>,
    frag_90: Option<f64>,
    /// Mean over seeds of alloc @130% as % of that seed's packing bound.
    of_bound: Option<f64>,
    decisions_per_s: f64,
    /// Milliseconds of one planner pass (the pass row only).
    pass_ms: Option<f64>,
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len().max(1) as f64
}

fn trace_benchmark(args: &Args) -> Result<Option<Vec<Row>>, String> {
    let dir = &args.trace_dir;
    let nodes_path = dir.join("openb_node_list_gpu_node.csv");
    if !nodes_path.exists() {
        eprintln!(
            "placement-bench: no trace at {} (set FLOTILLA_TRACE_DIR); nothing measured, no results written",
            dir.display()
        );
        return Ok(None);
    }
    let base = parse_nodes(&nodes_path)?;
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.strip_prefix("openb_pod_list_")
                .and_then(|r| r.strip_suffix(".csv"))
                .map(str::to_owned)
        })
        .collect();
    names.sort_by_key(|n| (n != "default", n.clone()));
    if let Some(only) = &args.traces {
        names.retain(|n| only.contains(n));
    }
    let traces: Vec<Trace> = names
        .into_iter()
        .map(|name| {
            let pods = parse_pods(
                &dir.join(format!("openb_pod_list_{name}.csv")),
                base.models(),
            )?;
            Ok(Trace { name, pods })
        })
        .collect::<Result<_, String>>()?;
    let workloads: Vec<TargetWorkload> = traces
        .iter()
        .map(|t| TargetWorkload::from_requests(&t.pods, TargetWorkload::DEFAULT_COVERAGE))
        .collect();
    let seqs: Vec<Vec<Vec<Request>>> = traces
        .iter()
        .map(|t| {
            (0..args.seeds)
                .map(|s| arrivals(&t.pods, base.gpu_capacity_milli(), s))
                .collect()
        })
        .collect();

    // Bounds first (the longest jobs), then the slowest policies, so the
    // pool drains evenly.
    let mut jobs = Vec::new();
    if args.bound {
        for t in 0..traces.len() {
            for s in 0..args.seeds {
                jobs.push(Job::Bound { t, s });
            }
        }
    }
    for p in args.policies.iter().rev() {
        for t in 0..traces.len() {
            for s in 0..args.seeds {
                jobs.push(Job::Online { t, p: *p, s });
                if args.bound && HINDSIGHT_POLICIES.contains(p) {
                    jobs.push(Job::Decreasing { t, p: *p, s });
                }
            }
        }
    }
    let next = AtomicUsize::new(0);
    let results: Mutex<BTreeMap<(usize, String), Vec<RunResult>>> = Mutex::new(BTreeMap::new());
    // Per (trace, seed): the packing bound, and the best hindsight packing.
    let bounds: Mutex<BTreeMap<(usize, u64), f64>> = Mutex::new(BTreeMap::new());
    let hindsight: Mutex<BTreeMap<(usize, u64), f64>> = Mutex::new(BTreeMap::new());
    let done = AtomicUsize::new(0);
    let cap = base.gpu_capacity_milli() as f64;
    std::thread::scope(|scope| {
        for _ in 0..args.jobs {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&job) = jobs.get(i) else { break };
                match job {
                    Job::Bound { t, s } => {
                        let b =
                            bound::Instance::new(&base, &seqs[t][s as usize]).packing_bound_milli();
                        lock(&bounds).insert((t, s), 100.0 * b / cap);
                    }
                    Job::Online { t, p, s } => {
                        let r = replay(&base, &workloads[t], &seqs[t][s as usize], p, s);
                        let mut h = lock(&hindsight);
                        let e = h.entry((t, s)).or_insert(0.0);
                        *e = e.max(r.alloc_130);
                        drop(h);
                        lock(&results)
                            .entry((t, p.name().to_owned()))
                            .or_default()
                            .push(r);
                    }
                    Job::Decreasing { t, p, s } => {
                        let seq = largest_first(&seqs[t][s as usize]);
                        let r = replay(&base, &workloads[t], &seq, p, s);
                        let mut h = lock(&hindsight);
                        let e = h.entry((t, s)).or_insert(0.0);
                        *e = e.max(r.alloc_130);
                    }
                }
                let d = done.fetch_add(1, Ordering::Relaxed) + 1;
                if d.is_multiple_of(50) || d == jobs.len() {
                    eprintln!("placement-bench: {d}/{} jobs", jobs.len());
                }
            });
        }
    });
    let results = results.into_inner().unwrap_or_else(|e| e.into_inner());
    let bounds = bounds.into_inner().unwrap_or_else(|e| e.into_inner());
    let hindsight = hindsight.into_inner().unwrap_or_else(|e| e.into_inner());
    let mut rows = Vec::new();
    for (t, trace) in traces.iter().enumerate() {
        let bound_of = |s: u64| bounds.get(&(t, s)).copied();
        for p in &args.policies {
            let Some(rs) = results.get(&(t, p.name().to_owned())) else {
                continue;
            };
            let a100: Vec<f64> = rs.iter().map(|r| r.alloc_100).collect();
            let a130: Vec<f64> = rs.iter().map(|r| r.alloc_130).collect();
            let f90: Vec<f64> = rs.iter().map(|r| r.frag_90).collect();
            let share: Option<Vec<f64>> = rs
                .iter()
                .map(|r| bound_of(r.seed).map(|b| 100.0 * r.alloc_130 / b))
                .collect();
            let decisions: usize = rs.iter().map(|r| r.decisions).sum();
            let secs: f64 = rs.iter().map(|r| r.secs).sum();
            rows.push(Row {
                trace: trace.name.clone(),
                policy: p.name().to_owned(),
                seeds: rs.len() as u64,
                alloc_100: Some(mean(&a100)),
                alloc_130: Some(mean(&a130)),
                frag_90: Some(mean(&f90)),
                of_bound: share.map(|v| mean(&v)),
                decisions_per_s: decisions as f64 / secs.max(1e-9),
                pass_ms: None,
            });
        }
        if args.bound {
            for (name, map) in [(BOUND_ROW, &bounds), (HINDSIGHT_ROW, &hindsight)] {
                let per_seed: Vec<(u64, f64)> = (0..args.seeds)
                    .filter_map(|s| map.get(&(t, s)).map(|&v| (s, v)))
                    .collect();
                let vals: Vec<f64> = per_seed.iter().map(|x| x.1).collect();
                let share: Option<Vec<f64>> = per_seed
                    .iter()
                    .map(|&(s, v)| bound_of(s).map(|b| 100.0 * v / b))
                    .collect();
                rows.push(Row {
                    trace: trace.name.clone(),
                    policy: name.to_owned(),
                    seeds: vals.len() as u64,
                    alloc_100: None,
                    alloc_130: Some(mean(&vals)),
                    frag_90: None,
                    of_bound: share.map(|v| mean(&v)),
                    decisions_per_s: f64::NAN,
                    pass_ms: None,
                });
            }
        }
    }
    Ok(Some(rows))
}

/// Whole-GPU requests (1/2/4/8 GPUs, 20% pinned to one model, three CPU and
/// memory sizes per GPU) on a synthetic cluster of `nodes` x 8 GPUs of four models,
/// placed one by one until 90% of the GPUs have been asked for; decisions
/// per second with the Flotilla policy, single thread.
fn throughput(nodes: usize) -> Row {
    let mut models = ModelTable::default();
    let ids: Vec<u8> = ["H100", "A100", "L40S", "A10"]
        .iter()
        .filter_map(|m| models.intern(m).ok())
        .collect();
    let mut cluster = Cluster::new(models);
    for i in 0..nodes {
        let spec = NodeSpec {
            model: Some(ids[i % ids.len()]),
            gpus: 8,
            cpu_milli: 128_000,
            mem_mib: 1_048_576,
        };
        if cluster.add_node(spec).is_err() {
            break;
        }
    }
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut reqs = Vec::new();
    let mut asked = 0u64;
    while asked < cluster.gpu_capacity_milli() * 9 / 10 {
        let count = match rng.gen_range(0..100) {
            0..=59 => 1,
            60..=74 => 2,
            75..=89 => 4,
            _ => 8,
        };
        // Instance-type sizing: CPU and memory per GPU from a small menu, as
        // a GPU cloud sells them. (Every request unique in CPU/memory would
        // defeat the per-shape score cache; see the crate docs.)
        let size = rng.gen_range(1..=3u32);
        let cpu = u32::from(count) * size * 4000;
        let mem = u64::from(count) * u64::from(size) * 32 * 1024;
        let mut r = Request::new(GpuDemand::Whole { count }, cpu, mem);
        if rng.gen_bool(0.2) {
            r = r.with_models(ModelSet::of([ids[rng.gen_range(0..ids.len())]]));
        }
        asked += u64::from(r.gpu.total_milli());
        reqs.push(r);
    }
    let wl = TargetWorkload::from_requests(&reqs, TargetWorkload::DEFAULT_COVERAGE);
    let mut engine = Engine::new(Policy::Flotilla.scorer(&wl));
    let start = Instant::now();
    for r in &reqs {
        if let Decision::Placed(p) = engine.decide(&cluster, r, &mut rng) {
            if let Err(e) = cluster.commit(r, &p) {
                panic!("engine produced an invalid placement: {e}");
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    Row {
        trace: format!("synthetic-{}k-x8-whole", nodes / 1000),
        policy: "Flotilla".into(),
        seeds: 1,
        alloc_100: None,
        alloc_130: None,
        frag_90: None,
        of_bound: None,
        decisions_per_s: reqs.len() as f64 / secs.max(1e-9),
        pass_ms: None,
    }
}

/// One pass of the planner (`flotilla_sched::pass::plan`) over `queued`
/// waiting works on `nodes` machines of 8 GPUs, three quarters of the GPUs
/// held by running work (a third of it preemptible spot work), from 40
/// tenants with guarantees; the median of 5 passes on one core.
fn pass_row(nodes: usize, queued: usize) -> Row {
    use flotilla_sched::gang::Locality;
    use flotilla_sched::pass::{
        plan, GpuAsk, GpuSnap, Hold, NodeSnap, QueuedWork, RunningWork, Snapshot, TenantPolicy,
    };
    use flotilla_sched::preempt::PreemptConfig;
    use flotilla_sched::queue::FairShareConfig;
    use flotilla_sched::quota::Quota;
    use flotilla_sched::Tier;

    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let models = ["H100", "A100", "L40S", "A10"];
    let mut snap_nodes = Vec::with_capacity(nodes);
    let mut running = Vec::new();
    for i in 0..nodes {
        let model = models[i % models.len()];
        // Every tenth A100/H100 machine runs its GPUs in MIG mode.
        let mig = i % 10 == 0 && (model == "H100" || model == "A100");
        let mut n = NodeSnap {
            ready: true,
            cordoned: false,
            region: format!("r{}", i % 3),
            pool: format!("p{}", i % 12),
            runtime: Runtime::Process,
            cpu_total_milli: 128_000,
            mem_total_mib: 1_048_576,
            cpu_free_milli: 128_000,
            mem_free_mib: 1_048_576,
            gpus: (0..8)
                .map(|_| GpuSnap {
                    model: model.into(),
                    mig,
                    free_milli: 1000,
                })
                .collect(),
        };
        for g in 0..8u16 {
            if rng.gen_bool(0.75) {
                let milli = if mig {
                    142
                } else if rng.gen_bool(0.3) {
                    500
                } else {
                    1000
                };
                n.gpus[usize::from(g)].free_milli -= milli;
                n.cpu_free_milli -= 8000;
                n.mem_free_mib -= 65_536;
                let spot = rng.gen_bool(0.33);
                running.push(RunningWork {
                    key: running.len() as u64,
                    tenant: rng.gen_range(0..40),
                    tier: if spot { Tier::Shared } else { Tier::Dedicated },
                    priority: 0,
                    preemptible: spot,
                    started_ms: rng.gen_range(0..3_600_000),
                    ends_by_ms: rng
                        .gen_bool(0.3)
                        .then(|| rng.gen_range(3_600_000..7_200_000)),
                    stopping: false,
                    preempted_by: None,
                    members: vec![Hold {
                        node: i,
                        gpus: vec![(g, milli)],
                        cpu_milli: 8000,
                        mem_mib: 65_536,
                    }],
                });
            }
        }
        snap_nodes.push(n);
    }
    let queue: Vec<QueuedWork> = (0..queued)
        .map(|k| {
            let gpu = match rng.gen_range(0..100) {
                0..=39 => GpuAsk::Whole(1),
                40..=54 => GpuAsk::Whole(2),
                55..=64 => GpuAsk::Whole(8),
                65..=84 => GpuAsk::Fraction([250, 500][rng.gen_range(0..2)]),
                _ => GpuAsk::Mig(142),
            };
            let members = if rng.gen_bool(0.05) { 4 } else { 1 };
            QueuedWork {
                key: 1_000_000 + k as u64,
                tenant: rng.gen_range(0..40),
                tier: [Tier::Dedicated, Tier::Shared, Tier::Queued][rng.gen_range(0..3)],
                priority: rng.gen_range(-1..=1),
                submitted_ms: 3_600_000 + k as u64,
                members,
                spread: members > 1,
                locality: Locality::Any,
                gpu,
                models: if rng.gen_bool(0.3) {
                    vec![models[rng.gen_range(0..models.len())].to_string()]
                } else {
                    Vec::new()
                },
                cpu_milli: 8000,
                mem_mib: 65_536,
                runtime: Runtime::Process,
                max_runtime_ms: rng.gen_bool(0.3).then_some(1_800_000),
                ready_ms: Vec::new(),
            }
        })
        .collect();
    let tenants = (0..40u32)
        .map(|t| {
            (
                t,
                TenantPolicy {
                    quota: Quota {
                        guaranteed_milli: 40_000,
                        burst_milli: 400_000,
                    },
                    per_model_milli: BTreeMap::new(),
                    weight: 1.0 + f64::from(t % 3),
                },
            )
        })
        .collect();
    let snap = Snapshot {
        now_ms: 3_700_000,
        seed: 7,
        policy: Policy::Flotilla,
        nodes: snap_nodes,
        running,
        promises: Vec::new(),
        queue,
        tenants,
        usage: Vec::new(),
        fair_share: FairShareConfig::default(),
        preempt: PreemptConfig::default(),
    };
    let mut times = Vec::new();
    let mut summary = (0, 0);
    for _ in 0..5 {
        let start = Instant::now();
        let p = match plan(&snap) {
            Ok(p) => p,
            Err(e) => panic!("planner refused the benchmark snapshot: {e}"),
        };
        times.push(start.elapsed().as_secs_f64() * 1000.0);
        summary = (p.placements.len(), p.preemptions.len());
    }
    times.sort_by(f64::total_cmp);
    let ms = times[times.len() / 2];
    eprintln!(
        "placement-bench: pass over {queued} queued on {nodes} nodes: {ms:.1} ms (placed {}, preempted {})",
        summary.0, summary.1
    );
    Row {
        trace: format!("pass-{}k-nodes-{}k-queued", nodes / 1000, queued / 1000),
        policy: "Flotilla".into(),
        seeds: 1,
        alloc_100: None,
        alloc_130: None,
        frag_90: None,
        of_bound: None,
        decisions_per_s: queued as f64 / (ms / 1000.0).max(1e-9),
        pass_ms: Some(ms),
    }
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.filter(|x| x.is_finite())
        .map_or("null".into(), |x| format!("{x:.digits$}"))
}

fn to_json(rows: &[Row]) -> String {
    let mut s = String::from("[\n");
    for (i, r) in rows.iter().enumerate() {
        let _ = writeln!(
            s,
            "  {{\"trace\": \"{}\", \"policy\": \"{}\", \"seeds\": {}, \"gpu_alloc_pct_at_100\": {}, \
             \"gpu_alloc_pct_at_130\": {}, \"frag_pct_at_90\": {}, \"pct_of_packing_bound\": {}, \"decisions_per_s\": {}, \"pass_ms\": {}}}{}",
            r.trace,
            r.policy,
            r.seeds,
            opt(r.alloc_100, 2),
            opt(r.alloc_130, 2),
            opt(r.frag_90, 2),
            opt(r.of_bound, 2),
            opt(Some(r.decisions_per_s), 0),
            opt(r.pass_ms, 1),
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    s.push_str("]\n");
    s
}

fn to_table(rows: &[Row]) -> String {
    let dash = |v: Option<f64>| {
        v.filter(|x| x.is_finite())
            .map_or("–".into(), |x| format!("{x:.1}"))
    };
    let mut s = String::new();
    let is_bound = |r: &Row| r.policy == BOUND_ROW || r.policy == HINDSIGHT_ROW;
    let trace_rows: Vec<&Row> = rows
        .iter()
        .filter(|r| r.alloc_130.is_some() && !is_bound(r))
        .collect();
    if !trace_rows.is_empty() {
        s.push_str("| trace | policy | seeds | GPU alloc % @100% | GPU alloc % @130% | published @130% | % of bound @130% | frag % @90% | decisions/s |\n");
        s.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
        for r in &trace_rows {
            let published = if r.trace == "default" {
                PUBLISHED_DEFAULT_130
                    .iter()
                    .find(|(p, _)| *p == r.policy)
                    .map_or("–".into(), |(_, v)| format!("{v:.1}"))
            } else {
                "–".into()
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {:.0} |",
                r.trace,
                r.policy,
                r.seeds,
                dash(r.alloc_100),
                dash(r.alloc_130),
                published,
                dash(r.of_bound),
                dash(r.frag_90),
                r.decisions_per_s
            );
        }
        // Per trace: the bound, hindsight, FGD and Flotilla, absolute and
        // as a share of the bound.
        let bounded = rows.iter().any(|r| r.policy == BOUND_ROW);
        if bounded {
            s.push_str(
                "\n| trace | packing bound @130% | hindsight @130% | FGD @130% | Flotilla @130% | Flotilla − FGD | hindsight % of bound | FGD % of bound | Flotilla % of bound |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
            );
        } else {
            s.push_str(
                "\n| trace | FGD @130% | Flotilla @130% | Flotilla − FGD |\n|---|---:|---:|---:|\n",
            );
        }
        let mut traces: Vec<&str> = trace_rows.iter().map(|r| r.trace.as_str()).collect();
        traces.dedup();
        for t in traces {
            let get = |p: &str| rows.iter().find(|r| r.trace == t && r.policy == p);
            let at = |p: &str| get(p).and_then(|r| r.alloc_130);
            let share = |p: &str| get(p).and_then(|r| r.of_bound);
            let (Some(f), Some(o)) = (at("FGD"), at("Flotilla")) else {
                continue;
            };
            if bounded {
                let two = |v: Option<f64>| v.map_or("–".into(), |x| format!("{x:.2}"));
                let _ = writeln!(
                    s,
                    "| {t} | {} | {} | {f:.2} | {o:.2} | {:+.2} | {} | {} | {} |",
                    two(at(BOUND_ROW)),
                    two(at(HINDSIGHT_ROW)),
                    o - f,
                    two(share(HINDSIGHT_ROW)),
                    two(share("FGD")),
                    two(share("Flotilla")),
                );
            } else {
                let _ = writeln!(s, "| {t} | {f:.2} | {o:.2} | {:+.2} |", o - f);
            }
        }
    }
    let tp: Vec<&Row> = rows
        .iter()
        .filter(|r| r.alloc_130.is_none() && r.pass_ms.is_none())
        .collect();
    if !tp.is_empty() {
        s.push_str("\n| throughput scenario | policy | decisions/s (one core) | µs/decision |\n|---|---|---:|---:|\n");
        for r in tp {
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {:.1} |",
                r.trace,
                r.policy,
                r.decisions_per_s,
                1e6 / r.decisions_per_s
            );
        }
    }
    for r in rows.iter().filter(|r| r.pass_ms.is_some()) {
        let _ = write!(
            s,
            "\n| planner pass | policy | ms per pass (one core, median of 5) | target |\n|---|---|---:|---:|\n| {} | {} | {} | ≤ 250 |\n",
            r.trace,
            r.policy,
            opt(r.pass_ms, 1)
        );
    }
    s
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    if args.pass_only {
        let rows = vec![pass_row(1_000, 10_000)];
        print!("{}", to_table(&rows));
        return;
    }
    let mut rows = match trace_benchmark(&args) {
        Ok(Some(rows)) => rows,
        Ok(None) => return,
        Err(e) => {
            eprintln!("placement-bench: {e}");
            std::process::exit(1);
        }
    };
    if args.throughput {
        for n in [1_000, 10_000, 50_000] {
            rows.push(throughput(n));
        }
        rows.push(pass_row(1_000, 10_000));
    }
    let table = to_table(&rows);
    print!("{table}");
    for (path, body) in [(&args.json, to_json(&rows)), (&args.table, table)] {
        if let Some(p) = path {
            if let Err(e) = std::fs::write(p, body) {
                eprintln!("placement-bench: {}: {e}", p.display());
                std::process::exit(1);
            }
        }
    }
}
