//! The Kubernetes executor against the API's semantics, without a
//! cluster: a fake API server on a local port answers kube-rs with
//! recorded bodies (`tests/fixtures/kube/`): Node and Pod objects, lists,
//! `Status` errors and watch event streams. Tests that need a real cluster
//! are in `kube_cluster.rs`.

#![cfg(feature = "kubernetes")]

mod support;

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use flotilla_backends::kube::{KubeConfig, KubeExecutor};
use flotilla_backends::{Executor, ExecutorError};
use flotilla_core::api::{Assignment, ObservedInstance, ObservedPhase};
use flotilla_core::id::{InstanceId, TenantId};
use flotilla_core::instance::ImageSpec;
use futures::channel::mpsc;
use support::fake_kube::{fixture, wait_for, FakeKube, Reply, Then};

const TENANT: &str = "ten_01jd3x7k2q9v8m4n6p5r0s1t2a";
const NS: &str = "flotilla-ten-01jd3x7k2q9v8m4n6p5r0s1t2a";
const PODS: &str = "/api/v1/pods";
const A: &str = "inst_01jd3x7k2q9v8m4n6p5r0s1t2w";
const B: &str = "inst_01jd3x7k2q9v8m4n6p5r0s1t2x";
const JOB: &str = "job_01jd3x7k2q9v8m4n6p5r0s1t2j";
const RANK0: &str = "inst_01jd3x7k2q9v8m4n6p5r0s1t30";
const RANK1: &str = "inst_01jd3x7k2q9v8m4n6p5r0s1t31";

fn id(s: &str) -> InstanceId {
    InstanceId::parse(s, "instance_id").unwrap()
}

fn pod_path(instance: &str) -> String {
    format!(
        "/api/v1/namespaces/{NS}/pods/flotilla-{}",
        instance.replace('_', "-")
    )
}

fn t(s: &str) -> DateTime<Utc> {
    s.parse().unwrap()
}

fn assignment(instance: &str, gpus: u32) -> Assignment {
    Assignment {
        instance_id: id(instance),
        tenant_id: Some(TenantId::parse(TENANT, "tenant_id").unwrap()),
        command: vec!["python".into(), "train.py".into()],
        env: BTreeMap::from([("EPOCHS".to_string(), "3".to_string())]),
        workdir: None,
        gpu_indices: (0..gpus).collect(),
        gpu_uuids: (0..gpus)
            .map(|i| format!("k8s-gpu-h100-0-gpu{i}"))
            .collect(),
        gpu_slices: vec![],
        stop: false,
        stop_grace_ms: 30_000,
        image: Some(ImageSpec {
            image: "nvcr.io/nvidia/pytorch:24.05-py3".into(),
            ports: vec![],
            scratch_mb: Some(2048),
        }),
        cpu_milli: Some(4000),
        memory_mb: Some(16384),
        registry_auth: None,
        disk_mb: None,
    }
}

fn member(instance: &str, rank: u32, nodes: &str) -> Assignment {
    let mut a = assignment(instance, 8);
    a.env.extend(flotilla_core::job::member_env(
        JOB,
        rank,
        2,
        1,
        &nodes.split(',').map(String::from).collect::<Vec<_>>(),
    ));
    a
}

/// Answers the server-side applies of the tenant's namespace objects.
fn serve_tenancy(fake: &FakeKube) {
    fake.on(
        "PATCH",
        &format!("/api/v1/namespaces/{NS}"),
        Reply::Json(200, fixture("namespace.json")),
    );
    fake.on(
        "PATCH",
        &format!("/api/v1/namespaces/{NS}/resourcequotas/flotilla-tenant"),
        Reply::Json(200, fixture("resourcequota.json")),
    );
    fake.on(
        "PATCH",
        &format!("/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/flotilla-tenant"),
        Reply::Json(200, fixture("networkpolicy.json")),
    );
}

fn c_security(pod: &serde_json::Value) -> &serde_json::Value {
    &pod["spec"]["containers"][0]["securityContext"]
}

async fn synced(ex: &KubeExecutor) {
    wait_for("the pod watch's first list", || async {
        ex.synced().then_some(())
    })
    .await;
}

async fn observed(ex: &KubeExecutor, node: &str, instance: &str) -> Option<ObservedInstance> {
    ex.observe(node)
        .await
        .unwrap()
        .into_iter()
        .find(|o| o.instance_id.as_str() == instance)
}

#[tokio::test]
async fn inventory_reads_gpu_and_mig_nodes() {
    let fake = FakeKube::start().await;
    fake.on(
        "GET",
        "/api/v1/nodes",
        Reply::Json(200, fixture("nodes.json")),
    );
    fake.on("GET", PODS, Reply::Json(200, fixture("pods-list.json")));
    let ex = KubeExecutor::new(fake.client(), KubeConfig::default());
    assert_eq!(ex.kind(), flotilla_core::node::ExecutorKind::Kubernetes);
    synced(&ex).await;

    let nodes = ex.inventory().await.unwrap();
    let names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
    // gpu-h100-1 is NotReady (its kubelet stopped posting status).
    assert_eq!(names, ["gpu-h100-0", "gpu-a100-mig-0", "cpu-0"]);

    let h100 = &nodes[0];
    assert_eq!(h100.gpus.len(), 8);
    assert!(h100
        .gpus
        .iter()
        .all(|g| g.model == "H100" && !g.mig_mode && g.memory_mib == 81559));
    let uuids: std::collections::HashSet<&str> =
        h100.gpus.iter().map(|g| g.uuid.as_str()).collect();
    assert_eq!(uuids.len(), 8, "every GPU has its own id");
    assert_eq!(h100.pool.as_deref(), Some("h100"));
    assert_eq!(h100.region.as_deref(), Some("us-east-2"));
    assert_eq!(h100.cpu_milli, 191_450);
    assert_eq!(h100.memory_mb, 2_085_388_576 / 1024);
    assert_eq!(h100.runtime, flotilla_core::node::RuntimeKind::Container);
    assert!(!h100.simulated);
    // What it still runs, so that registering again fails nothing there.
    assert_eq!(h100.running, vec![id(A), id(B)]);

    // Mixed strategy: one whole GPU, one in MIG mode (7 x 1g.10gb).
    let mig = &nodes[1];
    assert_eq!(mig.gpus.len(), 2);
    assert!(mig
        .gpus
        .iter()
        .all(|g| g.model == "A100-80GB" && g.memory_mib == 81920));
    assert!(!mig.gpus[0].mig_mode);
    assert!(mig.gpus[1].mig_mode);
    assert!(mig.running.is_empty());
    assert_eq!(mig.pool, None);
    assert_eq!(mig.region.as_deref(), Some("eu-west"));

    let cpu = &nodes[2];
    assert!(cpu.gpus.is_empty());
    assert_eq!(cpu.cpu_milli, 8000);

    // A node selector goes to the API server as a label selector.
    let config = KubeConfig {
        node_selector: Some("nvidia.com/gpu.present=true".into()),
        ..KubeConfig::default()
    };
    let ex = KubeExecutor::new(fake.client(), config);
    synced(&ex).await;
    ex.inventory().await.unwrap();
    let lists = fake.requests_to("GET", "/api/v1/nodes");
    assert!(
        lists[1].has_param("labelSelector", "nvidia.com/gpu.present=true"),
        "{:?}",
        lists[1]
    );
}

#[tokio::test]
async fn a_pod_is_created_on_the_placed_node_with_its_gpu_limits() {
    let fake = FakeKube::start().await;
    fake.on("GET", PODS, Reply::Json(200, fixture("pods-empty.json")));
    serve_tenancy(&fake);
    fake.on(
        "POST",
        &format!("/api/v1/namespaces/{NS}/pods"),
        Reply::Json(201, fixture("pod-created.json")),
    );
    let ex = KubeExecutor::new(fake.client(), KubeConfig::default());
    synced(&ex).await;

    ex.apply("gpu-h100-0", &[assignment(A, 2)]).await.unwrap();

    // The tenant's namespace, quota and policy, by server-side apply.
    let ns = fake.requests_to("PATCH", &format!("/api/v1/namespaces/{NS}"));
    assert_eq!(ns.len(), 1);
    assert!(ns[0].has_param("fieldManager", "flotilla") && ns[0].has_param("force", "true"));
    let ns_body = ns[0].body.as_ref().unwrap();
    assert_eq!(ns_body["metadata"]["labels"]["flotilla.dev/tenant"], TENANT);
    assert_eq!(
        ns_body["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "baseline"
    );
    let quota = &fake.requests_to(
        "PATCH",
        &format!("/api/v1/namespaces/{NS}/resourcequotas/flotilla-tenant"),
    )[0];
    assert_eq!(
        quota.body.as_ref().unwrap()["spec"]["hard"]["requests.nvidia.com/gpu"],
        "64"
    );
    let policy = &fake.requests_to(
        "PATCH",
        &format!("/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/flotilla-tenant"),
    )[0];
    let spec = &policy.body.as_ref().unwrap()["spec"];
    assert_eq!(spec["policyTypes"], serde_json::json!(["Ingress"]));
    assert_eq!(spec["podSelector"], serde_json::json!({}));
    assert_eq!(
        spec["ingress"][0]["from"][0],
        serde_json::json!({"podSelector": {}})
    );

    // The pod: pinned, GPUs as limits, the instance in its labels.
    let posts = fake.requests_to("POST", &format!("/api/v1/namespaces/{NS}/pods"));
    assert_eq!(posts.len(), 1);
    let pod = posts[0].body.as_ref().unwrap();
    assert_eq!(
        pod["metadata"]["name"],
        "flotilla-inst-01jd3x7k2q9v8m4n6p5r0s1t2w"
    );
    assert_eq!(pod["metadata"]["labels"]["flotilla.dev/instance"], A);
    assert_eq!(
        pod["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "flotilla"
    );
    assert_eq!(pod["spec"]["nodeName"], "gpu-h100-0");
    assert_eq!(pod["spec"]["restartPolicy"], "Never");
    assert_eq!(pod["spec"]["automountServiceAccountToken"], false);
    assert_eq!(
        pod["spec"]["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    assert_eq!(c_security(pod)["allowPrivilegeEscalation"], false);
    assert_eq!(pod["spec"]["terminationGracePeriodSeconds"], 30);
    let c = &pod["spec"]["containers"][0];
    assert_eq!(c["image"], "nvcr.io/nvidia/pytorch:24.05-py3");
    assert_eq!(c["args"], serde_json::json!(["python", "train.py"]));
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "2");
    assert_eq!(c["resources"]["limits"]["cpu"], "4000m");
    assert_eq!(c["resources"]["limits"]["memory"], "16384Mi");
    let env = c["env"].as_array().unwrap();
    assert!(env
        .iter()
        .any(|e| e["name"] == "EPOCHS" && e["value"] == "3"));
    assert!(env
        .iter()
        .any(|e| e["name"] == "FLOTILLA_INSTANCE_ID" && e["value"] == A));

    // Seen as starting at once (the created object), before any event.
    let o = observed(&ex, "gpu-h100-0", A).await.unwrap();
    assert_eq!(o.phase, ObservedPhase::Starting);
    assert_eq!(o.at, t("2026-12-01T18:02:11Z"));
    assert!(ex.observe("gpu-a100-mig-0").await.unwrap().is_empty());

    // The next round submits nothing again.
    ex.apply("gpu-h100-0", &[assignment(A, 2)]).await.unwrap();
    assert_eq!(
        fake.requests_to("POST", &format!("/api/v1/namespaces/{NS}/pods"))
            .len(),
        1
    );
    assert_eq!(
        fake.requests_to("PATCH", &format!("/api/v1/namespaces/{NS}"))
            .len(),
        1
    );
}

#[tokio::test]
async fn a_private_image_gets_a_pull_secret_named_like_its_pod() {
    let fake = FakeKube::start().await;
    fake.on("GET", PODS, Reply::Json(200, fixture("pods-empty.json")));
    serve_tenancy(&fake);
    let secret =
        format!("/api/v1/namespaces/{NS}/secrets/flotilla-inst-01jd3x7k2q9v8m4n6p5r0s1t2w");
    fake.on(
        "PATCH",
        &secret,
        Reply::Json(200, fixture("secret-pull.json")),
    );
    fake.on(
        "POST",
        &format!("/api/v1/namespaces/{NS}/pods"),
        Reply::Json(201, fixture("pod-created.json")),
    );
    let ex = KubeExecutor::new(fake.client(), KubeConfig::default());
    synced(&ex).await;
    let mut a = assignment(A, 1);
    a.image.as_mut().unwrap().image = "registry.example.com/acme/train:7".into();
    a.registry_auth = Some(flotilla_core::registry::RegistryAuth {
        registry: "registry.example.com".into(),
        username: "acme".into(),
        secret: "s3cret".into(),
    });
    ex.apply("gpu-h100-0", &[a]).await.unwrap();

    let put = &fake.requests_to("PATCH", &secret)[0];
    let body = put.body.as_ref().unwrap();
    assert_eq!(body["type"], "kubernetes.io/dockerconfigjson");
    let config: serde_json::Value =
        serde_json::from_str(body["stringData"][".dockerconfigjson"].as_str().unwrap()).unwrap();
    assert_eq!(config["auths"]["registry.example.com"]["username"], "acme");
    assert_eq!(
        config["auths"]["registry.example.com"]["password"],
        "s3cret"
    );
    let pod = fake.requests_to("POST", &format!("/api/v1/namespaces/{NS}/pods"))[0]
        .body
        .clone()
        .unwrap();
    assert_eq!(
        pod["spec"]["imagePullSecrets"],
        serde_json::json!([{"name": "flotilla-inst-01jd3x7k2q9v8m4n6p5r0s1t2w"}])
    );
}

#[tokio::test]
async fn a_pod_that_already_exists_counts_as_created() {
    // A restarted executor's first round: the pod was created by its
    // previous life and the watch has not shown it yet.
    let fake = FakeKube::start().await;
    fake.on("GET", PODS, Reply::Json(200, fixture("pods-empty.json")));
    serve_tenancy(&fake);
    fake.on(
        "POST",
        &format!("/api/v1/namespaces/{NS}/pods"),
        Reply::Json(409, fixture("status-already-exists-409.json")),
    );
    let ex = KubeExecutor::new(fake.client(), KubeConfig::default());
    synced(&ex).await;
    ex.apply("gpu-h100-0", &[assignment(A, 2)]).await.unwrap();
    assert!(
        observed(&ex, "gpu-h100-0", A).await.is_none(),
        "no failure recorded for a pod that exists"
    );
}

#[tokio::test]
async fn a_gang_whose_second_pod_is_refused_leaves_no_pod_behind() {
    let fake = FakeKube::start().await;
    fake.on(
        "GET",
        "/api/v1/nodes",
        Reply::Json(200, fixture("nodes.json")),
    );
    fake.on("GET", PODS, Reply::Json(200, fixture("pods-empty.json")));
    serve_tenancy(&fake);
    let pods = format!("/api/v1/namespaces/{NS}/pods");
    fake.on(
        "POST",
        &pods,
        Reply::Json(201, fixture("pod-created-rank0.json")),
    );
    fake.on(
        "POST",
        &pods,
        Reply::Json(403, fixture("status-quota-403.json")),
    );
    fake.on(
        "DELETE",
        &pod_path(RANK0),
        Reply::Json(200, fixture("pod-rank0-deleted.json")),
    );
    let ex = KubeExecutor::new(fake.client(), KubeConfig::default());
    synced(&ex).await;
    ex.inventory().await.unwrap();
    let nodes = "gpu-h100-0,gpu-a100-mig-0";

    // Rank 0 alone is held: its peer has not been assigned yet.
    ex.apply("gpu-h100-0", &[member(RANK0, 0, nodes)])
        .await
        .unwrap();
    assert!(fake.requests_to("POST", &pods).is_empty());
    let held = observed(&ex, "gpu-h100-0", RANK0).await.unwrap();
    assert_eq!(held.phase, ObservedPhase::Starting);
    assert!(held.message.unwrap().contains("1 of 2 assigned"));

    // Rank 1 completes the gang: both are created in rank order, the
    // quota refuses the second, the first is deleted at once.
    ex.apply("gpu-a100-mig-0", &[member(RANK1, 1, nodes)])
        .await
        .unwrap();
    let posts = fake.requests_to("POST", &pods);
    assert_eq!(posts.len(), 2);
    assert_eq!(
        posts[0].body.as_ref().unwrap()["metadata"]["labels"]["flotilla.dev/rank"],
        "0"
    );
    assert_eq!(
        posts[0].body.as_ref().unwrap()["spec"]["nodeName"],
        "gpu-h100-0"
    );
    assert_eq!(
        posts[1].body.as_ref().unwrap()["metadata"]["labels"]["flotilla.dev/rank"],
        "1"
    );
    assert_eq!(
        posts[1].body.as_ref().unwrap()["spec"]["nodeName"],
        "gpu-a100-mig-0"
    );
    assert_eq!(
        posts[1].body.as_ref().unwrap()["metadata"]["labels"]["flotilla.dev/job"],
        JOB
    );
    let deletes = fake.requests_to("DELETE", &pod_path(RANK0));
    assert_eq!(deletes.len(), 1);
    assert_eq!(deletes[0].body.as_ref().unwrap()["gracePeriodSeconds"], 0);

    // Both members report the refusal.
    let r1 = observed(&ex, "gpu-a100-mig-0", RANK1).await.unwrap();
    match r1.phase {
        ObservedPhase::FailedToStart { reason } => {
            assert!(
                reason.contains("exceeded quota: flotilla-tenant"),
                "{reason}"
            );
            assert!(reason.contains("403"), "{reason}");
        }
        other => panic!("rank 1: {other:?}"),
    }
    let r0 = observed(&ex, "gpu-h100-0", RANK0).await.unwrap();
    match r0.phase {
        ObservedPhase::FailedToStart { reason } => {
            assert!(
                reason.contains(RANK1) && reason.contains("exceeded quota"),
                "{reason}"
            )
        }
        other => panic!("rank 0: {other:?}"),
    }

    // The next rounds do not try again: the server decides the retry.
    ex.apply("gpu-h100-0", &[member(RANK0, 0, nodes)])
        .await
        .unwrap();
    ex.apply("gpu-a100-mig-0", &[member(RANK1, 1, nodes)])
        .await
        .unwrap();
    assert_eq!(fake.requests_to("POST", &pods).len(), 2);
    // Once the server stops assigning them, they are forgotten.
    ex.apply("gpu-h100-0", &[]).await.unwrap();
    assert!(observed(&ex, "gpu-h100-0", RANK0).await.is_none());
}

#[tokio::test]
async fn a_member_whose_peers_run_elsewhere_is_not_held() {
    let fake = FakeKube::start().await;
    fake.on(
        "GET",
        "/api/v1/nodes",
        Reply::Json(200, fixture("nodes.json")),
    );
    fake.on("GET", PODS, Reply::Json(200, fixture("pods-empty.json")));
    serve_tenancy(&fake);
    let pods = format!("/api/v1/namespaces/{NS}/pods");
    fake.on(
        "POST",
        &pods,
        Reply::Json(201, fixture("pod-created-rank0.json")),
    );
    let ex = KubeExecutor::new(fake.client(), KubeConfig::default());
    synced(&ex).await;
    ex.inventory().await.unwrap();
    // Rank 1 runs on an agent node, not on this cluster.
    ex.apply("gpu-h100-0", &[member(RANK0, 0, "gpu-h100-0,agent-7")])
        .await
        .unwrap();
    assert_eq!(fake.requests_to("POST", &pods).len(), 1);
}

#[tokio::test]
async fn watch_events_drive_phases_with_the_pods_own_times() {
    let fake = FakeKube::start().await;
    fake.on("GET", PODS, Reply::Json(200, fixture("pods-empty.json")));
    let (tx, rx) = mpsc::unbounded();
    fake.on_watch(PODS, String::new(), Then::Feed(rx));
    let ex = KubeExecutor::new(fake.client(), KubeConfig::default());
    synced(&ex).await;
    assert!(ex.observe("gpu-h100-0").await.unwrap().is_empty());

    let phase_of = |want: fn(&ObservedPhase) -> bool| {
        let ex = &ex;
        async move {
            wait_for("a phase", || async {
                observed(ex, "gpu-h100-0", A)
                    .await
                    .filter(|o| want(&o.phase))
            })
            .await
        }
    };

    tx.unbounded_send(fixture("watch-lifecycle-1-creating.ndjson"))
        .unwrap();
    let o = phase_of(|p| *p == ObservedPhase::Starting).await;
    assert_eq!(o.message.as_deref(), Some("ContainerCreating"));
    assert_eq!(o.at, t("2026-12-01T18:02:11Z"));

    tx.unbounded_send(fixture("watch-lifecycle-2-running.ndjson"))
        .unwrap();
    let o = phase_of(|p| matches!(p, ObservedPhase::Running { .. })).await;
    assert_eq!(
        o.at,
        t("2026-12-01T18:02:48Z"),
        "running since the container started"
    );
    assert!(o
        .container
        .unwrap()
        .container_id
        .starts_with("containerd://5f2c"));

    tx.unbounded_send(fixture("watch-lifecycle-3-succeeded.ndjson"))
        .unwrap();
    let o = phase_of(|p| matches!(p, ObservedPhase::Exited { .. })).await;
    assert_eq!(
        o.phase,
        ObservedPhase::Exited {
            code: 0,
            stopped: false
        }
    );
    assert_eq!(
        o.at,
        t("2026-12-01T18:09:29Z"),
        "ended when the container finished"
    );

    // The kubelet refusing a pod pinned to a node whose GPUs are taken.
    tx.unbounded_send(fixture("watch-admission-failed.ndjson"))
        .unwrap();
    let refused = wait_for("the refused pod", || async {
        observed(&ex, "gpu-h100-0", "inst_01jd3x7k2q9v8m4n6p5r0s1t2y").await
    })
    .await;
    match refused.phase {
        ObservedPhase::FailedToStart { reason } => {
            assert!(
                reason.starts_with("UnexpectedAdmissionError: Pod was rejected"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_watch_that_ends_resumes_and_410_gone_forces_a_relist() {
    let fake = FakeKube::start().await;
    fake.on("GET", PODS, Reply::Json(200, fixture("pods-list.json")));
    fake.on("GET", PODS, Reply::Json(200, fixture("pods-relist.json")));
    // 1: one event, then the server closes the watch.
    fake.on_watch(PODS, fixture("watch-ends.ndjson"), Then::End);
    // 2: resumed from the last resource version, which has expired.
    fake.on_watch(PODS, fixture("watch-gone.ndjson"), Then::End);
    // 3: after the relist, quiet.
    fake.on_watch(PODS, String::new(), Then::Hang);
    let ex = KubeExecutor::new(fake.client(), KubeConfig::default());

    // B was deleted while the watch was down: the relist shows it gone.
    let b = wait_for("the relist to notice B is gone", || async {
        let o = ex.observe("gpu-h100-0").await.ok()?;
        o.into_iter()
            .find(|o| o.instance_id.as_str() == B)
            .filter(|o| matches!(o.phase, ObservedPhase::Exited { .. }))
    })
    .await;
    assert_eq!(
        b.phase,
        ObservedPhase::Exited {
            code: 137,
            stopped: false
        }
    );
    assert_eq!(b.message.as_deref(), Some("pod deleted outside Flotilla"));
    let a = observed(&ex, "gpu-h100-0", A).await.unwrap();
    assert_eq!(a.phase, ObservedPhase::Running { pid: 0 });

    let lists: Vec<_> = fake
        .requests_to("GET", PODS)
        .into_iter()
        .filter(|r| !r.is_watch())
        .collect();
    let watches: Vec<_> = fake
        .requests_to("GET", PODS)
        .into_iter()
        .filter(|r| r.is_watch())
        .collect();
    assert_eq!(lists.len(), 2, "one list, one relist after 410");
    assert!(lists[0].has_param("labelSelector", "app.kubernetes.io/managed-by=flotilla"));
    wait_for("the watch after the relist", || async {
        (fake
            .requests_to("GET", PODS)
            .into_iter()
            .filter(|r| r.is_watch())
            .count()
            >= 3)
            .then_some(())
    })
    .await;
    let watches_now: Vec<_> = fake
        .requests_to("GET", PODS)
        .into_iter()
        .filter(|r| r.is_watch())
        .collect();
    assert!(watches.len() >= 2);
    assert!(
        watches_now[0].has_param("resourceVersion", "4402100"),
        "{:?}",
        watches_now[0]
    );
    assert!(
        watches_now[1].has_param("resourceVersion", "4402150"),
        "an ended watch resumes from the last event: {:?}",
        watches_now[1]
    );
    assert!(
        watches_now[2].has_param("resourceVersion", "4409000"),
        "{:?}",
        watches_now[2]
    );
}

#[tokio::test]
async fn stop_deletes_with_the_grace_period_and_orphans_are_deleted() {
    let fake = FakeKube::start().await;
    fake.on("GET", PODS, Reply::Json(200, fixture("pods-list.json")));
    let (tx, rx) = mpsc::unbounded();
    fake.on_watch(PODS, String::new(), Then::Feed(rx));
    fake.on(
        "DELETE",
        &pod_path(A),
        Reply::Json(200, fixture("pod-deleting.json")),
    );
    fake.on(
        "DELETE",
        &pod_path(B),
        Reply::Json(200, fixture("pod-deleting.json")),
    );
    let ex = KubeExecutor::new(fake.client(), KubeConfig::default());
    synced(&ex).await;

    let mut stop = assignment(A, 2);
    stop.stop = true;
    stop.stop_grace_ms = 30_000;
    // B is not assigned any more: an orphan.
    ex.apply("gpu-h100-0", &[stop.clone()]).await.unwrap();
    let del_a = fake.requests_to("DELETE", &pod_path(A));
    assert_eq!(del_a.len(), 1);
    assert_eq!(del_a[0].body.as_ref().unwrap()["gracePeriodSeconds"], 30);
    assert_eq!(fake.requests_to("DELETE", &pod_path(B)).len(), 1);

    tx.unbounded_send(fixture("watch-stop.ndjson")).unwrap();
    let o = wait_for("the stopped pod's end", || async {
        observed(&ex, "gpu-h100-0", A)
            .await
            .filter(|o| matches!(o.phase, ObservedPhase::Exited { .. }))
    })
    .await;
    assert_eq!(
        o.phase,
        ObservedPhase::Exited {
            code: 143,
            stopped: true
        }
    );
    assert_eq!(o.at, t("2026-12-01T18:11:01Z"));
    // Still reported after the pod is gone, until the server lets go.
    wait_for("the DELETED event", || async {
        let after = observed(&ex, "gpu-h100-0", A).await?;
        (after.phase
            == ObservedPhase::Exited {
                code: 143,
                stopped: true,
            })
        .then_some(())
    })
    .await;
    ex.apply("gpu-h100-0", &[stop]).await.unwrap();
    assert_eq!(
        fake.requests_to("DELETE", &pod_path(A)).len(),
        1,
        "not deleted twice"
    );
}

#[tokio::test]
async fn api_errors_surface_as_executor_errors() {
    let fake = FakeKube::start().await;
    fake.on(
        "GET",
        "/api/v1/nodes",
        Reply::Json(403, fixture("status-nodes-forbidden-403.json")),
    );
    fake.on(
        "GET",
        "/api/v1/nodes",
        Reply::Json(503, fixture("status-unavailable-503.json")),
    );
    fake.on("GET", PODS, Reply::Json(200, fixture("pods-empty.json")));
    let ex = KubeExecutor::new(fake.client(), KubeConfig::default());
    synced(&ex).await;

    match ex.inventory().await.unwrap_err() {
        e @ ExecutorError::Refused { .. } => {
            assert!(!e.is_transient());
            let m = e.to_string();
            assert!(
                m.contains("cannot list resource \"nodes\"") && m.contains("403"),
                "{m}"
            );
        }
        other => panic!("{other:?}"),
    }
    match ex.inventory().await.unwrap_err() {
        e @ ExecutorError::Unavailable { .. } => {
            assert!(e.is_transient());
            assert!(
                e.to_string().contains("unable to handle the request"),
                "{e}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        fake.requests_to("GET", "/api/v1/nodes").len(),
        2,
        "a 503 is answered at once, not retried inside the call"
    );

    // The pod list fails: the executor must not pretend nothing runs.
    let down = FakeKube::start().await;
    down.on(
        "GET",
        PODS,
        Reply::Json(503, fixture("status-unavailable-503.json")),
    );
    down.on(
        "GET",
        "/api/v1/nodes",
        Reply::Json(200, fixture("nodes.json")),
    );
    let ex = KubeExecutor::new(down.client(), KubeConfig::default());
    wait_for("the watch's failed list", || async {
        (!down.requests_to("GET", PODS).is_empty()).then_some(())
    })
    .await;
    for e in [
        ex.observe("gpu-h100-0").await.unwrap_err(),
        ex.apply("gpu-h100-0", &[assignment(A, 1)])
            .await
            .unwrap_err(),
        ex.inventory().await.unwrap_err(),
    ] {
        assert!(matches!(e, ExecutorError::Unavailable { .. }), "{e:?}");
    }

    // Nobody listening at all: the watch never lists.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let client = flotilla_backends::kube::client(kube::Config::new(dead.parse().unwrap())).unwrap();
    let ex = KubeExecutor::new(client, KubeConfig::default());
    assert!(ex.inventory().await.unwrap_err().is_transient());
}

#[tokio::test]
async fn logs_come_from_the_pod_log_api_numbered_without_gaps() {
    let fake = FakeKube::start().await;
    fake.on("GET", PODS, Reply::Json(200, fixture("pods-list.json")));
    let log = format!("{}/log", pod_path(A));
    fake.on("GET", &log, Reply::Text(200, fixture("pod-log.txt")));
    fake.on("GET", &log, Reply::Text(200, fixture("pod-log-after.txt")));
    fake.on(
        "GET",
        &log,
        Reply::Json(400, fixture("status-waiting-400.json")),
    );
    let ex = KubeExecutor::new(fake.client(), KubeConfig::default());
    synced(&ex).await;

    let lines = ex.logs(&id(A), 0).await.unwrap();
    assert_eq!(lines.len(), 4);
    assert_eq!(
        lines.iter().map(|l| l.seq).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    assert_eq!(lines[0].line, "NCCL version 2.21.5+cuda12.4");
    assert_eq!(lines[0].at, t("2026-12-01T18:02:48.913402611Z"));
    assert_eq!(lines[3].line, "epoch 2 loss 1.9876");
    let first = &fake.requests_to("GET", &log)[0];
    assert!(first.has_param("timestamps", "true") && first.has_param("container", "main"));
    assert!(!first.params().iter().any(|(k, _)| k == "sinceTime"));

    // The next read asks only for what follows, and drops the line at the
    // boundary second it already has.
    let more = ex.logs(&id(A), 4).await.unwrap();
    assert_eq!(more.iter().map(|l| l.seq).collect::<Vec<_>>(), [4, 5]);
    assert_eq!(more[0].line, "epoch 3 loss 1.7003");
    assert_eq!(more[1].line, "checkpoint saved");
    let second = &fake.requests_to("GET", &log)[1];
    assert!(
        second.has_param("sinceTime", "2026-12-01T18:02:51Z"),
        "{:?}",
        second
    );

    // A container that has not started has no log yet: not an error.
    assert!(ex.logs(&id(A), 0).await.unwrap().is_empty());
}
