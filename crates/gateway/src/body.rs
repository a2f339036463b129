//! Response bodies: the gateway's own (errors, model lists) and a replica's
//! passed through frame by frame — never buffered, so server-sent events
//! reach the caller as the replica writes them — while the bytes are
//! watched for the time to first byte and the `usage` the replica reports.
//! The watcher ([`Tracker`]) finishes the request when the body ends or
//! the caller goes away: it frees the replica slot, records latency and
//! queues the request's usage record.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use chrono::{DateTime, Utc};
use flotilla_core::gateway::RequestUsage;
use flotilla_core::id::RequestId;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use serde::Deserialize;
use tokio::time::Instant;

use crate::pool::{Endpoint, Lease};
use crate::Inner;

/// JSON bodies larger than this are passed through without reading their
/// usage (an embeddings answer can be large; its usage is then counted 0).
const MAX_JSON_SCAN: usize = 4 << 20;

/// What the gateway answers with.
pub enum GatewayBody {
    /// A body the gateway wrote itself.
    Full(Option<Bytes>),
    /// A replica's body, passed through.
    Proxied(Box<Proxied>),
}

/// A replica's body and its watcher.
pub struct Proxied {
    inner: Incoming,
    tracker: Tracker,
}

impl GatewayBody {
    /// A complete body.
    pub fn full(bytes: Bytes) -> Self {
        Self::Full(Some(bytes))
    }

    pub(crate) fn proxied(inner: Incoming, tracker: Tracker) -> Self {
        Self::Proxied(Box::new(Proxied { inner, tracker }))
    }
}

impl Body for GatewayBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            Self::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Self::Proxied(p) => {
                let polled = Pin::new(&mut p.inner).poll_frame(cx);
                match &polled {
                    Poll::Ready(Some(Ok(frame))) => {
                        if let Some(data) = frame.data_ref() {
                            p.tracker.on_data(data);
                        }
                        // hyper stops polling once a body of known length
                        // says it has ended: no `None` comes after it.
                        if p.inner.is_end_stream() {
                            p.tracker.complete = true;
                        }
                    }
                    Poll::Ready(None) => p.tracker.complete = true,
                    Poll::Ready(Some(Err(_))) | Poll::Pending => {}
                }
                polled
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Full(b) => b.is_none(),
            Self::Proxied(p) => p.inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Self::Full(None) => SizeHint::with_exact(0),
            Self::Proxied(p) => p.inner.size_hint(),
        }
    }
}

#[derive(Debug, Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct WithUsage {
    #[serde(default)]
    usage: Option<Usage>,
}

/// How the usage is read from the body.
pub(crate) enum Scan {
    /// Server-sent events: the last `data:` line carrying `usage` counts.
    Sse { line: Vec<u8> },
    /// A JSON document with a top-level `usage`. A body that comes in one
    /// frame (the usual answer) is kept as that frame, shared with the
    /// response rather than copied; `buf` gathers a body of several.
    Json {
        first: Option<Bytes>,
        buf: Vec<u8>,
        overflow: bool,
    },
    /// Neither: usage 0.
    Skip,
}

impl Scan {
    pub fn for_content_type(ct: Option<&str>) -> Self {
        match ct {
            Some(ct) if ct.starts_with("text/event-stream") => Self::Sse { line: Vec::new() },
            Some(ct) if ct.starts_with("application/json") => Self::Json {
                first: None,
                buf: Vec::new(),
                overflow: false,
            },
            _ => Self::Skip,
        }
    }
}

fn read_usage(json: &[u8]) -> Option<(u64, u64)> {
    let w: WithUsage = serde_json::from_slice(json).ok()?;
    let u = w.usage?;
    Some((
        u.prompt_tokens.unwrap_or(0),
        u.completion_tokens.unwrap_or(0),
    ))
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Follows one request from the moment it is routed to an endpoint to its
/// last byte; finishing happens on drop, whatever path ends the request.
pub(crate) struct Tracker {
    pub inner: Arc<Inner>,
    pub endpoint: Arc<Endpoint>,
    pub lease: Option<Lease>,
    pub request_id: RequestId,
    pub started_at: DateTime<Utc>,
    pub arrived: Instant,
    pub first_byte: Option<Instant>,
    pub status: u16,
    pub scan: Scan,
    pub tokens: Option<(u64, u64)>,
    pub complete: bool,
}

impl Tracker {
    pub fn new(
        inner: Arc<Inner>,
        endpoint: Arc<Endpoint>,
        request_id: RequestId,
        started_at: DateTime<Utc>,
        arrived: Instant,
    ) -> Self {
        Self {
            inner,
            endpoint,
            lease: None,
            request_id,
            started_at,
            arrived,
            first_byte: None,
            status: 0,
            scan: Scan::Skip,
            tokens: None,
            complete: false,
        }
    }

    /// Holds the replica slot; the request counts as in flight from here.
    pub fn sent(&mut self, lease: Lease) {
        self.endpoint
            .stats
            .in_flight
            .fetch_add(1, Ordering::Relaxed);
        self.lease = Some(lease);
    }

    fn on_data(&mut self, data: &Bytes) {
        if self.first_byte.is_none() && !data.is_empty() {
            self.first_byte = Some(Instant::now());
        }
        match &mut self.scan {
            Scan::Skip => {}
            Scan::Json {
                first,
                buf,
                overflow,
            } => {
                if *overflow {
                    return;
                }
                if first.is_none() && buf.is_empty() {
                    *first = Some(data.clone());
                } else {
                    if let Some(f) = first.take() {
                        buf.extend_from_slice(&f);
                    }
                    buf.extend_from_slice(data);
                }
                let held = first.as_ref().map_or(0, Bytes::len) + buf.len();
                if held > MAX_JSON_SCAN {
                    *overflow = true;
                    *first = None;
                    *buf = Vec::new();
                }
            }
            Scan::Sse { line } => {
                let mut rest: &[u8] = data;
                while let Some(nl) = rest.iter().position(|&b| b == b'\n') {
                    line.extend_from_slice(&rest[..nl]);
                    rest = &rest[nl + 1..];
                    if line.starts_with(b"data:") && contains(line, b"\"usage\"") {
                        if let Some(t) = read_usage(&line[5..]) {
                            self.tokens = Some(t);
                        }
                    }
                    line.clear();
                }
                // Only data lines can carry usage; keep a partial line only
                // while it may be one.
                if line.len() < 5 || line.starts_with(b"data:") || b"data:".starts_with(line) {
                    line.extend_from_slice(rest);
                }
            }
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        let now = Instant::now();
        if let Scan::Json {
            first,
            buf,
            overflow: false,
        } = &self.scan
        {
            if self.complete {
                self.tokens = read_usage(first.as_deref().unwrap_or(buf.as_slice()));
            }
        }
        let instance_id = self.lease.as_ref().map(|l| l.replica.instance_id.clone());
        let series = self
            .endpoint
            .series
            .get_or_init(|| self.inner.metrics.series(self.endpoint.id.as_str()));
        if self.lease.take().is_some() {
            self.endpoint
                .stats
                .in_flight
                .fetch_sub(1, Ordering::Relaxed);
            let latency = now - self.arrived;
            let ttft = self.first_byte.map(|t| t - self.arrived);
            self.endpoint.stats.record(now, ttft, latency);
            if let Some(t) = ttft {
                series.ttft.observe(t.as_secs_f64());
            }
            series.latency.observe(latency.as_secs_f64());
        }
        series.response(&self.inner.metrics, self.status);
        let (input_tokens, output_tokens) = self.tokens.unwrap_or((0, 0));
        let elapsed = chrono::Duration::from_std(now - self.arrived).unwrap_or_default();
        // Moved out, not copied: the tracker ends here.
        let request_id =
            std::mem::replace(&mut self.request_id, RequestId::from_trusted(String::new()));
        self.inner.meter.push(RequestUsage {
            request_id,
            endpoint_id: self.endpoint.id.clone(),
            instance_id,
            started_at: self.started_at,
            finished_at: self.started_at + elapsed,
            status: self.status,
            input_tokens,
            output_tokens,
        });
    }
}
