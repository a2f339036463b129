//! The process runtime: runs an instance's command as a process in its own
//! process group with the GPU selection in its environment, captures
//! stdout and stderr line by line into the instance's log buffer, stops the
//! whole group (SIGTERM, grace, SIGKILL) and reports how it exited.
//!
//! It must never signal anything but the process groups it created. A
//! process is spawned once per [`spawn`] call.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use flotilla_core::api::LogStream;
use flotilla_core::id::InstanceId;
use futures::future::BoxFuture;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::sync::watch;
use tokio::time::Instant;

use super::cgroup::{self, InstanceCgroup};
use super::limits::{disk_usage, Enforcement, DISK_CHECK};
use super::network::{Namespaces, Network};
use super::sandbox::{
    bwrap_args_hiding, create_private_dir, identity_binds, owner_of, prepare_workdir, setpriv_args,
    Isolation, SandboxConfig, SharedPath,
};
use super::state::{alive, start_ticks, tail, Checkpoint, Record, StateDir};
use super::{
    device_env, exit_code, Control, Exit, LogBuffer, Runtime, RuntimeError, RuntimeKind,
    SpawnError, SpawnSpec, Wakers, Workload,
};

/// How long reading a workload's output files may make no progress after
/// the workload ended (the server taking no lines) before the rest is
/// given up and the exit reported.
const STALLED_OUTPUT: Duration = Duration::from_secs(60);

/// How long the output relays may go on after the process group ended
/// (draining the pipes takes milliseconds).
const PIPE_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs workloads as processes of this host, isolated as well as the host
/// allows (see [`Isolation`]).
#[derive(Debug)]
pub struct ProcessRuntime {
    work_dir: PathBuf,
    /// Where the workloads' state is kept: one directory per node, so that
    /// an agent adopts only its own node's work.
    state_root: PathBuf,
    isolation: Isolation,
    /// Host paths shown inside every sandbox.
    shares: Vec<SharedPath>,
    /// How workloads are connected (a namespace each, as root).
    network: Network,
    /// The limits workloads are held to; `None`: none.
    limits: Option<Enforcement>,
    /// The program whose `agent-log-relay` subcommand relays a workload's
    /// output (see [`super::relay`]); `None`: the workload writes its
    /// output files itself, and is never slowed.
    relay: Option<PathBuf>,
    /// How long an ended instance's directory is kept for debugging;
    /// `None`: removed once its output was shipped.
    keep_workdirs: Option<Duration>,
    /// The operator's `--allow-egress` rules, as reported.
    allow_egress: Vec<flotilla_egress::AllowRule>,
}

impl ProcessRuntime {
    /// A process runtime with the strongest isolation this host allows
    /// (runs bubblewrap once to find out). Refuses to run as root without
    /// a sandbox unless `config.insecure`. Blocking.
    pub fn new(config: &SandboxConfig) -> Result<Self, RuntimeError> {
        create_private_dir(&config.work_dir).map_err(|source| RuntimeError::Io {
            what: format!("creating {}", config.work_dir.display()),
            source,
        })?;
        let isolation = Isolation::probe(config)?;
        if let Isolation::UsersOnly { .. } = isolation {
            // Without a sandbox the tenants' uids must reach their own
            // directories: traversable, not listable.
            use std::os::unix::fs::PermissionsExt;
            let instances = config.work_dir.join("instances");
            let traversable = |dir: &Path| {
                std::fs::create_dir_all(dir)?;
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
            };
            for dir in [config.work_dir.as_path(), instances.as_path()] {
                traversable(dir).map_err(|source| RuntimeError::Io {
                    what: format!("making {} traversable", dir.display()),
                    source,
                })?;
            }
        }
        let network = match isolation {
            Isolation::RootSandbox { .. } => Network::probe(config.allow_egress.clone()),
            _ => Network::Shared {
                why: "a namespace per workload needs root and bubblewrap".into(),
            },
        };
        if let Network::Shared { why } = &network {
            tracing::warn!(reason = %why, "process runtime: the network is NOT isolated; workloads reach the host's loopback services, each other and the metadata service");
        }
        tracing::info!(isolation = isolation.name(), network = %network.describe(), shares = ?config.shares, "process runtime ready");
        let mut runtime = Self::with_isolation(config.work_dir.clone(), isolation);
        runtime.shares = config.shares.clone();
        runtime.network = network;
        runtime.allow_egress = config.allow_egress.clone();
        Ok(runtime)
    }

    /// A process runtime isolating workloads as `isolation` says.
    pub fn with_isolation(work_dir: impl Into<PathBuf>, isolation: Isolation) -> Self {
        let work_dir = work_dir.into();
        Self {
            state_root: work_dir.join("state").join("local"),
            work_dir,
            isolation,
            shares: Vec::new(),
            network: Network::Shared {
                why: "not set up".into(),
            },
            limits: None,
            relay: None,
            keep_workdirs: None,
            allow_egress: Vec::new(),
        }
    }

    /// Holds every workload to its limits (cgroups, disk) as `limits`
    /// says.
    pub fn with_limits(mut self, limits: Enforcement) -> Self {
        self.limits = Some(limits);
        self
    }

    /// The limits workloads are held to, when any.
    pub fn limits(&self) -> Option<&Enforcement> {
        self.limits.as_ref()
    }

    /// The instance's cgroup (whether or not it exists).
    fn cgroup_of(&self, instance_id: &InstanceId) -> InstanceCgroup {
        self.limits
            .as_ref()
            .map_or(InstanceCgroup::None, |l| l.cgroups.of(instance_id))
    }

    /// What the disk watch of an instance measures, and its limit in bytes.
    fn disk_watch(&self, instance_id: &InstanceId, disk_bytes: u64) -> Option<(PathBuf, u64)> {
        self.limits.as_ref()?;
        Some((self.instance_dir(instance_id), disk_bytes))
    }

    /// Relays workloads' output through `program agent-log-relay` (this
    /// binary), which holds a workload back while its output is not
    /// shipped (see [`super::relay`]).
    pub fn with_relay(mut self, program: Option<PathBuf>) -> Self {
        self.relay = program;
        self
    }

    /// Keeps an ended instance's directory for `keep` after the agent is
    /// done with it, rather than removing it at once (see
    /// [`super::leftovers`]).
    pub fn keeping_workdirs(mut self, keep: Option<Duration>) -> Self {
        self.keep_workdirs = keep;
        self
    }

    /// Keeps the workloads' state under `state/<node>` (default `local`):
    /// agents of several nodes sharing a work directory must not adopt
    /// each other's work.
    pub fn for_node(mut self, node: &str) -> Self {
        self.state_root = self.work_dir.join("state").join(node);
        self
    }

    /// How it isolates workloads.
    pub fn isolation(&self) -> &Isolation {
        &self.isolation
    }

    /// How it connects workloads.
    pub fn network(&self) -> &Network {
        &self.network
    }

    /// The workloads' namespaces, when each has its own.
    fn namespaces(&self) -> Option<&Namespaces> {
        match &self.network {
            Network::Isolated(ns) => Some(ns),
            Network::Shared { .. } => None,
        }
    }

    /// The directory an instance owns: its working directory must be in it.
    pub fn instance_dir(&self, instance_id: &InstanceId) -> PathBuf {
        self.work_dir.join("instances").join(instance_id.as_str())
    }

    /// Spawns `spec` and starts supervising it. Must be called inside a
    /// tokio runtime.
    pub async fn spawn(&self, spec: &SpawnSpec, wakers: Wakers) -> Result<Workload, SpawnError> {
        if spec.image.is_some() {
            // Running the command without its image would run something
            // else than what was asked, with the host's programs.
            return Err(SpawnError::ImageOnProcessNode);
        }
        let (program, args) = spec.command.split_first().ok_or(SpawnError::EmptyCommand)?;
        let root = self.instance_dir(&spec.instance_id);
        let uid = match self.isolation.users() {
            Some(users) => Some(
                users
                    .uid_of(&owner_of(&spec.instance_id, spec.tenant_id.as_ref()))
                    .map_err(|source| SpawnError::Os {
                        program: program.clone(),
                        source,
                    })?,
            ),
            None => None,
        };
        prepare_workdir(&root, &spec.workdir, uid)?;
        let os = |source: std::io::Error| SpawnError::Os {
            program: program.clone(),
            source,
        };
        // Where its cgroup goes; made right before the spawn, so that no
        // refusal on the way leaves an empty one behind.
        let group = self.cgroup_of(&spec.instance_id);
        // Output goes to files the workload writes itself, so that it
        // outlives the agent (see [`super::state`]).
        let state = StateDir::new(&self.state_root, &spec.instance_id);
        state.create().map_err(os)?;
        // Both files exist before anything writes them: the readers open
        // them at once.
        for name in ["stdout", "stderr"] {
            state.append(name).map_err(os)?;
        }
        let relayed = self.relay.as_ref().and_then(|program| {
            let both = spawn_relay(program, &state, LogStream::Stdout)
                .and_then(|out| Ok((out, spawn_relay(program, &state, LogStream::Stderr)?)));
            // A relay that did start sees its pipe closed, and leaves.
            both.map_err(|error| {
                tracing::warn!(instance_id = %spec.instance_id, program = %program.display(), %error, "cannot start the output relays: the workload writes its files itself and is not held back")
            })
            .ok()
        });
        let (stdout, stderr, relays) = match relayed {
            Some(((out, out_relay), (err, err_relay))) => {
                let relays = vec![out_relay, err_relay];
                if let Err(error) = state.write_relays(&relays) {
                    tracing::warn!(instance_id = %spec.instance_id, %error, "cannot record the output relays: a restarted agent will not wait for them");
                }
                (Stdio::from(out), Stdio::from(err), relays)
            }
            None => (
                Stdio::from(state.append("stdout").map_err(os)?),
                Stdio::from(state.append("stderr").map_err(os)?),
                Vec::new(),
            ),
        };
        let mut stdin = Stdio::null();
        let mut env = base_env(&spec.workdir);
        env.extend(spec.env.iter().map(|(k, v)| (k.clone(), v.into())));
        env.extend(
            device_env(
                &spec.instance_id,
                &spec.gpu_indices,
                &spec.gpu_uuids,
                &spec.vendors,
                &spec.gpu_slices,
            )
            .into_iter()
            .map(|(k, v)| (k, v.into())),
        );
        let netns = match self.namespaces() {
            Some(ns) => {
                let (ns, id) = (ns.clone(), spec.instance_id.to_string());
                let owner = owner_of(&spec.instance_id, spec.tenant_id.as_ref());
                let port = spec.env.get("PORT").and_then(|p| p.parse::<u16>().ok());
                let attached = tokio::task::spawn_blocking(move || ns.attach(&id, &owner, port))
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(|r| r.map_err(|e| e.to_string()));
                match attached {
                    Ok(a) => Some(a),
                    Err(e) => {
                        state.remove();
                        let _ = group.remove(Duration::ZERO).await;
                        return Err(SpawnError::Network(e));
                    }
                }
            }
            None => None,
        };
        let mut cmd = match &self.isolation {
            Isolation::RootSandbox { bwrap, .. } | Isolation::UserSandbox { bwrap } => {
                // The sandbox resolves the program itself; a missing one
                // is reported here rather than as an exit code 1.
                let path = env
                    .iter()
                    .find(|(k, _)| k == "PATH")
                    .map(|(_, v)| v.clone());
                if resolve(program, path.as_deref()).is_none() {
                    self.detach(&spec.instance_id);
                    state.remove();
                    let _ = group.remove(Duration::ZERO).await;
                    return Err(SpawnError::NoSuchProgram(program.clone()));
                }
                // In its cgroup first (the shell joins it, then execs),
                // then in its own network namespace: `nsenter` execs
                // bubblewrap (the same pid) once it joined it. Its
                // absolute path: the command's `PATH` is the workload's.
                let mut cmd = match (&netns, self.namespaces()) {
                    (Some(a), Some(ns)) => {
                        let mut cmd = command_in(&group, ns.nsenter().as_os_str());
                        cmd.arg(format!("--net={}", a.netns_path().display()))
                            .arg("--")
                            .arg(bwrap);
                        cmd
                    }
                    _ => command_in(&group, bwrap),
                };
                let mut bwrap_args = bwrap_args_hiding(
                    &root,
                    &spec.workdir,
                    uid.is_none(),
                    Some(&self.work_dir),
                    &self.shares,
                );
                // bubblewrap records the exit code in the status file even
                // when the agent is gone; it reaches it as standard input,
                // which it closes for the workload.
                stdin = Stdio::from(state.append(state.status_file()).map_err(os)?);
                let end = bwrap_args.len() - 1;
                bwrap_args.splice(end..end, ["--json-status-fd".to_string(), "0".to_string()]);
                if let Some(uid) = uid {
                    // The tenant's user by name too (`scp`, `sftp-server`
                    // and others refuse a uid without one).
                    let binds = identity_binds(state.dir(), uid, &spec.workdir).map_err(os)?;
                    let end = bwrap_args.len() - 1;
                    bwrap_args.splice(end..end, binds);
                }
                cmd.args(bwrap_args);
                if let Some(uid) = uid {
                    cmd.args(setpriv_args(uid));
                }
                cmd.arg(program).args(args).current_dir("/");
                cmd
            }
            Isolation::UsersOnly { .. } => {
                if group != InstanceCgroup::None && resolve(program, env_path(&env)).is_none() {
                    // The joining shell would only exit 127.
                    return Err(SpawnError::NoSuchProgram(program.clone()));
                }
                let mut cmd = command_in(&group, program);
                cmd.args(args).current_dir(&spec.workdir);
                if let Some(uid) = uid {
                    // std drops the supplementary groups when root sets a uid.
                    cmd.uid(uid).gid(uid);
                }
                cmd
            }
            Isolation::None => {
                if group != InstanceCgroup::None && resolve(program, env_path(&env)).is_none() {
                    return Err(SpawnError::NoSuchProgram(program.clone()));
                }
                let mut cmd = command_in(&group, program);
                cmd.args(args).current_dir(&spec.workdir);
                cmd
            }
        };
        // A workload must not inherit the agent's environment: it may hold
        // the agent token or an operator's API key. It gets a minimal base,
        // its own variables, then the device variables.
        cmd.env_clear()
            .envs(env)
            .stdin(stdin)
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0)
            .kill_on_drop(false);
        if let Some(limits) = &self.limits {
            let made = limits.cgroups.create(
                &spec.instance_id,
                &limits.limits(spec.cpu_milli, spec.memory_mb),
            );
            if let Err(error) = made {
                state.remove();
                return Err(error.into());
            }
            if let (Some(uid), Isolation::UsersOnly { .. }) = (uid, &self.isolation) {
                // It joins its group after it became the tenant's user.
                for procs in group.procs_files() {
                    if let Err(error) = std::os::unix::fs::chown(&procs, Some(uid), Some(uid)) {
                        state.remove();
                        let _ = group.remove(Duration::ZERO).await;
                        return Err(os(error));
                    }
                }
            }
        }
        let spawned = cmd.spawn();
        // The command holds the pipes' write ends: the relays see their
        // end only once the workload's copies are the last ones.
        drop(cmd);
        if spawned.is_err() {
            self.detach(&spec.instance_id);
            // The relays leave with their directory (and their pipes).
            state.remove();
            let _ = group.remove(Duration::ZERO).await;
        }
        let child = spawned.map_err(|source| match source.kind() {
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
        let logs = Arc::new(LogBuffer::persistent(
            spec.instance_id.clone(),
            state.clone(),
            Checkpoint::default(),
        ));
        let (done_tx, done_rx) = watch::channel(false);
        let pumps = tails(&state, Checkpoint::default(), &logs, &wakers, &done_rx);
        // The leader has not been reaped yet, so its pid is known; 0 would
        // only come from a platform without pids and is never signalled.
        let pid = child.id().unwrap_or(0);
        // In a sandbox, the leader is bubblewrap; the workload runs under
        // the pid namespace's init, in a session and group of its own.
        let sandbox_init = if self.isolation.sandboxed() {
            wait_for_sandbox_init(pid, &state).await
        } else {
            None
        };
        tracing::info!(instance_id = %spec.instance_id, pid, ?sandbox_init, uid, program = %program, isolation = self.isolation.name(), addr = ?netns.as_ref().map(|a| a.addr()), "process started");
        let record = Record {
            pid,
            start_ticks: start_ticks(pid).unwrap_or(0),
            sandbox_init,
            started_at,
        };
        if let Err(error) = state.write_record(&record) {
            tracing::warn!(instance_id = %spec.instance_id, %error, "cannot record the process: a restarted agent will not find it");
        }
        let disk_bytes = self
            .limits
            .as_ref()
            .map(|l| l.defaults.disk_bytes(spec.disk_mb));
        if let Some(bytes) = disk_bytes {
            if let Err(error) = state.write_disk_limit(bytes) {
                tracing::warn!(instance_id = %spec.instance_id, %error, "cannot record the disk limit: a restarted agent applies the node's default");
            }
        }
        let (workload, control) = Workload::new(
            spec.instance_id.clone(),
            pid,
            Some(sandbox_init.unwrap_or(pid)),
            started_at,
            logs,
        );
        tokio::spawn(supervise(Supervised {
            instance_id: spec.instance_id.clone(),
            child: Leader::Child(child),
            pid,
            sandbox_init,
            control,
            pumps,
            done: done_tx,
            wakers,
            cgroup: group,
            disk: disk_bytes.and_then(|b| self.disk_watch(&spec.instance_id, b)),
            state,
            relays,
            logs: workload.logs().clone(),
        }));
        Ok(workload)
    }
}

impl Runtime for ProcessRuntime {
    fn kind(&self) -> RuntimeKind {
        RuntimeKind::Process
    }

    fn start(
        &self,
        spec: SpawnSpec,
        wakers: Wakers,
    ) -> BoxFuture<'_, Result<Workload, SpawnError>> {
        Box::pin(async move { self.spawn(&spec, wakers).await })
    }

    fn adopt(&self, wakers: Wakers) -> BoxFuture<'_, Result<Vec<Workload>, RuntimeError>> {
        Box::pin(async move {
            // Directories of instances an earlier agent ended but could not
            // remove (it was killed first); a minute's margin for a start
            // under way by another agent sharing the work directory.
            let removed = super::leftovers::sweep(
                &self.work_dir.join("instances"),
                &self.work_dir.join("state"),
                self.keep_workdirs.unwrap_or(Duration::from_secs(60)),
                std::time::SystemTime::now(),
            );
            if removed > 0 {
                tracing::info!(removed, "removed ended instances' directories");
            }
            let mut adopted = Vec::new();
            for (id, state) in StateDir::all(&self.state_root) {
                let Some(record) = state.record() else {
                    // Started, then the agent died before recording it:
                    // nothing to go by.
                    self.detach(&id);
                    state.remove();
                    continue;
                };
                let from = state.checkpoint();
                let logs = Arc::new(LogBuffer::persistent(id.clone(), state.clone(), from));
                let (done_tx, done_rx) = watch::channel(false);
                let pumps = tails(&state, from, &logs, &wakers, &done_rx);
                let running = alive(&record);
                tracing::info!(instance_id = %id, pid = record.pid, running, next_seq = from.next_seq, "taking over a workload an earlier agent started");
                let (workload, control) = Workload::new(
                    id.clone(),
                    record.pid,
                    Some(record.sandbox_init.unwrap_or(record.pid)),
                    record.started_at,
                    logs,
                );
                let disk_bytes = self.limits.as_ref().map(|l| {
                    state
                        .disk_limit()
                        .unwrap_or_else(|| l.defaults.disk_bytes(None))
                });
                let disk = disk_bytes.and_then(|b| self.disk_watch(&id, b));
                tokio::spawn(supervise(Supervised {
                    cgroup: self.cgroup_of(&id),
                    disk,
                    instance_id: id,
                    child: Leader::Adopted {
                        record: record.clone(),
                        state: state.clone(),
                        running,
                    },
                    pid: record.pid,
                    sandbox_init: record.sandbox_init,
                    control,
                    pumps,
                    done: done_tx,
                    wakers: wakers.clone(),
                    relays: state.relays(),
                    state,
                    logs: workload.logs().clone(),
                }));
                adopted.push(workload);
            }
            // Groups of workloads nobody follows any more (the agent died
            // between creating a group and recording its process).
            if let Some(limits) = &self.limits {
                for id in limits.cgroups.instances() {
                    if !adopted.iter().any(|w| w.instance_id() == &id) {
                        let _ = limits.cgroups.of(&id).remove(Duration::from_secs(1)).await;
                    }
                }
            }
            Ok(adopted)
        })
    }

    fn close(&self) {
        // Only empty groups go: work that outlives a shutdown keeps its own
        // (and so its parent) for the agent that adopts it.
        if let Some(limits) = &self.limits {
            for dir in limits.cgroups.node_dirs() {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }

    fn unenforced_limits(&self) -> Vec<String> {
        match &self.limits {
            Some(limits) => limits.unenforced(),
            None => vec![
                "memory, cpu, pids, disk: the process runtime was started without limits".into(),
            ],
        }
    }

    fn network(&self) -> Option<flotilla_core::api::NodeNetwork> {
        Some(self.network.report(&self.allow_egress))
    }

    fn release(&self, instance_id: &InstanceId) {
        self.detach(instance_id);
        StateDir::new(&self.state_root, instance_id).remove();
        super::leftovers::release(
            &self.work_dir.join("instances"),
            &self.work_dir.join("state"),
            instance_id,
            self.keep_workdirs,
        );
    }
}

impl ProcessRuntime {
    /// Removes an ended workload's namespace (off the async threads when
    /// inside a runtime).
    fn detach(&self, instance_id: &InstanceId) {
        let Some(ns) = self.namespaces() else {
            return;
        };
        let (ns, id) = (ns.clone(), instance_id.to_string());
        let work = move || {
            if let Err(error) = ns.detach(&id) {
                tracing::warn!(instance_id = %id, %error, "cannot remove the workload's network namespace");
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn_blocking(work);
            }
            Err(_) => work(),
        }
    }
}

/// A command that runs `program` inside `group` (see
/// [`cgroup::join_command`]); the caller adds the program's arguments.
fn command_in(
    group: &InstanceCgroup,
    program: impl Into<std::ffi::OsString>,
) -> tokio::process::Command {
    let (program, args) = cgroup::join_command(group, program);
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args);
    cmd
}

/// Starts the relay of `stream` (see [`super::relay`]): returns the pipe's
/// write end for the workload, and the relay's pid and start time. The
/// relay gets its own process group, so that neither a stop of the
/// workload's group nor a signal to the agent's cuts its output short.
fn spawn_relay(
    program: &Path,
    state: &StateDir,
    stream: LogStream,
) -> std::io::Result<(std::io::PipeWriter, (u32, u64))> {
    let (reader, writer) = std::io::pipe()?;
    let mut cmd = tokio::process::Command::new(program);
    cmd.arg("agent-log-relay")
        .arg("--dir")
        .arg(state.dir())
        .arg("--stream")
        .arg(match stream {
            LogStream::Stdout => "stdout",
            LogStream::Stderr => "stderr",
        })
        .env_clear()
        .stdin(reader)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .kill_on_drop(false);
    // Dropped unwaited: tokio reaps it when it ends; it is followed by
    // its pid and start time, as after an agent restart.
    let child = cmd.spawn()?;
    drop(cmd);
    let pid = child.id().unwrap_or(0);
    Ok((writer, (pid, start_ticks(pid).unwrap_or(0))))
}

/// Variables of the agent's own environment a workload may see: enough to
/// find programs and pick a locale, nothing that could carry a credential.
const INHERITED_ENV: [&str; 4] = ["PATH", "LANG", "LC_ALL", "TZ"];

/// The base environment of a workload: the allow-listed variables of the
/// agent's environment, and `HOME` set to the instance's working directory.
fn base_env(workdir: &Path) -> Vec<(String, std::ffi::OsString)> {
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

/// The `PATH` of an environment.
fn env_path(env: &[(String, std::ffi::OsString)]) -> Option<&std::ffi::OsStr> {
    env.iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_os_str())
}

/// `program` as `PATH` finds it (or as given, when it names a path).
fn resolve(program: &str, path: Option<&std::ffi::OsStr>) -> Option<PathBuf> {
    if program.contains('/') {
        return Some(PathBuf::from(program)).filter(|p| p.exists());
    }
    std::env::split_paths(path?)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// The init of the pid namespace bubblewrap `outer` creates: its child
/// whose pid in its own namespace is 1. Waits up to a second for it (it is
/// forked right away); `None` when the sandbox ended before.
async fn wait_for_sandbox_init(outer: u32, state: &StateDir) -> Option<u32> {
    // Usually a few milliseconds; a loaded machine can take seconds to
    // schedule bubblewrap's fork, and giving up early would leave stops
    // and the fence signalling bubblewrap instead of the workload. Only
    // bubblewrap ending (it failed to set the sandbox up) ends the wait
    // early.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // bubblewrap's own record first: it stays when bubblewrap ended
        // at once and its init was reparented.
        if let Some(init) = state.sandbox_init().or_else(|| sandbox_init_of(outer)) {
            return Some(init);
        }
        if Instant::now() >= deadline || !pid_runs(outer) {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Whether `pid` still runs (a zombie has ended).
fn pid_runs(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
    })
}

/// Waits (up to a second) until `parent` has a child: the sandbox's init
/// started the command.
async fn wait_for_child_of(parent: u32) {
    let deadline = Instant::now() + Duration::from_secs(1);
    while Instant::now() < deadline && children_of(parent).is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The pids whose parent is `parent`, with their `/proc/<pid>/status`.
fn children_of(parent: u32) -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        let ppid = status
            .lines()
            .find_map(|l| l.strip_prefix("PPid:"))
            .and_then(|p| p.trim().parse::<u32>().ok());
        if ppid == Some(parent) {
            out.push((pid, status));
        }
    }
    out
}

fn sandbox_init_of(outer: u32) -> Option<u32> {
    children_of(outer).into_iter().find_map(|(pid, status)| {
        let nspid = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
        (nspid.split_whitespace().last() == Some("1")).then_some(pid)
    })
}

/// The two ways of following a workload's leader.
enum Leader {
    /// This agent started it: its child, waited for.
    Child(tokio::process::Child),
    /// An earlier agent started it: watched through `/proc`, its exit code
    /// read from bubblewrap's status file.
    Adopted {
        record: Record,
        state: StateDir,
        /// It still ran when it was adopted.
        running: bool,
    },
}

/// How often an adopted workload is looked at to see whether it ended.
const ADOPTED_TICK: Duration = Duration::from_millis(100);

impl Leader {
    /// Waits for the leader to end; returns its exit code and when.
    async fn wait(&mut self) -> (i32, chrono::DateTime<Utc>) {
        match self {
            Leader::Child(child) => match child.wait().await {
                Ok(status) => (exit_code(status), Utc::now()),
                Err(error) => {
                    tracing::error!(%error, "cannot wait for process");
                    (-1, Utc::now())
                }
            },
            Leader::Adopted {
                record,
                state,
                running,
            } => {
                if *running {
                    while alive(record) {
                        tokio::time::sleep(ADOPTED_TICK).await;
                    }
                }
                // bubblewrap writes the status right before it exits.
                let mut code = state.exit_code();
                for _ in 0..20 {
                    if code.is_some() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    code = state.exit_code();
                }
                let at = if *running {
                    Utc::now()
                } else {
                    state.status_written().unwrap_or_else(Utc::now)
                };
                (code.unwrap_or(-1), at)
            }
        }
    }

    /// Whether the leader may still be signalled: an adopted one that
    /// ended may have had its pid reused.
    fn signalable(&self) -> bool {
        match self {
            Leader::Child(_) => true,
            Leader::Adopted { record, .. } => alive(record),
        }
    }
}

/// Follows a workload's output files from `from` into `logs`.
fn tails(
    state: &StateDir,
    from: Checkpoint,
    logs: &Arc<LogBuffer>,
    wakers: &Wakers,
    done: &watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    [
        (LogStream::Stdout, from.stdout),
        (LogStream::Stderr, from.stderr),
    ]
    .into_iter()
    .map(|(stream, offset)| {
        tokio::spawn(tail(
            state.output(stream),
            stream,
            offset,
            logs.clone(),
            wakers.logs.clone(),
            done.clone(),
        ))
    })
    .collect()
}

struct Supervised {
    instance_id: InstanceId,
    child: Leader,
    /// The leader: the command, or bubblewrap around it.
    pid: u32,
    /// The sandbox's pid namespace init, whose group holds the workload.
    sandbox_init: Option<u32>,
    control: Control,
    pumps: Vec<tokio::task::JoinHandle<()>>,
    /// Tells the output readers that no more output will come.
    done: watch::Sender<bool>,
    wakers: Wakers,
    /// Its cgroup: read for OOM kills, emptied and removed at the end.
    cgroup: InstanceCgroup,
    /// The directory whose size is watched, and its limit in bytes.
    disk: Option<(PathBuf, u64)>,
    state: StateDir,
    /// The output relays (pid, start time); none when the workload writes
    /// its files itself.
    relays: Vec<(u32, u64)>,
    logs: Arc<LogBuffer>,
}

/// Waits for the leader, applying stop requests; then kills what is left of
/// the group, waits for the pipes to drain and publishes the exit.
async fn supervise(mut s: Supervised) {
    let mut stop_requested = false;
    let mut kill_at: Option<Instant> = None;
    let mut disk_exceeded = false;
    let mut disk_check = tokio::time::interval(DISK_CHECK);
    disk_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (code, at) = loop {
        tokio::select! {
            ended = s.child.wait() => break ended,
            _ = disk_check.tick(), if s.disk.is_some() && !disk_exceeded => {
                if let Some(used) = over_disk_limit(s.disk.as_ref()).await {
                    tracing::warn!(instance_id = %s.instance_id, used, limit = s.disk.as_ref().map(|d| d.1), "disk limit exceeded, killing the workload");
                    disk_exceeded = true;
                    kill(s.pid, s.sandbox_init);
                    s.cgroup.kill_all();
                }
            }
            grace = s.control.stop_requested() => {
                if !stop_requested {
                    stop_requested = true;
                    tracing::info!(instance_id = %s.instance_id, pid = s.pid, grace_ms = grace.as_millis() as u64, "stopping process group");
                    if let Some(init) = s.sandbox_init {
                        // The namespace's init ignores SIGTERM: a stop that
                        // comes before it started the command would be lost.
                        wait_for_child_of(init).await;
                    }
                    terminate(s.pid, s.sandbox_init);
                }
                let deadline = Instant::now() + grace;
                kill_at = Some(kill_at.map_or(deadline, |k| k.min(deadline)));
            }
            () = sleep_until_opt(kill_at) => {
                tracing::warn!(instance_id = %s.instance_id, pid = s.pid, "grace period over, killing process group");
                kill(s.pid, s.sandbox_init);
                kill_at = None;
            }
        }
    };
    // The instance is over when its leader is: whatever it left behind in
    // its group would keep holding GPUs that are about to be handed out.
    if s.child.signalable() {
        kill(s.pid, s.sandbox_init);
    }
    // What it left written counts too, when it ended before a check.
    if !disk_exceeded && !stop_requested {
        disk_exceeded = over_disk_limit(s.disk.as_ref()).await.is_some();
    }
    // Killed by the kernel for its memory limit: an OOM kill in its group
    // and an exit that failed (a workload may survive a child's kill).
    let oom_killed = code != 0 && s.cgroup.oom_kills().is_some_and(|n| n > 0);
    if let Err(error) = s.cgroup.remove(CGROUP_REMOVE_PATIENCE).await {
        tracing::warn!(instance_id = %s.instance_id, %error, "cannot remove the instance's cgroup");
    }
    if !s.relays.is_empty() {
        // Whatever the pipes still hold goes to the files without holding
        // back; a relay still reading after the grace has a writer that
        // escaped the group (only without a sandbox's pid namespace).
        s.state.mark_ended();
        let relays_done = async {
            while s
                .relays
                .iter()
                .any(|&(pid, ticks)| start_ticks(pid) == Some(ticks))
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        if tokio::time::timeout(PIPE_DRAIN_TIMEOUT, relays_done)
            .await
            .is_err()
        {
            tracing::warn!(instance_id = %s.instance_id, "output still written after the process group ended, no longer relaying it");
            for &(pid, ticks) in &s.relays {
                if start_ticks(pid) == Some(ticks) {
                    if let Ok(pid) = i32::try_from(pid) {
                        let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
                    }
                }
            }
        }
    }
    s.done.send_replace(true);
    // The files hold all the output there will be: the readers finish
    // them as fast as the server takes the lines, never dropping any. A
    // server that takes none for a long while (failing every upload)
    // must not keep the exit from being reported: the rest is given up.
    let mut read = s.logs.captured();
    for pump in &mut s.pumps {
        loop {
            match tokio::time::timeout(STALLED_OUTPUT, &mut *pump).await {
                Ok(_) => break,
                Err(_) if s.logs.captured() != read => read = s.logs.captured(),
                Err(_) => {
                    tracing::warn!(instance_id = %s.instance_id, lines = read, "the server took no output for a long while after the process ended, giving up the unread rest");
                    pump.abort();
                    break;
                }
            }
        }
    }
    tracing::info!(instance_id = %s.instance_id, pid = s.pid, code, stopped = stop_requested, oom_killed, disk_exceeded, "process exited");
    s.control.exited(Exit {
        code,
        at,
        stop_requested,
        oom_killed,
        disk_exceeded,
    });
    s.wakers.logs.notify_one();
    s.wakers.changed.notify_one();
}

/// How long the processes left in an ended workload's cgroup get to die
/// before its removal is given up.
const CGROUP_REMOVE_PATIENCE: Duration = Duration::from_secs(10);

/// The bytes `disk` (directory, limit) uses when over its limit.
async fn over_disk_limit(disk: Option<&(PathBuf, u64)>) -> Option<u64> {
    let (dir, limit) = disk?.clone();
    let used = tokio::task::spawn_blocking(move || disk_usage(&dir))
        .await
        .ok()?;
    (used > limit).then_some(used)
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Asks the workload to end: SIGTERM to its group. In a sandbox that is the
/// group under the namespace's init, not bubblewrap itself, which would
/// die at once and so cut the workload's grace short.
fn terminate(leader: u32, sandbox_init: Option<u32>) {
    signal_group(sandbox_init.unwrap_or(leader), Signal::SIGTERM);
}

/// Ends the workload now: SIGKILL to the sandbox's init (the kernel then
/// kills everything in its pid namespace, even processes that left its
/// group) and to both groups.
fn kill(leader: u32, sandbox_init: Option<u32>) {
    if let Some(init) = sandbox_init {
        signal_group(init, Signal::SIGKILL);
        if let Ok(raw) = i32::try_from(init) {
            if raw > 1 {
                let _ = nix::sys::signal::kill(Pid::from_raw(raw), Signal::SIGKILL);
            }
        }
    }
    signal_group(leader, Signal::SIGKILL);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    use crate::runtime::MAX_LINE_BYTES;
    use flotilla_core::api::LogLine;
    use flotilla_core::catalog::Vendor;
    use flotilla_core::id::InstanceId;

    /// A spec with an instance id of its own. Tests run side by side, and
    /// a workload's network namespace is named after its instance,
    /// host-wide: two tests with one id tore down each other's namespace
    /// (the workload then failed to enter it and exited 1).
    fn spec(dir: &std::path::Path, command: &[&str]) -> SpawnSpec {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let instance_id =
            InstanceId::generate(1, (u128::from(std::process::id()) << 64) | u128::from(n));
        SpawnSpec {
            workdir: dir.join("instances").join(instance_id.as_str()),
            instance_id,
            tenant_id: None,
            command: command.iter().map(|s| s.to_string()).collect(),
            env: BTreeMap::from([("GREETING".to_string(), "hello".to_string())]),
            gpu_indices: vec![1, 3],
            gpu_uuids: vec!["GPU-a".into(), "GPU-b".into()],
            vendors: vec![Vendor::Nvidia, Vendor::Nvidia],
            gpu_slices: Vec::new(),
            image: None,
            cpu_milli: None,
            memory_mb: None,
            disk_mb: None,
            registry_auth: None,
        }
    }

    /// The runtime with the strongest isolation this host allows (as
    /// root: bubblewrap and per-tenant users, installed when missing).
    fn runtime(dir: &Path) -> ProcessRuntime {
        crate::runtime::sandbox::test_support::ensure_bwrap();
        ProcessRuntime::new(&SandboxConfig::new(dir)).unwrap()
    }

    async fn spawn(dir: &Path, spec: &SpawnSpec) -> Result<Workload, SpawnError> {
        runtime(dir).spawn(spec, Wakers::default()).await
    }

    /// Host pids of the processes running `sleep <arg>`: in a sandbox the
    /// workload only knows its pids in its own namespace.
    fn sleeping(arg: &str) -> Vec<u32> {
        let want = format!("sleep\0{arg}\0");
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c == want.as_bytes())
            })
            .filter(|pid| !process_gone(*pid))
            .collect()
    }

    async fn eventually_none_sleeping(arg: &str) -> bool {
        for _ in 0..250 {
            if sleeping(arg).is_empty() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// Gone means no such process, or a zombie nobody reaped yet: the
    /// fence's own reading.
    fn process_gone(pid: u32) -> bool {
        crate::fence::ended(pid)
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
        let p = spawn(dir.path(), &s).await.unwrap();
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
        let p = spawn(dir.path(), &s).await.unwrap();
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
    async fn stop_terminates_the_whole_process_group() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(
            dir.path(),
            &["sh", "-c", "sleep 100.1 & echo $!; sleep 100"],
        );
        let p = spawn(dir.path(), &s).await.unwrap();
        first_line(p.logs()).await;
        assert_eq!(sleeping("100.1").len(), 1);
        p.stop(Duration::from_secs(5));
        let exit = tokio::time::timeout(Duration::from_secs(10), p.wait())
            .await
            .unwrap();
        assert_eq!(exit.code, 128 + 15, "ended by SIGTERM");
        assert!(exit.stop_requested);
        assert!(eventually_gone(p.pid()).await, "leader gone");
        assert!(
            eventually_none_sleeping("100.1").await,
            "background child gone"
        );
    }

    #[tokio::test]
    async fn stop_kills_after_the_grace_when_term_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        // An ignored signal stays ignored across exec, so both shells and
        // the sleep ignore SIGTERM.
        let s = spec(
            dir.path(),
            &["sh", "-c", "trap '' TERM; sleep 100.2 & echo $!; wait"],
        );
        let p = spawn(dir.path(), &s).await.unwrap();
        first_line(p.logs()).await;
        assert_eq!(sleeping("100.2").len(), 1);
        let t0 = Instant::now();
        p.stop(Duration::from_millis(300));
        let exit = tokio::time::timeout(Duration::from_secs(10), p.wait())
            .await
            .unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(250));
        assert_eq!(exit.code, 128 + 9, "ended by SIGKILL");
        assert!(
            eventually_none_sleeping("100.2").await,
            "background child gone"
        );
    }

    #[tokio::test]
    async fn leftovers_in_the_group_die_with_the_leader() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(
            dir.path(),
            &["sh", "-c", "sleep 100.3 >/dev/null 2>&1 & echo $!; exit 0"],
        );
        let p = spawn(dir.path(), &s).await.unwrap();
        let exit = tokio::time::timeout(Duration::from_secs(10), p.wait())
            .await
            .unwrap();
        assert_eq!(exit.code, 0);
        assert!(eventually_none_sleeping("100.3").await);
    }

    /// A relay that cannot start (a binary replaced under a running
    /// agent) costs the back-pressure, not the start or the output.
    #[tokio::test]
    async fn a_relay_that_cannot_start_falls_back_to_the_files() {
        let dir = tempfile::tempdir().unwrap();
        let rt = ProcessRuntime::with_isolation(dir.path(), Isolation::None)
            .with_relay(Some(dir.path().join("no-such-flotilla")));
        let s = spec(dir.path(), &["sh", "-c", "echo out; echo err >&2"]);
        let p = rt.spawn(&s, Wakers::default()).await.unwrap();
        let exit = tokio::time::timeout(Duration::from_secs(10), p.wait())
            .await
            .unwrap();
        assert_eq!(exit.code, 0);
        let mut lines: Vec<String> = p.logs().peek(10).into_iter().map(|l| l.line).collect();
        lines.sort();
        assert_eq!(lines, ["err", "out"]);
    }

    #[tokio::test]
    async fn missing_program_fails_to_start() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(dir.path(), &["flotilla-no-such-program-xyz", "--flag"]);
        let e = spawn(dir.path(), &s).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "no such program `flotilla-no-such-program-xyz`"
        );
        let e = spawn(dir.path(), &spec(dir.path(), &[])).await.unwrap_err();
        assert_eq!(e.to_string(), "empty command");
        // An image is never run as a host command.
        let mut s = spec(dir.path(), &["true"]);
        s.image = Some(flotilla_core::instance::ImageSpec {
            image: "localhost/some:1".into(),
            ports: vec![8080],
            scratch_mb: None,
        });
        let e = spawn(dir.path(), &s).await.unwrap_err();
        assert!(matches!(e, SpawnError::ImageOnProcessNode), "{e}");
        assert!(
            e.to_string()
                .starts_with("this node runs processes; images need a container node"),
            "{e}"
        );
    }

    /// Removes a test node's cgroups when the test ends, even when it
    /// failed.
    struct NodeGroups(super::super::cgroup::Cgroups);

    impl Drop for NodeGroups {
        fn drop(&mut self) {
            for id in self.0.instances() {
                let group = self.0.of(&id);
                for _ in 0..100 {
                    group.kill_all();
                    if group
                        .dirs()
                        .iter()
                        .all(|d| std::fs::remove_dir(d).is_ok() || !d.exists())
                    {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            for dir in self.0.node_dirs() {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }

    /// As root where the cgroup trees are writable (CI): the workload is
    /// in its group, a restarted agent follows the group of what it adopts
    /// and removes a group nothing it adopted runs in, and the group goes
    /// when the work ends.
    #[tokio::test]
    async fn workloads_run_in_their_cgroup_and_adoption_keeps_it() {
        use crate::runtime::cgroup::Limits;
        use crate::runtime::limits::{Enforcement, LimitDefaults};
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: cgroups need root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let node = format!("proctest-{}", std::process::id());
        let limits = || {
            let defaults = LimitDefaults {
                memory_mb: None,
                pids: 32,
                disk_mb: 64,
            };
            Enforcement::detect(&node, dir.path(), defaults, 16_384)
        };
        let first = limits();
        let _cleanup = NodeGroups(first.cgroups.clone());
        assert!(first.unenforced().is_empty(), "{:?}", first.unenforced());
        let rt = runtime(dir.path())
            .for_node(&node)
            .with_limits(first.clone());
        let mut s = spec(dir.path(), &["sh", "-c", "echo ready; exec sleep 100.4"]);
        s.memory_mb = Some(64);
        s.cpu_milli = Some(250);
        let w = rt.spawn(&s, Wakers::default()).await.unwrap();
        first_line(w.logs()).await;
        let group = first.cgroups.of(&s.instance_id);
        let pid = sleeping("100.4")[0];
        assert!(group.pids().contains(&pid), "{pid} in {:?}", group.pids());
        // A group whose workload was never recorded.
        let stale = InstanceId::generate(2, 2);
        let stale_group = first.cgroups.create(&stale, &Limits::default()).unwrap();
        assert!(stale_group.exists());

        let again = ProcessRuntime::with_isolation(dir.path(), rt.isolation().clone())
            .for_node(&node)
            .with_limits(limits());
        let adopted = again.adopt(Wakers::default()).await.unwrap();
        assert_eq!(adopted.len(), 1);
        assert!(!stale_group.exists(), "an unfollowed group is removed");
        assert!(
            group.pids().contains(&pid),
            "the adopted work keeps its group"
        );
        adopted[0].stop(Duration::from_secs(5));
        tokio::time::timeout(Duration::from_secs(20), adopted[0].wait())
            .await
            .unwrap();
        assert!(!group.exists(), "the group goes with the work");
        assert!(eventually_none_sleeping("100.4").await);
    }

    #[tokio::test]
    async fn long_lines_are_split_and_partial_last_lines_kept() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(
            dir.path(),
            &[
                "sh",
                "-c",
                "head -c 200000 /dev/zero | tr '\\0' a; echo; printf 'caf\\303\\251\\r\\n\\377x\\nlast'",
            ],
        );
        let p = spawn(dir.path(), &s).await.unwrap();
        p.wait().await;
        let lines = p.logs().peek(10);
        let text: Vec<&str> = lines.iter().map(|l| l.line.as_str()).collect();
        assert_eq!(text.len(), 7, "{:?}", &text[4..]);
        let sizes: Vec<usize> = text[..4].iter().map(|l| l.len()).collect();
        assert_eq!(
            sizes,
            [
                MAX_LINE_BYTES,
                MAX_LINE_BYTES,
                MAX_LINE_BYTES,
                200_000 - 3 * MAX_LINE_BYTES
            ]
        );
        assert!(text[..4].iter().all(|l| l.bytes().all(|b| b == b'a')));
        assert_eq!(&text[4..], &["café", "\u{fffd}x", "last"]);
    }
}
