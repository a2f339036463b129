//! The pass planner: worked cases for each kind of decision, and property
//! tests over generated snapshots (capacity is never double-booked, tier-1
//! and non-preemptible work is never a victim, a plan applied and planned
//! again changes nothing).

use std::collections::BTreeMap;

use flotilla_core::placement::GpuShare;
use flotilla_sched::gang::Locality;
use flotilla_sched::pass::{
    plan, GpuAsk, GpuSnap, Hold, NodeSnap, Plan, Promise, QueuedWork, RunningWork, Snapshot,
    TenantPolicy, Wait, WorkKey,
};
use flotilla_sched::quota::Quota;
use flotilla_sched::{Policy, Runtime, Tier};
use proptest::prelude::*;

fn gpu(model: &str, mig: bool, free: u16) -> GpuSnap {
    GpuSnap {
        model: model.into(),
        mig,
        free_milli: free,
    }
}

fn node(gpus: Vec<GpuSnap>) -> NodeSnap {
    NodeSnap {
        ready: true,
        cordoned: false,
        region: "r1".into(),
        pool: "p1".into(),
        runtime: Runtime::Process,
        cpu_total_milli: 64_000,
        mem_total_mib: 512_000,
        cpu_free_milli: 64_000,
        mem_free_mib: 512_000,
        gpus,
    }
}

fn work(key: WorkKey, gpu: GpuAsk) -> QueuedWork {
    QueuedWork {
        key,
        tenant: 0,
        tier: Tier::Dedicated,
        priority: 0,
        submitted_ms: key,
        members: 1,
        spread: false,
        locality: Locality::Any,
        gpu,
        models: Vec::new(),
        cpu_milli: 1000,
        mem_mib: 1024,
        runtime: Runtime::Process,
        max_runtime_ms: None,
        ready_ms: Vec::new(),
    }
}

fn snapshot(nodes: Vec<NodeSnap>, queue: Vec<QueuedWork>) -> Snapshot {
    Snapshot::unlimited(1_000_000, 7, Policy::Flotilla, nodes, Vec::new(), queue)
}

fn placed(p: &Plan, key: WorkKey) -> bool {
    p.placements.iter().any(|x| x.key == key)
}

#[test]
fn a_replica_goes_where_it_is_ready_soonest_and_else_where_the_policy_packs() {
    // Two equal machines, nothing running: without times to ready the
    // policy picks machine 0.
    let nodes = || vec![node(vec![gpu("H100", false, 1000); 4]); 2];
    let p = plan(&snapshot(nodes(), vec![work(1, GpuAsk::Whole(1))])).unwrap();
    assert_eq!(p.placements[0].members[0].node, 0);
    // Machine 1 holds the weights (cached: 12.5 s), machine 0 would
    // download them (62 s): machine 1.
    let mut w = work(1, GpuAsk::Whole(1));
    w.ready_ms = vec![62_000, 12_500];
    let p = plan(&snapshot(nodes(), vec![w.clone()])).unwrap();
    assert_eq!(p.placements[0].members[0].node, 1);
    // Machine 1 full: the replica still starts, on machine 0.
    let mut full = nodes();
    for g in &mut full[1].gpus {
        g.free_milli = 0;
    }
    let p = plan(&snapshot(full, vec![w])).unwrap();
    assert_eq!(p.placements[0].members[0].node, 0);
}

fn mig(s: &str) -> GpuAsk {
    // Counted by its compute slices alone, as these tests' GPUs count them.
    GpuAsk::Mig(GpuShare::mig_named(s).unwrap().milli())
}

/// What applying `plan` to `snap` leaves: placed work runs, victims stop
/// (still holding their GPUs), the queue loses what was placed.
fn apply(snap: &Snapshot, plan: &Plan) -> Snapshot {
    let mut next = snap.clone();
    for p in &plan.placements {
        let w = next
            .queue
            .iter()
            .position(|w| w.key == p.key)
            .map(|i| next.queue.remove(i))
            .unwrap();
        let mut members = Vec::new();
        for m in &p.members {
            let n = &mut next.nodes[m.node];
            n.cpu_free_milli -= w.cpu_milli;
            n.mem_free_mib -= w.mem_mib;
            for &(g, milli) in &m.gpus {
                n.gpus[usize::from(g)].free_milli -= milli;
            }
            members.push(Hold {
                node: m.node,
                gpus: m.gpus.clone(),
                cpu_milli: w.cpu_milli,
                mem_mib: w.mem_mib,
            });
        }
        // A preemptor takes its promised capacity.
        next.promises.retain(|x| x.to != p.key);
        next.running.push(RunningWork {
            key: p.key,
            tenant: w.tenant,
            tier: w.tier,
            priority: w.priority,
            preemptible: w.tier != Tier::Dedicated,
            started_ms: snap.now_ms,
            ends_by_ms: w.max_runtime_ms.map(|t| snap.now_ms + t),
            stopping: false,
            preempted_by: None,
            members,
        });
    }
    for pre in &plan.preemptions {
        let r = next
            .running
            .iter_mut()
            .find(|r| r.key == pre.victim)
            .unwrap();
        r.stopping = true;
        r.preempted_by = Some(pre.by);
    }
    next
}

#[test]
fn two_half_shares_share_a_gpu_and_a_third_waits() {
    let s = snapshot(
        vec![node(vec![gpu("H100", false, 1000)])],
        vec![
            work(1, GpuAsk::Fraction(500)),
            work(2, GpuAsk::Fraction(500)),
            work(3, GpuAsk::Fraction(500)),
        ],
    );
    let p = plan(&s).unwrap();
    assert!(placed(&p, 1) && placed(&p, 2), "{p:?}");
    for x in &p.placements {
        assert_eq!(x.members[0].gpus, vec![(0, 500)]);
    }
    let why = p.wait_of(3).unwrap();
    assert!(
        matches!(why, Wait::NoFit(t) if t.contains("too little free GPU share")),
        "{why:?}"
    );
}

#[test]
fn mig_slices_land_only_on_mig_gpus() {
    let s = snapshot(
        vec![
            node(vec![gpu("H100", true, 1000)]),
            node(vec![gpu("L40S", false, 1000)]),
        ],
        vec![
            work(1, mig("1g.10gb")),
            work(2, mig("1g.10gb")),
            work(3, mig("1g.10gb")),
            work(4, GpuAsk::Whole(1)),
            work(5, GpuAsk::Fraction(250)),
        ],
    );
    let p = plan(&s).unwrap();
    for k in 1..=3 {
        let x = p.placements.iter().find(|x| x.key == k).unwrap();
        assert_eq!(x.members[0].node, 0);
        assert_eq!(x.members[0].model, "H100");
        assert_eq!(x.members[0].gpus, vec![(0, 142)]);
    }
    // Whole and fractional work never lands on the MIG-mode GPU.
    let whole = p.placements.iter().find(|x| x.key == 4).unwrap();
    assert_eq!(whole.members[0].node, 1);
    assert!(p.wait_of(5).is_some(), "the L40S is taken whole: {p:?}");
    // A MIG profile where no GPU is in MIG mode fits nowhere.
    let s = snapshot(
        vec![node(vec![gpu("L40S", false, 1000)])],
        vec![work(1, mig("1g.10gb"))],
    );
    let p = plan(&s).unwrap();
    assert_eq!(
        p.wait_of(1),
        Some(&Wait::NoFit(
            "0/1 nodes fit: 1 GPU model not allowed".into()
        ))
    );
}

#[test]
fn a_spread_job_puts_each_member_on_its_own_machine() {
    let mut w = work(1, GpuAsk::Whole(1));
    w.members = 2;
    w.spread = true;
    let s = snapshot(
        vec![
            node(vec![gpu("H100", false, 1000), gpu("H100", false, 1000)]),
            node(vec![gpu("H100", false, 1000)]),
        ],
        vec![w.clone()],
    );
    let p = plan(&s).unwrap();
    let nodes: Vec<usize> = p.placements[0].members.iter().map(|m| m.node).collect();
    assert_eq!(
        {
            let mut n = nodes.clone();
            n.sort();
            n
        },
        vec![0, 1]
    );
    // One machine of two GPUs cannot hold a spread pair.
    let s = snapshot(
        vec![node(vec![
            gpu("H100", false, 1000),
            gpu("H100", false, 1000),
        ])],
        vec![w],
    );
    let p = plan(&s).unwrap();
    assert!(p.placements.is_empty());
    // Never on this pool: said so, naming the field and the pool's size
    // (not the engine's count of machines closed to the gang).
    assert!(
        matches!(p.wait_of(1), Some(Wait::Unschedulable(t))
            if t.starts_with("nodes: asks 2 distinct machines") && t.ends_with("this pool has 1")),
        "{:?}",
        p.wait_of(1)
    );
    assert!(p.reservation.is_none(), "it could never fit: holds nothing");
}

#[test]
fn a_machine_with_two_models_never_promises_its_cpu_twice() {
    let mut n = node(vec![gpu("H100", false, 1000), gpu("L40S", false, 1000)]);
    n.cpu_total_milli = 2000;
    n.cpu_free_milli = 2000;
    let mut a = work(1, GpuAsk::Whole(1));
    a.models = vec!["H100".into()];
    a.cpu_milli = 1500;
    let mut b = work(2, GpuAsk::Whole(1));
    b.models = vec!["L40S".into()];
    b.cpu_milli = 1500;
    let p = plan(&snapshot(vec![n], vec![a, b])).unwrap();
    assert!(placed(&p, 1));
    assert_eq!(
        p.wait_of(2),
        Some(&Wait::NoFit("0/1 nodes fit: 1 too little free CPU".into()))
    );
}

#[test]
fn work_goes_to_machines_of_its_runtime_and_says_why_when_there_are_none() {
    let process = node(vec![gpu("H100", false, 1000)]);
    let mut container = node(vec![gpu("H100", false, 1000)]);
    container.runtime = Runtime::Container;
    let mut image = work(1, GpuAsk::Whole(1));
    image.runtime = Runtime::Container;
    let command = work(2, GpuAsk::Whole(1));
    // Process machine first: lowest index would win a tie on equal nodes.
    let p = plan(&snapshot(
        vec![process.clone(), container.clone()],
        vec![image.clone(), command.clone()],
    ))
    .unwrap();
    let at = |key| {
        p.placements
            .iter()
            .find(|x| x.key == key)
            .map(|x| x.members[0].node)
    };
    assert_eq!(at(1), Some(1), "the image goes to the container machine");
    assert_eq!(at(2), Some(0), "the command goes to the process machine");

    let p = plan(&snapshot(
        vec![process.clone(), process],
        vec![image, work(3, GpuAsk::None)],
    ))
    .unwrap();
    assert_eq!(
        p.wait_of(1),
        Some(&Wait::NoFit(
            "0/2 nodes fit: 2 runs processes, not images".into()
        ))
    );
    assert!(placed(&p, 3));
    let mut cpu_only = work(4, GpuAsk::None);
    cpu_only.runtime = Runtime::Process;
    let p = plan(&snapshot(vec![container], vec![cpu_only])).unwrap();
    assert_eq!(
        p.wait_of(4),
        Some(&Wait::NoFit("0/1 nodes fit: 1 runs containers only".into()))
    );
}

fn running(key: WorkKey, tier: Tier, preemptible: bool, node: usize, gpus: &[u16]) -> RunningWork {
    RunningWork {
        key,
        tenant: 1,
        tier,
        priority: 0,
        preemptible,
        started_ms: 0,
        ends_by_ms: None,
        stopping: false,
        preempted_by: None,
        members: vec![Hold {
            node,
            gpus: gpus.iter().map(|&g| (g, 1000)).collect(),
            cpu_milli: 0,
            mem_mib: 0,
        }],
    }
}

#[test]
fn tier_one_preempts_spot_work_and_then_waits_for_it() {
    let mut s = snapshot(
        vec![node(vec![gpu("H100", false, 0), gpu("H100", false, 0)])],
        vec![work(10, GpuAsk::Whole(1))],
    );
    s.running = vec![
        running(1, Tier::Dedicated, false, 0, &[0]),
        running(2, Tier::Shared, true, 0, &[1]),
    ];
    let p = plan(&s).unwrap();
    assert_eq!(p.preemptions.len(), 1);
    assert_eq!((p.preemptions[0].victim, p.preemptions[0].by), (2, 10));
    assert_eq!(p.preemptions[0].notice_ms, 30_000);
    assert_eq!(p.wait_of(10), Some(&Wait::VictimsStopping(vec![2])));
    assert_eq!(
        p.wait_of(10).unwrap().describe(|k| format!("inst_{k}")),
        "waiting for preempted instances to stop: inst_2"
    );
    // Planned again after applying: nothing new.
    let again = plan(&apply(&s, &p)).unwrap();
    assert!(again.preemptions.is_empty() && again.placements.is_empty());
    assert_eq!(again.wait_of(10), Some(&Wait::VictimsStopping(vec![2])));
    // The victim stopped: its GPU is promised to the preemptor alone.
    let mut done = apply(&s, &p);
    done.running.retain(|r| r.key != 2);
    done.nodes[0].gpus[1].free_milli = 1000;
    done.promises = vec![Promise {
        node: 0,
        gpu: 1,
        milli: 1000,
        to: 10,
    }];
    let mut other = work(5, GpuAsk::Whole(1));
    other.submitted_ms = 0; // first in FIFO order
    done.queue.insert(0, other);
    let p = plan(&done).unwrap();
    assert!(placed(&p, 10) && !placed(&p, 5), "{p:?}");
}

#[test]
fn tier_one_and_non_preemptible_work_is_never_a_victim() {
    let mut s = snapshot(
        vec![node(vec![gpu("H100", false, 0), gpu("H100", false, 0)])],
        vec![work(10, GpuAsk::Whole(1))],
    );
    s.running = vec![
        running(1, Tier::Dedicated, true, 0, &[0]),
        running(2, Tier::Shared, false, 0, &[1]),
    ];
    let p = plan(&s).unwrap();
    assert!(p.preemptions.is_empty());
    assert!(matches!(p.wait_of(10), Some(Wait::NoFit(_))));
}

#[test]
fn work_behind_a_blocked_head_backfills_only_where_it_cannot_delay_it() {
    // Machine 0: 2 H100, one held (unknown end). Machine 1: an L4.
    let mut s = snapshot(
        vec![
            node(vec![gpu("H100", false, 0), gpu("H100", false, 1000)]),
            node(vec![gpu("L4", false, 1000)]),
        ],
        vec![],
    );
    s.running = vec![running(1, Tier::Dedicated, false, 0, &[0])];
    let mut head = work(10, GpuAsk::Whole(2));
    head.models = vec!["H100".into()];
    let small = work(11, GpuAsk::Whole(1));
    let mut h100 = work(12, GpuAsk::Whole(1));
    h100.models = vec!["H100".into()];
    s.queue = vec![head, small, h100];
    let p = plan(&s).unwrap();
    let r = p.reservation.as_ref().unwrap();
    assert_eq!((r.work, r.start_ms, r.nodes.clone()), (10, None, vec![0]));
    let x = p.placements.iter().find(|x| x.key == 11).unwrap();
    assert_eq!(x.members[0].node, 1, "backfilled around the head");
    assert!(x.backfilled);
    assert_eq!(p.wait_of(12), Some(&Wait::BehindHead(10)));
}

#[test]
fn quota_limits_and_guarantees() {
    let mut s = snapshot(
        vec![node(vec![
            gpu("H100", false, 1000),
            gpu("H100", false, 1000),
        ])],
        vec![work(1, GpuAsk::Whole(1)), work(2, GpuAsk::Whole(1))],
    );
    s.tenants.insert(
        0,
        TenantPolicy {
            quota: Quota {
                guaranteed_milli: 0,
                burst_milli: 1000,
            },
            per_model_milli: BTreeMap::new(),
            weight: 1.0,
        },
    );
    let p = plan(&s).unwrap();
    assert!(placed(&p, 1));
    assert!(p.placements[0].borrowed, "no guarantee: borrowed");
    let why = p.wait_of(2).unwrap().describe(|k| k.to_string());
    assert!(
        why.starts_with("over quota: quota exceeded: 1 GPUs in use"),
        "{why}"
    );
    // Per-model limits steer work to models with room.
    let mut s = snapshot(
        vec![
            node(vec![gpu("H100", false, 1000)]),
            node(vec![gpu("L4", false, 1000)]),
        ],
        vec![work(1, GpuAsk::Whole(1))],
    );
    let mut t = TenantPolicy::unlimited();
    t.per_model_milli.insert("H100".into(), 0);
    s.tenants.insert(0, t);
    let p = plan(&s).unwrap();
    assert_eq!(p.placements[0].members[0].model, "L4");
}

#[test]
fn a_guaranteed_tenant_reclaims_borrowed_capacity() {
    let mut s = snapshot(
        vec![node(vec![gpu("H100", false, 0)])],
        vec![work(10, GpuAsk::Whole(1))],
    );
    // Tenant 1 holds the GPU, borrowed (no guarantee), preemptible, same tier.
    let mut r = running(1, Tier::Dedicated, true, 0, &[0]);
    r.tier = Tier::Shared;
    s.running = vec![r];
    s.queue[0].tier = Tier::Shared;
    let mut t = TenantPolicy::unlimited();
    t.quota.guaranteed_milli = 1000;
    s.tenants.insert(0, t);
    let p = plan(&s).unwrap();
    assert_eq!(p.preemptions.len(), 1, "{p:?}");
    // Without the guarantee, equals never preempt each other.
    s.tenants.clear();
    assert!(plan(&s).unwrap().preemptions.is_empty());
}

#[test]
fn unready_and_cordoned_machines_are_explained() {
    let mut a = node(vec![gpu("H100", false, 1000)]);
    a.ready = false;
    let mut b = node(vec![gpu("H100", false, 1000)]);
    b.cordoned = true;
    let p = plan(&snapshot(vec![a, b], vec![work(1, GpuAsk::Whole(1))])).unwrap();
    assert_eq!(
        p.wait_of(1),
        Some(&Wait::NoFit(
            "0/2 nodes fit: 1 unreachable, 1 cordoned".into()
        ))
    );
}

// ---- properties over generated snapshots ----

const MODELS: [&str; 2] = ["A100", "L40S"];

fn arb_node() -> impl Strategy<Value = NodeSnap> {
    (
        prop::collection::vec((0usize..2, any::<bool>(), 0u16..=4), 0..4),
        prop::bool::weighted(0.9),
        prop::bool::weighted(0.1),
        0u32..2,
        0u32..2,
        4_000u32..32_000,
    )
        .prop_map(|(gpus, ready, cordoned, region, pool, cpu)| NodeSnap {
            ready,
            cordoned,
            region: format!("r{region}"),
            pool: format!("p{pool}"),
            runtime: Runtime::Process,
            cpu_total_milli: cpu,
            mem_total_mib: 256_000,
            cpu_free_milli: cpu,
            mem_free_mib: 256_000,
            gpus: gpus
                .into_iter()
                .map(|(m, mig, used)| GpuSnap {
                    model: MODELS[m].into(),
                    // Only the A100 has a MIG geometry.
                    mig: mig && m == 0,
                    free_milli: 1000 - used * 250,
                })
                .collect(),
        })
}

fn arb_ask() -> impl Strategy<Value = GpuAsk> {
    prop_oneof![
        (1u16..=3).prop_map(GpuAsk::Whole),
        prop::sample::select(vec![250u16, 500, 750]).prop_map(GpuAsk::Fraction),
        prop::sample::select(vec!["1g.10gb", "2g.20gb", "3g.40gb"]).prop_map(mig),
        Just(GpuAsk::None),
    ]
}

fn arb_tier() -> impl Strategy<Value = Tier> {
    prop::sample::select(vec![Tier::Dedicated, Tier::Shared, Tier::Queued])
}

fn arb_work() -> impl Strategy<Value = QueuedWork> {
    (
        arb_ask(),
        1u16..=3,
        any::<bool>(),
        prop::sample::select(vec![
            Locality::Any,
            Locality::SameDomain,
            Locality::SameRegion,
        ]),
        0u32..3,
        arb_tier(),
        -1i32..=1,
        prop::option::of(prop::sample::select(vec!["A100", "L40S"])),
        500u32..6_000,
        prop::option::of(1u64..100_000),
    )
        .prop_map(
            |(gpu, members, spread, locality, tenant, tier, priority, model, cpu, runtime)| {
                QueuedWork {
                    key: 0,
                    tenant,
                    tier,
                    priority,
                    submitted_ms: 0,
                    members,
                    spread,
                    locality,
                    gpu,
                    models: model.map(|m| vec![m.to_string()]).unwrap_or_default(),
                    cpu_milli: cpu,
                    mem_mib: 1024,
                    runtime: Runtime::Process,
                    max_runtime_ms: runtime,
                    ready_ms: Vec::new(),
                }
            },
        )
}

fn arb_snapshot() -> impl Strategy<Value = Snapshot> {
    (
        prop::collection::vec(arb_node(), 1..6),
        prop::collection::vec(arb_work(), 0..12),
        prop::collection::vec(
            (0u32..3, arb_tier(), any::<bool>(), -1i32..=1, any::<bool>()),
            24,
        ),
        prop::collection::vec((0u64..3000, 0u64..3000), 0..3),
        any::<u64>(),
        prop::sample::select(vec![Policy::Flotilla, Policy::BestFit, Policy::Random]),
    )
        .prop_map(|(nodes, mut queue, owners, guarantees, seed, policy)| {
            for (i, w) in queue.iter_mut().enumerate() {
                w.key = 1000 + i as u64;
                w.submitted_ms = i as u64 * 10;
            }
            // Running work holds exactly the used capacity: one work per
            // used GPU (a whole GPU or a share of it).
            let mut running = Vec::new();
            let mut k = 0;
            let mut nodes = nodes;
            for (ni, n) in nodes.iter_mut().enumerate() {
                for (gi, g) in n.gpus.iter().enumerate() {
                    if g.free_milli < 1000 {
                        let cpu = if n.cpu_free_milli >= 1000 { 1000 } else { 0 };
                        n.cpu_free_milli -= cpu;
                        let (tenant, tier, preemptible, priority, stopping) =
                            owners[k % owners.len()];
                        running.push(RunningWork {
                            key: k as u64 + 1,
                            tenant,
                            tier,
                            priority,
                            preemptible,
                            started_ms: k as u64 * 1000,
                            ends_by_ms: None,
                            stopping: stopping && k % 5 == 0,
                            preempted_by: None,
                            members: vec![Hold {
                                node: ni,
                                gpus: vec![(gi as u16, 1000 - g.free_milli)],
                                cpu_milli: cpu,
                                mem_mib: 0,
                            }],
                        });
                        k += 1;
                    }
                }
            }
            let mut tenants = BTreeMap::new();
            for (t, (g, b)) in guarantees.into_iter().enumerate() {
                tenants.insert(
                    t as u32,
                    TenantPolicy {
                        quota: Quota {
                            guaranteed_milli: g,
                            burst_milli: b,
                        },
                        per_model_milli: BTreeMap::new(),
                        weight: 1.0 + t as f64,
                    },
                );
            }
            Snapshot {
                tenants,
                ..Snapshot::unlimited(1_000_000, seed, policy, nodes, running, queue)
            }
        })
}

fn check_capacity(s: &Snapshot, p: &Plan) -> Result<(), TestCaseError> {
    let mut gpu_left: Vec<Vec<i64>> = s
        .nodes
        .iter()
        .map(|n| n.gpus.iter().map(|g| i64::from(g.free_milli)).collect())
        .collect();
    let mut cpu_left: Vec<i64> = s
        .nodes
        .iter()
        .map(|n| i64::from(n.cpu_free_milli))
        .collect();
    for x in &p.placements {
        let w = s.queue.iter().find(|w| w.key == x.key).unwrap();
        prop_assert_eq!(x.members.len(), usize::from(w.members));
        let mut machines: Vec<usize> = x.members.iter().map(|m| m.node).collect();
        machines.sort_unstable();
        machines.dedup();
        if w.spread {
            prop_assert_eq!(
                machines.len(),
                x.members.len(),
                "spread work shares a machine"
            );
        }
        for m in &x.members {
            let n = &s.nodes[m.node];
            prop_assert!(
                n.ready && !n.cordoned,
                "placed on an unready or cordoned machine"
            );
            cpu_left[m.node] -= i64::from(w.cpu_milli);
            prop_assert!(cpu_left[m.node] >= 0, "cpu overbooked");
            if !w.models.is_empty() && w.gpu != GpuAsk::None {
                prop_assert!(w.models.contains(&m.model));
            }
            let want = match w.gpu {
                GpuAsk::None => 0,
                GpuAsk::Whole(c) => usize::from(c),
                _ => 1,
            };
            prop_assert_eq!(m.gpus.len(), want);
            for &(g, milli) in &m.gpus {
                let gs = &n.gpus[usize::from(g)];
                prop_assert_eq!(&gs.model, &m.model);
                match w.gpu {
                    GpuAsk::Mig(m) => {
                        prop_assert!(gs.mig);
                        prop_assert_eq!(milli, m);
                    }
                    GpuAsk::Whole(_) => {
                        prop_assert!(!gs.mig);
                        prop_assert_eq!(milli, 1000);
                    }
                    GpuAsk::Fraction(f) => {
                        prop_assert!(!gs.mig);
                        prop_assert_eq!(milli, f);
                    }
                    GpuAsk::None => prop_assert!(false),
                }
                gpu_left[m.node][usize::from(g)] -= i64::from(milli);
                prop_assert!(gpu_left[m.node][usize::from(g)] >= 0, "gpu double-booked");
            }
        }
    }
    Ok(())
}

proptest! {
    // A fixed seed: the same 256 snapshots on every run, so CI is
    // reproducible; `PROPTEST_CASES=20000` explores further (see the
    // idempotence property's note for the one rare divergence known).
    #![proptest_config(ProptestConfig {
        cases: 256,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x0F10_7111A),
        ..ProptestConfig::default()
    })]

    #[test]
    fn no_gpu_share_or_slice_is_double_booked(s in arb_snapshot()) {
        let p = plan(&s).unwrap();
        check_capacity(&s, &p)?;
        // Every queued work is either placed or waits, exactly once.
        let mut seen: Vec<WorkKey> = p.placements.iter().map(|x| x.key).collect();
        seen.extend(p.waiting.iter().map(|(k, _)| *k));
        seen.sort_unstable();
        let mut all: Vec<WorkKey> = s.queue.iter().map(|w| w.key).collect();
        all.sort_unstable();
        prop_assert_eq!(seen, all);
    }

    #[test]
    fn tier_one_and_non_preemptible_work_is_never_a_victim_prop(s in arb_snapshot()) {
        let p = plan(&s).unwrap();
        for pre in &p.preemptions {
            let v = s.running.iter().find(|r| r.key == pre.victim).unwrap();
            prop_assert!(v.tier != Tier::Dedicated, "tier-1 victim");
            prop_assert!(v.preemptible, "non-preemptible victim");
            prop_assert!(!v.stopping, "a victim already stopping was chosen again");
            let by = s.queue.iter().find(|w| w.key == pre.by).unwrap();
            prop_assert!(!p.placements.iter().any(|x| x.key == by.key));
        }
    }

    /// For the deterministic scorers: the Random baseline draws its choice
    /// (a reservation's plan among them) anew on each pass, so the work it
    /// lets backfill beside a reservation may differ from pass to pass.
    /// Known divergence, about 1 in 15,000 generated snapshots: when the
    /// head's start is known, the machines its plan uses depend on the
    /// pool's state, so a work refused as a backfill on one pass (it would
    /// delay the head as then planned) may be admitted on the next (it
    /// fits beside the head as planned then). Never a preemption, never
    /// an overbooking: the first pass was only more careful.
    #[test]
    fn a_plan_applied_and_planned_again_changes_nothing(mut s in arb_snapshot()) {
        if s.policy == Policy::Random {
            s.policy = Policy::Flotilla;
        }
        let p = plan(&s).unwrap();
        let next = apply(&s, &p);
        let again = plan(&next).unwrap();
        prop_assert!(again.placements.is_empty(), "new placements: {:?}\nfirst: {:?}\nagain: {:?}", again.placements, p, again);
        prop_assert!(again.preemptions.is_empty(), "new preemptions: {:?}\nfirst: {:?}\nagain: {:?}", again.preemptions, p, again);
    }

    #[test]
    fn the_same_snapshot_plans_the_same(s in arb_snapshot()) {
        prop_assert_eq!(plan(&s).unwrap(), plan(&s).unwrap());
    }
}

/// Capacity taken outside the running work (kept back, or held by work the
/// snapshot does not list) on many GPUs and machines: the pass commits it
/// to its engine while building the pool, and the order of those commits
/// shapes the engine's node classes and tie-breaking. They are made in
/// machine and GPU order, so every call plans the same (they once followed
/// a hash map's per-instance random order: about 1 plan in 300 differed
/// between two calls on such snapshots).
#[test]
fn the_same_snapshot_plans_the_same_in_every_call() {
    for policy in Policy::ALL {
        let nodes = (0..12u16)
            .map(|n| {
                node(
                    (0..8u16)
                        .map(|g| {
                            gpu(
                                "H100",
                                false,
                                [1000, 750, 500, 250, 0][usize::from((n * 3 + g) % 5)],
                            )
                        })
                        .collect(),
                )
            })
            .collect();
        let queue = (0..40)
            .map(|k| {
                work(
                    k,
                    match k % 4 {
                        0 => GpuAsk::Fraction(250),
                        1 => GpuAsk::Fraction(500),
                        2 => GpuAsk::Whole(1),
                        _ => GpuAsk::Whole(2),
                    },
                )
            })
            .collect();
        let mut snap = snapshot(nodes, queue);
        snap.policy = policy;
        let first = plan(&snap).unwrap();
        for _ in 0..30 {
            assert_eq!(plan(&snap).unwrap(), first, "{}", policy.name());
        }
    }
}
