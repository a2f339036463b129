//! The web console, served at `/`: server-rendered pages (maud) made live
//! with htmx, and charts drawn by uPlot. Every asset is compiled into the
//! binary (`include_str!`/`include_bytes!` of the checked-in files under
//! `assets/`, whose `package-lock.json` names the exact npm packages they
//! came from), so the console needs no network and no build step.
//!
//! Pages read and change state only through the API's typed client
//! (`flotilla_client`), which the server hands over reaching the API
//! in-process, and which each session holds as its signed-in key
//! ([`session::Session::api`]): the console can show nothing and do
//! nothing that the key could not through the API.
//! It never depends on the server or the store: what it needs of the
//! server that the API does not answer (its clock, its fresh GPU
//! telemetry) is handed to it as values when the server mounts it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use axum::extract::{Form, State};
use axum::http::header::{CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, SET_COOKIE};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;
use flotilla_client::Client;
use maud::{html, Markup, PreEscaped, DOCTYPE};

use flotilla_core::api::GpuSample;
use flotilla_core::clock::Clock;
use flotilla_core::id::NodeId;

pub mod fmt;
pub mod operator;
pub mod replay;
pub mod session;
pub mod tenant;
pub mod terminal;

use session::{Session, Sessions, LOGIN_COOKIE, SESSION_COOKIE, SESSION_TTL};

/// The GPU readings of every node heard from recently, by node: what the
/// fleet map colours by utilisation or temperature. The server hands the
/// console its in-memory telemetry, which no API route lists.
pub type Telemetry = Arc<dyn Fn() -> HashMap<NodeId, Vec<GpuSample>> + Send + Sync>;

/// What the console's handlers share.
#[derive(Clone)]
pub struct ConsoleState {
    /// The API, keyless: each session calls it with its own key
    /// ([`Client::with_token`]).
    pub api: Client,
    /// The server's clock (a manual one in tests): the console never
    /// reads the wall clock itself, so its months and "offered now" agree
    /// with the API's.
    pub clock: Arc<dyn Clock>,
    /// The server's fresh telemetry.
    pub telemetry: Telemetry,
    /// Signed-in browsers.
    pub sessions: Sessions,
    /// Recent samples of each endpoint's replicas and traffic, for its
    /// chart: taken when a browser polls the chart, kept in memory.
    pub series: Arc<Mutex<HashMap<String, VecDeque<Sample>>>>,
}

/// One point of an endpoint's chart.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    /// Unix seconds.
    pub t: i64,
    /// Replicas routed to.
    pub ready: u32,
    /// Replicas not yet stopped.
    pub replicas: u32,
    /// The autoscaler's target.
    pub desired: u32,
    /// Requests per second since the previous sample.
    pub rps: f64,
    /// Requests in flight and queued at the gateway.
    pub in_flight: u32,
    /// The gateway's p95 latency, ms.
    pub p95_ms: Option<f64>,
    /// The endpoint's SLO, ms.
    pub slo_ms: u64,
    /// The gateway's request counter at this point.
    #[serde(skip)]
    pub requests_total: u64,
}

/// Why a console request failed.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    /// No session, or the key stopped working: sign in again.
    #[error("sign in first")]
    SignIn,
    /// A form without this session's token.
    #[error("the form is stale or was not sent by this console: reload the page and try again")]
    Csrf,
    /// The API refused.
    #[error("{message}")]
    Api {
        /// Its status.
        status: StatusCode,
        /// Its message.
        message: String,
    },
    /// A form field is wrong.
    #[error("{field}: {message}")]
    Field {
        /// The field.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
    /// Something broke inside.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ConsoleError {
    /// Wraps an unexpected failure.
    pub fn internal(e: impl std::fmt::Display) -> Self {
        Self::Internal(e.to_string())
    }

    /// A field error.
    pub fn field(field: &'static str, message: impl Into<String>) -> Self {
        Self::Field {
            field,
            message: message.into(),
        }
    }

    fn status(&self) -> StatusCode {
        match self {
            Self::SignIn => StatusCode::UNAUTHORIZED,
            Self::Csrf => StatusCode::FORBIDDEN,
            Self::Api { status, .. } => *status,
            Self::Field { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        if let Self::SignIn = self {
            // htmx follows `HX-Redirect`; a plain request the 303.
            let mut r = Redirect::to("/login").into_response();
            r.headers_mut()
                .insert("HX-Redirect", HeaderValue::from_static("/login"));
            return r;
        }
        if let Self::Internal(e) = &self {
            tracing::error!(error = %e, "console request failed");
        }
        let status = self.status();
        let title = match status {
            StatusCode::NOT_FOUND => "Not found".to_string(),
            StatusCode::FORBIDDEN => "Not allowed".to_string(),
            s => format!("Error {}", s.as_u16()),
        };
        let body = html! {
            main.narrow {
                h1 { (title) }
                p.error role="alert" { (self.to_string()) }
                p { a href="/" { "Back to the console" } }
            }
        };
        secure((status, shell(&title, body))).into_response()
    }
}

/// Result of a console handler.
pub type ConsoleResult<T> = Result<T, ConsoleError>;

impl ConsoleState {
    /// A console over `api` (whose key is never used: sessions replace
    /// it with theirs), reading `clock` and `telemetry`, with no one
    /// signed in.
    pub fn new(api: Client, clock: Arc<dyn Clock>, telemetry: Telemetry) -> Self {
        Self {
            api,
            clock,
            telemetry,
            sessions: Sessions::default(),
            series: Arc::default(),
        }
    }

    /// Now, by the server's clock.
    pub fn now(&self) -> chrono::DateTime<chrono::Utc> {
        self.clock.now()
    }
}

/// The console's routes, mounted by the server beside the API.
pub fn router(st: ConsoleState) -> Router {
    Router::new()
        .route("/", get(home))
        .route("/login", get(login_page).post(login))
        .route("/logout", post(logout))
        .route("/assets/{name}", get(asset))
        .merge(tenant::routes())
        .merge(terminal::routes())
        .merge(operator::routes())
        .merge(replay::routes())
        .with_state(st)
}

/// Security headers of every console page: a strict content policy (only
/// the console's own scripts and styles; uPlot and xterm.js set element
/// styles from script, which the policy allows; connections, the
/// terminal's WebSocket included, to the console's own origin only), no
/// framing, no caching of pages that show a tenant's data.
pub fn secure(r: impl IntoResponse) -> Response {
    let mut r = r.into_response();
    let h = r.headers_mut();
    h.insert(
        CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; script-src 'self'; connect-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
        ),
    );
    h.insert("X-Frame-Options", HeaderValue::from_static("DENY"));
    h.insert(
        "X-Content-Type-Options",
        HeaderValue::from_static("nosniff"),
    );
    h.insert("Referrer-Policy", HeaderValue::from_static("same-origin"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

const HTMX: &str = include_str!("assets/htmx.min.js");
const UPLOT: &str = include_str!("assets/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("assets/uPlot.min.css");
const XTERM: &str = include_str!("assets/xterm.min.js");
const XTERM_CSS: &str = include_str!("assets/xterm.css");
const XTERM_FIT: &str = include_str!("assets/addon-fit.min.js");
const CONSOLE_JS: &str = include_str!("assets/console.js");
const CONSOLE_CSS: &str = include_str!("assets/console.css");

async fn asset(axum::extract::Path(name): axum::extract::Path<String>) -> Response {
    let (body, ty) = match name.as_str() {
        "htmx.min.js" => (HTMX, "text/javascript; charset=utf-8"),
        "uPlot.iife.min.js" => (UPLOT, "text/javascript; charset=utf-8"),
        "uPlot.min.css" => (UPLOT_CSS, "text/css; charset=utf-8"),
        "xterm.min.js" => (XTERM, "text/javascript; charset=utf-8"),
        "xterm.css" => (XTERM_CSS, "text/css; charset=utf-8"),
        "addon-fit.min.js" => (XTERM_FIT, "text/javascript; charset=utf-8"),
        "console.js" => (CONSOLE_JS, "text/javascript; charset=utf-8"),
        "console.css" => (CONSOLE_CSS, "text/css; charset=utf-8"),
        _ => return (StatusCode::NOT_FOUND, "no such asset").into_response(),
    };
    (
        [(CONTENT_TYPE, ty), (CACHE_CONTROL, "public, max-age=3600")],
        body,
    )
        .into_response()
}

/// A whole HTML document around `body`.
fn shell(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                meta name="htmx-config" content=r#"{"includeIndicatorStyles":false,"allowEval":false}"#;
                title { (title) " · Flotilla" }
                link rel="stylesheet" href="/assets/uPlot.min.css";
                link rel="stylesheet" href="/assets/console.css";
                script src="/assets/htmx.min.js" defer {}
                script src="/assets/uPlot.iife.min.js" defer {}
                script src="/assets/console.js" defer {}
            }
            body { (body) }
        }
    }
}

/// One entry of the navigation.
struct Nav {
    href: &'static str,
    label: &'static str,
}

fn nav_for(s: &Session) -> Vec<(&'static str, Vec<Nav>)> {
    let n = |href, label| Nav { href, label };
    let mut groups = vec![(
        "Compute",
        vec![
            n("/gpus", "GPUs"),
            n("/instances", "Instances"),
            n("/jobs", "Jobs"),
            n("/endpoints", "Endpoints"),
            n("/queue", "Queue"),
        ],
    )];
    groups.push((
        "Billing",
        vec![
            n("/billing", "Usage & invoices"),
            n("/budget", "Budget"),
            n("/estimate", "Estimator"),
            n("/prices", "Prices"),
            n("/keys", "API keys"),
        ],
    ));
    if s.is_operator() {
        groups.push((
            "Operator",
            vec![
                n("/fleet", "Fleet map"),
                n("/tenants", "Tenants"),
                n("/replay", "Replay demand"),
            ],
        ));
    }
    if s.is_provider() {
        groups.push(("Provider", vec![n("/provider", "My GPUs & payouts")]));
    }
    groups
}

/// A signed-in page: header, navigation, `body`.
pub fn page(s: &Session, title: &str, active: &str, body: Markup) -> Response {
    let doc = shell(
        title,
        html! {
            a.skip href="#main" { "Skip to content" }
            header.top {
                a.brand href="/" { "Flotilla" }
                span.who {
                    (s.tenant_name) " · " (s.role.as_str())
                }
                form.inline method="post" action="/logout" {
                    input type="hidden" name="csrf" value=(s.csrf);
                    button type="submit" { "Sign out" }
                }
            }
            div.layout {
                nav aria-label="Console" {
                    @for (group, items) in nav_for(s) {
                        h2 { (group) }
                        ul {
                            @for i in items {
                                li {
                                    a href=(i.href) aria-current=[(i.href == active).then_some("page")] { (i.label) }
                                }
                            }
                        }
                    }
                }
                main #main tabindex="-1" {
                    h1 { (title) }
                    (body)
                }
            }
        },
    );
    secure(doc)
}

/// The hidden field carrying the session's form token.
pub fn csrf_field(s: &Session) -> Markup {
    html! { input type="hidden" name="csrf" value=(s.csrf); }
}

/// Form fields as sent (a field may repeat; the last wins in [`Fields::get`]).
pub type Fields = Vec<(String, String)>;

/// The value of form field `name`, trimmed; `None` when absent or blank.
pub fn field<'a>(f: &'a Fields, name: &str) -> Option<&'a str> {
    f.iter()
        .rev()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.trim())
        .filter(|v| !v.is_empty())
}

/// Checks the form's CSRF token against the session's.
pub fn check(s: &Session, f: &Fields) -> ConsoleResult<()> {
    s.check_csrf(field(f, "csrf"))
}

async fn home(s: Option<Session>) -> Redirect {
    match s {
        Some(s) if s.is_operator() => Redirect::to("/fleet"),
        Some(_) => Redirect::to("/instances"),
        None => Redirect::to("/login"),
    }
}

impl axum::extract::OptionalFromRequestParts<ConsoleState> for Session {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &ConsoleState,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(session::cookie(&parts.headers, SESSION_COOKIE).and_then(|id| state.sessions.get(id)))
    }
}

fn login_form(token: &str, error: Option<&str>) -> Markup {
    html! {
        main.narrow #main {
            h1 { "Sign in to Flotilla" }
            @if let Some(e) = error {
                p.error role="alert" #login-error { (e) }
            }
            form method="post" action="/login" {
                input type="hidden" name="csrf" value=(token);
                label for="api_key" { "API key" }
                input #api_key type="password" name="api_key" autocomplete="off" required
                    placeholder="flt_…" aria-describedby="key-help";
                p.help #key-help { "`flotilla up` prints the operator key on first start; "
                    "`flotilla keys create` makes one for a tenant." }
                button type="submit" { "Sign in" }
            }
        }
    }
}

/// The sign-in form with a fresh CSRF token, in its cookie and its hidden
/// field, answered with `status` and, after a failed attempt, `error`.
fn sign_in_page(status: StatusCode, error: Option<&str>) -> Response {
    let token = session::random_token();
    let mut r = secure((status, shell("Sign in", login_form(&token, error))));
    if let Ok(v) = session::set_cookie(
        LOGIN_COOKIE,
        Some(&token),
        std::time::Duration::from_secs(3600),
    )
    .parse()
    {
        r.headers_mut().append(SET_COOKIE, v);
    }
    r
}

async fn login_page() -> Response {
    sign_in_page(StatusCode::OK, None)
}

async fn login(
    State(st): State<ConsoleState>,
    headers: HeaderMap,
    Form(f): Form<Fields>,
) -> Response {
    let fail = |status: StatusCode, msg: &str| sign_in_page(status, Some(msg));
    let sent = field(&f, "csrf").unwrap_or("");
    let ok = session::cookie(&headers, LOGIN_COOKIE).is_some_and(|c| session::same_token(c, sent));
    if !ok {
        return fail(StatusCode::FORBIDDEN, "the sign-in form expired: try again");
    }
    let Some(secret) = field(&f, "api_key") else {
        return fail(
            StatusCode::UNPROCESSABLE_ENTITY,
            "api_key: enter an API key",
        );
    };
    let api = st.api.with_token(secret);
    let me = match api.me().await {
        Ok(me) => me,
        Err(e) if e.status() == Some(429) => {
            return fail(
                StatusCode::TOO_MANY_REQUESTS,
                "too many attempts: wait a moment",
            )
        }
        Err(_) => {
            return fail(
                StatusCode::UNAUTHORIZED,
                "that key is not valid, or was revoked",
            )
        }
    };
    let s = st
        .sessions
        .open(api, me.key.role, me.key.tenant_id, me.tenant.name);
    let to = if s.is_operator() {
        "/fleet"
    } else {
        "/instances"
    };
    let mut r = Redirect::to(to).into_response();
    if let Ok(v) = session::set_cookie(SESSION_COOKIE, Some(&s.id), SESSION_TTL).parse() {
        r.headers_mut().append(SET_COOKIE, v);
    }
    if let Ok(v) = session::set_cookie(LOGIN_COOKIE, None, SESSION_TTL).parse() {
        r.headers_mut().append(SET_COOKIE, v);
    }
    r
}

async fn logout(
    State(st): State<ConsoleState>,
    s: Session,
    Form(f): Form<Fields>,
) -> ConsoleResult<Response> {
    check(&s, &f)?;
    st.sessions.close(&s.id);
    let mut r = Redirect::to("/login").into_response();
    if let Ok(v) = session::set_cookie(SESSION_COOKIE, None, SESSION_TTL).parse() {
        r.headers_mut().append(SET_COOKIE, v);
    }
    Ok(r)
}

/// A `<table>` with a caption and column headers.
pub fn table(caption: &str, headers: &[&str], rows: Vec<Markup>, empty: &str) -> Markup {
    html! {
        div.scroll {
            table {
                caption { (caption) }
                thead { tr { @for h in headers { th scope="col" { (h) } } } }
                tbody {
                    @if rows.is_empty() {
                        tr { td.empty colspan=(headers.len()) { (empty) } }
                    }
                    @for r in rows { (r) }
                }
            }
        }
    }
}

/// A state as a coloured badge (colour never alone: the word is there).
pub fn badge(state: &str) -> Markup {
    let class = match state {
        "running" | "ready" | "succeeded" | "finalised" => "ok",
        "pending" | "scheduled" | "starting" | "draft" | "queued" => "wait",
        "failed" | "lost" | "unreachable" | "unhealthy" | "cordoned" => "bad",
        _ => "neutral",
    };
    html! { span class={ "badge " (class) } { (state) } }
}

/// The fragment-or-page switch of htmx polling: `HX-Request` marks a
/// fragment request.
pub fn is_htmx(h: &HeaderMap) -> bool {
    h.contains_key("HX-Request")
}

/// Renders a fragment (for htmx swaps) with the console's headers.
pub fn fragment(m: Markup) -> Response {
    secure(m)
}

/// Inline JSON for the charts (read by `console.js`); `<` escaped so it
/// cannot close the script element.
pub fn json_data(id: &str, v: &impl serde::Serialize) -> Markup {
    let text = serde_json::to_string(v)
        .unwrap_or_else(|_| "null".into())
        .replace('<', "\\u003c");
    html! { script type="application/json" id=(id) { (PreEscaped(text)) } }
}

/// Groups `(key, value)` pairs.
pub fn group<K: Ord, V>(items: impl IntoIterator<Item = (K, V)>) -> BTreeMap<K, Vec<V>> {
    let mut m: BTreeMap<K, Vec<V>> = BTreeMap::new();
    for (k, v) in items {
        m.entry(k).or_default().push(v);
    }
    m
}
