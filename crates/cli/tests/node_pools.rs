//! A node pool grows under queued work and shrinks when idle, end to end
//! with the real binary: `flotilla server --node-pool ...provider=local`
//! has no node at all; an instance asking for 2 H100s fits nowhere, so the
//! node-pool loop asks the local cloud for a machine, which starts a real
//! `flotilla agent` with 2 simulated H100s and a one-time join token; the
//! agent joins (trading the token for its own key), registers in the pool,
//! and the instance runs there. The token is spent: presenting it again is
//! refused. Once the pool's node has been idle for the idle timeout it is
//! drained and terminated: its agent process is gone and its key revoked.

use std::time::Duration;

use flotilla_testkit::process::{http, wait_until, Home, Proc};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

/// Starts the server with one local node pool: machines of 2 H100s, at
/// most 2, idle after 3 s.
fn server_with_pool(env: &Home) -> Proc {
    let mut c = env.cmd();
    c.args(["server", "--bind", &format!("127.0.0.1:{}", env.port)])
        .arg("--data-dir")
        .arg(env.data())
        .args(["--heartbeat-timeout", "15"])
        .args([
            "--node-pool",
            "name=burst,provider=local,type=2xH100,min=0,max=2,idle=3,boot=120",
        ])
        .stdout(env.log("server"))
        .stderr(env.log("server"));
    let server = Proc(c.spawn().expect("start flotilla server"));
    let url = env.url();
    wait_until("the server answers", Duration::from_secs(30), || {
        http("GET", &format!("{url}/healthz"), None, None).is_ok_and(|(s, _)| s == 200)
    });
    server
}

fn pool(env: &Home, op: &str) -> Value {
    let pools = env.get(op, "/v1/node-pools");
    pools
        .as_array()
        .and_then(|a| a.iter().find(|p| p["name"] == "burst"))
        .cloned()
        .expect("the burst pool is listed")
}

/// The pids of this home's local machines' agents (their command line
/// names the machines' work directory) with their environment.
fn machine_agents(env: &Home) -> Vec<(i32, String)> {
    let needle = env.data().join("machines").to_string_lossy().into_owned();
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(&needle) && cmdline.contains(" agent ") {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            out.push((pid, String::from_utf8_lossy(&environ).into_owned()));
        }
    }
    out
}

fn instance(env: &Home, key: &str, id: &str) -> Value {
    env.get(key, &format!("/v1/instances/{id}"))
}

#[test]
fn a_local_node_pool_grows_under_queued_work_and_shrinks_when_idle() {
    let env = Home::new(BIN);
    let _server = server_with_pool(&env);
    let op = env.operator_key();
    let (_, key) = env.tenant("acme");
    assert!(
        pool(&env, &op)["machines"]
            .as_array()
            .is_some_and(Vec::is_empty),
        "no machine before any work"
    );

    // Work that fits no node: the server has none.
    let id = env.run_detached(
        &key,
        &["--gpus", "2", "--", "sh", "-c", "echo on the pool; sleep 2"],
    );

    // The pool asks for one machine; it joins as a node of the pool.
    wait_until(
        "a machine to join the pool",
        Duration::from_secs(60),
        || {
            pool(&env, &op)["machines"]
                .as_array()
                .is_some_and(|m| m.len() == 1 && m[0]["state"] == "joined")
        },
    );
    let p = pool(&env, &op);
    let machine = p["machines"][0]["name"].as_str().unwrap().to_string();
    assert!(machine.starts_with("burst-"), "{machine}");
    let nodes = env.get(&op, "/v1/nodes");
    let node = nodes["items"]
        .as_array()
        .and_then(|n| n.iter().find(|n| n["name"] == machine.as_str()))
        .cloned()
        .expect("the machine's node is registered");
    assert_eq!(node["pool"], "burst");
    assert_eq!(node["gpus"].as_array().map(Vec::len), Some(2));

    // The instance runs there, and ends.
    wait_until("the instance to succeed", Duration::from_secs(60), || {
        instance(&env, &key, &id)["state"] == "succeeded"
    });
    assert_eq!(instance(&env, &key, &id)["node_id"], node["id"]);

    // The join token is spent: presenting it again is refused, saying so.
    let agents = machine_agents(&env);
    assert_eq!(agents.len(), 1, "one local machine: {agents:?}");
    let token = agents[0]
        .1
        .split('\0')
        .find_map(|kv| kv.strip_prefix("FLOTILLA_JOIN_TOKEN="))
        .expect("the agent was given its join token")
        .to_string();
    assert!(token.starts_with("fjt_"));
    let (status, body) = http(
        "POST",
        &format!("{}/v1/agent/join", env.url()),
        None,
        Some(&serde_json::json!({ "token": token }).to_string()),
    )
    .unwrap();
    assert_eq!(status, 401, "{body}");
    let msg = body["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("already used"), "{body}");
    let (status, body) = http(
        "POST",
        &format!("{}/v1/agent/join", env.url()),
        None,
        Some(r#"{"token": "fjt_0000"}"#),
    )
    .unwrap();
    assert_eq!(status, 401, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("unknown join token")));

    // Idle for 3 s: drained (cordoned) and terminated; the agent is gone.
    wait_until(
        "the idle machine to be given back",
        Duration::from_secs(60),
        || {
            pool(&env, &op)["machines"]
                .as_array()
                .is_some_and(Vec::is_empty)
        },
    );
    wait_until(
        "the machine's agent to exit",
        Duration::from_secs(20),
        || machine_agents(&env).is_empty(),
    );
    let node = env.get(&op, &format!("/v1/nodes/{}", node["id"].as_str().unwrap()));
    assert_eq!(node["cordoned"], true, "a given-back node takes no work");
    assert!(
        std::fs::read_to_string(env.dir.path().join("server.log"))
            .unwrap_or_default()
            .contains("node-pool machine given back"),
        "the server logs the termination"
    );

    // A new instance grows the pool again, on a new machine.
    let again = env.run_detached(&key, &["--gpus", "1", "--", "sh", "-c", "echo again"]);
    wait_until(
        "the second instance to succeed",
        Duration::from_secs(60),
        || instance(&env, &key, &again)["state"] == "succeeded",
    );
    let second = instance(&env, &key, &again)["node_id"].clone();
    assert_ne!(second, node["id"], "a new machine, not the given-back one");
}
