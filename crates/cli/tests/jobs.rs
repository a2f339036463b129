//! Jobs end to end, as a user sees them: the real `flotilla` binary as
//! server, two agents (two simulated nodes of one H100 each) and CLI. A
//! 2-node job runs one rank on each node and succeeds; a tier-1 instance
//! preempts a spot job's member, every member gets SIGTERM, the whole job
//! is requeued and later completes.

use std::process::Output;
use std::time::Duration;

use flotilla_testkit::process::{wait_until, Home};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A server, two 1-GPU agents and a tenant admin key.
fn setup(
    env: &Home,
) -> (
    flotilla_testkit::process::Proc,
    Vec<flotilla_testkit::process::Proc>,
    String,
) {
    let server = env.server();
    let agents = vec![env.agent("node-a", "1xH100"), env.agent("node-b", "1xH100")];
    let op = env.operator_key();
    let t = env.cli_json(Some(&op), &["tenants", "create", "research"]);
    let tenant = t["id"].as_str().unwrap().to_string();
    let key = env.cli_json(
        Some(&op),
        &[
            "keys",
            "create",
            "--role",
            "tenant_admin",
            "--tenant",
            &tenant,
        ],
    )["secret"]
        .as_str()
        .unwrap()
        .to_string();
    wait_until("both nodes' GPUs", Duration::from_secs(20), || {
        env.get(&key, "/v1/gpu-types")["items"]
            .as_array()
            .is_some_and(|a| a.iter().any(|g| g["name"] == "H100" && g["free"] == 2))
    });
    (server, agents, key)
}

fn job(env: &Home, key: &str, id: &str) -> Value {
    env.get(key, &format!("/v1/jobs/{id}"))
}

fn rank_logs(env: &Home, key: &str, id: &str, rank: u32) -> String {
    text(&env.cli(
        Some(key),
        &["jobs", "logs", id, "--rank", &rank.to_string()],
    ))
}

#[test]
fn a_two_node_job_runs_one_rank_per_node_and_succeeds() {
    let env = Home::new(BIN);
    let (_server, _agents, key) = setup(&env);
    let out = env.cli(
        Some(&key),
        &[
            "jobs",
            "submit",
            "--gpus",
            "2",
            "--nodes",
            "2",
            "--name",
            "allreduce",
            "--wait",
            "--",
            "sh",
            "-c",
            "echo rank=$FLOTILLA_JOB_RANK of $FLOTILLA_JOB_WORLD_SIZE attempt=$FLOTILLA_JOB_ATTEMPT nodes=$FLOTILLA_JOB_NODES gpus=$CUDA_VISIBLE_DEVICES",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let id = stdout.split_whitespace().next().unwrap().to_string();
    assert!(id.starts_with("job_"), "{stdout}");
    assert!(stdout.contains("succeeded"), "{stdout}");

    let j = job(&env, &key, &id);
    assert_eq!(
        (j["state"].as_str(), j["attempts"].as_u64()),
        (Some("succeeded"), Some(1))
    );
    let members = j["members"].as_array().unwrap();
    assert_eq!(members.len(), 2, "{j}");
    assert_ne!(
        members[0]["node_id"], members[1]["node_id"],
        "one rank per node: {j}"
    );
    for rank in 0..2 {
        let logs = rank_logs(&env, &key, &id, rank);
        assert!(
            logs.contains(&format!("rank={rank} of 2 attempt=1 nodes=node-a,node-b"))
                || logs.contains(&format!("rank={rank} of 2 attempt=1 nodes=node-b,node-a")),
            "{logs}"
        );
        assert!(
            logs.contains("gpus=0"),
            "each rank sees its node's GPU: {logs}"
        );
    }

    // Members are instances, so they are metered like any: both ranks
    // appear in the tenant's usage.
    wait_until("both members metered", Duration::from_secs(60), || {
        let usage = env
            .get(
                &key,
                "/v1/usage?from=2000-01-01T00:00:00Z&to=2100-01-01T00:00:00Z",
            )
            .to_string();
        members
            .iter()
            .all(|m| usage.contains(m["instance_id"].as_str().unwrap()))
    });

    // list, show, explain and the queue, as a person reads them.
    let list = text(&env.cli(Some(&key), &["jobs", "list", "--all"]));
    assert!(
        list.contains(&id) && list.contains("succeeded") && list.contains("2xany (2x1)"),
        "{list}"
    );
    let show = text(&env.cli(Some(&key), &["explain", &id]));
    assert!(
        show.contains(&format!("{id} is succeeded: all 2 members exited 0")),
        "{show}"
    );
    assert!(show.contains("attempt 1 rank 1"), "{show}");
    let followed = text(&env.cli(Some(&key), &["jobs", "logs", &id, "--rank", "1", "-f"]));
    assert!(followed.contains("rank=1 of 2"), "{followed}");
    let member = members[1]["instance_id"].as_str().unwrap();
    let m = text(&env.cli(Some(&key), &["explain", member]));
    assert!(
        m.contains(&format!("member: rank 1 of {id}, attempt 1")),
        "{m}"
    );
    let q = env.cli_json(Some(&key), &["jobs", "queue"]);
    assert_eq!(q, serde_json::json!([]));
    // Operators set the tenant's guarantee and fair-share weight.
    let op = env.operator_key();
    let q = env.cli_json(
        Some(&op),
        &[
            "quota",
            "set",
            "--tenant",
            "research",
            "--guaranteed",
            "1",
            "--gpus-total",
            "4",
            "--weight",
            "2",
        ],
    );
    assert_eq!(
        (
            q["quota"]["gpus_guaranteed"].as_u64(),
            q["quota"]["weight"].as_u64()
        ),
        (Some(1), Some(2)),
        "{q}"
    );
    let shown = text(&env.cli(Some(&op), &["quota", "--tenant", "research"]));
    assert!(
        shown.contains("guaranteed GPUs: 1; fair-share weight: 2"),
        "{shown}"
    );
    let bad = env.cli(
        Some(&key),
        &[
            "jobs", "submit", "--gpus", "3", "--nodes", "2", "--", "true",
        ],
    );
    assert!(!bad.status.success());
    assert!(text(&bad).contains("gpus"), "{}", text(&bad));
}

#[test]
fn a_tier_one_instance_preempts_a_spot_job_member_and_the_whole_job_is_requeued_and_completes() {
    let env = Home::new(BIN);
    let (_server, _agents, key) = setup(&env);
    // Each rank checkpoints on SIGTERM (a marker file per rank) and, once
    // requeued, resumes from it and completes.
    let mark = env.shared().join("ckpt");
    let script = "trap 'echo got SIGTERM; touch \"$MARK.$FLOTILLA_JOB_RANK\"; exit 143' TERM; \
                  echo started attempt $FLOTILLA_JOB_ATTEMPT; \
                  if [ -f \"$MARK.$FLOTILLA_JOB_RANK\" ]; then echo resumed; exit 0; fi; \
                  while true; do sleep 0.2; done";
    let out = env.cli(
        Some(&key),
        &[
            "jobs",
            "submit",
            "--gpus",
            "2",
            "--nodes",
            "2",
            "--tier",
            "2",
            "--preemptible",
            "--billing",
            "spot",
            "--env",
            &format!("MARK={}", mark.display()),
            "--",
            "sh",
            "-c",
            script,
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    wait_until("both ranks to start", Duration::from_secs(20), || {
        (0..2).all(|r| rank_logs(&env, &key, &id, r).contains("started attempt 1"))
    });

    // A tier-1 run needs one GPU: the job is preempted whole.
    let out = env.cli(Some(&key), &["run", "--gpus", "1", "--", "echo", "hi"]);
    assert!(out.status.success(), "tier-1 run failed: {}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l == "hi"));

    // The run needed one GPU: the other member may still be in its
    // notice when the run ends.
    let attempt_one_stopped = || {
        let j = job(&env, &key, &id);
        j["members"].as_array().is_some_and(|ms| {
            ms.iter()
                .filter(|m| m["attempt"] == 1)
                .all(|m| m["state"] == "stopped")
        })
    };
    wait_until(
        "both members of attempt 1 to stop",
        Duration::from_secs(20),
        attempt_one_stopped,
    );
    let j = job(&env, &key, &id);
    let first: Vec<&Value> = j["members"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["attempt"] == 1)
        .collect();
    assert_eq!(first.len(), 2, "{j}");
    for m in &first {
        let inst = env.get(
            &key,
            &format!("/v1/instances/{}", m["instance_id"].as_str().unwrap()),
        );
        assert_eq!(inst["state"], "stopped", "{inst}");
        assert!(
            inst["preempted_by"].is_string(),
            "every member was preempted: {inst}"
        );
    }
    // The notice reached every rank: each got SIGTERM.
    let lines: Vec<String> = first
        .iter()
        .map(|m| {
            let id = m["instance_id"].as_str().unwrap();
            env.get(&key, &format!("/v1/instances/{id}/logs"))["items"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|l| l["line"].as_str().map(String::from))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .collect();
    for l in &lines {
        assert!(l.contains("got SIGTERM"), "{lines:?}");
    }

    // Requeued whole, placed again once the tier-1 run is done, completes.
    wait_until("the job to complete", Duration::from_secs(30), || {
        job(&env, &key, &id)["state"] == "succeeded"
    });
    let j = job(&env, &key, &id);
    assert_eq!(
        (j["attempts"].as_u64(), j["failures"].as_u64()),
        (Some(2), Some(0)),
        "{j}"
    );
    assert!(
        j["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["state"] == "queued"
                && e["reason"].as_str().unwrap().contains("requeued whole")),
        "{j}"
    );
    for r in 0..2 {
        let logs = rank_logs(&env, &key, &id, r);
        assert!(
            logs.contains("started attempt 2") && logs.contains("resumed"),
            "{logs}"
        );
    }
    // Nothing was requeued as a lone instance.
    let pending = env.get(&key, "/v1/instances?state=pending");
    assert!(pending["items"].as_array().unwrap().is_empty(), "{pending}");
}
