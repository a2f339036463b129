//! A stop that races placement: every instance ends `stopped` and gives
//! its GPUs back, whether the stop reached the agent before, with or
//! after the work itself.
//!
//! The leak this guards against: a stop that arrived in the same sync as
//! the placement (or before the agent ever saw it) was ignored by the
//! agent, as "a stop of an instance this agent never ran", and the
//! instance stayed `scheduled` with `stop_requested`, holding its GPUs
//! through agent restarts and leader changes. The agent now reports such
//! work as ended before it started.
//!
//! The real binary as server and agent (8 simulated H100s); 50 one-GPU
//! instances, each stopped 0 to 50 ms after the server placed it, from 8
//! client threads at once.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flotilla_testkit::process::{http, wait_until, Home, Proc};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
const INSTANCES: usize = 50;
const THREADS: usize = 8;

fn call(home: &Home, method: &str, key: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    http(method, &format!("{}{path}", home.url()), Some(key), body)
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

fn free_h100(home: &Home, key: &str) -> u64 {
    call(home, "GET", key, "/v1/gpu-types", None).1["items"]
        .as_array()
        .and_then(|a| a.iter().find(|t| t["name"] == "H100"))
        .and_then(|t| t["free"].as_u64())
        .unwrap_or(0)
}

/// `flotilla server` with a per-key rate limit high enough for the test's
/// tight polling (the default 100/s would answer 429).
fn server(home: &Home) -> Proc {
    let child = home
        .cmd()
        .args(["server", "--bind", &format!("127.0.0.1:{}", home.port)])
        .arg("--data-dir")
        .arg(home.data())
        .args(["--rate-limit", "20000"])
        .stdout(home.log("server"))
        .stderr(home.log("server"))
        .spawn()
        .expect("start flotilla server");
    let server = Proc(child);
    wait_until("the server answers", Duration::from_secs(60), || {
        http("GET", &format!("{}/healthz", home.url()), None, None).is_ok_and(|(s, _)| s == 200)
    });
    server
}

#[test]
fn work_stopped_as_it_is_placed_ends_stopped_and_frees_its_gpus() {
    let home = Home::new(BIN);
    let _server = server(&home);
    let _ = home.operator_key();
    let _agent = home.agent("stops", "8xH100");
    let (_tenant, key) = home.tenant("stopper");
    wait_until("8 free H100s", Duration::from_secs(60), || {
        free_h100(&home, &key) == 8
    });

    // (id, the state it was seen in when the stop was sent)
    let stopped: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (home_url, key, stopped) = (home.url(), key.clone(), stopped.clone());
            std::thread::spawn(move || {
                let url = |p: &str| format!("{home_url}{p}");
                let body = json!({"gpus": 1, "command": ["sleep", "300"]}).to_string();
                for i in (t..INSTANCES).step_by(THREADS) {
                    let (status, created) =
                        http("POST", &url("/v1/instances"), Some(&key), Some(&body)).unwrap();
                    assert!(matches!(status, 200 | 201), "create: {status} {created}");
                    let id = created["id"].as_str().unwrap().to_string();
                    // Placed: any state past `pending`. Polled tightly so
                    // the stop lands within the window the test means.
                    let deadline = Instant::now() + Duration::from_secs(120);
                    let seen = loop {
                        let (_, inst) = http(
                            "GET",
                            &url(&format!("/v1/instances/{id}")),
                            Some(&key),
                            None,
                        )
                        .unwrap();
                        let state = inst["state"].as_str().unwrap_or_default().to_string();
                        if state != "pending" {
                            break state;
                        }
                        assert!(Instant::now() < deadline, "{id} never placed");
                        std::thread::sleep(Duration::from_millis(2));
                    };
                    // 0 to 50 ms after placement, spread over the range.
                    std::thread::sleep(Duration::from_millis((i as u64 * 7) % 51));
                    let (status, answer) = http(
                        "POST",
                        &url(&format!("/v1/instances/{id}/stop")),
                        Some(&key),
                        None,
                    )
                    .unwrap();
                    // A stop that found the work already ended is a 409.
                    assert!(matches!(status, 200 | 409), "stop {id}: {status} {answer}");
                    stopped.lock().unwrap().push((id, seen));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a client thread panicked");
    }
    let stopped = stopped.lock().unwrap().clone();
    assert_eq!(stopped.len(), INSTANCES);
    let at_scheduled = stopped.iter().filter(|(_, s)| s == "scheduled").count();
    eprintln!(
        "{at_scheduled} of {INSTANCES} stops were sent while the instance was still `scheduled`"
    );

    let state_of = |id: &str| {
        call(&home, "GET", &key, &format!("/v1/instances/{id}"), None).1["state"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    wait_until(
        "every raced instance to reach a final state",
        Duration::from_secs(120),
        || {
            stopped
                .iter()
                .all(|(id, _)| matches!(state_of(id).as_str(), "stopped" | "succeeded" | "failed"))
        },
    );
    for (id, seen) in &stopped {
        let inst = call(&home, "GET", &key, &format!("/v1/instances/{id}"), None).1;
        assert_eq!(
            inst["state"], "stopped",
            "{id} (stopped while {seen}) ended otherwise: {inst}"
        );
    }
    wait_until("all 8 H100s free again", Duration::from_secs(60), || {
        free_h100(&home, &key) == 8
    });
}
