//! What the periodic billing step (spot prices, budget checks, webhook
//! deliveries: [`crate::reconcile`] runs it) remembers between runs, in
//! memory: when it last ran, whether a run is under way, and whose spend
//! may have changed since the last budget check. Plain state, so that
//! [`crate::state::AppState`] can hold it without importing the code that
//! runs the step.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use chrono::{DateTime, Datelike, Duration, Utc};
use flotilla_core::id::TenantId;

/// State of the periodic billing step.
#[derive(Debug, Default)]
pub struct Runtime {
    last: Mutex<Option<DateTime<Utc>>>,
    pub(crate) running: AtomicBool,
    /// Tenants whose spend may have changed since the last budget check.
    pub budgets: BudgetWatch,
}

impl Runtime {
    /// True (and remembers `now`) when a step is due and none is running.
    pub(crate) fn start(&self, now: DateTime<Utc>, every: std::time::Duration) -> bool {
        let every = Duration::from_std(every).unwrap_or(Duration::seconds(30));
        let mut last = match self.last.lock() {
            Ok(l) => l,
            Err(poisoned) => poisoned.into_inner(),
        };
        if last.is_some_and(|l| now - l < every) {
            return false;
        }
        if self.running.swap(true, Ordering::AcqRel) {
            return false;
        }
        *last = Some(now);
        true
    }
}

/// Which tenants' spend may have changed since the last budget check, so
/// that a check rates only those instead of every budgeted tenant's month.
/// New usage is seen in the store's usage marks (bumped by every append
/// that records events, whoever made it: this server, another replica, a
/// tool writing to the store); the rest is touched here by what changes
/// spend on this server: a budget set, terms added (one tenant), a price
/// version published (everyone). In memory: a restart starts with a full
/// check.
#[derive(Debug, Default)]
pub struct BudgetWatch(std::sync::Mutex<WatchState>);

#[derive(Debug, Default)]
struct WatchState {
    dirty: BTreeSet<TenantId>,
    all: bool,
    last_full: Option<DateTime<Utc>>,
    /// The usage marks as of the last check.
    seen: HashMap<TenantId, i64>,
}

/// The budgets one check rates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every budget.
    All,
    /// Only these tenants' (possibly none).
    Only(BTreeSet<TenantId>),
}

impl Scope {
    pub(crate) fn covers(&self, t: &TenantId) -> bool {
        match self {
            Scope::All => true,
            Scope::Only(set) => set.contains(t),
        }
    }
}

impl BudgetWatch {
    fn state(&self) -> std::sync::MutexGuard<'_, WatchState> {
        // Every update is a whole insert or swap: a poisoned lock holds
        // nothing half-written.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `tenants`' spend may have changed.
    pub fn touch<'a>(&self, tenants: impl IntoIterator<Item = &'a TenantId>) {
        let mut s = self.state();
        for t in tenants {
            if !s.dirty.contains(t) {
                s.dirty.insert(t.clone());
            }
        }
    }

    /// Everyone's spend may have changed (prices).
    pub fn touch_all(&self) {
        self.state().all = true;
    }

    /// The scope of a check at `now`, forgetting what it covers: every
    /// budget on the first check, when the month changed since the last
    /// full check (spend restarts, and monthly commitments bill from the
    /// first day), when prices changed, and at least every `full_every`;
    /// else only the tenants touched since the last check and those whose
    /// usage mark moved (`marks`: the store's, read for this check).
    pub fn take(
        &self,
        now: DateTime<Utc>,
        full_every: Duration,
        marks: HashMap<TenantId, i64>,
    ) -> Scope {
        let mut s = self.state();
        for (t, m) in &marks {
            if s.seen.get(t) != Some(m) {
                s.dirty.insert(t.clone());
            }
        }
        s.seen = marks;
        let full = s.all
            || s.last_full.is_none_or(|l| {
                now - l >= full_every || (l.year(), l.month()) != (now.year(), now.month())
            });
        if full {
            s.all = false;
            s.last_full = Some(now);
            s.dirty.clear();
            Scope::All
        } else {
            Scope::Only(std::mem::take(&mut s.dirty))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_billing_step_starts_when_due_and_never_twice_at_once() {
        let rt = Runtime::default();
        let t0 = DateTime::<Utc>::UNIX_EPOCH;
        let every = std::time::Duration::from_secs(10);
        assert!(rt.start(t0, every));
        // Running: not again, even when due.
        assert!(!rt.start(t0 + Duration::seconds(20), every));
        rt.running.store(false, Ordering::Release);
        assert!(!rt.start(t0 + Duration::seconds(5), every), "not due yet");
        assert!(rt.start(t0 + Duration::seconds(10), every));
    }
}
