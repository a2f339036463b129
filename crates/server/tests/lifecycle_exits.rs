//! Every lifecycle state has an exit (issue 25), as a property over the
//! state machine: from each state an instance can reach through the API
//! and the agent protocol (pending, scheduled, starting, running, lost),
//! a stop request, followed by whatever its node's agent does (nothing,
//! ever; syncing without a word about it; restarting; reporting the exit
//! late; reporting it running, then its exit), ends it in a final state
//! within a bound of control passes on a manual clock, with its GPU free:
//! the node's view shows no holder, and once its agent is back a new
//! one-GPU instance is placed on the single-GPU node.
//!
//! The cases are enumerated exhaustively (states × behaviours × delays),
//! each on a fresh server, so a failure names its case and replays alike.

use chrono::{Duration, TimeZone, Utc};
use flotilla_core::api::{ObservedInstance, ObservedPhase};
use flotilla_core::clock::Clock;
use flotilla_core::instance::InstanceState;
use flotilla_server::reconcile::liveness_pass;
use flotilla_server::schedule::schedule_pass;
use flotilla_testkit::server::{registration, OnClock};
use serde_json::{json, Value};

/// Where the instance stands when the stop is asked.
#[derive(Debug, Clone, Copy)]
enum Start {
    Pending,
    Scheduled,
    Starting,
    Running,
    /// Its node went silent past its lease: `lost`.
    Lost,
}

/// What the node's agent does after the stop.
#[derive(Debug, Clone, Copy)]
enum Agent {
    /// Never syncs again (until the check at the end).
    Silent,
    /// Syncs every step, reporting nothing about the instance.
    SyncsNothing,
    /// Registers afresh (it lost track of what it ran), then syncs every
    /// step reporting nothing.
    Restarts,
    /// Keeps reporting what it last saw for `n` steps, then the exit.
    ReportsLate(u32),
    /// Reports the instance running once, then its exit.
    RunningThenExit,
}

/// Seconds of manual time per step: one heartbeat interval by default.
const STEP_S: i64 = 5;
/// Steps within which the instance must be final: ten node leases.
const BOUND: u32 = 30;

struct Case {
    on: OnClock,
    provider: String,
    member: String,
    node: String,
}

impl Case {
    async fn new() -> Self {
        let t0 = Utc.with_ymd_and_hms(2026, 6, 1, 0, 0, 0).unwrap();
        let on = OnClock::new(t0).await;
        let op = on.operator.clone();
        let t = on
            .ok(&op, "POST", "/v1/tenants", Some(json!({"name": "lab"})))
            .await;
        let provider = on.key(&t["id"], "provider").await;
        let member = on.key(&t["id"], "tenant_member").await;
        let node = on.register_node(&provider, "n1", &[("H100", 1)]).await;
        Case {
            on,
            provider,
            member,
            node,
        }
    }

    /// The agent's sync reporting `observed` (instance, phase) now.
    async fn sync(&self, observed: &[(&str, ObservedPhase)]) -> Value {
        let observed: Vec<ObservedInstance> = observed
            .iter()
            .map(|(id, phase)| ObservedInstance {
                instance_id: serde_json::from_value(json!(id)).unwrap(),
                phase: phase.clone(),
                at: self.on.clock.now(),
                started_at: None,
                message: None,
                container: None,
                weights_tier: None,
                limit_exceeded: None,
            })
            .collect();
        self.on
            .ok(
                &self.provider,
                "POST",
                &format!("/v1/agent/nodes/{}/sync", self.node),
                Some(json!({"observed": observed, "wait_ms": 0})),
            )
            .await
    }

    async fn create(&self) -> String {
        let i = self
            .on
            .ok(
                &self.member,
                "POST",
                "/v1/instances",
                Some(json!({"gpus": 1, "command": ["train"]})),
            )
            .await;
        i["id"].as_str().unwrap().to_string()
    }

    async fn state(&self, id: &str) -> InstanceState {
        let op = self.on.operator.clone();
        let i = self
            .on
            .ok(&op, "GET", &format!("/v1/instances/{id}"), None)
            .await;
        InstanceState::parse(i["state"].as_str().unwrap()).unwrap()
    }

    /// The control passes, as the leader runs them.
    async fn passes(&self) {
        flotilla_server::jobs::jobs_pass(&self.on.st)
            .await
            .expect("a jobs pass");
        schedule_pass(&self.on.st).await.expect("a placement pass");
        liveness_pass(&self.on.st).await.expect("a liveness pass");
    }

    fn advance(&self) {
        self.on.clock.advance(Duration::seconds(STEP_S));
    }
}

/// One case: the instance brought to `start`, stopped, its agent doing
/// `agent`; panics naming the case unless the property holds.
async fn case(start: Start, agent: Agent) -> u32 {
    let c = Case::new().await;
    let id = c.create().await;
    let running = ObservedPhase::Running { pid: 7 };
    // What the agent last saw of the instance, if anything.
    let mut seen: Option<ObservedPhase> = None;
    match start {
        Start::Pending => {}
        Start::Scheduled => c.passes().await,
        Start::Starting => {
            c.passes().await;
            c.sync(&[(&id, ObservedPhase::Starting)]).await;
            seen = Some(ObservedPhase::Starting);
        }
        Start::Running | Start::Lost => {
            c.passes().await;
            c.sync(&[(&id, running.clone())]).await;
            seen = Some(running.clone());
        }
    }
    if let Start::Lost = start {
        // Silent past the lease and its margin: lost.
        for _ in 0..6 {
            c.advance();
            c.passes().await;
        }
    }
    let want = match start {
        Start::Pending => InstanceState::Pending,
        Start::Scheduled => InstanceState::Scheduled,
        Start::Starting => InstanceState::Starting,
        Start::Running => InstanceState::Running,
        Start::Lost => InstanceState::Lost,
    };
    assert_eq!(c.state(&id).await, want, "{start:?}: the starting state");

    c.on.ok(&c.member, "POST", &format!("/v1/instances/{id}/stop"), None)
        .await;

    let stopped = ObservedPhase::Exited {
        code: 143,
        stopped: true,
    };
    let mut steps = 0;
    while !c.state(&id).await.is_terminal() {
        assert!(
            steps < BOUND,
            "{start:?} then {agent:?}: still {:?} after {BOUND} steps of {STEP_S} s",
            c.state(&id).await
        );
        c.advance();
        match agent {
            Agent::Silent => {}
            Agent::SyncsNothing => {
                c.sync(&[]).await;
            }
            Agent::Restarts => {
                if steps == 0 {
                    let body = serde_json::to_value(registration(
                        "n1",
                        &[("H100", 1)],
                        Default::default(),
                    ))
                    .unwrap();
                    let r =
                        c.on.ok(&c.provider, "POST", "/v1/agent/register", Some(body))
                            .await;
                    assert_eq!(r["node_id"], json!(c.node), "the same node, re-attached");
                }
                c.sync(&[]).await;
            }
            Agent::ReportsLate(n) => {
                if steps < n {
                    match &seen {
                        Some(p) => c.sync(&[(&id, p.clone())]).await,
                        None => c.sync(&[]).await,
                    };
                } else {
                    c.sync(&[(&id, stopped.clone())]).await;
                }
            }
            Agent::RunningThenExit => {
                if steps == 0 {
                    c.sync(&[(&id, running.clone())]).await;
                    seen = Some(running.clone());
                } else {
                    c.sync(&[(&id, stopped.clone())]).await;
                }
            }
        }
        c.passes().await;
        steps += 1;
    }

    // Its GPU is free: nobody holds it in the node's view...
    let op = c.on.operator.clone();
    let node =
        c.on.ok(&op, "GET", &format!("/v1/nodes/{}", c.node), None)
            .await;
    for g in node["gpus"].as_array().unwrap() {
        assert!(
            g.get("instance_id").is_none() && g["used_milli"] == 0,
            "{start:?} then {agent:?}: final, and still holding {g}"
        );
    }
    // ...and, its agent back (reporting nothing), a new instance is
    // placed on that single GPU while the old one stays final.
    c.advance();
    c.sync(&[]).await;
    let next = c.create().await;
    c.passes().await;
    assert_eq!(
        c.state(&next).await,
        InstanceState::Scheduled,
        "{start:?} then {agent:?}: the GPU is placed again"
    );
    assert!(c.state(&id).await.is_terminal());
    steps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_every_state_a_stop_ends_the_instance_and_frees_its_gpu() {
    let began = std::time::Instant::now();
    let starts = [
        Start::Pending,
        Start::Scheduled,
        Start::Starting,
        Start::Running,
        Start::Lost,
    ];
    let mut agents = vec![
        Agent::Silent,
        Agent::SyncsNothing,
        Agent::Restarts,
        Agent::RunningThenExit,
    ];
    agents.extend((0..4).map(Agent::ReportsLate));
    let mut cases = 0;
    let mut longest = 0;
    let mut failed = Vec::new();
    for start in starts {
        for agent in agents.iter().copied() {
            // Each case in its own task, so one failure does not hide
            // the others: all failing cases are named at the end.
            match tokio::spawn(case(start, agent)).await {
                Ok(steps) => longest = longest.max(steps),
                Err(e) => failed.push(format!("{start:?} then {agent:?}: {e}")),
            }
            cases += 1;
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {cases} cases fail:\n{}",
        failed.len(),
        failed.join("\n")
    );
    println!(
        "{cases} cases, each final within {longest} steps of {STEP_S} s, in {:?}",
        began.elapsed()
    );
}
