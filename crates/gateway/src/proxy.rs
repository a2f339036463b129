//! One request, from arrival to the response head: authorise, route, check
//! the hard cap and rate limit, get a replica (waiting in the activator
//! queue if need be), send, and retry on another replica when a connection
//! could not be made. The body then streams through [`GatewayBody`].

use std::borrow::Cow;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use chrono::Utc;
use flotilla_core::gateway::{Balance, KeyGrant};
use flotilla_core::id::RequestId;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::body::{Scan, Tracker};
use crate::pool::{affinity_key, Endpoint, NoReplica, Replica};
use crate::{GatewayBody, Inner, Refusal};

/// The OpenAI paths routed by the body's `model`.
const MODEL_PATHS: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"];

/// Headers that belong to one hop and are not forwarded (RFC 9110 §7.6.1),
/// plus the caller's key, which replicas must never see.
const HOP_HEADERS: [HeaderName; 9] = [
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::HOST,
    header::AUTHORIZATION,
];

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const SESSION_ID: &str = "x-session-id";

pub(crate) async fn handle(
    inner: Arc<Inner>,
    peer: IpAddr,
    req: Request<Incoming>,
) -> Response<GatewayBody> {
    match req.uri().path() {
        "/health" => return json_response(StatusCode::OK, &json!({"status": "ok"})),
        "/metrics" => {
            return match metrics(&inner, peer, req.headers()).await {
                Ok(r) => r,
                Err(refusal) => refusal.response(),
            }
        }
        _ => {}
    }
    match route(inner, peer, req).await {
        Ok(r) => r,
        Err(refusal) => refusal.response(),
    }
}

fn json_response(status: StatusCode, v: &Value) -> Response<GatewayBody> {
    let mut r = Response::new(GatewayBody::full(Bytes::from(v.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// The gateway's Prometheus metrics, for an operator's key only: they
/// name every endpoint. Requests without one count against the address's
/// quota like any request without a valid key.
async fn metrics(
    inner: &Inner,
    peer: IpAddr,
    headers: &HeaderMap,
) -> Result<Response<GatewayBody>, Refusal> {
    // An operator seen a moment ago is not held back with the guesses
    // from its address.
    let seen_operator = bearer(headers)
        .is_ok_and(|k| matches!(crate::lock(&inner.operators).get(k), Some((_, true))));
    if !seen_operator {
        inner.check_held(peer)?;
    }
    let key = match bearer(headers) {
        Ok(k) => k,
        Err(_) => {
            inner.check_anonymous(peer)?;
            return Err(Refusal::MetricsForbidden);
        }
    };
    if !inner.operator(key).await? {
        inner.check_anonymous(peer)?;
        return Err(Refusal::MetricsForbidden);
    }
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &inner.metrics.registry).is_err() {
        return Err(Refusal::Upstream("metrics encoding failed".into()));
    }
    let mut r = Response::new(GatewayBody::full(Bytes::from(out)));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    Ok(r)
}

fn bearer(headers: &HeaderMap) -> Result<&str, Refusal> {
    let value = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .ok_or(Refusal::MissingKey)?;
    let (scheme, key) = value.split_once(' ').ok_or(Refusal::MissingKey)?;
    if !scheme.eq_ignore_ascii_case("bearer") || key.trim().is_empty() {
        return Err(Refusal::MissingKey);
    }
    Ok(key.trim())
}

#[derive(Deserialize)]
struct ModelPeek<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
}

/// Where a request goes.
enum Target {
    Endpoint {
        endpoint: Arc<Endpoint>,
        /// The path and query to send upstream.
        path: PathAndQuery,
    },
    Models,
}

fn allowed(grant: &KeyGrant, endpoint: &Endpoint) -> bool {
    grant.endpoints.is_empty() || grant.endpoints.contains(&endpoint.id)
}

/// The endpoint name a `Host` header designates, if any.
fn host_name<'a>(host: &'a str, domain: Option<&str>) -> Option<&'a str> {
    let host = host.rsplit_once(':').map_or(host, |(h, p)| {
        if p.chars().all(|c| c.is_ascii_digit()) {
            h
        } else {
            host
        }
    });
    match domain {
        Some(d) => host
            .strip_suffix(d)
            .and_then(|h| h.strip_suffix('.'))
            .filter(|n| !n.is_empty() && !n.contains('.')),
        None => {
            if host.parse::<std::net::IpAddr>().is_ok()
                || host.starts_with('[')
                || host.split('.').count() < 3
            {
                None
            } else {
                host.split('.').next()
            }
        }
    }
}

fn resolve(
    inner: &Inner,
    grant: &KeyGrant,
    parts: &Parts,
    body: &Bytes,
) -> Result<Target, Refusal> {
    let index = inner.index();
    let path = parts.uri.path();
    // Sent upstream as it came, except under `/e/{name}/`.
    let same_path = || {
        parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"))
    };
    let by_name = |name: &str| {
        index
            .named(&grant.tenant_id, name)
            .filter(|e| allowed(grant, e))
            .cloned()
    };
    if let Some(rest) = path.strip_prefix("/e/") {
        let (name, tail) = rest.split_once('/').map_or((rest, ""), |(n, t)| (n, t));
        let endpoint = by_name(name).ok_or_else(|| Refusal::EndpointNotFound(name.to_string()))?;
        let query = parts
            .uri
            .query()
            .map(|q| format!("?{q}"))
            .unwrap_or_default();
        let path =
            PathAndQuery::try_from(format!("/{tail}{query}")).map_err(|e| Refusal::BadRequest {
                field: "path",
                message: e.to_string(),
            })?;
        return Ok(Target::Endpoint { endpoint, path });
    }
    let host = parts
        .headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| parts.uri.authority().map(|a| a.as_str()));
    if let Some(name) = host.and_then(|h| host_name(h, inner.config.domain.as_deref())) {
        match by_name(name) {
            Some(endpoint) => {
                return Ok(Target::Endpoint {
                    endpoint,
                    path: same_path(),
                })
            }
            // With a configured domain the host names the endpoint; without
            // one the first label may be the gateway's own host name.
            None if inner.config.domain.is_some() => {
                return Err(Refusal::EndpointNotFound(name.to_string()))
            }
            None => {}
        }
    }
    if path == "/v1/models" && parts.method == Method::GET {
        return Ok(Target::Models);
    }
    if MODEL_PATHS.contains(&path) {
        let peek: ModelPeek<'_> =
            serde_json::from_slice(body).map_err(|e| Refusal::BadRequest {
                field: "body",
                message: format!("not a JSON object: {e}"),
            })?;
        let model = peek.model.ok_or(Refusal::BadRequest {
            field: "model",
            message: "required: the model to call".into(),
        })?;
        let endpoint = index
            .serving(&grant.tenant_id, &model)
            .filter(|e| allowed(grant, e))
            .cloned()
            .ok_or_else(|| Refusal::ModelNotFound(model.to_string()))?;
        return Ok(Target::Endpoint {
            endpoint,
            path: same_path(),
        });
    }
    Err(Refusal::NoRoute(path.to_string()))
}

fn list_models(inner: &Inner, grant: &KeyGrant) -> Response<GatewayBody> {
    let index = inner.index();
    let mut data = Vec::new();
    for e in index.by_tenant.get(&grant.tenant_id).into_iter().flatten() {
        if !allowed(grant, e) {
            continue;
        }
        for m in &e.route().models {
            data.push(
                json!({"id": m, "object": "model", "created": 0, "owned_by": grant.tenant_id}),
            );
        }
    }
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

async fn route(
    inner: Arc<Inner>,
    peer: IpAddr,
    req: Request<Incoming>,
) -> Result<Response<GatewayBody>, Refusal> {
    let arrived = Instant::now();
    let started_at = Utc::now();
    let (parts, body) = req.into_parts();
    // Borrowed from the request's headers, not copied.
    let key = bearer(&parts.headers);
    let grant = inner.authorize_from(peer, key.clone()).await?;
    let key = key?;
    let grant = &*grant;
    let limit = inner.config.max_body_bytes;
    let body = match Limited::new(body, limit).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            return Err(Refusal::TooLarge(limit))
        }
        Err(e) => {
            return Err(Refusal::BadRequest {
                field: "body",
                message: format!("could not be read: {e}"),
            })
        }
    };
    let (endpoint, path) = match resolve(&inner, grant, &parts, &body)? {
        Target::Models => return Ok(list_models(&inner, grant)),
        Target::Endpoint { endpoint, path } => (endpoint, path),
    };
    endpoint
        .stats
        .requests_total
        .fetch_add(1, Ordering::Relaxed);
    let request_id =
        RequestId::generate(started_at.timestamp_millis().max(0) as u64, rand::random());
    let mut tracker = Tracker::new(
        inner.clone(),
        endpoint.clone(),
        request_id,
        started_at,
        arrived,
    );
    let refused = |mut tracker: Tracker, refusal: Refusal| {
        tracker.status = refusal.status().as_u16();
        drop(tracker);
        Err(refusal)
    };
    if grant.over_hard_cap {
        return refused(tracker, Refusal::OverHardCap);
    }
    let route = endpoint.route();
    if let Err(r) = inner.check_rate(&endpoint, route.rate_limit_rps, key) {
        return refused(tracker, r);
    }
    let affinity = match route.balance {
        Balance::LeastOutstanding => None,
        Balance::SessionAffinity => parts
            .headers
            .get(SESSION_ID)
            .and_then(|v| v.to_str().ok())
            .map(affinity_key),
        Balance::PrefixAffinity => {
            prompt_prefix(&body, inner.config.affinity_prefix_chars).map(|p| affinity_key(&p))
        }
    };
    let deadline = arrived + std::time::Duration::from_millis(route.queue_timeout_ms);
    // Made once: it goes upstream and back to the caller.
    let request_id_header = HeaderValue::from_str(tracker.request_id.as_str()).ok();
    let mut exclude = Vec::new();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let lease = match endpoint.acquire(affinity, &exclude, deadline).await {
            Ok(l) => l,
            Err(NoReplica::QueueFull) => {
                return refused(tracker, Refusal::QueueFull(route.name.clone()))
            }
            Err(NoReplica::Timeout) => {
                return refused(tracker, Refusal::QueueTimeout(route.name.clone()))
            }
        };
        let upstream = match upstream_request(
            &lease.replica,
            &path,
            &parts,
            &body,
            request_id_header.as_ref(),
        ) {
            Ok(r) => r,
            Err(message) => return refused(tracker, Refusal::Upstream(message)),
        };
        let replica = lease.replica.clone();
        tracker.sent(lease);
        match inner.client.request(upstream).await {
            Ok(resp) => {
                let (mut head, incoming) = resp.into_parts();
                strip_hop_headers(&mut head.headers);
                if let Some(v) = &request_id_header {
                    head.headers.insert(REQUEST_ID, v.clone());
                }
                tracker.status = head.status.as_u16();
                tracker.scan = Scan::for_content_type(
                    head.headers
                        .get(header::CONTENT_TYPE)
                        .and_then(|v| v.to_str().ok()),
                );
                return Ok(Response::from_parts(
                    head,
                    GatewayBody::proxied(incoming, tracker),
                ));
            }
            Err(e) if e.is_connect() && attempt < inner.config.max_attempts => {
                // Nothing reached the replica: safe to send elsewhere.
                tracing::debug!(replica = %replica.instance_id, error = %e, "connect failed, retrying elsewhere");
                replica.eject(endpoint.now_ms() + inner.config.eject_for.as_millis() as u64);
                exclude.push(replica.instance_id.clone());
                if let Some(lease) = tracker.lease.take() {
                    endpoint.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
                    drop(lease);
                }
            }
            Err(e) => {
                if e.is_connect() {
                    replica.eject(endpoint.now_ms() + inner.config.eject_for.as_millis() as u64);
                }
                return refused(tracker, Refusal::Upstream(error_chain(&e)));
            }
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

fn strip_hop_headers(headers: &mut HeaderMap) {
    // Headers named by `Connection` are hop-by-hop too.
    if headers.contains_key(header::CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
            .collect();
        for h in &named {
            headers.remove(h);
        }
    }
    for h in HOP_HEADERS.iter().chain([&KEEP_ALIVE]) {
        headers.remove(h);
    }
}

fn upstream_request(
    replica: &Replica,
    path: &PathAndQuery,
    parts: &Parts,
    body: &Bytes,
    request_id: Option<&HeaderValue>,
) -> Result<Request<Full<Bytes>>, String> {
    let uri = match &replica.origin {
        Some((scheme, authority)) => {
            let mut uri = http::uri::Parts::default();
            uri.scheme = Some(scheme.clone());
            uri.authority = Some(authority.clone());
            uri.path_and_query = Some(path.clone());
            Uri::from_parts(uri).map_err(|e| e.to_string())
        }
        // A base with a path of its own: the request's path goes after it.
        None => format!("{}{path}", replica.base)
            .parse::<Uri>()
            .map_err(|e| e.to_string()),
    }
    .map_err(|e| format!("bad replica URL {}: {e}", replica.base))?;
    let mut req = Request::new(Full::new(body.clone()));
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = uri;
    let mut headers = parts.headers.clone();
    strip_hop_headers(&mut headers);
    if let Some(v) = request_id {
        headers.insert(REQUEST_ID, v.clone());
    }
    *req.headers_mut() = headers;
    Ok(req)
}

#[derive(Deserialize)]
struct PromptPeek {
    #[serde(default)]
    messages: Option<Vec<MessagePeek>>,
    #[serde(default)]
    prompt: Option<Value>,
    #[serde(default)]
    input: Option<Value>,
}

#[derive(Deserialize)]
struct MessagePeek {
    #[serde(default)]
    content: Value,
}

fn push_text(v: &Value, out: &mut String, limit: usize) {
    match v {
        Value::String(s) => out.extend(s.chars().take(limit.saturating_sub(out.chars().count()))),
        Value::Array(items) => {
            for item in items {
                let text = item.get("text").unwrap_or(item);
                push_text(text, out, limit);
                if out.chars().count() >= limit {
                    return;
                }
            }
        }
        _ => {}
    }
}

/// The first `limit` characters of the prompt: the chat messages' contents
/// in order, or `prompt`, or `input`. What affinity hashes.
pub(crate) fn prompt_prefix(body: &Bytes, limit: usize) -> Option<String> {
    let peek: PromptPeek = serde_json::from_slice(body).ok()?;
    let mut out = String::new();
    if let Some(messages) = &peek.messages {
        for m in messages {
            push_text(&m.content, &mut out, limit);
            if out.chars().count() >= limit {
                break;
            }
            out.push('\n');
        }
    } else if let Some(p) = peek.prompt.as_ref().or(peek.input.as_ref()) {
        push_text(p, &mut out, limit);
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_an_endpoint() {
        assert_eq!(
            host_name("chat.gw.example.com", Some("gw.example.com")),
            Some("chat")
        );
        assert_eq!(
            host_name("chat.gw.example.com:8080", Some("gw.example.com")),
            Some("chat")
        );
        assert_eq!(
            host_name("a.b.gw.example.com", Some("gw.example.com")),
            None
        );
        assert_eq!(host_name("gw.example.com", Some("gw.example.com")), None);
        assert_eq!(host_name("chat.gw.example.com", None), Some("chat"));
        assert_eq!(host_name("127.0.0.1:80", None), None);
        assert_eq!(host_name("localhost:80", None), None);
    }

    #[test]
    fn the_prefix_is_the_prompt_start() {
        let chat = Bytes::from(
            r#"{"model":"m","messages":[{"role":"system","content":"abcdef"},{"role":"user","content":[{"type":"text","text":"xyz"}]}]}"#,
        );
        assert_eq!(prompt_prefix(&chat, 4).as_deref(), Some("abcd"));
        assert_eq!(prompt_prefix(&chat, 100).as_deref(), Some("abcdef\nxyz\n"));
        let completion = Bytes::from(r#"{"model":"m","prompt":["hello","world"]}"#);
        assert_eq!(prompt_prefix(&completion, 7).as_deref(), Some("hellowo"));
        assert_eq!(prompt_prefix(&Bytes::from("nope"), 7), None);
    }
}
