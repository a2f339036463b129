//! The simulated cloud: provisioning delays, per-region limits, spot
//! availability and spot preemption, all drawn from a seeded generator on
//! the caller's clock. The simulator drives it from its virtual clock and
//! the server can run a node pool on it (`--node-pool ... provider
//! simulated`): the same model in both.
//!
//! Determinism: one generator, drawn in a fixed order per request (spot
//! availability, then the provisioning delay, then the spot lifetime), so a
//! seed and a sequence of calls always give the same machines.

use std::collections::BTreeMap;
use std::sync::Mutex;

use futures::future::{self, BoxFuture, FutureExt};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::{
    CapacityError, CapacityProvider, InstanceType, InterruptionNotice, Limit, Machine,
    MachineState, ProvisionRequest, Quota, Region,
};

/// The machine capacity of one region for one GPU type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionLimit {
    /// Region name.
    pub region: String,
    /// GPU type.
    pub gpu: String,
    /// Most machines of that type live at once in the region.
    pub max_nodes: u32,
}

/// An empirical distribution of provisioning delays, in milliseconds,
/// drawn uniformly (the simulator builds it from its cold-start model).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProvisionDelay {
    /// Never empty.
    samples: Vec<u64>,
}

impl ProvisionDelay {
    /// Delays drawn uniformly from `samples`; a fixed 1 ms when empty.
    pub fn from_samples(samples: Vec<u64>) -> Self {
        if samples.is_empty() {
            return Self::fixed(1);
        }
        Self { samples }
    }

    /// Every machine takes exactly `ms`.
    pub fn fixed(ms: u64) -> Self {
        Self { samples: vec![ms] }
    }

    fn sample(&self, rng: &mut impl Rng) -> u64 {
        self.samples[rng.gen_range(0..self.samples.len())]
    }
}

/// Settings of the [`SimulatedCloud`].
#[derive(Debug, Clone, PartialEq)]
pub struct SimulatedCloudConfig {
    /// Capacity per region and GPU type, tried in this order.
    pub limits: Vec<RegionLimit>,
    /// GPUs per machine.
    pub gpus_per_node: u32,
    /// Time from request to a ready machine.
    pub provision_delay: ProvisionDelay,
    /// Probability that a spot request finds capacity.
    pub spot_availability: f64,
    /// Mean lifetime of a spot machine before preemption (exponential).
    pub spot_mean_lifetime_ms: u64,
    /// How long before a preemption the cloud warns
    /// ([`CapacityProvider::interruptions`]).
    pub spot_notice_ms: u64,
}

#[derive(Debug, Clone)]
struct SimMachine {
    /// Index into `limits`.
    slot: usize,
    machine: Machine,
    gone: bool,
}

#[derive(Debug)]
struct State {
    rng: ChaCha8Rng,
    /// Live machines per index into `limits`.
    live: Vec<u32>,
    machines: BTreeMap<String, SimMachine>,
    next: u32,
}

/// A cloud with provisioning delays, per-region limits, spot availability
/// and preemption, all drawn from a seeded generator.
#[derive(Debug)]
pub struct SimulatedCloud {
    cfg: SimulatedCloudConfig,
    state: Mutex<State>,
}

impl SimulatedCloud {
    /// A cloud seeded with `seed`.
    pub fn new(cfg: SimulatedCloudConfig, seed: u64) -> Self {
        let live = vec![0; cfg.limits.len()];
        Self {
            cfg,
            state: Mutex::new(State {
                rng: ChaCha8Rng::seed_from_u64(seed),
                live,
                machines: BTreeMap::new(),
                next: 0,
            }),
        }
    }

    /// The instance type name of `gpu` machines: `8xH100`.
    pub fn instance_type_for(&self, gpu: &str) -> String {
        format!("{}x{gpu}", self.cfg.gpus_per_node)
    }

    /// Live machines in total.
    pub fn live_nodes(&self) -> usize {
        self.lock().machines.values().filter(|m| !m.gone).count()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state holds no invariant a panicking holder could break
        // half-way that matters more than carrying on.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The GPU of instance type `name` (`8xH100` or plain `H100`).
    fn gpu_of<'a>(&self, name: &'a str) -> &'a str {
        let prefix = format!("{}x", self.cfg.gpus_per_node);
        name.strip_prefix(&prefix).unwrap_or(name)
    }

    /// The pure provisioning step.
    pub fn provision_now(
        &self,
        now_ms: u64,
        req: &ProvisionRequest,
    ) -> Result<Machine, CapacityError> {
        let gpu = self.gpu_of(&req.instance_type);
        let mut st = self.lock();
        let st = &mut *st;
        let slot = self
            .cfg
            .limits
            .iter()
            .enumerate()
            .position(|(i, l)| {
                l.gpu.eq_ignore_ascii_case(gpu)
                    && req.region.as_ref().is_none_or(|r| r == &l.region)
                    && st.live[i] < l.max_nodes
            })
            .ok_or_else(|| CapacityError::NoCapacity {
                instance_type: gpu.to_string(),
                message: "every region is at its limit".to_string(),
            })?;
        if req.spot && !st.rng.gen_bool(self.cfg.spot_availability.clamp(0.0, 1.0)) {
            return Err(CapacityError::NoSpot {
                instance_type: gpu.to_string(),
            });
        }
        let ready_at_ms = now_ms + self.cfg.provision_delay.sample(&mut st.rng);
        let preempt_at_ms = req.spot.then(|| {
            let u: f64 = st.rng.gen_range(f64::EPSILON..1.0);
            ready_at_ms + (-u.ln() * self.cfg.spot_mean_lifetime_ms as f64) as u64
        });
        let id = format!("sim-{}", st.next);
        st.next += 1;
        st.live[slot] += 1;
        let machine = Machine {
            id: id.clone(),
            name: req.name.clone(),
            region: self.cfg.limits[slot].region.clone(),
            instance_type: self.instance_type_for(&self.cfg.limits[slot].gpu),
            gpus: self.cfg.gpus_per_node,
            spot: req.spot,
            state: MachineState::Provisioning,
            ready_at_ms: Some(ready_at_ms),
            preempt_at_ms,
        };
        st.machines.insert(
            id,
            SimMachine {
                slot,
                machine: machine.clone(),
                gone: false,
            },
        );
        Ok(machine)
    }

    /// The pure release step: idempotent.
    pub fn terminate_now(&self, id: &str) {
        let mut st = self.lock();
        let st = &mut *st;
        if let Some(m) = st.machines.get_mut(id) {
            if !m.gone {
                m.gone = true;
                st.live[m.slot] -= 1;
            }
        }
    }

    fn state_at(m: &SimMachine, now_ms: u64) -> MachineState {
        if m.gone || m.machine.preempt_at_ms.is_some_and(|p| p <= now_ms) {
            MachineState::Terminated
        } else if m.machine.ready_at_ms.is_some_and(|r| r > now_ms) {
            MachineState::Provisioning
        } else {
            MachineState::Running
        }
    }

    /// The pure describe step.
    pub fn describe_now(&self, now_ms: u64, id: &str) -> Result<Machine, CapacityError> {
        let st = self.lock();
        let m = st
            .machines
            .get(id)
            .ok_or_else(|| CapacityError::NotFound { id: id.to_string() })?;
        let mut machine = m.machine.clone();
        machine.state = Self::state_at(m, now_ms);
        Ok(machine)
    }

    /// The pure interruption step: live spot machines within their notice.
    pub fn interruptions_now(&self, now_ms: u64) -> Vec<InterruptionNotice> {
        let st = self.lock();
        st.machines
            .values()
            .filter(|m| !m.gone)
            .filter_map(|m| {
                let at = m.machine.preempt_at_ms?;
                let noticed = at.saturating_sub(self.cfg.spot_notice_ms);
                (noticed <= now_ms).then(|| InterruptionNotice {
                    machine: m.machine.id.clone(),
                    noticed_at_ms: noticed,
                    terminate_at_ms: at,
                })
            })
            .collect()
    }

    fn regions_now(&self) -> Vec<Region> {
        let mut out: Vec<Region> = Vec::new();
        for l in &self.cfg.limits {
            if !out.iter().any(|r| r.name == l.region) {
                out.push(Region {
                    name: l.region.clone(),
                });
            }
        }
        out
    }

    fn types_now(&self) -> Vec<InstanceType> {
        let mut out: Vec<InstanceType> = Vec::new();
        for l in &self.cfg.limits {
            let name = self.instance_type_for(&l.gpu);
            if !out.iter().any(|t| t.name == name) {
                out.push(InstanceType {
                    name,
                    gpu_model: Some(l.gpu.clone()),
                    gpus: self.cfg.gpus_per_node,
                    vcpus: 0,
                    ram_mib: 0,
                    spot: self.cfg.spot_availability > 0.0,
                });
            }
        }
        out
    }

    fn quota_now(&self, region: &str) -> Quota {
        let st = self.lock();
        let (mut max, mut used) = (0u64, 0u64);
        for (i, l) in self.cfg.limits.iter().enumerate() {
            if l.region == region {
                max += u64::from(l.max_nodes);
                used += u64::from(st.live[i]);
            }
        }
        let open = Limit { max: None, used: 0 };
        Quota {
            instances: Limit {
                max: Some(max),
                used,
            },
            vcpus: open,
            ram_mib: open,
        }
    }
}

impl CapacityProvider for SimulatedCloud {
    fn kind(&self) -> &'static str {
        "simulated"
    }

    fn regions(&self) -> BoxFuture<'_, Result<Vec<Region>, CapacityError>> {
        future::ready(Ok(self.regions_now())).boxed()
    }

    fn instance_types(&self) -> BoxFuture<'_, Result<Vec<InstanceType>, CapacityError>> {
        future::ready(Ok(self.types_now())).boxed()
    }

    fn quota<'a>(&'a self, region: &'a str) -> BoxFuture<'a, Result<Quota, CapacityError>> {
        future::ready(Ok(self.quota_now(region))).boxed()
    }

    fn provision<'a>(
        &'a self,
        now_ms: u64,
        req: &'a ProvisionRequest,
    ) -> BoxFuture<'a, Result<Machine, CapacityError>> {
        future::ready(self.provision_now(now_ms, req)).boxed()
    }

    fn describe<'a>(
        &'a self,
        now_ms: u64,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Machine, CapacityError>> {
        future::ready(self.describe_now(now_ms, id)).boxed()
    }

    fn terminate<'a>(
        &'a self,
        _now_ms: u64,
        id: &'a str,
    ) -> BoxFuture<'a, Result<(), CapacityError>> {
        self.terminate_now(id);
        future::ready(Ok(())).boxed()
    }

    fn interruptions(
        &self,
        now_ms: u64,
    ) -> BoxFuture<'_, Result<Vec<InterruptionNotice>, CapacityError>> {
        future::ready(Ok(self.interruptions_now(now_ms))).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(max_nodes: u32, spot: f64) -> SimulatedCloudConfig {
        SimulatedCloudConfig {
            limits: vec![
                RegionLimit {
                    region: "a".into(),
                    gpu: "H100".into(),
                    max_nodes,
                },
                RegionLimit {
                    region: "b".into(),
                    gpu: "H100".into(),
                    max_nodes,
                },
            ],
            gpus_per_node: 2,
            provision_delay: ProvisionDelay::fixed(1_000),
            spot_availability: spot,
            spot_mean_lifetime_ms: 60_000,
            spot_notice_ms: 30_000,
        }
    }

    fn want(gpu: &str, spot: bool) -> ProvisionRequest {
        ProvisionRequest {
            name: "n".into(),
            instance_type: gpu.into(),
            region: None,
            spot,
            join: None,
        }
    }

    #[test]
    fn provider_respects_region_limits_in_order() {
        let p = SimulatedCloud::new(cfg(1, 1.0), 7);
        let a = p.provision_now(0, &want("H100", false)).unwrap();
        let b = p.provision_now(0, &want("2xH100", false)).unwrap();
        assert_eq!((a.region.as_str(), b.region.as_str()), ("a", "b"));
        assert_eq!(a.ready_at_ms, Some(1_000));
        assert!(a.preempt_at_ms.is_none());
        assert!(matches!(
            p.provision_now(0, &want("H100", false)),
            Err(CapacityError::NoCapacity { .. })
        ));
        assert_eq!(p.quota_now("a").instances.left(), Some(0));
        p.terminate_now(&a.id);
        p.terminate_now(&a.id); // idempotent
        assert_eq!(p.quota_now("a").instances.left(), Some(1));
        assert_eq!(
            p.provision_now(5, &want("H100", false)).unwrap().region,
            "a"
        );
        assert!(p.provision_now(0, &want("A100-80GB", false)).is_err());
        assert_eq!(p.types_now().len(), 1);
        assert_eq!(p.regions_now().len(), 2);
    }

    #[test]
    fn machines_go_through_their_states_on_the_callers_clock() {
        let p = SimulatedCloud::new(cfg(4, 1.0), 3);
        let m = p.provision_now(0, &want("H100", true)).unwrap();
        let preempt = m.preempt_at_ms.unwrap();
        assert_eq!(
            p.describe_now(999, &m.id).unwrap().state,
            MachineState::Provisioning
        );
        assert_eq!(
            p.describe_now(1_000, &m.id).unwrap().state,
            MachineState::Running
        );
        assert!(p
            .interruptions_now(preempt.saturating_sub(30_001))
            .is_empty());
        let notes = p.interruptions_now(preempt.saturating_sub(30_000));
        assert_eq!(notes.len(), 1);
        assert_eq!(notes[0].terminate_at_ms, preempt);
        assert_eq!(
            p.describe_now(preempt, &m.id).unwrap().state,
            MachineState::Terminated
        );
        p.terminate_now(&m.id);
        assert!(p.interruptions_now(u64::MAX).is_empty());
        assert!(matches!(
            p.describe_now(0, "sim-99"),
            Err(CapacityError::NotFound { .. })
        ));
    }

    #[test]
    fn spot_machines_may_be_unavailable() {
        let p = SimulatedCloud::new(cfg(100, 0.5), 3);
        let (mut ok, mut none) = (0, 0);
        for _ in 0..100 {
            match p.provision_now(0, &want("H100", true)) {
                Ok(g) => {
                    ok += 1;
                    assert!(g.preempt_at_ms.unwrap() >= g.ready_at_ms.unwrap());
                }
                Err(CapacityError::NoSpot { .. }) => none += 1,
                Err(e) => panic!("{e}"),
            }
        }
        assert!(ok > 20 && none > 20, "{ok} {none}");
    }

    #[test]
    fn the_trait_answers_at_once() {
        let p = SimulatedCloud::new(cfg(1, 1.0), 1);
        let m = futures::executor::block_on(p.provision(0, &want("H100", false))).unwrap();
        assert_eq!(p.kind(), "simulated");
        assert!(futures::executor::block_on(p.terminate(1, &m.id)).is_ok());
        assert_eq!(p.live_nodes(), 0);
    }
}
