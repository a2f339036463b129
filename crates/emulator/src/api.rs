//! The emulator's HTTP surface: OpenAI-style requests in, filler text out,
//! timed like a real engine (see the crate doc).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State as AxState;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use crate::tokens::tokenize;
use crate::{State, Stats};

/// Words the filler output cycles through; each is one token.
const FILLER: [&str; 8] = ["the", "quic", "brow", "fox", "jump", "over", "lazy", "dog"];

pub(crate) fn router(state: Arc<State>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "not_found", "no such route") })
        .with_state(state)
}

/// A refusal before any work: small, so results carrying it stay cheap.
struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn bad(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            code,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error(self.status, self.code, self.message)
    }
}

fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    (
        status,
        axum::Json(json!({"error": {"message": message.into(), "type": kind, "code": code}})),
    )
        .into_response()
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Deserialize)]
struct Message {
    #[serde(default)]
    role: String,
    #[serde(default)]
    content: Value,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: Option<String>,
    messages: Vec<Message>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    prompt: Value,
    max_tokens: Option<u32>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
}

#[derive(Debug, Deserialize)]
struct EmbeddingRequest {
    model: Option<String>,
    input: Value,
}

/// The text of a message's `content`: a string, or the text parts of an
/// array of parts.
fn content_text(v: &Value, out: &mut String) {
    match v {
        Value::String(s) => out.push_str(s),
        Value::Array(parts) => {
            for p in parts {
                if let Some(t) = p.get("text").and_then(Value::as_str) {
                    out.push_str(t);
                    out.push(' ');
                }
            }
        }
        _ => {}
    }
}

/// `prompt` or `input`: a string or an array of strings, joined.
fn strings(v: &Value, field: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(items) => {
            let mut out = String::new();
            for item in items {
                let Some(s) = item.as_str() else {
                    return Err(ApiError::bad(
                        "invalid_value",
                        format!("{field}: must be a string or an array of strings"),
                    ));
                };
                out.push_str(s);
                out.push('\n');
            }
            Ok(out)
        }
        _ => Err(ApiError::bad(
            "invalid_value",
            format!("{field}: must be a string or an array of strings"),
        )),
    }
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("invalid_request", format!("invalid request body: {e}")))
}

/// Decrements a gauge when dropped, so every exit path counts.
struct Gauge<'a>(&'a AtomicU64);

impl<'a> Gauge<'a> {
    fn up(c: &'a AtomicU64) -> Self {
        c.fetch_add(1, Ordering::Relaxed);
        Self(c)
    }
}

impl Drop for Gauge<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the engine does for one admitted request.
struct Admitted {
    _permit: Option<OwnedSemaphorePermit>,
    stats: Arc<Stats>,
    prompt_tokens: u64,
    cached_tokens: u64,
    prefill: Duration,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl State {
    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.config.model => Err(ApiError {
                status: StatusCode::NOT_FOUND,
                code: "model_not_found",
                message: format!(
                    "model: `{m}` is not served here (this server serves `{}`)",
                    self.config.model
                ),
            }),
            _ => Ok(()),
        }
    }

    /// Readiness, a concurrency slot, then the prefix cache: what every
    /// inference request goes through before it is timed.
    async fn admit(self: &Arc<Self>, prompt: &str) -> Result<Admitted, Response> {
        if !self.ready.load(Ordering::Acquire) {
            return Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "model_loading",
                "the model's weights are still loading",
            ));
        }
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let permit = match &self.slots {
            None => None,
            Some(slots) => match slots.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) => {
                    if self.stats.queued.load(Ordering::Relaxed) >= u64::from(self.config.max_queue)
                    {
                        self.stats.rejected.fetch_add(1, Ordering::Relaxed);
                        return Err(busy("the request queue is full"));
                    }
                    let _waiting = Gauge::up(&self.stats.queued);
                    let wait = Duration::from_millis(self.config.queue_timeout_ms);
                    match tokio::time::timeout(wait, slots.clone().acquire_owned()).await {
                        Ok(Ok(p)) => Some(p),
                        _ => {
                            self.stats.rejected.fetch_add(1, Ordering::Relaxed);
                            return Err(busy("waited too long for a free slot"));
                        }
                    }
                }
            },
        };
        let tokens = tokenize(prompt);
        let cached = {
            let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            cache.lookup_and_insert(&tokens)
        };
        let prompt_tokens = tokens.len() as u64;
        let cached_tokens = cached as u64;
        self.stats
            .prompt_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        self.stats
            .cached_prompt_tokens
            .fetch_add(cached_tokens, Ordering::Relaxed);
        self.stats.in_flight.fetch_add(1, Ordering::Relaxed);
        Ok(Admitted {
            _permit: permit,
            stats: self.stats.clone(),
            prompt_tokens,
            cached_tokens,
            prefill: per_token(self.config.prefill_tokens_per_s)
                * (prompt_tokens - cached_tokens) as u32,
        })
    }

    fn decode_interval(&self) -> Duration {
        per_token(self.config.decode_tokens_per_s)
    }
}

fn busy(message: &str) -> Response {
    let mut r = error(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limit_exceeded",
        message,
    );
    r.headers_mut()
        .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    r
}

fn per_token(rate: f64) -> Duration {
    if rate > 0.0 {
        Duration::from_secs_f64(1.0 / rate)
    } else {
        Duration::ZERO
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn usage(a: &Admitted, completion: u64) -> Value {
    json!({
        "prompt_tokens": a.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": a.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": a.cached_tokens},
    })
}

fn filler(i: usize) -> &'static str {
    FILLER[i % FILLER.len()]
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat(AxState(state): AxState<Arc<State>>, body: Bytes) -> Response {
    let req: ChatRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = state.check_model(req.model.as_deref()) {
        return e.into_response();
    }
    let mut prompt = String::new();
    for m in &req.messages {
        prompt.push_str(&m.role);
        prompt.push(' ');
        content_text(&m.content, &mut prompt);
        prompt.push('\n');
    }
    let max = req.max_completion_tokens.or(req.max_tokens);
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    generate(state, Kind::Chat, &prompt, max, req.stream, include_usage).await
}

async fn completions(AxState(state): AxState<Arc<State>>, body: Bytes) -> Response {
    let req: CompletionRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = state.check_model(req.model.as_deref()) {
        return e.into_response();
    }
    let prompt = match strings(&req.prompt, "prompt") {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
    generate(
        state,
        Kind::Completion,
        &prompt,
        req.max_tokens,
        req.stream,
        include_usage,
    )
    .await
}

async fn generate(
    state: Arc<State>,
    kind: Kind,
    prompt: &str,
    max_tokens: Option<u32>,
    stream: bool,
    include_usage: bool,
) -> Response {
    let n = max_tokens.unwrap_or(state.config.default_max_tokens) as usize;
    let admitted = match state.admit(prompt).await {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    let id = format!("cmpl-{}", state.stats.requests.load(Ordering::Relaxed));
    let created = unix_now();
    let model = state.config.model.clone();
    let decode = state.decode_interval();
    if !stream {
        tokio::time::sleep(admitted.prefill + decode * n.saturating_sub(1) as u32).await;
        let text: Vec<&str> = (0..n).map(filler).collect();
        let text = text.join(" ");
        let body = match kind {
            Kind::Chat => json!({
                "id": id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
                "usage": usage(&admitted, n as u64),
            }),
            Kind::Completion => json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": usage(&admitted, n as u64),
            }),
        };
        return axum::Json(body).into_response();
    }
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(16);
    tokio::spawn(async move {
        let object = if kind == Kind::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        tokio::time::sleep(admitted.prefill).await;
        for i in 0..n {
            if i > 0 {
                tokio::time::sleep(decode).await;
            }
            let piece = if i == 0 {
                filler(i).to_string()
            } else {
                format!(" {}", filler(i))
            };
            let finish = if i + 1 == n {
                json!("length")
            } else {
                Value::Null
            };
            let choice = match kind {
                Kind::Chat if i == 0 => {
                    json!({"index": 0, "delta": {"role": "assistant", "content": piece}, "finish_reason": finish})
                }
                Kind::Chat => {
                    json!({"index": 0, "delta": {"content": piece}, "finish_reason": finish})
                }
                Kind::Completion => json!({"index": 0, "text": piece, "finish_reason": finish}),
            };
            let chunk = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]});
            if tx.send(Ok(sse(&chunk))).await.is_err() {
                return;
            }
        }
        if include_usage {
            let chunk = json!({"id": id, "object": object, "created": created, "model": model,
                "choices": [], "usage": usage(&admitted, n as u64)});
            if tx.send(Ok(sse(&chunk))).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
        drop(admitted);
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "response"))
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

async fn embeddings(AxState(state): AxState<Arc<State>>, body: Bytes) -> Response {
    let req: EmbeddingRequest = match parse(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = state.check_model(req.model.as_deref()) {
        return e.into_response();
    }
    let inputs: Vec<String> = match &req.input {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) if items.iter().all(Value::is_string) => items
            .iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect(),
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_value",
                "input: must be a string or an array of strings",
            )
        }
    };
    let admitted = match state.admit(&inputs.join("\n")).await {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    tokio::time::sleep(admitted.prefill).await;
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, text)| json!({"object": "embedding", "index": i, "embedding": embed(text)}))
        .collect();
    axum::Json(json!({
        "object": "list", "data": data, "model": state.config.model,
        "usage": {"prompt_tokens": admitted.prompt_tokens, "total_tokens": admitted.prompt_tokens},
    }))
    .into_response()
}

/// A deterministic unit vector of 8 dimensions derived from the text.
fn embed(text: &str) -> Vec<f64> {
    use std::hash::Hasher;
    let mut v: Vec<f64> = (0..8u8)
        .map(|d| {
            let mut h = fnv::FnvHasher::default();
            h.write_u8(d);
            h.write(text.as_bytes());
            (h.finish() % 2001) as f64 / 1000.0 - 1.0
        })
        .collect();
    let norm = v
        .iter()
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt()
        .max(f64::EPSILON);
    v.iter_mut().for_each(|x| *x /= norm);
    v
}

async fn models(AxState(state): AxState<Arc<State>>) -> Response {
    axum::Json(json!({"object": "list", "data": [
        {"id": state.config.model, "object": "model", "created": 0, "owned_by": "flotilla-emulator"}
    ]}))
    .into_response()
}

async fn health(AxState(state): AxState<Arc<State>>) -> Response {
    let mut r = if state.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ok").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "loading").into_response()
    };
    // Where the weights came from and how long they took: what a cold
    // start's breakdown names.
    if let Some(tier) = state.tier {
        let h = r.headers_mut();
        h.insert(
            "x-flotilla-load-tier",
            axum::http::HeaderValue::from_static(tier.as_str()),
        );
        h.insert(
            "x-flotilla-load-ms",
            axum::http::HeaderValue::from(state.load_ms),
        );
    }
    r
}

async fn metrics(AxState(state): AxState<Arc<State>>) -> Response {
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &state.registry).is_err() {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "metrics encoding",
        );
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        out,
    )
        .into_response()
}

/// Reads [`Stats`] at scrape time, so the hot path only bumps atomics.
#[derive(Debug)]
struct StatsCollector(Arc<Stats>);

impl prometheus_client::collector::Collector for StatsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = &self.0;
        let gauges = [
            ("emulator_in_flight", "Requests being served", &s.in_flight),
            ("emulator_queued", "Requests waiting for a slot", &s.queued),
        ];
        for (name, help, v) in gauges {
            let g = ConstGauge::new(v.load(Ordering::Relaxed) as i64);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        let counters = [
            (
                "emulator_requests",
                "Inference requests received",
                &s.requests,
            ),
            (
                "emulator_prompt_tokens",
                "Prompt tokens received",
                &s.prompt_tokens,
            ),
            (
                "emulator_prefix_cache_hit_tokens",
                "Prompt tokens found in the prefix cache",
                &s.cached_prompt_tokens,
            ),
            (
                "emulator_rejected",
                "Requests refused with 429",
                &s.rejected,
            ),
        ];
        for (name, help, v) in counters {
            let c = ConstCounter::new(v.load(Ordering::Relaxed));
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        Ok(())
    }
}

pub(crate) fn registry(stats: &Arc<Stats>) -> Registry {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(StatsCollector(stats.clone())));
    registry
}
