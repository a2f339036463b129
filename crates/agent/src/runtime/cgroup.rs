//! The kernel's control groups as the process runtime uses them: one group
//! per instance, holding every process of the workload, with its memory
//! (swap included), CPU and process-count limits, and the counters that
//! tell why it ended (OOM kills) and what it used (CPU time).
//!
//! Both layouts the kernel offers are handled behind [`InstanceCgroup`]:
//! cgroup v2 (one tree at `/sys/fs/cgroup`: `memory.max`,
//! `memory.swap.max`, `cpu.max`, `pids.max`, `memory.events`) and cgroup v1
//! (a tree per controller: `memory.limit_in_bytes`,
//! `memory.memsw.limit_in_bytes`, `cpu.cfs_quota_us`, `pids.max`,
//! `memory.oom_control`, `cpuacct.usage`). Groups live under
//! `flotilla/<node>-<hash of its work dir>/<instance id>` of each tree, so
//! agents of several nodes on one host never touch each other's.
//!
//! A workload joins its group before it runs anything of its own: the
//! runtime starts it through [`join_command`], a `/bin/sh` that writes its
//! own pid into the group and then `exec`s the workload (no `pre_exec`:
//! unsafe code is forbidden here). This module never signals a process
//! outside an instance's group.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use flotilla_core::id::InstanceId;
use nix::sys::signal::Signal;
use nix::unistd::Pid;

/// The period of the CPU bandwidth limit: the kernel's default, 100 ms.
pub const CPU_PERIOD_US: u64 = 100_000;
/// The smallest quota the kernel accepts per period.
const MIN_CPU_QUOTA_US: u64 = 1_000;
/// The shell a workload is started through to join its group.
const SH: &str = "/bin/sh";
/// Exit code of the joining shell when it cannot enter the group: the
/// workload is then never run outside its limits.
pub const JOIN_FAILED_EXIT: i32 = 125;

/// A resource the runtime limits through a cgroup controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Controller {
    /// Memory and swap.
    Memory,
    /// CPU bandwidth.
    Cpu,
    /// Number of processes and threads.
    Pids,
}

impl Controller {
    /// Every controller the runtime limits through.
    pub const ALL: [Controller; 3] = [Controller::Memory, Controller::Cpu, Controller::Pids];

    /// The kernel's name of it.
    pub fn name(self) -> &'static str {
        match self {
            Controller::Memory => "memory",
            Controller::Cpu => "cpu",
            Controller::Pids => "pids",
        }
    }
}

/// What the kernel refused.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// A file or directory of a cgroup tree could not be written.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Which cgroup trees the host mounts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// cgroup v2: one tree for every controller.
    V2 {
        /// Where it is mounted (usually `/sys/fs/cgroup`).
        root: PathBuf,
    },
    /// cgroup v1: a tree per controller (`cpuacct` counts CPU time).
    V1 {
        /// Controller name to where its tree is mounted.
        mounts: BTreeMap<String, PathBuf>,
    },
    /// No cgroup tree is mounted.
    None,
}

/// The v1 controllers the runtime joins: the limited ones and `cpuacct`,
/// which counts the group's CPU time.
const V1_CONTROLLERS: [&str; 4] = ["memory", "cpu", "cpuacct", "pids"];

impl Hierarchy {
    /// The hierarchy `/proc/mounts` describes (its text): v2 when a
    /// `cgroup2` tree is mounted at `/sys/fs/cgroup` (the unified layout),
    /// else the v1 trees of the controllers the runtime uses (a hybrid
    /// host's `cgroup2` at `/sys/fs/cgroup/unified` holds none of them).
    pub fn from_mounts(mounts: &str) -> Self {
        let mut v1 = BTreeMap::new();
        for line in mounts.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [_, point, fstype, options, ..] = fields[..] else {
                continue;
            };
            match fstype {
                "cgroup2" if point == "/sys/fs/cgroup" => {
                    return Hierarchy::V2 {
                        root: PathBuf::from(point),
                    };
                }
                "cgroup" => {
                    for option in options.split(',') {
                        if V1_CONTROLLERS.contains(&option) {
                            v1.insert(option.to_string(), PathBuf::from(point));
                        }
                    }
                }
                _ => {}
            }
        }
        if v1.is_empty() {
            Hierarchy::None
        } else {
            Hierarchy::V1 { mounts: v1 }
        }
    }

    /// This host's hierarchy.
    pub fn detect() -> Self {
        std::fs::read_to_string("/proc/mounts")
            .map(|m| Self::from_mounts(&m))
            .unwrap_or(Hierarchy::None)
    }

    /// Its name in logs and reports.
    pub fn name(&self) -> &'static str {
        match self {
            Hierarchy::V2 { .. } => "cgroup v2",
            Hierarchy::V1 { .. } => "cgroup v1",
            Hierarchy::None => "no cgroups",
        }
    }
}

/// The limits of one instance's group; `None` leaves a resource unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// Memory, bytes; swap is held to nothing beyond it.
    pub memory_bytes: Option<u64>,
    /// CPU, thousandths of a core.
    pub cpu_milli: Option<u32>,
    /// Processes and threads.
    pub pids: Option<u64>,
}

/// The cgroups of one node's workloads: where they go and which
/// controllers could be set up there.
#[derive(Debug, Clone)]
pub struct Cgroups {
    hierarchy: Hierarchy,
    /// Below each tree's root: `flotilla/<name>`.
    parent: PathBuf,
    /// The controllers whose parent group exists and is writable.
    usable: BTreeSet<Controller>,
    /// Why each other controller is not, for the node's report.
    unusable: BTreeMap<Controller, String>,
    /// A v1 `cpuacct` group can be made next to the limited ones (it only
    /// counts CPU time).
    counts_cpu: bool,
}

impl Cgroups {
    /// Sets up `flotilla/<name>` in `hierarchy` (`name`: one agent's, see
    /// [`flotilla_core::node::workload_cgroup`]) and finds what it can
    /// limit there. Never fails: what cannot be set up is recorded in
    /// [`Cgroups::unusable`]. Blocking.
    pub fn new(hierarchy: Hierarchy, name: &str) -> Self {
        let parent = Path::new("flotilla").join(name);
        let mut cgroups = Self {
            hierarchy,
            parent,
            usable: BTreeSet::new(),
            unusable: BTreeMap::new(),
            counts_cpu: false,
        };
        if let Hierarchy::V1 { mounts } = &cgroups.hierarchy {
            cgroups.counts_cpu = mounts.get("cpuacct").is_some_and(|m| {
                let dir = m.join(&cgroups.parent);
                std::fs::create_dir_all(&dir).is_ok() && writable(&dir.join("cgroup.procs")).is_ok()
            });
        }
        for c in Controller::ALL {
            match cgroups.prepare(c) {
                Ok(()) => {
                    cgroups.usable.insert(c);
                }
                Err(why) => {
                    cgroups.unusable.insert(c, why);
                }
            }
        }
        cgroups
    }

    /// A node without cgroups: nothing is limited.
    pub fn none() -> Self {
        Self::new(Hierarchy::None, "none")
    }

    /// The hierarchy.
    pub fn hierarchy(&self) -> &Hierarchy {
        &self.hierarchy
    }

    /// The controllers it limits through.
    pub fn usable(&self) -> &BTreeSet<Controller> {
        &self.usable
    }

    /// The controllers it cannot use, with why.
    pub fn unusable(&self) -> &BTreeMap<Controller, String> {
        &self.unusable
    }

    /// Creates the parent group of `c` (and, on v2, hands `c` down to it).
    fn prepare(&self, c: Controller) -> Result<(), String> {
        match &self.hierarchy {
            Hierarchy::None => Err("no cgroup tree is mounted".into()),
            Hierarchy::V1 { mounts } => {
                let Some(mount) = mounts.get(c.name()) else {
                    return Err(format!("no cgroup v1 `{}` tree is mounted", c.name()));
                };
                let dir = mount.join(&self.parent);
                std::fs::create_dir_all(&dir)
                    .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
                writable(&dir.join("cgroup.procs"))
            }
            Hierarchy::V2 { root } => {
                let available =
                    std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
                if !available.split_whitespace().any(|n| n == c.name()) {
                    return Err(format!(
                        "the cgroup v2 tree at {} offers no `{}` controller",
                        root.display(),
                        c.name()
                    ));
                }
                // Each level hands the controller down to the next.
                let mut dir = root.clone();
                for part in self.parent.components() {
                    let control = dir.join("cgroup.subtree_control");
                    std::fs::write(&control, format!("+{}", c.name())).map_err(|e| {
                        format!("cannot enable `{}` in {}: {e}", c.name(), control.display())
                    })?;
                    dir = dir.join(part);
                    std::fs::create_dir_all(&dir)
                        .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
                }
                std::fs::write(dir.join("cgroup.subtree_control"), format!("+{}", c.name()))
                    .map_err(|e| format!("cannot enable `{}` in {}: {e}", c.name(), dir.display()))
            }
        }
    }

    /// The group of `instance_id`, whether or not it exists.
    pub fn of(&self, instance_id: &InstanceId) -> InstanceCgroup {
        let rel = self.parent.join(instance_id.as_str());
        match &self.hierarchy {
            Hierarchy::None => InstanceCgroup::None,
            Hierarchy::V2 { root } => {
                if self.usable.is_empty() {
                    InstanceCgroup::None
                } else {
                    InstanceCgroup::V2 {
                        dir: root.join(rel),
                    }
                }
            }
            Hierarchy::V1 { mounts } => {
                let dir = |name: &str, usable: bool| {
                    mounts.get(name).filter(|_| usable).map(|m| m.join(&rel))
                };
                let usable = |c: Controller| self.usable.contains(&c);
                InstanceCgroup::V1 {
                    memory: dir("memory", usable(Controller::Memory)),
                    cpu: dir("cpu", usable(Controller::Cpu)),
                    // Only counts; shares the tree with `cpu` on most hosts.
                    cpuacct: dir("cpuacct", self.counts_cpu),
                    pids: dir("pids", usable(Controller::Pids)),
                }
            }
        }
    }

    /// Creates the group of `instance_id` with `limits` (an old one of the
    /// same instance is emptied and replaced). Blocking.
    pub fn create(
        &self,
        instance_id: &InstanceId,
        limits: &Limits,
    ) -> Result<InstanceCgroup, CgroupError> {
        let group = self.of(instance_id);
        group.kill_all();
        let _ = group.remove_now();
        for dir in group.dirs() {
            std::fs::create_dir_all(&dir).map_err(|source| CgroupError::Io {
                what: "creating",
                path: dir.clone(),
                source,
            })?;
        }
        group.apply(limits)?;
        Ok(group)
    }

    /// This agent's parent groups (`flotilla/<name>` in each tree).
    pub fn node_dirs(&self) -> Vec<PathBuf> {
        match &self.hierarchy {
            Hierarchy::None => Vec::new(),
            Hierarchy::V2 { root } => vec![root.join(&self.parent)],
            Hierarchy::V1 { mounts } => mounts.values().map(|m| m.join(&self.parent)).collect(),
        }
    }

    /// Instances that have a group under this node (the groups a restarted
    /// agent finds).
    pub fn instances(&self) -> BTreeSet<InstanceId> {
        self.node_dirs()
            .into_iter()
            .filter_map(|p| std::fs::read_dir(p).ok())
            .flat_map(|entries| entries.flatten())
            .filter(|e| e.path().is_dir())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                InstanceId::parse(&name, "instance_id").ok()
            })
            .collect()
    }
}

/// Whether `file` may be written (without writing to it).
fn writable(file: &Path) -> Result<(), String> {
    std::fs::OpenOptions::new()
        .append(true)
        .open(file)
        .map(drop)
        .map_err(|e| format!("cannot write {}: {e}", file.display()))
}

/// One instance's group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InstanceCgroup {
    /// No group: nothing is limited.
    None,
    /// Its directory in the v2 tree.
    V2 {
        /// The group.
        dir: PathBuf,
    },
    /// Its directory in each v1 tree this node uses.
    V1 {
        /// In the memory tree.
        memory: Option<PathBuf>,
        /// In the cpu tree.
        cpu: Option<PathBuf>,
        /// In the cpuacct tree (the same as `cpu` when they share a tree).
        cpuacct: Option<PathBuf>,
        /// In the pids tree.
        pids: Option<PathBuf>,
    },
}

impl InstanceCgroup {
    /// The Flotilla group process `pid` runs in, read from
    /// `/proc/PID/cgroup` against `hierarchy`: where a session into a
    /// running workload (`flotilla exec`) goes too, so that what it starts
    /// counts against the workload's limits instead of escaping them.
    /// [`InstanceCgroup::None`] when the process is in none of Flotilla's
    /// groups (limits off) or cannot be read.
    pub fn of_process(hierarchy: &Hierarchy, pid: u32) -> InstanceCgroup {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
            return InstanceCgroup::None;
        };
        Self::from_proc_cgroup(hierarchy, &text)
    }

    /// [`InstanceCgroup::of_process`] on the text of a `/proc/PID/cgroup`.
    pub fn from_proc_cgroup(hierarchy: &Hierarchy, text: &str) -> InstanceCgroup {
        // Only the runtime's own groups: never the agent's or the system's.
        let ours = |path: &str| path.starts_with("/flotilla/");
        let lines = text.lines().filter_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            ours(path).then_some((controllers, path.trim_start_matches('/')))
        });
        match hierarchy {
            Hierarchy::None => InstanceCgroup::None,
            Hierarchy::V2 { root } => lines
                .filter(|(controllers, _)| controllers.is_empty())
                .map(|(_, path)| InstanceCgroup::V2 {
                    dir: root.join(path),
                })
                .next()
                .unwrap_or(InstanceCgroup::None),
            Hierarchy::V1 { mounts } => {
                let (mut memory, mut cpu, mut cpuacct, mut pids) = (None, None, None, None);
                for (controllers, path) in lines {
                    for c in controllers.split(',') {
                        let dir = || mounts.get(c).map(|m| m.join(path));
                        match c {
                            "memory" => memory = dir(),
                            "cpu" => cpu = dir(),
                            "cpuacct" => cpuacct = dir(),
                            "pids" => pids = dir(),
                            _ => {}
                        }
                    }
                }
                if memory.is_none() && cpu.is_none() && cpuacct.is_none() && pids.is_none() {
                    InstanceCgroup::None
                } else {
                    InstanceCgroup::V1 {
                        memory,
                        cpu,
                        cpuacct,
                        pids,
                    }
                }
            }
        }
    }

    /// Its distinct directories.
    pub fn dirs(&self) -> Vec<PathBuf> {
        let mut dirs: Vec<PathBuf> = match self {
            InstanceCgroup::None => Vec::new(),
            InstanceCgroup::V2 { dir } => vec![dir.clone()],
            InstanceCgroup::V1 {
                memory,
                cpu,
                cpuacct,
                pids,
            } => [memory, cpu, cpuacct, pids]
                .into_iter()
                .flatten()
                .cloned()
                .collect(),
        };
        dirs.sort();
        dirs.dedup();
        dirs
    }

    /// Whether it has a group at all.
    pub fn exists(&self) -> bool {
        self.dirs().iter().any(|d| d.is_dir())
    }

    /// Writes `limits` into it.
    pub fn apply(&self, limits: &Limits) -> Result<(), CgroupError> {
        let quota = limits
            .cpu_milli
            .map(|m| (u64::from(m) * CPU_PERIOD_US / 1000).max(MIN_CPU_QUOTA_US));
        match self {
            InstanceCgroup::None => Ok(()),
            InstanceCgroup::V2 { dir } => {
                if let Some(bytes) = limits.memory_bytes {
                    write(&dir.join("memory.max"), bytes)?;
                    // Swap would let it hold more than its limit.
                    write_if_present(&dir.join("memory.swap.max"), 0)?;
                }
                if let Some(quota) = quota {
                    write(&dir.join("cpu.max"), format!("{quota} {CPU_PERIOD_US}"))?;
                }
                if let Some(pids) = limits.pids {
                    write(&dir.join("pids.max"), pids)?;
                }
                Ok(())
            }
            InstanceCgroup::V1 {
                memory, cpu, pids, ..
            } => {
                if let (Some(dir), Some(bytes)) = (memory, limits.memory_bytes) {
                    write(&dir.join("memory.limit_in_bytes"), bytes)?;
                    // memory+swap at the same value: no swap at all (only
                    // where the kernel accounts swap).
                    write_if_present(&dir.join("memory.memsw.limit_in_bytes"), bytes)?;
                }
                if let (Some(dir), Some(quota)) = (cpu, quota) {
                    write(&dir.join("cpu.cfs_period_us"), CPU_PERIOD_US)?;
                    write(&dir.join("cpu.cfs_quota_us"), quota)?;
                }
                if let (Some(dir), Some(n)) = (pids, limits.pids) {
                    write(&dir.join("pids.max"), n)?;
                }
                Ok(())
            }
        }
    }

    /// The `cgroup.procs` files the workload writes its pid into.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs()
            .into_iter()
            .map(|d| d.join("cgroup.procs"))
            .collect()
    }

    /// OOM kills the kernel counted in it (v2 `memory.events`, v1
    /// `memory.oom_control`); `None` without a memory group.
    pub fn oom_kills(&self) -> Option<u64> {
        let (file, key) = match self {
            InstanceCgroup::None => return None,
            InstanceCgroup::V2 { dir } => (dir.join("memory.events"), "oom_kill "),
            InstanceCgroup::V1 { memory, .. } => {
                (memory.as_ref()?.join("memory.oom_control"), "oom_kill ")
            }
        };
        let text = std::fs::read_to_string(file).ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse().ok())
    }

    /// CPU time its processes used (v2 `cpu.stat`, v1 `cpuacct.usage`).
    pub fn cpu_usage(&self) -> Option<Duration> {
        match self {
            InstanceCgroup::None => None,
            InstanceCgroup::V2 { dir } => {
                let text = std::fs::read_to_string(dir.join("cpu.stat")).ok()?;
                let us = text
                    .lines()
                    .find_map(|l| l.strip_prefix("usage_usec "))?
                    .trim()
                    .parse()
                    .ok()?;
                Some(Duration::from_micros(us))
            }
            InstanceCgroup::V1 { cpuacct, .. } => {
                let text = std::fs::read_to_string(cpuacct.as_ref()?.join("cpuacct.usage")).ok()?;
                Some(Duration::from_nanos(text.trim().parse().ok()?))
            }
        }
    }

    /// The processes in it.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .procs_files()
            .iter()
            .filter_map(|f| std::fs::read_to_string(f).ok())
            .flat_map(|t| {
                t.lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect::<Vec<u32>>()
            })
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// SIGKILLs every process in it (v2's `cgroup.kill` where the kernel
    /// has it). Everything in it was started for the instance.
    pub fn kill_all(&self) {
        if let InstanceCgroup::V2 { dir } = self {
            let kill = dir.join("cgroup.kill");
            if kill.is_file() && std::fs::write(&kill, "1").is_ok() {
                return;
            }
        }
        for pid in self.pids() {
            if let Ok(raw) = i32::try_from(pid) {
                if raw > 1 {
                    let _ = nix::sys::signal::kill(Pid::from_raw(raw), Signal::SIGKILL);
                }
            }
        }
    }

    /// Removes its directories; fails while a process is still in one.
    fn remove_now(&self) -> std::io::Result<()> {
        let mut result = Ok(());
        for dir in self.dirs() {
            match std::fs::remove_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => result = Err(e),
            }
        }
        result
    }

    /// Kills what is left in it and removes it, waiting up to `patience`
    /// for the killed processes to be gone.
    pub async fn remove(&self, patience: Duration) -> std::io::Result<()> {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            self.kill_all();
            match self.remove_now() {
                Ok(()) => return Ok(()),
                Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }
}

fn write(file: &Path, value: impl ToString) -> Result<(), CgroupError> {
    std::fs::write(file, value.to_string()).map_err(|source| CgroupError::Io {
        what: "writing",
        path: file.to_path_buf(),
        source,
    })
}

/// Writes a file the kernel offers only with some options (swap
/// accounting): a missing one is fine.
fn write_if_present(file: &Path, value: impl ToString) -> Result<(), CgroupError> {
    if file.exists() {
        write(file, value)
    } else {
        Ok(())
    }
}

/// The program and arguments that run `program args…` inside `group`:
/// `/bin/sh` writes its own pid into every `cgroup.procs` of the group,
/// then becomes the program, so nothing of the workload ever runs outside
/// it. When a write fails it says so on stderr and exits
/// [`JOIN_FAILED_EXIT`] without running the program. `None` without a
/// group: run the program itself.
pub fn join_command(
    group: &InstanceCgroup,
    program: impl Into<OsString>,
) -> (OsString, Vec<OsString>) {
    let program = program.into();
    let procs = group.procs_files();
    if procs.is_empty() {
        return (program, Vec::new());
    }
    let script = format!(
        "while [ \"$1\" != -- ]; do echo $$ > \"$1\" || {{ echo \"flotilla: cannot enter the instance's cgroup $1\" >&2; exit {JOIN_FAILED_EXIT}; }}; shift; done; shift; exec \"$@\""
    );
    let mut args: Vec<OsString> = vec!["-c".into(), script.into(), "flotilla-limits".into()];
    args.extend(procs.into_iter().map(OsString::from));
    args.push("--".into());
    args.push(program);
    (SH.into(), args)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu type cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,cpu,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,nodev,noexec,relatime,memory 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
";

    #[test]
    fn a_session_finds_the_workloads_own_groups_only() {
        let v1 = Hierarchy::from_mounts(HYBRID);
        let text = "\
12:pids:/flotilla/n0-ab/inst_1
9:memory:/flotilla/n0-ab/inst_1
4:cpu,cpuacct:/flotilla/n0-ab/inst_1
1:name=systemd:/agent.scope
0::/agent.scope
";
        let g = InstanceCgroup::from_proc_cgroup(&v1, text);
        let files: Vec<String> = g
            .procs_files()
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        assert!(
            files.contains(&"/sys/fs/cgroup/memory/flotilla/n0-ab/inst_1/cgroup.procs".to_string()),
            "{files:?}"
        );
        assert!(
            files
                .iter()
                .any(|f| f.contains("/pids/flotilla/n0-ab/inst_1/")),
            "{files:?}"
        );
        assert!(!files.iter().any(|f| f.contains("scope")), "{files:?}");
        // The agent's own groups are never joined.
        let mine = "9:memory:/agent.scope\n0::/agent.scope\n";
        assert_eq!(
            InstanceCgroup::from_proc_cgroup(&v1, mine).procs_files(),
            Vec::<std::path::PathBuf>::new()
        );
        let v2 = Hierarchy::V2 {
            root: "/sys/fs/cgroup".into(),
        };
        assert_eq!(
            InstanceCgroup::from_proc_cgroup(&v2, "0::/flotilla/n0-ab/inst_2\n").procs_files(),
            vec![std::path::PathBuf::from(
                "/sys/fs/cgroup/flotilla/n0-ab/inst_2/cgroup.procs"
            )]
        );
    }

    #[test]
    fn the_mounted_hierarchy_is_found() {
        let v2 = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0\n";
        assert_eq!(
            Hierarchy::from_mounts(v2),
            Hierarchy::V2 {
                root: "/sys/fs/cgroup".into()
            }
        );
        let Hierarchy::V1 { mounts } = Hierarchy::from_mounts(HYBRID) else {
            panic!("v1 expected");
        };
        assert_eq!(
            mounts.keys().map(String::as_str).collect::<Vec<_>>(),
            ["cpu", "cpuacct", "memory", "pids"]
        );
        assert_eq!(mounts["memory"], Path::new("/sys/fs/cgroup/memory"));
        assert_eq!(mounts["cpuacct"], Path::new("/sys/fs/cgroup/cpu,cpuacct"));
        assert_eq!(
            Hierarchy::from_mounts("proc /proc proc rw 0 0\n"),
            Hierarchy::None
        );
    }

    /// A temporary directory laid out like a v2 tree's root.
    fn fake_v2(controllers: &str) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("cgroup.controllers"), controllers).unwrap();
        root
    }

    #[test]
    fn v2_hands_the_controllers_down_and_writes_the_limits() {
        let root = fake_v2("cpuset cpu io memory hugetlb pids rdma misc\n");
        let cgroups = Cgroups::new(
            Hierarchy::V2 {
                root: root.path().into(),
            },
            "node-a",
        );
        assert_eq!(cgroups.usable().len(), 3, "{:?}", cgroups.unusable());
        for level in ["", "flotilla", "flotilla/node-a"] {
            // A fake tree keeps only the last write; the kernel keeps each.
            let control = root.path().join(level).join("cgroup.subtree_control");
            assert_eq!(std::fs::read_to_string(control).unwrap(), "+pids");
        }
        let id = InstanceId::generate(1, 7);
        let group = cgroups
            .create(
                &id,
                &Limits {
                    memory_bytes: Some(256 << 20),
                    cpu_milli: Some(500),
                    pids: Some(64),
                },
            )
            .unwrap();
        let dir = root.path().join("flotilla/node-a").join(id.as_str());
        assert_eq!(group, InstanceCgroup::V2 { dir: dir.clone() });
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
        assert_eq!(read("memory.max"), (256u64 << 20).to_string());
        assert_eq!(read("cpu.max"), "50000 100000");
        assert_eq!(read("pids.max"), "64");
        assert!(
            !dir.join("memory.swap.max").exists(),
            "written only where the kernel offers it"
        );
        assert_eq!(group.procs_files(), vec![dir.join("cgroup.procs")]);
        assert_eq!(cgroups.instances(), BTreeSet::from([id]));

        // The counters, as the kernel lays them out.
        std::fs::write(
            dir.join("memory.events"),
            "low 0\nhigh 0\nmax 31\noom 1\noom_kill 1\noom_group_kill 0\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("cpu.stat"),
            "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n",
        )
        .unwrap();
        std::fs::write(dir.join("memory.swap.max"), "max").unwrap();
        assert_eq!(group.oom_kills(), Some(1));
        assert_eq!(group.cpu_usage(), Some(Duration::from_millis(2500)));
        group
            .apply(&Limits {
                memory_bytes: Some(1 << 20),
                cpu_milli: Some(1),
                pids: None,
            })
            .unwrap();
        assert_eq!(read("memory.swap.max"), "0", "no swap beyond the limit");
        assert_eq!(read("cpu.max"), "1000 100000", "the kernel's least quota");
    }

    #[test]
    fn v2_without_a_controller_says_which_and_why() {
        let root = fake_v2("cpu io\n");
        let cgroups = Cgroups::new(
            Hierarchy::V2 {
                root: root.path().into(),
            },
            "n",
        );
        assert_eq!(cgroups.usable(), &BTreeSet::from([Controller::Cpu]));
        let why = &cgroups.unusable()[&Controller::Memory];
        assert!(why.contains("offers no `memory` controller"), "{why}");
        let none = Cgroups::none();
        assert!(none.usable().is_empty());
        assert_eq!(none.unusable().len(), 3);
        assert_eq!(none.of(&InstanceId::generate(1, 1)), InstanceCgroup::None);
        let (program, args) = join_command(&InstanceCgroup::None, "true");
        assert_eq!((program, args), (OsString::from("true"), Vec::new()));
    }

    /// This host's v1 memory, cpu and pids trees, when writable (as root
    /// on the CI machine); `None` elsewhere.
    fn real_v1(node: &str) -> Option<Cgroups> {
        let h = Hierarchy::detect();
        if !matches!(h, Hierarchy::V1 { .. }) || !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: no writable cgroup v1 here");
            return None;
        }
        let c = Cgroups::new(h, node);
        assert_eq!(c.usable().len(), 3, "{:?}", c.unusable());
        Some(c)
    }

    fn unique(prefix: &str) -> String {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        format!("{prefix}-{}-{nanos}", std::process::id())
    }

    /// Removes a test node's parent groups, even when the test failed.
    struct Cleanup(Cgroups, InstanceId);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let group = self.0.of(&self.1);
            group.kill_all();
            std::thread::sleep(Duration::from_millis(50));
            let _ = group.remove_now();
            if let Hierarchy::V1 { mounts } = self.0.hierarchy() {
                for m in mounts.values() {
                    let _ = std::fs::remove_dir(m.join(&self.0.parent));
                }
            }
        }
    }

    #[tokio::test]
    async fn v1_limits_a_process_that_joined_through_the_shell() {
        let node = unique("cgtest");
        let Some(cgroups) = real_v1(&node) else {
            return;
        };
        let id = InstanceId::generate(1, 9);
        let _cleanup = Cleanup(cgroups.clone(), id.clone());
        let group = cgroups
            .create(
                &id,
                &Limits {
                    memory_bytes: Some(64 << 20),
                    cpu_milli: Some(250),
                    pids: Some(8),
                },
            )
            .unwrap();
        let InstanceCgroup::V1 {
            memory, cpu, pids, ..
        } = &group
        else {
            panic!("v1 expected");
        };
        let read = |d: &Option<PathBuf>, f: &str| {
            std::fs::read_to_string(d.as_ref().unwrap().join(f))
                .unwrap()
                .trim()
                .to_string()
        };
        assert_eq!(
            read(memory, "memory.limit_in_bytes"),
            (64u64 << 20).to_string()
        );
        if memory
            .as_ref()
            .unwrap()
            .join("memory.memsw.limit_in_bytes")
            .exists()
        {
            assert_eq!(
                read(memory, "memory.memsw.limit_in_bytes"),
                (64u64 << 20).to_string()
            );
        }
        assert_eq!(read(cpu, "cpu.cfs_quota_us"), "25000");
        assert_eq!(read(pids, "pids.max"), "8");

        // Forks past the limit fail inside the group. dash ends when a fork
        // fails, so the loop runs in a shell of its own; the first one then
        // becomes a sleep (same pid, no fork) and says so.
        let (program, mut args) = join_command(&group, "sh");
        args.extend(
            [
                "-c",
                "sh -c 'for i in $(seq 20); do sleep 30 & done' 2>/dev/null; echo started; exec sleep 30",
            ]
            .map(OsString::from),
        );
        let mut child = tokio::process::Command::new(program)
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id().unwrap();
        let mut stdout = child.stdout.take().unwrap();
        let mut line = [0u8; 8];
        tokio::time::timeout(
            Duration::from_secs(30),
            tokio::io::AsyncReadExt::read_exact(&mut stdout, &mut line),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(&line, b"started\n");
        let inside = group.pids();
        assert!(
            inside.contains(&pid),
            "the shell joined before it ran anything: {inside:?}"
        );
        assert!(inside.len() <= 8, "held to pids.max: {inside:?}");
        let events = std::fs::read_to_string(pids.as_ref().unwrap().join("pids.events")).unwrap();
        assert_ne!(events.trim(), "max 0", "forks past the limit were refused");
        group.remove(Duration::from_secs(10)).await.unwrap();
        let status = child.wait().await.unwrap();
        assert!(!status.success());
        assert!(!group.exists(), "removed once empty");
    }

    #[test]
    fn a_failed_join_never_runs_the_program() {
        let dir = tempfile::tempdir().unwrap();
        let group = InstanceCgroup::V2 {
            dir: dir.path().join("missing"),
        };
        let (program, mut args) = join_command(&group, "echo");
        args.push("ran".into());
        let out = std::process::Command::new(program)
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(JOIN_FAILED_EXIT));
        assert!(out.stdout.is_empty());
        assert!(String::from_utf8_lossy(&out.stderr).contains("cannot enter the instance's cgroup"));
    }
}
