//! Time as an input. Decision code receives `now`; whoever calls it chooses
//! the clock (the server the wall clock, the simulator a virtual one).

use chrono::{DateTime, Utc};

/// A source of the current UTC time.
pub trait Clock: Send + Sync {
    /// The current instant, in UTC.
    fn now(&self) -> DateTime<Utc>;
}

/// A clock that only moves when told to: for tests and the simulator.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: std::sync::Arc<std::sync::Mutex<DateTime<Utc>>>,
}

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: DateTime<Utc>) -> Self {
        Self {
            now: std::sync::Arc::new(std::sync::Mutex::new(start)),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: chrono::Duration) {
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        *now += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.now.lock().unwrap_or_else(|e| e.into_inner())
    }
}
