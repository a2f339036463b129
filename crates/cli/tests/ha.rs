//! Several servers, one leader, as an operator runs them: real `flotilla
//! server` processes on one PostgreSQL database, real agents given every
//! server's URL, a client that tries each server in turn.
//!
//! - `kill -9` of the leader: another replica leads within two heartbeat
//!   intervals, no GPU is ever held by two instances, every acknowledged
//!   create runs, and each instance's usage is counted once.
//! - A leader paused with SIGSTOP past its lease: another takes over, and
//!   the resumed one steps down instead of placing anything.
//! - A leader paused with SIGSTOP inside a fenced write, holding its lease
//!   row locked, for three lease periods: the follower takes over within
//!   two heartbeat intervals of the lease running out, answers health and
//!   creates throughout, and no running work is killed.
//! - A node cut off from the control plane past its lease: its agent stops
//!   the job's member itself, and only then does the job run elsewhere;
//!   each copy is billed for the time it ran.
//!
//! - SQLite is one server: a second one on the same file refuses to start.
//!
//! All but the last need PostgreSQL (`FLOTILLA_TEST_DATABASE_URL`); without
//! it they say so and pass, like the store suite's PostgreSQL half.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use flotilla_testkit::process::{free_port, http, wait_until, Home, Proc};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

/// A home on a fresh PostgreSQL database, or `None` without one.
fn pg_home(prefix: &str, heartbeat_timeout: u64) -> Option<Home> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = rt.block_on(flotilla_testkit::db::postgres_url(prefix))?;
    let mut env = Home::new(BIN);
    env.database_url = Some(url);
    env.heartbeat_timeout = heartbeat_timeout;
    Some(env)
}

fn send_signal(child: &Child, sig: nix::sys::signal::Signal) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, sig).unwrap();
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

/// `GET /v1/health` of one server, if it answers.
fn health(url: &str) -> Option<Value> {
    match http("GET", &format!("{url}/v1/health"), None, None) {
        Ok((200, v)) => Some(v),
        _ => None,
    }
}

/// The servers (by index) that say they lead.
fn leaders(urls: &[String]) -> Vec<usize> {
    (0..urls.len())
        .filter(|&i| health(&urls[i]).is_some_and(|h| h["role"] == "leader"))
        .collect()
}

/// The first answer to `method path` from any server, trying each in turn
/// (the client's failover); `None` when none answered.
fn call_any(
    urls: &[String],
    method: &str,
    key: &str,
    path: &str,
    body: Option<&str>,
) -> Option<(u16, Value)> {
    urls.iter()
        .find_map(|u| http(method, &format!("{u}{path}"), Some(key), body).ok())
}

fn get_any(urls: &[String], key: &str, path: &str) -> Value {
    let (status, body) = call_any(urls, "GET", key, path, None).expect("some server answers");
    assert_eq!(status, 200, "GET {path}: {body}");
    body
}

/// A tenant and an admin key for it, made through the CLI.
fn tenant(env: &Home, name: &str) -> (String, String) {
    let op = env.operator_key();
    let t = env.cli_json(Some(&op), &["tenants", "create", name]);
    let id = t["id"].as_str().unwrap().to_string();
    let k = env.cli_json(
        Some(&op),
        &["keys", "create", "--role", "tenant_admin", "--tenant", &id],
    );
    (id, k["secret"].as_str().unwrap().to_string())
}

fn free_h100(urls: &[String], key: &str) -> u64 {
    get_any(urls, key, "/v1/gpu-types")["items"]
        .as_array()
        .and_then(|a| a.iter().find(|t| t["name"] == "H100"))
        .and_then(|t| t["free"].as_u64())
        .unwrap_or(0)
}

fn ts(v: &Value) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(v.as_str()?)
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

/// Every instance of the caller's tenant, all pages.
fn all_instances(urls: &[String], key: &str) -> Vec<Value> {
    let mut out = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/instances?limit=1000&cursor={c}"),
            None => "/v1/instances?limit=1000".to_string(),
        };
        let page = get_any(urls, key, &path);
        out.extend(page["items"].as_array().cloned().unwrap_or_default());
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => return out,
        }
    }
}

/// GPU-seconds billed per instance: the `gpu_seconds` events of the
/// caller's tenant over the last hour, each once, less those a correction
/// voids (the correction restates them).
fn billed_gpu_ms(urls: &[String], key: &str) -> BTreeMap<String, i64> {
    let now = Utc::now();
    let from = (now - chrono::Duration::hours(1)).to_rfc3339();
    let to = (now + chrono::Duration::hours(1)).to_rfc3339();
    let mut out = BTreeMap::new();
    let mut seen = std::collections::BTreeSet::new();
    let mut voided = std::collections::BTreeSet::new();
    let mut counted = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut path = format!(
            "/v1/usage?limit=1000&from={}&to={}",
            urlencode(&from),
            urlencode(&to)
        );
        if let Some(c) = &cursor {
            path.push_str(&format!("&cursor={c}"));
        }
        let page = get_any(urls, key, &path);
        for e in page["items"].as_array().cloned().unwrap_or_default() {
            if e["meter"]["meter"] != "gpu_seconds" {
                continue;
            }
            let k = format!("{}/{}", e["key"]["source"], e["key"]["id"]);
            assert!(seen.insert(k.clone()), "event {k} listed twice");
            let (Some(a), Some(b)) = (ts(&e["start"]), ts(&e["end"])) else {
                panic!("event without times: {e}");
            };
            let gpus: i64 = e["amount"].as_str().unwrap_or("0").parse().unwrap_or(0);
            if e["corrects"].is_object() {
                voided.insert(format!(
                    "{}/{}",
                    e["corrects"]["source"], e["corrects"]["id"]
                ));
            }
            counted.push((
                k,
                e["subject"]["id"].as_str().unwrap_or("").to_string(),
                gpus * (b - a).num_milliseconds(),
            ));
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    for (k, subject, s) in counted {
        if !voided.contains(&k) {
            *out.entry(subject).or_insert(0) += s;
        }
    }
    out
}

fn urlencode(s: &str) -> String {
    s.replace(':', "%3A").replace('+', "%2B")
}

/// What a finished instance should be billed, in GPU-milliseconds: from
/// its start to its billing end to the millisecond (each truncated to
/// whole milliseconds), times its GPUs.
fn expected_gpu_ms(inst: &Value, end: DateTime<Utc>) -> i64 {
    let start = ts(&inst["started_at"]).expect("started");
    let ms = flotilla_billing::meter::to_millisecond;
    inst["gpus"].as_i64().unwrap_or(0) * (ms(end) - ms(start)).num_milliseconds()
}

/// One instance's hold on GPUs: id, GPU ids, from, to.
type Holding = (String, Vec<String>, DateTime<Utc>, DateTime<Utc>);

/// When each instance held its GPUs: from placement to its final state.
fn holdings(instances: &[Value]) -> Vec<Holding> {
    instances
        .iter()
        .filter_map(|i| {
            let events = i["events"].as_array()?;
            let from = events
                .iter()
                .find(|e| e["state"] == "scheduled")
                .and_then(|e| ts(&e["at"]))?;
            let to = ts(&i["finished_at"]).unwrap_or_else(Utc::now);
            let gpus: Vec<String> = i["gpu_ids"]
                .as_array()?
                .iter()
                .filter_map(|g| g.as_str().map(str::to_string))
                .collect();
            Some((i["id"].as_str()?.to_string(), gpus, from, to))
        })
        .collect()
}

/// No GPU held by two instances at once.
fn assert_no_gpu_held_twice(instances: &[Value]) {
    let h = holdings(instances);
    for (i, (a, ga, fa, ta)) in h.iter().enumerate() {
        for (b, gb, fb, tb) in &h[i + 1..] {
            let shared = ga.iter().any(|g| gb.contains(g));
            let overlap = fa < tb && fb < ta;
            assert!(
                !(shared && overlap),
                "{a} ({fa}..{ta}) and {b} ({fb}..{tb}) held a GPU at once"
            );
        }
    }
}

#[test]
fn three_servers_survive_a_kill_9_of_the_leader() {
    // Heartbeat interval 3 s: the leader lease lives 3 s.
    let Some(env) = pg_home("ha", 9) else {
        return;
    };
    let interval = Duration::from_secs(3);
    let ports = [env.port, free_port(), free_port()];
    let urls: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    // One after the other: the first start bootstraps the database.
    let mut servers: Vec<Option<Proc>> = vec![Some(env.server_at(ports[0]))];
    let op = env.operator_key();
    servers.push(Some(env.server_at(ports[1])));
    servers.push(Some(env.server_at(ports[2])));
    let every = urls.join(",");
    let _agents = [
        env.agent_to("ha-a", "4xH100", &every),
        env.agent_to("ha-b", "4xH100", &every),
    ];
    let (_tenant, key) = tenant(&env, "ha");
    wait_until("one leader", Duration::from_secs(30), || {
        leaders(&urls).len() == 1
    });
    wait_until("8 free H100s", Duration::from_secs(30), || {
        free_h100(&urls, &key) == 8
    });
    let metrics = http("GET", &format!("{}/metrics", urls[0]), Some(&op), None)
        .unwrap()
        .1;
    assert!(
        metrics
            .as_str()
            .is_some_and(|m| m.contains("flotilla_leader")),
        "{metrics}"
    );

    // The client: creates 1-GPU instances in a loop, trying each server in
    // turn; keeps what was acknowledged.
    let stop = Arc::new(AtomicBool::new(false));
    let acked: Arc<Mutex<Vec<String>>> = Arc::default();
    let client = {
        let (stop, acked, urls, key) = (stop.clone(), acked.clone(), urls.clone(), key.clone());
        std::thread::spawn(move || {
            let body = json!({"gpus": 1, "command": ["sleep", "1"]}).to_string();
            while !stop.load(Ordering::Relaxed) {
                if let Some((201 | 200, v)) =
                    call_any(&urls, "POST", &key, "/v1/instances", Some(&body))
                {
                    if let Some(id) = v["id"].as_str() {
                        acked.lock().unwrap().push(id.to_string());
                    }
                }
                std::thread::sleep(Duration::from_millis(150));
            }
        })
    };
    wait_until("some instances created", Duration::from_secs(30), || {
        acked.lock().unwrap().len() >= 10
    });
    let old = leaders(&urls);
    assert_eq!(old.len(), 1, "one leader");
    let old = old[0];
    let mut killed = servers[old].take().unwrap();
    killed.0.kill().unwrap();
    let killed_at = Instant::now();
    killed.0.wait().unwrap();
    let survivors: Vec<String> = (0..3)
        .filter(|&i| i != old)
        .map(|i| urls[i].clone())
        .collect();
    let mut took = None;
    wait_until("a new leader", Duration::from_secs(30), || {
        if leaders(&survivors).len() == 1 {
            took = Some(killed_at.elapsed());
            true
        } else {
            false
        }
    });
    let took = took.unwrap();
    eprintln!("new leader after {took:?}");
    assert!(
        took <= interval * 2,
        "a lost leader is replaced within two heartbeat intervals, took {took:?}"
    );
    // A clean stop gives the lease back: the last replica leads at once
    // rather than after the lease ran out.
    let next = (0..3)
        .find(|&i| i != old && leaders(&urls[i..=i]) == [0])
        .unwrap();
    let mut stopped = servers[next].take().unwrap();
    send_signal(&stopped.0, nix::sys::signal::Signal::SIGTERM);
    let stopped_at = Instant::now();
    let last = (0..3).find(|&i| i != old && i != next).unwrap();
    wait_until("the last replica leads", Duration::from_secs(30), || {
        leaders(&urls[last..=last]) == [0]
    });
    let handed = stopped_at.elapsed();
    eprintln!("lease handed over after {handed:?}");
    assert!(
        handed < interval,
        "a released lease is taken within a try ({handed:?})"
    );
    assert!(stopped.0.wait().unwrap().success());
    let survivors = vec![urls[last].clone()];
    let at_kill = acked.lock().unwrap().len();
    wait_until(
        "creates through the new leader",
        Duration::from_secs(60),
        || acked.lock().unwrap().len() >= at_kill + 10,
    );
    stop.store(true, Ordering::Relaxed);
    client.join().unwrap();

    // Every acknowledged create ran, and ended.
    let acked = acked.lock().unwrap().clone();
    wait_until(
        "every acknowledged instance ran to its end",
        Duration::from_secs(180),
        || {
            let all = all_instances(&survivors, &key);
            acked.iter().all(|id| {
                all.iter()
                    .any(|i| i["id"] == id.as_str() && i["state"] == "succeeded")
            })
        },
    );
    let all = all_instances(&survivors, &key);
    for id in &acked {
        let inst = all.iter().find(|i| i["id"] == id.as_str()).unwrap();
        let states: Vec<&str> = inst["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e["state"].as_str())
            .collect();
        assert!(
            states.contains(&"running") && !states.contains(&"lost"),
            "{id}: {states:?}"
        );
    }
    assert_no_gpu_held_twice(&all);

    // Each instance's usage is counted once: exactly its run, to the
    // millisecond.
    let expected: BTreeMap<String, i64> = all
        .iter()
        .filter(|i| i["state"] == "succeeded")
        .map(|i| {
            let end = ts(&i["finished_at"]).unwrap();
            (
                i["id"].as_str().unwrap().to_string(),
                expected_gpu_ms(i, end),
            )
        })
        .collect();
    let mut billed = BTreeMap::new();
    wait_until("usage metered", Duration::from_secs(60), || {
        billed = billed_gpu_ms(&survivors, &key);
        expected.iter().all(|(id, _)| billed.contains_key(id))
    });
    for (id, want) in &expected {
        assert_eq!(billed.get(id), Some(want), "usage of {id}");
    }
}

#[test]
fn a_paused_leader_steps_down_and_places_nothing() {
    // Heartbeat interval 3 s: the leader lease lives 3 s.
    let Some(env) = pg_home("hapause", 9) else {
        return;
    };
    let ports = [env.port, free_port()];
    let urls: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let first = env.server_at(ports[0]);
    let _op = env.operator_key();
    let second = env.server_at(ports[1]);
    let _agent = env.agent_to("pause-a", "2xH100", &urls.join(","));
    let (_tenant, key) = tenant(&env, "pause");
    wait_until("one leader", Duration::from_secs(30), || {
        leaders(&urls) == [0]
    });
    wait_until("2 free H100s", Duration::from_secs(30), || {
        free_h100(&urls, &key) == 2
    });
    // The node exists once the registration committed, which may be before
    // the agent has the answer: stopped then, the leader would keep the
    // agent waiting on its register call (15 s) past the node's lease.
    wait_until("the agent registered", Duration::from_secs(30), || {
        std::fs::read_to_string(env.dir.path().join("agent.log"))
            .unwrap_or_default()
            .contains("registered with the server")
    });

    send_signal(&first.0, nix::sys::signal::Signal::SIGSTOP);
    let follower = [urls[1].clone()];
    wait_until("the follower takes over", Duration::from_secs(30), || {
        leaders(&follower) == [0]
    });
    // Work submitted meanwhile is placed by the new leader.
    let body = json!({"gpus": 1, "command": ["sleep", "600"]}).to_string();
    let (status, created) =
        call_any(&follower, "POST", &key, "/v1/instances", Some(&body)).unwrap();
    assert_eq!(status, 201, "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    wait_until("placed by the new leader", Duration::from_secs(30), || {
        get_any(&follower, &key, &format!("/v1/instances/{id}"))["state"] == "running"
    });

    // Resumed, the old leader finds its lease gone and steps down; the
    // new one keeps leading.
    send_signal(&first.0, nix::sys::signal::Signal::SIGCONT);
    wait_until("the old leader steps down", Duration::from_secs(30), || {
        health(&urls[0]).is_some_and(|h| h["role"] == "follower" && h["leader"].is_string())
    });
    let h0 = health(&urls[0]).unwrap();
    let h1 = health(&urls[1]).unwrap();
    assert_eq!(h0["leader"], h1["replica"], "{h0} {h1}");
    assert_eq!(leaders(&urls), [1]);
    // Work submitted through the old leader is placed by the new one, once.
    let (status, created) =
        call_any(&urls[..1], "POST", &key, "/v1/instances", Some(&body)).unwrap();
    assert_eq!(status, 201, "{created}");
    let id2 = created["id"].as_str().unwrap().to_string();
    wait_until("the second instance runs", Duration::from_secs(30), || {
        get_any(&urls, &key, &format!("/v1/instances/{id2}"))["state"] == "running"
    });
    let all = all_instances(&urls, &key);
    assert_no_gpu_held_twice(&all);
    assert_eq!(free_h100(&urls, &key), 0);
    let log = std::fs::read_to_string(env.dir.path().join("server.log")).unwrap_or_default();
    assert!(
        log.contains("leader lease lost")
            || log.contains("leader lease not renewed")
            || log.contains("renewal timed out"),
        "the resumed leader says it stopped its loops"
    );
    drop(second);
}

/// The leader lease's row straight from PostgreSQL: holder, token,
/// `expires_at` and `acquired_at` (UTC milliseconds). A plain read, which
/// no row lock holds up.
fn lease_row(url: &str) -> (String, i64, i64, i64) {
    use sqlx::{Connection, Row};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = sqlx::PgConnection::connect(url).await.unwrap();
        let r = sqlx::query(
            "SELECT holder, token, expires_at, acquired_at FROM leases WHERE name = 'leader'",
        )
        .fetch_one(&mut c)
        .await
        .unwrap();
        (r.get(0), r.get(1), r.get(2), r.get(3))
    })
}

/// A request to one server with its latency; `None` when it did not
/// answer.
fn timed(f: impl FnOnce() -> Option<u16>) -> (Option<u16>, Duration) {
    let start = Instant::now();
    let status = f();
    (status, start.elapsed())
}

#[test]
fn a_leader_frozen_holding_its_lease_row_stalls_nothing() {
    // Heartbeat interval 3 s: the leader lease lives 3 s.
    let Some(mut env) = pg_home("hafreeze", 9) else {
        return;
    };
    let interval = Duration::from_secs(3);
    let lease = interval;
    // The servers' test hook: a leader that sees this file appear holds
    // its lease row in a fenced transaction until the file is gone.
    let trigger = env.dir.path().join("hold-lease");
    let held = env.dir.path().join("hold-lease.held");
    env.server_env.push((
        "FLOTILLA_TEST_HOLD_LEASE_LOCK".into(),
        trigger.display().to_string(),
    ));
    let db = env.database_url.clone().unwrap();
    let ports = [env.port, free_port()];
    let urls: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let first = env.server_at(ports[0]);
    let _op = env.operator_key();
    let second = env.server_at(ports[1]);
    let _agent = env.agent_to("freeze-a", "2xH100", &urls.join(","));
    let (_tenant, key) = tenant(&env, "freeze");
    wait_until("one leader", Duration::from_secs(30), || {
        leaders(&urls) == [0]
    });
    wait_until("2 free H100s", Duration::from_secs(30), || {
        free_h100(&urls, &key) == 2
    });

    // Running work, which records its pid.
    let body =
        json!({"gpus": 1, "command": ["sh", "-c", "echo $$ > pid; exec sleep 600"]}).to_string();
    let (status, created) =
        call_any(&urls[..1], "POST", &key, "/v1/instances", Some(&body)).unwrap();
    assert_eq!(status, 201, "{created}");
    let running = created["id"].as_str().unwrap().to_string();
    let pid_file = env
        .dir
        .path()
        .join("agent/instances")
        .join(&running)
        .join("pid");
    let mut pid = 0u32;
    wait_until("the instance runs", Duration::from_secs(30), || {
        pid = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        pid != 0 && get_any(&urls, &key, &format!("/v1/instances/{running}"))["state"] == "running"
    });
    assert!(pid_alive(pid));

    // The leader holds its lease row locked in a fenced write, and is
    // stopped there for three lease periods.
    std::fs::write(&trigger, "").unwrap();
    wait_until(
        "the leader holds its lease row",
        Duration::from_secs(30),
        || held.exists(),
    );
    send_signal(&first.0, nix::sys::signal::Signal::SIGSTOP);
    let stopped = Instant::now();
    // The new leader must not hold it too; the old one, resumed, lets go.
    std::fs::remove_file(&trigger).unwrap();
    let (old_holder, old_token, old_expiry, _) = lease_row(&db);
    let follower = [urls[1].clone()];
    let mut created_during = None;
    let mut slowest_health = Duration::ZERO;
    let mut took_over = None;
    while stopped.elapsed() < lease * 3 {
        let (status, took) = timed(|| {
            http("GET", &format!("{}/v1/health", urls[1]), None, None)
                .ok()
                .map(|(s, _)| s)
        });
        assert_eq!(status, Some(200), "the follower's health answers");
        slowest_health = slowest_health.max(took);
        if created_during.is_none() {
            let (status, took) = timed(|| {
                let (s, v) = call_any(&follower, "POST", &key, "/v1/instances", Some(&body))?;
                created_during = v["id"].as_str().map(str::to_string);
                Some(s)
            });
            assert_eq!(status, Some(201), "a create through the follower");
            eprintln!("created through the follower in {took:?}");
        }
        if took_over.is_none() && leaders(&follower) == [0] {
            took_over = Some(stopped.elapsed());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let took_over = took_over.expect("the follower took over while the leader was stopped");
    let (holder, token, _, acquired) = lease_row(&db);
    assert_ne!(holder, old_holder);
    assert!(token > old_token);
    let after_expiry = Duration::from_millis(acquired.saturating_sub(old_expiry) as u64);
    eprintln!(
        "leader stopped holding its lease row: the follower took over {after_expiry:?} after \
         the lease ran out ({took_over:?} after the stop, seen by polling); slowest health \
         answer {slowest_health:?}"
    );
    assert!(
        after_expiry <= interval * 2,
        "taken over within two heartbeat intervals of the lease running out ({after_expiry:?})"
    );
    assert!(
        slowest_health < interval,
        "health answered promptly throughout ({slowest_health:?})"
    );
    let during = created_during.unwrap();
    wait_until(
        "the instance created during the stall runs",
        Duration::from_secs(30),
        || get_any(&follower, &key, &format!("/v1/instances/{during}"))["state"] == "running",
    );

    // Resumed, the old leader finds its held transaction ended and its
    // lease gone, and steps down; nothing running was stopped.
    send_signal(&first.0, nix::sys::signal::Signal::SIGCONT);
    wait_until("the old leader steps down", Duration::from_secs(30), || {
        health(&urls[0]).is_some_and(|h| h["role"] == "follower" && h["leader"].is_string())
    });
    assert_eq!(leaders(&urls), [1]);
    // Its held write did not land: the lease is the new leader's still.
    assert_eq!(lease_row(&db).0, holder);
    let log = std::fs::read_to_string(env.dir.path().join("server.log")).unwrap_or_default();
    assert!(
        log.contains("leader lease lost")
            || log.contains("leader lease not renewed")
            || log.contains("renewal timed out"),
        "the resumed leader says it stopped its loops"
    );
    let inst = get_any(&urls, &key, &format!("/v1/instances/{running}"));
    assert_eq!(inst["state"], "running", "{inst}");
    let states: Vec<&str> = inst["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["state"].as_str())
        .collect();
    assert!(!states.contains(&"lost"), "{states:?}");
    assert!(pid_alive(pid), "the running instance's process still runs");
    assert_eq!(
        std::fs::read_to_string(&pid_file).unwrap().trim(),
        pid.to_string(),
        "the same process"
    );
    assert_no_gpu_held_twice(&all_instances(&urls, &key));
    drop(second);
}

/// The job's member of `attempt`, as `(instance id, node id)`.
fn member(job: &Value, attempt: u64) -> Option<(String, String)> {
    job["members"].as_array()?.iter().find_map(|m| {
        (m["attempt"].as_u64() == Some(attempt) && m["state"] == "running").then(|| {
            (
                m["instance_id"].as_str().unwrap_or("").to_string(),
                m["node_id"].as_str().unwrap_or("").to_string(),
            )
        })
    })
}

/// Timestamps (ms) a copy wrote while it ran.
fn stamps(env: &Home, instance: &str) -> Vec<i64> {
    std::fs::read_to_string(
        env.dir
            .path()
            .join("agent/instances")
            .join(instance)
            .join("stamps"),
    )
    .unwrap_or_default()
    .lines()
    .filter_map(|l| l.trim().parse().ok())
    .collect()
}

/// Submits a one-member job that restarts on failure and stamps the time
/// into its working directory ten times a second; waits for its first
/// attempt to run. Its path, the first member's instance and node.
fn stamping_job(env: &Home, urls: &[String], key: &str) -> (String, String, String) {
    let submitted = env.cli_json(
        Some(key),
        &[
            "jobs",
            "submit",
            "--gpus",
            "1",
            "--restart",
            "on-failure",
            "--max-retries",
            "2",
            "--",
            "sh",
            "-c",
            "while :; do date +%s%3N >> stamps; sleep 0.1; done",
        ],
    );
    let job_id = submitted["id"].as_str().unwrap().to_string();
    let job_path = format!("/v1/jobs/{job_id}");
    let mut first = None;
    wait_until("the job runs on node A", Duration::from_secs(30), || {
        first = member(&get_any(urls, key, &job_path), 1);
        first.is_some()
    });
    let (old_id, node_a) = first.unwrap();
    (job_path, old_id, node_a)
}

#[test]
fn a_node_cut_off_past_its_lease_stops_its_work_before_it_runs_elsewhere() {
    // Node lease 6 s; the server waits one interval (2 s) more.
    let Some(env) = pg_home("halease", 6) else {
        return;
    };
    let lease = Duration::from_secs(6);
    let ports = [env.port, free_port()];
    let urls: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    // The first server leads; the second only serves node A, so pausing it
    // cuts node A off from the control plane and nothing else.
    let _leader = env.server_at(ports[0]);
    let _op = env.operator_key();
    let cut = env.server_at(ports[1]);
    // The old copy's stamps are read again once node A is back, when its
    // agent would otherwise remove the ended instance's directory.
    let _a = env.agent_with("lease-a", "1xH100", &urls[1], &["--keep-workdirs", "1h"]);
    let (_tenant, key) = tenant(&env, "lease");
    wait_until("node A's GPU", Duration::from_secs(30), || {
        free_h100(&urls, &key) == 1
    });
    let (job_path, old_id, node_a) = stamping_job(&env, &urls, &key);
    let old = get_any(&urls, &key, &format!("/v1/instances/{old_id}"));
    let pid: u32 = old["state_reason"]
        .as_str()
        .unwrap()
        .trim_start_matches("running as pid ")
        .parse()
        .unwrap();
    let _b = env.agent_to("lease-b", "1xH100", &urls[0]);
    wait_until("node B's GPU", Duration::from_secs(30), || {
        free_h100(&urls, &key) == 1
    });

    send_signal(&cut.0, nix::sys::signal::Signal::SIGSTOP);
    let paused = Instant::now();
    let mut second = None;
    wait_until(
        "the job runs again elsewhere",
        Duration::from_secs(60),
        || {
            second = member(&get_any(&urls[..1], &key, &job_path), 2);
            second.is_some()
        },
    );
    let (new_id, node_b) = second.unwrap();
    assert_ne!(node_a, node_b);
    assert!(
        paused.elapsed() >= lease,
        "restarted only after the node's lease ran out ({:?})",
        paused.elapsed()
    );
    assert!(
        !pid_alive(pid),
        "node A's agent stopped the old copy itself"
    );
    wait_until("the new copy writes", Duration::from_secs(30), || {
        !stamps(&env, &new_id).is_empty()
    });
    let (old_stamps, new_stamps) = (stamps(&env, &old_id), stamps(&env, &new_id));
    let old_last = *old_stamps.last().expect("the old copy ran");
    let new_first = new_stamps[0];
    assert!(
        old_last < new_first,
        "the old copy stopped ({old_last}) before the new one started ({new_first})"
    );

    // Node A comes back; nothing of the old copy starts again.
    send_signal(&cut.0, nix::sys::signal::Signal::SIGCONT);
    wait_until("node A is back", Duration::from_secs(60), || {
        get_any(&urls, &key, "/v1/gpu-types")["items"]
            .as_array()
            .is_some_and(|a| a.iter().any(|g| g["name"] == "H100" && g["free"] == 1))
    });
    assert_eq!(
        stamps(&env, &old_id),
        old_stamps,
        "the old copy never ran again"
    );

    // The old copy was stopped once its lease ran out (the agent counts it
    // from the last answer; the server from when it answered): near the
    // lease's end as the server counts it, within the agent's kill lead
    // (half an interval) after it, or one long-poll (a sync the server
    // took but never answered; half an interval) before, and a second of
    // slack. Usage: the job restarted it elsewhere, so the server ended
    // the lost copy before its agent came back: it is billed from its
    // start to the end of its lease as the server counts it, or to the
    // fence's kill when the agent, back, reports a kill before that end
    // (docs/billing.md, "A fenced copy is billed to its kill"; the two lie
    // milliseconds apart here, either way round).
    let old = get_any(&urls, &key, &format!("/v1/instances/{old_id}"));
    let lost_at = old["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["state"] == "lost")
        .and_then(|e| ts(&e["at"]))
        .expect("the old copy was declared lost");
    let last_ran = DateTime::from_timestamp_millis(old_last).unwrap();
    let slack = chrono::Duration::seconds(2);
    eprintln!("measured: last stamp {last_ran}, lease ended {lost_at}");
    assert!(
        (lost_at - slack..lost_at + slack).contains(&last_ran),
        "stopped at its lease's end: ran until {last_ran}, lease ended {lost_at}"
    );
    // The bill's end: the reported kill once recorded, else the loss.
    let bill_end = |old: &Value| match (old["exit_code"].is_null(), ts(&old["finished_at"])) {
        (false, Some(kill)) => {
            assert!(
                kill <= lost_at,
                "a late exit never lengthens the bill: {old}"
            );
            kill
        }
        _ => lost_at,
    };
    let mut billed = BTreeMap::new();
    let mut want_old = 0;
    // Usage lands slice by slice as the metering pass reaches it, and a
    // kill reported late corrects it: wait until it is the bill of the
    // instance as it stands.
    wait_until(
        "the old copy's usage in full",
        Duration::from_secs(60),
        || {
            let old = get_any(&urls, &key, &format!("/v1/instances/{old_id}"));
            want_old = expected_gpu_ms(&old, bill_end(&old));
            billed = billed_gpu_ms(&urls, &key);
            billed.get(&old_id) == Some(&want_old)
        },
    );
    assert_eq!(
        billed.get(&old_id),
        Some(&want_old),
        "old copy billed exactly"
    );
    let all = all_instances(&urls, &key);
    assert_no_gpu_held_twice(&all);
}

#[test]
fn sqlite_runs_one_server_and_says_so() {
    let mut env = Home::new(BIN);
    env.heartbeat_timeout = 3;
    let _first = env.server();
    wait_until("the first server leads", Duration::from_secs(30), || {
        health(&env.url()).is_some_and(|h| h["role"] == "leader" && h["backend"] == "sqlite")
    });
    let port = free_port();
    let mut second = env
        .cmd()
        .args(["server", "--bind", &format!("127.0.0.1:{port}")])
        .arg("--data-dir")
        .arg(env.data())
        .args(["--heartbeat-timeout", "3"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(s) = second.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > Duration::from_secs(60) {
            let _ = second.kill();
            panic!("a second server on one SQLite file kept running");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut second.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success());
    assert!(
        err.contains("another flotilla server") && err.contains("SQLite runs one server"),
        "{err}"
    );
    // The first one never stopped leading.
    assert_eq!(health(&env.url()).unwrap()["role"], "leader");
}

/// The case the node lease's fence exists for: the agent itself is paused
/// (SIGSTOP), its workloads are not. The fence process beside it stops the
/// job's old copy before the lease runs out, and the server restarts the
/// job elsewhere only after: never two copies at once.
#[test]
fn a_paused_agent_has_its_work_stopped_by_its_fence_before_it_runs_elsewhere() {
    let Some(env) = pg_home("hafence", 6) else {
        return;
    };
    let lease = Duration::from_secs(6);
    let url = format!("http://127.0.0.1:{}", env.port);
    let urls = vec![url.clone()];
    let _server = env.server_at(env.port);
    let _op = env.operator_key();
    let a = env.agent_to("fence-a", "1xH100", &url);
    let (_tenant, key) = tenant(&env, "fence");
    wait_until("node A's GPU", Duration::from_secs(30), || {
        free_h100(&urls, &key) == 1
    });
    let (job_path, old_id, node_a) = stamping_job(&env, &urls, &key);
    let mut pid = 0u32;
    wait_until("its pid", Duration::from_secs(30), || {
        let old = get_any(&urls, &key, &format!("/v1/instances/{old_id}"));
        pid = old["state_reason"]
            .as_str()
            .unwrap_or("")
            .trim_start_matches("running as pid ")
            .parse()
            .unwrap_or(0);
        pid != 0
    });
    let _b = env.agent_to("fence-b", "1xH100", &url);
    wait_until("node B's GPU", Duration::from_secs(30), || {
        free_h100(&urls, &key) == 1
    });

    send_signal(&a.0, nix::sys::signal::Signal::SIGSTOP);
    let paused = Instant::now();
    wait_until(
        "the fence stops the old copy",
        lease + Duration::from_secs(5),
        || !pid_alive(pid),
    );
    let mut second = None;
    wait_until(
        "the job runs again elsewhere",
        Duration::from_secs(60),
        || {
            second = member(&get_any(&urls, &key, &job_path), 2);
            second.is_some()
        },
    );
    let (new_id, node_b) = second.unwrap();
    assert_ne!(node_a, node_b);
    assert!(
        paused.elapsed() >= lease,
        "restarted only after the node's lease ran out ({:?})",
        paused.elapsed()
    );
    wait_until("the new copy writes", Duration::from_secs(30), || {
        !stamps(&env, &new_id).is_empty()
    });
    let (old_stamps, new_stamps) = (stamps(&env, &old_id), stamps(&env, &new_id));
    let old_last = *old_stamps.last().expect("the old copy ran");
    assert!(
        old_last < new_stamps[0],
        "the old copy stopped ({old_last}) before the new one started ({})",
        new_stamps[0]
    );
    send_signal(&a.0, nix::sys::signal::Signal::SIGCONT);
}
