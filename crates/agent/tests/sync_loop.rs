//! The agent's reconcile loop against a tiny in-process mock of the agent
//! protocol (hand-written HTTP/1.1 so the crate needs no server framework).
//! The mock holds every sync for the full long-poll wait unless the test
//! changes the assignments, so quick reports prove the agent resends on a
//! local change instead of waiting for the long-poll to return.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flotilla_core::api::{
    Assignment, LogBatch, ObservedInstance, ObservedPhase, RegisterNode, Registered, SyncRequest,
    SyncResponse,
};
use flotilla_core::id::{InstanceId, NodeId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::JoinSet;

#[derive(Default)]
struct MockState {
    node_id: Option<NodeId>,
    registrations: Vec<RegisterNode>,
    assignments: Vec<Assignment>,
    /// Every sync's observed list, oldest first.
    syncs: Vec<Vec<ObservedInstance>>,
    /// Lines the "server" holds per instance, by seq.
    logs: BTreeMap<InstanceId, BTreeMap<u64, String>>,
    /// For each instance reported final: how many lines were held then.
    lines_when_final: BTreeMap<InstanceId, usize>,
    /// Answer the next sync with 404.
    forget_node_once: bool,
    /// The assignments last answered.
    last_sent: Option<Vec<Assignment>>,
    /// The node lease stated to the agent (`None`: an older server).
    lease_ms: Option<u64>,
    /// Whether registration answers say the server gives busy answers.
    busy_answers: bool,
    /// Answer every sync busy (lease renewed, report not taken).
    busy: bool,
    /// Syncs answered busy, and whether each asked for it (`busy_ok`).
    busy_syncs: Vec<bool>,
    /// Whether each taken sync carried `busy_ok`.
    busy_ok: Vec<bool>,
}

#[derive(Clone, Default)]
struct Mock {
    state: Arc<Mutex<MockState>>,
    changed: Arc<Notify>,
}

impl Mock {
    fn with<R>(&self, f: impl FnOnce(&mut MockState) -> R) -> R {
        f(&mut self.state.lock().unwrap())
    }

    fn set_assignments(&self, f: impl FnOnce(&mut Vec<Assignment>)) {
        self.with(|s| f(&mut s.assignments));
        self.changed.notify_waiters();
    }

    fn latest(&self, id: &InstanceId) -> Option<ObservedInstance> {
        self.with(|s| {
            s.syncs
                .last()
                .and_then(|obs| obs.iter().find(|o| &o.instance_id == id).cloned())
        })
    }

    async fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        mut pred: impl FnMut(&MockState) -> bool,
    ) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.with(|s| pred(s)) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Serves on `addr` until the returned task is aborted (which also
    /// drops every open connection, like a killed server).
    async fn serve(&self, addr: SocketAddr) -> tokio::task::JoinHandle<()> {
        let listener = TcpListener::bind(addr).await.unwrap();
        let mock = self.clone();
        tokio::spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        if let Ok((stream, _)) = accepted {
                            conns.spawn(mock.clone().handle(stream));
                        }
                    }
                    Some(_) = conns.join_next() => {}
                }
            }
        })
    }

    async fn handle(self, mut stream: TcpStream) {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 8192];
        let header_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..header_end]).to_string();
        let mut lines = head.lines();
        let request_line = lines.next().unwrap_or_default().to_string();
        let mut length = 0usize;
        let mut auth = String::new();
        for l in lines {
            if let Some((k, v)) = l.split_once(':') {
                match k.trim().to_ascii_lowercase().as_str() {
                    "content-length" => length = v.trim().parse().unwrap_or(0),
                    "authorization" => auth = v.trim().to_string(),
                    _ => {}
                }
            }
        }
        while buf.len() < header_end + length {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body = &buf[header_end..header_end + length];
        let path = request_line
            .split_whitespace()
            .nth(1)
            .unwrap_or_default()
            .to_string();
        let (status, json) = if auth != "Bearer secret" {
            (
                401,
                r#"{"error":{"code":"unauthorized","message":"bad key","details":{}}}"#.to_string(),
            )
        } else {
            self.route(&path, body).await
        };
        let reason = match status {
            200 => "OK",
            204 => "No Content",
            401 => "Unauthorized",
            _ => "Not Found",
        };
        let resp = format!(
            "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{json}",
            json.len()
        );
        let _ = stream.write_all(resp.as_bytes()).await;
        let _ = stream.shutdown().await;
    }

    async fn route(&self, path: &str, body: &[u8]) -> (u16, String) {
        let not_found = r#"{"error":{"code":"not_found","message":"no such node","details":{}}}"#;
        if path == "/v1/agent/register" {
            let req: RegisterNode = serde_json::from_slice(body).unwrap();
            let node_id = self.with(|s| {
                s.registrations.push(req);
                s.node_id
                    .get_or_insert_with(|| NodeId::generate(1, 7))
                    .clone()
            });
            let reg = Registered {
                node_id,
                heartbeat_interval_ms: 5_000,
                lease_ms: self.with(|s| s.lease_ms),
                busy_answers: self.with(|s| s.busy_answers),
            };
            return (200, serde_json::to_string(&reg).unwrap());
        }
        if let Some(rest) = path.strip_prefix("/v1/agent/nodes/") {
            let req: SyncRequest = serde_json::from_slice(body).unwrap();
            let busy = self.with(|s| {
                if s.busy {
                    s.busy_syncs.push(req.busy_ok);
                }
                s.busy
            });
            if busy {
                let resp = SyncResponse {
                    assignments: vec![],
                    reregister: false,
                    lease_ms: self.with(|s| s.lease_ms),
                    sessions: vec![],
                    unpark: vec![],
                    busy_retry_ms: Some(200),
                };
                return (200, serde_json::to_string(&resp).unwrap());
            }
            let known = self.with(|s| {
                let node = rest.trim_end_matches("/sync");
                let known = s.node_id.as_ref().is_some_and(|n| n.as_str() == node)
                    && !std::mem::take(&mut s.forget_node_once);
                if known {
                    s.busy_ok.push(req.busy_ok);
                    for o in &req.observed {
                        if matches!(
                            o.phase,
                            ObservedPhase::Exited { .. } | ObservedPhase::FailedToStart { .. }
                        ) {
                            let held = s.logs.get(&o.instance_id).map_or(0, |l| l.len());
                            s.lines_when_final
                                .entry(o.instance_id.clone())
                                .or_insert(held);
                        }
                    }
                    s.syncs.push(req.observed.clone());
                }
                known
            });
            if !known {
                return (404, not_found.to_string());
            }
            // Long-poll: hold while the answer would be what this agent
            // already got, until the test changes something.
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.with(|s| s.last_sent.as_ref() == Some(&s.assignments)) {
                let _ = tokio::time::timeout(Duration::from_millis(req.wait_ms), notified).await;
            }
            let assignments = self.with(|s| {
                s.last_sent = Some(s.assignments.clone());
                s.assignments.clone()
            });
            let resp = SyncResponse {
                assignments,
                reregister: false,
                lease_ms: self.with(|s| s.lease_ms),
                sessions: vec![],
                unpark: vec![],
                busy_retry_ms: None,
            };
            return (200, serde_json::to_string(&resp).unwrap());
        }
        if let Some(rest) = path.strip_prefix("/v1/agent/instances/") {
            let id = InstanceId::parse(rest.trim_end_matches("/logs"), "id").unwrap();
            let batch: LogBatch = serde_json::from_slice(body).unwrap();
            self.with(|s| {
                let held = s.logs.entry(id).or_default();
                for l in batch.lines {
                    held.entry(l.seq).or_insert(l.line);
                }
            });
            return (204, String::new());
        }
        (404, not_found.to_string())
    }
}

fn assignment(n: u128, script: &str) -> Assignment {
    Assignment {
        instance_id: InstanceId::generate(1_000, n),
        tenant_id: None,
        command: vec!["sh".into(), "-c".into(), script.into()],
        env: BTreeMap::from([("FOO".to_string(), "bar".to_string())]),
        workdir: None,
        gpu_indices: vec![1],
        gpu_uuids: vec!["GPU-x".into()],
        gpu_slices: Vec::new(),
        stop: false,
        stop_grace_ms: 5_000,
        image: None,
        cpu_milli: None,
        memory_mb: None,
        registry_auth: None,
        disk_mb: None,
    }
}

fn pid_of(o: &ObservedInstance) -> Option<u32> {
    match o.phase {
        ObservedPhase::Running { pid } => Some(pid),
        _ => None,
    }
}

fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|s| s == "Z" || s == "X"),
    }
}

/// A free loopback address for a mock server to listen on.
fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// An agent (node `n`, key `secret`, simulated GPUs) syncing with the mock
/// at one address until [`RunningAgent::stop`]; its state directory lives
/// as long as it does.
struct RunningAgent {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    _dir: tempfile::TempDir,
}

impl RunningAgent {
    fn start(addr: SocketAddr, gpus: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut config =
            flotilla_agent::AgentConfig::new(format!("http://{addr}"), "secret", "n", dir.path());
        config.simulate_gpus = Some(gpus.into());
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(flotilla_agent::run(config, async {
            let _ = stop_rx.await;
        }));
        Self {
            stop,
            task,
            _dir: dir,
        }
    }

    /// Shuts the agent down and waits for it to return without error.
    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_reconciles_against_the_server() {
    let mock = Mock::default();
    let addr = free_addr();
    let mut server = mock.serve(addr).await;
    let dir = tempfile::tempdir().unwrap();

    // A: prints 1200 lines on both streams and exits 7.
    let a = assignment(
        1,
        "for i in $(seq 1 600); do echo out $i; echo err $i >&2; done; echo \"$FOO $CUDA_VISIBLE_DEVICES $FLOTILLA_GPU_UUIDS\"; exit 7",
    );
    mock.set_assignments(|v| v.push(a.clone()));

    let mut config = flotilla_agent::AgentConfig::new(
        format!("http://{addr}/"),
        "secret",
        "node-test",
        dir.path(),
    );
    config.simulate_gpus = Some("2xH100".into());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(flotilla_agent::run(config, async {
        let _ = stop_rx.await;
    }));

    // Registration carries the simulated inventory.
    mock.wait_for("registration", Duration::from_secs(10), |s| {
        !s.registrations.is_empty()
    })
    .await;
    let reg = mock.with(|s| s.registrations[0].clone());
    assert!(reg.simulated);
    assert_eq!(reg.gpus.len(), 2);
    assert_eq!(reg.name, "node-test");

    // A exits; its Exited report comes only after all 1201 lines arrived,
    // and quickly although the mock holds each sync for 5 s.
    let a_id = a.instance_id.clone();
    mock.wait_for("a exited", Duration::from_secs(4), |s| {
        s.lines_when_final.contains_key(&a_id)
    })
    .await;
    let exited = mock.latest(&a_id).unwrap();
    assert_eq!(
        exited.phase,
        ObservedPhase::Exited {
            code: 7,
            stopped: false
        }
    );
    mock.with(|s| {
        assert_eq!(s.lines_when_final[&a_id], 1201, "all lines before exit");
        let held = &s.logs[&a_id];
        assert_eq!(
            held.keys().copied().collect::<Vec<_>>(),
            (0..1201).collect::<Vec<u64>>()
        );
        // The streams interleave; only the content is fixed.
        assert!(held.values().any(|l| l == "bar 1 GPU-x"));
        assert!(held.values().any(|l| l == "err 600"));
    });

    // The server drops A; B starts and is stopped by the server.
    let b = assignment(2, "sleep 100");
    mock.set_assignments(|v| *v = vec![b.clone()]);
    let b_id = b.instance_id.clone();
    mock.wait_for("b running", Duration::from_secs(4), |s| {
        s.syncs.last().is_some_and(|o| {
            o.iter()
                .any(|o| o.instance_id == b_id && pid_of(o).is_some())
        })
    })
    .await;
    assert!(mock.latest(&a_id).is_none(), "a forgotten once unlisted");
    mock.set_assignments(|v| v[0].stop = true);
    mock.wait_for("b stopped", Duration::from_secs(4), |s| {
        s.lines_when_final.contains_key(&b_id)
    })
    .await;
    assert_eq!(
        mock.latest(&b_id).unwrap().phase,
        ObservedPhase::Exited {
            code: 143,
            stopped: true
        }
    );

    // C runs, then the server forgets it: the orphan is stopped.
    let c = assignment(3, "sleep 100");
    let c_id = c.instance_id.clone();
    mock.set_assignments(|v| *v = vec![c.clone()]);
    mock.wait_for("c running", Duration::from_secs(4), |s| {
        s.syncs.last().is_some_and(|o| {
            o.iter()
                .any(|o| o.instance_id == c_id && pid_of(o).is_some())
        })
    })
    .await;
    let c_pid = pid_of(&mock.latest(&c_id).unwrap()).unwrap();
    mock.set_assignments(Vec::clear);
    for _ in 0..200 {
        if gone(c_pid) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(gone(c_pid), "orphan stopped");

    // D runs; the server dies and comes back: D keeps running, same pid,
    // and its output written meanwhile arrives.
    let d = assignment(4, "echo before; sleep 1.5; echo during; sleep 100");
    let d_id = d.instance_id.clone();
    mock.set_assignments(|v| *v = vec![d.clone()]);
    mock.wait_for("d running", Duration::from_secs(4), |s| {
        s.logs.get(&d_id).is_some_and(|l| l.len() == 1)
            && s.syncs.last().is_some_and(|o| {
                o.iter()
                    .any(|o| o.instance_id == d_id && pid_of(o).is_some())
            })
    })
    .await;
    let d_pid = pid_of(&mock.latest(&d_id).unwrap()).unwrap();
    server.abort();
    let _ = server.await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!gone(d_pid), "work continues while the server is down");
    let syncs_before = mock.with(|s| s.syncs.len());
    server = mock.serve(addr).await;
    mock.wait_for("d re-reported", Duration::from_secs(10), |s| {
        s.syncs.len() > syncs_before && s.logs.get(&d_id).is_some_and(|l| l.len() == 2)
    })
    .await;
    assert_eq!(
        pid_of(&mock.latest(&d_id).unwrap()),
        Some(d_pid),
        "not restarted"
    );

    // The server forgets the node: the agent registers again and goes on.
    mock.with(|s| s.forget_node_once = true);
    mock.changed.notify_waiters();
    mock.wait_for("re-registration", Duration::from_secs(10), |s| {
        s.registrations.len() >= 2
    })
    .await;
    let syncs_before = mock.with(|s| s.syncs.len());
    mock.changed.notify_waiters();
    mock.wait_for("sync after re-registration", Duration::from_secs(10), |s| {
        s.syncs.len() > syncs_before
    })
    .await;
    assert_eq!(pid_of(&mock.latest(&d_id).unwrap()), Some(d_pid));

    // Shutdown stops D and reports it as stopped (not failed).
    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(20), agent)
        .await
        .expect("agent returns after shutdown")
        .unwrap()
        .unwrap();
    assert!(gone(d_pid));
    assert_eq!(
        mock.latest(&d_id).unwrap().phase,
        ObservedPhase::Exited {
            code: 143,
            stopped: true
        }
    );
    server.abort();
}

#[tokio::test]
async fn bad_key_fails_the_first_registration() {
    let mock = Mock::default();
    let addr = free_addr();
    let server = mock.serve(addr).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config =
        flotilla_agent::AgentConfig::new(format!("http://{addr}"), "wrong", "n", dir.path());
    config.simulate_gpus = Some("1xT4".into());
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        flotilla_agent::run(config, std::future::pending()),
    )
    .await
    .unwrap();
    let err = result.unwrap_err();
    assert!(format!("{err:#}").contains("401"), "{err:#}");
    server.abort();
}

/// Under a node lease, a server that goes away for longer than the lease
/// gets the work stopped by the agent itself, before the lease ends; back,
/// the server hears it exited, and the agent never starts it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_stops_its_work_when_its_lease_runs_out() {
    let mock = Mock::default();
    let lease = Duration::from_millis(2_000);
    mock.with(|s| s.lease_ms = Some(lease.as_millis() as u64));
    let addr = free_addr();
    let server = mock.serve(addr).await;
    let a = assignment(41, "sleep 600");
    let a_id = a.instance_id.clone();
    mock.set_assignments(|v| v.push(a.clone()));
    let agent = RunningAgent::start(addr, "2xH100");
    mock.wait_for("a runs", Duration::from_secs(10), |s| {
        s.syncs
            .last()
            .and_then(|o| o.iter().find(|o| o.instance_id == a_id))
            .is_some_and(|o| pid_of(o).is_some())
    })
    .await;
    let pid = pid_of(&mock.latest(&a_id).unwrap()).unwrap();
    // Under a lease the long-poll is half the interval: syncs keep coming.
    let syncs = mock.with(|s| s.syncs.len());
    mock.wait_for("another sync", Duration::from_secs(10), |s| {
        s.syncs.len() > syncs
    })
    .await;

    server.abort();
    let cut = tokio::time::Instant::now();
    while !gone(pid) {
        assert!(
            cut.elapsed() < lease + Duration::from_secs(2),
            "the work outlived the node's lease"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stopped_after = cut.elapsed();
    // Not before a quarter lease before its end (the last sync may have
    // been sent up to half an interval before the cut).
    assert!(
        stopped_after >= lease / 4,
        "stopped too early: {stopped_after:?}"
    );

    let server = mock.serve(addr).await;
    mock.wait_for("its exit is reported", Duration::from_secs(20), |s| {
        s.syncs.last().is_some_and(|o| {
            o.iter()
                .any(|o| o.instance_id == a_id && matches!(o.phase, ObservedPhase::Exited { .. }))
        })
    })
    .await;
    // The server still lists it (it has not declared it lost yet): the
    // agent does not start it again.
    let later = mock.with(|s| s.syncs.len());
    mock.wait_for("a few more syncs", Duration::from_secs(20), |s| {
        s.syncs.len() >= later + 2
    })
    .await;
    assert!(matches!(
        mock.latest(&a_id).map(|o| o.phase),
        Some(ObservedPhase::Exited { .. })
    ));
    agent.stop().await;
    server.abort();
}

/// A busy answer renews the node's lease and asks for nothing: the agent
/// keeps its work running (it neither stops it for the lease nor takes the
/// answer's empty assignments as the node's), and its report lands once
/// the server takes it. It asks for busy answers only of a server that
/// said it gives them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_answer_keeps_the_lease_and_the_work() {
    let mock = Mock::default();
    let lease = Duration::from_millis(2_000);
    mock.with(|s| {
        s.lease_ms = Some(lease.as_millis() as u64);
        s.busy_answers = true;
    });
    let addr = free_addr();
    let server = mock.serve(addr).await;
    let a = assignment(43, "sleep 600");
    let a_id = a.instance_id.clone();
    mock.set_assignments(|v| v.push(a.clone()));
    let agent = RunningAgent::start(addr, "2xH100");
    mock.wait_for("a runs", Duration::from_secs(10), |s| {
        s.syncs
            .last()
            .and_then(|o| o.iter().find(|o| o.instance_id == a_id))
            .is_some_and(|o| pid_of(o).is_some())
    })
    .await;
    let pid = pid_of(&mock.latest(&a_id).unwrap()).unwrap();
    assert!(
        mock.with(|s| s.busy_ok.iter().all(|b| *b)),
        "a server that gives busy answers is asked for them"
    );

    // Busy for three leases: every answer renews the lease and carries no
    // assignment.
    mock.with(|s| s.busy = true);
    let busy_from = tokio::time::Instant::now();
    while busy_from.elapsed() < lease * 3 {
        assert!(
            !gone(pid),
            "the work stopped {:?} into busy answers",
            busy_from.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let busy = mock.with(|s| {
        s.busy = false;
        s.busy_syncs.clone()
    });
    // Each comes back after about 200 ms (spread over 100 to 300 ms):
    // many in three leases, never a storm.
    assert!(
        busy.len() >= 6 && busy.len() <= 100,
        "{} syncs in {:?} of busy answers",
        busy.len(),
        lease * 3
    );
    assert!(busy.iter().all(|b| *b));

    // Taken again: the same process reported running.
    let taken = mock.with(|s| s.syncs.len());
    mock.wait_for(
        "a sync taken after the busy ones",
        Duration::from_secs(10),
        |s| s.syncs.len() > taken,
    )
    .await;
    assert_eq!(pid_of(&mock.latest(&a_id).unwrap()), Some(pid));
    assert!(!gone(pid));
    agent.stop().await;
    server.abort();
}

/// An agent does not send `busy_ok` to a server that did not say it gives
/// busy answers (an older server refuses unknown fields).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_answers_are_asked_only_of_a_server_that_gives_them() {
    let mock = Mock::default();
    let addr = free_addr();
    let server = mock.serve(addr).await;
    let agent = RunningAgent::start(addr, "1xH100");
    mock.wait_for("two syncs", Duration::from_secs(20), |s| s.syncs.len() >= 2)
        .await;
    assert!(mock.with(|s| s.busy_ok.iter().all(|b| !*b)));
    agent.stop().await;
    server.abort();
}

#[tokio::test]
async fn agent_fails_over_to_the_next_server_url() {
    // Two replicas of one control plane: two listeners on one shared state,
    // as two servers on one database would be.
    let mock = Mock::default();
    let (a, b) = (free_addr(), free_addr());
    let first = mock.serve(a).await;
    let second = mock.serve(b).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = flotilla_agent::AgentConfig::new(
        format!("http://{a}, http://{b}/v1"),
        "secret",
        "node-ha",
        dir.path(),
    );
    config.simulate_gpus = Some("1xT4".into());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(flotilla_agent::run(config, async {
        let _ = stop_rx.await;
    }));
    mock.wait_for("a first sync", Duration::from_secs(20), |s| {
        !s.syncs.is_empty()
    })
    .await;

    // The first replica dies, dropping the long-poll: the agent carries on
    // with the second, without registering again.
    first.abort();
    let before = mock.with(|s| s.syncs.len());
    mock.wait_for(
        "a sync through the second URL",
        Duration::from_secs(30),
        |s| s.syncs.len() > before,
    )
    .await;
    assert_eq!(mock.with(|s| s.registrations.len()), 1);

    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(30), agent)
        .await
        .expect("agent stops")
        .unwrap()
        .unwrap();
    second.abort();
}
