//! The output relay: back-pressure on a workload's output without giving up
//! what the files in [`super::state`] give (output that outlives the agent).
//!
//! A workload that wrote its output files directly could never be slowed:
//! a regular file never blocks, so a burst either filled the agent's
//! memory or was dropped. Instead each stream is a pipe, read by a small
//! process beside the workload (`flotilla agent-log-relay`, its own
//! process group, like the node lease's fence) that appends what it reads
//! to the stream's file and stops reading while the unshipped backlog (the
//! file's length minus the offset the agent's checkpoint says was shipped)
//! is over a bound. The pipe then fills and the workload's next write
//! blocks until the agent shipped enough: the workload is slowed, and
//! nothing is dropped.
//!
//! The relay does not need the agent: killed or restarted, the agent finds
//! the files and the checkpoint again, and the relay keeps the workload's
//! pipe open (a pipe to a dead reader would kill the workload with
//! SIGPIPE). It leaves when the pipe is closed (every writer is gone) and
//! everything read is in the file, or when its state directory is removed
//! (the agent released the instance). Once the workload ended (the agent
//! writes [`ENDED`]) it no longer holds back, so the agent can wait for it
//! to drain what is left in the pipe.
//!
//! It must never write anywhere but the one file it was given, and never
//! signal anything.

use std::io::{Read, Write as _};
use std::path::Path;
use std::time::Duration;

use flotilla_core::api::LogStream;

use super::state::StateDir;

/// The default bound on one stream's unshipped bytes: beyond it the relay
/// stops reading and the workload's writes block. Several shipping rounds'
/// worth (a batch is at most 512 KiB of JSON), so that a steady writer is
/// never held back by the round trip alone.
pub const MAX_BACKLOG_BYTES: u64 = 8 * 1024 * 1024;

pub use super::state::ENDED;

/// How often a relay that holds back looks at the checkpoint again.
const BACKLOG_TICK: Duration = Duration::from_millis(20);

/// Relays `input` into the file of `stream` in `dir` (see the module
/// doc), holding back while more than `max_backlog` bytes of it are
/// unshipped. Returns the bytes relayed, once `input` ended or the
/// directory was removed. Blocking.
pub fn relay(
    mut input: impl Read,
    dir: &Path,
    stream: LogStream,
    max_backlog: u64,
) -> std::io::Result<u64> {
    let state = StateDir::at(dir);
    let path = state.output(stream);
    let mut out = state.append(match stream {
        LogStream::Stdout => "stdout",
        LogStream::Stderr => "stderr",
    })?;
    let mut written = std::fs::metadata(&path)?.len();
    let mut relayed = 0u64;
    let mut shipped = 0u64;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        while written.saturating_sub(shipped) > max_backlog {
            if !dir.exists() {
                return Ok(relayed);
            }
            if dir.join(ENDED).exists() {
                break;
            }
            let c = state.checkpoint();
            shipped = match stream {
                LogStream::Stdout => c.stdout,
                LogStream::Stderr => c.stderr,
            };
            if written.saturating_sub(shipped) > max_backlog {
                std::thread::sleep(BACKLOG_TICK);
            }
        }
        let n = match input.read(&mut buf) {
            Ok(0) => return Ok(relayed),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        out.write_all(&buf[..n])?;
        written += n as u64;
        relayed += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::state::Checkpoint;
    use std::time::Instant;

    /// A writer is held back while the backlog is over the bound, goes on
    /// once the checkpoint moves, and everything arrives in order.
    #[test]
    fn holds_the_writer_back_until_the_output_is_shipped() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::at(dir.path());
        let (r, mut w) = std::io::pipe().unwrap();
        let d = dir.path().to_path_buf();
        let relay = std::thread::spawn(move || relay(r, &d, LogStream::Stdout, 1000));
        // The pipe holds 64 KiB: a writer of 1 MiB must block.
        let writer = std::thread::spawn(move || {
            let line = [b'x'; 99];
            for _ in 0..10_000 {
                w.write_all(&line).unwrap();
                w.write_all(b"\n").unwrap();
            }
        });
        let file = state.output(LogStream::Stdout);
        let size = || std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
        let deadline = Instant::now() + Duration::from_secs(30);
        while size() <= 1000 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(200));
        let held = size();
        assert!(held > 1000 && held <= 1000 + 64 * 1024, "{held}");
        assert!(!writer.is_finished(), "the writer is blocked");
        // Ship as it comes: the writer finishes, all of it in the file.
        while !relay.is_finished() && Instant::now() < deadline {
            state
                .write_checkpoint(Checkpoint {
                    next_seq: 0,
                    stdout: size(),
                    stderr: 0,
                })
                .unwrap();
            std::thread::sleep(Duration::from_millis(5));
        }
        writer.join().unwrap();
        assert_eq!(relay.join().unwrap().unwrap(), 1_000_000);
        let text = std::fs::read(&file).unwrap();
        assert_eq!(text.len(), 1_000_000);
        assert!(text
            .chunks(100)
            .all(|l| l[..99] == [b'x'; 99] && l[99] == b'\n'));
    }

    /// Once the workload ended the relay drains the pipe without holding
    /// back; a removed state directory ends it.
    #[test]
    fn drains_once_ended_and_leaves_with_its_directory() {
        let dir = tempfile::tempdir().unwrap();
        let (r, mut w) = std::io::pipe().unwrap();
        w.write_all(&[b'y'; 5000]).unwrap();
        std::fs::write(dir.path().join(ENDED), "").unwrap();
        drop(w);
        assert_eq!(
            relay(r, dir.path(), LogStream::Stderr, 10).unwrap(),
            5000,
            "not held back at 10 bytes"
        );

        let gone = dir.path().join("gone");
        std::fs::create_dir(&gone).unwrap();
        let (r, mut w) = std::io::pipe().unwrap();
        w.write_all(&[b'z'; 5000]).unwrap();
        let g = gone.clone();
        let relay = std::thread::spawn(move || relay(r, &g, LogStream::Stdout, 10));
        let deadline = Instant::now() + Duration::from_secs(30);
        while !gone.join("stdout").exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::fs::remove_dir_all(&gone).unwrap();
        assert!(relay.join().unwrap().unwrap() > 10);
    }
}
