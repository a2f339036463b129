//! A small API client over reqwest: one method per route, every failure
//! mapped to a one-line error a person can act on, pages followed to the
//! end, and the NDJSON log follow stream.
//!
//! Methods return the raw JSON of the answer ([`serde_json::Value`]) so
//! that `--json` prints exactly what the server said; callers decode it
//! into the `flotilla_core::api` types with [`decode`] for human output.
//! This module never prints.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use anyhow::{anyhow, Result};
use flotilla_core::api::{ErrorBody, LogLine, Page};
use reqwest::{header, Method, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

/// Page size asked for when following list cursors.
pub const PAGE_SIZE: usize = 100;
/// Page size asked for when reading logs without following.
pub const LOG_PAGE_SIZE: usize = 1000;
/// How long one ordinary request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Attempts for a request that failed in a way that may pass (connection
/// reset, 502/503/504, 429). POSTs carry an idempotency key, so a retried
/// create does not create twice.
const ATTEMPTS: u32 = 3;

/// Why a request failed, kept typed so callers can tell a refused
/// connection or a conflict from other failures.
#[derive(Debug)]
pub enum ClientError {
    /// The server answered with an error body (or a non-2xx status).
    Api {
        /// HTTP status.
        status: u16,
        /// The body's `code`, or `http_<status>` when the body had none.
        code: String,
        /// The body's `message`.
        message: String,
    },
    /// Nothing listens at the server URL.
    Unreachable {
        /// The server URL.
        server: String,
    },
    /// The request failed on the way (reset, timeout, bad answer).
    Transport {
        /// One line.
        message: String,
    },
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Api { message, .. } => f.write_str(message),
            Self::Unreachable { server } => write!(
                f,
                "cannot reach the server at {server}: is `flotilla up` running?"
            ),
            Self::Transport { message } => f.write_str(message),
        }
    }
}

impl std::error::Error for ClientError {}

impl ClientError {
    /// Whether trying again later may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Api { status, .. } => matches!(status, 429 | 502 | 503 | 504),
            Self::Unreachable { .. } | Self::Transport { .. } => true,
        }
    }
}

/// Whether the server refused a request because of the resource's state
/// (409), e.g. stopping an instance that already ended.
pub fn is_conflict(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<ClientError>(),
        Some(ClientError::Api { status, code, .. }) if *status == 409 || code == "conflict"
    )
}

/// Whether the server answered 404: the resource does not exist (or is
/// another tenant's).
pub fn is_not_found(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<ClientError>(),
        Some(ClientError::Api { status, .. }) if *status == 404
    )
}

/// Whether an error from this module may pass when tried again.
pub fn is_transient(e: &anyhow::Error) -> bool {
    e.downcast_ref::<ClientError>()
        .is_some_and(ClientError::is_transient)
}

/// Decodes a raw answer into a wire type.
pub fn decode<T: DeserializeOwned>(v: Value) -> Result<T> {
    serde_json::from_value(v).map_err(|e| {
        anyhow::Error::new(ClientError::Transport {
            message: format!("unexpected answer from the server: {e}"),
        })
    })
}

/// A fresh idempotency key in the UUIDv7 layout: 48 bits of milliseconds,
/// then random bits. Randomness comes from std's per-process random hash
/// keys, which is plenty to keep two creates apart.
pub fn idempotency_key() -> String {
    use std::hash::{BuildHasher, Hasher};
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(now.as_nanos());
    h.write_u32(std::process::id());
    let a = h.finish();
    h.write_u64(a);
    let b = h.finish();
    let ms = (now.as_millis() as u64) & 0xffff_ffff_ffff;
    let ver = 0x7000 | (a & 0x0fff);
    let var = 0x8000 | ((a >> 12) & 0x3fff);
    let tail = b & 0xffff_ffff_ffff;
    format!(
        "{:08x}-{:04x}-{ver:04x}-{var:04x}-{tail:012x}",
        ms >> 16,
        ms & 0xffff
    )
}

/// A typed view of the API at one server with one key.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    server: String,
    api_key: String,
}

impl Client {
    /// A client for `server` (a base URL such as `http://127.0.0.1:7420`).
    pub fn new(server: &str, api_key: &str) -> Result<Self> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .user_agent(concat!("flotilla-cli/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| anyhow!("cannot set up the HTTP client: {e}"))?;
        Ok(Self {
            http,
            server: server.trim_end_matches('/').to_string(),
            api_key: api_key.to_string(),
        })
    }

    fn transport(&self, e: reqwest::Error) -> anyhow::Error {
        anyhow::Error::new(map_reqwest(&self.server, e))
    }

    /// One request, retried while the failure may pass. Answers `Null` for
    /// an empty body (204).
    async fn request(
        &self,
        method: Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<&Value>,
    ) -> Result<Value> {
        let idem = (method == Method::POST).then(idempotency_key);
        let mut attempt = 0;
        loop {
            attempt += 1;
            match self
                .request_once(&method, path, query, body, idem.as_deref())
                .await
            {
                Ok(v) => return Ok(v),
                Err((e, retry_after)) if attempt < ATTEMPTS && e.is_transient() => {
                    let backoff = retry_after
                        .unwrap_or(Duration::from_millis(300 * u64::from(attempt)))
                        .min(Duration::from_secs(5));
                    tracing::debug!(error = %e, ?backoff, "retrying request");
                    tokio::time::sleep(backoff).await;
                }
                Err((e, _)) => return Err(anyhow::Error::new(e)),
            }
        }
    }

    async fn request_once(
        &self,
        method: &Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<&Value>,
        idem: Option<&str>,
    ) -> std::result::Result<Value, (ClientError, Option<Duration>)> {
        let url = format!("{}{path}", self.server);
        let mut req = self
            .http
            .request(method.clone(), &url)
            .bearer_auth(&self.api_key)
            .timeout(REQUEST_TIMEOUT)
            .header(header::ACCEPT, "application/json");
        if !query.is_empty() {
            req = req.query(query);
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        if let Some(k) = idem {
            req = req.header("Idempotency-Key", k);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| (map_reqwest(&self.server, e), None))?;
        let status = resp.status();
        let retry_after = resp
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| (map_reqwest(&self.server, e), None))?;
        if !status.is_success() {
            return Err((api_error(status, &bytes), retry_after));
        }
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&bytes).map_err(|e| {
            let message = format!("unexpected answer from the server: {e}");
            (ClientError::Transport { message }, None)
        })
    }

    /// GET returning the raw answer.
    pub async fn get(&self, path: &str, query: &[(&str, String)]) -> Result<Value> {
        self.request(Method::GET, path, query, None).await
    }

    /// GET asking for CSV (`Accept: text/csv`): the body and the next
    /// page's cursor (`X-Next-Cursor`), if any.
    pub async fn get_csv(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<(String, Option<String>)> {
        let resp = self
            .http
            .get(format!("{}{path}", self.server))
            .bearer_auth(&self.api_key)
            .timeout(REQUEST_TIMEOUT)
            .header(header::ACCEPT, "text/csv")
            .query(query)
            .send()
            .await
            .map_err(|e| self.transport(e))?;
        let status = resp.status();
        let next = resp
            .headers()
            .get("x-next-cursor")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let bytes = resp.bytes().await.map_err(|e| self.transport(e))?;
        if !status.is_success() {
            return Err(anyhow::Error::new(api_error(status, &bytes)));
        }
        Ok((String::from_utf8_lossy(&bytes).into_owned(), next))
    }

    /// Every page of a CSV list as one CSV text: the header of the first
    /// page, then the rows of every page.
    pub async fn list_csv(&self, path: &str, query: &[(&str, String)]) -> Result<String> {
        let mut out = String::new();
        let mut cursor: Option<String> = None;
        loop {
            let mut q = query.to_vec();
            q.push(("limit", PAGE_SIZE.to_string()));
            if let Some(c) = &cursor {
                q.push(("cursor", c.clone()));
            }
            let (text, next) = self.get_csv(path, &q).await?;
            if out.is_empty() {
                out.push_str(&text);
            } else {
                // Later pages repeat the header line: skip it.
                out.push_str(text.split_once('\n').map_or("", |(_, rows)| rows));
            }
            match next {
                Some(n) if cursor.as_deref() != Some(n.as_str()) => cursor = Some(n),
                _ => break,
            }
        }
        Ok(out)
    }

    /// POST with a JSON body and a fresh idempotency key.
    pub async fn post<B: Serialize>(&self, path: &str, body: &B) -> Result<Value> {
        let body = serde_json::to_value(body)?;
        self.request(Method::POST, path, &[], Some(&body)).await
    }

    /// PUT with a JSON body.
    pub async fn put<B: Serialize>(&self, path: &str, body: &B) -> Result<Value> {
        let body = serde_json::to_value(body)?;
        self.request(Method::PUT, path, &[], Some(&body)).await
    }

    /// DELETE.
    pub async fn delete(&self, path: &str) -> Result<()> {
        self.request(Method::DELETE, path, &[], None)
            .await
            .map(drop)
    }

    /// Every item of a paginated list, following cursors, or the first
    /// `limit` of them.
    pub async fn list(
        &self,
        path: &str,
        query: &[(&str, String)],
        limit: Option<usize>,
    ) -> Result<Vec<Value>> {
        let mut items = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let want = limit.map_or(PAGE_SIZE, |l| (l - items.len()).clamp(1, PAGE_SIZE));
            let mut q = query.to_vec();
            q.push(("limit", want.to_string()));
            if let Some(c) = &cursor {
                q.push(("cursor", c.clone()));
            }
            let page: Page<Value> = decode(self.get(path, &q).await?)?;
            let empty = page.items.is_empty();
            items.extend(page.items);
            if let Some(l) = limit {
                if items.len() >= l {
                    items.truncate(l);
                    break;
                }
            }
            match page.next_cursor {
                // A repeated cursor or an empty page would loop forever.
                Some(next) if !empty && cursor.as_deref() != Some(next.as_str()) => {
                    cursor = Some(next)
                }
                _ => break,
            }
        }
        Ok(items)
    }

    // ---- Routes -----------------------------------------------------------

    /// `GET /v1/me`.
    pub async fn me(&self) -> Result<Value> {
        self.get("/v1/me", &[]).await
    }

    /// `GET /v1/instances/{id}`.
    pub async fn instance(&self, id: &str) -> Result<Value> {
        self.get(&format!("/v1/instances/{id}"), &[]).await
    }

    /// `POST /v1/instances/{id}/stop`.
    pub async fn stop_instance(&self, id: &str) -> Result<Value> {
        self.post(&format!("/v1/instances/{id}/stop"), &serde_json::json!({}))
            .await
    }

    /// One page of an instance's log from `since`: the lines and the next
    /// sequence number to ask for.
    pub async fn logs_page(&self, id: &str, since: u64) -> Result<Page<LogLine>> {
        let q = [
            ("since", since.to_string()),
            ("limit", LOG_PAGE_SIZE.to_string()),
        ];
        decode(self.get(&format!("/v1/instances/{id}/logs"), &q).await?)
    }

    /// Every log line from `since` on that the server has now.
    pub async fn logs_all(&self, id: &str, mut since: u64) -> Result<Vec<LogLine>> {
        let mut lines = Vec::new();
        loop {
            let page = self.logs_page(id, since).await?;
            let before = since;
            for l in page.items {
                if l.seq >= since {
                    since = l.seq + 1;
                    lines.push(l);
                }
            }
            let cursor = page.next_cursor.and_then(|c| c.parse::<u64>().ok());
            match cursor {
                Some(c) if since > before => since = since.max(c),
                _ => break,
            }
        }
        Ok(lines)
    }

    /// Opens the follow stream of an instance's log from `since`.
    pub async fn follow_logs(&self, id: &str, since: u64) -> Result<LogFollow> {
        let url = format!("{}/v1/instances/{id}/logs", self.server);
        let resp = self
            .http
            .get(&url)
            .bearer_auth(&self.api_key)
            .header(header::ACCEPT, "application/x-ndjson")
            .query(&[("since", since.to_string()), ("follow", "true".to_string())])
            .send()
            .await
            .map_err(|e| self.transport(e))?;
        let status = resp.status();
        if !status.is_success() {
            let bytes = resp.bytes().await.unwrap_or_default();
            return Err(anyhow::Error::new(api_error(status, &bytes)));
        }
        let ndjson = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("ndjson"));
        let mut follow = LogFollow {
            server: self.server.clone(),
            resp: None,
            buf: Vec::new(),
            pending: VecDeque::new(),
        };
        if ndjson {
            follow.resp = Some(resp);
        } else {
            // A server without streaming answered one page: hand its lines
            // out and end; the caller reconnects from the next sequence.
            let bytes = resp.bytes().await.map_err(|e| self.transport(e))?;
            let page: Page<LogLine> = serde_json::from_slice(&bytes).map_err(|e| {
                anyhow::Error::new(ClientError::Transport {
                    message: format!("unexpected answer from the server: {e}"),
                })
            })?;
            follow.pending.extend(page.items);
        }
        Ok(follow)
    }
}

/// The follow stream of an instance's log: one [`LogLine`] per NDJSON line.
pub struct LogFollow {
    server: String,
    resp: Option<reqwest::Response>,
    buf: Vec<u8>,
    pending: VecDeque<LogLine>,
}

impl LogFollow {
    /// The next line; `None` when the server ended the stream.
    pub async fn next(&mut self) -> Result<Option<LogLine>> {
        if let Some(l) = self.pending.pop_front() {
            return Ok(Some(l));
        }
        loop {
            if let Some(pos) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=pos).collect();
                match parse_ndjson_line(&line)? {
                    Some(l) => return Ok(Some(l)),
                    None => continue,
                }
            }
            let Some(resp) = self.resp.as_mut() else {
                return Ok(None);
            };
            match resp.chunk().await {
                Ok(Some(bytes)) => self.buf.extend_from_slice(&bytes),
                Ok(None) => {
                    self.resp = None;
                    let rest = std::mem::take(&mut self.buf);
                    return parse_ndjson_line(&rest);
                }
                Err(e) => {
                    self.resp = None;
                    return Err(anyhow::Error::new(map_reqwest(&self.server, e)));
                }
            }
        }
    }
}

fn parse_ndjson_line(raw: &[u8]) -> Result<Option<LogLine>> {
    let text = String::from_utf8_lossy(raw);
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    if let Ok(line) = serde_json::from_str::<LogLine>(text) {
        return Ok(Some(line));
    }
    // The server may end a stream with an error object.
    if let Ok(body) = serde_json::from_str::<ErrorBody>(text) {
        return Err(anyhow::Error::new(ClientError::Api {
            status: 500,
            code: body.error.code,
            message: body.error.message,
        }));
    }
    Err(anyhow::Error::new(ClientError::Transport {
        message: "unexpected log line from the server".to_string(),
    }))
}

fn api_error(status: StatusCode, body: &[u8]) -> ClientError {
    if let Ok(b) = serde_json::from_slice::<ErrorBody>(body) {
        return ClientError::Api {
            status: status.as_u16(),
            code: b.error.code,
            message: crate::output::one_line(&b.error.message),
        };
    }
    let text = crate::output::one_line(&String::from_utf8_lossy(body));
    let reason = status.canonical_reason().unwrap_or("error");
    let message = if text.is_empty() {
        format!("server answered {} {reason}", status.as_u16())
    } else {
        let short: String = text.chars().take(200).collect();
        format!("server answered {} {reason}: {short}", status.as_u16())
    };
    ClientError::Api {
        status: status.as_u16(),
        code: format!("http_{}", status.as_u16()),
        message,
    }
}

fn map_reqwest(server: &str, e: reqwest::Error) -> ClientError {
    if e.is_connect() {
        return ClientError::Unreachable {
            server: server.to_string(),
        };
    }
    if e.is_timeout() {
        return ClientError::Transport {
            message: format!("the server at {server} did not answer in time"),
        };
    }
    // reqwest's own text names the URL; its sources say what happened.
    let mut message = format!("request to {server} failed");
    let mut source: Option<&dyn std::error::Error> = std::error::Error::source(&e);
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    ClientError::Transport {
        message: crate::output::one_line(&message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idempotency_keys_look_like_uuids_and_differ() {
        let a = idempotency_key();
        let b = idempotency_key();
        assert_ne!(a, b);
        let parts: Vec<usize> = a.split('-').map(str::len).collect();
        assert_eq!(parts, vec![8, 4, 4, 4, 12], "{a}");
        assert!(a.chars().all(|c| c == '-' || c.is_ascii_hexdigit()));
        assert_eq!(&a[14..15], "7");
    }

    #[test]
    fn error_bodies_become_their_message() {
        let body =
            br#"{"error":{"code":"not_found","message":"instance inst_x not found","details":{}}}"#;
        let e = api_error(StatusCode::NOT_FOUND, body);
        assert_eq!(e.to_string(), "instance inst_x not found");
        assert!(!e.is_transient());
        let e = api_error(StatusCode::BAD_GATEWAY, b"<html>\nbad\n</html>");
        assert_eq!(
            e.to_string(),
            "server answered 502 Bad Gateway: <html> bad </html>"
        );
        assert!(e.is_transient());
    }

    #[test]
    fn ndjson_lines_parse_and_blank_lines_are_skipped() {
        let l = parse_ndjson_line(
            br#"{"seq":3,"stream":"stderr","at":"2025-01-01T00:00:00Z","line":"hi"}
"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!((l.seq, l.line.as_str()), (3, "hi"));
        assert!(parse_ndjson_line(b"  \n").unwrap().is_none());
        let e = parse_ndjson_line(br#"{"error":{"code":"x","message":"boom"}}"#).unwrap_err();
        assert_eq!(e.to_string(), "boom");
    }
}
