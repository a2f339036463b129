//! The node lease's fence: a small process beside the agent that stops the
//! agent's workloads when the node's lease runs out, even when the agent
//! cannot do it itself (paused with SIGSTOP, wedged, or killed). Without
//! it, a paused agent's workloads would keep running while the server,
//! once the lease has run out, restarts them elsewhere: the same job twice.
//!
//! The agent writes the lease's two deadlines (the lease's end, counted
//! from the last sync the server answered: start stopping; half a
//! heartbeat interval later, before the server declares the work lost:
//! stopped by then) and its workloads' process groups to a file after
//! every sync that renewed the lease ([`write`]); the fence ([`watch`])
//! reads it ten times a second: past the first deadline it sends SIGTERM
//! to every group, past the second SIGKILL. It leaves when the agent
//! removes the file (a clean stop, or an agent that took over after this
//! one was killed: it holds the lease from then on), when another agent
//! took the file over, or, once it has stopped everything, when its agent
//! is gone.
//!
//! Process ids may be reused: a group listed in the file is signalled only
//! until the next renewal rewrites the list, which bounds the window to one
//! lease.
//!
//! Once it has signalled, the fence also writes when it saw each group's
//! leader end (gone, or a zombie its paused agent cannot reap) to
//! `<file>.ended` ([`ended_at`]): an agent that was paused when its work
//! was stopped sees the exit only when it runs again, and reports the
//! fence's time instead, so the work is billed to its kill and not to the
//! agent's return (to the fence's tick, a tenth of a second).

use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

/// What the agent tells its fence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The agent the file belongs to.
    pub agent_pid: u32,
    /// From when (ms since the epoch) the workloads get SIGTERM.
    pub stop_from_ms: u64,
    /// By when (ms since the epoch) they must be gone: SIGKILL.
    pub until_ms: u64,
    /// Process groups of the running workloads.
    pub groups: Vec<u32>,
}

impl Lease {
    fn render(&self) -> String {
        let groups: Vec<String> = self.groups.iter().map(u32::to_string).collect();
        format!(
            "{} {} {}\n{}\n",
            self.agent_pid,
            self.stop_from_ms,
            self.until_ms,
            groups.join(" ")
        )
    }

    fn parse(text: &str) -> Option<Lease> {
        let mut lines = text.lines();
        let mut head = lines.next()?.split_whitespace();
        let agent_pid = head.next()?.parse().ok()?;
        let stop_from_ms = head.next()?.parse().ok()?;
        let until_ms = head.next()?.parse().ok()?;
        let groups = lines
            .next()
            .unwrap_or("")
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<Vec<u32>, _>>()
            .ok()?;
        Some(Lease {
            agent_pid,
            stop_from_ms,
            until_ms,
            groups,
        })
    }
}

/// Milliseconds since the epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The lease in the fence file at `path`, if there is a readable one.
pub fn read(path: &Path) -> Option<Lease> {
    Lease::parse(&std::fs::read_to_string(path).ok()?)
}

/// Replaces the fence file with `lease`, atomically (a rename), readable by
/// its owner only.
pub fn write(path: &Path, lease: &Lease) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode_private()
            .open(&tmp)?;
        f.write_all(lease.render().as_bytes())?;
    }
    std::fs::rename(&tmp, path)
}

/// Opening files readable by their owner only.
trait PrivateMode {
    fn mode_private(&mut self) -> &mut Self;
}

impl PrivateMode for std::fs::OpenOptions {
    fn mode_private(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.mode(0o600)
    }
}

/// The file where the fence records when the groups it stopped ended.
pub fn ended_path(path: &Path) -> std::path::PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".ended");
    p.into()
}

/// When (ms since the epoch) the fence of the file at `path` saw `group`
/// end after it signalled it, if it did (the latest record: a group id
/// may be reused after a renewal).
pub fn ended_at(path: &Path, group: u32) -> Option<u64> {
    let text = std::fs::read_to_string(ended_path(path)).ok()?;
    text.lines()
        .filter_map(|l| {
            let (g, ms) = l.split_once(' ')?;
            Some((g.parse::<u32>().ok()?, ms.trim().parse::<u64>().ok()?))
        })
        .filter(|(g, _)| *g == group)
        .map(|(_, ms)| ms)
        .next_back()
}

fn record_ended(path: &Path, group: u32, ms: u64) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode_private()
        .open(ended_path(path))?;
    f.write_all(format!("{group} {ms}\n").as_bytes())
}

/// Whether the process `pid` (a group's leader) has ended: gone, or a
/// zombie (its parent, the agent, is paused and has not reaped it).
pub(crate) fn ended(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the command, which is in parentheses and may
        // hold anything: read after the last `)`.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X"),
    }
}

fn alive(pid: u32) -> bool {
    i32::try_from(pid).is_ok_and(|p| nix::sys::signal::kill(Pid::from_raw(p), None).is_ok())
}

fn signal_groups(groups: &[u32], sig: Signal) {
    for &g in groups {
        if let Ok(g) = i32::try_from(g) {
            if g > 1 {
                // Gone already is fine.
                let _ = killpg(Pid::from_raw(g), sig);
            }
        }
    }
}

/// Guards `agent_pid`'s workloads by the file at `path` until there is
/// nothing left to guard (see the module). Blocking; meant to be the whole
/// of a small process.
pub fn watch(path: &Path, agent_pid: u32) {
    let tick = Duration::from_millis(100);
    let mut termed = false;
    let mut killed = false;
    let mut seen = false;
    let mut recorded = std::collections::HashSet::new();
    loop {
        std::thread::sleep(tick);
        let lease = match std::fs::read_to_string(path) {
            Ok(text) => Lease::parse(&text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // Not yet written (no sync so far): wait while the agent
                // lives. Removed after it was written: a clean stop.
                if seen || !alive(agent_pid) {
                    return;
                }
                continue;
            }
            Err(_) => None,
        };
        seen = true;
        let Some(lease) = lease else { continue };
        if lease.agent_pid != agent_pid {
            return;
        }
        let now = now_ms();
        if now < lease.stop_from_ms {
            // Renewed.
            termed = false;
            killed = false;
            recorded.clear();
            continue;
        }
        if !termed {
            signal_groups(&lease.groups, Signal::SIGTERM);
            termed = true;
        }
        if now >= lease.until_ms && !killed {
            signal_groups(&lease.groups, Signal::SIGKILL);
            killed = true;
        }
        for &g in &lease.groups {
            if !recorded.contains(&g) && ended(g) {
                if let Err(e) = record_ended(path, g, now_ms()) {
                    tracing::warn!(group = g, error = %e, "fence cannot record a group's end");
                }
                recorded.insert(g);
            }
        }
        if killed && !alive(agent_pid) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_round_trips() {
        let l = Lease {
            agent_pid: 42,
            stop_from_ms: 1_000,
            until_ms: 2_000,
            groups: vec![7, 9],
        };
        assert_eq!(Lease::parse(&l.render()), Some(l.clone()));
        let none = Lease {
            groups: vec![],
            ..l
        };
        assert_eq!(Lease::parse(&none.render()), Some(none));
        assert_eq!(Lease::parse("x"), None);
        assert_eq!(Lease::parse("1 2\n"), None);
    }

    #[test]
    fn a_lease_run_out_stops_the_groups_and_a_removed_file_ends_the_watch() {
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node-lease");
        let mut child = std::process::Command::new("sleep")
            .arg("600")
            .process_group(0)
            .spawn()
            .unwrap();
        let me = std::process::id();
        let now = now_ms();
        write(
            &path,
            &Lease {
                agent_pid: me,
                stop_from_ms: now + 300,
                until_ms: now + 600,
                groups: vec![child.id()],
            },
        )
        .unwrap();
        let watcher = {
            let path = path.clone();
            std::thread::spawn(move || watch(&path, me))
        };
        let started = std::time::Instant::now();
        // Not reaped at once, as under a paused agent: a zombie the fence
        // counts as ended, at the time it saw it end.
        let group = child.id();
        let mut waited = Duration::ZERO;
        while ended_at(&path, group).is_none() && waited < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(20));
            waited += Duration::from_millis(20);
        }
        let at = ended_at(&path, group).expect("the fence recorded the group's end");
        assert!(
            at >= now + 300 && at <= now_ms(),
            "ended after the lease's stop time ({}), recorded {at}",
            now + 300
        );
        let status = child.wait().unwrap();
        assert!(!status.success());
        assert!(
            started.elapsed() >= Duration::from_millis(200),
            "not before the lease's stop time"
        );
        std::fs::remove_file(&path).unwrap();
        watcher.join().unwrap();
        assert_eq!(ended_at(&path, group + 1), None);
    }
}
