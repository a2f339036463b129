//! No workload outlives its bookkeeping: `flotilla up` (server and local
//! agent in one process) is killed with SIGKILL while 6 instances run and
//! restarted on the same data directory. The restarted agent takes the
//! still running workloads over: the server keeps them running (not
//! failed), their output goes on arriving in their logs under the same
//! instance, their run is metered from their first start to their stop,
//! and a new instance asking for every GPU waits until they are stopped.

use std::time::Duration;

use chrono::{DateTime, Utc};
use flotilla_testkit::process::{wait_until, Home};
use serde_json::Value;

mod support;

use support::times::time;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
const GPUS: usize = 6;

fn instance(home: &Home, key: &str, id: &str) -> Value {
    home.get(key, &format!("/v1/instances/{id}"))
}

fn lines(home: &Home, key: &str, id: &str) -> Vec<String> {
    let logs = home.get(key, &format!("/v1/instances/{id}/logs?limit=1000"));
    logs["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["line"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_killed_up_takes_its_running_work_over_after_a_restart() {
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    let home = Home::new(BIN);
    let mut first = home.up(&format!("{GPUS}xH100"), &[], "up");
    let key = home.operator_key();
    home.wait_free_gpus(&key, "H100", GPUS as u64);
    let ids: Vec<String> = (0..GPUS)
        .map(|_| {
            let out = home.cli(
                Some(&key),
                &[
                    "run",
                    "--detach",
                    "--gpus",
                    "1",
                    // The test machine may have two cores: ask for little.
                    "--cpu",
                    "100",
                    "--memory",
                    "64",
                    "--",
                    "sh",
                    "-c",
                    "i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.2; done",
                ],
            );
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        })
        .collect();
    let mut polls = 0;
    wait_until("all run and print", Duration::from_secs(60), || {
        polls += 1;
        if polls % 50 == 0 {
            for id in &ids {
                eprintln!(
                    "{id}: {} {} lines",
                    instance(&home, &key, id)["state"],
                    lines(&home, &key, id).len()
                );
            }
        }
        ids.iter().all(|id| {
            instance(&home, &key, id)["state"] == "running" && lines(&home, &key, id).len() >= 3
        })
    });
    let started: Vec<DateTime<Utc>> = ids
        .iter()
        .map(|id| time(&instance(&home, &key, id)["started_at"]))
        .collect();

    let before: Vec<usize> = ids.iter().map(|id| lines(&home, &key, id).len()).collect();
    // SIGKILL: no shutdown, nothing recorded.
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    let killed_at = Utc::now();
    std::thread::sleep(Duration::from_secs(1));

    let _second = home.up(&format!("{GPUS}xH100"), &[], "up");
    // A new instance wanting every GPU, asked for at once.
    let out = home.cli(
        Some(&key),
        &[
            "run",
            "--detach",
            "--gpus",
            &GPUS.to_string(),
            "--cpu",
            "100",
            "--memory",
            "64",
            "--",
            "true",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let big = String::from_utf8_lossy(&out.stdout).trim().to_string();

    // The old work goes on: output keeps arriving, nothing failed.
    wait_until(
        "output continues after the restart",
        Duration::from_secs(60),
        || {
            ids.iter()
                .zip(&before)
                .all(|(id, n)| lines(&home, &key, id).len() > n + 5)
        },
    );
    for (id, t0) in ids.iter().zip(&started) {
        let inst = instance(&home, &key, id);
        assert_eq!(inst["state"], "running", "{inst}");
        assert_eq!(time(&inst["started_at"]), *t0, "the same run");
        let l = lines(&home, &key, id);
        let ticks: Vec<u64> = l
            .iter()
            .filter_map(|l| l.strip_prefix("tick ")?.parse().ok())
            .collect();
        assert!(
            ticks.windows(2).all(|w| w[1] > w[0]),
            "one run, its lines in order: {l:?}"
        );
    }
    assert_eq!(
        instance(&home, &key, &big)["state"],
        "pending",
        "no GPU is handed out while the old work holds it"
    );

    // Stopped, they are billed until they stopped, and only then the GPUs
    // go to the new instance.
    for id in &ids {
        let out = home.cli(Some(&key), &["stop", id]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    wait_until("the old work stopped", Duration::from_secs(60), || {
        ids.iter().all(|id| {
            let s = instance(&home, &key, id)["state"].clone();
            s != "running" && s != "stopping"
        })
    });
    for (id, t0) in ids.iter().zip(&started) {
        let inst = instance(&home, &key, id);
        assert_ne!(inst["state"], "failed", "{inst}");
        let finished = time(&inst["finished_at"]);
        assert!(finished > killed_at, "ran past the kill: {inst}");
        assert_eq!(time(&inst["started_at"]), *t0);
    }
    wait_until(
        "the big instance is placed",
        Duration::from_secs(60),
        || {
            let s = instance(&home, &key, &big)["state"].clone();
            s != "pending"
        },
    );
}
