//! Sessions into running instances (exec, shell, port-forward): the
//! WebSocket routes of the tenant and of the agent, and the framed stream
//! both read and write (see [`flotilla_core::access`]).

use flotilla_core::access::{AccessKind, Frame};
use flotilla_core::id::{AccessSessionId, NodeId};
use futures::{SinkExt as _, StreamExt as _};
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::client::Client;
use crate::error::{Error, TransportKind};
use crate::Result;

type Socket = WebSocketStream<reqwest::Upgraded>;

/// One session's stream of [`Frame`]s over its WebSocket.
#[derive(Debug)]
pub struct Session {
    socket: Socket,
    server: String,
}

/// The sending half of a [`Session`] (see [`Session::split`]).
#[derive(Debug)]
pub struct SessionSender {
    sink: futures::stream::SplitSink<Socket, Message>,
    server: String,
}

/// The receiving half of a [`Session`] (see [`Session::split`]).
#[derive(Debug)]
pub struct SessionReceiver {
    stream: futures::stream::SplitStream<Socket>,
    server: String,
}

fn broken(server: &str, what: impl std::fmt::Display) -> Error {
    Error::Transport {
        server: server.to_string(),
        kind: TransportKind::Other,
        message: format!("the session broke: {what}"),
    }
}

async fn send_on<S>(sink: &mut S, server: &str, frame: &Frame) -> Result<()>
where
    S: futures::Sink<Message, Error = tokio_tungstenite::tungstenite::Error> + Unpin,
{
    sink.send(Message::Binary(frame.encode().into()))
        .await
        .map_err(|e| broken(server, e))
}

async fn recv_on<S>(stream: &mut S, server: &str) -> Option<Result<Frame>>
where
    S: futures::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    loop {
        return match stream.next().await? {
            Ok(Message::Binary(b)) => {
                Some(Frame::decode(&b).map_err(|e| broken(server, format!("bad frame: {e}"))))
            }
            Ok(Message::Close(_)) => None,
            // Pings are answered by the WebSocket layer itself.
            Ok(_) => continue,
            Err(e) => Some(Err(broken(server, e))),
        };
    }
}

impl Session {
    async fn over(upgraded: reqwest::Upgraded, server: String) -> Session {
        Session {
            socket: WebSocketStream::from_raw_socket(upgraded, Role::Client, None).await,
            server,
        }
    }

    /// Sends one frame.
    pub async fn send(&mut self, frame: &Frame) -> Result<()> {
        send_on(&mut self.socket, &self.server, frame).await
    }

    /// The next frame; `None` once the other side closed the session.
    pub async fn recv(&mut self) -> Option<Result<Frame>> {
        recv_on(&mut self.socket, &self.server).await
    }

    /// Two halves, to send and receive at the same time.
    pub fn split(self) -> (SessionSender, SessionReceiver) {
        let (sink, stream) = self.socket.split();
        (
            SessionSender {
                sink,
                server: self.server.clone(),
            },
            SessionReceiver {
                stream,
                server: self.server,
            },
        )
    }
}

impl SessionSender {
    /// Sends one frame.
    pub async fn send(&mut self, frame: &Frame) -> Result<()> {
        send_on(&mut self.sink, &self.server, frame).await
    }

    /// Closes the session (the WebSocket's close handshake).
    pub async fn close(&mut self) {
        let _ = self.sink.close().await;
    }
}

impl SessionReceiver {
    /// The next frame; `None` once the other side closed the session.
    pub async fn recv(&mut self) -> Option<Result<Frame>> {
        recv_on(&mut self.stream, &self.server).await
    }
}

/// The bytes of one SSH connection over `GET /v1/instances/{id}/ssh`'s
/// WebSocket (see [`Client::ssh`]): binary messages, no frames; the
/// server at the other end is an SSH server.
#[derive(Debug)]
pub struct Tunnel {
    socket: Socket,
    server: String,
}

/// The sending half of a [`Tunnel`].
#[derive(Debug)]
pub struct TunnelSender {
    sink: futures::stream::SplitSink<Socket, Message>,
    server: String,
}

/// The receiving half of a [`Tunnel`].
#[derive(Debug)]
pub struct TunnelReceiver {
    stream: futures::stream::SplitStream<Socket>,
    server: String,
}

impl Tunnel {
    /// Two halves, to send and receive at the same time.
    pub fn split(self) -> (TunnelSender, TunnelReceiver) {
        let (sink, stream) = self.socket.split();
        (
            TunnelSender {
                sink,
                server: self.server.clone(),
            },
            TunnelReceiver {
                stream,
                server: self.server,
            },
        )
    }
}

impl TunnelSender {
    /// Sends bytes of the connection.
    pub async fn send(&mut self, bytes: Vec<u8>) -> Result<()> {
        self.sink
            .send(Message::Binary(bytes.into()))
            .await
            .map_err(|e| broken(&self.server, e))
    }

    /// Closes the tunnel (the WebSocket's close handshake): the server's
    /// end of the connection sees it end.
    pub async fn close(&mut self) {
        let _ = self.sink.close().await;
    }
}

impl TunnelReceiver {
    /// The next bytes of the connection; `None` once the server closed it.
    pub async fn recv(&mut self) -> Option<Result<Vec<u8>>> {
        loop {
            return match self.stream.next().await? {
                Ok(Message::Binary(b)) => Some(Ok(b.to_vec())),
                Ok(Message::Close(_)) => None,
                // Pings are answered by the WebSocket layer itself.
                Ok(_) => continue,
                Err(e) => Some(Err(broken(&self.server, e))),
            };
        }
    }
}

impl Client {
    /// `GET /v1/instances/{id}/ssh` (a WebSocket): a tunnel to the
    /// server's SSH endpoint for the instance, for an SSH client's bytes.
    pub async fn ssh(&self, instance_id: &str) -> Result<Tunnel> {
        let upgraded = self
            .upgrade(&format!("/v1/instances/{instance_id}/ssh"), &[])
            .await?;
        Ok(Tunnel {
            socket: WebSocketStream::from_raw_socket(upgraded, Role::Client, None).await,
            server: self.current_server().to_string(),
        })
    }

    async fn session(&self, path: &str, query: &[(&str, String)]) -> Result<Session> {
        let upgraded = self.upgrade(path, query).await?;
        Ok(Session::over(upgraded, self.current_server().to_string()).await)
    }

    /// `GET /v1/instances/{id}/exec` (a WebSocket): runs a command in the
    /// instance, on a terminal of its own when `kind` asks for one. Only
    /// [`AccessKind::Exec`] is meaningful here.
    pub async fn exec(&self, instance_id: &str, kind: &AccessKind) -> Result<Session> {
        let AccessKind::Exec {
            command,
            tty,
            cols,
            rows,
        } = kind
        else {
            return Err(Error::Config {
                field: "kind",
                message: "exec runs a command".to_string(),
            });
        };
        let command = serde_json::to_string(command).map_err(|e| Error::Config {
            field: "command",
            message: e.to_string(),
        })?;
        let query = [
            ("command", command),
            ("tty", tty.to_string()),
            ("cols", cols.to_string()),
            ("rows", rows.to_string()),
        ];
        self.session(&format!("/v1/instances/{instance_id}/exec"), &query)
            .await
    }

    /// `GET /v1/instances/{id}/port-forward?port=` (a WebSocket): a TCP
    /// stream to `port` inside the instance.
    pub async fn port_forward(&self, instance_id: &str, port: u16) -> Result<Session> {
        let query = [("port", port.to_string())];
        self.session(&format!("/v1/instances/{instance_id}/port-forward"), &query)
            .await
    }

    /// `GET /v1/agent/nodes/{node_id}/sessions/{session_id}` (a
    /// WebSocket): the agent's end of a session its sync was handed.
    pub async fn attach_session(
        &self,
        node_id: &NodeId,
        session_id: &AccessSessionId,
    ) -> Result<Session> {
        self.session(
            &format!("/v1/agent/nodes/{node_id}/sessions/{session_id}"),
            &[],
        )
        .await
    }
}
