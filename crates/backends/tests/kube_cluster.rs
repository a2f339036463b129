//! The Kubernetes executor against a real cluster. Ignored by default:
//! these need a cluster reachable through `KUBECONFIG` (kind or k3s will
//! do; see docs/executors.md, "Running the cluster tests") and rights to
//! create namespaces and pods. They run a small public image without
//! GPUs, so a laptop cluster is enough:
//!
//! ```sh
//! kind create cluster --name flotilla-test
//! cargo test -p flotilla-backends --test kube_cluster -- --ignored --test-threads 1
//! kind delete cluster --name flotilla-test
//! ```

#![cfg(feature = "kubernetes")]

use std::collections::BTreeMap;
use std::time::Duration;

use flotilla_backends::kube::{KubeConfig, KubeExecutor};
use flotilla_backends::Executor;
use flotilla_core::api::{Assignment, ObservedPhase};
use flotilla_core::id::{InstanceId, TenantId};
use flotilla_core::instance::ImageSpec;

fn unique_id(prefix: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let ulid = format!("{:026}", now.as_nanos() % 10u128.pow(26));
    format!("{prefix}{ulid}")
}

async fn until<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test]
#[ignore = "needs a cluster"]
async fn a_pod_runs_to_completion_with_its_logs_and_is_cleaned_up() {
    let ex = KubeExecutor::connect(KubeConfig::default()).await.unwrap();
    until("the pod watch", || async { ex.synced().then_some(()) }).await;
    let nodes = ex.inventory().await.unwrap();
    assert!(!nodes.is_empty(), "the cluster has no Ready node");
    let node = nodes[0].name.clone();

    let instance = InstanceId::parse(&unique_id("inst_"), "instance_id").unwrap();
    let tenant = TenantId::parse(&unique_id("ten_"), "tenant_id").unwrap();
    let a = Assignment {
        instance_id: instance.clone(),
        tenant_id: Some(tenant),
        command: vec![
            "sh".into(),
            "-c".into(),
            "echo hello from $FLOTILLA_INSTANCE_ID; echo done".into(),
        ],
        env: BTreeMap::new(),
        workdir: None,
        gpu_indices: vec![],
        gpu_uuids: vec![],
        gpu_slices: vec![],
        stop: false,
        stop_grace_ms: 5_000,
        image: Some(ImageSpec {
            image: "busybox:1.36".into(),
            ports: vec![],
            scratch_mb: Some(64),
        }),
        cpu_milli: Some(100),
        memory_mb: Some(64),
        registry_auth: None,
        disk_mb: None,
    };
    ex.apply(&node, std::slice::from_ref(&a)).await.unwrap();
    let done =
        until("the pod to exit", || async {
            ex.observe(&node).await.ok()?.into_iter().find(|o| {
                o.instance_id == instance && matches!(o.phase, ObservedPhase::Exited { .. })
            })
        })
        .await;
    assert_eq!(
        done.phase,
        ObservedPhase::Exited {
            code: 0,
            stopped: false
        }
    );
    let logs = ex.logs(&instance, 0).await.unwrap();
    assert_eq!(logs.len(), 2);
    assert_eq!(logs[0].line, format!("hello from {instance}"));

    // The server lets go: the pod is deleted.
    ex.apply(&node, &[]).await.unwrap();
    until("the pod to be gone", || async {
        let gone =
            ex.observe(&node).await.ok()?.iter().all(|o| {
                o.instance_id != instance || matches!(o.phase, ObservedPhase::Exited { .. })
            });
        gone.then_some(())
    })
    .await;
}

#[tokio::test]
#[ignore = "needs a cluster"]
async fn a_stopped_pod_reports_a_requested_stop() {
    let ex = KubeExecutor::connect(KubeConfig::default()).await.unwrap();
    until("the pod watch", || async { ex.synced().then_some(()) }).await;
    let node = ex.inventory().await.unwrap()[0].name.clone();
    let instance = InstanceId::parse(&unique_id("inst_"), "instance_id").unwrap();
    let mut a = Assignment {
        instance_id: instance.clone(),
        tenant_id: None,
        command: vec!["sleep".into(), "3600".into()],
        env: BTreeMap::new(),
        workdir: None,
        gpu_indices: vec![],
        gpu_uuids: vec![],
        gpu_slices: vec![],
        stop: false,
        stop_grace_ms: 2_000,
        image: Some(ImageSpec {
            image: "busybox:1.36".into(),
            ports: vec![],
            scratch_mb: None,
        }),
        cpu_milli: Some(100),
        memory_mb: Some(64),
        registry_auth: None,
        disk_mb: None,
    };
    ex.apply(&node, std::slice::from_ref(&a)).await.unwrap();
    until("the pod to run", || async {
        ex.observe(&node)
            .await
            .ok()?
            .into_iter()
            .find(|o| o.instance_id == instance && matches!(o.phase, ObservedPhase::Running { .. }))
    })
    .await;
    a.stop = true;
    ex.apply(&node, std::slice::from_ref(&a)).await.unwrap();
    let ended =
        until("the stop", || async {
            ex.observe(&node).await.ok()?.into_iter().find(|o| {
                o.instance_id == instance && matches!(o.phase, ObservedPhase::Exited { .. })
            })
        })
        .await;
    assert!(matches!(
        ended.phase,
        ObservedPhase::Exited { stopped: true, .. }
    ));
    ex.apply(&node, &[]).await.unwrap();
}
