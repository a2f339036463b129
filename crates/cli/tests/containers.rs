//! Instances in containers end to end: the real `flotilla` server, an
//! agent with `--runtime container` on Podman's Docker API service
//! (`scripts/podman-service`), and the CLI, running the local busybox test
//! image (no registry is reachable). Skipped with a message only where the
//! engine cannot be started (no root and no running service).

use std::time::Duration;

use flotilla_testkit::containers::{engine, Engine, Sweep};
use flotilla_testkit::process::{
    http, probe_outcomes, probe_script, uid_of, wait_until, Home, Proc,
};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

/// A server, a container agent with 4 simulated H100s, and what removes
/// its containers at the end (they belong to the engine, not the test).
struct Setup {
    home: Home,
    engine: &'static Engine,
    node: String,
    _sweep: Sweep,
    _server: Proc,
    agent: Option<Proc>,
}

impl Setup {
    fn start(engine: &'static Engine, name: &str) -> Self {
        let home = Home::new(BIN);
        // Unique per run: the engine outlives tests, and adoption and the
        // sweep go by the node's label.
        let node = format!("{name}-{}-{}", std::process::id(), home.port);
        let sweep = engine.sweep_on_drop(&node);
        let server = home.server();
        let mut s = Setup {
            home,
            engine,
            node,
            _sweep: sweep,
            _server: server,
            agent: None,
        };
        s.start_agent();
        s
    }

    /// Starts (again) the container agent of this node.
    fn start_agent(&mut self) {
        self.agent = Some(self.home.agent_with(
            &self.node,
            "4xH100",
            &self.home.url(),
            &[
                "--runtime",
                "container",
                "--docker-host",
                &self.engine.docker_host,
            ],
        ));
    }

    fn instance(&self, key: &str, id: &str) -> Value {
        self.home.get(key, &format!("/v1/instances/{id}"))
    }

    fn logs(&self, key: &str, id: &str) -> Vec<String> {
        self.home
            .get(key, &format!("/v1/instances/{id}/logs?limit=1000"))["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["line"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    fn wait_state(&self, key: &str, id: &str, want: &str, limit: Duration) -> Value {
        let mut last = Value::Null;
        wait_until(&format!("{id} {want}"), limit, || {
            last = self.instance(key, id);
            last["state"] == want
        });
        last
    }
}

/// `flotilla run --detach ARGS`, asking a quarter core so that several
/// instances fit a two-core test machine.
fn run_detached(home: &Home, key: &str, args: &[&str]) -> String {
    let mut all = vec!["--cpus", "0.25"];
    all.extend_from_slice(args);
    home.run_detached(key, &all)
}

#[test]
fn an_image_runs_with_its_gpus_a_published_port_and_a_graceful_stop() {
    let Some(engine) = engine() else { return };
    let s = Setup::start(engine, "ctr-e2e");
    let (_, key) = s.home.tenant("acme");

    // An HTTP server on the published port, the GPU selection in the log,
    // and a TERM handler that says it ran (sh as the container's init
    // runs its trap once `wait` is interrupted).
    let script = "trap 'echo got TERM; exit 0' TERM; \
                  echo \"visible=$NVIDIA_VISIBLE_DEVICES\"; echo \"user=$(id -u)\"; \
                  httpd -f -p 8080 -h /www & wait";
    let id = run_detached(
        &s.home,
        &key,
        &[
            "--image",
            &engine.image,
            "--gpus",
            "2",
            "-p",
            "8080",
            "--memory",
            "256",
            "--",
            "sh",
            "-c",
            script,
        ],
    );
    s.wait_state(&key, &id, "running", Duration::from_secs(120));

    // The published port: in the API, `ps` and `explain`, and answering.
    let mut url = String::new();
    wait_until("the published port", Duration::from_secs(30), || {
        let i = s.instance(&key, &id);
        match i["published_ports"][0]["url"].as_str() {
            Some(u) => {
                url = u.to_string();
                i["published_ports"][0]["container_port"] == 8080
            }
            None => false,
        }
    });
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    let ps = s.home.cli(Some(&key), &["ps"]);
    assert!(
        String::from_utf8_lossy(&ps.stdout).contains(&url),
        "ps shows {url}: {}",
        String::from_utf8_lossy(&ps.stdout)
    );
    let explain = s.home.cli(Some(&key), &["explain", &id]);
    let explain = String::from_utf8_lossy(&explain.stdout).to_string();
    assert!(explain.contains(&format!("port 8080: {url}")), "{explain}");
    assert!(explain.contains("cold start:"), "{explain}");
    let mut answer = Value::Null;
    wait_until(
        "the container's HTTP server answers",
        Duration::from_secs(60),
        || match http("GET", &format!("{url}/index.html"), None, None) {
            Ok((200, body)) => {
                answer = body;
                true
            }
            _ => false,
        },
    );
    assert_eq!(answer.as_str().map(str::trim), Some("flotilla test image"));

    // Its output through the API: exactly its two GPUs, as a non-root user.
    let mut lines = Vec::new();
    wait_until("the GPU line in the log", Duration::from_secs(30), || {
        lines = s.logs(&key, &id);
        lines.iter().any(|l| l.starts_with("visible="))
            && lines.iter().any(|l| l.starts_with("user="))
    });
    let visible = lines.iter().find(|l| l.starts_with("visible=")).unwrap();
    let gpus: Vec<&str> = visible["visible=".len()..].split(',').collect();
    assert_eq!(gpus.len(), 2, "two GPUs: {visible}");
    assert_ne!(gpus[0], gpus[1], "{visible}");
    let uid: u32 = lines
        .iter()
        .find_map(|l| l.strip_prefix("user="))
        .and_then(|u| u.parse().ok())
        .unwrap();
    assert_ne!(uid, 0, "not root: {lines:?}");

    // The engine runs exactly one container for it, labelled for the node.
    let containers = s.engine.containers_of(&s.node);
    assert_eq!(containers.len(), 1, "{containers:?}");
    assert_eq!(
        containers[0]["Labels"]["flotilla.instance"].as_str(),
        Some(id.as_str())
    );

    // A stop: TERM reaches the workload, which ends within its grace.
    let out = s.home.cli(Some(&key), &["stop", &id]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let done = s.wait_state(&key, &id, "stopped", Duration::from_secs(60));
    assert_eq!(done["exit_code"], 0, "{done}");
    wait_until("the TERM handler's line", Duration::from_secs(30), || {
        s.logs(&key, &id).iter().any(|l| l == "got TERM")
    });

    // Metered: GPU-seconds for its two GPUs in the usage ledger.
    let mut usage = Value::Null;
    wait_until("the instance metered", Duration::from_secs(60), || {
        usage = s.home.get(
            &key,
            "/v1/usage?from=2000-01-01T00:00:00Z&to=2100-01-01T00:00:00Z",
        );
        usage.to_string().contains(&id)
    });

    // Done with it: the agent removes the container.
    wait_until("the container removed", Duration::from_secs(60), || {
        s.engine.containers_of(&s.node).is_empty()
    });
}

#[test]
fn a_container_node_takes_no_work_without_an_image_and_says_why() {
    let Some(engine) = engine() else { return };
    let s = Setup::start(engine, "ctr-noimg");
    // The agent registered as a container node; `flotilla nodes` says so.
    let op = s.home.operator_key();
    let mut table = String::new();
    wait_until("the node registers", Duration::from_secs(60), || {
        let out = s.home.cli(Some(&op), &["nodes"]);
        table = String::from_utf8_lossy(&out.stdout).into_owned();
        table.contains(&s.node)
    });
    let row = table.lines().find(|l| l.contains(&s.node)).unwrap();
    assert!(
        table.starts_with("ID") && table.contains("RUNTIME"),
        "{table}"
    );
    assert!(row.split_whitespace().any(|c| c == "container"), "{table}");
    let (_, key) = s.home.tenant("acme");
    let id = run_detached(&s.home, &key, &["--", "sh", "-c", "echo hi"]);
    // The scheduler does not place it there: it waits, saying why.
    let mut inst = Value::Null;
    wait_until("the wait reason", Duration::from_secs(60), || {
        inst = s.instance(&key, &id);
        inst["state_reason"]
            .as_str()
            .is_some_and(|r| r.contains("1 runs containers only"))
    });
    assert_eq!(inst["state"], "pending", "{inst}");
    assert!(s.engine.containers_of(&s.node).is_empty());
}

/// A shell command that succeeds when `GET path` at `addr` answers with
/// `want` in its body: busybox `nc`, since the static busybox's `wget`
/// crashes resolving any address.
fn fetch(addr: &str, path: &str, want: &str) -> String {
    let (host, port) = addr.rsplit_once(':').unwrap();
    format!("printf 'GET {path} HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {host} {port} | grep -q '{want}'")
}

fn readable(path: &std::path::Path) -> bool {
    std::fs::read(path).is_ok_and(|b| !b.is_empty())
}

/// The container runtime's version of `isolation.rs`: tenant B's container
/// tries what an attacker would (the operator's credentials, the data
/// directory, the database, the agent token, the engine's socket, tenant
/// A's files and environment, the host's password hashes, signalling A,
/// the control plane's port, A's container over the network) and every
/// attempt fails. Each target is first shown to exist and be reachable
/// from outside the container, so every assertion could fail.
#[test]
fn tenants_in_containers_cannot_reach_the_control_plane_or_each_other() {
    let Some(engine) = engine() else { return };
    let s = Setup::start(engine, "ctr-iso");
    let home = &s.home;
    let (_, key_a) = home.tenant("alpha");
    let (_, key_b) = home.tenant("beta");
    let secret = format!("A_SECRET=s3cret-{}-{}", std::process::id(), home.port);

    // Tenant A: a private file in its scratch space, a secret in its
    // environment, an HTTP server on a published port.
    let a = run_detached(
        home,
        &key_a,
        &[
            "--image",
            &engine.image,
            "-p",
            "8080",
            "-e",
            &secret,
            "--",
            "sh",
            "-c",
            "echo mine > /scratch/a-private.txt; echo a-ready; exec httpd -f -p 8080 -h /www",
        ],
    );
    wait_until("A runs", Duration::from_secs(120), || {
        s.logs(&key_a, &a).iter().any(|l| l == "a-ready")
    });

    // Preconditions, from the host.
    let inspect = |instance: &str| -> Value {
        let c = s
            .engine
            .containers_of(&s.node)
            .into_iter()
            .find(|c| c["Labels"]["flotilla.instance"] == instance)
            .unwrap_or_else(|| panic!("no container for {instance}"));
        s.engine.api(
            "GET",
            &format!("/containers/{}/json", c["Id"].as_str().unwrap()),
        )
    };
    let a_info = inspect(&a);
    let a_pid = u32::try_from(a_info["State"]["Pid"].as_u64().unwrap()).unwrap();
    assert!(a_pid > 0, "{a_info}");
    let environ = std::fs::read(format!("/proc/{a_pid}/environ")).unwrap();
    assert!(
        environ.split(|b| *b == 0).any(|v| v == secret.as_bytes()),
        "A's environment is readable from the host"
    );
    assert!(
        readable(std::path::Path::new(&format!(
            "/proc/{a_pid}/root/scratch/a-private.txt"
        ))),
        "A's file exists"
    );
    let a_ip = a_info["NetworkSettings"]["Networks"]
        .as_object()
        .and_then(|n| n.values().find_map(|v| v["IPAddress"].as_str()))
        .filter(|ip| !ip.is_empty())
        .unwrap_or_else(|| panic!("A's address: {a_info}"))
        .to_string();
    wait_until(
        "A's server answers the host",
        Duration::from_secs(60),
        || {
            matches!(
                http("GET", &format!("http://{a_ip}:8080/index.html"), None, None),
                Ok((200, _))
            )
        },
    );
    let creds = home.dir.path().join("config/credentials.json");
    assert!(readable(&creds));
    assert!(readable(&home.data().join("agent.token")));
    assert!(readable(&home.data().join("flotilla.db")));
    let root = flotilla_testkit::containers::is_root();
    if root {
        assert!(readable(std::path::Path::new("/etc/shadow")));
    }
    assert!(std::path::Path::new(engine.socket()).exists());
    assert!(
        matches!(
            http("GET", &format!("{}/healthz", home.url()), None, None),
            Ok((200, _))
        ),
        "the control plane answers on the host"
    );
    let a_uid = uid_of(a_pid);

    // Tenant B attacks, from a container with a published port (so on a
    // network with a route out, not only an internal one).
    let mut attacks = home.control_plane_attacks();
    attacks.extend([
        ("engine-socket", format!("test -e '{}'", engine.socket())),
        (
            "other-file",
            format!("cat /proc/{a_pid}/root/scratch/a-private.txt"),
        ),
        (
            "other-environ",
            format!("grep -q A_SECRET /proc/{a_pid}/environ"),
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
        (
            "control-plane",
            fetch(&format!("127.0.0.1:{}", home.port), "/healthz", "HTTP/1"),
        ),
        (
            "other-tenant-net",
            fetch(
                &format!("{a_ip}:8080"),
                "/index.html",
                "flotilla test image",
            ),
        ),
    ]);
    let script = probe_script(&attacks) + "exec sleep 300\n";
    let b = run_detached(
        home,
        &key_b,
        &[
            "--image",
            &engine.image,
            "-p",
            "9090",
            "--",
            "sh",
            "-c",
            &script,
        ],
    );
    wait_until("B's probe ends", Duration::from_secs(120), || {
        s.logs(&key_b, &b).iter().any(|l| l == "probe-done")
    });
    let lines = s.logs(&key_b, &b);
    let (probes, b_uid) = probe_outcomes(&lines);
    assert_eq!(probes.len(), attacks.len(), "{lines:?}");
    for (name, outcome) in &probes {
        assert_eq!(outcome, "denied", "tenant B could {name}: {lines:?}");
    }

    // The control for the network probe: A's own second container, on
    // A's network, reaches A's server with the same command.
    let a2 = run_detached(
        home,
        &key_a,
        &[
            "--image",
            &engine.image,
            "-p",
            "7070",
            "--",
            "sh",
            "-c",
            &format!(
                "{} && echo same-tenant-ok",
                fetch(
                    &format!("{a_ip}:8080"),
                    "/index.html",
                    "flotilla test image"
                )
            ),
        ],
    );
    wait_until(
        "A's second container reaches A",
        Duration::from_secs(120),
        || s.logs(&key_a, &a2).iter().any(|l| l == "same-tenant-ok"),
    );

    // Neither runs as root, and under a root agent each tenant is its own
    // user on the host.
    let b_uid = b_uid.expect("B's uid");
    let b_pid = u32::try_from(inspect(&b)["State"]["Pid"].as_u64().unwrap()).unwrap();
    assert_eq!(
        uid_of(b_pid),
        b_uid,
        "no user namespace: the same uid outside"
    );
    assert_ne!(a_uid, 0);
    assert_ne!(b_uid, 0);
    if root {
        assert_ne!(a_uid, b_uid, "each tenant its own user");
    }

    // A survived B's signal and still serves.
    assert!(std::path::Path::new(&format!("/proc/{a_pid}")).exists());
    assert_eq!(s.instance(&key_a, &a)["state"], "running");
    for (key, id) in [(&key_a, &a), (&key_b, &b)] {
        let out = home.cli(Some(key), &["stop", id]);
        assert!(out.status.success());
    }
    for (key, id) in [(&key_a, &a), (&key_b, &b)] {
        s.wait_state(key, id, "stopped", Duration::from_secs(60));
    }
}

/// An endpoint whose replicas run from an image: the replica's container
/// serves on its container port, the node publishes it, and the gateway
/// reaches it there.
#[test]
fn an_endpoint_replica_in_a_container_serves_through_the_gateway() {
    let Some(engine) = engine() else { return };
    let s = Setup::start(engine, "ctr-ep");
    let (_, key) = s.home.tenant("acme");
    let port = flotilla_testkit::process::free_port();
    let _gw = s.home.gateway(port);
    let out = s.home.cli(
        Some(&key),
        &[
            "endpoints",
            "deploy",
            "web",
            "--image",
            &engine.image,
            "--min",
            "1",
            "--readiness-path",
            "/index.html",
            "--",
            "sh",
            "-c",
            "echo \"serving on $PORT\"; exec httpd -f -p \"$PORT\" -h /www",
        ],
    );
    assert!(
        out.status.success(),
        "deploy: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Ready once the controller probed it at its published port.
    let mut ep = Value::Null;
    wait_until("a ready replica", Duration::from_secs(120), || {
        ep = s.home.cli_json(Some(&key), &["endpoints", "show", "web"]);
        ep["replicas"]
            .as_array()
            .is_some_and(|r| r.iter().any(|r| r["ready"] == true))
    });
    let replica = &ep["replicas"][0];
    let id = replica["instance_id"].as_str().unwrap();
    let inst = s.instance(&key, id);
    assert_eq!(inst["image"]["ports"][0], 8080, "{inst}");
    let published = inst["published_ports"][0]["url"].as_str().unwrap();
    assert_eq!(replica["url"].as_str(), Some(published), "{ep}");
    // PORT is the container port (the line may reach the server after
    // the replica was probed ready).
    wait_until("the replica's first line", Duration::from_secs(30), || {
        s.logs(&key, id).iter().any(|l| l == "serving on 8080")
    });

    // Through the gateway.
    let mut got = (0, Value::Null);
    wait_until(
        "the gateway routes to the replica",
        Duration::from_secs(60),
        || {
            got = http(
                "GET",
                &format!("http://127.0.0.1:{port}/e/web/index.html"),
                Some(&key),
                None,
            )
            .unwrap_or((0, Value::Null));
            got.0 == 200
        },
    );
    assert_eq!(got.1.as_str().map(str::trim), Some("flotilla test image"));

    let out = s.home.cli(Some(&key), &["endpoints", "delete", "web"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_until(
        "the replica's container removed",
        Duration::from_secs(120),
        || s.engine.containers_of(&s.node).is_empty(),
    );
}

/// A killed agent's containers keep running; the restarted agent adopts
/// them by their labels, keeps shipping their output with no line lost or
/// doubled, and stops them when asked.
#[test]
fn a_restarted_agent_adopts_its_running_containers() {
    let Some(engine) = engine() else { return };
    let mut s = Setup::start(engine, "ctr-adopt");
    let (_, key) = s.home.tenant("acme");
    let id = run_detached(
        &s.home,
        &key,
        &[
            "--image",
            &engine.image,
            "--",
            "sh",
            "-c",
            "trap 'echo got TERM; exit 0' TERM; i=0; while true; do echo \"tick $i\"; i=$((i+1)); sleep 0.2 & wait; done",
        ],
    );
    s.wait_state(&key, &id, "running", Duration::from_secs(120));
    wait_until("output before the restart", Duration::from_secs(60), || {
        s.logs(&key, &id).len() >= 5
    });

    // SIGKILL: no shutdown, the container is the engine's and runs on.
    drop(s.agent.take());
    let before = s.logs(&key, &id).len();
    let running = s.engine.containers_of(&s.node);
    assert_eq!(running.len(), 1, "{running:?}");
    assert_eq!(running[0]["State"], "running", "{running:?}");
    s.start_agent();

    // Output written while no agent ran, and after, reaches the server.
    wait_until("output after the restart", Duration::from_secs(90), || {
        s.logs(&key, &id).len() >= before + 10
    });
    assert_eq!(s.instance(&key, &id)["state"], "running");
    let lines = s.logs(&key, &id);
    for (n, line) in lines.iter().enumerate() {
        assert_eq!(
            line,
            &format!("tick {n}"),
            "no gap, no duplicate: {lines:?}"
        );
    }
    assert_eq!(
        s.engine.containers_of(&s.node).len(),
        1,
        "not started twice"
    );

    let out = s.home.cli(Some(&key), &["stop", &id]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    s.wait_state(&key, &id, "stopped", Duration::from_secs(60));
    wait_until("the TERM handler's line", Duration::from_secs(30), || {
        s.logs(&key, &id).last().is_some_and(|l| l == "got TERM")
    });
    wait_until("the container removed", Duration::from_secs(60), || {
        s.engine.containers_of(&s.node).is_empty()
    });
}

/// A container over its memory limit is killed by the kernel, and the
/// instance fails with that reason (not a bare exit code 137).
#[test]
fn a_container_over_its_memory_limit_fails_as_out_of_memory() {
    let Some(engine) = engine() else { return };
    let s = Setup::start(engine, "ctr-oom");
    let (_, key) = s.home.tenant("acme");
    let id = run_detached(
        &s.home,
        &key,
        &[
            "--image",
            &engine.image,
            "--memory",
            "32",
            "--",
            "sh",
            "-c",
            // Grows a shell variable a few MiB at a time, as a model load.
            "echo allocating; x=$(head -c 268435456 /dev/zero | tr '\\0' a); echo survived ${#x}",
        ],
    );
    let inst = s.wait_state(&key, &id, "failed", Duration::from_secs(120));
    let reason = inst["state_reason"].as_str().unwrap_or_default();
    assert!(reason.starts_with("out of memory"), "{inst}");
    assert_eq!(inst["exit_code"], 137, "{inst}");
    assert!(!s.logs(&key, &id).iter().any(|l| l.starts_with("survived")));
}
