//! `flotilla ssh` as OpenSSH's `ProxyCommand`, with the real binary, the
//! real `ssh`/`scp`, a real server and an agent with simulated GPUs under
//! the process runtime: a key the instance's tenant registered logs in,
//! runs a command (its output and exit status come back), copies a file in
//! and forwards a port; another key is refused; another tenant's API key
//! gets 404 for ssh, exec, shell and port-forward; each opening is in the
//! audit log; the host key outlives a restart; a removed key logs in no
//! more.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use flotilla_testkit::process::{free_port, http, wait_until, Home, Proc};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn have(program: &str) -> bool {
    Command::new(program)
        .arg("-V")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

/// Runs `c` to its end, its output read as it comes (a large output must
/// not fill the pipe and stall it); given up (and the test failed) after
/// `limit`.
fn within(mut c: Command, what: &str, limit: Duration) -> Output {
    use std::io::Read as _;
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let drain = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let (out, err) = (out.join().unwrap(), err.join().unwrap());
            panic!(
                "{what} did not end within {limit:?}: {} bytes out; {}",
                out.len(),
                text(&err)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// An ed25519 key pair made by `ssh-keygen` in `dir`: the private key's
/// path (the public one is beside it, `.pub`).
fn keypair(dir: &Path, name: &str) -> PathBuf {
    let path = dir.join(name);
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", name, "-f"])
        .arg(&path)
        .output()
        .expect("run ssh-keygen");
    assert!(out.status.success(), "ssh-keygen: {}", text(&out.stderr));
    path
}

/// `ssh-keygen -lf KEY.pub`'s fingerprint (`SHA256:…`).
fn fingerprint(key: &Path) -> String {
    let out = Command::new("ssh-keygen")
        .arg("-lf")
        .arg(key.with_extension("pub"))
        .output()
        .unwrap();
    text(&out.stdout)
        .split_whitespace()
        .nth(1)
        .unwrap()
        .to_string()
}

/// `program` (ssh or scp) with `flotilla ssh` as its ProxyCommand, the
/// API key `api_key` in its environment (which the ProxyCommand
/// inherits), `key` as its only identity and nothing read from the
/// user's own ssh configuration.
fn ssh_command(home: &Home, program: &str, api_key: &str, key: &Path) -> Command {
    let mut c = Command::new(program);
    c.env("FLOTILLA_CONFIG_DIR", home.dir.path().join("config"))
        .env("FLOTILLA_API_KEY", api_key)
        .env_remove("FLOTILLA_SERVER")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .args(["-F", "/dev/null", "-o"])
        .arg(format!("ProxyCommand={BIN} --server {} ssh %h", home.url()))
        .args([
            // Learns the host key once, then holds the server to it.
            "-o",
            "StrictHostKeyChecking=accept-new",
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "LogLevel=ERROR",
            "-o",
        ])
        .arg(format!(
            "UserKnownHostsFile={}",
            home.dir.path().join("known_hosts").display()
        ))
        .arg("-i")
        .arg(key);
    c
}

/// `ssh … root@ID COMMAND`.
fn ssh(home: &Home, api_key: &str, key: &Path, id: &str, command: &str) -> Output {
    let mut c = ssh_command(home, "ssh", api_key, key);
    c.arg(format!("root@{id}")).arg(command);
    within(c, &format!("ssh {command:?}"), Duration::from_secs(90))
}

#[test]
fn ssh_through_the_proxy_command_lets_in_registered_keys_only() {
    if !have("ssh") || !have("ssh-keygen") {
        eprintln!("skipped: needs OpenSSH's ssh and ssh-keygen (openssh-client)");
        return;
    }
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: entering an instance needs an agent running as root (as CI runs)");
        return;
    }
    let home = Home::new(BIN);
    let _server = home.server();
    let _agent: Proc = home.agent("ssh-node", "2xH100");
    let op = home.operator_key();
    let (tenant_a, key_a) = home.tenant("alpha");
    let (tenant_b, key_b) = home.tenant("beta");
    let keys = home.dir.path().join("keys");
    std::fs::create_dir_all(&keys).unwrap();
    let id_a = keypair(&keys, "id_a");
    let id_b = keypair(&keys, "id_b");

    // Registering: garbage is a 422 naming the field; A's key is stored
    // with ssh-keygen's fingerprint; registering it twice is a conflict.
    let (status, body) = http(
        "POST",
        &format!("{}/v1/ssh-keys", home.url()),
        Some(&key_a),
        Some(r#"{"public_key": "ssh-ed25519 not-a-key"}"#),
    )
    .unwrap();
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["details"]["field"], "public_key", "{body}");
    let pub_a = id_a.with_extension("pub");
    let made = home.cli_json(
        Some(&key_a),
        &[
            "ssh-keys",
            "add",
            pub_a.to_str().unwrap(),
            "--name",
            "laptop",
        ],
    );
    assert_eq!(made["fingerprint"], fingerprint(&id_a), "{made}");
    assert_eq!(made["name"], "laptop");
    let key_id = made["id"].as_str().unwrap().to_string();
    let again = home.cli(Some(&key_a), &["ssh-keys", "add", pub_a.to_str().unwrap()]);
    assert!(!again.status.success());
    assert!(
        text(&again.stderr).contains("already exists"),
        "{}",
        text(&again.stderr)
    );
    // A private key is refused before anything is sent.
    let out = home.cli(Some(&key_a), &["ssh-keys", "add", id_b.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("private key"),
        "{}",
        text(&out.stderr)
    );
    let out = home.cli(Some(&key_a), &["ssh-keys"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains(&fingerprint(&id_a)) && text(&out.stdout).contains("laptop"),
        "{}",
        text(&out.stdout)
    );
    let listed = home.get(&key_a, "/v1/ssh-keys");
    assert_eq!(listed["items"].as_array().unwrap().len(), 1, "{listed}");
    assert!(home.get(&key_b, "/v1/ssh-keys")["items"]
        .as_array()
        .unwrap()
        .is_empty());

    // A's instance serves HTTP on its loopback (the emulator, from the
    // binary's directory every sandbox shows), for the port forward.
    let port = free_port();
    let model = format!("ssh-fwd-{}", std::process::id());
    let script = format!("echo a-ready; exec {BIN} emulator --port {port} --model {model}");
    let a = home.run_detached(&key_a, &["--gpus", "1", "--", "sh", "-c", &script]);
    wait_until("A runs", Duration::from_secs(90), || {
        home.log_lines(&key_a, &a).iter().any(|l| l == "a-ready")
    });

    // A registered key: the command's output and exit status.
    let out = ssh(
        &home,
        &key_a,
        &id_a,
        &a,
        "echo hello; echo oops >&2; exit 7",
    );
    assert_eq!(
        text(&out.stdout),
        "hello\n",
        "stderr: {}",
        text(&out.stderr)
    );
    assert_eq!(text(&out.stderr), "oops\n");
    assert_eq!(out.status.code(), Some(7));
    // It runs inside the instance, as the workload's user, where it runs.
    let out = ssh(&home, &key_a, &id_a, &a, "id -u; pwd; uname -n; whoami");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<String> = text(&out.stdout).lines().map(str::to_string).collect();
    assert_ne!(lines[0], "0", "not as root");
    assert_eq!(
        lines[1],
        home.dir
            .path()
            .join("agent/instances")
            .join(&a)
            .display()
            .to_string()
    );
    assert_eq!(lines[2], "flotilla", "the sandbox's host name");
    assert_eq!(lines[3], "flotilla", "the tenant's user has a name");
    // With -tt the command gets a terminal.
    let mut c = ssh_command(&home, "ssh", &key_a, &id_a);
    c.args([
        "-tt",
        &format!("root@{a}"),
        "test -t 0 && echo on-a-terminal",
    ]);
    let out = within(c, "ssh -tt", Duration::from_secs(90));
    assert!(
        text(&out.stdout).contains("on-a-terminal"),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );

    // A file copied in and back through the connection, byte for byte
    // (the tunnel is binary-safe): `ssh ID 'cat > F' < F`, which needs
    // nothing in the instance but `cat`.
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 256) as u8).collect();
    let local = home.dir.path().join("payload.bin");
    std::fs::write(&local, &payload).unwrap();
    let mut c = ssh_command(&home, "ssh", &key_a, &id_a);
    c.arg(format!("root@{a}"))
        .arg("cat > copied.bin")
        .stdin(std::fs::File::open(&local).unwrap());
    let out = within(c, "ssh cat >", Duration::from_secs(90));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = ssh(&home, &key_a, &id_a, &a, "cat copied.bin");
    assert!(out.stdout == payload, "the copy came back whole");

    // scp. OpenSSH's scp speaks SFTP unless told `-O` (the old protocol,
    // which runs `scp -t` in the instance); both it and sftp-server look
    // the caller's uid up in /etc/passwd, where the sandbox lists the
    // tenant's user. The SFTP way needs an sftp-server in the instance,
    // which the host's root filesystem (what a process-runtime sandbox
    // shows) may lack.
    let sftp_server = [
        "/usr/lib/openssh/sftp-server",
        "/usr/libexec/openssh/sftp-server",
    ]
    .iter()
    .any(|p| Path::new(p).exists());
    let mut ways = vec![("scp-legacy.bin", true)];
    if sftp_server {
        ways.push(("scp-sftp.bin", false));
    } else {
        eprintln!("no sftp-server on this host: scp is tested with -O only");
    }
    for (name, legacy) in ways {
        let mut c = ssh_command(&home, "scp", &key_a, &id_a);
        if legacy {
            c.arg("-O");
        }
        c.arg(&local).arg(format!("root@{a}:{name}"));
        let out = within(c, "scp", Duration::from_secs(90));
        assert!(out.status.success(), "scp {name}: {}", text(&out.stderr));
        let out = ssh(&home, &key_a, &id_a, &a, &format!("cat {name}"));
        assert!(out.stdout == payload, "scp's {name} arrived whole");
    }

    // ssh -L: a TCP stream to the instance's loopback.
    let local_port = free_port();
    let mut fwd = ssh_command(&home, "ssh", &key_a, &id_a);
    fwd.args([
        "-N",
        "-L",
        &format!("127.0.0.1:{local_port}:127.0.0.1:{port}"),
        &format!("root@{a}"),
    ])
    .stdout(home.log("ssh-forward"))
    .stderr(home.log("ssh-forward"));
    let _fwd = Proc(fwd.spawn().unwrap());
    let url = format!("http://127.0.0.1:{local_port}/v1/models");
    wait_until("a request through ssh -L", Duration::from_secs(90), || {
        http("GET", &url, None, None)
            .is_ok_and(|(status, body)| status == 200 && body.to_string().contains(&model))
    });

    // Another key: refused at login.
    let out = ssh(&home, &key_a, &id_b, &a, "echo should-not-run");
    assert_eq!(out.status.code(), Some(255), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("Permission denied"),
        "{}",
        text(&out.stderr)
    );
    assert!(!text(&out.stdout).contains("should-not-run"));

    // Another tenant's API key, even with A's SSH key: the instance is not
    // found, for ssh as for exec, shell and port-forward.
    let out = ssh(&home, &key_b, &id_a, &a, "echo should-not-run");
    assert_eq!(out.status.code(), Some(255));
    assert!(
        text(&out.stderr).contains("not found"),
        "{}",
        text(&out.stderr)
    );
    for route in [
        "ssh",
        "exec?command=%5B%22true%22%5D",
        "port-forward?port=80",
    ] {
        let url = format!("{}/v1/instances/{a}/{route}", home.url());
        let (status, body) = http("GET", &url, Some(&key_b), None).unwrap();
        assert_eq!(status, 404, "{route}: {body}");
        // The owner's plain GET is refused only for not being a WebSocket.
        let (status, body) = http("GET", &url, Some(&key_a), None).unwrap();
        assert_eq!(status, 400, "{route}: {body}");
        assert_eq!(body["error"]["details"]["field"], "upgrade", "{body}");
    }
    for args in [
        vec!["exec", a.as_str(), "--", "true"],
        vec!["shell", a.as_str()],
        vec!["port-forward", a.as_str(), "1:80"],
    ] {
        let mut c = home.cmd();
        c.args(["--server", &home.url()])
            .args(&args)
            .env("FLOTILLA_API_KEY", &key_b);
        let out = within(c, &format!("flotilla {args:?}"), Duration::from_secs(60));
        assert!(!out.status.success(), "{args:?}");
        assert!(
            text(&out.stderr).contains("not found"),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }

    // The audit log has each opening: A's (switched to a WebSocket) and
    // B's (404).
    let ssh_route = "/v1/instances/{instance_id}/ssh";
    let entries = home.audit_statuses(&op, ssh_route, &a);
    assert!(entries.contains(&(tenant_a.clone(), 101)), "{entries:?}");
    assert!(entries.contains(&(tenant_b.clone(), 404)), "{entries:?}");
    for route in [
        "/v1/instances/{instance_id}/exec",
        "/v1/instances/{instance_id}/port-forward",
    ] {
        let entries = home.audit_statuses(&op, route, &a);
        assert!(
            entries.contains(&(tenant_b.clone(), 404)),
            "{route}: {entries:?}"
        );
    }

    // The host key outlives a restart of the server: the known_hosts
    // entry learnt above still matches (ssh would refuse a changed key).
    let known = std::fs::read_to_string(home.dir.path().join("known_hosts")).unwrap();
    assert!(
        known
            .lines()
            .any(|l| l.starts_with(&a) && l.contains(" ssh-ed25519 ")),
        "{known}"
    );
    drop(_server);
    let _server = home.server();
    wait_until(
        "ssh after the server's restart, with the known host key",
        Duration::from_secs(120),
        || {
            let out = ssh(&home, &key_a, &id_a, &a, "echo again");
            let changed = text(&out.stderr).contains("IDENTIFICATION HAS CHANGED");
            assert!(!changed, "the host key changed: {}", text(&out.stderr));
            out.status.success() && text(&out.stdout) == "again\n"
        },
    );

    // A removed key logs in no more.
    let out = home.cli(Some(&key_a), &["ssh-keys", "remove", &key_id]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = ssh(&home, &key_a, &id_a, &a, "echo should-not-run");
    assert_eq!(out.status.code(), Some(255), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("Permission denied"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn the_config_block_points_ssh_at_this_binary() {
    let home = Home::new(BIN);
    let out = home.cli(None, &["ssh", "--config"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let block = text(&out.stdout);
    assert!(block.contains("Host inst_*"), "{block}");
    assert!(
        block.contains(&format!(
            "ProxyCommand {BIN} --server {} ssh %h",
            home.url()
        )),
        "{block}"
    );
}
