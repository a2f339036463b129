//! Budgets: a tenant's monthly spend limit, its alert thresholds, where
//! alerts are delivered (a signed webhook) and whether the limit is a hard
//! cap on new spot and preemptible capacity.

use axum::extract::State;
use axum::Json;
use flotilla_billing::api::SetBudget;
use flotilla_billing::budget::{Budget, DEFAULT_THRESHOLDS};
use flotilla_core::tenant::Role;
use flotilla_core::FieldError;
use flotilla_store::budgets::StoredBudget;
use serde::Deserialize;

use crate::auth::Caller;
use crate::budgets::{month_of, spend};
use crate::error::{ApiError, ApiResult};
use crate::extract::{serde_urlencoded_query, ApiJson};
use crate::pricing::price_book;
use crate::routes::prices::billing_field;
use crate::routes::usage::target_tenant;
use crate::state::AppState;
use crate::webhook_target;
pub use flotilla_billing::api::BudgetView;

#[derive(Deserialize)]
struct TenantQuery {
    tenant: Option<String>,
}

async fn view(st: &AppState, b: StoredBudget) -> ApiResult<BudgetView> {
    let period = month_of(st.now()).map_err(ApiError::internal)?;
    let tenant = b.budget.tenant.clone();
    Ok(BudgetView {
        spend: spend(st, &tenant).await?,
        alerts: st.store().budget_alerts(&tenant, period.start).await?,
        deliveries: st.store().deliveries(&tenant, 20).await?,
        period_start: period.start,
        limit: b.budget.limit,
        currency: b.budget.currency,
        thresholds: b.budget.thresholds,
        hard_cap: b.budget.hard_cap,
        webhook_url: b.webhook_url,
        tenant,
    })
}

/// The tenant's budget (operators: `tenant=`), this month's spend, the
/// alerts raised and the webhook delivery log. 404 when it has none.
#[utoipa::path(get, path = "/v1/budget", tag = "billing",
    params(("tenant" = Option<String>, Query, description = "operators only: whose budget")),
    responses((status = 200, body = BudgetView), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn get_budget(
    State(st): State<AppState>,
    caller: Caller,
    uri: axum::http::Uri,
) -> ApiResult<Json<BudgetView>> {
    let q: TenantQuery = serde_urlencoded_query(uri.query())?;
    let tenant = target_tenant(&st, &caller, q.tenant.as_deref()).await?;
    let b = st
        .store()
        .budget(&tenant)
        .await?
        .ok_or_else(|| ApiError::not_found("budget"))?;
    Ok(Json(view(&st, b).await?))
}

/// Refuses (422, `webhook_url`) a webhook that is not http(s), or is or
/// already resolves to an address the egress policy refuses
/// (`crate::outbound`).
async fn check_webhook_target(st: &AppState, url: &reqwest::Url) -> ApiResult<()> {
    let (host, port) = webhook_target::host_port(url)
        .map_err(|e| ApiError::field(FieldError::new("webhook_url", e.to_string())))?;
    crate::outbound::check_destination(&st.config().webhook_egress(), &host, port, "webhook_url")
        .await
}

/// Sets (or replaces) the tenant's budget (tenant admins for their own
/// tenant; operators for any, with `tenant`). Alerts at each threshold are
/// recorded once a month and POSTed to `webhook_url` with the header
/// `Flotilla-Signature: t=<unix s>,v1=<hex HMAC-SHA256 of "t.body">`,
/// retried with backoff (1 s doubling, 8 attempts).
#[utoipa::path(put, path = "/v1/budget", tag = "billing", request_body = SetBudget,
    responses((status = 200, body = BudgetView),
              (status = 403, body = flotilla_core::api::ErrorBody),
              (status = 404, body = flotilla_core::api::ErrorBody),
              (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn set_budget(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<SetBudget>,
) -> ApiResult<Json<BudgetView>> {
    let tenant = target_tenant(&st, &caller, req.tenant.as_deref()).await?;
    caller.require(&[Role::TenantAdmin], "set budgets")?;
    match (&req.webhook_url, &req.webhook_secret) {
        (Some(url), Some(secret)) => {
            let ok_scheme = url.starts_with("http://") || url.starts_with("https://");
            let parsed = reqwest::Url::parse(url)
                .ok()
                .filter(|_| ok_scheme && url.len() <= 2048);
            let Some(parsed) = parsed else {
                return Err(ApiError::field(FieldError::new(
                    "webhook_url",
                    "must be an http:// or https:// URL of at most 2048 characters",
                )));
            };
            check_webhook_target(&st, &parsed).await?;
            if !(16..=256).contains(&secret.len()) {
                return Err(ApiError::field(FieldError::new(
                    "webhook_secret",
                    "must be 16 to 256 characters",
                )));
            }
        }
        (Some(_), None) => {
            return Err(ApiError::field(FieldError::new(
                "webhook_secret",
                "is required with webhook_url",
            )))
        }
        (None, Some(_)) => {
            return Err(ApiError::field(FieldError::new(
                "webhook_url",
                "is required with webhook_secret",
            )))
        }
        (None, None) => {}
    }
    let now = st.now();
    let book = price_book(st.store(), st.catalog(), now).await?;
    let budget = Budget {
        tenant,
        limit: req.limit,
        currency: book.currency().code.clone(),
        thresholds: req
            .thresholds
            .unwrap_or_else(|| DEFAULT_THRESHOLDS.to_vec()),
        hard_cap: req.hard_cap,
    };
    budget.validate().map_err(billing_field)?;
    let stored = StoredBudget {
        budget,
        webhook_url: req.webhook_url,
        webhook_secret: req.webhook_secret,
        updated_at: now,
    };
    st.store().set_budget(&stored).await?;
    st.billing().budgets.touch([&stored.budget.tenant]);
    tracing::info!(tenant = %stored.budget.tenant, limit = %stored.budget.limit, hard_cap = stored.budget.hard_cap, "budget set");
    Ok(Json(view(&st, stored).await?))
}
