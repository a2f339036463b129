//! `flotilla queue-worker` (hidden): a batch replica that drains a queue,
//! acknowledging each message after `--work-ms` of pretend work. It is
//! the replica command of queue-triggered endpoints in tests and demos: a
//! RabbitMQ queue (consumed with a prefetch limit) or a NATS JetStream
//! durable pull consumer. With `PORT` set it answers every HTTP request
//! on that port with 200, so the endpoint's readiness probe passes.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use futures::StreamExt;
use tokio::io::AsyncWriteExt;

/// `flotilla queue-worker` options.
#[derive(Debug, clap::Args)]
pub struct QueueWorkerArgs {
    /// RabbitMQ URL (with `--queue`).
    #[arg(long, value_name = "URL", requires = "queue", conflicts_with = "nats")]
    pub rabbitmq: Option<String>,
    /// RabbitMQ queue to consume.
    #[arg(long, value_name = "NAME")]
    pub queue: Option<String>,
    /// NATS URL (with `--stream` and `--consumer`).
    #[arg(long, value_name = "URL", requires_all = ["stream", "consumer"])]
    pub nats: Option<String>,
    /// JetStream stream.
    #[arg(long, value_name = "NAME")]
    pub stream: Option<String>,
    /// Durable pull consumer on the stream.
    #[arg(long, value_name = "NAME")]
    pub consumer: Option<String>,
    /// Time spent on each message before it is acknowledged, ms.
    #[arg(long = "work-ms", default_value_t = 10)]
    pub work_ms: u64,
    /// Messages held unacknowledged at once.
    #[arg(long, default_value_t = 10)]
    pub prefetch: u16,
}

/// Runs the worker until its queue's consumer ends or fails.
pub async fn run(a: QueueWorkerArgs) -> Result<ExitCode> {
    if let Some(port) = std::env::var("PORT")
        .ok()
        .and_then(|p| p.parse::<u16>().ok())
    {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .with_context(|| format!("listen on port {port}"))?;
        tokio::spawn(health(listener));
    }
    let work = Duration::from_millis(a.work_ms);
    match (&a.rabbitmq, &a.nats) {
        (Some(url), None) => {
            rabbitmq(url, a.queue.as_deref().unwrap_or(""), a.prefetch, work).await
        }
        (None, Some(url)) => {
            nats(
                url,
                a.stream.as_deref().unwrap_or(""),
                a.consumer.as_deref().unwrap_or(""),
                a.prefetch,
                work,
            )
            .await
        }
        _ => Err(anyhow!(
            "give --rabbitmq URL --queue Q, or --nats URL --stream S --consumer C"
        )),
    }
}

/// Answers each connection with one `200 OK` (the readiness probe): the
/// worker has no API, only a sign of life.
async fn health(listener: tokio::net::TcpListener) {
    while let Ok((mut conn, _)) = listener.accept().await {
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let _ = tokio::io::AsyncReadExt::read(&mut conn, &mut buf).await;
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                .await;
        });
    }
}

fn progress(acked: u64) {
    if acked.is_multiple_of(50) {
        println!("acked {acked} messages");
    }
}

async fn rabbitmq(url: &str, queue: &str, prefetch: u16, work: Duration) -> Result<ExitCode> {
    use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
    use lapin::types::FieldTable;
    let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .context("connect to RabbitMQ")?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
    let mut deliveries = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("consume queue `{queue}`"))?;
    println!("consuming RabbitMQ queue {queue}");
    let mut acked = 0u64;
    while let Some(d) = deliveries.next().await {
        let d = d.context("delivery")?;
        tokio::time::sleep(work).await;
        d.ack(BasicAckOptions::default()).await?;
        acked += 1;
        progress(acked);
    }
    Err(anyhow!(
        "the broker cancelled the consumer after {acked} messages"
    ))
}

async fn nats(
    url: &str,
    stream: &str,
    consumer: &str,
    prefetch: u16,
    work: Duration,
) -> Result<ExitCode> {
    use async_nats::jetstream::consumer::pull;
    let client = async_nats::connect(url).await.context("connect to NATS")?;
    let js = async_nats::jetstream::new(client);
    let c = js
        .get_stream(stream)
        .await
        .with_context(|| format!("stream `{stream}`"))?
        .get_consumer::<pull::Config>(consumer)
        .await
        .map_err(|e| anyhow!("consumer `{consumer}`: {e}"))?;
    let mut messages = c
        .stream()
        .max_messages_per_batch(usize::from(prefetch.max(1)))
        .messages()
        .await?;
    println!("consuming JetStream consumer {stream}/{consumer}");
    let mut acked = 0u64;
    while let Some(m) = messages.next().await {
        let m = m.map_err(|e| anyhow!("message: {e}"))?;
        tokio::time::sleep(work).await;
        m.ack().await.map_err(|e| anyhow!("ack: {e}"))?;
        acked += 1;
        progress(acked);
    }
    Err(anyhow!("the message stream ended after {acked} messages"))
}
