//! Entering a running instance with the real binary: `flotilla exec`,
//! `flotilla shell` (driven through a pseudo-terminal) and `flotilla
//! port-forward`, under the process runtime (bubblewrap, a uid per tenant
//! when run as root, as CI does), streamed over the API's WebSockets
//! through the server to the node's agent. Another tenant's key gets 404
//! for each, and every opening, refused or not, is in the audit log.

use std::io::{Read as _, Write as _};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::{Child, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flotilla_testkit::process::{free_port, http, uid_of, wait_until, Home, Proc};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

/// The binary under `args` with `key`, given up (and the test failed)
/// after `limit`.
fn cli_within(home: &Home, key: &str, args: &[&str], limit: Duration) -> Output {
    let mut c = home.cmd();
    c.args(["--server", &home.url()])
        .args(args)
        .env("FLOTILLA_API_KEY", key)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("run flotilla");
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "flotilla {args:?} did not end within {limit:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn exec(home: &Home, key: &str, id: &str, command: &[&str]) -> Output {
    let mut args = vec!["exec", id, "--"];
    args.extend_from_slice(command);
    cli_within(home, key, &args, Duration::from_secs(60))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Host pids of processes whose environment holds `needle`.
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

/// A pseudo-terminal for the CLI: the test's side and the terminal's path.
fn pty(cols: u16, rows: u16) -> (OwnedFd, PathBuf) {
    use rustix::pty::{grantpt, openpt, ptsname, unlockpt, OpenptFlags};
    let controller =
        openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC).unwrap();
    grantpt(&controller).unwrap();
    unlockpt(&controller).unwrap();
    let name = ptsname(&controller, Vec::new()).unwrap();
    set_size(&controller, cols, rows);
    (controller, PathBuf::from(name.to_str().unwrap()))
}

fn set_size(fd: impl std::os::fd::AsFd, cols: u16, rows: u16) {
    rustix::termios::tcsetwinsize(
        fd,
        rustix::termios::Winsize {
            ws_col: cols,
            ws_row: rows,
            ws_xpixel: 0,
            ws_ypixel: 0,
        },
    )
    .unwrap();
}

/// `flotilla shell ID` on a pseudo-terminal, and what it printed so far.
struct Terminal {
    child: Child,
    controller: std::fs::File,
    seen: Arc<Mutex<Vec<u8>>>,
}

impl Terminal {
    fn open(home: &Home, key: &str, id: &str, cols: u16, rows: u16) -> Terminal {
        let (controller, path) = pty(cols, rows);
        let terminal = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let mut c = home.cmd();
        c.args(["--server", &home.url(), "shell", id])
            .env("FLOTILLA_API_KEY", key)
            .stdin(terminal.try_clone().unwrap())
            .stdout(terminal.try_clone().unwrap())
            .stderr(terminal);
        let child = c.spawn().expect("run flotilla shell");
        drop(c);
        let controller = std::fs::File::from(controller);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut reader = controller.try_clone().unwrap();
        let into = seen.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                into.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Terminal {
            child,
            controller,
            seen,
        }
    }

    fn seen(&self) -> String {
        text(&self.seen.lock().unwrap())
    }

    fn type_line(&mut self, line: &str) {
        self.controller
            .write_all(format!("{line}\r").as_bytes())
            .unwrap();
    }

    /// Waits until the output holds `want` (after what was seen before).
    fn expect(&self, from: usize, want: &str) {
        wait_until(
            &format!("the terminal shows {want:?}"),
            Duration::from_secs(60),
            || self.seen()[from..].contains(want),
        );
    }
}

#[test]
fn tenants_enter_their_own_running_instances_and_only_those() {
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    let root = nix::unistd::geteuid().is_root();
    if !root {
        eprintln!("skipped: entering an instance needs an agent running as root (as CI runs)");
        return;
    }
    let home = Home::new(BIN);
    let _server = home.server();
    let _agent: Proc = home.agent("access-node", "2xH100");
    let op = home.operator_key();
    let (tenant_a, key_a) = home.tenant("alpha");
    let (tenant_b, key_b) = home.tenant("beta");
    let mark = format!("ACCESS_MARK=m-{}", std::process::id());

    let a = home.run_detached(
        &key_a,
        &[
            "--gpus",
            "1",
            "-e",
            &mark,
            "--",
            "sh",
            "-c",
            "echo a-ready; exec sleep 300",
        ],
    );
    wait_until("A runs", Duration::from_secs(60), || {
        home.log_lines(&key_a, &a).iter().any(|l| l == "a-ready")
    });
    let pids = pids_with_env(&mark);
    assert_eq!(pids.len(), 1, "A's process: {pids:?}");
    let a_uid = uid_of(pids[0]);
    assert_ne!(a_uid, 0, "the workload does not run as root");
    let a_workdir = home.dir.path().join("agent/instances").join(&a);
    assert!(a_workdir.is_dir());

    // exec: output, error output and the exit code.
    let out = exec(
        &home,
        &key_a,
        &a,
        &["sh", "-c", "echo out; echo err >&2; exit 7"],
    );
    assert_eq!(text(&out.stdout), "out\n", "stderr: {}", text(&out.stderr));
    assert_eq!(text(&out.stderr), "err\n");
    assert_eq!(out.status.code(), Some(7));

    // exec runs as the workload's user, where it runs, with its
    // environment, inside its sandbox (its own hostname, no data dir).
    let out = exec(
        &home,
        &key_a,
        &a,
        &["sh", "-c", "id -u; pwd; echo \"$ACCESS_MARK\"; uname -n"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<String> = text(&out.stdout).lines().map(str::to_string).collect();
    let want_mark = mark.split_once('=').unwrap().1;
    assert_eq!(
        lines,
        vec![
            a_uid.to_string(),
            a_workdir.display().to_string(),
            want_mark.to_string(),
            "flotilla".to_string(),
        ]
    );
    assert_ne!(
        rustix::system::uname().nodename().to_string_lossy(),
        "flotilla",
        "the host's name differs from the sandbox's"
    );
    // What a session starts is held to the workload's limits: it runs in
    // the instance's own cgroups (named after it), where the workload's
    // memory, CPU and process limits apply, not in the agent's.
    let out = exec(&home, &key_a, &a, &["cat", "/proc/self/cgroup"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let groups = text(&out.stdout);
    // The memory controller's line (cgroup v1), else the one v2 tree's.
    let line = groups
        .lines()
        .find(|l| {
            l.split(':')
                .nth(1)
                .is_some_and(|c| c.split(',').any(|c| c == "memory"))
        })
        .or_else(|| groups.lines().find(|l| l.starts_with("0::")))
        .unwrap_or_else(|| panic!("no memory cgroup in {groups}"));
    assert!(
        line.contains(a.as_str()),
        "a session runs in its instance's cgroups: {groups}"
    );
    let data = home.data();
    assert!(
        std::fs::read_dir(&data).is_ok() && data.join("agent.token").is_file(),
        "the data directory exists and is readable from outside"
    );
    let out = exec(
        &home,
        &key_a,
        &a,
        &["sh", "-c", &format!("cat '{}/agent.token'", data.display())],
    );
    assert_ne!(
        out.status.code(),
        Some(0),
        "the sandbox hides the agent token"
    );
    assert!(out.stdout.is_empty());

    // Standard input reaches the command with -i.
    let mut c = home.cmd();
    c.args(["--server", &home.url(), "exec", "-i", &a, "--", "wc", "-c"])
        .env("FLOTILLA_API_KEY", &key_a)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&[b'x'; 100_000])
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(text(&out.stdout).trim(), "100000", "{}", text(&out.stderr));

    // shell: an interactive terminal through a pseudo-terminal, its size
    // and a resize carried to the instance's terminal.
    let mut term = Terminal::open(&home, &key_a, &a, 100, 30);
    let at = term.seen().len();
    term.type_line("echo $((6*7))");
    term.expect(at, "42");
    // Its HOME (the working directory) is reachable by its absolute path,
    // as a shell reading $HOME/.bashrc needs: the sandbox's parents of it
    // are passable by the tenant's uid.
    let at = term.seen().len();
    term.type_line("cd / && cd \"$HOME\" && echo home-$((40+2))");
    term.expect(at, "home-42");
    assert!(
        !term.seen().contains("Permission denied"),
        "{}",
        term.seen()
    );
    let at = term.seen().len();
    term.type_line("expr 100 + 23");
    term.expect(at, "123");
    let at = term.seen().len();
    term.type_line("stty size");
    term.expect(at, "30 100");
    set_size(&term.controller, 120, 40);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(term.child.id() as i32),
        nix::sys::signal::Signal::SIGWINCH,
    )
    .unwrap();
    wait_until(
        "the resize reaches the instance",
        Duration::from_secs(60),
        || {
            let at = term.seen().len();
            term.type_line("stty size");
            std::thread::sleep(Duration::from_millis(300));
            term.seen()[at..].contains("40 120")
        },
    );
    term.type_line("exit 3");
    wait_until("the shell ends", Duration::from_secs(60), || {
        term.child.try_wait().unwrap().is_some()
    });
    assert_eq!(
        term.child.wait().unwrap().code(),
        Some(3),
        "{}",
        term.seen()
    );

    // port-forward: an HTTP request to a server inside the instance (the
    // emulator, from the binary's directory every sandbox shows).
    let remote = free_port();
    let model = format!("fwd-{}", std::process::id());
    let remote_s = remote.to_string();
    let srv = home.run_detached(
        &key_a,
        &[
            "--gpus", "1", "--", BIN, "emulator", "--port", &remote_s, "--model", &model,
        ],
    );
    wait_until("the server instance runs", Duration::from_secs(60), || {
        home.get(&key_a, &format!("/v1/instances/{srv}"))["state"] == "running"
    });
    let local = free_port();
    let ports = format!("{local}:{remote}");
    let mut fwd = home.cmd();
    fwd.args(["--server", &home.url(), "port-forward", &srv, &ports])
        .env("FLOTILLA_API_KEY", &key_a)
        .stdout(home.log("port-forward"))
        .stderr(home.log("port-forward"));
    let _fwd = Proc(fwd.spawn().unwrap());
    let url = format!("http://127.0.0.1:{local}/v1/models");
    wait_until(
        "a request through the forward",
        Duration::from_secs(60),
        || {
            http("GET", &url, None, None)
                .is_ok_and(|(status, body)| status == 200 && body.to_string().contains(&model))
        },
    );

    // Another tenant: 404 for exec, shell and port-forward, by the API
    // and by the CLI; the same request of the owner is only refused for
    // not being a WebSocket (the route exists and lets the owner in).
    for route in ["exec?command=%5B%22true%22%5D", "port-forward?port=80"] {
        let url = format!("{}/v1/instances/{a}/{route}", home.url());
        let (status, body) = http("GET", &url, Some(&key_b), None).unwrap();
        assert_eq!(status, 404, "{route}: {body}");
        let (status, body) = http("GET", &url, Some(&key_a), None).unwrap();
        assert_eq!(status, 400, "{route}: {body}");
        assert_eq!(body["error"]["details"]["field"], "upgrade", "{body}");
    }
    let limit = Duration::from_secs(60);
    for args in [
        vec!["exec", a.as_str(), "--", "true"],
        vec!["shell", a.as_str()],
        vec!["port-forward", srv.as_str(), "1:80"],
    ] {
        let out = cli_within(&home, &key_b, &args, limit);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            text(&out.stderr).contains("not found"),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }

    // The audit log has each opening: the owner's (switched to a
    // WebSocket) and the stranger's (404).
    let exec_route = "/v1/instances/{instance_id}/exec";
    let fwd_route = "/v1/instances/{instance_id}/port-forward";
    let entries = home.audit_statuses(&op, exec_route, &a);
    assert!(entries.contains(&(tenant_a.clone(), 101)), "{entries:?}");
    assert!(entries.contains(&(tenant_b.clone(), 404)), "{entries:?}");
    let entries = home.audit_statuses(&op, fwd_route, &srv);
    assert!(entries.contains(&(tenant_a.clone(), 101)), "{entries:?}");
    let entries = home.audit_statuses(&op, fwd_route, &a);
    assert!(entries.contains(&(tenant_b.clone(), 404)), "{entries:?}");

    // A session does not outlive its instance: what it started runs in
    // the instance's pid namespace and ends with it.
    let mut c = home.cmd();
    c.args(["--server", &home.url(), "exec", &a, "--", "sh", "-c"])
        .arg("echo session-started; exec sleep 301")
        .env("FLOTILLA_API_KEY", &key_a)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut session = c.spawn().unwrap();
    let mut first = [0u8; 16];
    session
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    assert_eq!(&first, b"session-started\n");
    let out = home.cli(Some(&key_a), &["stop", &a]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    wait_until(
        "the session ends with its instance",
        Duration::from_secs(60),
        || session.try_wait().unwrap().is_some(),
    );
    assert_ne!(session.wait().unwrap().code(), Some(0));
    assert!(
        !std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
            std::fs::read(e.path().join("cmdline")).is_ok_and(|c| c == b"sleep\x00301\x00")
        }),
        "the session's process is gone"
    );
    wait_until("A ended", Duration::from_secs(60), || {
        home.get(&key_a, &format!("/v1/instances/{a}"))["state"] != "running"
    });
    let out = exec(&home, &key_a, &a, &["true"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("not running"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn containers_are_entered_through_the_engine() {
    let Some(engine) = flotilla_testkit::containers::engine() else {
        return;
    };
    let home = Home::new(BIN);
    let node = format!("access-ctr-{}-{}", std::process::id(), home.port);
    let _sweep = engine.sweep_on_drop(&node);
    let _server = home.server();
    let _agent = home.agent_with(
        &node,
        "2xH100",
        &home.url(),
        &[
            "--runtime",
            "container",
            "--docker-host",
            &engine.docker_host,
        ],
    );
    let (_, key_a) = home.tenant("alpha");
    let (_, key_b) = home.tenant("beta");
    let port = free_port();
    // An HTTP server on the container's loopback only (not published):
    // reachable through the port-forward alone.
    let script = format!(
        "echo \"user=$(id -u)\"; httpd -f -p 127.0.0.1:{port} -h /www & echo ctr-ready; wait"
    );
    let id = home.run_detached(
        &key_a,
        &[
            "--cpus",
            "0.25",
            "--image",
            &engine.image,
            "--gpus",
            "1",
            "-e",
            "ACCESS_MARK=ctr",
            "--",
            "sh",
            "-c",
            &script,
        ],
    );
    wait_until("the container runs", Duration::from_secs(120), || {
        home.log_lines(&key_a, &id).iter().any(|l| l == "ctr-ready")
    });
    let uid = home
        .log_lines(&key_a, &id)
        .iter()
        .find_map(|l| l.strip_prefix("user=").map(str::to_string))
        .unwrap();
    assert_ne!(uid, "0", "the container does not run as root");

    let out = exec(
        &home,
        &key_a,
        &id,
        &["sh", "-c", "echo out; echo err >&2; exit 7"],
    );
    assert_eq!(text(&out.stdout), "out\n", "stderr: {}", text(&out.stderr));
    assert_eq!(text(&out.stderr), "err\n");
    assert_eq!(out.status.code(), Some(7));
    let out = exec(
        &home,
        &key_a,
        &id,
        &["sh", "-c", "id -u; echo \"$ACCESS_MARK\""],
    );
    assert_eq!(
        text(&out.stdout),
        format!("{uid}\nctr\n"),
        "{}",
        text(&out.stderr)
    );

    let local = free_port();
    let ports = format!("{local}:{port}");
    let mut fwd = home.cmd();
    fwd.args(["--server", &home.url(), "port-forward", &id, &ports])
        .env("FLOTILLA_API_KEY", &key_a)
        .stdout(home.log("port-forward"))
        .stderr(home.log("port-forward"));
    let _fwd = Proc(fwd.spawn().unwrap());
    let url = format!("http://127.0.0.1:{local}/index.html");
    wait_until(
        "a request through the forward",
        Duration::from_secs(60),
        || {
            http("GET", &url, None, None).is_ok_and(|(status, body)| {
                status == 200 && body.as_str().map(str::trim) == Some("flotilla test image")
            })
        },
    );

    let out = exec(&home, &key_b, &id, &["true"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("not found"),
        "{}",
        text(&out.stderr)
    );
}
