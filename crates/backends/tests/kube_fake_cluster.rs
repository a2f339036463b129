//! The Kubernetes executor against the stateful fake cluster
//! (`flotilla_backends::kube::fake`): pods it creates really run (their
//! command as a local process), move Pending → Running → Succeeded through
//! the watch, give their output as logs, end with SIGTERM on a graceful
//! delete, and are refused at admission when their node's GPUs are taken.
//! What `kube_executor.rs` checks answer by answer, this checks as a
//! lifecycle, and it is what the CLI's end-to-end test of mixed executors
//! stands on.

#![cfg(feature = "kubernetes")]

mod support;

use std::collections::BTreeMap;

use flotilla_backends::kube::{KubeConfig, KubeExecutor};
use flotilla_backends::Executor;
use flotilla_core::api::{Assignment, ObservedInstance, ObservedPhase};
use flotilla_core::id::{InstanceId, TenantId};
use flotilla_core::instance::ImageSpec;
use support::fake_kube::{wait_for, FakeKube, FakeNode};

const TENANT: &str = "ten_01jd3x7k2q9v8m4n6p5r0s1t2a";
const NS: &str = "flotilla-ten-01jd3x7k2q9v8m4n6p5r0s1t2a";
const NODE: &str = "kube-a100-0";

fn assignment(instance: &str, gpus: u32, script: &str) -> Assignment {
    Assignment {
        instance_id: InstanceId::parse(instance, "instance_id").unwrap(),
        tenant_id: Some(TenantId::parse(TENANT, "tenant_id").unwrap()),
        command: vec!["sh".into(), "-c".into(), script.into()],
        env: BTreeMap::from([("GREETING".to_string(), "hello".to_string())]),
        workdir: None,
        gpu_indices: (0..gpus).collect(),
        gpu_uuids: (0..gpus).map(|i| format!("k8s-{NODE}-gpu{i}")).collect(),
        gpu_slices: vec![],
        stop: false,
        stop_grace_ms: 5_000,
        image: Some(ImageSpec {
            image: "busybox:1.36".into(),
            ports: vec![],
            scratch_mb: None,
        }),
        cpu_milli: Some(1000),
        memory_mb: Some(1024),
        registry_auth: None,
        disk_mb: None,
    }
}

async fn observed(ex: &KubeExecutor, instance: &str) -> Option<ObservedInstance> {
    ex.observe(NODE)
        .await
        .ok()?
        .into_iter()
        .find(|o| o.instance_id.as_str() == instance)
}

async fn cluster() -> (FakeKube, KubeExecutor) {
    let fake =
        FakeKube::stateful(vec![FakeNode::gpu(NODE, "NVIDIA-A100-SXM4-80GB", 81920, 2)
            .label("flotilla.dev/pool", "kube")])
        .await;
    let ex = KubeExecutor::new(fake.client(), KubeConfig::default());
    wait_for("the pod watch's first list", || async {
        ex.synced().then_some(())
    })
    .await;
    (fake, ex)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_runs_its_command_reports_its_output_and_succeeds() {
    let (fake, ex) = cluster().await;
    let nodes = ex.inventory().await.unwrap();
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0].gpus.len(), 2);
    assert_eq!(nodes[0].gpus[0].model, "A100-80GB");
    assert_eq!(nodes[0].pool.as_deref(), Some("kube"));

    let a = "inst_01jd3x7k2q9v8m4n6p5r0s1t2w";
    let list = [assignment(
        a,
        1,
        "echo \"$GREETING from $FLOTILLA_INSTANCE_ID\"; sleep 1; echo done",
    )];
    ex.apply(NODE, &list).await.unwrap();

    // The tenant's namespace, quota and policy were applied.
    assert!(fake.object("namespaces", "", NS).is_some());
    assert!(fake
        .object("resourcequotas", NS, "flotilla-tenant")
        .is_some());
    assert!(fake
        .object("networkpolicies", NS, "flotilla-tenant")
        .is_some());

    let running = wait_for("the pod to run", || async {
        observed(&ex, a)
            .await
            .filter(|o| matches!(o.phase, ObservedPhase::Running { .. }))
    })
    .await;
    let done = wait_for("the pod to succeed", || async {
        observed(&ex, a)
            .await
            .filter(|o| matches!(o.phase, ObservedPhase::Exited { .. }))
    })
    .await;
    assert_eq!(
        done.phase,
        ObservedPhase::Exited {
            code: 0,
            stopped: false
        }
    );
    assert!(done.at >= running.at, "{done:?} after {running:?}");
    let lines: Vec<String> = ex
        .logs(&done.instance_id, 0)
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.line)
        .collect();
    assert_eq!(lines, [format!("hello from {a}"), "done".to_string()]);

    // The watch saw it go through every phase, as a kubelet reports them.
    let phases: Vec<String> = fake
        .pod_events()
        .iter()
        .map(|(t, o)| format!("{t} {}", o["status"]["phase"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(
        phases,
        [
            "ADDED Pending",
            "MODIFIED Pending",
            "MODIFIED Running",
            "MODIFIED Succeeded"
        ]
    );
    let pod = &fake.pods()[0];
    assert_eq!(pod["spec"]["nodeName"], NODE);
    assert_eq!(
        pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_deletes_the_pod_with_its_grace_and_a_full_node_refuses_a_pod() {
    let (fake, ex) = cluster().await;
    ex.inventory().await.unwrap();
    let long = "inst_01jd3x7k2q9v8m4n6p5r0s1t2x";
    let mut list = vec![assignment(
        long,
        2,
        "trap 'echo term; exit 143' TERM; echo up; while true; do sleep 0.1; done",
    )];
    ex.apply(NODE, &list).await.unwrap();
    wait_for("the long pod to run", || async {
        observed(&ex, long)
            .await
            .filter(|o| matches!(o.phase, ObservedPhase::Running { .. }))
    })
    .await;

    // Both GPUs are taken: the kubelet refuses a third pod at admission.
    let extra = "inst_01jd3x7k2q9v8m4n6p5r0s1t2y";
    list.push(assignment(extra, 1, "echo never"));
    ex.apply(NODE, &list).await.unwrap();
    let refused = wait_for("the extra pod to be refused", || async {
        observed(&ex, extra)
            .await
            .filter(|o| matches!(o.phase, ObservedPhase::FailedToStart { .. }))
    })
    .await;
    let ObservedPhase::FailedToStart { reason } = refused.phase else {
        unreachable!()
    };
    assert!(reason.contains("UnexpectedAdmissionError"), "{reason}");

    // A stop: the pod is deleted with the grace asked, its command gets
    // SIGTERM, and it ends as stopped.
    list[0].stop = true;
    ex.apply(NODE, &list).await.unwrap();
    let deletes: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| r.method == "DELETE" && r.path.contains("/pods/"))
        .collect();
    assert_eq!(deletes.len(), 1, "{deletes:?}");
    let grace = deletes[0]
        .param("gracePeriodSeconds")
        .or_else(|| {
            deletes[0]
                .body
                .as_ref()
                .and_then(|b| b["gracePeriodSeconds"].as_i64())
                .map(|g| g.to_string())
        })
        .unwrap_or_default();
    assert_eq!(grace, "5");
    let stopped = wait_for("the stopped pod to be gone", || async {
        observed(&ex, long)
            .await
            .filter(|o| matches!(o.phase, ObservedPhase::Exited { .. }) && fake.pods().len() == 1)
    })
    .await;
    assert_eq!(
        stopped.phase,
        ObservedPhase::Exited {
            code: 143,
            stopped: true
        }
    );
    let types: Vec<String> = fake.pod_events().into_iter().map(|(t, _)| t).collect();
    assert_eq!(types.last().map(String::as_str), Some("DELETED"));
}
