//! Usage and invoices: batched ingestion of metered usage events into the
//! append-only ledger, the tenant's usage list, and a draft invoice rated
//! from the ledger by flotilla-billing.
//!
//! Ingestion is idempotent by design, event by event: every event carries
//! its key `(tenant, source, id)`, and the store's unique key absorbs
//! re-sends. So a sender (an agent, the gateway) that lost an answer or
//! crashed re-sends the whole batch, and the answer says how many were
//! new and how many duplicates.

use axum::extract::{Request, State};
use axum::response::IntoResponse;
use axum::Json;
use chrono::{DateTime, Duration, Utc};
use flotilla_billing::invoice::Invoice;
use flotilla_billing::meter::UsageEvent;
use flotilla_billing::{BillingError, Period};
use flotilla_core::id::{InvoiceId, TenantId};
use flotilla_core::tenant::Role;
use flotilla_core::FieldError;
use flotilla_store::usage::{validate_event, AppendOutcome};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::{page_limit, parse_json, required_instant, serde_urlencoded_query};
use crate::state::AppState;

/// Most events in one `POST /v1/usage/events`.
pub const MAX_EVENTS: usize = 10_000;

/// Largest body of `POST /v1/usage/events`: 10,000 events of up to about
/// 1.6 KiB each. The general 1 MiB limit would cap a batch near 3,000.
pub const USAGE_BODY_LIMIT: usize = 16 * 1024 * 1024;

/// How long after its end an event is still accepted. Invoices of a
/// period can only be finalised once this has passed after its end, so
/// late events always land on a draft. Three days covers an agent that
/// was cut off over a weekend.
pub fn grace() -> Duration {
    crate::metering::grace()
}

/// A batch of usage events.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UsageBatch {
    /// 1 to 10,000 events. Each is flotilla-billing's `UsageEvent`:
    /// `key {tenant, source, id}`, `subject {kind, id}`, `meter` (tagged by
    /// `meter`: `gpu_seconds` with `model` and `share`, `instance_seconds`,
    /// `storage_gb_seconds`, `requests`, `input_tokens`, `output_tokens`),
    /// `billing_class`, `start`, `end` (RFC 3339, whole milliseconds),
    /// `amount` (decimal string), optional `node` and `corrects`.
    #[schema(value_type = Vec<Object>)]
    pub events: Vec<UsageEvent>,
}

/// One refused event.
#[derive(Debug, Serialize, ToSchema)]
pub struct RejectedEvent {
    /// Its position in the batch.
    pub index: usize,
    /// Its key, `tenant/source/id`.
    pub key: String,
    /// `key_conflict` (the key holds another payload; send a correction as
    /// a new event), `late` (past the grace window) or `unknown_tenant`.
    pub code: String,
    /// The field at fault, if one is.
    pub field: Option<String>,
    /// What is wrong.
    pub message: String,
}

/// What a batch did: `accepted + duplicates + rejected` is its size.
#[derive(Debug, Serialize, ToSchema)]
pub struct UsageAccepted {
    /// Events recorded now.
    pub accepted: u64,
    /// Events already recorded with the same payload; nothing changed.
    pub duplicates: u64,
    /// Events refused, with reasons.
    pub rejected: Vec<RejectedEvent>,
}

impl From<AppendOutcome> for UsageAccepted {
    fn from(o: AppendOutcome) -> Self {
        Self {
            accepted: o.accepted,
            duplicates: o.duplicates,
            rejected: o
                .rejected
                .into_iter()
                .map(|r| RejectedEvent {
                    index: r.index,
                    key: r.key,
                    code: r.code.to_string(),
                    field: r.field,
                    message: r.message,
                })
                .collect(),
        }
    }
}

/// Records a batch of metered usage. Agents and gateways send usage, so
/// only provider and operator keys may, and a provider only for usage on
/// its own nodes (every event names its `node`). The whole batch is validated first
/// (422 names `events[i].field`; nothing is stored); then it is appended in
/// one transaction: new events are recorded, exact re-sends are counted as
/// duplicates, and an event whose key holds another payload, or that ended
/// before the grace window (72 h), is refused in `rejected`. Re-sending a
/// whole batch is always safe.
#[utoipa::path(post, path = "/v1/usage/events", tag = "usage", request_body = UsageBatch,
    responses((status = 200, body = UsageAccepted),
              (status = 403, body = flotilla_core::api::ErrorBody),
              (status = 413, body = flotilla_core::api::ErrorBody),
              (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn post_usage_events(
    State(st): State<AppState>,
    caller: Caller,
    req: Request,
) -> ApiResult<Json<UsageAccepted>> {
    caller.require(&[Role::Provider], "send usage events")?;
    let bytes = axum::body::to_bytes(req.into_body(), USAGE_BODY_LIMIT)
        .await
        .map_err(|_| ApiError::too_large(USAGE_BODY_LIMIT))?;
    let batch: UsageBatch = parse_json(&bytes)?;
    if batch.events.is_empty() || batch.events.len() > MAX_EVENTS {
        return Err(ApiError::field(FieldError::new(
            "events",
            format!(
                "must hold 1 to {MAX_EVENTS} events, got {}",
                batch.events.len()
            ),
        )));
    }
    for (i, e) in batch.events.iter().enumerate() {
        validate_event(e).map_err(|err| billing_field(&format!("events[{i}]"), err))?;
    }
    if !caller.is_operator() {
        // A provider reports only usage served by its own nodes: otherwise
        // one provider key could bill any tenant for anything.
        let mut own: std::collections::BTreeMap<String, bool> = Default::default();
        for (i, e) in batch.events.iter().enumerate() {
            let field = format!("events[{i}].node");
            let Some(node) = &e.node else {
                return Err(ApiError::field(FieldError::new(
                    field,
                    "a provider key must name the node that served the usage",
                )));
            };
            let mine = match own.get(node.as_str()) {
                Some(m) => *m,
                None => {
                    let m = match st.store().node(node).await {
                        Ok(n) => n.owner_tenant_id == caller.tenant_id,
                        Err(flotilla_store::StoreError::NotFound(_)) => false,
                        Err(e) => return Err(e.into()),
                    };
                    own.insert(node.as_str().to_string(), m);
                    m
                }
            };
            if !mine {
                return Err(ApiError::field(FieldError::new(
                    field,
                    "is not a node of this provider",
                )));
            }
        }
    }
    let started = tokio::time::Instant::now();
    let out = st
        .store()
        .append_usage(&batch.events, grace(), st.now())
        .await?;
    st.ops()
        .usage_ingest
        .observe(started.elapsed().as_secs_f64());
    st.ops().usage_outcome(
        "api",
        out.accepted,
        out.duplicates,
        out.rejected.len() as u64,
    );
    tracing::info!(
        accepted = out.accepted,
        duplicates = out.duplicates,
        rejected = out.rejected.len(),
        key = %caller.key_id,
        "usage batch"
    );
    Ok(Json(out.into()))
}

/// A billing validation error as a 422 naming `prefix.field`.
fn billing_field(prefix: &str, err: BillingError) -> ApiError {
    match err {
        BillingError::Invalid { field, message } => {
            ApiError::field(FieldError::new(format!("{prefix}.{field}"), message))
        }
        other => ApiError::field(FieldError::new(prefix, other.to_string())),
    }
}

/// One page of usage events.
#[derive(Debug, Serialize, ToSchema)]
pub struct UsagePage {
    /// Events in order of `(end, source, id)`.
    #[schema(value_type = Vec<Object>)]
    pub items: Vec<UsageEvent>,
    /// Cursor of the next page, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

#[derive(Deserialize)]
struct UsageQuery {
    from: Option<String>,
    to: Option<String>,
    tenant: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
}

/// The tenant a read is about: the caller's own, or for operators any
/// named one (404 when it does not exist). Others naming another tenant
/// get 404, as for every resource they cannot see.
pub(crate) async fn target_tenant(
    st: &AppState,
    caller: &Caller,
    raw: Option<&str>,
) -> ApiResult<TenantId> {
    let Some(raw) = raw else {
        return Ok(caller.tenant_id.clone());
    };
    let id =
        TenantId::parse(raw, "tenant").map_err(|e| ApiError::bad_request("tenant", e.message))?;
    if !caller.sees(&id) {
        return Err(ApiError::not_found("tenant"));
    }
    st.store().tenant(&id).await?;
    Ok(id)
}

/// The cursor: hex of the JSON `[end_ms, source, id]` of the last item.
fn encode_cursor(e: &UsageEvent) -> String {
    let v = serde_json::json!([e.end.timestamp_millis(), e.key.source, e.key.id]);
    let mut s = String::new();
    for b in v.to_string().bytes() {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

fn decode_cursor(raw: &str) -> Option<(DateTime<Utc>, String, String)> {
    if raw.len() & 1 == 1 || raw.len() > 4096 {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..raw.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(raw.get(i..i + 2)?, 16).ok())
        .collect();
    let (end, source, id): (i64, String, String) = serde_json::from_slice(&bytes?).ok()?;
    Some((DateTime::from_timestamp_millis(end)?, source, id))
}

/// The tenant's usage events touching `[from, to)` (operators: `tenant=`
/// picks another tenant). Pages like every list: `limit` (1-1000, default
/// 100) and the opaque `cursor` from `next_cursor`. `format=csv` (or
/// `Accept: text/csv`) answers the page as CSV.
#[utoipa::path(get, path = "/v1/usage", tag = "usage",
    params(("from" = String, Query, description = "RFC 3339 start, inclusive"),
           ("to" = String, Query, description = "RFC 3339 end, exclusive"),
           ("tenant" = Option<String>, Query, description = "operators only: whose usage"),
           ("limit" = Option<u32>, Query, description = "page size, 1-1000"),
           ("cursor" = Option<String>, Query, description = "from next_cursor"),
           ("format" = Option<String>, Query, description = "csv: one row per event (also `Accept: text/csv`); the next cursor is in `X-Next-Cursor`")),
    responses((status = 200, body = UsagePage, description = "JSON, or text/csv when asked"), (status = 400, body = flotilla_core::api::ErrorBody),
              (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn list_usage(
    State(st): State<AppState>,
    caller: Caller,
    headers: axum::http::HeaderMap,
    uri: axum::http::Uri,
) -> ApiResult<axum::response::Response> {
    let csv = super::export::wants_csv(&uri, &headers)?;
    let q: UsageQuery = serde_urlencoded_query(uri.query())?;
    let from = required_instant(q.from.as_deref(), "from")?;
    let to = required_instant(q.to.as_deref(), "to")?;
    if from >= to {
        return Err(ApiError::bad_request("to", "must be after from"));
    }
    let limit = page_limit(q.limit.as_deref())?;
    let after = match q.cursor.as_deref() {
        None => None,
        Some(c) => Some(decode_cursor(c).ok_or_else(|| {
            ApiError::bad_request("cursor", "is not a cursor returned by this API")
        })?),
    };
    let tenant = target_tenant(&st, &caller, q.tenant.as_deref()).await?;
    let (items, more) = st
        .store()
        .list_usage(&tenant, from, to, after, limit)
        .await?;
    let next_cursor = if more {
        items.last().map(encode_cursor)
    } else {
        None
    };
    if csv {
        let body = super::export::usage_csv(&items)?;
        return Ok(super::export::csv_response(body, next_cursor.as_deref()));
    }
    Ok(Json(UsagePage { items, next_cursor }).into_response())
}

#[derive(Deserialize)]
struct PreviewQuery {
    period: Option<String>,
    tenant: Option<String>,
}

pub(crate) fn parse_month(raw: Option<&str>) -> ApiResult<Period> {
    let bad = || ApiError::bad_request("period", "must be a month like 2025-01");
    let raw = raw.ok_or_else(bad)?;
    let (y, m) = raw.split_once('-').ok_or_else(bad)?;
    if y.len() != 4 || m.len() != 2 {
        return Err(bad());
    }
    let (y, m) = (
        y.parse::<i32>().map_err(|_| bad())?,
        m.parse::<u32>().map_err(|_| bad())?,
    );
    Period::month(y, m).map_err(|_| bad())
}

/// A draft invoice of the tenant (operators: `tenant=`) for a calendar
/// month, rated now from the ledger with the stored price catalog (each
/// line names its version), the recorded spot series and the tenant's
/// commitments, discounts and credits. The
/// tenant's events are summed in SQL into rows that rate exactly like the
/// events themselves, so a month of millions of events rates in one scan.
/// Nothing is stored; the invoice id is fresh on every call.
#[utoipa::path(get, path = "/v1/invoices/preview", tag = "usage",
    params(("period" = String, Query, description = "the month, YYYY-MM (UTC)"),
           ("tenant" = Option<String>, Query, description = "operators only: whose invoice")),
    responses((status = 200, body = Object, description = "flotilla-billing's Invoice: id, tenant, period, currency, status, lines (kind, description, model, quantity, unit, unit_price, amount, price_version, …), subtotal, total"),
              (status = 400, body = flotilla_core::api::ErrorBody),
              (status = 409, body = flotilla_core::api::ErrorBody, description = "usage without a price in the book")))]
pub async fn invoice_preview(
    State(st): State<AppState>,
    caller: Caller,
    uri: axum::http::Uri,
) -> ApiResult<Json<Invoice>> {
    let q: PreviewQuery = serde_urlencoded_query(uri.query())?;
    let period = parse_month(q.period.as_deref())?;
    let tenant = target_tenant(&st, &caller, q.tenant.as_deref()).await?;
    let (t, r) = st.ids();
    let id = InvoiceId::generate(t, r);
    let draft =
        crate::pricing::draft_invoice(st.store(), st.catalog(), &tenant, period, &id, st.now())
            .await?;
    Ok(Json(draft.invoice))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_reject_garbage() {
        let e: UsageEvent = serde_json::from_value(serde_json::json!({
            "key": {"tenant": TenantId::generate(1, 1), "source": "agent:n/1", "id": "x y"},
            "subject": {"kind": "instance", "id": "inst_1"},
            "meter": {"meter": "instance_seconds"},
            "billing_class": "on_demand",
            "start": "2025-01-01T00:00:00Z", "end": "2025-01-01T00:01:00Z",
            "amount": "1"
        }))
        .unwrap();
        let c = encode_cursor(&e);
        assert!(c.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(
            decode_cursor(&c),
            Some((e.end, "agent:n/1".into(), "x y".into()))
        );
        assert_eq!(decode_cursor("zz"), None);
        assert_eq!(decode_cursor("abc"), None);
    }

    #[test]
    fn months_parse_strictly() {
        assert!(parse_month(Some("2025-01")).is_ok());
        for bad in ["2025-13", "2025-1", "25-01", "2025/01", ""] {
            assert!(parse_month(Some(bad)).is_err(), "{bad}");
        }
        assert!(parse_month(None).is_err());
    }
}
