//! Process supervision: spawns an instance's command in its own process
//! group with the GPU selection in its environment, captures stdout and
//! stderr line by line into a per-instance log buffer, stops the whole
//! group (SIGTERM, grace, SIGKILL) and reports how it exited.
//!
//! This module must never talk to the server, never run a command through a
//! shell, and never signal anything but the process groups it created. A
//! process is spawned once per [`spawn`] call; whether an instance may be
//! (re)started is the caller's decision.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, Utc};
use flotilla_core::api::{GpuSlice, LogLine, LogStream};
use flotilla_core::catalog::Vendor;
use flotilla_core::id::InstanceId;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::sync::{mpsc, watch, Notify};
use tokio::time::Instant;

/// Longest line kept, in bytes; the rest of a longer line is dropped.
pub const MAX_LINE_BYTES: usize = 64 * 1024;
/// Most unsent lines kept per instance; older ones are dropped first.
pub const MAX_PENDING_LINES: usize = 100_000;
/// Pending lines that wake the log shipper before its next tick.
pub const SHIP_BATCH_LINES: usize = 500;
/// How long to wait for the pipes to close after the process group ended.
const PIPE_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// What to run for one instance.
#[derive(Debug, Clone)]
pub struct SpawnSpec {
    /// The instance.
    pub instance_id: InstanceId,
    /// Program and arguments (no shell).
    pub command: Vec<String>,
    /// Extra environment, on top of the agent's own.
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
    /// A stop had been requested through [`Process::stop`] before it ended.
    pub stop_requested: bool,
}

/// A supervised process. Cheap to clone; every clone controls the same
/// process. Dropping all clones does not stop it.
#[derive(Debug, Clone)]
pub struct Process {
    pid: u32,
    started_at: DateTime<Utc>,
    stop_tx: mpsc::UnboundedSender<Duration>,
    exit_rx: watch::Receiver<Option<Exit>>,
    logs: Arc<LogBuffer>,
}

impl Process {
    /// Process id of the leader (also the process group id).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// When it was spawned.
    pub fn started_at(&self) -> DateTime<Utc> {
        self.started_at
    }

    /// Asks for the process group to stop: SIGTERM now, SIGKILL after
    /// `grace` if the leader still runs. A later call may shorten the grace.
    /// Returns at once.
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

/// Variables of the agent's own environment a workload may see: enough to
/// find programs and pick a locale, nothing that could carry a credential.
const INHERITED_ENV: [&str; 5] = ["PATH", "LANG", "LC_ALL", "TZ", "USER"];

/// The base environment of a workload: the allow-listed variables of the
/// agent's environment, and `HOME` set to the instance's working directory.
fn base_env(workdir: &std::path::Path) -> Vec<(String, std::ffi::OsString)> {
    let mut env: Vec<(String, std::ffi::OsString)> = INHERITED_ENV
        .iter()
        .filter_map(|k| std::env::var_os(k).map(|v| (k.to_string(), v)))
        .collect();
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push(("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into()));
    }
    env.push(("HOME".into(), workdir.as_os_str().to_owned()));
    env
}

/// Spawns `spec` in its own process group and starts supervising it.
/// Must be called inside a tokio runtime.
pub fn spawn(spec: &SpawnSpec, wakers: Wakers) -> Result<Process, SpawnError> {
    let (program, args) = spec.command.split_first().ok_or(SpawnError::EmptyCommand)?;
    std::fs::create_dir_all(&spec.workdir).map_err(|source| SpawnError::Workdir {
        path: spec.workdir.display().to_string(),
        source,
    })?;
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        // A workload must not inherit the agent's environment: it may hold
        // the agent token or an operator's API key. It gets a minimal base,
        // its own variables, then the device variables.
        .env_clear()
        .envs(base_env(&spec.workdir))
        .envs(&spec.env)
        .envs(device_env(
            &spec.instance_id,
            &spec.gpu_indices,
            &spec.gpu_uuids,
            &spec.vendors,
            &spec.gpu_slices,
        ))
        .current_dir(&spec.workdir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(false);
    let mut child = cmd.spawn().map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => SpawnError::NoSuchProgram(program.clone()),
        std::io::ErrorKind::PermissionDenied => SpawnError::NotExecutable {
            program: program.clone(),
            source,
        },
        _ => SpawnError::Os {
            program: program.clone(),
            source,
        },
    })?;
    let started_at = Utc::now();
    let logs = Arc::new(LogBuffer::new(spec.instance_id.clone()));
    let mut pumps = Vec::with_capacity(2);
    if let Some(out) = child.stdout.take() {
        pumps.push(tokio::spawn(pump(
            out,
            LogStream::Stdout,
            logs.clone(),
            wakers.logs.clone(),
        )));
    }
    if let Some(err) = child.stderr.take() {
        pumps.push(tokio::spawn(pump(
            err,
            LogStream::Stderr,
            logs.clone(),
            wakers.logs.clone(),
        )));
    }
    let (stop_tx, stop_rx) = mpsc::unbounded_channel();
    let (exit_tx, exit_rx) = watch::channel(None);
    // The leader has not been reaped yet, so its pid is known; 0 would only
    // come from a platform without pids and is never signalled.
    let pid = child.id().unwrap_or(0);
    tracing::info!(instance_id = %spec.instance_id, pid, program = %program, "process started");
    tokio::spawn(supervise(Supervised {
        instance_id: spec.instance_id.clone(),
        child,
        pid,
        stop_rx,
        exit_tx,
        pumps,
        wakers,
    }));
    Ok(Process {
        pid,
        started_at,
        stop_tx,
        exit_rx,
        logs,
    })
}

struct Supervised {
    instance_id: InstanceId,
    child: tokio::process::Child,
    pid: u32,
    stop_rx: mpsc::UnboundedReceiver<Duration>,
    exit_tx: watch::Sender<Option<Exit>>,
    pumps: Vec<tokio::task::JoinHandle<()>>,
    wakers: Wakers,
}

/// Waits for the leader, applying stop requests; then kills what is left of
/// the group, waits for the pipes to drain and publishes the exit.
async fn supervise(mut s: Supervised) {
    let mut stop_requested = false;
    let mut kill_at: Option<Instant> = None;
    let mut stops_open = true;
    let status = loop {
        tokio::select! {
            status = s.child.wait() => break status,
            grace = s.stop_rx.recv(), if stops_open => match grace {
                Some(grace) => {
                    if !stop_requested {
                        stop_requested = true;
                        tracing::info!(instance_id = %s.instance_id, pid = s.pid, grace_ms = grace.as_millis() as u64, "stopping process group");
                        signal_group(s.pid, Signal::SIGTERM);
                    }
                    let deadline = Instant::now() + grace;
                    kill_at = Some(kill_at.map_or(deadline, |k| k.min(deadline)));
                }
                None => stops_open = false,
            },
            () = sleep_until_opt(kill_at) => {
                tracing::warn!(instance_id = %s.instance_id, pid = s.pid, "grace period over, killing process group");
                signal_group(s.pid, Signal::SIGKILL);
                kill_at = None;
            }
        }
    };
    let at = Utc::now();
    // The instance is over when its leader is: whatever it left behind in
    // its group would keep holding GPUs that are about to be handed out.
    signal_group(s.pid, Signal::SIGKILL);
    let code = match status {
        Ok(status) => exit_code(status),
        Err(error) => {
            tracing::error!(instance_id = %s.instance_id, %error, "cannot wait for process");
            -1
        }
    };
    let drain = async {
        for pump in &mut s.pumps {
            let _ = pump.await;
        }
    };
    if tokio::time::timeout(PIPE_DRAIN_TIMEOUT, drain)
        .await
        .is_err()
    {
        tracing::warn!(instance_id = %s.instance_id, "output pipes still open after the process group ended, closing them");
        for pump in &s.pumps {
            pump.abort();
        }
    }
    tracing::info!(instance_id = %s.instance_id, pid = s.pid, code, stopped = stop_requested, "process exited");
    s.exit_tx.send_replace(Some(Exit {
        code,
        at,
        stop_requested,
    }));
    s.wakers.logs.notify_one();
    s.wakers.changed.notify_one();
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Signals process group `pgid`; a group that is already gone is fine.
fn signal_group(pgid: u32, signal: Signal) {
    let Ok(raw) = i32::try_from(pgid) else {
        return;
    };
    // Never signal group 0 (our own) or below: that would hit the agent.
    if raw <= 1 {
        return;
    }
    match killpg(Pid::from_raw(raw), signal) {
        Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
        Err(error) => tracing::warn!(pgid, ?signal, %error, "cannot signal process group"),
    }
}

/// Exit status as reported: the code, or 128 + the signal that ended it.
pub fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => -1,
    }
}

/// Reads `reader` line by line into `logs` until end of file.
async fn pump<R: AsyncRead + Unpin>(
    reader: R,
    stream: LogStream,
    logs: Arc<LogBuffer>,
    wake: Arc<Notify>,
) {
    let mut reader = BufReader::with_capacity(16 * 1024, reader);
    let mut line: Vec<u8> = Vec::new();
    let mut truncated = false;
    loop {
        let buf = match reader.fill_buf().await {
            Ok(buf) => buf,
            Err(error) => {
                tracing::warn!(instance_id = %logs.instance_id, ?stream, %error, "cannot read process output");
                break;
            }
        };
        if buf.is_empty() {
            if !line.is_empty() || truncated {
                emit(&logs, &wake, stream, &line);
            }
            break;
        }
        let (chunk, consumed, end_of_line) = match buf.iter().position(|b| *b == b'\n') {
            Some(i) => (&buf[..i], i + 1, true),
            None => (buf, buf.len(), false),
        };
        let room = MAX_LINE_BYTES.saturating_sub(line.len());
        if chunk.len() > room {
            truncated = true;
        }
        line.extend_from_slice(&chunk[..chunk.len().min(room)]);
        reader.consume(consumed);
        if end_of_line {
            emit(&logs, &wake, stream, &line);
            line.clear();
            truncated = false;
        }
    }
}

fn emit(logs: &LogBuffer, wake: &Notify, stream: LogStream, raw: &[u8]) {
    let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
    let pending = logs.push(stream, String::from_utf8_lossy(raw).into_owned());
    if pending >= SHIP_BATCH_LINES {
        wake.notify_one();
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

    fn spec(dir: &std::path::Path, command: &[&str]) -> SpawnSpec {
        SpawnSpec {
            instance_id: InstanceId::generate(1, 42),
            command: command.iter().map(|s| s.to_string()).collect(),
            env: BTreeMap::from([("GREETING".to_string(), "hello".to_string())]),
            workdir: dir.join("instances").join("one"),
            gpu_indices: vec![1, 3],
            gpu_uuids: vec!["GPU-a".into(), "GPU-b".into()],
            vendors: vec![Vendor::Nvidia, Vendor::Nvidia],
            gpu_slices: Vec::new(),
        }
    }

    /// Gone means no such process, or a zombie nobody reaped yet.
    fn process_gone(pid: u32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => true,
            Ok(stat) => stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state == "Z" || state == "X"),
        }
    }

    async fn eventually_gone(pid: u32) -> bool {
        for _ in 0..100 {
            if process_gone(pid) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    async fn first_line(logs: &LogBuffer) -> LogLine {
        for _ in 0..250 {
            if let Some(line) = logs.peek(1).pop() {
                return line;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("no output");
    }

    #[tokio::test]
    async fn exit_code_env_and_both_streams_are_captured() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(
            dir.path(),
            &[
                "sh",
                "-c",
                "echo $CUDA_VISIBLE_DEVICES; echo err >&2; sleep 0.05; echo \"$GREETING $FLOTILLA_GPU_UUIDS $NVIDIA_VISIBLE_DEVICES ${ROCR_VISIBLE_DEVICES-unset}\"; pwd; exit 3",
            ],
        );
        let p = spawn(&s, Wakers::default()).unwrap();
        assert!(p.pid() > 1);
        let exit = p.wait().await;
        assert_eq!(exit.code, 3);
        assert!(!exit.stop_requested);
        let lines = p.logs().peek(100);
        let seqs: Vec<u64> = lines.iter().map(|l| l.seq).collect();
        assert_eq!(seqs, vec![0, 1, 2, 3]);
        let mut out: Vec<(&str, LogStream)> =
            lines.iter().map(|l| (l.line.as_str(), l.stream)).collect();
        // The two pipes race; only the order within each stream is fixed.
        out.sort_by_key(|(_, s)| *s == LogStream::Stderr);
        let workdir = s.workdir.canonicalize().unwrap();
        assert_eq!(
            out,
            vec![
                ("1,3", LogStream::Stdout),
                ("hello GPU-a,GPU-b 1,3 unset", LogStream::Stdout),
                (workdir.to_str().unwrap(), LogStream::Stdout),
                ("err", LogStream::Stderr),
            ]
        );
        assert_eq!(p.exit(), Some(exit));
    }

    /// cargo sets CARGO_MANIFEST_DIR in the test's own environment: a
    /// stand-in for the agent token or an operator key that the agent's
    /// environment may hold and a workload must never see.
    #[tokio::test]
    async fn workloads_do_not_inherit_the_agents_environment() {
        assert!(std::env::var_os("CARGO_MANIFEST_DIR").is_some());
        let dir = tempfile::tempdir().unwrap();
        let s = spec(
            dir.path(),
            &["sh", "-c", "echo \"${CARGO_MANIFEST_DIR-absent} $HOME\"; command -v sh >/dev/null && echo path-ok"],
        );
        let p = spawn(&s, Wakers::default()).unwrap();
        assert_eq!(p.wait().await.code, 0);
        let lines: Vec<String> = p.logs().peek(10).into_iter().map(|l| l.line).collect();
        assert_eq!(
            lines,
            vec![
                format!("absent {}", s.workdir.display()),
                "path-ok".to_string()
            ]
        );
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

    #[tokio::test]
    async fn stop_terminates_the_whole_process_group() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(dir.path(), &["sh", "-c", "sleep 100 & echo $!; sleep 100"]);
        let p = spawn(&s, Wakers::default()).unwrap();
        let background: u32 = first_line(p.logs()).await.line.parse().unwrap();
        assert!(!process_gone(background));
        p.stop(Duration::from_secs(5));
        let exit = tokio::time::timeout(Duration::from_secs(10), p.wait())
            .await
            .unwrap();
        assert_eq!(exit.code, 128 + 15, "ended by SIGTERM");
        assert!(exit.stop_requested);
        assert!(eventually_gone(p.pid()).await, "leader gone");
        assert!(eventually_gone(background).await, "background child gone");
    }

    #[tokio::test]
    async fn stop_kills_after_the_grace_when_term_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        // An ignored signal stays ignored across exec, so both shells and
        // the sleep ignore SIGTERM.
        let s = spec(
            dir.path(),
            &["sh", "-c", "trap '' TERM; sleep 100 & echo $!; wait"],
        );
        let p = spawn(&s, Wakers::default()).unwrap();
        let background: u32 = first_line(p.logs()).await.line.parse().unwrap();
        let t0 = Instant::now();
        p.stop(Duration::from_millis(300));
        let exit = tokio::time::timeout(Duration::from_secs(10), p.wait())
            .await
            .unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(250));
        assert_eq!(exit.code, 128 + 9, "ended by SIGKILL");
        assert!(eventually_gone(background).await, "background child gone");
    }

    #[tokio::test]
    async fn leftovers_in_the_group_die_with_the_leader() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(
            dir.path(),
            &["sh", "-c", "sleep 100 >/dev/null 2>&1 & echo $!; exit 0"],
        );
        let p = spawn(&s, Wakers::default()).unwrap();
        let exit = tokio::time::timeout(Duration::from_secs(10), p.wait())
            .await
            .unwrap();
        assert_eq!(exit.code, 0);
        let background: u32 = p.logs().peek(1)[0].line.parse().unwrap();
        assert!(eventually_gone(background).await);
    }

    #[tokio::test]
    async fn missing_program_fails_to_start() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(dir.path(), &["flotilla-no-such-program-xyz", "--flag"]);
        let e = spawn(&s, Wakers::default()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "no such program `flotilla-no-such-program-xyz`"
        );
        let e = spawn(&spec(dir.path(), &[]), Wakers::default()).unwrap_err();
        assert_eq!(e.to_string(), "empty command");
    }

    #[tokio::test]
    async fn long_lines_are_capped_and_partial_last_lines_kept() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(
            dir.path(),
            &[
                "sh",
                "-c",
                "head -c 200000 /dev/zero | tr '\\0' a; echo; printf 'caf\\303\\251\\r\\n\\377x\\nlast'",
            ],
        );
        let p = spawn(&s, Wakers::default()).unwrap();
        p.wait().await;
        let lines = p.logs().peek(10);
        let text: Vec<&str> = lines.iter().map(|l| l.line.as_str()).collect();
        assert_eq!(text.len(), 4, "{:?}", &text[1..]);
        assert_eq!(text[0].len(), MAX_LINE_BYTES);
        assert_eq!(&text[1..], &["café", "\u{fffd}x", "last"]);
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
