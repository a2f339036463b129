//! Replays a cluster's own recorded demand (`GET /v1/history/demand`)
//! through the scheduling pass the server runs, [`flotilla_sched::pass::plan`],
//! on a virtual clock, so an operator can ask "what if" of their own
//! cluster rather than of a public trace: another placement policy, more
//! or fewer machines.
//!
//! The replay is a discrete-event loop: at every submission and every end
//! of a run it builds one [`Snapshot`] of its model (the pool's machines,
//! the work holding GPUs, the queue) and applies the plan the pass makes of
//! it: placements start work, which holds its GPUs for as long as it held
//! them in the record; preemptions stop their victims at once and queue
//! them again with the rest of their run; work that fits nowhere waits, as
//! on the server. Each work keeps the asks it was recorded with (GPUs and
//! share, models, CPU, memory, tier, priority, preemptible, runtime, gang
//! size), so with the recorded settings the replay holds the same GPU time
//! as the record, and its waits are the pass's own.
//!
//! GPU time is costed at the list on-demand price of the model each work
//! ran on, from the billing crate's list book ([`crate::cost`]).
//!
//! Not replayed (yet): tenants' quotas and fair-share history (the replay
//! runs every tenant unlimited, weight 1), endpoints' request rates through
//! the autoscaler (their replicas are replayed as the instances they were),
//! the server's own price versions, spot prices and owners' payouts.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use flotilla_core::history::{DemandHistory, RecordedNode, RecordedWork};
use flotilla_sched::gang::Locality;
use flotilla_sched::pass::{
    self, GpuAsk, GpuSnap, Hold, NodeSnap, QueuedWork, RunningWork, Snapshot, WorkKey,
};
use flotilla_sched::{Policy, Runtime, Tier};
use rust_decimal::Decimal;
use serde::Serialize;

use crate::cost::Pricing;

/// What the replay varies.
#[derive(Debug, Clone)]
pub struct ReplaySettings {
    /// The scoring policy of the pass.
    pub policy: Policy,
    /// The machines of the pool.
    pub nodes: Vec<RecordedNode>,
}

/// What happened, in the record or in a replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    /// Works that ran in the record: the demand replayed.
    pub works: usize,
    /// Of them, works that ran here.
    pub ran: usize,
    /// Works never placed (in a replay: fit nowhere in its pool).
    pub never_ran: usize,
    /// GPU-hours held (fractions and slices counted by their share).
    pub gpu_hours: f64,
    /// Time from submission to (first) placement, seconds.
    pub mean_wait_s: f64,
    pub p95_wait_s: f64,
    pub max_wait_s: f64,
    /// Works stopped to make room for others.
    pub preemptions: usize,
    /// What tenants pay for that GPU time at the list on-demand price of
    /// the model each work ran on (the billing crate's list book, as the
    /// server rates usage by default); GPU time of an unpriced model
    /// counts nothing.
    pub cost: Decimal,
    /// The currency of `cost`.
    pub currency: String,
}

/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The pass could not model the snapshot (too many GPU models).
    #[error("the scheduling pass refused the replay's snapshot: {0}")]
    Pass(#[from] flotilla_sched::Error),
}

fn ms_since(from: DateTime<Utc>, t: DateTime<Utc>) -> u64 {
    u64::try_from((t - from).num_milliseconds()).unwrap_or(0)
}

/// One work of the demand, as the replay needs it.
#[derive(Debug, Clone)]
struct Demand {
    tenant: u32,
    submitted_ms: u64,
    run_ms: u64,
    members: u16,
    gpu: GpuAsk,
    models: Vec<String>,
    tier: u8,
    priority: i32,
    preemptible: bool,
    cpu_milli: u32,
    mem_mib: u64,
    runtime: Runtime,
    milli: u64,
    recorded_wait_ms: u64,
    /// The model it ran on in the record (or asked for first).
    model: String,
}

fn ask_of(w: &RecordedWork) -> GpuAsk {
    let milli = u16::try_from(w.gpu_milli.min(1000)).unwrap_or(1000);
    if w.gpus == 0 {
        GpuAsk::None
    } else if w.mig {
        GpuAsk::Mig(milli)
    } else if milli < 1000 {
        GpuAsk::Fraction(milli)
    } else {
        GpuAsk::Whole(u16::try_from(w.gpus).unwrap_or(u16::MAX))
    }
}

/// The works of `h` that ran in the record (were placed before its end),
/// oldest first.
fn demand(h: &DemandHistory) -> Vec<Demand> {
    let any_model = h
        .nodes
        .iter()
        .find_map(|n| n.gpus.first().cloned())
        .unwrap_or_default();
    let mut tenants: BTreeMap<&str, u32> = BTreeMap::new();
    let mut out = Vec::new();
    for w in &h.works {
        let Some(run_ms) = w.ran_ms(h.to) else {
            continue;
        };
        let next = u32::try_from(tenants.len()).unwrap_or(u32::MAX);
        let tenant = *tenants.entry(w.tenant_id.as_str()).or_insert(next);
        let submitted_ms = ms_since(h.from, w.submitted_at);
        let placed_ms = w.started_at.map_or(submitted_ms, |s| ms_since(h.from, s));
        out.push(Demand {
            tenant,
            submitted_ms,
            run_ms,
            members: u16::try_from(w.members.max(1)).unwrap_or(u16::MAX),
            gpu: ask_of(w),
            models: w.gpu_types.clone(),
            tier: w.tier,
            priority: w.priority,
            preemptible: w.preemptible,
            cpu_milli: w.cpu_milli,
            mem_mib: w.memory_mb,
            runtime: Runtime::from(w.runtime),
            milli: w.milli(),
            recorded_wait_ms: placed_ms.saturating_sub(submitted_ms),
            model: w
                .gpu_model
                .clone()
                .or_else(|| w.gpu_types.first().cloned())
                .unwrap_or_else(|| any_model.clone()),
        });
    }
    out
}

/// Milli-GPU-milliseconds held, by GPU model.
type Held = BTreeMap<String, u128>;

/// GPU-hours and their list cost.
fn totals(held: &Held) -> (f64, Decimal, String) {
    let mut currency = String::from("USD");
    let mut cost = Decimal::ZERO;
    let mut milli_ms = 0u128;
    for (model, &m) in held {
        milli_ms += m;
        if let Ok(p) = Pricing::list(model) {
            currency = p.currency.clone();
            // milli-GPU-ms / 1000 = GPU-ms; / 1000 = GPU-seconds.
            let gpu_s = Decimal::from_i128_with_scale(i128::try_from(m).unwrap_or(i128::MAX), 6);
            cost += gpu_s * p.on_demand_per_gpu_second;
        }
    }
    (
        milli_ms as f64 / 1000.0 / 3_600_000.0,
        cost.round_dp(2),
        currency,
    )
}

fn outcome(works: usize, waits_ms: &mut [u64], held: &Held, preemptions: usize) -> Outcome {
    waits_ms.sort_unstable();
    let ran = waits_ms.len();
    let s = |ms: u64| ms as f64 / 1000.0;
    let mean = if ran == 0 {
        0.0
    } else {
        waits_ms.iter().map(|&w| w as f64).sum::<f64>() / ran as f64 / 1000.0
    };
    let p95 = if ran == 0 {
        0
    } else {
        waits_ms[((ran as f64 * 0.95).ceil() as usize).clamp(1, ran) - 1]
    };
    let (gpu_hours, cost, currency) = totals(held);
    Outcome {
        works,
        ran,
        never_ran: works - ran,
        gpu_hours,
        mean_wait_s: mean,
        p95_wait_s: s(p95),
        max_wait_s: s(waits_ms.last().copied().unwrap_or(0)),
        preemptions,
        cost,
        currency,
    }
}

/// What the record says happened to the same demand.
pub fn recorded(h: &DemandHistory) -> Outcome {
    let d = demand(h);
    let mut waits: Vec<u64> = d.iter().map(|w| w.recorded_wait_ms).collect();
    let mut held = Held::new();
    for w in &d {
        *held.entry(w.model.clone()).or_default() += u128::from(w.milli) * u128::from(w.run_ms);
    }
    outcome(d.len(), &mut waits, &held, 0)
}

/// A work holding GPUs in the replay.
#[derive(Debug, Clone)]
struct Run {
    key: usize,
    started_ms: u64,
    ends_ms: u64,
    holds: Vec<Hold>,
    /// The GPU model it runs on.
    model: String,
}

/// The replay's model of the pool.
struct Model<'a> {
    demand: &'a [Demand],
    nodes: &'a [RecordedNode],
    settings: &'a ReplaySettings,
    running: Vec<Run>,
    queue: BTreeSet<usize>,
    /// Remaining run of each work (less after a preemption).
    remaining_ms: Vec<u64>,
    first_placed_ms: Vec<Option<u64>>,
    held: Held,
    preemptions: usize,
    passes: u64,
}

impl Model<'_> {
    fn snapshot(&self, now_ms: u64) -> Snapshot {
        let mut nodes: Vec<NodeSnap> = self
            .nodes
            .iter()
            .map(|n| NodeSnap {
                ready: true,
                cordoned: false,
                region: n.region.clone(),
                pool: n.pool.clone(),
                runtime: Runtime::from(n.runtime),
                cpu_total_milli: u32::try_from(n.cpu_milli).unwrap_or(u32::MAX),
                mem_total_mib: n.memory_mb,
                cpu_free_milli: u32::try_from(n.cpu_milli).unwrap_or(u32::MAX),
                mem_free_mib: n.memory_mb,
                gpus: n
                    .gpus
                    .iter()
                    .enumerate()
                    .map(|(i, m)| GpuSnap {
                        model: m.clone(),
                        mig: n.mig.get(i).copied().unwrap_or(false),
                        free_milli: 1000,
                    })
                    .collect(),
            })
            .collect();
        let mut running = Vec::with_capacity(self.running.len());
        for r in &self.running {
            for h in &r.holds {
                if let Some(n) = nodes.get_mut(h.node) {
                    n.cpu_free_milli = n.cpu_free_milli.saturating_sub(h.cpu_milli);
                    n.mem_free_mib = n.mem_free_mib.saturating_sub(h.mem_mib);
                    for &(g, m) in &h.gpus {
                        if let Some(gpu) = n.gpus.get_mut(usize::from(g)) {
                            gpu.free_milli = gpu.free_milli.saturating_sub(m);
                        }
                    }
                }
            }
            let d = &self.demand[r.key];
            running.push(RunningWork {
                key: r.key as WorkKey,
                tenant: d.tenant,
                tier: Tier::from_number_or_dedicated(d.tier),
                priority: d.priority,
                preemptible: d.preemptible,
                started_ms: r.started_ms,
                ends_by_ms: Some(r.ends_ms),
                stopping: false,
                preempted_by: None,
                members: r.holds.clone(),
            });
        }
        let queue = self
            .queue
            .iter()
            .map(|&k| {
                let d = &self.demand[k];
                QueuedWork {
                    key: k as WorkKey,
                    tenant: d.tenant,
                    tier: Tier::from_number_or_dedicated(d.tier),
                    priority: d.priority,
                    submitted_ms: d.submitted_ms,
                    members: d.members,
                    spread: d.members > 1,
                    locality: Locality::Any,
                    gpu: d.gpu,
                    models: d.models.clone(),
                    cpu_milli: d.cpu_milli,
                    mem_mib: d.mem_mib,
                    runtime: d.runtime,
                    max_runtime_ms: Some(self.remaining_ms[k]),
                    ready_ms: Vec::new(),
                }
            })
            .collect();
        Snapshot::unlimited(
            now_ms,
            0x4157_0a1e ^ self.passes,
            self.settings.policy,
            nodes,
            running,
            queue,
        )
    }

    /// Ends runs due by `now_ms`.
    fn finish(&mut self, now_ms: u64) {
        let demand = self.demand;
        let held = &mut self.held;
        self.running.retain(|r| {
            if r.ends_ms <= now_ms {
                *held.entry(r.model.clone()).or_default() +=
                    u128::from(demand[r.key].milli) * u128::from(r.ends_ms - r.started_ms);
                false
            } else {
                true
            }
        });
    }

    /// One pass at `now_ms`, applied; whether it changed anything.
    fn pass(&mut self, now_ms: u64) -> Result<bool, ReplayError> {
        if self.queue.is_empty() {
            return Ok(false);
        }
        let snap = self.snapshot(now_ms);
        self.passes += 1;
        let plan = pass::plan(&snap)?;
        let mut changed = false;
        for v in &plan.preemptions {
            let key = v.victim as usize;
            if let Some(at) = self.running.iter().position(|r| r.key == key) {
                let r = self.running.swap_remove(at);
                let ran = now_ms - r.started_ms;
                *self.held.entry(r.model.clone()).or_default() +=
                    u128::from(self.demand[key].milli) * u128::from(ran);
                self.remaining_ms[key] = self.remaining_ms[key].saturating_sub(ran);
                self.queue.insert(key);
                self.preemptions += 1;
                changed = true;
            }
        }
        for p in &plan.placements {
            let key = p.key as usize;
            if !self.queue.remove(&key) {
                continue;
            }
            let d = &self.demand[key];
            let holds = p
                .members
                .iter()
                .map(|m| Hold {
                    node: m.node,
                    gpus: m.gpus.clone(),
                    cpu_milli: d.cpu_milli,
                    mem_mib: d.mem_mib,
                })
                .collect();
            self.first_placed_ms[key].get_or_insert(now_ms);
            let model = p
                .members
                .first()
                .map_or_else(|| d.model.clone(), |m| m.model.clone());
            self.running.push(Run {
                key,
                started_ms: now_ms,
                ends_ms: now_ms + self.remaining_ms[key],
                holds,
                model,
            });
            changed = true;
        }
        Ok(changed)
    }
}

/// Replays the demand of `h` under `settings`.
pub fn replay(h: &DemandHistory, settings: &ReplaySettings) -> Result<Outcome, ReplayError> {
    let demand = demand(h);
    let mut m = Model {
        demand: &demand,
        nodes: &settings.nodes,
        settings,
        running: Vec::new(),
        queue: BTreeSet::new(),
        remaining_ms: demand.iter().map(|d| d.run_ms).collect(),
        first_placed_ms: vec![None; demand.len()],
        held: Held::new(),
        preemptions: 0,
        passes: 0,
    };
    let mut next_arrival = 0;
    loop {
        let arrival = demand.get(next_arrival).map(|d| d.submitted_ms);
        let end = m.running.iter().map(|r| r.ends_ms).min();
        let now = match (arrival, end) {
            (Some(a), Some(e)) => a.min(e),
            (Some(a), None) => a,
            (None, Some(e)) => e,
            (None, None) => break,
        };
        m.finish(now);
        while demand
            .get(next_arrival)
            .is_some_and(|d| d.submitted_ms <= now)
        {
            m.queue.insert(next_arrival);
            next_arrival += 1;
        }
        // Victims free their GPUs at once here, so the pass that chose
        // them places their preemptor on the next round at the same time.
        for _ in 0..4 {
            if !m.pass(now)? {
                break;
            }
        }
    }
    let mut waits: Vec<u64> = m
        .first_placed_ms
        .iter()
        .zip(&demand)
        .filter_map(|(p, d)| p.map(|p| p.saturating_sub(d.submitted_ms)))
        .collect();
    Ok(outcome(demand.len(), &mut waits, &m.held, m.preemptions))
}

/// A kind of machine: its GPUs' models and MIG modes, its pool and region.
type Kind = (Vec<String>, Vec<bool>, String, String);

/// `nodes` with each kind of machine (same GPUs, pool and region) scaled
/// by `factor`, rounded, at least one of a kind when `factor > 0`: `0.5`
/// keeps every other machine of each kind, `2` doubles them (the copies
/// named `<name>+1`, …).
pub fn scale_nodes(nodes: &[RecordedNode], factor: f64) -> Vec<RecordedNode> {
    let mut kinds: BTreeMap<Kind, Vec<&RecordedNode>> = BTreeMap::new();
    for n in nodes {
        kinds
            .entry((
                n.gpus.clone(),
                n.mig.clone(),
                n.pool.clone(),
                n.region.clone(),
            ))
            .or_default()
            .push(n);
    }
    let mut out = Vec::new();
    for list in kinds.values() {
        let want = ((list.len() as f64) * factor)
            .round()
            .max(if factor > 0.0 { 1.0 } else { 0.0 }) as usize;
        for i in 0..want {
            let mut n = list[i % list.len()].clone();
            let copy = i / list.len();
            if copy > 0 {
                n.name = format!("{}+{copy}", n.name);
            }
            out.push(n);
        }
    }
    out
}

/// Parses a placement policy by name (as `flotilla server
/// --placement-policy` takes it), case-insensitively.
pub fn parse_policy(name: &str) -> Option<Policy> {
    Policy::ALL
        .into_iter()
        .find(|p| p.name().eq_ignore_ascii_case(name))
}

/// How `b` differs from `a`, in one sentence per measure that moved.
pub fn differences(a: &Outcome, b: &Outcome) -> Vec<String> {
    let mut out = Vec::new();
    let pct = |x: f64, y: f64| {
        if x == 0.0 {
            String::new()
        } else {
            format!(" ({:+.0} %)", (y - x) / x * 100.0)
        }
    };
    if b.mean_wait_s > a.mean_wait_s + 0.5 {
        out.push(format!(
            "waits grow: mean {:.1} s → {:.1} s{}, p95 {:.1} s → {:.1} s",
            a.mean_wait_s,
            b.mean_wait_s,
            pct(a.mean_wait_s, b.mean_wait_s),
            a.p95_wait_s,
            b.p95_wait_s
        ));
    } else if b.mean_wait_s + 0.5 < a.mean_wait_s {
        out.push(format!(
            "waits shrink: mean {:.1} s → {:.1} s{}",
            a.mean_wait_s,
            b.mean_wait_s,
            pct(a.mean_wait_s, b.mean_wait_s)
        ));
    } else {
        out.push(format!(
            "waits hold: mean {:.1} s → {:.1} s",
            a.mean_wait_s, b.mean_wait_s
        ));
    }
    if b.never_ran > a.never_ran {
        out.push(format!(
            "{} works never run (fit nowhere in the pool)",
            b.never_ran - a.never_ran
        ));
    }
    if b.cost != a.cost {
        out.push(format!(
            "cost to tenants {} → {} {}",
            a.cost, b.cost, b.currency
        ));
    }
    if (b.gpu_hours - a.gpu_hours).abs() > a.gpu_hours * 0.02 {
        out.push(format!(
            "GPU-hours {:.2} → {:.2}{}",
            a.gpu_hours,
            b.gpu_hours,
            pct(a.gpu_hours, b.gpu_hours)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{Duration, TimeZone};
    use flotilla_core::id::{InstanceId, TenantId};

    fn node(name: &str, gpus: usize) -> RecordedNode {
        RecordedNode {
            name: name.into(),
            region: "local".into(),
            pool: "default".into(),
            runtime: flotilla_core::node::RuntimeKind::Process,
            cpu_milli: 64_000,
            memory_mb: 256_000,
            gpus: vec!["H100".into(); gpus],
            mig: vec![false; gpus],
        }
    }

    fn replay_on(h: &DemandHistory, policy: Policy, nodes: Vec<RecordedNode>) -> Outcome {
        replay(h, &ReplaySettings { policy, nodes }).unwrap()
    }

    fn t0() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 12, 1, 0, 0, 0).unwrap()
    }

    /// `n` works of `gpus` GPUs, one a minute, each placed at once and
    /// running `run_min` minutes.
    fn history(n: usize, gpus: u32, run_min: i64, nodes: Vec<RecordedNode>) -> DemandHistory {
        let works = (0..n)
            .map(|i| {
                let at = t0() + Duration::minutes(i as i64);
                RecordedWork {
                    id: InstanceId::from_trusted(format!("ins_{i:04}")).into(),
                    tenant_id: TenantId::from_trusted(format!("ten_{}", i % 2)),
                    members: 1,
                    gpus,
                    gpu_milli: 1000,
                    mig: false,
                    gpu_types: Vec::new(),
                    cpu_milli: 1000,
                    memory_mb: 1024,
                    tier: 2,
                    priority: 0,
                    preemptible: false,
                    runtime: flotilla_core::node::RuntimeKind::Process,
                    submitted_at: at,
                    started_at: Some(at),
                    finished_at: Some(at + Duration::minutes(run_min)),
                    gpu_model: Some("H100".into()),
                }
            })
            .collect();
        DemandHistory {
            from: t0(),
            to: t0() + Duration::days(1),
            works,
            nodes,
            placement_policy: "BestFit".into(),
        }
    }

    #[test]
    fn the_unchanged_replay_holds_the_recorded_gpu_time_without_waits() {
        // At most five run at once: 10 of the 16 GPUs.
        let h = history(20, 2, 5, vec![node("a", 8), node("b", 8)]);
        let rec = recorded(&h);
        assert_eq!(rec.works, 20);
        assert!(
            (rec.gpu_hours - 20.0 * 2.0 * 5.0 / 60.0).abs() < 1e-9,
            "{rec:?}"
        );
        let r = replay_on(&h, Policy::BestFit, h.nodes.clone());
        assert_eq!(r.ran, 20);
        assert!((r.gpu_hours - rec.gpu_hours).abs() < 1e-9, "{r:?}");
        assert_eq!(r.max_wait_s, 0.0, "{r:?}");
        assert_eq!(r.preemptions, 0);
        // 3.33 GPU-hours of H100 at its list price, both ways.
        let h100 = Pricing::list("H100").unwrap().on_demand(3_600_000);
        assert_eq!(
            rec.cost,
            (h100 * Decimal::from(10) / Decimal::from(3)).round_dp(2)
        );
        assert_eq!(r.cost, rec.cost);
    }

    #[test]
    fn half_the_nodes_make_waits_and_the_differences_say_so() {
        let h = history(20, 2, 30, vec![node("a", 8), node("b", 8)]);
        let half = scale_nodes(&h.nodes, 0.5);
        assert_eq!(half.len(), 1);
        let r = replay_on(&h, Policy::Fgd, half);
        assert_eq!(r.ran, 20, "everything runs, later");
        assert!((r.gpu_hours - 20.0).abs() < 1e-9);
        let rec = recorded(&h);
        assert!(r.mean_wait_s > rec.mean_wait_s + 60.0, "{r:?}");
        let said = differences(&rec, &r).join("; ");
        assert!(said.contains("waits grow"), "{said}");
    }

    #[test]
    fn work_wider_than_every_node_never_runs() {
        let h = history(3, 16, 10, vec![node("a", 8)]);
        let r = replay_on(&h, Policy::BestFit, h.nodes.clone());
        assert_eq!((r.ran, r.never_ran), (0, 3));
        assert!(differences(&recorded(&h), &r)
            .join(" ")
            .contains("3 works never run"));
    }

    #[test]
    fn scaling_nodes_keeps_each_kind() {
        let nodes = vec![node("a", 8), node("b", 8), node("c", 4)];
        let names = |v: Vec<RecordedNode>| v.into_iter().map(|n| n.name).collect::<Vec<_>>();
        assert_eq!(names(scale_nodes(&nodes, 0.5)), ["c", "a"]);
        assert_eq!(
            names(scale_nodes(&nodes, 2.0)),
            ["c", "c+1", "a", "b", "a+1", "b+1"]
        );
        assert!(scale_nodes(&nodes, 0.0).is_empty());
    }
}
