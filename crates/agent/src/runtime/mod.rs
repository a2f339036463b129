//! Where workloads run: the [`Runtime`] trait the agent's loops drive, the
//! [`Workload`] handle every runtime returns, and what all runtimes share
//! (the spec of what to run, the GPU environment, the log buffer).
//!
//! A runtime starts a workload from a [`SpawnSpec`], supervises it (stop
//! with a grace, exit, captured output) and, after the agent restarted,
//! finds the workloads of this node that still run ([`Runtime::adopt`]) so
//! that none outlives its bookkeeping. Which runtime a node uses is its
//! configuration ([`RuntimeKind`]): [`process`] runs sandboxed processes,
//! [`crate::container`] runs containers through the Docker Engine API, and
//! [`simulated`] runs timers in the agent process (a simulated fleet).
//!
//! A runtime must never talk to the server, never run a command through a
//! shell, never signal anything it did not start (or adopt), and never
//! decide whether an instance may be (re)started: that is the agent's call.

pub mod cgroup;
pub mod leftovers;
pub mod limits;
pub mod network;
pub mod process;
pub mod relay;
pub mod sandbox;
pub mod simulated;
pub mod state;

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, Utc};
use flotilla_core::api::{GpuSlice, LogLine, LogStream, ObservedContainer};
use flotilla_core::catalog::Vendor;
use flotilla_core::id::{InstanceId, TenantId};
use flotilla_core::instance::ImageSpec;
use futures::future::BoxFuture;
use tokio::sync::{mpsc, watch, Notify};

pub use process::ProcessRuntime;

/// Longest line, in bytes; a longer one is split into several.
pub const MAX_LINE_BYTES: usize = 64 * 1024;
/// Most unsent lines kept per instance for a runtime that cannot hold its
/// workload back (a container engine's stream): past it the oldest not
/// being shipped are dropped, and a marker says exactly how many. Output
/// read from files never gets there (see [`state::TAIL_MAX_PENDING_LINES`]).
pub const MAX_PENDING_LINES: usize = 100_000;
/// Pending lines that wake the log shipper before its next tick, and the
/// most lines in one batch.
pub const SHIP_BATCH_LINES: usize = 500;
/// About the most JSON bytes in one batch: half the server's 1 MiB limit
/// on a request body, so escapes and framing always fit.
pub const SHIP_BATCH_BYTES: usize = 512 * 1024;

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
    /// The image to run it from (with its ports and scratch space): only a
    /// container runtime runs it; a process runtime refuses it.
    pub image: Option<ImageSpec>,
    /// CPU limit in milli-cores (both runtimes enforce it).
    pub cpu_milli: Option<u32>,
    /// Memory limit in MiB (both runtimes enforce it).
    pub memory_mb: Option<u64>,
    /// Limit of the instance directory's size in MiB (the process runtime
    /// enforces it; absent: the node's default).
    pub disk_mb: Option<u64>,
    /// The tenant's login for the image's registry, when the server sent
    /// one (a container runtime pulls with it).
    pub registry_auth: Option<flotilla_core::registry::RegistryAuth>,
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
    /// The instance names an image and this node runs processes.
    #[error("this node runs processes; images need a container node (`flotilla agent --runtime container`)")]
    ImageOnProcessNode,
    /// A container runtime needs the tenant (its network); the server did
    /// not say.
    #[error(
        "the server did not say whose instance this is; a container joins its tenant's network"
    )]
    NoTenant,
    /// The instance names no image and this node runs containers.
    #[error("this node runs containers; an instance without an image needs a process node (`--image IMAGE` runs it here)")]
    NoImageOnContainerNode,
    /// The instance's limits could not be set up (its cgroup).
    #[error("cannot set up the instance's limits: {0}")]
    Limits(#[from] cgroup::CgroupError),
    /// The container engine refused or failed (pull, create, start).
    #[error(transparent)]
    Container(#[from] crate::container_error::ContainerError),
    /// The workload's network namespace could not be set up.
    #[error("cannot set up the workload's network: {0}")]
    Network(String),
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
    /// The kernel killed it for exceeding its memory limit.
    pub oom_killed: bool,
    /// The runtime stopped it for writing past its disk limit.
    pub disk_exceeded: bool,
}

/// Which runtime a node runs its workloads with (shared with the server,
/// which places work by it).
pub use flotilla_core::node::RuntimeKind;

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

    /// Called once the agent stopped its work for good (a clean
    /// shutdown): removes what the runtime set up for its workloads and no
    /// longer needs.
    fn close(&self) {}

    /// The limits this runtime cannot hold workloads to on this node,
    /// each with why (reported at registration); empty: all of them.
    fn unenforced_limits(&self) -> Vec<String> {
        Vec::new()
    }

    /// What a start under way last reported (an image pull's progress),
    /// shown as the instance's state reason while it starts.
    fn progress(&self, _instance_id: &InstanceId) -> Option<String> {
        None
    }

    /// The agent is done with the instance (its end was reported and the
    /// server no longer lists it): whatever the runtime kept to take it
    /// over after a restart may go.
    fn release(&self, _instance_id: &InstanceId) {}

    /// The node's image cache, reported to the server with every sync;
    /// `None` for runtimes without images (processes).
    fn cached_images(&self) -> Option<Vec<flotilla_core::api::NodeImage>> {
        None
    }

    /// The container engine's API, for a runtime of containers: sessions
    /// into its instances (`flotilla exec`) run through the engine's exec.
    fn engine(&self) -> Option<bollard::Docker> {
        None
    }

    /// How workloads' network is isolated, reported at registration
    /// (see [`network`]); `None`: the runtime does not say.
    fn network(&self) -> Option<flotilla_core::api::NodeNetwork> {
        None
    }

    /// Its workloads run nowhere ([`simulated`]): there is no process to
    /// enter, so the agent refuses sessions into them.
    fn simulated(&self) -> bool {
        false
    }
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
    container: Option<Arc<ObservedContainer>>,
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
                container: None,
            },
            Control {
                stop_rx,
                exit_tx,
                stops_open: true,
            },
        )
    }

    /// The same handle, telling that it runs in a container: its id,
    /// published ports and cold start, reported with every observation.
    pub fn in_container(mut self, container: ObservedContainer) -> Self {
        self.container = Some(Arc::new(container));
        self
    }

    /// Its container, when it runs in one (`oom_killed` is told by
    /// [`Workload::exit`], not here).
    pub fn container(&self) -> Option<&ObservedContainer> {
        self.container.as_deref()
    }

    /// The instance it runs for.
    pub fn instance_id(&self) -> &InstanceId {
        &self.instance_id
    }

    /// Process id of its main process, as seen from the host (for a
    /// container: its init process, as the engine reports it; 0 when the
    /// engine did not say).
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
        oom_killed: false,
        disk_exceeded: false,
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

/// Cuts a byte stream into lines: at each `\n` (a trailing `\r` is
/// dropped), and a line longer than [`MAX_LINE_BYTES`] into several, cut
/// before a UTF-8 character that would cross the limit, so that nothing is
/// lost and every piece fits a log batch.
#[derive(Debug, Default)]
pub struct LineSplitter {
    line: Vec<u8>,
}

impl LineSplitter {
    /// Feeds `bytes`, calling `emit` with every complete line.
    pub fn feed(&mut self, bytes: &[u8], mut emit: impl FnMut(&[u8])) {
        self.feed_at(bytes, |line, _| emit(line));
    }

    /// Feeds `bytes`, calling `emit` with every complete line and where in
    /// `bytes` it ended (after its newline; 0 for a piece of a long line
    /// that ended before `bytes`).
    pub fn feed_at(&mut self, bytes: &[u8], mut emit: impl FnMut(&[u8], usize)) {
        let mut rest = bytes;
        while !rest.is_empty() {
            let (chunk, end_of_line) = match rest.iter().position(|b| *b == b'\n') {
                Some(i) => (&rest[..i], true),
                None => (rest, false),
            };
            rest = &rest[chunk.len() + usize::from(end_of_line)..];
            let consumed = bytes.len() - rest.len();
            self.line.extend_from_slice(chunk);
            while self.line.len() > MAX_LINE_BYTES {
                let cut = utf8_cut(&self.line, MAX_LINE_BYTES);
                let left = self.line.len() - cut + usize::from(end_of_line);
                emit(&self.line[..cut], consumed.saturating_sub(left));
                self.line.drain(..cut);
            }
            if end_of_line {
                let line = self.line.strip_suffix(b"\r").unwrap_or(&self.line);
                emit(line, consumed);
                self.line.clear();
            }
        }
    }

    /// The end of the stream: emits a last line without a newline.
    pub fn finish(&mut self, mut emit: impl FnMut(&[u8])) {
        if !self.line.is_empty() {
            emit(&self.line);
            self.line.clear();
        }
    }
}

/// Where to cut `bytes` at most `max` long without splitting a UTF-8
/// character (bytes that are not UTF-8 are cut anywhere).
fn utf8_cut(bytes: &[u8], max: usize) -> usize {
    let mut cut = max;
    // A continuation byte (10xxxxxx) may not start a piece; back up at most
    // three of them.
    while cut > max.saturating_sub(3) && cut > 0 && bytes.get(cut).is_some_and(|b| b & 0xC0 == 0x80)
    {
        cut -= 1;
    }
    if cut == 0 {
        max
    } else {
        cut
    }
}

/// The captured, not yet shipped output of one instance. Lines get
/// consecutive sequence numbers from 0 across both streams; a line leaves
/// the buffer only once the server accepted it (see [`LogBuffer::ack`]).
#[derive(Debug)]
pub struct LogBuffer {
    instance_id: InstanceId,
    inner: Mutex<LogInner>,
    /// Where how far the output was shipped is recorded, for an agent that
    /// takes the workload over after a restart.
    state: Option<state::StateDir>,
    /// Woken whenever the server answered a batch.
    acked: Notify,
}

#[derive(Debug, Default)]
struct LogInner {
    next_seq: u64,
    /// Unsent lines and gaps, in sequence order.
    pending: VecDeque<Pending>,
    /// How many of them are lines (not gaps).
    lines: usize,
    /// The bytes of those lines.
    bytes: usize,
    /// Lines dropped so far (buffer full, or refused for good).
    dropped: u64,
    /// The last sequence number of the batch handed out for shipping and
    /// not yet answered: lines up to it are never dropped, nor gaps up to
    /// it grown, so that the server never gets a line that is also
    /// counted lost, nor a marker whose count changed after it was sent.
    in_flight: Option<u64>,
    /// For output read from files: where each pending line ended in its
    /// file, and how far the shipped lines reach.
    ends: VecDeque<(u64, LogStream, u64)>,
    shipped: state::Checkpoint,
}

/// One unsent entry of a [`LogBuffer`].
#[derive(Debug, Clone)]
enum Pending {
    /// A captured line.
    Line(LogLine),
    /// `lost` consecutive lines that were dropped, the last of them
    /// numbered `seq`: shipped as one marker line under that number (the
    /// server never got a line with it), saying exactly this gap's count.
    Gap {
        seq: u64,
        lost: u64,
        at: DateTime<Utc>,
    },
}

impl Pending {
    fn seq(&self) -> u64 {
        match self {
            Pending::Line(l) => l.seq,
            Pending::Gap { seq, .. } => *seq,
        }
    }

    /// As it is shipped: the line, or the gap's marker.
    fn to_line(&self) -> LogLine {
        match self {
            Pending::Line(l) => l.clone(),
            Pending::Gap { seq, lost, at } => LogLine {
                seq: *seq,
                stream: LogStream::Stderr,
                at: *at,
                line: lost_marker(*lost),
            },
        }
    }
}

impl LogInner {
    /// Lines up to `seq` left the buffer: moves the checkpoint past them.
    fn passed(&mut self, seq: u64) {
        while let Some(&(s, stream, end)) = self.ends.front() {
            if s > seq {
                break;
            }
            match stream {
                LogStream::Stdout => self.shipped.stdout = end,
                LogStream::Stderr => self.shipped.stderr = end,
            }
            self.ends.pop_front();
        }
        self.shipped.next_seq = self.shipped.next_seq.max(seq + 1);
    }

    /// Drops the oldest line not in flight into a gap: the gap right
    /// before it grows (when it is not in flight either), or the line
    /// becomes a gap of one.
    fn lose_oldest(&mut self) {
        let first = match self.in_flight {
            Some(f) => self.pending.partition_point(|e| e.seq() <= f),
            None => 0,
        };
        let Some(i) = (first..self.pending.len())
            .find(|&i| matches!(self.pending.get(i), Some(Pending::Line(_))))
        else {
            return;
        };
        let Some(Pending::Line(line)) = self.pending.get(i) else {
            return;
        };
        let (seq, at) = (line.seq, line.at);
        self.bytes -= line.line.len();
        self.lines -= 1;
        self.dropped += 1;
        if i > first {
            if let Some(Pending::Gap { seq: g, lost, .. }) = self.pending.get_mut(i - 1) {
                *g = seq;
                *lost += 1;
                self.pending.remove(i);
                return;
            }
        }
        self.pending[i] = Pending::Gap { seq, lost: 1, at };
    }

    /// Removes every entry up to `seq`; returns the lines and the gaps'
    /// lost lines among them.
    fn remove_through(&mut self, seq: u64) -> (u64, u64) {
        let (mut lines, mut lost) = (0, 0);
        while let Some(e) = self.pending.front() {
            if e.seq() > seq {
                break;
            }
            match e {
                Pending::Line(l) => {
                    lines += 1;
                    self.bytes -= l.line.len();
                }
                Pending::Gap { lost: n, .. } => lost += n,
            }
            self.pending.pop_front();
        }
        self.lines -= lines as usize;
        (lines, lost)
    }
}

/// The line that stands in an instance's log for `n` lines the node could
/// not deliver: those right before it (its sequence number is the last
/// of them), and only those.
pub fn lost_marker(n: u64) -> String {
    format!("[flotilla: {n} lines of output lost: the node could not deliver them]")
}

/// The count a [`lost_marker`] line states, for readers that add up a log.
pub fn parse_lost_marker(line: &str) -> Option<u64> {
    line.strip_prefix("[flotilla: ")?
        .strip_suffix(" lines of output lost: the node could not deliver them]")?
        .parse()
        .ok()
}

/// About how many bytes `line` takes in a JSON batch: escapes counted at
/// their longest, plus the fields around it.
pub fn json_size(line: &LogLine) -> usize {
    const FIELDS: usize = 96;
    FIELDS
        + line
            .line
            .chars()
            .map(|c| match c {
                '"' | '\\' => 2,
                c if (c as u32) < 0x20 => 6,
                c => c.len_utf8(),
            })
            .sum::<usize>()
}

impl LogBuffer {
    /// An empty buffer for `instance_id`.
    pub fn new(instance_id: InstanceId) -> Self {
        Self {
            instance_id,
            inner: Mutex::new(LogInner::default()),
            state: None,
            acked: Notify::new(),
        }
    }

    /// A buffer for output read from files, continuing from `from` (what
    /// was shipped before) and recording its progress in `state`.
    pub fn persistent(
        instance_id: InstanceId,
        state: state::StateDir,
        from: state::Checkpoint,
    ) -> Self {
        Self {
            instance_id,
            inner: Mutex::new(LogInner {
                next_seq: from.next_seq,
                shipped: from,
                ..LogInner::default()
            }),
            state: Some(state),
            acked: Notify::new(),
        }
    }

    fn save(&self, inner: &LogInner) {
        if let Some(state) = &self.state {
            if let Err(error) = state.write_checkpoint(inner.shipped) {
                tracing::debug!(instance_id = %self.instance_id, %error, "cannot record shipped output");
            }
        }
    }

    /// Appends a line read from a file, where it ended at byte `end`.
    pub fn push_at(&self, stream: LogStream, line: String, end: u64) -> usize {
        let mut inner = self.lock();
        let seq = inner.next_seq;
        inner.ends.push_back((seq, stream, end));
        self.push_locked(&mut inner, stream, line)
    }

    fn lock(&self) -> MutexGuard<'_, LogInner> {
        // The critical sections cannot panic half-way; a poisoned lock still
        // holds consistent data.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends a line, giving it the next sequence number; returns how many
    /// lines are pending. Beyond [`MAX_PENDING_LINES`] the oldest line not
    /// being shipped is dropped, and a marker line reports exactly the gap
    /// (see [`lost_marker`]). Readers of files never get there: they wait
    /// (see [`LogBuffer::wait_for_room`]).
    pub fn push(&self, stream: LogStream, line: String) -> usize {
        let mut inner = self.lock();
        self.push_locked(&mut inner, stream, line)
    }

    fn push_locked(&self, inner: &mut LogInner, stream: LogStream, line: String) -> usize {
        let seq = inner.next_seq;
        inner.next_seq += 1;
        inner.bytes += line.len();
        inner.pending.push_back(Pending::Line(LogLine {
            seq,
            stream,
            at: Utc::now(),
            line,
        }));
        inner.lines += 1;
        if inner.lines > MAX_PENDING_LINES {
            inner.lose_oldest();
            if inner.dropped == 1 || inner.dropped.is_multiple_of(10_000) {
                tracing::warn!(
                    instance_id = %self.instance_id,
                    dropped = inner.dropped,
                    "log buffer full, dropping oldest unsent lines"
                );
            }
        }
        inner.lines
    }

    /// Waits until fewer than `max_lines` lines and `max_bytes` bytes are
    /// pending (woken by every answer from the server): how a reader of
    /// output files holds back instead of dropping lines, the files being
    /// the buffer.
    pub async fn wait_for_room(&self, max_lines: usize, max_bytes: usize) {
        loop {
            let acked = self.acked.notified();
            {
                let inner = self.lock();
                if inner.lines < max_lines && inner.bytes < max_bytes {
                    return;
                }
            }
            // A missed wake-up costs at most a tick.
            let _ = tokio::time::timeout(Duration::from_millis(100), acked).await;
        }
    }

    /// Copies up to `max` of the oldest pending lines (a lost-lines marker
    /// in place of each gap).
    pub fn peek(&self, max: usize) -> Vec<LogLine> {
        let inner = self.lock();
        inner
            .pending
            .iter()
            .take(max)
            .map(Pending::to_line)
            .collect()
    }

    /// The next batch to ship: the oldest pending lines, at most
    /// `max_lines` and, past the first, at most about `max_bytes` of JSON
    /// (see [`json_size`]). Its lines stay pending, and are never dropped,
    /// until [`LogBuffer::ack`], [`LogBuffer::give_up`] or
    /// [`LogBuffer::discard`] answers it.
    pub fn peek_batch(&self, max_lines: usize, max_bytes: usize) -> Vec<LogLine> {
        let mut inner = self.lock();
        let mut out: Vec<LogLine> = Vec::new();
        let mut bytes: usize = 0;
        for entry in &inner.pending {
            if out.len() >= max_lines {
                break;
            }
            let line = entry.to_line();
            let size = json_size(&line);
            if !out.is_empty() && bytes.saturating_add(size) > max_bytes {
                break;
            }
            bytes = bytes.saturating_add(size);
            out.push(line);
        }
        inner.in_flight = out.last().map(|l| l.seq);
        out
    }

    /// Forgets every pending line up to and including `seq` (the server
    /// has them).
    pub fn ack(&self, seq: u64) {
        let mut inner = self.lock();
        inner.remove_through(seq);
        inner.in_flight = None;
        inner.passed(seq);
        self.save(&inner);
        drop(inner);
        self.acked.notify_waiters();
    }

    /// The server refused `batch` for good: its lines are lost, and one
    /// marker in their place will say how many (with the lines of any gap
    /// the batch reported, which the server did not take either). A
    /// marker refused alone is dropped with an error: the server refuses
    /// the very report.
    pub fn give_up(&self, batch: &[LogLine]) {
        let Some(last) = batch.last() else {
            return;
        };
        let mut inner = self.lock();
        inner.in_flight = None;
        let (lines, lost) = inner.remove_through(last.seq);
        inner.dropped += lines;
        if lines == 0 {
            if lost > 0 {
                tracing::error!(instance_id = %self.instance_id, lost, "server refused the marker of lost lines; their count is not in the log");
                inner.passed(last.seq);
                self.save(&inner);
            }
        } else {
            // The checkpoint stays before them until the marker is
            // shipped: an agent that restarts meanwhile reads them again.
            inner.pending.push_front(Pending::Gap {
                seq: last.seq,
                lost: lines + lost,
                at: last.at,
            });
        }
        drop(inner);
        self.acked.notify_waiters();
    }

    /// Drops every pending line (and marker): nobody will take them.
    pub fn discard(&self) {
        let mut inner = self.lock();
        inner.in_flight = None;
        if let Some(last) = inner.pending.back().map(Pending::seq) {
            let (lines, _) = inner.remove_through(last);
            inner.dropped += lines;
            inner.passed(last);
            self.save(&inner);
        }
        drop(inner);
        self.acked.notify_waiters();
    }

    /// Lines waiting to be shipped (each lost-lines marker counts as one).
    pub fn pending(&self) -> usize {
        self.lock().pending.len()
    }

    /// Lines captured so far (the next sequence number).
    pub fn captured(&self) -> u64 {
        self.lock().next_seq
    }

    /// Lines dropped (buffer full, or refused for good by the server).
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
            oom_killed: false,
            disk_exceeded: false,
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
    fn long_lines_are_split_on_character_boundaries() {
        let mut s = LineSplitter::default();
        let mut out: Vec<Vec<u8>> = Vec::new();
        let mut text = "a".repeat(MAX_LINE_BYTES - 1).into_bytes();
        text.extend_from_slice("éb\r\nc".as_bytes());
        for piece in text.chunks(1000) {
            s.feed(piece, |l| out.push(l.to_vec()));
        }
        s.finish(|l| out.push(l.to_vec()));
        assert_eq!(out.len(), 3);
        assert_eq!(out[0].len(), MAX_LINE_BYTES - 1, "é is not cut in two");
        assert_eq!(out[1], "éb".as_bytes());
        assert_eq!(out[2], b"c");
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
        // Three lines lost: a marker under the last lost line's number
        // goes first, then the oldest kept line.
        assert_eq!(b.pending(), MAX_PENDING_LINES + 1);
        assert_eq!(b.dropped(), 3);
        let head = b.peek(2);
        assert_eq!(head[0].seq, 7);
        assert_eq!(head[0].line, lost_marker(3));
        assert_eq!(head[1].seq, 8);
        b.ack(8);
        assert_eq!(b.pending(), MAX_PENDING_LINES - 1);
        assert_eq!(b.peek(1)[0].seq, 9);
    }

    /// Counts a log as the server would keep it: lines kept, and lost
    /// lines as the markers state them.
    fn kept_and_lost(log: &[LogLine]) -> (u64, u64) {
        let lost: u64 = log.iter().filter_map(|l| parse_lost_marker(&l.line)).sum();
        let markers = log
            .iter()
            .filter(|l| parse_lost_marker(&l.line).is_some())
            .count() as u64;
        (log.len() as u64 - markers, lost)
    }

    /// Lines keep arriving while batches are in flight, far over the cap:
    /// no line is both delivered and counted lost, every marker states
    /// its own gap only, and the numbering's gaps are exactly the markers'.
    #[test]
    fn every_marker_states_exactly_its_own_gap() {
        let b = LogBuffer::new(InstanceId::generate(1, 1));
        let mut server: Vec<LogLine> = Vec::new();
        let written = 3 * MAX_PENDING_LINES as u64 + 777;
        let mut next = 0u64;
        while next < written {
            let batch = b.peek_batch(SHIP_BATCH_LINES, SHIP_BATCH_BYTES);
            // A burst arrives while the batch is on its way.
            for _ in 0..(20_000.min(written - next)) {
                b.push(LogStream::Stdout, format!("{next}"));
                next += 1;
            }
            if let Some(last) = batch.last().map(|l| l.seq) {
                server.extend(batch);
                b.ack(last);
            }
        }
        loop {
            let batch = b.peek_batch(SHIP_BATCH_LINES, SHIP_BATCH_BYTES);
            let Some(last) = batch.last().map(|l| l.seq) else {
                break;
            };
            server.extend(batch);
            b.ack(last);
        }
        let (kept, lost) = kept_and_lost(&server);
        assert!(lost > 0, "the cap was reached");
        assert_eq!(kept + lost, written);
        assert_eq!(lost, b.dropped());
        // Sequence numbers are the lines' own: each marker stands right
        // after the lines it reports, under the last one's number.
        let mut expect = 0u64;
        for l in &server {
            match parse_lost_marker(&l.line) {
                Some(n) => {
                    assert_eq!(l.seq, expect + n - 1, "marker {n} at {}", l.seq);
                    expect += n;
                }
                None => {
                    assert_eq!(l.line, l.seq.to_string());
                    assert_eq!(l.seq, expect);
                    expect += 1;
                }
            }
        }
        assert_eq!(expect, written);
    }

    #[test]
    fn batches_fit_the_servers_limit_and_refused_lines_are_reported_lost() {
        let b = LogBuffer::new(InstanceId::generate(1, 1));
        for _ in 0..40 {
            b.push(LogStream::Stdout, "x".repeat(60 * 1024));
        }
        b.push(LogStream::Stdout, "\u{1}".repeat(1000));
        let mut batches = 0;
        loop {
            let batch = b.peek_batch(SHIP_BATCH_LINES, SHIP_BATCH_BYTES);
            let Some(last) = batch.last() else { break };
            let size: usize = batch.iter().map(json_size).sum();
            assert!(size <= SHIP_BATCH_BYTES, "{size}");
            let json = serde_json::to_vec(&batch).unwrap();
            assert!(json.len() <= size, "{} > {size}", json.len());
            b.ack(last.seq);
            batches += 1;
        }
        assert_eq!(batches, 5, "8 lines of 60 KiB fit 512 KiB");

        for i in 0..3 {
            b.push(LogStream::Stdout, format!("r{i}"));
        }
        let batch = b.peek_batch(2, SHIP_BATCH_BYTES);
        b.give_up(&batch);
        assert_eq!(b.dropped(), 2);
        let next = b.peek_batch(1, SHIP_BATCH_BYTES);
        assert_eq!(next[0].line, lost_marker(2));
        assert_eq!(next[0].seq, batch[1].seq);
        assert_eq!(b.peek(10)[1].line, "r2");
        // A refused batch that held a marker: its count joins the new one.
        let next = b.peek_batch(2, SHIP_BATCH_BYTES);
        b.give_up(&next);
        assert_eq!(b.dropped(), 3);
        let next = b.peek_batch(10, SHIP_BATCH_BYTES);
        assert_eq!(next.len(), 1);
        assert_eq!(next[0].line, lost_marker(3));
        // The marker refused alone is dropped, not resent forever.
        b.give_up(&next);
        assert_eq!(b.pending(), 0);
    }
}
