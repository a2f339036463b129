//! Readiness tiers in the simulator: parked replicas come back at the
//! host-to-GPU restore time, released ones from the disk cache or remote,
//! parked memory is counted and priced, and the tiered policy spends less
//! than the untiered one on bursty traffic at equal attainment.

use flotilla_scale::{Bounds, Decision, Observation, Policy, ReadinessTiers, Reason, Tier};
use flotilla_sim::engine::TierSetting;
use flotilla_sim::report::{compare, tiered_markdown_table};
use flotilla_sim::scenario::{scale_to_peak, Scenario};
use flotilla_sim::{coldstart::ColdStartModel, simulate, PolicyKind, Request, ServiceModel};
use flotilla_sim::{SimConfig, Trace};

fn setting(host_gb: f64, disk_gb: f64) -> TierSetting {
    TierSetting {
        tiers: ReadinessTiers::default(),
        model_gb: 16.0,
        nodes: 2,
        host_memory_gb_per_node: host_gb,
        disk_gb_per_node: disk_gb,
    }
}

fn cfg(tiers: TierSetting) -> SimConfig {
    let mut c = SimConfig::new(
        ServiceModel::for_gpu("H100").unwrap(),
        ColdStartModel::fixed(60_000),
        2_000,
    );
    c.tiers = Some(tiers);
    c
}

const TICK_MS: u64 = 10;

/// Asks for `on` replicas before `busy_until_ms` and from `back_at_ms`;
/// in between none warm and `park` parked.
struct Script {
    on: u32,
    park: u32,
    busy_until_ms: u64,
    back_at_ms: u64,
    parked_now: u32,
}

impl Policy for Script {
    fn name(&self) -> &'static str {
        "script"
    }
    fn bounds(&self) -> Bounds {
        Bounds::new(0, 10).unwrap()
    }
    fn interval_ms(&self) -> u64 {
        TICK_MS
    }
    fn decide(&mut self, now_ms: u64, _obs: &Observation) -> Decision {
        let on = now_ms < self.busy_until_ms || now_ms >= self.back_at_ms;
        self.parked_now = if on { 0 } else { self.park };
        Decision::new(if on { self.on } else { 0 }, Reason::Metric)
    }
    fn parked(&self) -> u32 {
        self.parked_now
    }
}

fn req(t: u64) -> Request {
    Request {
        arrival_ms: t,
        input_tokens: 1_500,
        output_tokens: 8,
    }
}

/// Two replicas start remote (weights staged into host memory for the
/// 60 s cold start, then a parked restore on the GPU: the request at 0
/// waits past the 60 s timeout), stop at 100 s and come back at 200 s for
/// a request at 200 s (100 ms prefill + 100 ms decode). The run ends at
/// the first tick after that request is done.
fn run(park: u32, host_gb: f64, disk_gb: f64) -> flotilla_sim::SimResult {
    let t = Trace::new("t", vec![req(0), req(200_000)]).unwrap();
    let mut p = Script {
        on: 2,
        park,
        busy_until_ms: 100_000,
        back_at_ms: 200_000,
        parked_now: 0,
    };
    simulate(&t, &mut p, &cfg(setting(host_gb, disk_gb)), &mut |_, _| {})
}

#[test]
fn parked_replicas_come_back_at_the_host_memory_restore_time() {
    let r = run(2, 64.0, 0.0);
    let st = r.tiers.unwrap();
    assert_eq!((st.remote_starts, st.parked_starts), (2, 2), "{st:?}");
    // The request at 200 s waits one parked restore (820 ms) and is
    // served within the SLO; the one at 0 outwaited the remote start.
    let restore = ReadinessTiers::default().restore_ms(Tier::Parked, 16.0);
    assert_eq!(restore, 820);
    assert_eq!(r.end_ms, 200_000 + restore + 200);
    assert_eq!((r.slo_met, r.dropped), (1, 1));
    // Host memory: two replicas staging for 60 s, then parked from 100 s
    // to 200 s: 320 replica-s of 16 GB.
    assert_eq!(st.parked_replica_ms, 2 * 60_000 + 2 * 100_000);
    assert!((st.parked_gb_seconds - 5_120.0).abs() < 1e-9);
    // GPU time: from the end of staging (60 s) to 100 s, and from 200 s;
    // never while weights download or sit parked.
    assert_eq!(r.gpu_ms, 2 * 40_000 + 2 * (r.end_ms - 200_000));
}

#[test]
fn without_room_or_wish_to_park_they_come_from_disk_or_remote() {
    // Host memory too small for one 16 GB copy: nothing parked; disks
    // hold one copy per node: the comeback is two cached starts.
    let r = run(2, 8.0, 20.0);
    let st = r.tiers.unwrap();
    assert_eq!(
        (st.parked_starts, st.cached_starts, st.remote_starts),
        (0, 2, 2)
    );
    // Only the first starts' staging held host memory.
    assert_eq!(st.parked_replica_ms, 2 * 60_000);
    let cached = ReadinessTiers::default().restore_ms(Tier::Cached, 16.0);
    let done = 200_000 + cached + 200;
    assert!(
        r.end_ms >= done && r.end_ms < done + TICK_MS,
        "{}",
        r.end_ms
    );
    // Nothing parked, no disk cache: every start is remote.
    let r = run(0, 64.0, 0.0);
    let st = r.tiers.unwrap();
    assert_eq!(
        (st.parked_starts, st.cached_starts, st.remote_starts),
        (0, 0, 4)
    );
    assert!(r.end_ms >= 260_000, "{}", r.end_ms);
}

#[test]
fn tiered_policy_cuts_cost_on_bursts_at_equal_attainment() {
    let t = Scenario::OnOff.trace(1).unwrap();
    let service = ServiceModel::for_gpu("H100").unwrap();
    let (t, _) = scale_to_peak(&t, &service, 10.0, 1).unwrap();
    let mut plain = SimConfig::new(service, ColdStartModel::fixed(60_000), 2_000);
    plain.warmup_ms = 600_000;
    let mut tiered = plain.clone();
    tiered.tiers = Some(setting(512.0, 0.0));
    let a = compare(&t, &[PolicyKind::Flotilla], &plain, 200, &mut |_, _, _| {}).unwrap();
    let b = compare(&t, &[PolicyKind::Flotilla], &tiered, 200, &mut |_, _, _| {}).unwrap();
    let (a, b) = (&a.rows[0], &b.rows[0]);
    let bt = b.tiers.as_ref().unwrap();
    eprintln!("{}", tiered_markdown_table(std::slice::from_ref(b)));
    assert_eq!(b.policy, "flotilla-tiered");
    assert!(a.tiers.is_none());
    assert!(bt.cold_starts_parked > 0, "{bt:?}");
    assert!(bt.memory_cost > rust_decimal::Decimal::ZERO);
    assert_eq!(bt.total_cost, b.cost + bt.memory_cost);
    assert!(
        b.slo_attainment_pct >= a.slo_attainment_pct - 0.5,
        "{} vs {}",
        b.slo_attainment_pct,
        a.slo_attainment_pct
    );
    assert!(
        bt.total_cost < a.cost,
        "tiered {} vs untiered {}",
        bt.total_cost,
        a.cost
    );
    // The tiered oracle bounds the tiered run from below, and is below
    // the fixed-delay oracle (it may park instead of starting cold).
    assert!(bt.tiered_oracle_cost > rust_decimal::Decimal::ZERO);
    assert!(
        bt.total_cost >= bt.tiered_oracle_cost,
        "{} < {}",
        bt.total_cost,
        bt.tiered_oracle_cost
    );
    assert!(bt.tiered_oracle_cost < bt.oracle_cost);
}

#[test]
fn the_tiered_policy_learns_prefill_and_restore_times_from_the_run() {
    // Every prompt 6,000 tokens: 400 ms of prefill on an H100.
    let service = ServiceModel::for_gpu("H100").unwrap();
    let reqs: Vec<Request> = (0..6_000u64)
        .map(|i| Request {
            // Bursts of 40 requests a second for 20 s, then 40 s quiet:
            // replicas park in the lulls and restore for the bursts.
            arrival_ms: (i / 800) * 60_000 + (i % 800) * 25,
            input_tokens: 6_000,
            output_tokens: 64,
        })
        .collect();
    assert_eq!(service.prefill_ms(&reqs[0]), 400);
    let t = Trace::new("t", reqs).unwrap();
    let c = cfg(setting(512.0, 0.0));
    let ep = flotilla_sim::policies::Endpoint {
        max_concurrency: service.max_concurrency,
        mean_service_ms: service.service_ms(&t.requests()[0]) as f64,
        cold_start_ms: 60_000,
        slo_ms: 2_000,
        max_replicas: 100,
    };
    let econ = flotilla_scale::TierEconomics {
        tiers: ReadinessTiers::default(),
        model_gb: 16.0,
        memory_price_per_gb_hour: 0.004237,
        parked_capacity: 64,
    };
    let mut p = flotilla_scale::builder::build_tiered(&ep, econ).unwrap();
    assert_eq!(p.queue_tolerance().tolerance_ms(), 775, "the priors");
    let r = simulate(&t, &mut p, &c, &mut |_, _| {});
    assert!(r.tiers.unwrap().parked_starts > 0);
    // Learned: the 400 ms prompts and the 820 ms restores, measured in
    // the run.
    let q = p.queue_tolerance();
    assert_eq!(q.prefill_ms(), 400);
    assert_eq!(q.restore_ms(), 820);
    assert_eq!(q.tolerance_ms(), 2_000 - 820 - 205 - 400);
}

#[test]
fn tiered_runs_are_deterministic() {
    let t = Scenario::OnOff.trace(3).unwrap();
    let service = ServiceModel::for_gpu("H100").unwrap();
    let (t, _) = scale_to_peak(&t, &service, 5.0, 3).unwrap();
    let mut c = SimConfig::new(service, ColdStartModel::lognormal(60_000), 2_000);
    c.tiers = Some(setting(64.0, 64.0));
    let x = compare(&t, &[PolicyKind::Flotilla], &c, 100, &mut |_, _, _| {}).unwrap();
    let y = compare(&t, &[PolicyKind::Flotilla], &c, 100, &mut |_, _, _| {}).unwrap();
    assert_eq!(x.rows, y.rows);
}
