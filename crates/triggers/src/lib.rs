//! External queue scalers: the depth of a RabbitMQ queue (a passive
//! `queue.declare`, whose answer carries the ready message count) or of a
//! NATS JetStream durable consumer (its pending plus ack-pending
//! messages), for an endpoint's queue triggers.
//!
//! Connections are cached per broker URL and dropped when they fail, so
//! the next read reconnects. Every read is bounded by a timeout, so a
//! broker that hangs costs one timeout per tick rather than stalling the
//! endpoint controller. Errors never carry a URL's password.
//!
//! A trigger's URL is chosen by a tenant, so every connection follows the
//! egress policy (`flotilla-egress`): the broker's host is resolved, every
//! address it stands for is checked (loopback, private, link-local and the
//! rest are refused unless the operator allows them), and the client
//! connects to those checked addresses only, never to a second lookup's
//! answer (DNS rebinding) nor to servers a NATS broker advertises. A
//! broker that cannot be reached is reported as `broker unreachable`
//! whatever the cause (refused, reset, timed out, not speaking the
//! protocol), so that a trigger cannot be used to tell ports apart; the
//! cause goes to the operator's log only.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use flotilla_core::queue_trigger::{QueueKind, QueueTrigger, REDACTED};
use flotilla_egress::{EgressPolicy, ResolveError};
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
    /// No connection to the broker, or no answer in time. One error for
    /// refused, reset, timed out and garbled, so that what a tenant sees
    /// says nothing about what listens where; the operator's log has the
    /// cause.
    #[error("broker unreachable")]
    Unreachable,
    /// The broker's host is, or resolves to, an address the egress policy
    /// refuses: nothing was sent.
    #[error("broker unreachable: {0}")]
    Refused(String),
    /// The broker answered with an error.
    #[error("broker error: {0}")]
    Broker(String),
}

/// Reads queue depths; holds one connection per broker URL.
pub struct Scaler {
    amqp: Mutex<HashMap<String, Arc<lapin::Connection>>>,
    nats: Mutex<HashMap<String, async_nats::Client>>,
    timeout: Duration,
    policy: EgressPolicy,
}

impl std::fmt::Debug for Scaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scaler")
            .field("timeout", &self.timeout)
            .field("policy", &self.policy)
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

/// The parts of a broker URL `scheme://[userinfo@]host[:port][/rest]`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BrokerUrl<'a> {
    /// `scheme://userinfo@`, or `scheme://`.
    head: &'a str,
    /// The host, IPv6 brackets removed.
    host: &'a str,
    port: u16,
    /// From the first `/`, `?` or `#` on.
    tail: &'a str,
}

impl<'a> BrokerUrl<'a> {
    fn parse(url: &'a str, default_port: u16) -> Option<Self> {
        let (scheme, rest) = url.split_once("://")?;
        let auth_len = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (auth, tail) = rest.split_at(auth_len);
        let host_at = auth.rfind('@').map_or(0, |i| i + 1);
        let head = &url[..scheme.len() + 3 + host_at];
        let hostport = &auth[host_at..];
        let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
            let (h, after) = v6.split_once(']')?;
            match after {
                "" => (h, None),
                p => (h, Some(p.strip_prefix(':')?)),
            }
        } else {
            match hostport.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (hostport, None),
            }
        };
        let port = match port {
            None | Some("") => default_port,
            Some(p) => p.parse().ok()?,
        };
        (!host.is_empty()).then_some(Self {
            head,
            host,
            port,
            tail,
        })
    }

    /// The same URL aimed at `addr`, a checked address of its host.
    fn at(&self, addr: std::net::SocketAddr) -> String {
        let host = match addr.ip() {
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
            v4 => v4.to_string(),
        };
        format!("{}{host}:{}{}", self.head, addr.port(), self.tail)
    }
}

/// The broker port a trigger's URL means when it names none.
fn default_port(kind: QueueKind) -> u16 {
    match kind {
        QueueKind::Rabbitmq => 5672,
        QueueKind::Nats => 4222,
    }
}

/// The host (IPv6 brackets removed) and port a trigger connects to, for
/// the server's check when the trigger is set; `None` when its URL names
/// no host.
pub fn destination(t: &QueueTrigger) -> Option<(&str, u16)> {
    BrokerUrl::parse(&t.url, default_port(t.kind)).map(|u| (u.host, u.port))
}

impl Scaler {
    /// A scaler whose reads give up after `timeout`, reaching public
    /// addresses only.
    pub fn new(timeout: Duration) -> Self {
        Self {
            amqp: Mutex::new(HashMap::new()),
            nats: Mutex::new(HashMap::new()),
            timeout,
            policy: EgressPolicy::default(),
        }
    }

    /// The same scaler following `policy` (the operator's allow rules).
    pub fn with_policy(mut self, policy: EgressPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The addresses `url`'s host stands for, each allowed by the policy,
    /// with the URL rewritten for each (the host replaced by the checked
    /// address, so the client never looks the name up again).
    async fn targets(&self, url: &str, default_port: u16) -> Result<Vec<String>, TriggerError> {
        let parsed = BrokerUrl::parse(url, default_port)
            .ok_or_else(|| TriggerError::Refused("the URL names no host and port".to_string()))?;
        match flotilla_egress::resolve(parsed.host, parsed.port, &self.policy).await {
            Ok(addrs) => Ok(addrs.into_iter().map(|a| parsed.at(a)).collect()),
            Err(e @ ResolveError::Refused { .. }) => Err(TriggerError::Refused(e.to_string())),
            Err(e @ ResolveError::Unresolved { .. }) => {
                tracing::warn!(error = %e, "queue trigger broker does not resolve");
                Err(TriggerError::Unreachable)
            }
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
                tracing::warn!(trigger = %t.label(), timeout_ms = self.timeout.as_millis() as u64, "queue trigger read timed out");
                Err(TriggerError::Unreachable)
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
        let mut conn = None;
        for target in self.targets(url, default_port(QueueKind::Rabbitmq)).await? {
            match lapin::Connection::connect(&target, lapin::ConnectionProperties::default()).await
            {
                Ok(c) => {
                    conn = Some(c);
                    break;
                }
                Err(e) => unreachable(scrub(e, url)),
            }
        }
        let c = Arc::new(conn.ok_or(TriggerError::Unreachable)?);
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
                unreachable(scrub(e, url));
                return Err(TriggerError::Unreachable);
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
                    unreachable(scrub(e, url));
                    Err(TriggerError::Unreachable)
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
        let mut client = None;
        for target in self.targets(url, default_port(QueueKind::Nats)).await? {
            // Only the checked address: not the servers the broker
            // advertises (a broker could name any address there).
            match async_nats::ConnectOptions::new()
                .connection_timeout(self.timeout)
                .ignore_discovered_servers()
                .connect(target.as_str())
                .await
            {
                Ok(c) => {
                    client = Some(c);
                    break;
                }
                Err(e) => unreachable(scrub(e, url)),
            }
        }
        let c = client.ok_or(TriggerError::Unreachable)?;
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
                K::TimedOut => {
                    unreachable(scrub(e, url));
                    TriggerError::Unreachable
                }
                K::NoResponders => {
                    TriggerError::Broker("JetStream is not enabled on this server".into())
                }
                _ => TriggerError::Broker(scrub(e, url)),
            }),
        }
    }
}

/// Logs why a broker could not be reached, for the operator; the tenant
/// sees [`TriggerError::Unreachable`] only.
fn unreachable(cause: String) {
    tracing::warn!(cause = %cause, "queue trigger broker unreachable");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_urls_are_aimed_at_the_checked_address() {
        let u = BrokerUrl::parse("amqp://u:p@w@rabbit.example:5673/%2f?x=1", 5672).unwrap();
        assert_eq!((u.host, u.port), ("rabbit.example", 5673));
        assert_eq!(
            u.at("203.0.113.5:5673".parse().unwrap()),
            "amqp://u:p@w@203.0.113.5:5673/%2f?x=1"
        );
        let u = BrokerUrl::parse("nats://[2001:db8::1]", 4222).unwrap();
        assert_eq!((u.host, u.port), ("2001:db8::1", 4222));
        assert_eq!(
            u.at("[2001:db8::1]:4222".parse().unwrap()),
            "nats://[2001:db8::1]:4222"
        );
        let u = BrokerUrl::parse("nats://tok@10.0.0.1", 4222).unwrap();
        assert_eq!((u.head, u.host, u.tail), ("nats://tok@", "10.0.0.1", ""));
        for bad in ["nats://", "amqp://u@:5672/", "amqp://h:x/", "nope"] {
            assert_eq!(BrokerUrl::parse(bad, 1), None, "{bad}");
        }
    }

    #[tokio::test]
    async fn inward_brokers_are_refused_before_any_connection() {
        // 10.0.0.1 and 169.254.169.254 are never contacted: the policy
        // refuses them before a socket is opened.
        let s = Scaler::new(Duration::from_secs(5));
        for url in [
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            "amqp://guest:guest@10.0.0.1/%2f",
            "amqp://169.254.169.254:80/%2f",
            "amqp://localhost/%2f",
        ] {
            let e = s
                .depth(&QueueTrigger::rabbitmq(url, "q"))
                .await
                .unwrap_err();
            assert!(matches!(e, TriggerError::Refused(_)), "{url}: {e:?}");
            assert!(e.to_string().starts_with("broker unreachable: "), "{e}");
        }
        let e = s
            .depth(&QueueTrigger::nats("nats://[::1]:4222", "S", "C"))
            .await
            .unwrap_err();
        assert!(matches!(e, TriggerError::Refused(_)), "{e:?}");
    }

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
