//! The client against a real HTTPS server on loopback (axum behind
//! `flotilla_tls::TlsListener` with a self-signed certificate): trust by
//! pin and by CA file, a wrong pin refused once with both fingerprints
//! named, and the two ways of mixing up the scheme.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::routing::get;
use axum::{Json, Router};
use flotilla_client::{Client, Error, RetryPolicy, Trust};
use flotilla_tls::{ServerTls, TlsListener};
use serde_json::{json, Value};

/// axum's view of the TLS listener (a local type, so the trait may be
/// implemented here).
struct Https(TlsListener);

impl axum::serve::Listener for Https {
    type Io = flotilla_tls::TlsStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        self.0.accept().await
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.0.local_addr())
    }
}

fn app(hits: Arc<AtomicUsize>) -> Router {
    Router::new().route(
        "/v1/ping",
        get(move || {
            hits.fetch_add(1, Ordering::SeqCst);
            async { Json(json!({"pong": true})) }
        }),
    )
}

/// An HTTPS server with a fresh self-signed certificate: its port, the
/// certificate, the directory holding `tls.crt`, and its hit counter.
async fn https_server() -> (u16, ServerTls, tempfile::TempDir, Arc<AtomicUsize>) {
    let dir = tempfile::tempdir().unwrap();
    let tls = ServerTls::self_signed(dir.path(), &["localhost".into()]).unwrap();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = tcp.local_addr().unwrap().port();
    let listener = Https(tls.listen(tcp).unwrap());
    let hits = Arc::new(AtomicUsize::new(0));
    let router = app(hits.clone());
    tokio::spawn(async move { axum::serve(listener, router).await });
    (port, tls, dir, hits)
}

fn client(url: &str, trust: Trust) -> Client {
    Client::builder(url, "k")
        .trust(trust)
        .retry(RetryPolicy::default())
        .build()
        .unwrap()
}

#[tokio::test]
async fn https_by_pin_and_by_ca_file() {
    let (port, tls, dir, hits) = https_server().await;
    let pinned = client(
        &format!("https://127.0.0.1:{port}"),
        Trust::Pinned(tls.fingerprint()),
    );
    let v: Value = pinned.get("/v1/ping", &[]).await.unwrap();
    assert_eq!(v["pong"], true);
    let ca = Trust::ca_file(&dir.path().join(flotilla_tls::CERT_FILE)).unwrap();
    let by_ca = client(&format!("https://localhost:{port}"), ca);
    let v: Value = by_ca.get("/v1/ping", &[]).await.unwrap();
    assert_eq!(v["pong"], true);
    assert_eq!(hits.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_wrong_pin_fails_at_once_naming_both_fingerprints() {
    let (port, tls, _dir, hits) = https_server().await;
    let wrong = format!("sha256:{}", "5a".repeat(32)).parse().unwrap();
    let url = format!("https://127.0.0.1:{port}");
    let e = client(&url, Trust::Pinned(wrong))
        .get::<Value>("/v1/ping", &[])
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Tls { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!(
            "TLS with {url} failed: invalid peer certificate: the server's certificate has fingerprint {}, not the pinned {wrong}",
            tls.fingerprint()
        )
    );
    // Not worth retrying: the same certificate would be met again.
    assert!(!e.is_transient() && !e.is_unreachable());
    assert_eq!(hits.load(Ordering::SeqCst), 0, "no request got through");
}

#[tokio::test]
async fn mixed_up_schemes_say_so() {
    // http:// to the HTTPS port: the listener's plain 400.
    let (port, _tls, _dir, _) = https_server().await;
    let e = Client::new(&format!("http://127.0.0.1:{port}"), "k")
        .unwrap()
        .get::<Value>("/v1/ping", &[])
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(400), "{e:?}");
    assert_eq!(e.code(), Some("https_required"));
    assert!(e.message().contains("use an https:// URL"), "{e}");

    // https:// to a plain-HTTP server.
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let plain = tcp.local_addr().unwrap().port();
    let router = app(Arc::new(AtomicUsize::new(0)));
    tokio::spawn(async move { axum::serve(tcp, router).await });
    let pin = format!("sha256:{}", "5a".repeat(32)).parse().unwrap();
    let e = client(&format!("https://127.0.0.1:{plain}"), Trust::Pinned(pin))
        .get::<Value>("/v1/ping", &[])
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Tls { .. }), "{e:?}");
    assert!(e.to_string().contains("is its URL http://?"), "{e}");

    // A pin with an http:// URL would be silently bypassed: refused.
    let e = Client::builder(&format!("http://127.0.0.1:{plain}"), "k")
        .trust(Trust::Pinned(pin))
        .build()
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("invalid client setting server: `http://127.0.0.1:{plain}` is not an https:// URL, but a TLS fingerprint or CA certificate is set for it")
    );
}
