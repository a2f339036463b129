//! The web console in a real browser: the real `flotilla` binary as
//! server, agent (simulated GPUs) and gateway, and `tests/browser/console.mjs` driving
//! Debian's headless Chromium through Playwright as tenant A, tenant B,
//! the provider and the operator (sign in; launch an instance, see it running, read its
//! logs, run a command in its terminal tab, stop it; a share of a GPU
//! shown as a share; deploy an endpoint and see its replica chart; open an
//! invoice and download its CSV; the provider sets an offer window and
//! its node takes no new work outside it; B sees none of A's objects by
//! page or by URL; the operator cordons a node from the fleet map). Then this test
//! checks through the API what the clicks did.
//!
//! Needs `node` and `chromium` and `npm ci` in `tests/browser` (`.ci/run`
//! does all three); without them it says so and passes, unless
//! `FLOTILLA_REQUIRE_BROWSER=1` (set by `.ci/run`) makes that a failure.
//! The terminal step needs the agent to run as root (entering an
//! instance's namespaces does), as CI runs it; otherwise the script skips
//! that step alone, saying so.
//! `FLOTILLA_CONSOLE_SHOTS=<dir>` keeps the screenshots there (the
//! README's are made so, into `docs/console`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use flotilla_testkit::process::{free_port, http, wait_until, Home};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
const LONG: Duration = Duration::from_secs(120);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root")
}

/// Why the browser test cannot run here, if it cannot.
fn missing_tools(browser_dir: &Path, chromium: &str) -> Option<String> {
    if Command::new("node").arg("--version").output().is_err() {
        return Some("`node` is not installed".into());
    }
    if !Path::new(chromium).exists() {
        return Some(format!(
            "no Chromium at {chromium} (apt-get install chromium)"
        ));
    }
    if !browser_dir.join("node_modules/playwright-core").exists() {
        return Some(format!("run `npm ci` in {}", browser_dir.display()));
    }
    None
}

#[test]
fn the_console_in_a_browser_rents_gpus_deploys_bills_isolates_and_cordons() {
    let root = repo_root();
    let browser_dir = root.join("tests/browser");
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    if let Some(why) = missing_tools(&browser_dir, &chromium) {
        if std::env::var("FLOTILLA_REQUIRE_BROWSER").is_ok_and(|v| v == "1") {
            panic!("the browser test cannot run: {why}");
        }
        eprintln!("skipped: the browser test needs node, chromium and playwright-core: {why}");
        return;
    }

    // The terminal enters the instance's sandbox: as root, bubblewrap.
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    let root = nix::unistd::geteuid().is_root();
    let home = Home::new(BIN);
    let _server = home.server();
    let _agent = home.agent("gpu-a", "4xH100,2xL40S");
    let gw_port = free_port();
    let _gateway = home.gateway(gw_port);
    let op = home.operator_key();
    let (a_tenant, a_key) = home.tenant("acme");
    let (_b_tenant, b_key) = home.tenant("bolt");
    wait_until("the node is ready", LONG, || {
        home.get(&op, "/v1/nodes")["items"]
            .as_array()
            .is_some_and(|n| {
                n.iter()
                    .any(|n| n["name"] == "gpu-a" && n["state"] == "ready")
            })
    });

    // A catalog version with a reserved offer, in force within seconds,
    // so that the estimator compares a commitment too.
    let mut v = home.get(&op, "/v1/prices")["versions"][0].clone();
    v.as_object_mut().expect("a version").remove("version");
    v["effective_from"] = json!((chrono::Utc::now() + chrono::Duration::seconds(2)).to_rfc3339());
    v["reserved_offers"] = json!([{"term_days": 365, "discount": "0.35"}]);
    let (status, body) = http(
        "POST",
        &format!("{}/v1/prices", home.url()),
        Some(&op),
        Some(&v.to_string()),
    )
    .expect("the server answers");
    assert!(
        status == 200 || status == 201,
        "publish prices: {status} {body}"
    );
    wait_until("the new prices are in force", LONG, || {
        home.get(&op, "/v1/prices")["in_force"] == 2
    });

    // The local agent's token is the provider key of the node's owner.
    let provider_key =
        std::fs::read_to_string(home.data().join("agent.token")).expect("agent token");
    let shots = std::env::var("FLOTILLA_CONSOLE_SHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| home.dir.path().join("shots"));
    let out = Command::new("node")
        .arg(browser_dir.join("console.mjs"))
        .current_dir(&browser_dir)
        .env("FLOTILLA_URL", home.url())
        .env("OP_KEY", &op)
        .env("A_KEY", &a_key)
        .env("B_KEY", &b_key)
        .env("PROVIDER_KEY", provider_key.trim())
        .env("GATEWAY", format!("http://127.0.0.1:{gw_port}"))
        .env("BIN", BIN)
        .env("SHOTS", &shots)
        .env("CHROMIUM", &chromium)
        .env("NODE_NAME", "gpu-a")
        .env("TERMINAL", if root { "1" } else { "0" })
        .output()
        .expect("run node");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the browser script failed:\n{stderr}\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let made: Value = serde_json::from_slice(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .unwrap_or("")
            .as_bytes(),
    )
    .expect("the script's summary line");
    eprintln!("{stderr}");

    // What the clicks did, through the API.
    let inst = made["instance"].as_str().expect("an instance");
    let i = home.get(&a_key, &format!("/v1/instances/{inst}"));
    assert_eq!(i["state"], "stopped", "{i}");
    assert_eq!(i["tenant_id"], a_tenant.as_str());
    assert_eq!(i["gpu_model"], "H100");
    let logs = home.get(&a_key, &format!("/v1/instances/{inst}/logs"));
    assert!(
        logs.to_string()
            .contains("console-line-3 hi-from-the-console"),
        "{logs}"
    );
    // The instance launched outside the node's offer window waited (the
    // page showed the node counted as cordoned) and ran once offered.
    let outside = made["outside"]
        .as_str()
        .expect("an instance outside the window");
    let o = home.get(&a_key, &format!("/v1/instances/{outside}"));
    let events = o["events"].as_array().expect("events").clone();
    assert!(
        events.iter().any(|e| e["state"] == "running"),
        "ran once offered: {o}"
    );
    assert_eq!(o["gpu_model"], "H100", "{o}");
    let ep = made["endpoint"].as_str().expect("an endpoint");
    let e = home.get(&a_key, &format!("/v1/endpoints/{ep}"));
    assert_eq!(e["name"], "chat");
    assert_eq!(e["spec"]["min_replicas"], 1);
    assert!(made["csv_rows"].as_u64().unwrap_or(0) >= 1, "{made}");
    assert!(made["served"].as_u64().unwrap_or(0) >= 50, "{made}");
    // B gets 404 for A's objects from the API as well.
    for path in [
        format!("/v1/instances/{inst}"),
        format!("/v1/endpoints/{ep}"),
    ] {
        let (status, _) = http("GET", &format!("{}{path}", home.url()), Some(&b_key), None)
            .expect("the server answers");
        assert_eq!(status, 404, "{path}");
    }

    // The node is cordoned: new work stays pending while it is.
    let nodes = home.get(&op, "/v1/nodes");
    let node = nodes["items"]
        .as_array()
        .and_then(|n| n.iter().find(|n| n["name"] == "gpu-a"))
        .expect("the node")
        .clone();
    assert_eq!(node["cordoned"], true, "{node}");
    let (status, body) = http(
        "POST",
        &format!("{}/v1/instances", home.url()),
        Some(&a_key),
        Some(&json!({"gpus": 1, "command": ["true"]}).to_string()),
    )
    .expect("the server answers");
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_str().expect("id").to_string();
    wait_until("the scheduler gives a reason", LONG, || {
        let i = home.get(&a_key, &format!("/v1/instances/{id}"));
        i["state"] == "pending" && !i["state_reason"].as_str().unwrap_or("").is_empty()
    });
    let i = home.get(&a_key, &format!("/v1/instances/{id}"));
    assert_eq!(i["state"], "pending", "cordoned node took new work: {i}");
    assert!(i["node_id"].is_null(), "{i}");
}
