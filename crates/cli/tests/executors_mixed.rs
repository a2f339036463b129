//! Three executors in one pool, end to end with the real binary: a
//! `flotilla server`, one `flotilla agent` with two simulated L4s, the
//! Slurm bridge (`flotilla executor slurm`) in front of the real Slurm
//! cluster of `scripts/slurm-cluster` (two nodes of two simulated H100s),
//! and the Kubernetes bridge (`flotilla executor kubernetes`) in front of
//! the fake API server of `flotilla_backends::kube::fake` (one node of two
//! A100-80GB, found through a `KUBECONFIG` as kubectl finds a cluster).
//!
//! It shows that `flotilla nodes` lists the nodes of all three executors
//! with their GPUs, and that one scheduling pass places work on all three:
//! three instances, each accepting one GPU model (and a model no node has),
//! are held in the queue by the tenant's per-model quota, and one quota
//! write releases them together, so the first pass after it places all
//! three. Each runs (its output arrives as its log; the pod exists in the
//! fake with its GPU limit and pinned node; the Slurm job runs on the
//! node Flotilla chose), is stopped, and is metered for the time its
//! engine ran it.
//!
//! Without a Slurm cluster the test runs with the agent and Kubernetes
//! only and says that it skipped the Slurm part; `.ci/run` sets
//! `FLOTILLA_REQUIRE_SLURM`, which turns that skip into a failure.

use std::time::Duration;

use flotilla_backends::kube::fake::{FakeKube, FakeNode};
use flotilla_testkit::process::{http, wait_until, Home, Proc};
use serde_json::{json, Value};

mod support;

use support::slurm::{instance, log_lines, metered_secs, text, CancelOnDrop, Cluster};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
const KUBE_NODE: &str = "kube-a100-0";
const AGENT_NODE: &str = "metal-0";

fn secs_between(from: &Value, to: &Value) -> f64 {
    let t = |v: &Value| {
        chrono::DateTime::parse_from_rfc3339(v.as_str().unwrap_or_default())
            .map(|d| d.timestamp_millis())
            .unwrap_or(0)
    };
    (t(to) - t(from)) as f64 / 1000.0
}

fn put_quota(env: &Home, op: &str, tenant: &str, quota: &Value) {
    let (status, body) = http(
        "PUT",
        &format!("{}/v1/tenants/{tenant}/quota", env.url()),
        Some(op),
        Some(&quota.to_string()),
    )
    .expect("the server answers");
    assert_eq!(status, 200, "PUT quota: {body}");
}

#[test]
fn agent_slurm_and_kubernetes_nodes_share_one_inventory_and_one_placement() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime for the fake API server");
    let slurm = match Cluster::find() {
        Ok(c) => Some(c),
        Err(why) if std::env::var_os("FLOTILLA_REQUIRE_SLURM").is_some() => {
            panic!("FLOTILLA_REQUIRE_SLURM is set but there is no Slurm cluster: {why}")
        }
        Err(why) => {
            eprintln!("SKIPPED the Slurm part: no Slurm cluster: {why}");
            None
        }
    };
    if let Some(s) = &slurm {
        s.cancel_ours();
    }
    let _cleanup = CancelOnDrop(slurm.as_ref());
    let fake = rt.block_on(FakeKube::stateful(vec![FakeNode::gpu(
        KUBE_NODE,
        "NVIDIA-A100-SXM4-80GB",
        81920,
        2,
    )
    .label("flotilla.dev/pool", "kube")]));

    let env = Home::new(BIN);
    let _server = env.server();
    let op = env.operator_key();
    let (tenant, key) = env.tenant("mixed");
    let _agent = env.agent(AGENT_NODE, "2xL4");
    let token_path = env.data().join("agent.token");
    let token = std::fs::read_to_string(&token_path).expect("agent token");
    let token = token.trim().to_string();

    let _slurm_bridge = slurm.as_ref().map(|s| {
        let v = &s.vars;
        Proc(
            env.cmd()
                .args(["--server", &env.url(), "executor", "slurm"])
                .args(["--token", &token])
                .args(["--slurmrestd", &v["FLOTILLA_SLURMRESTD"]])
                .args(["--slurm-user", &v["FLOTILLA_SLURM_USER"]])
                .args(["--output-dir", &v["FLOTILLA_SLURM_OUTPUT_DIR"]])
                .arg("--simulated-gpus")
                .env("FLOTILLA_SLURM_TOKEN", &v["FLOTILLA_SLURM_TOKEN"])
                .stdout(env.log("slurm-bridge"))
                .stderr(env.log("slurm-bridge"))
                .spawn()
                .expect("start flotilla executor slurm"),
        )
    });
    let kubeconfig = env.dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, fake.kubeconfig()).expect("write the kubeconfig");
    let _kube_bridge = Proc(
        env.cmd()
            .args(["--server", &env.url(), "executor", "kubernetes"])
            .args(["--token", &token])
            .env("KUBECONFIG", &kubeconfig)
            .stdout(env.log("kube-bridge"))
            .stderr(env.log("kube-bridge"))
            .spawn()
            .expect("start flotilla executor kubernetes"),
    );

    // One inventory: every node of every executor, ready, with its GPUs.
    let mut expected: Vec<(&str, &str, &str)> = vec![
        (AGENT_NODE, "agent", "L4"),
        (KUBE_NODE, "kubernetes", "A100-80GB"),
    ];
    if slurm.is_some() {
        expected.push(("flotilla-n1", "slurm", "H100"));
        expected.push(("flotilla-n2", "slurm", "H100"));
    }
    wait_until(
        "the nodes of every executor to be ready",
        Duration::from_secs(90),
        || {
            let nodes = env.get(&op, "/v1/nodes");
            let items = nodes["items"].as_array().cloned().unwrap_or_default();
            expected.iter().all(|(name, executor, model)| {
                items.iter().any(|n| {
                    n["name"] == *name
                        && n["executor"] == *executor
                        && n["state"] == "ready"
                        && n["gpus"]
                            .as_array()
                            .is_some_and(|g| g.len() == 2 && g.iter().all(|g| g["model"] == *model))
                })
            })
        },
    );
    let out = env.cli(Some(&op), &["nodes"]);
    assert!(out.status.success(), "{}", text(&out));
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    let header = table.lines().next().unwrap_or_default();
    assert!(
        header.contains("EXECUTOR") && header.contains("GPUS"),
        "{table}"
    );
    for (name, executor, model) in &expected {
        let row = table
            .lines()
            .find(|l| l.split_whitespace().any(|w| w == *name))
            .unwrap_or_else(|| panic!("{name} in `flotilla nodes`:\n{table}"));
        assert!(
            row.split_whitespace().any(|w| w == *executor),
            "{name} is a {executor} node: {row}"
        );
        assert!(
            row.contains(&format!("2x{model} (2 free)")),
            "{name} has its GPUs: {row}"
        );
    }
    eprintln!("{table}");

    // Hold: the tenant may use none of the three models for now. Each
    // instance also accepts a T4, which no node has, so the quota admits
    // it and it queues.
    let held = json!({"gpus_per_model": {"L4": 0, "H100": 0, "A100-80GB": 0}});
    put_quota(&env, &op, &tenant, &held);
    let mut work: Vec<(&str, &str, String)> = Vec::new();
    let agent_id = env.run_detached(
        &key,
        &[
            "--gpu-type",
            "L4,T4",
            "--",
            "sh",
            "-c",
            "echo agent up; for i in 1 2 3 4 5 6; do sleep 1; echo tick $i; done; exec sleep 300",
        ],
    );
    work.push(("agent", AGENT_NODE, agent_id));
    let kube_id = env.run_detached(
        &key,
        &[
            "--gpu-type",
            "A100-80GB,T4",
            "--image",
            "busybox:1.36",
            "--",
            "sh",
            "-c",
            "echo kube up; for i in 1 2 3 4 5 6; do sleep 1; echo tick $i; done; exec sleep 300",
        ],
    );
    work.push(("kubernetes", KUBE_NODE, kube_id.clone()));
    let slurm_id = slurm.as_ref().map(|_| {
        env.run_detached(
            &key,
            &[
                "--gpu-type",
                "H100,T4",
                "--",
                "sh",
                "-c",
                "echo slurm up; for i in 1 2 3 4 5 6; do sleep 1; echo tick $i; done; exec sleep 300",
            ],
        )
    });
    if let Some(id) = &slurm_id {
        work.push(("slurm", "", id.clone()));
    }
    wait_until(
        "every instance to wait in the queue with its reason",
        Duration::from_secs(60),
        || {
            work.iter().all(|(_, _, id)| {
                // Created with "waiting for placement"; the first pass
                // after it names the quota.
                let i = instance(&env, &key, id);
                i["state"] == "pending"
                    && i["state_reason"]
                        .as_str()
                        .is_some_and(|r| r.contains("GPU model not allowed"))
            })
        },
    );
    for (executor, _, id) in &work {
        let i = instance(&env, &key, id);
        assert!(i["node_id"].is_null(), "held: {i}");
        let reason = i["state_reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains("GPU model not allowed"),
            "held by the quota: {reason}"
        );
        eprintln!("{executor}: {id} waits: {reason}");
    }

    // Release: one quota write makes all of them placeable at once.
    put_quota(&env, &op, &tenant, &json!({}));
    wait_until(
        "every instance to run on its executor",
        Duration::from_secs(120),
        || {
            work.iter()
                .all(|(_, _, id)| instance(&env, &key, id)["state"] == "running")
        },
    );
    let node_of = |id: &str| -> Value {
        let i = instance(&env, &key, id);
        env.get(
            &op,
            &format!("/v1/nodes/{}", i["node_id"].as_str().unwrap_or("")),
        )
    };
    for (executor, name, id) in &work {
        let node = node_of(id);
        assert_eq!(node["executor"], *executor, "{id} on {node}");
        if !name.is_empty() {
            assert_eq!(node["name"], *name, "{id}");
        }
        let tag = match *executor {
            "kubernetes" => "kube",
            e => e,
        };
        wait_until(
            &format!("{id}'s output from {executor}"),
            Duration::from_secs(60),
            || {
                log_lines(&env, &key, id)
                    .iter()
                    .any(|l| l == &format!("{tag} up"))
            },
        );
    }

    // The pod: in the tenant's namespace, pinned to the node, with the
    // GPU limit placement chose, running.
    let pod_name = format!("flotilla-{}", kube_id.replace('_', "-"));
    let pod = fake
        .pods()
        .into_iter()
        .find(|p| p["metadata"]["name"] == pod_name.as_str())
        .unwrap_or_else(|| panic!("the pod {pod_name} in {:?}", fake.pods()));
    assert_eq!(
        pod["metadata"]["namespace"],
        format!("flotilla-{}", tenant.replace('_', "-"))
    );
    assert_eq!(pod["spec"]["nodeName"], KUBE_NODE);
    assert_eq!(
        pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "1"
    );
    assert_eq!(pod["status"]["phase"], "Running");
    // Its cold start, from the pod's conditions and container state, as
    // the agent reports its own.
    let inst = instance(&env, &key, &kube_id);
    let cold = &inst["cold_start"];
    assert!(cold["ready_at"].is_string(), "{inst}");
    assert_eq!(
        secs_between(
            &pod["status"]["containerStatuses"][0]["state"]["running"]["startedAt"],
            &cold["ready_at"]
        ),
        0.0,
        "ready when the container started: {inst}"
    );
    assert!(cold["starting_ms"].is_u64(), "{inst}");
    assert!(cold["queued_ms"].is_u64(), "{inst}");

    // The Slurm job: running on the node Flotilla placed the instance on.
    if let (Some(s), Some(id)) = (&slurm, &slurm_id) {
        let job = s.job_of(id).expect("the instance's Slurm job");
        assert_eq!(job.job_state, "RUNNING", "{job:?}");
        assert_eq!(node_of(id)["name"], job.nodes.as_str(), "{job:?}");
    }

    // Each has run for six seconds by its own count.
    wait_until(
        "every instance to count to six",
        Duration::from_secs(60),
        || {
            work.iter()
                .all(|(_, _, id)| log_lines(&env, &key, id).iter().any(|l| l == "tick 6"))
        },
    );

    // Stop all three; each engine ends its work.
    for (_, _, id) in &work {
        let out = env.cli(Some(&key), &["stop", id]);
        assert!(out.status.success(), "{}", text(&out));
    }
    wait_until("every instance to stop", Duration::from_secs(90), || {
        work.iter()
            .all(|(_, _, id)| instance(&env, &key, id)["state"] == "stopped")
    });
    wait_until("the pod to be deleted", Duration::from_secs(30), || {
        fake.pods()
            .iter()
            .all(|p| p["metadata"]["name"] != pod_name.as_str())
    });
    if let (Some(s), Some(id)) = (&slurm, &slurm_id) {
        wait_until(
            "the Slurm job to be cancelled",
            Duration::from_secs(30),
            || s.job_of(id).is_some_and(|j| j.job_state == "CANCELLED"),
        );
    }

    // Usage: each metered for the time its engine ran it.
    let engine_secs = |executor: &str, id: &str| -> f64 {
        match executor {
            "kubernetes" => {
                let last = fake
                    .pod_events()
                    .into_iter()
                    .rev()
                    .find(|(_, p)| p["metadata"]["name"] == pod_name.as_str())
                    .map(|(_, p)| p)
                    .expect("the pod's last state");
                let t = &last["status"]["containerStatuses"][0]["state"]["terminated"];
                secs_between(&t["startedAt"], &t["finishedAt"])
            }
            "slurm" => {
                let j = slurm
                    .as_ref()
                    .and_then(|s| s.job_of(id))
                    .expect("the Slurm job");
                (j.end_time - j.start_time) as f64
            }
            _ => {
                let i = instance(&env, &key, id);
                secs_between(&i["started_at"], &i["finished_at"])
            }
        }
    };
    for (executor, _, id) in &work {
        let engine = engine_secs(executor, id);
        assert!(engine > 0.0, "{executor} ran {id} for {engine}s");
        let mut metered = 0.0;
        wait_until(
            &format!("{id} metered as {executor} ran it ({engine}s)"),
            Duration::from_secs(90),
            || {
                metered = metered_secs(&env, &key, id);
                // Slurm and Kubernetes report whole seconds; usage is
                // metered to the millisecond of the times reported.
                (metered - engine).abs() <= 2.0
            },
        );
        assert!(
            engine >= 5.0 && metered >= 5.0,
            "{id}: ran {engine}s, metered {metered}s"
        );
        eprintln!("{executor}: {id} ran {engine:.3}s, metered {metered:.3}s");
    }
}
