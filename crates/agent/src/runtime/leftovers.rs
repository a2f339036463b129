//! Ended instances leave nothing behind: once the agent is done with an
//! instance (its exit reported after all its output was shipped, and the
//! server no longer lists it), its directory `<work dir>/instances/<id>`
//! goes, with whatever the workload wrote there. A tenant's files must
//! not outlive the rental on a node the next tenant uses, nor fill its
//! disk.
//!
//! For debugging, an operator may keep them a while (`flotilla agent
//! --keep-workdirs 1h`): the directory's modification time is set to the
//! release, and a sweep removes every directory released longer ago than
//! that (after the wait, and whenever the agent starts). A directory the
//! state of any node's runtime still names belongs to a live workload
//! (agents of several nodes may share a work directory) and is never
//! swept.
//!
//! Removal never follows a link the workload planted (`remove_dir_all`
//! opens each directory without following links).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, SystemTime};

use flotilla_core::id::InstanceId;

/// The longest an operator may keep ended instances' directories: the
/// retention is for debugging, not storage.
pub const MAX_KEEP: Duration = Duration::from_secs(7 * 24 * 3600);

/// Parses a retention such as `90s`, `30m`, `1h` or `2d` (at most
/// [`MAX_KEEP`]).
pub fn parse_keep(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("`{s}`: expected a number and a unit, e.g. `1h`"))?;
    let unit_s = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("`{s}`: the unit must be s, m, h or d")),
    };
    let keep = Duration::from_secs(n.saturating_mul(unit_s));
    if keep > MAX_KEEP {
        return Err(format!("`{s}`: at most 7d"));
    }
    Ok(keep)
}

/// The agent is done with `id`: removes its directory under `instances`
/// now, or, with `keep`, marks it released and sweeps it once `keep`
/// passed. `state_roots` is the directory holding every node's state
/// (`<work dir>/state`).
pub fn release(instances: &Path, state_roots: &Path, id: &InstanceId, keep: Option<Duration>) {
    let dir = instances.join(id.as_str());
    match keep {
        None => remove(&dir),
        Some(keep) => {
            if let Err(error) =
                std::fs::File::open(&dir).and_then(|f| f.set_modified(SystemTime::now()))
            {
                tracing::debug!(dir = %dir.display(), %error, "cannot mark the directory released");
            }
            tracing::info!(instance_id = %id, keep_s = keep.as_secs(), "keeping the ended instance's directory");
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                let (instances, state_roots) = (instances.to_path_buf(), state_roots.to_path_buf());
                handle.spawn(async move {
                    tokio::time::sleep(keep).await;
                    let _ = tokio::task::spawn_blocking(move || {
                        sweep(&instances, &state_roots, keep, SystemTime::now())
                    })
                    .await;
                });
            }
        }
    }
}

/// Removes every instance directory under `instances` that no node's
/// state names and that was last modified (released) `keep` or longer
/// before `now`. Returns how many it removed.
pub fn sweep(instances: &Path, state_roots: &Path, keep: Duration, now: SystemTime) -> usize {
    let Ok(entries) = std::fs::read_dir(instances) else {
        return 0;
    };
    let nodes: Vec<_> = std::fs::read_dir(state_roots)
        .map(|e| e.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(id) = name.to_str() else { continue };
        if InstanceId::parse(id, "instance_id").is_err() {
            continue;
        }
        if nodes.iter().any(|n| n.join(id).exists()) {
            continue;
        }
        let released = entry.metadata().and_then(|m| m.modified());
        let due = released.is_ok_and(|at| now.duration_since(at).is_ok_and(|age| age >= keep));
        if due {
            remove(&entry.path());
            removed += 1;
        }
    }
    removed
}

/// Removes `dir` and everything in it; a workload that took the write
/// permission off its own directories does not stop it.
fn remove(dir: &Path) {
    let first = match std::fs::remove_dir_all(dir) {
        Ok(()) => return,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
        Err(e) => e,
    };
    open_up(dir);
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(error) => {
            tracing::warn!(dir = %dir.display(), %error, %first, "cannot remove an ended instance's directory")
        }
    }
}

/// Gives the owner full access to `dir` and every directory below it,
/// never following a link.
fn open_up(dir: &Path) {
    let Ok(meta) = std::fs::symlink_metadata(dir) else {
        return;
    };
    if !meta.is_dir() {
        return;
    }
    let mode = meta.permissions().mode() | 0o700;
    let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode));
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            open_up(&entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let instances = dir.path().join("instances");
        let state = dir.path().join("state");
        std::fs::create_dir_all(&instances).unwrap();
        std::fs::create_dir_all(state.join("node-a")).unwrap();
        (dir, instances, state)
    }

    fn workdir(instances: &Path, id: &InstanceId) -> std::path::PathBuf {
        let d = instances.join(id.as_str());
        std::fs::create_dir_all(d.join("out/locked")).unwrap();
        std::fs::write(d.join("out/locked/model.bin"), b"weights").unwrap();
        // The workload took its own permissions away.
        std::fs::set_permissions(d.join("out"), std::fs::Permissions::from_mode(0o500)).unwrap();
        d
    }

    #[test]
    fn retentions_parse_with_their_unit_and_a_limit() {
        assert_eq!(parse_keep("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_keep("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_keep("7d"), Ok(MAX_KEEP));
        assert!(parse_keep("8d").unwrap_err().contains("at most 7d"));
        assert!(parse_keep("1").unwrap_err().contains("unit"));
        assert!(parse_keep("h").unwrap_err().contains("number"));
    }

    #[test]
    fn a_released_directory_goes_at_once_with_everything_in_it() {
        let (_t, instances, state) = setup();
        let id = InstanceId::generate(1, 1);
        let d = workdir(&instances, &id);
        assert!(d.join("out/locked/model.bin").exists());
        release(&instances, &state, &id, None);
        assert!(!d.exists());
    }

    #[test]
    fn a_kept_directory_goes_once_its_time_passed_and_a_live_one_never() {
        let (_t, instances, state) = setup();
        let (ended, live) = (InstanceId::generate(1, 1), InstanceId::generate(1, 2));
        let (e, l) = (workdir(&instances, &ended), workdir(&instances, &live));
        std::fs::create_dir_all(state.join("node-a").join(live.as_str())).unwrap();
        let keep = Duration::from_secs(3600);
        release(&instances, &state, &ended, Some(keep));
        let now = SystemTime::now();
        assert_eq!(sweep(&instances, &state, keep, now), 0, "kept an hour");
        assert!(e.exists());
        let later = now + keep + Duration::from_secs(1);
        assert_eq!(sweep(&instances, &state, keep, later), 1);
        assert!(!e.exists(), "gone after the hour");
        assert!(l.exists(), "a live workload's directory stays");
    }
}
