//! The CLI's side of `flotilla-client`, the one client of the API: how the
//! CLI builds it (several comma-separated server URLs fail over), how it
//! reads the client's errors, and how it phrases them for a person.
//!
//! Commands call the client's typed method of each route and get the
//! API's own types back (`flotilla_core::api`, `flotilla_billing::api`);
//! `--json` prints that answer written out again
//! ([`crate::output::print_answer`]). They name no URL path and never read
//! an answer by key. This module never prints.

use anyhow::Result;

pub use flotilla_client::{Client, Error as ClientError, LogFollow};

/// A client of `servers` (one URL or several, comma-separated) with
/// `api_key`, trusting `https://` servers by `trust`.
pub fn connect(servers: &str, api_key: &str, trust: flotilla_client::Trust) -> Result<Client> {
    Ok(Client::builder(servers, api_key)
        .trust(trust)
        .user_agent(concat!("flotilla-cli/", env!("CARGO_PKG_VERSION")))
        .build()?)
}

/// Whether an error of the client may pass when tried again.
pub fn is_transient(e: &anyhow::Error) -> bool {
    e.downcast_ref::<ClientError>()
        .is_some_and(ClientError::is_transient)
}

/// A client error as the CLI says it: the server's own sentence for an
/// answer, and a hint for a server that cannot be reached.
pub fn describe(e: &ClientError) -> String {
    if e.is_unreachable() {
        return format!("{e}: is `flotilla up` running?");
    }
    if e.code() == Some("https_required") {
        return format!(
            "{}: the server serves HTTPS; use its https:// URL (with --tls-fingerprint or --ca-cert for a self-signed certificate)",
            e.message()
        );
    }
    e.message()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_phrased_for_a_person() {
        let e = ClientError::Api {
            status: 404,
            code: "not_found".into(),
            message: "instance inst_x not found".into(),
            field: None,
            retry_after: None,
        };
        assert_eq!(describe(&e), "instance inst_x not found");
        assert!(!is_transient(&anyhow::Error::new(e)));
        let e = ClientError::Transport {
            server: "http://127.0.0.1:1".into(),
            kind: flotilla_client::TransportKind::Connect,
            message: String::new(),
        };
        assert_eq!(
            describe(&e),
            "cannot reach the server at http://127.0.0.1:1: is `flotilla up` running?"
        );
        assert!(is_transient(&anyhow::Error::new(e)));
    }
}
