//! Vertical scaling: which GPU class an endpoint's replicas should run on.
//!
//! Horizontal policies change how many replicas run; this one changes what
//! they run on. Two moves, both judged against the endpoint's SLO and the
//! classes' prices and speeds:
//!
//! - **Up** when the SLO is at risk: the observed p95 time to first token
//!   is above `up_at` of the SLO. The GPU-bound part of it (prefill) shrinks
//!   in proportion to a faster class's relative performance; the move goes
//!   to the class with the lowest projected cost that brings the projection
//!   under `target` of the SLO (the fastest class when none does).
//! - **Down** when the endpoint is mostly idle: utilisation below
//!   `down_util` and p95 well under the SLO. The projected monthly cost of
//!   serving the observed work on each class (at least `min_replicas`
//!   replicas, each loaded to `target_util`) decides; the move must save at
//!   least `min_saving` and keep the projected p95 under `target` of the SLO.
//!
//! Moving costs a cold start on the new class, so a recommendation must
//! hold for `sustain_ms` before it becomes a move, and no move follows
//! another within `dwell_ms`. Classes with less memory than the model needs
//! are never chosen.
//!
//! This is the decision core only, pure like the rest of the crate: the
//! caller supplies the classes (from its catalog and price book) and the
//! signals. The server's endpoint loop calls it for endpoints that opt in;
//! the simulator does not.

use serde::{Deserialize, Serialize};

use crate::ScaleError;

/// A GPU class an endpoint could run on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuClass {
    /// Catalog name, e.g. `H100`.
    pub name: String,
    /// Price of one replica (one GPU) per hour, in the price book's
    /// currency. A ranking input only: money is rated elsewhere, exactly.
    pub price_per_hour: f64,
    /// Speed relative to a common reference (the catalog's
    /// `relative_performance`): a class twice as fast does the same
    /// GPU-bound work in half the time.
    pub relative_performance: f64,
    /// GPU memory, GiB.
    pub memory_gib: u32,
}

/// Settings of [`Vertical`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerticalConfig {
    /// GPU memory the model and its cache need; smaller classes are never
    /// chosen.
    pub min_memory_gib: u32,
    /// Move up when p95 TTFT exceeds this fraction of the SLO (0.9).
    pub up_at: f64,
    /// A move must leave the projected p95 under this fraction of the SLO
    /// (0.7).
    pub target: f64,
    /// Consider moving down only below this utilisation (0.3)…
    pub down_util: f64,
    /// …and only while p95 is under this fraction of the SLO (0.5).
    pub down_below: f64,
    /// Utilisation a replica is planned at when costing a class (0.7).
    pub target_util: f64,
    /// Replicas that run whatever the load (1; scale-to-zero endpoints
    /// still pay one replica while serving).
    pub min_replicas: u32,
    /// Smallest relative saving worth a move down (0.15).
    pub min_saving: f64,
    /// How long a recommendation must hold before it is a move (600 s).
    pub sustain_ms: u64,
    /// Least time between moves (1800 s).
    pub dwell_ms: u64,
}

impl Default for VerticalConfig {
    fn default() -> Self {
        Self {
            min_memory_gib: 24,
            up_at: 0.9,
            target: 0.7,
            down_util: 0.3,
            down_below: 0.5,
            target_util: 0.7,
            min_replicas: 1,
            min_saving: 0.15,
            sustain_ms: 600_000,
            dwell_ms: 1_800_000,
        }
    }
}

/// What the endpoint looked like over the last window, on its current
/// class.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct VerticalSignals {
    /// p95 time to first token, ms.
    pub p95_ttft_ms: f64,
    /// Of which GPU-bound (prefill at p95), ms: the part a faster class
    /// shortens.
    pub p95_gpu_ms: f64,
    /// The endpoint's SLO on time to first token, ms.
    pub slo_ms: f64,
    /// Busy fraction of the running replicas, 0–1.
    pub utilisation: f64,
    /// Replicas running.
    pub replicas: u32,
}

/// A decided move.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Move {
    /// Class to move to.
    pub to: String,
    /// Why, in words an operator can check.
    pub reason: String,
}

/// The vertical-scaling state machine of one endpoint.
#[derive(Debug, Clone)]
pub struct Vertical {
    config: VerticalConfig,
    classes: Vec<GpuClass>,
    current: usize,
    /// The recommendation being sustained and since when.
    pending: Option<(usize, u64)>,
    last_move_ms: Option<u64>,
}

impl Vertical {
    /// An endpoint running on `current`, one of `classes`.
    pub fn new(
        config: VerticalConfig,
        classes: Vec<GpuClass>,
        current: &str,
    ) -> Result<Self, ScaleError> {
        let bad = |reason| {
            Err(ScaleError::InvalidConfig {
                field: "vertical",
                reason,
            })
        };
        let fraction = |x: f64| x.is_finite() && x > 0.0 && x <= 1.0;
        let fractions = [
            config.up_at,
            config.target,
            config.down_util,
            config.down_below,
            config.target_util,
        ];
        let saving_ok = config.min_saving.is_finite() && (0.0..1.0).contains(&config.min_saving);
        if !(fractions.into_iter().all(fraction) && saving_ok) {
            return bad("thresholds must be fractions in (0, 1]");
        }
        if classes.iter().any(|c| {
            !(c.price_per_hour.is_finite()
                && c.price_per_hour >= 0.0
                && c.relative_performance.is_finite()
                && c.relative_performance > 0.0)
        }) {
            return bad("every class needs a price >= 0 and a performance > 0");
        }
        let Some(current) = classes.iter().position(|c| c.name == current) else {
            return bad("the current class must be one of the classes");
        };
        Ok(Self {
            config,
            classes,
            current,
            pending: None,
            last_move_ms: None,
        })
    }

    /// The class the endpoint runs on now.
    pub fn current(&self) -> &GpuClass {
        &self.classes[self.current]
    }

    /// Observes the last window at `now_ms`; a move when a recommendation
    /// has held for the sustain period and the last move is a dwell period
    /// old. The caller moves the replicas, then keeps calling.
    pub fn decide(&mut self, now_ms: u64, s: &VerticalSignals) -> Option<Move> {
        let valid = [s.p95_ttft_ms, s.p95_gpu_ms, s.slo_ms, s.utilisation]
            .iter()
            .all(|x| x.is_finite() && *x >= 0.0)
            && s.slo_ms > 0.0
            && s.p95_gpu_ms <= s.p95_ttft_ms;
        let want = if valid { self.recommend(s) } else { None };
        let Some((to, reason)) = want else {
            self.pending = None;
            return None;
        };
        let since = match self.pending {
            Some((p, since)) if p == to => since,
            _ => {
                self.pending = Some((to, now_ms));
                now_ms
            }
        };
        let sustained = now_ms.saturating_sub(since) >= self.config.sustain_ms;
        let dwelt = self
            .last_move_ms
            .is_none_or(|t| now_ms.saturating_sub(t) >= self.config.dwell_ms);
        if !(sustained && dwelt) {
            return None;
        }
        self.current = to;
        self.pending = None;
        self.last_move_ms = Some(now_ms);
        Some(Move {
            to: self.classes[to].name.clone(),
            reason,
        })
    }

    /// Projected p95 TTFT on `c`: the GPU-bound part scales with speed.
    fn projected_p95(&self, s: &VerticalSignals, c: &GpuClass) -> f64 {
        let speedup = c.relative_performance / self.current().relative_performance;
        s.p95_ttft_ms - s.p95_gpu_ms + s.p95_gpu_ms / speedup
    }

    /// Hourly cost of serving the observed work on `c`.
    fn projected_cost(&self, s: &VerticalSignals, c: &GpuClass) -> f64 {
        let work = f64::from(s.replicas) * s.utilisation * self.current().relative_performance;
        let needed = work / (c.relative_performance * self.config.target_util);
        needed.max(f64::from(self.config.min_replicas)) * c.price_per_hour
    }

    /// The class the signals point to now, and why; `None` to stay.
    fn recommend(&self, s: &VerticalSignals) -> Option<(usize, String)> {
        let cfg = &self.config;
        let cur = self.current();
        let fits = |c: &GpuClass| c.memory_gib >= cfg.min_memory_gib;
        if s.p95_ttft_ms > cfg.up_at * s.slo_ms {
            let faster: Vec<usize> = (0..self.classes.len())
                .filter(|&i| {
                    let c = &self.classes[i];
                    fits(c) && c.relative_performance > cur.relative_performance
                })
                .collect();
            let meets =
                |i: &usize| self.projected_p95(s, &self.classes[*i]) <= cfg.target * s.slo_ms;
            let cost = |i: &usize| self.projected_cost(s, &self.classes[*i]);
            let pick = faster
                .iter()
                .copied()
                .filter(meets)
                .min_by(|a, b| cost(a).total_cmp(&cost(b)))
                .or_else(|| {
                    faster.iter().copied().max_by(|a, b| {
                        self.classes[*a]
                            .relative_performance
                            .total_cmp(&self.classes[*b].relative_performance)
                    })
                })?;
            let to = &self.classes[pick];
            return Some((
                pick,
                format!(
                    "p95 time to first token {:.0} ms is over {:.0}% of the {:.0} ms SLO on {}; \
                     {} projects {:.0} ms",
                    s.p95_ttft_ms,
                    cfg.up_at * 100.0,
                    s.slo_ms,
                    cur.name,
                    to.name,
                    self.projected_p95(s, to)
                ),
            ));
        }
        if s.utilisation < cfg.down_util && s.p95_ttft_ms < cfg.down_below * s.slo_ms {
            let now_cost = self.projected_cost(s, cur);
            let pick = (0..self.classes.len())
                .filter(|&i| i != self.current && fits(&self.classes[i]))
                .filter(|&i| self.projected_p95(s, &self.classes[i]) <= cfg.target * s.slo_ms)
                .map(|i| (i, self.projected_cost(s, &self.classes[i])))
                .filter(|&(_, c)| c <= now_cost * (1.0 - cfg.min_saving))
                .min_by(|a, b| a.1.total_cmp(&b.1))?;
            let to = &self.classes[pick.0];
            return Some((
                pick.0,
                format!(
                    "{:.0}% busy on {} at {:.2}/h; {} serves the same work for {:.2}/h \
                     with a projected p95 of {:.0} ms",
                    s.utilisation * 100.0,
                    cur.name,
                    now_cost,
                    to.name,
                    pick.1,
                    self.projected_p95(s, to)
                ),
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A few classes with the catalog's list prices and relative speeds.
    fn classes() -> Vec<GpuClass> {
        [
            ("T4", 0.35, 0.21, 16),
            ("L4", 0.70, 0.39, 24),
            ("L40S", 1.50, 1.16, 48),
            ("A100-80GB", 2.00, 1.00, 80),
            ("H100", 2.99, 3.17, 80),
            ("B200", 5.99, 7.21, 180),
        ]
        .into_iter()
        .map(|(n, p, r, m)| GpuClass {
            name: n.into(),
            price_per_hour: p,
            relative_performance: r,
            memory_gib: m,
        })
        .collect()
    }

    fn on(current: &str) -> Vertical {
        Vertical::new(VerticalConfig::default(), classes(), current).unwrap()
    }

    fn signals(p95: f64, gpu: f64, util: f64, replicas: u32) -> VerticalSignals {
        VerticalSignals {
            p95_ttft_ms: p95,
            p95_gpu_ms: gpu,
            slo_ms: 2000.0,
            utilisation: util,
            replicas,
        }
    }

    const MIN: u64 = 60_000;

    #[test]
    fn a_slow_class_moves_up_only_after_the_signal_holds() {
        let mut v = on("L4");
        // p95 2.4 s against a 2 s SLO, 2 s of it prefill.
        let s = signals(2400.0, 2000.0, 0.9, 4);
        for t in 0..10 {
            assert_eq!(v.decide(t * MIN, &s), None, "minute {t}: still sustaining");
        }
        let m = v.decide(10 * MIN, &s).expect("a move after 10 minutes");
        // L40S projects 400 + 2000 × 0.39/1.16 ≈ 1072 ms, under 70% of the
        // SLO, and serves the load cheapest of the classes that do.
        assert_eq!(m.to, "L40S", "{m:?}");
        assert_eq!(v.current().name, "L40S");
        assert!(m.reason.contains("SLO"), "{}", m.reason);
    }

    #[test]
    fn a_dip_restarts_the_sustain_window() {
        let mut v = on("L4");
        let hot = signals(2400.0, 2000.0, 0.9, 4);
        let calm = signals(900.0, 600.0, 0.6, 4);
        assert_eq!(v.decide(0, &hot), None);
        assert_eq!(v.decide(9 * MIN, &hot), None);
        assert_eq!(v.decide(9 * MIN + 1, &calm), None);
        assert_eq!(v.decide(10 * MIN, &hot), None, "the window restarted");
        assert!(v.decide(20 * MIN, &hot).is_some());
    }

    #[test]
    fn an_idle_fast_class_moves_down_to_the_cheapest_that_keeps_the_slo() {
        let mut v = on("H100");
        // One replica, 5% busy, p95 well under the SLO.
        let s = signals(300.0, 200.0, 0.05, 1);
        assert_eq!(v.decide(0, &s), None);
        let m = v.decide(10 * MIN, &s).expect("a move down");
        // T4 is too small for the model; L4 would project 100 + 200 ×
        // 3.17/0.39 ≈ 1726 ms, over 70% of the SLO; L40S projects ≈ 647 ms
        // at 1.50/h against 2.99/h, the cheapest of those that keep it.
        assert_eq!(m.to, "L40S", "{m:?}");
        assert!(m.reason.contains("busy"), "{}", m.reason);
    }

    #[test]
    fn too_little_memory_is_never_chosen() {
        let mut v = Vertical::new(
            VerticalConfig {
                min_memory_gib: 60,
                ..VerticalConfig::default()
            },
            classes(),
            "H100",
        )
        .unwrap();
        let s = signals(300.0, 200.0, 0.05, 1);
        v.decide(0, &s);
        let m = v.decide(10 * MIN, &s).expect("a move down");
        assert_eq!(m.to, "A100-80GB", "L40S has 48 GiB: {m:?}");
    }

    #[test]
    fn moves_are_a_dwell_period_apart() {
        let mut v = on("L4");
        let hot = signals(2400.0, 2000.0, 0.9, 4);
        v.decide(0, &hot);
        assert!(v.decide(10 * MIN, &hot).is_some());
        // Still over the SLO on the new class (say the load grew).
        let hotter = signals(2600.0, 2000.0, 0.95, 8);
        v.decide(11 * MIN, &hotter);
        assert_eq!(v.decide(25 * MIN, &hotter), None, "within 30 min of a move");
        assert!(v.decide(40 * MIN, &hotter).is_some());
    }

    #[test]
    fn a_comfortable_endpoint_and_bad_readings_stay_put() {
        let mut v = on("H100");
        let fine = signals(800.0, 300.0, 0.6, 6);
        let nan = signals(f64::NAN, 1.0, 0.1, 1);
        let inverted = signals(100.0, 500.0, 0.1, 1);
        for t in 0..60 {
            assert_eq!(v.decide(t * MIN, &fine), None);
            assert_eq!(v.decide(t * MIN, &nan), None);
            assert_eq!(v.decide(t * MIN, &inverted), None);
        }
        assert_eq!(v.current().name, "H100");
    }

    #[test]
    fn bad_configuration_is_refused() {
        assert!(Vertical::new(VerticalConfig::default(), classes(), "V100").is_err());
        let bad = VerticalConfig {
            target: 1.5,
            ..VerticalConfig::default()
        };
        assert!(Vertical::new(bad, classes(), "H100").is_err());
        let mut cs = classes();
        cs[0].relative_performance = 0.0;
        assert!(Vertical::new(VerticalConfig::default(), cs, "H100").is_err());
    }
}
