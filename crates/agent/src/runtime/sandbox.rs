//! How the process runtime isolates a workload from the host, the agent and
//! other tenants, decided once when the agent starts ([`Isolation::probe`]).
//!
//! - **Root with bubblewrap** (a GPU server): each tenant's work runs as a
//!   user of its own, a uid taken from a reserved range ([`Users`]) with no
//!   `/etc/passwd` entry on the host, so nothing on the host is owned by it
//!   but the instance's working directory (mode 0700). `bwrap` runs as root
//!   (so it can reach working directories under the agent's private work
//!   directory, mode 0700) and builds a fresh mount, pid, IPC and UTS
//!   namespace that shows `/usr`, `/etc` (without the shadow files, with
//!   the tenant's user added to `passwd` and `group`: [`identity_files`])
//!   and the library directories read-only, a new `/proc`, a minimal `/dev`, an
//!   empty `/tmp` and the instance's own working directory, nothing else:
//!   the data directory, the credentials, the agent's token and other
//!   tenants' directories are not there. Inside, `setpriv` drops to the
//!   tenant's uid with no groups, no capabilities (bounding set included)
//!   and `no_new_privs` before the command runs. A different uid and pid
//!   namespace make other tenants' processes invisible and unsignalable,
//!   their `/proc/<pid>/environ` unreadable.
//! - **Root without bubblewrap**: refused unless the operator allowed it
//!   (`--insecure-process-runtime`): then only the per-tenant uid separates
//!   workloads (std's `CommandExt::uid`/`gid`, supplementary groups
//!   dropped), and they see the host's files and processes.
//! - **An ordinary user** (a laptop): bubblewrap in a user namespace, as the
//!   same user, with the same view; without it, plain processes of the
//!   user, which see everything the user can. The agent warns at start.
//!
//! `--die-with-parent` is deliberately not used: the sandbox must outlive
//! an agent that crashed, so that the restarted agent can adopt it instead
//! of the work dying with its bookkeeping.

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;

use flotilla_core::id::{InstanceId, TenantId};

use super::{RuntimeError, SpawnError};

/// First uid (and gid) of the range tenants' users are taken from: above
/// any distribution's ordinary and system users and the usual subordinate
/// id ranges of rootless containers, below 2^31 (some tools store uids as
/// signed 32-bit numbers).
pub const DEFAULT_UID_BASE: u32 = 2_000_000_000;
/// How many uids the range holds.
pub const DEFAULT_UID_COUNT: u32 = 1_000_000;

/// Files bound empty over their host copies: password hashes.
const HIDDEN_ETC: [&str; 4] = [
    "/etc/shadow",
    "/etc/gshadow",
    "/etc/shadow-",
    "/etc/gshadow-",
];

/// Host directories shown read-only (symlinks, as on merged-/usr systems,
/// are recreated as symlinks). Not `/opt`, `/var`, `/srv` or `/home`:
/// data directories live there.
const SYSTEM_DIRS: [&str; 8] = [
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc",
];

/// How the process runtime isolates workloads.
#[derive(Debug, Clone)]
pub enum Isolation {
    /// Root: bubblewrap as root, the command as the tenant's own uid.
    RootSandbox {
        /// The `bwrap` program.
        bwrap: PathBuf,
        /// The tenants' users.
        users: Users,
    },
    /// Root without bubblewrap, allowed explicitly: the tenant's uid only.
    UsersOnly {
        /// The tenants' users.
        users: Users,
    },
    /// An ordinary user: bubblewrap in a user namespace.
    UserSandbox {
        /// The `bwrap` program.
        bwrap: PathBuf,
    },
    /// An ordinary user without a working bubblewrap: plain processes.
    None,
}

/// What [`Isolation::probe`] needs.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// The agent's work directory (instances' directories and the runtime's
    /// state go below it).
    pub work_dir: PathBuf,
    /// Run without bubblewrap as root (only the uid separates tenants).
    pub insecure: bool,
    /// First uid of the tenants' range.
    pub uid_base: u32,
    /// Size of the range.
    pub uid_count: u32,
    /// Host paths the operator shares with every workload on this node
    /// (model weights, a scratch volume, toolkits outside `/usr`).
    pub shares: Vec<SharedPath>,
    /// Inward networks and ports workloads may reach anyway
    /// (`--allow-egress`; see [`super::network`]).
    pub allow_egress: Vec<flotilla_egress::AllowRule>,
}

/// A host path the operator exposes inside every sandbox on a node, at the
/// same path: `PATH` read-only, `PATH:rw` read-write. Every tenant's
/// workloads on the node see it, so it is for data meant to be shared
/// (weights, datasets, checkpoints of one team), never for secrets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedPath {
    /// Absolute host path, bound at the same path.
    pub path: PathBuf,
    /// Bound read-write rather than read-only.
    pub writable: bool,
}

impl std::str::FromStr for SharedPath {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (path, writable) = match s.rsplit_once(':') {
            Some((p, "rw")) => (p, true),
            Some((p, "ro")) => (p, false),
            _ => (s, false),
        };
        let path = PathBuf::from(path);
        if !path.is_absolute() {
            return Err(format!(
                "`{s}`: a shared path must be absolute (PATH or PATH:rw)"
            ));
        }
        Ok(SharedPath { path, writable })
    }
}

impl SandboxConfig {
    /// The default uid range under `work_dir`, bubblewrap required as root.
    pub fn new(work_dir: impl Into<PathBuf>) -> Self {
        Self {
            work_dir: work_dir.into(),
            insecure: false,
            uid_base: DEFAULT_UID_BASE,
            uid_count: DEFAULT_UID_COUNT,
            shares: Vec::new(),
            allow_egress: Vec::new(),
        }
    }
}

impl Isolation {
    /// Finds the strongest isolation this host allows (see the module):
    /// runs bubblewrap once to see that it works here. Blocking.
    pub fn probe(config: &SandboxConfig) -> Result<Isolation, RuntimeError> {
        let root = nix::unistd::geteuid().is_root();
        let bwrap = find_program("bwrap");
        if root {
            let users = Users::new(config)?;
            let why = match &bwrap {
                Some(bwrap) => match probe_bwrap(bwrap, Some(users.base)) {
                    Ok(()) => {
                        return Ok(Isolation::RootSandbox {
                            bwrap: bwrap.clone(),
                            users,
                        })
                    }
                    Err(why) => why,
                },
                None => "bubblewrap (`bwrap`) is not installed".to_string(),
            };
            if config.insecure {
                tracing::warn!(reason = %why, "process runtime without a sandbox (--insecure-process-runtime): workloads run as per-tenant users but see the host's files and processes");
                return Ok(Isolation::UsersOnly { users });
            }
            return Err(RuntimeError::Insecure(format!(
                "refusing to run workloads as root without a sandbox: {why}; install Debian's `bubblewrap` (and `util-linux` for setpriv), or pass --insecure-process-runtime to run them as per-tenant users without one"
            )));
        }
        let why = match bwrap.map(|b| probe_bwrap(&b, None).map(|()| b)) {
            Some(Ok(bwrap)) => {
                tracing::warn!("process runtime as an ordinary user: workloads run sandboxed by bubblewrap but as this same user: they cannot see the data directory, credentials or other instances' directories, yet share this user's uid (no per-tenant users without root)");
                return Ok(Isolation::UserSandbox { bwrap });
            }
            Some(Err(why)) => why,
            None => "bubblewrap (`bwrap`) is not installed".to_string(),
        };
        tracing::warn!(reason = %why, "process runtime WITHOUT a sandbox: workloads run as this user and can read everything it can (the data directory, the agent token, credentials, other instances' directories and environments); install bubblewrap or run the agent as root with it");
        Ok(Isolation::None)
    }

    /// A short name for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Isolation::RootSandbox { .. } => "bubblewrap, per-tenant users",
            Isolation::UsersOnly { .. } => "per-tenant users, no sandbox",
            Isolation::UserSandbox { .. } => "bubblewrap, same user",
            Isolation::None => "none",
        }
    }

    /// The tenants' users, when the agent is root.
    pub fn users(&self) -> Option<&Users> {
        match self {
            Isolation::RootSandbox { users, .. } | Isolation::UsersOnly { users } => Some(users),
            Isolation::UserSandbox { .. } | Isolation::None => None,
        }
    }

    /// Whether the workload runs in a bubblewrap sandbox.
    pub fn sandboxed(&self) -> bool {
        matches!(
            self,
            Isolation::RootSandbox { .. } | Isolation::UserSandbox { .. }
        )
    }
}

/// What `flotilla up` checks before it starts anything: that an agent
/// running as root will find a working sandbox (an ordinary user falls
/// back to weaker isolation, with a warning, so nothing is checked).
/// Looks on `PATH` only (where the operator's shell looks, unlike
/// [`Isolation::probe`]'s fallback to the system directories), then runs
/// bubblewrap once as the first tenant uid would. Returns what is wrong,
/// in words that name the fix. Blocking.
pub fn preflight_root_sandbox() -> Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let bwrap = std::env::split_paths(&path)
        .filter(|d| !d.as_os_str().is_empty())
        .map(|d| d.join("bwrap"))
        .find(|p| p.is_file())
        .ok_or_else(|| "bubblewrap (`bwrap`) is not installed (not on PATH)".to_string())?;
    probe_bwrap(&bwrap, Some(DEFAULT_UID_BASE))
}

/// `program` on the `PATH` (or the usual system directories).
pub(crate) fn find_program(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/bin".into(), "/bin".into(), "/usr/sbin".into()])
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// Runs `true` in the sandbox once (as `uid` when root).
fn probe_bwrap(bwrap: &Path, uid: Option<u32>) -> Result<(), String> {
    let dir = std::env::temp_dir();
    let mut args = bwrap_args(&dir, &dir, uid.is_none());
    if let Some(uid) = uid {
        args.extend(setpriv_args(uid));
    }
    args.push("true".into());
    let out = std::process::Command::new(bwrap)
        .args(&args)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bwrap.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "bubblewrap does not work here ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// bubblewrap's arguments up to (not including) the command: the
/// namespaces and the file system view (see the module). `root` is the
/// instance's directory, bound read-write at its own path; the command
/// starts in `workdir`. `user_ns`: create a user namespace (not root).
pub fn bwrap_args(root: &Path, workdir: &Path, user_ns: bool) -> Vec<String> {
    bwrap_args_hiding(root, workdir, user_ns, None, &[])
}

/// [`bwrap_args`], with `work_dir` (the agent's) covered by an empty
/// file system before the instance's directory is bound inside it, in case
/// it lies below a directory the sandbox shows.
pub fn bwrap_args_hiding(
    root: &Path,
    workdir: &Path,
    user_ns: bool,
    work_dir: Option<&Path>,
    shares: &[SharedPath],
) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let mut push = |items: &[&str]| a.extend(items.iter().map(|s| s.to_string()));
    if user_ns {
        push(&["--unshare-user"]);
    }
    // The network namespace is the one bubblewrap starts in: as root, the
    // workload's own (see `super::network`). A new session: no controlling
    // terminal to inject keystrokes into.
    push(&[
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--new-session",
        "--hostname",
        "flotilla",
    ]);
    for dir in SYSTEM_DIRS {
        let p = Path::new(dir);
        match fs::symlink_metadata(p) {
            Ok(m) if m.file_type().is_symlink() => {
                if let Ok(target) = fs::read_link(p) {
                    push(&["--symlink", &target.to_string_lossy(), dir]);
                }
            }
            Ok(m) if m.is_dir() => push(&["--ro-bind", dir, dir]),
            _ => {}
        }
    }
    for secret in HIDDEN_ETC {
        if Path::new(secret).exists() {
            push(&["--ro-bind", "/dev/null", secret]);
        }
    }
    push(&["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]);
    // After the empty /tmp, so a share below /tmp shows; before the agent's
    // directory is covered, so a share can never uncover it.
    for share in shares {
        // bubblewrap makes missing parents of a mount point 0700 (root's),
        // which the tenant's uid could not walk through: make them
        // traversable first. `/tmp` itself is the empty tmpfs above.
        let mut parents: Vec<&Path> = share.path.ancestors().skip(1).collect();
        parents.reverse();
        for dir in parents {
            if dir == Path::new("/") || dir == Path::new("/tmp") {
                continue;
            }
            push(&["--perms", "0755", "--dir", &dir.to_string_lossy()]);
        }
        let path = share.path.to_string_lossy();
        let bind = if share.writable {
            "--bind"
        } else {
            "--ro-bind"
        };
        push(&[bind, &path, &path]);
    }
    if let Some(work_dir) = work_dir {
        push(&["--tmpfs", &work_dir.to_string_lossy()]);
    }
    // The same for the instance's own directory: its `HOME` is its
    // working directory, and a shell looking up `$HOME/.bashrc` by its
    // absolute path must walk the parents bubblewrap made (0700 otherwise:
    // "Permission denied" at every `flotilla shell`). 0711: passable, not
    // listable.
    let mut parents: Vec<&Path> = root.ancestors().skip(1).collect();
    parents.reverse();
    for dir in parents {
        if dir == Path::new("/") || dir == Path::new("/tmp") {
            continue;
        }
        push(&["--perms", "0711", "--dir", &dir.to_string_lossy()]);
    }
    let root = root.to_string_lossy();
    let workdir = workdir.to_string_lossy();
    push(&["--bind", &root, &root, "--chdir", &workdir, "--"]);
    a
}

/// `setpriv` dropping everything but the tenant's uid, for the command line
/// inside a root sandbox.
pub fn setpriv_args(uid: u32) -> Vec<String> {
    vec![
        "setpriv".into(),
        format!("--reuid={uid}"),
        format!("--regid={uid}"),
        "--clear-groups".into(),
        "--inh-caps=-all".into(),
        "--bounding-set=-all".into(),
        "--no-new-privs".into(),
        "--".into(),
    ]
}

/// The tenants' users: uids from a reserved range, one per tenant, claimed
/// by files `users/<uid>` in the agent's work directory holding the
/// tenant's id, so that a tenant keeps its uid across restarts and two
/// agents sharing the directory never hand one uid to two tenants (a claim
/// is created exclusively).
#[derive(Debug, Clone)]
pub struct Users {
    dir: PathBuf,
    /// First uid.
    pub base: u32,
    count: u32,
}

impl Users {
    /// The users of `config`'s work directory and uid range (the same
    /// claims whichever runtime runs the tenant's work).
    pub fn new(config: &SandboxConfig) -> Result<Users, RuntimeError> {
        let dir = config.work_dir.join("users");
        create_private_dir(&dir).map_err(|source| RuntimeError::Io {
            what: format!("creating {}", dir.display()),
            source,
        })?;
        Ok(Users {
            dir,
            base: config.uid_base,
            count: config.uid_count.max(1),
        })
    }

    /// The uid of `owner` (a tenant's id, or an instance's when the tenant
    /// is not known), claiming one on first use.
    pub fn uid_of(&self, owner: &str) -> std::io::Result<u32> {
        let start = fnv1a(owner.as_bytes()) % u64::from(self.count);
        for step in 0..u64::from(self.count) {
            let uid = self.base + ((start + step) % u64::from(self.count)) as u32;
            let claim = self.dir.join(uid.to_string());
            match fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&claim)
            {
                Ok(mut f) => {
                    f.write_all(owner.as_bytes())?;
                    return Ok(uid);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    // Written right after the exclusive create: an empty
                    // claim is another agent's, being written now.
                    let mut held = fs::read_to_string(&claim)?;
                    for _ in 0..50 {
                        if !held.is_empty() {
                            break;
                        }
                        std::thread::sleep(std::time::Duration::from_millis(10));
                        held = fs::read_to_string(&claim)?;
                    }
                    if held == owner {
                        return Ok(uid);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(std::io::Error::other("the tenants' uid range is exhausted"))
    }
}

/// Who a workload runs as: its tenant, or the instance alone when the
/// server did not say.
pub fn owner_of(instance_id: &InstanceId, tenant_id: Option<&TenantId>) -> String {
    tenant_id.map_or_else(|| instance_id.to_string(), TenantId::to_string)
}

/// 64-bit FNV-1a: a stable spread of owners over the uid range (stable
/// across builds, unlike std's hasher).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The name a tenant's user goes by inside a root sandbox (unless the
/// host has a user of that name: then `flotilla-UID`).
const SANDBOX_USER: &str = "flotilla";

/// `/etc/passwd` and `/etc/group` as a root sandbox shows them: the host's
/// (`host_passwd`, `host_group`), plus a user and a group for the tenant's
/// `uid`, at home in `home`. The uid has no entry on the host (see the
/// module), and programs that look their user up refuse to run without
/// one: OpenSSH's `scp` and `sftp-server` (what `scp` and `sftp` run
/// through `flotilla ssh`), `whoami`, Python's `getpass.getuser`. Only
/// names and ids: the host's files hold no password hashes (those are in
/// the shadow files, hidden).
pub fn identity_files(
    host_passwd: &str,
    host_group: &str,
    uid: u32,
    home: &Path,
) -> (String, String) {
    let taken = |file: &str, name: &str| file.lines().any(|l| l.split(':').next() == Some(name));
    let name = if taken(host_passwd, SANDBOX_USER) || taken(host_group, SANDBOX_USER) {
        format!("{SANDBOX_USER}-{uid}")
    } else {
        SANDBOX_USER.to_string()
    };
    // A host line for the same id would be found first: leave it out.
    let keep = |file: &str| -> String {
        file.lines()
            .filter(|l| l.split(':').nth(2) != Some(uid.to_string().as_str()))
            .map(|l| format!("{l}\n"))
            .collect()
    };
    let home = home.to_string_lossy().replace([':', '\n'], "_");
    let passwd = format!(
        "{}{name}:x:{uid}:{uid}:Flotilla workload:{home}:/bin/sh\n",
        keep(host_passwd)
    );
    let group = format!("{}{name}:x:{uid}:\n", keep(host_group));
    (passwd, group)
}

/// Writes [`identity_files`] for `uid` into `dir` (the instance's state
/// directory, which the sandbox does not show) and returns bubblewrap's
/// arguments that show them as `/etc/passwd` and `/etc/group`.
pub fn identity_binds(dir: &Path, uid: u32, home: &Path) -> std::io::Result<Vec<String>> {
    let read = |p: &str| fs::read_to_string(p).unwrap_or_default();
    let (passwd, group) = identity_files(&read("/etc/passwd"), &read("/etc/group"), uid, home);
    let mut args = Vec::new();
    for (name, text) in [("passwd", passwd), ("group", group)] {
        let path = dir.join(name);
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&path)?;
        f.write_all(text.as_bytes())?;
        args.extend([
            "--ro-bind".to_string(),
            path.to_string_lossy().into_owned(),
            format!("/etc/{name}"),
        ]);
    }
    Ok(args)
}

/// Creates `dir` and its missing parents with mode 0700.
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    // An existing directory keeps the mode it had; tighten it.
    let mode = fs::metadata(dir)?.permissions().mode() & 0o777;
    if mode != 0o700 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// Prepares an instance's directory `root` (mode 0700, owned by `uid` when
/// given) and the working directory `workdir` inside it. A working
/// directory outside `root` is refused: it would expose a host path to the
/// workload.
pub fn prepare_workdir(root: &Path, workdir: &Path, uid: Option<u32>) -> Result<(), SpawnError> {
    let err = |path: &Path, source: std::io::Error| SpawnError::Workdir {
        path: path.display().to_string(),
        source,
    };
    let Ok(rel) = workdir.strip_prefix(root) else {
        return Err(err(
            workdir,
            std::io::Error::other("outside the instance's own directory"),
        ));
    };
    if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(err(
            workdir,
            std::io::Error::other("`..` is not allowed in a working directory"),
        ));
    }
    if let Some(parent) = root.parent().filter(|p| !p.is_dir()) {
        create_private_dir(parent).map_err(|e| err(parent, e))?;
    }
    let mut dir = root.to_path_buf();
    let mut parts = vec![dir.clone()];
    for part in rel.components() {
        dir.push(part);
        parts.push(dir.clone());
    }
    for dir in parts {
        match fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => {}
            Err(e) => return Err(err(&dir, e)),
        }
        // Never follow a link the workload may have planted.
        let meta = fs::symlink_metadata(&dir).map_err(|e| err(&dir, e))?;
        if !meta.is_dir() {
            return Err(err(&dir, std::io::Error::other("not a directory")));
        }
        if let Some(uid) = uid {
            std::os::unix::fs::lchown(&dir, Some(uid), Some(uid)).map_err(|e| err(&dir, e))?;
        }
    }
    Ok(())
}

/// For tests (this crate's and others'): what the sandbox needs.
#[doc(hidden)]
pub mod test_support {
    use std::sync::Once;

    /// Installs Debian's `bubblewrap` when it is missing and this runs as
    /// root (as CI does); an ordinary user without it gets the weaker
    /// isolation the runtime falls back to.
    pub fn ensure_bwrap() {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            if super::find_program("bwrap").is_some() || !nix::unistd::geteuid().is_root() {
                return;
            }
            eprintln!("installing bubblewrap for the sandbox tests");
            let install = || {
                std::process::Command::new("apt-get")
                    .args([
                        "install",
                        "-y",
                        "-qq",
                        "-o",
                        "DPkg::Lock::Timeout=300",
                        "bubblewrap",
                    ])
                    .env("DEBIAN_FRONTEND", "noninteractive")
                    .status()
                    .is_ok_and(|s| s.success())
            };
            if !install() {
                let _ = std::process::Command::new("apt-get")
                    .args(["update", "-qq"])
                    .status();
                assert!(install(), "cannot install bubblewrap with apt-get");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_keep_their_uid_and_never_share_one() {
        let dir = tempfile::tempdir().unwrap();
        let config = SandboxConfig {
            uid_count: 2,
            ..SandboxConfig::new(dir.path())
        };
        let users = Users::new(&config).unwrap();
        let a = users.uid_of("ten_a").unwrap();
        let b = users.uid_of("ten_b").unwrap();
        assert_ne!(a, b);
        assert!((DEFAULT_UID_BASE..DEFAULT_UID_BASE + 2).contains(&a));
        // Another agent on the same directory agrees.
        let again = Users::new(&config).unwrap();
        assert_eq!(again.uid_of("ten_b").unwrap(), b);
        assert_eq!(again.uid_of("ten_a").unwrap(), a);
        assert!(again.uid_of("ten_c").is_err(), "range of two is full");
        let mode = fs::metadata(dir.path().join("users"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
    }

    #[test]
    fn the_tenants_user_is_added_to_the_hosts_identity_files() {
        let home = Path::new("/w/instances/inst_1");
        let (passwd, group) = identity_files(
            "root:x:0:0:root:/root:/bin/bash\nstale:x:2000000007:1::/:/bin/sh\n",
            "root:x:0:\n",
            2_000_000_007,
            home,
        );
        assert_eq!(
            passwd,
            "root:x:0:0:root:/root:/bin/bash\nflotilla:x:2000000007:2000000007:Flotilla workload:/w/instances/inst_1:/bin/sh\n"
        );
        assert_eq!(group, "root:x:0:\nflotilla:x:2000000007:\n");
        // A host user of that name keeps it.
        let (passwd, _) =
            identity_files("flotilla:x:999:999::/:/bin/false", "", 2_000_000_001, home);
        assert!(
            passwd.contains("\nflotilla-2000000001:x:2000000001:"),
            "{passwd}"
        );
        assert!(passwd.starts_with("flotilla:x:999:"));
    }

    #[test]
    fn working_directories_stay_inside_the_instance() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("instances").join("inst_1");
        prepare_workdir(&root, &root.join("a/b"), None).unwrap();
        assert!(root.join("a/b").is_dir());
        let mode = fs::metadata(&root).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        let e = prepare_workdir(&root, Path::new("/etc"), None).unwrap_err();
        assert!(e.to_string().contains("outside"), "{e}");
        let e = prepare_workdir(&root, &root.join("../x"), None).unwrap_err();
        assert!(e.to_string().contains(".."), "{e}");
    }
}
