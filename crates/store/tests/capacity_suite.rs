//! Node pools' machines and one-time join tokens, on every backend: a
//! token is redeemed once, never after it expired, and a redemption mints
//! the agent key with it; machines move through their states.

use chrono::Duration;
use flotilla_core::api::RegisterNode;
use flotilla_core::id::{GpuId, KeyId, NodeId, TenantId};
use flotilla_core::tenant::Role;
use flotilla_store::capacity::{JoinRefusal, MachineState, NewMachine};
use flotilla_store::keys::NewKey;
use flotilla_store::Store;
use flotilla_testdb::{rnd, t0};

flotilla_testdb::backend_suite!(
    "capacity":
    a_join_token_is_redeemed_once,
    an_expired_or_unknown_join_token_is_refused,
    machines_move_through_their_states,
);

async fn tenant(s: &Store) -> TenantId {
    let tenant = TenantId::generate(1, rnd());
    s.create_tenant(&tenant, &format!("t{}", rnd()), t0())
        .await
        .unwrap();
    tenant
}

fn new_machine(tenant: &TenantId, name: &str, hash: &str) -> NewMachine {
    NewMachine {
        name: name.into(),
        pool: "gpu".into(),
        provider: "local".into(),
        instance_type: "2xH100".into(),
        token_hash: hash.into(),
        tenant_id: tenant.clone(),
        expires_at: t0() + Duration::minutes(10),
    }
}

fn key(tenant: &TenantId) -> NewKey {
    NewKey {
        id: KeyId::generate(1, rnd()),
        tenant_id: tenant.clone(),
        role: Role::Provider,
        name: "node-pool machine".into(),
        prefix: "fk_x".into(),
        secret_hash: format!("hash{}", rnd()),
    }
}

async fn a_join_token_is_redeemed_once(s: &Store) {
    let t = tenant(s).await;
    let name = format!("gpu-{}", rnd());
    let hash = format!("tok{}", rnd());
    s.add_pool_machine(&new_machine(&t, &name, &hash), t0())
        .await
        .unwrap();
    assert_eq!(s.join_token_tenant(&hash).await.unwrap(), Some(t.clone()));
    let k = key(&t);
    let grant = s
        .redeem_join_token(&hash, &k, t0() + Duration::minutes(1))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (grant.pool.as_str(), grant.machine.as_str()),
        ("gpu", name.as_str())
    );
    let minted = s.key(&k.id).await.unwrap();
    assert_eq!(minted.role, Role::Provider);
    // Twice: refused, naming when it was used, and no second key.
    let again = key(&t);
    let refused = s
        .redeem_join_token(&hash, &again, t0() + Duration::minutes(2))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(
        refused,
        JoinRefusal::Used {
            at: t0() + Duration::minutes(1)
        }
    );
    assert!(refused.to_string().contains("already used"));
    assert!(s.key(&again.id).await.is_err());
    // The machine is gone: its key is revoked.
    s.revoke_machine_key(&name, t0() + Duration::minutes(3))
        .await
        .unwrap();
    assert!(s.key(&k.id).await.unwrap().revoked_at.is_some());
}

async fn an_expired_or_unknown_join_token_is_refused(s: &Store) {
    let t = tenant(s).await;
    let name = format!("gpu-{}", rnd());
    let hash = format!("tok{}", rnd());
    s.add_pool_machine(&new_machine(&t, &name, &hash), t0())
        .await
        .unwrap();
    let k = key(&t);
    let refused = s
        .redeem_join_token(&hash, &k, t0() + Duration::minutes(10))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(
        refused,
        JoinRefusal::Expired {
            at: t0() + Duration::minutes(10)
        }
    );
    assert!(s.key(&k.id).await.is_err(), "no key for a refused token");
    let unknown = s
        .redeem_join_token("no-such-hash", &key(&t), t0())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(unknown, JoinRefusal::Unknown);
    assert_eq!(s.join_token_tenant("no-such-hash").await.unwrap(), None);
}

async fn machines_move_through_their_states(s: &Store) {
    let t = tenant(s).await;
    let pool = format!("pool{}", rnd());
    let name = format!("{pool}-1");
    let mut m = new_machine(&t, &name, &format!("tok{}", rnd()));
    m.pool = pool.clone();
    s.add_pool_machine(&m, t0()).await.unwrap();
    s.set_machine_id(&name, "srv-1").await.unwrap();
    let got = s.pool_machine(&name).await.unwrap();
    assert_eq!(got.state, MachineState::Booting);
    assert_eq!(got.machine_id.as_deref(), Some("srv-1"));

    // A node of that name registers in the pool.
    let req = RegisterNode {
        name: name.clone(),
        region: None,
        pool: Some(pool.clone()),
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
    let node = s
        .register_node(
            &t,
            &req,
            || (NodeId::generate(1, rnd()), Vec::<GpuId>::new()),
            t0(),
        )
        .await
        .unwrap();
    let nodes = s.nodes_in_pool(&pool).await.unwrap();
    assert_eq!(nodes, vec![(node.id.clone(), name.clone())]);
    assert_eq!(s.live_instances_on(&node.id).await.unwrap(), 0);

    let t1 = t0() + Duration::seconds(30);
    s.mark_machine_joined(&name, &node.id, t1).await.unwrap();
    let got = s.pool_machine(&name).await.unwrap();
    assert_eq!(got.state, MachineState::Joined);
    assert_eq!((got.joined_at, got.idle_since), (Some(t1), Some(t1)));
    s.set_machine_idle_since(&name, None).await.unwrap();
    assert_eq!(s.pool_machine(&name).await.unwrap().idle_since, None);

    s.set_node_cordoned(&node.id, true).await.unwrap();
    assert!(s.node(&node.id).await.unwrap().cordoned);
    s.set_machine_state(&name, MachineState::Draining, Some("idle"), t1)
        .await
        .unwrap();
    assert_eq!(s.pool_machines(&pool).await.unwrap().len(), 1);
    s.set_machine_state(&name, MachineState::Terminated, None, t1)
        .await
        .unwrap();
    let got = s.pool_machine(&name).await.unwrap();
    assert_eq!(got.state, MachineState::Terminated);
    assert_eq!(
        got.reason.as_deref(),
        Some("idle"),
        "a None reason keeps the last"
    );
    assert!(s.pool_machines(&pool).await.unwrap().is_empty());
    assert_eq!(s.pool_machine_history(&pool).await.unwrap().len(), 1);
    assert!(s.set_machine_id("nope", "x").await.is_err());
}
