//! What the process runtime holds each workload to, and what this node can
//! hold it to: memory, CPU and processes through the instance's cgroup
//! ([`super::cgroup`]), and the size of its directory, which the runtime
//! measures while it runs ([`DISK_CHECK`]) and stops it past its limit.
//!
//! A request the instance leaves out gets the node's default
//! ([`LimitDefaults`]); what the node cannot enforce (no writable
//! controller, an agent that is not root) is said once at start and in the
//! node's registration ([`Enforcement::unenforced`]), never silently
//! dropped.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use super::cgroup::{Cgroups, Controller, Hierarchy, Limits};

/// How often a running workload's directory is measured.
pub const DISK_CHECK: Duration = Duration::from_secs(1);
/// Default process limit per instance.
pub const DEFAULT_PIDS: u64 = 4096;
/// Default disk limit per instance, MiB (10 GiB).
pub const DEFAULT_DISK_MB: u64 = 10 * 1024;

/// The node's limits for what an instance leaves out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitDefaults {
    /// Memory, MiB; `None`: a quarter of the node's memory.
    pub memory_mb: Option<u64>,
    /// Processes and threads.
    pub pids: u64,
    /// Size of the instance's directory, MiB.
    pub disk_mb: u64,
}

impl Default for LimitDefaults {
    fn default() -> Self {
        Self {
            memory_mb: None,
            pids: DEFAULT_PIDS,
            disk_mb: DEFAULT_DISK_MB,
        }
    }
}

impl LimitDefaults {
    /// The cgroup limits of an instance that asked for `cpu_milli` and
    /// `memory_mb` (its request is its limit), on a node of
    /// `node_memory_mb`.
    pub fn limits(
        &self,
        cpu_milli: Option<u32>,
        memory_mb: Option<u64>,
        node_memory_mb: u64,
    ) -> Limits {
        let memory_mb = memory_mb
            .filter(|m| *m > 0)
            .or(self.memory_mb)
            .unwrap_or((node_memory_mb / 4).max(256));
        Limits {
            memory_bytes: Some(memory_mb.saturating_mul(1 << 20)),
            cpu_milli: cpu_milli.filter(|m| *m > 0),
            pids: Some(self.pids),
        }
    }

    /// The disk limit of an instance that asked for `disk_mb`, bytes.
    pub fn disk_bytes(&self, disk_mb: Option<u64>) -> u64 {
        disk_mb
            .filter(|m| *m > 0)
            .unwrap_or(self.disk_mb)
            .saturating_mul(1 << 20)
    }
}

/// What this node holds its workloads to.
#[derive(Debug, Clone)]
pub struct Enforcement {
    /// The node's cgroups.
    pub cgroups: Cgroups,
    /// The defaults.
    pub defaults: LimitDefaults,
    /// The node's memory, MiB (the default memory limit is a part of it).
    pub node_memory_mb: u64,
}

impl Enforcement {
    /// The limits this host can enforce for the workloads the agent of
    /// node `node` runs from `work_dir`: its mounted cgroup hierarchy, set
    /// up under `flotilla/<node>-<hash of work_dir>`
    /// ([`flotilla_core::node::workload_cgroup`]). Blocking.
    pub fn detect(
        node: &str,
        work_dir: &Path,
        defaults: LimitDefaults,
        node_memory_mb: u64,
    ) -> Self {
        let name = flotilla_core::node::workload_cgroup(node, work_dir);
        let cgroups = Cgroups::new(Hierarchy::detect(), &name);
        Self {
            cgroups,
            defaults,
            node_memory_mb,
        }
    }

    /// The cgroup limits of an instance asking for `cpu_milli` and
    /// `memory_mb`.
    pub fn limits(&self, cpu_milli: Option<u32>, memory_mb: Option<u64>) -> Limits {
        self.defaults
            .limits(cpu_milli, memory_mb, self.node_memory_mb)
    }

    /// Lines saying what is not enforced here and why, e.g. `memory: no
    /// cgroup v1 `memory` tree is mounted`; empty when everything is.
    pub fn unenforced(&self) -> Vec<String> {
        self.cgroups
            .unusable()
            .iter()
            .map(|(c, why)| format!("{}: {why}", c.name()))
            .collect()
    }

    /// Whether `c` is enforced.
    pub fn enforces(&self, c: Controller) -> bool {
        self.cgroups.usable().contains(&c)
    }
}

/// Bytes of disk the files under `dir` take (allocated blocks, each file
/// once however many links it has; symbolic links are not followed).
/// Blocking; files that vanish while it walks are skipped.
pub fn disk_usage(dir: &Path) -> u64 {
    let mut seen = HashSet::new();
    let mut total = 0u64;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            if meta.nlink() > 1 && !meta.is_dir() && !seen.insert((meta.dev(), meta.ino())) {
                continue;
            }
            total = total.saturating_add(meta.blocks().saturating_mul(512));
            if meta.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_limits_and_defaults_fill_the_rest() {
        let d = LimitDefaults::default();
        let l = d.limits(Some(500), Some(256), 16_384);
        assert_eq!(l.memory_bytes, Some(256 << 20));
        assert_eq!(l.cpu_milli, Some(500));
        assert_eq!(l.pids, Some(DEFAULT_PIDS));
        let l = d.limits(None, None, 16_384);
        assert_eq!(l.memory_bytes, Some(4096 << 20), "a quarter of the node");
        assert_eq!(l.cpu_milli, None);
        let custom = LimitDefaults {
            memory_mb: Some(512),
            pids: 100,
            disk_mb: 50,
        };
        let l = custom.limits(Some(0), Some(0), 16_384);
        assert_eq!(
            (l.memory_bytes, l.cpu_milli, l.pids),
            (Some(512 << 20), None, Some(100))
        );
        assert_eq!(custom.disk_bytes(None), 50 << 20);
        assert_eq!(custom.disk_bytes(Some(8)), 8 << 20);
    }

    #[test]
    fn disk_usage_counts_blocks_once_per_file() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("a/b");
        std::fs::create_dir_all(&sub).unwrap();
        std::fs::write(sub.join("f"), vec![1u8; 3 << 20]).unwrap();
        std::fs::hard_link(sub.join("f"), dir.path().join("g")).unwrap();
        std::os::unix::fs::symlink("/usr", dir.path().join("usr")).unwrap();
        // A sparse file takes what it allocated, not its length.
        let sparse = std::fs::File::create(dir.path().join("sparse")).unwrap();
        sparse.set_len(1 << 30).unwrap();
        let used = disk_usage(dir.path());
        assert!((3 << 20..4 << 20).contains(&used), "{used}");
        assert_eq!(disk_usage(&dir.path().join("missing")), 0);
    }
}
