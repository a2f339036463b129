//! The agent's end of sessions into running instances (exec, shell,
//! port-forward): the sync answer lists a session, the agent dials it back
//! (`Client::attach_session`) and serves it inside the instance.
//!
//! For a workload of the process runtime the command joins the workload
//! where it runs: `nsenter` into the mount, pid, UTS, IPC and network
//! namespaces of its sandbox (whatever they are: a network namespace of
//! its own or the host's), then `setpriv` to the workload's own uid and
//! gid with no groups, no capabilities and `no_new_privs`, as the sandbox
//! starts the workload itself, in its working directory and with its
//! environment. All of these are read from the workload's main process
//! (`/proc/PID/{status,cwd,environ}`), so the session is what the workload
//! is, never more. A port-forward connects from a thread moved into the
//! workload's network namespace (`setns`), to `127.0.0.1:PORT` there.
//!
//! Entering another process's namespaces needs root: an agent running as
//! an ordinary user refuses sessions, naming why. A container is entered
//! through its engine's exec (the container's user, directory and
//! environment), and its ports through its init's network namespace.

use std::ffi::OsString;
use std::os::fd::{AsFd as _, OwnedFd};
use std::os::unix::ffi::OsStringExt as _;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use flotilla_client::{SessionReceiver, SessionSender};
use flotilla_core::access::{AccessKind, AccessSession, Frame};
use flotilla_core::id::NodeId;

use crate::runtime::cgroup::{self, Hierarchy, InstanceCgroup};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::client::Client;

/// How long output is still read after the command ended (a process it
/// left in the background may hold its output open).
const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(2);
/// How long a port-forward's connection inside the instance may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest chunk read at once from a command's output or a forwarded port.
const CHUNK: usize = 32 * 1024;

/// Where a session's instance runs, as its workload tells.
#[derive(Debug, Clone)]
pub enum Place {
    /// A process of the process runtime: `ns_pid` is in the workload's
    /// namespaces (its sandbox's init, or the process itself without a
    /// sandbox); `main_pid` is the workload's own process, whose user,
    /// directory and environment a session takes.
    Process {
        /// A process inside the workload's namespaces.
        ns_pid: u32,
        /// The workload's main process (the sandbox's leader when it runs
        /// in one: its first child inside is the command).
        leader: u32,
        /// Whether it runs in a bubblewrap sandbox.
        sandboxed: bool,
    },
    /// A container.
    Container {
        /// Its engine id.
        id: String,
        /// Its init process as the engine reports it (0: not reported).
        pid: u32,
        /// The engine, whose exec runs commands in it.
        engine: bollard::Docker,
    },
    /// Somewhere this agent cannot enter.
    Unknown,
}

/// Dials `session` back and serves it; `place` is where its instance runs
/// on this node, or why it cannot be entered. Logs, never fails: the
/// tenant is told through the session.
pub async fn serve(
    client: Client,
    node: NodeId,
    session: AccessSession,
    place: Result<Place, String>,
) {
    let id = session.id.clone();
    let mut stream = match client.attach_session(&node, &session.id).await {
        Ok(s) => s,
        Err(error) => {
            tracing::warn!(session = %id, %error, "cannot dial the session back");
            return;
        }
    };
    tracing::info!(session = %id, instance_id = %session.instance_id, kind = session.kind.name(), "access session started");
    let work = match place.and_then(|place| prepare(&session.kind, place)) {
        Ok(work) => work,
        Err(why) => {
            tracing::info!(session = %id, reason = %why, "access session refused");
            let _ = stream.send(&Frame::Error(why)).await;
            return;
        }
    };
    let (mut tx, rx) = stream.split();
    let result = match work {
        Work::Exec {
            ctx,
            command,
            tty: true,
            cols,
            rows,
        } => exec_tty(&mut tx, rx, &ctx, &command, cols, rows).await,
        Work::Exec { ctx, command, .. } => exec_pipes(&mut tx, rx, &ctx, &command).await,
        Work::Forward { ns_pid, port } => forward(&mut tx, rx, ns_pid, port).await,
        Work::ContainerExec {
            engine,
            id,
            command,
            tty,
            cols,
            rows,
        } => exec_container(&mut tx, rx, &engine, &id, command, tty, (cols, rows)).await,
    };
    match result {
        Ok(code) => tracing::info!(session = %id, code, "access session ended"),
        Err(why) => {
            tracing::info!(session = %id, reason = %why, "access session failed");
            let _ = tx.send(&Frame::Error(why)).await;
        }
    }
    tx.close().await;
}

/// What a session will do, checked before anything starts.
enum Work {
    Exec {
        ctx: Context,
        command: Vec<String>,
        tty: bool,
        cols: u16,
        rows: u16,
    },
    Forward {
        ns_pid: u32,
        port: u16,
    },
    ContainerExec {
        engine: bollard::Docker,
        id: String,
        command: Vec<String>,
        tty: bool,
        cols: u16,
        rows: u16,
    },
}

fn prepare(kind: &AccessKind, place: Place) -> Result<Work, String> {
    let (ns_pid, leader, sandboxed) = match place {
        Place::Process {
            ns_pid,
            leader,
            sandboxed,
        } => (ns_pid, leader, sandboxed),
        Place::Container { id, pid, engine } => return prepare_container(kind, id, pid, engine),
        Place::Unknown => return Err("this node cannot enter the instance".to_string()),
    };
    if !rustix::process::geteuid().is_root() {
        return Err(
            "this node's agent does not run as root, so it cannot enter an instance".to_string(),
        );
    }
    Ok(match kind {
        AccessKind::Exec {
            command,
            tty,
            cols,
            rows,
        } => {
            let main = if sandboxed {
                first_child(ns_pid).ok_or("the instance's command is not running")?
            } else {
                leader
            };
            // The command's own process is in every namespace of its
            // sandbox, and its working directory is the one to start in.
            let ctx = Context::of(main, main)
                .map_err(|e| format!("cannot read the instance's process: {e}"))?;
            Work::Exec {
                ctx,
                command: command.clone(),
                tty: *tty,
                cols: *cols,
                rows: *rows,
            }
        }
        AccessKind::PortForward { port } => Work::Forward {
            ns_pid,
            port: *port,
        },
    })
}

/// A session into a container: a command through the engine's exec (as
/// the container's user, in its working directory, with its environment,
/// which the engine gives an exec), a port through the network namespace
/// of its init process.
fn prepare_container(
    kind: &AccessKind,
    id: String,
    pid: u32,
    engine: bollard::Docker,
) -> Result<Work, String> {
    match kind {
        AccessKind::Exec {
            command,
            tty,
            cols,
            rows,
        } => Ok(Work::ContainerExec {
            engine,
            id,
            command: command.clone(),
            tty: *tty,
            cols: *cols,
            rows: *rows,
        }),
        AccessKind::PortForward { port } => {
            if pid == 0 {
                return Err(
                    "the container engine did not say which process the container runs".to_string(),
                );
            }
            if !rustix::process::geteuid().is_root() {
                return Err(
                    "this node's agent does not run as root, so it cannot enter an instance"
                        .to_string(),
                );
            }
            Ok(Work::Forward {
                ns_pid: pid,
                port: *port,
            })
        }
    }
}

/// What a session inherits from the workload's main process.
#[derive(Debug, Clone)]
pub struct Context {
    /// A process in the workload's namespaces.
    pub ns_pid: u32,
    /// Its uid and gid.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
    /// Its environment.
    pub env: Vec<(OsString, OsString)>,
    /// Its cgroups: a session joins them first, so that what it starts is
    /// held to the workload's limits (memory, CPU, processes).
    pub cgroup: InstanceCgroup,
}

impl Context {
    /// Reads `main`'s user and environment (its working directory is
    /// entered by `nsenter --wd`).
    pub fn of(ns_pid: u32, main: u32) -> std::io::Result<Context> {
        let status = std::fs::read_to_string(format!("/proc/{main}/status"))?;
        let id = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|l| l.split_whitespace().next())
                .and_then(|v| v.parse::<u32>().ok())
                .ok_or_else(|| std::io::Error::other(format!("no {key} in its status")))
        };
        let uid = id("Uid:")?;
        let gid = id("Gid:")?;
        let env = parse_environ(&std::fs::read(format!("/proc/{main}/environ"))?);
        Ok(Context {
            ns_pid,
            uid,
            gid,
            env,
            cgroup: InstanceCgroup::of_process(&Hierarchy::detect(), main),
        })
    }

    /// The program and arguments that run `command` inside the workload,
    /// as its user (see the module).
    pub fn command_line(&self, command: &[String]) -> Vec<OsString> {
        // In the workload's cgroups before anything runs (a shell joins
        // them, then becomes `nsenter`), like the workload itself.
        let (joiner, join_args) = cgroup::join_command(&self.cgroup, program("nsenter"));
        let mut a: Vec<OsString> = vec![joiner];
        a.extend(join_args);
        a.extend([
            format!("--target={}", self.ns_pid).into(),
            "--mount".into(),
            "--uts".into(),
            "--ipc".into(),
            "--net".into(),
            "--pid".into(),
        ]);
        // The target's own working directory, opened through its
        // `/proc/PID/cwd` (a path given here would be opened in the
        // agent's mount namespace, where the sandbox's view of it is not).
        a.push("--wd".into());
        a.extend(
            [
                "--".to_string(),
                program("setpriv").to_string_lossy().into_owned(),
                format!("--reuid={}", self.uid),
                format!("--regid={}", self.gid),
                "--clear-groups".into(),
                "--inh-caps=-all".into(),
                "--bounding-set=-all".into(),
                "--no-new-privs".into(),
                "--".into(),
            ]
            .map(OsString::from),
        );
        a.extend(command.iter().map(OsString::from));
        a
    }
}

/// `NAME=value` pairs of a `/proc/PID/environ`.
fn parse_environ(raw: &[u8]) -> Vec<(OsString, OsString)> {
    raw.split(|b| *b == 0)
        .filter(|v| !v.is_empty())
        .filter_map(|v| {
            let eq = v.iter().position(|b| *b == b'=')?;
            Some((
                OsString::from_vec(v[..eq].to_vec()),
                OsString::from_vec(v[eq + 1..].to_vec()),
            ))
        })
        .collect()
}

/// A program of the host's system directories (which every sandbox shows
/// at the same path), by name when it is not found there.
fn program(name: &str) -> PathBuf {
    ["/usr/bin", "/bin", "/usr/sbin", "/sbin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(name))
}

/// The first child of `pid` (the command a sandbox's init started).
fn first_child(pid: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .ok()?
        .split_whitespace()
        .find_map(|p| p.parse().ok())
}

/// The exit code a shell would report: the code, or 128 + the signal.
fn code_of(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt as _;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(-1)
}

/// Kills `group` (the session's command and whatever it started).
fn kill_group(group: Option<u32>) {
    if let Some(pid) = group.and_then(|p| i32::try_from(p).ok()).filter(|p| *p > 0) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Reads `from` in chunks into `out` as frames made by `frame`.
async fn pump<R: tokio::io::AsyncRead + Unpin>(
    mut from: R,
    frame: fn(Vec<u8>) -> Frame,
    out: mpsc::Sender<Frame>,
) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if out.send(frame(buf[..n].to_vec())).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Sends the command's output to the tenant until the command ended and
/// its output was read (or [`DRAIN_AFTER_EXIT`] passed), killing the
/// command's group when the tenant left first; then the exit code.
async fn finish(
    tx: &mut SessionSender,
    mut out: mpsc::Receiver<Frame>,
    mut child: tokio::process::Child,
    mut tenant_gone: tokio::task::JoinHandle<()>,
) -> Result<i32, String> {
    let group = child.id();
    let mut exit: Option<ExitStatus> = None;
    let mut output_open = true;
    let mut tenant_open = true;
    let mut deadline = Instant::now() + Duration::from_secs(365 * 24 * 3600);
    loop {
        if exit.is_some() && !output_open {
            break;
        }
        tokio::select! {
            f = out.recv(), if output_open => match f {
                Some(f) => {
                    if tx.send(&f).await.is_err() {
                        output_open = false;
                        kill_group(group);
                    }
                }
                None => output_open = false,
            },
            st = child.wait(), if exit.is_none() => {
                let st = st.map_err(|e| format!("cannot wait for the command: {e}"))?;
                exit = Some(st);
                deadline = Instant::now() + DRAIN_AFTER_EXIT;
            },
            _ = &mut tenant_gone, if tenant_open => {
                tenant_open = false;
                kill_group(group);
            },
            () = tokio::time::sleep_until(deadline), if exit.is_some() => break,
        }
    }
    tenant_gone.abort();
    let code = exit.map_or(-1, code_of);
    let _ = tx.send(&Frame::Exit(code)).await;
    Ok(code)
}

/// Runs `command` with pipes: standard input from the tenant, standard
/// output and error back, then the exit code.
async fn exec_pipes(
    tx: &mut SessionSender,
    mut rx: SessionReceiver,
    ctx: &Context,
    command: &[String],
) -> Result<i32, String> {
    let line = ctx.command_line(command);
    let mut child = tokio::process::Command::new(&line[0])
        .args(&line[1..])
        .env_clear()
        .envs(ctx.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start nsenter: {e}"))?;
    let (out_tx, out_rx) = mpsc::channel(16);
    if let Some(stdout) = child.stdout.take() {
        tokio::spawn(pump(stdout, Frame::Stdout, out_tx.clone()));
    }
    if let Some(stderr) = child.stderr.take() {
        tokio::spawn(pump(stderr, Frame::Stderr, out_tx));
    }
    let mut stdin = child.stdin.take();
    let input = tokio::spawn(async move {
        while let Some(Ok(frame)) = rx.recv().await {
            match frame {
                Frame::Stdin(bytes) => {
                    if let Some(s) = stdin.as_mut() {
                        if s.write_all(&bytes).await.is_err() {
                            stdin = None;
                        }
                    }
                }
                Frame::StdinEof => stdin = None,
                _ => {}
            }
        }
    });
    finish(tx, out_rx, child, input).await
}

/// A new pseudo-terminal: the controller and the path of its terminal.
fn open_pty(cols: u16, rows: u16) -> std::io::Result<(OwnedFd, PathBuf)> {
    use rustix::pty::{grantpt, openpt, ptsname, unlockpt, OpenptFlags};
    let controller = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
    grantpt(&controller)?;
    unlockpt(&controller)?;
    let name = ptsname(&controller, Vec::new())?;
    let path = PathBuf::from(OsString::from_vec(name.into_bytes()));
    resize(&controller, cols, rows);
    Ok((controller, path))
}

fn resize(fd: &OwnedFd, cols: u16, rows: u16) {
    if cols == 0 || rows == 0 {
        return;
    }
    let size = rustix::termios::Winsize {
        ws_col: cols,
        ws_row: rows,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let _ = rustix::termios::tcsetwinsize(fd.as_fd(), size);
}

/// Runs `command` on a pseudo-terminal of its own (its controlling
/// terminal, through `setsid --ctty`): the tenant's keystrokes in, the
/// terminal's output back, resizes applied, then the exit code.
async fn exec_tty(
    tx: &mut SessionSender,
    mut rx: SessionReceiver,
    ctx: &Context,
    command: &[String],
    cols: u16,
    rows: u16,
) -> Result<i32, String> {
    let (controller, path) =
        open_pty(cols, rows).map_err(|e| format!("cannot open a terminal: {e}"))?;
    let terminal = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let dup = |f: &std::fs::File| {
        f.try_clone()
            .map_err(|e| format!("cannot share the terminal: {e}"))
    };
    let (stdin, stdout, stderr) = (dup(&terminal)?, dup(&terminal)?, terminal);
    let mut env = ctx.env.clone();
    if !env.iter().any(|(k, _)| k == "TERM") {
        env.push(("TERM".into(), "xterm-256color".into()));
    }
    let line = ctx.command_line(command);
    let child = tokio::process::Command::new(program("setsid"))
        .args(["--ctty", "--wait"])
        .args(&line)
        .env_clear()
        .envs(env)
        .stdin(stdin)
        .stdout(stdout)
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start setsid: {e}"))?;
    // The terminal's fds went to the child (the Command held the last
    // copies and dropped them with the spawn's arguments).
    let reader = std::fs::File::from(
        controller
            .try_clone()
            .map_err(|e| format!("cannot share the terminal: {e}"))?,
    );
    let writer = std::fs::File::from(
        controller
            .try_clone()
            .map_err(|e| format!("cannot share the terminal: {e}"))?,
    );
    let (out_tx, out_rx) = mpsc::channel(16);
    // Blocking reads on threads of their own: a terminal's controller is
    // not something tokio polls. Ends with EIO once every process holding
    // the terminal ended.
    std::thread::spawn(move || {
        use std::io::Read as _;
        let mut reader = reader;
        let mut buf = vec![0u8; CHUNK];
        loop {
            match reader.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if out_tx
                        .blocking_send(Frame::Stdout(buf[..n].to_vec()))
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
    });
    let (in_tx, mut in_rx) = mpsc::channel::<Vec<u8>>(16);
    std::thread::spawn(move || {
        use std::io::Write as _;
        let mut writer = writer;
        while let Some(bytes) = in_rx.blocking_recv() {
            if writer.write_all(&bytes).is_err() {
                return;
            }
        }
    });
    let input = tokio::spawn(async move {
        while let Some(Ok(frame)) = rx.recv().await {
            match frame {
                Frame::Stdin(bytes) => {
                    let sent = in_tx.send(bytes).await;
                    if sent.is_err() {
                        break;
                    }
                }
                Frame::Resize { cols, rows } => resize(&controller, cols, rows),
                // End of input on a terminal is the tenant's ^D, sent as a
                // keystroke; a closed input just stops the keystrokes.
                _ => {}
            }
        }
    });
    finish(tx, out_rx, child, input).await
}

/// Runs `command` in container `id` through the engine's exec, attached:
/// standard input in, output back (one terminal stream with `tty`),
/// resizes applied, then the exit code the engine recorded.
async fn exec_container(
    tx: &mut SessionSender,
    mut rx: SessionReceiver,
    engine: &bollard::Docker,
    id: &str,
    command: Vec<String>,
    tty: bool,
    (cols, rows): (u16, u16),
) -> Result<i32, String> {
    use bollard::container::LogOutput;
    use bollard::exec::{CreateExecOptions, ResizeExecOptions, StartExecOptions, StartExecResults};
    use futures::StreamExt as _;
    let exec = engine
        .create_exec(
            id,
            CreateExecOptions::<String> {
                attach_stdin: Some(true),
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                tty: Some(tty),
                cmd: Some(command),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| format!("the container engine refused the command: {e}"))?
        .id;
    let started = engine
        .start_exec(
            &exec,
            Some(StartExecOptions {
                detach: false,
                tty,
                output_capacity: None,
            }),
        )
        .await
        .map_err(|e| format!("the container engine cannot start the command: {e}"))?;
    let StartExecResults::Attached {
        mut output,
        mut input,
    } = started
    else {
        return Err("the container engine started the command detached".to_string());
    };
    if tty && cols > 0 && rows > 0 {
        let _ = engine
            .resize_exec(
                &exec,
                ResizeExecOptions {
                    height: rows,
                    width: cols,
                },
            )
            .await;
    }
    let resizer = engine.clone();
    let exec_id = exec.clone();
    let input_task = tokio::spawn(async move {
        while let Some(Ok(frame)) = rx.recv().await {
            match frame {
                Frame::Stdin(bytes) => {
                    if input.write_all(&bytes).await.is_err() {
                        return;
                    }
                    let _ = input.flush().await;
                }
                Frame::StdinEof => {
                    let _ = input.shutdown().await;
                }
                Frame::Resize { cols, rows } => {
                    let _ = resizer
                        .resize_exec(
                            &exec_id,
                            ResizeExecOptions {
                                height: rows,
                                width: cols,
                            },
                        )
                        .await;
                }
                _ => {}
            }
        }
    });
    while let Some(item) = output.next().await {
        let frame = match item {
            Ok(LogOutput::StdOut { message } | LogOutput::Console { message }) => {
                Frame::Stdout(message.to_vec())
            }
            Ok(LogOutput::StdErr { message }) => Frame::Stderr(message.to_vec()),
            Ok(LogOutput::StdIn { .. }) => continue,
            Err(_) => break,
        };
        if tx.send(&frame).await.is_err() {
            break;
        }
    }
    input_task.abort();
    let code = engine
        .inspect_exec(&exec)
        .await
        .ok()
        .and_then(|i| i.exit_code)
        .and_then(|c| i32::try_from(c).ok())
        .unwrap_or(-1);
    let _ = tx.send(&Frame::Exit(code)).await;
    Ok(code)
}

/// Connects to `127.0.0.1:port` inside `ns_pid`'s network namespace, from
/// a thread of its own moved there (the socket stays in that namespace;
/// the thread ends with the connection made).
fn connect_inside(ns_pid: u32, port: u16) -> std::io::Result<std::net::TcpStream> {
    let ns = std::fs::File::open(format!("/proc/{ns_pid}/ns/net"))?;
    std::thread::spawn(move || {
        rustix::thread::move_into_link_name_space(
            ns.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )?;
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let stream = std::net::TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)?;
        stream.set_nonblocking(true)?;
        Ok(stream)
    })
    .join()
    .map_err(|_| std::io::Error::other("the connecting thread failed"))?
}

/// Forwards the session to `port` inside the instance until both sides
/// ended.
async fn forward(
    tx: &mut SessionSender,
    mut rx: SessionReceiver,
    ns_pid: u32,
    port: u16,
) -> Result<i32, String> {
    let stream = tokio::task::spawn_blocking(move || connect_inside(ns_pid, port))
        .await
        .map_err(|e| format!("cannot connect: {e}"))?
        .map_err(|e| format!("cannot connect to port {port} inside the instance: {e}"))?;
    let stream = tokio::net::TcpStream::from_std(stream)
        .map_err(|e| format!("cannot connect to port {port} inside the instance: {e}"))?;
    let (mut read, mut write) = stream.into_split();
    let input = tokio::spawn(async move {
        while let Some(Ok(frame)) = rx.recv().await {
            match frame {
                Frame::Stdin(bytes) => {
                    let written = write.write_all(&bytes).await;
                    if written.is_err() {
                        return;
                    }
                }
                Frame::StdinEof => {
                    let _ = write.shutdown().await;
                }
                _ => {}
            }
        }
    });
    let mut buf = vec![0u8; CHUNK];
    loop {
        match read.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if tx.send(&Frame::Stdout(buf[..n].to_vec())).await.is_err() {
                    break;
                }
            }
        }
    }
    input.abort();
    let _ = tx.send(&Frame::Exit(0)).await;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environments_are_read_whole() {
        let env = parse_environ(b"PATH=/usr/bin\0A=b=c\0EMPTY=\0\0junk\0");
        assert_eq!(
            env,
            vec![
                ("PATH".into(), "/usr/bin".into()),
                ("A".into(), "b=c".into()),
                ("EMPTY".into(), "".into()),
            ]
        );
    }

    #[test]
    fn the_command_enters_every_namespace_and_drops_to_the_user() {
        let ctx = Context {
            ns_pid: 42,
            uid: 2_000_000_001,
            gid: 2_000_000_001,
            env: vec![],
            cgroup: InstanceCgroup::None,
        };
        let line: Vec<String> = ctx
            .command_line(&["id".into(), "-u".into()])
            .into_iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        assert!(line[0].ends_with("nsenter"), "{line:?}");
        for want in [
            "--target=42",
            "--mount",
            "--pid",
            "--net",
            "--ipc",
            "--uts",
            "--wd",
            "--reuid=2000000001",
            "--regid=2000000001",
            "--clear-groups",
            "--no-new-privs",
        ] {
            assert!(line.iter().any(|a| a == want), "{want} in {line:?}");
        }
        assert_eq!(&line[line.len() - 2..], ["id", "-u"]);
    }

    #[test]
    fn exit_codes_are_a_shells() {
        use std::os::unix::process::ExitStatusExt as _;
        assert_eq!(code_of(ExitStatus::from_raw(7 << 8)), 7);
        assert_eq!(code_of(ExitStatus::from_raw(9)), 137);
    }
}
