//! Tenants are isolated from the host, the control plane and each other
//! under the process runtime: the real `flotilla` server and agent, two
//! tenants, tenant B's workload trying what an attacker would (read the
//! operator's saved credentials, the data directory, the database, the
//! agent token, tenant A's working directory and environment, the password
//! hashes; signal A's process), and every attempt failing. Each refusal is
//! checked against a precondition that shows the target exists and is
//! readable or signalable from outside the sandbox, so the assertion could
//! fail.
//!
//! Run as root (as CI does) it checks the root setup (bubblewrap, a uid
//! per tenant) and then plays an ordinary user (uid 65534) to check the
//! laptop setup (bubblewrap in a user namespace); run as an ordinary user it
//! checks the latter only.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use flotilla_testkit::process::{probe_outcomes, uid_of, wait_until, Home};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
/// The ordinary user a root test plays (`nobody` on Debian).
const ORDINARY_UID: u32 = 65_534;

fn run(home: &Home, key: &str, args: &[&str]) -> String {
    let mut all = vec!["--gpus", "1"];
    all.extend_from_slice(args);
    home.run_detached(key, &all)
}

fn state(home: &Home, key: &str, id: &str) -> String {
    home.get(key, &format!("/v1/instances/{id}"))["state"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Host pids of `sleep 300` processes whose environment holds `needle`
/// (readable from outside).
fn pids_with_env(needle: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == b"sleep\x00300\x00")
        })
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == needle.as_bytes()))
        })
        .collect()
}

fn readable(path: &Path) -> bool {
    std::fs::read(path).is_ok_and(|b| !b.is_empty())
}

/// The attacks, as one shell script: each prints `probe NAME allowed` or
/// `probe NAME denied`.
fn attack_script(home: &Home, a_workdir: &Path, a_pid: u32) -> String {
    let mut attacks = home.control_plane_attacks();
    attacks.extend([
        ("other-workdir", format!("ls '{}'", a_workdir.display())),
        (
            "other-file",
            format!("cat '{}/a-private.txt'", a_workdir.display()),
        ),
        (
            "other-environ",
            format!("cat /proc/{a_pid}/environ | grep -q A_SECRET"),
        ),
        (
            "any-environ",
            "cat /proc/[0-9]*/environ 2>/dev/null | grep -q A_SECRET".to_string(),
        ),
        (
            "shadow",
            "test -s /etc/shadow && cat /etc/shadow".to_string(),
        ),
        ("signal-other", format!("kill -9 {a_pid}")),
    ]);
    flotilla_testkit::process::probe_script(&attacks)
}

fn scenario(home: &Home, per_tenant_users: bool) {
    let _server = home.server();
    let _agent = home.agent("iso-node", "2xH100");
    let (_, key_a) = home.tenant("alpha");
    let (_, key_b) = home.tenant("beta");
    let secret = format!(
        "A_SECRET=s3cret-{}-{}",
        std::process::id(),
        home.dir.path().display()
    );

    // Tenant A: a private file in its working directory, a secret in its
    // environment, and a long sleep.
    let a = run(
        home,
        &key_a,
        &[
            "-e",
            &secret,
            "--",
            "sh",
            "-c",
            "echo mine > a-private.txt; echo a-ready; exec sleep 300",
        ],
    );
    wait_until("A runs", Duration::from_secs(60), || {
        home.log_lines(&key_a, &a).iter().any(|l| l == "a-ready")
    });

    // Preconditions, from outside the sandbox (the agent's side).
    let a_workdir = home.dir.path().join("agent/instances").join(&a);
    assert!(
        readable(&a_workdir.join("a-private.txt")),
        "A's file exists"
    );
    let a_pids = pids_with_env(&secret);
    assert_eq!(
        a_pids.len(),
        1,
        "A's process and its environment are readable from outside: {a_pids:?}"
    );
    let a_pid = a_pids[0];
    assert!(readable(&home.dir.path().join("config/credentials.json")));
    assert!(readable(&home.data().join("agent.token")));
    assert!(readable(&home.data().join("flotilla.db")));
    assert!(std::fs::read_dir(home.data()).is_ok());
    if nix::unistd::geteuid().is_root() {
        assert!(readable(Path::new("/etc/shadow")), "root reads the hashes");
    }
    let a_uid = uid_of(a_pid);

    // The control plane's files are private to their owner.
    let data = home.data();
    let config = home.dir.path().join("config");
    let agent = home.dir.path().join("agent");
    for (path, want) in [
        (data.clone(), 0o700),
        (data.join("flotilla.db"), 0o600),
        (data.join("flotilla.db-wal"), 0o600),
        (data.join("flotilla.db-shm"), 0o600),
        (data.join("agent.token"), 0o600),
        (config.clone(), 0o700),
        (config.join("credentials.json"), 0o600),
        (agent.clone(), 0o700),
        (agent.join("instances"), 0o700),
        (a_workdir.clone(), 0o700),
    ] {
        let mode = std::fs::metadata(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, want, "mode of {}: {mode:o}", path.display());
    }

    // Tenant B attacks.
    let b = run(
        home,
        &key_b,
        &["--", "sh", "-c", &attack_script(home, &a_workdir, a_pid)],
    );
    wait_until("B's probe ends", Duration::from_secs(60), || {
        home.log_lines(&key_b, &b).iter().any(|l| l == "probe-done")
    });
    let lines = home.log_lines(&key_b, &b);
    let (probes, b_uid) = probe_outcomes(&lines);
    assert_eq!(probes.len(), 10, "{lines:?}");
    for (name, outcome) in &probes {
        assert_eq!(outcome, "denied", "tenant B could {name}: {lines:?}");
    }
    let b_uid = b_uid.expect("B's uid");
    assert_ne!(a_uid, 0, "A does not run as root");
    if per_tenant_users {
        // B's uid inside is its uid outside: no user namespace as root.
        assert_ne!(b_uid, 0, "B does not run as root");
        assert_ne!(b_uid, a_uid, "each tenant its own user");
        assert_ne!(
            a_uid,
            nix::unistd::geteuid().as_raw(),
            "not the agent's user"
        );
    }

    // A survived B's signal.
    assert!(
        Path::new(&format!("/proc/{a_pid}")).exists(),
        "A still runs"
    );
    assert_eq!(state(home, &key_a, &a), "running");
    let out = home.cli(Some(&key_a), &["stop", &a]);
    assert!(out.status.success());
    wait_until("A stopped", Duration::from_secs(60), || {
        state(home, &key_a, &a) != "running"
    });
}

#[test]
fn tenants_cannot_reach_the_control_plane_or_each_other() {
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    let root = nix::unistd::geteuid().is_root();
    let home = Home::new(BIN);
    scenario(&home, root);
    if !root {
        return;
    }
    // The same as an ordinary user on a laptop: one uid for everything,
    // bubblewrap in a user namespace.
    let mut home = Home::new(BIN);
    std::os::unix::fs::chown(home.dir.path(), Some(ORDINARY_UID), Some(ORDINARY_UID)).unwrap();
    home.uid = Some(ORDINARY_UID);
    scenario(&home, false);
}
