//! GPU telemetry: the counters the DCGM exporter publishes, read through
//! NVML and sent to the server with every sync.
//!
//! The agent reads only what the driver answers. Simulated GPUs have no
//! driver, so they report nothing: the server then has no utilisation for
//! them rather than an invented one. A counter a device does not support
//! (power on some boards) is left out of its sample, not sent as zero.

use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

use flotilla_core::api::GpuSample;

const MIB: u64 = 1024 * 1024;

/// Where samples come from.
pub enum Telemetry {
    /// A driver answers: read the devices the node registered.
    Nvml {
        /// Boxed: the library handle is large and the agent holds one.
        nvml: Box<Nvml>,
        /// Indices of the GPUs the node offers (devices the catalog does
        /// not know are not offered, so not sampled either).
        indices: Vec<u32>,
    },
    /// Simulated GPUs: nothing to read.
    None,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Telemetry::Nvml { indices, .. } => f
                .debug_struct("Telemetry::Nvml")
                .field("indices", indices)
                .finish(),
            Telemetry::None => f.write_str("Telemetry::None"),
        }
    }
}

impl Telemetry {
    /// Opens NVML for the GPUs at `indices`.
    pub fn nvml(indices: Vec<u32>) -> Result<Self, NvmlError> {
        Ok(Telemetry::Nvml {
            nvml: Box::new(Nvml::init()?),
            indices,
        })
    }

    /// One sample of every offered GPU. A device that cannot be opened is
    /// skipped (logged once per call); a counter that cannot be read is
    /// absent from its sample.
    pub fn sample(&self) -> Vec<GpuSample> {
        let Telemetry::Nvml { nvml, indices } = self else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(indices.len());
        for &index in indices {
            let device = match nvml.device_by_index(index) {
                Ok(d) => d,
                Err(error) => {
                    tracing::warn!(index, %error, "cannot open gpu for telemetry");
                    continue;
                }
            };
            let Ok(uuid) = device.uuid() else { continue };
            let utilization = device.utilization_rates().ok();
            let memory = device.memory_info().ok();
            out.push(GpuSample {
                index,
                uuid,
                device_name: device.name().unwrap_or_default(),
                gpu_util_pct: utilization.as_ref().map(|u| u.gpu),
                mem_copy_util_pct: utilization.as_ref().map(|u| u.memory),
                fb_used_mib: memory.as_ref().map(|m| m.used / MIB),
                fb_free_mib: memory.as_ref().map(|m| m.free / MIB),
                temperature_c: device.temperature(TemperatureSensor::Gpu).ok(),
                power_w: device.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
                sm_clock_mhz: device.clock_info(Clock::SM).ok(),
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulated_gpus_report_nothing() {
        assert!(Telemetry::None.sample().is_empty());
    }
}
