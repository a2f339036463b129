//! Demand signals per endpoint: counters and recent latency windows for the
//! autoscaler ([`EndpointSignals`], pushed through `Control::report`), and
//! the same on the gateway's Prometheus `/metrics`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, Weak};
use std::time::Duration;

use chrono::Utc;
use flotilla_core::gateway::EndpointSignals;
use flotilla_core::id::EndpointId;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use tokio::time::Instant;

/// How far back the percentiles sent to the autoscaler look.
const WINDOW: Duration = Duration::from_secs(30);
/// Samples kept per window at most, so a burst costs bounded memory.
const WINDOW_SAMPLES: usize = 4096;

#[derive(Default)]
struct Windows {
    ttft_ms: VecDeque<(Instant, f64)>,
    latency_ms: VecDeque<(Instant, f64)>,
}

fn push(w: &mut VecDeque<(Instant, f64)>, at: Instant, v: f64) {
    if w.len() == WINDOW_SAMPLES {
        w.pop_front();
    }
    w.push_back((at, v));
}

fn samples(w: &VecDeque<(Instant, f64)>) -> Vec<f64> {
    w.iter().map(|(_, v)| *v).collect()
}

/// One endpoint's counters.
#[derive(Default)]
pub(crate) struct EndpointStats {
    /// Requests sent to a replica and not finished.
    pub in_flight: AtomicU32,
    /// Requests that arrived (routed to this endpoint).
    pub requests_total: AtomicU64,
    windows: Mutex<Windows>,
}

impl EndpointStats {
    pub fn record(&self, at: Instant, ttft: Option<Duration>, latency: Duration) {
        let mut w = self.windows.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = ttft {
            push(&mut w.ttft_ms, at, t.as_secs_f64() * 1000.0);
        }
        push(&mut w.latency_ms, at, latency.as_secs_f64() * 1000.0);
    }

    /// The reading sent to the control plane.
    /// `queued`: the requests waiting in the endpoint's queue now.
    pub fn signals(&self, endpoint_id: &EndpointId, queued: u32, now: Instant) -> EndpointSignals {
        let since = now.checked_sub(WINDOW).unwrap_or(now);
        // Only the copy happens under the lock that every finishing request
        // takes; the sorts (thousands of samples) happen after it.
        let (mut ttft, mut latency) = {
            let mut guard = self.windows.lock().unwrap_or_else(|p| p.into_inner());
            let w = &mut *guard;
            for q in [&mut w.ttft_ms, &mut w.latency_ms] {
                while q.front().is_some_and(|(t, _)| *t < since) {
                    q.pop_front();
                }
            }
            (samples(&w.ttft_ms), samples(&w.latency_ms))
        };
        let percentile = flotilla_core::gateway::nearest_rank;
        EndpointSignals {
            endpoint_id: endpoint_id.clone(),
            at: Utc::now(),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            queued,
            requests_total: self.requests_total.load(Ordering::Relaxed),
            ttft_p50_ms: percentile(&mut ttft, 0.5),
            ttft_p95_ms: percentile(&mut ttft, 0.95),
            latency_p95_ms: percentile(&mut latency, 0.95),
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct EndpointLabel {
    pub endpoint: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ResponseLabels {
    pub endpoint: String,
    pub code: u16,
}

/// The gateway's Prometheus metrics.
pub(crate) struct Metrics {
    pub registry: Registry,
    pub ttft: Family<EndpointLabel, Histogram>,
    pub latency: Family<EndpointLabel, Histogram>,
    pub responses: Family<ResponseLabels, Counter>,
    pub usage_dropped: Counter,
}

fn seconds_histogram() -> Histogram {
    // 1 ms to about 65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// One live endpoint's counters at scrape time, as the gateway reads them.
pub(crate) struct LiveCounts {
    pub endpoint: String,
    pub in_flight: u32,
    pub queued: u32,
    pub requests_total: u64,
}

/// Reads gauges (in-flight, queued, arrivals, pending usage) at scrape time
/// from the live endpoints, so the request path only bumps atomics.
struct Live(Weak<crate::Inner>);

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Live")
    }
}

impl prometheus_client::collector::Collector for Live {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(inner) = self.0.upgrade() else {
            return Ok(());
        };
        let endpoints = inner.live_counts();
        type Read = fn(&LiveCounts) -> u64;
        let series: [(&str, &str, MetricType, Read); 3] = [
            (
                "gateway_in_flight",
                "Requests sent to a replica and not finished",
                MetricType::Gauge,
                |e| u64::from(e.in_flight),
            ),
            (
                "gateway_queued",
                "Requests waiting in the activator queue",
                MetricType::Gauge,
                |e| u64::from(e.queued),
            ),
            (
                "gateway_requests",
                "Requests routed to the endpoint",
                MetricType::Counter,
                |e| e.requests_total,
            ),
        ];
        for (name, help, kind, read) in series {
            let mut family = encoder.encode_descriptor(name, help, None, kind)?;
            for ep in &endpoints {
                let label = EndpointLabel {
                    endpoint: ep.endpoint.clone(),
                };
                let metric = family.encode_family(&label)?;
                match kind {
                    MetricType::Counter => ConstCounter::new(read(ep)).encode(metric)?,
                    _ => ConstGauge::new(read(ep) as i64).encode(metric)?,
                }
            }
        }
        let pending = ConstGauge::new(inner.meter.pending() as i64);
        pending.encode(encoder.encode_descriptor(
            "gateway_usage_pending",
            "Usage records not yet accepted by the control plane",
            None,
            pending.metric_type(),
        )?)?;
        Ok(())
    }
}

/// One endpoint's series, looked up once per endpoint rather than per
/// request (a family lookup allocates the label and hashes it under the
/// family's lock).
pub(crate) struct EndpointSeries {
    pub ttft: Histogram,
    pub latency: Histogram,
    /// Response counters by status code, the few codes seen so far.
    responses: Mutex<Vec<(u16, Counter)>>,
    label: String,
}

impl EndpointSeries {
    /// Counts one response with `code`.
    pub fn response(&self, metrics: &Metrics, code: u16) {
        let mut seen = self.responses.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, c)) = seen.iter().find(|(k, _)| *k == code) {
            c.inc();
            return;
        }
        let c = metrics
            .responses
            .get_or_create(&ResponseLabels {
                endpoint: self.label.clone(),
                code,
            })
            .clone();
        c.inc();
        seen.push((code, c));
    }
}

impl Metrics {
    /// The series of the endpoint labelled `endpoint`.
    pub fn series(&self, endpoint: &str) -> EndpointSeries {
        let label = EndpointLabel {
            endpoint: endpoint.to_string(),
        };
        EndpointSeries {
            ttft: self.ttft.get_or_create(&label).clone(),
            latency: self.latency.get_or_create(&label).clone(),
            responses: Mutex::new(Vec::new()),
            label: label.endpoint,
        }
    }

    /// The metrics; `live` is the gateway they read gauges from (weak,
    /// as the gateway owns them).
    pub fn new(live: Weak<crate::Inner>) -> Self {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Live(live)));
        let ttft = Family::<EndpointLabel, Histogram>::new_with_constructor(
            seconds_histogram as fn() -> Histogram,
        );
        let latency = Family::<EndpointLabel, Histogram>::new_with_constructor(
            seconds_histogram as fn() -> Histogram,
        );
        let responses = Family::<ResponseLabels, Counter>::default();
        let usage_dropped = Counter::default();
        registry.register_with_unit(
            "gateway_time_to_first_byte",
            "Arrival to the first response byte",
            prometheus_client::registry::Unit::Seconds,
            ttft.clone(),
        );
        registry.register_with_unit(
            "gateway_request_duration",
            "Arrival to the last response byte",
            prometheus_client::registry::Unit::Seconds,
            latency.clone(),
        );
        registry.register(
            "gateway_responses",
            "Responses by status code",
            responses.clone(),
        );
        registry.register(
            "gateway_usage_dropped",
            "Usage records dropped because the buffer was full",
            usage_dropped.clone(),
        );
        Self {
            registry,
            ttft,
            latency,
            responses,
            usage_dropped,
        }
    }
}
