//! What the process runtime keeps on disk per workload so that a restarted
//! agent can take over what an earlier one started: the workload's output
//! files, which it writes to directly (a pipe to a dead agent would kill
//! it with SIGPIPE), bubblewrap's status file (its exit code, written even
//! when nobody waits for it), a record of the process (pid and start time,
//! so that a reused pid is not mistaken for it) and how far its output was
//! shipped.
//!
//! Everything lives in `<work dir>/state/<node>/<instance id>/`, mode 0700, owned
//! by the agent's user: a workload never sees it.

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use flotilla_core::api::LogStream;
use flotilla_core::id::InstanceId;
use tokio::io::AsyncReadExt;
use tokio::sync::{watch, Notify};

use super::sandbox::create_private_dir;
use super::{LineSplitter, LogBuffer, SHIP_BATCH_LINES};

/// The file in the state directory that tells the relays the workload
/// ended: they drain the pipe without holding back, and leave.
pub const ENDED: &str = "ended";

/// How often an output file is read again after its end was reached.
const TAIL_TICK: Duration = Duration::from_millis(50);

/// Lines read ahead of what the server took: the tail holds back beyond
/// them, the rest waiting in the file. A read adds at most 64 Ki lines,
/// so the buffer never reaches [`super::MAX_PENDING_LINES`] and never
/// drops a line read from a file.
pub const TAIL_MAX_PENDING_LINES: usize = 10_000;
/// Bytes of lines read ahead, likewise (lines may be 64 KiB long).
pub const TAIL_MAX_PENDING_BYTES: usize = 4 * 1024 * 1024;

/// One workload's directory of state.
#[derive(Debug, Clone)]
pub struct StateDir {
    dir: PathBuf,
}

/// The process a workload is, as recorded when it started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The leader's pid (bubblewrap, or the command).
    pub pid: u32,
    /// Its start time in clock ticks since boot (`/proc/<pid>/stat`).
    pub start_ticks: u64,
    /// The sandbox's pid namespace init, when there is one.
    pub sandbox_init: Option<u32>,
    /// When it was started.
    pub started_at: DateTime<Utc>,
}

/// How far the output was shipped: the next sequence number, and the end
/// of the last shipped line in each file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Checkpoint {
    /// The next line's sequence number.
    pub next_seq: u64,
    /// Bytes of `stdout` shipped.
    pub stdout: u64,
    /// Bytes of `stderr` shipped.
    pub stderr: u64,
}

impl StateDir {
    /// The state directory of `instance_id` under `root` (one per node:
    /// agents of several nodes may share a work directory).
    pub fn new(root: &Path, instance_id: &InstanceId) -> Self {
        Self {
            dir: root.join(instance_id.as_str()),
        }
    }

    /// The state directory at `dir` (a relay is given its path).
    pub fn at(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
        }
    }

    /// Where it is.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Records the relays of its output (see [`super::relay`]): their
    /// pids and start times, so a restarted agent waits for them too.
    pub fn write_relays(&self, relays: &[(u32, u64)]) -> std::io::Result<()> {
        let text: String = relays.iter().map(|(p, t)| format!("{p} {t}\n")).collect();
        replace(&self.path("relays"), &text)
    }

    /// The recorded relays: pid and start time of each.
    pub fn relays(&self) -> Vec<(u32, u64)> {
        let Ok(text) = fs::read_to_string(self.path("relays")) else {
            return Vec::new();
        };
        text.lines()
            .filter_map(|l| {
                let (p, t) = l.split_once(' ')?;
                Some((p.parse().ok()?, t.parse().ok()?))
            })
            .collect()
    }

    /// Tells the relays the workload ended (see [`ENDED`]).
    pub fn mark_ended(&self) {
        let _ = replace(&self.path(ENDED), "");
    }

    /// Every state directory under `root`, with its instance.
    pub fn all(root: &Path) -> Vec<(InstanceId, StateDir)> {
        let Ok(entries) = fs::read_dir(root) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let id = InstanceId::parse(&name, "instance_id").ok()?;
                Some((id, StateDir { dir: e.path() }))
            })
            .collect()
    }

    /// Creates it (mode 0700), empty.
    pub fn create(&self) -> std::io::Result<()> {
        if self.dir.exists() {
            fs::remove_dir_all(&self.dir)?;
        }
        create_private_dir(&self.dir)
    }

    /// Removes it.
    pub fn remove(&self) {
        let _ = fs::remove_dir_all(&self.dir);
    }

    /// Records the workload's disk limit, bytes, for an agent that adopts
    /// it.
    pub fn write_disk_limit(&self, bytes: u64) -> std::io::Result<()> {
        replace(&self.path("disk_limit"), &format!("{bytes}\n"))
    }

    /// The recorded disk limit, bytes.
    pub fn disk_limit(&self) -> Option<u64> {
        fs::read_to_string(self.path("disk_limit"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The file a stream is written to.
    pub fn output(&self, stream: LogStream) -> PathBuf {
        self.path(match stream {
            LogStream::Stdout => "stdout",
            LogStream::Stderr => "stderr",
        })
    }

    /// Opens a file of this directory for appending (created 0600).
    pub fn append(&self, name: &str) -> std::io::Result<fs::File> {
        fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(self.path(name))
    }

    /// The file bubblewrap writes its status to.
    pub fn status_file(&self) -> &'static str {
        "status"
    }

    /// The exit code bubblewrap recorded, once the sandbox ended.
    pub fn exit_code(&self) -> Option<i32> {
        let text = fs::read_to_string(self.path(self.status_file())).ok()?;
        text.lines().rev().find_map(|l| {
            let rest = l.trim().strip_prefix("{ \"exit-code\":")?;
            rest.trim().strip_suffix('}')?.trim().parse().ok()
        })
    }

    /// The host pid of the sandbox's pid namespace init, as bubblewrap
    /// recorded it when it started the sandbox.
    pub fn sandbox_init(&self) -> Option<u32> {
        let text = fs::read_to_string(self.path(self.status_file())).ok()?;
        text.lines().find_map(|l| {
            let rest = l.trim().strip_prefix("{ \"child-pid\":")?;
            rest.split([',', '}']).next()?.trim().parse().ok()
        })
    }

    /// When the status file was last written (the sandbox's end, once it
    /// ended).
    pub fn status_written(&self) -> Option<DateTime<Utc>> {
        let modified = fs::metadata(self.path(self.status_file()))
            .ok()?
            .modified()
            .ok()?;
        Some(DateTime::<Utc>::from(modified))
    }

    /// Records the process.
    pub fn write_record(&self, r: &Record) -> std::io::Result<()> {
        let text = format!(
            "{} {} {} {}\n",
            r.pid,
            r.start_ticks,
            r.sandbox_init.unwrap_or(0),
            r.started_at.timestamp_millis()
        );
        replace(&self.path("process"), &text)
    }

    /// The recorded process.
    pub fn record(&self) -> Option<Record> {
        let text = fs::read_to_string(self.path("process")).ok()?;
        let mut f = text.split_whitespace().map(str::parse::<i64>);
        let pid = u32::try_from(f.next()?.ok()?).ok()?;
        let start_ticks = u64::try_from(f.next()?.ok()?).ok()?;
        let init = u32::try_from(f.next()?.ok()?).ok()?;
        let started_at = Utc.timestamp_millis_opt(f.next()?.ok()?).single()?;
        Some(Record {
            pid,
            start_ticks,
            sandbox_init: (init > 0).then_some(init),
            started_at,
        })
    }

    /// Records how far the output was shipped.
    pub fn write_checkpoint(&self, c: Checkpoint) -> std::io::Result<()> {
        replace(
            &self.path("shipped"),
            &format!("{} {} {}\n", c.next_seq, c.stdout, c.stderr),
        )
    }

    /// How far the output was shipped (nothing, when never recorded).
    pub fn checkpoint(&self) -> Checkpoint {
        let Ok(text) = fs::read_to_string(self.path("shipped")) else {
            return Checkpoint::default();
        };
        let v: Vec<u64> = text
            .split_whitespace()
            .filter_map(|s| s.parse().ok())
            .collect();
        match v[..] {
            [next_seq, stdout, stderr] => Checkpoint {
                next_seq,
                stdout,
                stderr,
            },
            _ => Checkpoint::default(),
        }
    }
}

/// Replaces `path` with `text` atomically (a rename), mode 0600.
fn replace(path: &Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(text.as_bytes())?;
    }
    fs::rename(&tmp, path)
}

/// The start time of `pid` in clock ticks since boot, while it runs (a
/// zombie has ended).
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields are counted
    // after its closing parenthesis (state is field 3, start time 22).
    let rest = stat.rsplit_once(')')?.1;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// Whether the recorded process still runs (the same one: a reused pid has
/// another start time).
pub fn alive(r: &Record) -> bool {
    start_ticks(r.pid) == Some(r.start_ticks)
}

/// Reads the output file of `stream` from `offset` into `logs` as lines,
/// until `done` turns true and the end of the file is reached; records for
/// each line where it ended (see [`LogBuffer::push_at`]).
pub async fn tail(
    path: PathBuf,
    stream: LogStream,
    offset: u64,
    logs: Arc<LogBuffer>,
    wake: Arc<Notify>,
    mut done: watch::Receiver<bool>,
) {
    use tokio::io::AsyncSeekExt;
    let mut file = match tokio::fs::File::open(&path).await {
        Ok(f) => f,
        Err(error) => {
            tracing::warn!(path = %path.display(), %error, "cannot read workload output");
            return;
        }
    };
    if offset > 0 {
        if let Err(error) = file.seek(std::io::SeekFrom::Start(offset)).await {
            tracing::warn!(path = %path.display(), %error, "cannot seek in workload output");
            return;
        }
    }
    let mut lines = LineSplitter::default();
    let mut pos = offset;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // The file is the buffer: while enough is pending, wait for the
        // server to take some rather than read on and drop lines.
        logs.wait_for_room(TAIL_MAX_PENDING_LINES, TAIL_MAX_PENDING_BYTES)
            .await;
        // Seen before the read: a read that then finds the end has all
        // the output there will be.
        let finished = *done.borrow();
        let n = match file.read(&mut buf).await {
            Ok(n) => n,
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "cannot read workload output");
                break;
            }
        };
        if n == 0 {
            if finished {
                break;
            }
            tokio::select! {
                () = tokio::time::sleep(TAIL_TICK) => {}
                _ = done.changed() => {}
            }
            continue;
        }
        let mut consumed = 0;
        let start = pos;
        lines.feed_at(&buf[..n], |line, end| {
            consumed = end;
            let pending = logs.push_at(
                stream,
                String::from_utf8_lossy(line).into_owned(),
                start + end as u64,
            );
            if pending >= SHIP_BATCH_LINES {
                wake.notify_one();
            }
        });
        let _ = consumed;
        pos += n as u64;
    }
    lines.finish(|line| {
        logs.push_at(stream, String::from_utf8_lossy(line).into_owned(), pos);
    });
    wake.notify_one();
}
