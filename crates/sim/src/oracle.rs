//! The oracle: a lower bound on the GPU-seconds that any policy — even one
//! that knows the whole trace in advance — needs to serve every request
//! within the SLO, given the service model and the cold start.
//!
//! Request `i` arrives at `a`, needs prefill `p` and holds a slot for `s`
//! (prefill + decode). To meet the SLO it must start by `a + slo − p`, so
//! whatever the schedule it is in service throughout the **mandatory
//! interval** `[a + slo − p, a + s]` (empty when decode is short). Let
//! `m(t)` count mandatory intervals at `t`; a replica has `C` slots, so at
//! every `t` at least `n(t) = ceil(m(t) / C)` replicas are up and ready.
//! Requests that cannot meet the SLO even when served at once (`p > slo`)
//! are left out, which only lowers the bound.
//!
//! Two bounds, the answer is the larger (each is valid, so the larger is):
//!
//! 1. **Envelope with cold starts.** A policy's cost is `∫R + ∫S` with `R`
//!    the ready (or draining) and `S` the starting replicas. Cut `n` into
//!    levels `j = 1, 2, ...`. Every time `R` rises through a level a replica
//!    became ready, after a cold start of at least `H` (the shortest cold
//!    start the model draws), and distinct rises are distinct replicas, so
//!    `∫S ≥ H × rises`. For each level, the time where `n ≥ j` is paid in
//!    `∫R`; across each gap of length `g` between two such stretches (and
//!    from time 0 to the first), `R` either stayed at `≥ j` (`g` more of
//!    `∫R`) or dropped and rose again (`H` more of `∫S`): at least
//!    `min(g, H)`. Summing over levels and gaps bounds the cost.
//! 2. **Work in windows.** Cut time into windows of width `W`; a request
//!    whose whole feasible span `[a, a + slo − p + s]` lies in one window
//!    does all of its `s` of work there, so `∫R` over the window is at
//!    least that work divided by `C`, and at least `∫n` over the window.
//!    The sum over windows of the larger bounds `∫R`. This catches short
//!    requests whose mandatory interval is empty. Taken for `W` of 10 s,
//!    30 s, 60 s and 300 s, keeping the largest sum.

use crate::service::ServiceModel;
use crate::trace::Trace;

/// The oracle's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Oracle {
    /// The lower bound, GPU-milliseconds.
    pub gpu_ms: u64,
    /// Bound 1 (envelope with cold starts), GPU-milliseconds.
    pub envelope_ms: u64,
    /// Bound 2 (work in windows), GPU-milliseconds.
    pub work_ms: u64,
    /// Peak of `n(t)`: the fewest replicas the busiest moment needs.
    pub peak_replicas: u32,
}

/// Window widths tried by bound 2.
const WINDOWS_MS: [u64; 4] = [10_000, 30_000, 60_000, 300_000];

/// The lower bound for `trace` under `service`, an SLO on time to first
/// token of `slo_ms` and a shortest cold start of `min_cold_ms`.
pub fn lower_bound(trace: &Trace, service: &ServiceModel, slo_ms: u64, min_cold_ms: u64) -> Oracle {
    let c = u64::from(service.max_concurrency.max(1));
    // Mandatory intervals as +1/−1 steps.
    let mut steps: Vec<(u64, i32)> = Vec::new();
    for r in trace.requests() {
        let p = service.prefill_ms(r);
        if p > slo_ms {
            continue;
        }
        let (from, to) = (
            r.arrival_ms + slo_ms - p,
            r.arrival_ms + service.service_ms(r),
        );
        if to > from {
            steps.push((from, 1));
            steps.push((to, -1));
        }
    }
    // Ends before starts at the same time: a slot freed can be reused.
    steps.sort_unstable();
    // The envelope n(t) as segments (from, to, n).
    let mut segments: Vec<(u64, u64, u64)> = Vec::new();
    let (mut m, mut t_prev) = (0i64, 0u64);
    for &(t, d) in &steps {
        if t > t_prev {
            let n = (m.max(0) as u64).div_ceil(c);
            match segments.last_mut() {
                Some(last) if last.2 == n && last.1 == t_prev => last.1 = t,
                _ => segments.push((t_prev, t, n)),
            }
            t_prev = t;
        }
        m += i64::from(d);
    }

    // Bound 1: per level, stretches plus min(gap, H) before each.
    let h = min_cold_ms;
    let peak = segments.iter().map(|s| s.2).max().unwrap_or(0);
    let mut below_since = vec![0u64; peak as usize + 1];
    let mut up_since = vec![0u64; peak as usize + 1];
    let (mut level, mut envelope) = (0u64, 0u64);
    for &(from, _, n) in &segments {
        if n > level {
            for j in level + 1..=n {
                envelope += (from - below_since[j as usize]).min(h);
                up_since[j as usize] = from;
            }
        } else {
            for j in n + 1..=level {
                envelope += from - up_since[j as usize];
                below_since[j as usize] = from;
            }
        }
        level = n;
    }
    let end = segments.last().map_or(0, |s| s.1);
    for j in 1..=level {
        envelope += end - up_since[j as usize];
    }

    // Bound 2: work in windows.
    let mut work = 0u64;
    for w in WINDOWS_MS {
        let windows = (trace.duration_ms() + 2 * slo_ms + 3_600_000) / w + 2;
        let mut slot_ms = vec![0u64; windows as usize];
        for r in trace.requests() {
            let p = service.prefill_ms(r);
            if p > slo_ms {
                continue;
            }
            let s = service.service_ms(r);
            let k = r.arrival_ms / w;
            if r.arrival_ms + (slo_ms - p) + s <= (k + 1) * w {
                if let Some(x) = slot_ms.get_mut(k as usize) {
                    *x += s;
                }
            }
        }
        let mut env = vec![0u64; windows as usize];
        for &(from, to, n) in &segments {
            let mut t = from;
            while t < to {
                let k = t / w;
                let until = to.min((k + 1) * w);
                if let Some(x) = env.get_mut(k as usize) {
                    *x += (until - t) * n;
                }
                t = until;
            }
        }
        let sum: u64 = slot_ms
            .iter()
            .zip(&env)
            .map(|(&s, &e)| s.div_ceil(c).max(e))
            .sum();
        work = work.max(sum);
    }
    Oracle {
        gpu_ms: envelope.max(work),
        envelope_ms: envelope,
        work_ms: work,
        peak_replicas: u32::try_from(peak).unwrap_or(u32::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Request;

    fn svc() -> ServiceModel {
        ServiceModel {
            gpu: "H100".into(),
            prefill_tokens_per_s: 1_000.0,
            decode_tokens_per_s: 10.0,
            max_concurrency: 2,
        }
    }

    fn req(t: u64, input: u32, output: u32) -> Request {
        Request {
            arrival_ms: t,
            input_tokens: input,
            output_tokens: output,
        }
    }

    #[test]
    fn one_long_request_needs_one_replica_for_its_mandatory_time() {
        // p = 100 ms, s = 100 + 10,000 ms; SLO 1 s: mandatory [900, 10,100].
        let t = Trace::new("t", vec![req(0, 100, 100)]).unwrap();
        let o = lower_bound(&t, &svc(), 1_000, 5_000);
        assert_eq!(o.peak_replicas, 1);
        // Level 1: lead-in min(900, 5,000) + 9,200 of service.
        assert_eq!(o.envelope_ms, 900 + 9_200);
        // Work bound: 10,100 slot-ms / 2 slots.
        assert!(o.work_ms >= 5_050);
        assert_eq!(o.gpu_ms, 10_100);
    }

    #[test]
    fn gaps_cost_the_cheaper_of_waiting_and_restarting() {
        let reqs = vec![req(0, 100, 100), req(100_000, 100, 100)];
        let t = Trace::new("t", reqs).unwrap();
        let far = lower_bound(&t, &svc(), 1_000, 5_000);
        // Two stretches of 9,200, the gap (≈ 90 s) costs one cold start.
        assert_eq!(far.envelope_ms, 900 + 9_200 + 5_000 + 9_200);
        let slow = lower_bound(&t, &svc(), 1_000, 500_000);
        assert_eq!(slow.envelope_ms, 900 + 9_200 + (100_900 - 10_100) + 9_200);
    }

    #[test]
    fn concurrency_packs_requests_and_short_requests_count_as_work() {
        let many: Vec<Request> = (0..4).map(|_| req(0, 100, 100)).collect();
        let t = Trace::new("t", many).unwrap();
        assert_eq!(lower_bound(&t, &svc(), 1_000, 0).peak_replicas, 2);
        // Short requests: no mandatory time, but 100 of them hold
        // 100 × 200 ms of slot time within the first 10 s window.
        let short: Vec<Request> = (0..100).map(|i| req(i * 10, 100, 1)).collect();
        let t = Trace::new("t", short).unwrap();
        let o = lower_bound(&t, &svc(), 1_000, 0);
        assert_eq!(o.envelope_ms, 0);
        assert_eq!(o.work_ms, 100 * 200 / 2);
    }

    #[test]
    fn requests_that_cannot_meet_the_slo_are_left_out() {
        let t = Trace::new("t", vec![req(0, 5_000, 100)]).unwrap();
        assert_eq!(lower_bound(&t, &svc(), 1_000, 1_000).gpu_ms, 0);
    }
}
