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
//! Every replica that becomes ready spent at least `H` starting, `H` the
//! cold-start delay the bound is taken for: the shortest cold start the
//! model can draw (the **strict** bound, valid for every realisation of the
//! cold starts) or a fixed delay such as the setting's median (the
//! **fixed-delay** bound: valid for any policy facing that fixed delay;
//! the benchmark's ratio column). A policy's cost is `∫R + ∫S` with `R` the
//! ready (or draining) and `S` the starting replicas; cut `R` into levels
//! `j = 1, 2, ...` (level `j` is "up" while `R ≥ j`). Each time level `j`
//! goes up, a distinct replica became ready, so `∫S ≥ H × (rises)`.
//! Replicas already up at time 0 (kept from the unmeasured warm-up) are
//! free, and one starting then is paid only from 0. Three bounds, the answer is the largest (each is valid):
//!
//! 1. **Envelope with cold starts.** Level `j` is up wherever `n ≥ j`,
//!    which is paid in `∫R`; across each gap of length `g` between two such
//!    stretches (and from time 0 to the first), level `j` either stayed up
//!    (`g` more of `∫R`) or went down and up again (`H` more of `∫S`): at
//!    least `min(g, H)`.
//! 2. **Work in windows.** Cut time into windows of width `W`. A request's
//!    feasible span is `[a, a + slack + s]` with `slack = slo − p`; its `s`
//!    of slot time lies in the span, so at least `overlap − slack` of it
//!    lies in any window the span overlaps by `overlap`. Slot time in a
//!    window divided by `C` is replica time in it: `∫R` over window `k` is
//!    at least `w_k = max(work_k / C, ∫n over the window)`, and the sum over
//!    windows bounds `∫R`.
//! 3. **Work with cold starts.** In window `k`, `∫R ≥ w_k` forces `R` to
//!    reach `L_k = max(ceil(w_k / W), max n)` somewhere in the window:
//!    level `j ≤ L_k` is touched there. Between two windows `k < k'` that
//!    touch level `j` with `G = k' − k − 1` windows between (none of which
//!    touches it), level `j` either stayed up through those windows or went
//!    down and up. Staying up through window `m` of the gap means `R ≥ j >
//!    L_m` throughout it, so `∫R` there is at least `j × W ≥ w_m + W`: the
//!    level costs a full `W` over what `w_m` already counts. So the cost is
//!    at least `Σ w_k + Σ_levels Σ_gaps min(G × W, H)`. Before a level's
//!    first window `k` the gap counts `k − 1` windows: a replica already
//!    starting at time 0 (in the warm-up) is paid only from 0, so it costs
//!    its remaining start plus the whole windows it then stays up, at least
//!    `(k − 1) × W`. Distinct levels and gaps are distinct rises and
//!    distinct replica-time, so the terms add up.
//!
//! Bounds 2 and 3 are taken for `W` of 2 s, 5 s, 10 s, 30 s and 60 s,
//! keeping the largest; bound 3 is at least bound 2 for the same `W`.
//!
//! [`tiered_lower_bound`] is the same reasoning for schedules that may also
//! park replicas in host memory and restore them: a rise costs a restore
//! of GPU time instead of a cold start, and a level let down keeps its
//! weights parked (at the memory price) or fetches them again.

use crate::service::ServiceModel;
use crate::trace::Trace;

/// The oracle's answer for one cold-start delay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Oracle {
    /// The cold-start delay the bound was taken for, milliseconds.
    pub cold_start_ms: u64,
    /// The lower bound (the largest of the three), GPU-milliseconds.
    pub gpu_ms: u64,
    /// Bound 1 (envelope with cold starts), GPU-milliseconds.
    pub envelope_ms: u64,
    /// Bound 2 (work in windows), GPU-milliseconds.
    pub work_ms: u64,
    /// Bound 3 (work with cold starts), GPU-milliseconds.
    pub work_cold_ms: u64,
    /// Peak of `n(t)`: the fewest replicas the busiest moment needs.
    pub peak_replicas: u32,
}

/// Window widths tried by bounds 2 and 3.
const WINDOWS_MS: [u64; 5] = [2_000, 5_000, 10_000, 30_000, 60_000];

/// The lower bound for `trace` under `service` and an SLO on time to first
/// token of `slo_ms`, for any policy whose every cold start lasts at least
/// `cold_ms`: the shortest the model can draw for the strict bound, the
/// fixed delay for the fixed-delay bound.
pub fn lower_bound(trace: &Trace, service: &ServiceModel, slo_ms: u64, cold_ms: u64) -> Oracle {
    let c = u64::from(service.max_concurrency.max(1));
    let segments = envelope(trace, service, slo_ms);

    // Bound 1: per level, stretches plus min(gap, H) before each.
    let h = cold_ms;
    let peak = segments.iter().map(|s| s.2).max().unwrap_or(0);
    let envelope = level_cost(
        &segments,
        |gap| gap.min(h) as f64,
        |lead| lead.min(h) as f64,
    ) as u64;

    // Bounds 2 and 3, per window width.
    let (mut work, mut work_cold) = (0u64, 0u64);
    for w in WINDOWS_MS {
        let (bound2, bound3) = windowed(trace, service, slo_ms, h, &segments, c, w);
        work = work.max(bound2);
        work_cold = work_cold.max(bound3);
    }
    Oracle {
        cold_start_ms: cold_ms,
        gpu_ms: envelope.max(work).max(work_cold),
        envelope_ms: envelope,
        work_ms: work,
        work_cold_ms: work_cold,
        peak_replicas: u32::try_from(peak).unwrap_or(u32::MAX),
    }
}

/// The tiered oracle's answer: a lower bound on GPU time plus parked host
/// memory, in GPU-milliseconds (memory converted at its price relative to
/// the GPU's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TieredOracle {
    /// The bound, GPU-milliseconds at the GPU price (memory included).
    pub gpu_equivalent_ms: u64,
    /// Bound 1 with restores and parked memory, same unit.
    pub envelope_ms: u64,
    /// Bound 3 with every rise costing one restore of GPU time, GPU-ms.
    pub work_restore_ms: u64,
}

/// The tiered oracle: a lower bound on the cost, in GPU-milliseconds at
/// the GPU price, of any schedule of replica states — active on a GPU,
/// parked in host memory, off — that serves every request of `trace`
/// within `slo_ms`, when a replica becomes ready only after `restore_ms`
/// on its GPU (from host memory), weights reach host memory only after
/// `cold_ms` there (from remote), and a replica-millisecond of host memory
/// costs `memory_weight` of a GPU-millisecond (the parked price of the
/// model's size over the GPU price). docs/autoscaling.md gives the
/// argument; in short:
///
/// - every rise of a ready level is a replica that spent at least
///   `restore_ms` starting on its GPU, so bound 3 holds with `H` =
///   `restore_ms` (the GPU part: the windows and their work do not change
///   with tiers);
/// - bound 1 holds with a gap between two stretches of level `j` costing
///   the cheaper of staying up (`gap` of GPU) and going down and up: one
///   restore of GPU plus, for the gap, the weights held in host memory
///   (`gap`) or fetched again (`cold_ms` of host memory while they
///   download), at `memory_weight`. Matching each drop of a level to its
///   next rise is the cheapest way tokens (parked copies) can flow between
///   levels: any other matching of the same drops and rises has the same
///   total gap length spread more evenly, and `min(·, cold_ms)` is
///   concave.
///
/// The largest of the two is the answer.
pub fn tiered_lower_bound(
    trace: &Trace,
    service: &ServiceModel,
    slo_ms: u64,
    restore_ms: u64,
    cold_ms: u64,
    memory_weight: f64,
) -> TieredOracle {
    let m = if memory_weight.is_finite() && memory_weight > 0.0 {
        memory_weight.min(1.0)
    } else {
        0.0
    };
    let segments = envelope(trace, service, slo_ms);
    let r = restore_ms as f64;
    // A replica ready at time 0 is free; one that must be ready by `lead`
    // either ran on its GPU since 0 or restored after 0 (its host memory
    // before then may have been paid in the warm-up).
    let envelope = level_cost(
        &segments,
        |gap| (gap as f64).min(r + m * gap.min(cold_ms) as f64),
        |lead| (lead as f64).min(r),
    )
    .floor() as u64;
    let gpu = lower_bound(trace, service, slo_ms, restore_ms);
    TieredOracle {
        gpu_equivalent_ms: envelope.max(gpu.work_cold_ms).max(gpu.work_ms),
        envelope_ms: envelope,
        work_restore_ms: gpu.work_cold_ms,
    }
}

/// Bound 1's sum over levels of the envelope: every stretch of `n ≥ j` in
/// full, `gap(g)` for each gap of `g` ms between two stretches of one
/// level and `lead(t)` before a level's first stretch at `t`.
fn level_cost(
    segments: &[(u64, u64, u64)],
    gap: impl Fn(u64) -> f64,
    lead: impl Fn(u64) -> f64,
) -> f64 {
    let peak = segments.iter().map(|s| s.2).max().unwrap_or(0);
    let mut below_since: Vec<Option<u64>> = vec![None; peak as usize + 1];
    let mut up_since = vec![0u64; peak as usize + 1];
    let (mut level, mut cost) = (0u64, 0.0f64);
    for &(from, _, n) in segments {
        if n > level {
            for j in level + 1..=n {
                cost += match below_since[j as usize] {
                    Some(since) => gap(from - since),
                    None => lead(from),
                };
                up_since[j as usize] = from;
            }
        } else {
            for j in n + 1..=level {
                cost += (from - up_since[j as usize]) as f64;
                below_since[j as usize] = Some(from);
            }
        }
        level = n;
    }
    let end = segments.last().map_or(0, |s| s.1);
    for j in 1..=level {
        cost += (end - up_since[j as usize]) as f64;
    }
    cost
}

/// The envelope `n(t)` as segments `(from, to, n)`: the fewest replicas
/// ready at each time, from the mandatory intervals.
fn envelope(trace: &Trace, service: &ServiceModel, slo_ms: u64) -> Vec<(u64, u64, u64)> {
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
    segments
}

/// Bounds 2 and 3 for windows of `w` ms, replica-milliseconds.
fn windowed(
    trace: &Trace,
    service: &ServiceModel,
    slo_ms: u64,
    h: u64,
    segments: &[(u64, u64, u64)],
    c: u64,
    w: u64,
) -> (u64, u64) {
    let windows = (trace.duration_ms() + 2 * slo_ms + 3_600_000) / w + 2;
    let mut slot_ms = vec![0u64; windows as usize];
    for r in trace.requests() {
        let p = service.prefill_ms(r);
        if p > slo_ms {
            continue;
        }
        let (s, slack) = (service.service_ms(r), slo_ms - p);
        let (from, to) = (r.arrival_ms, r.arrival_ms + slack + s);
        // At least `overlap − slack` of the slot time lies in each window.
        let mut k = from / w;
        while k * w < to {
            let overlap = to.min((k + 1) * w) - from.max(k * w);
            if let Some(x) = slot_ms.get_mut(k as usize) {
                *x += overlap.saturating_sub(slack);
            }
            k += 1;
        }
    }
    // ∫n and max n per window.
    let mut env = vec![0u64; windows as usize];
    let mut top = vec![0u64; windows as usize];
    for &(from, to, n) in segments {
        let mut t = from;
        while t < to {
            let k = t / w;
            let until = to.min((k + 1) * w);
            if let Some(x) = env.get_mut(k as usize) {
                *x += (until - t) * n;
            }
            if let Some(x) = top.get_mut(k as usize) {
                *x = (*x).max(n);
            }
            t = until;
        }
    }
    let mut bound2 = 0u64;
    let mut gaps = 0u64;
    // Per level, the window that last touched it (`None`: time 0).
    let mut last: Vec<Option<u64>> = Vec::new();
    for k in 0..windows {
        let i = k as usize;
        let need = slot_ms[i].div_ceil(c).max(env[i]);
        bound2 += need;
        let touched = need.div_ceil(w).max(top[i]);
        if touched as usize > last.len() {
            last.resize(touched as usize, None);
        }
        for slot in last.iter_mut().take(touched as usize) {
            let between = match *slot {
                Some(prev) => k - prev - 1,
                // From time 0: a replica that was starting then is paid
                // only from 0, so only whole windows after its first
                // partial one are sure to be paid.
                None => k.saturating_sub(1),
            };
            gaps += (between * w).min(h);
            *slot = Some(k);
        }
    }
    (bound2, bound2 + gaps)
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

    #[test]
    fn tiered_gaps_cost_a_restore_plus_the_parked_memory() {
        let reqs = vec![req(0, 100, 100), req(100_000, 100, 100)];
        let t = Trace::new("t", reqs).unwrap();
        // Restore 500 ms, remote 5 s, memory at 1 % of the GPU price.
        let o = tiered_lower_bound(&t, &svc(), 1_000, 500, 5_000, 0.01);
        // Lead-in: a restore (500 < 900); the ≈ 90.8 s gap: a restore
        // plus the cheaper of parking through it and fetching again
        // (5 s of memory): 500 + 50.
        assert_eq!(o.envelope_ms, 500 + 9_200 + 550 + 9_200);
        assert!(o.gpu_equivalent_ms >= o.envelope_ms);
        // The untiered bound at the same delay pays the 5 s start.
        assert!(lower_bound(&t, &svc(), 1_000, 5_000).gpu_ms > o.gpu_equivalent_ms);
        // Free memory: bound 1 with the restore as the cold start.
        let free = tiered_lower_bound(&t, &svc(), 1_000, 500, 5_000, 0.0);
        assert_eq!(
            free.envelope_ms,
            lower_bound(&t, &svc(), 1_000, 500).envelope_ms
        );
        // Gaps shorter than a restore stay up: 400 ms, not 500 + 4.
        let close = vec![req(0, 100, 100), req(9_600, 100, 100)];
        let t = Trace::new("t", close).unwrap();
        let o = tiered_lower_bound(&t, &svc(), 1_000, 500, 5_000, 0.01);
        // Stretches [900, 10,100] and [10,500, 19,700].
        assert_eq!(o.envelope_ms, 500 + 9_200 + 400 + 9_200);
        // Nonsense weights count as free memory, never a panic.
        let nan = tiered_lower_bound(&t, &svc(), 1_000, 500, 5_000, f64::NAN);
        assert!(nan.envelope_ms <= o.envelope_ms);
    }

    #[test]
    fn silences_shorter_than_the_delay_are_paid_in_full() {
        // Two bursts of 40 short requests 30 s apart: no mandatory time,
        // 40 × 200 slot-ms / 2 slots = 4,000 replica-ms of work each.
        let mut reqs: Vec<Request> = (0..40).map(|_| req(0, 100, 100)).collect();
        reqs.extend((0..40).map(|_| req(30_000, 100, 100)));
        let reqs: Vec<Request> = reqs
            .into_iter()
            .map(|r| Request {
                output_tokens: 1,
                ..r
            })
            .collect();
        let t = Trace::new("t", reqs).unwrap();
        let slow = lower_bound(&t, &svc(), 1_000, 60_000);
        assert_eq!(slow.envelope_ms, 0);
        assert_eq!(slow.work_ms, 8_000);
        // 2 s windows: each burst needs two levels in one window; both
        // levels are kept through the 14 windows between (28 s < 60 s).
        assert_eq!(slow.work_cold_ms, 8_000 + 2 * 28_000);
        assert_eq!(slow.gpu_ms, 64_000);
        // With 3 s starts, restarting both levels is cheaper.
        let fast = lower_bound(&t, &svc(), 1_000, 3_000);
        assert_eq!(fast.work_cold_ms, 8_000 + 2 * 3_000);
        assert!(fast.gpu_ms < slow.gpu_ms);
    }
}
