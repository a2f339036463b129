//! An HTTPS listener: TCP accepted here, TLS handshakes completed in their
//! own tasks, finished streams handed to the HTTP server in order of
//! completion.
//!
//! Handshakes run concurrently because one done inline in the accept loop
//! would let a single client that connects and says nothing stall every
//! other connection for the handshake timeout.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// How long a client may take from connecting to a finished handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; past it, accepting waits.
const MAX_HANDSHAKES: usize = 1024;
/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;
/// The most of a plain-HTTP request read before answering it.
const PLAIN_REQUEST_LIMIT: usize = 16 * 1024;

/// Accepts TLS connections on a TCP listener; see the module doc.
///
/// A plain-HTTP request (its first byte an uppercase letter, as every
/// method is) gets a plain `400` with the API's error body, code
/// `https_required`, instead of a dropped connection, so that a client
/// given an `http://` URL by mistake is told why (Go's net/http does the
/// same). Dropping the listener closes the port.
#[derive(Debug)]
pub struct TlsListener {
    local: SocketAddr,
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    accept: JoinHandle<()>,
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl TlsListener {
    /// Starts accepting on `tcp` with `config` (must be called within a
    /// tokio runtime).
    pub fn new(tcp: TcpListener, config: Arc<rustls::ServerConfig>) -> std::io::Result<Self> {
        let local = tcp.local_addr()?;
        let (tx, ready) = mpsc::channel(64);
        let accept = tokio::spawn(accept_loop(tcp, TlsAcceptor::from(config), tx));
        Ok(Self {
            local,
            ready,
            accept,
        })
    }

    /// The next connection whose handshake completed, and its peer.
    pub async fn accept(&mut self) -> (TlsStream<TcpStream>, SocketAddr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            // The accept loop only ends when this listener is dropped.
            None => std::future::pending().await,
        }
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

async fn accept_loop(
    tcp: TcpListener,
    acceptor: TlsAcceptor,
    ready: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    let permits = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    loop {
        let (stream, peer) = match tcp.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: back off instead
                // of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let (acceptor, ready) = (acceptor.clone(), ready.clone());
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&acceptor, stream)).await {
                Ok(Ok(Some(tls))) => {
                    let _ = ready.send((tls, peer)).await;
                }
                Ok(Ok(None)) => {}
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
            }
        });
    }
}

/// The TLS stream, or `None` when the peer closed or spoke plain HTTP
/// (then answered here).
async fn handshake(
    acceptor: &TlsAcceptor,
    stream: TcpStream,
) -> std::io::Result<Option<TlsStream<TcpStream>>> {
    let mut first = [0u8; 1];
    if stream.peek(&mut first).await? == 0 {
        return Ok(None);
    }
    if first[0] != TLS_HANDSHAKE {
        if first[0].is_ascii_uppercase() {
            answer_plain_http(stream).await?;
        }
        return Ok(None);
    }
    acceptor.accept(stream).await.map(Some)
}

/// Reads the request head, answers 400 `https_required` and closes.
async fn answer_plain_http(mut stream: TcpStream) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 2048];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < PLAIN_REQUEST_LIMIT {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let body = r#"{"error":{"code":"https_required","message":"this server speaks HTTPS: use an https:// URL","details":{}}}"#;
    let answer = format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(answer.as_bytes()).await?;
    stream.shutdown().await?;
    // Read what the client still sends (a request body) before closing:
    // closing with unread data would reset the connection, and the reset
    // can destroy the answer before the client reads it.
    let mut drained = 0usize;
    while drained < 1024 * 1024 {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
    Ok(())
}
