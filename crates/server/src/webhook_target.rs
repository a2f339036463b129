//! Where budget webhooks may be sent.
//!
//! A tenant admin chooses the webhook URL and the server POSTs to it, so
//! without a rule a tenant could make the control plane call into the
//! operator's internal network (server-side request forgery: cloud metadata
//! at 169.254.169.254, databases on 10.x, admin ports on 127.0.0.1). The
//! rule is the egress policy every tenant-chosen connection follows
//! (`flotilla-egress`): public addresses only, plus what the operator
//! allows (`--allow-egress CIDR[:PORTS]`, or `--webhook-allow-private` for
//! every address, webhooks only). It is applied twice: when the budget is
//! set (for literal addresses and names that already resolve inward, so
//! the admin hears at once) and at every delivery, after DNS resolution,
//! connecting only to the addresses that were checked, so that a name that
//! changes its answer later (DNS rebinding) is still caught.

use std::net::SocketAddr;

use flotilla_egress::{EgressPolicy, Refused, ResolveError};

/// Why a target is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    /// Not an absolute `http://` or `https://` URL with a host.
    #[error("must be an http:// or https:// URL with a host")]
    NotHttp,
    /// The host is, or resolves to, an address the policy refuses.
    #[error("{host}: {refused}")]
    Private {
        /// The host as written in the URL.
        host: String,
        /// The refused address and its kind.
        #[source]
        refused: Refused,
    },
    /// The name did not resolve (delivery time only).
    #[error("{host} does not resolve: {reason}")]
    Unresolved {
        /// The host as written in the URL.
        host: String,
        /// The resolver's message.
        reason: String,
    },
}

impl From<ResolveError> for TargetError {
    fn from(e: ResolveError) -> Self {
        match e {
            ResolveError::Refused { host, refused } => TargetError::Private { host, refused },
            ResolveError::Unresolved { host, reason } => TargetError::Unresolved { host, reason },
        }
    }
}

/// The host and port of an `http(s)` URL, with IPv6 brackets removed.
pub fn host_port(url: &reqwest::Url) -> Result<(String, u16), TargetError> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(TargetError::NotHttp);
    }
    let host = url
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or(TargetError::NotHttp)?;
    // An IPv6 literal is written in brackets.
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
        .to_string();
    let port = url.port_or_known_default().ok_or(TargetError::NotHttp)?;
    Ok((host, port))
}

/// Resolves the URL's host and checks every address it resolves to (an
/// IP literal is its own answer) against `policy`. Returns the host and
/// the addresses a delivery must connect to: only those, never a second
/// lookup's.
pub async fn resolve(
    url: &reqwest::Url,
    policy: &EgressPolicy,
) -> Result<(String, Vec<SocketAddr>), TargetError> {
    let (host, port) = host_port(url)?;
    let addrs = flotilla_egress::resolve(&host, port, policy).await?;
    Ok((host, addrs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_egress::Inward;

    #[tokio::test]
    async fn literals_and_names_are_judged_by_what_they_reach() {
        let url = |s: &str| reqwest::Url::parse(s).unwrap();
        let public = EgressPolicy::default();
        let err = resolve(&url("http://[::1]:9/x"), &public)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, TargetError::Private { refused, .. } if refused.kind == Inward::Loopback),
            "{err}"
        );
        for inward in [
            "http://10.0.0.1/x",
            "http://169.254.169.254/latest/meta-data",
            "http://127.0.0.1:5432/",
        ] {
            let err = resolve(&url(inward), &public).await.unwrap_err();
            assert!(
                matches!(err, TargetError::Private { .. }),
                "{inward}: {err}"
            );
        }
        // `localhost` is a name: it is resolved (from /etc/hosts) and its
        // loopback answer refused.
        let err = resolve(&url("http://localhost:9/x"), &public)
            .await
            .unwrap_err();
        assert!(matches!(err, TargetError::Private { .. }), "{err}");
        assert!(err.to_string().contains("--allow-egress"), "{err}");
        let (host, addrs) = resolve(&url("http://127.0.0.1:9/x"), &EgressPolicy::allow_all())
            .await
            .unwrap();
        assert_eq!(host, "127.0.0.1");
        assert_eq!(addrs, vec!["127.0.0.1:9".parse().unwrap()]);
        let only_9 = EgressPolicy::new(vec!["127.0.0.1:9".parse().unwrap()]);
        assert!(resolve(&url("http://127.0.0.1:9/x"), &only_9).await.is_ok());
        assert!(resolve(&url("http://127.0.0.1:10/x"), &only_9)
            .await
            .is_err());
        let (_, addrs) = resolve(&url("https://8.8.8.8/x"), &public).await.unwrap();
        assert_eq!(addrs[0].port(), 443);
        assert_eq!(
            resolve(&url("ftp://8.8.8.8/x"), &public).await.unwrap_err(),
            TargetError::NotHttp
        );
    }
}
