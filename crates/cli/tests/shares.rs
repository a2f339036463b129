//! GPU shares end to end with the real binary: an agent started with a
//! simulated H100 in MIG mode (`--simulate-gpus 1xH100:mig,1xH100`) runs
//! three `1g.10gb` instances at once, each seeing its own MIG device, and a
//! `--gpu-fraction` run sees its MPS thread percentage and memory cap.

use std::time::Duration;

use flotilla_testkit::process::{wait_until, Home};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

fn tenant_key(home: &Home) -> String {
    let op = home.operator_key();
    let t = home.cli_json(Some(&op), &["tenants", "create", "shares"]);
    let id = t["id"].as_str().unwrap().to_string();
    let k = home.cli_json(
        Some(&op),
        &["keys", "create", "--role", "tenant_admin", "--tenant", &id],
    );
    k["secret"].as_str().unwrap().to_string()
}

fn instance(home: &Home, key: &str, id: &str) -> Value {
    home.get(key, &format!("/v1/instances/{id}"))
}

#[test]
fn three_mig_slices_run_at_once_on_one_simulated_h100_and_a_fraction_gets_mps_limits() {
    let home = Home::new(BIN);
    let _server = home.server();
    let _agent = home.agent("mig-node", "1xH100:mig,1xH100");
    let key = tenant_key(&home);
    wait_until("the node's two GPUs", Duration::from_secs(30), || {
        let nodes = home.get(&key, "/v1/gpu-types");
        nodes["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["name"] == "H100" && t["total"] == 2)
    });
    let mut ids = Vec::new();
    for _ in 0..3 {
        let i = home.cli_json(
            Some(&key),
            &[
                "run",
                "--detach",
                "--mig",
                "1g.10gb",
                // Small, so three fit on a two-core test machine.
                "--cpu",
                "100",
                "--",
                "sh",
                "-c",
                // Runs until told to stop, so all three are up at once.
                "echo \"dev=$CUDA_VISIBLE_DEVICES profile=$FLOTILLA_MIG_PROFILE\"; sleep 120",
            ],
        );
        ids.push(i["id"].as_str().unwrap().to_string());
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while !ids
        .iter()
        .all(|id| instance(&home, &key, id)["state"] == "running")
    {
        if std::time::Instant::now() > deadline {
            let states: Vec<Value> = ids.iter().map(|id| instance(&home, &key, id)).collect();
            panic!("three MIG instances never ran at once: {states:#?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut devices = Vec::new();
    for id in &ids {
        let mut line = String::new();
        wait_until("the instance's first line", Duration::from_secs(30), || {
            let out = home.cli(Some(&key), &["logs", id]);
            line = String::from_utf8_lossy(&out.stdout)
                .lines()
                .find(|l| l.starts_with("dev="))
                .unwrap_or_default()
                .to_string();
            !line.is_empty()
        });
        assert!(line.ends_with("profile=1g.10gb"), "{line}");
        let dev = line["dev=".len()..].split(' ').next().unwrap().to_string();
        let slice = &instance(&home, &key, id)["gpu_slices"][0];
        assert_eq!(slice["mig_device"], dev.as_str(), "{line}");
        devices.push(dev);
    }
    devices.sort();
    assert!(
        devices.iter().all(|d| d.starts_with("MIG-GPU-")),
        "{devices:?}"
    );
    let numbers: Vec<&str> = devices
        .iter()
        .map(|d| d.rsplit('/').nth(1).unwrap())
        .collect();
    assert_eq!(numbers, vec!["1", "2", "3"], "{devices:?}");
    for id in &ids {
        let out = home.cli(Some(&key), &["stop", id]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // A quarter share, in the foreground: its output is the MPS limits.
    let out = home.cli(
        Some(&key),
        &[
            "run",
            "--gpu-fraction",
            "0.25",
            "--cpu",
            "100",
            "--",
            "sh",
            "-c",
            "echo \"mps=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE mem=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT dev=$CUDA_VISIBLE_DEVICES\"",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The GPU out of MIG mode is index 1; a quarter of 80 GiB is 20480 MiB.
    assert!(stdout.contains("mps=25 mem=0=20480M dev=1"), "{stdout}");
}
