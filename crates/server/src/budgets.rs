//! Budgets in the server: each tenant's spend this month checked against
//! its budget (alerts at thresholds, recorded once and delivered as signed
//! webhooks with retries), and the hard cap that refuses new spot and
//! preemptible capacity once spend reaches the limit.
//!
//! The decisions are flotilla-billing's (`check_budget`, `admit`,
//! `sign_webhook`); this module reads spend from the ledger, keeps the
//! alert state in the store and talks HTTP.

use std::collections::{BTreeMap, BTreeSet};

use axum::http::StatusCode;
use chrono::{DateTime, Datelike, Duration, Utc};
use flotilla_billing::budget::{admit, check_budget, sign_webhook, BudgetState, CapacityKind};
use flotilla_billing::{BillingError, Period};
use flotilla_core::id::{InvoiceId, TenantId};
use flotilla_core::instance::{BillingClass, InstanceSpec};
use flotilla_store::budgets::StoredBudget;
use rust_decimal::Decimal;
use serde_json::json;

use crate::billing_step::Scope;
use crate::error::ApiError;
use crate::pricing::{draft_invoice, RatingError};
use crate::state::AppState;
use crate::webhook_target::{self, TargetError};

/// Attempts per webhook delivery before it is marked failed.
pub const MAX_ATTEMPTS: u32 = 8;

/// How long a receiver may take to answer.
const DELIVERY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The calendar month holding `now`: the budget period.
pub fn month_of(now: DateTime<Utc>) -> Result<Period, BillingError> {
    Period::month(now.year(), now.month())
}

/// When to try a delivery again after its `attempts`-th failed attempt:
/// 1 s, 2 s, 4 s, … doubling, at most an hour; `None` once `MAX_ATTEMPTS`
/// are spent. Exponential so that a receiver that is down for a while is
/// not hammered, capped so that one back within the hour is reached soon.
pub fn next_attempt(attempts: u32, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
    if attempts >= MAX_ATTEMPTS {
        return None;
    }
    let secs = 1i64 << attempts.saturating_sub(1).min(12);
    Some(now + Duration::seconds(secs.min(3600)))
}

/// What `tenant` owes for the month holding `now` so far: the draft
/// invoice's total (after discounts and credits).
pub async fn spend(st: &AppState, tenant: &TenantId) -> Result<Decimal, RatingError> {
    let now = st.now();
    let period = month_of(now)?;
    let (t, r) = st.ids();
    let draft = draft_invoice(
        st.store(),
        st.catalog(),
        tenant,
        period,
        &InvoiceId::generate(t, r),
        now,
    )
    .await?;
    Ok(draft.invoice.total())
}

/// How often every budget is rated even without a known change: the
/// safety net for what changes spend without new usage or a call to this
/// replica (a credit expiring, terms or budgets set through another
/// replica). An hour bounds how late such an alert can be.
pub const FULL_CHECK_EVERY: Duration = Duration::hours(1);

/// Checks budgets against this month's spend; each threshold newly
/// crossed is recorded once (the store's key) and, when the budget has a
/// webhook, queued for delivery in the same transaction. Only the budgets
/// of tenants whose spend may have changed are rated (`BudgetWatch`),
/// except on a full check.
pub async fn check_budgets(st: &AppState) -> Result<usize, RatingError> {
    let now = st.now();
    let period = month_of(now)?;
    let watch = &st.billing().budgets;
    let scope = watch.take(now, FULL_CHECK_EVERY, st.store().usage_marks().await?);
    if scope == Scope::Only(BTreeSet::new()) {
        return Ok(0);
    }
    let mut raised = 0;
    for b in st.store().budgets().await? {
        let tenant = b.budget.tenant.clone();
        if !scope.covers(&tenant) {
            continue;
        }
        let spend = match spend(st, &tenant).await {
            Ok(s) => s,
            Err(e) => {
                // Rated again next check.
                watch.touch([&tenant]);
                tracing::warn!(tenant = %tenant, error = %e, "cannot rate spend for the budget");
                continue;
            }
        };
        let mut state = BudgetState {
            period_start: Some(period.start),
            crossed: st
                .store()
                .budget_alerts(&tenant, period.start)
                .await?
                .into_iter()
                .map(|a| a.threshold_percent)
                .collect(),
        };
        for alert in check_budget(&b.budget, &mut state, period.start, spend, now)? {
            let (t, r) = st.ids();
            let delivery_id = format!("whd_{t:012x}{:020x}", r >> 48);
            if st
                .store()
                .record_budget_alert(&alert, b.webhook_url.as_deref(), &delivery_id, now)
                .await?
            {
                tracing::info!(tenant = %tenant, threshold = alert.threshold_percent, spend = %spend, "budget alert");
                raised += 1;
            }
        }
    }
    Ok(raised)
}

/// Delivers due webhooks: POSTs each alert with its `Flotilla-Signature`
/// (HMAC-SHA256 with the budget's secret), and records the attempt: a 2xx
/// answer delivers it, anything else is retried with backoff. A target
/// that resolves into the operator's network is never contacted and the
/// delivery is marked failed (unless the operator allows it,
/// [`crate::ServerConfig::webhook_egress`]). A receiver that cannot be
/// reached is recorded as `receiver unreachable`, whatever the cause.
pub async fn deliver_webhooks(st: &AppState) -> Result<usize, RatingError> {
    let due = st.store().due_deliveries(st.now(), 50).await?;
    if due.is_empty() {
        return Ok(0);
    }
    let policy = st.config().webhook_egress();
    let mut secrets: BTreeMap<TenantId, Option<String>> = BTreeMap::new();
    let mut delivered = 0;
    for d in due {
        if !secrets.contains_key(&d.tenant) {
            let s = st
                .store()
                .budget(&d.tenant)
                .await?
                .and_then(|b| b.webhook_secret);
            secrets.insert(d.tenant.clone(), s);
        }
        let now = st.now();
        let Some(secret) = secrets.get(&d.tenant).cloned().flatten() else {
            // The budget lost its webhook since the alert was queued: never
            // send an unsigned (or wrongly signed) delivery.
            st.store()
                .record_delivery_attempt(
                    &d.id,
                    false,
                    None,
                    Some("the budget no longer has a webhook secret"),
                    None,
                    now,
                )
                .await?;
            continue;
        };
        let http = match delivery_client(&d.url, &policy).await {
            Ok(c) => c,
            Err(e) => {
                // A target inside the operator's network is refused for
                // good; a name that does not resolve may later.
                let next = match e {
                    DeliveryTarget::Refused(_) => None,
                    DeliveryTarget::Unresolved(_) | DeliveryTarget::Client(_) => {
                        next_attempt(d.attempts + 1, now)
                    }
                };
                let error = e.to_string();
                tracing::warn!(delivery = %d.id, error = %error, "webhook target refused");
                st.store()
                    .record_delivery_attempt(&d.id, false, None, Some(&error), next, now)
                    .await?;
                continue;
            }
        };
        let signature = sign_webhook(secret.as_bytes(), now, d.body.as_bytes())?;
        let result = http
            .post(&d.url)
            .header("content-type", "application/json")
            .header(flotilla_billing::budget::SIGNATURE_HEADER, signature)
            .header("Flotilla-Delivery", &d.id)
            .body(d.body.clone())
            .send()
            .await;
        let (ok, status, error) = match result {
            Ok(resp) if resp.status().is_success() => (true, Some(resp.status().as_u16()), None),
            Ok(resp) => (
                false,
                Some(resp.status().as_u16()),
                Some(format!("receiver answered {}", resp.status())),
            ),
            Err(e) => {
                // The tenant sees one word for refused, reset and timed
                // out alike (a webhook must not probe ports); the cause
                // is for the operator.
                tracing::warn!(delivery = %d.id, error = %error_chain(&e), "webhook receiver unreachable");
                (false, None, Some("receiver unreachable".to_string()))
            }
        };
        let next = if ok {
            None
        } else {
            next_attempt(d.attempts + 1, now)
        };
        st.store()
            .record_delivery_attempt(&d.id, ok, status, error.as_deref(), next, st.now())
            .await?;
        if ok {
            delivered += 1;
        } else {
            tracing::warn!(delivery = %d.id, attempts = d.attempts + 1, error = error.as_deref().unwrap_or(""), "webhook not delivered");
        }
    }
    Ok(delivered)
}

/// Why a delivery was not attempted.
#[derive(Debug, thiserror::Error)]
enum DeliveryTarget {
    /// The URL is not http(s), or reaches the operator's network.
    #[error("{0}")]
    Refused(TargetError),
    /// The host does not resolve now.
    #[error("{0}")]
    Unresolved(TargetError),
    /// The HTTP client could not be built.
    #[error("webhook client: {0}")]
    Client(#[from] reqwest::Error),
}

/// An HTTP client for one delivery to `url`: its host is resolved and
/// every address checked (`webhook_target`) first, and the client connects
/// only to those addresses, so a second, different DNS answer (rebinding)
/// cannot redirect the POST inward. Redirects are not followed: a public
/// receiver answering 30x to an internal address would be the same hole.
/// No HTTP proxy is used (`HTTP_PROXY` and the like are ignored): a proxy
/// would resolve the name itself, after the check.
async fn delivery_client(
    url: &str,
    policy: &flotilla_egress::EgressPolicy,
) -> Result<reqwest::Client, DeliveryTarget> {
    let parsed =
        reqwest::Url::parse(url).map_err(|_| DeliveryTarget::Refused(TargetError::NotHttp))?;
    let (host, addrs) = webhook_target::resolve(&parsed, policy)
        .await
        .map_err(|e| match e {
            TargetError::Unresolved { .. } => DeliveryTarget::Unresolved(e),
            _ => DeliveryTarget::Refused(e),
        })?;
    let mut b = reqwest::Client::builder()
        .timeout(DELIVERY_TIMEOUT)
        .user_agent("flotilla-webhooks")
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy();
    if host.parse::<std::net::IpAddr>().is_err() {
        b = b.resolve_to_addrs(&host, &addrs);
    }
    Ok(b.build()?)
}

/// `e` and its causes, for the operator's log.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

/// The hard cap at instance creation: spot or preemptible work of tier 2
/// or 3 is refused (402, `budget_exceeded`) once the tenant's spend this
/// month reaches a hard-capped budget. Tier-1 and on-demand work is never
/// refused, and nothing running is stopped. Only spot and preemptible
/// requests of capped tenants pay for rating the month.
pub async fn admit_instance(
    st: &AppState,
    tenant: &TenantId,
    spec: &InstanceSpec,
) -> Result<(), ApiError> {
    let kind = if spec.billing_class == BillingClass::Spot || spec.preemptible {
        CapacityKind::Spot
    } else {
        return Ok(());
    };
    if spec.tier <= 1 {
        return Ok(());
    }
    let Some(StoredBudget { budget, .. }) = st.store().budget(tenant).await? else {
        return Ok(());
    };
    if !budget.hard_cap {
        return Ok(());
    }
    let spent = spend(st, tenant).await?;
    match admit(&budget, spent, kind, spec.tier) {
        Ok(()) => Ok(()),
        Err(BillingError::BudgetCapReached {
            spend,
            limit,
            currency,
            kind,
            ..
        }) => {
            // Name what made it spot-like: the class, or the preemptible flag.
            let field = if spec.billing_class == BillingClass::Spot {
                "billing_class"
            } else {
                "preemptible"
            };
            Err(budget_exceeded(spend, limit, &currency, kind, field))
        }
        Err(e) => Err(ApiError::internal(e)),
    }
}

/// 402 `budget_exceeded`: the answer of the hard cap.
pub fn budget_exceeded(
    spend: Decimal,
    limit: Decimal,
    currency: &str,
    kind: &str,
    field: &str,
) -> ApiError {
    ApiError {
        status: StatusCode::PAYMENT_REQUIRED,
        code: "budget_exceeded",
        message: format!(
            "the tenant's budget is hard-capped and this month's spend ({spend} {currency}) has \
             reached its limit ({limit} {currency}): new {kind} or preemptible capacity of tier 2 \
             or 3 is refused; tier-1 and on-demand work still start, and running work is not \
             stopped"
        ),
        details: json!({
            "field": field,
            "spend": spend.to_string(),
            "limit": limit.to_string(),
            "currency": currency,
            "kind": kind,
        }),
        retry_after: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::billing_step::BudgetWatch;
    use chrono::TimeZone;
    use std::collections::HashMap;

    #[test]
    fn budget_checks_rate_only_touched_tenants_between_full_checks() {
        let w = BudgetWatch::default();
        let t0 = Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0).unwrap();
        let hour = Duration::hours(1);
        let (a, b, c) = (
            TenantId::generate(1, 1),
            TenantId::generate(2, 2),
            TenantId::generate(3, 3),
        );
        let none = || Scope::Only(BTreeSet::new());
        let marks = |m: &[(&TenantId, i64)]| -> HashMap<TenantId, i64> {
            m.iter().map(|(t, n)| ((*t).clone(), *n)).collect()
        };
        let m1 = marks(&[(&c, 4)]);
        assert_eq!(
            w.take(t0, hour, m1.clone()),
            Scope::All,
            "the first check is full"
        );
        let s = |secs| t0 + Duration::seconds(secs);
        assert_eq!(w.take(s(30), hour, m1.clone()), none(), "nothing moved");
        w.touch([&a, &a]);
        assert_eq!(
            w.take(s(60), hour, m1.clone()),
            Scope::Only(BTreeSet::from([a.clone()]))
        );
        assert_eq!(w.take(s(90), hour, m1), none(), "forgotten once taken");
        // Usage recorded for c (its mark moved) and, for the first time, b.
        assert_eq!(
            w.take(s(100), hour, marks(&[(&c, 5), (&b, 1)])),
            Scope::Only(BTreeSet::from([b.clone(), c.clone()]))
        );
        assert_eq!(w.take(s(110), hour, marks(&[(&c, 5), (&b, 1)])), none());
        w.touch([&b]);
        w.touch_all();
        assert_eq!(
            w.take(s(120), hour, HashMap::new()),
            Scope::All,
            "prices changed"
        );
        assert_eq!(
            w.take(s(150), hour, HashMap::new()),
            none(),
            "b was covered"
        );
        assert_eq!(
            w.take(s(120 + 3600), hour, HashMap::new()),
            Scope::All,
            "an hour after the last full one"
        );
        // The month turns at midnight UTC: full, even within the hour.
        let w = BudgetWatch::default();
        let eve = Utc.with_ymd_and_hms(2026, 11, 30, 23, 59, 0).unwrap();
        assert_eq!(w.take(eve, hour, HashMap::new()), Scope::All);
        assert_eq!(
            w.take(eve + Duration::seconds(30), hour, HashMap::new()),
            none()
        );
        assert_eq!(
            w.take(eve + Duration::seconds(90), hour, HashMap::new()),
            Scope::All
        );
    }

    #[test]
    fn retries_back_off_doubling_then_give_up() {
        let t = DateTime::<Utc>::UNIX_EPOCH;
        let secs = |a| next_attempt(a, t).map(|n| (n - t).num_seconds());
        assert_eq!(secs(1), Some(1));
        assert_eq!(secs(2), Some(2));
        assert_eq!(secs(3), Some(4));
        assert_eq!(secs(7), Some(64));
        assert_eq!(secs(MAX_ATTEMPTS), None);
    }
}
