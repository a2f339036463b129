//! Queue triggers end to end, as a user runs them: the real `flotilla`
//! binary as server, agent (simulated GPUs) and CLI, the real RabbitMQ
//! and NATS JetStream brokers of this machine, and replicas that are real
//! processes started by the agent (`flotilla queue-worker`, acking each
//! message). A batch endpoint at zero replicas whose queue does not exist
//! yet shows the trigger's error and stays at zero; 500 messages
//! published on its fresh queue scale it from zero (`reason: queue`), its
//! replicas drain the queue, and it returns to zero after its idle window.
//! The broker password never appears in what the API shows. The server
//! runs with `--allow-egress` for the two brokers' loopback ports:
//! without it, loopback is refused (tests/outbound.rs). Queue and
//! stream names are unique per run and deleted at the end; a test is
//! skipped, with a message, where its broker does not answer.

use std::time::Duration;

use flotilla_testkit::brokers::{broker_up, unique_name, JetStreamQueue, RabbitQueue};
use flotilla_testkit::process::{http, wait_until, Home, Proc};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
/// Generous: a loaded two-core CI machine.
const LONG: Duration = Duration::from_secs(180);
const MESSAGES: usize = 500;

/// The real binary as server and agent (4 simulated GPUs), and a tenant
/// key. The workers reach the brokers on the host's loopback, which
/// workloads reach only where the operator allows it.
fn stack() -> (Home, Proc, Proc, String) {
    let mut home = Home::new(BIN);
    // The brokers are on this machine's loopback, which a tenant's
    // trigger may reach only because the operator allows these ports.
    home.server_args = [
        "--allow-egress",
        "127.0.0.1:5672",
        "--allow-egress",
        "127.0.0.1:4222",
    ]
    .map(String::from)
    .to_vec();
    let server = home.server();
    let agent = home.agent_with(
        "n0",
        "4xH100",
        &home.url(),
        &[
            "--allow-egress",
            "127.0.0.1:5672",
            "--allow-egress",
            "127.0.0.1:4222",
        ],
    );
    let (_, key) = home.tenant("batch");
    (home, server, agent, key)
}

fn endpoint(home: &Home, key: &str, name: &str) -> Value {
    home.cli_json(Some(key), &["endpoints", "show", name])
}

fn deploy(home: &Home, key: &str, name: &str, trigger: &[&str], worker: &[&str]) {
    let mut args = vec![
        "endpoints",
        "deploy",
        name,
        "--max",
        "3",
        "--idle-window",
        "5",
        "--drain-grace-ms",
        "500",
        "--messages-per-replica",
        "50",
    ];
    args.extend_from_slice(trigger);
    args.extend_from_slice(&["--", BIN, "queue-worker"]);
    args.extend_from_slice(worker);
    let out = home.cli(Some(key), &args);
    assert!(
        out.status.success(),
        "deploy: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The shared middle of both tests: the endpoint scales from zero on the
/// published messages, its replicas drain the queue, it returns to zero.
/// `depth` reads the broker directly.
fn scale_out_drain_and_back_to_zero(
    home: &Home,
    key: &str,
    name: &str,
    trigger: &str,
    depth: impl Fn() -> u64,
) {
    let op = home.operator_key();
    let mut peak = 0;
    let mut saw_queue_reason = false;
    let mut saw_gauge = false;
    wait_until("the workers drain the queue", LONG, || {
        let ep = endpoint(home, key, name);
        peak = peak.max(ep["replicas"].as_array().map_or(0, Vec::len));
        saw_queue_reason |= ep["reason"] == "queue" && ep["desired_replicas"] == 3;
        if !saw_gauge {
            let (_, m) =
                http("GET", &format!("{}/metrics", home.url()), Some(&op), None).expect("metrics");
            let m = m.as_str().unwrap_or_default().to_string();
            saw_gauge = m.lines().any(|l| {
                l.starts_with("flotilla_endpoint_queue_depth{")
                    && l.contains(&format!("trigger=\"{trigger}\""))
                    && l.contains(ep["id"].as_str().unwrap_or("-"))
            });
        }
        ep["triggers"][0]["depth"] == 0 && depth() == 0
    });
    assert!(
        saw_queue_reason,
        "the queue never asked for 3 replicas (500 messages, 50 per replica, max 3)"
    );
    assert!(peak >= 1, "no replica ever started");
    eprintln!("{name}: peak {peak} replicas");
    // The replicas were the workers: their output says so (and nothing
    // else consumes the queue, so they acked every message).
    let logs = home.cli_json(Some(key), &["endpoints", "logs", name]);
    let lines: Vec<&str> = logs
        .as_array()
        .map(|l| l.iter().filter_map(|x| x["line"].as_str()).collect())
        .unwrap_or_default();
    assert!(
        lines.iter().any(|l| l.starts_with("consuming ")),
        "no worker output: {logs}"
    );
    assert!(
        saw_gauge,
        "no flotilla_endpoint_queue_depth sample for {trigger}"
    );
    wait_until("back to zero after the idle window", LONG, || {
        let ep = endpoint(home, key, name);
        ep["replicas"] == serde_json::json!([]) && ep["desired_replicas"] == 0
    });
    let ep = endpoint(home, key, name);
    assert_eq!(ep["reason"], "idle", "{ep}");
}

/// Waits until the endpoint shows its trigger's error (the queue or
/// consumer is missing) while it stays at zero.
fn missing_then_zero(home: &Home, key: &str, name: &str) -> Value {
    let mut last = Value::Null;
    wait_until("the trigger's error is shown", LONG, || {
        last = endpoint(home, key, name);
        last["triggers"][0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("missing"))
    });
    assert_eq!(last["replicas"], serde_json::json!([]), "{last}");
    assert_eq!(last["triggers"][0]["wants"], 0, "{last}");
    last
}

#[test]
fn a_rabbitmq_queue_scales_a_batch_endpoint_from_zero_and_back() {
    if !broker_up(5672) {
        return;
    }
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let queue = unique_name("flotilla-e2e");
    // The trigger carries the credentials; the worker uses the broker's
    // default ones, so the command shows no password either.
    let trigger_url = "amqp://guest:guest@127.0.0.1:5672/%2f";
    let q = rt.block_on(RabbitQueue::connect(trigger_url, &queue));

    let (home, _server, _agent, key) = stack();
    deploy(
        &home,
        &key,
        "jobs",
        &["--rabbitmq-queue", &format!("{trigger_url}#{queue}")],
        &[
            "--rabbitmq",
            "amqp://127.0.0.1:5672/%2f",
            "--queue",
            &queue,
            "--work-ms",
            "20",
        ],
    );
    let ep = missing_then_zero(&home, &key, "jobs");
    let shown = ep.to_string();
    assert!(
        !shown.contains("guest:guest"),
        "the password is shown: {shown}"
    );
    assert_eq!(
        ep["spec"]["queue_triggers"][0]["url"],
        "amqp://guest:***@127.0.0.1:5672/%2f"
    );

    rt.block_on(async {
        q.declare().await;
        q.publish(MESSAGES).await;
    });
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        scale_out_drain_and_back_to_zero(&home, &key, "jobs", &format!("rabbitmq:{queue}"), || {
            rt.block_on(q.depth())
        })
    }));
    rt.block_on(q.delete());
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

#[test]
fn a_nats_jetstream_consumer_scales_a_batch_endpoint_from_zero_and_back() {
    if !broker_up(4222) {
        return;
    }
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let name = unique_name("FLOTILLA_E2E");
    let url = "nats://127.0.0.1:4222";
    let q = rt.block_on(JetStreamQueue::connect(url, &name, "workers"));

    let (home, _server, _agent, key) = stack();
    deploy(
        &home,
        &key,
        "jobs",
        &["--nats-consumer", &format!("{url}#{name}/workers")],
        &[
            "--nats",
            url,
            "--stream",
            &name,
            "--consumer",
            "workers",
            "--work-ms",
            "20",
        ],
    );
    missing_then_zero(&home, &key, "jobs");

    rt.block_on(async {
        q.create().await;
        q.publish(MESSAGES).await;
    });
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        scale_out_drain_and_back_to_zero(
            &home,
            &key,
            "jobs",
            &format!("nats:{name}/workers"),
            || rt.block_on(q.depth()),
        )
    }));
    rt.block_on(q.delete());
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}
