//! Instances in containers end to end: the real `flotilla` server, an
//! agent with `--runtime container` on Podman's Docker API service
//! (`scripts/podman-service`), and the CLI, running the local busybox test
//! image (no registry is reachable). Skipped with a message only where the
//! engine cannot be started (no root and no running service).

use std::time::Duration;

use flotilla_testkit::containers::{engine, Engine, Sweep};
use flotilla_testkit::process::{http, wait_until, Home, Proc};
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
    _agent: Proc,
}

impl Setup {
    fn start(engine: &'static Engine, name: &str) -> Self {
        let home = Home::new(BIN);
        // Unique per run: the engine outlives tests, and adoption and the
        // sweep go by the node's label.
        let node = format!("{name}-{}-{}", std::process::id(), home.port);
        let sweep = engine.sweep_on_drop(&node);
        let server = home.server();
        let agent = home.agent_with(
            &node,
            "4xH100",
            &home.url(),
            &[
                "--runtime",
                "container",
                "--docker-host",
                &engine.docker_host,
            ],
        );
        Setup {
            home,
            engine,
            node,
            _sweep: sweep,
            _server: server,
            _agent: agent,
        }
    }

    fn instance(&self, key: &str, id: &str) -> Value {
        self.home.get(key, &format!("/v1/instances/{id}"))
    }

    fn logs(&self, key: &str, id: &str) -> Vec<String> {
        self.home.get(key, &format!("/v1/instances/{id}/logs?limit=1000"))["items"]
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

fn run_detached(home: &Home, key: &str, args: &[&str]) -> String {
    let mut all = vec!["run", "--detach"];
    all.extend_from_slice(args);
    let out = home.cli(Some(key), &all);
    assert!(
        out.status.success(),
        "flotilla run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
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
    wait_until("the container's HTTP server answers", Duration::from_secs(60), || {
        match http("GET", &format!("{url}/index.html"), None, None) {
            Ok((200, body)) => {
                answer = body;
                true
            }
            _ => false,
        }
    });
    assert_eq!(answer.as_str().map(str::trim), Some("flotilla test image"));

    // Its output through the API: exactly its two GPUs, as a non-root user.
    let mut lines = Vec::new();
    wait_until("the GPU line in the log", Duration::from_secs(30), || {
        lines = s.logs(&key, &id);
        lines.iter().any(|l| l.starts_with("visible=")) && lines.iter().any(|l| l.starts_with("user="))
    });
    let visible = lines.iter().find(|l| l.starts_with("visible=")).unwrap();
    let gpus: Vec<&str> = visible["visible=".len()..].split(',').collect();
    assert_eq!(gpus.len(), 2, "two GPUs: {visible}");
    assert_ne!(gpus[0], gpus[1], "{visible}");
    assert!(lines.contains(&"user=65534".to_string()), "{lines:?}");

    // The engine runs exactly one container for it, labelled for the node.
    let containers = s.engine.containers_of(&s.node);
    assert_eq!(containers.len(), 1, "{containers:?}");
    assert_eq!(
        containers[0]["Labels"]["flotilla.instance"].as_str(),
        Some(id.as_str())
    );

    // A stop: TERM reaches the workload, which ends within its grace.
    let out = s.home.cli(Some(&key), &["stop", &id]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
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
fn a_container_node_refuses_work_without_an_image_with_a_reason() {
    let Some(engine) = engine() else { return };
    let s = Setup::start(engine, "ctr-noimg");
    let (_, key) = s.home.tenant("acme");
    let id = run_detached(&s.home, &key, &["--", "sh", "-c", "echo hi"]);
    let inst = s.wait_state(&key, &id, "failed", Duration::from_secs(60));
    let reason = inst["state_reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("this node runs containers"),
        "{inst}"
    );
    assert!(s.engine.containers_of(&s.node).is_empty());
}
