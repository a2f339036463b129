//! The instance page's terminal: a WebSocket from the browser, signed in
//! by the console's session cookie, joined to the API's own
//! `GET /v1/instances/{id}/exec` session opened as the signed-in key
//! ([`flotilla_client::Client::exec`], in-process when the server mounts
//! the console).
//!
//! Browsers cannot put an `Authorization` header on a WebSocket, so the
//! console answers the handshake at `/instances/{id}/terminal` and opens
//! the session through the client, like every other console page: the
//! API's route checks the key, the instance and its state, records the
//! session in the audit log (a `GET` of `/v1/instances/{instance_id}/exec`,
//! refusals included), waits for the agent and splices the two ends. This
//! module only relays the session's frames, unchanged, between the
//! browser and the API.
//!
//! A cookie travels with any request to this origin, so before the
//! handshake goes anywhere the console checks that the page asking is its
//! own: the `Origin` header (which browsers always send on a WebSocket and
//! a page cannot forge) must name this host, and the query must carry the
//! session's CSRF token. That stops cross-site WebSocket hijacking.

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query};
use axum::http::header::{HOST, ORIGIN};
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use flotilla_core::access::{AccessKind, Frame};
use futures::{SinkExt as _, StreamExt as _};
use serde::Deserialize;

use super::session::Session;
use super::tenant::seg;
use super::{ConsoleError, ConsoleResult, ConsoleState};

/// What the terminal runs: bash where the instance has it, else sh (what
/// `flotilla shell` runs when not told otherwise).
pub const SHELL: [&str; 3] = [
    "sh",
    "-c",
    "if command -v bash >/dev/null 2>&1; then exec bash; else exec sh; fi",
];

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

/// The session the terminal asks the API for: [`SHELL`] on a terminal of
/// the browser's size.
fn shell_session(cols: u16, rows: u16) -> AccessKind {
    AccessKind::Exec {
        command: SHELL.iter().map(|s| s.to_string()).collect(),
        tty: true,
        cols,
        rows,
    }
}

/// `GET /instances/{id}/terminal?csrf=&cols=&rows=`: the WebSocket of the
/// terminal tab, carrying the API's session frames (`docs/access.md`).
async fn terminal(
    s: Session,
    Path(id): Path<String>,
    Query(q): Query<TerminalQuery>,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> ConsoleResult<Response> {
    let id = seg(&id)?;
    if !same_origin(&headers) {
        return Err(ConsoleError::Csrf);
    }
    s.check_csrf(q.csrf.as_deref())?;
    let ws = ws.map_err(|_| ConsoleError::Api {
        status: StatusCode::BAD_REQUEST,
        message: "the terminal is a WebSocket: open it from the instance's page".into(),
    })?;
    let kind = shell_session(q.cols.unwrap_or(80), q.rows.unwrap_or(24));
    // Opened before the browser's handshake is answered, so that a refusal
    // (not running, another tenant's, a role that may not enter) reaches
    // the browser, which cannot read a failed handshake, as an error
    // frame on an accepted one.
    let opened = s.api.exec(id, &kind).await;
    Ok(ws
        .on_upgrade(move |socket| async move {
            match opened {
                Ok(session) => relay(socket, session).await,
                Err(e) => {
                    let mut socket = socket;
                    let frame = Frame::Error(refusal(&e)).encode();
                    let _ = socket.send(Message::Binary(frame.into())).await;
                    let _ = socket.close().await;
                }
            }
        })
        .into_response())
}

/// Carries frames both ways until either side ends: the browser's input
/// and resizes to the API, the session's output and exit to the browser.
async fn relay(browser: WebSocket, session: flotilla_client::Session) {
    let (mut to_api, mut from_api) = session.split();
    let (mut to_browser, mut from_browser) = browser.split();
    let up = async {
        while let Some(Ok(m)) = from_browser.next().await {
            match m {
                Message::Binary(b) => {
                    let Ok(frame) = Frame::decode(&b) else { break };
                    if to_api.send(&frame).await.is_err() {
                        break;
                    }
                }
                Message::Close(_) => break,
                _ => {}
            }
        }
        to_api.close().await;
    };
    let down = async {
        while let Some(next) = from_api.recv().await {
            let frame = match next {
                Ok(frame) => frame,
                Err(e) => Frame::Error(e.message()),
            };
            let last = matches!(frame, Frame::Error(_));
            if to_browser
                .send(Message::Binary(frame.encode().into()))
                .await
                .is_err()
                || last
            {
                break;
            }
        }
        let _ = to_browser.close().await;
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

/// The message of the API's refusal, for the terminal.
fn refusal(e: &flotilla_client::Error) -> String {
    match e.status() {
        Some(401) => "the key of this console session stopped working: sign in again".into(),
        Some(status) if e.code() == Some(&format!("http_{status}")) => {
            format!("the session was refused ({status})")
        }
        _ => e.message(),
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
        let AccessKind::Exec {
            command,
            tty,
            cols,
            rows,
        } = shell_session(120, 40)
        else {
            panic!("not an exec session");
        };
        assert_eq!(command, SHELL);
        assert!(tty);
        assert_eq!((cols, rows), (120, 40));
    }

    fn answer(status: u16, code: &str, message: &str) -> flotilla_client::Error {
        flotilla_client::Error::Api {
            status,
            code: code.into(),
            message: message.into(),
            field: None,
            retry_after: None,
        }
    }

    #[test]
    fn refusals_read_as_the_apis_message() {
        assert_eq!(
            refusal(&answer(
                409,
                "conflict",
                "instance inst_1 is stopped, not running"
            )),
            "instance inst_1 is stopped, not running"
        );
        assert!(refusal(&answer(401, "unauthorized", "no")).contains("sign in"));
        assert!(refusal(&answer(502, "http_502", "oops")).contains("502"));
    }
}
