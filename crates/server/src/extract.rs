//! Extractors that turn malformed requests into errors naming the part at
//! fault, instead of axum's plain-text rejections.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::error::ApiError;

/// Largest request body accepted, in bytes.
pub const BODY_LIMIT: usize = 1024 * 1024;

/// A JSON body whose errors name the JSON path at fault.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| match e {
            BytesRejection::FailedToBufferBody(_) => ApiError::too_large(BODY_LIMIT),
            other => ApiError::bad_request("body", other.body_text()),
        })?;
        parse_json(&bytes).map(ApiJson)
    }
}

/// Parses `bytes` as `T`; errors carry the JSON path of the bad value.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // Every body of this API is an object; serde would also read a struct
    // from an array, which only yields confusing errors.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::bad_request("body", "must be a JSON object"));
    }
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let result: Result<T, _> = serde_path_to_error::deserialize(de);
    result.map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = inner.to_string();
        use serde_json::error::Category;
        match inner.classify() {
            Category::Syntax | Category::Eof | Category::Io => {
                ApiError::bad_request("body", format!("malformed JSON: {msg}"))
            }
            Category::Data => {
                // `unknown field `x`` is reported at the parent's path.
                let field = match (msg.strip_prefix("unknown field `"), path.as_str()) {
                    (Some(rest), p) => {
                        let name = rest.split('`').next().unwrap_or_default();
                        if p == "." || p.is_empty() {
                            name.to_string()
                        } else if p == name || p.ends_with(&format!(".{name}")) {
                            p.to_string()
                        } else {
                            format!("{p}.{name}")
                        }
                    }
                    (None, "." | "") => missing_field(&msg).unwrap_or_else(|| "body".to_string()),
                    (None, p) => p.to_string(),
                };
                let msg = msg.split(" at line ").next().unwrap_or(&msg).to_string();
                ApiError::field(flotilla_core::FieldError::new(field, msg))
            }
        }
    })
}

fn missing_field(msg: &str) -> Option<String> {
    let rest = msg.strip_prefix("missing field `")?;
    Some(rest.split('`').next()?.to_string())
}

/// `?limit=&cursor=` of every list.
#[derive(Debug, Clone, Default)]
pub struct Pagination {
    /// Page size, 1–1000 (default 100).
    pub limit: u32,
    /// Opaque cursor from the previous page.
    pub cursor: Option<String>,
}

#[derive(Deserialize)]
struct RawPagination {
    limit: Option<String>,
    cursor: Option<String>,
}

impl<S: Send + Sync> FromRequestParts<S> for Pagination {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let raw: RawPagination = serde_urlencoded_query(parts.uri.query())?;
        let limit = page_limit(raw.limit.as_deref())?;
        if let Some(c) = &raw.cursor {
            if c.is_empty()
                || c.len() > 64
                || !c.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '_')
            {
                return Err(ApiError::bad_request(
                    "cursor",
                    "is not a cursor returned by this API",
                ));
            }
        }
        Ok(Self {
            limit,
            cursor: raw.cursor,
        })
    }
}

/// The `limit` query parameter of a paged read: 1–1000, 100 when absent.
pub fn page_limit(raw: Option<&str>) -> Result<u32, ApiError> {
    match raw {
        None => Ok(100),
        Some(s) => s
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=1000).contains(n))
            .ok_or_else(|| ApiError::bad_request("limit", "must be a whole number from 1 to 1000")),
    }
}

/// A time in query parameter `field`, RFC 3339 with any offset, as UTC:
/// one parser so that every route accepts and refuses the same times.
pub fn instant(raw: &str, field: &str) -> Result<DateTime<Utc>, ApiError> {
    DateTime::parse_from_rfc3339(raw)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|_| {
            ApiError::bad_request(field, "must be an RFC 3339 time like 2025-01-01T00:00:00Z")
        })
}

/// [`instant`] for a parameter the route cannot do without.
pub fn required_instant(raw: Option<&str>, field: &str) -> Result<DateTime<Utc>, ApiError> {
    instant(
        raw.ok_or_else(|| ApiError::bad_request(field, "is required (RFC 3339)"))?,
        field,
    )
}

/// Parses a query string into `T`, ignoring keys `T` does not name.
pub fn serde_urlencoded_query<T: DeserializeOwned>(q: Option<&str>) -> Result<T, ApiError> {
    axum::extract::Query::<T>::try_from_uri(
        &format!("/?{}", q.unwrap_or_default())
            .parse()
            .map_err(|_| ApiError::bad_request("query", "is not a valid query string"))?,
    )
    .map(|q| q.0)
    .map_err(|e| ApiError::bad_request("query", e.body_text()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_core::instance::CreateInstance;

    fn field_of(body: &str) -> (u16, String) {
        let e = parse_json::<CreateInstance>(body.as_bytes()).unwrap_err();
        (
            e.status.as_u16(),
            e.details["field"].as_str().unwrap_or("").to_string(),
        )
    }

    #[test]
    fn json_errors_name_the_field() {
        assert_eq!(field_of("{"), (400, "body".into()));
        assert_eq!(
            field_of(r#"{"gpus": "two", "command": ["x"]}"#),
            (422, "gpus".into())
        );
        assert_eq!(
            field_of(r#"{"gpus": -1, "command": ["x"]}"#),
            (422, "gpus".into())
        );
        assert_eq!(
            field_of(r#"{"gpus": 1, "command": ["x"], "colour": 1}"#),
            (422, "colour".into())
        );
        assert_eq!(field_of(r#"{"command": ["x"]}"#), (422, "gpus".into()));
        assert_eq!(
            field_of(r#"{"gpus": 1, "command": [1]}"#),
            (422, "command[0]".into())
        );
        assert_eq!(
            field_of(r#"{"gpus": 1, "command": ["x"], "env": {"A": 1}}"#),
            (422, "env.A".into())
        );
    }
}
