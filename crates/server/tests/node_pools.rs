//! The node-pool loop on a manual clock over the simulated cloud (the same
//! `SimulatedCloud` the simulator drives): queued work that fits no node
//! grows the pool; the machine's agent joins with its one-time token and
//! registers; the work is placed there; the idle machine is drained and
//! terminated after the idle timeout and its key revoked; a spot machine
//! the cloud announces it will take back is cordoned, drained once its work
//! ends, and terminated. The agent is played through the agent protocol
//! (join, register, sync), the passes are run by the test.

use std::sync::{Arc, Mutex};
use std::time::Duration as StdDuration;

use chrono::{Duration, TimeZone, Utc};
use flotilla_backends::capacity::{
    CapacityError, CapacityProvider, InstanceType, InterruptionNotice, Machine, ProvisionDelay,
    ProvisionRequest, Quota, Region, RegionLimit, SimulatedCloud, SimulatedCloudConfig,
};
use flotilla_core::api::{DiscoveredGpu, ObservedInstance, ObservedPhase, RegisterNode};
use flotilla_core::catalog::Vendor;
use flotilla_core::clock::Clock;
use flotilla_core::node::RuntimeKind;
use flotilla_scale::nodepool::PoolBounds;
use flotilla_server::nodepools::{pass, NodePoolConfig, PoolStatus};
use flotilla_server::schedule::schedule_pass;
use flotilla_store::capacity::MachineState;
use flotilla_testkit::server::OnClock;
use futures::future::BoxFuture;
use reqwest::StatusCode;
use serde_json::{json, Value};

/// The simulated cloud, recording what it was asked (the join tokens a
/// real machine would find in its user data) and what it granted.
struct Recording {
    cloud: SimulatedCloud,
    asked: Mutex<Vec<ProvisionRequest>>,
    granted: Mutex<Vec<Machine>>,
}

impl CapacityProvider for Recording {
    fn kind(&self) -> &'static str {
        "simulated"
    }
    fn regions(&self) -> BoxFuture<'_, Result<Vec<Region>, CapacityError>> {
        self.cloud.regions()
    }
    fn instance_types(&self) -> BoxFuture<'_, Result<Vec<InstanceType>, CapacityError>> {
        self.cloud.instance_types()
    }
    fn quota<'a>(&'a self, region: &'a str) -> BoxFuture<'a, Result<Quota, CapacityError>> {
        self.cloud.quota(region)
    }
    fn provision<'a>(
        &'a self,
        now_ms: u64,
        req: &'a ProvisionRequest,
    ) -> BoxFuture<'a, Result<Machine, CapacityError>> {
        self.asked.lock().unwrap().push(req.clone());
        let got = self.cloud.provision_now(now_ms, req);
        if let Ok(m) = &got {
            self.granted.lock().unwrap().push(m.clone());
        }
        Box::pin(async move { got })
    }
    fn describe<'a>(
        &'a self,
        now_ms: u64,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Machine, CapacityError>> {
        self.cloud.describe(now_ms, id)
    }
    fn terminate<'a>(
        &'a self,
        now_ms: u64,
        id: &'a str,
    ) -> BoxFuture<'a, Result<(), CapacityError>> {
        self.cloud.terminate(now_ms, id)
    }
    fn interruptions(
        &self,
        now_ms: u64,
    ) -> BoxFuture<'_, Result<Vec<InterruptionNotice>, CapacityError>> {
        self.cloud.interruptions(now_ms)
    }
}

fn pool(provider: Arc<Recording>, spot: bool) -> NodePoolConfig {
    NodePoolConfig {
        name: "sim".into(),
        provider,
        instance_type: "2xH100".into(),
        gpu_model: "H100".into(),
        runtime: RuntimeKind::Process,
        bounds: PoolBounds {
            min: 0,
            max: 2,
            gpus_per_machine: 2,
            idle_timeout_ms: 60_000,
            boot_timeout_ms: 600_000,
        },
        spot,
        region: None,
        join_url: "http://127.0.0.1:7420".into(),
        join_fingerprint: None,
        join_ttl: StdDuration::from_secs(1800),
        status: Arc::new(Mutex::new(PoolStatus::default())),
    }
}

fn cloud(spot_lifetime_ms: u64) -> Arc<Recording> {
    Arc::new(Recording {
        cloud: SimulatedCloud::new(
            SimulatedCloudConfig {
                limits: vec![RegionLimit {
                    region: "sim-a".into(),
                    gpu: "H100".into(),
                    max_nodes: 4,
                }],
                gpus_per_node: 2,
                provision_delay: ProvisionDelay::fixed(30_000),
                spot_availability: 1.0,
                spot_mean_lifetime_ms: spot_lifetime_ms,
                spot_notice_ms: 120_000,
            },
            42,
        ),
        asked: Mutex::new(Vec::new()),
        granted: Mutex::new(Vec::new()),
    })
}

/// The machine's agent: joins with the token it was booted with and
/// registers under the name and pool the join gave. `(node id, key)`.
async fn join_and_register(live: &OnClock, token: &str) -> (String, String) {
    let (status, joined) = live
        .call(
            "",
            "POST",
            "/v1/agent/join",
            Some(json!({ "token": token })),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{joined}");
    assert_eq!(joined["pool"], "sim");
    let key = joined["agent_token"].as_str().unwrap().to_string();
    let name = joined["name"].as_str().unwrap().to_string();
    let req = RegisterNode {
        name: name.clone(),
        region: None,
        pool: Some("sim".into()),
        cpu_milli: 64_000,
        memory_mb: 512_000,
        simulated: true,
        gpus: (0..2)
            .map(|index| DiscoveredGpu {
                index,
                model: "H100".into(),
                uuid: format!("GPU-{name}-{index}"),
                memory_mib: 81920,
                vendor: Vendor::Nvidia,
                mig_mode: false,
            })
            .collect(),
        agent_version: "test".into(),
        runtime: RuntimeKind::Process,
        executor: Default::default(),
        running: Vec::new(),
        unenforced_limits: Vec::new(),
        network: None,
    };
    let (status, reg) = live
        .call(
            &key,
            "POST",
            "/v1/agent/register",
            Some(serde_json::to_value(req).unwrap()),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{reg}");
    (reg["node_id"].as_str().unwrap().to_string(), key)
}

/// The agent reports `instance` running, then exited with 0.
async fn exits(live: &OnClock, key: &str, node: &str, instance: &str) {
    for phase in [
        ObservedPhase::Running { pid: 4242 },
        ObservedPhase::Exited {
            code: 0,
            stopped: false,
        },
    ] {
        let observed = ObservedInstance {
            instance_id: serde_json::from_value(json!(instance)).unwrap(),
            phase,
            at: live.clock.now(),
            started_at: None,
            message: None,
            container: None,
            weights_tier: None,
            limit_exceeded: None,
        };
        let (status, body) = live
            .call(
                key,
                "POST",
                &format!("/v1/agent/nodes/{node}/sync"),
                Some(json!({"observed": [observed], "wait_ms": 0})),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
    }
    let state = instance_state(live, instance).await;
    assert_eq!(state, "succeeded");
}

async fn instance_state(live: &OnClock, id: &str) -> String {
    instance(live, id).await["state"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

async fn run_instance(live: &OnClock, gpus: u32) -> String {
    let (status, inst) = live
        .call(
            &live.operator,
            "POST",
            "/v1/instances",
            Some(json!({"gpus": gpus, "command": ["sleep", "3600"]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{inst}");
    inst["id"].as_str().unwrap().to_string()
}

async fn instance(live: &OnClock, id: &str) -> Value {
    live.call(&live.operator, "GET", &format!("/v1/instances/{id}"), None)
        .await
        .1
}

#[tokio::test]
async fn the_pool_grows_for_queued_work_and_gives_back_an_idle_machine() {
    let live = OnClock::new(Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap()).await;
    let cloud = cloud(3_600_000);
    let p = pool(cloud.clone(), false);
    let store = live.st.store().clone();

    // Nothing queued: nothing asked.
    let d = pass(&live.st, &p).await.unwrap();
    assert_eq!((d.provision, d.reason.as_str()), (0, "steady"));

    let id = run_instance(&live, 2).await;
    schedule_pass(&live.st).await.unwrap();
    assert_eq!(instance(&live, &id).await["state"], "pending");
    let d = pass(&live.st, &p).await.unwrap();
    assert_eq!(d.provision, 1, "{}", d.reason);
    assert_eq!(cloud.cloud.live_nodes(), 1);
    // The next pass counts the booting machine: no second one.
    assert_eq!(pass(&live.st, &p).await.unwrap().provision, 0);
    assert_eq!(cloud.cloud.live_nodes(), 1);

    let asked = cloud.asked.lock().unwrap()[0].clone();
    let token = asked.join.as_ref().unwrap().token.clone();
    assert_eq!(asked.instance_type, "2xH100");
    let machine = store.pool_machine(&asked.name).await.unwrap();
    assert_eq!(machine.state, MachineState::Booting);

    // The machine boots and its agent joins once.
    live.clock.advance(Duration::seconds(30));
    let (node, key) = join_and_register(&live, &token).await;
    let (status, again) = live
        .call(
            "",
            "POST",
            "/v1/agent/join",
            Some(json!({ "token": token })),
        )
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(
        again["error"]["message"]
            .as_str()
            .unwrap()
            .contains("already used"),
        "{again}"
    );
    pass(&live.st, &p).await.unwrap();
    assert_eq!(
        store.pool_machine(&asked.name).await.unwrap().state,
        MachineState::Joined
    );

    // The work lands there; the busy machine is not idle.
    schedule_pass(&live.st).await.unwrap();
    let inst = instance(&live, &id).await;
    assert_eq!(inst["node_id"], node.as_str(), "{inst}");
    pass(&live.st, &p).await.unwrap();
    assert_eq!(
        store.pool_machine(&asked.name).await.unwrap().idle_since,
        None
    );

    // It ends; the machine is idle from the next pass, and given back one
    // idle timeout later, not before.
    exits(&live, &key, &node, &id).await;
    pass(&live.st, &p).await.unwrap();
    let idle_from = store
        .pool_machine(&asked.name)
        .await
        .unwrap()
        .idle_since
        .unwrap();
    assert_eq!(idle_from, live.clock.now());
    live.clock.advance(Duration::seconds(59));
    let d = pass(&live.st, &p).await.unwrap();
    assert!(d.terminate.is_empty(), "{}", d.reason);
    live.clock.advance(Duration::seconds(1));
    let d = pass(&live.st, &p).await.unwrap();
    assert_eq!(d.terminate.len(), 1, "{}", d.reason);
    assert_eq!(cloud.cloud.live_nodes(), 0, "terminated at the provider");
    let m = store.pool_machine(&asked.name).await.unwrap();
    assert_eq!(
        (m.state, m.reason.as_deref()),
        (MachineState::Terminated, Some("idle"))
    );
    let (_, n) = live
        .call(&live.operator, "GET", &format!("/v1/nodes/{node}"), None)
        .await;
    assert_eq!(n["cordoned"], true, "drained");
    // Its key went with it.
    let (status, _) = live
        .call(
            &key,
            "POST",
            &format!("/v1/agent/nodes/{node}/sync"),
            Some(json!({"observed": [], "wait_ms": 0})),
        )
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (_, pools) = live
        .call(&live.operator, "GET", "/v1/node-pools", None)
        .await;
    assert_eq!(
        pools,
        json!([]),
        "this state has no configured pools: {pools}"
    );
}

#[tokio::test]
async fn a_spot_interruption_drains_the_machine_and_gives_it_back() {
    let live = OnClock::new(Utc.with_ymd_and_hms(2026, 1, 1, 0, 0, 0).unwrap()).await;
    let cloud = cloud(600_000);
    let p = pool(cloud.clone(), true);
    let store = live.st.store().clone();

    let id = run_instance(&live, 1).await;
    schedule_pass(&live.st).await.unwrap();
    assert_eq!(pass(&live.st, &p).await.unwrap().provision, 1);
    let granted = cloud.granted.lock().unwrap()[0].clone();
    assert!(granted.spot);
    let preempt_at = granted.preempt_at_ms.unwrap();
    let asked = cloud.asked.lock().unwrap()[0].clone();
    let (node, key) = join_and_register(&live, &asked.join.unwrap().token).await;
    pass(&live.st, &p).await.unwrap();
    schedule_pass(&live.st).await.unwrap();
    assert_eq!(instance(&live, &id).await["node_id"], node.as_str());

    // The cloud's notice comes 120 s ahead: the node is cordoned and the
    // machine drains while its work still runs.
    let now_ms = u64::try_from(live.clock.now().timestamp_millis()).unwrap();
    let to_notice = preempt_at.saturating_sub(120_000).saturating_sub(now_ms);
    live.clock
        .advance(Duration::milliseconds(i64::try_from(to_notice).unwrap()));
    pass(&live.st, &p).await.unwrap();
    let m = store.pool_machine(&asked.name).await.unwrap();
    assert_eq!(m.state, MachineState::Draining);
    assert!(m.reason.unwrap().starts_with("spot interruption"));
    let (_, n) = live
        .call(&live.operator, "GET", &format!("/v1/nodes/{node}"), None)
        .await;
    assert_eq!(n["cordoned"], true);
    assert_eq!(cloud.cloud.live_nodes(), 1, "still running its work");

    // The work ends: the drained machine is given back.
    exits(&live, &key, &node, &id).await;
    pass(&live.st, &p).await.unwrap();
    let m = store.pool_machine(&asked.name).await.unwrap();
    assert_eq!(
        (m.state, m.reason.as_deref()),
        (MachineState::Terminated, Some("drained"))
    );
    assert_eq!(cloud.cloud.live_nodes(), 0);
}
