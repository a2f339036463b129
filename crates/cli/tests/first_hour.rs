//! A newcomer's first hour, on the real binary: the README's quick start
//! run line by line against `flotilla up` (read from README.md itself, so
//! the README cannot drift from what works), the start refused before
//! anything starts when the sandbox is missing, `./flotilla`'s install
//! step, CPU and memory defaults that fit a small machine, and work that
//! can never fit the pool saying so.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use flotilla_testkit::process::{free_port, http, wait_until, Home, Proc};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn text(out: &std::process::Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The shell commands of the README's `## Quick start` section: every
/// line of its `sh` blocks, continuation lines joined.
fn quick_start_commands(readme: &str) -> Vec<String> {
    let start = readme
        .find("\n## Quick start")
        .expect("README has a Quick start section");
    let section = &readme[start + 1..];
    let end = section[3..].find("\n## ").map_or(section.len(), |e| e + 3);
    let section = &section[..end];
    let mut commands = Vec::new();
    let mut in_block = false;
    let mut pending = String::new();
    for line in section.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block && line.trim() == "```sh";
            continue;
        }
        if !in_block || line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        match line.trim_end().strip_suffix('\\') {
            Some(head) => {
                pending.push_str(head);
                pending.push(' ');
            }
            None => {
                pending.push_str(line.trim());
                commands.push(std::mem::take(&mut pending));
            }
        }
    }
    assert!(!in_block, "an unclosed code block in the quick start");
    commands
}

/// The ids the quick start's commands printed, by prefix, latest last.
fn ids_in(out: &str, seen: &mut BTreeMap<&'static str, String>) {
    for prefix in ["node_", "inst_", "job_", "ten_"] {
        for word in out.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if word.starts_with(prefix) && word.len() > prefix.len() + 8 {
                seen.insert(prefix, word.to_string());
            }
        }
    }
}

/// `<… id>` placeholders replaced by an id an earlier command printed.
fn fill_placeholders(cmd: &str, seen: &BTreeMap<&'static str, String>) -> String {
    let mut out = String::new();
    let mut rest = cmd;
    while let Some(open) = rest.find('<') {
        let Some(close) = rest[open..].find('>') else {
            break;
        };
        let inner = &rest[open + 1..open + close];
        let prefix = if inner.contains("node") {
            "node_"
        } else if inner.contains("instance") || inner.contains("inst") {
            "inst_"
        } else if inner.contains("job") {
            "job_"
        } else if inner.contains("ten") {
            "ten_"
        } else {
            panic!("a placeholder the test cannot fill: <{inner}> in {cmd}")
        };
        let id = seen
            .get(prefix)
            .unwrap_or_else(|| panic!("no {prefix}… id printed before: {cmd}"));
        out.push_str(&rest[..open]);
        out.push_str(id);
        rest = &rest[open + close + 1..];
    }
    out.push_str(rest);
    out
}

/// `flotilla up` in `env`'s home on free ports, waiting until it answers.
fn start_up(env: &Home, extra: &[&str]) -> Proc {
    let bind = format!("127.0.0.1:{}", env.port);
    let gateway = format!("127.0.0.1:{}", free_port());
    let child = env
        .cmd()
        .args(["up", "--bind", &bind, "--gateway-bind", &gateway])
        .args(extra)
        .stdout(env.log("up"))
        .stderr(env.log("up"))
        .spawn()
        .expect("start flotilla up");
    let up = Proc(child);
    wait_until("up answers", Duration::from_secs(60), || {
        http("GET", &format!("{}/healthz", env.url()), None, None).is_ok_and(|(s, _)| s == 200)
    });
    up
}

#[test]
fn the_readmes_quick_start_runs_on_up() {
    let readme = std::fs::read_to_string(repo().join("README.md")).expect("README.md");
    let commands = quick_start_commands(&readme);
    assert!(
        commands.len() >= 15 && commands.iter().all(|c| c.starts_with("./flotilla ")),
        "{commands:#?}"
    );
    let env = Home::new(BIN);
    let _up = start_up(&env, &[]);
    let key = env.operator_key();
    wait_until("the local node is ready", Duration::from_secs(60), || {
        env.get(&key, "/v1/nodes")["items"][0]["state"] == "ready"
    });
    // `./flotilla` as the README writes it: the binary under test, run by
    // a shell in a directory that holds it under that name.
    let cwd = tempfile::tempdir().expect("temporary directory");
    std::os::unix::fs::symlink(BIN, cwd.path().join("flotilla")).expect("link the binary");
    let mut seen = BTreeMap::new();
    for cmd in &commands {
        let line = fill_placeholders(cmd, &seen);
        let began = Instant::now();
        // `cmd()` runs the binary: take its environment, run the shell.
        let base = env.cmd();
        let mut sh = Command::new("sh");
        sh.arg("-c").arg(&line).current_dir(cwd.path());
        for (k, v) in base.get_envs() {
            match v {
                Some(v) => sh.env(k, v),
                None => sh.env_remove(k),
            };
        }
        sh.env("FLOTILLA_SERVER", env.url())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = sh.spawn().expect("run the shell");
        let pid = child.id();
        // Each command to completion within a deadline.
        let deadline = Duration::from_secs(120);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(child.wait_with_output());
        });
        let out = match rx.recv_timeout(deadline) {
            Ok(out) => out.expect("wait for the shell"),
            Err(_) => {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
                env.dump_logs();
                panic!("`{line}` did not end within {deadline:?}");
            }
        };
        assert!(out.status.success(), "`{line}`: {}", text(&out));
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        eprintln!("`{line}` ({:.1} s)", began.elapsed().as_secs_f64());
        ids_in(&stdout, &mut seen);
        // What the quick start promises each shows.
        if line.contains("--gpus 2 -- sh -c 'echo \"my GPUs") {
            assert!(stdout.starts_with("my GPUs: "), "{stdout}");
        }
        if line.contains("--gpu-fraction 0.25") {
            assert!(stdout.contains("share: 0.25"), "{stdout}");
        }
        if line.contains("flotilla exec ") {
            assert!(stdout.starts_with("inside, GPUs "), "{stdout}");
        }
        if line.contains("jobs submit") {
            assert!(stdout.contains("succeeded"), "{stdout}");
        }
    }
    for prefix in ["node_", "inst_", "job_"] {
        assert!(seen.contains_key(prefix), "no {prefix} id seen: {seen:?}");
    }
}

/// Six simulated GPUs on a node that reports two CPUs: six one-GPU
/// instances asking no CPU or memory all run at once, each with a sixth of
/// the node.
#[test]
fn six_one_gpu_instances_run_at_once_on_two_cpus() {
    let env = Home::new(BIN);
    let _server = env.server();
    let _agent = env.agent_with(
        "small",
        "4xH100,2xL40S",
        &env.url(),
        &["--simulate-cpus", "2", "--simulate-memory-gb", "6"],
    );
    let key = env.operator_key();
    wait_until("the node is ready", Duration::from_secs(60), || {
        env.get(&key, "/v1/nodes")["items"][0]["state"] == "ready"
    });
    let node = env.get(&key, "/v1/nodes")["items"][0].clone();
    assert_eq!(node["cpu_milli"], 2000, "{node}");
    let ids: Vec<String> = (0..6)
        .map(|_| env.run_detached(&key, &["--gpus", "1", "--", "sleep", "300"]))
        .collect();
    wait_until("six instances running", Duration::from_secs(90), || {
        ids.iter()
            .all(|id| env.get(&key, &format!("/v1/instances/{id}"))["state"] == "running")
    });
    let mut cpu = 0;
    for id in &ids {
        let i = env.get(&key, &format!("/v1/instances/{id}"));
        assert_eq!(i["cpu_milli"], 333, "a sixth of two CPUs: {i}");
        assert_eq!(i["memory_mb"], 6_000_000_000u64 / (1024 * 1024) / 6, "{i}");
        cpu += i["cpu_milli"].as_u64().unwrap();
    }
    assert!(cpu <= 2000, "{cpu}");
    // A half GPU asks half a GPU's share; an explicit request is kept.
    let half = env.run_detached(&key, &["--gpu-fraction", "0.5", "--", "true"]);
    let i = env.get(&key, &format!("/v1/instances/{half}"));
    assert_eq!(i["cpu_milli"], 166, "{i}");
    let own = env.run_detached(&key, &["--gpus", "1", "--cpu", "1500", "--", "true"]);
    let i = env.get(&key, &format!("/v1/instances/{own}"));
    assert_eq!(i["cpu_milli"], 1500, "{i}");
}

/// A two-node gang on a one-machine pool: held with a reason that names
/// the field and the pool's size (never "cordoned"), and `--wait` exits
/// non-zero instead of waiting forever.
#[test]
fn a_gang_wider_than_the_pool_is_unschedulable_and_wait_fails() {
    let env = Home::new(BIN);
    let _server = env.server();
    let _agent = env.agent("only", "4xH100,2xL40S");
    let key = env.operator_key();
    wait_until("the node is ready", Duration::from_secs(60), || {
        env.get(&key, "/v1/nodes")["items"][0]["state"] == "ready"
    });
    // The pool would hold the same GPUs on one machine: a one-node job runs.
    let out = env.cli(
        Some(&key),
        &[
            "jobs", "submit", "--gpus", "2", "--nodes", "1", "--wait", "--", "true",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    let began = Instant::now();
    let out = env.cli(
        Some(&key),
        &[
            "jobs", "submit", "--gpus", "2", "--nodes", "2", "--wait", "--", "true",
        ],
    );
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(began.elapsed() < Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("unschedulable in this pool: nodes: asks 2 distinct machines"),
        "{stderr}"
    );
    assert!(stderr.contains("this pool has 1"), "{stderr}");
    assert!(!stderr.contains("cordoned"), "{stderr}");
    // It stays queued, and `flotilla queue` lists it with its reason.
    let queue = env.cli(Some(&key), &["queue"]);
    let listed = String::from_utf8_lossy(&queue.stdout);
    assert!(
        queue.status.success() && listed.contains("job_"),
        "{}",
        text(&queue)
    );
    assert!(listed.contains("unschedulable in this pool"), "{listed}");
    let q = env.cli_json(Some(&key), &["queue"]);
    assert_eq!(q[0]["kind"], "job", "{q}");
}

/// `flotilla up` as root with bubblewrap missing from `PATH`: it exits
/// before the server binds or "flotilla is up" is printed, naming what to
/// install. (Precondition: with bubblewrap on `PATH` the same start
/// passes the check and answers.)
#[test]
fn up_without_bubblewrap_refuses_before_starting() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: the sandbox check applies to root");
        return;
    }
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    let env = Home::new(BIN);
    // A PATH with everything of the system's but bwrap.
    let bin = tempfile::tempdir().expect("temporary directory");
    let mut linked = 0;
    for dir in [
        "/usr/local/sbin",
        "/usr/local/bin",
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
    ] {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            if name == "bwrap" || bin.path().join(&name).exists() {
                continue;
            }
            if std::os::unix::fs::symlink(e.path(), bin.path().join(&name)).is_ok() {
                linked += 1;
            }
        }
    }
    assert!(linked > 10 && bin.path().join("sh").exists());
    let bind = format!("127.0.0.1:{}", env.port);
    let out = env
        .cmd()
        .env("PATH", bin.path())
        .args([
            "up",
            "--bind",
            &bind,
            "--gateway-bind",
            &format!("127.0.0.1:{}", free_port()),
        ])
        .output()
        .expect("run flotilla up");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(!stdout.contains("flotilla is up"), "{}", text(&out));
    assert!(
        stderr.contains("bubblewrap (`bwrap`) is not installed")
            && stderr.contains("apt-get install bubblewrap"),
        "{stderr}"
    );
    // Nothing started: no database, no key saved.
    assert!(!env.data().join("flotilla.db").exists());
    assert!(!env.dir.path().join("config/credentials.json").exists());

    // The same start with bubblewrap on PATH passes the check.
    let _up = start_up(&env, &[]);
    assert!(env.data().join("flotilla.db").exists());
}

/// `scripts/prerequisites` (run by `./flotilla up` before the build) as
/// root with bubblewrap and nft missing: it installs bubblewrap and
/// nftables (not iproute2, which is there) with apt-get. A stub `apt-get`
/// first on `PATH` records its arguments and "installs" by linking the real
/// binaries, so no package is touched.
#[test]
fn the_flotilla_script_installs_the_sandbox_and_network_packages_as_root() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: the install step runs as root");
        return;
    }
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    let real_bwrap = ["/usr/bin/bwrap", "/bin/bwrap"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("bwrap installed");
    let tmp = tempfile::tempdir().expect("temporary directory");
    let stub = tmp.path().join("stub");
    let system = tmp.path().join("system");
    std::fs::create_dir_all(&stub).unwrap();
    std::fs::create_dir_all(&system).unwrap();
    for dir in ["/usr/sbin", "/usr/bin", "/sbin", "/bin"] {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = e.file_name();
            if name == "bwrap" || name == "nft" || name == "apt-get" || system.join(&name).exists()
            {
                continue;
            }
            let _ = std::os::unix::fs::symlink(e.path(), system.join(&name));
        }
    }
    // As root the workload network needs nft too: hidden the same way
    // (ip stays, so one missing package and one present are both seen).
    let real_nft = ["/usr/sbin/nft", "/sbin/nft", "/usr/bin/nft"]
        .into_iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.exists())
        .expect("nft installed (scripts/test installs nftables)");
    let log = tmp.path().join("apt-get.log");
    std::fs::write(
        stub.join("apt-get"),
        format!(
            "#!/bin/sh\necho \"$@\" >> {log}\ncase \"$*\" in *install*bubblewrap*) ln -sf {real_bwrap} {stub}/bwrap ;; esac\ncase \"$*\" in *install*nftables*) ln -sf {real_nft} {stub}/nft ;; esac\n",
            log = log.display(),
            stub = stub.display(),
            real_nft = real_nft.display(),
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(stub.join("apt-get"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", stub.display(), system.display());
    let run = || {
        Command::new(repo().join("scripts/prerequisites"))
            .env("PATH", &path)
            .output()
            .expect("run scripts/prerequisites")
    };
    // Precondition: bwrap is not reachable on that PATH.
    let which = Command::new("sh")
        .args(["-c", "command -v bwrap"])
        .env("PATH", &path)
        .output()
        .unwrap();
    assert!(!which.status.success(), "bwrap hidden");

    let out = run();
    assert!(out.status.success(), "{}", text(&out));
    let calls = std::fs::read_to_string(&log).expect("apt-get was called");
    assert!(
        calls.lines().any(|l| l.contains("install")
            && l.contains("bubblewrap")
            && l.contains("nftables")
            && !l.contains("iproute2")
            && l.contains("-y")),
        "{calls}"
    );
    assert!(stub.join("bwrap").exists());
    assert!(stub.join("nft").exists());
    // Installed now: a second run asks apt-get nothing.
    let out = run();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(std::fs::read_to_string(&log).unwrap(), calls);
    // `./flotilla` runs the step before `up` and `agent`.
    let script = std::fs::read_to_string(repo().join("flotilla")).unwrap();
    assert!(
        script.contains("up | agent) \"$here/scripts/prerequisites\""),
        "{script}"
    );
}

#[test]
fn quick_start_parsing_joins_lines_and_fills_ids() {
    let readme = "# X\n\n## Quick start\n\n```sh\n./flotilla a   # c\n./flotilla b \\\n    -- c\n```\n\n```text\nnot run\n```\n\n## More\n```sh\n./flotilla no\n```\n";
    assert_eq!(
        quick_start_commands(readme),
        ["./flotilla a   # c", "./flotilla b  -- c"]
    );
    let mut seen = BTreeMap::new();
    ids_in(
        "inst_0123456789abcdef running\njob_0123456789abcdef ok",
        &mut seen,
    );
    assert_eq!(
        fill_placeholders("./flotilla logs <instance id> <job id>", &seen),
        "./flotilla logs inst_0123456789abcdef job_0123456789abcdef"
    );
}
