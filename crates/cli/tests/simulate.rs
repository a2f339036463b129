//! `flotilla simulate` as a user runs it: the real binary on a small
//! generated trace, writing its report folder.

use flotilla_testkit::process::Home;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

/// A generic-CSV trace: a quiet start, a burst, a quiet end.
fn trace_csv() -> String {
    let mut s = String::from("arrival_ms,input_tokens,output_tokens\n");
    let mut t = 0u64;
    for i in 0..3_000u64 {
        // 2 s apart for 200 requests, then 20 ms apart, then 2 s again.
        t += if (200..2_800).contains(&i) { 20 } else { 2_000 };
        s.push_str(&format!(
            "{t},{},{}\n",
            500 + (i * 37) % 1500,
            50 + (i * 13) % 300
        ));
    }
    s
}

#[test]
fn writes_a_deterministic_report_folder() {
    let home = Home::new(BIN);
    let trace = home.dir.path().join("trace.csv");
    std::fs::write(&trace, trace_csv()).unwrap();
    let run = |out: &str| {
        let out = home.dir.path().join(out);
        let o = home
            .cmd()
            .args(["simulate", "--trace"])
            .arg(&trace)
            .args([
                "--policy",
                "flotilla,hpa,kpa",
                "--slo-ms",
                "2000",
                "--gpu",
                "H100",
            ])
            .args([
                "--seed",
                "7",
                "--peak-replicas",
                "4",
                "--cold-start-median-s",
                "20",
            ])
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let stdout = String::from_utf8(o.stdout).unwrap();
        assert!(stdout.contains("| trace | flotilla |"), "{stdout}");
        out
    };
    let (a, b) = (run("a"), run("b"));
    for f in [
        "report.md",
        "results.json",
        "flotilla.svg",
        "hpa.svg",
        "kpa.svg",
    ] {
        let x = std::fs::read(a.join(f)).unwrap();
        assert!(!x.is_empty(), "{f} empty");
        assert_eq!(
            x,
            std::fs::read(b.join(f)).unwrap(),
            "{f} differs between runs"
        );
    }
    let report = std::fs::read_to_string(a.join("report.md")).unwrap();
    assert!(report.contains("SLO attainment %") && report.contains("![kpa](kpa.svg)"));
    let rows: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.join("results.json")).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 3);
    for r in rows {
        for key in [
            "trace",
            "policy",
            "slo_ms",
            "slo_attainment_pct",
            "gpu_seconds",
            "oracle_gpu_seconds",
            "cost_ratio_to_oracle",
            "p99_ms",
            "cold_starts",
        ] {
            assert!(r.get(key).is_some(), "{key} missing in {r}");
        }
        assert!(r["cost_ratio_to_oracle"].as_f64().unwrap() >= 1.0, "{r}");
    }
}

#[test]
fn scenarios_run_and_bad_input_is_named() {
    let home = Home::new(BIN);
    let out = home.dir.path().join("spike");
    let o = home
        .cmd()
        .args([
            "simulate",
            "--scenario",
            "viral-spike",
            "--policy",
            "ray",
            "--peak-replicas",
            "3",
        ])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.join("ray.svg").exists());

    // On a simulated node pool the report adds node GPU time and preemptions.
    let pooled = home.dir.path().join("pooled");
    let o = home
        .cmd()
        .args(["simulate", "--scenario", "black-friday", "--policy", "hpa"])
        .args(["--peak-replicas", "3", "--node-pool"])
        .arg("--out")
        .arg(&pooled)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report = std::fs::read_to_string(pooled.join("report.md")).unwrap();
    assert!(
        report.contains("spot preemptions") && report.contains("| hpa |"),
        "{report}"
    );

    let fail = |args: &[&str]| {
        let o = home.cmd().arg("simulate").args(args).output().unwrap();
        assert!(!o.status.success());
        String::from_utf8(o.stderr).unwrap()
    };
    let e = fail(&["--scenario", "viral-spike", "--policy", "vpa"]);
    assert!(e.contains("policy") && e.contains("vpa"), "{e}");
    let e = fail(&["--scenario", "cyber-monday"]);
    assert!(e.contains("scenario"), "{e}");
    let e = fail(&["--scenario", "viral-spike", "--gpu", "T4"]);
    assert!(e.contains("gpu"), "{e}");
    let bad = home.dir.path().join("bad.csv");
    std::fs::write(
        &bad,
        "arrival_ms,input_tokens,output_tokens\n0,1,1\nx,1,1\n",
    )
    .unwrap();
    let e = fail(&["--trace", bad.to_str().unwrap()]);
    assert!(e.contains("line 3") && e.contains("arrival_ms"), "{e}");
}

#[test]
fn tiered_simulation_reports_starts_by_tier_and_cost_in_money() {
    let home = Home::new(BIN);
    let trace = home.dir.path().join("trace.csv");
    std::fs::write(&trace, trace_csv()).unwrap();
    let out = home.dir.path().join("tiered");
    let o = home
        .cmd()
        .args(["simulate", "--trace"])
        .arg(&trace)
        .args(["--policy", "flotilla,kpa", "--peak-replicas", "4"])
        .args(["--tiered", "--tier-nodes", "1", "--cache-gb-per-node", "64"])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        report.contains("Readiness tiers: 16 GB")
            && report.contains("| flotilla-tiered |")
            && report.contains("ratio in money"),
        "{report}"
    );
    let rows: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    let tiered = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["policy"] == "flotilla-tiered")
        .cloned()
        .unwrap();
    let t = &tiered["tiers"];
    let starts: u64 = [
        "cold_starts_parked",
        "cold_starts_cached",
        "cold_starts_remote",
    ]
    .iter()
    .map(|k| t[k].as_u64().unwrap())
    .sum();
    assert_eq!(starts, tiered["cold_starts"].as_u64().unwrap(), "{t}");
    assert!(t["cold_starts_parked"].as_u64().unwrap() > 0, "{t}");
    assert!(t["money_ratio_to_oracle"].as_f64().unwrap() > 0.0, "{t}");

    // Tiers on a node pool are not modelled: refused by name.
    let o = home
        .cmd()
        .args([
            "simulate",
            "--scenario",
            "on-off",
            "--tiered",
            "--node-pool",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--node-pool"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `flotilla simulate --from-history` against a real server and two
/// agents: instances and a two-node job run and end, then the window is
/// replayed. With the recorded settings the replay holds the recorded
/// GPU-hours (within 2 %); the changed replay is reported beside it; bad
/// windows and non-operator keys get clear errors.
#[test]
fn replays_this_clusters_recorded_demand() {
    use std::time::Duration;

    use flotilla_testkit::process::wait_until;

    let home = Home::new(BIN);
    let _server = home.server();
    let _agents = [
        home.agent("node-a", "2xH100"),
        home.agent("node-b", "2xH100"),
    ];
    let op = home.operator_key();
    let (_, key) = home.tenant("lab");
    wait_until("both nodes' GPUs", Duration::from_secs(30), || {
        home.get(&key, "/v1/gpu-types")["items"]
            .as_array()
            .is_some_and(|a| a.iter().any(|g| g["name"] == "H100" && g["free"] == 4))
    });
    let from = chrono::Utc::now() - chrono::Duration::seconds(5);
    let mut ids = Vec::new();
    for gpus in ["1", "2", "1"] {
        ids.push(home.run_detached(&key, &["--gpus", gpus, "--", "sleep", "2"]));
    }
    let job = home.cli(
        Some(&key),
        &[
            "jobs", "submit", "--gpus", "2", "--nodes", "2", "--wait", "--", "sleep", "1",
        ],
    );
    assert!(
        job.status.success(),
        "{}",
        String::from_utf8_lossy(&job.stderr)
    );
    wait_until("every instance ended", Duration::from_secs(90), || {
        ids.iter()
            .all(|id| home.get(&key, &format!("/v1/instances/{id}"))["state"] == "succeeded")
    });
    let to = chrono::Utc::now() + chrono::Duration::seconds(5);
    let window = format!(
        "{}..{}",
        from.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        to.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    );
    let out_dir = home.dir.path().join("replay");
    let r = home.cli_json(
        Some(&op),
        &[
            "simulate",
            "--from-history",
            &window,
            "--placement-policy",
            "BestFit",
            "--node-scale",
            "0.5",
            "--out",
            out_dir.to_str().unwrap(),
        ],
    );
    let recorded = &r["recorded"];
    assert_eq!(recorded["works"], 4, "three instances and the job: {r}");
    let rec_h = recorded["gpu_hours"].as_f64().unwrap();
    assert!(rec_h > 0.0, "{r}");
    let same = &r["replay_recorded_settings"]["outcome"];
    let same_h = same["gpu_hours"].as_f64().unwrap();
    assert!(
        (same_h - rec_h).abs() <= rec_h * 0.02,
        "replayed {same_h} GPU-hours against {rec_h} recorded: {r}"
    );
    assert_eq!(same["ran"], 4, "{r}");
    let changed = &r["replay_changed"];
    assert_eq!(changed["policy"], "BestFit", "{r}");
    assert_eq!(changed["nodes"], 1, "half of two machines: {r}");
    assert_eq!(
        changed["outcome"]["ran"], 3,
        "the 2-node job fits no single machine: {r}"
    );
    let report = std::fs::read_to_string(out_dir.join("report.md")).unwrap();
    assert!(report.contains("| GPU-hours |"), "{report}");
    assert!(report.contains("never run"), "{report}");

    // Clear errors: a window backwards, a malformed one, a tenant's key.
    for (bad, says) in [
        ("2026-12-02..2026-12-01", "TO must be after FROM"),
        ("yesterday", "FROM..TO"),
    ] {
        let o = home.cli(Some(&op), &["simulate", "--from-history", bad]);
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(says), "{bad}: {err}");
    }
    let o = home.cli(Some(&key), &["simulate", "--from-history", &window]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("may not read the cluster's demand history"),
        "{err}"
    );
}
