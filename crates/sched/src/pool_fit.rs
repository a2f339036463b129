//! Work against the pool as a whole, whatever is running: the CPU and
//! memory a request gets when it names none (a GPU's share of its node),
//! and work that could never be placed in this pool however long it
//! waits. Pure: the caller hands in the machines it knows.
//!
//! Why a share of the node: a fixed default (once 1 CPU and 1 GiB per
//! instance) starves GPUs on small hosts: six simulated GPUs on two cores
//! held two instances at a time. Asking each GPU's share of the host's CPU
//! and memory lets every GPU be rented at once, on any machine.

use crate::input::{GpuAsk, NodeSnap, QueuedWork};

/// One machine as the defaults see it: its totals and its GPUs' models.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineShape {
    /// CPU the machine offers, milli-cores.
    pub cpu_milli: u64,
    /// Memory the machine offers, MiB.
    pub mem_mib: u64,
    /// The model of each of its GPUs.
    pub gpu_models: Vec<String>,
}

/// The CPU (milli-cores) and memory (MiB) a member asking `gpu_milli`
/// milli-GPU (1000 per whole GPU; a share scales down) of `models` (empty:
/// any) gets when it names none: on each machine that could hold it, the
/// machine's CPU and memory divided by its GPUs, times the GPUs asked;
/// the smallest over those machines, so the request fits wherever its GPUs
/// do. `None` when no machine could hold it or it asks no GPU (the caller
/// keeps its fixed default).
pub fn share_of_node(
    machines: &[MachineShape],
    models: &[String],
    gpu_milli: u64,
) -> Option<(u32, u64)> {
    if gpu_milli == 0 {
        return None;
    }
    machines
        .iter()
        .filter_map(|m| {
            let gpus = m.gpu_models.len() as u64;
            let allowed = m
                .gpu_models
                .iter()
                .filter(|g| models.is_empty() || models.contains(g))
                .count() as u64;
            // A share fits on one allowed GPU; whole GPUs need that many.
            if allowed == 0 || allowed.saturating_mul(1000) < gpu_milli {
                return None;
            }
            let per =
                |total: u64| (total.saturating_mul(gpu_milli) / gpus.saturating_mul(1000)).max(1);
            Some((per(m.cpu_milli), per(m.mem_mib)))
        })
        .reduce(|(c, m), (c2, m2)| (c.min(c2), m.min(m2)))
        .map(|(c, m)| (u32::try_from(c).unwrap_or(u32::MAX), m))
}

/// Why `w` could never be placed in a pool of `nodes`, even empty, with
/// every machine ready and uncordoned; `None` when it could be. Only
/// counts and models are judged, so a pool that grows (a node joins) turns
/// the answer back to `None` at the next pass.
pub fn never_fits(nodes: &[NodeSnap], w: &QueuedWork) -> Option<String> {
    let (count, per_gpu) = match w.gpu {
        GpuAsk::None => (0u16, 0u16),
        GpuAsk::Whole(n) => (n, 1000),
        GpuAsk::Fraction(m) | GpuAsk::Mig(m) => (1, m),
    };
    let kind = if w.models.is_empty() {
        String::new()
    } else {
        format!("{} ", w.models.join(" or "))
    };
    // `1 GPU`, `2 H100 GPUs`.
    let gpus = |n: u16| format!("{n} {kind}GPU{}", if n == 1 { "" } else { "s" });
    let models = format!("{kind}GPUs");
    // Machines that could hold one member, emptied. The runtime is left
    // to the engine's own reason ("runs processes, not images"): a
    // machine of the other runtime may be added by its operator any time.
    let allowed = |n: &NodeSnap| {
        n.gpus
            .iter()
            .filter(|g| w.models.is_empty() || w.models.contains(&g.model))
            .filter(|g| count == 0 || !g.mig || matches!(w.gpu, GpuAsk::Mig(_)))
            .count()
    };
    let holds_one =
        |n: &&NodeSnap| count == 0 || (allowed(n) >= usize::from(count) && per_gpu <= 1000);
    if nodes.is_empty() {
        // No machine yet (an agent still starting): nothing to judge.
        return None;
    }
    let fit: Vec<&NodeSnap> = nodes.iter().filter(holds_one).collect();
    if fit.is_empty() {
        let most = nodes.iter().map(allowed).max().unwrap_or(0);
        return Some(if most == 0 {
            format!("gpu_types: no machine in this pool has {models} it can take")
        } else {
            format!(
                "gpus: asks {} on one machine; the most any machine here has is {most}",
                gpus(count)
            )
        });
    }
    if !fit
        .iter()
        .any(|n| n.cpu_total_milli >= w.cpu_milli && n.mem_total_mib >= w.mem_mib)
    {
        let cpu = fit.iter().map(|n| n.cpu_total_milli).max().unwrap_or(0);
        let mem = fit.iter().map(|n| n.mem_total_mib).max().unwrap_or(0);
        return Some(format!(
            "cpu_milli, memory_mb: asks {} milli-CPU and {} MiB per member; the largest machine here has {cpu} and {mem}",
            w.cpu_milli, w.mem_mib
        ));
    }
    if w.spread && usize::from(w.members) > fit.len() {
        return Some(format!(
            "nodes: asks {} distinct machines with {} each; this pool has {}",
            w.members,
            gpus(count.max(1)),
            fit.len()
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gang::Locality;
    use crate::pass::GpuSnap;
    use crate::Runtime;

    fn machine(cpu: u64, mem: u64, models: &[&str]) -> MachineShape {
        MachineShape {
            cpu_milli: cpu,
            mem_mib: mem,
            gpu_models: models.iter().map(|m| m.to_string()).collect(),
        }
    }

    #[test]
    fn a_gpu_gets_its_share_of_the_node() {
        let six = machine(
            2000,
            6000,
            &["H100", "H100", "H100", "H100", "L40S", "L40S"],
        );
        // Six one-GPU members fit the two cores.
        assert_eq!(
            share_of_node(std::slice::from_ref(&six), &[], 1000),
            Some((333, 1000))
        );
        assert_eq!(
            share_of_node(std::slice::from_ref(&six), &[], 2000),
            Some((666, 2000))
        );
        // A half share asks half a GPU's share.
        assert_eq!(
            share_of_node(std::slice::from_ref(&six), &[], 500),
            Some((166, 500))
        );
        // The smallest share among machines that could hold it.
        let big = machine(64_000, 512_000, &["H100", "H100"]);
        assert_eq!(
            share_of_node(&[six.clone(), big.clone()], &[], 1000),
            Some((333, 1000))
        );
        // Models narrow the machines: only the big one has no L40S.
        assert_eq!(
            share_of_node(&[six.clone(), big], &["L40S".into()], 1000),
            Some((333, 1000))
        );
        // Nothing holds it, or no GPU asked: the caller's default.
        assert_eq!(
            share_of_node(std::slice::from_ref(&six), &["A100".into()], 1000),
            None
        );
        assert_eq!(share_of_node(std::slice::from_ref(&six), &[], 0), None);
        assert_eq!(share_of_node(&[six], &["L40S".into()], 3000), None);
        assert_eq!(share_of_node(&[], &[], 1000), None);
    }

    fn node(models: &[&str]) -> NodeSnap {
        NodeSnap {
            ready: true,
            cordoned: false,
            region: "r".into(),
            pool: "p".into(),
            runtime: Runtime::Process,
            cpu_total_milli: 2000,
            mem_total_mib: 4096,
            cpu_free_milli: 2000,
            mem_free_mib: 4096,
            gpus: models
                .iter()
                .map(|m| GpuSnap {
                    model: m.to_string(),
                    mig: false,
                    free_milli: 1000,
                })
                .collect(),
        }
    }

    fn gang(members: u16, per: u16) -> QueuedWork {
        QueuedWork {
            key: 1,
            tenant: 0,
            tier: crate::Tier::Dedicated,
            priority: 0,
            submitted_ms: 0,
            members,
            spread: members > 1,
            locality: Locality::Any,
            gpu: GpuAsk::Whole(per),
            models: Vec::new(),
            cpu_milli: 100,
            mem_mib: 100,
            runtime: Runtime::Process,
            max_runtime_ms: None,
            ready_ms: Vec::new(),
        }
    }

    #[test]
    fn a_gang_wider_than_the_pool_never_fits_and_says_why() {
        let one = [node(&["H100", "H100", "H100", "H100", "L40S", "L40S"])];
        let why = never_fits(&one, &gang(2, 1)).expect("two machines from one");
        assert!(why.starts_with("nodes: asks 2 distinct machines"), "{why}");
        assert!(why.contains("this pool has 1"), "{why}");
        assert!(!why.contains("cordoned"), "{why}");
        // One member, or two machines: it fits.
        assert_eq!(never_fits(&one, &gang(1, 2)), None);
        let two = [node(&["H100"; 2]), node(&["H100"; 2])];
        assert_eq!(never_fits(&two, &gang(2, 2)), None);
        // More GPUs than any machine has.
        let why = never_fits(&one, &gang(1, 8)).expect("eight from six");
        assert!(why.starts_with("gpus: asks 8 GPUs on one machine"), "{why}");
        // No machine yet: nothing to judge.
        assert_eq!(never_fits(&[], &gang(2, 1)), None);
        // A busy machine is not a reason: only totals count.
        let mut busy = node(&["H100"]);
        busy.cpu_free_milli = 0;
        busy.gpus[0].free_milli = 0;
        busy.cordoned = true;
        assert_eq!(never_fits(&[busy], &gang(1, 1)), None);
    }
}
