//! Flotilla's control plane: the `/v1` REST API (axum, OpenAPI by
//! utoipa), API-key auth with roles and tenant scoping, quotas, the agent
//! protocol, and the reconcile loops that place instances and watch nodes.
//!
//! The server records desired state and observed state in the store; the
//! decisions themselves (validation, quotas, placement) are the pure
//! functions of `flotilla-core`, called with the wall clock.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use axum::extract::DefaultBodyLimit;
use axum::http::{header, HeaderName, StatusCode};
use axum::response::{Html, IntoResponse};
use axum::routing::get;
use axum::{middleware, Json, Router};
use flotilla_core::id::{KeyId, TenantId};
use flotilla_core::tenant::Role;
use flotilla_store::keys::NewKey;
pub use flotilla_store::Store;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

pub mod access;
pub mod audit;
pub mod auth;
pub mod billing_step;
pub mod budgets;
pub mod config;
pub mod endpoints;
pub mod error;
pub mod extract;
pub mod heartbeats;
pub mod idempotency;
pub mod jobs;
pub mod last_plan;
pub mod leader;
pub mod metering;
pub mod metrics;
pub mod nodepools;
pub mod offers;
pub mod ops_metrics;
pub mod outbound;
pub mod parking;
pub mod pricing;
pub mod reconcile;
pub mod reconciliation;
mod request_defaults;
pub mod routes;
pub mod schedule;
pub mod ssh;
pub mod state;
pub mod webhook_target;

pub use crate::config::ServerConfig;
use crate::state::{AppState, SystemClock};

/// What bootstrap created or found.
#[derive(Debug, Clone)]
pub struct BootstrapOutcome {
    /// The operator key's secret; only when this call created it.
    pub operator_key: Option<String>,
    /// The local agent's token (kept in `data_dir/agent.token`, mode 0600).
    pub agent_token: String,
}

/// Opens (creating a SQLite file when needed) and migrates the store. A
/// SQLite file is private to the server's user (mode 0600, as SQLite gives
/// its `-wal` and `-shm` files the database's mode); a directory it
/// creates for it is 0700. `timeouts` apply on PostgreSQL
/// ([`ServerConfig::store_timeouts`]).
pub async fn open_store(
    database_url: &str,
    timeouts: flotilla_store::leases::Timeouts,
) -> anyhow::Result<Store> {
    if let Some(path) = database_url.strip_prefix("sqlite://") {
        let file = Path::new(path.split('?').next().unwrap_or(path));
        if let Some(dir) = file.parent() {
            if !dir.as_os_str().is_empty() && !dir.exists() {
                private_dir(dir).with_context(|| format!("cannot create {}", dir.display()))?;
            }
        }
        private_sqlite_files(file)
            .with_context(|| format!("cannot make {} private", file.display()))?;
    }
    Store::connect_with(database_url, timeouts)
        .await
        .with_context(|| format!("cannot open the database at {}", redact(database_url)))
}

/// The URL without its password, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{}:***{}", &url[..s + 3], user, &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

/// Creates `dir` and missing parents with mode 0700.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Creates the SQLite database `file` empty with mode 0600 when missing,
/// and takes group and other access away from it and its `-wal`, `-shm`
/// and `-journal` files when they have any (files of older versions).
fn private_sqlite_files(file: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    if file.as_os_str().is_empty() || file.to_str() == Some(":memory:") {
        return Ok(());
    }
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(file)
    {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut name = file.as_os_str().to_owned();
        name.push(suffix);
        let path = Path::new(&name);
        if let Ok(meta) = std::fs::metadata(path) {
            if meta.permissions().mode() & 0o077 != 0 {
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
            }
        }
    }
    Ok(())
}

fn write_private(path: &Path, contents: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    if let Some(dir) = path.parent() {
        if !dir.exists() {
            private_dir(dir)?;
        }
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    // An existing file keeps its mode through `open`.
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    f.write_all(contents.as_bytes())?;
    Ok(())
}

async fn mint_key(
    store: &Store,
    tenant: &TenantId,
    role: Role,
    name: &str,
) -> anyhow::Result<String> {
    let minted = auth::mint_secret();
    let now = chrono::Utc::now();
    store
        .create_key(
            &NewKey {
                id: KeyId::generate(now.timestamp_millis().max(0) as u64, rand::random()),
                tenant_id: tenant.clone(),
                role,
                name: name.into(),
                prefix: minted.prefix,
                secret_hash: minted.hash,
            },
            now,
        )
        .await?;
    Ok(minted.secret)
}

/// First start: creates the `default` tenant and an operator key (returned
/// once), and a provider key for the local agent, kept in
/// `data_dir/agent.token`. Later starts return the same agent token.
pub async fn bootstrap(store: &Store, data_dir: &Path) -> anyhow::Result<BootstrapOutcome> {
    let now = chrono::Utc::now();
    let tenant = match store.tenant_by_name("default").await? {
        Some(t) => t.id,
        None => {
            let id = TenantId::generate(now.timestamp_millis().max(0) as u64, rand::random());
            store.create_tenant(&id, "default", now).await?;
            id
        }
    };
    let operator_key = if store.has_operator_key().await? {
        None
    } else {
        Some(mint_key(store, &tenant, Role::Operator, "bootstrap operator").await?)
    };
    let token_file = data_dir.join("agent.token");
    if token_file.exists() {
        // Written by an older version with the default mode, perhaps.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("cannot make {} private", token_file.display()))?;
    }
    let existing = std::fs::read_to_string(&token_file)
        .ok()
        .map(|s| s.trim().to_string());
    let agent_token = match existing {
        Some(t) if store.key_by_hash(&auth::hash_secret(&t)).await?.is_some() => t,
        _ => {
            let t = mint_key(store, &tenant, Role::Provider, "local agent").await?;
            write_private(&token_file, &t)?;
            t
        }
    };
    Ok(BootstrapOutcome {
        operator_key,
        agent_token,
    })
}

/// The whole HTTP application for `state`.
/// Counts every API request that may have written (any method but GET,
/// HEAD and OPTIONS), once it is answered: a quota, a cordon or a new
/// instance can change what the scheduler would plan, so the kept plan
/// (`last_plan`) must not serve readers past it, and the leader's pass is
/// due (`reconcile::PassTrigger`). The agents' and the gateway's protocol
/// calls and usage reports are not counted: they arrive all the time, and
/// the routes signal a change themselves when one changes what the
/// scheduler sees (`AppState::notify_change`). A counter, not a change
/// signal: agents' long polls are not woken by it.
async fn writes_layer(
    axum::extract::State(st): axum::extract::State<AppState>,
    req: axum::extract::Request,
    next: middleware::Next,
) -> axum::response::Response {
    let counted = routes::kinds::is_write(req.method(), req.uri().path());
    let resp = next.run(req).await;
    if counted {
        st.note_write();
    }
    resp
}

pub fn app(state: AppState) -> Router {
    let (api, doc) = routes::documented();
    let doc_json = Arc::new(doc);
    let docs_html = Arc::new(routes::docs::render(&doc_json));
    let request_id = HeaderName::from_static("x-request-id");
    let api = api
        .route(
            routes::kinds::OPENAPI_JSON,
            get({
                let d = doc_json.clone();
                move || async move { Json((*d).clone()) }
            }),
        )
        .route(
            routes::kinds::DOCS_HTML,
            get({
                let h = docs_html.clone();
                move || async move { Html((*h).clone()) }
            }),
        )
        .route("/healthz", get(health))
        .route(routes::kinds::HEALTH_JSON, get(health_json))
        .route("/metrics", get(metrics::metrics))
        .fallback(|| async { error::ApiError::not_found("route") })
        .method_not_allowed_fallback(|| async {
            error::ApiError {
                status: StatusCode::METHOD_NOT_ALLOWED,
                code: "method_not_allowed",
                message: "method not allowed on this route".into(),
                details: serde_json::json!({}),
                retry_after: None,
            }
        })
        // Outermost first: authentication (and its rate limits), the audit
        // log (which needs the caller), then idempotent replays (which must
        // come after authentication and be audited as what they answer).
        .layer(middleware::from_fn_with_state(
            state.clone(),
            idempotency::layer,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), audit::layer))
        .layer(middleware::from_fn_with_state(state.clone(), writes_layer))
        .layer(middleware::from_fn_with_state(state.clone(), auth::layer))
        .layer(DefaultBodyLimit::max(extract::BODY_LIMIT))
        .with_state(state.clone());
    // The console calls this very API in-process, as the signed-in key,
    // through the typed client, so a click in the console passes the same
    // authentication, rate limits and audit log as the API call it makes.
    let telemetry_of = state.clone();
    let telemetry: flotilla_console::Telemetry = Arc::new(move || {
        telemetry_of
            .fresh_telemetry()
            .into_iter()
            .map(|(node, t)| (node, t.gpus))
            .collect()
    });
    let console = match flotilla_client::Client::in_process(console_connection(api.clone()), "")
        // A page answers at once: a refusal (429 included) is the page's
        // to show, not the client's to wait out.
        .retry(flotilla_client::RetryPolicy::none())
        .build()
    {
        Ok(client) => flotilla_console::router(flotilla_console::ConsoleState::new(
            client,
            state.clock(),
            telemetry,
        )),
        Err(e) => {
            tracing::error!(error = %e, "the console could not be set up; serving the API alone");
            axum::Router::new()
        }
    };
    api.merge(console)
    .layer(PropagateRequestIdLayer::new(request_id.clone()))
    .layer(
        TraceLayer::new_for_http().make_span_with(|req: &axum::http::Request<_>| {
            let id = req
                .headers()
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-");
            tracing::info_span!("request", method = %req.method(), path = %req.uri().path(), request_id = %id)
        }),
    )
    .layer(SetRequestIdLayer::new(request_id, MakeRequestUuid))
}

/// Connections to `api` that never leave the process: each call serves a
/// fresh in-memory connection as HTTP/1.1 with upgrades (so the console's
/// terminal can open the exec WebSocket) and returns the client's end.
fn console_connection(api: axum::Router) -> flotilla_client::InProcess {
    flotilla_client::InProcess::new(move || {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let service = hyper_util::service::TowerToHyperService::new(api.clone());
        tokio::spawn(async move {
            let served = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(server), service)
                .with_upgrades()
                .await;
            if let Err(e) = served {
                tracing::debug!(error = %e, "in-process API connection ended");
            }
        });
        client
    })
}

async fn health(axum::extract::State(st): axum::extract::State<AppState>) -> impl IntoResponse {
    match st.store().ping().await {
        Ok(()) => (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain")], "ok"),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::CONTENT_TYPE, "text/plain")],
            "database unavailable",
        ),
    }
}

/// `GET /v1/health`: whether the database answers, and this replica's part
/// (`leader` runs the control loops; a `follower` serves the API and names
/// the leader while its lease is current). No key needed, like `/healthz`:
/// load balancers and operators' probes read it.
async fn health_json(
    axum::extract::State(st): axum::extract::State<AppState>,
) -> impl IntoResponse {
    let database = st.store().ping().await.is_ok();
    let (role, leader, token) = match st.leadership() {
        state::Leadership::Leader { token, .. } if st.leads() => {
            ("leader", Some(st.replica().to_string()), Some(token))
        }
        state::Leadership::Leader { .. } => ("follower", None, None),
        state::Leadership::Follower { leader } => ("follower", leader, None),
    };
    let body = serde_json::json!({
        "status": if database { "ok" } else { "database unavailable" },
        "replica": st.replica(),
        "role": role,
        "leader": leader,
        "token": token,
        "backend": match st.store().backend() {
            flotilla_store::Backend::Sqlite => "sqlite",
            flotilla_store::Backend::Postgres => "postgres",
        },
    });
    let status = if database {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body))
}

/// Serves the API on `listener` until `shutdown` resolves, and runs the
/// reconcile loops while this replica holds the leader lease
/// ([`leader`]); then stops taking requests, ends long-polls and log
/// streams, gives the lease back, and returns. On SQLite it first takes
/// the lease, and fails when another server holds it.
pub async fn serve(
    store: Store,
    config: ServerConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_on(store, config, listener, shutdown).await
}

/// [`serve`] over HTTPS: TLS handshakes with `tls`'s certificate on
/// `listener` (a plain-HTTP request is answered 400 `https_required`).
pub async fn serve_https(
    store: Store,
    config: ServerConfig,
    listener: tokio::net::TcpListener,
    tls: flotilla_tls::ServerTls,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let https = Https(
        tls.listen(listener)
            .context("reading the listener's address")?,
    );
    // `tap_io` only to get axum's `ConnectInfo<SocketAddr>` for any
    // listener whose address is a `SocketAddr`: the anonymous rate limit
    // (`auth::layer`) keys on the peer's address over TLS too.
    use axum::serve::ListenerExt;
    serve_on(store, config, https.tap_io(|_| {}), shutdown).await
}

/// The API's HTTPS listener, as axum's `serve` takes one.
struct Https(flotilla_tls::TlsListener);

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

async fn serve_on<L>(
    store: Store,
    config: ServerConfig,
    listener: L,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()>
where
    L: axum::serve::Listener<Addr = std::net::SocketAddr>,
    for<'a> std::net::SocketAddr:
        axum::extract::connect_info::Connected<axum::serve::IncomingStream<'a, L>>,
{
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let tick = config.reconcile_tick;
    let lease = config.leader_lease();
    let state = AppState::new(store.clone(), config, Arc::new(SystemClock), stop_rx);
    let me = state.replica().to_string();
    if store.backend() == flotilla_store::Backend::Sqlite {
        leader::claim_single(&store, &me, lease).await?;
    }
    let leading = tokio::spawn(leader::run(state.clone(), tick, me));
    let addr = listener.local_addr().ok();
    tracing::info!(addr = ?addr, replica = %state.replica(), "serving the api");
    // With the peer's address: requests without a valid key are
    // rate-limited by it (`auth::layer`).
    axum::serve(
        listener,
        app(state).into_make_service_with_connect_info::<std::net::SocketAddr>(),
    )
    .with_graceful_shutdown(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    })
    .await
    .context("http server failed")?;
    let _ = leading.await;
    store.close().await;
    tracing::info!("server stopped");
    Ok(())
}
