//! A node's cordon flag and its provider's offer windows, on every
//! backend: both reach the placement snapshot, an offer round-trips, a
//! node without one is offered always, and an unknown node is NotFound.

use flotilla_core::api::RegisterNode;
use flotilla_core::id::{NodeId, TenantId};
use flotilla_core::offer::{NodeOffer, OfferWindow};
use flotilla_store::{Store, StoreError};
use flotilla_testdb::{rnd, t0};

flotilla_testdb::backend_suite!(
    "offers":
    cordon_and_offer_reach_the_placement_snapshot,
);

async fn node(s: &Store) -> (TenantId, NodeId) {
    let t = TenantId::generate(1, rnd());
    s.create_tenant(&t, &format!("t{}", rnd()), t0())
        .await
        .unwrap();
    let req = RegisterNode {
        name: format!("offer-node-{}", rnd()),
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
    let id = s
        .register_node(&t, &req, || (NodeId::generate(1, rnd()), Vec::new()), t0())
        .await
        .unwrap()
        .id;
    (t, id)
}

async fn snap(s: &Store, id: NodeId) -> flotilla_core::placement::NodeSnapshot {
    s.placement_snapshot()
        .await
        .unwrap()
        .into_iter()
        .find(|n| n.id == id)
        .expect("the node in the snapshot")
}

async fn cordon_and_offer_reach_the_placement_snapshot(s: &Store) {
    let (_t, id) = node(s).await;
    let n = snap(s, id.clone()).await;
    assert!(!n.cordoned);
    assert_eq!(n.offer, NodeOffer::default(), "no offer: offered always");

    s.set_node_cordoned(&id, true).await.unwrap();
    assert!(snap(s, id.clone()).await.cordoned);
    assert!(s.node(&id).await.unwrap().cordoned);
    s.set_node_cordoned(&id, false).await.unwrap();
    assert!(!snap(s, id.clone()).await.cordoned);

    let offer = NodeOffer {
        windows: vec![OfferWindow {
            days: vec!["mon".into(), "fri".into()],
            start: "18:00".into(),
            end: "08:00".into(),
        }],
    };
    s.set_node_offer(&id, &offer).await.unwrap();
    assert_eq!(s.node_offer(&id).await.unwrap(), offer);
    assert_eq!(snap(s, id.clone()).await.offer, offer);
    assert!(s
        .node_offers()
        .await
        .unwrap()
        .iter()
        .any(|(n, o)| n == &id && o == &offer));

    let missing = NodeId::generate(1, rnd());
    assert!(matches!(
        s.set_node_cordoned(&missing, true).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        s.set_node_offer(&missing, &offer).await,
        Err(StoreError::NotFound(_))
    ));
}
