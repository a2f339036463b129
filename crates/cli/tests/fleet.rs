//! Issue 25, the fleet load generator: `flotilla agent --simulate-fleet 50`
//! is 50 agents in one process, and the server cannot tell them from a real
//! one. Next to one real `flotilla agent` (sandboxed processes) on the same
//! server:
//!
//! - every simulated node registers as the real node does (same kind of
//!   node, same GPUs), each under its own name, and keeps syncing;
//! - work created through the API runs on them: a `sleep 1.2` runs 1.2 s
//!   and succeeds, a server runs until stopped through the API;
//! - each run is metered exactly as the real node's is: the ledger bills
//!   the start and the end the agent reported, to the millisecond, and the
//!   reported run is what the workload did (1.2 s and a few ms).

use std::collections::BTreeMap;
use std::process::Child;
use std::time::Duration;

use chrono::{DateTime, Utc};
use flotilla_billing::meter::{effective_events, to_millisecond, Meter, UsageEvent};
use flotilla_testkit::process::{http, wait_until, Home, Proc};
use rust_decimal::Decimal;
use serde_json::{json, Value};

mod support;

use support::times::{event_at, time};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
const FLEET: usize = 50;

/// Every node, all pages, by name.
fn nodes(home: &Home, op: &str) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/nodes?limit=1000&cursor={c}"),
            None => "/v1/nodes?limit=1000".to_string(),
        };
        let page = home.get(op, &path);
        for n in page["items"].as_array().cloned().unwrap_or_default() {
            out.insert(n["name"].as_str().unwrap().to_string(), n);
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => return out,
        }
    }
}

/// GPU-seconds the ledger bills each subject, corrections applied.
fn billed(home: &Home, key: &str) -> BTreeMap<String, Decimal> {
    let enc = |t: DateTime<Utc>| t.to_rfc3339().replace(':', "%3A").replace('+', "%2B");
    let now = Utc::now();
    let mut events: Vec<UsageEvent> = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut path = format!(
            "/v1/usage?limit=1000&from={}&to={}",
            enc(now - chrono::Duration::hours(1)),
            enc(now + chrono::Duration::hours(1))
        );
        if let Some(c) = &cursor {
            path.push_str(&format!("&cursor={c}"));
        }
        let page = home.get(key, &path);
        events.extend(
            page["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| serde_json::from_value::<UsageEvent>(i.clone()).unwrap()),
        );
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    let mut out = BTreeMap::new();
    for e in effective_events(&events).unwrap() {
        if matches!(e.meter, Meter::GpuSeconds { .. }) {
            *out.entry(e.subject.id.clone()).or_insert(Decimal::ZERO) +=
                e.quantity_within(e.start, e.end).unwrap();
        }
    }
    out
}

/// What the instance's recorded run bills: its GPUs times its start to its
/// end, each to the millisecond.
fn recorded_gpu_seconds(inst: &Value) -> Decimal {
    let (s, f) = (time(&inst["started_at"]), time(&inst["finished_at"]));
    let ms = (to_millisecond(f) - to_millisecond(s)).num_milliseconds();
    Decimal::new(ms, 3) * Decimal::from(inst["gpus"].as_i64().unwrap())
}

/// Starts `flotilla agent --simulate-fleet` for `home`'s server.
fn fleet(home: &Home, nodes: usize, stats: &std::path::Path) -> Proc {
    let path = home.data().join("agent.token");
    wait_until("the agent token", Duration::from_secs(20), || {
        std::fs::read_to_string(&path).is_ok_and(|t| !t.trim().is_empty())
    });
    let token = std::fs::read_to_string(&path).unwrap();
    let child: Child = home
        .cmd()
        .args(["agent", "--server", &home.url(), "--token", token.trim()])
        .args(["--simulate-fleet", &nodes.to_string()])
        .args(["--simulate-gpus", "8xH100", "--name", "sim"])
        .arg("--work-dir")
        .arg(home.dir.path().join("fleet"))
        .arg("--fleet-stats")
        .arg(stats)
        .stdout(home.log("fleet"))
        .stderr(home.log("fleet"))
        .spawn()
        .expect("start the fleet");
    Proc(child)
}

/// What must be equal between a simulated node and a real one (all but
/// the GPU model: the real node's are A100-80GBs, the fleet's H100s).
fn kind_of_node(n: &Value) -> Value {
    let gpus: Vec<Value> = n["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| json!([g["index"], g["state"], g["fault"]]))
        .collect();
    json!({
        "state": n["state"], "region": n["region"], "pool": n["pool"],
        "simulated": n["simulated"], "runtime": n["runtime"],
        "executor": n["executor"], "cordoned": n["cordoned"],
        "cpu_milli": n["cpu_milli"], "memory_mb": n["memory_mb"], "gpus": gpus,
    })
}

#[test]
fn fifty_simulated_nodes_register_sync_and_are_metered_like_a_real_one() {
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    let mut home = Home::new(BIN);
    // Heartbeat interval 3 s: syncs are seen within seconds.
    home.heartbeat_timeout = 9;
    let _server = home.server();
    let op = home.operator_key();
    // An A100-80GB node: work asking for that model runs on the real node only.
    let _real = home.agent("real-0", "8xA100-80GB");
    let stats_file = home.dir.path().join("fleet-stats.json");
    let _fleet = fleet(&home, FLEET, &stats_file);

    // Registered: 50 nodes of their own names, each like the real one.
    let mut all = BTreeMap::new();
    wait_until("51 ready nodes", Duration::from_secs(120), || {
        all = nodes(&home, &op);
        all.len() == FLEET + 1 && all.values().all(|n| n["state"] == "ready")
    });
    let real = kind_of_node(&all["real-0"]);
    assert_eq!(real["gpus"].as_array().unwrap().len(), 8, "{real}");
    for i in 0..FLEET {
        let name = format!("sim-{i:05}");
        let node = all.get(&name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(kind_of_node(node), real, "{name} registers as a real node");
        let models: Vec<&str> = node["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["model"].as_str().unwrap())
            .collect();
        assert_eq!(models, ["H100"; 8], "{name}");
    }
    let ids: std::collections::BTreeSet<&str> =
        all.values().map(|n| n["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), FLEET + 1, "each its own node");

    // Syncing: every node's heartbeat moves on.
    let first: BTreeMap<String, DateTime<Utc>> = all
        .iter()
        .map(|(k, n)| (k.clone(), time(&n["last_heartbeat_at"])))
        .collect();
    wait_until("every node syncs again", Duration::from_secs(60), || {
        nodes(&home, &op)
            .iter()
            .all(|(k, n)| time(&n["last_heartbeat_at"]) > first[k])
    });
    let mut stats = Value::Null;
    wait_until("the fleet's statistics", Duration::from_secs(30), || {
        stats = std::fs::read_to_string(&stats_file)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(Value::Null);
        stats["syncs_answered"].as_u64().unwrap_or(0) >= 2 * FLEET as u64
    });
    assert_eq!(stats["registered"], FLEET, "{stats}");
    assert_eq!(stats["nodes"], FLEET, "{stats}");

    // Work: an 8-GPU `sleep 1.2` on the real node (A100-80GB), and one per
    // simulated node and one more (H100), created 8 at a time.
    let (_tenant, key) = home.tenant("fleet");
    let sleep = |model: &str| {
        json!({"gpus": 8, "gpu_types": [model], "cpu_milli": 100, "memory_mb": 64,
               "command": ["sleep", "1.2"]})
        .to_string()
    };
    let url = format!("{}/v1/instances", home.url());
    let bodies: Vec<String> = std::iter::once(sleep("A100-80GB"))
        .chain((0..=FLEET).map(|_| sleep("H100")))
        .collect();
    let created: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = bodies
            .chunks(bodies.len().div_ceil(8))
            .map(|chunk| {
                let url = &url;
                let key = &key;
                s.spawn(move || {
                    chunk
                        .iter()
                        .map(|body| {
                            let (status, v) = http("POST", url, Some(key), Some(body)).unwrap();
                            assert_eq!(status, 201, "{v}");
                            v["id"].as_str().unwrap().to_string()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    let mut done: Vec<Value> = Vec::new();
    // One list per look: a look per instance would meet the key's rate limit.
    wait_until("every sleep succeeded", Duration::from_secs(180), || {
        let listed = home.get(&key, "/v1/instances?limit=1000")["items"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        done = listed
            .into_iter()
            .filter(|i| created.iter().any(|id| i["id"] == id.as_str()))
            .collect();
        done.len() == created.len() && done.iter().all(|i| i["state"] == "succeeded")
    });
    let node_name: BTreeMap<String, String> = all
        .values()
        .map(|n| {
            (
                n["id"].as_str().unwrap().to_string(),
                n["name"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let ran_on: std::collections::BTreeSet<&str> = done
        .iter()
        .map(|i| node_name[i["node_id"].as_str().unwrap()].as_str())
        .collect();
    assert!(ran_on.contains("real-0"), "{ran_on:?}");
    // Spread over the fleet (a node that finished its sleep may take the
    // next one, so not necessarily one each).
    assert!(ran_on.len() > FLEET / 4, "ran on {ran_on:?}");

    // A server on a simulated node runs until the API stops it.
    let serve = json!({"gpus": 8, "gpu_types": ["H100"], "cpu_milli": 100, "memory_mb": 64,
                       "command": ["serve", "--port", "80"]})
    .to_string();
    let (status, v) = http("POST", &url, Some(&key), Some(&serve)).unwrap();
    assert_eq!(status, 201, "{v}");
    let served = v["id"].as_str().unwrap().to_string();
    let mut inst = Value::Null;
    wait_until("the server runs", Duration::from_secs(60), || {
        inst = home.get(&key, &format!("/v1/instances/{served}"));
        inst["state"] == "running"
    });
    // It keeps running for a while (held by nothing but its stop).
    let running_since = time(&inst["started_at"]);
    wait_until("two seconds of serving", Duration::from_secs(30), || {
        Utc::now() - running_since > chrono::Duration::seconds(2)
    });
    assert_eq!(
        home.get(&key, &format!("/v1/instances/{served}"))["state"],
        "running"
    );
    let (status, v) = http(
        "POST",
        &format!("{url}/{served}/stop"),
        Some(&key),
        Some("{}"),
    )
    .unwrap();
    assert_eq!(status, 200, "{v}");
    wait_until("the server stopped", Duration::from_secs(60), || {
        inst = home.get(&key, &format!("/v1/instances/{served}"));
        inst["state"] == "stopped"
    });
    assert!(
        node_name[inst["node_id"].as_str().unwrap()].starts_with("sim-"),
        "{inst}"
    );
    done.push(inst);

    // Metered exactly as the real node's run: billed == the run the agent
    // reported, to the millisecond; and that run is what the workload did.
    let mut bills = BTreeMap::new();
    wait_until(
        "the ledger bills every run",
        Duration::from_secs(120),
        || {
            bills = billed(&home, &key);
            done.iter()
                .all(|i| bills.get(i["id"].as_str().unwrap()) >= Some(&recorded_gpu_seconds(i)))
        },
    );
    for inst in &done {
        let id = inst["id"].as_str().unwrap();
        let on = &node_name[inst["node_id"].as_str().unwrap()];
        let want = recorded_gpu_seconds(inst);
        assert_eq!(
            bills.get(id),
            Some(&want),
            "{id} on {on}: billed exactly its run"
        );
        if inst["state"] != "succeeded" {
            continue;
        }
        let ran =
            to_millisecond(event_at(inst, "succeeded")) - to_millisecond(event_at(inst, "running"));
        let ran = ran.num_milliseconds();
        // The real `sleep` starts a sandbox first, the simulated one not.
        let slack = if on == "real-0" { 1_000 } else { 200 };
        assert!(
            (1_200..1_200 + slack).contains(&ran),
            "{id} on {on} ran {ran} ms for a 1.2 s sleep: {inst}"
        );
        eprintln!("{id} on {on}: ran {ran} ms, billed {want} GPU-s");
        // The events are the agent's observations as well (10 ms: the
        // server's rounding of event times, as in exact_edges).
        assert!(
            (want - Decimal::new(ran, 3) * Decimal::from(8)).abs() <= Decimal::new(80, 3),
            "{id} on {on}: recorded {want} GPU-s, events {ran} ms"
        );
    }
}
