//! The control loops: the scheduling pass ([`crate::schedule`]: gather a
//! snapshot, plan with `flotilla-sched`, apply), node liveness, the job
//! loop, metering and billing. Every pass reads the store, decides with
//! pure code, and commits through the store's conditional writes, so a
//! pass may be cut at any line and rerun.

use std::time::Duration;

use chrono::Duration as ChronoDuration;
use flotilla_store::StoreError;

use chrono::{DateTime, Utc};

use crate::schedule::{run_pass, PassOutcome};
use crate::state::AppState;

/// The longest work may wait without a pass while this replica sees no
/// change: what a pass could decide differently with time alone (fair
/// share decaying) or after a change made through another replica (an
/// exit its agent reported there) is picked up within it.
pub const PASS_AT_LEAST_EVERY: ChronoDuration = ChronoDuration::seconds(5);

/// When the leader's scheduling pass is due: when something changed since
/// the last one (the state's change generation: a change signalled, or an
/// API request that may have written; or work submitted through any
/// replica, seen as a new newest waiting id), when a time the last plan
/// named arrives (the blocked head's expected start, an offer window's
/// opening), and, while work waits, at least every `at_least_every`
/// ([`PASS_AT_LEAST_EVERY`] by default). Never by the round's tick alone:
/// an idle leader with nothing waiting plans nothing.
#[derive(Debug, Clone)]
pub struct PassTrigger {
    /// The longest work waits without a pass when nothing changes.
    at_least_every: ChronoDuration,
    /// The generation the last pass started at; `None` before the first.
    generation: Option<u64>,
    /// The newest waiting instance and job when it started.
    newest: (Option<String>, Option<String>),
    /// When the last pass ran.
    ran_at: Option<DateTime<Utc>>,
    /// What it found.
    last: PassOutcome,
}

impl Default for PassTrigger {
    fn default() -> Self {
        Self::new(PASS_AT_LEAST_EVERY)
    }
}

impl PassTrigger {
    /// A trigger that has seen no pass, passing at least every
    /// `at_least_every` while work waits.
    pub fn new(at_least_every: ChronoDuration) -> Self {
        Self {
            at_least_every,
            generation: None,
            newest: (None, None),
            ran_at: None,
            last: PassOutcome::default(),
        }
    }

    /// Whether a pass is due at `generation`, with `newest` the newest
    /// waiting ids, at `now`.
    pub fn due(
        &self,
        generation: u64,
        newest: &(Option<String>, Option<String>),
        now: DateTime<Utc>,
    ) -> bool {
        let Some(ran_at) = self.ran_at else {
            return true;
        };
        self.generation != Some(generation)
            || &self.newest != newest
            || self.last.planned().is_some_and(|t| t <= now)
            || (self.last.waiting > 0 && now - ran_at >= self.at_least_every)
    }

    /// A pass started at `generation` and `newest` ran at `now` and found
    /// `outcome`.
    pub fn ran(
        &mut self,
        generation: u64,
        newest: (Option<String>, Option<String>),
        now: DateTime<Utc>,
        outcome: PassOutcome,
    ) {
        self.generation = Some(generation);
        self.newest = newest;
        self.ran_at = Some(now);
        self.last = outcome;
    }
}

/// Marks nodes whose heartbeats stopped as unreachable and their work
/// lost, once their lease ran out and a margin more
/// ([`crate::ServerConfig::node_lease`], `node_lease_margin`): by then an
/// agent that could not reach the control plane has stopped that work
/// itself, so a job restarted elsewhere never runs twice. A lost copy is
/// billed until its lease ran out (when its agent had stopped it at the
/// latest), not until the server noticed. After a restart the server first
/// waits one lease, so agents get the chance to sync before they are
/// declared gone.
pub async fn liveness_pass(st: &AppState) -> Result<usize, StoreError> {
    let now = st.now();
    let lease =
        ChronoDuration::from_std(st.config().node_lease()).unwrap_or(ChronoDuration::seconds(15));
    let margin = ChronoDuration::from_std(st.config().node_lease_margin())
        .unwrap_or(ChronoDuration::seconds(5));
    if now - st.started_at() < lease {
        return Ok(0);
    }
    let cutoff = now - lease - margin;
    let mut lost = 0;
    for (node, last) in st.store().stale_nodes_since(cutoff).await? {
        if st.store().mark_node_unreachable(&node, cutoff).await? {
            let stopped_by = (last + lease).min(now);
            let ids = st.store().mark_node_lost(&node, stopped_by).await?;
            tracing::warn!(node = %node, lost = ids.len(), "node unreachable: its lease ran out");
            let message = format!(
                "unreachable: no heartbeat since {last}; {} instance(s) lost, billed until {stopped_by}",
                ids.len()
            );
            st.store()
                .add_node_event(&node, "unreachable", &message, now)
                .await?;
            lost += ids.len();
        }
    }
    if lost > 0 {
        st.notify_change();
    }
    Ok(lost)
}

/// Shortest time from the start of one round of passes to the start of the
/// next when changes keep coming. Each create signals a change; at a
/// thousand creates a second the loop would otherwise run its passes back
/// to back, each reading the oldest queued work afresh, and take a CPU of
/// its own from the API it shares the machine with, to place nothing new.
/// Changes that arrive meanwhile are
/// taken together by the next round, so the first change after a quiet
/// spell is still acted on at once and a stream of them waits at most this
/// long.
pub const MIN_ROUND_GAP: Duration = Duration::from_millis(50);

/// While changes keep coming, a round's passes take at most one part in
/// this many of the loop's time: the next round starts no sooner than this
/// many times its duration after this one started (and at least
/// [`MIN_ROUND_GAP`], at most [`MAX_ROUND_GAP`] after). A pass reads and
/// plans the whole queue, so with 10,000 queued instances and a stream of
/// creates, rounds back to back would take a core from the API they share
/// the machine with; new work then waits a little longer for its first
/// pass, in proportion to what a pass costs, and a change after a quiet
/// spell is still acted on at once.
pub const ROUND_DUTY: u32 = 4;

/// The longest gap from the start of one round to the start of the next,
/// however long the round: a round that placed a burst (thousands of
/// creates at once took 10-15 s at 1,000 nodes) must not hold the next
/// one back four times as long. Without this cap the leader then waited
/// 40-60 s with new work queued (docs/scale.md). The same bound as a
/// quiet replica's pass ([`PASS_AT_LEAST_EVERY`]).
pub const MAX_ROUND_GAP: Duration = Duration::from_secs(5);

/// The gap from the start of a round that took `round` to the start of
/// the next while changes keep coming: [`ROUND_DUTY`] times the round,
/// within [`MIN_ROUND_GAP`] and [`MAX_ROUND_GAP`].
pub fn round_gap(round: Duration) -> Duration {
    (round * ROUND_DUTY).clamp(MIN_ROUND_GAP, MAX_ROUND_GAP)
}

/// Runs the passes until shutdown: placement on every change (and at least
/// each `tick`), liveness each `tick`, housekeeping hourly. Metering runs
/// beside it ([`crate::metering::run`]), so a minute's slices for a whole
/// fleet never hold a placement back.
pub async fn run(st: AppState, tick: Duration) {
    let mut changes = st.subscribe();
    let mut control = st.subscribe_control();
    let mut shutdown = st.shutdown_signal();
    let mut last_housekeeping = st.now();
    let mut trigger = PassTrigger::new(
        ChronoDuration::from_std(st.config().pass_at_least_every).unwrap_or(PASS_AT_LEAST_EVERY),
    );
    loop {
        if *shutdown.borrow() {
            return;
        }
        // Marked seen before the passes read the store, so a change made
        // while they run wakes the next round instead of waiting a tick.
        changes.borrow_and_update();
        control.borrow_and_update();
        let round_started = tokio::time::Instant::now();
        if !st.leads() {
            // The lease ran out by this process's clock before the election
            // loop stopped this one: a pass now would only be refused.
            tokio::select! {
                _ = shutdown.changed() => {}
                _ = tokio::time::sleep(tick) => {}
            }
            continue;
        }
        let timed = |pass: &'static str, from: tokio::time::Instant| {
            st.ops().leader_pass(pass, from.elapsed());
            tokio::time::Instant::now()
        };
        if let Err(e) = crate::jobs::jobs_pass(&st).await {
            tracing::warn!(error = %e, "job pass failed; retrying");
        }
        let at = timed("jobs", round_started);
        if let Err(e) = scheduling_round(&st, &mut trigger).await {
            tracing::warn!(error = %e, "placement pass failed; retrying");
        }
        let at = timed("placement", at);
        if let Err(e) = crate::offers::offers_pass(&st).await {
            tracing::warn!(error = %e, "offer window pass failed; retrying");
        }
        let at = timed("offers", at);
        if let Err(e) = liveness_pass(&st).await {
            tracing::warn!(error = %e, "liveness pass failed; retrying");
        }
        timed("liveness", at);
        billing_pass(&st);
        let now = st.now();
        if now - last_housekeeping > ChronoDuration::hours(1) {
            last_housekeeping = now;
            st.prune_rate_limits();
            match st
                .store()
                .expire_idempotency_keys(now - ChronoDuration::hours(24))
                .await
            {
                Ok(n) if n > 0 => tracing::info!(expired = n, "idempotency keys expired"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "could not expire idempotency keys"),
            }
        }
        // Measured before the wait for the next change: a quiet spell is
        // not work, and must not delay the round after it.
        let round = round_started.elapsed();
        st.ops().leader_pass("round", round);
        let gap = round_gap(round);
        let waiting = tokio::time::Instant::now();
        let woken_by = tokio::select! {
            _ = changes.changed() => "change",
            _ = control.changed() => "control",
            _ = shutdown.changed() => "shutdown",
            _ = tokio::time::sleep(tick) => "tick",
        };
        let woken = waiting.elapsed();
        tokio::select! {
            _ = shutdown.changed() => {}
            _ = tokio::time::sleep_until(round_started + gap) => {}
        }
        let waited = waiting.elapsed();
        st.ops().leader_pass("wait", waited);
        // By the code above the wait ends within a tick of a change, and at
        // least `gap` after the round began: a much longer one means this
        // task was not woken or not run in time.
        if waited > gap + tick * 2 {
            tracing::warn!(
                waited_ms = waited.as_millis() as u64,
                woken_ms = woken.as_millis() as u64,
                woken_by,
                gap_ms = gap.as_millis() as u64,
                "the reconcile loop's wait overran"
            );
        }
    }
}

/// One round's scheduling step: a pass when `trigger` says one is due;
/// what it found, or `None` when none was due. A failed pass leaves the
/// trigger as it was, so it is due again next round.
pub async fn scheduling_round(
    st: &AppState,
    trigger: &mut PassTrigger,
) -> Result<Option<PassOutcome>, StoreError> {
    let generation = st.change_generation();
    let newest = st.store().newest_waiting().await?;
    if !trigger.due(generation, &newest, st.now()) {
        return Ok(None);
    }
    let outcome = run_pass(st).await?;
    trigger.ran(generation, newest, st.now(), outcome);
    Ok(Some(outcome))
}

/// The periodic billing step, called from the reconcile loop: when due
/// (`ServerConfig::billing_every`) and not already running, spawns one run
/// of spot pricing, budget checks and webhook deliveries, and returns at
/// once. Every part is idempotent, so a run cut short by a crash or a
/// shutdown is simply done again.
pub fn billing_pass(st: &AppState) {
    if !st.billing().start(st.now(), st.config().billing_every) {
        return;
    }
    let st = st.clone();
    tokio::spawn(async move {
        // Clears `running` however the run ends, a panic included, so one
        // bad run never stops billing for good.
        let _running = Running(st.clone());
        let now = st.now();
        match crate::pricing::price_book(st.store(), st.catalog(), now).await {
            Ok(book) => {
                if let Err(e) = crate::pricing::record_spot_prices(st.store(), &book, now).await {
                    tracing::warn!(error = %e, "spot pricing failed; retrying next pass");
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot read the price catalog"),
        }
        if let Err(e) = crate::budgets::check_budgets(&st).await {
            tracing::warn!(error = %e, "budget check failed; retrying next pass");
        }
        if let Err(e) = crate::budgets::deliver_webhooks(&st).await {
            tracing::warn!(error = %e, "webhook delivery failed; retrying next pass");
        }
    });
}

/// Marks the billing step as not running when dropped.
struct Running(AppState);

impl Drop for Running {
    fn drop(&mut self) {
        self.0
            .billing()
            .running
            .store(false, std::sync::atomic::Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_round_holds_the_next_back_at_most_the_cap() {
        assert_eq!(round_gap(Duration::ZERO), MIN_ROUND_GAP);
        assert_eq!(
            round_gap(Duration::from_millis(300)),
            Duration::from_millis(1200)
        );
        // A burst's 15 s round: the next starts 5 s after it began (at
        // once after it ended), not a minute later.
        assert_eq!(round_gap(Duration::from_secs(15)), MAX_ROUND_GAP);
    }
    use chrono::TimeZone;

    #[test]
    fn a_pass_is_due_on_a_change_a_planned_time_or_a_wait_never_on_a_tick() {
        let t = Utc.with_ymd_and_hms(2026, 12, 3, 10, 0, 0).unwrap();
        let none = (None, None);
        let mut p = PassTrigger::default();
        assert!(p.due(0, &none, t), "the first round passes");
        p.ran(0, none.clone(), t, PassOutcome::default());
        // Idle: nothing waits, nothing changes, for an hour of rounds.
        assert!(!p.due(0, &none, t + ChronoDuration::hours(1)));
        // A change on this replica, or new work through any replica.
        assert!(p.due(1, &none, t));
        assert!(p.due(0, &(Some("ins_2".into()), None), t));
        // A blocked head expected to start in 30 s: due then, not before.
        p.ran(
            0,
            none.clone(),
            t,
            PassOutcome {
                placed: 0,
                waiting: 1,
                head_due: Some(t + ChronoDuration::seconds(30)),
                window_opens: None,
            },
        );
        assert!(!p.due(0, &none, t + ChronoDuration::seconds(4)));
        assert!(p.due(0, &none, t + ChronoDuration::seconds(30)));
        // Work waiting and no planned time: at least every few seconds.
        p.ran(
            0,
            none.clone(),
            t,
            PassOutcome {
                placed: 0,
                waiting: 3,
                head_due: None,
                window_opens: None,
            },
        );
        assert!(!p.due(0, &none, t + ChronoDuration::seconds(4)));
        assert!(p.due(0, &none, t + PASS_AT_LEAST_EVERY));
        // An offer window opening in 30 s, with the periodic pass an hour
        // apart: due at the opening, not before.
        let mut p = PassTrigger::new(ChronoDuration::hours(1));
        p.ran(
            0,
            none.clone(),
            t,
            PassOutcome {
                placed: 0,
                waiting: 1,
                head_due: Some(t + ChronoDuration::seconds(90)),
                window_opens: Some(t + ChronoDuration::seconds(30)),
            },
        );
        assert!(!p.due(0, &none, t + ChronoDuration::seconds(29)));
        assert!(p.due(0, &none, t + ChronoDuration::seconds(30)));
    }
}
