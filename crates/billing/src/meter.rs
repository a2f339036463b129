//! Metering: usage events, their idempotency keys, the append-only ledger
//! and the conversion of an instance's lifecycle into per-second usage.
//!
//! The ledger never edits or deletes. A key seen twice with the same payload
//! is a harmless duplicate (that is how a crashed sender re-sends safely); a
//! key reused with another payload is refused; a correction is a new event
//! that names the event it voids (`corrects`) and restates the right usage.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Duration, SubsecRound, Utc};
use flotilla_core::id::{NodeId, TenantId};
use flotilla_core::instance::BillingClass;
use rust_decimal::prelude::ToPrimitive;
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

use crate::error::BillingError;
use crate::money::{self, millis};
use crate::Result;

/// A whole GPU is 7000 share units: the least common multiple of a milli
/// share (1/1000) and a MIG slice (1/7 of every NVIDIA MIG-capable GPU), so
/// every share is an integer number of units and GPU-time sums are exact
/// integers (unit-milliseconds) until a line turns them into GPU-seconds.
pub const SHARE_UNITS_PER_GPU: i128 = 7000;

/// Unit-milliseconds in one whole-GPU-second.
pub const UNIT_MS_PER_GPU_SECOND: i128 = SHARE_UNITS_PER_GPU * 1000;

/// Longest interval one event may cover; bounds every product below.
pub const MAX_EVENT_DAYS: i64 = 366;

/// Largest count of GPUs, shares or instances in one event.
pub const MAX_UNITS: u32 = 1_000_000;

/// Largest count (requests, tokens) or GB in one event.
pub const MAX_COUNT: i64 = 1_000_000_000_000_000;

/// The idempotency key of an event: unique per tenant and source (an
/// agent, the gateway, the lifecycle meter). Sorting by it is what makes
/// rating independent of arrival order.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EventKey {
    /// The tenant billed.
    pub tenant: TenantId,
    /// Who emitted the event, e.g. `agent:node_…` or `gateway`.
    pub source: String,
    /// The emitter's id for it, unique within the source.
    pub id: String,
}

impl std::fmt::Display for EventKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.tenant, self.source, self.id)
    }
}

/// How much of a GPU one unit of a GPU meter is: the platform's one share
/// type, serialised in the ledger's own form (see its documentation).
pub use flotilla_core::placement::GpuShare;

/// What a GPU meter's share is worth in exact units (see
/// [`SHARE_UNITS_PER_GPU`]): a whole GPU 7,000, a fraction 7 per milli, a
/// MIG instance 1,000 per compute slice of the GPU's 7. Sevenths and
/// thousandths both count exactly, so no share rounds.
pub trait ShareUnits {
    /// Share units of one unit of this share.
    fn units(&self) -> i128;
    /// The share as a fraction of a whole GPU (MIG: slices / 7).
    fn fraction(&self) -> Result<Decimal>;
}

impl ShareUnits for GpuShare {
    fn units(&self) -> i128 {
        match self {
            GpuShare::Whole => SHARE_UNITS_PER_GPU,
            GpuShare::Fraction { milli } => i128::from(*milli) * 7,
            GpuShare::Mig(p) => i128::from(p.compute_slices) * 1000,
        }
    }

    fn fraction(&self) -> Result<Decimal> {
        money::div(
            money::dec_i128(self.units(), "share")?,
            Decimal::from(7000),
            "share",
        )
    }
}

/// What an event measures.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "meter", rename_all = "snake_case")]
pub enum Meter {
    /// GPU time: `amount` GPUs (or shares) of `model` held over the interval.
    GpuSeconds {
        /// Canonical catalog model name.
        model: String,
        /// Whole, milli share or MIG profile.
        share: GpuShare,
    },
    /// Instance time: `amount` instances held over the interval.
    InstanceSeconds,
    /// Storage: `amount` GB held over the interval.
    StorageGbSeconds,
    /// Host memory held by a parked endpoint replica (weights in host
    /// memory, GPU released): `amount` GB over the interval.
    ParkedGbSeconds,
    /// `amount` served requests, counted at the event's end.
    Requests,
    /// `amount` input (prompt) tokens.
    InputTokens,
    /// `amount` output (generated) tokens.
    OutputTokens,
}

impl Meter {
    /// Rate meters accrue over time; the others count things.
    pub fn is_rate(&self) -> bool {
        matches!(
            self,
            Self::GpuSeconds { .. }
                | Self::InstanceSeconds
                | Self::StorageGbSeconds
                | Self::ParkedGbSeconds
        )
    }
}

/// What kind of thing used the resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SubjectKind {
    /// A rented instance.
    Instance,
    /// A batch or training job.
    Job,
    /// A serverless endpoint; its GPU time is priced as serverless.
    Endpoint,
}

/// The instance, job or endpoint that used the resources.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Subject {
    /// Instance, job or endpoint.
    pub kind: SubjectKind,
    /// Its id (`inst_…`, `job_…`, `ep_…`).
    pub id: String,
}

/// One metered usage record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageEvent {
    /// Idempotency key; the tenant billed is `key.tenant`.
    pub key: EventKey,
    /// Who used it.
    pub subject: Subject,
    /// What was measured.
    pub meter: Meter,
    /// On-demand, spot or reserved (GPU meters of instances and jobs).
    pub billing_class: BillingClass,
    /// Start of the usage.
    pub start: DateTime<Utc>,
    /// End of the usage; count meters are billed in the period holding it.
    pub end: DateTime<Utc>,
    /// Rate meters: GPUs/shares, instances or GB held throughout
    /// `[start, end)`. Count meters: the count.
    pub amount: Decimal,
    /// The node that served it; payouts follow it to the node's provider.
    #[serde(default)]
    pub node: Option<NodeId>,
    /// The event this one voids and restates, if it is a correction. A
    /// correction of a rate meter may restate nothing (`start == end`).
    #[serde(default)]
    pub corrects: Option<EventKey>,
}

impl UsageEvent {
    /// Checks every field; the error names the first one at fault.
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [("key.source", &self.key.source), ("key.id", &self.key.id)] {
            if v.is_empty() || v.len() > 256 {
                return Err(BillingError::invalid(field, "must be 1 to 256 characters"));
            }
        }
        if self.subject.id.is_empty() || self.subject.id.len() > 256 {
            return Err(BillingError::invalid(
                "subject.id",
                "must be 1 to 256 characters",
            ));
        }
        let span = millis(self.start, self.end);
        // A correction may restate nothing (an empty interval): it voids
        // the event it names, e.g. a slice metered wholly after the
        // work's exit, which only became known later.
        if span < 0 || (self.meter.is_rate() && span == 0 && self.corrects.is_none()) {
            return Err(BillingError::invalid(
                "end",
                format!("must be after start {}, got {}", self.start, self.end),
            ));
        }
        if span > MAX_EVENT_DAYS * 86_400_000 {
            return Err(BillingError::invalid(
                "end",
                format!("an event covers at most {MAX_EVENT_DAYS} days"),
            ));
        }
        if self.amount.is_sign_negative() || self.amount.is_zero() {
            return Err(BillingError::invalid("amount", "must be positive"));
        }
        match &self.meter {
            Meter::GpuSeconds { model, .. } => {
                if model.is_empty() {
                    return Err(BillingError::invalid(
                        "meter.model",
                        "must name a GPU model",
                    ));
                }
                self.whole_units()?;
            }
            Meter::InstanceSeconds => {
                self.whole_units()?;
            }
            _ => {
                if self.amount > Decimal::from(MAX_COUNT) {
                    return Err(BillingError::invalid(
                        "amount",
                        format!("must be at most {MAX_COUNT}"),
                    ));
                }
            }
        }
        if let Some(c) = &self.corrects {
            if c.tenant != self.key.tenant {
                return Err(BillingError::invalid(
                    "corrects.tenant",
                    "must be the event's own tenant",
                ));
            }
            if c == &self.key {
                return Err(BillingError::invalid(
                    "corrects",
                    "an event cannot correct itself",
                ));
            }
        }
        Ok(())
    }

    /// `amount` as a whole count of GPUs/shares/instances.
    fn whole_units(&self) -> Result<i128> {
        if self.amount.fract() != Decimal::ZERO
            || self.amount < Decimal::ONE
            || self.amount > Decimal::from(MAX_UNITS)
        {
            return Err(BillingError::invalid(
                "amount",
                format!("must be a whole number from 1 to {MAX_UNITS} for this meter"),
            ));
        }
        self.amount
            .to_i128()
            .ok_or_else(|| BillingError::invalid("amount", "must be a whole number"))
    }

    /// Share units held throughout the interval, for GPU meters.
    pub fn gpu_units(&self) -> Result<Option<i128>> {
        match &self.meter {
            Meter::GpuSeconds { share, .. } => Ok(Some(self.whole_units()? * share.units())),
            _ => Ok(None),
        }
    }

    /// GPU time inside `[from, to)` in unit-milliseconds (0 outside).
    pub fn gpu_unit_ms_within(&self, from: DateTime<Utc>, to: DateTime<Utc>) -> Result<i128> {
        let Some(units) = self.gpu_units()? else {
            return Ok(0);
        };
        let a = self.start.max(from);
        let b = self.end.min(to);
        Ok(if a < b {
            units * i128::from(millis(a, b))
        } else {
            0
        })
    }

    /// The metered quantity inside `[from, to)`: rate meters pro rata to the
    /// overlap (GPU: whole-GPU-seconds; instance: instance-seconds; storage:
    /// GB-seconds), count meters in full when `end` lies inside.
    pub fn quantity_within(&self, from: DateTime<Utc>, to: DateTime<Utc>) -> Result<Decimal> {
        if let Some(unit_ms) = self.gpu_units()?.map(|_| self.gpu_unit_ms_within(from, to)) {
            return gpu_seconds(unit_ms?);
        }
        if self.meter.is_rate() {
            let a = self.start.max(from);
            let b = self.end.min(to);
            if a >= b {
                return Ok(Decimal::ZERO);
            }
            let secs = Decimal::new(millis(a, b), 3);
            return money::mul(self.amount, secs, "quantity");
        }
        Ok(if from <= self.end && self.end < to {
            self.amount
        } else {
            Decimal::ZERO
        })
    }
}

/// Whole-GPU-seconds from unit-milliseconds.
pub fn gpu_seconds(unit_ms: i128) -> Result<Decimal> {
    money::div(
        money::dec_i128(unit_ms, "gpu seconds")?,
        money::dec_i128(UNIT_MS_PER_GPU_SECOND, "gpu seconds")?,
        "gpu seconds",
    )
}

/// What an append did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Appended {
    /// The event is new and was recorded.
    New,
    /// The same event was already recorded; nothing changed.
    Duplicate,
}

/// The append-only usage ledger. `flotilla-store` implements it over SQL;
/// [`MemoryLedger`] is the reference used by tests and the simulator. Both
/// must decide appends with [`check_append`] so their rules cannot drift.
pub trait Ledger {
    /// How long after an event's end it is still accepted.
    fn grace(&self) -> Duration;
    /// Records `event` unless its key is already there.
    fn append(&mut self, event: UsageEvent, now: DateTime<Utc>) -> Result<Appended>;
    /// Every recorded event of `tenant` whose usage touches `[from, to)`,
    /// sorted by key.
    fn events(&self, tenant: &TenantId, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<UsageEvent>;
    /// Every tenant with at least one event, sorted.
    fn tenants(&self) -> Vec<TenantId>;
}

/// The append rule shared by every ledger: validate, then a key already
/// present is a duplicate if the payload is identical (checked before the
/// grace window, so re-sending after a crash is always safe) or a conflict
/// if not; a new event must end no more than `grace` before `now`.
pub fn check_append(
    event: &UsageEvent,
    existing: Option<&UsageEvent>,
    grace: Duration,
    now: DateTime<Utc>,
) -> Result<Appended> {
    event.validate()?;
    if let Some(old) = existing {
        return if old == event {
            Ok(Appended::Duplicate)
        } else {
            Err(BillingError::KeyConflict {
                key: event.key.to_string(),
            })
        };
    }
    if event.end + grace < now {
        return Err(BillingError::LateEvent {
            key: event.key.to_string(),
            end: event.end,
            grace_secs: grace.num_seconds(),
            now,
        });
    }
    Ok(Appended::New)
}

/// A ledger in memory, ordered by key.
#[derive(Debug, Clone)]
pub struct MemoryLedger {
    grace: Duration,
    events: BTreeMap<EventKey, UsageEvent>,
}

impl MemoryLedger {
    /// An empty ledger accepting events up to `grace` after their end.
    pub fn new(grace: Duration) -> Self {
        Self {
            grace,
            events: BTreeMap::new(),
        }
    }

    /// Number of recorded events.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}

impl Ledger for MemoryLedger {
    fn grace(&self) -> Duration {
        self.grace
    }

    fn append(&mut self, event: UsageEvent, now: DateTime<Utc>) -> Result<Appended> {
        let r = check_append(&event, self.events.get(&event.key), self.grace, now)?;
        if r == Appended::New {
            self.events.insert(event.key.clone(), event);
        }
        Ok(r)
    }

    fn events(&self, tenant: &TenantId, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<UsageEvent> {
        self.events
            .values()
            .filter(|e| &e.key.tenant == tenant && e.start < to && e.end >= from)
            .cloned()
            .collect()
    }

    fn tenants(&self) -> Vec<TenantId> {
        let set: BTreeSet<&TenantId> = self.events.keys().map(|k| &k.tenant).collect();
        set.into_iter().cloned().collect()
    }
}

/// The events that count: duplicates collapsed, every event voided by a
/// correction dropped, sorted by key. Voiding is applied here, at rating,
/// not at append, so the result does not depend on whether a correction
/// arrived before the event it corrects. Two different payloads under one
/// key are a conflict.
pub fn effective_events<'a, I>(events: I) -> Result<Vec<UsageEvent>>
where
    I: IntoIterator<Item = &'a UsageEvent>,
{
    let mut by_key: BTreeMap<&EventKey, &UsageEvent> = BTreeMap::new();
    for e in events {
        e.validate()?;
        match by_key.get(&e.key) {
            Some(old) if *old != e => {
                return Err(BillingError::KeyConflict {
                    key: e.key.to_string(),
                })
            }
            Some(_) => {}
            None => {
                by_key.insert(&e.key, e);
            }
        }
    }
    let voided: BTreeSet<&EventKey> = by_key
        .values()
        .filter_map(|e| e.corrects.as_ref())
        .collect();
    Ok(by_key
        .into_iter()
        .filter(|(k, _)| !voided.contains(k))
        .map(|(_, e)| e.clone())
        .collect())
}

/// `t` truncated to whole milliseconds: the metering rule's only rounding
/// of time (the ledger stores milliseconds). Usage is metered from the
/// engine's own start and end to the millisecond.
pub fn to_millisecond(t: DateTime<Utc>) -> DateTime<Utc> {
    t.trunc_subsecs(3)
}

/// An instance's (or job's) life as the control plane recorded it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lifecycle {
    /// The tenant billed.
    pub tenant: TenantId,
    /// Event source written into the keys, e.g. `lifecycle`.
    pub source: String,
    /// The instance or job.
    pub subject: Subject,
    /// Canonical GPU model.
    pub model: String,
    /// Share of each GPU.
    pub share: GpuShare,
    /// GPUs (or shares) held.
    pub gpus: u32,
    /// How it is billed.
    pub billing_class: BillingClass,
    /// When its GPUs were taken.
    pub start: DateTime<Utc>,
    /// When they were released; `None` while it runs.
    pub end: Option<DateTime<Utc>>,
    /// When it was preempted, if it was; nothing is charged after it.
    pub preempted_at: Option<DateTime<Utc>>,
    /// The node it ran on.
    pub node: Option<NodeId>,
}

/// Turns a lifecycle into usage events, to the millisecond: the start and
/// the stop are the engine's own times truncated to whole milliseconds (the
/// ledger's resolution), nothing more is rounded here; an invoice rounds
/// money once per line. The stop is the earliest of `end` and
/// `preempted_at`, so preempted spot work is not charged after its
/// preemption. Usage is cut into slices aligned on multiples of
/// `slice_secs` since the Unix epoch, one GPU and one instance event per
/// slice, keyed `subject/meter/slice-start`: re-running this after a crash
/// yields the same keys, hence exactly-once. While it runs (no end, no
/// preemption) only slices complete at `now` are emitted, so a slice is
/// never emitted twice with different contents.
pub fn lifecycle_usage(
    l: &Lifecycle,
    now: DateTime<Utc>,
    slice_secs: u32,
) -> Result<Vec<UsageEvent>> {
    if slice_secs == 0 {
        return Err(BillingError::invalid("slice_secs", "must be positive"));
    }
    if l.gpus == 0 || l.gpus > MAX_UNITS {
        return Err(BillingError::invalid(
            "gpus",
            format!("must be between 1 and {MAX_UNITS}"),
        ));
    }
    let start = to_millisecond(l.start);
    let stop = match (l.end, l.preempted_at) {
        (Some(e), Some(p)) => Some(to_millisecond(e.min(p))),
        (Some(t), None) | (None, Some(t)) => Some(to_millisecond(t)),
        (None, None) => None,
    };
    let horizon = stop.unwrap_or_else(|| to_millisecond(now));
    if horizon <= start {
        return Ok(Vec::new());
    }
    if millis(start, horizon) > MAX_EVENT_DAYS * 86_400_000 {
        return Err(BillingError::invalid(
            "end",
            format!("a lifecycle is metered over at most {MAX_EVENT_DAYS} days at a time"),
        ));
    }
    let slice = i64::from(slice_secs);
    let mut out = Vec::new();
    let mut s0 = start.timestamp().div_euclid(slice) * slice;
    loop {
        let slice_start = DateTime::<Utc>::from_timestamp(s0, 0)
            .ok_or_else(|| BillingError::invalid("start", "out of range"))?;
        if slice_start >= horizon {
            break;
        }
        let slice_end = slice_start + Duration::seconds(slice);
        let a = slice_start.max(start);
        let b = slice_end.min(horizon);
        let complete = stop.is_some() || slice_end <= now;
        if a < b && complete {
            for (tag, meter, amount) in [
                (
                    "gpu",
                    Meter::GpuSeconds {
                        model: l.model.clone(),
                        share: l.share.clone(),
                    },
                    l.gpus,
                ),
                ("instance", Meter::InstanceSeconds, 1),
            ] {
                out.push(UsageEvent {
                    key: EventKey {
                        tenant: l.tenant.clone(),
                        source: l.source.clone(),
                        id: format!("{}/{tag}/{s0}", l.subject.id),
                    },
                    subject: l.subject.clone(),
                    meter,
                    billing_class: l.billing_class,
                    start: a,
                    end: b,
                    amount: Decimal::from(amount),
                    node: l.node.clone(),
                    corrects: None,
                });
            }
        }
        s0 += slice;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(s, 0).unwrap()
    }

    fn ev(id: &str, start: i64, end: i64) -> UsageEvent {
        UsageEvent {
            key: EventKey {
                tenant: TenantId::generate(1, 1),
                source: "agent".into(),
                id: id.into(),
            },
            subject: Subject {
                kind: SubjectKind::Instance,
                id: "inst_x".into(),
            },
            meter: Meter::GpuSeconds {
                model: "H100".into(),
                share: GpuShare::Whole,
            },
            billing_class: BillingClass::OnDemand,
            start: t(start),
            end: t(end),
            amount: Decimal::from(2),
            node: None,
            corrects: None,
        }
    }

    #[test]
    fn duplicates_conflicts_and_late_events() {
        let mut l = MemoryLedger::new(Duration::hours(1));
        let e = ev("a", 0, 100);
        assert_eq!(l.append(e.clone(), t(200)).unwrap(), Appended::New);
        assert_eq!(l.append(e.clone(), t(99_999)).unwrap(), Appended::Duplicate);
        let mut other = e.clone();
        other.amount = Decimal::from(3);
        assert!(matches!(
            l.append(other, t(200)),
            Err(BillingError::KeyConflict { .. })
        ));
        assert!(matches!(
            l.append(ev("b", 0, 100), t(100 + 3601)),
            Err(BillingError::LateEvent { .. })
        ));
        assert_eq!(
            l.append(ev("c", 0, 100), t(100 + 3600)).unwrap(),
            Appended::New
        );
        assert_eq!(l.len(), 2);
    }

    #[test]
    fn a_correction_may_restate_nothing() {
        let a = ev("a", 0, 60);
        let mut void = ev("a-void", 60, 60);
        assert!(void.validate().is_err(), "an empty interval is no usage");
        void.corrects = Some(a.key.clone());
        void.validate().unwrap();
        let x = effective_events([&a, &void]).unwrap();
        let total: Decimal = x
            .iter()
            .map(|e| e.quantity_within(t(0), t(1000)).unwrap())
            .sum();
        assert_eq!(total, Decimal::ZERO);
    }

    #[test]
    fn corrections_void_in_any_order() {
        let a = ev("a", 0, 100);
        let mut fix = ev("a-fix", 0, 50);
        fix.corrects = Some(a.key.clone());
        let x = effective_events([&fix, &a]).unwrap();
        let y = effective_events([&a, &fix, &a]).unwrap();
        assert_eq!(x, y);
        assert_eq!(x.len(), 1);
        assert_eq!(x[0].key.id, "a-fix");
    }

    #[test]
    fn shares_are_exact_units() {
        assert_eq!(GpuShare::Whole.units(), 7000);
        assert_eq!(GpuShare::Fraction { milli: 250 }.units(), 1750);
        let mig = GpuShare::mig_named("3g.40gb").unwrap();
        assert_eq!(mig.units(), 3000);
        assert!(GpuShare::mig_named("9g.1gb").is_err());
        assert!(GpuShare::from_milli(0).is_err());
        // The ledger's form: what stored events hold reads back the same.
        for (json, share) in [
            (r#"{"kind":"whole"}"#, GpuShare::Whole),
            (
                r#"{"kind":"milli","milli":250}"#,
                GpuShare::Fraction { milli: 250 },
            ),
            (r#"{"kind":"mig","profile":"3g.40gb"}"#, mig),
        ] {
            assert_eq!(serde_json::from_str::<GpuShare>(json).unwrap(), share);
            assert_eq!(serde_json::to_string(&share).unwrap(), json);
        }
        assert_eq!(
            serde_json::from_str::<GpuShare>(r#"{"kind":"milli","milli":1000}"#).unwrap(),
            GpuShare::Whole
        );
        assert!(serde_json::from_str::<GpuShare>(r#"{"kind":"milli","milli":0}"#).is_err());
        assert!(serde_json::from_str::<GpuShare>(r#"{"kind":"mig","profile":"x"}"#).is_err());
        let e = ev("a", 0, 100);
        assert_eq!(
            e.quantity_within(t(50), t(1000)).unwrap(),
            Decimal::from(100)
        );
    }

    #[test]
    fn lifecycle_is_to_the_millisecond_and_stops_at_preemption() {
        let l = Lifecycle {
            tenant: TenantId::generate(1, 1),
            source: "lifecycle".into(),
            subject: Subject {
                kind: SubjectKind::Instance,
                id: "inst_a".into(),
            },
            model: "H100".into(),
            share: GpuShare::Whole,
            gpus: 2,
            billing_class: BillingClass::Spot,
            start: t(3500) + Duration::milliseconds(400),
            end: Some(t(9000)),
            preempted_at: Some(t(7300) + Duration::milliseconds(1)),
            node: None,
        };
        let evs = lifecycle_usage(&l, t(10_000), 3600).unwrap();
        let gpu: Decimal = evs
            .iter()
            .map(|e| e.quantity_within(t(0), t(20_000)).unwrap())
            .zip(evs.iter())
            .filter(|(_, e)| matches!(e.meter, Meter::GpuSeconds { .. }))
            .map(|(q, _)| q)
            .sum();
        // 3500.4 .. 7300.001 is 3799.601 s, times 2 GPUs.
        assert_eq!(gpu, Decimal::new(7_599_202, 3));
        assert_eq!(evs.len(), 6);
        // While running, only complete slices appear, and they are stable.
        let running = Lifecycle {
            end: None,
            preempted_at: None,
            ..l.clone()
        };
        let part = lifecycle_usage(&running, t(7300), 3600).unwrap();
        // Slices [0, 3600) and [3600, 7200) are complete at 7300; two meters each.
        assert_eq!(part.len(), 4);
        assert_eq!(
            part[0],
            lifecycle_usage(&running, t(9000), 3600).unwrap()[0]
        );
    }

    fn short(start: DateTime<Utc>, end: DateTime<Utc>) -> Lifecycle {
        Lifecycle {
            tenant: TenantId::generate(1, 1),
            source: "lifecycle".into(),
            subject: Subject {
                kind: SubjectKind::Instance,
                id: "inst_s".into(),
            },
            model: "H100".into(),
            share: GpuShare::Whole,
            gpus: 1,
            billing_class: BillingClass::OnDemand,
            start,
            end: Some(end),
            preempted_at: None,
            node: None,
        }
    }

    fn gpu_seconds(evs: &[UsageEvent]) -> Decimal {
        evs.iter()
            .filter(|e| matches!(e.meter, Meter::GpuSeconds { .. }))
            .map(|e| e.quantity_within(t(0), t(1_000_000)).unwrap())
            .sum()
    }

    #[test]
    fn a_short_run_is_billed_exactly_what_it_ran() {
        let ms = Duration::milliseconds;
        // 1.2 s from a whole second: 1.2 GPU-seconds, not 2.
        let l = short(t(100), t(101) + ms(200));
        let evs = lifecycle_usage(&l, t(200), 60).unwrap();
        assert_eq!(gpu_seconds(&evs), Decimal::new(1200, 3));
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].key.id, "inst_s/gpu/60");
        // 1.2 s off the second, across a slice boundary (59.9 .. 61.1):
        // 0.1 s in the slice at 0, 1.1 s in the slice at 60, 1.2 s in all.
        let l = short(t(59) + ms(900), t(61) + ms(100));
        let evs = lifecycle_usage(&l, t(200), 60).unwrap();
        assert_eq!(gpu_seconds(&evs), Decimal::new(1200, 3));
        let keys: Vec<&str> = evs.iter().map(|e| e.key.id.as_str()).collect();
        assert_eq!(
            keys,
            [
                "inst_s/gpu/0",
                "inst_s/instance/0",
                "inst_s/gpu/60",
                "inst_s/instance/60"
            ]
        );
        assert_eq!(evs[0].start, t(59) + ms(900));
        assert_eq!(evs[2].end, t(61) + ms(100));
        // Sub-millisecond edges are truncated to the millisecond, the
        // ledger's resolution: 10.0005 .. 11.2009 meters 10.000 .. 11.200.
        let l = short(
            t(10) + Duration::microseconds(500),
            t(11) + Duration::microseconds(200_900),
        );
        let evs = lifecycle_usage(&l, t(200), 60).unwrap();
        assert_eq!(gpu_seconds(&evs), Decimal::new(1200, 3));
        assert_eq!(evs[0].start, t(10));
        assert_eq!(evs[0].end, t(11) + ms(200));
        // The same lifecycle metered again gives the same events.
        assert_eq!(evs, lifecycle_usage(&l, t(300), 60).unwrap());
        // Under a millisecond is nothing to bill.
        let l = short(t(10), t(10) + Duration::microseconds(999));
        assert!(lifecycle_usage(&l, t(200), 60).unwrap().is_empty());
    }
}
