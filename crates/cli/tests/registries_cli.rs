//! `flotilla registries` and `flotilla nodes show` as a user runs them:
//! the real binary as server, agent and CLI. The secret goes in on stdin,
//! is never printed back, and is nowhere in the server's data directory in
//! plain text (database, WAL, key file); the key file is private.

use std::io::Write as _;
use std::process::Stdio;
use std::time::Duration;

use flotilla_testkit::process::{http, wait_until, Home};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
const SECRET: &str = "ghp_plaintext-must-never-reach-the-disk-42";

fn text(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every file under `dir`, recursively.
fn files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn registry_logins_are_added_listed_and_removed_and_never_stored_plain() {
    let home = Home::new(BIN);
    let _server = home.server();
    let (_, admin) = home.tenant("acme");

    let mut add = home.cmd();
    add.args([
        "--server",
        &home.url(),
        "registries",
        "add",
        "Registry.Example.com:5000",
    ])
    .args(["--username", "ci-bot", "--secret-stdin"])
    .env("FLOTILLA_API_KEY", &admin)
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = add.spawn().unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{SECRET}\n").as_bytes())
        .unwrap();
    let out = text(&child.wait_with_output().unwrap());
    assert!(
        out.contains("stored for registry.example.com:5000 as ci-bot"),
        "{out}"
    );
    assert!(!out.contains(SECRET));

    // Without a secret on stdin or in the environment: refused.
    let none = home.cli(Some(&admin), &["registries", "add", "ghcr.io", "-u", "x"]);
    assert!(!none.status.success());
    assert!(String::from_utf8_lossy(&none.stderr).contains("--secret-stdin"));

    let table = text(&home.cli(Some(&admin), &["registries"]));
    assert!(
        table.contains("registry.example.com:5000") && table.contains("ci-bot"),
        "{table}"
    );
    let listed = home.cli_json(Some(&admin), &["registries", "list"]);
    assert!(!listed.to_string().contains(SECRET), "{listed}");
    let id = listed[0]["id"].as_str().unwrap().to_string();

    // At rest: no file of the server holds the secret; the key is private.
    let key_file = home.data().join("secrets.key");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&key_file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    for f in files(&home.data()) {
        let bytes = std::fs::read(&f).unwrap_or_default();
        assert!(
            !bytes.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()),
            "{} holds the secret in plain text",
            f.display()
        );
    }

    let out = text(&home.cli(Some(&admin), &["registries", "remove", &id]));
    assert!(out.contains("removed"), "{out}");
    assert_eq!(home.cli_json(Some(&admin), &["registries"]), json!([]));
    let again = home.cli(Some(&admin), &["registries", "remove", &id]);
    assert!(!again.status.success());
}

#[test]
fn nodes_show_lists_the_image_cache_its_agent_reported() {
    let home = Home::new(BIN);
    let _server = home.server();
    let op = home.operator_key();
    let _agent = home.agent("cache-node", "1xH100");
    let mut node = String::new();
    wait_until("the node registers", Duration::from_secs(60), || {
        let nodes = home.cli_json(Some(&op), &["nodes"]);
        match nodes.as_array().and_then(|n| n.first()) {
            Some(n) => {
                node = n["id"].as_str().unwrap().to_string();
                true
            }
            None => false,
        }
    });
    let shown = text(&home.cli(Some(&op), &["nodes", "show", &node]));
    assert!(
        shown.contains("cache-node") && shown.contains("none reported"),
        "{shown}"
    );

    // What a container agent sends with its sync.
    let token = std::fs::read_to_string(home.data().join("agent.token")).unwrap();
    let report = json!({"observed": [], "images": [
        {"image": "registry.example.com/team/llm:7", "id": "sha256:0123456789abcdef0123",
         "size_bytes": 12_345_678_901_u64, "last_used": "2026-01-02T03:04:05Z"}
    ]});
    let (status, body) = http(
        "POST",
        &format!("{}/v1/agent/nodes/{node}/sync", home.url()),
        Some(token.trim()),
        Some(&report.to_string()),
    )
    .unwrap();
    assert_eq!(status, 200, "{body}");
    let shown = text(&home.cli(Some(&op), &["nodes", "show", &node]));
    assert!(shown.contains("1 cached, 12.3 GB"), "{shown}");
    assert!(shown.contains("registry.example.com/team/llm:7"), "{shown}");
    assert!(shown.contains("0123456789ab"), "{shown}");
    let raw = home.cli_json(Some(&op), &["nodes", "show", &node]);
    assert_eq!(raw["images"][0]["size_bytes"], 12_345_678_901_u64);
}
