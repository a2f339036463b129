//! The inference gateway in the CLI: started beside the server by
//! `flotilla up`, or alone by `flotilla gateway --server URL --token …`
//! against any server. Either way it reaches the control plane only
//! through its API (`flotilla_gateway::ApiControl`).

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use clap::Args;
use flotilla_gateway::{ApiControl, GatewayConfig, GatewayHandle};

use crate::config;
use crate::daemon::{init_logging, Signals, TlsArgs};
use crate::output::say;

/// Where the gateway listens by default.
pub const DEFAULT_GATEWAY_BIND: &str = "127.0.0.1:7430";

/// Options of `flotilla gateway`.
#[derive(Debug, Args)]
pub struct GatewayArgs {
    /// A provider key (the agent token in the server's data directory,
    /// `agent.token`) or an operator key.
    #[arg(long, env = "FLOTILLA_GATEWAY_TOKEN", hide_env_values = true)]
    pub token: String,
    /// Address to listen on.
    #[arg(long, default_value = DEFAULT_GATEWAY_BIND, value_name = "ADDR")]
    pub bind: String,
    /// HTTPS (a self-signed certificate is kept in the data directory's
    /// `gateway/`).
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Requests per second allowed per source address without a valid
    /// inference key (none, unknown, revoked), in bursts of twice that;
    /// more answer 429 with `Retry-After`. Keys seen valid are not held
    /// back.
    #[arg(long, default_value_t = DEFAULT_ANONYMOUS_RATE_LIMIT, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub anonymous_rate_limit: u32,
}

/// Requests per second per source address without a valid key, by default
/// (the API's own anonymous limit).
pub const DEFAULT_ANONYMOUS_RATE_LIMIT: u32 = 10;

/// Starts a gateway on `bind` with the control plane at `servers`
/// (comma-separated URLs, trusted by `trust` when `https://`),
/// authenticated by `token`; it serves HTTPS with `tls` when given, and
/// allows `anonymous_rate_limit` requests per second per address without
/// a valid key.
pub async fn start(
    servers: &str,
    token: &str,
    trust: flotilla_client::Trust,
    bind: &str,
    tls: Option<flotilla_tls::ServerTls>,
    anonymous_rate_limit: u32,
) -> Result<GatewayHandle> {
    let client = flotilla_client::Client::builder(servers, token)
        .trust(trust)
        .user_agent(concat!("flotilla-gateway/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| anyhow!("gateway's control client: {e}"))?;
    let listener = tokio::net::TcpListener::bind(bind).await.map_err(|e| {
        anyhow!("the gateway cannot listen on {bind}: {e}; pick another with --gateway-bind")
    })?;
    flotilla_gateway::serve(
        listener,
        Arc::new(ApiControl::new(client)),
        GatewayConfig {
            tls,
            anonymous_rate_limit_per_second: anonymous_rate_limit,
            ..GatewayConfig::default()
        },
    )
    .await
    .map_err(|e| anyhow!("starting the gateway: {e}"))
}

/// `flotilla gateway`.
pub async fn run(
    server: Option<String>,
    trust: config::TlsFlags<'_>,
    args: GatewayArgs,
) -> Result<ExitCode> {
    init_logging();
    let trust = config::trust(trust.fingerprint, trust.ca_cert)?;
    let Some(server) = server else {
        bail!("--server is required: the URL of the control plane");
    };
    if args.token.trim().is_empty() {
        bail!("--token is empty: pass a provider (agent) or operator key");
    }
    let dir = crate::daemon::data_dir(None)?.join("gateway");
    if args.tls.self_signed() {
        // The key file is owner-only; keep its directory so too.
        config::create_private_dir(&dir)?;
    }
    let tls = args
        .tls
        .load(&dir, &crate::daemon::certificate_names(&args.bind))?;
    let mut signals = Signals::new()?;
    let fingerprint = tls.as_ref().map(|t| t.fingerprint());
    let gw = start(
        &server,
        args.token.trim(),
        trust,
        &args.bind,
        tls,
        args.anonymous_rate_limit,
    )
    .await?;
    say!("gateway:  {} (control plane {server})", gw.url());
    if let Some(f) = fingerprint {
        say!("TLS:      certificate fingerprint {f}");
    }
    say!("press Ctrl-C to stop");
    signals.recv().await;
    eprintln!("stopping: requests in flight finish, usage is delivered");
    tokio::select! {
        _ = gw.shutdown() => {}
        _ = signals.recv() => {
            eprintln!("forced exit");
            return Ok(ExitCode::from(130));
        }
    }
    say!("stopped");
    Ok(ExitCode::SUCCESS)
}

/// `flotilla emulator`: serves until SIGINT or SIGTERM (an agent stopping
/// the replica), printing `listening on ADDR` first.
pub async fn emulator(config: flotilla_emulator::EmulatorConfig) -> Result<ExitCode> {
    let mut signals = Signals::new()?;
    let emulator = flotilla_emulator::Emulator::start(config)
        .await
        .map_err(|e| anyhow!("starting the emulator: {e}"))?;
    say!("listening on {}", emulator.addr());
    signals.recv().await;
    emulator.shutdown().await;
    Ok(ExitCode::SUCCESS)
}
