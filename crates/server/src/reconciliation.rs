//! Billing reconciliation: gathers, over a window, the time the ledger
//! bills each instance and the run its executor reported, and hands both
//! to `flotilla_billing::reconcile`, which compares them. The route
//! (`GET /v1/billing/reconcile`) answers with the report; the leader's
//! loop ([`run`]) checks a recent window every few minutes and exports the
//! count of differences as `flotilla_billing_reconcile_differences`.
//!
//! Reads only: a difference is reported, never corrected here (a
//! correction is a new ledger event, see docs/billing.md).

use std::time::Duration;

use chrono::{DateTime, Duration as ChronoDuration, Utc};
use flotilla_billing::api::ReconcileReport;
use flotilla_billing::reconcile::{ledger_spans, observed_run, reconcile};
use rust_decimal::Decimal;

use crate::pricing::RatingError;
use crate::state::AppState;

/// How far behind now a window ends by default: metering writes a running
/// instance's usage in complete one-minute slices, every few seconds, so
/// the ledger is complete up to two minutes ago.
pub const SETTLE: ChronoDuration = ChronoDuration::minutes(2);

/// How often the leader's loop checks.
pub const LOOP_EVERY: Duration = Duration::from_secs(300);

/// The window the leader's loop checks: the last hour (up to
/// [`SETTLE`] ago). Consecutive windows overlap, so a difference stays
/// counted for an hour after it happened.
pub const LOOP_WINDOW: ChronoDuration = ChronoDuration::hours(1);

/// Compares what the ledger bills with what the executors saw run over
/// `[since, until)`; differences up to `threshold_ms` per instance are not
/// reported. Gather (the store), compare (billing), report.
pub async fn reconcile_window(
    st: &AppState,
    since: DateTime<Utc>,
    until: DateTime<Utc>,
    threshold_ms: i64,
) -> Result<ReconcileReport, RatingError> {
    let events = st.store().time_usage_between(since, until).await?;
    let ledger = ledger_spans(&events)?;
    let observed: Vec<_> = st
        .store()
        .instances_ran_between(since, until)
        .await?
        .iter()
        .filter_map(observed_run)
        .collect();
    let r = reconcile(since, until, &ledger, &observed, threshold_ms);
    Ok(ReconcileReport {
        since,
        until,
        threshold_seconds: Decimal::new(threshold_ms, 3).normalize(),
        instances: r.instances,
        billed_seconds: r.billed_seconds,
        observed_seconds: r.observed_seconds,
        differences: r.differences,
    })
}

/// One check of the last [`LOOP_WINDOW`] at the default threshold; the
/// count of differences is exported.
pub async fn reconcile_pass(st: &AppState) -> Result<usize, RatingError> {
    let until = st.now() - SETTLE;
    let report = reconcile_window(
        st,
        until - LOOP_WINDOW,
        until,
        flotilla_billing::reconcile::DEFAULT_THRESHOLD_MS,
    )
    .await?;
    let n = report.differences.len();
    st.ops().billing_reconcile_differences.set(n as i64);
    if n > 0 {
        let mut causes: Vec<&str> = report
            .differences
            .iter()
            .map(|d| d.cause.as_str())
            .collect();
        causes.sort_unstable();
        causes.dedup();
        tracing::warn!(
            differences = n,
            causes = %causes.join(","),
            since = %report.since,
            until = %report.until,
            "the ledger and the executors disagree: see GET /v1/billing/reconcile"
        );
    }
    Ok(n)
}

/// The leader's loop: a check every [`LOOP_EVERY`] while this replica
/// leads, until shutdown.
pub async fn run(st: AppState) {
    let mut shutdown = st.shutdown_signal();
    loop {
        if *shutdown.borrow() {
            return;
        }
        if st.leads() {
            if let Err(e) = reconcile_pass(&st).await {
                tracing::warn!(error = %e, "billing reconciliation failed; retrying");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(LOOP_EVERY) => {}
            _ = shutdown.changed() => {}
        }
    }
}
