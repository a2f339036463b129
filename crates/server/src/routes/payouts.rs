//! Marketplace payouts: for a month, each provider's revenue from the
//! usage its nodes carried (every tenant's), the operator's fee and what
//! the provider is paid.

use axum::extract::State;
use axum::Json;
use flotilla_billing::payout::{payout_statement, PayoutPolicy};
use flotilla_core::id::ProviderId;
use flotilla_core::tenant::Role;
use serde::Deserialize;

use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::serde_urlencoded_query;
use crate::pricing::{price_book, spot_series, RatingError};
use crate::routes::usage::parse_month;
use crate::state::AppState;
pub use flotilla_billing::api::Payouts;

#[derive(Deserialize)]
struct PayoutQuery {
    period: Option<String>,
    provider: Option<String>,
}

/// The payout statements of a month (`period=YYYY-MM`): a provider key
/// sees its own provider's; operators see every provider's, or one with
/// `provider=`. Providers are paid on the list value of the usage their
/// GPUs carried (on-demand price, the spot price in force, the serverless
/// GPU-second price), less the operator's fee; tenant discounts and
/// credits are the operator's business and change nothing here.
#[utoipa::path(get, path = "/v1/payouts", tag = "billing",
    params(("period" = String, Query, description = "the month, YYYY-MM (UTC)"),
           ("provider" = Option<String>, Query, description = "operators only: one provider")),
    responses((status = 200, body = Payouts),
              (status = 400, body = flotilla_core::api::ErrorBody),
              (status = 403, body = flotilla_core::api::ErrorBody),
              (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn get_payouts(
    State(st): State<AppState>,
    caller: Caller,
    uri: axum::http::Uri,
) -> ApiResult<Json<Payouts>> {
    caller.require(&[Role::Provider], "read payouts")?;
    let q: PayoutQuery = serde_urlencoded_query(uri.query())?;
    let period = parse_month(q.period.as_deref())?;
    let providers: Vec<ProviderId> = if caller.is_operator() {
        let all: Vec<ProviderId> = st
            .store()
            .providers()
            .await?
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        match q.provider.as_deref() {
            None => all,
            Some(raw) => {
                let p = ProviderId::parse(raw, "provider")
                    .map_err(|e| ApiError::bad_request("provider", e.message))?;
                if !all.contains(&p) {
                    return Err(ApiError::not_found("provider"));
                }
                vec![p]
            }
        }
    } else {
        match st.store().provider_of_tenant(&caller.tenant_id).await? {
            // A provider that never registered a node has nothing yet.
            None => Vec::new(),
            Some(own) => {
                if q.provider.as_deref().is_some_and(|p| p != own.as_str()) {
                    return Err(ApiError::not_found("provider"));
                }
                vec![own]
            }
        }
    };
    let now = st.now();
    let book = price_book(st.store(), st.catalog(), now).await?;
    let spot = spot_series(st.store(), &book, period.end).await?;
    let owners = st.store().node_providers().await?;
    // Summed per node and interval at ingestion: a month of millions of
    // events reads a few rows per node.
    let events = st.store().usage_on_nodes(period).await?.events;
    let policy = PayoutPolicy {
        operator_fee_percent: st.config().operator_fee_percent,
    };
    let mut items = Vec::new();
    for p in &providers {
        items.push(
            payout_statement(p, period, &owners, &events, &book, &spot, &policy)
                .map_err(RatingError::from)?,
        );
    }
    Ok(Json(Payouts { items }))
}
