//! `flotilla exec`, `flotilla shell` and `flotilla port-forward`: sessions
//! into a running instance over the API's WebSockets (see
//! `docs/access.md`). The command runs inside the instance as its
//! workload's user; this side only carries bytes and the exit code.

use std::io::Write as _;
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context as _, Result};
use flotilla_client::{Session, SessionReceiver, SessionSender};
use flotilla_core::access::{parse_port_pair, AccessKind, Frame, DEFAULT_SHELL};
use flotilla_core::id::InstanceId;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::mpsc;

use crate::ctx::Ctx;

pub(crate) fn instance(id: &str) -> Result<InstanceId> {
    InstanceId::parse(id.trim(), "id").map_err(|e| anyhow!("{}: {}", e.field, e.message))
}

/// The exit code of the command, as this process's (its low 8 bits, as a
/// shell sees them).
fn exit_code(code: i32) -> ExitCode {
    ExitCode::from((code & 0xff) as u8)
}

/// How long `exec`, `shell` and `port-forward` wait for an instance that
/// is still on its way (pending, scheduled, starting) to run: an image
/// pull can take minutes; Ctrl-C gives up sooner.
const START_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

/// Waits until `id` runs: a session right after `run --detach` (a script,
/// the README's quick start) would otherwise meet a `scheduled` instance.
/// An instance that ended, or is lost, is an error at once.
pub(crate) async fn until_running(ctx: &Ctx, id: &InstanceId) -> Result<()> {
    let deadline = tokio::time::Instant::now() + START_WAIT;
    let mut said = false;
    loop {
        let inst = ctx
            .client
            .instance(id.as_str())
            .await
            .with_context(|| format!("cannot enter {id}"))?;
        let state = inst.state.as_str();
        match state {
            "running" => return Ok(()),
            "pending" | "scheduled" | "starting" if tokio::time::Instant::now() < deadline => {
                if !said {
                    eprintln!("waiting for {id} to start ({state})");
                    said = true;
                }
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
            _ => bail!("instance {id} is {state}, not running"),
        }
    }
}

/// `flotilla exec ID [-i] [-t] -- CMD…`.
pub async fn exec(
    ctx: &Ctx,
    id: &str,
    command: Vec<String>,
    stdin: bool,
    tty: bool,
) -> Result<ExitCode> {
    let id = instance(id)?;
    until_running(ctx, &id).await?;
    let (cols, rows) = if tty { terminal_size() } else { (0, 0) };
    let kind = AccessKind::Exec {
        command,
        tty,
        cols,
        rows,
    };
    let session = ctx
        .client
        .exec(id.as_str(), &kind)
        .await
        .with_context(|| format!("cannot enter {id}"))?;
    let _raw = if tty { RawMode::enter() } else { None };
    attach(session, stdin || tty, tty).await
}

/// `flotilla shell ID [-- CMD…]`: an interactive terminal in the instance.
pub async fn shell(ctx: &Ctx, id: &str, command: Vec<String>) -> Result<ExitCode> {
    let command = if command.is_empty() {
        DEFAULT_SHELL.iter().map(|s| s.to_string()).collect()
    } else {
        command
    };
    exec(ctx, id, command, true, true).await
}

/// Carries this terminal (or standard input and output) to the session
/// and the session's output back, until it reports the exit code.
async fn attach(session: Session, stdin: bool, tty: bool) -> Result<ExitCode> {
    let (tx, mut rx) = session.split();
    let (frames, outgoing) = mpsc::channel::<Frame>(16);
    let writer = tokio::spawn(send_all(tx, outgoing));
    if stdin {
        tokio::spawn(read_stdin(frames.clone(), !tty));
    } else {
        let _ = frames.send(Frame::StdinEof).await;
    }
    if tty {
        tokio::spawn(forward_resizes(frames.clone()));
    }
    drop(frames);
    let result = receive(&mut rx).await;
    writer.abort();
    result
}

async fn send_all(mut tx: SessionSender, mut frames: mpsc::Receiver<Frame>) {
    while let Some(f) = frames.recv().await {
        if tx.send(&f).await.is_err() {
            return;
        }
    }
}

/// Standard input as frames; its end as [`Frame::StdinEof`] when `eof`
/// (a terminal's end of input is a keystroke, sent as one).
async fn read_stdin(frames: mpsc::Sender<Frame>, eof: bool) {
    let mut stdin = tokio::io::stdin();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match stdin.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if frames.send(Frame::Stdin(buf[..n].to_vec())).await.is_err() {
                    return;
                }
            }
        }
    }
    if eof {
        let _ = frames.send(Frame::StdinEof).await;
    }
}

/// Sends the terminal's size each time it changes (SIGWINCH).
async fn forward_resizes(frames: mpsc::Sender<Frame>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut changes) = signal(SignalKind::window_change()) else {
        return;
    };
    while changes.recv().await.is_some() {
        let (cols, rows) = terminal_size();
        if frames.send(Frame::Resize { cols, rows }).await.is_err() {
            return;
        }
    }
}

/// Writes the session's output until its exit code (or its error).
async fn receive(rx: &mut SessionReceiver) -> Result<ExitCode> {
    let mut stdout = tokio::io::stdout();
    let mut stderr = tokio::io::stderr();
    while let Some(frame) = rx.recv().await {
        match frame? {
            Frame::Stdout(b) => {
                stdout.write_all(&b).await?;
                stdout.flush().await?;
            }
            Frame::Stderr(b) => {
                stderr.write_all(&b).await?;
                stderr.flush().await?;
            }
            Frame::Exit(code) => return Ok(exit_code(code)),
            Frame::Error(message) => bail!("{message}"),
            Frame::Stdin(_) | Frame::StdinEof | Frame::Resize { .. } => {}
        }
    }
    bail!("the session ended before the command did")
}

/// This terminal's size (80×24 when standard input is not one).
fn terminal_size() -> (u16, u16) {
    match rustix::termios::tcgetwinsize(rustix::stdio::stdin()) {
        Ok(w) if w.ws_col > 0 && w.ws_row > 0 => (w.ws_col, w.ws_row),
        _ => (80, 24),
    }
}

/// This terminal in raw mode (keystrokes go through as typed, ^C
/// included, to the instance's terminal), restored when dropped.
struct RawMode {
    saved: rustix::termios::Termios,
}

impl RawMode {
    /// `None` when standard input is not a terminal.
    fn enter() -> Option<RawMode> {
        use rustix::termios::{tcgetattr, tcsetattr, OptionalActions};
        let fd = rustix::stdio::stdin();
        let saved = tcgetattr(fd).ok()?;
        let mut raw = saved.clone();
        raw.make_raw();
        tcsetattr(fd, OptionalActions::Now, &raw).ok()?;
        Some(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        use rustix::termios::{tcsetattr, OptionalActions};
        let _ = tcsetattr(rustix::stdio::stdin(), OptionalActions::Now, &self.saved);
    }
}

/// `flotilla port-forward ID LOCAL:REMOTE`: listens on 127.0.0.1:LOCAL and
/// carries each connection to REMOTE inside the instance, until stopped.
pub async fn port_forward(ctx: &Ctx, id: &str, ports: &str) -> Result<ExitCode> {
    let id = instance(id)?;
    let (local, remote) =
        parse_port_pair(ports).map_err(|e| anyhow!("{}: {}", e.field, e.message))?;
    // Fails early for an instance the key cannot enter or that ended, and
    // waits for one still starting (the session itself is opened per
    // connection).
    until_running(ctx, &id).await?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", local))
        .await
        .with_context(|| format!("cannot listen on 127.0.0.1:{local}"))?;
    eprintln!("forwarding 127.0.0.1:{local} to port {remote} of {id}");
    let _ = std::io::stderr().flush();
    loop {
        let (conn, _) = listener.accept().await?;
        let client = ctx.client.clone();
        let id = id.clone();
        tokio::spawn(async move {
            if let Err(e) = forward_one(&client, &id, remote, conn).await {
                eprintln!("error: port {remote} of {id}: {}", crate::error_line(&e));
            }
        });
    }
}

async fn forward_one(
    client: &flotilla_client::Client,
    id: &InstanceId,
    port: u16,
    conn: tokio::net::TcpStream,
) -> Result<()> {
    let session = client.port_forward(id.as_str(), port).await?;
    let (mut tx, mut rx) = session.split();
    let (mut read, mut write) = conn.into_split();
    let up = tokio::spawn(async move {
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            match read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send(&Frame::Stdin(buf[..n].to_vec())).await.is_err() {
                        return;
                    }
                }
            }
        }
        let _ = tx.send(&Frame::StdinEof).await;
    });
    let mut result = Ok(());
    while let Some(frame) = rx.recv().await {
        match frame? {
            Frame::Stdout(b) => {
                let written = write.write_all(&b).await;
                if written.is_err() {
                    break;
                }
            }
            Frame::Error(message) => {
                result = Err(anyhow!("{message}"));
                break;
            }
            Frame::Exit(_) => break,
            _ => {}
        }
    }
    let _ = write.shutdown().await;
    up.abort();
    result
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use crate::{Cli, Command};

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("flotilla").chain(args.iter().copied()))
    }

    #[test]
    fn exec_takes_the_command_after_the_separator() {
        let cli = parse(&["exec", "-it", "inst_1", "--", "ls", "-la"]).unwrap();
        let Command::Exec {
            id,
            stdin,
            tty,
            command,
        } = cli.command
        else {
            panic!("not exec")
        };
        assert_eq!(id, "inst_1");
        assert!(stdin && tty);
        assert_eq!(command, ["ls", "-la"]);
        assert!(parse(&["exec", "inst_1"]).is_err(), "a command is required");
    }

    #[test]
    fn shell_and_port_forward_parse() {
        let cli = parse(&["shell", "inst_1"]).unwrap();
        assert!(matches!(cli.command, Command::Shell { ref command, .. } if command.is_empty()));
        let cli = parse(&["port-forward", "inst_1", "8888:8080"]).unwrap();
        assert!(
            matches!(cli.command, Command::PortForward { ref ports, .. } if ports == "8888:8080")
        );
    }

    #[test]
    fn exit_codes_keep_their_low_byte() {
        assert_eq!(super::exit_code(7), std::process::ExitCode::from(7));
        assert_eq!(super::exit_code(256 + 3), std::process::ExitCode::from(3));
    }
}
