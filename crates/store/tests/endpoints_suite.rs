//! Serverless endpoints on every backend (SQLite always, PostgreSQL when
//! `FLOTILLA_TEST_DATABASE_URL` is set): names unique among live endpoints
//! of a tenant, revisions, signals and the idle clock, replicas with
//! readiness and draining, the route table, and inference-key scopes.

use chrono::{DateTime, Duration, Utc};
use flotilla_core::catalog::Catalog;
use flotilla_core::endpoint::CreateEndpoint;
use flotilla_core::gateway::EndpointSignals;
use flotilla_core::id::{EndpointId, InstanceId, KeyId, TenantId};
use flotilla_core::instance::InstanceState;
use flotilla_core::tenant::Role;
use flotilla_store::keys::NewKey;
use flotilla_store::{Store, StoreError};
use flotilla_testdb::{rnd, t0};

flotilla_testdb::backend_suite!(
    "endpoints":
    endpoints_keep_spec_revision_signals_replicas_and_routes,
    vertical_opt_ins_and_moves,
);

fn signals(id: &EndpointId, in_flight: u32, total: u64, at: DateTime<Utc>) -> EndpointSignals {
    EndpointSignals {
        endpoint_id: id.clone(),
        at,
        in_flight,
        queued: 0,
        requests_total: total,
        ttft_p50_ms: None,
        ttft_p95_ms: None,
        latency_p95_ms: None,
    }
}

async fn endpoints_keep_spec_revision_signals_replicas_and_routes(s: &Store) {
    let c = Catalog::default();
    let tenant = TenantId::generate(1, rnd());
    s.create_tenant(&tenant, "acme", t0()).await.unwrap();
    let spec = CreateEndpoint {
        name: "chat".into(),
        command: vec!["serve".into()],
        ..CreateEndpoint::default()
    }
    .validate(&c)
    .unwrap();
    let id = EndpointId::generate(1, rnd());
    let ep = s.create_endpoint(&id, &tenant, &spec, t0()).await.unwrap();
    assert_eq!((ep.revision, ep.deleting), (1, false));
    assert_eq!(ep.last_request_at, Some(t0()));
    let dup = EndpointId::generate(1, rnd());
    assert!(matches!(
        s.create_endpoint(&dup, &tenant, &spec, t0()).await,
        Err(StoreError::AlreadyExists(_))
    ));

    // A revision bump, and a change that is not one.
    let ep = s.update_endpoint(&id, &spec, true, t0()).await.unwrap();
    assert_eq!(ep.revision, 2);
    let ep = s.update_endpoint(&id, &spec, false, t0()).await.unwrap();
    assert_eq!(ep.revision, 2);

    // The idle clock moves only when a request is seen.
    let t1 = t0() + Duration::seconds(10);
    s.set_endpoint_signals(&id, &signals(&id, 0, 0, t1), t1)
        .await
        .unwrap();
    assert_eq!(s.endpoint(&id).await.unwrap().last_request_at, Some(t0()));
    let t2 = t0() + Duration::seconds(20);
    s.set_endpoint_signals(&id, &signals(&id, 0, 3, t2), t2)
        .await
        .unwrap();
    let t3 = t0() + Duration::seconds(30);
    s.set_endpoint_signals(&id, &signals(&id, 0, 3, t3), t3)
        .await
        .unwrap();
    let ep = s.endpoint(&id).await.unwrap();
    assert_eq!(ep.last_request_at, Some(t2));
    assert_eq!(ep.signals.map(|x| x.requests_total), Some(3));
    s.set_endpoint_decision(&id, 2, "activator").await.unwrap();
    s.set_endpoint_custom_metric(&id, 7.5).await.unwrap();

    // Two replicas: one probed ready (routed), one not.
    let inst = spec.replica_instance(&c, &id, 2, 40001).unwrap();
    let (a, b) = (
        InstanceId::generate(1, rnd()),
        InstanceId::generate(1, rnd()),
    );
    for (i, port) in [(&a, 40001), (&b, 40002)] {
        s.create_instance(i, &tenant, &inst, t0()).await.unwrap();
        s.add_endpoint_replica(&id, i, 2, port, t0()).await.unwrap();
    }
    assert_eq!(
        s.replica_ports_in_use().await.unwrap(),
        [40001, 40002].into()
    );
    s.mark_replica_ready(&a, t1).await.unwrap();
    let ep = s.endpoint(&id).await.unwrap();
    assert_eq!(ep.desired_replicas, Some(2));
    assert_eq!(ep.custom_metric, Some(7.5));
    assert_eq!(ep.replicas.len(), 2);
    assert!(ep
        .replicas
        .iter()
        .all(|r| r.state == InstanceState::Pending));
    // Ready means probed and running; a pending instance is not routed.
    assert!(ep.replicas.iter().all(|r| !r.ready));
    let routes = s.route_table().await.unwrap();
    let r = routes.endpoints.iter().find(|e| e.id == id).unwrap();
    assert_eq!(r.models, vec!["chat".to_string()]);
    assert!(r.replicas.is_empty());
    assert_eq!(s.replica_of(&a).await.unwrap().unwrap().endpoint_id, id);

    s.mark_replica_draining(&a, t2).await.unwrap();
    let row = s.replica_of(&a).await.unwrap().unwrap();
    assert_eq!((row.ready_at, row.draining_at), (Some(t1), Some(t2)));

    // Delete: out of the routes and the list, the name free again.
    s.delete_endpoint(&id, t3).await.unwrap();
    assert!(s.endpoint(&id).await.unwrap().deleting);
    assert!(!s
        .route_table()
        .await
        .unwrap()
        .endpoints
        .iter()
        .any(|e| e.id == id));
    // Its live replicas keep it on the autoscaler's list until they end.
    assert!(s.endpoint_ids_to_scale().await.unwrap().contains(&id));
    s.create_endpoint(&dup, &tenant, &spec, t3).await.unwrap();

    // An inference key's scope.
    let k = KeyId::generate(1, rnd());
    s.create_key(
        &NewKey {
            id: k.clone(),
            tenant_id: tenant.clone(),
            role: Role::TenantMember,
            name: String::new(),
            prefix: "flt_x".into(),
            secret_hash: format!("h{}", rnd()),
        },
        t0(),
    )
    .await
    .unwrap();
    assert_eq!(s.key(&k).await.unwrap().endpoints, None);
    let key = s
        .set_key_endpoints(&k, std::slice::from_ref(&dup))
        .await
        .unwrap();
    assert_eq!(key.endpoints, Some(vec![dup]));
}

async fn vertical_opt_ins_and_moves(s: &Store) {
    use flotilla_core::advice::VerticalOptIn;
    let c = Catalog::default();
    let tenant = TenantId::generate(1, rnd());
    s.create_tenant(&tenant, "acme", t0()).await.unwrap();
    let spec = CreateEndpoint {
        name: "chat".into(),
        command: vec!["serve".into()],
        ..CreateEndpoint::default()
    }
    .validate(&c)
    .unwrap();
    let id = EndpointId::generate(1, rnd());
    s.create_endpoint(&id, &tenant, &spec, t0()).await.unwrap();
    assert_eq!(s.vertical(&id).await.unwrap(), None);
    let opt = VerticalOptIn {
        classes: vec!["H100".into(), "L40S".into()],
        sustain_s: 30,
    };
    let st = s.set_vertical(&id, &opt, t0()).await.unwrap();
    assert_eq!(
        (st.opt_in.clone(), st.opted_at, st.last_move),
        (opt.clone(), t0(), None)
    );
    let later = t0() + Duration::seconds(40);
    s.record_vertical_move(&id, "to L40S (revision 2): idle", later)
        .await
        .unwrap();
    let st = s.vertical(&id).await.unwrap().unwrap();
    assert_eq!(st.last_move.as_deref(), Some("to L40S (revision 2): idle"));
    assert_eq!(st.moved_at, Some(later));
    // A new opt-in replaces the old one and forgets its move.
    let again = VerticalOptIn {
        sustain_s: 60,
        ..opt
    };
    let st = s.set_vertical(&id, &again, later).await.unwrap();
    assert_eq!((st.opt_in.sustain_s, st.moved_at), (60, None));
}
