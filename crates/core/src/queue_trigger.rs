//! Queue triggers: an endpoint scaled by the depth of an external queue (a
//! RabbitMQ queue, or a NATS JetStream durable consumer), as KEDA's queue
//! scalers do. This module holds the trigger's spec and its validation
//! (every error names its field), the redaction of the credentials a
//! broker URL may carry, what a trigger read showed, and the pure demand a
//! set of depths makes. The reads themselves are I/O and live in
//! `flotilla-triggers`; the decision takes their results as input.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::error::FieldError;

/// Most queue triggers one endpoint may have.
pub const MAX_TRIGGERS: usize = 8;
/// Target depth per replica when none is given.
pub const DEFAULT_MESSAGES_PER_REPLICA: u32 = 10;
/// What replaces a password (or a NATS token) when a URL is shown.
pub const REDACTED: &str = "***";

/// The broker a trigger reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum QueueKind {
    /// A RabbitMQ (AMQP 0-9-1) queue: depth is its ready message count.
    Rabbitmq,
    /// A NATS JetStream durable consumer: depth is its pending plus
    /// ack-pending messages.
    Nats,
}

impl QueueKind {
    /// The name used in the API and in metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueKind::Rabbitmq => "rabbitmq",
            QueueKind::Nats => "nats",
        }
    }
}

fn default_messages_per_replica() -> u32 {
    DEFAULT_MESSAGES_PER_REPLICA
}

/// One external queue whose depth asks for replicas:
/// `ceil(depth / messages_per_replica)`, within the endpoint's bounds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct QueueTrigger {
    /// `rabbitmq` or `nats`.
    pub kind: QueueKind,
    /// Broker URL: `amqp://user:password@host:5672/vhost` (RabbitMQ) or
    /// `nats://[user:password@]host:4222` (NATS). Credentials are kept
    /// secret: the API shows the password as `***`.
    pub url: String,
    /// RabbitMQ queue name (rabbitmq only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    /// JetStream stream (nats only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<String>,
    /// Durable consumer on `stream` (nats only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumer: Option<String>,
    /// Target depth per replica (default 10).
    #[serde(default = "default_messages_per_replica")]
    pub messages_per_replica: u32,
}

impl QueueTrigger {
    /// A trigger on the RabbitMQ queue `queue` at `url`, at the default
    /// target depth per replica.
    pub fn rabbitmq(url: impl Into<String>, queue: impl Into<String>) -> Self {
        Self {
            kind: QueueKind::Rabbitmq,
            url: url.into(),
            queue: Some(queue.into()),
            stream: None,
            consumer: None,
            messages_per_replica: DEFAULT_MESSAGES_PER_REPLICA,
        }
    }

    /// A trigger on the JetStream durable `consumer` of `stream` at `url`,
    /// at the default target depth per replica.
    pub fn nats(
        url: impl Into<String>,
        stream: impl Into<String>,
        consumer: impl Into<String>,
    ) -> Self {
        Self {
            kind: QueueKind::Nats,
            url: url.into(),
            queue: None,
            stream: Some(stream.into()),
            consumer: Some(consumer.into()),
            messages_per_replica: DEFAULT_MESSAGES_PER_REPLICA,
        }
    }

    /// A short name without credentials, for metric labels and logs:
    /// `rabbitmq:QUEUE` or `nats:STREAM/CONSUMER`.
    pub fn label(&self) -> String {
        match self.kind {
            QueueKind::Rabbitmq => format!("rabbitmq:{}", self.queue.as_deref().unwrap_or("")),
            QueueKind::Nats => format!(
                "nats:{}/{}",
                self.stream.as_deref().unwrap_or(""),
                self.consumer.as_deref().unwrap_or("")
            ),
        }
    }

    /// The trigger as it may be shown: its URL's secret replaced.
    pub fn redacted(&self) -> QueueTrigger {
        QueueTrigger {
            url: redact_url(&self.url),
            ..self.clone()
        }
    }

    /// Checks one trigger; `at` is its JSON path (`queue_triggers[0]`).
    pub fn validate(&self, at: &str) -> Result<(), FieldError> {
        // TLS schemes (`amqps`, `tls`) are refused rather than accepted and
        // failing at every read: the scalers are built without TLS.
        let schemes: &[&str] = match self.kind {
            QueueKind::Rabbitmq => &["amqp"],
            QueueKind::Nats => &["nats"],
        };
        let url_field = format!("{at}.url");
        let Some((scheme, rest)) = self.url.split_once("://") else {
            return Err(FieldError::new(
                url_field,
                format!("must be a URL such as {}://host", schemes[0]),
            ));
        };
        if !schemes.contains(&scheme) {
            return Err(FieldError::new(
                url_field,
                format!(
                    "a {} trigger's URL must start with {}:// (TLS brokers are not supported yet)",
                    self.kind.as_str(),
                    schemes[0]
                ),
            ));
        }
        let host = authority(rest)
            .rsplit_once('@')
            .map_or(authority(rest), |(_, h)| h);
        if host.is_empty()
            || self.url.len() > 2048
            || self
                .url
                .chars()
                .any(|c| c.is_control() || c.is_whitespace())
        {
            return Err(FieldError::new(
                url_field,
                "must name a host, without spaces, at most 2048 characters",
            ));
        }
        let name_ok = |v: &str| {
            !v.is_empty()
                && v.len() <= 255
                && !v.chars().any(|c| c.is_control() || c.is_whitespace())
        };
        // JetStream names are single subject tokens.
        let nats_name_ok = |v: &str| name_ok(v) && !v.contains(['.', '*', '>', '/', '\\']);
        /// Named optional fields of the trigger.
        type Fields<'a> = [(&'a str, &'a Option<String>)];
        let (needs, forbids): (&Fields, &Fields) = match self.kind {
            QueueKind::Rabbitmq => (
                &[("queue", &self.queue)],
                &[("stream", &self.stream), ("consumer", &self.consumer)],
            ),
            QueueKind::Nats => (
                &[("stream", &self.stream), ("consumer", &self.consumer)],
                &[("queue", &self.queue)],
            ),
        };
        for (f, v) in needs {
            let ok = match (self.kind, v.as_deref()) {
                (_, None) => false,
                (QueueKind::Rabbitmq, Some(v)) => name_ok(v),
                (QueueKind::Nats, Some(v)) => nats_name_ok(v),
            };
            if !ok {
                return Err(FieldError::new(
                    format!("{at}.{f}"),
                    match self.kind {
                        QueueKind::Rabbitmq => "a rabbitmq trigger needs its queue name (1-255 characters, no spaces)",
                        QueueKind::Nats => "a nats trigger needs its stream and durable consumer names (no spaces, `.`, `*`, `>`, `/`)",
                    },
                ));
            }
        }
        for (f, v) in forbids {
            if v.is_some() {
                return Err(FieldError::new(
                    format!("{at}.{f}"),
                    format!("is not used by a {} trigger", self.kind.as_str()),
                ));
            }
        }
        if self.messages_per_replica == 0 || self.messages_per_replica > 1_000_000 {
            return Err(FieldError::new(
                format!("{at}.messages_per_replica"),
                "must be between 1 and 1000000",
            ));
        }
        Ok(())
    }
}

/// The authority of what follows `scheme://`: up to the path, query or
/// fragment.
fn authority(rest: &str) -> &str {
    rest.split(['/', '?', '#']).next().unwrap_or("")
}

/// `url` with its password replaced by [`REDACTED`]; a user alone (a NATS
/// token) is replaced whole. A URL without credentials comes back as is.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let auth = authority(rest);
    let Some((userinfo, host)) = auth.rsplit_once('@') else {
        return url.to_string();
    };
    let shown = match userinfo.split_once(':') {
        Some((user, _)) => format!("{user}:{REDACTED}"),
        None if scheme == "nats" || scheme == "tls" => REDACTED.to_string(),
        None => userinfo.to_string(),
    };
    format!("{scheme}://{shown}@{host}{}", &rest[auth.len()..])
}

/// Validates an endpoint's list of triggers (`queue_triggers`).
pub fn validate_triggers(triggers: &[QueueTrigger]) -> Result<(), FieldError> {
    if triggers.len() > MAX_TRIGGERS {
        return Err(FieldError::new(
            "queue_triggers",
            format!("at most {MAX_TRIGGERS} triggers"),
        ));
    }
    for (i, t) in triggers.iter().enumerate() {
        t.validate(&format!("queue_triggers[{i}]"))?;
    }
    Ok(())
}

/// A change that sends back a trigger as the API showed it (password
/// `***`) keeps the stored secret: the trigger of the old list whose
/// shown URL is the same gives its URL.
pub fn keep_secrets(old: &[QueueTrigger], new: &mut [QueueTrigger]) {
    for t in new.iter_mut() {
        if !t.url.contains(REDACTED) {
            continue;
        }
        if let Some(o) = old.iter().find(|o| redact_url(&o.url) == t.url) {
            t.url = o.url.clone();
        }
    }
}

/// What the last read of one trigger showed, as the API reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TriggerStatus {
    /// `rabbitmq:QUEUE` or `nats:STREAM/CONSUMER`.
    pub trigger: String,
    /// Messages waiting; absent when the read failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub depth: Option<u64>,
    /// Replicas this trigger asks for (0 when the read failed).
    pub wants: u32,
    /// Why the read failed (queue missing, broker unreachable, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// When it was read.
    pub read_at: DateTime<Utc>,
}

/// Replicas one depth asks for: `ceil(depth / messages_per_replica)`,
/// capped by `max_replicas`. A failed read (`None`) asks for nothing: a
/// broker that is down never raises, nor lowers, what traffic wants.
pub fn trigger_wants(depth: Option<u64>, messages_per_replica: u32, max_replicas: u32) -> u32 {
    let Some(depth) = depth else {
        return 0;
    };
    let per = u64::from(messages_per_replica.max(1));
    let n = depth.div_ceil(per);
    u32::try_from(n).unwrap_or(u32::MAX).min(max_replicas)
}

/// What an endpoint's triggers ask for together: the highest wish of any
/// (the highest demand wins), and the total depth read.
pub fn queue_demand(
    triggers: &[QueueTrigger],
    depths: &[Option<u64>],
    max_replicas: u32,
) -> (u32, u64) {
    triggers
        .iter()
        .zip(depths)
        .fold((0, 0), |(wants, total), (t, d)| {
            (
                wants.max(trigger_wants(*d, t.messages_per_replica, max_replicas)),
                total.saturating_add(d.unwrap_or(0)),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rabbit(url: &str, queue: &str) -> QueueTrigger {
        QueueTrigger::rabbitmq(url, queue)
    }

    fn nats(stream: &str, consumer: &str) -> QueueTrigger {
        QueueTrigger {
            messages_per_replica: 5,
            ..QueueTrigger::nats("nats://127.0.0.1:4222", stream, consumer)
        }
    }

    #[test]
    fn passwords_and_tokens_are_redacted() {
        assert_eq!(
            redact_url("amqp://guest:s3cret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact_url("nats://tok3n@127.0.0.1:4222"),
            "nats://***@127.0.0.1:4222"
        );
        assert_eq!(redact_url("amqp://bob@h/v"), "amqp://bob@h/v");
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        // An `@` in the path is not a credential.
        assert_eq!(redact_url("amqp://h/v@x"), "amqp://h/v@x");
        let t = rabbit("amqp://u:pw@h:5672/%2f", "jobs");
        assert!(!t.redacted().url.contains("pw"));
        let mut back = vec![t.redacted()];
        keep_secrets(std::slice::from_ref(&t), &mut back);
        assert_eq!(back[0].url, t.url);
    }

    #[test]
    fn validation_names_the_field() {
        assert!(validate_triggers(&[rabbit("amqp://h", "q"), nats("S", "C")]).is_ok());
        let cases = [
            (rabbit("http://h", "q"), "queue_triggers[0].url"),
            (rabbit("amqps://h", "q"), "queue_triggers[0].url"),
            (rabbit("amqp://", "q"), "queue_triggers[0].url"),
            (rabbit("amqp h", "q"), "queue_triggers[0].url"),
            (rabbit("amqp://h", ""), "queue_triggers[0].queue"),
            (
                QueueTrigger {
                    stream: Some("S".into()),
                    ..rabbit("amqp://h", "q")
                },
                "queue_triggers[0].stream",
            ),
            (
                QueueTrigger {
                    messages_per_replica: 0,
                    ..rabbit("amqp://h", "q")
                },
                "queue_triggers[0].messages_per_replica",
            ),
            (nats("a.b", "C"), "queue_triggers[0].stream"),
            (
                QueueTrigger {
                    consumer: None,
                    ..nats("S", "C")
                },
                "queue_triggers[0].consumer",
            ),
            (
                QueueTrigger {
                    url: "amqp://h".into(),
                    ..nats("S", "C")
                },
                "queue_triggers[0].url",
            ),
        ];
        for (t, field) in cases {
            assert_eq!(validate_triggers(&[t]).unwrap_err().field, field);
        }
        let many = vec![rabbit("amqp://h", "q"); MAX_TRIGGERS + 1];
        assert_eq!(
            validate_triggers(&many).unwrap_err().field,
            "queue_triggers"
        );
    }

    #[test]
    fn demand_is_the_highest_wish_and_failed_reads_ask_for_nothing() {
        assert_eq!(trigger_wants(Some(0), 10, 4), 0);
        assert_eq!(trigger_wants(Some(1), 10, 4), 1);
        assert_eq!(trigger_wants(Some(21), 10, 4), 3);
        assert_eq!(trigger_wants(Some(500), 10, 4), 4);
        assert_eq!(trigger_wants(None, 10, 4), 0);
        let ts = [rabbit("amqp://h", "q"), nats("S", "C")];
        assert_eq!(queue_demand(&ts, &[Some(11), Some(11)], 9), (3, 22));
        assert_eq!(queue_demand(&ts, &[None, Some(0)], 9), (0, 0));
    }
}
