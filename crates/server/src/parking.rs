//! Parked replicas' host memory, metered from the time each was parked
//! to the time it ended, both on the agent's clock: the node's agent
//! reports every parked replica (its weights in host memory, its GPU
//! released) with when it parked, and every park that ended (a new
//! replica took it back onto a GPU, its time ran out, a newer park needed
//! the room, or its endpoint was deleted) with when it ended
//! ([`flotilla_core::api::SyncRequest::parks_ended`]). The endpoint's
//! tenant is billed `Meter::ParkedGbSeconds`: the weights' GB over the
//! parked time, priced per GB-hour in the price book. An agent that sends
//! no ends (an older one, or one restarted since) leaves the end to the
//! server: the sync whose report no longer holds the park, exact only to
//! a sync interval. One event per park, keyed by the replica and when it
//! parked, written before the report replaces the stored one, so a pass
//! cut between the two and replayed, or an agent resending an end it was
//! not sure arrived, bills the park once.
//!
//! A deleted endpoint never restores its replicas, so its tenant pays for
//! no park past the deletion: a park's bill ends at the endpoint's
//! deletion (one that began after it bills nothing), and each sync tells
//! the agent which replicas of deleted endpoints to release or not park
//! ([`flotilla_core::api::SyncResponse::unpark`]).

use chrono::{DateTime, Duration, SubsecRound, Utc};
use flotilla_billing::meter::{EventKey, Meter, Subject, SubjectKind, UsageEvent};
use flotilla_core::api::{EndedPark, NodeWeights, WeightTier};
use flotilla_core::id::{NodeId, TenantId};
use flotilla_core::instance::BillingClass;
use flotilla_store::StoreError;
use rust_decimal::Decimal;

use crate::state::AppState;

/// Event source of parked-memory usage.
pub const SOURCE: &str = "parked";

/// The usage of one park that ended at `end`, billed to `tenant`; `None`
/// for an entry that is not a park of an endpoint's replica.
pub fn park_usage(
    node: &NodeId,
    tenant: &TenantId,
    park: &NodeWeights,
    end: DateTime<Utc>,
) -> Option<UsageEvent> {
    if park.tier != WeightTier::Parked {
        return None;
    }
    let (replica, endpoint) = (park.replica.as_ref()?, park.endpoint_id.as_ref()?);
    // The ledger keeps whole milliseconds; a park is at least one (rate
    // events need a span).
    let start = park.since.trunc_subsecs(3);
    let end = end.trunc_subsecs(3).max(start + Duration::milliseconds(1));
    Some(UsageEvent {
        key: EventKey {
            tenant: tenant.clone(),
            source: SOURCE.into(),
            id: format!("{replica}/{}", start.timestamp_millis()),
        },
        subject: Subject {
            kind: SubjectKind::Endpoint,
            id: endpoint.to_string(),
        },
        meter: Meter::ParkedGbSeconds,
        billing_class: BillingClass::OnDemand,
        start,
        end,
        // GB = 10^9 bytes, as the price book's per-GB-hour price reads it.
        amount: Decimal::from(park.size_bytes) / Decimal::from(1_000_000_000u64),
        node: Some(node.clone()),
        corrects: None,
    })
}

/// When the bill of a park that began at `since` and ended at `ended`
/// stops: at `ended`, or at its endpoint's deletion (`deleted_at`) when
/// that came first; `None` for a park that began after the deletion
/// (nothing to bill: the endpoint could never restore it).
pub fn park_end(
    since: DateTime<Utc>,
    ended: DateTime<Utc>,
    deleted_at: Option<DateTime<Utc>>,
) -> Option<DateTime<Utc>> {
    match deleted_at {
        Some(d) if since.trunc_subsecs(3) >= d.trunc_subsecs(3) => None,
        Some(d) => Some(ended.min(d)),
        None => Some(ended),
    }
}

/// When a park ended, for its bill: the agent's `ended_at` when it sent
/// one, held within `[since, now]` (an agent's clock may run ahead of the
/// server's, or step back between the two readings; a park is never
/// billed past the sync that reports it, nor negative), else `now`, the
/// server's time of the sync that no longer lists it.
pub fn observed_end(
    since: DateTime<Utc>,
    ended_at: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
) -> DateTime<Utc> {
    match ended_at {
        Some(e) => e.min(now).max(since),
        None => now,
    }
}

/// The parks to bill in one sync, each with the end its agent observed
/// (`None`: it sent none): every park the agent says ended, and every park
/// the stored report held that `report` no longer does and the agent said
/// nothing of. A park matches its end by replica, key and `since` (to the
/// millisecond, as stored).
pub fn parks_to_bill(
    stored_ended: Vec<NodeWeights>,
    agent_ended: &[EndedPark],
) -> Vec<(NodeWeights, Option<DateTime<Utc>>)> {
    let same = |w: &NodeWeights, e: &EndedPark| {
        w.replica.as_ref() == Some(&e.replica)
            && w.key == e.key
            && w.since.trunc_subsecs(3) == e.since.trunc_subsecs(3)
    };
    let mut out: Vec<(NodeWeights, Option<DateTime<Utc>>)> = agent_ended
        .iter()
        .map(|e| (e.as_weights(), Some(e.ended_at)))
        .collect();
    out.extend(
        stored_ended
            .into_iter()
            .filter(|w| !agent_ended.iter().any(|e| same(w, e)))
            .map(|w| (w, None)),
    );
    out
}

/// Records a node's report of the weights it holds (`None`: the sync
/// carried none, the stored one stands) and of the parks that ended:
/// meters the parks that ended since the last report, then stores the
/// report.
pub async fn record_report(
    st: &AppState,
    node: &NodeId,
    report: Option<&[NodeWeights]>,
    ended: &[EndedPark],
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    // What the node held, read once: for the parks that ended and for
    // whether the report changed anything.
    let stored = match report {
        Some(_) => st.store().node_weights(node).await?,
        None => Vec::new(),
    };
    let stored_ended = match report {
        Some(r) => flotilla_store::weights::parks_ended_of(&stored, r),
        None => Vec::new(),
    };
    let mut events = Vec::new();
    for (park, ended_at) in parks_to_bill(stored_ended, ended) {
        let Some(ep) = &park.endpoint_id else {
            continue;
        };
        let tenant = match st.store().endpoint(ep).await {
            Ok(e) => e.tenant_id,
            Err(StoreError::NotFound(_)) => {
                tracing::warn!(endpoint = %ep, "parked replica of an unknown endpoint; not billed");
                continue;
            }
            Err(e) => return Err(e),
        };
        let deleted_at = st.store().endpoint_deleted_at(ep).await?;
        let end = observed_end(park.since, ended_at, now);
        let Some(end) = park_end(park.since, end, deleted_at) else {
            tracing::info!(endpoint = %ep, "parked after its endpoint's deletion; not billed");
            continue;
        };
        events.extend(park_usage(node, &tenant, &park, end));
    }
    if !events.is_empty() {
        let out = st
            .store()
            .append_usage(&events, crate::metering::grace(), now)
            .await?;
        for r in &out.rejected {
            tracing::warn!(key = %r.key, code = r.code, message = %r.message, "parked usage refused");
        }
    }
    if let Some(report) = report {
        st.store()
            .set_node_weights_over(node, &stored, report, now)
            .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;
    use flotilla_core::id::{EndpointId, InstanceId};

    use super::*;

    #[test]
    fn a_park_bills_its_gigabytes_over_its_time_to_its_endpoint() {
        let t0 = Utc.timestamp_opt(1_700_000_000, 0).single().unwrap();
        let node = NodeId::generate(1, 1);
        let tenant = TenantId::generate(1, 2);
        let ep = EndpointId::generate(1, 3);
        let replica = InstanceId::generate(1, 4);
        let park = NodeWeights {
            key: format!("{ep}-r1"),
            tier: WeightTier::Parked,
            size_bytes: 16_000_000_000,
            since: t0,
            replica: Some(replica.clone()),
            endpoint_id: Some(ep.clone()),
        };
        let e = park_usage(&node, &tenant, &park, t0 + Duration::seconds(90)).unwrap();
        assert_eq!(e.meter, Meter::ParkedGbSeconds);
        assert_eq!(e.amount, Decimal::from(16));
        assert_eq!((e.end - e.start).num_seconds(), 90);
        assert_eq!(e.subject.id, ep.to_string());
        assert_eq!(e.key.id, format!("{replica}/{}", t0.timestamp_millis()));
        e.validate().unwrap();
        // A disk-cache entry is not billed here.
        let cached = NodeWeights {
            tier: WeightTier::Cached,
            ..park
        };
        assert!(park_usage(&node, &tenant, &cached, t0).is_none());
    }

    #[test]
    fn a_deleted_endpoints_park_is_billed_up_to_the_deletion_only() {
        let t = |s: i64| Utc.timestamp_opt(1_700_000_000 + s, 0).single().unwrap();
        // Live endpoint: the park is billed until it ended.
        assert_eq!(park_end(t(0), t(90), None), Some(t(90)));
        // Deleted while parked: billed up to the deletion.
        assert_eq!(park_end(t(0), t(90), Some(t(30))), Some(t(30)));
        // Deleted after the park ended: the end stands.
        assert_eq!(park_end(t(0), t(90), Some(t(120))), Some(t(90)));
        // Parked at or after the deletion: nothing.
        assert_eq!(park_end(t(30), t(90), Some(t(30))), None);
        assert_eq!(park_end(t(40), t(90), Some(t(30))), None);
    }

    #[test]
    fn the_agents_end_is_billed_within_the_park_and_the_sync() {
        let t = |ms: i64| Utc.timestamp_millis_opt(1_700_000_000_000 + ms).unwrap();
        // The agent's end stands when it lies between the park and now.
        assert_eq!(observed_end(t(0), Some(t(12_345)), t(30_000)), t(12_345));
        // No end from the agent: the sync's time.
        assert_eq!(observed_end(t(0), None, t(30_000)), t(30_000));
        // An agent clock ahead of the server's: never past the sync.
        assert_eq!(observed_end(t(0), Some(t(31_000)), t(30_000)), t(30_000));
        // An end before the park (a clock stepped back): zero time.
        assert_eq!(observed_end(t(5_000), Some(t(4_000)), t(30_000)), t(5_000));
    }

    #[test]
    fn a_park_the_agent_ended_is_billed_to_its_end_and_others_to_the_sync() {
        let t0 = Utc.timestamp_opt(1_700_000_000, 0).single().unwrap();
        let ep = EndpointId::generate(1, 3);
        let park = |n: u128, since: DateTime<Utc>| NodeWeights {
            key: format!("{ep}-r1"),
            tier: WeightTier::Parked,
            size_bytes: 1_000,
            since,
            replica: Some(InstanceId::generate(1, n)),
            endpoint_id: Some(ep.clone()),
        };
        let (a, b) = (park(4, t0), park(5, t0 + Duration::seconds(1)));
        let ended = |w: &NodeWeights, at: DateTime<Utc>| EndedPark {
            replica: w.replica.clone().unwrap(),
            endpoint_id: ep.clone(),
            key: w.key.clone(),
            size_bytes: w.size_bytes,
            // The agent's time has sub-millisecond digits; the store's not.
            since: w.since + Duration::microseconds(300),
            ended_at: at,
        };
        // `a` ended on the agent at 7 s; `b` left the report with no end
        // sent (an older agent); `c` began and ended between two syncs
        // (never in a report).
        let c = park(6, t0 + Duration::seconds(2));
        let at = t0 + Duration::seconds(7);
        let got = parks_to_bill(vec![a.clone(), b.clone()], &[ended(&a, at), ended(&c, at)]);
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got[0].0.replica, a.replica);
        assert_eq!(got[0].1, Some(at));
        assert_eq!(got[1].0.replica, c.replica);
        assert_eq!(got[2], (b, None));
    }
}
