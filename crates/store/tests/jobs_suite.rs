//! Jobs in the store, on every backend: submission under quota, a gang
//! scheduled whole in one transaction (or not at all), settling at an
//! attempt, cancel, and preempted members that are not requeued alone.

mod support;

use std::collections::BTreeMap;

use flotilla_core::api::{DiscoveredGpu, ObservedInstance, ObservedPhase, RegisterNode};
use flotilla_core::catalog::Vendor;
use flotilla_core::id::{GpuId, InstanceId, JobId, NodeId, TenantId, WorkId};
use flotilla_core::instance::{BillingClass, InstanceSpec, InstanceState};
use flotilla_core::job::{JobSpec, JobState, RestartPolicy};
use flotilla_core::placement::{Placement, PlacementRequest};
use flotilla_core::quota::Quota;
use flotilla_store::instances::Applied;
use flotilla_store::waiting::PendingWork;
use flotilla_store::{PageReq, Store, StoreError};
use flotilla_testdb::{rnd, t0};

flotilla_testdb::backend_suite!(
    "jobs":
    job_lifecycle_through_restart_and_cancel,
    a_gang_is_scheduled_whole_or_not_at_all,
    a_preempted_member_is_not_requeued_alone,
    preemptors_are_promised_their_victims_gpus_and_limits_are_read,
    a_page_of_jobs_carries_each_jobs_own_members_and_events,
    instances_and_jobs_wait_in_one_queue,
);

async fn tenant(s: &Store, name: &str) -> TenantId {
    let id = TenantId::generate(1, rnd());
    s.create_tenant(&id, name, t0()).await.unwrap();
    id
}

async fn node(s: &Store, owner: &TenantId, name: &str, gpus: u32) -> NodeId {
    let list = (0..gpus)
        .map(|index| DiscoveredGpu {
            index,
            model: "H100".into(),
            uuid: format!("GPU-{name}-{index}"),
            memory_mib: 81920,
            vendor: Vendor::Nvidia,
            mig_mode: false,
        })
        .collect::<Vec<_>>();
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
    s.register_node(
        owner,
        &req,
        || {
            (
                NodeId::generate(1, rnd()),
                (0..gpus).map(|_| GpuId::generate(1, rnd())).collect(),
            )
        },
        t0(),
    )
    .await
    .unwrap()
    .id
}

fn spec(gpus: u32, nodes: u32) -> JobSpec {
    JobSpec {
        name: Some("train".into()),
        gpus,
        nodes,
        gpu_types: vec![],
        cpu_milli: 1000,
        memory_mb: 1024,
        command: vec!["train".into()],
        env: BTreeMap::from([("A".to_string(), "1".to_string())]),
        workdir: None,
        billing_class: BillingClass::Spot,
        priority: 0,
        tier: 2,
        preemptible: true,
        restart_policy: RestartPolicy::OnFailure,
        max_retries: 1,
        locality: Default::default(),
        time_limit_s: None,
        gpu_fraction: None,
        mig_profile: None,
        image: None,
        disk_mb: None,
    }
}

/// One member per node, first fit, as plans for `schedule_work`.
async fn plans(s: &Store, per: u32, nodes: &[NodeId]) -> Vec<Placement> {
    let snap = s.placement_snapshot().await.unwrap();
    let req = PlacementRequest {
        gpus: per,
        models: vec![],
        cpu_milli: 1000,
        memory_mb: 1024,
        share: flotilla_core::placement::GpuShare::Whole,
    };
    nodes
        .iter()
        .map(|n| {
            let one: Vec<_> = snap.iter().filter(|x| &x.id == n).cloned().collect();
            support::first_fitting(&one, &req).unwrap()
        })
        .collect()
}

/// An instance of one whole GPU.
fn one_gpu() -> InstanceSpec {
    InstanceSpec {
        name: None,
        gpus: 1,
        gpu_types: vec![],
        cpu_milli: 1000,
        memory_mb: 1024,
        command: vec!["x".into()],
        env: BTreeMap::new(),
        workdir: None,
        billing_class: BillingClass::OnDemand,
        priority: 0,
        tier: 1,
        preemptible: false,
        share: flotilla_core::placement::GpuShare::Whole,
        image: None,
        disk_mb: None,
    }
}

/// Places queued job `id` at `plans`, as a pass that read it now would;
/// returns its new members by rank.
async fn schedule(
    s: &Store,
    id: &JobId,
    plans: &[Placement],
) -> Result<Vec<InstanceId>, StoreError> {
    let work = support::waiting(s, id.clone()).await;
    s.schedule_work(&work, plans, support::new_member, t0())
        .await
}

async fn job_lifecycle_through_restart_and_cancel(s: &Store) {
    let t = tenant(s, "jobs").await;
    let a = node(s, &t, "a", 2).await;
    let b = node(s, &t, "b", 2).await;
    // Queued jobs count against the quota.
    s.set_quota(
        &t,
        &Quota {
            gpus_total: Some(6),
            gpus_per_model: BTreeMap::new(),
            ..Default::default()
        },
        t0(),
    )
    .await
    .unwrap();
    let id = JobId::generate(1, rnd());
    let j = s.create_job(&id, &t, &spec(4, 2), t0()).await.unwrap();
    assert_eq!((j.state, j.attempts, j.failures), (JobState::Queued, 0, 0));
    let over = s
        .create_job(&JobId::generate(1, rnd()), &t, &spec(4, 2), t0())
        .await;
    assert!(matches!(over, Err(StoreError::Quota(_))), "{over:?}");
    assert_eq!(s.usage(&t).await.unwrap().gpus_total, 0);

    let queued = s.pending_work(10).await.unwrap();
    assert_eq!(queued.len(), 1);
    let PendingWork::Job(first) = &queued[0] else {
        panic!("{queued:?}")
    };
    assert_eq!((first.attempt, first.spec.nodes), (0, 2));
    s.set_work_reason(&id.clone().into(), "waiting for GPUs: x", t0())
        .await
        .unwrap();
    assert_eq!(
        s.job(&id).await.unwrap().state_reason,
        "waiting for GPUs: x"
    );

    // Scheduled whole: two members, one per node, with their variables.
    let p = plans(s, 2, &[a.clone(), b.clone()]).await;
    let m = s
        .schedule_work(&queued[0], &p, support::new_member, t0())
        .await
        .unwrap();
    let j = s.job(&id).await.unwrap();
    assert_eq!((j.state, j.attempts), (JobState::Running, 1));
    assert_eq!(j.members.len(), 2);
    assert!(j.started_at.is_some());
    for (rank, member) in m.iter().enumerate() {
        let i = s.instance(member).await.unwrap();
        assert_eq!(i.state, InstanceState::Scheduled);
        let job = i.job.clone().unwrap();
        assert_eq!(
            (job.job_id, job.rank, job.attempt),
            (id.clone(), rank as u32, 1)
        );
        assert_eq!(i.env["FLOTILLA_JOB_RANK"], rank.to_string());
        assert_eq!(i.env["FLOTILLA_JOB_WORLD_SIZE"], "2");
        assert_eq!(i.env["FLOTILLA_JOB_ATTEMPT"], "1");
        assert_eq!(i.env["FLOTILLA_JOB_NODES"], "a,b");
        assert_eq!(i.env["A"], "1");
        assert_eq!((i.gpus, i.tier, i.preemptible), (2, 2, true));
        assert_eq!(i.node_id.as_ref(), Some(&p[rank].node));
    }
    assert_eq!(s.usage(&t).await.unwrap().gpus_total, 4);
    // A second schedule of the job as read at the old attempt is refused.
    let again = s
        .schedule_work(&queued[0], &p, support::new_member, t0())
        .await;
    assert!(matches!(again, Err(StoreError::Conflict(_))), "{again:?}");

    let running = s.running_jobs().await.unwrap();
    assert_eq!(running.len(), 1);
    assert_eq!(running[0].members.len(), 2);

    // Requeued after a failure: counts, and a stale attempt changes nothing.
    for member in &m {
        s.request_stop(member, t0()).await.unwrap();
        let node = s.instance(member).await.unwrap().node_id.unwrap();
        let obs = ObservedInstance {
            instance_id: member.clone(),
            phase: ObservedPhase::Exited {
                code: 1,
                stopped: false,
            },
            at: t0(),
            started_at: None,
            message: None,
            container: None,
            weights_tier: None,
            limit_exceeded: None,
        };
        assert_eq!(
            s.apply_observed(&node, &obs, t0()).await.unwrap(),
            Applied::Changed
        );
    }
    assert!(s
        .settle_job(&id, 1, JobState::Queued, true, "rank 0 failed", t0())
        .await
        .unwrap());
    assert!(!s
        .settle_job(&id, 1, JobState::Failed, false, "late", t0())
        .await
        .unwrap());
    let j = s.job(&id).await.unwrap();
    assert_eq!((j.state, j.attempts, j.failures), (JobState::Queued, 1, 1));
    assert!(j.finished_at.is_none());
    // The second attempt's members are told apart from the first's.
    let p = plans(s, 2, &[a.clone(), b.clone()]).await;
    let m2 = schedule(s, &id, &p).await.unwrap();
    assert_eq!(
        s.instance(&m2[1]).await.unwrap().env["FLOTILLA_JOB_ATTEMPT"],
        "2"
    );
    let running = s.running_jobs().await.unwrap();
    let current: Vec<&InstanceId> = running[0].members.iter().map(|i| &i.id).collect();
    assert_eq!(current, m2.iter().collect::<Vec<_>>());
    assert_eq!(s.job(&id).await.unwrap().members.len(), 4);

    // Cancel: a running job is flagged; a queued one ends at once.
    let j = s.cancel_job(&id, t0()).await.unwrap();
    assert_eq!((j.state, j.cancel_requested), (JobState::Running, true));
    let other = JobId::generate(1, rnd());
    s.create_job(&other, &t, &spec(2, 1), t0()).await.unwrap();
    let c = s.cancel_job(&other, t0()).await.unwrap();
    assert_eq!(c.state, JobState::Cancelled);
    assert!(c.finished_at.is_some());
    assert!(matches!(
        s.cancel_job(&other, t0()).await,
        Err(StoreError::Conflict(_))
    ));
    let listed = s
        .list_jobs(Some(&t), Some(JobState::Cancelled), &PageReq::new(None, 10))
        .await
        .unwrap();
    assert_eq!(listed.items.len(), 1);
    assert_eq!(listed.items[0].id, other);
    let events: Vec<JobState> = c.events.iter().map(|e| e.state).collect();
    assert_eq!(events, vec![JobState::Queued, JobState::Cancelled]);
    assert!(matches!(
        s.job(&JobId::generate(9, 9)).await,
        Err(StoreError::NotFound(_))
    ));
}

async fn a_gang_is_scheduled_whole_or_not_at_all(s: &Store) {
    let t = tenant(s, "gang").await;
    let a = node(s, &t, "ga", 1).await;
    let b = node(s, &t, "gb", 1).await;
    let id = JobId::generate(1, rnd());
    s.create_job(&id, &t, &spec(2, 2), t0()).await.unwrap();
    let mut p = plans(s, 1, &[a.clone(), b.clone()]).await;
    // Rank 1 is planned onto rank 0's GPU: the whole gang is refused.
    p[1] = p[0].clone();
    let r = schedule(s, &id, &p).await;
    assert!(matches!(r, Err(StoreError::Conflict(_))), "{r:?}");
    let j = s.job(&id).await.unwrap();
    assert_eq!((j.state, j.attempts), (JobState::Queued, 0));
    assert!(j.members.is_empty());
    let snap = s.placement_snapshot().await.unwrap();
    assert!(snap.iter().all(|n| n.gpus.iter().all(|g| g.free)));
    // A plan of the wrong size is refused too.
    let r = schedule(s, &id, &p[..1]).await;
    assert!(matches!(r, Err(StoreError::Conflict(_))), "{r:?}");
    let p = plans(s, 1, &[a, b]).await;
    schedule(s, &id, &p).await.unwrap();
    let snap = s.placement_snapshot().await.unwrap();
    assert!(snap.iter().all(|n| n.gpus.iter().all(|g| !g.free)));
}

async fn a_preempted_member_is_not_requeued_alone(s: &Store) {
    let t = tenant(s, "pre").await;
    let a = node(s, &t, "pa", 2).await;
    let id = JobId::generate(1, rnd());
    s.create_job(&id, &t, &spec(2, 2), t0()).await.unwrap();
    let p = plans(s, 1, std::slice::from_ref(&a)).await;
    let mut second = p[0].clone();
    let snap = s.placement_snapshot().await.unwrap();
    second.gpus = vec![snap[0].gpus[1].id.clone()];
    let m = schedule(s, &id, &[p[0].clone(), second]).await.unwrap();
    // A job preempts it: the preemption names the job.
    let by = flotilla_core::id::WorkId::Job(JobId::generate(3, rnd()));
    assert!(s.preempt(&m[0], &by, t0()).await.unwrap());
    let obs = ObservedInstance {
        instance_id: m[0].clone(),
        phase: ObservedPhase::Exited {
            code: 143,
            stopped: true,
        },
        at: t0(),
        started_at: None,
        message: None,
        container: None,
        weights_tier: None,
        limit_exceeded: None,
    };
    s.apply_observed(&a, &obs, t0()).await.unwrap();
    let i = s.instance(&m[0]).await.unwrap();
    assert_eq!(i.state, InstanceState::Stopped);
    assert_eq!(i.preempted_by.as_ref(), Some(&by));
    let pending = s.pending_work(10).await.unwrap();
    assert!(
        pending
            .iter()
            .all(|w| !matches!(w, PendingWork::Instance(_))),
        "{pending:?}"
    );
}

async fn preemptors_are_promised_their_victims_gpus_and_limits_are_read(s: &Store) {
    let t = tenant(s, "promise").await;
    let a = node(s, &t, "qa", 2).await;
    // A running, time-limited job of two members on the node.
    let id = JobId::generate(1, rnd());
    let limited = JobSpec {
        time_limit_s: Some(60),
        ..spec(2, 2)
    };
    s.create_job(&id, &t, &limited, t0()).await.unwrap();
    let snap = s.placement_snapshot().await.unwrap();
    let gpus: Vec<_> = snap[0].gpus.iter().map(|g| g.id.clone()).collect();
    let p0 = Placement {
        node: a.clone(),
        model: "H100".into(),
        gpus: vec![gpus[0].clone()],
        share: flotilla_core::placement::GpuShare::Whole,
    };
    let p1 = Placement {
        gpus: vec![gpus[1].clone()],
        ..p0.clone()
    };
    let m = schedule(s, &id, &[p0, p1]).await.unwrap();
    let limits = s.running_time_limits().await.unwrap();
    assert_eq!(limits.get(&id), Some(&60));
    let held = s.held_instances().await.unwrap();
    assert!(held
        .iter()
        .all(|h| h.job_id.as_ref() == Some(&id) && h.gpu_model == "H100"));

    // A queued job preempts rank 0, a pending instance rank 1.
    let by_job = JobId::generate(2, rnd());
    s.create_job(&by_job, &t, &spec(1, 1), t0()).await.unwrap();
    let by_inst = InstanceId::generate(2, rnd());
    s.create_instance(&by_inst, &t, &one_gpu(), t0())
        .await
        .unwrap();
    let wj = flotilla_core::id::WorkId::Job(by_job.clone());
    let wi = flotilla_core::id::WorkId::Instance(by_inst.clone());
    assert!(s.preempt(&m[0], &wj, t0()).await.unwrap());
    assert!(s.preempt(&m[1], &wi, t0()).await.unwrap());
    let promised = s.promised_gpus().await.unwrap();
    assert_eq!(promised.get(&wj), Some(&vec![gpus[0].clone()]));
    assert_eq!(promised.get(&wi), Some(&vec![gpus[1].clone()]));
    // A pass reads the same, in one snapshot.
    let inputs = s
        .pass_inputs(100, t0() - chrono::Duration::hours(24))
        .await
        .unwrap();
    assert_eq!(inputs.promised, promised);
    assert_eq!(inputs.time_limits.get(&id), Some(&60));
    let held_ids = |h: &[flotilla_store::instances::HeldInstance]| {
        h.iter().map(|h| h.id.clone()).collect::<Vec<_>>()
    };
    assert_eq!(
        held_ids(&inputs.held),
        held_ids(&s.held_instances().await.unwrap())
    );
    let queued: Vec<_> = inputs.queue.iter().map(PendingWork::id).collect();
    assert!(queued.contains(&by_inst.clone().into()));
    assert!(queued.contains(&by_job.clone().into()));
    assert_eq!(
        inputs.nodes.len(),
        s.placement_snapshot().await.unwrap().len()
    );
    assert_eq!(
        inputs.usage.len(),
        s.recent_usage(t0() - chrono::Duration::hours(24))
            .await
            .unwrap()
            .len()
    );
    // Once the preemptor is no longer waiting, nothing is promised to it.
    s.cancel_job(&by_job, t0()).await.unwrap();
    s.request_stop(&by_inst, t0()).await.unwrap();
    assert!(s.promised_gpus().await.unwrap().is_empty());
}

/// A listed page reads members and events for its id range at once: each
/// job must still get exactly its own, even with another tenant's jobs
/// between them in id order.
async fn a_page_of_jobs_carries_each_jobs_own_members_and_events(s: &Store) {
    let a = tenant(s, "pages-a").await;
    let b = tenant(s, "pages-b").await;
    let n1 = node(s, &a, "p1", 2).await;
    let n2 = node(s, &a, "p2", 2).await;
    // Ids in creation order: a's first, b's, a's second.
    let (j1, jb, j2) = (
        JobId::generate(10, rnd()),
        JobId::generate(11, rnd()),
        JobId::generate(12, rnd()),
    );
    s.create_job(&j1, &a, &spec(2, 2), t0()).await.unwrap();
    s.create_job(&jb, &b, &spec(2, 1), t0()).await.unwrap();
    s.create_job(&j2, &a, &spec(2, 1), t0()).await.unwrap();
    let p = plans(s, 1, &[n1.clone(), n2.clone()]).await;
    let m1 = schedule(s, &j1, &p).await.unwrap();
    let pb = plans(s, 1, std::slice::from_ref(&n1)).await;
    schedule(s, &jb, &pb).await.unwrap();
    s.cancel_job(&j2, t0()).await.unwrap();

    let page = s
        .list_jobs(Some(&a), None, &PageReq::new(None, 10))
        .await
        .unwrap();
    let listed: Vec<&JobId> = page.items.iter().map(|j| &j.id).collect();
    assert_eq!(listed, vec![&j1, &j2]);
    let members: Vec<&InstanceId> = page.items[0]
        .members
        .iter()
        .map(|m| &m.instance_id)
        .collect();
    assert_eq!(members.len(), 2);
    assert!(members.iter().all(|m| m1.contains(m)), "{members:?}");
    assert!(page.items[1].members.is_empty());
    let states = |j: &flotilla_core::api::Job| j.events.iter().map(|e| e.state).collect::<Vec<_>>();
    assert_eq!(
        states(&page.items[0]),
        vec![JobState::Queued, JobState::Running]
    );
    assert_eq!(
        states(&page.items[1]),
        vec![JobState::Queued, JobState::Cancelled]
    );
    // The same as reading each alone.
    for j in &page.items {
        let one = s.job(&j.id).await.unwrap();
        assert_eq!(one.members.len(), j.members.len());
        assert_eq!(one.events.len(), j.events.len());
    }
}

/// Instances and jobs wait in one queue: read oldest first whatever their
/// kind, at most `limit` of them all together, explained through the
/// work's id, and an instance placed through the same call as a gang.
async fn instances_and_jobs_wait_in_one_queue(s: &Store) {
    let t = tenant(s, "queue").await;
    let n = node(s, &t, "wq", 2).await;
    let at = |secs: i64| t0() + chrono::Duration::seconds(secs);
    let i1 = InstanceId::generate(1, rnd());
    s.create_instance(&i1, &t, &one_gpu(), at(0)).await.unwrap();
    let j1 = JobId::generate(2, rnd());
    s.create_job(&j1, &t, &spec(1, 1), at(1)).await.unwrap();
    let i2 = InstanceId::generate(3, rnd());
    s.create_instance(&i2, &t, &one_gpu(), at(2)).await.unwrap();
    let (w1, wj, w2): (WorkId, WorkId, WorkId) =
        (i1.clone().into(), j1.clone().into(), i2.clone().into());
    let queue = move |limit: u32| async move {
        let work = s.pending_work(limit).await.unwrap();
        work.iter().map(PendingWork::id).collect::<Vec<_>>()
    };
    assert_eq!(queue(10).await, vec![w1.clone(), wj.clone(), w2.clone()]);
    assert_eq!(queue(2).await, vec![w1.clone(), wj.clone()]);

    // Why it waits, set through its id.
    s.set_work_reason(&w2, "waiting for GPUs: y", at(3))
        .await
        .unwrap();
    assert_eq!(
        s.instance(&i2).await.unwrap().state_reason,
        "waiting for GPUs: y"
    );

    // An instance is placed with exactly one placement.
    let work = support::waiting(s, i1.clone()).await;
    let p = plans(s, 1, std::slice::from_ref(&n)).await;
    for wrong in [Vec::new(), vec![p[0].clone(), p[0].clone()]] {
        let r = s
            .schedule_work(&work, &wrong, support::new_member, at(3))
            .await;
        assert!(matches!(r, Err(StoreError::Conflict(_))), "{r:?}");
    }
    assert_eq!(s.instance(&i1).await.unwrap().state, InstanceState::Pending);
    let placed = s
        .schedule_work(&work, &p, support::new_member, at(3))
        .await
        .unwrap();
    assert_eq!(placed, vec![i1.clone()]);
    let inst = s.instance(&i1).await.unwrap();
    assert_eq!(inst.state, InstanceState::Scheduled);
    assert_eq!(inst.gpu_ids, p[0].gpus);

    // Placed, it left the queue: placing it again (on the GPU still free)
    // is a conflict, and its reason no longer changes.
    let free = plans(s, 1, std::slice::from_ref(&n)).await;
    assert_ne!(free[0].gpus, p[0].gpus);
    let again = s
        .schedule_work(&work, &free, support::new_member, at(4))
        .await;
    assert!(matches!(again, Err(StoreError::Conflict(_))), "{again:?}");
    s.set_work_reason(&w1, "late", at(4)).await.unwrap();
    let inst = s.instance(&i1).await.unwrap();
    assert_eq!(inst.state, InstanceState::Scheduled);
    assert_ne!(inst.state_reason, "late");
    assert_eq!(queue(10).await, vec![wj, w2]);
    let free_after = plans(s, 1, std::slice::from_ref(&n)).await;
    assert_eq!(
        free_after[0].gpus, free[0].gpus,
        "the refused write took nothing"
    );
}
