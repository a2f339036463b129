//! `flotilla audit` as a user runs it: the real binary as server and CLI.
//! A tenant admin's calls show up in its own log, refusals included, and
//! not in another tenant's; the operator reads every tenant's or one's.

use flotilla_testkit::process::Home;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

fn text(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn audit_shows_who_changed_what_to_operators_and_to_the_tenant() {
    let home = Home::new(BIN);
    let _server = home.server();
    let op = home.operator_key();
    let (acme, admin) = home.tenant("acme");
    let (_, other) = home.tenant("other");

    let key = home.cli_json(
        Some(&admin),
        &["keys", "create", "--role", "tenant_member", "--name", "ci"],
    );
    let key_id = key["key"]["id"].as_str().unwrap().to_string();
    // A refused call is recorded too: a tenant admin may not mint an
    // operator key.
    let refused = home.cli(Some(&admin), &["keys", "create", "--role", "operator"]);
    assert!(!refused.status.success());

    let mine = home.cli_json(Some(&admin), &["audit"]);
    let mine = mine.as_array().unwrap();
    assert_eq!(mine.len(), 2, "{mine:#?}");
    assert_eq!(mine[0]["status"], 403);
    assert_eq!(mine[1]["route"], "/v1/keys");
    assert_eq!(mine[1]["object_id"], key_id.as_str());
    assert_eq!(mine[1]["status"], 201);
    assert!(mine.iter().all(|e| e["tenant_id"] == acme.as_str()));

    let table = text(&home.cli(Some(&admin), &["audit"]));
    assert!(table.contains("POST /v1/keys"), "{table}");
    assert!(table.contains(&key_id), "{table}");

    // Another tenant sees none of it.
    let theirs = home.cli_json(Some(&other), &["audit"]);
    assert_eq!(theirs.as_array().unwrap().len(), 0, "{theirs:#?}");

    // The operator: everything (its tenant and key creations too), or one
    // tenant's by name.
    let all = home.cli_json(Some(&op), &["audit", "--limit", "1000"]);
    assert!(all.as_array().unwrap().len() >= 6, "{all:#?}");
    let one = home.cli_json(Some(&op), &["audit", "--tenant", "acme"]);
    assert_eq!(one.as_array().unwrap().len(), 2, "{one:#?}");
    let newest = home.cli_json(Some(&op), &["audit", "--limit", "1"]);
    assert_eq!(newest.as_array().unwrap().len(), 1);
}
