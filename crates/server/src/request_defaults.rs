//! The CPU and memory work gets when its request names none: a GPU's share
//! of the node ([`flotilla_sched::pool_fit::share_of_node`]), resolved here
//! when the work is created, from the machines registered then, and stored
//! as the work's own request (what placement checks and the agent
//! enforces). A pool with no machine that could hold the work yet keeps
//! the fixed default of the request's validation (1 CPU, 1 GiB).
//!
//! Resolved at creation rather than per node at placement: requests are
//! stored concrete, so the agents' limits, the API and usage show the
//! numbers the work runs with. The share is the smallest over the machines
//! that could hold the work, so it fits wherever its GPUs do.

use flotilla_sched::pool_fit::{share_of_node, MachineShape};
use flotilla_store::PageReq;

use crate::error::ApiResult;
use crate::state::AppState;

/// The largest CPU request validation accepts, milli-cores.
const MAX_CPU_MILLI: u32 = 1_024_000;
/// The largest memory request validation accepts, MiB.
const MAX_MEMORY_MB: u64 = 64 * 1024 * 1024;

/// What a request asks, as far as its default CPU and memory go.
pub(crate) struct Ask<'a> {
    /// Whole GPUs per member (ignored with a share).
    pub gpus: u32,
    /// Models asked, as the request spells them (unknown ones are left to
    /// validation).
    pub gpu_types: &'a [String],
    /// A fraction of one GPU.
    pub gpu_fraction: Option<f64>,
    /// A MIG profile, e.g. `1g.10gb`: its compute slices of seven.
    pub mig_profile: Option<&'a str>,
}

impl Ask<'_> {
    /// Milli-GPU asked per member: 1000 a whole GPU, a share scaled down.
    fn gpu_milli(&self) -> u64 {
        if let Some(f) = self.gpu_fraction.filter(|f| f.is_finite() && *f > 0.0) {
            return (f.min(1.0) * 1000.0).round().max(1.0) as u64;
        }
        if let Some(p) = self.mig_profile {
            // `Ng.…`: N of the GPU's seven compute slices.
            let slices: u64 = p
                .split('g')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(1);
            return (slices.clamp(1, 7) * 1000 / 7).max(1);
        }
        u64::from(self.gpus).saturating_mul(1000)
    }
}

/// Fills in `cpu_milli` and `memory_mb` where the request left them out.
pub(crate) async fn fill(
    st: &AppState,
    ask: Ask<'_>,
    cpu_milli: &mut Option<u32>,
    memory_mb: &mut Option<u64>,
) -> ApiResult<()> {
    if cpu_milli.is_some() && memory_mb.is_some() {
        return Ok(());
    }
    let catalog = st.catalog();
    let models: Vec<String> = ask
        .gpu_types
        .iter()
        .filter_map(|t| catalog.resolve(t, "gpu_types").ok())
        .collect();
    let Some((cpu, mem)) = share_of_node(&machines(st).await?, &models, ask.gpu_milli()) else {
        return Ok(());
    };
    // Within what validation accepts: a huge machine's share must not
    // turn a request that named nothing into an error naming a field.
    cpu_milli.get_or_insert(cpu.min(MAX_CPU_MILLI));
    memory_mb.get_or_insert(mem.min(MAX_MEMORY_MB));
    Ok(())
}

/// Every registered machine's totals and GPU models.
async fn machines(st: &AppState) -> ApiResult<Vec<MachineShape>> {
    let mut out = Vec::new();
    let mut page = PageReq {
        after: None,
        limit: 1000,
    };
    loop {
        let nodes = st.store().list_nodes(&page).await?;
        out.extend(nodes.items.into_iter().map(|n| MachineShape {
            cpu_milli: n.cpu_milli,
            mem_mib: n.memory_mb,
            gpu_models: n.gpus.into_iter().map(|g| g.model).collect(),
        }));
        match nodes.next {
            Some(next) => page.after = Some(next),
            None => return Ok(out),
        }
    }
}
