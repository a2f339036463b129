//! Output is never dropped silently: a workload's lines that together far
//! exceed the server's 1 MiB limit on a request all arrive in its log, in
//! order (the agent ships them in batches that fit).

use std::time::Duration;

use flotilla_testkit::process::{wait_until, Home};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

#[test]
fn forty_lines_of_sixty_kib_and_a_marker_all_arrive() {
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    let home = Home::new(BIN);
    let _server = home.server();
    let _agent = home.agent("logs-node", "1xH100");
    let op = home.operator_key();
    let t = home.cli_json(Some(&op), &["tenants", "create", "chatty"]);
    let k = home.cli_json(
        Some(&op),
        &[
            "keys",
            "create",
            "--role",
            "tenant_admin",
            "--tenant",
            t["id"].as_str().unwrap(),
        ],
    );
    let key = k["secret"].as_str().unwrap();
    let out = home.cli(
        Some(key),
        &[
            "run",
            "--detach",
            "--gpus",
            "1",
            "--",
            "sh",
            "-c",
            "for i in $(seq 1 40); do printf '%05d' $i; head -c 61435 /dev/zero | tr '\\0' x; echo; done; echo the-end",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    wait_until("the instance ends", Duration::from_secs(90), || {
        let s = home.get(key, &format!("/v1/instances/{id}"))["state"]
            .as_str()
            .unwrap()
            .to_string();
        s == "succeeded" || s == "failed"
    });
    let inst = home.get(key, &format!("/v1/instances/{id}"));
    assert_eq!(inst["state"], "succeeded", "{inst}");
    let logs = home.get(key, &format!("/v1/instances/{id}/logs?limit=100"));
    let lines: Vec<&str> = logs["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["line"].as_str().unwrap())
        .collect();
    assert_eq!(lines.len(), 41, "every line arrives");
    for (i, line) in lines[..40].iter().enumerate() {
        assert_eq!(line.len(), 61_440, "line {i} whole");
        assert!(
            line.starts_with(&format!("{:05}", i + 1)),
            "line {i} in order"
        );
    }
    assert_eq!(lines[40], "the-end");
}
