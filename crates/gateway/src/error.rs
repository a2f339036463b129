//! Errors: what a caller is answered ([`Refusal`], OpenAI-style JSON, all
//! mapped to a status in one place) and what starting the gateway can fail
//! at ([`GatewayError`]).

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use serde_json::json;

use crate::body::GatewayBody;

/// Why the gateway answered a request itself instead of a replica.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Refusal {
    /// No `Authorization: Bearer` header.
    #[error("missing inference key: send `Authorization: Bearer <key>`")]
    MissingKey,
    /// The key is not known.
    #[error("invalid inference key")]
    InvalidKey,
    /// No endpoint of that name for the caller (another tenant's endpoint
    /// is answered the same, so names do not leak across tenants).
    #[error("endpoint `{0}` not found")]
    EndpointNotFound(String),
    /// No endpoint of the caller serves that model.
    #[error("model: `{0}` not found")]
    ModelNotFound(String),
    /// Nothing is served at this path.
    #[error("no route for {0}: use /e/{{endpoint}}/..., an endpoint host, or /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models")]
    NoRoute(String),
    /// The request body is not what the path needs.
    #[error("{field}: {message}")]
    BadRequest {
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// The body is over the gateway's limit.
    #[error("request body over {0} bytes")]
    TooLarge(usize),
    /// The tenant's budget hard cap is reached.
    #[error("the budget's hard cap is reached: raise it or wait for the next period")]
    OverHardCap,
    /// The key is over the endpoint's rate limit.
    #[error("rate limit of {rps} requests per second for this key reached")]
    RateLimited {
        /// The limit.
        rps: u32,
        /// Seconds until a request would pass.
        retry_after_s: u64,
    },
    /// Too many requests without a valid key from this source address
    /// (none, unknown, revoked): guessing keys is slowed down.
    #[error("too many requests without a valid inference key from this address")]
    TooManyUnauthenticated {
        /// Seconds until a request would pass.
        retry_after_s: u64,
    },
    /// `/metrics` without the operator's key.
    #[error("metrics need an operator key: send `Authorization: Bearer <operator key>`")]
    MetricsForbidden,
    /// The endpoint's wait queue is full.
    #[error("endpoint `{0}` is at capacity and its queue is full")]
    QueueFull(String),
    /// No replica took the request before the endpoint's deadline.
    #[error("no replica of endpoint `{0}` became available within its queue timeout")]
    QueueTimeout(String),
    /// The replica failed before answering.
    #[error("upstream replica failed: {0}")]
    Upstream(String),
    /// The control plane could not be asked about the key.
    #[error("the control plane is unavailable")]
    ControlUnavailable,
}

impl Refusal {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::MissingKey | Self::InvalidKey => StatusCode::UNAUTHORIZED,
            Self::EndpointNotFound(_) | Self::ModelNotFound(_) | Self::NoRoute(_) => {
                StatusCode::NOT_FOUND
            }
            Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::OverHardCap => StatusCode::PAYMENT_REQUIRED,
            Self::MetricsForbidden => StatusCode::UNAUTHORIZED,
            Self::RateLimited { .. } | Self::TooManyUnauthenticated { .. } | Self::QueueFull(_) => {
                StatusCode::TOO_MANY_REQUESTS
            }
            Self::QueueTimeout(_) | Self::ControlUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::Upstream(_) => StatusCode::BAD_GATEWAY,
        }
    }

    /// OpenAI's `error.code`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::MissingKey | Self::InvalidKey => "invalid_api_key",
            Self::EndpointNotFound(_) => "endpoint_not_found",
            Self::ModelNotFound(_) => "model_not_found",
            Self::NoRoute(_) => "not_found",
            Self::BadRequest { .. } => "invalid_request",
            Self::TooLarge(_) => "request_too_large",
            Self::OverHardCap => "insufficient_quota",
            Self::RateLimited { .. } | Self::TooManyUnauthenticated { .. } => "rate_limit_exceeded",
            Self::MetricsForbidden => "operator_key_required",
            Self::QueueFull(_) => "queue_full",
            Self::QueueTimeout(_) => "no_replica_available",
            Self::Upstream(_) => "upstream_error",
            Self::ControlUnavailable => "control_plane_unavailable",
        }
    }

    /// OpenAI's `error.type`.
    fn kind(&self) -> &'static str {
        match self {
            Self::MissingKey | Self::InvalidKey | Self::MetricsForbidden => "authentication_error",
            Self::OverHardCap => "insufficient_quota",
            Self::RateLimited { .. } | Self::TooManyUnauthenticated { .. } | Self::QueueFull(_) => {
                "rate_limit_error"
            }
            Self::QueueTimeout(_) | Self::Upstream(_) | Self::ControlUnavailable => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// Seconds a client should wait before retrying, when that helps.
    fn retry_after_s(&self) -> Option<u64> {
        match self {
            Self::RateLimited { retry_after_s, .. }
            | Self::TooManyUnauthenticated { retry_after_s } => Some((*retry_after_s).max(1)),
            Self::QueueFull(_) | Self::QueueTimeout(_) | Self::ControlUnavailable => Some(1),
            _ => None,
        }
    }

    /// The response sent to the caller.
    pub fn response(&self) -> Response<GatewayBody> {
        let body = json!({"error": {"message": self.to_string(), "type": self.kind(), "code": self.code()}});
        let mut r = Response::new(GatewayBody::full(Bytes::from(body.to_string())));
        *r.status_mut() = self.status();
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(s) = self.retry_after_s() {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// What starting or running the gateway failed at.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The listener's address could not be read.
    #[error("gateway listener")]
    Listener(#[source] std::io::Error),
    /// A configuration value is out of range.
    #[error("invalid gateway configuration {field}: {message}")]
    Config {
        /// The setting.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
}
