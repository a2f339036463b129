//! The API served in the same process, reached without a socket: for a
//! service that runs inside the server (the web console) and must pass
//! through exactly the API's rules (authentication, roles, tenant
//! scoping, rate limits, audit), as a remote caller does.
//!
//! The server hands the client an [`InProcess`]: a function that opens one
//! in-memory connection (a [`DuplexStream`]) whose other end the server
//! serves as HTTP/1.1, with upgrades. The client speaks HTTP/1.1 over it
//! with hyper, so every request is the same bytes a remote client would
//! send, and a WebSocket route's `101 Switching Protocols` hands back a
//! real upgraded stream: [`Client::exec`](crate::Client::exec) works
//! in-process too. A handler-level shortcut (calling the router as a
//! `tower` service) could not do that: axum's WebSocket extractor needs
//! the connection's pending upgrade, which only a served connection has.
//!
//! One connection per request keeps it simple: an in-memory connection
//! costs a task and a buffer, nothing like a TCP handshake.

use std::sync::Arc;

use hyper_util::rt::TokioIo;
use tokio::io::DuplexStream;

use crate::error::{Error, TransportKind};
use crate::Result;

/// The URL an in-process client names its server by, in its errors and
/// [`Client::servers`](crate::Client::servers): never dialled.
pub const IN_PROCESS_URL: &str = "http://in-process.invalid";

/// Opens in-memory connections to the API (see the module's doc).
#[derive(Clone)]
pub struct InProcess {
    connect: Arc<dyn Fn() -> DuplexStream + Send + Sync>,
}

impl std::fmt::Debug for InProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InProcess")
    }
}

impl InProcess {
    /// Connections from `connect`: each call returns the client's end of a
    /// fresh connection whose other end is already being served.
    pub fn new(connect: impl Fn() -> DuplexStream + Send + Sync + 'static) -> Self {
        Self {
            connect: Arc::new(connect),
        }
    }

    fn broken(message: impl std::fmt::Display) -> Error {
        Error::Transport {
            server: IN_PROCESS_URL.to_string(),
            kind: TransportKind::Other,
            message: format!("in-process request failed: {message}"),
        }
    }

    /// Sends `req` on a fresh connection, within its timeout if it has one;
    /// the answer whatever its status, its upgrade (if any) still pending.
    pub(crate) async fn send(&self, req: reqwest::Request) -> Result<reqwest::Response> {
        let timeout = req.timeout().copied();
        let exchange = self.exchange(req);
        match timeout {
            Some(t) => tokio::time::timeout(t, exchange)
                .await
                .map_err(|_| Error::Transport {
                    server: IN_PROCESS_URL.to_string(),
                    kind: TransportKind::Timeout,
                    message: "in-process request timed out".to_string(),
                })?,
            None => exchange.await,
        }
    }

    async fn exchange(&self, req: reqwest::Request) -> Result<reqwest::Response> {
        let mut req: http::Request<reqwest::Body> = req.try_into().map_err(Self::broken)?;
        // Origin form, as a client writes it to a server it connected to;
        // the absolute URL names no real host.
        let target = req
            .uri()
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .parse()
            .map_err(Self::broken)?;
        *req.uri_mut() = target;
        req.headers_mut().insert(
            http::header::HOST,
            http::HeaderValue::from_static("in-process.invalid"),
        );
        let io = TokioIo::new((self.connect)());
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(Self::broken)?;
        // The connection runs until the answer is read (or, after an
        // upgrade, until the upgraded stream is dropped).
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(error = %e, "in-process connection ended");
            }
        });
        let resp = sender.send_request(req).await.map_err(Self::broken)?;
        // Extensions (the pending upgrade among them) stay with the parts.
        Ok(reqwest::Response::from(resp.map(reqwest::Body::wrap)))
    }
}
