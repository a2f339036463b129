//! The node-pool autoscaler: how many machines a pool should add or give
//! back, from the work the last placement pass could not fit anywhere, the
//! pool's machines and its bounds.
//!
//! Pure, like the rest of this crate: the server gathers the inputs (the
//! planner's `no fit` reasons, the pool's machines from its store, the
//! clock) and applies the decision through a capacity provider; a test can
//! replay any sequence of inputs.
//!
//! The rules, in order:
//! 1. A machine that failed to build, or did not join within the boot
//!    timeout, is given back (it holds quota and costs money).
//! 2. Grow: pack the waiting work's GPUs (first fit, largest first) onto
//!    new machines of the pool's instance type, less the capacity already
//!    coming (machines still booting) or standing idle (a waiting work that
//!    fits an idle machine of the pool is placed there by the next pass, so
//!    it must not buy another). Never past `max`; up to `min` always.
//! 3. Shrink: a joined machine idle for the idle timeout is drained and
//!    given back, oldest idle first, never below `min` and never one the
//!    waiting work is counted on.
//!
//! A work whose single member needs more GPUs than one machine has can
//! never run on this pool; it is counted in the reason and ignored.

use serde::{Deserialize, Serialize};

/// A pool's bounds and timings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolBounds {
    /// Machines kept even when idle.
    pub min: u32,
    /// Most machines at once.
    pub max: u32,
    /// GPUs per machine of the pool's instance type.
    pub gpus_per_machine: u32,
    /// An idle machine is given back after this long.
    pub idle_timeout_ms: u64,
    /// A machine that has not joined this long after it was asked for is
    /// given back.
    pub boot_timeout_ms: u64,
}

impl PoolBounds {
    /// Checks the bounds: `min <= max`, `max > 0`, `gpus_per_machine > 0`.
    pub fn validate(&self) -> Result<(), crate::ScaleError> {
        if self.max == 0 || self.min > self.max {
            return Err(crate::ScaleError::InvalidBounds {
                min: self.min,
                max: self.max,
            });
        }
        if self.gpus_per_machine == 0 {
            return Err(crate::ScaleError::InvalidConfig {
                field: "gpus_per_machine",
                reason: "must be at least 1",
            });
        }
        Ok(())
    }
}

/// One waiting work the pool's instance type could host (the caller
/// filters by GPU model and runtime).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiting {
    /// Machines' worth of members (1 for an instance, N for a gang).
    pub members: u32,
    /// GPUs each member needs (a fraction or MIG slice counts as 1).
    pub gpus: u32,
}

/// Where one of the pool's machines is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Asked for at `since_ms`; its node has not joined yet.
    Booting { since_ms: u64 },
    /// Its node joined. `idle_since_ms`: since when it has run nothing
    /// (`None`: busy).
    Joined { idle_since_ms: Option<u64> },
    /// The provider could not build it, or it died.
    Failed,
}

/// One machine of the pool, as the decision sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolMachine {
    /// The caller's name for it (echoed in [`Terminate`]).
    pub name: String,
    pub phase: Phase,
}

/// Why a machine is given back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Why {
    /// Idle for the idle timeout.
    Idle,
    /// Did not join within the boot timeout.
    BootTimeout,
    /// The provider failed to build it, or it died.
    Failed,
}

impl Why {
    /// A stable label for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            Why::Idle => "idle",
            Why::BootTimeout => "boot_timeout",
            Why::Failed => "failed",
        }
    }
}

/// A machine to give back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Terminate {
    pub name: String,
    pub why: Why,
}

/// What the pool should do now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PoolDecision {
    /// New machines to ask for.
    pub provision: u32,
    /// Machines to drain and give back.
    pub terminate: Vec<Terminate>,
    /// In words, for logs and the API.
    pub reason: String,
}

/// Machines needed to hold `waiting`: first fit, largest member first.
/// Returns `(machines, members that fit no machine)`.
fn machines_for(waiting: &[Waiting], per_machine: u32) -> (u32, u32) {
    let mut members: Vec<u32> = Vec::new();
    let mut too_big = 0u32;
    for w in waiting {
        if w.gpus > per_machine {
            too_big = too_big.saturating_add(w.members);
            continue;
        }
        // Bounded: a pool never has more than u32 machines' worth asked.
        let n = w.members.min(10_000);
        members.extend(std::iter::repeat_n(w.gpus.max(1), n as usize));
    }
    members.sort_unstable_by(|a, b| b.cmp(a));
    let mut free: Vec<u32> = Vec::new();
    for m in members {
        match free.iter_mut().find(|f| **f >= m) {
            Some(f) => *f -= m,
            None => free.push(per_machine - m),
        }
    }
    (u32::try_from(free.len()).unwrap_or(u32::MAX), too_big)
}

/// The decision for one pool at `now_ms` (see the module doc).
pub fn decide(
    now_ms: u64,
    bounds: &PoolBounds,
    waiting: &[Waiting],
    machines: &[PoolMachine],
) -> PoolDecision {
    let mut out = PoolDecision::default();
    let mut why: Vec<String> = Vec::new();

    // 1. Broken machines go.
    let mut booting = 0u32;
    let mut idle: Vec<(&PoolMachine, u64)> = Vec::new();
    let mut live = 0u32;
    for m in machines {
        match m.phase {
            Phase::Failed => out.terminate.push(Terminate {
                name: m.name.clone(),
                why: Why::Failed,
            }),
            Phase::Booting { since_ms }
                if now_ms.saturating_sub(since_ms) >= bounds.boot_timeout_ms =>
            {
                out.terminate.push(Terminate {
                    name: m.name.clone(),
                    why: Why::BootTimeout,
                })
            }
            Phase::Booting { .. } => {
                booting += 1;
                live += 1;
            }
            Phase::Joined { idle_since_ms } => {
                live += 1;
                if let Some(t) = idle_since_ms {
                    idle.push((m, t));
                }
            }
        }
    }
    let broken = out.terminate.len();
    if broken > 0 {
        why.push(format!("{broken} failed or did not join"));
    }

    // 2. Grow.
    let (needed, too_big) = machines_for(waiting, bounds.gpus_per_machine);
    if too_big > 0 {
        why.push(format!(
            "{too_big} waiting member(s) need more than {} GPUs per machine",
            bounds.gpus_per_machine
        ));
    }
    let coming = booting.saturating_add(u32::try_from(idle.len()).unwrap_or(u32::MAX));
    let room = bounds.max.saturating_sub(live);
    let for_work = needed.saturating_sub(coming);
    let for_min = bounds.min.saturating_sub(live);
    out.provision = for_work.max(for_min).min(room);
    if for_work > 0 {
        why.push(format!(
            "waiting work needs {needed} machine(s), {coming} booting or idle"
        ));
        if for_work > room {
            why.push(format!("capped at max {}", bounds.max));
        }
    } else if for_min > 0 {
        why.push(format!("below min {}", bounds.min));
    }

    // 3. Shrink: idle machines past the timeout that the waiting work does
    // not count on, oldest idle first, down to `min`.
    let spare = coming.saturating_sub(needed.min(coming));
    let mut expired: Vec<(&PoolMachine, u64)> = idle
        .into_iter()
        .filter(|(_, t)| now_ms.saturating_sub(*t) >= bounds.idle_timeout_ms)
        .collect();
    expired.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.name.cmp(&b.0.name)));
    let above_min = live.saturating_sub(bounds.min);
    let give_back = u32::try_from(expired.len())
        .unwrap_or(u32::MAX)
        .min(spare)
        .min(above_min);
    for (m, _) in expired.into_iter().take(give_back as usize) {
        out.terminate.push(Terminate {
            name: m.name.clone(),
            why: Why::Idle,
        });
    }
    if give_back > 0 {
        why.push(format!(
            "{give_back} idle for {} s",
            bounds.idle_timeout_ms / 1000
        ));
    }
    out.reason = if why.is_empty() {
        "steady".to_string()
    } else {
        why.join("; ")
    };
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn bounds(min: u32, max: u32) -> PoolBounds {
        PoolBounds {
            min,
            max,
            gpus_per_machine: 2,
            idle_timeout_ms: 60_000,
            boot_timeout_ms: 600_000,
        }
    }

    fn joined(name: &str, idle_since_ms: Option<u64>) -> PoolMachine {
        PoolMachine {
            name: name.into(),
            phase: Phase::Joined { idle_since_ms },
        }
    }

    fn booting(name: &str, since_ms: u64) -> PoolMachine {
        PoolMachine {
            name: name.into(),
            phase: Phase::Booting { since_ms },
        }
    }

    const ONE: Waiting = Waiting {
        members: 1,
        gpus: 1,
    };

    #[test]
    fn waiting_work_grows_the_pool_once() {
        let b = bounds(0, 4);
        let d = decide(0, &b, &[ONE, ONE, ONE], &[]);
        assert_eq!(
            d.provision, 2,
            "three 1-GPU instances fill two 2-GPU machines"
        );
        assert!(d.terminate.is_empty());
        // Next round, the machines are booting: nothing more is bought.
        let m = [booting("a", 0), booting("b", 0)];
        assert_eq!(decide(1_000, &b, &[ONE, ONE, ONE], &m).provision, 0);
        // Once joined and idle, the next pass will use them: still nothing.
        let m = [joined("a", Some(5_000)), joined("b", Some(5_000))];
        assert_eq!(decide(6_000, &b, &[ONE, ONE, ONE], &m).provision, 0);
    }

    #[test]
    fn growth_stops_at_max_and_ignores_what_never_fits() {
        let b = bounds(0, 2);
        let big = Waiting {
            members: 1,
            gpus: 3,
        };
        let gang = Waiting {
            members: 4,
            gpus: 2,
        };
        let d = decide(0, &b, &[big, gang], &[joined("a", None)]);
        assert_eq!(d.provision, 1, "{}", d.reason);
        assert!(d.reason.contains("need more than 2 GPUs"), "{}", d.reason);
        assert!(d.reason.contains("capped at max 2"), "{}", d.reason);
        assert_eq!(decide(0, &b, &[big], &[]).provision, 0);
    }

    #[test]
    fn idle_machines_go_after_the_timeout_down_to_min() {
        let b = bounds(1, 4);
        let m = [
            joined("a", Some(0)),
            joined("b", Some(10_000)),
            joined("c", None),
        ];
        assert!(decide(59_999, &b, &[], &m).terminate.is_empty());
        let d = decide(60_000, &b, &[], &m);
        assert_eq!(
            d.terminate,
            vec![Terminate {
                name: "a".into(),
                why: Why::Idle
            }]
        );
        let d = decide(70_000, &b, &[], &m);
        assert_eq!(d.terminate.len(), 2, "min 1 is the busy machine c");
        // min 3: nobody goes.
        assert!(decide(1_000_000, &bounds(3, 4), &[], &m)
            .terminate
            .is_empty());
    }

    #[test]
    fn an_idle_machine_the_queue_counts_on_stays() {
        let b = bounds(0, 4);
        let m = [joined("a", Some(0))];
        let d = decide(1_000_000, &b, &[ONE], &m);
        assert!(d.terminate.is_empty());
        assert_eq!(d.provision, 0);
    }

    #[test]
    fn broken_and_late_machines_are_given_back_and_replaced() {
        let b = bounds(0, 4);
        let m = [
            PoolMachine {
                name: "x".into(),
                phase: Phase::Failed,
            },
            booting("y", 0),
        ];
        let d = decide(600_000, &b, &[ONE], &m);
        assert_eq!(d.provision, 1);
        let whys: Vec<Why> = d.terminate.iter().map(|t| t.why).collect();
        assert_eq!(whys, vec![Why::Failed, Why::BootTimeout]);
    }

    #[test]
    fn min_is_kept() {
        let d = decide(0, &bounds(2, 4), &[], &[joined("a", Some(0))]);
        assert_eq!(d.provision, 1);
        assert!(d.reason.contains("below min"), "{}", d.reason);
    }

    #[test]
    fn bounds_are_checked() {
        assert!(bounds(3, 2).validate().is_err());
        assert!(bounds(0, 0).validate().is_err());
        let mut b = bounds(0, 1);
        b.gpus_per_machine = 0;
        assert!(b.validate().is_err());
        assert!(bounds(0, 1).validate().is_ok());
    }

    proptest! {
        /// Whatever the inputs, the pool never exceeds max, never drops
        /// below min by shrinking, and never both buys and idles out.
        #[test]
        fn decisions_respect_the_bounds(
            min in 0u32..4, extra in 1u32..6, now in 0u64..2_000_000,
            waiting in proptest::collection::vec((1u32..4, 1u32..4), 0..6),
            idle in proptest::collection::vec(proptest::option::of(0u64..2_000_000), 0..6),
            boots in proptest::collection::vec(0u64..2_000_000, 0..3),
        ) {
            let b = bounds(min, min + extra);
            let waiting: Vec<Waiting> = waiting.into_iter()
                .map(|(members, gpus)| Waiting { members, gpus }).collect();
            let mut machines: Vec<PoolMachine> = idle.iter().enumerate()
                .map(|(i, t)| joined(&format!("j{i}"), *t)).collect();
            machines.extend(boots.iter().enumerate().map(|(i, t)| booting(&format!("b{i}"), *t)));
            let d = decide(now, &b, &waiting, &machines);
            let live = machines.len() as u32;
            let gone = d.terminate.len() as u32;
            prop_assert!(live.saturating_sub(gone) + d.provision <= b.max.max(live));
            let idle_gone = d.terminate.iter().filter(|t| t.why == Why::Idle).count() as u32;
            let others_gone = gone - idle_gone;
            prop_assert!(idle_gone == 0 || live - others_gone - idle_gone >= b.min);
            prop_assert!(d.provision == 0 || idle_gone == 0);
        }
    }
}
