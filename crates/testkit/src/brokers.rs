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
