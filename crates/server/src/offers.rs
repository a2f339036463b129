//! Providers' offer windows in force. The scheduling pass sees a node
//! outside its windows as cordoned (`schedule::gather`); this pass stops
//! the work on a node whose window is about to close, with notice: a
//! [`NOTICE`] ahead of the close its instances are asked to stop (SIGTERM,
//! then the grace period) and their `state_reason` says why and when, so
//! the node is empty when its owner takes it back. The decisions are
//! `flotilla_core::offer`'s pure functions, asked with the pass's clock.

use flotilla_store::StoreError;

use crate::state::AppState;

pub use flotilla_core::offer::NOTICE;

/// Stops the work on nodes whose offer window closes within [`NOTICE`]
/// or has closed; the number of instances asked to stop.
pub async fn offers_pass(st: &AppState) -> Result<usize, StoreError> {
    let now = st.now();
    let mut stopped = 0;
    for (node, offer) in st.store().node_offers().await? {
        let reason = if !offer.offered_at(now) {
            format!("the offer window of node {node} closed: stopping")
        } else if let Some(at) = offer.closes_within(now, NOTICE) {
            format!(
                "the offer window of node {node} closes at {}: stopping before then",
                at.format("%Y-%m-%d %H:%M UTC")
            )
        } else {
            continue;
        };
        for id in st.store().instances_on(&node).await? {
            if st.store().stop_with_notice(&id, &reason, now).await? {
                tracing::info!(instance = %id, node = %node, "offer window closing: stop requested");
                stopped += 1;
            }
        }
    }
    if stopped > 0 {
        st.notify_change();
    }
    Ok(stopped)
}
