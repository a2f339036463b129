//! The contract between the inference gateway and the control plane.
//!
//! The gateway never reads the database: it learns where to send requests
//! from a [`RouteTable`] the server builds, asks the server whether an
//! inference key may call an endpoint ([`KeyGrant`]), pushes the demand it
//! sees ([`EndpointSignals`]) so the autoscaler reacts to a queued request
//! at once, and hands over what each request used ([`RequestUsage`]) for
//! metering. These are wire types only: the server serves them on
//! `/v1/gateway/*` and the gateway's control client reads them.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::id::{EndpointId, InstanceId, RequestId, TenantId};

/// The `q` quantile of `v` by nearest rank (sorts `v` in place); `None`
/// when `v` is empty. How every latency percentile the gateway reports
/// (and `flotilla demo` shows) is computed: a value that was measured,
/// never an interpolation between two.
pub fn nearest_rank(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    Some(v[i])
}

/// Everything the gateway needs to route: every endpoint that exists, with
/// the replicas ready to take requests. Replaced as a whole on each poll.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RouteTable {
    /// Endpoints, in no particular order.
    pub endpoints: Vec<EndpointRoute>,
}

/// How requests pick a replica among the ready ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Balance {
    /// Least outstanding requests over two random choices.
    #[default]
    LeastOutstanding,
    /// Bounded-load consistent hashing on the prompt's prefix, so requests
    /// sharing a prefix reuse one replica's KV cache.
    PrefixAffinity,
    /// Bounded-load consistent hashing on the `x-session-id` header.
    SessionAffinity,
}

/// One endpoint as the gateway routes to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EndpointRoute {
    /// The endpoint.
    pub id: EndpointId,
    /// Its owner: only this tenant's keys reach it.
    pub tenant_id: TenantId,
    /// Its name, unique per tenant; requests under `/e/{name}/…` or with
    /// the host `{name}.{gateway domain}` go here.
    pub name: String,
    /// Model names served; an OpenAI request whose body's `model` is one of
    /// these goes here.
    pub models: Vec<String>,
    /// How to pick a replica.
    #[serde(default)]
    pub balance: Balance,
    /// Requests that may wait (no replica yet, or all saturated) before new
    /// ones are refused with 429.
    pub queue_limit: u32,
    /// How long a request may wait for a replica before it is answered 503.
    pub queue_timeout_ms: u64,
    /// Requests a replica takes at once before it counts as saturated.
    pub replica_concurrency: u32,
    /// Requests per second allowed per inference key; `None` is unlimited.
    #[serde(default)]
    pub rate_limit_rps: Option<u32>,
    /// Replicas that take requests. A draining one finishes what it has
    /// and gets nothing new.
    pub replicas: Vec<ReplicaRoute>,
}

/// One replica the gateway may send requests to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplicaRoute {
    /// The instance serving it.
    pub instance_id: InstanceId,
    /// Base URL, e.g. `http://127.0.0.1:41234`.
    pub url: String,
    /// The endpoint revision it runs.
    pub revision: u32,
    /// Being scaled down or replaced: no new requests.
    #[serde(default)]
    pub draining: bool,
}

/// The server's answer on whether an inference key may call endpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct KeyGrant {
    /// The key's tenant.
    pub tenant_id: TenantId,
    /// The endpoints the key may call; empty means every endpoint of its
    /// tenant.
    #[serde(default)]
    pub endpoints: Vec<EndpointId>,
    /// The tenant's budget hard cap is reached: requests answer 402.
    #[serde(default)]
    pub over_hard_cap: bool,
}

/// Demand one gateway saw on one endpoint. Sent at least every second, and
/// at once when a request starts waiting at zero replicas.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EndpointSignals {
    /// The endpoint.
    pub endpoint_id: EndpointId,
    /// When the gateway took the reading.
    pub at: DateTime<Utc>,
    /// Requests sent to replicas and not yet answered.
    pub in_flight: u32,
    /// Requests waiting in the activator queue.
    pub queued: u32,
    /// Requests that have arrived since the gateway started (monotone).
    pub requests_total: u64,
    /// Recent time-to-first-byte p50/p95, ms, when any request completed.
    #[serde(default)]
    pub ttft_p50_ms: Option<f64>,
    /// Recent time-to-first-byte p95, ms.
    #[serde(default)]
    pub ttft_p95_ms: Option<f64>,
    /// Recent whole-request latency p95, ms.
    #[serde(default)]
    pub latency_p95_ms: Option<f64>,
}

/// What one finished request used: metered exactly once by its id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RequestUsage {
    /// The request; the idempotency key of its usage event.
    pub request_id: RequestId,
    /// The endpoint it called.
    pub endpoint_id: EndpointId,
    /// The replica that served it; `None` when it never reached one.
    #[serde(default)]
    pub instance_id: Option<InstanceId>,
    /// When it arrived at the gateway.
    pub started_at: DateTime<Utc>,
    /// When its last byte was sent back.
    pub finished_at: DateTime<Utc>,
    /// The HTTP status returned to the caller.
    pub status: u16,
    /// Prompt tokens, from the upstream's `usage` (streams included).
    #[serde(default)]
    pub input_tokens: u64,
    /// Completion tokens, from the upstream's `usage`.
    #[serde(default)]
    pub output_tokens: u64,
}

/// The key a caller of the gateway presented.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AuthorizeRequest {
    /// The bearer secret.
    pub key: String,
}

/// Demand readings of one gateway (`POST /v1/gateway/signals`).
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SignalsBatch {
    /// One reading per endpoint.
    pub signals: Vec<EndpointSignals>,
}

/// Finished requests (`POST /v1/gateway/usage`).
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UsageBatch {
    /// One record per request.
    pub requests: Vec<RequestUsage>,
}

/// How many records a batch call took.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Accepted {
    /// Records recorded.
    pub accepted: u64,
    /// Records already recorded (re-sent).
    #[serde(default)]
    pub duplicates: u64,
    /// Records refused, each as `key: reason` (usage only); the gateway
    /// need not re-send them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rejected: Vec<String>,
}

#[cfg(test)]
mod tests {
    #[test]
    fn quantiles_are_nearest_rank() {
        let mut v = vec![5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(super::nearest_rank(&mut v, 0.5), Some(3.0));
        assert_eq!(super::nearest_rank(&mut v, 0.99), Some(5.0));
        assert_eq!(super::nearest_rank(&mut [], 0.5), None);
    }
}
