//! The one error type of the client.

use std::time::Duration;

use flotilla_core::api::ErrorBody;

/// How a request failed on the way, before or without an HTTP answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// No connection could be made: nothing listens, or the host is
    /// unknown. The request was not sent, so trying elsewhere is safe.
    Connect,
    /// The server did not answer within the request's timeout.
    Timeout,
    /// The connection broke, or the answer was not HTTP.
    Other,
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The server answered with a non-2xx status. `code`, `message` and
    /// `field` come from its error body (`{"error": {"code", "message",
    /// "details": {"field"}}}`); a body that is not one gives the code
    /// `http_<status>` and a message quoting the start of the body. Shown
    /// as the message with the status and code after it, for logs; a
    /// person-facing front end may show [`Error::message`] alone.
    #[error("{}", api_message(*status, code, message))]
    Api {
        /// HTTP status.
        status: u16,
        /// Machine-readable code (`not_found`, `invalid_field`, …).
        code: String,
        /// One line for a person.
        message: String,
        /// The offending request field (`details.field`), when named.
        field: Option<String>,
        /// How long the server asked to wait (`Retry-After`), if it did.
        retry_after: Option<Duration>,
    },
    /// The request failed on the way: no connection, a timeout, a reset.
    #[error("{}", transport_message(*kind, server, message))]
    Transport {
        /// The server URL (or URLs, comma-separated, when none answered).
        server: String,
        /// What kind of failure.
        kind: TransportKind,
        /// One line: what happened, from the HTTP library's causes.
        message: String,
    },
    /// The TLS handshake failed: the server's certificate is not trusted
    /// (a pinned fingerprint that does not match, an unknown issuer, a
    /// name it is not valid for) or the server does not speak TLS. Not
    /// transient: trying again meets the same certificate.
    #[error("TLS with {server} failed: {message}")]
    Tls {
        /// The server URL.
        server: String,
        /// What failed, naming both fingerprints for a pin mismatch.
        message: String,
    },
    /// The server answered 2xx with a body that is not the expected type.
    #[error("unexpected answer from the server: {source}")]
    Decode {
        /// Why it does not decode.
        #[source]
        source: serde_json::Error,
    },
    /// The client was set up wrong (no server URL, an invalid URL, TLS
    /// set-up): nothing was sent.
    #[error("invalid client setting {field}: {message}")]
    Config {
        /// Which setting.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
}

fn api_message(status: u16, code: &str, message: &str) -> String {
    if code.starts_with("http_") {
        // The message already quotes the status.
        message.to_string()
    } else {
        format!("{message} ({status} {code})")
    }
}

fn transport_message(kind: TransportKind, server: &str, message: &str) -> String {
    match kind {
        TransportKind::Connect => format!("cannot reach the server at {server}"),
        TransportKind::Timeout => format!("the server at {server} did not answer in time"),
        TransportKind::Other => message.to_string(),
    }
}

impl Error {
    /// The HTTP status, for an answer from the server.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The error code of the server's body, for an answer from the server.
    pub fn code(&self) -> Option<&str> {
        match self {
            Self::Api { code, .. } => Some(code),
            _ => None,
        }
    }

    /// The sentence for a person: the server's message for an answer, the
    /// whole text otherwise.
    pub fn message(&self) -> String {
        match self {
            Self::Api { message, .. } => message.clone(),
            other => other.to_string(),
        }
    }

    /// Whether trying again later may succeed: transport failures, 5xx,
    /// 408 and 429. Whether it is *safe* to try again is the request's
    /// business (see [`crate::RetryPolicy`]).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Transport { .. } => true,
            Self::Api { status, .. } => *status >= 500 || matches!(status, 408 | 429),
            Self::Decode { .. } | Self::Config { .. } | Self::Tls { .. } => false,
        }
    }

    /// Whether no connection could be made to any server.
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            Self::Transport {
                kind: TransportKind::Connect,
                ..
            }
        )
    }

    /// 404: the resource does not exist (or is another tenant's).
    pub fn is_not_found(&self) -> bool {
        self.status() == Some(404)
    }

    /// 409: refused because of the resource's state, e.g. stopping an
    /// instance that already ended.
    pub fn is_conflict(&self) -> bool {
        self.status() == Some(409) || self.code() == Some("conflict")
    }

    /// 401 or 403: the key was refused.
    pub fn is_auth(&self) -> bool {
        matches!(self.status(), Some(401 | 403))
    }

    /// Whether another server URL may answer where this one did not: no
    /// connection (the request was never sent) or 503 (this replica does not
    /// serve now: starting, draining, or not the leader).
    /// The server did not answer within the request's timeout.
    pub(crate) fn timed_out(&self) -> bool {
        matches!(
            self,
            Self::Transport {
                kind: TransportKind::Timeout,
                ..
            }
        )
    }

    pub(crate) fn fails_over(&self) -> bool {
        self.is_unreachable() || self.status() == Some(503)
    }

    /// The wait a 429 or 503 asked for.
    pub(crate) fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Api { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// The error of a non-2xx answer with `body`.
    pub(crate) fn from_answer(status: u16, body: &[u8], retry_after: Option<Duration>) -> Self {
        if let Ok(b) = serde_json::from_slice::<ErrorBody>(body) {
            let field = b
                .error
                .details
                .get("field")
                .and_then(|f| f.as_str())
                .map(str::to_string);
            return Self::Api {
                status,
                code: b.error.code,
                message: one_line(&b.error.message),
                field,
                retry_after,
            };
        }
        let text = one_line(&String::from_utf8_lossy(body));
        let reason = reqwest::StatusCode::from_u16(status)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("error");
        let message = if text.is_empty() {
            format!("server answered {status} {reason}")
        } else {
            let short: String = text.chars().take(200).collect();
            format!("server answered {status} {reason}: {short}")
        };
        Self::Api {
            status,
            code: format!("http_{status}"),
            message,
            field: None,
            retry_after,
        }
    }

    /// The error of a failed request to `server`.
    pub(crate) fn from_reqwest(server: &str, e: &reqwest::Error) -> Self {
        if let Some(tls) = flotilla_tls::find(e) {
            return Self::Tls {
                server: server.to_string(),
                message: flotilla_tls::explain(tls),
            };
        }
        let kind = if e.is_connect() {
            TransportKind::Connect
        } else if e.is_timeout() {
            TransportKind::Timeout
        } else {
            TransportKind::Other
        };
        // reqwest's own text names the URL; its sources say what happened.
        let mut message = format!("request to {server} failed");
        let mut source: Option<&dyn std::error::Error> = std::error::Error::source(e);
        while let Some(s) = source {
            message.push_str(": ");
            message.push_str(&s.to_string());
            source = s.source();
        }
        Self::Transport {
            server: server.to_string(),
            kind,
            message: one_line(&message),
        }
    }
}

/// `s` on one line: runs of whitespace, newlines included, become one
/// space, so a message never breaks a terminal line or a log record.
pub(crate) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_give_code_message_and_field() {
        let body = br#"{"error":{"code":"invalid_field","message":"gpus: must be\nat least 1","details":{"field":"gpus"}}}"#;
        let e = Error::from_answer(422, body, None);
        assert_eq!(e.message(), "gpus: must be at least 1");
        assert_eq!(
            e.to_string(),
            "gpus: must be at least 1 (422 invalid_field)"
        );
        match &e {
            Error::Api {
                status,
                code,
                field,
                ..
            } => {
                assert_eq!((*status, code.as_str()), (422, "invalid_field"));
                assert_eq!(field.as_deref(), Some("gpus"));
            }
            other => panic!("{other:?}"),
        }
        assert!(!e.is_transient() && !e.is_not_found());
    }

    #[test]
    fn other_bodies_are_quoted_on_one_line() {
        let e = Error::from_answer(502, b"<html>\nbad\n</html>", None);
        assert_eq!(
            e.to_string(),
            "server answered 502 Bad Gateway: <html> bad </html>"
        );
        assert_eq!(e.code(), Some("http_502"));
        assert!(e.is_transient() && !e.fails_over());
        let e = Error::from_answer(503, b"", Some(Duration::from_secs(2)));
        assert_eq!(e.to_string(), "server answered 503 Service Unavailable");
        assert!(e.fails_over());
        assert_eq!(e.retry_after(), Some(Duration::from_secs(2)));
    }

    #[test]
    fn statuses_classify() {
        let e = |s| Error::from_answer(s, b"", None);
        assert!(e(404).is_not_found());
        assert!(e(409).is_conflict());
        assert!(e(401).is_auth() && e(403).is_auth() && !e(404).is_auth());
        assert!(e(429).is_transient() && e(500).is_transient() && e(408).is_transient());
        assert!(!e(400).is_transient() && !e(422).is_transient());
        let unreachable = Error::Transport {
            server: "http://a".into(),
            kind: TransportKind::Connect,
            message: String::new(),
        };
        assert!(unreachable.is_transient() && unreachable.fails_over());
        assert_eq!(
            unreachable.to_string(),
            "cannot reach the server at http://a"
        );
    }
}
