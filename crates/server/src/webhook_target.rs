//! Where budget webhooks may be sent.
//!
//! A tenant admin chooses the webhook URL and the server POSTs to it, so
//! without a rule a tenant could make the control plane call into the
//! operator's internal network (server-side request forgery: cloud metadata
//! at 169.254.169.254, databases on 10.x, admin ports on 127.0.0.1). Unless
//! the operator allows private targets (`--webhook-allow-private`, for a
//! receiver on the same host or network), a webhook may only reach public
//! addresses. The rule is applied twice: when the budget is set (for
//! literal addresses and names that already resolve inward, so the admin
//! hears at once) and at every delivery, after DNS resolution, connecting
//! only to the addresses that were checked, so that a name that changes
//! its answer later (DNS rebinding) is still caught.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Why a target is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    /// Not an absolute `http://` or `https://` URL with a host.
    #[error("must be an http:// or https:// URL with a host")]
    NotHttp,
    /// The host is, or resolves to, an address of a forbidden kind.
    #[error(
        "{host} is {kind} address ({addr}); webhooks may only reach public addresses unless the \
         operator starts the server with --webhook-allow-private"
    )]
    Private {
        /// The host as written in the URL.
        host: String,
        /// The offending address.
        addr: IpAddr,
        /// `a loopback`, `a private`, …
        kind: &'static str,
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

/// The kind of address `ip` is when a webhook must not reach it, `None`
/// for a public address. IPv4 addresses written as IPv6 (`::ffff:a.b.c.d`)
/// are judged as the IPv4 address they reach.
pub fn forbidden_kind(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => forbidden_v4(v4),
            None => forbidden_v6(v6),
        },
    }
}

fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    if ip.is_unspecified() || ip.octets()[0] == 0 {
        // 0.0.0.0/8 "this network": 0.0.0.0 connects to the local host.
        Some("an unspecified")
    } else if ip.is_loopback() {
        Some("a loopback")
    } else if ip.is_private() {
        Some("a private")
    } else if ip.is_link_local() {
        Some("a link-local")
    } else {
        None
    }
}

fn forbidden_v6(ip: Ipv6Addr) -> Option<&'static str> {
    if ip.is_unspecified() {
        Some("an unspecified")
    } else if ip.is_loopback() {
        Some("a loopback")
    } else if ip.is_unique_local() {
        Some("a unique-local")
    } else if ip.is_unicast_link_local() {
        Some("a link-local")
    } else {
        None
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

/// Checks `addrs`, the addresses `host` stands for.
pub fn check_addrs(host: &str, addrs: &[SocketAddr]) -> Result<(), TargetError> {
    for a in addrs {
        if let Some(kind) = forbidden_kind(a.ip()) {
            return Err(TargetError::Private {
                host: host.to_string(),
                addr: a.ip(),
                kind,
            });
        }
    }
    Ok(())
}

/// Resolves the URL's host and checks every address it resolves to (an
/// IP literal is its own answer). Returns the host and the addresses a
/// delivery must connect to: only those, never a second lookup's.
pub async fn resolve(
    url: &reqwest::Url,
    allow_private: bool,
) -> Result<(String, Vec<SocketAddr>), TargetError> {
    let (host, port) = host_port(url)?;
    let addrs: Vec<SocketAddr> = match host.parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => tokio::net::lookup_host((host.as_str(), port))
            .await
            .map_err(|e| TargetError::Unresolved {
                host: host.clone(),
                reason: e.to_string(),
            })?
            .collect(),
    };
    if addrs.is_empty() {
        return Err(TargetError::Unresolved {
            host,
            reason: "no addresses".into(),
        });
    }
    if !allow_private {
        check_addrs(&host, &addrs)?;
    }
    Ok((host, addrs))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(s: &str) -> Option<&'static str> {
        forbidden_kind(s.parse().unwrap())
    }

    #[test]
    fn inward_addresses_are_refused_and_public_ones_pass() {
        for (ip, k) in [
            ("127.0.0.1", "a loopback"),
            ("127.255.0.9", "a loopback"),
            ("10.1.2.3", "a private"),
            ("172.16.0.1", "a private"),
            ("172.31.255.255", "a private"),
            ("192.168.1.1", "a private"),
            ("169.254.169.254", "a link-local"),
            ("0.0.0.0", "an unspecified"),
            ("0.1.2.3", "an unspecified"),
            ("::1", "a loopback"),
            ("::", "an unspecified"),
            ("fd00::1", "a unique-local"),
            ("fc00::1", "a unique-local"),
            ("fe80::1", "a link-local"),
            ("::ffff:127.0.0.1", "a loopback"),
            ("::ffff:10.0.0.1", "a private"),
            ("::ffff:169.254.169.254", "a link-local"),
        ] {
            assert_eq!(kind(ip), Some(k), "{ip}");
        }
        for ip in [
            "8.8.8.8",
            "172.32.0.1",
            "172.15.255.255",
            "192.169.0.1",
            "1.1.1.1",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
        ] {
            assert_eq!(kind(ip), None, "{ip}");
        }
    }

    #[tokio::test]
    async fn literals_and_names_are_judged_by_what_they_reach() {
        let url = |s: &str| reqwest::Url::parse(s).unwrap();
        let err = resolve(&url("http://[::1]:9/x"), false).await.unwrap_err();
        assert!(
            matches!(
                err,
                TargetError::Private {
                    kind: "a loopback",
                    ..
                }
            ),
            "{err}"
        );
        // `localhost` is a name: it is resolved (from /etc/hosts) and its
        // loopback answer refused.
        let err = resolve(&url("http://localhost:9/x"), false)
            .await
            .unwrap_err();
        assert!(matches!(err, TargetError::Private { .. }), "{err}");
        assert!(err.to_string().contains("--webhook-allow-private"));
        let (host, addrs) = resolve(&url("http://127.0.0.1:9/x"), true).await.unwrap();
        assert_eq!(host, "127.0.0.1");
        assert_eq!(addrs, vec!["127.0.0.1:9".parse().unwrap()]);
        let (_, addrs) = resolve(&url("https://8.8.8.8/x"), false).await.unwrap();
        assert_eq!(addrs[0].port(), 443);
        assert_eq!(
            resolve(&url("ftp://8.8.8.8/x"), false).await.unwrap_err(),
            TargetError::NotHttp
        );
    }
}
