//! Lifecycle metering: turns the time instances ran into usage events in
//! the ledger, per second, in one-minute slices keyed by instance and
//! slice, so a pass cut anywhere and rerun is exactly-once (the ledger drops
//! exact duplicates). The rule for what is billed lives in
//! `flotilla-billing` (`lifecycle_usage`); this module only decides the
//! window and remembers how far it got.
//!
//! Billed: from `running` to the final state, at the time the agent
//! reported for it (the workload's exit, also one during an outage of the
//! server or the agent, or the time the lease's fence stopped it). A `lost`
//! instance is not metered while lost; if its agent returns with the work
//! still running the time in between is billed (the work ran), if it
//! returns reporting the exit the bill stops at that exit, and if it never
//! returns (the server ends the instance: no exit code) the bill stops when
//! it was lost. An agent that returns and reports the exit only after the
//! server ended the instance (its fence killed the work while the agent was
//! frozen, and the agent saw the end after its first sync back) moves the
//! end back to that exit (`flotilla_store`'s late exit): the bill then
//! stops at the exit too.
//!
//! While an instance seems to run its complete minutes are metered before
//! anyone knows whether it still runs (a server back from an outage meters
//! the outage's minutes before the agent reports), and a lost one is billed
//! to its loss before a late exit says it ended earlier: when the end
//! finally known lies before what was metered, every event in the ledger
//! that bills past it is corrected by a new event that voids it and
//! restates it up to the end (nothing, for a minute wholly after it). The
//! corrections are made from what the ledger holds, so a correction can
//! itself be corrected (a loss restated, then an earlier exit). The ledger
//! is never edited.

use chrono::{DateTime, Duration, Utc};
use flotilla_billing::meter::{
    lifecycle_usage, GpuShare, Lifecycle, Subject, SubjectKind, UsageEvent,
};
use flotilla_core::api::Instance;
use flotilla_core::instance::InstanceState;
use flotilla_store::StoreError;

use crate::state::AppState;

/// Slice length of lifecycle usage events.
pub const SLICE_SECS: u32 = 60;
/// Event source written into the keys.
pub const SOURCE: &str = "lifecycle";

/// What to meter now for one instance.
#[derive(Debug, Clone, PartialEq)]
pub enum Window {
    /// Nothing now (lost, or not started).
    Wait,
    /// Complete slices up to now; the instance runs on.
    Running {
        /// First instant not yet metered (a slice boundary).
        from: DateTime<Utc>,
    },
    /// The rest of its life, up to `end`; metering is then done.
    Final {
        /// First instant not yet metered.
        from: DateTime<Utc>,
        /// When billing stops (before `from` when metering overran it).
        end: DateTime<Utc>,
        /// When the instance finished (metering is recorded as done then).
        finished: DateTime<Utc>,
        /// How far it was metered while it seemed to run, when that is
        /// past `end`: those slices are corrected back to `end`.
        overrun: Option<DateTime<Utc>>,
    },
}

/// Decides the window of `inst`, metered up to `until` so far.
pub fn window(inst: &Instance, until: Option<DateTime<Utc>>) -> Window {
    let Some(started) = inst.started_at else {
        return Window::Wait;
    };
    let from = until.map_or(started, |u| u.max(started));
    // The last state before the current one tells whether it ended while
    // its node was gone.
    let ended_while_lost = inst
        .events
        .iter()
        .rev()
        .nth(1)
        .filter(|e| e.state == InstanceState::Lost)
        .map(|e| e.at);
    match (inst.state, inst.finished_at) {
        (InstanceState::Lost, _) => Window::Wait,
        (s, Some(finished)) if s.is_terminal() => {
            // Ended while lost: at the exit its agent reported when it came
            // back, also after the server had ended it (an exit code says it
            // did; see `flotilla_store`'s late exit), else when it was lost.
            let end = match ended_while_lost {
                Some(lost) if inst.exit_code.is_none() => lost,
                _ => finished,
            }
            .max(started);
            Window::Final {
                from,
                end,
                finished,
                overrun: until.filter(|u| *u > end),
            }
        }
        (InstanceState::Running | InstanceState::Starting, _) => Window::Running { from },
        _ => Window::Wait,
    }
}

/// The events of `window` for `inst` at `now`, and how far metering then got.
/// `billed`: for a final window that metering overran, the instance's
/// events in the ledger that end after the window's end (see
/// [`billed_past`]); they are what the corrections void. Ignored otherwise.
pub fn usage(
    inst: &Instance,
    window: &Window,
    now: DateTime<Utc>,
    billed: &[UsageEvent],
) -> Result<(Vec<UsageEvent>, Option<DateTime<Utc>>), flotilla_billing::BillingError> {
    let (from, end, done, overrun) = match window {
        Window::Wait => return Ok((Vec::new(), None)),
        Window::Running { from } => (*from, None, None, None),
        Window::Final {
            from,
            end,
            finished,
            overrun,
        } => (*from, Some(*end), Some(*finished), *overrun),
    };
    let (Some(model), gpus) = (inst.gpu_model.clone(), inst.gpus) else {
        return Ok((Vec::new(), done));
    };
    let lifecycle = Lifecycle {
        tenant: inst.tenant_id.clone(),
        source: SOURCE.into(),
        subject: Subject {
            kind: SubjectKind::Instance,
            id: inst.id.to_string(),
        },
        model,
        share: share_of(inst),
        gpus,
        billing_class: inst.billing_class,
        start: from,
        end,
        preempted_at: None,
        node: inst.node_id.clone(),
    };
    let mut events = lifecycle_usage(&lifecycle, now, SLICE_SECS)?;
    if let (Some(end), Some(_)) = (end, overrun) {
        events.extend(corrections(billed, end)?);
    }
    let reached = match done {
        Some(finished) => Some(finished),
        None => {
            // Only complete slices are emitted while it runs.
            let slice = i64::from(SLICE_SECS);
            let boundary = now.timestamp().div_euclid(slice) * slice;
            DateTime::from_timestamp(boundary, 0).filter(|b| *b > from)
        }
    };
    Ok((events, reached))
}

/// Corrections of what the ledger bills past `end` (`billed`: the
/// instance's stored events, at least every one ending after `end`): each
/// event that counts (not voided) and bills time past the end, to the
/// millisecond as `lifecycle_usage` bills, is voided and restated up to
/// it, as nothing when it began after it. A correction's key is the key
/// it voids plus `/exit`, and its payload follows from that event and the
/// end alone, so a pass cut anywhere and rerun writes each once, and an
/// event already restated is restated again from its restatement.
fn corrections(
    billed: &[UsageEvent],
    end: DateTime<Utc>,
) -> Result<Vec<UsageEvent>, flotilla_billing::BillingError> {
    let stop = flotilla_billing::meter::to_millisecond(end);
    Ok(flotilla_billing::meter::effective_events(billed)?
        .into_iter()
        // An empty event (a minute already restated as nothing) bills
        // nothing to correct.
        .filter(|e| e.end > stop && e.start < e.end)
        .map(|e| {
            let mut c = e.clone();
            c.key.id = format!("{}/exit", e.key.id);
            c.end = stop.max(e.start);
            c.corrects = Some(e.key);
            c
        })
        .collect())
}

/// The events of `inst` in the ledger that `window` may have to correct:
/// for a final window metering overran, those billing past its end.
async fn billed_past(
    st: &AppState,
    inst: &Instance,
    window: &Window,
) -> Result<Vec<UsageEvent>, StoreError> {
    let Window::Final {
        end,
        overrun: Some(_),
        ..
    } = window
    else {
        return Ok(Vec::new());
    };
    st.store()
        .usage_keyed_after(
            &inst.tenant_id,
            SOURCE,
            &format!("{}/", inst.id),
            flotilla_billing::meter::to_millisecond(*end),
        )
        .await
}

/// What one unit of the instance's GPU meter is: a fraction bills its
/// share (a 0.25 share accrues 0.25 GPU-seconds a second), a MIG instance
/// its compute slices of 7, whole GPUs one GPU each. An instance whose
/// stored share no longer reads (a profile the catalog dropped, which
/// validation at creation rules out) bills as whole GPUs, the safe side
/// for nobody: it is logged.
pub fn share_of(inst: &Instance) -> GpuShare {
    let share = match (&inst.mig_profile, inst.gpu_fraction) {
        (Some(profile), _) => GpuShare::mig_named(profile),
        // Stored in milli, so the round trip through f64 is exact.
        (None, Some(f)) => GpuShare::from_milli((f * 1000.0).round().clamp(1.0, 1000.0) as u32),
        (None, None) => Ok(GpuShare::Whole),
    };
    share.unwrap_or_else(|e| {
        tracing::error!(instance = %inst.id, error = %e, "unreadable GPU share; metered as whole GPUs");
        GpuShare::Whole
    })
}

/// Instances read per page of a metering pass.
const PAGE: u32 = 500;

/// Events per append: one transaction each.
const APPEND_AT_MOST: usize = 10_000;

/// How often the metering task looks for due work. Slices are a minute
/// long, so a few seconds only delays the last slice of ended work.
pub const METERING_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// Meters every instance that needs it, a page at a time: the page's
/// events go to the ledger in one append and how far each got in one
/// update. Returns the events appended.
///
/// A serverless endpoint's replica bills its GPU time to the endpoint, at
/// the serverless GPU-second price: the subject becomes the endpoint. The
/// keys stay the instance's, so two replicas never share one.
pub async fn metering_pass(st: &AppState) -> Result<usize, StoreError> {
    let now = st.now();
    let mut appended = 0;
    let mut after: Option<flotilla_core::id::InstanceId> = None;
    loop {
        let page = st
            .store()
            .instances_to_meter(now, SLICE_SECS, after.as_ref(), PAGE)
            .await?;
        let Some((last, _)) = page.last() else {
            break;
        };
        after = Some(last.id.clone());
        let full = page.len() == PAGE as usize;
        appended += meter_page(st, &page, now).await?;
        if !full {
            break;
        }
    }
    Ok(appended)
}

/// Meters one page of due instances.
async fn meter_page(
    st: &AppState,
    page: &[(Instance, Option<DateTime<Utc>>)],
    now: DateTime<Utc>,
) -> Result<usize, StoreError> {
    let mut metered = Vec::with_capacity(page.len());
    let mut reached_all = Vec::with_capacity(page.len());
    // Final windows by instance: where a refused slice says the ledger
    // holds more than the record of how far metering got (see below).
    let mut finals = std::collections::HashMap::new();
    for (inst, until) in page {
        let w = window(inst, *until);
        if let Window::Final { end, .. } = w {
            finals.insert(inst.id.clone(), (inst, end));
        }
        let billed = billed_past(st, inst, &w).await?;
        match usage(inst, &w, now, &billed) {
            Ok((events, reached)) => {
                if let Some(r) = reached {
                    reached_all.push((inst.id.clone(), r));
                }
                if !events.is_empty() {
                    metered.push((inst.id.clone(), events));
                }
            }
            Err(e) => tracing::warn!(instance = %inst.id, error = %e, "cannot meter instance"),
        }
    }
    let mut appended = 0;
    if !metered.is_empty() {
        let ids: Vec<_> = metered.iter().map(|(id, _)| id.clone()).collect();
        let endpoints = st.store().replica_endpoints(&ids).await?;
        let mut events = Vec::new();
        // Whose each event is, by position in `events`.
        let mut owners = Vec::new();
        for (id, mut list) in metered {
            if let Some(endpoint) = endpoints.get(&id) {
                for e in &mut list {
                    e.subject = Subject {
                        kind: SubjectKind::Endpoint,
                        id: endpoint.to_string(),
                    };
                }
            }
            owners.extend(std::iter::repeat_n(id, list.len()));
            events.extend(list);
        }
        let mut restate = std::collections::BTreeSet::new();
        // A page of work back from a long outage holds a slice per minute
        // each: appended in bounded transactions.
        for (n, chunk) in events.chunks(APPEND_AT_MOST).enumerate() {
            let started = tokio::time::Instant::now();
            let out = st.store().append_usage(chunk, grace(), now).await?;
            st.ops()
                .usage_ingest
                .observe(started.elapsed().as_secs_f64());
            st.ops().usage_outcome(
                "metering",
                out.accepted,
                out.duplicates,
                out.rejected.len() as u64,
            );
            appended += out.accepted as usize;
            for r in &out.rejected {
                let owner = &owners[n * APPEND_AT_MOST + r.index];
                if r.code == "key_conflict" && finals.contains_key(owner) {
                    restate.insert(owner.clone());
                } else {
                    tracing::warn!(key = %r.key, code = r.code, "usage event refused by the ledger");
                }
            }
        }
        // A final slice refused for its key: the ledger already bills that
        // slice differently, whole, written by a pass that was cut (its
        // leader killed, its last write failed) before it recorded how far
        // it got, so this window's `until` lies before what is billed and
        // saw no overrun. The ledger is the truth: what it bills past the
        // end is corrected as an overrun is.
        for id in restate {
            let (inst, end) = finals[&id];
            let billed = st
                .store()
                .usage_keyed_after(
                    &inst.tenant_id,
                    SOURCE,
                    &format!("{}/", inst.id),
                    flotilla_billing::meter::to_millisecond(end),
                )
                .await?;
            let fixes = match corrections(&billed, end) {
                Ok(fixes) => fixes,
                Err(e) => {
                    tracing::warn!(instance = %inst.id, error = %e, "cannot restate a cut pass's slices");
                    continue;
                }
            };
            tracing::info!(instance = %inst.id, corrections = fixes.len(),
                "restating slices a cut metering pass billed past the end");
            let out = st.store().append_usage(&fixes, grace(), now).await?;
            appended += out.accepted as usize;
            for r in &out.rejected {
                tracing::warn!(key = %r.key, code = r.code, "usage event refused by the ledger");
            }
        }
    }
    // After the events: a pass cut between the two meters the page again,
    // and the ledger drops the exact duplicates.
    st.store().set_metered_until_many(&reached_all).await?;
    Ok(appended)
}

/// Runs metering passes while this replica leads, beside the scheduling
/// round rather than in it: at a minute's boundary a fleet's every running
/// instance has a slice to write, and a round that waited for that held
/// placement back by seconds (and, through the round's duty cycle, by
/// four times as long again). Runs when the state's clock has moved on
/// [`METERING_EVERY`] since the last pass (a manual clock that stands
/// still meters once).
pub async fn run(st: AppState, tick: std::time::Duration) {
    let mut shutdown = st.shutdown_signal();
    let every = Duration::from_std(METERING_EVERY).unwrap_or(Duration::seconds(2));
    let mut last: Option<DateTime<Utc>> = None;
    loop {
        if *shutdown.borrow() {
            return;
        }
        let now = st.now();
        if st.leads() && last.is_none_or(|l| now - l >= every) {
            last = Some(now);
            let started = std::time::Instant::now();
            if let Err(e) = metering_pass(&st).await {
                tracing::warn!(error = %e, "metering pass failed; retrying");
            }
            st.ops().leader_pass("metering", started.elapsed());
        }
        tokio::select! {
            _ = shutdown.changed() => {}
            _ = tokio::time::sleep(tick.min(METERING_EVERY)) => {}
        }
    }
}

/// How late an event may arrive (the API's window too).
pub fn grace() -> Duration {
    Duration::hours(72)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_core::api::InstanceEvent;
    use flotilla_core::id::{InstanceId, TenantId};
    use flotilla_core::instance::BillingClass;

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
    }

    fn inst(
        state: InstanceState,
        events: &[(InstanceState, i64)],
        finished: Option<i64>,
    ) -> Instance {
        Instance {
            id: InstanceId::generate(1, 1),
            tenant_id: TenantId::generate(1, 2),
            name: None,
            state,
            state_reason: String::new(),
            gpus: 2,
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
            started_at: Some(t(10)),
            finished_at: finished.map(t),
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

    fn gpu_seconds(events: &[UsageEvent]) -> i64 {
        events
            .iter()
            .filter(|e| e.key.id.contains("/gpu/"))
            .map(|e| (e.end - e.start).num_seconds() * 2)
            .sum()
    }

    #[test]
    fn running_then_final_bills_each_second_once() {
        use InstanceState::*;
        let running = inst(Running, &[(Pending, 0), (Running, 10)], None);
        let w = window(&running, None);
        let (first, reached) = usage(&running, &w, t(130), &[]).unwrap();
        // Complete slices only: up to the minute boundary before t(130).
        let boundary = reached.unwrap();
        assert_eq!(boundary.timestamp() % 60, 0);
        assert_eq!(gpu_seconds(&first), 2 * (boundary - t(10)).num_seconds());
        let done = inst(
            Succeeded,
            &[(Pending, 0), (Running, 10), (Succeeded, 200)],
            Some(200),
        );
        let (rest, reached) = usage(&done, &window(&done, Some(boundary)), t(300), &first).unwrap();
        assert_eq!(reached, Some(t(200)));
        assert_eq!(
            gpu_seconds(&first) + gpu_seconds(&rest),
            2 * 190,
            "190 s on 2 GPUs"
        );
        let keys: std::collections::HashSet<_> = first
            .iter()
            .chain(&rest)
            .map(|e| e.key.id.clone())
            .collect();
        assert_eq!(keys.len(), first.len() + rest.len(), "no slice twice");
    }

    #[test]
    fn a_half_share_accrues_half_a_gpu_second_per_second() {
        use InstanceState::*;
        let half = Instance {
            gpus: 1,
            gpu_fraction: Some(0.5),
            ..inst(
                Succeeded,
                &[(Pending, 0), (Running, 10), (Succeeded, 130)],
                Some(130),
            )
        };
        let (events, _) = usage(&half, &window(&half, None), t(200), &[]).unwrap();
        let gpu_units: i128 = events
            .iter()
            .map(|e| e.gpu_unit_ms_within(t(0), t(1000)).unwrap())
            .sum();
        // 120 s at 0.5 GPU: 60 GPU-seconds of 7000 units each.
        assert_eq!(
            gpu_units,
            60 * flotilla_billing::meter::UNIT_MS_PER_GPU_SECOND
        );
        let mig = Instance {
            gpu_fraction: None,
            mig_profile: Some("1g.10gb".into()),
            ..half
        };
        assert_eq!(share_of(&mig), GpuShare::mig_named("1g.10gb").unwrap());
    }

    #[test]
    fn lost_waits_and_a_loss_that_never_returns_stops_the_bill() {
        use InstanceState::*;
        let lost = inst(Lost, &[(Running, 10), (Lost, 100)], None);
        assert_eq!(window(&lost, None), Window::Wait);
        let failed = inst(
            Failed,
            &[(Running, 10), (Lost, 100), (Failed, 500)],
            Some(500),
        );
        let w = window(&failed, None);
        assert_eq!(
            w,
            Window::Final {
                from: t(10),
                end: t(100),
                finished: t(500),
                overrun: None,
            }
        );
        let (events, reached) = usage(&failed, &w, t(600), &[]).unwrap();
        assert_eq!(gpu_seconds(&events), 2 * 90);
        assert_eq!(reached, Some(t(500)));
        let never_ran = Instance {
            started_at: None,
            ..inst(Stopped, &[(Pending, 0), (Stopped, 5)], Some(5))
        };
        assert_eq!(window(&never_ran, None), Window::Wait);
    }

    /// GPU-seconds that count: corrections applied, as rating does.
    fn billed(events: &[UsageEvent]) -> rust_decimal::Decimal {
        flotilla_billing::meter::effective_events(events)
            .unwrap()
            .iter()
            .filter(|e| e.key.id.contains("/gpu/"))
            .map(|e| e.quantity_within(t(-100_000), t(100_000)).unwrap())
            .sum()
    }

    /// Runs the passes: one at each of `passes` while `running`, then one
    /// for `done`. Returns every event written.
    fn meter(running: &Instance, passes: &[i64], done: &Instance, last: i64) -> Vec<UsageEvent> {
        let mut until = None;
        let mut all = Vec::new();
        for &p in passes {
            let (events, reached) = usage(running, &window(running, until), t(p), &all).unwrap();
            all.extend(events);
            until = reached.or(until);
        }
        let (events, reached) = usage(done, &window(done, until), t(last), &all).unwrap();
        assert_eq!(reached, done.finished_at);
        all.extend(events);
        all
    }

    #[test]
    fn an_exit_reported_after_its_minutes_were_metered_corrects_them() {
        use InstanceState::*;
        let running = inst(Running, &[(Pending, 0), (Running, 10)], None);
        // Metered through t(120) (a server back from an outage) before the
        // agent reports the exit at t(75.4), inside the second minute.
        let exit = t(75) + Duration::milliseconds(400);
        let done = Instance {
            exit_code: Some(0),
            finished_at: Some(exit),
            ..inst(
                Succeeded,
                &[(Pending, 0), (Running, 10), (Succeeded, 75)],
                None,
            )
        };
        let all = meter(&running, &[130], &done, 140);
        // [10, 75.4): to the millisecond, 2 GPUs.
        assert_eq!(billed(&all), rust_decimal::Decimal::new(2 * 65_400, 3));
        let fixes: Vec<_> = all.iter().filter(|e| e.corrects.is_some()).collect();
        assert_eq!(
            fixes.len(),
            2,
            "the second minute's gpu and instance slices"
        );
        // Nothing edited: the slice and its correction are both there.
        assert!(all
            .iter()
            .any(|e| Some(&e.key) == fixes[0].corrects.as_ref()));

        // An exit before the last metered minute began voids it whole.
        let early = Instance {
            finished_at: Some(t(55)),
            ..done.clone()
        };
        let all = meter(&running, &[70, 130], &early, 140);
        assert_eq!(billed(&all), rust_decimal::Decimal::from(2 * 45));
        assert!(all
            .iter()
            .any(|e| e.corrects.is_some() && e.start == e.end && e.start == t(60)));
        // Rerun after a crash: the same keys and payloads.
        let again = usage(&early, &window(&early, Some(t(120))), t(150), &all)
            .unwrap()
            .0;
        assert!(again.iter().all(|e| all.contains(e)), "exactly once");
    }

    /// Runs one pass per `(instance as it then stood, time)`, as the
    /// server would; returns every event written and how far it got.
    fn passes(stages: &[(&Instance, i64)]) -> (Vec<UsageEvent>, Option<DateTime<Utc>>) {
        let mut until = None;
        let mut all = Vec::new();
        for (i, at) in stages {
            let (events, reached) = usage(i, &window(i, until), t(*at), &all).unwrap();
            all.extend(events);
            until = reached.or(until);
        }
        (all, until)
    }

    #[test]
    fn a_late_exit_after_the_server_ended_a_lost_copy_corrects_its_bill() {
        use InstanceState::*;
        // Running from t(10); its lease ran out at t(100) (lost then, the
        // fence killed it at t(93.2)); the agent came back at t(130)
        // without reporting it, so the server failed it (no exit code):
        // billed to t(100). Then the agent reported the kill.
        let running = inst(Running, &[(Running, 10)], None);
        let lost = inst(Lost, &[(Running, 10), (Lost, 100)], None);
        let events = [(Running, 10), (Lost, 100), (Failed, 130)];
        let given_up = inst(Failed, &events, Some(130));
        let killed = t(93) + Duration::milliseconds(200);
        let reported = Instance {
            exit_code: Some(143),
            finished_at: Some(killed),
            ..given_up.clone()
        };
        let to_kill = rust_decimal::Decimal::new(2 * 83_200, 3);
        // Metered to t(60) while it ran: billed to the loss, then the kill.
        let stages = [(&running, 70), (&lost, 110), (&given_up, 135)];
        let (before, until) = passes(&stages);
        assert_eq!(billed(&before), rust_decimal::Decimal::from(2 * 90));
        assert_eq!(until, Some(t(130)));
        let (all, until) = passes(&[&stages[..], &[(&reported, 140)]].concat());
        assert_eq!(until, Some(killed), "metering done at the new end");
        assert_eq!(billed(&all), to_kill);
        // The ledger only grew: the bill to the loss is all still there.
        assert!(before.iter().all(|e| all.contains(e)));
        // Rerun (a pass cut after the append): nothing new.
        let (again, _) = usage(&reported, &window(&reported, Some(t(130))), t(150), &all).unwrap();
        assert!(again.iter().all(|e| all.contains(e)), "exactly once");

        // Metered to t(120) while it seemed to run (the margin after its
        // lease): the loss already corrected [60, 120) back to t(100); the
        // kill corrects that correction.
        let stages = [(&running, 125), (&lost, 128), (&given_up, 135)];
        let (before, _) = passes(&stages);
        assert_eq!(billed(&before), rust_decimal::Decimal::from(2 * 90));
        let (all, _) = passes(&[&stages[..], &[(&reported, 140)]].concat());
        assert_eq!(billed(&all), to_kill);
        assert!(all.iter().any(|e| e.key.id.ends_with("/exit/exit")));

        // The late exit reaches the server before the metering pass that
        // would have billed the loss: billed to the kill all the same.
        let (all, _) = passes(&[(&running, 70), (&lost, 110), (&reported, 140)]);
        assert_eq!(billed(&all), to_kill);
    }

    #[test]
    fn a_fenced_copy_is_billed_to_the_kill_its_agent_reports() {
        use InstanceState::*;
        // Lost at its lease's end t(100); its agent's fence killed it at
        // t(93.2), which the agent reports (with an exit code) when back.
        let running = inst(Running, &[(Running, 10)], None);
        let killed = t(93) + Duration::milliseconds(200);
        let fenced = Instance {
            exit_code: Some(143),
            finished_at: Some(killed),
            ..inst(Failed, &[(Running, 10), (Lost, 100), (Failed, 93)], None)
        };
        let all = meter(&running, &[], &fenced, 200);
        assert_eq!(billed(&all), rust_decimal::Decimal::new(2 * 83_200, 3));
        // Metered into the minute past the kill while it seemed to run.
        let all = meter(&running, &[125], &fenced, 200);
        assert_eq!(billed(&all), rust_decimal::Decimal::new(2 * 83_200, 3));
        // Killed after the lease's end (SIGTERM at the end, then its exit):
        // billed to the kill too.
        let late = Instance {
            finished_at: Some(t(101)),
            ..fenced.clone()
        };
        assert_eq!(
            billed(&meter(&running, &[], &late, 200)),
            rust_decimal::Decimal::from(2 * 91)
        );
        // Never back: the server ends it (no exit code) and the bill
        // stops at the lease's end.
        let given_up = Instance {
            exit_code: None,
            finished_at: Some(t(500)),
            ..fenced
        };
        assert_eq!(
            billed(&meter(&running, &[], &given_up, 600)),
            rust_decimal::Decimal::from(2 * 90)
        );
    }
}
