//! The cold-start model: how long a new replica takes before it serves.
//!
//! The shape is measured, the scale is a setting. GenTD26's
//! `basemodel_update_latency_anon.csv` (inside
//! `basemodel_update_latency_anon.tar.gz`) holds production base-model load
//! latencies; their distribution — a long right tail over a fast mode —
//! is what a GPU cold start looks like. [`ColdStartModel::from_samples`]
//! rescales the samples so their median is the setting (60 s in the
//! benchmark) and draws from them uniformly. Without the data,
//! [`ColdStartModel::lognormal`] gives a documented stand-in: 1,001
//! quantiles of a log-normal with the same median and σ = 0.5.

use std::io::Read;
use std::path::Path;

use rand::Rng;

use crate::SimError;

/// An empirical cold-start distribution, in milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct ColdStartModel {
    /// Name for reports.
    pub source: String,
    /// Sorted samples (never empty).
    samples: Vec<u64>,
}

impl ColdStartModel {
    /// Samples (milliseconds, any order) scaled so that their median is
    /// `median_ms`. Non-finite or non-positive samples are dropped.
    pub fn from_samples(
        source: impl Into<String>,
        samples: &[f64],
        median_ms: u64,
    ) -> Result<Self, SimError> {
        let mut xs: Vec<f64> = samples
            .iter()
            .copied()
            .filter(|x| x.is_finite() && *x > 0.0)
            .collect();
        if xs.is_empty() {
            return Err(SimError::invalid(
                "cold_start",
                "no positive latency sample",
            ));
        }
        if median_ms == 0 {
            return Err(SimError::invalid(
                "cold_start.median_ms",
                "must be positive",
            ));
        }
        xs.sort_by(f64::total_cmp);
        let median = xs[xs.len() / 2];
        let k = median_ms as f64 / median;
        let samples = xs.iter().map(|x| ((x * k).round() as u64).max(1)).collect();
        Ok(Self {
            source: source.into(),
            samples,
        })
    }

    /// Every start takes exactly `ms` (tests, and operators who know).
    pub fn fixed(ms: u64) -> Self {
        Self {
            source: format!("fixed {ms} ms"),
            samples: vec![ms.max(1)],
        }
    }

    /// The stand-in shape: log-normal quantiles with median `median_ms`
    /// and σ = 0.5.
    pub fn lognormal(median_ms: u64) -> Self {
        let n = 1001;
        let samples = (0..n)
            .map(|i| {
                let p = (i as f64 + 0.5) / n as f64;
                let x = median_ms as f64 * (0.5 * probit(p)).exp();
                (x.round() as u64).max(1)
            })
            .collect();
        Self {
            source: format!("log-normal, median {} s, sigma 0.5", median_ms / 1000),
            samples,
        }
    }

    /// Read GenTD26's base-model load latencies (`value` column, ms) from
    /// the `.tar.gz` as published or from the extracted `.csv`.
    pub fn load_gentd26(path: &Path, median_ms: u64) -> Result<Self, SimError> {
        let io = |source| SimError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let mut csv = String::new();
        let gz = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gz") || e.eq_ignore_ascii_case("tgz"));
        if gz {
            let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(file));
            let mut found = false;
            for entry in archive.entries().map_err(io)? {
                let mut entry = entry.map_err(io)?;
                let is_csv = entry
                    .path()
                    .map_err(io)?
                    .extension()
                    .is_some_and(|e| e == "csv");
                if is_csv {
                    entry.read_to_string(&mut csv).map_err(io)?;
                    found = true;
                    break;
                }
            }
            if !found {
                return Err(SimError::invalid(
                    "cold_start",
                    "no .csv inside the archive",
                ));
            }
        } else {
            let mut file = file;
            file.read_to_string(&mut csv).map_err(io)?;
        }
        let samples = parse_latencies(&csv)?;
        Self::from_samples("GenTD26 base-model load latency", &samples, median_ms)
    }

    /// Draw one cold start.
    pub fn sample(&self, rng: &mut impl Rng) -> u64 {
        self.samples[rng.gen_range(0..self.samples.len())]
    }

    /// The sorted samples, to hand the distribution to another model
    /// (the simulated cloud's provisioning delay) that draws the same way.
    pub fn samples(&self) -> &[u64] {
        &self.samples
    }

    /// The shortest cold start the model can draw (the oracle's bound).
    pub fn min_ms(&self) -> u64 {
        self.samples[0]
    }

    /// The median cold start.
    pub fn median_ms(&self) -> u64 {
        self.samples[self.samples.len() / 2]
    }

    /// The `q`-quantile, `0.0..=1.0`.
    pub fn quantile_ms(&self, q: f64) -> u64 {
        let i = ((self.samples.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
        self.samples[i]
    }
}

/// `timestamp_anon,value,container_ip` rows: the `value` column.
fn parse_latencies(csv: &str) -> Result<Vec<f64>, SimError> {
    let mut lines = csv.lines().enumerate();
    let col = match lines.next() {
        Some((_, h)) => h
            .split(',')
            .position(|c| c.trim() == "value")
            .ok_or_else(|| SimError::parse(1, "value", "no `value` column".into()))?,
        None => return Err(SimError::invalid("cold_start", "empty latency file")),
    };
    let mut out = Vec::new();
    for (i, line) in lines {
        if line.trim().is_empty() {
            continue;
        }
        let v = line.split(',').nth(col).unwrap_or("");
        let x = v
            .trim()
            .parse::<f64>()
            .map_err(|e| SimError::parse(i + 1, "value", format!("{v:?}: {e}")))?;
        out.push(x);
    }
    Ok(out)
}

/// Inverse of the standard normal CDF (Acklam's rational approximation,
/// relative error below 1.2e-9), for the log-normal stand-in.
fn probit(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::*;

    #[test]
    fn samples_rescale_to_the_median() {
        let m = ColdStartModel::from_samples("t", &[1.0, 2.0, 3.0, 10.0, f64::NAN, -1.0], 60_000)
            .unwrap();
        assert_eq!(m.median_ms(), 60_000);
        assert_eq!(m.min_ms(), 20_000);
        assert_eq!(m.quantile_ms(1.0), 200_000);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        assert!((0..100).all(|_| m.sample(&mut rng) >= 20_000));
        assert!(ColdStartModel::from_samples("t", &[0.0], 1).is_err());
    }

    #[test]
    fn lognormal_stand_in_has_the_median() {
        let m = ColdStartModel::lognormal(60_000);
        assert!((m.median_ms() as i64 - 60_000).abs() <= 1);
        assert!(m.quantile_ms(0.84) > 90_000 && m.quantile_ms(0.84) < 110_000);
        assert!(probit(0.5).abs() < 1e-9);
    }

    #[test]
    fn latency_csv_value_column() {
        let v = parse_latencies("timestamp_anon,value,container_ip\n1.0,2639.0,a\n2.0,39010.0,b\n")
            .unwrap();
        assert_eq!(v, vec![2639.0, 39010.0]);
        assert!(parse_latencies("a,b\n1,2\n").is_err());
    }

    #[test]
    fn reads_the_gentd26_archive_when_present() {
        let dir = std::env::var_os("FLOTILLA_DATA_DIR").map_or_else(
            || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"),
            std::path::PathBuf::from,
        );
        let path = dir.join("alibaba-genai-2026/basemodel_update_latency_anon.tar.gz");
        if !path.exists() {
            eprintln!("skipping: GenTD26 data absent at {}", path.display());
            return;
        }
        let m = ColdStartModel::load_gentd26(&path, 60_000).unwrap();
        assert_eq!(m.median_ms(), 60_000);
        assert!(m.quantile_ms(0.99) > m.median_ms());
    }
}
