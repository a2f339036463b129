//! A tenant cannot take the node down under the process runtime: the real
//! `flotilla` server and agent, and workloads doing what an attacker would
//! (allocate far past their memory, spin more CPUs than they asked for,
//! fork without end, fill the disk), each held to its limit and, where the
//! limit ends it, ended with the reason. Each limit is checked against a
//! precondition that shows the same workload gets past it where it is
//! allowed to, so the assertion could fail.
//!
//! Needs root (cgroups are the kernel's, the agent sets them up as root,
//! as in production and in CI); as another user it says so and passes.
//! The agent's groups are removed with the test's home, even on failure
//! (`flotilla_testkit::process::Home`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use flotilla_testkit::process::{http, wait_until, Home};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
/// The node's default process limit in this test: low, so that the fork
/// loop cannot hurt the machine running the test.
const PIDS: u64 = 64;
/// The node's default disk limit in this test, MiB.
const DISK_MB: u64 = 64;

fn run(home: &Home, key: &str, args: &[&str]) -> String {
    let mut all = vec!["--gpus", "1"];
    all.extend_from_slice(args);
    home.run_detached(key, &all)
}

fn instance(home: &Home, key: &str, id: &str) -> Value {
    home.get(key, &format!("/v1/instances/{id}"))
}

/// Waits until the instance ended; its state and reason.
fn ended(home: &Home, key: &str, id: &str) -> (String, String) {
    let mut last = Value::Null;
    wait_until(&format!("{id} ended"), Duration::from_secs(120), || {
        last = instance(home, key, id);
        matches!(
            last["state"].as_str(),
            Some("succeeded" | "failed" | "stopped")
        )
    });
    (
        last["state"].as_str().unwrap_or_default().to_string(),
        last["state_reason"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    )
}

fn wait_for_line(home: &Home, key: &str, id: &str, line: &str) {
    wait_until(
        &format!("{id} printed {line}"),
        Duration::from_secs(60),
        || home.log_lines(key, id).iter().any(|l| l == line),
    );
}

fn stop(home: &Home, key: &str, id: &str) {
    let out = home.cli(Some(key), &["stop", id]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn cgroup_v2() -> bool {
    Path::new("/sys/fs/cgroup/cgroup.controllers").is_file()
}

/// The agent's parent group in the tree of `controller` (v1) or the one
/// tree (v2); `node` is its group's name.
fn node_group(node: &str, controller: &str) -> PathBuf {
    let root = Path::new("/sys/fs/cgroup");
    if cgroup_v2() {
        root.join("flotilla").join(node)
    } else {
        root.join(controller).join("flotilla").join(node)
    }
}

/// The instance's group in the tree of `controller`.
fn cgroup(node: &str, id: &str, controller: &str) -> PathBuf {
    node_group(node, controller).join(id)
}

/// CPU time the instance's group used so far.
fn cpu_used(node: &str, id: &str) -> Option<Duration> {
    if cgroup_v2() {
        let text = std::fs::read_to_string(cgroup(node, id, "cpu").join("cpu.stat")).ok()?;
        let us = text.lines().find_map(|l| l.strip_prefix("usage_usec "))?;
        return Some(Duration::from_micros(us.trim().parse().ok()?));
    }
    let text = std::fs::read_to_string(cgroup(node, id, "cpuacct").join("cpuacct.usage")).ok()?;
    Some(Duration::from_nanos(text.trim().parse().ok()?))
}

fn memory_available_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        / 1024
}

/// Holds 1 GiB: `tail` keeps the last line, and the zeros have no newline.
/// Its status is `tail`'s (137 when killed).
const ALLOCATE_1G: &str = "head -c 1G /dev/zero | tail >/dev/null && echo allocated";

fn memory(home: &Home, key: &str) {
    assert!(
        memory_available_mib() > 2048,
        "the host has the memory for the allocation"
    );
    let allowed = run(
        home,
        key,
        &["--memory", "2048M", "--", "sh", "-c", ALLOCATE_1G],
    );
    let limited = run(
        home,
        key,
        &["--memory", "256M", "--", "sh", "-c", ALLOCATE_1G],
    );
    let (state, reason) = ended(home, key, &allowed);
    assert_eq!(
        (state.as_str(), reason.as_str()),
        ("succeeded", "exit code 0")
    );
    assert!(home
        .log_lines(key, &allowed)
        .contains(&"allocated".to_string()));
    let (state, reason) = ended(home, key, &limited);
    assert_eq!(state, "failed");
    assert!(reason.starts_with("out of memory"), "{reason}");
}

/// Periods in which the group wanted more CPU than its quota (`cpu.stat`
/// of the cpu tree, v1 and v2 alike).
fn throttled_periods(node: &str, id: &str) -> u64 {
    let text = std::fs::read_to_string(cgroup(node, id, "cpu").join("cpu.stat")).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("nr_throttled "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

fn cpu(home: &Home, key: &str, node: &str) {
    let spin = "while :; do :; done & while :; do :; done & echo spinning; wait";
    let half = run(home, key, &["--cpu", "500", "--", "sh", "-c", spin]);
    // A tenth of a core is below what the loops get even on a loaded test
    // machine, so its quota must visibly hold them back.
    let tenth = run(home, key, &["--cpu", "100", "--", "sh", "-c", spin]);
    wait_for_line(home, key, &half, "spinning");
    wait_for_line(home, key, &tenth, "spinning");
    let (t0, h0, u0) = (
        Instant::now(),
        cpu_used(node, &half).expect("cpu usage"),
        cpu_used(node, &tenth).expect("cpu usage"),
    );
    let throttled0 = throttled_periods(node, &tenth);
    std::thread::sleep(Duration::from_secs(5));
    let secs = t0.elapsed().as_secs_f64();
    let half_rate = (cpu_used(node, &half).expect("cpu usage") - h0).as_secs_f64() / secs;
    let tenth_rate = (cpu_used(node, &tenth).expect("cpu usage") - u0).as_secs_f64() / secs;
    let throttled = throttled_periods(node, &tenth) - throttled0;
    let half_throttled = throttled_periods(node, &half);
    for id in [&half, &tenth] {
        stop(home, key, id);
    }
    for id in [&half, &tenth] {
        ended(home, key, id);
    }
    eprintln!(
        "cpu: --cpu 500 used {half_rate:.3} CPU-s/s ({half_throttled} periods throttled), \
         --cpu 100 used {tenth_rate:.3} ({throttled} periods throttled)"
    );
    assert!(
        half_rate <= 0.6,
        "--cpu 500 used {half_rate:.3} CPU-seconds per second"
    );
    assert!(half_rate > 0.02, "the loops ran: {half_rate:.3}");
    if half_rate > 0.45 {
        assert!(half_throttled > 0, "at its quota, it was held there");
    }
    assert!(
        throttled > 10,
        "the quota held the loops back: {throttled} periods"
    );
    assert!(tenth_rate <= 0.15, "--cpu 100 used {tenth_rate:.3}");
}

fn pids(home: &Home, key: &str, node: &str) {
    // dash ends when a fork fails: the loop runs in a shell of its own,
    // and the instance's shell goes on (without forking) once it ended.
    let forks =
        "sh -c 'for i in $(seq 200); do sleep 300 & done' 2>/dev/null; echo forked; exec sleep 300";
    let id = run(home, key, &["--", "sh", "-c", forks]);
    wait_for_line(home, key, &id, "forked");
    let group = cgroup(node, &id, "pids");
    let procs = std::fs::read_to_string(group.join("cgroup.procs")).unwrap();
    let n = procs.lines().count() as u64;
    let events = std::fs::read_to_string(group.join("pids.events")).unwrap();
    let refused: u64 = events
        .lines()
        .find_map(|l| l.strip_prefix("max "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    eprintln!("pids: {n} processes in the group, {refused} forks refused");
    assert!(refused > 0, "forks past the limit were refused: {events}");
    assert!(n <= PIDS && n > PIDS / 2, "held at the limit: {n}");
    assert_eq!(instance(home, key, &id)["state"], "running");
    stop(home, key, &id);
    let (state, _) = ended(home, key, &id);
    assert_eq!(state, "stopped");
    // The node survived: it runs the next instance, and the group is gone.
    assert!(
        !group.exists(),
        "the group was removed: {}",
        group.display()
    );
    let next = run(home, key, &["--", "sh", "-c", "echo still-here"]);
    assert_eq!(ended(home, key, &next).0, "succeeded");
}

fn disk(home: &Home, key: &str) {
    // The API refuses a limit it cannot hold, naming the field, before
    // anything is created.
    for bad in ["0", "67108865"] {
        let body = format!(r#"{{"gpus": 1, "command": ["true"], "disk_mb": {bad}}}"#);
        let (status, answer) = http(
            "POST",
            &format!("{}/v1/instances", home.url()),
            Some(key),
            Some(&body),
        )
        .unwrap();
        assert_eq!(status, 422, "{answer}");
        assert_eq!(answer["error"]["details"]["field"], "disk_mb", "{answer}");
    }

    // Precondition: writing works, here past the node's default because
    // the instance asked for more (`--disk`).
    let write = |mb: u64| format!("head -c {mb}M /dev/zero > f && echo wrote; sleep 300");
    let asked = run(
        home,
        key,
        &["--disk", "160M", "--", "sh", "-c", &write(100)],
    );
    wait_for_line(home, key, &asked, "wrote");
    let big = run(home, key, &["--", "sh", "-c", &write(100)]);
    let (state, reason) = ended(home, key, &big);
    assert_eq!(state, "failed");
    assert!(reason.starts_with("disk limit exceeded"), "{reason}");
    // The one that asked for more kept running past the default's
    // checks.
    assert_eq!(instance(home, key, &asked)["state"], "running");
    stop(home, key, &asked);
    assert_eq!(ended(home, key, &asked).0, "stopped");
}

/// The node's id, once an agent named `name` registered.
fn node_id(home: &Home, op: &str, name: &str) -> String {
    let mut id = String::new();
    wait_until(
        &format!("{name} registers"),
        Duration::from_secs(60),
        || {
            let nodes = home.cli_json(Some(op), &["nodes"]);
            let found = nodes
                .as_array()
                .and_then(|n| n.iter().find(|n| n["name"] == name))
                .and_then(|n| n["id"].as_str());
            if let Some(found) = found {
                id = found.to_string();
            }
            found.is_some()
        },
    );
    id
}

/// An agent that is not root cannot set up cgroups: `nodes show` says
/// which limits its node does not enforce, and the enforcing node shows
/// none.
fn unenforced_limits_are_reported(home: &Home, enforcing: &str) {
    use std::os::unix::process::CommandExt;
    const NOBODY: u32 = 65_534;
    let op = home.operator_key();
    let shown = home.cli(
        Some(&op),
        &["nodes", "show", &node_id(home, &op, enforcing)],
    );
    let shown = String::from_utf8_lossy(&shown.stdout).into_owned();
    assert!(
        shown.contains(enforcing) && !shown.contains("not enforced"),
        "{shown}"
    );

    let work = home.dir.path().join("agent-nobody");
    std::fs::create_dir_all(&work).unwrap();
    std::os::unix::fs::chown(&work, Some(NOBODY), Some(NOBODY)).unwrap();
    let token = std::fs::read_to_string(home.data().join("agent.token")).unwrap();
    let agent = home
        .cmd()
        .args(["agent", "--server", &home.url(), "--token", token.trim()])
        .args([
            "--name",
            "unlimited",
            "--simulate-gpus",
            "1xH100",
            "--work-dir",
        ])
        .arg(&work)
        .uid(NOBODY)
        .gid(NOBODY)
        .current_dir("/")
        .stdout(home.log("agent-nobody"))
        .stderr(home.log("agent-nobody"))
        .spawn()
        .unwrap();
    let _agent = flotilla_testkit::process::Proc(agent);
    let id = node_id(home, &op, "unlimited");
    let shown = home.cli(Some(&op), &["nodes", "show", &id]);
    let shown = String::from_utf8_lossy(&shown.stdout).into_owned();
    for controller in ["memory", "cpu", "pids"] {
        assert!(
            shown.contains(&format!("limits:    not enforced: {controller}: ")),
            "{shown}"
        );
    }
    let log = std::fs::read_to_string(home.dir.path().join("agent-nobody.log")).unwrap();
    assert!(
        log.contains("some limits cannot be enforced on this node"),
        "{log}"
    );
}

#[test]
fn workloads_are_held_to_their_limits() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: cgroup limits need root (CI runs this as root)");
        return;
    }
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    let name = format!("limits-{}", std::process::id());
    let home = Home::new(BIN);
    // The agent's group, as it names it.
    let node = flotilla_core::node::workload_cgroup(&name, &home.dir.path().join("agent"));
    let _server = home.server();
    let _agent = home.agent_with(
        &name,
        "4xH100",
        &home.url(),
        &[
            "--default-pids",
            &PIDS.to_string(),
            "--default-disk",
            &format!("{DISK_MB}M"),
        ],
    );
    let (_, key) = home.tenant("limited");
    memory(&home, &key);
    cpu(&home, &key, &node);
    pids(&home, &key, &node);
    disk(&home, &key);
    unenforced_limits_are_reported(&home, &name);
    // Nothing of this node is left in the cgroup trees once its work ended.
    for controller in ["memory", "cpu", "pids"] {
        let parent = node_group(&node, controller);
        let left: Vec<_> = std::fs::read_dir(&parent)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.file_name())
                    .collect()
            })
            .unwrap_or_default();
        assert!(
            left.is_empty(),
            "groups left in {}: {left:?}",
            parent.display()
        );
    }
    let agent_log = std::fs::read_to_string(home.dir.path().join("agent.log")).unwrap();
    assert!(
        agent_log.contains("workloads are held to their memory, cpu, pids and disk limits"),
        "the node enforces every limit"
    );
}
