//! The one error type of the API and its single mapping to HTTP: every
//! non-2xx answer has the body `{"error": {"code", "message", "details"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use flotilla_core::api::{ErrorBody, ErrorDetail};
use flotilla_core::{FieldError, QuotaExceeded};
use flotilla_store::StoreError;
use serde_json::json;

/// An API error: status, machine code, message, details.
#[derive(Debug)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Machine-readable code.
    pub code: &'static str,
    /// Human sentence.
    pub message: String,
    /// Structured context.
    pub details: serde_json::Value,
    /// Seconds, for 429.
    pub retry_after: Option<u64>,
}

/// Handler result.
pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            details: json!({}),
            retry_after: None,
        }
    }

    /// 422: a value is wrong; names the field.
    pub fn field(e: FieldError) -> Self {
        Self {
            details: json!({ "field": e.field }),
            ..Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_field",
                e.to_string(),
            )
        }
    }

    /// 400: the request cannot be read; names the part at fault.
    pub fn bad_request(field: &str, message: impl Into<String>) -> Self {
        let message = message.into();
        Self {
            details: json!({ "field": field }),
            ..Self::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("{field}: {message}"),
            )
        }
    }

    /// 401.
    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthenticated", message)
    }

    /// 403: the caller's role does not allow this.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", message)
    }

    /// 404; also what another tenant's resources look like.
    pub fn not_found(what: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("{what} not found"),
        )
    }

    /// 409: the resource's state forbids the change.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", message)
    }

    /// 413.
    pub fn too_large(limit: usize) -> Self {
        Self {
            details: json!({ "field": "body", "limit_bytes": limit }),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                format!("body: request body is larger than {limit} bytes"),
            )
        }
    }

    /// 429 with `Retry-After`.
    pub fn rate_limited(retry_after_s: u64) -> Self {
        Self {
            retry_after: Some(retry_after_s.max(1)),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                "too many requests for this API key; retry after the Retry-After seconds",
            )
        }
    }

    /// 429 with `Retry-After` for requests without a valid key, limited
    /// by their source address.
    pub fn rate_limited_anonymous(retry_after_s: u64) -> Self {
        Self {
            retry_after: Some(retry_after_s.max(1)),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                "too many requests without a valid API key from this address; retry after the Retry-After seconds",
            )
        }
    }

    /// 500; the cause is logged, not shown.
    pub fn internal(cause: impl std::fmt::Display) -> Self {
        tracing::error!(error = %cause, "internal error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "internal error; see the server log",
        )
    }

    /// 503 while shutting down or when the database is unavailable.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }
}

impl From<QuotaExceeded> for ApiError {
    fn from(q: QuotaExceeded) -> Self {
        Self {
            details: json!({ "quota": q.quota, "limit": q.limit, "in_use": q.in_use, "requested": q.requested }),
            ..Self::new(StatusCode::FORBIDDEN, "quota_exceeded", q.to_string())
        }
    }
}

impl From<FieldError> for ApiError {
    fn from(e: FieldError) -> Self {
        Self::field(e)
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(what) => Self::not_found(what),
            StoreError::AlreadyExists(what) => Self::conflict(format!("{what} already exists")),
            StoreError::Conflict(m) => Self::conflict(m),
            StoreError::Quota(q) => q.into(),
            StoreError::Unavailable(e) => {
                tracing::warn!(error = %e, "database unavailable");
                Self {
                    retry_after: Some(1),
                    ..Self::unavailable("the database is unavailable; retry shortly")
                }
            }
            // A lock held by a stalled replica, given up on rather than
            // waited for (`flotilla_store::leases::Timeouts`).
            StoreError::Busy(e) => {
                tracing::warn!(error = %e, "database busy: gave up waiting for a lock");
                Self {
                    retry_after: Some(1),
                    ..Self::unavailable("the database is busy; retry shortly")
                }
            }
            other => Self::internal(other),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.to_string(),
                message: self.message,
                details: self.details,
            },
        };
        let mut resp = (self.status, axum::Json(body)).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}
