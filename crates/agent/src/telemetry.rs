//! GPU telemetry: the counters the DCGM exporter publishes, read through
//! NVML and sent to the server with every sync.
//!
//! The agent reads only what the driver answers, health signals included
//! (the last critical XID error, uncorrectable ECC errors, temperature):
//! it reports them, and the server decides whether a GPU leaves placement.
//! Simulated GPUs have no driver. They report nothing, unless the agent
//! was given a readings file (`--simulated-telemetry`), which stands in
//! for the driver: each sync reads it again, so a test or a demo can raise
//! an XID error or heat on a simulated GPU while the agent runs. A counter
//! a device does not support (power on some boards) is left out of its
//! sample, not sent as zero.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{EventSet, Nvml};

use flotilla_core::api::{DiscoveredGpu, GpuSample};

const MIB: u64 = 1024 * 1024;

/// NVML's code for an XID error it could not name.
const XID_UNKNOWN: u64 = 999;

/// Where samples come from.
pub enum Telemetry {
    /// A driver answers: read the devices the node registered.
    Nvml {
        /// Opened once for the agent's life and never closed, so the XID
        /// event sets, which borrow it, may live as long.
        nvml: &'static Nvml,
        /// Indices of the GPUs the node offers (devices the catalog does
        /// not know are not offered, so not sampled either).
        indices: Vec<u32>,
        /// Critical XID events per GPU, and the last one seen of each.
        xids: Mutex<XidWatch>,
    },
    /// Simulated GPUs with a readings file standing in for the driver.
    Simulated {
        /// The file: a JSON object from GPU index to that GPU's readings
        /// (`{"0": {"last_xid": 79, "temperature_c": 70}}`), fields as in
        /// [`GpuSample`].
        file: PathBuf,
        /// The simulated GPUs: index, UUID, catalog model.
        gpus: Vec<(u32, String, String)>,
    },
    /// Simulated GPUs: nothing to read.
    None,
}

/// XID event sets of the GPUs that support them, and the last critical XID
/// each raised since the agent started (DCGM reports the same: the last
/// value, not a count).
pub struct XidWatch {
    sets: Vec<(u32, EventSet<'static>)>,
    last: HashMap<u32, u64>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Telemetry::Nvml { indices, .. } => f
                .debug_struct("Telemetry::Nvml")
                .field("indices", indices)
                .finish(),
            Telemetry::Simulated { file, gpus } => f
                .debug_struct("Telemetry::Simulated")
                .field("file", file)
                .field("gpus", &gpus.len())
                .finish(),
            Telemetry::None => f.write_str("Telemetry::None"),
        }
    }
}

impl Telemetry {
    /// Opens NVML for the GPUs at `indices`, and registers for their
    /// critical XID events where the device supports them.
    pub fn nvml(indices: Vec<u32>) -> Result<Self, NvmlError> {
        // Leaked on purpose: one handle for the agent's whole life, which
        // the event sets borrow.
        let nvml: &'static Nvml = Box::leak(Box::new(Nvml::init()?));
        let mut sets = Vec::new();
        for &index in &indices {
            let Ok(device) = nvml.device_by_index(index) else {
                continue;
            };
            let supported = device
                .supported_event_types()
                .is_ok_and(|t| t.contains(EventTypes::CRITICAL_XID_ERROR));
            if !supported {
                tracing::info!(index, "gpu raises no xid events; xid errors go unseen");
                continue;
            }
            let registered = nvml
                .create_event_set()
                .map_err(nvml_wrapper::error::NvmlErrorWithSource::from)
                .and_then(|set| device.register_events(EventTypes::CRITICAL_XID_ERROR, set));
            match registered {
                Ok(set) => sets.push((index, set)),
                Err(error) => {
                    tracing::warn!(index, error = %error.error, "cannot watch xid errors");
                }
            }
        }
        Ok(Telemetry::Nvml {
            nvml,
            indices,
            xids: Mutex::new(XidWatch {
                sets,
                last: HashMap::new(),
            }),
        })
    }

    /// Simulated GPUs whose readings come from `file`.
    pub fn simulated(file: PathBuf, gpus: &[DiscoveredGpu]) -> Self {
        Telemetry::Simulated {
            file,
            gpus: gpus
                .iter()
                .map(|g| (g.index, g.uuid.clone(), g.model.clone()))
                .collect(),
        }
    }

    /// One sample of every offered GPU. A device that cannot be opened is
    /// skipped (logged once per call); a counter that cannot be read is
    /// absent from its sample.
    pub fn sample(&self) -> Vec<GpuSample> {
        match self {
            Telemetry::Nvml {
                nvml,
                indices,
                xids,
            } => sample_nvml(nvml, indices, xids),
            Telemetry::Simulated { file, gpus } => sample_file(file, gpus),
            Telemetry::None => Vec::new(),
        }
    }
}

fn sample_nvml(nvml: &Nvml, indices: &[u32], xids: &Mutex<XidWatch>) -> Vec<GpuSample> {
    // Drain what the driver raised since the last sample. A panic cannot
    // leave the map half-written (one insert per event).
    let last_xid = {
        let mut watch = xids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let XidWatch { sets, last } = &mut *watch;
        for (index, set) in sets.iter() {
            // A zero timeout answers at once: `Timeout` when none is pending.
            while let Ok(event) = set.wait(0) {
                if let Some(xid) = event.event_data {
                    let code = match xid {
                        XidError::Value(v) => v,
                        XidError::Unknown => XID_UNKNOWN,
                    };
                    tracing::warn!(index, xid = code, "gpu raised a critical xid error");
                    last.insert(*index, code);
                }
            }
        }
        last.clone()
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
            last_xid: last_xid.get(&index).copied(),
            // Boards without ECC (or with it off) answer an error: absent.
            ecc_uncorrected: device
                .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
                .ok(),
        });
    }
    out
}

/// One GPU's readings in the file: the counters of a [`GpuSample`], each
/// optional; a misspelt name is refused rather than ignored.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Readings {
    gpu_util_pct: Option<u32>,
    mem_copy_util_pct: Option<u32>,
    fb_used_mib: Option<u64>,
    fb_free_mib: Option<u64>,
    temperature_c: Option<u32>,
    power_w: Option<f64>,
    sm_clock_mhz: Option<u32>,
    last_xid: Option<u64>,
    ecc_uncorrected: Option<u64>,
}

/// The readings file's samples for the simulated GPUs it names. A missing
/// file is no readings; an unreadable one is logged and is no readings.
fn sample_file(file: &std::path::Path, gpus: &[(u32, String, String)]) -> Vec<GpuSample> {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(error) => {
            tracing::warn!(file = %file.display(), %error, "cannot read simulated telemetry");
            return Vec::new();
        }
    };
    let readings: BTreeMap<String, Readings> = match serde_json::from_str(&text) {
        Ok(r) => r,
        Err(error) => {
            tracing::warn!(file = %file.display(), %error, "simulated telemetry is not a JSON object of gpu index to readings");
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for (index, uuid, model) in gpus {
        if let Some(r) = readings.get(&index.to_string()) {
            out.push(GpuSample {
                index: *index,
                uuid: uuid.clone(),
                device_name: format!("Simulated {model}"),
                gpu_util_pct: r.gpu_util_pct,
                mem_copy_util_pct: r.mem_copy_util_pct,
                fb_used_mib: r.fb_used_mib,
                fb_free_mib: r.fb_free_mib,
                temperature_c: r.temperature_c,
                power_w: r.power_w,
                sm_clock_mhz: r.sm_clock_mhz,
                last_xid: r.last_xid,
                ecc_uncorrected: r.ecc_uncorrected,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulated_gpus_report_nothing() {
        assert!(Telemetry::None.sample().is_empty());
    }

    #[test]
    fn a_readings_file_stands_in_for_the_driver() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("readings.json");
        let gpu = |index: u32| DiscoveredGpu {
            index,
            model: "H100".into(),
            uuid: format!("GPU-sim-{index}"),
            memory_mib: 81_920,
            vendor: flotilla_core::catalog::Vendor::Nvidia,
            mig_mode: false,
        };
        let t = Telemetry::simulated(file.clone(), &[gpu(0), gpu(1)]);
        // No file yet: nothing, as without one.
        assert!(t.sample().is_empty());
        std::fs::write(
            &file,
            r#"{"1": {"last_xid": 79, "temperature_c": 71}, "5": {"last_xid": 48}}"#,
        )
        .unwrap();
        let s = t.sample();
        assert_eq!(s.len(), 1);
        // Only GPUs the node has; their identity comes from discovery.
        assert_eq!((s[0].index, s[0].uuid.as_str()), (1, "GPU-sim-1"));
        assert_eq!(s[0].device_name, "Simulated H100");
        assert_eq!((s[0].last_xid, s[0].temperature_c), (Some(79), Some(71)));
        assert_eq!(s[0].gpu_util_pct, None);
        // A broken file is no readings, not a crash.
        std::fs::write(&file, "not json").unwrap();
        assert!(t.sample().is_empty());
    }
}
