//! Scorers on tiny hand-made clusters, and invariants of the whole pipeline
//! as property tests.

use flotilla_sched::{
    Cluster, Decision, Engine, GpuDemand, ModelSet, ModelTable, NodeSpec, Placement, Policy,
    Request, TargetWorkload, MILLI,
};
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn cluster(nodes: &[(u8, u16)]) -> Cluster {
    let mut models = ModelTable::default();
    for m in ["A", "B", "C"] {
        models.intern(m).unwrap();
    }
    let mut c = Cluster::new(models);
    for &(model, gpus) in nodes {
        c.add_node(NodeSpec {
            model: Some(model),
            gpus,
            cpu_milli: 64_000,
            mem_mib: 256 * 1024,
        })
        .unwrap();
    }
    c
}

fn place(c: &mut Cluster, node: u32, req: Request, gpus: Vec<u16>) {
    c.commit(&req, &Placement { node, gpus }).unwrap();
}

fn decide(policy: Policy, wl: &TargetWorkload, c: &Cluster, req: &Request) -> Decision {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    Engine::new(policy.scorer(wl)).decide(c, req, &mut rng)
}

fn placed(d: Decision) -> Placement {
    match d {
        Decision::Placed(p) => p,
        Decision::Unschedulable(e) => panic!("unschedulable: {e}"),
    }
}

#[test]
fn best_fit_picks_the_tightest_node() {
    let mut c = cluster(&[(0, 4), (0, 4), (0, 4)]);
    place(
        &mut c,
        2,
        Request::new(GpuDemand::Whole { count: 3 }, 0, 0),
        vec![0, 1, 2],
    );
    let one = Request::new(GpuDemand::Whole { count: 1 }, 1000, 0);
    let p = placed(decide(
        Policy::BestFit,
        &TargetWorkload::default(),
        &c,
        &one,
    ));
    assert_eq!(
        p,
        Placement {
            node: 2,
            gpus: vec![3]
        }
    );
}

#[test]
fn fgd_and_flotilla_take_the_placement_that_fragments_least() {
    // Target mix: half of the requests want 500 milli, half one whole GPU.
    let half = Request::new(GpuDemand::Share { milli: 500 }, 0, 0);
    let whole = Request::new(GpuDemand::Whole { count: 1 }, 0, 0);
    let wl = TargetWorkload::from_requests(&[half, whole], 1.0);
    // Node 0: [1000, 1000]; node 1: [1000, 600].
    let mut c = cluster(&[(0, 2), (0, 2)]);
    place(
        &mut c,
        1,
        Request::new(GpuDemand::Share { milli: 400 }, 0, 0),
        vec![1],
    );
    // By hand, for a 500-milli share:
    //   node 0: frag 0 -> [1000, 500]: the whole-GPU shape cannot use 500,
    //           0.5 * 500 = 250; delta +250.
    //   node 1: frag 0.5 * 600 = 300 (the whole-GPU shape cannot use 600).
    //           On the 600 GPU -> [1000, 100]: both shapes waste 100, frag 100,
    //           delta -200. On the 1000 GPU -> [500, 600]: the whole-GPU shape
    //           fits nowhere, 0.5 * 1100 = 550, delta +250.
    // Least fragmentation: node 1, GPU 1 (the one with 600 free).
    for policy in [Policy::Fgd, Policy::Flotilla] {
        let p = placed(decide(policy, &wl, &c, &half));
        assert_eq!(
            p,
            Placement {
                node: 1,
                gpus: vec![1]
            },
            "{policy:?}"
        );
    }
    let s = c.state_of(1).unwrap();
    assert!((wl.node_frag(s) - 300.0).abs() < 1e-9);
}

#[test]
fn fgd_breaks_share_ties_by_lowest_device_index() {
    // One node, GPUs [1000, 600] by device index. With an empty mix every
    // GPU scores int(100 * sigmoid(0)) = 50; the simulator walks the GPUs by
    // index and keeps the first, so FGD takes GPU 0 (not the fuller GPU 1).
    let mut c = cluster(&[(0, 2)]);
    place(
        &mut c,
        0,
        Request::new(GpuDemand::Share { milli: 400 }, 0, 0),
        vec![1],
    );
    let share = Request::new(GpuDemand::Share { milli: 300 }, 0, 0);
    let wl = TargetWorkload::default();
    let p = placed(decide(Policy::Fgd, &wl, &c, &share));
    assert_eq!(
        p,
        Placement {
            node: 0,
            gpus: vec![0]
        }
    );
    // Flotilla's best fit takes the fuller GPU.
    let p = placed(decide(Policy::Flotilla, &wl, &c, &share));
    assert_eq!(
        p,
        Placement {
            node: 0,
            gpus: vec![1]
        }
    );
}

#[test]
fn gpu_packing_prefers_a_shared_gpu_then_a_used_node() {
    let mut c = cluster(&[(0, 2), (0, 2), (0, 2)]);
    place(
        &mut c,
        1,
        Request::new(GpuDemand::Share { milli: 300 }, 0, 0),
        vec![0],
    );
    place(
        &mut c,
        2,
        Request::new(GpuDemand::Whole { count: 1 }, 0, 0),
        vec![0],
    );
    let wl = TargetWorkload::default();
    let share = Request::new(GpuDemand::Share { milli: 500 }, 0, 0);
    assert_eq!(
        placed(decide(Policy::GpuPacking, &wl, &c, &share)),
        Placement {
            node: 1,
            gpus: vec![0]
        }
    );
    let one = Request::new(GpuDemand::Whole { count: 1 }, 0, 0);
    let p = placed(decide(Policy::GpuPacking, &wl, &c, &one));
    assert!(p.node == 1 || p.node == 2, "{p:?}");
}

#[test]
fn gpu_clustering_keeps_like_with_like() {
    let mut c = cluster(&[(0, 4), (0, 4), (0, 4)]);
    place(
        &mut c,
        0,
        Request::new(GpuDemand::Share { milli: 200 }, 0, 0),
        vec![0],
    );
    place(
        &mut c,
        2,
        Request::new(GpuDemand::Whole { count: 2 }, 0, 0),
        vec![0, 1],
    );
    let wl = TargetWorkload::default();
    let two = Request::new(GpuDemand::Whole { count: 2 }, 0, 0);
    assert_eq!(placed(decide(Policy::GpuClustering, &wl, &c, &two)).node, 2);
    let share = Request::new(GpuDemand::Share { milli: 200 }, 0, 0);
    assert_eq!(
        placed(decide(Policy::GpuClustering, &wl, &c, &share)).node,
        0
    );
}

#[test]
fn dot_product_avoids_aligned_free_resources() {
    // Same free CPU; node 1 has less GPU free, so the dot product with a
    // GPU-heavy request is smaller there and DotProd prefers it.
    let mut c = cluster(&[(0, 8), (0, 8)]);
    place(
        &mut c,
        1,
        Request::new(GpuDemand::Whole { count: 6 }, 0, 0),
        vec![0, 1, 2, 3, 4, 5],
    );
    let two = Request::new(GpuDemand::Whole { count: 2 }, 0, 0);
    assert_eq!(
        placed(decide(
            Policy::DotProd,
            &TargetWorkload::default(),
            &c,
            &two
        ))
        .node,
        1
    );
}

#[test]
fn random_places_on_a_feasible_node() {
    let mut c = cluster(&[(0, 1), (1, 1), (2, 1)]);
    place(
        &mut c,
        0,
        Request::new(GpuDemand::Whole { count: 1 }, 0, 0),
        vec![0],
    );
    let req = Request::new(GpuDemand::Share { milli: 100 }, 0, 0).with_models(ModelSet::of([0, 2]));
    for seed in 0..20 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let d = Engine::new(Policy::Random.scorer(&TargetWorkload::default()))
            .decide(&c, &req, &mut rng);
        assert_eq!(placed(d).node, 2);
    }
}

#[test]
fn unschedulable_requests_are_explained() {
    let mut c = cluster(&[(0, 2), (1, 2), (1, 2), (2, 1)]);
    c.set_cordoned(0, true).unwrap();
    place(
        &mut c,
        1,
        Request::new(GpuDemand::Whole { count: 2 }, 0, 0),
        vec![0, 1],
    );
    let req = Request::new(GpuDemand::Whole { count: 2 }, 0, 0).with_models(ModelSet::of([0, 1]));
    let Decision::Unschedulable(why) = decide(
        Policy::Flotilla,
        &TargetWorkload::default(),
        &{
            place(
                &mut c,
                2,
                Request::new(GpuDemand::Share { milli: 10 }, 0, 0),
                vec![1],
            );
            c
        },
        &req,
    ) else {
        panic!("expected unschedulable");
    };
    assert_eq!(
        why.to_string(),
        "0/4 nodes fit: 2 too little free GPU share, 1 cordoned, 1 GPU model not allowed"
    );
}

fn arb_request() -> impl Strategy<Value = Request> {
    let gpu = prop_oneof![
        Just(GpuDemand::None),
        (1u16..=8).prop_map(|count| GpuDemand::Whole { count }),
        (1u16..MILLI).prop_map(|milli| GpuDemand::Share { milli }),
    ];
    let models = prop_oneof![Just(ModelSet::Any), (0u64..8).prop_map(ModelSet::Only)];
    (gpu, models, 0u32..40_000, 0u64..100_000)
        .prop_map(|(gpu, models, cpu, mem)| Request::new(gpu, cpu, mem).with_models(models))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Whatever the policy and the request stream: no GPU is ever
    /// overdrawn, whole-GPU requests get distinct GPUs, every placement is on
    /// an allowed model, and an unschedulable request's explanation accounts
    /// for every node.
    #[test]
    fn placements_respect_capacity_models_and_explanations(
        nodes in prop::collection::vec((0u8..3, 1u16..=8), 1..12),
        reqs in prop::collection::vec(arb_request(), 1..60),
        policy in prop::sample::select(Policy::ALL.to_vec()),
        seed in any::<u64>(),
    ) {
        let mut c = cluster(&nodes);
        let wl = TargetWorkload::from_requests(&reqs, 0.95);
        let mut engine = Engine::new(policy.scorer(&wl));
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for req in &reqs {
            match engine.decide(&c, req, &mut rng) {
                Decision::Placed(p) => {
                    let node = c.node(p.node).unwrap();
                    prop_assert_eq!(p.gpus.len(), usize::from(req.gpu.gpu_count()));
                    let mut sorted = p.gpus.clone();
                    sorted.sort_unstable();
                    sorted.dedup();
                    prop_assert_eq!(sorted.len(), p.gpus.len(), "gpus not distinct");
                    if req.gpu.gpu_count() > 0 {
                        prop_assert!(req.models.allows(node.spec.model), "model not allowed");
                    }
                    // commit re-checks every share against what is free.
                    prop_assert!(c.commit(req, &p).is_ok());
                }
                Decision::Unschedulable(why) => {
                    let sum: usize = why.reasons().iter().map(|r| r.1).sum();
                    prop_assert_eq!(sum, c.len());
                    prop_assert_eq!(why.nodes, c.len());
                }
            }
            for n in c.nodes() {
                prop_assert!(n.gpu_free.iter().all(|&f| f <= MILLI));
            }
        }
        let allocated: u64 = c.nodes().iter().flat_map(|n| n.gpu_free.iter()).map(|&f| u64::from(MILLI - f)).sum();
        prop_assert_eq!(allocated, c.gpu_allocated_milli());
    }
}

/// The real trace, when present: a short FGD/Flotilla replay stays sane.
#[test]
fn openb_trace_smoke() {
    let dir = std::env::var_os("FLOTILLA_TRACE_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../../shared/data/alibaba-gpu-2023")
        });
    let nodes = dir.join("openb_node_list_gpu_node.csv");
    let Ok(text) = std::fs::read_to_string(&nodes) else {
        eprintln!(
            "skipping openb_trace_smoke: no trace at {} (set FLOTILLA_TRACE_DIR)",
            dir.display()
        );
        return;
    };
    let mut models = ModelTable::default();
    let mut specs = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        let gpus: u16 = f[3].parse().unwrap();
        specs.push(NodeSpec {
            model: Some(models.intern(f[4]).unwrap()),
            gpus,
            cpu_milli: f[1].parse().unwrap(),
            mem_mib: f[2].parse().unwrap(),
        });
    }
    let mut c = Cluster::new(models);
    for s in specs {
        c.add_node(s).unwrap();
    }
    assert_eq!(c.len(), 1213);
    assert_eq!(c.gpu_capacity_milli(), 6212 * 1000);
    let one = Request::new(GpuDemand::Whole { count: 8 }, 8000, 0);
    let mut engine =
        Engine::new(Policy::Flotilla.scorer(&TargetWorkload::from_requests(&[one], 1.0)));
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let mut placed = 0;
    while let Decision::Placed(p) = engine.decide(&c, &one, &mut rng) {
        c.commit(&one, &p).unwrap();
        placed += 1;
    }
    // 549 G2 + 39 G3 + 21 V100M32 + 8 V100M16 nodes have 8 GPUs.
    assert_eq!(placed, 549 + 39 + 21 + 8);
}
