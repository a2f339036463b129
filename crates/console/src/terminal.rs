//! The instance page's terminal: a WebSocket from the browser, signed in
//! by the console's session cookie, handed to the API's own
//! `GET /v1/instances/{id}/exec` as the signed-in key.
//!
//! Browsers cannot put an `Authorization` header on a WebSocket, so the
//! console answers the handshake at `/instances/{id}/terminal` and passes
//! it on in-process, like every other console page: the API's route
//! checks the key, the instance and its state, records the session in the
//! audit log (a `GET` of `/v1/instances/{instance_id}/exec`, refusals
//! included), waits for the agent and splices the two ends. This module
//! never opens, records or splices a session itself.
//!
//! A cookie travels with any request to this origin, so before the
//! handshake goes anywhere the console checks that the page asking is its
//! own: the `Origin` header (which browsers always send on a WebSocket and
//! a page cannot forge) must name this host, and the query must carry the
//! session's CSRF token. That stops cross-site WebSocket hijacking.

use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::ws::{Message, WebSocketUpgrade};
use axum::extract::{ConnectInfo, FromRequestParts, Path, Query, Request, State};
use axum::http::header::{AUTHORIZATION, COOKIE, HOST, ORIGIN};
use axum::http::{HeaderMap, HeaderName, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use flotilla_core::access::Frame;
use futures::SinkExt as _;
use serde::Deserialize;

use super::session::{urlencode, Session};
use super::tenant::seg;
use super::{ConsoleError, ConsoleResult, ConsoleState};

/// What the terminal runs: bash where the instance has it, else sh (what
/// `flotilla shell` runs when not told otherwise).
pub const SHELL: [&str; 3] = [
    "sh",
    "-c",
    "if command -v bash >/dev/null 2>&1; then exec bash; else exec sh; fi",
];

/// Largest refusal read back from the API for its message.
const REFUSAL_LIMIT: usize = 64 * 1024;

pub(super) fn routes() -> Router<ConsoleState> {
    Router::new().route("/instances/{id}/terminal", get(terminal))
}

#[derive(Deserialize)]
struct TerminalQuery {
    csrf: Option<String>,
    cols: Option<u16>,
    rows: Option<u16>,
}

/// Whether the request's `Origin` is this server as the browser reached
/// it (the `Host` it sent). A missing `Origin` is refused: every browser
/// sends one on a WebSocket handshake.
pub fn same_origin(headers: &HeaderMap) -> bool {
    let header = |name: HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
    let (Some(origin), Some(host)) = (header(ORIGIN), header(HOST)) else {
        return false;
    };
    let authority = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    authority.is_some_and(|a| !a.is_empty() && a.eq_ignore_ascii_case(host))
}

/// The API's path for the terminal's session.
fn exec_path(id: &str, cols: u16, rows: u16) -> ConsoleResult<String> {
    let command = serde_json::to_string(&SHELL).map_err(ConsoleError::internal)?;
    Ok(format!(
        "/v1/instances/{id}/exec?command={}&tty=true&cols={cols}&rows={rows}",
        urlencode(&command)
    ))
}

/// `GET /instances/{id}/terminal?csrf=&cols=&rows=`: the WebSocket of the
/// terminal tab, carrying the API's session frames (`docs/access.md`).
async fn terminal(
    State(st): State<ConsoleState>,
    s: Session,
    Path(id): Path<String>,
    Query(q): Query<TerminalQuery>,
    req: Request,
) -> ConsoleResult<Response> {
    let id = seg(&id)?;
    if !same_origin(req.headers()) {
        return Err(ConsoleError::Csrf);
    }
    s.check_csrf(q.csrf.as_deref())?;
    let (mut parts, _) = req.into_parts();
    // The connection's upgrade goes to the API's handler; a clone stays
    // here, to tell the browser why when the API refuses.
    let upgrade = parts.extensions.get::<hyper::upgrade::OnUpgrade>().cloned();
    let peer = parts.extensions.get::<ConnectInfo<SocketAddr>>().cloned();
    let ws = WebSocketUpgrade::from_request_parts(&mut parts, &())
        .await
        .map_err(|_| ConsoleError::Api {
            status: StatusCode::BAD_REQUEST,
            message: "the terminal is a WebSocket: open it from the instance's page".into(),
        })?;
    let path = exec_path(id, q.cols.unwrap_or(80), q.rows.unwrap_or(24))?;
    // A fresh request: the console's own routing (its matched path and
    // path parameters) must not reach the API's router, which would add
    // its own to them.
    let mut inner = axum::http::Request::builder()
        .method(Method::GET)
        .uri(path)
        .body(Body::empty())
        .map_err(ConsoleError::internal)?;
    for (name, value) in &parts.headers {
        if *name != COOKIE && *name != AUTHORIZATION {
            inner.headers_mut().append(name, value.clone());
        }
    }
    if let Some(u) = upgrade {
        inner.extensions_mut().insert(u);
    }
    if let Some(p) = peer {
        inner.extensions_mut().insert(p);
    }
    let answer = st.api.forward_as(&s, inner).await?;
    if answer.status() == StatusCode::SWITCHING_PROTOCOLS {
        return Ok(answer);
    }
    // Refused (not running, another tenant's, a role that may not enter):
    // the browser cannot read a failed handshake, so it gets the API's
    // message as an error frame instead.
    let status = answer.status();
    let body = axum::body::to_bytes(answer.into_body(), REFUSAL_LIMIT)
        .await
        .unwrap_or_default();
    let message = refusal(status, &body);
    Ok(ws
        .on_upgrade(move |mut socket| async move {
            let frame = Frame::Error(message).encode();
            let _ = socket.send(Message::Binary(frame.into())).await;
            let _ = socket.close().await;
        })
        .into_response())
}

/// The message of the API's refusal, for the terminal.
fn refusal(status: StatusCode, body: &[u8]) -> String {
    if status == StatusCode::UNAUTHORIZED {
        return "the key of this console session stopped working: sign in again".into();
    }
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    match v["error"]["message"].as_str() {
        Some(m) => m.to_string(),
        None => format!("the session was refused ({})", status.as_u16()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(origin: Option<&str>, host: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(HOST, host.parse().unwrap());
        if let Some(o) = origin {
            h.insert(ORIGIN, o.parse().unwrap());
        }
        h
    }

    #[test]
    fn only_the_consoles_own_pages_may_open_a_terminal() {
        assert!(same_origin(&headers(
            Some("http://127.0.0.1:7420"),
            "127.0.0.1:7420"
        )));
        assert!(same_origin(&headers(
            Some("https://Console.Example"),
            "console.example"
        )));
        for (origin, host) in [
            (None, "127.0.0.1:7420"),
            (Some("http://evil.example"), "127.0.0.1:7420"),
            (Some("http://127.0.0.1:7421"), "127.0.0.1:7420"),
            (Some("null"), "127.0.0.1:7420"),
            (Some("http://"), ""),
            (Some("ftp://127.0.0.1:7420"), "127.0.0.1:7420"),
        ] {
            assert!(!same_origin(&headers(origin, host)), "{origin:?} {host}");
        }
    }

    #[test]
    fn the_terminal_runs_the_shell_flotilla_shell_runs() {
        let p = exec_path("inst_1", 120, 40).unwrap();
        assert!(p.starts_with("/v1/instances/inst_1/exec?command=%5B%22sh%22%2C%22-c%22%2C"));
        assert!(p.ends_with("&tty=true&cols=120&rows=40"), "{p}");
    }

    #[test]
    fn refusals_read_as_the_apis_message() {
        let body = br#"{"error": {"code": "conflict", "message": "instance inst_1 is stopped, not running"}}"#;
        assert_eq!(
            refusal(StatusCode::CONFLICT, body),
            "instance inst_1 is stopped, not running"
        );
        assert!(refusal(StatusCode::UNAUTHORIZED, b"").contains("sign in"));
        assert!(refusal(StatusCode::BAD_GATEWAY, b"oops").contains("502"));
    }
}
