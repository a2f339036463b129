//! `GET /v1/billing/reconcile`: the ledger against the executors, per
//! instance, over a window (see [`crate::reconciliation`]). Operators
//! only: it reads every tenant's usage and work.

use axum::extract::State;
use axum::Json;
use chrono::Duration;
use flotilla_billing::api::ReconcileReport;
use flotilla_billing::reconcile::DEFAULT_THRESHOLD_MS;
use rust_decimal::prelude::ToPrimitive;
use rust_decimal::Decimal;
use serde::Deserialize;

use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::{instant, serde_urlencoded_query};
use crate::reconciliation::{reconcile_window, SETTLE};
use crate::state::AppState;

/// The longest window one call compares.
const MAX_WINDOW_DAYS: i64 = 31;

/// The largest threshold, seconds.
const MAX_THRESHOLD_S: i64 = 86_400;

#[derive(Debug, Deserialize)]
struct Query {
    since: Option<String>,
    until: Option<String>,
    threshold_s: Option<String>,
}

/// Threshold in milliseconds from `threshold_s` (decimal seconds).
fn threshold_ms(raw: Option<&str>) -> Result<i64, ApiError> {
    let Some(raw) = raw else {
        return Ok(DEFAULT_THRESHOLD_MS);
    };
    let bad = || {
        ApiError::bad_request(
            "threshold_s",
            format!("must be a number of seconds from 0 to {MAX_THRESHOLD_S}"),
        )
    };
    let s: Decimal = raw.trim().parse().map_err(|_| bad())?;
    if s.is_sign_negative() || s > Decimal::from(MAX_THRESHOLD_S) {
        return Err(bad());
    }
    (s * Decimal::from(1000)).trunc().to_i64().ok_or_else(bad)
}

/// Compares, per instance (endpoint replicas included), the time the
/// ledger bills (its instance-second events, else its GPU-second events'
/// wall time; corrections applied) with the time its executor reported it
/// running (its `running` and final events, from the agent or a Slurm or
/// Kubernetes bridge), over `[since, until)`, and lists every instance
/// whose two differ by more than the threshold, with the cause:
/// `billed_without_run`, `ran_without_bill`, `over_billed`,
/// `under_billed`. Default window: the hour before `until`; default
/// `until`: two minutes ago (metering writes one-minute slices); default
/// threshold: 1 s (usage is metered to the millisecond of the run's start
/// and stop; the second is room for clocks to disagree).
#[utoipa::path(get, path = "/v1/billing/reconcile", tag = "billing",
    params(("since" = Option<String>, Query, description = "RFC 3339 start, inclusive (default: an hour before until)"),
           ("until" = Option<String>, Query, description = "RFC 3339 end, exclusive (default: two minutes ago); at most 31 days after since"),
           ("threshold_s" = Option<String>, Query, description = "seconds per instance a difference may reach unreported (default 1)")),
    responses((status = 200, body = ReconcileReport),
              (status = 400, body = flotilla_core::api::ErrorBody),
              (status = 403, body = flotilla_core::api::ErrorBody)))]
pub async fn get_reconcile(
    State(st): State<AppState>,
    caller: Caller,
    uri: axum::http::Uri,
) -> ApiResult<Json<ReconcileReport>> {
    caller.require(&[], "reconcile the ledger")?;
    let q: Query = serde_urlencoded_query(uri.query())?;
    let until = match q.until.as_deref() {
        Some(raw) => instant(raw, "until")?,
        None => st.now() - SETTLE,
    };
    let since = match q.since.as_deref() {
        Some(raw) => instant(raw, "since")?,
        None => until - Duration::hours(1),
    };
    if since >= until {
        return Err(ApiError::bad_request(
            "since",
            format!("must be before until ({until})"),
        ));
    }
    if until - since > Duration::days(MAX_WINDOW_DAYS) {
        return Err(ApiError::bad_request(
            "since",
            format!("the window may be at most {MAX_WINDOW_DAYS} days"),
        ));
    }
    let threshold = threshold_ms(q.threshold_s.as_deref())?;
    Ok(Json(reconcile_window(&st, since, until, threshold).await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_is_decimal_seconds_within_bounds() {
        assert_eq!(threshold_ms(None).unwrap(), 1_000);
        assert_eq!(threshold_ms(Some("0")).unwrap(), 0);
        assert_eq!(threshold_ms(Some("1.5")).unwrap(), 1_500);
        for bad in ["-1", "x", "86401"] {
            assert!(threshold_ms(Some(bad)).is_err(), "{bad}");
        }
    }
}
