//! Which routes are which, by path: the API's layers (authentication,
//! idempotency, audit, the write counter the pass trigger reads) each treat
//! a few routes apart, and they must agree on which. The paths live here,
//! beside the routes, so that a route that moves or is added is classified
//! in one place and no layer keeps its own copy of a path.

use axum::http::Method;

/// Routes anyone may read without a key: probes and the API's own
/// description.
pub const PUBLIC: &[&str] = &["/healthz", "/v1/health", "/v1/openapi.json", "/v1/docs"];

/// Where the API describes itself (served beside the routes, see
/// `crate::app`).
pub const OPENAPI_JSON: &str = "/v1/openapi.json";
/// The rendered API reference.
pub const DOCS_HTML: &str = "/v1/docs";
/// The health answer as JSON (`/healthz` is the plain probe).
pub const HEALTH_JSON: &str = "/v1/health";

/// Path prefixes of machine protocol: the agents' and the gateway's calls.
const PROTOCOL_PREFIXES: &[&str] = &["/v1/agent/", "/v1/gateway/"];
/// Usage batches: idempotent event by event (their keys), and reported by
/// machines, not people.
const USAGE_EVENTS: &str = "/v1/usage/events";

/// Mutating routes that are not audited, by template: the protocol traffic
/// of agents and the gateway and reported metrics (observations sent every
/// few seconds, not decisions of a person, whose own records, the ledger,
/// logs and node state, keep them), and `POST /v1/estimates`, which
/// computes a price and stores nothing.
pub const AUDIT_EXEMPT: &[&str] = &[
    "/v1/agent/nodes/{node_id}/sync",
    "/v1/agent/instances/{instance_id}/logs",
    "/v1/gateway/authorize",
    "/v1/gateway/signals",
    "/v1/gateway/usage",
    USAGE_EVENTS,
    "/v1/endpoints/{endpoint_id}/metrics",
    "/v1/estimates",
];

/// Reads that are audited all the same: the WebSocket upgrades that enter
/// a running instance (exec, port-forward, ssh). They change nothing in
/// the store, yet run code in a tenant's workload.
pub const ENTERING: &[&str] = &[
    "/v1/instances/{instance_id}/exec",
    "/v1/instances/{instance_id}/port-forward",
    "/v1/instances/{instance_id}/ssh",
];

/// Whether `path` may be read without a key.
pub fn is_public(path: &str) -> bool {
    PUBLIC.contains(&path)
}

/// Whether `path` is machine protocol (agents, the gateway, usage
/// batches): calls that report rather than decide. Such calls skip the
/// idempotency store (usage batches are idempotent per event and may be
/// far larger than its body limit) and do not count as writes that could
/// change a plan.
pub fn is_protocol(path: &str) -> bool {
    PROTOCOL_PREFIXES.iter().any(|p| path.starts_with(p)) || path == USAGE_EVENTS
}

/// Whether a `method` call on `path` is a person's write: a mutating
/// method on a route that is not machine protocol.
pub fn is_write(method: &Method, path: &str) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) && !is_protocol(path)
}

/// Whether a call of `method` on the route `template` is audited: every
/// mutating call but [`AUDIT_EXEMPT`], and the reads that are
/// [`ENTERING`] an instance.
pub fn audited(method: &Method, template: &str) -> bool {
    (matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    ) && !AUDIT_EXEMPT.contains(&template))
        || (*method == Method::GET && ENTERING.contains(&template))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_traffic_is_told_apart_from_peoples_writes() {
        assert!(is_protocol("/v1/agent/nodes/node_1/sync"));
        assert!(is_protocol("/v1/gateway/usage"));
        assert!(is_protocol("/v1/usage/events"));
        assert!(!is_protocol("/v1/usage"));
        assert!(!is_protocol("/v1/instances"));
        assert!(is_write(&Method::POST, "/v1/instances"));
        assert!(is_write(&Method::DELETE, "/v1/keys/key_1"));
        assert!(!is_write(&Method::GET, "/v1/instances"));
        assert!(!is_write(&Method::POST, "/v1/agent/nodes/node_1/sync"));
    }

    #[test]
    fn only_probes_and_the_description_are_public() {
        assert!(is_public("/healthz"));
        assert!(is_public(OPENAPI_JSON));
        assert!(is_public(DOCS_HTML));
        assert!(is_public(HEALTH_JSON));
        assert!(!is_public("/metrics"));
        assert!(!is_public("/v1/instances"));
    }

    #[test]
    fn protocol_traffic_and_reads_are_not_audited() {
        assert!(audited(&Method::POST, "/v1/instances"));
        assert!(audited(&Method::DELETE, "/v1/keys/{key_id}"));
        assert!(audited(&Method::PUT, "/v1/budget"));
        assert!(!audited(&Method::GET, "/v1/instances"));
        assert!(!audited(&Method::POST, "/v1/agent/nodes/{node_id}/sync"));
        assert!(!audited(&Method::POST, "/v1/estimates"));
        assert!(audited(&Method::GET, "/v1/instances/{instance_id}/exec"));
        assert!(audited(
            &Method::GET,
            "/v1/instances/{instance_id}/port-forward"
        ));
        assert!(audited(&Method::GET, "/v1/instances/{instance_id}/ssh"));
        assert!(!audited(&Method::GET, "/v1/instances/{instance_id}"));
    }

    #[test]
    fn every_exempt_route_is_a_mutating_route_of_the_api() {
        let (_, doc) = crate::routes::api().split_for_parts();
        for t in AUDIT_EXEMPT {
            let item = doc
                .paths
                .paths
                .get(*t)
                .unwrap_or_else(|| panic!("{t} is not a route"));
            assert!(
                item.post.is_some()
                    || item.put.is_some()
                    || item.patch.is_some()
                    || item.delete.is_some(),
                "{t} has no mutating method"
            );
        }
    }
}
