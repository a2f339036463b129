//! What `flotilla up` (and `flotilla agent`) need from the machine, checked
//! before anything starts: before the server binds, before "flotilla is
//! up" is printed. One failure, one message naming what to install.
//!
//! The binary never installs packages itself: `./flotilla` (the checkout's
//! script, through `scripts/prerequisites`) does, as root with apt-get.

use anyhow::{bail, Result};

/// Refuses to start when the local node could not run workloads: as root
/// with the process runtime, bubblewrap must be on `PATH` and work here
/// (unless `--insecure-process-runtime`). Blocking (runs bubblewrap once).
pub fn check(
    runtime: flotilla_agent::runtime::RuntimeKind,
    insecure_process_runtime: bool,
) -> Result<()> {
    if runtime != flotilla_agent::runtime::RuntimeKind::Process || insecure_process_runtime {
        return Ok(());
    }
    if let Err(why) = flotilla_agent::runtime::sandbox::preflight_root_sandbox() {
        bail!(
            "cannot run workloads as root: {why}. Install bubblewrap (Debian/Ubuntu: \
             `apt-get install bubblewrap util-linux`; Fedora: `dnf install bubblewrap`), \
             or start from a checkout with `./flotilla up`, which installs it; \
             or pass --insecure-process-runtime to run workloads without a sandbox"
        );
    }
    Ok(())
}
