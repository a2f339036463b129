//! External queue scalers: the depth of a RabbitMQ queue (a passive
//! `queue.declare`, whose answer carries the ready message count) or of a
//! NATS JetStream durable consumer (its pending plus ack-pending
//! messages), for an endpoint's queue triggers.
//!
//! Connections are cached per broker URL and dropped when they fail, so
//! the next read reconnects. Every read is bounded by a timeout, so a
//! broker that hangs costs one timeout per tick rather than stalling the
//! endpoint controller. Errors never carry a URL's password.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use flotilla_core::queue_trigger::{QueueKind, QueueTrigger, REDACTED};
use lapin::options::QueueDeclareOptions;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::FieldTable;
use tokio::sync::Mutex;

/// How long one read (connecting included) may take by default.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a trigger's depth could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TriggerError {
    /// The RabbitMQ queue does not exist (yet).
    #[error("queue `{0}` is missing")]
    QueueMissing(String),
    /// The JetStream stream or consumer does not exist (yet).
    #[error("consumer `{consumer}` of stream `{stream}` is missing")]
    ConsumerMissing {
        /// The stream.
        stream: String,
        /// The durable consumer.
        consumer: String,
    },
    /// No connection to the broker.
    #[error("broker unreachable: {0}")]
    Unreachable(String),
    /// The broker did not answer in time.
    #[error("no answer from the broker within {0:?}")]
    Timeout(Duration),
    /// The broker answered with an error.
    #[error("broker error: {0}")]
    Broker(String),
}

/// Reads queue depths; holds one connection per broker URL.
pub struct Scaler {
    amqp: Mutex<HashMap<String, Arc<lapin::Connection>>>,
    nats: Mutex<HashMap<String, async_nats::Client>>,
    timeout: Duration,
}

impl std::fmt::Debug for Scaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scaler")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Default for Scaler {
    fn default() -> Self {
        Self::new(READ_TIMEOUT)
    }
}

/// `msg` with the password (or token) of `url` replaced: broker errors
/// may quote what they were given.
fn scrub(msg: impl std::fmt::Display, url: &str) -> String {
    let msg = msg.to_string();
    let Some((_, rest)) = url.split_once("://") else {
        return msg;
    };
    let auth = rest.split(['/', '?', '#']).next().unwrap_or("");
    let Some((userinfo, _)) = auth.rsplit_once('@') else {
        return msg;
    };
    let secret = userinfo.split_once(':').map_or(userinfo, |(_, p)| p);
    if secret.is_empty() {
        msg
    } else {
        msg.replace(secret, REDACTED)
    }
}

impl Scaler {
    /// A scaler whose reads give up after `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Self {
            amqp: Mutex::new(HashMap::new()),
            nats: Mutex::new(HashMap::new()),
            timeout,
        }
    }

    /// The depth of `t`'s queue now.
    pub async fn depth(&self, t: &QueueTrigger) -> Result<u64, TriggerError> {
        let read = async {
            match t.kind {
                QueueKind::Rabbitmq => {
                    self.rabbitmq(&t.url, t.queue.as_deref().unwrap_or(""))
                        .await
                }
                QueueKind::Nats => {
                    self.nats(
                        &t.url,
                        t.stream.as_deref().unwrap_or(""),
                        t.consumer.as_deref().unwrap_or(""),
                    )
                    .await
                }
            }
        };
        match tokio::time::timeout(self.timeout, read).await {
            Ok(r) => r,
            Err(_) => {
                // A hung connection is not trusted again.
                self.forget(t).await;
                Err(TriggerError::Timeout(self.timeout))
            }
        }
    }

    async fn forget(&self, t: &QueueTrigger) {
        match t.kind {
            QueueKind::Rabbitmq => {
                self.amqp.lock().await.remove(&t.url);
            }
            QueueKind::Nats => {
                self.nats.lock().await.remove(&t.url);
            }
        }
    }

    /// The cached connection to `url`, or a new one. The cache is not
    /// locked while connecting, so a slow broker does not hold up reads of
    /// the others.
    async fn amqp_connection(&self, url: &str) -> Result<Arc<lapin::Connection>, TriggerError> {
        {
            let mut conns = self.amqp.lock().await;
            match conns.get(url) {
                Some(c) if c.status().connected() => return Ok(c.clone()),
                Some(_) => {
                    conns.remove(url);
                }
                None => {}
            }
        }
        let c = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
            .await
            .map_err(|e| TriggerError::Unreachable(scrub(e, url)))?;
        let c = Arc::new(c);
        self.amqp.lock().await.insert(url.to_string(), c.clone());
        Ok(c)
    }

    async fn rabbitmq(&self, url: &str, queue: &str) -> Result<u64, TriggerError> {
        let conn = self.amqp_connection(url).await?;
        // A channel per read: a passive declare of a missing queue closes
        // the channel it ran on (not the connection).
        let ch = match conn.create_channel().await {
            Ok(ch) => ch,
            Err(e) => {
                self.amqp.lock().await.remove(url);
                return Err(TriggerError::Unreachable(scrub(e, url)));
            }
        };
        let declared = ch
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await;
        match declared {
            Ok(q) => {
                let _ = ch.close(200, "depth read".into()).await;
                Ok(u64::from(q.message_count()))
            }
            Err(e) => match e.kind() {
                lapin::ErrorKind::ProtocolError(p)
                    if matches!(p.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)) =>
                {
                    Err(TriggerError::QueueMissing(queue.to_string()))
                }
                lapin::ErrorKind::ProtocolError(_) => Err(TriggerError::Broker(scrub(e, url))),
                _ => {
                    self.amqp.lock().await.remove(url);
                    Err(TriggerError::Unreachable(scrub(e, url)))
                }
            },
        }
    }

    /// The cached client of `url`, or a new one (not connecting under
    /// the lock, as for AMQP).
    async fn nats_client(&self, url: &str) -> Result<async_nats::Client, TriggerError> {
        {
            let mut clients = self.nats.lock().await;
            match clients.get(url) {
                Some(c) if c.connection_state() == async_nats::connection::State::Connected => {
                    return Ok(c.clone())
                }
                Some(_) => {
                    clients.remove(url);
                }
                None => {}
            }
        }
        let c = async_nats::ConnectOptions::new()
            .connection_timeout(self.timeout)
            .connect(url)
            .await
            .map_err(|e| TriggerError::Unreachable(scrub(e, url)))?;
        self.nats.lock().await.insert(url.to_string(), c.clone());
        Ok(c)
    }

    async fn nats(&self, url: &str, stream: &str, consumer: &str) -> Result<u64, TriggerError> {
        use async_nats::jetstream::context::ConsumerInfoErrorKind as K;
        let client = self.nats_client(url).await?;
        let js = async_nats::jetstream::new(client);
        // No stream info needed: the consumer's info request names both.
        let s = js
            .get_stream_no_info(stream)
            .await
            .map_err(|e| TriggerError::Broker(scrub(e, url)))?;
        match s.consumer_info(consumer).await {
            Ok(info) => Ok(info
                .num_pending
                .saturating_add(u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX))),
            Err(e) => Err(match e.kind() {
                K::NotFound | K::StreamNotFound => TriggerError::ConsumerMissing {
                    stream: stream.to_string(),
                    consumer: consumer.to_string(),
                },
                K::TimedOut => TriggerError::Timeout(self.timeout),
                K::NoResponders => {
                    TriggerError::Broker("JetStream is not enabled on this server".into())
                }
                _ => TriggerError::Broker(scrub(e, url)),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_never_quote_the_password() {
        assert_eq!(
            scrub(
                "cannot log in to amqp://u:hunter2@h as u:hunter2",
                "amqp://u:hunter2@h"
            ),
            "cannot log in to amqp://u:***@h as u:***"
        );
        assert_eq!(scrub("refused", "nats://127.0.0.1:4222"), "refused");
        assert_eq!(scrub("tok in msg", "nats://tok@h"), "*** in msg");
    }
}
