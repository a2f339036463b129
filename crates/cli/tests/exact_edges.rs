//! Issue 26, "exact edges": usage is metered to the millisecond from the
//! engine's own start and end, so a real 1.2 s process on `flotilla up` is
//! billed what the agent observed it run, not a started second more at
//! each end.

use std::time::Duration;

use chrono::{DateTime, Utc};
use flotilla_billing::meter::{effective_events, to_millisecond, Meter, UsageEvent};
use flotilla_testkit::process::{wait_until, Home};
use rust_decimal::Decimal;

mod support;

use support::times::{event_at, time};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

/// GPU-seconds the ledger bills `subject`, corrections applied.
fn billed(home: &Home, key: &str, subject: &str) -> Decimal {
    let enc = |t: DateTime<Utc>| t.to_rfc3339().replace(':', "%3A").replace('+', "%2B");
    let now = Utc::now();
    let path = format!(
        "/v1/usage?limit=1000&from={}&to={}",
        enc(now - chrono::Duration::hours(1)),
        enc(now + chrono::Duration::hours(1))
    );
    let events: Vec<UsageEvent> = home.get(key, &path)["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| serde_json::from_value(i.clone()).unwrap())
        .filter(|e: &UsageEvent| e.subject.id == subject)
        .collect();
    effective_events(&events)
        .unwrap()
        .iter()
        .filter(|e| matches!(e.meter, Meter::GpuSeconds { .. }))
        .map(|e| e.quantity_within(e.start, e.end).unwrap())
        .sum()
}

#[test]
fn a_1_2_s_process_is_billed_what_it_ran_to_the_millisecond() {
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    let home = Home::new(BIN);
    let _up = home.up("1xH100", &[], "up");
    let key = home.operator_key();
    home.wait_free_gpus(&key, "H100", 1);
    let id = home.run_detached(
        &key,
        &[
            "--gpus",
            "1",
            "--cpu",
            "100",
            "--memory",
            "64",
            "--",
            "sh",
            "-c",
            "sleep 1.2",
        ],
    );
    wait_until("it finishes", Duration::from_secs(60), || {
        home.get(&key, &format!("/v1/instances/{id}"))["state"] == "succeeded"
    });
    let inst = home.get(&key, &format!("/v1/instances/{id}"));
    // What the agent observed: its running and final events.
    let (ran, ended) = (event_at(&inst, "running"), event_at(&inst, "succeeded"));
    let observed = Decimal::new(
        (to_millisecond(ended) - to_millisecond(ran)).num_milliseconds(),
        3,
    );
    assert!(
        observed >= Decimal::new(1200, 3),
        "the process slept 1.2 s: {inst}"
    );
    // The rule: the start and the stop the instance records, each to the
    // millisecond, nothing rounded up.
    let (s, f) = (time(&inst["started_at"]), time(&inst["finished_at"]));
    let want = Decimal::new(
        (to_millisecond(f) - to_millisecond(s)).num_milliseconds(),
        3,
    );
    let mut got = Decimal::ZERO;
    wait_until("the ledger bills the run", Duration::from_secs(60), || {
        got = billed(&home, &key, &id);
        got >= want
    });
    eprintln!("observed {observed} s, recorded {want} s, billed {got} GPU-s");
    assert_eq!(got, want, "billed exactly the recorded run");
    assert!(
        (got - observed).abs() <= Decimal::new(10, 3),
        "billed {got} s, observed {observed} s: {inst}"
    );
}

/// Issue 26, "reconcile over activity recorded on `up`": real processes
/// on `flotilla up` with sub-second edges, ending every way work ends
/// (succeeded, failed, stopped by its tenant while running), some of them
/// at once on two GPUs; once metered, `flotilla billing reconcile` at a
/// threshold of 0 s over their window finds every one and no difference:
/// the ledger bills what the agent observed, to the millisecond. (The
/// same over a whole simulated day: `server/tests/history.rs`.)
#[test]
fn real_work_on_up_reconciles_at_a_zero_threshold() {
    flotilla_agent::runtime::sandbox::test_support::ensure_bwrap();
    let home = Home::new(BIN);
    let _up = home.up("2xH100", &[], "up");
    let key = home.operator_key();
    home.wait_free_gpus(&key, "H100", 2);
    let since = Utc::now() - chrono::Duration::seconds(5);
    let run = |script: &str| {
        home.run_detached(
            &key,
            &[
                "--gpus", "1", "--cpu", "100", "--memory", "64", "--", "sh", "-c", script,
            ],
        )
    };
    // Ends by itself: three short runs, one failure.
    let mut ids: Vec<(String, &str)> = vec![
        (run("sleep 0.3"), "succeeded"),
        (run("sleep 0.7"), "succeeded"),
        (run("sleep 1.2"), "succeeded"),
        (run("sleep 0.4; exit 3"), "failed"),
    ];
    // Stopped by its tenant once it runs.
    let long = run("sleep 120");
    wait_until("the long one runs", Duration::from_secs(120), || {
        home.get(&key, &format!("/v1/instances/{long}"))["state"] == "running"
    });
    let stop = home.cli(Some(&key), &["stop", &long]);
    assert!(stop.status.success(), "{stop:?}");
    ids.push((long, "stopped"));
    for (id, want) in &ids {
        wait_until(
            &format!("{id} ends {want}"),
            Duration::from_secs(120),
            || home.get(&key, &format!("/v1/instances/{id}"))["state"] == *want,
        );
    }
    // Metering runs every few seconds: wait until the ledger bills every
    // one, then the report must hold no difference at all.
    let until = Utc::now() + chrono::Duration::seconds(1);
    let window = |t: DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let report = || -> flotilla_billing::api::ReconcileReport {
        let out = home.cli(
            Some(&key),
            &[
                "--json",
                "billing",
                "reconcile",
                "--since",
                &window(since),
                "--until",
                &window(until),
                "--threshold-s",
                "0",
            ],
        );
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("a report ({e}): {out:?}"))
    };
    let mut last = None;
    wait_until("every run billed", Duration::from_secs(120), || {
        let r = report();
        let done = r.differences.is_empty() && r.instances >= ids.len() as u64;
        last = Some(r);
        done
    });
    let r = last.unwrap();
    eprintln!(
        "reconciled {} instances: billed {} s, observed {} s",
        r.instances, r.billed_seconds, r.observed_seconds
    );
    assert_eq!(r.billed_seconds, r.observed_seconds);
    // Each run observed as the agent reported it: started to finished, to
    // the millisecond, and it is in the ledger.
    let mut total = Decimal::ZERO;
    for (id, _) in &ids {
        let inst = home.get(&key, &format!("/v1/instances/{id}"));
        let (s, f) = (time(&inst["started_at"]), time(&inst["finished_at"]));
        let ran = Decimal::new(
            (to_millisecond(f) - to_millisecond(s)).num_milliseconds(),
            3,
        );
        assert_eq!(billed(&home, &key, id), ran, "{inst}");
        total += ran;
    }
    assert_eq!(r.observed_seconds, total, "{r:?}");
}
