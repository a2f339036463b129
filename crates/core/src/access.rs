//! Access into a running instance: a command run in it (`flotilla exec`),
//! an interactive terminal (`flotilla shell`) and a TCP stream to one of
//! its ports (`flotilla port-forward`). Each is a *session*: the tenant's
//! WebSocket arrives at the server, the server hands the session to the
//! node's agent with its next sync answer, the agent dials back a
//! WebSocket of its own, and the server splices the two. This module holds
//! what the three parties share: the session as the agent is told it, the
//! request's validation and the frames both WebSockets carry.
//!
//! A frame is one binary WebSocket message: a tag byte, then the payload.
//! The same frames serve a port-forward: its bytes to the instance travel
//! as [`Frame::Stdin`], those back as [`Frame::Stdout`], a half-close as
//! [`Frame::StdinEof`].

use serde::{Deserialize, Serialize};

use crate::id::{AccessSessionId, InstanceId};
use crate::FieldError;

/// Longest command line (all arguments together, in bytes) accepted.
pub const MAX_COMMAND_BYTES: usize = 64 * 1024;
/// Most arguments accepted.
pub const MAX_COMMAND_ARGS: usize = 1024;

/// The shell a session starts when not told which (`flotilla shell`, an
/// `ssh` login): bash where the instance has it, else sh.
pub const DEFAULT_SHELL: [&str; 3] = [
    "sh",
    "-c",
    "if command -v bash >/dev/null 2>&1; then exec bash; else exec sh; fi",
];

/// What a session does inside the instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum AccessKind {
    /// Runs `command` as the workload's user, in its working directory,
    /// with its environment; on a terminal of its own when `tty`.
    Exec {
        /// Program and arguments (no shell).
        command: Vec<String>,
        /// Give it a pseudo-terminal (an interactive shell).
        tty: bool,
        /// The terminal's initial width, in columns (`tty` only).
        #[serde(default)]
        cols: u16,
        /// The terminal's initial height, in rows (`tty` only).
        #[serde(default)]
        rows: u16,
    },
    /// A TCP connection to `port` on the loopback address of the
    /// instance's network namespace (the container's address for a
    /// container).
    PortForward {
        /// The instance's port.
        port: u16,
    },
}

impl AccessKind {
    /// The name the audit log and the agent's log use.
    pub fn name(&self) -> &'static str {
        match self {
            AccessKind::Exec { tty: true, .. } => "shell",
            AccessKind::Exec { .. } => "exec",
            AccessKind::PortForward { .. } => "port-forward",
        }
    }

    /// Checks a tenant's request, naming the offending field.
    pub fn validate(&self) -> Result<(), FieldError> {
        match self {
            AccessKind::Exec { command, .. } => {
                if command.is_empty() || command[0].is_empty() {
                    return Err(FieldError::new("command", "must name a program"));
                }
                if command.len() > MAX_COMMAND_ARGS {
                    return Err(FieldError::new(
                        "command",
                        format!("at most {MAX_COMMAND_ARGS} arguments"),
                    ));
                }
                if command.iter().map(String::len).sum::<usize>() > MAX_COMMAND_BYTES {
                    return Err(FieldError::new(
                        "command",
                        format!("at most {MAX_COMMAND_BYTES} bytes"),
                    ));
                }
                if command.iter().any(|a| a.contains('\0')) {
                    return Err(FieldError::new("command", "must not contain NUL bytes"));
                }
                Ok(())
            }
            AccessKind::PortForward { port } => {
                if *port == 0 {
                    return Err(FieldError::new("port", "must be 1-65535"));
                }
                Ok(())
            }
        }
    }
}

/// A session the server hands to the agent of the instance's node (in its
/// sync answer): the agent dials it back under `id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AccessSession {
    /// The session (`acc_…`), as the agent dials it back.
    pub id: AccessSessionId,
    /// The instance to enter.
    pub instance_id: InstanceId,
    /// What to do there.
    #[serde(flatten)]
    pub kind: AccessKind,
}

/// One message of a session's WebSocket (see the module).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Bytes for the command's standard input (or the forwarded port).
    Stdin(Vec<u8>),
    /// Bytes the command wrote to its standard output (or the terminal, or
    /// that the forwarded port sent).
    Stdout(Vec<u8>),
    /// Bytes the command wrote to its standard error.
    Stderr(Vec<u8>),
    /// No more standard input (a half-close of the forwarded stream).
    StdinEof,
    /// The terminal's new size.
    Resize {
        /// Width in columns.
        cols: u16,
        /// Height in rows.
        rows: u16,
    },
    /// The command ended with this exit code (128 + the signal's number
    /// when a signal ended it); the last frame of a session that worked.
    Exit(i32),
    /// The session could not do what was asked (no such program, the
    /// instance does not run here, the port refused the connection); the
    /// last frame.
    Error(String),
}

const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const STDIN_EOF: u8 = 3;
const RESIZE: u8 = 4;
const EXIT: u8 = 5;
const ERROR: u8 = 6;

/// A message that is not a [`Frame`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// An empty message.
    #[error("empty frame")]
    Empty,
    /// An unknown tag byte.
    #[error("unknown frame tag {0}")]
    UnknownTag(u8),
    /// A payload of the wrong length for its tag.
    #[error("frame {tag} needs {want} payload bytes, has {got}")]
    Length {
        /// The tag.
        tag: u8,
        /// Bytes expected.
        want: usize,
        /// Bytes present.
        got: usize,
    },
}

impl Frame {
    /// The message's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let tagged = |tag: u8, payload: &[u8]| {
            let mut v = Vec::with_capacity(payload.len() + 1);
            v.push(tag);
            v.extend_from_slice(payload);
            v
        };
        match self {
            Frame::Stdin(b) => tagged(STDIN, b),
            Frame::Stdout(b) => tagged(STDOUT, b),
            Frame::Stderr(b) => tagged(STDERR, b),
            Frame::StdinEof => vec![STDIN_EOF],
            Frame::Resize { cols, rows } => {
                let mut p = cols.to_be_bytes().to_vec();
                p.extend_from_slice(&rows.to_be_bytes());
                tagged(RESIZE, &p)
            }
            Frame::Exit(code) => tagged(EXIT, &code.to_be_bytes()),
            Frame::Error(m) => tagged(ERROR, m.as_bytes()),
        }
    }

    /// Reads a message.
    pub fn decode(bytes: &[u8]) -> Result<Frame, FrameError> {
        let (&tag, payload) = bytes.split_first().ok_or(FrameError::Empty)?;
        let exact = |want: usize| {
            if payload.len() == want {
                Ok(())
            } else {
                Err(FrameError::Length {
                    tag,
                    want,
                    got: payload.len(),
                })
            }
        };
        Ok(match tag {
            STDIN => Frame::Stdin(payload.to_vec()),
            STDOUT => Frame::Stdout(payload.to_vec()),
            STDERR => Frame::Stderr(payload.to_vec()),
            STDIN_EOF => {
                exact(0)?;
                Frame::StdinEof
            }
            RESIZE => {
                exact(4)?;
                Frame::Resize {
                    cols: u16::from_be_bytes([payload[0], payload[1]]),
                    rows: u16::from_be_bytes([payload[2], payload[3]]),
                }
            }
            EXIT => {
                exact(4)?;
                Frame::Exit(i32::from_be_bytes([
                    payload[0], payload[1], payload[2], payload[3],
                ]))
            }
            ERROR => Frame::Error(String::from_utf8_lossy(payload).into_owned()),
            other => return Err(FrameError::UnknownTag(other)),
        })
    }
}

/// Parses `flotilla port-forward`'s `LOCAL:REMOTE` (or `PORT`, the same
/// on both sides): the local and the instance's port.
pub fn parse_port_pair(s: &str) -> Result<(u16, u16), FieldError> {
    let port = |p: &str| {
        p.parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| FieldError::new("ports", format!("`{p}` is not a port (1-65535)")))
    };
    match s.split_once(':') {
        Some((local, remote)) => Ok((port(local)?, port(remote)?)),
        None => {
            let p = port(s)?;
            Ok((p, p))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        for f in [
            Frame::Stdin(b"ls\n".to_vec()),
            Frame::Stdout(vec![]),
            Frame::Stderr(vec![0, 255, 7]),
            Frame::StdinEof,
            Frame::Resize {
                cols: 200,
                rows: 50,
            },
            Frame::Exit(-1),
            Frame::Exit(137),
            Frame::Error("no such program".into()),
        ] {
            assert_eq!(Frame::decode(&f.encode()), Ok(f.clone()), "{f:?}");
        }
    }

    #[test]
    fn malformed_frames_are_refused() {
        assert_eq!(Frame::decode(&[]), Err(FrameError::Empty));
        assert_eq!(Frame::decode(&[99]), Err(FrameError::UnknownTag(99)));
        assert!(matches!(
            Frame::decode(&[EXIT, 1, 2]),
            Err(FrameError::Length {
                want: 4,
                got: 2,
                ..
            })
        ));
        assert!(Frame::decode(&[STDIN_EOF, 1]).is_err());
    }

    #[test]
    fn requests_are_validated_naming_the_field() {
        let exec = |command: &[&str]| AccessKind::Exec {
            command: command.iter().map(|s| s.to_string()).collect(),
            tty: false,
            cols: 0,
            rows: 0,
        };
        assert!(exec(&["sh", "-c", "true"]).validate().is_ok());
        assert_eq!(exec(&[]).validate().unwrap_err().field, "command");
        assert_eq!(exec(&[""]).validate().unwrap_err().field, "command");
        assert_eq!(exec(&["a\0b"]).validate().unwrap_err().field, "command");
        let e = AccessKind::PortForward { port: 0 }.validate().unwrap_err();
        assert_eq!(e.field, "port");
        assert!(AccessKind::PortForward { port: 8080 }.validate().is_ok());
    }

    #[test]
    fn sessions_serialise_flat() {
        let s = AccessSession {
            id: AccessSessionId::generate(1, 2),
            instance_id: InstanceId::generate(1, 3),
            kind: AccessKind::PortForward { port: 80 },
        };
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["kind"], "port_forward");
        assert_eq!(v["port"], 80);
        let back: AccessSession = serde_json::from_value(v).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn port_pairs() {
        assert_eq!(parse_port_pair("8080:80").unwrap(), (8080, 80));
        assert_eq!(parse_port_pair("9000").unwrap(), (9000, 9000));
        assert_eq!(parse_port_pair("0:80").unwrap_err().field, "ports");
        assert!(parse_port_pair("a:80").is_err());
        assert!(parse_port_pair("80:70000").is_err());
    }
}
