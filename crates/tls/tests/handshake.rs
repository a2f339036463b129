//! Real TLS over loopback TCP: a [`TlsListener`] serving a certificate
//! from [`ServerTls`], and rustls clients configured by [`Trust`].

use std::sync::Arc;
use std::time::Duration;

use flotilla_tls::{ServerTls, TlsListener, Trust};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;

/// A listener that answers every connection's first line with `hello`.
async fn echo_server(tls: &ServerTls) -> (TlsListener, std::net::SocketAddr) {
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let listener = tls.listen(tcp).unwrap();
    let addr = listener.local_addr();
    (listener, addr)
}

fn serve(mut listener: TlsListener) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await;
            tokio::spawn(async move {
                let mut buf = [0u8; 64];
                if stream.read(&mut buf).await.is_ok() {
                    let _ = stream.write_all(b"hello").await;
                    let _ = stream.shutdown().await;
                }
            });
        }
    })
}

/// Connects with `trust` to `addr` as `name`, says hi, returns the answer.
async fn talk(trust: &Trust, addr: std::net::SocketAddr, name: &str) -> Result<String, String> {
    let config = trust.client_config().map_err(|e| e.to_string())?;
    let connector = TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = ServerName::try_from(name.to_string()).unwrap();
    let words = |e: std::io::Error| match flotilla_tls::find(&e) {
        Some(r) => flotilla_tls::explain(r),
        None => e.to_string(),
    };
    let mut tls = connector.connect(name, tcp).await.map_err(words)?;
    tls.write_all(b"hi\n").await.map_err(words)?;
    let mut out = String::new();
    tls.read_to_string(&mut out).await.map_err(words)?;
    Ok(out)
}

#[tokio::test]
async fn a_pinned_client_accepts_exactly_the_pinned_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let tls = ServerTls::self_signed(dir.path(), &["localhost".into()]).unwrap();
    let other = ServerTls::self_signed(&dir.path().join("other"), &[]).unwrap();
    let (listener, addr) = echo_server(&tls).await;
    let _server = serve(listener);

    // By pin, under any name: the pin is the identity.
    let pinned = Trust::Pinned(tls.fingerprint());
    assert_eq!(talk(&pinned, addr, "localhost").await.unwrap(), "hello");
    assert_eq!(
        talk(&pinned, addr, "elsewhere.example").await.unwrap(),
        "hello"
    );

    let wrong = Trust::Pinned(other.fingerprint());
    let e = talk(&wrong, addr, "localhost").await.unwrap_err();
    assert!(
        e.contains(&format!(
            "the server's certificate has fingerprint {}, not the pinned {}",
            tls.fingerprint(),
            other.fingerprint()
        )),
        "{e}"
    );
}

#[tokio::test]
async fn a_ca_file_trusts_the_names_in_the_certificate_only() {
    let dir = tempfile::tempdir().unwrap();
    let tls =
        ServerTls::self_signed(dir.path(), &["localhost".into(), "127.0.0.1".into()]).unwrap();
    let (listener, addr) = echo_server(&tls).await;
    let _server = serve(listener);
    let ca = Trust::ca_file(&dir.path().join(flotilla_tls::CERT_FILE)).unwrap();
    assert_eq!(talk(&ca, addr, "localhost").await.unwrap(), "hello");
    assert_eq!(talk(&ca, addr, "127.0.0.1").await.unwrap(), "hello");
    let e = talk(&ca, addr, "elsewhere.example").await.unwrap_err();
    assert!(e.contains("not valid for name"), "{e}");

    // Another CA does not vouch for this server.
    let other = ServerTls::self_signed(&dir.path().join("other"), &["localhost".into()]).unwrap();
    drop(other);
    let other_ca = Trust::ca_file(&dir.path().join("other").join(flotilla_tls::CERT_FILE)).unwrap();
    let e = talk(&other_ca, addr, "localhost").await.unwrap_err();
    assert!(e.contains("invalid peer certificate"), "{e}");

    let bad = dir.path().join(flotilla_tls::KEY_FILE);
    let e = Trust::ca_file(&bad).unwrap_err().to_string();
    assert!(
        e.contains("is not a usable CA certificate: no PEM certificate"),
        "{e}"
    );
}

#[tokio::test]
async fn plain_http_is_told_to_use_https_and_silent_clients_block_no_one() {
    let dir = tempfile::tempdir().unwrap();
    let tls = ServerTls::self_signed(dir.path(), &[]).unwrap();
    let (listener, addr) = echo_server(&tls).await;
    let _server = serve(listener);

    // Connections that never say anything hold a handshake slot each, not
    // the accept loop.
    let mut silent = Vec::new();
    for _ in 0..20 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    let pinned = Trust::Pinned(tls.fingerprint());
    let answer = tokio::time::timeout(Duration::from_secs(5), talk(&pinned, addr, "localhost"))
        .await
        .expect("served while others stay silent");
    assert_eq!(answer.unwrap(), "hello");

    let mut plain = TcpStream::connect(addr).await.unwrap();
    plain
        .write_all(b"POST /v1/instances HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        .await
        .unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), plain.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    assert!(out.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{out}");
    assert!(out.contains(r#""code":"https_required""#), "{out}");
    drop(silent);
}
