//! What the long-running commands (`up`, `server`, `agent`, `gateway`,
//! `executor`) share as processes: the stderr logger, SIGINT and SIGTERM,
//! the data directory and the TLS flags. Kept apart from `local` (which
//! starts the control plane and the local agent) so that the gateway and
//! the executor can use them without importing what starts them.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use clap::Args;

/// Whether a server or gateway serves HTTPS, and with which certificate:
/// `--tls self-signed`, or `--tls-cert` with `--tls-key`. Plain HTTP
/// otherwise (the default, for loopback: `flotilla up` as the README
/// starts it).
#[derive(Debug, Clone, Args)]
pub struct TlsArgs {
    /// `self-signed`: serve HTTPS with a certificate made at first start and
    /// kept in the data directory (`tls.crt`; `tls.key`, mode 0600), reused
    /// on every restart; its SHA-256 fingerprint is printed for clients to
    /// pin (`--tls-fingerprint`). `off`: plain HTTP.
    #[arg(
        long,
        value_name = "MODE",
        env = "FLOTILLA_TLS",
        conflicts_with_all = ["tls_cert", "tls_key"]
    )]
    pub tls: Option<TlsMode>,
    /// Serve HTTPS with this PEM certificate chain, leaf first (with
    /// `--tls-key`).
    #[arg(
        long,
        value_name = "FILE",
        env = "FLOTILLA_TLS_CERT",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of `--tls-cert` (PKCS#8, PKCS#1 or SEC1); keep it
    /// readable by the server's user only.
    #[arg(
        long,
        value_name = "FILE",
        env = "FLOTILLA_TLS_KEY",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
}

/// `--tls`'s values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TlsMode {
    /// Plain HTTP.
    Off,
    /// HTTPS with a self-signed certificate kept in the data directory.
    SelfSigned,
}

impl TlsArgs {
    /// The certificate to serve, or `None` for plain HTTP. A self-signed
    /// one lives in `dir` and names `names`; files that cannot be read or
    /// do not match refuse the start with the file named.
    pub(crate) fn load(
        &self,
        dir: &Path,
        names: &[String],
    ) -> Result<Option<flotilla_tls::ServerTls>> {
        match (&self.tls_cert, &self.tls_key, self.tls) {
            (Some(cert), Some(key), _) => flotilla_tls::ServerTls::from_files(cert, key)
                .map(Some)
                .map_err(|e| anyhow!("--tls-cert/--tls-key: {e}")),
            (_, _, Some(TlsMode::SelfSigned)) => flotilla_tls::ServerTls::self_signed(dir, names)
                .map(Some)
                .map_err(|e| anyhow!("--tls self-signed: {e}")),
            _ => Ok(None),
        }
    }

    /// Whether the certificate is ours (self-signed), so that clients
    /// started here pin it and saved credentials carry its fingerprint.
    pub(crate) fn self_signed(&self) -> bool {
        self.tls == Some(TlsMode::SelfSigned)
    }
}

/// The names a self-signed certificate for a listener on `bind` is made
/// valid for: loopback, this host's name, and the bound address when it is
/// a particular one. (Pinning clients ignore names; these serve clients
/// that trust the certificate as a CA file instead.)
pub(crate) fn certificate_names(bind: &str) -> Vec<String> {
    let mut names = vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ];
    let host = hostname();
    if host != "local" {
        names.push(host);
    }
    let bound = bind
        .rsplit_once(':')
        .map_or(bind, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']');
    let wildcard = bound
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified());
    if !bound.is_empty() && !wildcard && !names.iter().any(|n| n == bound) {
        names.push(bound.to_string());
    }
    names
}

/// Installs the stderr logger: `RUST_LOG` when set, else `info` for the
/// flotilla crates and `warn` for everything else.
pub fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new(
            "warn,flotilla=info,flotilla_cli=info,flotilla_server=info,\
             flotilla_agent=info,flotilla_store=info,flotilla_core=info",
        )
    });
    // A second install (tests) keeps the first.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// SIGINT and SIGTERM, awaitable more than once (a second Ctrl-C during a
/// graceful shutdown forces the exit).
pub struct Signals {
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl Signals {
    /// Takes over SIGINT and SIGTERM for the rest of the process.
    pub fn new() -> Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Self {
                int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
                term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            })
        }
        #[cfg(not(unix))]
        {
            Ok(Self {})
        }
    }

    /// Waits for the next SIGINT or SIGTERM.
    pub async fn recv(&mut self) {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.int.recv() => {}
                _ = self.term.recv() => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

pub(crate) fn data_dir(flag: Option<PathBuf>) -> Result<PathBuf> {
    let env = std::env::var_os("FLOTILLA_DATA_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from);
    let dir = match flag.or(env) {
        Some(d) => d,
        None => dirs::data_dir()
            .map(|d| d.join("flotilla"))
            .ok_or_else(|| anyhow!("cannot find a data directory: pass --data-dir"))?,
    };
    std::path::absolute(&dir).with_context(|| format!("resolving {}", dir.display()))
}

/// This machine's name, for the local node and the certificate.
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "local".to_string())
}
