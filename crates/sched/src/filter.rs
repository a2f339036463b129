//! Feasibility: can a node host a request at all? Checks run cheapest first
//! and the first failing one is the node's reason, so an unschedulable
//! request comes back with counts a person can act on ("0/1213 nodes fit:
//! 812 too little free GPU share, 390 GPU model not allowed, 11 cordoned").

use std::fmt;

use crate::request::Request;
use crate::snapshot::{NodeState, Runtime};

/// Why a node cannot host a request. Named so that metrics and the
/// `explain` command can count them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The node's heartbeats stopped (the pass planner counts such nodes;
    /// the engine never sees them).
    Unreachable,
    Cordoned,
    /// A process node, and the request has an image.
    RunsProcesses,
    /// A container node, and the request has no image.
    RunsContainers,
    NoGpus,
    ModelNotAllowed,
    TooFewGpus,
    TooLittleCpu,
    TooLittleMemory,
    TooLittleGpuShare,
    /// A member of the same spread gang already went to this machine (one
    /// member per machine): not a cordon, though the engine closes the
    /// machine to the gang the same way.
    OtherMember,
}

impl Reason {
    pub const ALL: [Reason; 11] = [
        Reason::Unreachable,
        Reason::Cordoned,
        Reason::RunsProcesses,
        Reason::RunsContainers,
        Reason::NoGpus,
        Reason::ModelNotAllowed,
        Reason::TooFewGpus,
        Reason::TooLittleCpu,
        Reason::TooLittleMemory,
        Reason::TooLittleGpuShare,
        Reason::OtherMember,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Reason::Unreachable => "unreachable",
            Reason::Cordoned => "cordoned",
            Reason::RunsProcesses => "runs processes, not images",
            Reason::RunsContainers => "runs containers only",
            Reason::NoGpus => "no GPUs",
            Reason::ModelNotAllowed => "GPU model not allowed",
            Reason::TooFewGpus => "too few GPUs",
            Reason::TooLittleCpu => "too little free CPU",
            Reason::TooLittleMemory => "too little free memory",
            Reason::TooLittleGpuShare => "too little free GPU share",
            Reason::OtherMember => "holds another member",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Whether `state` can host `req`, and if not the first reason why.
pub fn check(state: &NodeState, req: &Request) -> Result<(), Reason> {
    if state.cordoned {
        return Err(Reason::Cordoned);
    }
    if state.runtime != req.runtime {
        return Err(match state.runtime {
            Runtime::Process => Reason::RunsProcesses,
            Runtime::Container => Reason::RunsContainers,
        });
    }
    let count = usize::from(req.gpu.gpu_count());
    if count > 0 {
        if state.model.is_none() || state.gpu_count() == 0 {
            return Err(Reason::NoGpus);
        }
        if !req.models.allows(state.model) {
            return Err(Reason::ModelNotAllowed);
        }
        if state.gpu_count() < count {
            return Err(Reason::TooFewGpus);
        }
    }
    // GPUs before CPU and memory: work that names no CPU or memory asks
    // its GPUs' share of the node, so a node whose GPUs are taken is out
    // of both at once, and the GPUs are the cause a person can act on.
    if count > 0 && state.gpus_with_at_least(req.gpu.per_gpu_milli()) < count {
        return Err(Reason::TooLittleGpuShare);
    }
    if state.cpu_free < req.cpu_milli {
        return Err(Reason::TooLittleCpu);
    }
    if state.mem_free < req.mem_mib {
        return Err(Reason::TooLittleMemory);
    }
    Ok(())
}

/// Why a request fits nowhere: how many nodes failed for each reason.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Explanation {
    pub nodes: usize,
    counts: [usize; Reason::ALL.len()],
}

impl Explanation {
    pub fn add(&mut self, reason: Reason, nodes: usize) {
        self.counts[reason.index()] += nodes;
        self.nodes += nodes;
    }

    pub fn count(&self, reason: Reason) -> usize {
        self.counts[reason.index()]
    }

    /// Reasons with a non-zero count, most frequent first.
    pub fn reasons(&self) -> Vec<(Reason, usize)> {
        let mut v: Vec<_> = Reason::ALL
            .iter()
            .map(|&r| (r, self.count(r)))
            .filter(|&(_, n)| n > 0)
            .collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.index().cmp(&b.0.index())));
        v
    }
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "0/{} nodes fit", self.nodes)?;
        for (i, (r, n)) in self.reasons().into_iter().enumerate() {
            let sep = if i == 0 { ": " } else { ", " };
            write!(f, "{sep}{n} {}", r.label())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{GpuDemand, ModelSet};

    fn state(model: u8, gpus: &[u16]) -> NodeState {
        NodeState {
            model: Some(model),
            runtime: Runtime::Process,
            cordoned: false,
            cpu_free: 4000,
            mem_free: 100,
            gpu_free: gpus.to_vec(),
            tags: 0,
        }
    }

    #[test]
    fn reasons_in_order() {
        let share = Request::new(GpuDemand::Share { milli: 500 }, 1000, 10);
        assert_eq!(check(&state(0, &[1000, 200]), &share), Ok(()));
        assert_eq!(
            check(&state(0, &[400, 200]), &share),
            Err(Reason::TooLittleGpuShare)
        );
        let mut s = state(0, &[1000]);
        s.cordoned = true;
        assert_eq!(check(&s, &share), Err(Reason::Cordoned));
        let only1 = share.with_models(ModelSet::of([1]));
        assert_eq!(
            check(&state(0, &[1000]), &only1),
            Err(Reason::ModelNotAllowed)
        );
        let four = Request::new(GpuDemand::Whole { count: 4 }, 0, 0);
        assert_eq!(
            check(&state(0, &[1000, 1000]), &four),
            Err(Reason::TooFewGpus)
        );
        let cpu = Request::new(GpuDemand::None, 5000, 0);
        assert_eq!(check(&state(0, &[]), &cpu), Err(Reason::TooLittleCpu));
    }

    #[test]
    fn a_node_takes_only_work_of_its_runtime() {
        let image = Request::new(GpuDemand::whole(1), 0, 0).with_runtime(Runtime::Container);
        let command = Request::new(GpuDemand::whole(1), 0, 0);
        let process = state(0, &[1000]);
        let mut container = state(0, &[1000]);
        container.runtime = Runtime::Container;
        assert_eq!(check(&process, &image), Err(Reason::RunsProcesses));
        assert_eq!(check(&container, &command), Err(Reason::RunsContainers));
        assert_eq!(check(&container, &image), Ok(()));
        assert_eq!(check(&process, &command), Ok(()));
        // Cordoned still comes first; the runtime before any capacity.
        container.cordoned = true;
        assert_eq!(check(&container, &command), Err(Reason::Cordoned));
        let big = Request::new(GpuDemand::whole(8), 99_000, 0).with_runtime(Runtime::Container);
        assert_eq!(check(&process, &big), Err(Reason::RunsProcesses));
        assert_eq!(Reason::RunsProcesses.label(), "runs processes, not images");
        assert_eq!(Reason::RunsContainers.label(), "runs containers only");
    }

    #[test]
    fn explanation_reads_like_the_issue() {
        let mut e = Explanation::default();
        e.add(Reason::Cordoned, 11);
        e.add(Reason::TooLittleGpuShare, 812);
        e.add(Reason::ModelNotAllowed, 390);
        assert_eq!(
            e.to_string(),
            "0/1213 nodes fit: 812 too little free GPU share, 390 GPU model not allowed, 11 cordoned"
        );
    }
}
