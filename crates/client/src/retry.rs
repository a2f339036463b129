//! The retry policy: how often, and how long apart, a request that failed
//! in a way that may pass is tried again.

use std::time::Duration;

/// How a failed idempotent request is retried. Only requests that are
/// safe to repeat are retried (GET, PUT, DELETE, and POSTs with an
/// `Idempotency-Key`), only on failures that may pass (see
/// [`crate::Error::is_transient`]), and never sooner than the server's
/// `Retry-After`; a `Retry-After` longer than [`RetryPolicy::max_delay`] is
/// not waited for: the error goes back to the caller, who knows whether
/// waiting that long is worth it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Tries in all, the first included (1: never retry).
    pub attempts: u32,
    /// Wait before the first retry; it doubles for each one after.
    pub base_delay: Duration,
    /// Longest wait between two tries.
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    /// Three tries, 300 ms then 600 ms apart (at most 5 s): enough to ride
    /// out a server restart or a replica failover without hanging a person
    /// at a terminal.
    fn default() -> Self {
        Self {
            attempts: 3,
            base_delay: Duration::from_millis(300),
            max_delay: Duration::from_secs(5),
        }
    }
}

impl RetryPolicy {
    /// One try, no retry: for callers that run their own backoff loop (the
    /// agent). Failover across server URLs still happens within the try.
    pub const fn none() -> Self {
        Self {
            attempts: 1,
            base_delay: Duration::ZERO,
            max_delay: Duration::ZERO,
        }
    }

    /// The wait before try number `attempt + 1` after try `attempt`
    /// (1-based) failed, given the server's `Retry-After`; `None` when no
    /// further try should be made.
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Option<Duration> {
        if attempt >= self.attempts {
            return None;
        }
        let doubling = 2u32.saturating_pow(attempt.saturating_sub(1));
        let backoff = self.base_delay.saturating_mul(doubling).min(self.max_delay);
        match retry_after {
            Some(wait) if wait > self.max_delay => None,
            Some(wait) => Some(wait.max(backoff)),
            None => Some(backoff),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_cap_and_stop_after_the_last_try() {
        let p = RetryPolicy {
            attempts: 5,
            base_delay: Duration::from_millis(300),
            max_delay: Duration::from_secs(1),
        };
        let d: Vec<Option<u128>> = (1..=5)
            .map(|a| p.delay(a, None).map(|d| d.as_millis()))
            .collect();
        assert_eq!(d, vec![Some(300), Some(600), Some(1000), Some(1000), None]);
        assert_eq!(RetryPolicy::none().delay(1, None), None);
    }

    #[test]
    fn retry_after_is_honoured_within_the_cap() {
        let p = RetryPolicy::default();
        let s = Duration::from_secs;
        assert_eq!(p.delay(1, Some(s(2))), Some(s(2)));
        // Never sooner than the backoff either.
        assert_eq!(
            p.delay(2, Some(Duration::ZERO)),
            Some(Duration::from_millis(600))
        );
        // Longer than the cap: the caller decides.
        assert_eq!(p.delay(1, Some(s(60))), None);
    }
}
