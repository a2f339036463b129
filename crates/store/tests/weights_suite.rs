//! A node's reported model weights, on every backend: a report replaces
//! what was stored (unchanged reports write nothing), the parks a report
//! no longer holds are the ones that ended, and placement reads each
//! key's fastest tier per node.

use chrono::Duration;
use flotilla_core::api::{NodeWeights, RegisterNode, WeightTier};
use flotilla_core::id::{EndpointId, InstanceId, NodeId, TenantId};
use flotilla_store::Store;
use flotilla_testdb::{rnd, t0};

flotilla_testdb::backend_suite!(
    "weights":
    a_report_replaces_the_stored_weights_and_ended_parks_are_named,
);

async fn node(s: &Store) -> NodeId {
    let t = TenantId::generate(1, rnd());
    s.create_tenant(&t, &format!("t{}", rnd()), t0())
        .await
        .unwrap();
    let req = RegisterNode {
        name: format!("w-node-{}", rnd()),
        region: None,
        pool: None,
        cpu_milli: 8_000,
        memory_mb: 16_000,
        simulated: true,
        gpus: Vec::new(),
        agent_version: "test".into(),
        runtime: Default::default(),
        executor: Default::default(),
        running: Vec::new(),
        unenforced_limits: Vec::new(),
        network: None,
    };
    s.register_node(&t, &req, || (NodeId::generate(1, rnd()), Vec::new()), t0())
        .await
        .unwrap()
        .id
}

async fn a_report_replaces_the_stored_weights_and_ended_parks_are_named(s: &Store) {
    let n = node(s).await;
    let ep = EndpointId::generate(1, rnd());
    let key = format!("{ep}-r1");
    let cached = NodeWeights {
        key: key.clone(),
        tier: WeightTier::Cached,
        size_bytes: 16_000_000_000,
        since: t0(),
        replica: None,
        endpoint_id: None,
    };
    let park = |r: InstanceId, at: i64| NodeWeights {
        key: key.clone(),
        tier: WeightTier::Parked,
        size_bytes: 16_000_000_000,
        since: t0() + Duration::milliseconds(at),
        replica: Some(r),
        endpoint_id: Some(ep.clone()),
    };
    let (r1, r2) = (
        InstanceId::generate(1, rnd()),
        InstanceId::generate(2, rnd()),
    );
    let first = vec![
        cached.clone(),
        park(r1.clone(), 1500),
        park(r2.clone(), 2500),
    ];
    assert!(s.parks_ended(&n, &first).await.unwrap().is_empty());
    assert!(s.set_node_weights(&n, &first, t0()).await.unwrap());
    assert!(
        !s.set_node_weights(&n, &first, t0()).await.unwrap(),
        "unchanged"
    );
    assert_eq!(s.node(&n).await.unwrap().weights.len(), 3);
    let by_node = s.weights_by_node().await.unwrap();
    assert_eq!(by_node[&n][&key], WeightTier::Parked, "the fastest tier");
    // r1 was taken back onto a GPU: the next report lacks it.
    let next = vec![cached.clone(), park(r2.clone(), 2500)];
    let ended = s.parks_ended(&n, &next).await.unwrap();
    assert_eq!(ended, vec![park(r1, 1500)]);
    assert!(s.set_node_weights(&n, &next, t0()).await.unwrap());
    // Only the disk copy left.
    s.set_node_weights(&n, std::slice::from_ref(&cached), t0())
        .await
        .unwrap();
    assert_eq!(
        s.weights_by_node().await.unwrap()[&n][&key],
        WeightTier::Cached
    );
}
