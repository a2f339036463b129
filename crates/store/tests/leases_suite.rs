//! Leases and fencing, on every backend: the leader lease changes hands
//! only once it ran out, its token grows with every new holding, and a
//! fenced store's writes are refused once its token is stale.

mod support;

use std::collections::BTreeMap;

use chrono::Duration;
use flotilla_core::api::{DiscoveredGpu, RegisterNode};
use flotilla_core::catalog::Vendor;
use flotilla_core::id::{GpuId, InstanceId, NodeId, TenantId};
use flotilla_core::instance::{BillingClass, InstanceSpec, InstanceState};
use flotilla_core::placement::{GpuShare, PlacementRequest};
use flotilla_store::leases::LEADER;
use flotilla_store::{Backend, Store, StoreError};
use flotilla_testdb::{rnd, t0};

flotilla_testdb::backend_suite!(
    "leases":
    a_lease_changes_hands_only_once_it_ran_out,
    a_write_under_a_stale_token_is_refused,
    concurrent_takeovers_grant_one_holder_one_new_token,
    a_takeover_gives_up_on_a_locked_row,
    a_stalled_fenced_write_is_ended_and_frees_the_lease,
);

async fn a_lease_changes_hands_only_once_it_ran_out(s: &Store) {
    let ttl = Duration::seconds(2);
    assert_eq!(s.lease(LEADER).await.unwrap(), None);
    let a = s.acquire_lease(LEADER, "a", ttl, t0()).await.unwrap();
    assert!(a.held_by("a", t0()));
    assert_eq!((a.token, a.expires_at), (1, t0() + ttl));
    // Renewal keeps the token and moves the expiry.
    let t1 = t0() + Duration::seconds(1);
    let a = s.acquire_lease(LEADER, "a", ttl, t1).await.unwrap();
    assert_eq!((a.token, a.expires_at, a.acquired_at), (1, t1 + ttl, t0()));
    // Another replica is refused while it holds, and learns who does.
    let b = s.acquire_lease(LEADER, "b", ttl, t1).await.unwrap();
    assert!(!b.held_by("b", t1));
    assert_eq!((b.holder.as_str(), b.token), ("a", 1));
    // Once it ran out, the other takes it under a new token.
    let t2 = t1 + ttl;
    let b = s.acquire_lease(LEADER, "b", ttl, t2).await.unwrap();
    assert!(b.held_by("b", t2));
    assert_eq!(b.token, 2);
    let a = s.acquire_lease(LEADER, "a", ttl, t2).await.unwrap();
    assert!(!a.held_by("a", t2));
    // A released lease is free at once; the next holding is a new term.
    assert!(s.release_lease(LEADER, "b").await.unwrap());
    assert!(!s.release_lease(LEADER, "b-not-holding").await.unwrap());
    let a = s.acquire_lease(LEADER, "a", ttl, t2).await.unwrap();
    assert!(a.held_by("a", t2));
    assert_eq!(a.token, 3);
    // A holder that let its own lease run out starts a new term too: a
    // write it began before is stale.
    let t3 = t2 + ttl + Duration::seconds(1);
    let a = s.acquire_lease(LEADER, "a", ttl, t3).await.unwrap();
    assert_eq!(a.token, 4);
    assert_eq!(s.lease(LEADER).await.unwrap(), Some(a));
    // A holder known to be gone is taken over before its lease runs out,
    // under a new token; a stale take-over (from someone who no longer
    // holds) changes nothing.
    let c = s.take_over_lease(LEADER, "a", "c", ttl, t3).await.unwrap();
    assert!(c.held_by("c", t3));
    assert_eq!(c.token, 5);
    let again = s.take_over_lease(LEADER, "a", "d", ttl, t3).await.unwrap();
    assert_eq!((again.holder.as_str(), again.token), ("c", 5));
}

async fn placement_fixture(s: &Store) -> (InstanceId, flotilla_core::placement::Placement) {
    let tenant = TenantId::generate(1, rnd());
    s.create_tenant(&tenant, &format!("t{}", rnd()), t0())
        .await
        .unwrap();
    let gpus: Vec<DiscoveredGpu> = (0..2)
        .map(|index| DiscoveredGpu {
            index,
            model: "H100".into(),
            uuid: format!("GPU-fence-{index}"),
            memory_mib: 81920,
            vendor: Vendor::Nvidia,
            mig_mode: false,
        })
        .collect();
    let req = RegisterNode {
        name: "fence-node".into(),
        region: None,
        pool: None,
        cpu_milli: 64_000,
        memory_mb: 512_000,
        simulated: true,
        gpus,
        agent_version: "test".into(),
        runtime: Default::default(),
        executor: Default::default(),
        running: Vec::new(),
        unenforced_limits: Vec::new(),
        network: None,
    };
    s.register_node(
        &tenant,
        &req,
        || {
            (
                NodeId::generate(1, rnd()),
                (0..2).map(|_| GpuId::generate(1, rnd())).collect(),
            )
        },
        t0(),
    )
    .await
    .unwrap();
    let spec = InstanceSpec {
        name: None,
        gpus: 1,
        gpu_types: vec!["H100".into()],
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
    let id = InstanceId::generate(1, rnd());
    s.create_instance(&id, &tenant, &spec, t0()).await.unwrap();
    let snap = s.placement_snapshot().await.unwrap();
    let req = PlacementRequest {
        gpus: 1,
        models: vec!["H100".into()],
        cpu_milli: 1000,
        memory_mb: 1024,
        share: GpuShare::Whole,
    };
    let plan = support::first_fitting(&snap, &req).unwrap();
    (id, plan)
}

async fn a_write_under_a_stale_token_is_refused(s: &Store) {
    let ttl = Duration::seconds(2);
    let (id, plan) = placement_fixture(s).await;
    let work = support::waiting(s, id.clone()).await;
    let plan = [plan];
    let old = s.acquire_lease(LEADER, "old", ttl, t0()).await.unwrap();
    let deposed = s.fenced(LEADER, old.token);
    assert_eq!(deposed.fence().map(|f| f.token), Some(old.token));
    // The old leader paused past its lease; another replica took it.
    let later = t0() + ttl + Duration::seconds(1);
    let new = s.acquire_lease(LEADER, "new", ttl, later).await.unwrap();
    assert!(new.held_by("new", later) && new.token > old.token);
    // The deposed leader's placement is refused, and nothing changed.
    match deposed
        .schedule_work(&work, &plan, support::new_member, later)
        .await
    {
        Err(StoreError::Fenced {
            lease,
            token,
            current,
        }) => {
            assert_eq!(
                (lease.as_str(), token, current),
                (LEADER, old.token, Some(new.token))
            );
        }
        other => panic!("expected a fenced refusal, got {other:?}"),
    }
    let inst = s.instance(&id).await.unwrap();
    assert_eq!(inst.state, InstanceState::Pending);
    assert!(inst.gpu_ids.is_empty() && inst.node_id.is_none());
    assert!(s
        .placement_snapshot()
        .await
        .unwrap()
        .iter()
        .flat_map(|n| &n.gpus)
        .all(|g| g.free));
    // Its other write paths are fenced too: the ledger and node liveness.
    assert!(matches!(
        deposed.request_stop(&id, later).await,
        Err(StoreError::Fenced { .. })
    ));
    assert_eq!(s.instance(&id).await.unwrap().state, InstanceState::Pending);
    // A store fenced on a lease that was never granted cannot write.
    assert!(matches!(
        s.fenced("never-granted", 1)
            .schedule_work(&work, &plan, support::new_member, later)
            .await,
        Err(StoreError::Fenced { current: None, .. })
    ));
    // The current leader's write goes through.
    s.fenced(LEADER, new.token)
        .schedule_work(&work, &plan, support::new_member, later)
        .await
        .unwrap();
    assert_eq!(
        s.instance(&id).await.unwrap().state,
        InstanceState::Scheduled
    );
}

async fn concurrent_takeovers_grant_one_holder_one_new_token(s: &Store) {
    let ttl = Duration::seconds(5);
    let first = s.acquire_lease(LEADER, "first", ttl, t0()).await.unwrap();
    let later = t0() + ttl;
    let tries = (0..8).map(|i| {
        let s = s.clone();
        tokio::spawn(async move {
            let who = format!("r{i}");
            // SQLite may answer `database is locked` to a writer that lost
            // a race; a refused try is not a grant.
            let got = s.acquire_lease(LEADER, &who, ttl, later).await.ok();
            got.is_some_and(|l| l.held_by(&who, later)).then_some(who)
        })
    });
    let mut winners = Vec::new();
    for t in tries {
        if let Some(w) = t.await.unwrap() {
            winners.push(w);
        }
    }
    assert_eq!(winners.len(), 1, "winners: {winners:?}");
    let now = s.lease(LEADER).await.unwrap().unwrap();
    assert_eq!(now.holder, winners[0]);
    assert_eq!(now.token, first.token + 1);
}

/// PostgreSQL: a takeover that finds the lease row locked (its holder
/// inside a fenced write) gives up within the lease's lock timeout instead
/// of queueing behind the lock; once the row is free, it takes the lease.
/// (SQLite has one writer, which the takeover waits for as any write.)
async fn a_takeover_gives_up_on_a_locked_row(s: &Store) {
    if s.backend() != Backend::Postgres {
        return;
    }
    let ttl = Duration::seconds(2);
    let a = s.acquire_lease(LEADER, "a", ttl, t0()).await.unwrap();
    let later = t0() + ttl;
    let (tried, waited) = s
        .fenced(LEADER, a.token)
        .hold_write_transaction(async {
            let start = tokio::time::Instant::now();
            let tried = s.acquire_lease(LEADER, "b", ttl, later).await;
            (tried, start.elapsed())
        })
        .await
        .unwrap();
    assert!(matches!(tried, Err(StoreError::Busy(_))), "{tried:?}");
    assert!(
        waited < s.timeouts().lease_statement * 4,
        "gave up after {waited:?}"
    );
    let b = s.acquire_lease(LEADER, "b", ttl, later).await.unwrap();
    assert!(b.held_by("b", later));
    assert_eq!(b.token, a.token + 1);
}

/// PostgreSQL: a session left idle inside a fenced transaction (its
/// process stopped) is ended by the server after the idle-in-transaction
/// timeout: the lease row is free for a takeover, and the stalled write
/// fails instead of landing.
async fn a_stalled_fenced_write_is_ended_and_frees_the_lease(s: &Store) {
    if s.backend() != Backend::Postgres {
        return;
    }
    let ttl = Duration::seconds(2);
    let a = s.acquire_lease(LEADER, "a", ttl, t0()).await.unwrap();
    let later = t0() + ttl;
    let idle = s.timeouts().idle_in_transaction;
    let mut taken = None;
    let stalled = s
        .fenced(LEADER, a.token)
        .hold_write_transaction(async {
            tokio::time::sleep(idle + std::time::Duration::from_secs(1)).await;
            taken = Some(s.acquire_lease(LEADER, "b", ttl, later).await);
        })
        .await;
    assert!(stalled.is_err(), "the stalled write failed: {stalled:?}");
    let b = taken.unwrap().unwrap();
    assert!(b.held_by("b", later), "{b:?}");
    assert_eq!(b.token, a.token + 1);
}
