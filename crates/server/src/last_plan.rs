//! The last plan a scheduling pass made, kept for the readers that only
//! need to know what it decided: `GET /v1/instances/queue` and
//! `GET /v1/jobs/queue` (the queue's order) and the node-pool loop (the
//! work that fits nowhere). Without it each of them gathered the whole
//! snapshot from the store and planned again, once per request and once
//! per pool per tick.
//!
//! A kept plan serves only while it is current: made at this replica's
//! present change generation (it grows with every change signalled,
//! `AppState::notify_change`, and every API request that may have written,
//! `AppState::note_write`) and no older than
//! [`MAX_AGE`], which bounds how long a change made through another replica
//! (whose signal this one does not see) can go unseen. Otherwise the reader
//! plans afresh (`crate::schedule::current_plan`) and keeps that.
//!
//! A leaf: core and sched types only, so that the state can hold it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use flotilla_core::id::WorkId;
use flotilla_sched::Runtime;

/// The longest a kept plan serves readers.
pub const MAX_AGE: Duration = Duration::from_secs(2);

/// Waiting work the plan fits nowhere: what a node pool may grow for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unfit {
    /// Members placed together.
    pub members: u32,
    /// GPUs per member (a share counts one).
    pub gpus: u32,
    /// Acceptable GPU models; empty: any.
    pub models: Vec<String>,
    /// The runtime its machines must run.
    pub runtime: Runtime,
}

/// What one pass decided, for readers.
#[derive(Debug, Clone, PartialEq)]
pub struct LastPlan {
    /// The change generation its snapshot was gathered at.
    pub generation: u64,
    /// When it was made.
    pub at: DateTime<Utc>,
    /// Waiting work in the order the scheduler tries it.
    pub order: Vec<WorkId>,
    /// Waiting work that fits nowhere now (or never in this pool).
    pub unfit: Vec<Unfit>,
}

/// The kept plan of one replica.
#[derive(Debug, Default)]
pub struct Kept(Mutex<Option<Arc<LastPlan>>>);

impl Kept {
    /// The kept plan, if it is current at `generation` and `now`.
    pub fn current(&self, generation: u64, now: DateTime<Utc>) -> Option<Arc<LastPlan>> {
        let kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let plan = kept.as_ref()?;
        let age = (now - plan.at).to_std().unwrap_or(Duration::ZERO);
        (plan.generation == generation && age <= MAX_AGE).then(|| plan.clone())
    }

    /// Keeps `plan` unless a newer one is kept already.
    pub fn keep(&self, plan: LastPlan) -> Arc<LastPlan> {
        let plan = Arc::new(plan);
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let newer = kept
            .as_ref()
            .is_some_and(|k| (k.generation, k.at) > (plan.generation, plan.at));
        if !newer {
            *kept = Some(plan.clone());
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn plan(generation: u64, at: DateTime<Utc>) -> LastPlan {
        LastPlan {
            generation,
            at,
            order: Vec::new(),
            unfit: Vec::new(),
        }
    }

    #[test]
    fn a_kept_plan_serves_until_a_change_or_its_age() {
        let t = Utc.with_ymd_and_hms(2026, 12, 3, 10, 0, 0).unwrap();
        let k = Kept::default();
        assert!(k.current(0, t).is_none(), "nothing kept yet");
        k.keep(plan(3, t));
        assert!(k.current(3, t + chrono::Duration::seconds(2)).is_some());
        assert!(k.current(4, t).is_none(), "a change since");
        assert!(
            k.current(3, t + chrono::Duration::milliseconds(2001))
                .is_none(),
            "too old"
        );
        // An older plan (a slow reader's) never replaces a newer one.
        k.keep(plan(2, t));
        assert_eq!(k.current(3, t).unwrap().generation, 3);
    }
}
