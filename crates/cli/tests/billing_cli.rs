//! The billing commands as a user runs them: the real `flotilla` binary as
//! server and CLI. Prices (list and publish), estimates, budgets,
//! invoices (finalise, list, CSV), usage as CSV and payouts.

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
fn billing_commands_round_trip_through_the_api() {
    let home = Home::new(BIN);
    let _server = home.server();
    let op = home.operator_key();
    let t = home.cli_json(Some(&op), &["tenants", "create", "acme"]);
    let tenant = t["id"].as_str().unwrap().to_string();
    let admin = home.cli_json(
        Some(&op),
        &[
            "keys",
            "create",
            "--role",
            "tenant_admin",
            "--tenant",
            &tenant,
        ],
    )["secret"]
        .as_str()
        .unwrap()
        .to_string();

    // Prices: the default catalog, then a new version published from a file.
    let prices = text(&home.cli(Some(&admin), &["prices"]));
    assert!(prices.contains("in force"), "{prices}");
    assert!(prices.contains("H100"), "{prices}");
    let catalog = home.cli_json(Some(&admin), &["prices"]);
    let mut next = catalog["versions"][0].clone();
    next.as_object_mut().unwrap().remove("version");
    next["effective_from"] = serde_json::json!("2100-01-01T00:00:00Z");
    let file = home.data().join("book.json");
    std::fs::create_dir_all(home.data()).unwrap();
    std::fs::write(&file, next.to_string()).unwrap();
    let file = file.to_str().unwrap();
    let refused = home.cli(Some(&admin), &["prices", "set", "--file", file]);
    assert!(!refused.status.success(), "tenant admins cannot publish");
    let out = text(&home.cli(Some(&op), &["prices", "set", "--file", file]));
    assert!(out.contains("published price version 2"), "{out}");
    let prices = text(&home.cli(Some(&admin), &["prices"]));
    assert!(prices.contains("scheduled"), "{prices}");

    // Estimates: a table and the cheapest option that meets the workload.
    let est = text(&home.cli(
        Some(&admin),
        &[
            "estimate",
            "--gpu",
            "H100",
            "--count",
            "8",
            "--hours-per-day",
            "10",
            "--duty-cycle",
            "0.6",
            "--tier",
            "2",
        ],
    ));
    assert!(est.contains("cheapest that meets it: H100"), "{est}");
    let est = home.cli_json(
        Some(&admin),
        &[
            "estimate",
            "--rps",
            "2",
            "--input-tokens",
            "500",
            "--output-tokens",
            "100",
        ],
    );
    assert!(est["cheapest"].is_object(), "{est}");
    let bad = home.cli(
        Some(&admin),
        &["estimate", "--count", "1", "--duty-cycle", "2"],
    );
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("duty_cycle"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );

    // Budget: none yet is a state, not an error; then set, and shown
    // with this month's spend.
    let none = text(&home.cli(Some(&admin), &["budget"]));
    assert!(none.contains("no budget set"), "{none}");
    let out = text(&home.cli(
        Some(&admin),
        &["budget", "set", "--limit", "250", "--hard-cap"],
    ));
    assert!(out.contains("250 USD a month, hard cap"), "{out}");
    let b = home.cli_json(Some(&admin), &["budget"]);
    assert_eq!(b["limit"], "250");

    // Terms: operators add them, the tenant reads them.
    let out = text(&home.cli(
        Some(&op),
        &[
            "terms",
            "--tenant",
            &tenant,
            "commitment",
            "--id",
            "res-1",
            "--model",
            "H100",
            "--gpus",
            "2",
            "--start",
            "2025-01-01T00:00:00Z",
            "--term-days",
            "30",
            "--discount",
            "0.3",
        ],
    ));
    assert!(out.contains("added commitment `res-1`"), "{out}");
    text(&home.cli(
        Some(&op),
        &[
            "terms", "--tenant", &tenant, "credit", "--id", "promo", "--amount", "25",
        ],
    ));
    let refused = home.cli(
        Some(&admin),
        &[
            "terms",
            "discount",
            "--id",
            "d",
            "--percent",
            "10",
            "--from",
            "2025-01-01T00:00:00Z",
        ],
    );
    assert!(!refused.status.success(), "only operators add terms");
    let terms = text(&home.cli(Some(&admin), &["terms"]));
    assert!(
        terms.contains("res-1") && terms.contains("25 granted, 0 drawn"),
        "{terms}"
    );

    // Invoices: January 2025 holds no usage but the whole unused
    // commitment: 2 GPUs × 30 days = 5,184,000 GPU-s at $2.99/h × 0.7
    // = $3,013.92 (the credit was granted now, too late for January).
    let fin = home.cli_json(Some(&op), &["invoices", "finalise", "--period", "2025-01"]);
    let done = fin["finalised"].as_array().unwrap();
    assert_eq!(done.len(), 1, "{fin}");
    assert_eq!(done[0]["total"], "3013.92", "{fin}");
    let id = done[0]["id"].as_str().unwrap().to_string();
    let list = text(&home.cli(Some(&admin), &["invoices"]));
    assert!(list.starts_with("ID") && list.contains(&id), "{list}");
    let show = text(&home.cli(Some(&admin), &["invoices", "show", &id]));
    // The unit price at the catalog's precision ($2.093/h per second), not
    // its 28-digit exact value.
    assert!(
        show.contains("0.0005813889") && !show.contains("0.00058138888888"),
        "{show}"
    );
    assert!(
        show.contains("reserved, unused (res-1)") && show.contains("total: 3013.92 USD"),
        "{show}"
    );
    let csv = text(&home.cli(Some(&admin), &["invoices", "list", "--csv"]));
    assert!(csv.starts_with("invoice,tenant,period_start"), "{csv}");
    assert_eq!(csv.lines().count(), 2, "a header and one line: {csv}");
    let again = home.cli(
        Some(&op),
        &[
            "invoices", "finalise", "--period", "2025-01", "--tenant", &tenant,
        ],
    );
    assert!(!again.status.success(), "a final invoice cannot be redone");
    let usage = text(&home.cli(
        Some(&admin),
        &[
            "usage",
            "--csv",
            "--from",
            "2025-01-01T00:00:00Z",
            "--to",
            "2025-02-01T00:00:00Z",
        ],
    ));
    assert_eq!(usage.lines().count(), 1, "only the header: {usage}");
    let open = home.cli(Some(&op), &["invoices", "finalise", "--period", "2999-01"]);
    assert!(!open.status.success());

    // Payouts: a provider with no nodes has none yet.
    let provider = home.cli_json(
        Some(&op),
        &["keys", "create", "--role", "provider", "--tenant", &tenant],
    )["secret"]
        .as_str()
        .unwrap()
        .to_string();
    let out = text(&home.cli(Some(&provider), &["payouts", "--period", "2025-01"]));
    assert!(out.contains("no payouts for 2025-01"), "{out}");
}

/// `flotilla billing reconcile`: a clean ledger reconciles (exit 0); usage
/// with no workload behind it is printed with its cause and exits 3, the
/// documented status for differences found; `--json` gives the report.
#[test]
fn billing_reconcile_prints_the_report_and_exits_3_on_differences() {
    let home = Home::new(BIN);
    let _server = home.server();
    let op = home.operator_key();
    let (tenant, admin) = home.tenant("acme");

    let clean = home.cli(Some(&op), &["billing", "reconcile"]);
    assert_eq!(clean.status.code(), Some(0), "{clean:?}");
    let out = String::from_utf8_lossy(&clean.stdout);
    assert!(out.contains("no differences"), "{out}");

    // Four minutes ago, a minute of instance time of an instance that
    // never existed.
    let now = chrono::Utc::now();
    let at = |ago_s: i64| {
        (now - chrono::Duration::seconds(ago_s)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    };
    let body = serde_json::json!({"events": [{
        "key": {"tenant": tenant, "source": "operator:test", "id": "ghost-1"},
        "subject": {"kind": "instance", "id": "inst_ghost"},
        "meter": {"meter": "instance_seconds"},
        "billing_class": "on_demand",
        "start": at(300),
        "end": at(240),
        "amount": "1"
    }]});
    let (status, answer) = flotilla_testkit::process::http(
        "POST",
        &format!("{}/v1/usage/events", home.url()),
        Some(&op),
        Some(&body.to_string()),
    )
    .unwrap();
    assert_eq!(
        (status, &answer["accepted"]),
        (200, &serde_json::json!(1)),
        "{answer}"
    );

    let since = at(3600);
    let found = home.cli(Some(&op), &["billing", "reconcile", "--since", &since]);
    assert_eq!(found.status.code(), Some(3), "{found:?}");
    let out = String::from_utf8_lossy(&found.stdout);
    for want in [
        "inst_ghost",
        "billed_without_run",
        "1 difference(s)",
        "CAUSE",
    ] {
        assert!(out.contains(want), "missing {want}: {out}");
    }
    let json = home.cli(
        Some(&op),
        &[
            "--json",
            "billing",
            "reconcile",
            "--since",
            &since,
            "--threshold-s",
            "1",
        ],
    );
    assert_eq!(json.status.code(), Some(3));
    let report: flotilla_billing::api::ReconcileReport =
        serde_json::from_slice(&json.stdout).expect("a report");
    assert_eq!(report.differences.len(), 1, "{report:?}");
    assert_eq!(
        report.differences[0].cause,
        flotilla_billing::reconcile::Cause::BilledWithoutRun
    );
    assert_eq!(report.differences[0].billed_seconds, 60.into());
    assert_eq!(report.threshold_seconds, 1.into());

    // Operators only; a bad time is an error (1), named.
    let refused = home.cli(Some(&admin), &["billing", "reconcile"]);
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    let bad = home.cli(Some(&op), &["billing", "reconcile", "--since", "yesterday"]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("since"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}
