//! Where workloads run: the [`Runtime`] trait the agent's loops drive, the
//! [`Workload`] handle every runtime returns, and what all runtimes share
//! (the spec of what to run, the GPU environment, the log buffer).
//!
//! A runtime starts a workload from a [`SpawnSpec`], supervises it (stop
//! with a grace, exit, captured output) and, after the agent restarted,
//! finds the workloads of this node that still run ([`Runtime::adopt`]) so
//! that none outlives its bookkeeping. Which runtime a node uses is its
//! configuration ([`RuntimeKind`]): [`process`] runs sandboxed processes.
//!
//! A runtime must never talk to the server, never run a command through a
//! shell, never signal anything it did not start (or adopt), and never
//! decide whether an instance may be (re)started: that is the agent's call.

pub mod process;
pub mod sandbox;

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, Utc};
use flotilla_core::api::{GpuSlice, LogLine, LogStream};
use flotilla_core::catalog::Vendor;
use flotilla_core::id::{InstanceId, TenantId};
use futures::future::BoxFuture;
use tokio::sync::{mpsc, watch, Notify};

pub use process::ProcessRuntime;

/// Longest line kept, in bytes; the rest of a longer line is dropped.
pub const MAX_LINE_BYTES: usize = 64 * 1024;
/// Most unsent lines kept per instance; older ones are dropped first.
pub const MAX_PENDING_LINES: usize = 100_000;
/// Pending lines that wake the log shipper before its next tick.
pub const SHIP_BATCH_LINES: usize = 500;

/// What to run for one instance.
#[derive(Debug, Clone)]
pub struct SpawnSpec {
    /// The instance.
    pub instance_id: InstanceId,
    /// Its tenant, when the server said: a sandboxing runtime isolates
    /// tenants from each other (absent: each instance on its own).
    pub tenant_id: Option<TenantId>,
    /// Program and arguments (no shell).
    pub command: Vec<String>,
    /// The instance's own environment (never the agent's).
    pub env: BTreeMap<String, String>,
    /// Working directory; created when missing.
    pub workdir: PathBuf,
    /// Node-local GPU indices the instance owns.
    pub gpu_indices: Vec<u32>,
    /// Their UUIDs, in the same order.
    pub gpu_uuids: Vec<String>,
    /// Vendors of those GPUs (decides which selection variables are set).
    pub vendors: Vec<Vendor>,
    /// What it holds of each GPU when it shares them (fractions, MIG
    /// instances); empty for whole GPUs.
    pub gpu_slices: Vec<GpuSlice>,
}

/// Who to wake when something happens to a process.
#[derive(Debug, Clone, Default)]
pub struct Wakers {
    /// Woken when the process exited (phase change).
    pub changed: Arc<Notify>,
    /// Woken when log lines are waiting to be shipped in bulk, and on exit.
    pub logs: Arc<Notify>,
}

/// Why a process could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// The command is empty.
    #[error("empty command")]
    EmptyCommand,
    /// The program does not exist.
    #[error("no such program `{0}`")]
    NoSuchProgram(String),
    /// The program exists but may not be executed.
    #[error("program `{program}` cannot be executed: {source}")]
    NotExecutable {
        /// The program.
        program: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The working directory could not be created.
    #[error("cannot create working directory `{path}`: {source}")]
    Workdir {
        /// The directory.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Any other OS error.
    #[error("cannot start `{program}`: {source}")]
    Os {
        /// The program.
        program: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    /// Exit status; 128 + signal when a signal ended it.
    pub code: i32,
    /// When the agent saw it end.
    pub at: DateTime<Utc>,
    /// A stop had been requested through [`Workload::stop`] before it ended.
    pub stop_requested: bool,
}

/// Which runtime a node runs its workloads with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RuntimeKind {
    /// Sandboxed processes ([`process`]).
    #[default]
    Process,
    /// Containers through the Docker Engine API.
    Container,
}

impl RuntimeKind {
    /// The name used in configuration and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            RuntimeKind::Process => "process",
            RuntimeKind::Container => "container",
        }
    }
}

impl std::fmt::Display for RuntimeKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for RuntimeKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "process" => Ok(RuntimeKind::Process),
            "container" => Ok(RuntimeKind::Container),
            other => Err(format!(
                "unknown runtime `{other}` (expected `process` or `container`)"
            )),
        }
    }
}

/// Where an instance's work runs. Object safe, so the agent holds an
/// `Arc<dyn Runtime>` chosen by configuration.
pub trait Runtime: Send + Sync {
    /// Which runtime this is.
    fn kind(&self) -> RuntimeKind;

    /// Starts `spec` and supervises it until it ended. May take long (an
    /// image pull): the agent calls it off its sync loop and reports the
    /// instance as starting meanwhile. Must be called inside a tokio
    /// runtime.
    fn start(&self, spec: SpawnSpec, wakers: Wakers)
        -> BoxFuture<'_, Result<Workload, SpawnError>>;

    /// The workloads of this node that an earlier agent process started
    /// and that still run, now supervised by this one (their output is
    /// captured from where the earlier process left it). Called once, at
    /// start, before any [`Runtime::start`].
    fn adopt(&self, wakers: Wakers) -> BoxFuture<'_, Result<Vec<Workload>, RuntimeError>>;
}

/// Why a runtime could not be set up or could not list its workloads.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A sandbox the node needs is missing, and running unsandboxed was
    /// not allowed.
    #[error("{0}")]
    Insecure(String),
    /// Reading or writing the runtime's own state failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The engine behind the runtime failed (a container engine's API).
    #[error("{0}")]
    Engine(String),
}

/// A supervised workload, as every runtime hands it to the agent. Cheap to
/// clone; every clone controls the same workload. Dropping all clones does
/// not stop it.
#[derive(Debug, Clone)]
pub struct Workload {
    instance_id: InstanceId,
    pid: u32,
    process_group: Option<u32>,
    started_at: DateTime<Utc>,
    stop_tx: mpsc::UnboundedSender<Duration>,
    exit_rx: watch::Receiver<Option<Exit>>,
    logs: Arc<LogBuffer>,
}

/// The runtime's side of a [`Workload`]: receives stop requests and
/// publishes the exit.
#[derive(Debug)]
pub struct Control {
    stop_rx: mpsc::UnboundedReceiver<Duration>,
    exit_tx: watch::Sender<Option<Exit>>,
    stops_open: bool,
}

impl Workload {
    /// A handle for a workload a runtime just started (or adopted), and the
    /// runtime's side of it. `pid` is what the server is told (the host
    /// pid of its main process); `process_group` is a group the node
    /// lease's fence may signal to stop it, when it has one.
    pub fn new(
        instance_id: InstanceId,
        pid: u32,
        process_group: Option<u32>,
        started_at: DateTime<Utc>,
        logs: Arc<LogBuffer>,
    ) -> (Workload, Control) {
        let (stop_tx, stop_rx) = mpsc::unbounded_channel();
        let (exit_tx, exit_rx) = watch::channel(None);
        (
            Workload {
                instance_id,
                pid,
                process_group,
                started_at,
                stop_tx,
                exit_rx,
                logs,
            },
            Control {
                stop_rx,
                exit_tx,
                stops_open: true,
            },
        )
    }

    /// The instance it runs for.
    pub fn instance_id(&self) -> &InstanceId {
        &self.instance_id
    }

    /// Process id of its main process, as seen from the host.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The process group the node lease's fence signals to stop it.
    pub fn process_group(&self) -> Option<u32> {
        self.process_group
    }

    /// When it was started (by this agent process or an earlier one).
    pub fn started_at(&self) -> DateTime<Utc> {
        self.started_at
    }

    /// Asks for it to stop: SIGTERM now, SIGKILL after `grace` if it still
    /// runs. A later call may shorten the grace. Returns at once.
    pub fn stop(&self, grace: Duration) {
        // A closed channel means the supervisor is done: nothing to stop.
        let _ = self.stop_tx.send(grace);
    }

    /// How it ended, once it ended and its output was fully read.
    pub fn exit(&self) -> Option<Exit> {
        *self.exit_rx.borrow()
    }

    /// Waits until it ended and its output was fully read.
    pub async fn wait(&self) -> Exit {
        let mut rx = self.exit_rx.clone();
        let published = rx.wait_for(Option::is_some).await.ok().and_then(|e| *e);
        // The supervisor always publishes before it ends; if it vanished
        // anyway (a panic), report an unknown status rather than hang.
        published.unwrap_or_else(lost_exit)
    }

    /// Its captured output.
    pub fn logs(&self) -> &Arc<LogBuffer> {
        &self.logs
    }
}

impl Control {
    /// The next stop request's grace; pending forever once every handle
    /// is gone (nobody can ask any more), so it fits a `select!` arm.
    pub async fn stop_requested(&mut self) -> Duration {
        if self.stops_open {
            if let Some(grace) = self.stop_rx.recv().await {
                return grace;
            }
            self.stops_open = false;
        }
        std::future::pending().await
    }

    /// Publishes how it ended; call once its output was fully read.
    pub fn exited(self, exit: Exit) {
        self.exit_tx.send_replace(Some(exit));
    }
}

fn lost_exit() -> Exit {
    Exit {
        code: -1,
        at: Utc::now(),
        stop_requested: false,
    }
}

/// The environment variables that give an instance its GPUs.
///
/// Shares: a MIG instance is selected by its MIG device name in
/// `CUDA_VISIBLE_DEVICES` (CUDA then sees that instance only, with the
/// profile's compute and memory). A fraction sees its GPU and is held to
/// its share by MPS: `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` limits the SMs its
/// contexts may use and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` caps the device
/// memory it may allocate (both honoured when the node runs the MPS control
/// daemon); `FLOTILLA_GPU_MEMORY_LIMIT_MIB` states the cap for frameworks
/// that limit themselves (e.g. a PyTorch memory fraction).
pub fn device_env(
    instance_id: &InstanceId,
    gpu_indices: &[u32],
    gpu_uuids: &[String],
    vendors: &[Vendor],
    slices: &[GpuSlice],
) -> Vec<(String, String)> {
    let mig: Vec<&str> = slices
        .iter()
        .filter_map(|s| s.mig_device.as_deref())
        .collect();
    let indices = if mig.is_empty() {
        gpu_indices
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",")
    } else {
        mig.join(",")
    };
    let mut env = vec![
        ("CUDA_VISIBLE_DEVICES".to_string(), indices.clone()),
        ("NVIDIA_VISIBLE_DEVICES".to_string(), indices.clone()),
    ];
    if vendors.contains(&Vendor::Amd) {
        env.push(("ROCR_VISIBLE_DEVICES".to_string(), indices));
    }
    env.push((
        "FLOTILLA_INSTANCE_ID".to_string(),
        instance_id.as_str().to_string(),
    ));
    env.push(("FLOTILLA_GPU_UUIDS".to_string(), gpu_uuids.join(",")));
    if let Some(slice) = slices.first() {
        if let Some(profile) = &slice.mig_profile {
            env.push(("FLOTILLA_MIG_PROFILE".to_string(), profile.clone()));
        } else {
            // Whole percent, at least 1: MPS takes an integer.
            let percent = ((slice.milli + 5) / 10).clamp(1, 100);
            env.push((
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".to_string(),
                percent.to_string(),
            ));
            env.push((
                "FLOTILLA_GPU_FRACTION".to_string(),
                format!("{}", f64::from(slice.milli) / 1000.0),
            ));
            if let Some(mib) = slice.memory_limit_mib {
                // Device 0 of the devices the workload sees: its one GPU.
                env.push((
                    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".to_string(),
                    format!("0={mib}M"),
                ));
            }
        }
        if let Some(mib) = slice.memory_limit_mib {
            env.push(("FLOTILLA_GPU_MEMORY_LIMIT_MIB".to_string(), mib.to_string()));
        }
    }
    env
}

/// Exit status as reported: the code, or 128 + the signal that ended it.
pub fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => -1,
    }
}

/// The captured, not yet shipped output of one instance. Lines get
/// consecutive sequence numbers from 0 across both streams; a line leaves
/// the buffer only once the server accepted it (see [`LogBuffer::ack`]).
#[derive(Debug)]
pub struct LogBuffer {
    instance_id: InstanceId,
    inner: Mutex<LogInner>,
}

#[derive(Debug, Default)]
struct LogInner {
    next_seq: u64,
    pending: VecDeque<LogLine>,
    dropped: u64,
}

impl LogBuffer {
    /// An empty buffer for `instance_id`.
    pub fn new(instance_id: InstanceId) -> Self {
        Self {
            instance_id,
            inner: Mutex::new(LogInner::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LogInner> {
        // The critical sections cannot panic half-way; a poisoned lock still
        // holds consistent data.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends a line, giving it the next sequence number; returns how many
    /// lines are pending. Beyond [`MAX_PENDING_LINES`] the oldest is dropped.
    pub fn push(&self, stream: LogStream, line: String) -> usize {
        let mut inner = self.lock();
        let seq = inner.next_seq;
        inner.next_seq += 1;
        inner.pending.push_back(LogLine {
            seq,
            stream,
            at: Utc::now(),
            line,
        });
        if inner.pending.len() > MAX_PENDING_LINES {
            inner.pending.pop_front();
            inner.dropped += 1;
            if inner.dropped == 1 || inner.dropped % 10_000 == 0 {
                tracing::warn!(
                    instance_id = %self.instance_id,
                    dropped = inner.dropped,
                    "log buffer full, dropping oldest unsent lines"
                );
            }
        }
        inner.pending.len()
    }

    /// Copies up to `max` of the oldest pending lines.
    pub fn peek(&self, max: usize) -> Vec<LogLine> {
        self.lock().pending.iter().take(max).cloned().collect()
    }

    /// Forgets every pending line up to and including `seq`.
    pub fn ack(&self, seq: u64) {
        let mut inner = self.lock();
        while inner.pending.front().is_some_and(|l| l.seq <= seq) {
            inner.pending.pop_front();
        }
    }

    /// Lines waiting to be shipped.
    pub fn pending(&self) -> usize {
        self.lock().pending.len()
    }

    /// Lines captured so far (the next sequence number).
    pub fn captured(&self) -> u64 {
        self.lock().next_seq
    }

    /// Lines dropped because the buffer was full.
    pub fn dropped(&self) -> u64 {
        self.lock().dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_kinds_parse_and_print() {
        assert_eq!("process".parse(), Ok(RuntimeKind::Process));
        assert_eq!("container".parse(), Ok(RuntimeKind::Container));
        assert_eq!(RuntimeKind::default(), RuntimeKind::Process);
        assert_eq!(RuntimeKind::Container.to_string(), "container");
        assert!("vm".parse::<RuntimeKind>().unwrap_err().contains("`vm`"));
    }

    #[tokio::test]
    async fn a_workload_handle_carries_stops_and_the_exit() {
        let id = InstanceId::generate(1, 1);
        let logs = Arc::new(LogBuffer::new(id.clone()));
        let (w, mut control) = Workload::new(id, 42, Some(42), Utc::now(), logs);
        assert_eq!(w.exit(), None);
        w.clone().stop(Duration::from_secs(3));
        assert_eq!(control.stop_requested().await, Duration::from_secs(3));
        let exit = Exit {
            code: 143,
            at: Utc::now(),
            stop_requested: true,
        };
        control.exited(exit);
        assert_eq!(w.wait().await, exit);
        assert_eq!(w.exit(), Some(exit));
    }

    #[tokio::test]
    async fn amd_gpus_get_rocr_visible_devices() {
        let id = InstanceId::generate(1, 1);
        let env = device_env(
            &id,
            &[0, 2],
            &["u0".into(), "u2".into()],
            &[Vendor::Amd],
            &[],
        );
        assert!(env.contains(&("ROCR_VISIBLE_DEVICES".into(), "0,2".into())));
        assert!(env.contains(&("CUDA_VISIBLE_DEVICES".into(), "0,2".into())));
        assert!(env.contains(&("FLOTILLA_INSTANCE_ID".into(), id.to_string())));
        let env = device_env(&id, &[], &[], &[], &[]);
        assert!(env.contains(&("CUDA_VISIBLE_DEVICES".into(), String::new())));
        assert!(!env.iter().any(|(k, _)| k == "ROCR_VISIBLE_DEVICES"));
    }

    #[test]
    fn shares_get_mig_devices_or_mps_limits() {
        let id = InstanceId::generate(1, 1);
        let gpu = flotilla_core::id::GpuId::generate(1, 7);
        let mig = GpuSlice {
            gpu_id: gpu.clone(),
            milli: 142,
            mig_profile: Some("1g.10gb".into()),
            mig_device: Some("MIG-GPU-a/2/0".into()),
            memory_limit_mib: Some(10_240),
        };
        let env = device_env(&id, &[3], &["GPU-a".into()], &[Vendor::Nvidia], &[mig]);
        let get = |env: &[(String, String)], k: &str| {
            env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        };
        assert_eq!(
            get(&env, "CUDA_VISIBLE_DEVICES").as_deref(),
            Some("MIG-GPU-a/2/0")
        );
        assert_eq!(
            get(&env, "FLOTILLA_MIG_PROFILE").as_deref(),
            Some("1g.10gb")
        );
        assert_eq!(get(&env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), None);
        let quarter = GpuSlice {
            gpu_id: gpu,
            milli: 250,
            mig_profile: None,
            mig_device: None,
            memory_limit_mib: Some(20_480),
        };
        let env = device_env(&id, &[3], &["GPU-a".into()], &[Vendor::Nvidia], &[quarter]);
        assert_eq!(get(&env, "CUDA_VISIBLE_DEVICES").as_deref(), Some("3"));
        assert_eq!(
            get(&env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").as_deref(),
            Some("25")
        );
        assert_eq!(
            get(&env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT").as_deref(),
            Some("0=20480M")
        );
        assert_eq!(
            get(&env, "FLOTILLA_GPU_MEMORY_LIMIT_MIB").as_deref(),
            Some("20480")
        );
        assert_eq!(get(&env, "FLOTILLA_GPU_FRACTION").as_deref(), Some("0.25"));
    }

    #[test]
    fn buffer_numbers_acks_and_caps() {
        let b = LogBuffer::new(InstanceId::generate(1, 1));
        for i in 0..5 {
            b.push(LogStream::Stdout, format!("l{i}"));
        }
        assert_eq!(b.peek(2).iter().map(|l| l.seq).collect::<Vec<_>>(), [0, 1]);
        b.ack(1);
        assert_eq!(b.pending(), 3);
        assert_eq!(b.peek(1)[0].seq, 2);
        b.ack(10);
        assert_eq!(b.pending(), 0);
        assert_eq!(b.captured(), 5);
        for _ in 0..MAX_PENDING_LINES + 3 {
            b.push(LogStream::Stderr, String::new());
        }
        assert_eq!(b.pending(), MAX_PENDING_LINES);
        assert_eq!(b.dropped(), 3);
        assert_eq!(b.peek(1)[0].seq, 8);
    }
}
