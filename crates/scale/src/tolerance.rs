//! The tiered policy's queue tolerance, learned online from measured
//! prefill and restore times instead of fixed by a sweep.
//!
//! The warm side of [`crate::TieredFlotilla`] lets a queue wait for the
//! ready replicas for up to the *queue tolerance* before it counts as
//! demand. A request that waits that long and is then met by a replica
//! restored from host memory starts after `tolerance + tick + restore` and
//! has its first token a prefill later, so the tolerance is what the SLO
//! leaves after those:
//!
//! `tolerance = SLO − q(restore) − tick − q(prefill)`
//!
//! with `q` high quantiles of what this endpoint has measured
//! ([`QueueTolerance`]). Both are tracked by [`DecayingQuantile`], a
//! histogram whose weights decay with time, so the estimate follows a
//! change of workload within minutes and old samples fade.
//!
//! Prefill samples the tolerance cannot protect are left out: a request
//! whose prefill alone takes longer than the SLO less a restore and a tick
//! misses whenever it has to wait for a restore, however short the
//! tolerance (only a free slot on arrival saves it, and that is headroom,
//! not tolerance). Reserving for such prompts would only idle GPUs for
//! requests that miss anyway — on a trace where one request in ten has a
//! prompt longer than the SLO can prefill, a quantile over every sample
//! would drive the tolerance to zero.
//!
//! Before the first sample the priors are the constant this replaced: a
//! tenth of the SLO for the prefill and the configured restore time. Pure:
//! the caller passes the time with every sample.

use serde::{Deserialize, Serialize};

use crate::observe::Timing;

/// Width of a histogram bucket, ms: quantiles are exact to this.
const BUCKET_MS: u64 = 10;

/// Time constant of the estimates' forgetting, ms: ten minutes, the
/// policy's long-run time constant.
pub const TOLERANCE_TIME_CONSTANT_MS: u64 = 600_000;

/// Quantile of prefill times reserved: the tolerance protects a request
/// only in its worst case (a full wait, then a restore), so nine in ten
/// requests that meet that worst case still make the SLO; the rest of
/// those rare requests are the price of not idling a GPU for every short
/// queue. On the Azure conversation trace it reserves about 180 ms, on the
/// code trace about 350 ms.
pub const PREFILL_QUANTILE: f64 = 0.9;

/// Quantile of restore times reserved: every request the tolerance lets
/// wait pays a whole restore when one is needed, so nearly all of them.
pub const RESTORE_QUANTILE: f64 = 0.99;

/// Share of the SLO assumed for a prefill before any is measured: the
/// reserve of the constant tolerance this estimate replaced.
pub const PREFILL_PRIOR_SHARE: f64 = 0.1;

/// A quantile of durations, from a histogram of `BUCKET_MS`-wide buckets
/// up to a ceiling whose weights decay by `e^(−Δt/τ)`. A sample counts in
/// the bucket its duration rounds up to; samples above the ceiling count
/// at the ceiling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecayingQuantile {
    weights: Vec<f64>,
    total: f64,
    time_constant_ms: u64,
    at_ms: Option<u64>,
}

impl DecayingQuantile {
    /// An empty estimate for durations up to `max_ms`, forgetting with
    /// time constant `time_constant_ms` (at least 1 ms).
    pub fn new(max_ms: u64, time_constant_ms: u64) -> Self {
        Self {
            weights: vec![0.0; (max_ms.div_ceil(BUCKET_MS) + 1) as usize],
            total: 0.0,
            time_constant_ms: time_constant_ms.max(1),
            at_ms: None,
        }
    }

    /// Decay every weight to `now_ms` (a time that goes backwards counts
    /// as no time passing).
    fn decay_to(&mut self, now_ms: u64) {
        let dt = match self.at_ms {
            Some(at) if now_ms > at => now_ms - at,
            Some(_) => return,
            None => 0,
        };
        self.at_ms = Some(now_ms);
        if dt == 0 {
            return;
        }
        let f = (-(dt as f64) / self.time_constant_ms as f64).exp();
        for w in &mut self.weights {
            *w *= f;
        }
        self.total *= f;
    }

    /// Add a sample of `ms` with `weight` (finite and positive, else
    /// ignored) at `now_ms`.
    pub fn add(&mut self, now_ms: u64, ms: u64, weight: f64) {
        self.decay_to(now_ms);
        if !(weight.is_finite() && weight > 0.0) {
            return;
        }
        let last = self.weights.len() - 1;
        let i = (ms.div_ceil(BUCKET_MS) as usize).min(last);
        self.weights[i] += weight;
        self.total += weight;
    }

    /// The `q`-quantile (`0..=1`), rounded up to a multiple of the bucket
    /// width; `None` before any sample.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        if self.total <= 0.0 {
            return None;
        }
        let want = q.clamp(0.0, 1.0) * self.total;
        let mut seen = 0.0;
        for (i, w) in self.weights.iter().enumerate() {
            seen += w;
            if seen >= want && *w > 0.0 {
                return Some(i as u64 * BUCKET_MS);
            }
        }
        let top = self.weights.iter().rposition(|w| *w > 0.0).unwrap_or(0);
        Some(top as u64 * BUCKET_MS)
    }
}

/// The queue tolerance of the tiered policy's warm side (module
/// documentation), or a fixed one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueueTolerance {
    slo_ms: u64,
    tick_ms: u64,
    prefill: DecayingQuantile,
    restore: DecayingQuantile,
    /// A fixed tolerance instead of the estimate (for comparisons).
    fixed: Option<u64>,
}

impl QueueTolerance {
    /// Learned online for an SLO of `slo_ms`, decisions every `tick_ms`
    /// and a configured restore of `restore_ms` (the prior until restores
    /// are measured).
    pub fn learned(slo_ms: u64, tick_ms: u64, restore_ms: u64) -> Self {
        let mut t = Self {
            slo_ms,
            tick_ms,
            prefill: DecayingQuantile::new(slo_ms, TOLERANCE_TIME_CONSTANT_MS),
            restore: DecayingQuantile::new(slo_ms, TOLERANCE_TIME_CONSTANT_MS),
            fixed: None,
        };
        // Priors: one sample each at time 0, forgotten like any other.
        let prefill_prior = (PREFILL_PRIOR_SHARE * slo_ms as f64).ceil() as u64;
        t.prefill.add(0, prefill_prior, 1.0);
        t.restore.add(0, restore_ms, 1.0);
        t
    }

    /// A tolerance fixed at `ms`, whatever is measured.
    pub fn fixed(ms: u64) -> Self {
        Self {
            fixed: Some(ms),
            ..Self::learned(0, 0, 0)
        }
    }

    /// Learn from `timing`, measured at `now_ms`.
    pub fn record(&mut self, now_ms: u64, timing: Timing) {
        match timing {
            Timing::Restore { ms } => self.restore.add(now_ms, ms, 1.0),
            Timing::Prefill { ms } => {
                // Only prompts a wait for a restore can still serve in time
                // (module documentation).
                let room = self
                    .slo_ms
                    .saturating_sub(self.restore_ms())
                    .saturating_sub(self.tick_ms);
                if ms <= room {
                    self.prefill.add(now_ms, ms, 1.0);
                }
            }
        }
    }

    /// The restore time reserved, ms.
    pub fn restore_ms(&self) -> u64 {
        self.restore.quantile(RESTORE_QUANTILE).unwrap_or(0)
    }

    /// The prefill time reserved, ms.
    pub fn prefill_ms(&self) -> u64 {
        self.prefill.quantile(PREFILL_QUANTILE).unwrap_or(0)
    }

    /// The tolerance now, ms: what the SLO leaves after a restore, a tick
    /// and a prefill (never below zero).
    pub fn tolerance_ms(&self) -> u64 {
        if let Some(ms) = self.fixed {
            return ms;
        }
        self.slo_ms
            .saturating_sub(self.restore_ms())
            .saturating_sub(self.tick_ms)
            .saturating_sub(self.prefill_ms())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_exact_to_a_bucket_and_forget_with_time() {
        let mut q = DecayingQuantile::new(2_000, 600_000);
        assert_eq!(q.quantile(0.9), None);
        for ms in 0..100u64 {
            q.add(0, ms * 10, 1.0); // 0, 10, ..., 990 ms
        }
        assert_eq!(q.quantile(0.9), Some(890));
        assert_eq!(q.quantile(0.5), Some(490));
        // Above the ceiling counts at the ceiling.
        q.add(0, 60_000, 1_000.0);
        assert_eq!(q.quantile(0.5), Some(2_000));
        // An hour later (six time constants) 100 new samples of 100 ms
        // outweigh all of that: e^−6 × 1,100 ≈ 2.7.
        for _ in 0..100 {
            q.add(3_600_000, 100, 1.0);
        }
        assert_eq!(q.quantile(0.9), Some(100));
        // Nonsense weights are ignored, never a panic.
        q.add(3_600_000, 5, f64::NAN);
        q.add(3_600_000, 5, -1.0);
        assert_eq!(q.quantile(0.9), Some(100));
    }

    #[test]
    fn priors_give_the_old_constant() {
        // 2 s SLO, 205 ms ticks, 820 ms restore: 2,000 − 820 − 205 − 200.
        let t = QueueTolerance::learned(2_000, 205, 820);
        assert_eq!(t.restore_ms(), 820);
        assert_eq!(t.prefill_ms(), 200);
        assert_eq!(t.tolerance_ms(), 775);
    }

    #[test]
    fn long_prefills_shrink_it_and_hopeless_ones_do_not() {
        let mut t = QueueTolerance::learned(2_000, 205, 820);
        // Prompts of 400 ms, one in twenty of 600 ms: the 90 % reserve
        // follows them.
        for i in 0..1_000u64 {
            let ms = if i % 20 == 0 { 600 } else { 400 };
            t.record(i * 10, Timing::Prefill { ms });
        }
        assert_eq!(t.prefill_ms(), 400);
        assert_eq!(t.tolerance_ms(), 2_000 - 820 - 205 - 400);
        // One in ten needs more than the SLO to prefill: they miss
        // whatever the queue does, and change nothing.
        let before = t.tolerance_ms();
        for i in 0..10_000u64 {
            let ms = if i % 10 == 0 { 2_500 } else { 400 };
            t.record(10_000 + i, Timing::Prefill { ms });
        }
        assert_eq!(t.tolerance_ms(), before);
        // Slower restores come out of the tolerance.
        for i in 0..100u64 {
            t.record(20_000 + i, Timing::Restore { ms: 1_199 });
        }
        assert_eq!(t.restore_ms(), 1_200);
        assert_eq!(t.tolerance_ms(), 2_000 - 1_200 - 205 - 400);
        // Restores longer than the SLO leave no tolerance, without
        // underflow.
        for i in 0..1_000u64 {
            t.record(30_000 + i, Timing::Restore { ms: 5_000 });
        }
        assert_eq!(t.tolerance_ms(), 0);
        assert_eq!(QueueTolerance::fixed(775).tolerance_ms(), 775);
    }
}
