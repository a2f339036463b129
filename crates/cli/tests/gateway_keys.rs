//! The gateway against key guessing and prying, as deployed: the real
//! `flotilla` binary as server and as `flotilla gateway`, real HTTP.
//!
//! - 300 distinct unknown keys from one address get 429 with
//!   `Retry-After` once the address's burst is spent (10/s, bursts of
//!   20), while a valid key from the same address keeps getting through,
//!   and another address keeps its own budget.
//! - `/metrics` (which names every endpoint) is refused without a key and
//!   with a tenant's key, and served with the operator's key.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use flotilla_testkit::process::{free_port, Home};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
const GUESSES: usize = 300;

/// A client whose connections leave from `from` (any 127/8 address is
/// this machine's loopback).
fn client_from(from: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .local_address(from.parse::<IpAddr>().expect("address"))
        .timeout(Duration::from_secs(60))
        .no_proxy()
        .build()
        .expect("client")
}

async fn get(c: &reqwest::Client, url: &str, key: Option<&str>) -> (u16, Option<String>, String) {
    let mut r = c.get(url);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let resp = r.send().await.expect("the gateway answers");
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    (status, retry_after, resp.text().await.unwrap_or_default())
}

/// A server, a gateway on its own port, a tenant key and the operator's.
fn stack() -> (
    Home,
    [flotilla_testkit::process::Proc; 2],
    String,
    String,
    String,
) {
    let home = Home::new(BIN);
    let server = home.server();
    let (_, key) = home.tenant("acme");
    let op = home.operator_key();
    let port = free_port();
    let gw = home.gateway(port);
    let url = format!("http://127.0.0.1:{port}");
    (home, [server, gw], url, key, op)
}

#[test]
fn unknown_keys_from_one_address_get_429_after_the_burst_and_valid_keys_still_pass() {
    let (_home, _procs, gw, key, _) = stack();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let here = client_from("127.0.0.1");
        let models = format!("{gw}/v1/models");
        // The valid key works (and the gateway has now seen it valid).
        let (st, _, body) = get(&here, &models, Some(&key)).await;
        assert_eq!(st, 200, "{body}");

        let started = Instant::now();
        let (mut unauthorized, mut limited) = (0u32, 0u32);
        let mut valid_during = Vec::new();
        for i in 0..GUESSES {
            let guess = format!("flt_guess{i:04}xxxxxxxxxxxxxxxxxxxxxxxxxxxx");
            let (st, retry_after, body) = get(&here, &models, Some(&guess)).await;
            match st {
                401 => unauthorized += 1,
                429 => {
                    limited += 1;
                    let s: u64 = retry_after
                        .as_deref()
                        .and_then(|s| s.parse().ok())
                        .unwrap_or_else(|| panic!("429 without Retry-After: {body}"));
                    assert!((1..=60).contains(&s), "Retry-After {s}");
                    assert!(body.contains("rate_limit_exceeded"), "{body}");
                }
                other => panic!("guess {i}: {other} {body}"),
            }
            if i % 50 == 25 {
                // The valid key, from the same address, mid-flood.
                valid_during.push(get(&here, &models, Some(&key)).await.0);
            }
        }
        let elapsed = started.elapsed().as_secs_f64();
        eprintln!(
            "{GUESSES} guesses in {elapsed:.2}s: {unauthorized} answered 401, {limited} answered 429; \
             the valid key meanwhile: {valid_during:?}"
        );
        // The burst (20) and what the rate (10/s) refills while guessing;
        // the rest is refused without asking the control plane.
        let allowed = 20.0 + 10.0 * elapsed + 1.0;
        assert!(
            f64::from(unauthorized) <= allowed,
            "{unauthorized} guesses were answered (at most {allowed:.0} in {elapsed:.2}s)"
        );
        assert!(unauthorized >= 20, "the burst was not honoured: {unauthorized}");
        assert!(limited > 0, "no 429 at all");
        assert_eq!(valid_during, vec![200; valid_during.len()], "the valid key was held back");

        // Another address has a budget of its own: an unknown key from
        // there is still answered 401.
        let there = client_from("127.0.0.2");
        let (st, _, body) = get(&there, &models, Some("flt_another_address_guess")).await;
        assert_eq!(st, 401, "{body}");
        // Requests without any key count too: a quick run of them from
        // one address meets 429.
        let mut statuses = Vec::new();
        for _ in 0..60 {
            let (st, _, _) = get(&there, &models, None).await;
            statuses.push(st);
            if st == 429 {
                break;
            }
        }
        assert_eq!(statuses.last(), Some(&429), "{statuses:?}");
        assert!(statuses.iter().all(|s| *s == 401 || *s == 429), "{statuses:?}");
    });
}

#[test]
fn the_gateways_metrics_want_the_operators_key() {
    let (_home, _procs, gw, key, op) = stack();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let c = client_from("127.0.0.1");
        let metrics = format!("{gw}/metrics");
        // The gateway is up and serving (a precondition: refusals below
        // are not an outage).
        let (st, _, _) = get(&c, &format!("{gw}/health"), None).await;
        assert_eq!(st, 200);
        for (who, k) in [("no key", None), ("a tenant's key", Some(key.as_str()))] {
            let (st, _, body) = get(&c, &metrics, k).await;
            assert_eq!(st, 401, "{who}: {body}");
            assert!(!body.contains("gateway_responses"), "{who}: {body}");
            assert!(body.contains("operator"), "{who}: {body}");
        }
        // Asked of the control plane (a fresh gateway may still be
        // starting its client): wait for the exact answer, generously.
        let deadline = Instant::now() + Duration::from_secs(60);
        let served = loop {
            let (st, _, body) = get(&c, &metrics, Some(&op)).await;
            if st == 200 {
                break body;
            }
            assert!(Instant::now() < deadline, "the operator's key: {st} {body}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert!(
            served.contains("gateway_responses") || served.contains("gateway_usage_dropped"),
            "{served}"
        );
    });
}
