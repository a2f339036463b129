//! One store suite, run against every backend: SQLite always, PostgreSQL
//! when `FLOTILLA_TEST_DATABASE_URL` is set (CI sets it). Each PostgreSQL
//! test gets a database of its own, so tests run in parallel.

mod support;

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, Utc};
use flotilla_core::api::{
    DiscoveredGpu, LimitExceeded, LogLine, LogStream, ObservedContainer, ObservedInstance,
    ObservedPhase, PublishedPort, RegisterNode,
};
use flotilla_core::catalog::{Catalog, Vendor};
use flotilla_core::id::{GpuId, InstanceId, KeyId, NodeId, TenantId};
use flotilla_core::instance::{BillingClass, InstanceSpec, InstanceState};
use flotilla_core::placement::{GpuShare, Placement, PlacementRequest};
use flotilla_core::quota::Quota;
use flotilla_core::tenant::Role;
use flotilla_store::idempotency::Claim;
use flotilla_store::instances::Applied;
use flotilla_store::keys::NewKey;
use flotilla_store::{PageReq, Store, StoreError};
use flotilla_testdb::{rnd, t0};

flotilla_testdb::backend_suite!(
    "store":
    tenants_and_quotas,
    keys_hash_lookup_and_revoke,
    pagination_walks_every_item_once,
    node_registration_is_idempotent_by_name,
    instance_lifecycle_and_gpu_release,
    gpus_are_never_allocated_twice_under_races,
    fractions_never_exceed_a_gpu_under_races,
    mig_instances_never_exceed_the_geometry_under_races,
    quota_is_enforced_at_create,
    quota_holds_under_concurrent_creates,
    unlimited_creates_race_freely_and_a_new_limit_holds,
    instance_lists_filter_and_page_by_tenant_and_state,
    lost_instances_reattach_or_fail,
    a_late_exit_ends_a_lost_copy_at_its_kill,
    usage_keyed_after_reads_one_instances_events,
    logs_are_deduplicated_by_seq,
    idempotency_keys_replay_and_detect_mismatch,
    containers_report_ports_cold_starts_and_oom_kills,
    an_exit_seen_before_running_still_counts_as_run,
    observed_times_bound_metering,
    metering_reads_only_due_work_page_by_page,
    a_sync_applies_what_changed_and_skips_what_did_not,
    an_exit_with_its_start_is_metered_from_it,
    gpu_faults_cordons_drains_and_node_events,
    fleet_counts_for_metrics,
    limits_reach_the_agent_and_name_why_work_ended,
    reconciliation_reads_time_meters_and_runs_in_a_window,
    heartbeats_in_one_statement_keep_the_latest_and_skip_unknown_nodes,
    a_batch_of_placements_keeps_the_rest_when_one_loses_a_race,
    one_sync_writes_together_and_a_taken_gpu_costs_only_its_own_report,
);

async fn tenant(s: &Store, name: &str) -> TenantId {
    let id = TenantId::generate(1, rnd());
    s.create_tenant(&id, name, t0()).await.unwrap();
    id
}

fn spec(gpus: u32, types: &[&str]) -> InstanceSpec {
    InstanceSpec {
        name: None,
        gpus,
        gpu_types: types.iter().map(|s| s.to_string()).collect(),
        cpu_milli: 1000,
        memory_mb: 1024,
        command: vec!["echo".into(), "hi".into()],
        env: BTreeMap::from([("A".to_string(), "1".to_string())]),
        workdir: None,
        billing_class: BillingClass::Spot,
        priority: 0,
        tier: 2,
        preemptible: true,
        share: GpuShare::Whole,
        image: None,
        disk_mb: None,
    }
}

fn mig(profile: &str) -> GpuShare {
    GpuShare::Mig(Catalog::default().mig_profile(profile).unwrap().0)
}

async fn node(s: &Store, owner: &TenantId, name: &str, gpus: &[(&str, u32)]) -> NodeId {
    let mut list = Vec::new();
    for (model, n) in gpus {
        // `H100:mig`: GPUs in MIG mode.
        let (model, mig) = match model.strip_suffix(":mig") {
            Some(m) => (m, true),
            None => (*model, false),
        };
        for _ in 0..*n {
            let index = list.len() as u32;
            list.push(DiscoveredGpu {
                index,
                model: model.to_string(),
                uuid: format!("GPU-{name}-{index}"),
                memory_mib: 81920,
                vendor: Vendor::Nvidia,
                mig_mode: mig,
            });
        }
    }
    let req = RegisterNode {
        name: name.into(),
        region: None,
        pool: None,
        cpu_milli: 64_000,
        memory_mb: 512_000,
        simulated: true,
        gpus: list,
        agent_version: "test".into(),
        runtime: Default::default(),
        executor: Default::default(),
        running: Vec::new(),
        unenforced_limits: Vec::new(),
        network: None,
    };
    let count = req.gpus.len();
    s.register_node(
        owner,
        &req,
        || {
            (
                NodeId::generate(1, rnd()),
                (0..count).map(|_| GpuId::generate(1, rnd())).collect(),
            )
        },
        t0(),
    )
    .await
    .unwrap()
    .id
}

async fn place(s: &Store, id: &InstanceId, now: DateTime<Utc>) -> Result<(), StoreError> {
    let inst = s.instance(id).await?;
    let snap = s.placement_snapshot().await?;
    let req = PlacementRequest {
        gpus: inst.gpus,
        models: inst.gpu_types.clone(),
        cpu_milli: inst.cpu_milli as u64,
        memory_mb: inst.memory_mb,
        share: GpuShare::Whole,
    };
    match support::first_fitting(&snap, &req) {
        Some(p) => {
            let work = support::waiting(s, id.clone()).await;
            s.schedule_work(&work, &[p], support::new_member, now)
                .await
                .map(drop)
        }
        None => Err(StoreError::Conflict("no node fits".into())),
    }
}

/// The states an instance that ran and exited 0 went through, in order.
const RAN_TO_SUCCESS: [InstanceState; 5] = [
    InstanceState::Pending,
    InstanceState::Scheduled,
    InstanceState::Starting,
    InstanceState::Running,
    InstanceState::Succeeded,
];

fn observed(id: &InstanceId, phase: ObservedPhase) -> ObservedInstance {
    seen(id, phase, t0())
}

/// An observation of a phase the node saw begin at `at`.
fn seen(id: &InstanceId, phase: ObservedPhase, at: DateTime<Utc>) -> ObservedInstance {
    ObservedInstance {
        instance_id: id.clone(),
        phase,
        at,
        started_at: None,
        message: None,
        container: None,
        weights_tier: None,
        limit_exceeded: None,
    }
}

async fn tenants_and_quotas(s: &Store) {
    let a = tenant(s, "acme").await;
    let dup = s
        .create_tenant(&TenantId::generate(2, rnd()), "acme", t0())
        .await;
    assert!(matches!(dup, Err(StoreError::AlreadyExists(m)) if m.contains("acme")));
    assert_eq!(s.tenant(&a).await.unwrap().name, "acme");
    assert_eq!(s.tenant_by_name("acme").await.unwrap().unwrap().id, a);
    assert!(matches!(
        s.tenant(&TenantId::generate(9, 9)).await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(s.quota(&a).await.unwrap(), Quota::default());
    let q = Quota {
        gpus_total: Some(8),
        gpus_per_model: BTreeMap::from([("H100".to_string(), 4)]),
        ..Default::default()
    };
    s.set_quota(&a, &q, t0()).await.unwrap();
    assert_eq!(s.quota(&a).await.unwrap(), q);
    let shared = Quota {
        gpus_guaranteed: Some(2),
        weight: Some(5),
        ..q
    };
    s.set_quota(&a, &shared, t0()).await.unwrap();
    assert_eq!(s.quota(&a).await.unwrap(), shared);
    let sharing = s.sharing_quotas().await.unwrap();
    assert_eq!(sharing.get(&a), Some(&shared));
}

async fn keys_hash_lookup_and_revoke(s: &Store) {
    let a = tenant(s, "keys").await;
    assert!(!s.has_operator_key().await.unwrap());
    let k = NewKey {
        id: KeyId::generate(1, rnd()),
        tenant_id: a.clone(),
        role: Role::Operator,
        name: "root".into(),
        prefix: "flt_abcd".into(),
        secret_hash: "h1".into(),
    };
    let created = s.create_key(&k, t0()).await.unwrap();
    assert_eq!(created.role, Role::Operator);
    assert!(s.has_operator_key().await.unwrap());
    assert_eq!(s.key_by_hash("h1").await.unwrap().unwrap().id, k.id);
    assert!(s.key_by_hash("nope").await.unwrap().is_none());
    // The only operator key stays (see audit_suite.rs); with a second one
    // the first can go.
    assert!(matches!(
        s.revoke_key(&k.id, t0()).await,
        Err(StoreError::Conflict(_))
    ));
    let second = NewKey {
        id: KeyId::generate(2, rnd()),
        secret_hash: "h2".into(),
        ..k.clone()
    };
    s.create_key(&second, t0()).await.unwrap();
    let revoked = s.revoke_key(&k.id, t0()).await.unwrap();
    assert!(revoked.revoked_at.is_some());
    assert!(s.key_by_hash("h1").await.unwrap().is_none());
    assert_eq!(s.key_by_hash("h2").await.unwrap().unwrap().id, second.id);
    assert!(s.has_operator_key().await.unwrap());
}

async fn pagination_walks_every_item_once(s: &Store) {
    let mut made = Vec::new();
    for i in 0..7 {
        made.push(tenant(s, &format!("t{i}")).await);
    }
    made.sort();
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = s
            .list_tenants(None, &PageReq::new(cursor, 3))
            .await
            .unwrap();
        assert!(page.items.len() <= 3);
        seen.extend(page.items.iter().map(|t| t.id.clone()));
        match page.next {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(seen, made);
    let only = s
        .list_tenants(Some(&made[2]), &PageReq::new(None, 100))
        .await
        .unwrap();
    assert_eq!(only.items.len(), 1);
}

async fn node_registration_is_idempotent_by_name(s: &Store) {
    let p = tenant(s, "prov").await;
    let n1 = node(s, &p, "gpu-box-1", &[("H100", 4)]).await;
    let n2 = node(s, &p, "gpu-box-1", &[("H100", 4)]).await;
    assert_eq!(n1, n2, "same name re-attaches to the same node");
    let n = s.node(&n1).await.unwrap();
    assert_eq!(n.gpus.len(), 4);
    let ids: Vec<_> = n.gpus.iter().map(|g| g.id.clone()).collect();
    node(s, &p, "gpu-box-1", &[("H100", 4)]).await;
    let again: Vec<_> = s
        .node(&n1)
        .await
        .unwrap()
        .gpus
        .iter()
        .map(|g| g.id.clone())
        .collect();
    assert_eq!(ids, again, "GPU ids survive re-registration");
    let other = tenant(s, "other").await;
    let stolen = s
        .register_node(
            &other,
            &RegisterNode {
                name: "gpu-box-1".into(),
                region: None,
                pool: None,
                cpu_milli: 1,
                memory_mb: 1,
                simulated: true,
                gpus: vec![],
                agent_version: String::new(),
                runtime: Default::default(),
                executor: Default::default(),
                running: Vec::new(),
                unenforced_limits: Vec::new(),
                network: None,
            },
            || (NodeId::generate(1, rnd()), vec![]),
            t0(),
        )
        .await;
    assert!(matches!(stolen, Err(StoreError::Conflict(_))));
    assert_eq!(
        s.list_nodes(&PageReq::new(None, 10))
            .await
            .unwrap()
            .items
            .len(),
        1
    );
}

async fn instance_lifecycle_and_gpu_release(s: &Store) {
    let t = tenant(s, "life").await;
    let n = node(s, &t, "n1", &[("H100", 4)]).await;
    let id = InstanceId::generate(1, rnd());
    let inst = s
        .create_instance(&id, &t, &spec(2, &["H100"]), t0())
        .await
        .unwrap();
    assert_eq!(inst.state, InstanceState::Pending);
    assert_eq!(inst.billing_class, BillingClass::Spot);
    assert_eq!(inst.env.get("A").map(String::as_str), Some("1"));
    place(s, &id, t0()).await.unwrap();
    let a = s.assignments(&n).await.unwrap();
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].gpu_indices, vec![0, 1]);
    assert_eq!(s.usage(&t).await.unwrap().gpus_total, 2);
    let later = t0() + Duration::seconds(5);
    assert_eq!(
        s.apply_observed(
            &n,
            &seen(&id, ObservedPhase::Running { pid: 42 }, later),
            later
        )
        .await
        .unwrap(),
        Applied::Changed
    );
    assert_eq!(
        s.apply_observed(
            &n,
            &seen(&id, ObservedPhase::Running { pid: 42 }, later),
            later
        )
        .await
        .unwrap(),
        Applied::Unchanged
    );
    let i = s.instance(&id).await.unwrap();
    assert_eq!(i.state, InstanceState::Running);
    assert_eq!(i.started_at, Some(later));
    let done = seen(
        &id,
        ObservedPhase::Exited {
            code: 0,
            stopped: false,
        },
        later,
    );
    s.apply_observed(&n, &done, later).await.unwrap();
    let i = s.instance(&id).await.unwrap();
    assert_eq!(i.state, InstanceState::Succeeded);
    assert_eq!(i.exit_code, Some(0));
    let states: Vec<_> = i.events.iter().map(|e| e.state).collect();
    assert_eq!(states, RAN_TO_SUCCESS);
    assert!(
        s.node(&n)
            .await
            .unwrap()
            .gpus
            .iter()
            .all(|g| g.instance_id.is_none()),
        "GPUs free again"
    );
    assert!(s.assignments(&n).await.unwrap().is_empty());
    assert!(matches!(
        s.request_stop(&id, later).await,
        Err(StoreError::Conflict(_))
    ));
    // An instance on another node is foreign to this one.
    let other = node(s, &t, "n2", &[("L4", 1)]).await;
    assert_eq!(
        s.apply_observed(&other, &done, later).await.unwrap(),
        Applied::Foreign
    );

    // Stop: pending stops at once; placed ones are flagged for the agent.
    let p = InstanceId::generate(2, rnd());
    s.create_instance(&p, &t, &spec(1, &["B200"]), t0())
        .await
        .unwrap();
    assert_eq!(
        s.request_stop(&p, t0()).await.unwrap().state,
        InstanceState::Stopped
    );
    let r = InstanceId::generate(3, rnd());
    s.create_instance(&r, &t, &spec(1, &["H100"]), t0())
        .await
        .unwrap();
    place(s, &r, t0()).await.unwrap();
    let flagged = s.request_stop(&r, t0()).await.unwrap();
    assert!(flagged.stop_requested);
    assert!(s.assignments(&n).await.unwrap()[0].stop);
    s.apply_observed(
        &n,
        &observed(
            &r,
            ObservedPhase::Exited {
                code: 143,
                stopped: true,
            },
        ),
        t0(),
    )
    .await
    .unwrap();
    assert_eq!(s.instance(&r).await.unwrap().state, InstanceState::Stopped);

    let f = InstanceId::generate(4, rnd());
    s.create_instance(&f, &t, &spec(1, &[]), t0())
        .await
        .unwrap();
    place(s, &f, t0()).await.unwrap();
    let failed = observed(
        &f,
        ObservedPhase::FailedToStart {
            reason: "no such program".into(),
        },
    );
    s.apply_observed(
        &s.instance(&f).await.unwrap().node_id.unwrap(),
        &failed,
        t0(),
    )
    .await
    .unwrap();
    let fi = s.instance(&f).await.unwrap();
    assert_eq!(fi.state, InstanceState::Failed);
    assert!(fi.state_reason.contains("no such program"));
}

async fn gpus_are_never_allocated_twice_under_races(s: &Store) {
    let t = tenant(s, "race").await;
    let n = node(s, &t, "race-node", &[("H100", 8)]).await;
    let mut ids = Vec::new();
    for i in 0..24 {
        let id = InstanceId::generate(i, rnd());
        s.create_instance(&id, &t, &spec(1, &["H100"]), t0())
            .await
            .unwrap();
        ids.push(id);
    }
    // Every task computes its plan from the same stale snapshot, so most
    // plans collide; the store must let exactly one win per GPU.
    let snap = s.placement_snapshot().await.unwrap();
    let queue = s.pending_work(1_000).await.unwrap();
    let tasks: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let s = s.clone();
            let work = queue.iter().find(|w| w.id() == *id).unwrap().clone();
            let mut snap = snap.clone();
            // Spread the plans so some succeed: task i prefers GPU i % 8.
            snap[0].gpus.rotate_left(i % 8);
            for (k, g) in snap[0].gpus.iter_mut().enumerate() {
                g.index = k as u32;
            }
            tokio::spawn(async move {
                let req = PlacementRequest {
                    gpus: 1,
                    models: vec![],
                    cpu_milli: 1,
                    memory_mb: 1,
                    share: GpuShare::Whole,
                };
                let plan = support::first_fitting(&snap, &req).unwrap();
                s.schedule_work(&work, &[plan], support::new_member, t0())
                    .await
            })
        })
        .collect();
    let mut won = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => won += 1,
            Err(StoreError::Conflict(_)) => {}
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    assert_eq!(won, 8, "exactly one winner per GPU");
    let node = s.node(&n).await.unwrap();
    let holders: std::collections::HashSet<_> = node
        .gpus
        .iter()
        .filter_map(|g| g.instance_id.clone())
        .collect();
    assert_eq!(holders.len(), 8, "eight distinct holders");
    let mut scheduled = 0;
    let mut all_gpu_ids = std::collections::HashSet::new();
    for id in &ids {
        let i = s.instance(id).await.unwrap();
        if i.state == InstanceState::Scheduled {
            scheduled += 1;
            for g in i.gpu_ids {
                assert!(all_gpu_ids.insert(g), "gpu recorded on two instances");
            }
        } else {
            assert_eq!(i.state, InstanceState::Pending, "losers stay pending");
            assert!(i.gpu_ids.is_empty());
        }
    }
    assert_eq!(scheduled, 8);
}

/// Creates `n` instances of `share` and has each place itself from the
/// same stale snapshot (task `i` preferring GPU `i % spread`), all at
/// once. Returns the instances and whether each won.
async fn race_shares(
    s: &Store,
    t: &TenantId,
    share: &GpuShare,
    n: u64,
    spread: usize,
) -> Vec<(InstanceId, bool)> {
    let mut ids = Vec::new();
    for i in 0..n {
        let id = InstanceId::generate(i, rnd());
        let spec = InstanceSpec {
            gpus: 1,
            share: share.clone(),
            ..spec(1, &["H100"])
        };
        s.create_instance(&id, t, &spec, t0()).await.unwrap();
        ids.push(id);
    }
    let snap = s.placement_snapshot().await.unwrap();
    let queue = s.pending_work(1_000).await.unwrap();
    let tasks: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let s = s.clone();
            let work = queue.iter().find(|w| w.id() == *id).unwrap().clone();
            let mut snap = snap.clone();
            let share = share.clone();
            snap[0].gpus.rotate_left(i % spread);
            for (k, g) in snap[0].gpus.iter_mut().enumerate() {
                g.index = k as u32;
            }
            tokio::spawn(async move {
                let req = PlacementRequest {
                    gpus: 1,
                    models: vec![],
                    cpu_milli: 1,
                    memory_mb: 1,
                    share,
                };
                // Where placement sees no room, ask the store anyway: its
                // own check must refuse.
                let plan = support::first_fitting(&snap, &req).unwrap_or_else(|| Placement {
                    node: snap[0].id.clone(),
                    model: "H100".into(),
                    gpus: vec![snap[0].gpus[0].id.clone()],
                    share: req.share.clone(),
                });
                s.schedule_work(&work, &[plan], support::new_member, t0())
                    .await
            })
        })
        .collect();
    let mut out = Vec::new();
    for (id, task) in ids.into_iter().zip(tasks) {
        let won = match task.await.unwrap() {
            Ok(_) => true,
            Err(StoreError::Conflict(_)) => false,
            Err(e) => panic!("unexpected error: {e}"),
        };
        out.push((id, won));
    }
    out
}

async fn fractions_never_exceed_a_gpu_under_races(s: &Store) {
    let t = tenant(s, "fractions").await;
    let n = node(s, &t, "frac-node", &[("H100", 2)]).await;
    // 0.3 each: three fit a GPU (900 milli), a fourth would make 1200.
    let third = GpuShare::Fraction { milli: 300 };
    let raced = race_shares(s, &t, &third, 12, 2).await;
    assert_eq!(raced.iter().filter(|(_, w)| *w).count(), 6, "three per GPU");
    let node = s.node(&n).await.unwrap();
    for g in &node.gpus {
        assert_eq!(g.used_milli, 900, "{}", g.id);
        assert!(g.instance_id.is_none(), "no one holds a shared GPU whole");
    }
    let mut per_gpu: BTreeMap<GpuId, u32> = BTreeMap::new();
    for (id, won) in &raced {
        let i = s.instance(id).await.unwrap();
        if *won {
            assert_eq!(i.gpu_fraction, Some(0.3));
            assert_eq!(i.gpu_slices.len(), 1);
            let slice = &i.gpu_slices[0];
            assert_eq!(slice.milli, 300);
            assert_eq!(slice.memory_limit_mib, Some(81920 * 3 / 10));
            *per_gpu.entry(slice.gpu_id.clone()).or_default() += slice.milli;
        } else {
            assert_eq!(i.state, InstanceState::Pending, "losers stay pending");
        }
    }
    assert!(per_gpu.values().all(|&m| m == 900), "{per_gpu:?}");
    // A whole GPU, a MIG instance or a share too big finds no room.
    for share in [
        GpuShare::Whole,
        mig("1g.10gb"),
        GpuShare::Fraction { milli: 101 },
    ] {
        let raced = race_shares(s, &t, &share, 1, 1).await;
        assert!(!raced[0].1, "{share:?} placed on a shared GPU");
    }
    // Ending one share gives its 300 milli back.
    let (first, _) = raced.iter().find(|(_, w)| *w).unwrap();
    let failed = observed(
        first,
        ObservedPhase::FailedToStart {
            reason: "gone".into(),
        },
    );
    s.apply_observed(&n, &failed, t0()).await.unwrap();
    let node = s.node(&n).await.unwrap();
    let used: Vec<u32> = node.gpus.iter().map(|g| g.used_milli).collect();
    assert_eq!(used.iter().sum::<u32>(), 1500, "{used:?}");
}

async fn mig_instances_never_exceed_the_geometry_under_races(s: &Store) {
    let t = tenant(s, "mig").await;
    let n = node(s, &t, "mig-node", &[("H100:mig", 1)]).await;
    // 1g.20gb takes 1 of 7 compute slices but 2 of 8 memory slices: the
    // memory runs out after four, well before 1000 milli (4 x 142).
    let raced = race_shares(s, &t, &mig("1g.20gb"), 10, 1).await;
    assert_eq!(raced.iter().filter(|(_, w)| *w).count(), 4);
    let node = s.node(&n).await.unwrap();
    assert!(node.gpus[0].mig_mode);
    assert_eq!(node.gpus[0].used_milli, 4 * 142);
    let mut devices = Vec::new();
    for (id, won) in &raced {
        let i = s.instance(id).await.unwrap();
        if *won {
            assert_eq!(i.mig_profile.as_deref(), Some("1g.20gb"));
            let slice = &i.gpu_slices[0];
            assert_eq!(slice.memory_limit_mib, Some(20 * 1024));
            devices.push(slice.mig_device.clone().unwrap());
        }
    }
    devices.sort();
    let uuid = &node.gpus[0].uuid;
    let want: Vec<String> = (1..=4).map(|gi| format!("MIG-{uuid}/{gi}/0")).collect();
    assert_eq!(devices, want, "one GPU instance number each");
    // Neither whole nor fractional work lands on a GPU in MIG mode, even
    // with compute to spare; 1g.10gb needs one memory slice and none is left.
    for share in [GpuShare::Whole, GpuShare::Fraction { milli: 100 }] {
        assert!(!race_shares(s, &t, &share, 1, 1).await[0].1, "{share:?}");
    }
    let tiny = race_shares(s, &t, &mig("1g.10gb"), 1, 1).await;
    assert!(!tiny[0].1, "memory slices are all taken");
    // Ending one frees its slot and slices for the next.
    let (first, _) = raced.iter().find(|(_, w)| *w).unwrap();
    let gone = observed(first, ObservedPhase::FailedToStart { reason: "x".into() });
    s.apply_observed(&n, &gone, t0()).await.unwrap();
    let again = race_shares(s, &t, &mig("1g.10gb"), 2, 1).await;
    assert_eq!(
        again.iter().filter(|(_, w)| *w).count(),
        2,
        "two 1-slice instances"
    );
    let node = s.node(&n).await.unwrap();
    assert_eq!(node.gpus[0].used_milli, 5 * 142);
}

async fn quota_is_enforced_at_create(s: &Store) {
    let t = tenant(s, "quota").await;
    s.set_quota(
        &t,
        &Quota {
            gpus_total: Some(3),
            gpus_per_model: BTreeMap::from([("H100".into(), 2)]),
            ..Default::default()
        },
        t0(),
    )
    .await
    .unwrap();
    s.create_instance(
        &InstanceId::generate(1, rnd()),
        &t,
        &spec(2, &["H100"]),
        t0(),
    )
    .await
    .unwrap();
    let e = s
        .create_instance(
            &InstanceId::generate(1, rnd()),
            &t,
            &spec(1, &["H100"]),
            t0(),
        )
        .await
        .unwrap_err();
    match e {
        StoreError::Quota(q) => assert_eq!(
            (q.quota.as_str(), q.limit, q.in_use),
            ("gpus_per_model.H100", 2, 2)
        ),
        other => panic!("expected quota error, got {other}"),
    }
    let e = s
        .create_instance(&InstanceId::generate(1, rnd()), &t, &spec(2, &["L4"]), t0())
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Quota(q) if q.quota == "gpus_total" && q.limit == 3));
    s.create_instance(&InstanceId::generate(1, rnd()), &t, &spec(1, &["L4"]), t0())
        .await
        .unwrap();
    let n = s
        .list_instances(Some(&t), None, &PageReq::new(None, 100))
        .await
        .unwrap()
        .items
        .len();
    assert_eq!(n, 2, "refused requests leave nothing behind");
}

/// Creates of one tenant race in parallel (on SQLite through the one
/// writer connection, on PostgreSQL on the tenant row's lock): exactly as
/// many as the quota allows get in, the others are refused with a quota
/// error, none with a database error.
async fn quota_holds_under_concurrent_creates(s: &Store) {
    let t = tenant(s, "racing").await;
    s.set_quota(
        &t,
        &Quota {
            gpus_total: Some(5),
            ..Default::default()
        },
        t0(),
    )
    .await
    .unwrap();
    let (admitted, refused) = race_creates(s, &t, 24, 0).await;
    assert_eq!((admitted, refused), (5, 19));
    let pending = s
        .list_instances(
            Some(&t),
            Some(InstanceState::Pending),
            &PageReq::new(None, 100),
        )
        .await
        .unwrap();
    assert_eq!(pending.items.len(), 5);
}

/// Races `n` creates of one GPU each for `t`: (admitted, refused by quota);
/// a refusal must name `gpus_total`, and any other failure fails the test.
async fn race_creates(s: &Store, t: &TenantId, n: u64, seed: u64) -> (u32, u32) {
    let mut racing = tokio::task::JoinSet::new();
    for i in 0..n {
        let (s, t) = (s.clone(), t.clone());
        racing.spawn(async move {
            s.create_instance(
                &InstanceId::generate(seed + i, rnd()),
                &t,
                &spec(1, &[]),
                t0(),
            )
            .await
        });
    }
    let (mut admitted, mut refused) = (0, 0);
    while let Some(done) = racing.join_next().await {
        match done.unwrap() {
            Ok(_) => admitted += 1,
            Err(StoreError::Quota(q)) => {
                assert_eq!(q.quota, "gpus_total", "{q:?}");
                refused += 1;
            }
            Err(other) => panic!("a create failed otherwise than on its quota: {other}"),
        }
    }
    (admitted, refused)
}

/// A tenant without limits creates in parallel (on PostgreSQL under a
/// shared lock of its row, so side by side): every create lands, none
/// deadlocks or fails. A limit set afterwards holds for the next race:
/// creates that read it take the serialised path and stop at it.
async fn unlimited_creates_race_freely_and_a_new_limit_holds(s: &Store) {
    let t = tenant(s, "free-racing").await;
    assert_eq!(race_creates(s, &t, 24, 5_000).await, (24, 0));
    s.set_quota(
        &t,
        &Quota {
            gpus_total: Some(30),
            ..Default::default()
        },
        t0(),
    )
    .await
    .unwrap();
    // Pending work counts against the quota: 24 held, room for 6 more.
    assert_eq!(race_creates(s, &t, 8, 6_000).await, (6, 2));
    let pending = s
        .list_instances(
            Some(&t),
            Some(InstanceState::Pending),
            &PageReq::new(None, 100),
        )
        .await
        .unwrap();
    assert_eq!(pending.items.len(), 30);
}

/// Every combination of the tenant and state filters, walked two at a
/// time, returns exactly the matching instances in id order, each with its
/// own events and no other's.
async fn instance_lists_filter_and_page_by_tenant_and_state(s: &Store) {
    let a = tenant(s, "lists-a").await;
    let b = tenant(s, "lists-b").await;
    // Interleaved ids: a's and b's alternate, and some of each end.
    let mut made: Vec<(InstanceId, TenantId, InstanceState)> = Vec::new();
    for i in 0..10u64 {
        let owner = if i % 2 == 0 { &a } else { &b };
        let id = InstanceId::generate(1000 + i, rnd());
        s.create_instance(&id, owner, &spec(1, &[]), t0())
            .await
            .unwrap();
        let state = if i % 3 == 0 {
            s.request_stop(&id, t0()).await.unwrap().state
        } else {
            InstanceState::Pending
        };
        made.push((id, owner.clone(), state));
    }
    made.sort_by(|x, y| x.0.cmp(&y.0));
    for only in [None, Some(&a), Some(&b)] {
        for state in [
            None,
            Some(InstanceState::Pending),
            Some(InstanceState::Stopped),
        ] {
            let want: Vec<InstanceId> = made
                .iter()
                .filter(|(_, t, st)| only.is_none_or(|o| o == t) && state.is_none_or(|x| x == *st))
                .map(|(id, _, _)| id.clone())
                .collect();
            let mut seen = Vec::new();
            let mut cursor = None;
            loop {
                let page = s
                    .list_instances(only, state, &PageReq::new(cursor, 2))
                    .await
                    .unwrap();
                assert!(page.items.len() <= 2);
                for i in &page.items {
                    let first = i.events.first().expect("every instance has events");
                    assert_eq!(first.state, InstanceState::Pending);
                    assert_eq!(
                        i.events.last().unwrap().state,
                        i.state,
                        "{}'s own events",
                        i.id
                    );
                }
                seen.extend(page.items.iter().map(|i| i.id.clone()));
                match page.next {
                    Some(c) => cursor = Some(c),
                    None => break,
                }
            }
            assert_eq!(seen, want, "tenant {only:?}, state {state:?}");
        }
    }
}

/// One-L40S instances `ids` of `t`, placed (on `n`, the only node with
/// room) and reported running there, at `t0()`.
async fn running_on(s: &Store, t: &TenantId, n: &NodeId, ids: &[&InstanceId]) {
    for id in ids {
        s.create_instance(id, t, &spec(1, &["L40S"]), t0())
            .await
            .unwrap();
        place(s, id, t0()).await.unwrap();
        s.apply_observed(n, &observed(id, ObservedPhase::Running { pid: 7 }), t0())
            .await
            .unwrap();
    }
}

async fn lost_instances_reattach_or_fail(s: &Store) {
    let t = tenant(s, "lost").await;
    let n = node(s, &t, "flaky", &[("L40S", 2)]).await;
    let keep = InstanceId::generate(1, rnd());
    let gone = InstanceId::generate(2, rnd());
    running_on(s, &t, &n, &[&keep, &gone]).await;
    let later = t0() + Duration::seconds(60);
    assert_eq!(s.stale_nodes(later).await.unwrap(), vec![n.clone()]);
    assert!(s.mark_node_unreachable(&n, later).await.unwrap());
    assert_eq!(s.mark_node_lost(&n, later).await.unwrap().len(), 2);
    assert!(s
        .node(&n)
        .await
        .unwrap()
        .gpus
        .iter()
        .all(|g| g.instance_id.is_none()));
    assert!(
        !s.placement_snapshot().await.unwrap()[0].ready,
        "unreachable nodes take no work"
    );
    // The agent returns and reports only `keep`.
    s.mark_node_ready(&n, later).await.unwrap();
    s.apply_observed(
        &n,
        &observed(&keep, ObservedPhase::Running { pid: 7 }),
        later,
    )
    .await
    .unwrap();
    assert_eq!(
        s.fail_unreported_lost(&n, std::slice::from_ref(&keep), later)
            .await
            .unwrap(),
        1
    );
    let k = s.instance(&keep).await.unwrap();
    assert_eq!(k.state, InstanceState::Running);
    assert_eq!(
        k.events.last().unwrap().reason,
        "node re-attached; command still running"
    );
    assert_eq!(
        s.instance(&gone).await.unwrap().state,
        InstanceState::Failed
    );
    let held: Vec<_> = s
        .node(&n)
        .await
        .unwrap()
        .gpus
        .into_iter()
        .filter_map(|g| g.instance_id)
        .collect();
    assert_eq!(held, vec![keep.clone()]);
}

/// A lost copy the server failed when its agent came back without it
/// (the agent had not yet reaped the work its fence killed) takes the exit
/// the agent reports next as its end: final still, its GPU left to whoever
/// holds it now, once only, and never later than the loss.
async fn a_late_exit_ends_a_lost_copy_at_its_kill(s: &Store) {
    let t = tenant(s, "late").await;
    let n = node(s, &t, "frozen", &[("L40S", 2)]).await;
    let at = |ms: i64| t0() + Duration::milliseconds(ms);
    let (fenced, late, done) = (
        InstanceId::generate(1, rnd()),
        InstanceId::generate(2, rnd()),
        InstanceId::generate(3, rnd()),
    );
    for id in [&fenced, &late] {
        s.create_instance(id, &t, &spec(1, &["L40S"]), t0())
            .await
            .unwrap();
        place(s, id, t0()).await.unwrap();
        s.apply_observed(
            &n,
            &seen(id, ObservedPhase::Running { pid: 7 }, at(1_000)),
            at(1_000),
        )
        .await
        .unwrap();
    }
    // Lost at the lease's end, 60 s; failed when the node returned.
    assert!(s.mark_node_unreachable(&n, at(65_000)).await.unwrap());
    assert_eq!(s.mark_node_lost(&n, at(60_000)).await.unwrap().len(), 2);
    s.mark_node_ready(&n, at(70_000)).await.unwrap();
    assert_eq!(
        s.fail_unreported_lost(&n, &[], at(70_000)).await.unwrap(),
        2
    );
    // Its GPU went to new work meanwhile.
    s.create_instance(&done, &t, &spec(2, &["L40S"]), at(70_000))
        .await
        .unwrap();
    place(s, &done, at(70_000)).await.unwrap();

    let exited = ObservedPhase::Exited {
        code: 143,
        stopped: false,
    };
    let killed = at(58_765);
    let report = seen(&fenced, exited.clone(), killed);
    assert_eq!(
        s.apply_observed(&n, &report, at(72_000)).await.unwrap(),
        Applied::Changed
    );
    let i = s.instance(&fenced).await.unwrap();
    assert_eq!(i.state, InstanceState::Failed, "not reopened");
    assert_eq!((i.exit_code, i.finished_at), (Some(143), Some(killed)));
    assert!(
        i.state_reason.contains("exit (code 143)"),
        "{}",
        i.state_reason
    );
    let states: Vec<_> = i.events.iter().map(|e| e.state).collect();
    assert_eq!(
        &states[states.len() - 2..],
        [InstanceState::Lost, InstanceState::Failed],
        "no new transition"
    );
    let held: Vec<_> = s
        .node(&n)
        .await
        .unwrap()
        .gpus
        .into_iter()
        .filter_map(|g| g.instance_id)
        .collect();
    assert_eq!(
        held,
        vec![done.clone(), done.clone()],
        "the new work keeps both GPUs"
    );
    // Resent, or sent again with another time: nothing changes.
    for again in [report.clone(), seen(&fenced, exited.clone(), at(30_000))] {
        assert_eq!(
            s.apply_observed(&n, &again, at(74_000)).await.unwrap(),
            Applied::Unchanged
        );
    }
    assert_eq!(s.instance(&fenced).await.unwrap().finished_at, Some(killed));
    // An exit after the loss bills nothing more: the bill stopped there.
    let after = seen(&late, exited, at(61_000));
    assert_eq!(
        s.apply_observed(&n, &after, at(74_000)).await.unwrap(),
        Applied::Unchanged
    );
    let l = s.instance(&late).await.unwrap();
    assert_eq!((l.exit_code, l.finished_at), (None, Some(at(70_000))));
}

/// The events metering corrects from: one tenant's, one source's, under
/// one key prefix exactly (not another instance's whose id matches it as
/// a `LIKE` pattern), ending after the time given.
async fn usage_keyed_after_reads_one_instances_events(s: &Store) {
    use flotilla_billing::meter::{EventKey, Meter, Subject, SubjectKind, UsageEvent};
    let (a, b) = (tenant(s, "keyed-a").await, tenant(s, "keyed-b").await);
    let at = |secs: i64| t0() + Duration::seconds(secs);
    let event = |t: &TenantId, source: &str, id: &str, end: i64| UsageEvent {
        key: EventKey {
            tenant: t.clone(),
            source: source.into(),
            id: id.into(),
        },
        subject: Subject {
            kind: SubjectKind::Instance,
            id: "inst_a".into(),
        },
        meter: Meter::InstanceSeconds,
        billing_class: BillingClass::OnDemand,
        start: at(0),
        end: at(end),
        amount: rust_decimal::Decimal::ONE,
        node: None,
        corrects: None,
    };
    let events = [
        event(&a, "lifecycle", "inst_a/instance/60", 120),
        event(&a, "lifecycle", "inst_a/instance/60/exit", 100),
        event(&a, "lifecycle", "inst_a/instance/0", 60),
        event(&a, "lifecycle", "instXa/instance/60", 120),
        event(&a, "lifecycle", "INST_A/instance/60", 120),
        event(&a, "agent", "inst_a/instance/60", 120),
        event(&b, "lifecycle", "inst_a/instance/60", 120),
    ];
    s.append_usage(&events, Duration::days(3), at(200))
        .await
        .unwrap();
    let got: Vec<String> = s
        .usage_keyed_after(&a, "lifecycle", "inst_a/", at(60))
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.key.id)
        .collect();
    assert_eq!(got, ["inst_a/instance/60", "inst_a/instance/60/exit"]);
}

async fn logs_are_deduplicated_by_seq(s: &Store) {
    let t = tenant(s, "logs").await;
    let id = InstanceId::generate(1, rnd());
    s.create_instance(&id, &t, &spec(1, &[]), t0())
        .await
        .unwrap();
    let lines: Vec<LogLine> = (0..1200)
        .map(|i| LogLine {
            seq: i,
            stream: if i % 2 == 0 {
                LogStream::Stdout
            } else {
                LogStream::Stderr
            },
            at: t0(),
            line: format!("line {i} with 'quotes' and ünïcode"),
        })
        .collect();
    s.append_logs(&id, &lines[..700]).await.unwrap();
    s.append_logs(&id, &lines[500..]).await.unwrap();
    let got = s.logs(&id, 0, 5000).await.unwrap();
    assert_eq!(got, lines);
    let tail = s.logs(&id, 1195, 100).await.unwrap();
    assert_eq!(tail.len(), 5);
}

async fn idempotency_keys_replay_and_detect_mismatch(s: &Store) {
    assert_eq!(
        s.claim_idempotency_key("k1", "abc", "h", t0())
            .await
            .unwrap(),
        Claim::New
    );
    assert_eq!(
        s.claim_idempotency_key("k1", "abc", "h", t0())
            .await
            .unwrap(),
        Claim::InFlight
    );
    s.complete_idempotency_key("k1", "abc", 201, "{}")
        .await
        .unwrap();
    assert_eq!(
        s.claim_idempotency_key("k1", "abc", "h", t0())
            .await
            .unwrap(),
        Claim::Done {
            status: 201,
            body: "{}".into()
        }
    );
    assert_eq!(
        s.claim_idempotency_key("k1", "abc", "other", t0())
            .await
            .unwrap(),
        Claim::Mismatch
    );
    assert_eq!(
        s.claim_idempotency_key("k2", "abc", "h", t0())
            .await
            .unwrap(),
        Claim::New,
        "scoped per caller"
    );
    s.release_idempotency_key("k2", "abc").await.unwrap();
    assert_eq!(
        s.claim_idempotency_key("k2", "abc", "h", t0())
            .await
            .unwrap(),
        Claim::New
    );
    assert_eq!(
        s.expire_idempotency_keys(t0() + Duration::hours(25))
            .await
            .unwrap(),
        2
    );
}

async fn containers_report_ports_cold_starts_and_oom_kills(s: &Store) {
    use flotilla_core::api::{ColdStart, ObservedContainer, PublishedPort};
    use flotilla_core::instance::ImageSpec;
    let t = tenant(s, "boxes").await;
    let n = node(s, &t, "n1", &[("H100", 2)]).await;
    let id = InstanceId::generate(1, rnd());
    let image = ImageSpec {
        image: "localhost/app:1".into(),
        ports: vec![8080],
        scratch_mb: Some(64),
    };
    let spec = InstanceSpec {
        image: Some(image.clone()),
        memory_mb: 32,
        ..spec(1, &["H100"])
    };
    let inst = s.create_instance(&id, &t, &spec, t0()).await.unwrap();
    assert_eq!(inst.image.as_ref(), Some(&image));
    assert!(inst.published_ports.is_empty() && inst.cold_start.is_none());
    place(s, &id, t0() + Duration::seconds(2)).await.unwrap();
    let a = s.assignments(&n).await.unwrap();
    assert_eq!(a[0].image.as_ref(), Some(&image));
    assert_eq!(a[0].tenant_id.as_ref(), Some(&t));
    assert_eq!(a[0].memory_mb, Some(32));
    // The pull's progress shows in the starting state's reason.
    let mut starting = observed(&id, ObservedPhase::Starting);
    s.apply_observed(&n, &starting, t0()).await.unwrap();
    starting.message = Some("pulling image localhost/app:1: 3 of 5 MB".into());
    s.apply_observed(&n, &starting, t0()).await.unwrap();
    let i = s.instance(&id).await.unwrap();
    assert_eq!(i.state, InstanceState::Starting);
    assert_eq!(i.state_reason, "pulling image localhost/app:1: 3 of 5 MB");
    let port = PublishedPort {
        container_port: 8080,
        host_port: 40123,
        url: "http://node-1:40123".into(),
    };
    let container = ObservedContainer {
        container_id: "c0ffee".into(),
        ports: vec![port.clone()],
        cold_start: Some(ColdStart {
            image_cached: false,
            weights_tier: None,
            pulling_ms: Some(1500),
            starting_ms: Some(300),
            ..Default::default()
        }),
        oom_killed: false,
    };
    let mut running = observed(&id, ObservedPhase::Running { pid: 0 });
    running.container = Some(container.clone());
    s.apply_observed(&n, &running, t0()).await.unwrap();
    let i = s.instance(&id).await.unwrap();
    assert_eq!(i.state, InstanceState::Running);
    assert_eq!(i.published_ports, vec![port]);
    let cold = i.cold_start.unwrap();
    assert_eq!((cold.pulling_ms, cold.starting_ms), (Some(1500), Some(300)));
    assert_eq!(cold.queued_ms, Some(2000), "creation to placement");
    let mut oom = observed(
        &id,
        ObservedPhase::Exited {
            code: 137,
            stopped: false,
        },
    );
    oom.container = Some(ObservedContainer {
        oom_killed: true,
        ..container
    });
    s.apply_observed(&n, &oom, t0()).await.unwrap();
    let i = s.instance(&id).await.unwrap();
    assert_eq!(i.state, InstanceState::Failed);
    assert!(
        i.state_reason.starts_with("out of memory"),
        "{}",
        i.state_reason
    );
    assert_eq!(i.exit_code, Some(137));
}

/// A command that ends between two agent syncs is first reported as
/// starting, then as exited: it ran, so it gets a start time and is metered
/// (it was once left unbilled, a flaky `jobs` test found it).
async fn an_exit_seen_before_running_still_counts_as_run(s: &Store) {
    let t = tenant(s, "quick").await;
    let n = node(s, &t, "n1", &[("H100", 1)]).await;
    let id = InstanceId::generate(7, rnd());
    s.create_instance(&id, &t, &spec(1, &["H100"]), t0())
        .await
        .unwrap();
    place(s, &id, t0()).await.unwrap();
    s.apply_observed(&n, &observed(&id, ObservedPhase::Starting), t0())
        .await
        .unwrap();
    assert_eq!(
        s.instance(&id).await.unwrap().state,
        InstanceState::Starting
    );
    let later = t0() + Duration::milliseconds(40);
    let exited = ObservedPhase::Exited {
        code: 0,
        stopped: false,
    };
    assert_eq!(
        s.apply_observed(&n, &seen(&id, exited, later), later)
            .await
            .unwrap(),
        Applied::Changed
    );
    let i = s.instance(&id).await.unwrap();
    assert_eq!(i.state, InstanceState::Succeeded);
    assert_eq!((i.started_at, i.finished_at), (Some(later), Some(later)));
    let states: Vec<_> = i.events.iter().map(|e| e.state).collect();
    assert_eq!(states, RAN_TO_SUCCESS);
    let to_meter = s.instances_to_meter(later, 60, None, 100).await.unwrap();
    assert!(
        to_meter.iter().any(|(i, _)| i.id == id),
        "a command that ran is metered"
    );
}

/// The time a node says a phase began (an executor reports its engine's
/// start and end times) is when the instance entered it, so usage is
/// metered from it; kept between the instance's last change and now, and
/// ignored when far outside (a node whose clock is off).
async fn observed_times_bound_metering(s: &Store) {
    let t = tenant(s, "clocks").await;
    let n = node(s, &t, "n1", &[("H100", 4)]).await;
    let secs = Duration::seconds;
    let t = &t;
    let new = |k: u64| async move {
        let id = InstanceId::generate(9, rnd() ^ u128::from(k));
        s.create_instance(&id, t, &spec(1, &["H100"]), t0())
            .await
            .unwrap();
        place(s, &id, t0()).await.unwrap();
        id
    };
    let running = ObservedPhase::Running { pid: 1 };
    let exited = ObservedPhase::Exited {
        code: 0,
        stopped: false,
    };
    // The engine's times, reported late: both are kept.
    let a = new(1).await;
    s.apply_observed(
        &n,
        &seen(&a, running.clone(), t0() + secs(3)),
        t0() + secs(10),
    )
    .await
    .unwrap();
    s.apply_observed(
        &n,
        &seen(&a, exited.clone(), t0() + secs(8)),
        t0() + secs(20),
    )
    .await
    .unwrap();
    let i = s.instance(&a).await.unwrap();
    assert_eq!(
        (i.started_at, i.finished_at),
        (Some(t0() + secs(3)), Some(t0() + secs(8)))
    );
    // A whole-second engine clock just before the placement: the placement.
    let b = new(2).await;
    s.apply_observed(
        &n,
        &seen(&b, running.clone(), t0() - secs(1)),
        t0() + secs(5),
    )
    .await
    .unwrap();
    assert_eq!(s.instance(&b).await.unwrap().started_at, Some(t0()));
    // A clock an hour off, either way: the server's time.
    let c = new(3).await;
    s.apply_observed(
        &n,
        &seen(&c, running.clone(), t0() - secs(3600)),
        t0() + secs(5),
    )
    .await
    .unwrap();
    assert_eq!(
        s.instance(&c).await.unwrap().started_at,
        Some(t0() + secs(5))
    );
    let d = new(4).await;
    s.apply_observed(&n, &seen(&d, running, t0() + secs(3600)), t0() + secs(5))
        .await
        .unwrap();
    assert_eq!(
        s.instance(&d).await.unwrap().started_at,
        Some(t0() + secs(5))
    );
}

/// Metering reads only work with something to meter: a running instance
/// once a whole slice has passed since metering last reached, and ended
/// work not yet metered to its end; pages in id order cover all of it.
/// (It read every started instance by id, 500 at most: with 500 running
/// ahead of it, ended work was never metered.)
async fn metering_reads_only_due_work_page_by_page(s: &Store) {
    let t = tenant(s, "meter").await;
    let n = node(s, &t, "n1", &[("H100", 4)]).await;
    let secs = Duration::seconds;
    let mut ids = Vec::new();
    for k in 0..3u64 {
        let id = InstanceId::generate(13, rnd() ^ u128::from(k));
        s.create_instance(&id, &t, &spec(1, &["H100"]), t0())
            .await
            .unwrap();
        place(s, &id, t0()).await.unwrap();
        let running = ObservedPhase::Running { pid: 1 };
        s.apply_observed(&n, &seen(&id, running, t0() + secs(1)), t0() + secs(1))
            .await
            .unwrap();
        ids.push(id);
    }
    ids.sort();
    let due = |now: DateTime<Utc>, limit: u32| async move {
        let mut all = Vec::new();
        let mut after: Option<InstanceId> = None;
        loop {
            let page = s
                .instances_to_meter(now, 60, after.as_ref(), limit)
                .await
                .unwrap();
            assert!(page.len() <= limit as usize);
            let Some((last, _)) = page.last() else { break };
            after = Some(last.id.clone());
            let full = page.len() == limit as usize;
            for (i, _) in &page {
                assert!(!i.events.is_empty(), "read with its events");
            }
            all.extend(page.into_iter().map(|(i, u)| (i.id, u)));
            if !full {
                break;
            }
        }
        all
    };
    // Within the first slice nothing is complete: nothing is read.
    assert!(due(t0() + secs(59), 1).await.is_empty());
    // Past its end, all three, one page at a time, in id order.
    let all: Vec<_> = due(t0() + secs(61), 1).await;
    assert_eq!(
        all.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>(),
        ids
    );
    assert!(all.iter().all(|(_, until)| until.is_none()));
    // Two metered to the boundary drop out until the next one.
    let boundary = t0() + secs(60);
    s.set_metered_until_many(&[(ids[0].clone(), boundary), (ids[1].clone(), boundary)])
        .await
        .unwrap();
    let all = due(t0() + secs(100), 2).await;
    assert_eq!(all, vec![(ids[2].clone(), None)]);
    assert_eq!(due(t0() + secs(120), 2).await.len(), 3);
    // The first ends: due until metered to its finish, whatever the time.
    let exited = ObservedPhase::Exited {
        code: 0,
        stopped: false,
    };
    s.apply_observed(&n, &seen(&ids[0], exited, t0() + secs(70)), t0() + secs(70))
        .await
        .unwrap();
    let all = due(t0() + secs(71), 2).await;
    assert_eq!(
        all,
        vec![(ids[0].clone(), Some(boundary)), (ids[2].clone(), None)]
    );
    s.set_metered_until_many(&[(ids[0].clone(), t0() + secs(70))])
        .await
        .unwrap();
    assert_eq!(due(t0() + secs(71), 2).await, vec![(ids[2].clone(), None)]);
}

/// A node's whole report in one call: what is still as recorded writes
/// nothing, a new phase or new ports are recorded, another node's and an
/// unknown instance are left alone; the answer says whether a transition
/// was recorded.
async fn a_sync_applies_what_changed_and_skips_what_did_not(s: &Store) {
    let t = tenant(s, "sync").await;
    let n = node(s, &t, "n1", &[("H100", 4)]).await;
    let secs = Duration::seconds;
    let mut ids = Vec::new();
    for k in 0..3u64 {
        let id = InstanceId::generate(14, rnd() ^ u128::from(k));
        s.create_instance(&id, &t, &spec(1, &["H100"]), t0())
            .await
            .unwrap();
        place(s, &id, t0()).await.unwrap();
        ids.push(id);
    }
    let running = |id: &InstanceId, at| seen(id, ObservedPhase::Running { pid: 9 }, at);
    // The first two run; the third is still starting.
    let first: Vec<_> = vec![
        running(&ids[0], t0() + secs(1)),
        running(&ids[1], t0() + secs(1)),
    ];
    assert!(s
        .apply_observed_all(&n, &first, t0() + secs(1))
        .await
        .unwrap());
    let events = |id: InstanceId| async move { s.instance(&id).await.unwrap().events.len() };
    let before = [events(ids[0].clone()).await, events(ids[1].clone()).await];
    // Nothing new: no transition, no event, whatever the time.
    let later = t0() + secs(30);
    let same = vec![
        running(&ids[0], t0() + secs(1)),
        running(&ids[1], t0() + secs(1)),
    ];
    assert!(!s.apply_observed_all(&n, &same, later).await.unwrap());
    assert_eq!(
        [events(ids[0].clone()).await, events(ids[1].clone()).await],
        before
    );
    // New ports of a running one are recorded (not a transition); the
    // third starts running; another node's and an unknown instance are
    // not this node's to change.
    let mut ported = running(&ids[0], t0() + secs(1));
    ported.container = Some(ObservedContainer {
        container_id: "c0".into(),
        ports: vec![PublishedPort {
            container_port: 8000,
            host_port: 31000,
            url: "http://n1:31000".into(),
        }],
        cold_start: None,
        oom_killed: false,
    });
    let other = node(s, &t, "n2", &[("L4", 1)]).await;
    let unknown = InstanceId::generate(15, rnd());
    let report = vec![
        ported,
        running(&ids[1], t0() + secs(1)),
        running(&ids[2], later),
        running(&unknown, later),
    ];
    assert!(s.apply_observed_all(&n, &report, later).await.unwrap());
    let i0 = s.instance(&ids[0]).await.unwrap();
    assert_eq!(i0.published_ports.len(), 1);
    assert_eq!(i0.published_ports[0].host_port, 31000);
    assert_eq!(i0.events.len(), before[0]);
    assert_eq!(
        s.instance(&ids[2]).await.unwrap().state,
        InstanceState::Running
    );
    assert!(matches!(
        s.instance(&unknown).await,
        Err(StoreError::NotFound(_))
    ));
    // Reported by the wrong node: nothing happens to it.
    let exited = ObservedPhase::Exited {
        code: 0,
        stopped: false,
    };
    let elsewhere = vec![seen(&ids[1], exited, later)];
    assert!(!s
        .apply_observed_all(&other, &elsewhere, later)
        .await
        .unwrap());
    assert_eq!(
        s.instance(&ids[1]).await.unwrap().state,
        InstanceState::Running
    );
    // The same report again: the ports are as stored, nothing to write.
    let again = vec![report[0].clone()];
    assert!(!s.apply_observed_all(&n, &again, later).await.unwrap());
    assert!(!s.apply_observed_all(&n, &[], later).await.unwrap());
}

/// An exit that is the first report of a run (a 0.5 s Slurm job over
/// between two bridge rounds) carries the run's start: the run is metered
/// from it, not from the exit (which billed nothing). A whole-second
/// engine start just before the server's record of the start of starting,
/// in the same second, stands; a start from a clock far off is ignored. A
/// stop with a start ran; one without never did.
async fn an_exit_with_its_start_is_metered_from_it(s: &Store) {
    let t = tenant(s, "short").await;
    let n = node(s, &t, "n1", &[("H100", 4)]).await;
    let ms = Duration::milliseconds;
    let t = &t;
    let new = |k: u64| async move {
        let id = InstanceId::generate(11, rnd() ^ u128::from(k));
        s.create_instance(&id, t, &spec(1, &["H100"]), t0())
            .await
            .unwrap();
        place(s, &id, t0()).await.unwrap();
        id
    };
    let exit =
        |id: &InstanceId, stopped: bool, start: Option<DateTime<Utc>>, at| ObservedInstance {
            started_at: start,
            ..seen(id, ObservedPhase::Exited { code: 0, stopped }, at)
        };
    // Starting recorded at t0 + 300 ms; Slurm's start is t0 (its whole
    // second), its end t0 + 1 s, reported at t0 + 1.8 s.
    let a = new(1).await;
    s.apply_observed(
        &n,
        &seen(&a, ObservedPhase::Starting, t0() + ms(300)),
        t0() + ms(300),
    )
    .await
    .unwrap();
    let done = exit(&a, false, Some(t0()), t0() + ms(1000));
    assert_eq!(
        s.apply_observed(&n, &done, t0() + ms(1800)).await.unwrap(),
        Applied::Changed
    );
    let i = s.instance(&a).await.unwrap();
    assert_eq!(i.state, InstanceState::Succeeded);
    assert_eq!(
        (i.started_at, i.finished_at),
        (Some(t0()), Some(t0() + ms(1000))),
        "metered from the reported start: 1 s, not 0"
    );
    let states: Vec<_> = i.events.iter().map(|e| e.state).collect();
    assert_eq!(states, RAN_TO_SUCCESS);
    // Straight from scheduled (no report before the exit) likewise.
    let b = new(2).await;
    let done = exit(&b, false, Some(t0() + ms(250)), t0() + ms(750));
    s.apply_observed(&n, &done, t0() + ms(900)).await.unwrap();
    let i = s.instance(&b).await.unwrap();
    assert_eq!(
        (i.started_at, i.finished_at),
        (Some(t0() + ms(250)), Some(t0() + ms(750)))
    );
    // A start from a clock an hour off: not trusted, the exit stands.
    let c = new(3).await;
    let done = exit(&c, false, Some(t0() - Duration::hours(1)), t0() + ms(500));
    s.apply_observed(&n, &done, t0() + ms(600)).await.unwrap();
    let i = s.instance(&c).await.unwrap();
    assert_eq!(
        (i.started_at, i.finished_at),
        (Some(t0() + ms(500)), Some(t0() + ms(500)))
    );
    // Cancelled after it ran: stopped, and metered from its start.
    let d = new(4).await;
    let done = exit(&d, true, Some(t0() + ms(100)), t0() + ms(1100));
    s.apply_observed(&n, &done, t0() + ms(1200)).await.unwrap();
    let i = s.instance(&d).await.unwrap();
    assert_eq!(i.state, InstanceState::Stopped);
    assert_eq!(
        (i.started_at, i.finished_at),
        (Some(t0() + ms(100)), Some(t0() + ms(1100)))
    );
    // Cancelled before it ran: stopped, never started, nothing to meter.
    let e = new(5).await;
    let done = exit(&e, true, None, t0() + ms(400));
    s.apply_observed(&n, &done, t0() + ms(500)).await.unwrap();
    let i = s.instance(&e).await.unwrap();
    assert_eq!((i.state, i.started_at), (InstanceState::Stopped, None));
}

async fn gpu_faults_cordons_drains_and_node_events(s: &Store) {
    let t = tenant(s, "health").await;
    let n = node(s, &t, "hn", &[("H100", 2)]).await;
    let gpus = s.node(&n).await.unwrap().gpus;
    let (g0, g1) = (gpus[0].id.clone(), gpus[1].id.clone());

    // A fault takes the GPU out of placement, once, with an event.
    let later = t0() + Duration::seconds(1);
    assert!(s
        .set_gpu_fault(&n, &g1, Some("xid error 79"), later)
        .await
        .unwrap());
    assert!(!s
        .set_gpu_fault(&n, &g1, Some("xid error 48"), later)
        .await
        .unwrap());
    let seen = s.node(&n).await.unwrap();
    assert_eq!(
        seen.gpus[1].fault.as_deref(),
        Some("xid error 79"),
        "first fault kept"
    );
    assert_eq!(seen.gpus[0].fault, None);
    let snap = s.placement_snapshot().await.unwrap();
    let slots = &snap.iter().find(|x| x.id == n).unwrap().gpus;
    assert!(slots[0].free && !slots[1].free);
    assert_eq!(slots[1].free_milli, 0);
    // Two GPUs wanted, one offered: no fit.
    let id = InstanceId::generate(1, rnd());
    s.create_instance(&id, &t, &spec(2, &["H100"]), t0())
        .await
        .unwrap();
    assert!(place(s, &id, later).await.is_err());
    // A GPU of another node is not this node's to reset.
    let other = node(s, &t, "hn2", &[("H100", 1)]).await;
    assert!(!s.set_gpu_fault(&other, &g1, None, later).await.unwrap());
    assert!(s.set_gpu_fault(&n, &g1, None, later).await.unwrap());
    place(s, &id, later).await.unwrap();

    // Cordon and drain.
    s.set_node_cordoned(&n, true).await.unwrap();
    assert!(s.node(&n).await.unwrap().cordoned);
    s.set_node_cordoned(&n, false).await.unwrap();
    assert!(!s.node(&n).await.unwrap().cordoned);
    assert!(matches!(
        s.set_node_cordoned(&NodeId::generate(1, rnd()), true).await,
        Err(StoreError::NotFound(_))
    ));
    let stopping = s.drain_node(&n, later).await.unwrap();
    assert_eq!(stopping, vec![id.clone()]);
    assert!(s.node(&n).await.unwrap().cordoned);
    let inst = s.instance(&id).await.unwrap();
    assert!(inst.stop_requested);
    assert!(s.assignments(&n).await.unwrap()[0].stop);
    // Draining again asks nothing new.
    assert!(s.drain_node(&n, later).await.unwrap().is_empty());
    s.add_node_event(&n, "uncordoned", "by test", later)
        .await
        .unwrap();

    let events = s.node_events(&n, 0, 100).await.unwrap();
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        ["gpu_fault", "gpu_reset", "drained", "drained", "uncordoned"]
    );
    assert_eq!(
        events.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5]
    );
    assert_eq!(events[0].gpu_id.as_ref(), Some(&g1));
    assert_eq!(events[0].at, later);
    assert_eq!(s.node_events(&n, 3, 1).await.unwrap()[0].seq, 4);
    assert!(s.node_events(&other, 0, 10).await.unwrap().is_empty());
    let _ = g0;
}

async fn fleet_counts_for_metrics(s: &Store) {
    let t = tenant(s, "fleet").await;
    assert_eq!(
        s.queue_stats()
            .await
            .unwrap()
            .iter()
            .map(|q| (q.kind, q.depth, q.oldest))
            .collect::<Vec<_>>(),
        [("instance", 0, None), ("job", 0, None)]
    );
    let _n = node(s, &t, "fn", &[("H100", 1)]).await;
    let a = InstanceId::generate(1, rnd());
    let b = InstanceId::generate(2, rnd());
    s.create_instance(&a, &t, &spec(1, &["H100"]), t0())
        .await
        .unwrap();
    s.create_instance(&b, &t, &spec(1, &["H100"]), t0() + Duration::seconds(3))
        .await
        .unwrap();
    place(s, &a, t0() + Duration::seconds(4)).await.unwrap();
    let q = s.queue_stats().await.unwrap();
    assert_eq!(
        (q[0].kind, q[0].depth, q[0].oldest),
        ("instance", 1, Some(t0() + Duration::seconds(3)))
    );
    let work = s.tenant_work().await.unwrap();
    let mine: Vec<(String, u64, u64)> = work
        .iter()
        .filter(|w| w.tenant == t)
        .map(|w| (w.state.clone(), w.instances, w.gpus))
        .collect();
    assert_eq!(
        mine,
        [
            ("pending".to_string(), 1, 1),
            ("scheduled".to_string(), 1, 1)
        ]
    );
    assert!(s.endpoint_targets().await.unwrap().is_empty());
    assert!(s.budget_alert_levels().await.unwrap().is_empty());
}

/// The disk limit an instance asked for reaches its node's agent; an exit
/// the agent reports as past a limit ends the instance with that reason;
/// what a node cannot enforce is kept with it.
async fn limits_reach_the_agent_and_name_why_work_ended(s: &Store) {
    let t = tenant(s, "limits").await;
    let n = node(s, &t, "lim", &[("H100", 2)]).await;
    assert!(s.node(&n).await.unwrap().unenforced_limits.is_empty());
    let mut ids = Vec::new();
    for (disk_mb, exceeded) in [
        (Some(512), Some(LimitExceeded::Disk)),
        (None, Some(LimitExceeded::Memory)),
    ] {
        let id = InstanceId::generate(3, rnd());
        let mut sp = spec(1, &["H100"]);
        sp.disk_mb = disk_mb;
        let inst = s.create_instance(&id, &t, &sp, t0()).await.unwrap();
        assert_eq!(inst.disk_mb, disk_mb);
        place(s, &id, t0()).await.unwrap();
        ids.push((id, disk_mb, exceeded));
    }
    let assigned = s.assignments(&n).await.unwrap();
    for (id, disk_mb, _) in &ids {
        let a = assigned.iter().find(|a| &a.instance_id == id).unwrap();
        assert_eq!(a.disk_mb, *disk_mb);
    }
    for (id, _, exceeded) in &ids {
        let mut o = observed(
            id,
            ObservedPhase::Exited {
                code: 137,
                stopped: false,
            },
        );
        o.limit_exceeded = *exceeded;
        s.apply_observed(&n, &o, t0()).await.unwrap();
    }
    let disk = s.instance(&ids[0].0).await.unwrap();
    assert_eq!(disk.state, InstanceState::Failed);
    assert!(
        disk.state_reason.starts_with("disk limit exceeded"),
        "{}",
        disk.state_reason
    );
    let oom = s.instance(&ids[1].0).await.unwrap();
    assert_eq!(oom.state, InstanceState::Failed);
    assert!(
        oom.state_reason.starts_with("out of memory"),
        "{}",
        oom.state_reason
    );

    // Re-registering says what it cannot enforce; a later one that can
    // clears it.
    let register = |unenforced: Vec<String>| RegisterNode {
        name: "lim".into(),
        region: None,
        pool: None,
        cpu_milli: 64_000,
        memory_mb: 512_000,
        simulated: true,
        gpus: (0..2)
            .map(|index| DiscoveredGpu {
                index,
                model: "H100".into(),
                uuid: format!("GPU-lim-{index}"),
                memory_mib: 81920,
                vendor: Vendor::Nvidia,
                mig_mode: false,
            })
            .collect(),
        agent_version: "test".into(),
        runtime: Default::default(),
        executor: Default::default(),
        running: Vec::new(),
        unenforced_limits: unenforced,
        network: None,
    };
    let why = vec!["memory: no cgroup v1 `memory` tree is mounted".to_string()];
    let ids = || {
        (
            NodeId::generate(1, rnd()),
            (0..2).map(|_| GpuId::generate(1, rnd())).collect(),
        )
    };
    s.register_node(&t, &register(why.clone()), ids, t0())
        .await
        .unwrap();
    assert_eq!(s.node(&n).await.unwrap().unenforced_limits, why);
    s.register_node(&t, &register(Vec::new()), ids, t0())
        .await
        .unwrap();
    assert!(s.node(&n).await.unwrap().unenforced_limits.is_empty());
}

/// What billing's reconciliation reads over a window: every tenant's GPU-
/// and instance-second events touching it (not requests, not events outside
/// it), and the instances running at some time in it, with their events.
async fn reconciliation_reads_time_meters_and_runs_in_a_window(s: &Store) {
    use flotilla_billing::meter::{EventKey, Meter, Subject, SubjectKind, UsageEvent};
    use rust_decimal::Decimal;
    let (a, b) = (tenant(s, "rec-a").await, tenant(s, "rec-b").await);
    let n = node(s, &a, "n1", &[("H100", 2)]).await;
    let at = |secs: i64| t0() + Duration::seconds(secs);
    let event = |t: &TenantId, id: &str, meter: Meter, start: i64, end: i64| UsageEvent {
        key: EventKey {
            tenant: t.clone(),
            source: "lifecycle".into(),
            id: id.into(),
        },
        subject: Subject {
            kind: SubjectKind::Instance,
            id: "inst_x".into(),
        },
        meter,
        billing_class: BillingClass::OnDemand,
        start: at(start),
        end: at(end),
        amount: Decimal::ONE,
        node: None,
        corrects: None,
    };
    let gpu = || Meter::GpuSeconds {
        model: "H100".into(),
        share: GpuShare::Whole,
    };
    let events = [
        event(&a, "in-gpu", gpu(), 60, 120),
        event(&b, "in-inst", Meter::InstanceSeconds, 110, 200),
        event(&a, "requests", Meter::Requests, 60, 120),
        event(&a, "before", Meter::InstanceSeconds, 0, 100),
        event(&b, "after", Meter::InstanceSeconds, 300, 360),
    ];
    s.append_usage(&events, Duration::days(3), at(400))
        .await
        .unwrap();
    let mut got: Vec<String> = s
        .time_usage_between(at(100), at(300))
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.key.id)
        .collect();
    got.sort();
    assert_eq!(got, ["in-gpu", "in-inst"]);

    // One instance runs 10 s to 50 s, another from 20 s on; a third never
    // starts.
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = InstanceId::generate(1, rnd());
        s.create_instance(&id, &a, &spec(1, &["H100"]), t0())
            .await
            .unwrap();
        ids.push(id);
    }
    for (id, start) in ids.iter().take(2).zip([10, 20]) {
        place(s, id, t0()).await.unwrap();
        s.apply_observed(
            &n,
            &seen(id, ObservedPhase::Running { pid: 1 }, at(start)),
            at(start),
        )
        .await
        .unwrap();
    }
    let done = ObservedPhase::Exited {
        code: 0,
        stopped: false,
    };
    s.apply_observed(&n, &seen(&ids[0], done, at(50)), at(50))
        .await
        .unwrap();
    let ran = |from: i64, to: i64| async move {
        let list = s.instances_ran_between(at(from), at(to)).await.unwrap();
        assert!(list.iter().all(|i| !i.events.is_empty()), "{list:?}");
        list.into_iter().map(|i| i.id).collect::<Vec<_>>()
    };
    let mut both = vec![ids[0].clone(), ids[1].clone()];
    both.sort();
    assert_eq!(ran(0, 100).await, both);
    assert_eq!(ran(60, 100).await, vec![ids[1].clone()]);
    assert_eq!(ran(0, 10).await, Vec::<InstanceId>::new());
}

/// The server's grouped heartbeats (`heartbeat_many`): one statement sets
/// every named node's last heartbeat, a node named twice keeps its latest
/// time, an unknown node is left out of the answer (the sync then says
/// `NotFound`), and each node's state before is returned as one
/// `heartbeat` would.
async fn heartbeats_in_one_statement_keep_the_latest_and_skip_unknown_nodes(s: &Store) {
    let owner = tenant(s, "beats").await;
    let a = node(s, &owner, "beat-a", &[("H100", 1)]).await;
    let b = node(s, &owner, "beat-b", &[("H100", 1)]).await;
    let ghost = NodeId::generate(1, rnd());
    // b goes unreachable: its state before the heartbeat says so.
    assert!(s
        .mark_node_unreachable(&b, t0() + Duration::seconds(60))
        .await
        .unwrap());
    let t1 = t0() + Duration::seconds(70);
    let t2 = t0() + Duration::seconds(75);
    let states = s
        .heartbeat_many(&[
            (a.clone(), t2),
            (b.clone(), t1),
            (ghost.clone(), t1),
            (a.clone(), t1),
        ])
        .await
        .unwrap();
    assert_eq!(states.len(), 2, "{states:?}");
    assert_eq!(states[&a], flotilla_core::node::NodeState::Ready);
    assert_eq!(states[&b], flotilla_core::node::NodeState::Unreachable);
    assert!(!states.contains_key(&ghost));
    assert_eq!(
        s.node(&a).await.unwrap().last_heartbeat_at,
        t2,
        "the latest of a's two"
    );
    assert_eq!(s.node(&b).await.unwrap().last_heartbeat_at, t1);
    // More than one statement's worth (500 per statement) still lands.
    let many: Vec<_> = (0..1_200)
        .map(|i| {
            (
                if i % 2 == 0 { a.clone() } else { b.clone() },
                t2 + Duration::milliseconds(i),
            )
        })
        .collect();
    let states = s.heartbeat_many(&many).await.unwrap();
    assert_eq!(states.len(), 2);
    assert_eq!(
        s.node(&b).await.unwrap().last_heartbeat_at,
        t2 + Duration::milliseconds(1_199)
    );
}

/// A pass writes its placements a batch per commit: one that loses a race
/// inside the batch (its GPU went to an earlier one of the same batch)
/// leaves nothing behind and stays waiting, while the others stand.
async fn a_batch_of_placements_keeps_the_rest_when_one_loses_a_race(s: &Store) {
    let t = tenant(s, "batch").await;
    node(s, &t, "n1", &[("H100", 2)]).await;
    let mut ids = Vec::new();
    for k in 0..3u64 {
        let id = InstanceId::generate(16, rnd() ^ u128::from(k));
        s.create_instance(&id, &t, &spec(1, &["H100"]), t0())
            .await
            .unwrap();
        ids.push(id);
    }
    let snap = s.placement_snapshot().await.unwrap();
    let gpus: Vec<GpuId> = snap[0].gpus.iter().map(|g| g.id.clone()).collect();
    let on = |gpu: &GpuId| Placement {
        node: snap[0].id.clone(),
        model: "H100".into(),
        gpus: vec![gpu.clone()],
        share: GpuShare::Whole,
    };
    // The second asks for the GPU the first takes.
    let plans = [on(&gpus[0]), on(&gpus[0]), on(&gpus[1])];
    let mut works = Vec::new();
    for id in &ids {
        works.push(support::waiting(s, id.clone()).await);
    }
    let batch: Vec<_> = works
        .iter()
        .zip(&plans)
        .map(|(w, p)| (w, std::slice::from_ref(p)))
        .collect();
    let out = s
        .schedule_works(&batch, support::new_member, t0())
        .await
        .unwrap();
    assert_eq!(out.len(), 3);
    assert_eq!(out[0].as_ref().unwrap(), &vec![ids[0].clone()]);
    assert!(
        matches!(out[1], Err(StoreError::Conflict(_))),
        "{:?}",
        out[1]
    );
    assert_eq!(out[2].as_ref().unwrap(), &vec![ids[2].clone()]);
    let mut states = Vec::new();
    for id in &ids {
        states.push(s.instance(id).await.unwrap().state);
    }
    assert_eq!(
        states,
        [
            InstanceState::Scheduled,
            InstanceState::Pending,
            InstanceState::Scheduled
        ]
    );
    let loser = s.instance(&ids[1]).await.unwrap();
    assert_eq!(loser.events.len(), 1, "the loser's write left nothing");
    assert!(loser.gpu_ids.is_empty());
    let n = s.node(&snap[0].id).await.unwrap();
    let holders: Vec<_> = n.gpus.iter().map(|g| g.instance_id.clone()).collect();
    assert_eq!(holders, [Some(ids[0].clone()), Some(ids[2].clone())]);
    // The loser is placed by a later batch, once the winner's GPU is free.
    let done = ObservedPhase::Exited {
        code: 0,
        stopped: false,
    };
    for phase in [ObservedPhase::Running { pid: 9 }, done] {
        s.apply_observed(&snap[0].id, &observed(&ids[0], phase), t0())
            .await
            .unwrap();
    }
    assert_eq!(
        s.instance(&ids[0]).await.unwrap().state,
        InstanceState::Succeeded
    );
    let again = support::waiting(s, ids[1].clone()).await;
    let retry = s
        .schedule_works(
            &[(&again, std::slice::from_ref(&plans[1]))],
            support::new_member,
            t0(),
        )
        .await
        .unwrap();
    assert!(retry[0].is_ok(), "{:?}", retry[0]);
}

/// A node's whole report is written in one transaction. A lost instance
/// whose GPU another took while its node was away cannot come back, and
/// nothing of its report stands; the other reports of the same sync do.
async fn one_sync_writes_together_and_a_taken_gpu_costs_only_its_own_report(s: &Store) {
    let t = tenant(s, "together").await;
    let n = node(s, &t, "flaky", &[("L40S", 2)]).await;
    let a = InstanceId::generate(17, rnd());
    let b = InstanceId::generate(18, rnd());
    running_on(s, &t, &n, &[&a, &b]).await;
    let later = t0() + Duration::seconds(60);
    assert!(s.mark_node_unreachable(&n, later).await.unwrap());
    assert_eq!(s.mark_node_lost(&n, later).await.unwrap().len(), 2);
    s.mark_node_ready(&n, later).await.unwrap();
    // New work takes one of the two GPUs while both are lost.
    let newer = InstanceId::generate(19, rnd());
    s.create_instance(&newer, &t, &spec(1, &["L40S"]), later)
        .await
        .unwrap();
    place(s, &newer, later).await.unwrap();
    let took = s.instance(&newer).await.unwrap().gpu_ids;
    let (taken, kept) = if s.instance(&a).await.unwrap().gpu_ids == took {
        (a.clone(), b.clone())
    } else {
        (b.clone(), a.clone())
    };
    let events_before = s.instance(&taken).await.unwrap().events.len();
    // The agent returns; its one sync reports both, the taken one first
    // and with new ports (a write that must not stand either).
    let back = later + Duration::seconds(5);
    let mut first = seen(&taken, ObservedPhase::Running { pid: 7 }, t0());
    first.container = Some(ObservedContainer {
        container_id: "c1".into(),
        ports: vec![PublishedPort {
            container_port: 8000,
            host_port: 31001,
            url: "http://flaky:31001".into(),
        }],
        cold_start: None,
        oom_killed: false,
    });
    let report = vec![first, seen(&kept, ObservedPhase::Running { pid: 8 }, t0())];
    assert!(s.apply_observed_all(&n, &report, back).await.unwrap());
    let k = s.instance(&kept).await.unwrap();
    assert_eq!(k.state, InstanceState::Running);
    let l = s.instance(&taken).await.unwrap();
    assert_eq!(l.state, InstanceState::Lost);
    assert_eq!(l.events.len(), events_before);
    assert!(l.published_ports.is_empty(), "{:?}", l.published_ports);
    let holders: BTreeMap<GpuId, Option<InstanceId>> = s
        .node(&n)
        .await
        .unwrap()
        .gpus
        .into_iter()
        .map(|g| (g.id, g.instance_id))
        .collect();
    assert_eq!(holders.get(&took[0]), Some(&Some(newer.clone())));
    assert_eq!(
        holders
            .values()
            .filter(|h| h.as_ref() == Some(&kept))
            .count(),
        1
    );
}
