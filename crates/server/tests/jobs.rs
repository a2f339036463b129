//! Jobs over real HTTP with a fake agent per node: a gang is placed whole
//! across two nodes or not at all, a failing member stops the others and
//! the gang restarts until it succeeds or its retries run out, cancel
//! stops every member, and a tier-1 instance preempting one member
//! requeues the whole job.

use std::time::Duration;

use flotilla_core::api::ObservedPhase;
use flotilla_testkit::server::{fast, TestServer};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

struct Server(TestServer);

impl std::ops::Deref for Server {
    type Target = TestServer;
    fn deref(&self) -> &TestServer {
        &self.0
    }
}

/// A server, a tenant's member key, a provider key and `nodes` nodes of
/// `gpus` H100s each.
async fn setup(nodes: u32, gpus: u32) -> (Server, String, String, Vec<String>) {
    let s = Server(flotilla_testkit::server::start(fast()).await);
    let t = s.create_tenant("trainers").await;
    let key = s.key(&t, "tenant_member").await;
    let provider = s.key(&t, "provider").await;
    let mut ids = Vec::new();
    for n in 0..nodes {
        ids.push(
            s.register_node(&provider, &format!("n{n}"), &[("H100", gpus)])
                .await,
        );
    }
    (s, key, provider, ids)
}

impl Server {
    async fn submit(&self, key: &str, body: Value) -> String {
        let (status, b) = self.call(key, Method::POST, "/v1/jobs", Some(body)).await;
        assert_eq!(status, StatusCode::CREATED, "{b}");
        b["id"].as_str().unwrap().to_string()
    }

    /// Submits a job, waits for it to be placed and reports every member
    /// of its first attempt running, as its agents would; its id and state.
    async fn start_job(&self, key: &str, provider: &str, body: Value) -> (String, Value) {
        let id = self.submit(key, body).await;
        let j = self
            .wait_job(key, &id, "running", |j| j["state"] == "running")
            .await;
        let ranks = j["spec"]["nodes"].as_u64().expect("spec.nodes") as usize;
        for r in 0..ranks {
            self.report(provider, &j, r, running()).await;
        }
        (id, j)
    }

    async fn job(&self, key: &str, id: &str) -> Value {
        self.ok(key, Method::GET, &format!("/v1/jobs/{id}"), None)
            .await
    }

    async fn wait_job(
        &self,
        key: &str,
        id: &str,
        what: &str,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        for _ in 0..200 {
            let j = self.job(key, id).await;
            if pred(&j) {
                return j;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("{id} never {what}: {}", self.job(key, id).await);
    }

    /// Reports `phase` for `member` from the node it runs on.
    async fn report(&self, provider: &str, job: &Value, rank: usize, phase: ObservedPhase) {
        let m = current(job, rank);
        let node = m["node_id"].as_str().unwrap().to_string();
        let id = m["instance_id"].as_str().unwrap().to_string();
        self.sync(provider, &node, vec![(id, phase)]).await;
    }

    async fn instance(&self, key: &str, id: &str) -> Value {
        self.ok(key, Method::GET, &format!("/v1/instances/{id}"), None)
            .await
    }
}

/// The member of the job's current attempt at `rank`.
fn current(job: &Value, rank: usize) -> Value {
    let attempt = job["attempts"].as_u64().unwrap();
    job["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["attempt"].as_u64() == Some(attempt) && m["rank"].as_u64() == Some(rank as u64))
        .unwrap_or_else(|| panic!("no rank {rank} in attempt {attempt}: {job}"))
        .clone()
}

fn running() -> ObservedPhase {
    ObservedPhase::Running { pid: 7 }
}

fn exited(code: i32, stopped: bool) -> ObservedPhase {
    ObservedPhase::Exited { code, stopped }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gang_is_placed_whole_across_two_nodes_or_not_at_all() {
    let (s, key, provider, nodes) = setup(2, 1).await;

    // Validation names the field.
    for (body, field) in [
        (json!({"gpus": 3, "nodes": 2, "command": ["x"]}), "gpus"),
        (json!({"gpus": 2, "nodes": 0, "command": ["x"]}), "nodes"),
        (
            json!({"gpus": 1, "command": ["x"], "restart_policy": "never", "max_retries": 2}),
            "max_retries",
        ),
        (
            json!({"gpus": 1, "command": ["x"], "env": {"FLOTILLA_JOB_RANK": "3"}}),
            "env.FLOTILLA_JOB_RANK",
        ),
    ] {
        let (status, b) = s.call(&key, Method::POST, "/v1/jobs", Some(body)).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
        assert_eq!(b["error"]["details"]["field"], field, "{b}");
    }

    // Two members of 2 GPUs each fit on no pair of 1-GPU nodes: nothing is
    // placed, not even one member, and the queue says why: never in this
    // pool, naming the field.
    let big = s
        .submit(&key, json!({"gpus": 4, "nodes": 2, "command": ["train"]}))
        .await;
    let j = s
        .wait_job(&key, &big, "explained", |j| {
            j["state_reason"].as_str().unwrap_or("").contains(
                "unschedulable in this pool: gpus: asks 2 GPUs on one machine; the most any machine here has is 1",
            )
        })
        .await;
    assert_eq!(j["state"], "queued");
    assert!(j["members"].as_array().unwrap().is_empty(), "{j}");
    let q = s.ok(&key, Method::GET, "/v1/jobs/queue", None).await;
    assert_eq!(q["items"][0]["job"]["id"], big.as_str(), "{q}");
    assert_eq!(q["items"][0]["position"], 1);
    assert!(
        q["items"][0]["job"]["state_reason"]
            .as_str()
            .unwrap()
            .contains("unschedulable in this pool"),
        "{q}"
    );
    for n in &nodes {
        assert!(s.sync(&provider, n, vec![]).await.is_empty());
    }
    let c = s
        .ok(&key, Method::POST, &format!("/v1/jobs/{big}/cancel"), None)
        .await;
    assert_eq!(c["state"], "cancelled");
    let (status, _) = s
        .call(&key, Method::POST, &format!("/v1/jobs/{big}/cancel"), None)
        .await;
    assert_eq!(status, StatusCode::CONFLICT);

    // One GPU per member: placed across both nodes at once.
    let id = s
        .submit(
            &key,
            json!({"gpus": 2, "nodes": 2, "command": ["train"], "env": {"LR": "0.1"}}),
        )
        .await;
    let j = s
        .wait_job(&key, &id, "running", |j| j["state"] == "running")
        .await;
    assert_eq!(j["attempts"], 1);
    let mut placed: Vec<String> = (0..2)
        .map(|r| current(&j, r)["node_id"].as_str().unwrap().to_string())
        .collect();
    placed.sort();
    let mut all = nodes.clone();
    all.sort();
    assert_eq!(placed, all);
    // Each node's agent gets its rank with the job's variables.
    let mut ranks = Vec::new();
    for n in &nodes {
        let a = s.sync(&provider, n, vec![]).await;
        assert_eq!(a.len(), 1, "{a:?}");
        let env = &a[0]["env"];
        assert_eq!(env["FLOTILLA_JOB_ID"], id.as_str());
        assert_eq!(env["FLOTILLA_JOB_WORLD_SIZE"], "2");
        assert_eq!(env["FLOTILLA_JOB_ATTEMPT"], "1");
        assert_eq!(
            env["FLOTILLA_JOB_NODES"]
                .as_str()
                .unwrap()
                .split(',')
                .count(),
            2
        );
        assert_eq!(env["LR"], "0.1");
        ranks.push(env["FLOTILLA_JOB_RANK"].as_str().unwrap().to_string());
    }
    ranks.sort();
    assert_eq!(ranks, vec!["0", "1"]);
    // The members are instances of the tenant, tagged with the job.
    let m = s
        .instance(&key, current(&j, 1)["instance_id"].as_str().unwrap())
        .await;
    assert_eq!(m["job"]["job_id"], id.as_str());
    assert_eq!(
        (m["job"]["rank"].as_u64(), m["gpus"].as_u64()),
        (Some(1), Some(1))
    );
    // Both run, both exit 0: the job succeeded.
    for r in 0..2 {
        s.report(&provider, &j, r, running()).await;
    }
    s.report(&provider, &j, 0, exited(0, false)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        s.job(&key, &id).await["state"],
        "running",
        "rank 0 finishing first stops nothing"
    );
    s.report(&provider, &j, 1, exited(0, false)).await;
    let j = s
        .wait_job(&key, &id, "succeeded", |j| j["state"] == "succeeded")
        .await;
    assert!(j["finished_at"].is_string());
    let listed = s
        .ok(&key, Method::GET, "/v1/jobs?state=succeeded", None)
        .await;
    assert_eq!(listed["items"].as_array().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_member_stops_the_gang_which_restarts_until_it_succeeds_or_runs_out() {
    let (s, key, provider, _) = setup(2, 1).await;
    let (id, j) = s.start_job(&key, &provider, json!({"gpus": 2, "nodes": 2, "command": ["train"], "restart_policy": "on_failure", "max_retries": 1})).await;
    // Rank 1 fails: rank 0 is told to stop.
    s.report(&provider, &j, 1, exited(3, false)).await;
    let r0 = current(&j, 0)["instance_id"].as_str().unwrap().to_string();
    for _ in 0..200 {
        if s.instance(&key, &r0).await["stop_requested"] == true {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // The job loop stops the members, then notes why: wait for the note.
    let j1 = s
        .wait_job(&key, &id, "explained", |j| {
            j["state_reason"]
                .as_str()
                .is_some_and(|r| r.contains("rank 1 failed (exit code 3)"))
        })
        .await;
    assert_eq!(j1["state"], "running", "{j1}");
    s.report(&provider, &j, 0, exited(143, true)).await;
    // The gang is placed again as attempt 2, with one failure counted.
    let j = s
        .wait_job(&key, &id, "restarted", |j| {
            j["state"] == "running" && j["attempts"] == 2
        })
        .await;
    assert_eq!(j["failures"], 1);
    let events: Vec<&str> = j["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["reason"].as_str().unwrap())
        .collect();
    assert!(
        events.iter().any(|e| e.contains("retry 1 of 1")),
        "{events:?}"
    );
    let m = s
        .instance(&key, current(&j, 0)["instance_id"].as_str().unwrap())
        .await;
    assert_eq!(m["env"]["FLOTILLA_JOB_ATTEMPT"], "2");
    // This time rank 0 fails; no retries are left: the job fails.
    for r in 0..2 {
        s.report(&provider, &j, r, running()).await;
    }
    s.report(&provider, &j, 0, exited(1, false)).await;
    let r1 = current(&j, 1)["instance_id"].as_str().unwrap().to_string();
    for _ in 0..200 {
        if s.instance(&key, &r1).await["stop_requested"] == true {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    s.report(&provider, &j, 1, exited(143, true)).await;
    let j = s
        .wait_job(&key, &id, "failed", |j| j["state"] == "failed")
        .await;
    assert_eq!(
        (j["attempts"].as_u64(), j["failures"].as_u64()),
        (Some(2), Some(1))
    );
    assert!(
        j["state_reason"]
            .as_str()
            .unwrap()
            .contains("no retries left"),
        "{j}"
    );

    // Restart then success.
    let id = s
        .submit(
            &key,
            json!({"gpus": 2, "nodes": 2, "command": ["train"], "restart_policy": "on_failure"}),
        )
        .await;
    let j = s
        .wait_job(&key, &id, "running", |j| j["state"] == "running")
        .await;
    s.report(&provider, &j, 0, exited(1, false)).await;
    s.report(&provider, &j, 1, exited(1, false)).await;
    let j = s
        .wait_job(&key, &id, "restarted", |j| {
            j["state"] == "running" && j["attempts"] == 2
        })
        .await;
    for r in 0..2 {
        s.report(&provider, &j, r, exited(0, false)).await;
    }
    let j = s
        .wait_job(&key, &id, "succeeded", |j| j["state"] == "succeeded")
        .await;
    assert_eq!(
        (j["attempts"].as_u64(), j["failures"].as_u64()),
        (Some(2), Some(1))
    );
    assert_eq!(j["members"].as_array().unwrap().len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_every_member() {
    let (s, key, provider, _) = setup(2, 1).await;
    let (id, j) = s
        .start_job(
            &key,
            &provider,
            json!({"gpus": 2, "nodes": 2, "command": ["train"]}),
        )
        .await;
    let c = s
        .ok(&key, Method::POST, &format!("/v1/jobs/{id}/cancel"), None)
        .await;
    assert_eq!(
        (c["state"].as_str(), c["cancel_requested"].as_bool()),
        (Some("running"), Some(true))
    );
    for r in 0..2 {
        let m = current(&j, r)["instance_id"].as_str().unwrap().to_string();
        for _ in 0..200 {
            if s.instance(&key, &m).await["stop_requested"] == true {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(s.instance(&key, &m).await["stop_requested"], true);
        s.report(&provider, &j, r, exited(143, true)).await;
    }
    let j = s
        .wait_job(&key, &id, "cancelled", |j| j["state"] == "cancelled")
        .await;
    assert_eq!(j["attempts"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preempting_one_member_requeues_the_whole_job() {
    let (s, key, provider, _) = setup(2, 1).await;
    let t2 = s.create_tenant("serving").await;
    let dedicated = s.key(&t2, "tenant_member").await;
    let (id, j) = s
        .start_job(
            &key,
            &provider,
            json!({"gpus": 2, "nodes": 2, "command": ["train"], "billing_class": "spot"}),
        )
        .await;
    let (status, b) = s
        .call(
            &dedicated,
            Method::POST,
            "/v1/instances",
            Some(json!({"gpus": 1, "command": ["serve"]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{b}");
    let first = b["id"].as_str().unwrap().to_string();
    // Both members get the notice, though the tier-1 instance needs one GPU.
    for r in 0..2 {
        let m = current(&j, r)["instance_id"].as_str().unwrap().to_string();
        let mut i = Value::Null;
        for _ in 0..200 {
            i = s.instance(&key, &m).await;
            if i["stop_requested"] == true {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(i["preempted_by"], first.as_str(), "{i}");
        assert_eq!(i["state"], "running", "runs through its notice: {i}");
    }
    for r in 0..2 {
        s.report(&provider, &j, r, exited(143, true)).await;
    }
    let j = s
        .wait_job(&key, &id, "requeued", |j| j["state"] == "queued")
        .await;
    assert_eq!(
        (j["attempts"].as_u64(), j["failures"].as_u64()),
        (Some(1), Some(0))
    );
    let requeued = j["events"].as_array().unwrap().iter().any(|e| {
        e["state"] == "queued" && e["reason"] == format!("preempted by {first}; requeued whole")
    });
    assert!(requeued, "{j}");
    // No member was requeued on its own.
    let pending = s
        .ok(&key, Method::GET, "/v1/instances?state=pending", None)
        .await;
    assert!(pending["items"].as_array().unwrap().is_empty(), "{pending}");
    // The tier-1 instance gets a GPU; the job waits for both.
    for _ in 0..200 {
        if s.instance(&dedicated, &first).await["state"] == "scheduled" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(s.instance(&dedicated, &first).await["state"], "scheduled");
    let j = s
        .wait_job(&key, &id, "explained", |j| {
            j["state_reason"]
                .as_str()
                .unwrap_or("")
                .contains("waiting for GPUs")
        })
        .await;
    assert_eq!(j["state"], "queued");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gang_kept_in_one_region_lands_there_or_says_why_not() {
    let s = Server(flotilla_testkit::server::start(fast()).await);
    let t = s.create_tenant("regional").await;
    let key = s.key(&t, "tenant_member").await;
    let provider = s.key(&t, "provider").await;
    let mut nodes = Vec::new();
    for (name, region) in [("eu1", "eu"), ("us1", "us"), ("us2", "us")] {
        let body = json!({
            "name": name, "region": region, "cpu_milli": 64000, "memory_mb": 512000,
            "simulated": true, "agent_version": "test",
            "gpus": [{"index": 0, "model": "H100", "uuid": format!("GPU-{name}"), "memory_mib": 81920, "vendor": "nvidia"}],
        });
        let r = s
            .ok(&provider, Method::POST, "/v1/agent/register", Some(body))
            .await;
        nodes.push(r["node_id"].as_str().unwrap().to_string());
    }
    let too_big = s
        .submit(
            &key,
            json!({"gpus": 3, "nodes": 3, "command": ["x"], "locality": "same_region"}),
        )
        .await;
    let j = s
        .wait_job(&key, &too_big, "explained", |j| {
            j["state_reason"].as_str().unwrap_or("").contains("region")
        })
        .await;
    assert!(
        j["state_reason"]
            .as_str()
            .unwrap()
            .contains("fits in no single region"),
        "{j}"
    );
    // It could never fit, so it holds nothing: the next job is not kept
    // waiting behind it.
    let id = s
        .submit(
            &key,
            json!({"gpus": 2, "nodes": 2, "command": ["x"], "locality": "same_region"}),
        )
        .await;
    let j = s
        .wait_job(&key, &id, "running", |j| j["state"] == "running")
        .await;
    assert_eq!(j["spec"]["locality"], "same_region");
    let mut placed: Vec<String> = (0..2)
        .map(|r| current(&j, r)["node_id"].as_str().unwrap().to_string())
        .collect();
    placed.sort();
    let mut us = nodes[1..].to_vec();
    us.sort();
    assert_eq!(placed, us, "both ranks in us: {j}");
    assert_eq!(s.job(&key, &too_big).await["state"], "queued");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemption_spares_a_gang_when_a_lone_instance_makes_room() {
    // Three one-GPU machines: the gang's two members need two of them.
    let (s, key, provider, _) = setup(3, 1).await;
    let t2 = s.create_tenant("serving").await;
    let dedicated = s.key(&t2, "tenant_member").await;
    // An older spot instance (more GPU time lost if preempted)...
    let (status, b) = s
        .call(
            &key,
            Method::POST,
            "/v1/instances",
            Some(json!({"gpus": 1, "command": ["x"], "billing_class": "spot"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{b}");
    let lone = b["id"].as_str().unwrap().to_string();
    let mut placed = Value::Null;
    for _ in 0..200 {
        placed = s.instance(&key, &lone).await;
        if placed["state"] == "scheduled" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let its_node = placed["node_id"].as_str().unwrap().to_string();
    s.sync(&provider, &its_node, vec![(lone.clone(), running())])
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // ...and a younger spot gang fill the node.
    let (_, j) = s
        .start_job(
            &key,
            &provider,
            json!({"gpus": 2, "nodes": 2, "command": ["train"], "billing_class": "spot"}),
        )
        .await;
    let (status, b) = s
        .call(
            &dedicated,
            Method::POST,
            "/v1/instances",
            Some(json!({"gpus": 1, "command": ["serve"]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{b}");
    let mut l = Value::Null;
    for _ in 0..200 {
        l = s.instance(&key, &lone).await;
        if l["stop_requested"] == true {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(
        l["stop_requested"], true,
        "the lone instance is the victim: {l}"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    for r in 0..2 {
        let m = s
            .instance(&key, current(&j, r)["instance_id"].as_str().unwrap())
            .await;
        assert_eq!(m["stop_requested"], false, "the gang is spared: {m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_one_job_preempts_spot_work_on_every_node_it_needs() {
    let (s, key, provider, nodes) = setup(2, 1).await;
    let t2 = s.create_tenant("spotty").await;
    let spot = s.key(&t2, "tenant_member").await;
    let mut victims = Vec::new();
    for _ in 0..2 {
        let (status, b) = s
            .call(
                &spot,
                Method::POST,
                "/v1/instances",
                Some(json!({"gpus": 1, "command": ["x"], "billing_class": "spot"})),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED, "{b}");
        victims.push(b["id"].as_str().unwrap().to_string());
    }
    let mut on = Vec::new();
    for v in &victims {
        let mut i = Value::Null;
        for _ in 0..200 {
            i = s.instance(&spot, v).await;
            if i["state"] == "scheduled" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let node = i["node_id"].as_str().unwrap().to_string();
        s.sync(&provider, &node, vec![(v.clone(), running())]).await;
        on.push(node);
    }
    on.sort();
    let mut all = nodes.clone();
    all.sort();
    assert_eq!(on, all, "one spot instance per node");

    // A tier-1 job of two members needs both nodes: both are preempted
    // for it, named by the job.
    let id = s
        .submit(&key, json!({"gpus": 2, "nodes": 2, "command": ["train"]}))
        .await;
    for v in &victims {
        let mut i = Value::Null;
        for _ in 0..200 {
            i = s.instance(&spot, v).await;
            if i["stop_requested"] == true {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(i["preempted_by"], id.as_str(), "{i}");
    }
    let j = s
        .wait_job(&key, &id, "waiting", |j| {
            j["state_reason"]
                .as_str()
                .unwrap_or("")
                .starts_with("waiting for preempted instances to stop")
        })
        .await;
    assert_eq!(j["state"], "queued");
    // One victim stops: its GPU is promised to the job, which still needs
    // the other; the requeued spot work cannot take it.
    let node_of = |v: &str| {
        let v = v.to_string();
        let s = &s;
        let spot = spot.clone();
        async move {
            s.instance(&spot, &v).await["node_id"]
                .as_str()
                .unwrap()
                .to_string()
        }
    };
    let n0 = node_of(&victims[0]).await;
    s.sync(
        &provider,
        &n0,
        vec![(victims[0].clone(), exited(143, true))],
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pending = s
        .ok(&spot, Method::GET, "/v1/instances?state=pending", None)
        .await;
    assert_eq!(pending["items"].as_array().unwrap().len(), 1, "{pending}");
    assert_eq!(s.job(&key, &id).await["state"], "queued");
    let n1 = node_of(&victims[1]).await;
    s.sync(
        &provider,
        &n1,
        vec![(victims[1].clone(), exited(143, true))],
    )
    .await;
    let j = s
        .wait_job(&key, &id, "running", |j| j["state"] == "running")
        .await;
    let mut placed: Vec<String> = (0..2)
        .map(|r| current(&j, r)["node_id"].as_str().unwrap().to_string())
        .collect();
    placed.sort();
    assert_eq!(placed, all);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_past_its_time_limit_is_stopped_and_the_job_fails() {
    let (s, key, provider, _) = setup(1, 1).await;
    let (status, e) = s
        .call(
            &key,
            Method::POST,
            "/v1/jobs",
            Some(json!({"gpus": 1, "command": ["x"], "time_limit_s": 0})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{e}");
    assert_eq!(e["error"]["details"]["field"], "time_limit_s");
    let id = s
        .submit(
            &key,
            json!({"gpus": 1, "command": ["x"], "time_limit_s": 1, "restart_policy": "on_failure"}),
        )
        .await;
    let j = s
        .wait_job(&key, &id, "running", |j| j["state"] == "running")
        .await;
    s.report(&provider, &j, 0, running()).await;
    let m = current(&j, 0)["instance_id"].as_str().unwrap().to_string();
    let mut i = Value::Null;
    for _ in 0..200 {
        i = s.instance(&key, &m).await;
        if i["stop_requested"] == true {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(i["stop_requested"], true, "{i}");
    s.report(&provider, &j, 0, exited(143, true)).await;
    let j = s
        .wait_job(&key, &id, "failed", |j| j["state"] == "failed")
        .await;
    assert_eq!(j["state_reason"], "time limit of 1 s reached", "{j}");
    assert_eq!(j["attempts"], 1, "no retry after a time limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_ends_before_the_head_can_start_is_backfilled_ahead_of_it() {
    let (s, key, provider, nodes) = setup(1, 3).await;
    // A long job holds one GPU for at most an hour.
    let long = s
        .submit(
            &key,
            json!({"gpus": 1, "command": ["x"], "time_limit_s": 3600}),
        )
        .await;
    let j = s
        .wait_job(&key, &long, "running", |j| j["state"] == "running")
        .await;
    s.report(&provider, &j, 0, running()).await;
    // The head needs all three GPUs: it can start in an hour at the latest.
    let (status, b) = s
        .call(
            &key,
            Method::POST,
            "/v1/instances",
            Some(json!({"gpus": 3, "command": ["big"]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{b}");
    let head = b["id"].as_str().unwrap().to_string();
    for _ in 0..200 {
        let h = s.instance(&key, &head).await;
        if h["state_reason"]
            .as_str()
            .unwrap_or("")
            .contains("waiting for GPUs")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // A one-minute job ends long before: it runs now, on the head's node.
    let short = s
        .submit(
            &key,
            json!({"gpus": 1, "command": ["y"], "time_limit_s": 60}),
        )
        .await;
    let sj = s
        .wait_job(&key, &short, "running", |j| j["state"] == "running")
        .await;
    assert_eq!(current(&sj, 0)["node_id"], nodes[0].as_str());
    // Work of unknown length would delay the head: it waits behind it.
    let (status, b) = s
        .call(
            &key,
            Method::POST,
            "/v1/instances",
            Some(json!({"gpus": 1, "command": ["z"]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{b}");
    let open_ended = b["id"].as_str().unwrap().to_string();
    let mut i = Value::Null;
    for _ in 0..200 {
        i = s.instance(&key, &open_ended).await;
        if i["state_reason"]
            .as_str()
            .unwrap_or("")
            .contains("waiting behind")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(i["state_reason"].as_str().unwrap().contains(&head), "{i}");
    assert_eq!(i["state"], "pending");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_of_a_job_land_on_as_many_distinct_nodes() {
    // One machine has room for both members; `--nodes 2` means two
    // machines, as Slurm's -N does.
    let (s, key, _provider, nodes) = setup(2, 2).await;
    let id = s
        .submit(&key, json!({"gpus": 2, "nodes": 2, "command": ["train"]}))
        .await;
    let j = s
        .wait_job(&key, &id, "running", |j| j["state"] == "running")
        .await;
    let mut on: Vec<String> = (0..2)
        .map(|r| current(&j, r)["node_id"].as_str().unwrap().to_string())
        .collect();
    on.sort();
    let mut want = nodes.clone();
    want.sort();
    assert_eq!(on, want, "{j}");
    // A third member has no third machine: the job waits and says why.
    let id = s
        .submit(&key, json!({"gpus": 3, "nodes": 3, "command": ["train"]}))
        .await;
    let j = s
        .wait_job(&key, &id, "told why it waits", |j| {
            j["state_reason"]
                .as_str()
                .is_some_and(|r| r.contains("unschedulable in this pool: nodes: asks 3 distinct machines with 1 GPU each; this pool has 2"))
        })
        .await;
    assert_eq!(j["state"], "queued", "{j}");
}
