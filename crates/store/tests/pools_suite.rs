//! Replica pools on every backend (SQLite always, PostgreSQL when
//! `FLOTILLA_TEST_DATABASE_URL` is set).

use chrono::Duration;
use flotilla_core::api::{CreateReplicaPool, PoolMetrics, PoolPolicy};
use flotilla_core::catalog::Catalog;
use flotilla_core::id::{InstanceId, ReplicaPoolId, TenantId};
use flotilla_core::instance::{CreateInstance, InstanceState};
use flotilla_store::{Store, StoreError};
use flotilla_testdb::{rnd, t0};

flotilla_testdb::backend_suite!(
    "pools":
    pools_keep_spec_metrics_decision_and_members,
);

fn body() -> CreateReplicaPool {
    let replica: CreateInstance =
        serde_json::from_value(serde_json::json!({"gpus": 1, "command": ["sleep", "60"]})).unwrap();
    CreateReplicaPool {
        name: "chat".into(),
        policy: PoolPolicy {
            kind: "flotilla".into(),
            max_concurrency: 32,
            mean_service_ms: 3_000.0,
            cold_start_ms: 60_000,
            slo_ms: 2_000,
        },
        max_replicas: 10,
        replica,
    }
}

async fn pools_keep_spec_metrics_decision_and_members(s: &Store) {
    let tenant = TenantId::generate(1, rnd());
    s.create_tenant(&tenant, "acme", t0()).await.unwrap();
    let id = ReplicaPoolId::generate(1, rnd());
    let pool = s
        .create_replica_pool(&id, &tenant, &body(), t0())
        .await
        .unwrap();
    assert_eq!(pool.name, "chat");
    assert_eq!(pool.policy.kind, "flotilla");
    assert_eq!((pool.desired_replicas, pool.metrics), (None, None));
    assert_eq!(s.replica_pool_ids().await.unwrap(), vec![id.clone()]);

    let m = PoolMetrics {
        in_flight: 3,
        queued: 1,
        requests_total: 40,
        gpu_utilization: Some(0.5),
        p95_ms: None,
    };
    s.set_pool_metrics(&id, &m, t0() + Duration::seconds(1))
        .await
        .unwrap();
    s.set_pool_decision(&id, 2, "forecast").await.unwrap();

    let spec = body().replica.validate(&Catalog::default()).unwrap();
    let (a, b) = (
        InstanceId::generate(1, rnd()),
        InstanceId::generate(1, rnd()),
    );
    for i in [&a, &b] {
        s.create_instance(i, &tenant, &spec, t0()).await.unwrap();
        s.add_pool_member(&id, i, t0()).await.unwrap();
    }
    s.request_stop(&b, t0()).await.unwrap();
    let members = s.pool_members(&id).await.unwrap();
    assert_eq!(members.len(), 2);
    assert_eq!(members.iter().filter(|m| m.is_live()).count(), 1);
    assert!(members.iter().any(|m| m.state == InstanceState::Stopped));

    let pool = s.replica_pool(&id).await.unwrap();
    assert_eq!(pool.metrics, Some(m));
    assert_eq!(pool.metrics_at, Some(t0() + Duration::seconds(1)));
    assert_eq!(pool.desired_replicas, Some(2));
    assert_eq!(pool.reason.as_deref(), Some("forecast"));
    assert_eq!(pool.replicas, vec![a]);

    let missing = ReplicaPoolId::generate(1, rnd());
    assert!(matches!(
        s.set_pool_metrics(&missing, &m, t0()).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        s.replica_pool(&missing).await,
        Err(StoreError::NotFound(_))
    ));
}
