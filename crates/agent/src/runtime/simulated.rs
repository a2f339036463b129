//! A runtime whose workloads run nowhere: each is a timer inside the agent
//! process. It lets one process play a whole fleet of nodes
//! ([`crate::fleet`]) without a process, a sandbox or a directory per
//! workload, while the agent reports, stops, fences and the server meters
//! its workloads through exactly the paths a real runtime's take.
//!
//! What a command does here (the first word decides; nothing is executed):
//!
//! - `sleep SECONDS`: runs that long (decimal seconds, millisecond
//!   precision), then exits 0, as `sleep` would;
//! - `true` and `false`: exit at once with 0 and 1;
//! - anything else (a server, a notebook, an endpoint's replica): runs
//!   until it is stopped.
//!
//! A stop ends a workload at once with 143 (128 + SIGTERM), as `sleep`
//! ends on the SIGTERM a real stop sends. Start and exit times are the
//! wall clock's when the timer started and fired: what a real runtime
//! reports of a process it watched, so metering (from the reported start
//! to the reported exit, to the millisecond) treats both alike.
//!
//! It must never start a process, touch the disk, or outlive the agent
//! process: its workloads end with it (nothing to adopt after a restart).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use futures::future::BoxFuture;

use super::Workload;
use super::{Exit, LogBuffer, Runtime, RuntimeError, RuntimeKind, SpawnError, SpawnSpec, Wakers};

/// Exit status of a workload ended by a stop: 128 + SIGTERM (15).
pub const STOPPED_CODE: i32 = 143;

/// Longest `sleep` a simulated workload takes literally (a year); longer
/// ones run until stopped.
const MAX_SLEEP: Duration = Duration::from_secs(365 * 24 * 3600);

/// What a simulated command does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// Exits with `code` after `after`.
    ExitsAfter {
        /// How long it runs.
        after: Duration,
        /// Its exit status.
        code: i32,
    },
    /// Runs until stopped.
    RunsUntilStopped,
}

impl Behaviour {
    /// What `command` does (see the module doc). `None`: an empty command,
    /// refused like a real runtime refuses it.
    pub fn of(command: &[String]) -> Option<Behaviour> {
        let program = command.first()?;
        let name = program.rsplit('/').next().unwrap_or(program);
        Some(match name {
            "true" => Behaviour::ExitsAfter {
                after: Duration::ZERO,
                code: 0,
            },
            "false" => Behaviour::ExitsAfter {
                after: Duration::ZERO,
                code: 1,
            },
            "sleep" => match command.get(1).and_then(|s| parse_seconds(s)) {
                Some(after) => Behaviour::ExitsAfter { after, code: 0 },
                // `sleep` with a bad operand fails at once, as coreutils' does.
                None => Behaviour::ExitsAfter {
                    after: Duration::ZERO,
                    code: 1,
                },
            },
            _ => Behaviour::RunsUntilStopped,
        })
    }
}

/// `sleep`'s operand in decimal seconds (`1`, `1.25`, `0.5s`); `inf` and
/// anything past [`MAX_SLEEP`] run until stopped.
fn parse_seconds(s: &str) -> Option<Duration> {
    let s = s.strip_suffix('s').unwrap_or(s);
    if s == "inf" || s == "infinity" {
        return Some(MAX_SLEEP);
    }
    let secs: f64 = s.parse().ok()?;
    if !secs.is_finite() || secs < 0.0 {
        return None;
    }
    Some(Duration::from_secs_f64(secs).min(MAX_SLEEP))
}

/// The simulated runtime; one may serve many nodes of a fleet at once.
#[derive(Debug)]
pub struct SimulatedRuntime {
    /// Stand-in process ids, reported as the workloads' pids; never
    /// signalled (the workloads have no process group, so the fence skips
    /// them too).
    next_pid: AtomicU32,
    /// Workloads started and not yet exited.
    running: Arc<AtomicU64>,
}

impl Default for SimulatedRuntime {
    fn default() -> Self {
        Self::new()
    }
}

impl SimulatedRuntime {
    /// A runtime with no workloads.
    pub fn new() -> Self {
        // Above Linux's default pid_max, so a reported pid is visibly not a
        // process of this host.
        Self {
            next_pid: AtomicU32::new(10_000_000),
            running: Arc::default(),
        }
    }

    /// Workloads running now (started, not yet exited).
    pub fn running(&self) -> u64 {
        self.running.load(Ordering::Relaxed)
    }

    /// Starts the timer of `spec`'s workload.
    fn start_now(&self, spec: &SpawnSpec, wakers: Wakers) -> Result<Workload, SpawnError> {
        let behaviour = Behaviour::of(&spec.command).ok_or(SpawnError::EmptyCommand)?;
        if spec.image.is_some() {
            return Err(SpawnError::ImageOnProcessNode);
        }
        let pid = self.next_pid.fetch_add(1, Ordering::Relaxed);
        let logs = Arc::new(LogBuffer::new(spec.instance_id.clone()));
        let (workload, mut control) =
            Workload::new(spec.instance_id.clone(), pid, None, Utc::now(), logs);
        let running = self.running.clone();
        running.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            let ends = async {
                match behaviour {
                    Behaviour::ExitsAfter { after, code } => {
                        tokio::time::sleep(after).await;
                        code
                    }
                    Behaviour::RunsUntilStopped => std::future::pending().await,
                }
            };
            let (code, stop_requested) = tokio::select! {
                code = ends => (code, false),
                _grace = control.stop_requested() => (STOPPED_CODE, true),
            };
            running.fetch_sub(1, Ordering::Relaxed);
            control.exited(Exit {
                code,
                at: Utc::now(),
                stop_requested,
                oom_killed: false,
                disk_exceeded: false,
            });
            wakers.changed.notify_one();
            wakers.logs.notify_one();
        });
        Ok(workload)
    }
}

impl Runtime for SimulatedRuntime {
    /// Reported as a process node: the server places on it what it places
    /// on one (work without an image).
    fn kind(&self) -> RuntimeKind {
        RuntimeKind::Process
    }

    fn start(
        &self,
        spec: SpawnSpec,
        wakers: Wakers,
    ) -> BoxFuture<'_, Result<Workload, SpawnError>> {
        Box::pin(async move { self.start_now(&spec, wakers) })
    }

    /// Nothing outlives the process that ran it.
    fn adopt(&self, _wakers: Wakers) -> BoxFuture<'_, Result<Vec<Workload>, RuntimeError>> {
        Box::pin(async { Ok(Vec::new()) })
    }

    fn simulated(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_core::id::InstanceId;

    fn cmd(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn commands_map_to_what_the_real_program_does() {
        assert_eq!(Behaviour::of(&[]), None);
        assert_eq!(
            Behaviour::of(&cmd(&["sleep", "1.25"])),
            Some(Behaviour::ExitsAfter {
                after: Duration::from_millis(1250),
                code: 0
            })
        );
        assert_eq!(
            Behaviour::of(&cmd(&["/bin/false"])),
            Some(Behaviour::ExitsAfter {
                after: Duration::ZERO,
                code: 1
            })
        );
        assert_eq!(
            Behaviour::of(&cmd(&["sleep", "-1"])),
            Some(Behaviour::ExitsAfter {
                after: Duration::ZERO,
                code: 1
            })
        );
        assert_eq!(
            Behaviour::of(&cmd(&["python", "serve.py"])),
            Some(Behaviour::RunsUntilStopped)
        );
        assert_eq!(
            Behaviour::of(&cmd(&["sleep", "inf"])),
            Some(Behaviour::ExitsAfter {
                after: MAX_SLEEP,
                code: 0
            })
        );
    }

    fn spec(command: &[&str]) -> SpawnSpec {
        SpawnSpec {
            instance_id: InstanceId::generate(1, 1),
            tenant_id: None,
            command: cmd(command),
            env: Default::default(),
            workdir: "/nonexistent".into(),
            gpu_indices: vec![0],
            gpu_uuids: vec![],
            vendors: vec![],
            gpu_slices: vec![],
            image: None,
            cpu_milli: None,
            memory_mb: None,
            disk_mb: None,
            registry_auth: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_sleep_exits_on_time_and_a_stop_ends_a_server_with_143() {
        let rt = SimulatedRuntime::new();
        let wakers = Wakers::default();
        let sleeper = rt.start(spec(&["sleep", "2"]), wakers.clone()).await;
        let sleeper = sleeper.unwrap();
        assert!(sleeper.exit().is_none());
        assert_eq!(rt.running(), 1);
        let t0 = tokio::time::Instant::now();
        let exit = sleeper.wait().await;
        assert_eq!(t0.elapsed(), Duration::from_secs(2));
        assert_eq!((exit.code, exit.stop_requested), (0, false));
        assert_eq!(rt.running(), 0);
        assert!(exit.at >= sleeper.started_at());
        assert_eq!(sleeper.logs().pending(), 0);

        let server = rt.start(spec(&["serve"]), wakers.clone()).await.unwrap();
        assert_ne!(server.pid(), sleeper.pid());
        assert_eq!(
            server.process_group(),
            None,
            "nothing for a fence to signal"
        );
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert!(server.exit().is_none(), "runs until stopped");
        server.stop(Duration::from_secs(10));
        let exit = server.wait().await;
        assert_eq!((exit.code, exit.stop_requested), (STOPPED_CODE, true));
    }

    #[tokio::test]
    async fn refuses_what_a_process_node_refuses() {
        let rt = SimulatedRuntime::new();
        assert!(matches!(
            rt.start(spec(&[]), Wakers::default()).await,
            Err(SpawnError::EmptyCommand)
        ));
        assert!(rt.adopt(Wakers::default()).await.unwrap().is_empty());
    }
}
