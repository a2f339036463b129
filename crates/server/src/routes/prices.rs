//! The price catalog: read by everyone (a tenant can check every price an
//! invoice line names), published by operators as new versions with an
//! effective date; the recorded spot price series; and cost estimates
//! priced with the catalog in force.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use flotilla_billing::estimate::{estimate, Estimate, Workload};
use flotilla_billing::price::PriceVersion;
use flotilla_billing::BillingError;
use flotilla_core::tenant::Role;
use flotilla_core::FieldError;
use serde::Deserialize;

use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::{instant, page_limit, parse_json, serde_urlencoded_query};
use crate::pricing::{price_book, spot_series};
use crate::state::AppState;
pub use flotilla_billing::api::{PriceCatalog, SpotPrices};

/// A billing error as a 422 naming its field.
pub(crate) fn billing_field(err: BillingError) -> ApiError {
    match err {
        BillingError::Invalid { field, message } => {
            ApiError::field(FieldError::new(field, message))
        }
        other => ApiError::field(FieldError::new("body", other.to_string())),
    }
}

/// The price catalog: every published version and the one in force.
/// Versions are immutable; a new price is a new version.
#[utoipa::path(get, path = "/v1/prices", tag = "billing",
    responses((status = 200, body = PriceCatalog)))]
pub async fn get_prices(
    State(st): State<AppState>,
    _caller: Caller,
) -> ApiResult<Json<PriceCatalog>> {
    let now = st.now();
    let book = price_book(st.store(), st.catalog(), now).await?;
    let in_force = book
        .in_force(now)
        .map_err(|e| ApiError::conflict(e.to_string()))?
        .version;
    Ok(Json(PriceCatalog {
        in_force,
        currency: book.currency().code.clone(),
        versions: book.versions().to_vec(),
    }))
}

/// Publishes the next catalog version (operators). The body is a version
/// as listed by `GET /v1/prices`; `version` may be left out (the next
/// number is taken). It must take effect after the latest version and not
/// in the past, so no charge already made can change, and keep the
/// catalog's currency. Errors name the field (`on_demand.H100.per_gpu_second`,
/// `effective_from`, …); two operators publishing at once: 409 for the
/// second.
#[utoipa::path(post, path = "/v1/prices", tag = "billing",
    request_body(content = Object, description = "a price version; `version` optional"),
    responses((status = 201, body = Object, description = "the published version"),
              (status = 403, body = flotilla_core::api::ErrorBody),
              (status = 409, body = flotilla_core::api::ErrorBody),
              (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn publish_prices(
    State(st): State<AppState>,
    caller: Caller,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<PriceVersion>)> {
    caller.require(&[], "publish prices")?;
    let now = st.now();
    let mut book = price_book(st.store(), st.catalog(), now).await?;
    let mut raw: serde_json::Map<String, serde_json::Value> = parse_json(&body)?;
    raw.entry("version")
        .or_insert_with(|| serde_json::json!(book.latest().version + 1));
    let bytes = serde_json::to_vec(&raw).map_err(ApiError::internal)?;
    let version: PriceVersion = parse_json(&bytes)?;
    book.publish(version.clone(), now).map_err(billing_field)?;
    st.store().insert_price_version(&version, now).await?;
    st.billing().budgets.touch_all();
    tracing::info!(version = version.version, effective_from = %version.effective_from, key = %caller.key_id, "price version published");
    Ok((StatusCode::CREATED, Json(version)))
}

#[derive(Deserialize)]
struct SpotQuery {
    model: Option<String>,
    from: Option<String>,
    to: Option<String>,
    limit: Option<String>,
}

/// The spot price in force per model: the latest point of the series
/// recorded from pool utilisation (`floor + (ceiling - floor) × u`), or the
/// band's floor from the epoch before any was recorded. Invoice lines name
/// the point (`price_point_at`) that priced them; `model` (with `from`,
/// `to`, `limit`) lists that model's recorded points, so any spot line can
/// be checked against the utilisation and band it came from.
#[utoipa::path(get, path = "/v1/prices/spot", tag = "billing",
    params(("model" = Option<String>, Query, description = "also list this model's recorded points"),
           ("from" = Option<String>, Query, description = "RFC 3339, inclusive (default: 24 h ago)"),
           ("to" = Option<String>, Query, description = "RFC 3339, exclusive (default: now)"),
           ("limit" = Option<u32>, Query, description = "points per page, 1-1000 (default 100)")),
    responses((status = 200, body = SpotPrices), (status = 400, body = flotilla_core::api::ErrorBody)))]
pub async fn get_spot_prices(
    State(st): State<AppState>,
    _caller: Caller,
    uri: axum::http::Uri,
) -> ApiResult<Json<SpotPrices>> {
    let q: SpotQuery = serde_urlencoded_query(uri.query())?;
    let now = st.now();
    // Every parameter is checked, `model` given or not: a bad value is
    // refused rather than ignored.
    let from = match q.from.as_deref() {
        Some(f) => instant(f, "from")?,
        None => now - chrono::Duration::hours(24),
    };
    let to = match q.to.as_deref() {
        Some(t) => instant(t, "to")?,
        None => now + chrono::Duration::milliseconds(1),
    };
    let limit = page_limit(q.limit.as_deref())?;
    let (history, next_from) = match q.model.as_deref() {
        None => (Vec::new(), None),
        Some(m) => {
            let model = st
                .catalog()
                .resolve(m, "model")
                .map_err(|e| ApiError::bad_request("model", e.message))?;
            let (points, more) = st.store().spot_history(&model, from, to, limit).await?;
            let next = more
                .then(|| {
                    points
                        .last()
                        .map(|p| (p.at + chrono::Duration::milliseconds(1)).to_rfc3339())
                })
                .flatten();
            (points, next)
        }
    };
    let book = price_book(st.store(), st.catalog(), now).await?;
    let series = spot_series(st.store(), &book, now + chrono::Duration::milliseconds(1)).await?;
    let latest = book
        .in_force(now)
        .map_err(|e| ApiError::conflict(e.to_string()))?
        .spot
        .keys()
        .filter_map(|m| series.latest(m).cloned())
        .collect();
    Ok(Json(SpotPrices {
        latest,
        history,
        next_from,
    }))
}

/// Prices a workload for a 30-day month under every billing model and GPU
/// model, with the catalog and spot prices in force, and names the
/// cheapest option that meets it (tier-1 work never runs on spot; only
/// request-serving work runs serverless). Body: `{"kind": "gpu", "model"
/// (optional), "gpus", "hours_per_day", "duty_cycle", "tier",
/// "serves_requests"}` or `{"kind": "serverless", "model" (optional),
/// "requests_per_second", "input_tokens_per_request",
/// "output_tokens_per_request", "gpu_seconds_per_request", "tier",
/// "parked_gb" (optional: GB of weights kept parked all month)}`.
#[utoipa::path(post, path = "/v1/estimates", tag = "billing",
    request_body(content = Object, description = "a workload"),
    responses((status = 200, body = Object, description = "currency, price_version, month_seconds, options (model, billing_model, gpus, monthly_cost, meets, note), cheapest"),
              (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn post_estimate(
    State(st): State<AppState>,
    caller: Caller,
    body: Bytes,
) -> ApiResult<Json<Estimate>> {
    caller.require(
        &[Role::TenantAdmin, Role::TenantMember, Role::Provider],
        "estimate",
    )?;
    let workload: Workload = parse_json(&body)?;
    let model = match &workload {
        Workload::Gpu(g) => g.model.as_deref(),
        Workload::Serverless(s) => s.model.as_deref(),
    };
    let workload = match model {
        Some(m) => {
            let resolved = st.catalog().resolve(m, "model")?;
            let mut w = workload.clone();
            match &mut w {
                Workload::Gpu(g) => g.model = Some(resolved),
                Workload::Serverless(s) => s.model = Some(resolved),
            }
            w
        }
        None => workload,
    };
    let now = st.now();
    let book = price_book(st.store(), st.catalog(), now).await?;
    let series = spot_series(st.store(), &book, now + chrono::Duration::milliseconds(1)).await?;
    let est = estimate(&workload, &book, &series, now).map_err(|e| match e {
        BillingError::Invalid { .. } => billing_field(e),
        other => ApiError::conflict(other.to_string()),
    })?;
    Ok(Json(est))
}
