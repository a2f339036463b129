//! Preemption end to end, as a user sees it: the real `flotilla` binary as
//! server, agent (2 simulated H100s) and CLI. A spot job fills the node; a
//! tier-1 run preempts it; the spot job gets SIGTERM, is requeued, and
//! later runs again and completes.

use std::time::Duration;

use flotilla_testkit::process::{wait_until, Home};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

fn instances(env: &Home, key: &str) -> Vec<Value> {
    env.get(key, "/v1/instances")["items"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

#[test]
fn tier_one_run_preempts_a_spot_job_which_is_requeued_and_completes() {
    let env = Home::new(BIN);
    let _server = env.server();
    let _agent = env.agent("preempt-node", "2xH100");
    let op = env.operator_key();
    let t = env.cli_json(Some(&op), &["tenants", "create", "acme"]);
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
    wait_until("the node's 2 GPUs", Duration::from_secs(20), || {
        env.get(&key, "/v1/gpu-types")["items"]
            .as_array()
            .is_some_and(|a| a.iter().any(|g| g["name"] == "H100" && g["free"] == 2))
    });

    // The spot job checkpoints on SIGTERM (a marker file) and, once
    // requeued, resumes from it and completes.
    let mark = env.shared().join("checkpoint");
    let script = "trap 'echo got SIGTERM; touch \"$MARK\"; exit 143' TERM; echo started; \
                  if [ -f \"$MARK\" ]; then echo resumed; exit 0; fi; \
                  while true; do sleep 0.2; done";
    let out = env.cli(
        Some(&key),
        &[
            "run",
            "--detach",
            "--billing",
            "spot",
            "--gpus",
            "2",
            "--env",
            &format!("MARK={}", mark.display()),
            "--",
            "sh",
            "-c",
            script,
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let spot = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(spot.starts_with("inst_"), "detach prints the id: {spot}");
    wait_until("the spot job to start", Duration::from_secs(15), || {
        env.log_lines(&key, &spot).iter().any(|l| l == "started")
    });

    let out = env.cli(Some(&key), &["run", "--gpus", "2", "--", "echo", "hi"]);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "tier-1 run failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.lines().any(|l| l == "hi"), "{stdout}");

    let v = env.get(&key, &format!("/v1/instances/{spot}"));
    assert_eq!(v["state"], "stopped", "{v}");
    assert!(
        v["state_reason"].as_str().unwrap().contains("preempted"),
        "{v}"
    );
    assert!(
        v["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["state"] == "running"
                && e["reason"].as_str().unwrap().starts_with("preempted by")),
        "an event announced the preemption: {v}"
    );
    assert!(
        env.log_lines(&key, &spot)
            .iter()
            .any(|l| l == "got SIGTERM"),
        "the spot job got SIGTERM: {:?}",
        env.log_lines(&key, &spot)
    );

    // The requeued work runs again and completes.
    let mut requeued = String::new();
    wait_until(
        "the requeued spot work to complete",
        Duration::from_secs(20),
        || {
            let Some(r) = instances(&env, &key)
                .into_iter()
                .find(|i| i["requeued_from"] == spot.as_str())
            else {
                return false;
            };
            requeued = r["id"].as_str().unwrap_or("").to_string();
            r["state"] == "succeeded"
        },
    );
    let lines = env.log_lines(&key, &requeued);
    assert!(lines.iter().any(|l| l == "resumed"), "{lines:?}");
    // Nothing is left queued.
    let q = env.cli(Some(&key), &["queue"]);
    assert!(q.status.success(), "{}", String::from_utf8_lossy(&q.stderr));
    // An empty queue says so rather than printing a bare header.
    let out = String::from_utf8_lossy(&q.stdout);
    assert!(out.contains("the queue is empty"), "{out}");
    assert!(!out.contains("POS"), "{out}");
}
