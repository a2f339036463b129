//! The SSH endpoint: `GET /v1/instances/{id}/ssh` upgrades to a WebSocket
//! whose binary messages carry the bytes of one SSH connection, and this
//! module is that connection's SSH server. `flotilla ssh ID` pipes them
//! between `ssh` and the WebSocket as the client's `ProxyCommand`, so
//! `ssh`, `scp`, `sftp` and VS Code Remote reach an instance with the API
//! key and a registered SSH key, and nothing else.
//!
//! Why the control plane terminates SSH, rather than an sshd per instance:
//! keys are checked in one place, against the tenant's registry as it is
//! at each login (a removed key stops working at once); nothing listens
//! inside instances or on nodes; and agents keep never accepting a
//! connection (they dial out for every session, see [`crate::access`]).
//! Each SSH channel becomes one ordinary access session (a command, a
//! shell, the sftp server or a TCP stream to the instance's loopback), run
//! by the agent exactly as `flotilla exec` and `flotilla port-forward` are:
//! in the instance's sandbox or container, as its user, within its limits.
//!
//! The host key is an ed25519 key derived from the server's secrets key
//! ([`flotilla_store::secrets::SecretKey::derive`]): the same after a
//! restart and on every replica sharing the secrets key, so `known_hosts`
//! stays valid, and stored nowhere. It changes only with the secrets key.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{Message, WebSocket};
use flotilla_core::access::{AccessKind, Frame, DEFAULT_SHELL};
use flotilla_core::id::{InstanceId, TenantId};
use flotilla_core::FieldError;
use futures::{SinkExt as _, StreamExt as _};
use russh::keys::ssh_key::{self, HashAlg};
use russh::server::{Auth, ChannelOpenHandle, Msg, PublicKeyOffer, Session, VerifiedPublicKey};
use russh::{Channel, ChannelId, ChannelMsg, ChannelOpenFailure, MethodKind, MethodSet, Pty};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::access::{running_node, NOT_DIALLED};
use crate::error::ApiError;
use crate::state::AppState;

/// What the host key is derived for (changing it changes every
/// control plane's host key).
const HOST_KEY_PURPOSE: &str = "flotilla ssh host key v1";

/// The sftp server inside the instance: OpenSSH's, where the image has it
/// (Debian and Ubuntu, Fedora and RHEL, Arch, Alpine put it in these).
/// `exec` that fails ends a non-interactive `sh`, so each path is tested
/// before it is run.
const SFTP_SERVER: &str = "for p in /usr/lib/openssh/sftp-server /usr/libexec/openssh/sftp-server \
     /usr/lib/ssh/sftp-server /usr/libexec/sftp-server; do \
     [ -x \"$p\" ] && exec \"$p\"; done; \
     echo 'this instance has no sftp-server (install openssh-sftp-server, or use scp -O)' >&2; exit 127";

/// Bytes buffered between the WebSocket and the SSH server.
const PIPE_BYTES: usize = 256 * 1024;

/// Key algorithms accepted for registration: those this server verifies.
const ACCEPTED: &str = "ssh-ed25519, ecdsa-sha2-nistp256/384/521 or ssh-rsa";

/// A public key line, parsed: what the store keeps of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedKey {
    /// `ssh-ed25519`, `ecdsa-sha2-nistp256`, `ssh-rsa`.
    pub algorithm: String,
    /// `SHA256:…`, as `ssh-keygen -l` shows it.
    pub fingerprint: String,
    /// `ALGORITHM BASE64`, without the comment.
    pub public_key: String,
    /// The comment (often `user@host`), empty when there is none.
    pub comment: String,
}

/// Parses an OpenSSH public key line (`ssh-ed25519 AAAA… comment`); the
/// error names `public_key` and says what is expected.
pub fn parse_public_key(line: &str) -> Result<ParsedKey, FieldError> {
    let line = line.trim();
    let key = ssh_key::PublicKey::from_openssh(line).map_err(|_| {
        FieldError::new(
            "public_key",
            "is not an OpenSSH public key: give the line of a `.pub` file, such as `ssh-ed25519 AAAA… you@host`",
        )
    })?;
    let algorithm = key.algorithm();
    if !matches!(
        algorithm,
        ssh_key::Algorithm::Ed25519
            | ssh_key::Algorithm::Ecdsa { .. }
            | ssh_key::Algorithm::Rsa { .. }
    ) {
        return Err(FieldError::new(
            "public_key",
            format!(
                "{} keys are not accepted; use {ACCEPTED}",
                algorithm.as_str()
            ),
        ));
    }
    let mut words = line.split_whitespace();
    let (kind, body) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    Ok(ParsedKey {
        algorithm: algorithm.as_str().to_string(),
        fingerprint: key.fingerprint(HashAlg::Sha256).to_string(),
        public_key: format!("{kind} {body}"),
        comment: words.collect::<Vec<_>>().join(" "),
    })
}

/// The control plane's SSH host key (see the module); 503 on a server
/// without a secrets key.
pub fn host_key(st: &AppState) -> Result<ssh_key::PrivateKey, ApiError> {
    let seed = st.secret_key()?.derive(HOST_KEY_PURPOSE);
    Ok(host_key_from_seed(&seed))
}

fn host_key_from_seed(seed: &[u8; 32]) -> ssh_key::PrivateKey {
    ssh_key::PrivateKey::from(ssh_key::private::Ed25519Keypair::from_seed(seed))
}

/// The SSH server's settings: public keys only, no idle limit (an editor's
/// remote session may sit idle for hours) but keepalives, so a client that
/// vanished is noticed within two minutes.
fn config(host_key: ssh_key::PrivateKey) -> russh::server::Config {
    russh::server::Config {
        server_id: russh::SshId::Standard("SSH-2.0-flotilla".into()),
        methods: MethodSet::from(&[MethodKind::PublicKey][..]),
        auth_rejection_time: Duration::from_secs(1),
        // The "none" probe every client starts with is refused at once.
        auth_rejection_time_initial: Some(Duration::ZERO),
        keys: vec![host_key],
        inactivity_timeout: None,
        keepalive_interval: Some(Duration::from_secs(30)),
        keepalive_max: 4,
        ..Default::default()
    }
}

/// One instance as the SSH connection reaches it: whose keys let in, and
/// how each channel enters it.
#[derive(Clone)]
pub struct Door {
    st: AppState,
    tenant: TenantId,
    instance: InstanceId,
    /// The fingerprint of the key that logged in, for the log.
    key: Arc<str>,
}

impl Door {
    /// The door into `instance`, which belongs to `tenant`.
    pub fn new(st: AppState, tenant: TenantId, instance: InstanceId) -> Door {
        Door {
            st,
            tenant,
            instance,
            key: Arc::from(""),
        }
    }

    /// Whether `key` is one of the tenant's registered keys now.
    async fn lets_in(&self, key: &ssh_key::PublicKey) -> bool {
        let fingerprint = key.fingerprint(HashAlg::Sha256).to_string();
        match self
            .st
            .store()
            .ssh_key_by_fingerprint(&self.tenant, &fingerprint)
            .await
        {
            Ok(found) => found.is_some(),
            Err(e) => {
                tracing::warn!(error = %e, instance = %self.instance, "ssh: reading the tenant's keys failed");
                false
            }
        }
    }

    /// Opens a session of `kind` into the instance, as exec does: the
    /// agent's WebSocket, or what to tell the client.
    async fn enter(&self, kind: AccessKind) -> Result<WebSocket, String> {
        kind.validate()
            .map_err(|e| format!("{}: {}", e.field, e.message))?;
        // Read again for each channel: the instance may have ended since
        // the connection was opened.
        let inst = self
            .st
            .store()
            .instance(&self.instance)
            .await
            .map_err(|e| format!("cannot read instance {}: {e}", self.instance))?;
        let node = running_node(&inst)?;
        let name = kind.name();
        let dialling = self
            .st
            .access()
            .enter(node, inst.id, kind, self.st.ids(), || {
                self.st.notify_change()
            });
        tracing::info!(session = %dialling.id, instance = %self.instance, ssh_key = %self.key, kind = name, "ssh channel opened");
        dialling
            .agent(self.st.access())
            .await
            .ok_or_else(|| NOT_DIALLED.to_string())
    }
}

/// Serves the SSH connection whose bytes `socket` carries, until either
/// side ends it.
pub async fn serve(door: Door, host_key: ssh_key::PrivateKey, socket: WebSocket) {
    let (ours, theirs) = tokio::io::duplex(PIPE_BYTES);
    let instance = door.instance.clone();
    let server = async move {
        let handler = Connection { door };
        match russh::server::run_stream(Arc::new(config(host_key)), theirs, handler).await {
            Ok(running) => {
                if let Err(e) = running.await {
                    tracing::debug!(error = %e, instance = %instance, "ssh connection ended");
                }
            }
            Err(e) => tracing::debug!(error = %e, instance = %instance, "ssh handshake failed"),
        }
    };
    tokio::join!(server, pump(socket, ours));
}

/// Carries the WebSocket's binary messages into `pipe` and what comes out
/// of `pipe` back as binary messages. The SSH server's end of the pipe
/// closing (the connection ended) closes the WebSocket; the WebSocket
/// closing ends the pipe's input, which ends the connection.
async fn pump(socket: WebSocket, pipe: tokio::io::DuplexStream) {
    let (mut ws_tx, mut ws_rx) = socket.split();
    let (mut from_server, mut to_server) = tokio::io::split(pipe);
    let up = tokio::spawn(async move {
        while let Some(Ok(m)) = ws_rx.next().await {
            match m {
                Message::Binary(b) => {
                    if to_server.write_all(&b).await.is_err() {
                        break;
                    }
                }
                Message::Close(_) => break,
                Message::Text(_) | Message::Ping(_) | Message::Pong(_) => {}
            }
        }
        let _ = to_server.shutdown().await;
    });
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        match from_server.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let chunk = bytes::Bytes::copy_from_slice(&buf[..n]);
                if ws_tx.send(Message::Binary(chunk)).await.is_err() {
                    break;
                }
            }
        }
    }
    let _ = ws_tx.close().await;
    // The connection is over: a client that keeps its WebSocket open has
    // nothing more to send to.
    up.abort();
}

/// One SSH connection's handler (russh makes one per connection).
struct Connection {
    door: Door,
}

impl russh::server::Handler for Connection {
    type Error = russh::Error;

    // Only keys of the instance's tenant go on to the signature check.
    async fn auth_publickey_offered(
        &mut self,
        _user: &str,
        offer: PublicKeyOffer<'_>,
    ) -> Result<Auth, Self::Error> {
        Ok(if self.door.lets_in(offer.public_key).await {
            Auth::Accept
        } else {
            Auth::reject()
        })
    }

    // Checked again once the client proved it holds the key (it may have
    // skipped the offer, or the key may have been removed meanwhile).
    async fn auth_publickey(
        &mut self,
        user: &str,
        key: VerifiedPublicKey<'_>,
    ) -> Result<Auth, Self::Error> {
        let fingerprint = key.public_key.fingerprint(HashAlg::Sha256).to_string();
        if self.door.lets_in(key.public_key).await {
            tracing::info!(instance = %self.door.instance, ssh_key = %fingerprint, user, "ssh login");
            self.door.key = Arc::from(fingerprint.as_str());
            Ok(Auth::Accept)
        } else {
            tracing::info!(instance = %self.door.instance, ssh_key = %fingerprint, "ssh login refused: the key is not registered for the instance's tenant");
            Ok(Auth::reject())
        }
    }

    async fn channel_open_session(
        &mut self,
        channel: Channel<Msg>,
        reply: ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        reply.accept().await;
        tokio::spawn(session_channel(self.door.clone(), channel));
        Ok(())
    }

    // `ssh -L` and editors' port forwards: to the instance's own loopback
    // only (the agent connects to 127.0.0.1 inside its network namespace;
    // another host would be a way out of the instance's network).
    async fn channel_open_direct_tcpip(
        &mut self,
        channel: Channel<Msg>,
        host_to_connect: &str,
        port_to_connect: u32,
        _originator_address: &str,
        _originator_port: u32,
        reply: ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        match forward_target(host_to_connect, port_to_connect) {
            Some(port) => {
                reply.accept().await;
                tokio::spawn(forward_channel(self.door.clone(), channel, port));
            }
            None => {
                tracing::info!(instance = %self.door.instance, host = host_to_connect, port = port_to_connect, "ssh forward refused: not the instance's loopback");
                reply
                    .reject(ChannelOpenFailure::AdministrativelyProhibited)
                    .await;
            }
        }
        Ok(())
    }

    // The requests below are carried out by the channel's task, which
    // sees them too; here they are only answered.
    async fn pty_request(
        &mut self,
        channel: ChannelId,
        _term: &str,
        _col_width: u32,
        _row_height: u32,
        _pix_width: u32,
        _pix_height: u32,
        _modes: &[(Pty, u32)],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_success(channel)
    }

    async fn shell_request(
        &mut self,
        channel: ChannelId,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_success(channel)
    }

    async fn exec_request(
        &mut self,
        channel: ChannelId,
        _data: &[u8],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_success(channel)
    }

    async fn subsystem_request(
        &mut self,
        channel: ChannelId,
        name: &str,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        if name == "sftp" {
            session.channel_success(channel)
        } else {
            session.channel_failure(channel)
        }
    }

    async fn window_change_request(
        &mut self,
        channel: ChannelId,
        _col_width: u32,
        _row_height: u32,
        _pix_width: u32,
        _pix_height: u32,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_success(channel)
    }

    // A session runs with the workload's environment, not the client's.
    async fn env_request(
        &mut self,
        channel: ChannelId,
        _variable_name: &str,
        _variable_value: &str,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_failure(channel)
    }
}

/// The port of a direct-tcpip target that is the instance's loopback.
fn forward_target(host: &str, port: u32) -> Option<u16> {
    let loopback = matches!(
        host.to_ascii_lowercase().as_str(),
        "localhost" | "127.0.0.1" | "::1" | "[::1]"
    );
    u16::try_from(port).ok().filter(|p| loopback && *p != 0)
}

/// A terminal size from the client's (0: not given, 80×24).
fn size(cols: u32, rows: u32) -> (u16, u16) {
    let fit = |v: u32, default: u16| match u16::try_from(v) {
        Ok(0) => default,
        Ok(v) => v,
        Err(_) => u16::MAX,
    };
    (fit(cols, 80), fit(rows, 24))
}

/// What a session channel asked to run: the command and, with a
/// pseudo-terminal, its size.
fn requested(command: Vec<String>, pty: Option<(u16, u16)>) -> AccessKind {
    let (cols, rows) = pty.unwrap_or((0, 0));
    AccessKind::Exec {
        command,
        tty: pty.is_some(),
        cols,
        rows,
    }
}

/// A session channel: waits for what to run (a command, a shell, the
/// sftp subsystem), then runs it as an access session and carries its
/// input, output and exit status.
async fn session_channel(door: Door, mut channel: Channel<Msg>) {
    let mut pty: Option<(u16, u16)> = None;
    let kind = loop {
        match channel.wait().await {
            Some(ChannelMsg::RequestPty {
                col_width,
                row_height,
                ..
            }) => pty = Some(size(col_width, row_height)),
            Some(ChannelMsg::WindowChange {
                col_width,
                row_height,
                ..
            }) if pty.is_some() => pty = Some(size(col_width, row_height)),
            // ssh sends a command as one string, for the login shell.
            Some(ChannelMsg::Exec { command, .. }) => {
                let line = String::from_utf8_lossy(&command).into_owned();
                break requested(vec!["sh".into(), "-c".into(), line], pty);
            }
            Some(ChannelMsg::RequestShell { .. }) => {
                break requested(DEFAULT_SHELL.iter().map(|s| s.to_string()).collect(), pty)
            }
            Some(ChannelMsg::RequestSubsystem { name, .. }) if name == "sftp" => {
                let command = vec!["sh".into(), "-c".into(), SFTP_SERVER.into()];
                break requested(command, None);
            }
            Some(ChannelMsg::Close) | None => return,
            Some(_) => {}
        }
    };
    match door.enter(kind).await {
        Ok(agent) => bridge(channel, agent, true).await,
        Err(why) => {
            let _ = channel
                .extended_data_bytes(1, format!("flotilla: {why}\r\n").into_bytes())
                .await;
            let _ = channel.eof().await;
            let _ = channel.exit_status(255).await;
            let _ = channel.close().await;
        }
    }
}

/// A direct-tcpip channel: a TCP stream to `port` on the instance's
/// loopback, as `flotilla port-forward` opens one.
async fn forward_channel(door: Door, channel: Channel<Msg>, port: u16) {
    match door.enter(AccessKind::PortForward { port }).await {
        Ok(agent) => bridge(channel, agent, false).await,
        Err(why) => {
            tracing::info!(instance = %door.instance, port, why, "ssh forward failed");
            let _ = channel.close().await;
        }
    }
}

/// Carries a channel's input to the agent's session as frames, and the
/// session's frames back: output as data, error output as extended data
/// 1, and for a `command` channel the exit code as its exit status (255
/// with the message on error output when the session failed).
async fn bridge(channel: Channel<Msg>, agent: WebSocket, command: bool) {
    let (mut from_client, to_client) = channel.split();
    let (mut agent_tx, mut agent_rx) = agent.split();
    let up = tokio::spawn(async move {
        while let Some(msg) = from_client.wait().await {
            let frame = match msg {
                ChannelMsg::Data { data } => Frame::Stdin(data.to_vec()),
                ChannelMsg::Eof => Frame::StdinEof,
                ChannelMsg::WindowChange {
                    col_width,
                    row_height,
                    ..
                } => {
                    let (cols, rows) = size(col_width, row_height);
                    Frame::Resize { cols, rows }
                }
                ChannelMsg::Close => break,
                _ => continue,
            };
            if agent_tx
                .send(Message::Binary(frame.encode().into()))
                .await
                .is_err()
            {
                break;
            }
        }
        // The client closed the channel (or the connection ended): the
        // agent ends the session.
        let _ = agent_tx.close().await;
    });
    let mut status = None;
    while let Some(Ok(m)) = agent_rx.next().await {
        let bytes = match m {
            Message::Binary(b) => b,
            Message::Close(_) => break,
            Message::Text(_) | Message::Ping(_) | Message::Pong(_) => continue,
        };
        let sent = match Frame::decode(&bytes) {
            Ok(Frame::Stdout(b)) => to_client.data_bytes(b).await,
            Ok(Frame::Stderr(b)) if command => to_client.extended_data_bytes(1, b).await,
            Ok(Frame::Exit(code)) => {
                // 128 + N for signal N, as a shell reports it.
                status = Some(u32::try_from(code).unwrap_or(255));
                break;
            }
            Ok(Frame::Error(message)) => {
                if command {
                    let line = format!("flotilla: {message}\r\n");
                    let _ = to_client.extended_data_bytes(1, line.into_bytes()).await;
                }
                status = Some(255);
                break;
            }
            Ok(_) => Ok(()),
            Err(e) => {
                tracing::warn!(error = %e, "ssh: a bad frame from the agent");
                break;
            }
        };
        if sent.is_err() {
            break;
        }
    }
    let _ = to_client.eof().await;
    if command {
        // A session that ended without its exit code (the agent went
        // away) fails, as ssh reports a lost connection.
        let _ = to_client.exit_status(status.unwrap_or(255)).await;
    }
    let _ = to_client.close().await;
    up.abort();
}

#[cfg(test)]
mod tests {
    use super::*;

    const ED25519: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID6EQuz9BKYfcxIS24MSilJMFVF5QnBpeo7SHdQhY7fS me@laptop";

    #[test]
    fn a_public_key_line_is_parsed_with_its_fingerprint() {
        let k = parse_public_key(&format!("  {ED25519}\n")).unwrap();
        assert_eq!(k.algorithm, "ssh-ed25519");
        // As `ssh-keygen -lf` prints it.
        assert_eq!(
            k.fingerprint,
            "SHA256:G/F2AZvPkuSOuONyZkyISon6Kvy7jpOxTuquKWJuSWU"
        );
        assert_eq!(
            k.public_key,
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID6EQuz9BKYfcxIS24MSilJMFVF5QnBpeo7SHdQhY7fS"
        );
        assert_eq!(k.comment, "me@laptop");
        // The comment does not change the key.
        let bare = parse_public_key(&k.public_key).unwrap();
        assert_eq!(bare.fingerprint, k.fingerprint);
        assert_eq!(bare.comment, "");
    }

    #[test]
    fn garbage_and_private_keys_are_refused_naming_the_field() {
        for bad in [
            "",
            "hello",
            "ssh-ed25519 not-base64",
            "-----BEGIN OPENSSH PRIVATE KEY-----",
            // Cut short.
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID6EQuz9BKYfcxIS24MSilJMFVF5QnBp",
        ] {
            let e = parse_public_key(bad).unwrap_err();
            assert_eq!(e.field, "public_key", "{bad}");
        }
    }

    #[test]
    fn the_host_key_is_the_same_for_the_same_seed() {
        let a = host_key_from_seed(&[7; 32]);
        let b = host_key_from_seed(&[7; 32]);
        let c = host_key_from_seed(&[8; 32]);
        assert_eq!(a.public_key(), b.public_key());
        assert_ne!(a.public_key(), c.public_key());
        assert_eq!(a.algorithm(), ssh_key::Algorithm::Ed25519);
    }

    #[test]
    fn only_the_instances_loopback_is_forwarded_to() {
        assert_eq!(forward_target("localhost", 8888), Some(8888));
        assert_eq!(forward_target("127.0.0.1", 22), Some(22));
        assert_eq!(forward_target("::1", 80), Some(80));
        assert_eq!(forward_target("10.0.0.1", 80), None);
        assert_eq!(forward_target("example.com", 80), None);
        assert_eq!(forward_target("localhost", 0), None);
        assert_eq!(forward_target("localhost", 70_000), None);
    }

    #[test]
    fn terminal_sizes_fit_and_default() {
        assert_eq!(size(120, 40), (120, 40));
        assert_eq!(size(0, 0), (80, 24));
        assert_eq!(size(100_000, 5), (u16::MAX, 5));
    }
}
