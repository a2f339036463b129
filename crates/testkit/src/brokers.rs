//! The message brokers of the test machines (RabbitMQ on 5672, NATS with
//! JetStream on 4222), for the queue trigger suites: whether one answers,
//! and names unique per run for the queues and streams a test makes.

use std::time::Duration;

/// Whether a broker answers on `127.0.0.1:port`; says the test is skipped
/// when not.
pub fn broker_up(port: u16) -> bool {
    let up = std::net::TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(2),
    )
    .is_ok();
    if !up {
        eprintln!("skipped: no broker answers on 127.0.0.1:{port}");
    }
    up
}

/// `prefix` and a fresh ULID: a queue or stream name no other run uses
/// (letters, digits, `_` and what `prefix` has; valid for JetStream when
/// `prefix` is).
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}_{}", ulid::Ulid::new().to_string().to_lowercase())
}

/// A RabbitMQ queue a test fills and watches, on its own connection.
pub struct RabbitQueue {
    /// The queue's name.
    pub name: String,
    /// The channel the queue is used on (declare, publish, get).
    pub ch: lapin::Channel,
    _conn: lapin::Connection,
}

impl std::fmt::Debug for RabbitQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitQueue")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl RabbitQueue {
    /// Connects to `url` for the queue `name` (not declared yet).
    pub async fn connect(url: &str, name: &str) -> Self {
        let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
            .await
            .expect("connect to RabbitMQ");
        let ch = conn.create_channel().await.expect("a channel");
        Self {
            name: name.to_string(),
            ch,
            _conn: conn,
        }
    }

    /// Declares the queue.
    pub async fn declare(&self) {
        self.ch
            .queue_declare(
                self.name.as_str().into(),
                lapin::options::QueueDeclareOptions::default(),
                lapin::types::FieldTable::default(),
            )
            .await
            .expect("declare the queue");
    }

    /// Publishes `n` messages on the queue.
    pub async fn publish(&self, n: usize) {
        for i in 0..n {
            self.ch
                .basic_publish(
                    "".into(),
                    self.name.as_str().into(),
                    lapin::options::BasicPublishOptions::default(),
                    format!("job {i}").as_bytes(),
                    lapin::BasicProperties::default(),
                )
                .await
                .expect("publish")
                .await
                .expect("the broker took it");
        }
    }

    /// Its ready message count (the queue must exist).
    pub async fn depth(&self) -> u64 {
        let q = self
            .ch
            .queue_declare(
                self.name.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..lapin::options::QueueDeclareOptions::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .expect("the queue exists");
        u64::from(q.message_count())
    }

    /// Deletes the queue (cleanup: a failure is ignored).
    pub async fn delete(&self) {
        let _ = self
            .ch
            .queue_delete(
                self.name.as_str().into(),
                lapin::options::QueueDeleteOptions::default(),
            )
            .await;
    }
}

/// A JetStream stream (subject `flotilla-test.{stream}`) with a durable
/// pull consumer, which a test creates, fills and watches.
#[derive(Debug)]
pub struct JetStreamQueue {
    /// The stream's name.
    pub stream: String,
    /// The durable consumer's name.
    pub consumer: String,
    js: async_nats::jetstream::Context,
}

impl JetStreamQueue {
    /// Connects to `url` for `stream` and its durable `consumer` (not
    /// created yet).
    pub async fn connect(url: &str, stream: &str, consumer: &str) -> Self {
        let client = async_nats::connect(url).await.expect("connect to NATS");
        Self {
            stream: stream.to_string(),
            consumer: consumer.to_string(),
            js: async_nats::jetstream::new(client),
        }
    }

    fn subject(&self) -> String {
        format!("flotilla-test.{}", self.stream)
    }

    /// Creates the stream and the durable pull consumer (explicit acks).
    pub async fn create(
        &self,
    ) -> async_nats::jetstream::consumer::Consumer<async_nats::jetstream::consumer::pull::Config>
    {
        let s = self
            .js
            .create_stream(async_nats::jetstream::stream::Config {
                name: self.stream.clone(),
                subjects: vec![self.subject()],
                ..Default::default()
            })
            .await
            .expect("create the stream");
        s.create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some(self.consumer.clone()),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .expect("create the durable consumer")
    }

    /// Publishes `n` messages, each stored before the next.
    pub async fn publish(&self, n: usize) {
        for i in 0..n {
            self.js
                .publish(self.subject(), format!("job {i}").into())
                .await
                .expect("publish")
                .await
                .expect("stored");
        }
    }

    /// The consumer's pending plus ack-pending messages.
    pub async fn depth(&self) -> u64 {
        let s = self
            .js
            .get_stream(&self.stream)
            .await
            .expect("the stream exists");
        let i = s
            .consumer_info(&self.consumer)
            .await
            .expect("the consumer exists");
        i.num_pending + i.num_ack_pending as u64
    }

    /// Deletes the stream (cleanup: a failure is ignored).
    pub async fn delete(&self) {
        let _ = self.js.delete_stream(&self.stream).await;
    }
}
