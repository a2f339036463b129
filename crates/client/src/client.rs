//! The client: server URLs, the key, and the request machinery (retry,
//! failover, decoding) every route method goes through.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use flotilla_core::api::Page;
use flotilla_tls::Trust;
use reqwest::{header, Method};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::Error;
use crate::in_process::{InProcess, IN_PROCESS_URL};
use crate::retry::RetryPolicy;
use crate::Result;

/// Page size asked for when following list cursors.
pub const PAGE_SIZE: usize = 100;
/// Page size asked for when reading logs without following.
pub const LOG_PAGE_SIZE: usize = 1000;
/// How long one ordinary request may take, by default.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long establishing a connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Splits a comma-separated list of server URLs and normalises each: adds
/// `http://` when no scheme is given, drops trailing slashes and a
/// trailing `/v1` (routes carry it). Empty entries are skipped; duplicates
/// are kept once, in order.
pub fn parse_servers(list: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for part in list.split(',') {
        let url = part.trim().trim_end_matches('/');
        let url = url.strip_suffix("/v1").unwrap_or(url).trim_end_matches('/');
        if url.is_empty() {
            continue;
        }
        let url = if url.contains("://") {
            url.to_string()
        } else {
            format!("http://{url}")
        };
        if !out.contains(&url) {
            out.push(url);
        }
    }
    out
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

/// Sets up a [`Client`].
#[derive(Debug, Clone)]
pub struct Builder {
    servers: Vec<String>,
    token: String,
    retry: RetryPolicy,
    timeout: Duration,
    user_agent: String,
    trust: Trust,
    in_process: Option<InProcess>,
}

impl Builder {
    /// Reaches the API through `conn` instead of over the network (see
    /// [`InProcess`]): the server URLs are replaced by
    /// [`IN_PROCESS_URL`], and TLS does not apply.
    pub fn in_process(mut self, conn: InProcess) -> Self {
        self.servers = vec![IN_PROCESS_URL.to_string()];
        self.trust = Trust::System;
        self.in_process = Some(conn);
        self
    }

    /// Which server certificates `https://` URLs may present (default:
    /// [`Trust::System`], the operating system's roots). A pinned
    /// fingerprint or a CA file is refused with an `http://` URL, which
    /// would silently bypass it.
    pub fn trust(mut self, trust: Trust) -> Self {
        self.trust = trust;
        self
    }

    /// The retry policy (default: [`RetryPolicy::default`]).
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// How long one request may take (default 30 s); long-polls add their
    /// wait on top.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The `User-Agent` (default `flotilla-client/VERSION`).
    pub fn user_agent(mut self, user_agent: impl Into<String>) -> Self {
        self.user_agent = user_agent.into();
        self
    }

    /// The client; fails when no server URL was given or one is not a URL.
    pub fn build(self) -> Result<Client> {
        if self.servers.is_empty() {
            return Err(Error::Config {
                field: "server",
                message: "no server URL".to_string(),
            });
        }
        for s in &self.servers {
            if reqwest::Url::parse(s).is_err() {
                return Err(Error::Config {
                    field: "server",
                    message: format!("`{s}` is not a URL"),
                });
            }
        }
        let https =
            self.in_process.is_none() && self.servers.iter().any(|s| s.starts_with("https://"));
        if !matches!(self.trust, Trust::System) {
            if let Some(plain) = self.servers.iter().find(|s| !s.starts_with("https://")) {
                return Err(Error::Config {
                    field: "server",
                    message: format!(
                        "`{plain}` is not an https:// URL, but a TLS fingerprint or CA certificate is set for it"
                    ),
                });
            }
        }
        let mut http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .user_agent(self.user_agent);
        // Built only for https URLs: plain-HTTP clients (the local default)
        // never read the system's certificate store.
        if https {
            let tls = self.trust.client_config().map_err(|e| Error::Config {
                field: "tls",
                message: e.to_string(),
            })?;
            http = http.use_preconfigured_tls(tls);
        }
        let http = http.build().map_err(|e| Error::Config {
            field: "http",
            message: format!("cannot set up the HTTP client: {e}"),
        })?;
        Ok(Client {
            inner: Arc::new(Inner {
                http,
                servers: self.servers,
                current: AtomicUsize::new(0),
                token: self.token,
                retry: self.retry,
                timeout: self.timeout,
                in_process: self.in_process,
            }),
        })
    }
}

/// A typed view of the API, at one or more server URLs (replicas of the
/// control plane) with one key. Cheap to clone: clones share the
/// connection pool and the memory of which server answered last.
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    http: reqwest::Client,
    servers: Vec<String>,
    /// Index of the server that answered last: requests start there.
    current: AtomicUsize,
    token: String,
    retry: RetryPolicy,
    timeout: Duration,
    /// Set: requests go to the API in this process, not over the network.
    in_process: Option<InProcess>,
}

/// One request as the machinery sends it (to each server in turn, and
/// again on retry).
pub(crate) struct Call<'a> {
    pub method: Method,
    pub path: &'a str,
    pub query: &'a [(&'a str, String)],
    /// JSON body, serialised once.
    pub body: Option<Vec<u8>>,
    pub accept: &'static str,
    /// Instead of the client's timeout.
    pub timeout: Option<Duration>,
    /// No timeout at all (a stream that lasts as long as its subject).
    pub unbounded: bool,
    /// Sent as `Idempotency-Key`; makes a POST safe to retry.
    pub idempotency_key: Option<String>,
    /// Safe to repeat even without a key (the agent routes are idempotent
    /// by design).
    pub idempotent: bool,
}

impl<'a> Call<'a> {
    pub(crate) fn new(method: Method, path: &'a str) -> Self {
        Self {
            method,
            path,
            query: &[],
            body: None,
            accept: "application/json",
            timeout: None,
            unbounded: false,
            idempotency_key: None,
            idempotent: false,
        }
    }

    fn is_idempotent(&self) -> bool {
        self.idempotent
            || self.idempotency_key.is_some()
            || matches!(self.method, Method::GET | Method::PUT | Method::DELETE)
    }
}

impl Client {
    /// A builder for `servers` (a comma-separated list, see
    /// [`parse_servers`]) and the bearer `token`.
    pub fn builder(servers: &str, token: &str) -> Builder {
        Builder {
            servers: parse_servers(servers),
            token: token.trim().to_string(),
            retry: RetryPolicy::default(),
            timeout: REQUEST_TIMEOUT,
            user_agent: concat!("flotilla-client/", env!("CARGO_PKG_VERSION")).to_string(),
            trust: Trust::System,
            in_process: None,
        }
    }

    /// A builder for the API served in this process, reached through
    /// `conn` (see [`InProcess`]), with the bearer `token`.
    pub fn in_process(conn: InProcess, token: &str) -> Builder {
        Self::builder(IN_PROCESS_URL, token).in_process(conn)
    }

    /// A client with the default settings (see [`Client::builder`]).
    pub fn new(servers: &str, token: &str) -> Result<Self> {
        Self::builder(servers, token).build()
    }

    /// The same servers, settings and connection pool with another key:
    /// for a service that checks a key it was handed by asking the API as
    /// that key (the gateway's operator check for `/metrics`).
    pub fn with_token(&self, token: &str) -> Client {
        Client {
            inner: Arc::new(Inner {
                http: self.inner.http.clone(),
                servers: self.inner.servers.clone(),
                current: AtomicUsize::new(self.inner.current.load(Ordering::Relaxed)),
                token: token.trim().to_string(),
                retry: self.inner.retry,
                timeout: self.inner.timeout,
                in_process: self.inner.in_process.clone(),
            }),
        }
    }

    /// Every server URL, normalised, in the order given.
    pub fn servers(&self) -> &[String] {
        &self.inner.servers
    }

    /// The server that answered last (the first before any answer).
    pub fn current_server(&self) -> &str {
        let i = self.inner.current.load(Ordering::Relaxed);
        &self.inner.servers[i % self.inner.servers.len()]
    }

    /// Sends `call` with the retry policy and failover; the answer when it
    /// is 2xx, else the error.
    pub(crate) async fn send(&self, call: &Call<'_>) -> Result<reqwest::Response> {
        let retry = self.inner.retry;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let err = match self.send_failover(call).await {
                Ok(resp) => return Ok(resp),
                Err(e) => e,
            };
            if !(call.is_idempotent() && err.is_transient()) {
                return Err(err);
            }
            let Some(wait) = retry.delay(attempt, err.retry_after()) else {
                return Err(err);
            };
            tracing::debug!(error = %err, attempt, wait_ms = wait.as_millis() as u64, path = call.path, "retrying request");
            tokio::time::sleep(wait).await;
        }
    }

    /// One try: each server in turn from the one that answered last,
    /// moving on while a server cannot be reached or answers 503.
    async fn send_failover(&self, call: &Call<'_>) -> Result<reqwest::Response> {
        let servers = &self.inner.servers;
        let n = servers.len();
        let start = self.inner.current.load(Ordering::Relaxed) % n;
        let mut unreachable = Vec::new();
        let mut last = None;
        for i in 0..n {
            let idx = (start + i) % n;
            match self.send_to(&servers[idx], call).await {
                Err(e) if e.fails_over() => {
                    tracing::debug!(server = %servers[idx], error = %e, "server did not serve, trying the next");
                    if e.is_unreachable() {
                        unreachable.push(servers[idx].as_str());
                    }
                    last = Some(e);
                }
                Err(e) if e.timed_out() && n > 1 => {
                    // A server that accepted the connection but did not
                    // answer in time (paused, overloaded, partitioned
                    // mid-way) may never answer: the next call starts at
                    // the next server. This call is not resent, since it
                    // may have been served, and its caller bounded it.
                    tracing::debug!(server = %servers[idx], "server did not answer in time; the next call goes to the next");
                    self.inner.current.store((idx + 1) % n, Ordering::Relaxed);
                    return Err(e);
                }
                other => {
                    self.inner.current.store(idx, Ordering::Relaxed);
                    return other;
                }
            }
        }
        match last {
            // None could be reached: name them all.
            Some(Error::Transport { kind, message, .. }) if unreachable.len() == n => {
                Err(Error::Transport {
                    server: unreachable.join(", "),
                    kind,
                    message,
                })
            }
            Some(e) => Err(e),
            None => Err(Error::Config {
                field: "server",
                message: "no server URL".to_string(),
            }),
        }
    }

    async fn send_to(&self, server: &str, call: &Call<'_>) -> Result<reqwest::Response> {
        let mut req = self
            .inner
            .http
            .request(call.method.clone(), format!("{server}{}", call.path))
            .bearer_auth(&self.inner.token)
            .header(header::ACCEPT, call.accept);
        if !call.unbounded {
            req = req.timeout(call.timeout.unwrap_or(self.inner.timeout));
        }
        if !call.query.is_empty() {
            req = req.query(call.query);
        }
        if let Some(b) = &call.body {
            req = req
                .header(header::CONTENT_TYPE, "application/json")
                .body(b.clone());
        }
        if let Some(k) = &call.idempotency_key {
            req = req.header("Idempotency-Key", k);
        }
        let resp = self.execute(server, req).await?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        // Only the delta-seconds form: the server writes no other, and an
        // HTTP-date would need the wall clock to read.
        let retry_after = resp
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let bytes = resp.bytes().await.unwrap_or_default();
        Err(Error::from_answer(status.as_u16(), &bytes, retry_after))
    }

    /// Opens a WebSocket on `path` at the server that answered last (then
    /// the next ones, while one cannot be reached): the HTTP/1.1 upgrade
    /// with the client's key, its connection handed back once the server
    /// switched protocols. Never retried past that: a session that was
    /// opened may have run its command.
    pub(crate) async fn upgrade(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<reqwest::Upgraded> {
        use base64::Engine as _;
        let servers = &self.inner.servers;
        let n = servers.len();
        let start = self.inner.current.load(Ordering::Relaxed) % n;
        let mut last = None;
        for i in 0..n {
            let idx = (start + i) % n;
            let server = &servers[idx];
            // The key only proves the server speaks WebSocket; it need not
            // be secret, only fresh.
            let nonce = idempotency_key();
            let key = base64::engine::general_purpose::STANDARD.encode(&nonce.as_bytes()[..16]);
            let mut req = self
                .inner
                .http
                .get(format!("{server}{path}"))
                .bearer_auth(&self.inner.token)
                .header(header::CONNECTION, "Upgrade")
                .header(header::UPGRADE, "websocket")
                .header(header::SEC_WEBSOCKET_VERSION, "13")
                .header(header::SEC_WEBSOCKET_KEY, key)
                .timeout(self.inner.timeout);
            if !query.is_empty() {
                req = req.query(query);
            }
            let resp = match self.execute(server, req).await {
                Ok(resp) => resp,
                Err(e) => {
                    if e.fails_over() {
                        last = Some(e);
                        continue;
                    }
                    return Err(e);
                }
            };
            let status = resp.status();
            if status == reqwest::StatusCode::SWITCHING_PROTOCOLS {
                self.inner.current.store(idx, Ordering::Relaxed);
                return resp.upgrade().await.map_err(|e| Error::Transport {
                    server: server.clone(),
                    kind: crate::TransportKind::Other,
                    message: format!("the WebSocket upgrade failed: {e}"),
                });
            }
            let bytes = resp.bytes().await.unwrap_or_default();
            let e = if status.is_success() {
                Error::Transport {
                    server: server.clone(),
                    kind: crate::TransportKind::Other,
                    message: format!("the server answered {status} instead of a WebSocket"),
                }
            } else {
                Error::from_answer(status.as_u16(), &bytes, None)
            };
            if e.fails_over() {
                last = Some(e);
                continue;
            }
            return Err(e);
        }
        Err(last.unwrap_or_else(|| Error::Config {
            field: "server",
            message: "no server URL".to_string(),
        }))
    }

    /// Sends a built request over the network, or in-process when the
    /// client was built so; the answer whatever its status.
    async fn execute(
        &self,
        server: &str,
        req: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response> {
        match &self.inner.in_process {
            None => req
                .send()
                .await
                .map_err(|e| Error::from_reqwest(server, &e)),
            Some(conn) => {
                let req = req.build().map_err(|e| Error::from_reqwest(server, &e))?;
                conn.send(req).await
            }
        }
    }

    /// Sends `call` and decodes the JSON answer; an empty body (204)
    /// decodes as JSON `null`, so `()` and `Option<T>` take it.
    pub(crate) async fn json<T: DeserializeOwned>(&self, call: &Call<'_>) -> Result<T> {
        let resp = self.send(call).await?;
        let server = resp.url().origin().ascii_serialization();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| Error::from_reqwest(&server, &e))?;
        decode_body(&bytes)
    }

    fn body<B: Serialize + ?Sized>(body: &B) -> Result<Vec<u8>> {
        serde_json::to_vec(body).map_err(|e| Error::Config {
            field: "body",
            message: format!("cannot encode the request: {e}"),
        })
    }

    // ---- Generic verbs ------------------------------------------------------

    /// `GET path?query`, decoded.
    pub async fn get<T: DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<T> {
        let mut call = Call::new(Method::GET, path);
        call.query = query;
        self.json(&call).await
    }

    /// `POST path` with a JSON body and a fresh idempotency key (so a
    /// retried create does not create twice), decoded.
    pub async fn post<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T> {
        let mut call = Call::new(Method::POST, path);
        call.body = Some(Self::body(body)?);
        call.idempotency_key = Some(idempotency_key());
        self.json(&call).await
    }

    /// `PUT path` with a JSON body, decoded.
    pub async fn put<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T> {
        let mut call = Call::new(Method::PUT, path);
        call.body = Some(Self::body(body)?);
        self.json(&call).await
    }

    /// `PATCH path` with a JSON body and a fresh idempotency key, decoded.
    pub async fn patch<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T> {
        let mut call = Call::new(Method::PATCH, path);
        call.body = Some(Self::body(body)?);
        call.idempotency_key = Some(idempotency_key());
        self.json(&call).await
    }

    /// `DELETE path`, its answer decoded.
    pub async fn delete_json<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        let call = Call::new(Method::DELETE, path);
        self.json(&call).await
    }

    /// `DELETE path`.
    pub async fn delete(&self, path: &str) -> Result<()> {
        let call = Call::new(Method::DELETE, path);
        self.send(&call).await.map(drop)
    }

    /// A POST on the agent protocol: idempotent by design (the server
    /// exempts these routes from idempotency keys), with its own timeout.
    pub(crate) async fn post_agent<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
        timeout: Option<Duration>,
    ) -> Result<T> {
        let mut call = Call::new(Method::POST, path);
        call.body = Some(Self::body(body)?);
        call.idempotent = true;
        call.timeout = timeout;
        self.json(&call).await
    }

    /// Every item of a paginated list, following cursors, or the first
    /// `limit` of them.
    pub async fn list<T: DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
        limit: Option<usize>,
    ) -> Result<Vec<T>> {
        let mut items = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let want = limit.map_or(PAGE_SIZE, |l| {
                l.saturating_sub(items.len()).clamp(1, PAGE_SIZE)
            });
            let mut q = query.to_vec();
            q.push(("limit", want.to_string()));
            if let Some(c) = &cursor {
                q.push(("cursor", c.clone()));
            }
            let page: Page<T> = self.get(path, &q).await?;
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

    /// GET asking for CSV (`Accept: text/csv`): the body and the next
    /// page's cursor (`X-Next-Cursor`), if any.
    pub async fn get_csv(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<(String, Option<String>)> {
        let mut call = Call::new(Method::GET, path);
        call.query = query;
        call.accept = "text/csv";
        let resp = self.send(&call).await?;
        let server = resp.url().origin().ascii_serialization();
        let next = resp
            .headers()
            .get("x-next-cursor")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| Error::from_reqwest(&server, &e))?;
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
}

/// Decodes a 2xx body; an empty one reads as JSON `null`.
fn decode_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    let bytes: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"null"
    } else {
        bytes
    };
    serde_json::from_slice(bytes).map_err(|source| Error::Decode { source })
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
    fn server_lists_are_split_and_normalised() {
        assert_eq!(
            parse_servers(" http://a:1/ ,b:2/v1/, ,https://c/v1,http://a:1"),
            vec!["http://a:1", "http://b:2", "https://c"]
        );
        assert!(parse_servers(" , ").is_empty());
    }

    #[test]
    fn clients_need_a_valid_server() {
        let e = Client::new(" , ", "k").unwrap_err();
        assert!(
            matches!(
                e,
                Error::Config {
                    field: "server",
                    ..
                }
            ),
            "{e}"
        );
        let e = Client::new("http://[bad", "k").unwrap_err();
        assert!(e.to_string().contains("not a URL"), "{e}");
        let c = Client::new("a:1,b:2", "k").unwrap();
        assert_eq!(c.servers(), ["http://a:1", "http://b:2"]);
        assert_eq!(c.current_server(), "http://a:1");
    }

    #[test]
    fn empty_bodies_decode_as_null() {
        let v: Option<u32> = decode_body(b" \n").unwrap();
        assert_eq!(v, None);
        decode_body::<()>(b"").unwrap();
        let e = decode_body::<u32>(b"\"x\"").unwrap_err();
        assert!(matches!(e, Error::Decode { .. }));
    }
}
