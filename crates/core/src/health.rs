//! GPU health: which telemetry readings take a GPU out of placement.
//!
//! The agent only reports what the driver says (an XID error, an
//! uncorrectable ECC count, a temperature); this module is the server's
//! rule for what counts as a fault. It is pure: a reading and a policy in,
//! a verdict out, so the live server and tests decide the same way.

use serde::{Deserialize, Serialize};

use crate::api::GpuSample;

/// XID errors the application causes (NVIDIA's XID catalogue: 13 graphics
/// engine exception, 31 MMU fault, 43 the GPU stopped processing, 45
/// preemptive cleanup, 68 video decoder exception): a buggy kernel raises
/// them on a healthy board, so they do not take the GPU out. Every other
/// XID (48 double-bit ECC, 63/64 row remapping, 74 NVLink, 79 fallen off
/// the bus, 92/94/95 ECC, 119/120 GSP …) points at the hardware or driver.
pub const APPLICATION_XIDS: [u64; 5] = [13, 31, 43, 45, 68];

/// Default temperature at or above which a GPU is taken out, °C. Data
/// centre boards throttle around 85–90 °C and shut down near 95 °C.
pub const DEFAULT_MAX_TEMP_C: u32 = 90;

/// The server's thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthPolicy {
    /// A reading at or above this temperature is a fault.
    pub max_temp_c: u32,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            max_temp_c: DEFAULT_MAX_TEMP_C,
        }
    }
}

/// Why a GPU leaves placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuFault {
    /// The driver raised a hardware XID error.
    Xid {
        /// Its code.
        code: u64,
    },
    /// Uncorrectable ECC errors were counted.
    EccUncorrected {
        /// How many since the driver loaded.
        count: u64,
    },
    /// The core ran at or above the policy's limit.
    OverTemperature {
        /// The reading, °C.
        celsius: u32,
        /// The limit, °C.
        limit: u32,
    },
}

impl GpuFault {
    /// Short stable name, as alert labels and events carry it.
    pub fn kind(&self) -> &'static str {
        match self {
            GpuFault::Xid { .. } => "xid",
            GpuFault::EccUncorrected { .. } => "ecc",
            GpuFault::OverTemperature { .. } => "over_temperature",
        }
    }
}

impl std::fmt::Display for GpuFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuFault::Xid { code } => write!(f, "xid error {code}"),
            GpuFault::EccUncorrected { count } => {
                write!(f, "{count} uncorrectable ecc error(s)")
            }
            GpuFault::OverTemperature { celsius, limit } => {
                write!(f, "over temperature: {celsius} °C (limit {limit} °C)")
            }
        }
    }
}

/// The fault `sample` shows under `policy`, if any; the most severe first
/// (an XID or ECC error outranks heat, which may pass).
pub fn assess(sample: &GpuSample, policy: &HealthPolicy) -> Option<GpuFault> {
    if let Some(code) = sample.last_xid {
        if !APPLICATION_XIDS.contains(&code) {
            return Some(GpuFault::Xid { code });
        }
    }
    if let Some(count) = sample.ecc_uncorrected.filter(|c| *c > 0) {
        return Some(GpuFault::EccUncorrected { count });
    }
    match sample.temperature_c {
        Some(celsius) if celsius >= policy.max_temp_c => Some(GpuFault::OverTemperature {
            celsius,
            limit: policy.max_temp_c,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> GpuSample {
        GpuSample {
            index: 0,
            uuid: "GPU-0".into(),
            device_name: "NVIDIA H100".into(),
            temperature_c: Some(60),
            ..GpuSample::default()
        }
    }

    #[test]
    fn a_healthy_reading_is_no_fault() {
        assert_eq!(assess(&sample(), &HealthPolicy::default()), None);
        // Counters the board does not report are not faults either.
        assert_eq!(
            assess(&GpuSample::default(), &HealthPolicy::default()),
            None
        );
    }

    #[test]
    fn hardware_xids_are_faults_application_xids_are_not() {
        let p = HealthPolicy::default();
        for code in [48, 63, 74, 79, 94] {
            let s = GpuSample {
                last_xid: Some(code),
                ..sample()
            };
            assert_eq!(assess(&s, &p), Some(GpuFault::Xid { code }), "xid {code}");
        }
        for code in APPLICATION_XIDS {
            let s = GpuSample {
                last_xid: Some(code),
                ..sample()
            };
            assert_eq!(assess(&s, &p), None, "xid {code}");
        }
    }

    #[test]
    fn ecc_and_heat_are_faults_xid_first() {
        let p = HealthPolicy { max_temp_c: 85 };
        let ecc = GpuSample {
            ecc_uncorrected: Some(2),
            ..sample()
        };
        assert_eq!(
            assess(&ecc, &p),
            Some(GpuFault::EccUncorrected { count: 2 })
        );
        let zero = GpuSample {
            ecc_uncorrected: Some(0),
            ..sample()
        };
        assert_eq!(assess(&zero, &p), None);
        let hot = GpuSample {
            temperature_c: Some(85),
            ..sample()
        };
        let fault = assess(&hot, &p).unwrap();
        assert_eq!(fault.kind(), "over_temperature");
        assert_eq!(fault.to_string(), "over temperature: 85 °C (limit 85 °C)");
        let all = GpuSample {
            last_xid: Some(79),
            ecc_uncorrected: Some(1),
            temperature_c: Some(99),
            ..sample()
        };
        assert_eq!(assess(&all, &p), Some(GpuFault::Xid { code: 79 }));
    }
}
