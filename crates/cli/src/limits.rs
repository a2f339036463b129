//! The node's limits for what an instance leaves out (`flotilla up` and
//! `flotilla agent`): the process runtime holds every workload to its
//! memory, CPU, process count and disk, taking these where the instance
//! asked for nothing.

use clap::Args;
use flotilla_agent::runtime::limits::{LimitDefaults, DEFAULT_DISK_MB, DEFAULT_PIDS};

/// Default limits of the process runtime (`up`, `agent`).
#[derive(Debug, Clone, Args)]
pub struct LimitArgs {
    /// Memory limit of an instance that asks for none (`512M`, `4G`);
    /// default: a quarter of the node's memory. Swap is never allowed
    /// beyond it.
    #[arg(long, value_name = "SIZE", value_parser = parse_memory)]
    pub default_memory: Option<u64>,
    /// Most processes and threads one instance may run.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_PIDS, value_parser = clap::value_parser!(u64).range(16..))]
    pub default_pids: u64,
    /// Disk limit of an instance's directory when it asks for none
    /// (`512M`, `20G`): past it the instance is stopped ("disk limit
    /// exceeded").
    #[arg(long, value_name = "SIZE", value_parser = parse_memory, default_value_t = DEFAULT_DISK_MB)]
    pub default_disk: u64,
}

impl LimitArgs {
    /// The agent's defaults.
    pub fn defaults(&self) -> LimitDefaults {
        LimitDefaults {
            memory_mb: self.default_memory,
            pids: self.default_pids,
            disk_mb: self.default_disk,
        }
    }
}

/// Parses `--memory`: MiB, or a size with a unit (`512M`, `2G`, `1.5g`,
/// `512MiB`).
pub fn parse_memory(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let t = t
        .strip_suffix("ib")
        .or_else(|| t.strip_suffix('b'))
        .unwrap_or(&t);
    let (num, factor) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1.0 / 1024.0),
        Some('m') => (&t[..t.len() - 1], 1.0),
        Some('g') => (&t[..t.len() - 1], 1024.0),
        Some('t') => (&t[..t.len() - 1], 1024.0 * 1024.0),
        _ => (t, 1.0),
    };
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("expected a size such as 512M or 2G, got `{s}`"))?;
    let mib = (n * factor).ceil();
    if !n.is_finite() || !(1.0..=64.0 * 1024.0 * 1024.0).contains(&mib) {
        return Err(format!("expected between 1M and 64T, got `{s}`"));
    }
    Ok(mib as u64)
}
