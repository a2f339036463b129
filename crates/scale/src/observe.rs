//! What a policy sees: one [`Observation`] per call, the [`Signal`]s a
//! metric-driven policy can target, and the time-window average the
//! windowed policies (KPA, Ray Serve) keep.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// Latency percentiles of recent requests, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Latency {
    /// Median.
    pub p50_ms: f64,
    /// 95th percentile: the percentile endpoint SLOs are written against.
    pub p95_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
}

/// One snapshot of an endpoint's state, as the gateway and agents report it.
///
/// Counts are integers; rates are not observed directly but derived by the
/// policy from the monotone [`Observation::requests_total`] counter, so a
/// missed or late tick loses no arrivals (the Prometheus counter idea).
/// Non-finite or negative readings count as zero: a broken exporter must not
/// scale the fleet to its maximum.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Observation {
    /// Replicas ready to serve.
    pub ready: u32,
    /// Replicas asked for but not yet ready (provisioning, pulling, loading).
    pub starting: u32,
    /// Requests being served by replicas right now.
    pub in_flight: u32,
    /// Requests waiting: in the gateway queue or the scale-from-zero
    /// activator's buffer.
    pub queued: u32,
    /// Requests that have arrived since an arbitrary origin (monotone; a
    /// decrease is read as a counter reset).
    pub requests_total: u64,
    /// Mean GPU utilisation over ready replicas, `0.0..=1.0`.
    pub gpu_utilization: f64,
    /// Recent latency percentiles, if any request completed recently.
    pub latency: Option<Latency>,
    /// The endpoint's p95 latency objective in milliseconds, if it has one.
    pub slo_ms: Option<f64>,
    /// An operator-defined metric, summed over the endpoint (like a KEDA
    /// external metric or a Prometheus `sum(...)`).
    pub custom: Option<f64>,
}

/// One measured duration a policy may learn from, reported by the caller
/// as it happens ([`crate::Policy::record`]): the live server from the
/// gateway's and agents' reports, the simulator from its events. Policies
/// that learn nothing from them ignore them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Timing {
    /// A request's prefill took `ms` (its first token came `ms` after it
    /// took a slot).
    Prefill { ms: u64 },
    /// A replica restored from host memory (parked) was ready `ms` after it
    /// took its GPU.
    Restore { ms: u64 },
}

/// Whether a signal is a total over the endpoint or already an average per
/// replica. HPA divides totals by the replica count; averages it takes as
/// they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aggregation {
    /// Summed over the endpoint (requests, custom metric).
    Total,
    /// Already a per-replica mean or an endpoint-wide ratio.
    Average,
}

/// A metric a policy can target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Signal {
    /// In-flight plus queued requests (Knative's and Ray Serve's "ongoing
    /// requests"): the usual metric for inference endpoints.
    Concurrency,
    /// Requests being served.
    InFlight,
    /// Requests waiting.
    Queued,
    /// Mean GPU utilisation, `0.0..=1.0`.
    GpuUtilization,
    /// Observed p95 latency divided by the SLO: 1.0 means exactly on target.
    SloPressure,
    /// The operator's custom metric (a total).
    Custom,
}

impl Signal {
    /// How the signal aggregates across replicas.
    pub const fn aggregation(self) -> Aggregation {
        match self {
            Self::Concurrency | Self::InFlight | Self::Queued | Self::Custom => Aggregation::Total,
            Self::GpuUtilization | Self::SloPressure => Aggregation::Average,
        }
    }
}

/// `x` if finite and positive, else zero.
pub(crate) fn sane(x: f64) -> f64 {
    if x.is_finite() && x > 0.0 {
        x
    } else {
        0.0
    }
}

impl Observation {
    /// Replicas asked for: ready plus starting. This is what Kubernetes
    /// calls the current replicas (the scale subresource's count).
    pub fn current(&self) -> u32 {
        self.ready.saturating_add(self.starting)
    }

    /// In-flight plus queued requests.
    pub fn concurrency(&self) -> f64 {
        f64::from(self.in_flight) + f64::from(self.queued)
    }

    /// The value of `signal`, or `None` when it is not observed (no custom
    /// metric, no latency or no SLO).
    pub fn value(&self, signal: Signal) -> Option<f64> {
        match signal {
            Signal::Concurrency => Some(self.concurrency()),
            Signal::InFlight => Some(f64::from(self.in_flight)),
            Signal::Queued => Some(f64::from(self.queued)),
            Signal::GpuUtilization => Some(sane(self.gpu_utilization).min(1.0)),
            Signal::SloPressure => {
                let slo = sane(self.slo_ms?);
                let p95 = sane(self.latency?.p95_ms);
                (slo > 0.0).then(|| p95 / slo)
            }
            Signal::Custom => self.custom.map(sane),
        }
    }
}

/// Average of samples over a sliding time window, kept in fixed-width
/// buckets so memory stays `window / granularity` however often the caller
/// samples. Each bucket holds the mean of its samples; the window average is
/// the mean of the buckets in the window. This is the shape of Knative's
/// `TimedFloat64Buckets` (one-second buckets) and of Ray Serve's look-back
/// average.
#[derive(Debug, Clone)]
pub(crate) struct WindowAverage {
    window_ms: u64,
    granularity_ms: u64,
    /// `(bucket index = t / granularity, sum, count)`, oldest first.
    buckets: VecDeque<(u64, f64, u32)>,
}

impl WindowAverage {
    pub(crate) fn new(window_ms: u64, granularity_ms: u64) -> Self {
        Self {
            window_ms: window_ms.max(1),
            granularity_ms: granularity_ms.max(1),
            buckets: VecDeque::new(),
        }
    }

    /// Record `value` at `now_ms` (non-decreasing; see [`crate::policy`]).
    pub(crate) fn record(&mut self, now_ms: u64, value: f64) {
        let idx = now_ms / self.granularity_ms;
        let v = sane(value);
        match self.buckets.back_mut() {
            Some((last, sum, n)) if *last >= idx => {
                *sum += v;
                *n = n.saturating_add(1);
            }
            _ => self.buckets.push_back((idx, v, 1)),
        }
        self.prune(now_ms);
    }

    fn prune(&mut self, now_ms: u64) {
        let oldest = now_ms.saturating_sub(self.window_ms) / self.granularity_ms;
        while self.buckets.front().is_some_and(|(i, _, _)| *i < oldest) {
            self.buckets.pop_front();
        }
    }

    /// Mean over buckets within the window ending at `now_ms`; zero when
    /// there is no data in the window.
    pub(crate) fn average(&self, now_ms: u64) -> f64 {
        let oldest = now_ms.saturating_sub(self.window_ms) / self.granularity_ms;
        let (mut total, mut count) = (0.0, 0u32);
        for (i, sum, n) in &self.buckets {
            if *i >= oldest && *n > 0 {
                total += sum / f64::from(*n);
                count += 1;
            }
        }
        if count == 0 {
            0.0
        } else {
            total / f64::from(count)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slo_pressure_needs_latency_and_slo() {
        let mut o = Observation::default();
        assert_eq!(o.value(Signal::SloPressure), None);
        o.slo_ms = Some(800.0);
        o.latency = Some(Latency {
            p50_ms: 100.0,
            p95_ms: 1200.0,
            p99_ms: 2000.0,
        });
        assert_eq!(o.value(Signal::SloPressure), Some(1.5));
    }

    #[test]
    fn broken_readings_count_as_zero() {
        let o = Observation {
            gpu_utilization: f64::NAN,
            custom: Some(f64::INFINITY),
            ..Observation::default()
        };
        assert_eq!(o.value(Signal::GpuUtilization), Some(0.0));
        assert_eq!(o.value(Signal::Custom), Some(0.0));
    }

    #[test]
    fn window_average_forgets_old_buckets() {
        let mut w = WindowAverage::new(6_000, 1_000);
        w.record(0, 10.0);
        w.record(500, 20.0); // same bucket: mean 15
        w.record(1_000, 3.0);
        assert!((w.average(1_000) - 9.0).abs() < 1e-9);
        assert_eq!(w.average(20_000), 0.0);
        w.record(20_000, 4.0);
        assert!((w.average(20_000) - 4.0).abs() < 1e-9);
    }
}
