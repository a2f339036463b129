//! A deposed leader's passes write nothing: the loops of a replica that
//! lost the leader lease (paused past it, say) run on a store fenced with
//! its old token, so the placement it decided and the node it would
//! declare lost are refused by the database, on SQLite and PostgreSQL,
//! while the new leader's same passes go through.

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::{Duration, TimeZone, Utc};
use flotilla_core::api::{DiscoveredGpu, RegisterNode};
use flotilla_core::catalog::Vendor;
use flotilla_core::clock::ManualClock;
use flotilla_core::id::{GpuId, InstanceId, NodeId, TenantId};
use flotilla_core::instance::{BillingClass, InstanceSpec, InstanceState};
use flotilla_core::placement::GpuShare;
use flotilla_server::reconcile::liveness_pass;
use flotilla_server::schedule::schedule_pass;
use flotilla_server::state::AppState;
use flotilla_server::ServerConfig;
use flotilla_store::leases::LEADER;
use flotilla_store::{Store, StoreError};

flotilla_testkit::backend_suite!(
    "leader":
    a_deposed_leader_cannot_place_or_declare_nodes_lost,
);

async fn a_deposed_leader_cannot_place_or_declare_nodes_lost(s: &Store) {
    let t0 = Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap();
    let clock = ManualClock::new(t0);
    let (_stop, rx) = tokio::sync::watch::channel(false);
    let config = ServerConfig::default();
    let ttl = Duration::from_std(config.leader_lease()).unwrap();
    let st = AppState::new(s.clone(), config.clone(), Arc::new(clock.clone()), rx);

    let tenant = TenantId::generate(1, 1);
    s.create_tenant(&tenant, "fenced", t0).await.unwrap();
    let node = RegisterNode {
        name: "n1".into(),
        region: None,
        pool: None,
        cpu_milli: 64_000,
        memory_mb: 512_000,
        simulated: true,
        gpus: vec![DiscoveredGpu {
            index: 0,
            model: "H100".into(),
            uuid: "GPU-n1-0".into(),
            memory_mib: 81920,
            vendor: Vendor::Nvidia,
            mig_mode: false,
        }],
        agent_version: "test".into(),
        runtime: Default::default(),
        executor: Default::default(),
        running: Vec::new(),
        unenforced_limits: Vec::new(),
        network: None,
    };
    let node_id = s
        .register_node(
            &tenant,
            &node,
            || (NodeId::generate(1, 2), vec![GpuId::generate(1, 3)]),
            t0,
        )
        .await
        .unwrap()
        .id;
    let id = InstanceId::generate(1, 4);
    let spec = InstanceSpec {
        name: None,
        gpus: 1,
        gpu_types: vec![],
        cpu_milli: 1000,
        memory_mb: 1024,
        command: vec!["true".into()],
        env: BTreeMap::new(),
        workdir: None,
        billing_class: BillingClass::OnDemand,
        priority: 0,
        tier: 1,
        preemptible: false,
        share: GpuShare::Whole,
        image: None,
        disk_mb: None,
    };
    s.create_instance(&id, &tenant, &spec, t0).await.unwrap();

    // The old leader's term; then it stalls past its lease and another
    // replica takes over.
    let old = s.acquire_lease(LEADER, "old", ttl, t0).await.unwrap();
    let deposed = st.fenced(old.token);
    clock.advance(ttl + Duration::seconds(1));
    let new = s.acquire_lease(LEADER, "new", ttl, st.now()).await.unwrap();
    assert!(new.held_by("new", st.now()) && new.token > old.token);

    // Its placement pass decides, and its write is refused.
    match schedule_pass(&deposed).await {
        Err(StoreError::Fenced { token, current, .. }) => {
            assert_eq!((token, current), (old.token, Some(new.token)));
        }
        other => panic!("a deposed leader's placement must be refused, got {other:?}"),
    }
    let inst = s.instance(&id).await.unwrap();
    assert_eq!(inst.state, InstanceState::Pending);
    assert!(inst.node_id.is_none() && inst.gpu_ids.is_empty());

    // The new leader places it.
    let leader = st.fenced(new.token);
    assert_eq!(schedule_pass(&leader).await.unwrap(), 1);
    assert_eq!(
        s.instance(&id).await.unwrap().state,
        InstanceState::Scheduled
    );

    // The node falls silent past its lease: the deposed leader cannot
    // declare it (or its work) lost; the leader can.
    clock.advance(
        Duration::from_std(config.node_lease() + config.node_lease_margin()).unwrap()
            + Duration::seconds(1),
    );
    assert!(matches!(
        liveness_pass(&deposed).await,
        Err(StoreError::Fenced { .. })
    ));
    assert_eq!(
        s.instance(&id).await.unwrap().state,
        InstanceState::Scheduled
    );
    // Fencing is by token: the leader's lease ran out on the manual clock
    // meanwhile, but nobody took it, so its writes still go through.
    assert_eq!(liveness_pass(&leader).await.unwrap(), 1);
    let lost = s.instance(&id).await.unwrap();
    assert_eq!(lost.state, InstanceState::Lost);
    // Lost as of the end of its node's lease (registration counts as the
    // last heartbeat), not when the pass noticed.
    let lease_end = t0 + Duration::from_std(config.node_lease()).unwrap();
    assert_eq!(lost.events.last().map(|e| e.at), Some(lease_end));
    assert_eq!(
        s.node(&node_id).await.unwrap().state,
        flotilla_core::node::NodeState::Unreachable
    );
}
