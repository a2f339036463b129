//! Loading from a readiness tier: the emulator binary, told a model size
//! and a tier as the node's agent tells it (`FLOTILLA_MODEL_GB`,
//! `FLOTILLA_LOAD_TIER`), is not ready before that tier's restore time and
//! names the tier on `/health`; a slower tier takes longer.

use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

/// Starts the binary loading 2 GB from `tier` (parked: 0.3 s + 2 GB at
/// 10 GB/s = 0.5 s; remote: 1 s + 2 GB at 1 GB/s = 3 s); returns how long
/// it took to become ready and the tier and load time `/health` named.
async fn ready_after(tier: &str) -> (Duration, String, u64) {
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_flotilla-emulator"))
        .args(["--port", "0", "--parked-gb-per-s", "10"])
        .args(["--parked-overhead-ms", "300", "--remote-gb-per-s", "1"])
        .args(["--remote-overhead-ms", "1000"])
        .env("FLOTILLA_MODEL_GB", "2")
        .env("FLOTILLA_LOAD_TIER", tier)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("emulator starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .await
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap()
        .to_string();
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = http
            .get(format!("http://{addr}/health"))
            .send()
            .await
            .unwrap();
        let header = |name: &str| {
            r.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string()
        };
        let (named, ms) = (header("x-flotilla-load-tier"), header("x-flotilla-load-ms"));
        if r.status().is_success() {
            return (started.elapsed(), named, ms.parse().unwrap());
        }
        assert_eq!(r.status(), 503);
        assert_eq!(named, tier, "named while loading too");
        assert!(Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_parked_load_takes_its_restore_time_and_a_remote_one_the_download() {
    let (parked, tier, ms) = ready_after("parked").await;
    assert_eq!((tier.as_str(), ms), ("parked", 500));
    assert!(parked >= Duration::from_millis(500), "{parked:?}");
    let (remote, tier, ms) = ready_after("remote").await;
    assert_eq!((tier.as_str(), ms), ("remote", 3000));
    assert!(remote >= Duration::from_millis(3000), "{remote:?}");
}

#[tokio::test]
async fn an_unknown_tier_is_refused_naming_the_flag() {
    let out = Command::new(env!("CARGO_BIN_EXE_flotilla-emulator"))
        .args(["--port", "0", "--model-gb", "1", "--tier", "lukewarm"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tier"), "{err}");
}
