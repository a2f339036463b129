//! Synthetic traces — the scenarios from the field and long traces for
//! speed tests — and the rate multiplication that sizes a trace to the
//! benchmark's setting.
//!
//! Synthetic requests draw prompt tokens uniformly from 128..=2048 and
//! generated tokens from 16..=512 (a chat-like mix); arrivals are Poisson
//! with a piecewise-linear rate, generated second by second.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::service::ServiceModel;
use crate::trace::{Request, Trace};
use crate::SimError;

/// A built-in scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    /// 100 requests/hour for 30 min, a 10-minute ramp to 10,000/hour held
    /// for an hour, then 30 minutes back down to 100/hour, and 30 quiet
    /// minutes more.
    ViralSpike,
    /// A Black-Friday day: 2 hours at a base rate of 1,000 requests/hour,
    /// a 10× step held for 4 hours, 2 hours back at the base.
    BlackFriday,
    /// Bursty on/off traffic for 2 hours: 30-second bursts at 10,000
    /// requests/hour separated by near-silences (100/hour) of 20 s, 45 s,
    /// 90 s and 300 s in turn — some shorter, some longer than a cold start.
    OnOff,
    /// A diurnal day: 24 hours of a sinusoidal rate between 400 and 3,600
    /// requests/hour, lowest at 02:00 and highest at 14:00.
    Diurnal,
}

impl std::str::FromStr for Scenario {
    type Err = SimError;
    fn from_str(s: &str) -> Result<Self, SimError> {
        match s {
            "viral-spike" => Ok(Self::ViralSpike),
            "black-friday" => Ok(Self::BlackFriday),
            "on-off" => Ok(Self::OnOff),
            "diurnal" => Ok(Self::Diurnal),
            _ => Err(SimError::invalid(
                "scenario",
                format!(
                    "unknown scenario {s:?}; expected viral-spike, black-friday, on-off or diurnal"
                ),
            )),
        }
    }
}

impl Scenario {
    /// The scenario's name in reports.
    pub const fn name(self) -> &'static str {
        match self {
            Self::ViralSpike => "viral-spike",
            Self::BlackFriday => "black-friday",
            Self::OnOff => "on-off",
            Self::Diurnal => "diurnal",
        }
    }

    /// Rate in requests per hour as `(seconds from start, rate)` knots,
    /// linear in between.
    fn knots(self) -> Vec<(u64, f64)> {
        match self {
            Self::ViralSpike => vec![
                (0, 100.0),
                (1_800, 100.0),
                (2_400, 10_000.0),
                (6_000, 10_000.0),
                (7_800, 100.0),
                (9_600, 100.0),
            ],
            Self::BlackFriday => vec![
                (0, 1_000.0),
                (7_200, 1_000.0),
                (7_201, 10_000.0),
                (21_600, 10_000.0),
                (21_601, 1_000.0),
                (28_800, 1_000.0),
            ],
            Self::OnOff => {
                let (mut knots, mut t) = (Vec::new(), 0u64);
                for gap in [20u64, 45, 90, 300].iter().cycle() {
                    if t >= 7_200 {
                        break;
                    }
                    knots.extend([(t, 10_000.0), (t + 29, 10_000.0)]);
                    knots.extend([(t + 30, 100.0), (t + 29 + gap, 100.0)]);
                    t += 30 + gap;
                }
                knots
            }
            Self::Diurnal => (0..=48u64)
                .map(|i| {
                    let hours = i as f64 / 2.0;
                    let phase = (hours - 8.0) / 24.0 * std::f64::consts::TAU;
                    (i * 1_800, 2_000.0 + 1_600.0 * phase.sin())
                })
                .collect(),
        }
    }

    /// The scenario's trace, drawn with `seed`.
    pub fn trace(self, seed: u64) -> Result<Trace, SimError> {
        piecewise(self.name(), &self.knots(), seed)
    }
}

/// Poisson arrivals at a piecewise-linear rate (requests/hour between
/// `(second, rate)` knots), second by second.
pub fn piecewise(name: &str, knots: &[(u64, f64)], seed: u64) -> Result<Trace, SimError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let end = knots.last().map_or(0, |k| k.0);
    let mut requests = Vec::new();
    for s in 0..end {
        let rate = rate_at(knots, s as f64 + 0.5) / 3600.0;
        // Poisson count for one second by inversion (rates here are small
        // per second; a long step falls back to a normal approximation).
        let n = poisson(&mut rng, rate);
        for _ in 0..n {
            let at = s * 1000 + rng.gen_range(0..1000);
            requests.push(request(&mut rng, at));
        }
    }
    Trace::new(name, requests)
}

/// `n` requests at a constant `per_s` Poisson rate: the long synthetic
/// trace of the speed benchmark.
pub fn constant(name: &str, n: usize, per_s: f64, seed: u64) -> Result<Trace, SimError> {
    if !(per_s.is_finite() && per_s > 0.0) {
        return Err(SimError::invalid("rate", "must be positive"));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut t = 0.0f64;
    let requests = (0..n)
        .map(|_| {
            let u: f64 = rng.gen_range(f64::EPSILON..1.0);
            t += -u.ln() / per_s;
            request(&mut rng, (t * 1000.0) as u64)
        })
        .collect();
    Trace::new(name, requests)
}

fn request(rng: &mut ChaCha8Rng, arrival_ms: u64) -> Request {
    Request {
        arrival_ms,
        input_tokens: rng.gen_range(128..=2048),
        output_tokens: rng.gen_range(16..=512),
    }
}

fn rate_at(knots: &[(u64, f64)], t: f64) -> f64 {
    for w in knots.windows(2) {
        let ((t0, r0), (t1, r1)) = (w[0], w[1]);
        if t >= t0 as f64 && t < t1 as f64 {
            let f = (t - t0 as f64) / (t1 - t0).max(1) as f64;
            return r0 + f * (r1 - r0);
        }
    }
    knots.last().map_or(0.0, |k| k.1)
}

fn poisson(rng: &mut ChaCha8Rng, mean: f64) -> u64 {
    if mean <= 0.0 {
        return 0;
    }
    if mean > 30.0 {
        // Normal approximation, rounded, never negative.
        let (u1, u2): (f64, f64) = (rng.gen_range(f64::EPSILON..1.0), rng.gen());
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        return (mean + z * mean.sqrt()).round().max(0.0) as u64;
    }
    let (l, mut k, mut p) = ((-mean).exp(), 0u64, 1.0f64);
    loop {
        p *= rng.gen::<f64>();
        if p <= l {
            return k;
        }
        k += 1;
    }
}

/// Peak offered load of `trace` in replicas: the largest, over one-minute
/// windows, slot time of the requests arriving in it divided by the
/// window and the replica's concurrency (Little's law).
pub fn peak_load(trace: &Trace, service: &ServiceModel) -> f64 {
    const W: u64 = 60_000;
    let mut windows = vec![0u64; (trace.duration_ms() / W + 1) as usize];
    for r in trace.requests() {
        windows[(r.arrival_ms / W) as usize] += service.service_ms(r);
    }
    let peak = windows.iter().copied().max().unwrap_or(0);
    peak as f64 / (W as f64 * f64::from(service.max_concurrency.max(1)))
}

/// The trace with its arrival rate multiplied by the smallest integer `k`
/// that makes its peak offered load at least `min_peak_replicas`
/// replicas (`k` = 1 when it already does). Each request is kept and `k −
/// 1` copies with the same tokens are placed uniformly at random in the
/// gap to the next arrival, so the rate is multiplied where it is and the
/// trace's shape (bursts, lulls, diurnal swing) is kept at the
/// resolution of its inter-arrival gaps. Requests that share a timestamp
/// (GenTD26 records whole seconds) spread their copies over the trace's
/// timestamp resolution, its smallest positive gap, rather than stacking
/// thousands of requests on one millisecond. Returns the trace and `k`.
pub fn scale_to_peak(
    trace: &Trace,
    service: &ServiceModel,
    min_peak_replicas: f64,
    seed: u64,
) -> Result<(Trace, u32), SimError> {
    let peak = peak_load(trace, service);
    if peak <= 0.0 {
        return Err(SimError::EmptyTrace);
    }
    let k = (min_peak_replicas / peak).ceil().max(1.0);
    if k > 100_000.0 {
        return Err(SimError::invalid(
            "peak_replicas",
            "the trace is too sparse to scale",
        ));
    }
    let k = k as u32;
    if k == 1 {
        return Ok((trace.clone(), 1));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let reqs = trace.requests();
    let resolution = reqs
        .windows(2)
        .map(|w| w[1].arrival_ms - w[0].arrival_ms)
        .filter(|&g| g > 0)
        .min()
        .unwrap_or(1);
    let mut out = Vec::with_capacity(reqs.len() * k as usize);
    for (i, r) in reqs.iter().enumerate() {
        out.push(*r);
        let gap = reqs
            .get(i + 1)
            .map_or(0, |n| n.arrival_ms - r.arrival_ms)
            .max(resolution);
        for _ in 1..k {
            let dt = if gap == 0 { 0 } else { rng.gen_range(0..gap) };
            out.push(Request {
                arrival_ms: r.arrival_ms + dt,
                ..*r
            });
        }
    }
    Ok((Trace::new(trace.name.clone(), out)?, k))
}

/// `trace` with a share of its requests given prompts too long to prefill
/// within `slo_ms`: each request, with probability `share` (seeded), gets
/// a prompt whose prefill under `service` is uniform between the SLO and
/// twice it; the others, arrivals and every output length are kept. Such
/// requests miss their time to first token whatever the policy does, and
/// hold a slot for seconds of prefill: the trace checks that a policy that
/// learns from measured prefill times is not thrown by them (the tiered
/// policy's queue tolerance) while the rest is served as before.
pub fn long_prompts(
    trace: &Trace,
    name: &str,
    share: f64,
    slo_ms: u64,
    service: &ServiceModel,
    seed: u64,
) -> Result<Trace, SimError> {
    if !(share.is_finite() && (0.0..=1.0).contains(&share)) {
        return Err(SimError::invalid("share", "must be within 0..=1"));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6c6f_6e67);
    let per_ms = service.prefill_tokens_per_s / 1000.0;
    let reqs = trace
        .requests()
        .iter()
        .map(|r| {
            if rng.gen::<f64>() < share {
                let ms = slo_ms as f64 * (1.0 + rng.gen::<f64>());
                // One token more than the SLO's worth, so the prefill is
                // strictly longer than the SLO even after rounding.
                let tokens = ((ms * per_ms).ceil() as u32).max((slo_ms as f64 * per_ms) as u32 + 1);
                Request {
                    input_tokens: tokens,
                    ..*r
                }
            } else {
                *r
            }
        })
        .collect();
    Trace::new(name, reqs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn viral_spike_has_its_rates() {
        let t = Scenario::ViralSpike.trace(1).unwrap();
        let count = |from: u64, to: u64| {
            t.requests()
                .iter()
                .filter(|r| r.arrival_ms >= from * 1000 && r.arrival_ms < to * 1000)
                .count() as f64
        };
        // First 30 min at 100/h: ~50; the hour at 10,000/h: ~10,000.
        assert!(
            (30.0..80.0).contains(&count(0, 1_800)),
            "{}",
            count(0, 1_800)
        );
        let peak = count(2_400, 6_000);
        assert!((9_500.0..10_500.0).contains(&peak), "{peak}");
        assert_eq!(t, Scenario::ViralSpike.trace(1).unwrap());
        assert!("nope".parse::<Scenario>().is_err());
    }

    #[test]
    fn black_friday_steps_tenfold() {
        let t = Scenario::BlackFriday.trace(2).unwrap();
        let before = t
            .requests()
            .iter()
            .filter(|r| r.arrival_ms < 7_200_000)
            .count();
        let during = t
            .requests()
            .iter()
            .filter(|r| (7_200_000..14_400_000).contains(&r.arrival_ms))
            .count();
        let ratio = during as f64 / before as f64;
        assert!((8.5..11.5).contains(&ratio), "{ratio}");
    }

    #[test]
    fn scaling_multiplies_the_rate_to_the_peak() {
        let s = ServiceModel::for_gpu("H100").unwrap();
        let t = Scenario::ViralSpike.trace(3).unwrap();
        let (big, k) = scale_to_peak(&t, &s, 20.0, 9).unwrap();
        assert!(k > 1);
        assert_eq!(big.len(), t.len() * k as usize);
        assert!(peak_load(&big, &s) >= 18.0, "{}", peak_load(&big, &s));
        let (same, one) = scale_to_peak(&big, &s, 1.0, 9).unwrap();
        assert_eq!((same.len(), one), (big.len(), 1));
    }

    #[test]
    fn equal_timestamps_spread_over_the_resolution() {
        let s = ServiceModel::for_gpu("H100").unwrap();
        let reqs: Vec<Request> = [0u64, 0, 1_000, 2_000]
            .iter()
            .map(|&t| Request {
                arrival_ms: t,
                input_tokens: 100,
                output_tokens: 100,
            })
            .collect();
        let t = Trace::new("s", reqs).unwrap();
        let (big, k) = scale_to_peak(&t, &s, 1.0, 1).unwrap();
        assert!(k > 10);
        let at_zero = big.requests().iter().filter(|r| r.arrival_ms == 0).count();
        assert!(
            at_zero < k as usize / 2,
            "{at_zero} of {k} copies stacked at 0"
        );
        assert!(big.requests().iter().all(|r| r.arrival_ms < 3_000));
    }

    #[test]
    fn long_prompts_miss_the_slo_in_their_share() {
        let s = ServiceModel::for_gpu("H100").unwrap();
        let t = constant("c", 20_000, 100.0, 1).unwrap();
        let long = long_prompts(&t, "c-long", 0.1, 2_000, &s, 1).unwrap();
        assert_eq!(long.len(), t.len());
        let over = long
            .requests()
            .iter()
            .filter(|r| s.prefill_ms(r) > 2_000)
            .count();
        let share = over as f64 / t.len() as f64;
        assert!((0.09..0.11).contains(&share), "{share}");
        assert!(long
            .requests()
            .iter()
            .all(|r| s.prefill_ms(r) <= 4_001 && r.output_tokens > 0));
        // The rest untouched, arrivals everywhere untouched.
        let kept = long
            .requests()
            .iter()
            .zip(t.requests())
            .filter(|(a, b)| a == b)
            .count();
        assert_eq!(kept, t.len() - over);
        assert!(long_prompts(&t, "x", 1.5, 2_000, &s, 1).is_err());
    }

    #[test]
    fn constant_trace_has_its_length_and_rate() {
        let t = constant("c", 10_000, 100.0, 1).unwrap();
        assert_eq!(t.len(), 10_000);
        let secs = t.duration_ms() as f64 / 1000.0;
        assert!((90.0..110.0).contains(&secs), "{secs}");
        assert!(constant("c", 1, 0.0, 1).is_err());
    }
}
