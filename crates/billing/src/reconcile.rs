//! Reconciliation: does the ledger bill, instance by instance, the time
//! the executors saw the work run?
//!
//! Two independent records of one fact are compared over a window: the
//! usage events the ledger holds for an instance (its `instance_seconds`,
//! or failing those its `gpu_seconds`) and the run its executor reported
//! (the instance's `running` and final events, as the agent, or the Slurm
//! or Kubernetes bridge, sent them). Every instance whose two numbers
//! differ by more than a threshold is a [`Difference`] with its [`Cause`].
//!
//! Pure: the caller reads the ledger and the instances (the store) and
//! the time; this module only compares. It never corrects anything: a
//! correction is a new event in the ledger, made by whoever knows the
//! right usage.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use flotilla_core::api::Instance;
use flotilla_core::id::TenantId;
use flotilla_core::instance::InstanceState;
use rust_decimal::prelude::ToPrimitive;
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

use crate::meter::{effective_events, Meter, SubjectKind, UsageEvent};
use crate::money::millis;
use crate::Result;

/// The default threshold, milliseconds per instance. Lifecycle metering
/// bills a run from its start to its stop to the millisecond, so a
/// correctly billed run differs from what its executor reported by under a
/// millisecond at each end; a second leaves room for the clocks of the
/// control plane and the executor to disagree a little, and is still well
/// under any real discrepancy (a missed or duplicated slice is a minute).
pub const DEFAULT_THRESHOLD_MS: i64 = 1_000;

/// Which meter a ledger span came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpanMeter {
    /// `instance_seconds`: `amount` instances held.
    Instance,
    /// `gpu_seconds`: `amount` GPUs (or shares) held; its wall time counts.
    Gpu,
}

/// Time one usage event bills to one instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerSpan {
    /// The tenant billed.
    pub tenant: TenantId,
    /// The instance (`inst_…`) the usage is of.
    pub instance: String,
    /// The meter it came from.
    pub meter: SpanMeter,
    /// Start of the usage.
    pub start: DateTime<Utc>,
    /// End of the usage.
    pub end: DateTime<Utc>,
    /// Instances (instance meter) held throughout; whole.
    pub amount: i64,
}

impl LedgerSpan {
    /// The span an event bills to an instance, if it bills one: a rate
    /// meter of time (GPU or instance) whose subject is an instance, or
    /// whose key names one (an endpoint's replica bills its endpoint, in
    /// events keyed `inst_…/gpu/…` by the instance that ran). Storage,
    /// parked memory, requests and tokens are not an instance's run time;
    /// neither is usage of a job or endpoint that names no instance.
    pub fn of(e: &UsageEvent) -> Option<Self> {
        let meter = match e.meter {
            Meter::InstanceSeconds => SpanMeter::Instance,
            Meter::GpuSeconds { .. } => SpanMeter::Gpu,
            _ => return None,
        };
        let instance = match e.subject.kind {
            SubjectKind::Instance => e.subject.id.clone(),
            SubjectKind::Endpoint | SubjectKind::Job => {
                let first = e.key.id.split('/').next().unwrap_or_default();
                if !first.starts_with("inst_") {
                    return None;
                }
                first.to_string()
            }
        };
        Some(Self {
            tenant: e.key.tenant.clone(),
            instance,
            meter,
            start: e.start,
            end: e.end,
            // Validated whole for both meters; a fraction bills as one.
            amount: e.amount.ceil().to_i64().unwrap_or(1).max(1),
        })
    }
}

/// The spans `events` bill to instances: duplicates collapsed and events
/// voided by a correction left out, as rating does.
pub fn ledger_spans<'a, I>(events: I) -> Result<Vec<LedgerSpan>>
where
    I: IntoIterator<Item = &'a UsageEvent>,
{
    Ok(effective_events(events)?
        .iter()
        .filter_map(LedgerSpan::of)
        .collect())
}

/// The run an executor reported for one instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObservedRun {
    /// The instance's tenant.
    pub tenant: TenantId,
    /// The instance.
    pub instance: String,
    /// When it was reported running.
    pub start: DateTime<Utc>,
    /// When it stopped running; `None` while it runs.
    pub end: Option<DateTime<Utc>>,
}

/// The run of `inst` as its executor reported it, from its events: from
/// the first `running` to the final state. A `lost` spell the instance
/// came back from counts as running (its agent returned with the work
/// still running); one that ended the instance ends the run at the exit
/// its agent reported when back (an exit code says it did, also one
/// reported after the server had ended it, which moves its finish back to
/// the exit), else when it was lost, as does a `lost` that still lasts.
/// The same rule as metering's. Without events (an instance
/// recorded before they were kept), its own started and finished times.
/// `None`: it never ran.
pub fn observed_run(inst: &Instance) -> Option<ObservedRun> {
    let mut start = None;
    let mut end = None;
    let mut lost_at = None;
    for e in &inst.events {
        match e.state {
            InstanceState::Running => {
                start = start.or(Some(e.at));
                lost_at = None;
            }
            InstanceState::Lost => lost_at = Some(e.at),
            s if s.is_terminal() => {
                end = Some(match (lost_at, inst.exit_code, inst.finished_at) {
                    (Some(_), Some(_), Some(exit)) => exit,
                    (Some(lost), _, _) => lost,
                    _ => e.at,
                });
                break;
            }
            _ => {}
        }
    }
    let (start, end) = match start {
        Some(s) => (s, end.or(lost_at)),
        None if inst.events.is_empty() => (inst.started_at?, inst.finished_at),
        None => return None,
    };
    Some(ObservedRun {
        tenant: inst.tenant_id.clone(),
        instance: inst.id.to_string(),
        start,
        end: end.map(|e| e.max(start)),
    })
}

/// Why an instance's bill and its run differ.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// Usage with no run behind it: an instance that did not run in the
    /// window (or does not exist) is billed.
    BilledWithoutRun,
    /// A run with no usage: the instance ran and nothing bills it.
    RanWithoutBill,
    /// Billed more than it ran, beyond the threshold.
    OverBilled,
    /// Billed less than it ran, beyond the threshold.
    UnderBilled,
}

impl Cause {
    /// The wire name (`billed_without_run`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BilledWithoutRun => "billed_without_run",
            Self::RanWithoutBill => "ran_without_bill",
            Self::OverBilled => "over_billed",
            Self::UnderBilled => "under_billed",
        }
    }
}

/// One instance whose bill and run differ beyond the threshold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Difference {
    /// The instance (as the ledger or the store names it).
    pub instance: String,
    /// Its tenant (the ledger's, when no instance ran).
    #[schema(value_type = String)]
    pub tenant: TenantId,
    /// Why they differ.
    pub cause: Cause,
    /// Instance-seconds the ledger bills inside the window.
    #[schema(value_type = String)]
    pub billed_seconds: Decimal,
    /// Seconds the executor saw it run inside the window.
    #[schema(value_type = String)]
    pub observed_seconds: Decimal,
    /// `billed_seconds - observed_seconds`.
    #[schema(value_type = String)]
    pub difference_seconds: Decimal,
}

/// What a comparison found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Reconciliation {
    /// Instances that were billed or ran in the window.
    pub instances: u64,
    /// Instance-seconds billed in the window, over all of them.
    pub billed_seconds: Decimal,
    /// Seconds observed running in the window, over all of them.
    pub observed_seconds: Decimal,
    /// Differences beyond the threshold, by instance id.
    pub differences: Vec<Difference>,
}

/// Milliseconds of `[start, end)` inside `[from, to)`.
fn overlap_ms(
    start: DateTime<Utc>,
    end: DateTime<Utc>,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> i64 {
    millis(start.max(from), end.min(to)).max(0)
}

/// What each instance is billed and ran, in milliseconds inside the window.
#[derive(Debug, Default)]
struct Tally {
    tenant: Option<TenantId>,
    instance_ms: i128,
    gpu_wall_ms: i128,
    has_instance_meter: bool,
    observed_ms: i128,
}

impl Tally {
    /// Billed instance-milliseconds: the instance meter's; an instance
    /// billed only GPU time is billed its wall time.
    fn billed_ms(&self) -> i128 {
        if self.has_instance_meter {
            self.instance_ms
        } else {
            self.gpu_wall_ms
        }
    }
}

fn seconds(ms: i128) -> Decimal {
    Decimal::from_i128_with_scale(ms, 3).normalize()
}

/// Compares, per instance, what `ledger` bills inside `[from, to)` with
/// what `observed` ran inside it (a run still going counts up to `to`),
/// and reports every instance whose two differ by more than
/// `threshold_ms`: billed but never running (`billed_without_run`),
/// running but never billed (`ran_without_bill`), or both with the
/// numbers apart (`over_billed`, `under_billed`). Sorted by instance.
pub fn reconcile(
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    ledger: &[LedgerSpan],
    observed: &[ObservedRun],
    threshold_ms: i64,
) -> Reconciliation {
    let mut by: BTreeMap<&str, Tally> = BTreeMap::new();
    for s in ledger {
        let ms = i128::from(overlap_ms(s.start, s.end, from, to));
        if ms == 0 {
            continue;
        }
        let t = by.entry(s.instance.as_str()).or_default();
        t.tenant.get_or_insert_with(|| s.tenant.clone());
        match s.meter {
            SpanMeter::Instance => {
                t.has_instance_meter = true;
                t.instance_ms += ms * i128::from(s.amount);
            }
            SpanMeter::Gpu => t.gpu_wall_ms += ms,
        }
    }
    for r in observed {
        let ms = i128::from(overlap_ms(r.start, r.end.unwrap_or(to), from, to));
        if ms == 0 {
            continue;
        }
        let t = by.entry(r.instance.as_str()).or_default();
        // The instance's own tenant wins over whatever the ledger says.
        t.tenant = Some(r.tenant.clone());
        t.observed_ms += ms;
    }
    let threshold = i128::from(threshold_ms.max(0));
    let mut out = Reconciliation {
        instances: by.len() as u64,
        ..Reconciliation::default()
    };
    let (mut billed_total, mut observed_total) = (0i128, 0i128);
    for (instance, t) in by {
        let billed = t.billed_ms();
        billed_total += billed;
        observed_total += t.observed_ms;
        let diff = billed - t.observed_ms;
        if diff.abs() <= threshold {
            continue;
        }
        let cause = if t.observed_ms == 0 {
            Cause::BilledWithoutRun
        } else if billed == 0 {
            Cause::RanWithoutBill
        } else if diff > 0 {
            Cause::OverBilled
        } else {
            Cause::UnderBilled
        };
        let Some(tenant) = t.tenant else { continue };
        out.differences.push(Difference {
            instance: instance.to_string(),
            tenant,
            cause,
            billed_seconds: seconds(billed),
            observed_seconds: seconds(t.observed_ms),
            difference_seconds: seconds(diff),
        });
    }
    out.billed_seconds = seconds(billed_total);
    out.observed_seconds = seconds(observed_total);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meter::{lifecycle_usage, EventKey, GpuShare, Lifecycle, Subject};
    use flotilla_core::api::InstanceEvent;
    use flotilla_core::id::InstanceId;
    use flotilla_core::instance::BillingClass;

    fn t(ms: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_800_000_000_000 + ms).unwrap()
    }

    fn tenant() -> TenantId {
        TenantId::generate(1, 2)
    }

    /// What the server's metering writes for a run of `[start, end)`.
    fn metered(ten: &TenantId, inst: &str, start: i64, end: i64) -> Vec<UsageEvent> {
        let l = Lifecycle {
            tenant: ten.clone(),
            source: "lifecycle".into(),
            subject: Subject {
                kind: SubjectKind::Instance,
                id: inst.into(),
            },
            model: "H100".into(),
            share: GpuShare::Whole,
            gpus: 2,
            billing_class: BillingClass::OnDemand,
            start: t(start),
            end: Some(t(end)),
            preempted_at: None,
            node: None,
        };
        lifecycle_usage(&l, t(end), 60).unwrap()
    }

    fn run(ten: &TenantId, inst: &str, start: i64, end: Option<i64>) -> ObservedRun {
        ObservedRun {
            tenant: ten.clone(),
            instance: inst.into(),
            start: t(start),
            end: end.map(t),
        }
    }

    fn spans(events: &[UsageEvent]) -> Vec<LedgerSpan> {
        ledger_spans(events).unwrap()
    }

    #[test]
    fn metered_runs_reconcile_whatever_their_sub_second_edges() {
        let ten = tenant();
        let mut events = Vec::new();
        let mut runs = Vec::new();
        // Edges on and off whole seconds, across slice boundaries.
        for (i, (a, b)) in [
            (0, 60_000),
            (1, 119_001),
            (999, 500_001),
            (30_500, 30_600),
            (10_000, 3_600_000),
        ]
        .into_iter()
        .enumerate()
        {
            let id = format!("inst_{i}");
            events.extend(metered(&ten, &id, a, b));
            runs.push(run(&ten, &id, a, Some(b)));
        }
        let r = reconcile(
            t(-60_000),
            t(4_000_000),
            &spans(&events),
            &runs,
            DEFAULT_THRESHOLD_MS,
        );
        assert_eq!(r.differences, vec![], "{r:?}");
        assert_eq!(r.instances, 5);
        // Metered to the millisecond: billed exactly what ran.
        assert_eq!(r.billed_seconds, r.observed_seconds, "{r:?}");
    }

    #[test]
    fn each_cause_is_named_with_both_numbers() {
        let ten = tenant();
        let mut events = metered(&ten, "inst_over", 0, 60_000);
        // Billed twice over its first minute under another source.
        events.extend(
            metered(&ten, "inst_over", 0, 60_000)
                .into_iter()
                .map(|mut e| {
                    e.key.source = "agent:n1".into();
                    e
                }),
        );
        events.extend(metered(&ten, "inst_under", 0, 60_000));
        events.extend(metered(&ten, "inst_ghost", 0, 30_000));
        let runs = [
            run(&ten, "inst_over", 0, Some(60_000)),
            run(&ten, "inst_under", 0, Some(120_000)),
            run(&ten, "inst_unbilled", 5_000, Some(65_000)),
        ];
        let r = reconcile(t(0), t(200_000), &spans(&events), &runs, 2_000);
        let found: Vec<(&str, Cause, Decimal, Decimal)> = r
            .differences
            .iter()
            .map(|d| {
                (
                    d.instance.as_str(),
                    d.cause,
                    d.billed_seconds,
                    d.observed_seconds,
                )
            })
            .collect();
        assert_eq!(
            found,
            vec![
                ("inst_ghost", Cause::BilledWithoutRun, 30.into(), 0.into()),
                ("inst_over", Cause::OverBilled, 120.into(), 60.into()),
                ("inst_unbilled", Cause::RanWithoutBill, 0.into(), 60.into()),
                ("inst_under", Cause::UnderBilled, 60.into(), 120.into()),
            ]
        );
        assert_eq!(r.differences[3].difference_seconds, Decimal::from(-60));
        assert!(r.differences.iter().all(|d| d.tenant == ten));
    }

    #[test]
    fn the_threshold_and_the_window_bound_what_counts() {
        let ten = tenant();
        // Billed 5 s short.
        let events = metered(&ten, "inst_a", 0, 55_000);
        let runs = [run(&ten, "inst_a", 0, Some(60_000))];
        let s = spans(&events);
        assert_eq!(
            reconcile(t(0), t(60_000), &s, &runs, 2_000)
                .differences
                .len(),
            1
        );
        assert!(reconcile(t(0), t(60_000), &s, &runs, 5_000)
            .differences
            .is_empty());
        // The window ends before the gap: nothing to see.
        assert!(reconcile(t(0), t(50_000), &s, &runs, 2_000)
            .differences
            .is_empty());
        // A run still going counts up to the window's end.
        let open = [run(&ten, "inst_a", 0, None)];
        assert!(reconcile(t(0), t(55_000), &s, &open, 0)
            .differences
            .is_empty());
        let r = reconcile(t(0), t(70_000), &s, &open, 2_000);
        assert_eq!(r.differences[0].cause, Cause::UnderBilled);
        assert_eq!(r.differences[0].observed_seconds, Decimal::from(70));
    }

    #[test]
    fn a_correction_voids_what_it_corrects_and_replicas_bill_their_instance() {
        let ten = tenant();
        let mut events = metered(&ten, "inst_r", 0, 60_000);
        // A replica's events bill the endpoint, keyed by the instance.
        for e in &mut events {
            e.subject = Subject {
                kind: SubjectKind::Endpoint,
                id: "ep_1".into(),
            };
        }
        // An over-long event, then its correction restating 60 s.
        let wrong = UsageEvent {
            key: EventKey {
                tenant: ten.clone(),
                source: "agent:n1".into(),
                id: "x".into(),
            },
            subject: Subject {
                kind: SubjectKind::Instance,
                id: "inst_c".into(),
            },
            meter: Meter::InstanceSeconds,
            billing_class: BillingClass::OnDemand,
            start: t(0),
            end: t(90_000),
            amount: Decimal::ONE,
            node: None,
            corrects: None,
        };
        let right = UsageEvent {
            key: EventKey {
                id: "x-fix".into(),
                ..wrong.key.clone()
            },
            end: t(60_000),
            corrects: Some(wrong.key.clone()),
            ..wrong.clone()
        };
        events.extend([wrong.clone(), right]);
        let runs = [
            run(&ten, "inst_r", 0, Some(60_000)),
            run(&ten, "inst_c", 0, Some(60_000)),
        ];
        let r = reconcile(t(0), t(100_000), &spans(&events), &runs, 2_000);
        assert_eq!(r.differences, vec![], "{r:?}");
        // Without the correction the wrong one is over-billed.
        let r = reconcile(t(0), t(100_000), &spans(&[wrong]), &runs[1..], 2_000);
        assert_eq!(r.differences[0].cause, Cause::OverBilled);
        // Requests and tokens are no instance's run time.
        let req = UsageEvent {
            meter: Meter::Requests,
            ..metered(&ten, "inst_q", 0, 60_000)[0].clone()
        };
        assert_eq!(LedgerSpan::of(&req), None);
    }

    fn instance(events: &[(InstanceState, i64)]) -> Instance {
        Instance {
            id: InstanceId::generate(1, 1),
            tenant_id: tenant(),
            name: None,
            state: InstanceState::Running,
            state_reason: String::new(),
            gpus: 1,
            gpu_types: vec![],
            cpu_milli: 1000,
            memory_mb: 1024,
            command: vec!["x".into()],
            env: Default::default(),
            workdir: None,
            billing_class: BillingClass::OnDemand,
            node_id: None,
            gpu_model: Some("H100".into()),
            gpu_ids: vec![],
            gpu_fraction: None,
            mig_profile: None,
            gpu_slices: vec![],
            exit_code: None,
            stop_requested: false,
            priority: 0,
            tier: 1,
            preemptible: false,
            preempted_by: None,
            requeued_from: None,
            job: None,
            created_at: t(0),
            started_at: None,
            finished_at: None,
            events: events
                .iter()
                .map(|(s, at)| InstanceEvent {
                    state: *s,
                    reason: String::new(),
                    at: t(*at),
                })
                .collect(),
            image: None,
            published_ports: Vec::new(),
            cold_start: None,
            disk_mb: None,
        }
    }

    #[test]
    fn an_observed_run_follows_the_reported_states() {
        use InstanceState::*;
        let span =
            |ev: &[(InstanceState, i64)]| observed_run(&instance(ev)).map(|r| (r.start, r.end));
        assert_eq!(
            span(&[
                (Pending, 0),
                (Scheduled, 1),
                (Starting, 2),
                (Running, 5),
                (Succeeded, 90)
            ]),
            Some((t(5), Some(t(90))))
        );
        // Lost and back: the spell counts; lost for good: it ends there.
        assert_eq!(
            span(&[(Running, 5), (Lost, 20), (Running, 40), (Stopped, 90)]),
            Some((t(5), Some(t(90))))
        );
        assert_eq!(
            span(&[(Running, 5), (Lost, 20), (Failed, 500)]),
            Some((t(5), Some(t(20))))
        );
        assert_eq!(span(&[(Running, 5), (Lost, 20)]), Some((t(5), Some(t(20)))));
        // Lost, then its agent reported the exit (killed by its fence at
        // t(17)): when back, or after the server ended it at t(500).
        for ended in [17, 500] {
            let mut fenced = instance(&[(Running, 5), (Lost, 20), (Failed, ended)]);
            fenced.exit_code = Some(143);
            fenced.finished_at = Some(t(17));
            assert_eq!(
                observed_run(&fenced).map(|r| (r.start, r.end)),
                Some((t(5), Some(t(17))))
            );
        }
        assert_eq!(span(&[(Running, 5)]), Some((t(5), None)));
        // Never ran.
        assert_eq!(span(&[(Pending, 0), (Stopped, 3)]), None);
        let mut bare = instance(&[]);
        bare.started_at = Some(t(7));
        bare.finished_at = Some(t(9));
        assert_eq!(
            observed_run(&bare).map(|r| (r.start, r.end)),
            Some((t(7), Some(t(9))))
        );
    }
}
