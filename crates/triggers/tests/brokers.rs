//! The scalers against the real brokers on this machine (RabbitMQ on
//! 127.0.0.1:5672, NATS with JetStream on 127.0.0.1:4222): depths follow
//! what is published and acknowledged, a missing queue or consumer is a
//! typed error that leaves the cached connection usable, an unreachable
//! broker is an error (never a hang past the timeout), and no error
//! quotes the URL's password. Queue and stream names are unique per run
//! and deleted at the end. Skipped, with a message, where a broker does
//! not answer.

use std::time::Duration;

use flotilla_core::queue_trigger::QueueTrigger;
use flotilla_testkit::brokers::{broker_up, unique_name, JetStreamQueue, RabbitQueue};
use flotilla_triggers::{Scaler, TriggerError};
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicGetOptions};

const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const NATS: &str = "nats://127.0.0.1:4222";

/// A scaler allowed to reach this machine's brokers (loopback is refused
/// by default, as for any tenant-chosen URL).
fn scaler(timeout: Duration) -> Scaler {
    Scaler::new(timeout).with_policy(flotilla_egress::EgressPolicy::new(vec!["127.0.0.0/8"
        .parse()
        .expect("rule")]))
}

fn rabbit(url: &str, queue: &str) -> QueueTrigger {
    QueueTrigger::rabbitmq(url, queue)
}

#[tokio::test]
async fn rabbitmq_depth_follows_the_queue_and_a_missing_queue_is_reported() {
    if !broker_up(5672) {
        return;
    }
    let scaler = scaler(Duration::from_secs(10));
    let queue = unique_name("flotilla-test");
    // Missing first: a typed error, and the connection survives it.
    assert_eq!(
        scaler.depth(&rabbit(AMQP, &queue)).await,
        Err(TriggerError::QueueMissing(queue.clone()))
    );
    let q = RabbitQueue::connect(AMQP, &queue).await;
    q.declare().await;
    q.publish(25).await;
    assert_eq!(scaler.depth(&rabbit(AMQP, &queue)).await, Ok(25));
    for _ in 0..5 {
        let m =
            q.ch.basic_get(queue.as_str().into(), BasicGetOptions::default())
                .await
                .expect("get")
                .expect("a message");
        m.delivery
            .ack(BasicAckOptions::default())
            .await
            .expect("ack");
    }
    assert_eq!(scaler.depth(&rabbit(AMQP, &queue)).await, Ok(20));
    q.delete().await;
    assert!(matches!(
        scaler.depth(&rabbit(AMQP, &queue)).await,
        Err(TriggerError::QueueMissing(_))
    ));

    // Wrong password: refused, and the error does not quote it.
    let bad = "amqp://guest:n0t-the-password@127.0.0.1:5672/%2f";
    let e = scaler.depth(&rabbit(bad, "q")).await.unwrap_err();
    assert!(!e.to_string().contains("n0t-the-password"), "{e}");
}

#[tokio::test]
async fn an_unreachable_broker_is_an_error_within_the_timeout() {
    // A port nothing listens on: refused at once.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let scaler = scaler(Duration::from_secs(5));
    let started = std::time::Instant::now();
    let e = scaler
        .depth(&rabbit(&format!("amqp://u:pw@127.0.0.1:{port}/%2f"), "q"))
        .await
        .unwrap_err();
    assert!(
        e == TriggerError::Unreachable && e.to_string() == "broker unreachable",
        "{e:?}"
    );
    let nats = QueueTrigger::nats(format!("nats://127.0.0.1:{port}"), "S", "C");
    let e = scaler.depth(&nats).await.unwrap_err();
    assert!(
        e == TriggerError::Unreachable && e.to_string() == "broker unreachable",
        "{e:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[tokio::test]
async fn nats_depth_is_pending_plus_ack_pending() {
    if !broker_up(4222) {
        return;
    }
    let name = unique_name("FLOTILLA_TEST");
    let q = JetStreamQueue::connect(NATS, &name, "workers").await;
    let trigger = QueueTrigger::nats(NATS, name.as_str(), "workers");
    let scaler = scaler(Duration::from_secs(10));
    assert!(matches!(
        scaler.depth(&trigger).await,
        Err(TriggerError::ConsumerMissing { .. })
    ));
    let c = q.create().await;
    q.publish(30).await;
    assert_eq!(scaler.depth(&trigger).await, Ok(30));
    // Five fetched, two of them acked: three are still ack-pending.
    let mut batch = c.fetch().max_messages(5).messages().await.expect("fetch");
    let mut got = Vec::new();
    while let Some(m) = batch.next().await {
        got.push(m.expect("message"));
    }
    assert_eq!(got.len(), 5);
    for m in &got[..2] {
        m.double_ack().await.expect("ack");
    }
    assert_eq!(scaler.depth(&trigger).await, Ok(28));
    q.delete().await;
}
