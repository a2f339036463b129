//! End to end, as a user runs it: the real `flotilla` binary as server,
//! agent (4 simulated GPUs) and CLI, on ephemeral ports, with a SQLite file.

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use flotilla_testkit::process::{http, wait_until, Home, Proc};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

/// The binary under test in a temporary home, with this file's helpers.
struct Env(Home);

impl std::ops::Deref for Env {
    type Target = Home;
    fn deref(&self) -> &Home {
        &self.0
    }
}

impl std::ops::DerefMut for Env {
    fn deref_mut(&mut self) -> &mut Home {
        &mut self.0
    }
}

impl Env {
    fn new() -> Self {
        Env(Home::new(BIN))
    }

    /// An agent with 4 simulated H100s.
    fn agent(&self, name: &str) -> Proc {
        self.0.agent(name, "4xH100")
    }

    /// A tenant and an admin key for it, made through the CLI.
    fn tenant(&self, name: &str) -> (String, String) {
        let op = self.operator_key();
        let t = self.cli_json(Some(&op), &["tenants", "create", name]);
        let id = t["id"].as_str().unwrap().to_string();
        let k = self.cli_json(
            Some(&op),
            &["keys", "create", "--role", "tenant_admin", "--tenant", &id],
        );
        (id, k["secret"].as_str().unwrap().to_string())
    }
}

fn free_h100(env: &Env, key: &str) -> u64 {
    let types = env.get(key, "/v1/gpu-types");
    types["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "H100")
        .unwrap()["free"]
        .as_u64()
        .unwrap()
}

/// Milliseconds of `instance_seconds` usage billed for instance `id`,
/// without the events a correction voids.
fn billed_instance_ms(env: &Env, key: &str, id: &str) -> i64 {
    let items = env.get(
        key,
        "/v1/usage?limit=1000&from=2000-01-01T00:00:00Z&to=2100-01-01T00:00:00Z",
    )["items"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let voided: std::collections::BTreeSet<String> = items
        .iter()
        .filter(|e| e["corrects"].is_object())
        .map(|e| format!("{}/{}", e["corrects"]["source"], e["corrects"]["id"]))
        .collect();
    let ms = |v: &Value| {
        chrono::DateTime::parse_from_rfc3339(v.as_str().unwrap_or_default())
            .map(|t| t.timestamp_millis())
            .unwrap_or(0)
    };
    items
        .iter()
        .filter(|e| {
            e["subject"]["id"] == id
                && e["meter"]["meter"] == "instance_seconds"
                && !voided.contains(&format!("{}/{}", e["key"]["source"], e["key"]["id"]))
        })
        .map(|e| ms(&e["end"]) - ms(&e["start"]))
        .sum()
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

#[test]
fn run_prints_its_two_gpus_and_frees_them() {
    let env = Env::new();
    run_scenario(&env);
    assert!(
        env.data().join("flotilla.db").exists(),
        "the default store is a SQLite file"
    );
}

/// The same scenario with the server on PostgreSQL: operators move the
/// same binary there with `--database-url`.
#[test]
fn run_on_postgres() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let Some(url) = rt.block_on(flotilla_testkit::db::postgres_url("e2e")) else {
        return;
    };
    let mut env = Env::new();
    env.database_url = Some(url);
    run_scenario(&env);
    assert!(
        !env.data().join("flotilla.db").exists(),
        "no SQLite file: the server used PostgreSQL"
    );
}

fn run_scenario(env: &Env) {
    let _server = env.server();
    let _agent = env.agent("e2e-node");
    let (_tenant, key) = env.tenant("acme");
    wait_until("4 free H100s", Duration::from_secs(30), || {
        free_h100(env, &key) == 4
    });

    // Watch the states from the side while `flotilla run` runs.
    let watcher = {
        let url = env.url();
        let key = key.clone();
        std::thread::spawn(move || {
            let mut seen: Vec<String> = Vec::new();
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(60) {
                if let Ok((200, body)) =
                    http("GET", &format!("{url}/v1/instances"), Some(&key), None)
                {
                    if let Some(i) = body["items"].as_array().and_then(|a| a.first()) {
                        let s = i["state"].as_str().unwrap_or("").to_string();
                        if seen.last() != Some(&s) {
                            seen.push(s.clone());
                        }
                        if s == "succeeded" || s == "failed" {
                            return seen;
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            seen
        })
    };
    let out = env.cli(
        Some(&key),
        &[
            "run",
            "--gpus",
            "2",
            "--gpu-type",
            "H100",
            "--",
            "sh",
            "-c",
            "echo \"gpus=$CUDA_VISIBLE_DEVICES\"; sleep 1.5; echo done",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        out.status.success(),
        "run failed: {stderr}\nstdout: {stdout}"
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("gpus="))
        .unwrap_or_else(|| panic!("no gpus line in {stdout:?}"));
    let ids: Vec<&str> = line.trim_start_matches("gpus=").split(',').collect();
    assert_eq!(ids.len(), 2, "exactly two GPU ids: {line}");
    assert_ne!(ids[0], ids[1], "distinct GPU ids: {line}");
    assert!(
        stdout.lines().any(|l| l == "done"),
        "whole log streamed: {stdout:?}"
    );

    let seen = watcher.join().unwrap();
    let pos = |s: &str| seen.iter().position(|x| x == s);
    assert!(pos("running").is_some(), "running observed: {seen:?}");
    assert!(
        pos("running") < pos("succeeded"),
        "running then succeeded: {seen:?}"
    );

    let inst = &env.get(&key, "/v1/instances")["items"][0];
    assert_eq!(inst["state"], "succeeded");
    assert_eq!(inst["exit_code"], 0);
    let events: Vec<&str> = inst["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["state"].as_str().unwrap())
        .collect();
    assert_eq!(
        events,
        ["pending", "scheduled", "starting", "running", "succeeded"]
    );
    let logs = env.get(
        &key,
        &format!("/v1/instances/{}/logs", inst["id"].as_str().unwrap()),
    );
    assert!(logs["items"]
        .as_array()
        .unwrap()
        .iter()
        .any(|l| l["line"].as_str().unwrap().starts_with("gpus=")));
    // The run is metered from its lifecycle: GPU-seconds in the ledger and
    // on the invoice preview, whose total is the sum of its lines.
    let id = inst["id"].as_str().unwrap();
    let month = chrono::Utc::now().format("%Y-%m").to_string();
    // 2 GPUs from its start to its end, to the millisecond.
    let at = |v: &Value| {
        flotilla_billing::meter::to_millisecond(
            v.as_str()
                .unwrap()
                .parse::<chrono::DateTime<chrono::Utc>>()
                .unwrap(),
        )
    };
    let ran_ms = (at(&inst["finished_at"]) - at(&inst["started_at"])).num_milliseconds();
    let want = rust_decimal::Decimal::new(2 * ran_ms, 3);
    let h100_quantity = |inv: &Value| {
        inv["lines"].as_array().and_then(|l| {
            l.iter()
                .find(|l| l["description"].as_str().unwrap_or("").contains("H100"))
                .and_then(|l| {
                    l["quantity"]
                        .as_str()?
                        .parse::<rust_decimal::Decimal>()
                        .ok()
                })
        })
    };
    let mut invoice = Value::Null;
    wait_until(
        "metered usage on the invoice",
        Duration::from_secs(30),
        || {
            invoice = env.get(&key, &format!("/v1/invoices/preview?period={month}"));
            h100_quantity(&invoice).is_some_and(|q| q >= want)
        },
    );
    let dec = |v: &Value| v.as_str().unwrap().parse::<f64>().unwrap();
    let lines = invoice["lines"].as_array().unwrap();
    let sum: f64 = lines.iter().map(|l| dec(&l["amount"])).sum();
    assert!((sum - dec(&invoice["total"])).abs() < 1e-9, "{invoice}");
    let gpu_line = lines
        .iter()
        .find(|l| l["description"].as_str().unwrap_or("").contains("H100"))
        .unwrap_or_else(|| panic!("no H100 line: {invoice}"));
    // 2 GPUs for about 1.5 s, exactly, to the millisecond.
    assert_eq!(h100_quantity(&invoice), Some(want), "{gpu_line}");
    let gpu_seconds = dec(&gpu_line["quantity"]);
    assert_eq!(gpu_line["unit"], "gpu_second");
    // Rated at the H100 list price per second, rounded half-even to cents.
    let expected = (gpu_seconds * 2.99 / 3600.0 * 100.0).round() / 100.0;
    assert!(
        (dec(&gpu_line["amount"]) - expected).abs() < 0.011,
        "{gpu_line}"
    );
    let via_cli = env.cli_json(Some(&key), &["invoices", "preview", "--period", &month]);
    assert_eq!(via_cli["total"], invoice["total"]);
    let usage = env.get(
        &key,
        "/v1/usage?from=2000-01-01T00:00:00Z&to=2100-01-01T00:00:00Z",
    );
    assert!(
        usage.to_string().contains(id),
        "usage lists the instance: {usage}"
    );
    wait_until("the GPUs free again", Duration::from_secs(10), || {
        free_h100(env, &key) == 4
    });

    // A failing command's exit code comes back through `run`.
    let out = env.cli(Some(&key), &["run", "--", "sh", "-c", "exit 7"]);
    assert_eq!(
        out.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Errors are one line, no backtrace.
    let out = env.cli(Some(&key), &["run", "--gpus", "0", "--", "true"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("gpus") && !err.contains("backtrace") && !err.contains("panicked"),
        "{err}"
    );
}

#[test]
fn kill_9_server_keeps_everything_and_the_agent_reattaches() {
    let env = Env::new();
    let mut server = env.server();
    let _agent = env.agent("crash-node");
    let (tenant, key) = env.tenant("durable");
    wait_until("4 free H100s", Duration::from_secs(30), || {
        free_h100(&env, &key) == 4
    });
    let created = env.cli_json(
        Some(&key),
        &[
            "run",
            "--detach",
            "--gpus",
            "2",
            "--",
            "sh",
            "-c",
            "echo up; sleep 600",
        ],
    );
    let id = created["id"].as_str().unwrap().to_string();
    let mut pid = 0u32;
    wait_until("the instance runs", Duration::from_secs(30), || {
        let i = env.get(&key, &format!("/v1/instances/{id}"));
        if i["state"] != "running" {
            return false;
        }
        let reason = i["state_reason"].as_str().unwrap_or("");
        pid = reason
            .trim_start_matches("running as pid ")
            .parse()
            .unwrap_or(0);
        pid > 0
    });
    assert!(pid_alive(pid));
    let before = env.get(&key, &format!("/v1/instances/{id}"));
    let keys_before = env.get(&env.operator_key(), "/v1/keys");

    // kill -9: no chance to clean up.
    server.0.kill().unwrap();
    server.0.wait().unwrap();
    std::thread::sleep(Duration::from_secs(2));
    assert!(pid_alive(pid), "the work survives the server");
    let _server2 = env.server();

    // Everything the store acknowledged is there.
    assert_eq!(
        env.get(&env.operator_key(), "/v1/keys")["items"],
        keys_before["items"]
    );
    assert_eq!(
        env.get(&key, &format!("/v1/tenants/{tenant}"))["name"],
        "durable"
    );
    // The agent re-attaches: still running, same process, no restart.
    let ts = |v: &Value| chrono::DateTime::parse_from_rfc3339(v.as_str().unwrap_or("")).ok();
    let last_event = ts(&before["events"].as_array().unwrap().last().unwrap()["at"]).unwrap();
    let killed_at = chrono::Utc::now();
    wait_until("the agent syncs again", Duration::from_secs(30), || {
        let nodes = env.get(&env.operator_key(), "/v1/nodes");
        let node = &nodes["items"][0];
        ts(&node["last_heartbeat_at"]).is_some_and(|hb| hb > last_event && hb > killed_at)
            && node["state"] == "ready"
    });
    std::thread::sleep(Duration::from_secs(1));
    let after = env.get(&key, &format!("/v1/instances/{id}"));
    assert_eq!(after["state"], "running", "{after}");
    assert_eq!(
        after["events"], before["events"],
        "no transition recorded: the work never stopped"
    );
    assert!(pid_alive(pid), "same process still running");
    assert_eq!(free_h100(&env, &key), 2);

    // And it can still be stopped through the restarted server.
    let out = env.cli(Some(&key), &["stop", &id]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_until("stopped", Duration::from_secs(30), || {
        env.get(&key, &format!("/v1/instances/{id}"))["state"] == "stopped"
    });
    wait_until("the process is gone", Duration::from_secs(10), || {
        !pid_alive(pid)
    });
    let logs = env.get(&key, &format!("/v1/instances/{id}/logs"));
    assert_eq!(logs["items"][0]["line"], "up");
}

fn send_signal(child: &Child, sig: nix::sys::signal::Signal) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, sig).unwrap();
}

fn wait_exit(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            start.elapsed() < limit,
            "process did not exit within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `flotilla up` as the README tells a newcomer: it prints where to go and
/// the key once, the CLI finds the key by itself, and Ctrl-C stops the
/// running work and records it before exiting.
#[test]
fn up_quick_start_and_ctrl_c() {
    let env = Env::new();
    let bind = format!("127.0.0.1:{}", env.port);
    // Not the default 7430: another `up` on the machine may hold it.
    let gateway_bind = format!("127.0.0.1:{}", flotilla_testkit::process::free_port());
    let start_up = || {
        let child = env
            .cmd()
            .args(["up", "--bind", &bind, "--gateway-bind", &gateway_bind])
            .stdout(Stdio::piped())
            .stderr(env.log("up"))
            .spawn()
            .unwrap();
        wait_until("up answers", Duration::from_secs(30), || {
            http("GET", &format!("{}/healthz", env.url()), None, None)
                .map(|(s, _)| s == 200)
                .unwrap_or(false)
        });
        Proc(child)
    };
    let mut up = start_up();
    let creds = env.dir.path().join("config/credentials.json");
    wait_until("credentials saved", Duration::from_secs(10), || {
        creds.exists()
    });
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&creds).unwrap().permissions().mode() & 0o777,
        0o600,
        "key file private"
    );
    let key = env.operator_key();

    // The quick start, with no key or server given: the CLI finds both.
    let quick = |args: &[&str]| {
        let out = env.cmd().args(args).output().unwrap();
        assert!(
            out.status.success(),
            "flotilla {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    wait_until("the local node", Duration::from_secs(30), || {
        quick(&["nodes"]).contains("ready")
    });
    let gpus = quick(&["gpus"]);
    let h100: Vec<&str> = gpus
        .lines()
        .find(|l| l.starts_with("H100"))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(
        h100[h100.len() - 2..],
        ["4", "4"],
        "4 simulated H100s, all free: {gpus}"
    );
    let out = quick(&[
        "run",
        "--gpus",
        "2",
        "--",
        "sh",
        "-c",
        "echo \"my GPUs: $CUDA_VISIBLE_DEVICES\"",
    ]);
    let ids: Vec<u32> = out
        .trim()
        .trim_start_matches("my GPUs: ")
        .split(',')
        .map(|i| i.parse().unwrap())
        .collect();
    assert_eq!(ids.len(), 2, "{out}");
    assert!(
        ids[0] != ids[1] && ids.iter().all(|&i| i < 6),
        "two distinct GPUs of the 6: {out}"
    );
    let id = quick(&["run", "--detach", "--gpus", "1", "--", "sleep", "300"])
        .trim()
        .to_string();
    assert!(id.starts_with("inst_"), "{id}");
    wait_until("running", Duration::from_secs(30), || {
        env.get(&key, &format!("/v1/instances/{id}"))["state"] == "running"
    });
    assert!(quick(&["ps"]).contains(&id));
    // Simulated GPUs have no driver: `top` says there is nothing to read
    // rather than showing invented numbers.
    let top = quick(&["top", &id]);
    assert!(top.contains("no GPU readings"), "{top}");

    // Ctrl-C: the work is stopped and recorded, then everything exits.
    send_signal(&up.0, nix::sys::signal::Signal::SIGINT);
    let status = wait_exit(&mut up.0, Duration::from_secs(30));
    assert!(status.success(), "up exits cleanly: {status:?}");
    let mut printed = String::new();
    use std::io::Read;
    up.0.stdout
        .take()
        .unwrap()
        .read_to_string(&mut printed)
        .unwrap();
    assert!(
        printed.contains(&format!("API:      {}", env.url())),
        "{printed}"
    );
    assert!(
        printed.contains("/v1/docs") && printed.contains(&key),
        "URLs and the key once: {printed}"
    );
    assert!(
        printed.contains("flotilla demo"),
        "the demo hint: {printed}"
    );

    // A second start keeps the data and prints no new key.
    let mut up2 = start_up();
    let inst = env.get(&key, &format!("/v1/instances/{id}"));
    assert_eq!(inst["state"], "stopped", "{inst}");
    assert_eq!(inst["exit_code"], 143);
    send_signal(&up2.0, nix::sys::signal::Signal::SIGINT);
    assert!(wait_exit(&mut up2.0, Duration::from_secs(30)).success());
    let mut printed = String::new();
    up2.0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut printed)
        .unwrap();
    assert!(
        !printed.contains("flt_"),
        "the key is shown only once: {printed}"
    );
}

/// A node whose agent stops answering: the node turns unreachable and its
/// instance lost once the node's lease ran out; when the agent runs again
/// it finds its lease gone and stops the work itself (the server may have
/// restarted it elsewhere), never restarting it, and the node is usable
/// again.
#[test]
fn silent_node_is_unreachable_then_stops_its_work() {
    let mut env = Env::new();
    env.heartbeat_timeout = 3;
    let _server = env.server();
    let agent = env.agent("flaky-node");
    let (_tenant, key) = env.tenant("partition");
    wait_until("4 free H100s", Duration::from_secs(30), || {
        free_h100(&env, &key) == 4
    });
    let created = env.cli_json(
        Some(&key),
        &["run", "--detach", "--gpus", "1", "--", "sleep", "600"],
    );
    let id = created["id"].as_str().unwrap().to_string();
    let path = format!("/v1/instances/{id}");
    wait_until("running", Duration::from_secs(30), || {
        env.get(&key, &path)["state"] == "running"
    });
    let reason = env.get(&key, &path)["state_reason"]
        .as_str()
        .unwrap()
        .to_string();
    let pid: u32 = reason
        .trim_start_matches("running as pid ")
        .parse()
        .unwrap();

    // Freeze the agent: no syncs; its child would keep running but for the
    // fence. When the fence stopped it, as this test sees it: after it was
    // last seen alive, by when it was first seen gone.
    send_signal(&agent.0, nix::sys::signal::Signal::SIGSTOP);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut alive_at = chrono::Utc::now();
    while pid_alive(pid) {
        assert!(Instant::now() < deadline, "the fence never stopped {pid}");
        alive_at = chrono::Utc::now();
        std::thread::sleep(Duration::from_millis(10));
    }
    let gone_at = chrono::Utc::now();
    wait_until("lost", Duration::from_secs(30), || {
        env.get(&key, &path)["state"] == "lost"
    });
    let op = env.operator_key();
    assert_eq!(
        env.get(&op, "/v1/nodes")["items"][0]["state"],
        "unreachable"
    );
    assert_eq!(
        free_h100(&env, &key),
        0,
        "an unreachable node offers nothing"
    );
    // The agent is frozen, but the fence beside it stopped the work by
    // the end of the node's lease, before the server declared it lost.
    assert!(
        !pid_alive(pid),
        "the node lease's fence stopped the frozen agent's work"
    );

    send_signal(&agent.0, nix::sys::signal::Signal::SIGCONT);
    wait_until("the agent stops the work", Duration::from_secs(30), || {
        !pid_alive(pid)
    });
    // Failed, with the exit its agent reported: on the agent's first sync
    // back (the server fails the copy the sync does not report), or the
    // next (it had not reaped the killed work yet), which ends the failed
    // copy at the exit.
    let mut inst = Value::Null;
    wait_until(
        "failed with the exit its agent reported",
        Duration::from_secs(30),
        || {
            inst = env.get(&key, &path);
            inst["state"] == "failed" && !inst["exit_code"].is_null()
        },
    );
    let events: Vec<&str> = inst["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["state"].as_str().unwrap())
        .collect();
    assert_eq!(
        events,
        [
            "pending",
            "scheduled",
            "starting",
            "running",
            "lost",
            "failed"
        ],
        "never taken back as running: {inst}"
    );
    // Billed to the kill, as the fence saw it (it looks every 100 ms) and
    // the agent reported it on its return, not to that return (seconds
    // later): the run is the reported start to the fence's time, and the
    // bill is exactly that run (to the millisecond).
    let time = |v: &Value| {
        chrono::DateTime::parse_from_rfc3339(v.as_str().unwrap_or_default())
            .map(|t| t.with_timezone(&chrono::Utc))
            .unwrap_or_else(|e| panic!("a time, not {v}: {e}"))
    };
    let (started, ended) = (time(&inst["started_at"]), time(&inst["finished_at"]));
    assert!(
        ended >= alive_at && ended <= gone_at + chrono::Duration::milliseconds(250),
        "ended {ended}: the fence stopped it between {alive_at} and {gone_at}"
    );
    let want = (ended - started).num_milliseconds();
    wait_until(
        &format!("the lost run billed {want} ms"),
        Duration::from_secs(60),
        || billed_instance_ms(&env, &key, &id) == want,
    );
    wait_until("the node is back", Duration::from_secs(30), || {
        env.get(&op, "/v1/nodes")["items"][0]["state"] == "ready"
    });
    wait_until("its GPUs are free", Duration::from_secs(30), || {
        free_h100(&env, &key) == 4
    });
}

#[test]
fn cli_and_agent_fail_over_past_a_dead_server_url() {
    let env = Env::new();
    let _server = env.server();
    let op = env.operator_key();
    let dead = format!(
        "http://127.0.0.1:{}",
        flotilla_testkit::process::free_port()
    );
    let both = format!("{dead},{}", env.url());

    // Nothing answers: the error names the server and what to do.
    let out = env
        .cmd()
        .args(["--server", &dead, "nodes"])
        .env("FLOTILLA_API_KEY", &op)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("cannot reach the server at {dead}"))
            && err.contains("is `flotilla up` running?"),
        "{err}"
    );

    // An agent given the dead URL first registers through the live one.
    let token = std::fs::read_to_string(env.data().join("agent.token")).unwrap();
    let _agent = Proc(
        env.cmd()
            .args(["agent", "--server", &both, "--token", token.trim()])
            .args(["--name", "ha-node", "--simulate-gpus", "1xT4", "--work-dir"])
            .arg(env.dir.path().join("agent"))
            .stdout(env.log("agent"))
            .stderr(env.log("agent"))
            .spawn()
            .unwrap(),
    );
    // The CLI, given the same list (here through FLOTILLA_SERVER), sees it.
    wait_until(
        "the node through the second URL",
        Duration::from_secs(60),
        || {
            let out = env
                .cmd()
                .env("FLOTILLA_SERVER", &both)
                .env("FLOTILLA_API_KEY", &op)
                .args(["--json", "nodes"])
                .output()
                .unwrap();
            out.status.success()
                && serde_json::from_slice::<Value>(&out.stdout).is_ok_and(|v| {
                    v.as_array()
                        .is_some_and(|a| a.iter().any(|n| n["name"] == "ha-node"))
                })
        },
    );
}
