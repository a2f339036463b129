//! What a workload asks for: a number of whole GPUs or a share of one GPU,
//! the GPU models it accepts, CPU and memory.

use crate::{Error, MILLI};

/// Index of a GPU model in a [`crate::snapshot::ModelTable`].
pub type ModelId = u8;

/// How a node runs work: sandboxed processes or containers. A request
/// names the one it needs ([`Request::runtime`]) and only nodes running it
/// fit. Process is the default, so callers that never mention runtimes
/// (the simulator, the benchmarks) place exactly as before.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Runtime {
    #[default]
    Process,
    Container,
}

impl From<flotilla_core::node::RuntimeKind> for Runtime {
    fn from(r: flotilla_core::node::RuntimeKind) -> Self {
        match r {
            flotilla_core::node::RuntimeKind::Process => Runtime::Process,
            flotilla_core::node::RuntimeKind::Container => Runtime::Container,
        }
    }
}

/// The GPU part of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpuDemand {
    /// CPU-only work.
    None,
    /// `count` whole GPUs, each entirely free before placement.
    Whole { count: u16 },
    /// A share of one GPU in milli-GPU, strictly between 0 and 1000 (a full
    /// share is normalised to `Whole { count: 1 }` by [`GpuDemand::share`]).
    Share { milli: u16 },
}

impl GpuDemand {
    /// A share of one GPU; 1000 milli is one whole GPU.
    pub fn share(milli: u16) -> Result<Self, Error> {
        match milli {
            0 => Err(Error::InvalidRequest(
                "a gpu share must be at least 1 milli",
            )),
            MILLI => Ok(GpuDemand::Whole { count: 1 }),
            m if m > MILLI => Err(Error::InvalidRequest(
                "a gpu share must be at most 1000 milli",
            )),
            m => Ok(GpuDemand::Share { milli: m }),
        }
    }

    /// `count` whole GPUs; zero means CPU-only.
    pub fn whole(count: u16) -> Self {
        if count == 0 {
            GpuDemand::None
        } else {
            GpuDemand::Whole { count }
        }
    }

    /// The trace's encoding (`num_gpu`, `gpu_milli` per GPU): a share only
    /// when one GPU is asked for with less than 1000 milli.
    pub fn from_trace(num_gpu: u16, gpu_milli: u16) -> Result<Self, Error> {
        match num_gpu {
            0 => Ok(GpuDemand::None),
            1 => GpuDemand::share(gpu_milli),
            n => Ok(GpuDemand::Whole { count: n }),
        }
    }

    /// How many GPUs the request touches.
    pub fn gpu_count(self) -> u16 {
        match self {
            GpuDemand::None => 0,
            GpuDemand::Share { .. } => 1,
            GpuDemand::Whole { count } => count,
        }
    }

    /// Milli-GPU needed on each GPU touched.
    pub fn per_gpu_milli(self) -> u16 {
        match self {
            GpuDemand::None => 0,
            GpuDemand::Share { milli } => milli,
            GpuDemand::Whole { .. } => MILLI,
        }
    }

    /// Total milli-GPU requested.
    pub fn total_milli(self) -> u32 {
        u32::from(self.gpu_count()) * u32::from(self.per_gpu_milli())
    }

    /// The GPU-clustering tag of this demand: bit 0 for shares, bit `n` for
    /// `n` whole GPUs (capped at 31), none for CPU-only work.
    pub fn tag(self) -> u32 {
        match self {
            GpuDemand::None => 0,
            GpuDemand::Share { .. } => 1,
            GpuDemand::Whole { count } => 1 << count.min(31),
        }
    }
}

/// The GPU models a request accepts.
///
/// A bitmask over [`ModelId`]s so the filter's model check is one AND. `Any`
/// is distinct from an empty set: a request naming only models the cluster
/// does not have fits nowhere rather than everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ModelSet {
    #[default]
    Any,
    Only(u64),
}

impl ModelSet {
    /// The set of the given models.
    pub fn of(models: impl IntoIterator<Item = ModelId>) -> Self {
        ModelSet::Only(models.into_iter().fold(0u64, |m, id| m | (1u64 << id)))
    }

    /// Whether a node with this model (None: a node without GPUs) is allowed.
    pub fn allows(self, model: Option<ModelId>) -> bool {
        match (self, model) {
            (ModelSet::Any, _) => true,
            (ModelSet::Only(_), None) => false,
            (ModelSet::Only(mask), Some(id)) => mask & (1u64 << id) != 0,
        }
    }
}

/// One placement request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub gpu: GpuDemand,
    /// Allowed GPU models; only consulted when the request needs a GPU.
    pub models: ModelSet,
    pub cpu_milli: u32,
    pub mem_mib: u64,
    /// The runtime its node must run (an image needs containers).
    pub runtime: Runtime,
}

/// By hand so that the runtime costs the engine's shape cache no extra
/// hasher call: it rides in the word that carries the CPU demand.
impl std::hash::Hash for Request {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.gpu.hash(state);
        self.models.hash(state);
        state.write_u64(u64::from(self.cpu_milli) | (self.runtime as u64) << 32);
        state.write_u64(self.mem_mib);
    }
}

impl Request {
    pub fn new(gpu: GpuDemand, cpu_milli: u32, mem_mib: u64) -> Self {
        Request {
            gpu,
            models: ModelSet::Any,
            cpu_milli,
            mem_mib,
            runtime: Runtime::Process,
        }
    }

    pub fn with_models(mut self, models: ModelSet) -> Self {
        self.models = models;
        self
    }

    pub fn with_runtime(mut self, runtime: Runtime) -> Self {
        self.runtime = runtime;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_encoding_normalises_full_shares() {
        assert_eq!(
            GpuDemand::from_trace(1, 1000),
            Ok(GpuDemand::Whole { count: 1 })
        );
        assert_eq!(
            GpuDemand::from_trace(1, 470),
            Ok(GpuDemand::Share { milli: 470 })
        );
        assert_eq!(
            GpuDemand::from_trace(8, 1000),
            Ok(GpuDemand::Whole { count: 8 })
        );
        assert_eq!(GpuDemand::from_trace(0, 0), Ok(GpuDemand::None));
        assert!(GpuDemand::from_trace(1, 0).is_err());
        assert!(GpuDemand::share(1001).is_err());
    }

    #[test]
    fn model_sets() {
        let s = ModelSet::of([1, 3]);
        assert!(s.allows(Some(1)) && s.allows(Some(3)));
        assert!(!s.allows(Some(2)) && !s.allows(None));
        assert!(ModelSet::Any.allows(None));
        assert!(!ModelSet::Only(0).allows(Some(0)));
    }
}
