//! Where a tenant's traffic may go: one egress policy for every place that
//! opens a connection on a tenant's behalf.
//!
//! A GPU cloud runs strangers' code next to its own services. Two kinds of
//! code open connections that a tenant chooses: the tenant's workloads
//! (the agent's firewall decides what their network namespace may reach)
//! and the control plane's outbound calls made for a tenant (queue
//! triggers, budget webhooks, registry logins). Both follow the same rule:
//!
//! - **public addresses are allowed** (a workload downloads models, a
//!   webhook reaches the tenant's receiver);
//! - **inward addresses are refused** ([`Inward`]): loopback, the private
//!   ranges, link-local (the cloud metadata service at 169.254.169.254),
//!   shared carrier-grade NAT space (where some clouds keep their metadata
//!   service, 100.100.100.200), unspecified, multicast and broadcast;
//! - **unless the operator allows them** with rules
//!   ([`AllowRule`], `--allow-egress 10.2.0.0/16:5432`), for a database or
//!   a registry on the operator's own network.
//!
//! The host's own public addresses are inward too, but only the agent
//! knows them; it adds them to its firewall's refused set itself.
//!
//! This crate decides; it never opens a connection. [`resolve`] looks a
//! name up and checks every address it stands for, so a caller connects
//! only to addresses that were checked (a name that later changes its
//! answer, DNS rebinding, is not consulted again).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ops::RangeInclusive;
use std::str::FromStr;

pub use ipnet::IpNet;

/// A kind of address a tenant may not reach unless the operator allows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Inward {
    /// `0.0.0.0/8`, `::`: connects to the local host.
    Unspecified,
    /// `127.0.0.0/8`, `::1`: the host itself.
    Loopback,
    /// RFC 1918: `10/8`, `172.16/12`, `192.168/16`.
    Private,
    /// `169.254/16`, `fe80::/10`: the metadata service lives here.
    LinkLocal,
    /// `100.64/10`: carrier-grade NAT space some clouds use inside.
    Shared,
    /// `fc00::/7`.
    UniqueLocal,
    /// `224/4`, `ff00::/8`, `255.255.255.255`.
    Multicast,
}

impl Inward {
    /// "a loopback", "a private", …: reads as "`ADDR` is *a loopback* address".
    pub fn describe(self) -> &'static str {
        match self {
            Inward::Unspecified => "an unspecified",
            Inward::Loopback => "a loopback",
            Inward::Private => "a private",
            Inward::LinkLocal => "a link-local",
            Inward::Shared => "a shared (carrier-grade NAT)",
            Inward::UniqueLocal => "a unique-local",
            Inward::Multicast => "a multicast or broadcast",
        }
    }
}

impl fmt::Display for Inward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// The networks refused by default, for a firewall that needs them as
/// prefixes (the agent's nftables set). [`inward_kind`] is the same rule
/// for one address.
pub fn inward_nets() -> Vec<(IpNet, Inward)> {
    let net = |s: &str| s.parse::<IpNet>().expect("a valid literal network");
    vec![
        (net("0.0.0.0/8"), Inward::Unspecified),
        (net("127.0.0.0/8"), Inward::Loopback),
        (net("10.0.0.0/8"), Inward::Private),
        (net("172.16.0.0/12"), Inward::Private),
        (net("192.168.0.0/16"), Inward::Private),
        (net("169.254.0.0/16"), Inward::LinkLocal),
        (net("100.64.0.0/10"), Inward::Shared),
        (net("224.0.0.0/4"), Inward::Multicast),
        (net("255.255.255.255/32"), Inward::Multicast),
        (net("::/128"), Inward::Unspecified),
        (net("::1/128"), Inward::Loopback),
        (net("fc00::/7"), Inward::UniqueLocal),
        (net("fe80::/10"), Inward::LinkLocal),
        (net("ff00::/8"), Inward::Multicast),
    ]
}

/// The kind of inward address `ip` is, `None` for a public one. IPv4
/// written as IPv6 (`::ffff:a.b.c.d`) is judged as the IPv4 address it
/// reaches.
pub fn inward_kind(ip: IpAddr) -> Option<Inward> {
    match ip {
        IpAddr::V4(v4) => inward_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => inward_v4(v4),
            None => inward_v6(v6),
        },
    }
}

fn inward_v4(ip: Ipv4Addr) -> Option<Inward> {
    let o = ip.octets();
    if o[0] == 0 {
        Some(Inward::Unspecified)
    } else if ip.is_loopback() {
        Some(Inward::Loopback)
    } else if ip.is_private() {
        Some(Inward::Private)
    } else if ip.is_link_local() {
        Some(Inward::LinkLocal)
    } else if o[0] == 100 && (o[1] & 0xc0) == 64 {
        Some(Inward::Shared)
    } else if ip.is_multicast() || ip.is_broadcast() {
        Some(Inward::Multicast)
    } else {
        None
    }
}

fn inward_v6(ip: Ipv6Addr) -> Option<Inward> {
    if ip.is_unspecified() {
        Some(Inward::Unspecified)
    } else if ip.is_loopback() {
        Some(Inward::Loopback)
    } else if ip.is_unique_local() {
        Some(Inward::UniqueLocal)
    } else if ip.is_unicast_link_local() {
        Some(Inward::LinkLocal)
    } else if ip.is_multicast() {
        Some(Inward::Multicast)
    } else {
        None
    }
}

/// One operator rule letting tenants reach inward addresses: a network and
/// optionally a port or port range. Written `CIDR`, `ADDR`, `CIDR:PORT`,
/// `CIDR:LOW-HIGH`, with IPv6 in brackets when a port follows
/// (`[fd00::/8]:443`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowRule {
    /// The network allowed.
    pub net: IpNet,
    /// The ports allowed on it; `None`: every port.
    pub ports: Option<RangeInclusive<u16>>,
}

impl AllowRule {
    /// Whether the rule lets a connection to `addr` through.
    pub fn matches(&self, addr: SocketAddr) -> bool {
        let ip = match addr.ip() {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            v4 => v4,
        };
        self.net.contains(&ip) && self.ports.as_ref().is_none_or(|p| p.contains(&addr.port()))
    }
}

/// Why an allow rule could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{rule}`: {why} (expected CIDR, CIDR:PORT or CIDR:LOW-HIGH, e.g. 10.2.0.0/16:5432)")]
pub struct RuleError {
    /// The rule as written.
    pub rule: String,
    /// What is wrong with it.
    pub why: &'static str,
}

impl FromStr for AllowRule {
    type Err = RuleError;

    fn from_str(s: &str) -> Result<Self, RuleError> {
        let err = |why| RuleError {
            rule: s.to_string(),
            why,
        };
        let s = s.trim();
        let (net, ports) = if let Some(rest) = s.strip_prefix('[') {
            let (net, after) = rest.split_once(']').ok_or(err("an unclosed `[`"))?;
            match after {
                "" => (net, None),
                p => (net, Some(p.strip_prefix(':').ok_or(err("junk after `]`"))?)),
            }
        } else if s.matches(':').count() > 1 {
            // A bare IPv6 network: no port can follow without brackets.
            (s, None)
        } else {
            match s.split_once(':') {
                Some((net, p)) => (net, Some(p)),
                None => (s, None),
            }
        };
        let net = match net.parse::<IpNet>() {
            Ok(n) => n.trunc(),
            Err(_) => IpNet::from(
                net.parse::<IpAddr>()
                    .map_err(|_| err("not an address or network"))?,
            ),
        };
        let port = |p: &str| p.parse::<u16>().ok().filter(|p| *p > 0);
        let ports = match ports {
            None => None,
            Some(p) => Some(match p.split_once('-') {
                Some((lo, hi)) => {
                    let (lo, hi) = (
                        port(lo).ok_or(err("a bad port"))?,
                        port(hi).ok_or(err("a bad port"))?,
                    );
                    if lo > hi {
                        return Err(err("a port range must run low to high"));
                    }
                    lo..=hi
                }
                None => {
                    let p = port(p).ok_or(err("a bad port"))?;
                    p..=p
                }
            }),
        };
        Ok(AllowRule { net, ports })
    }
}

impl fmt::Display for AllowRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let net = match self.net {
            IpNet::V6(n) if self.ports.is_some() => format!("[{n}]"),
            n => n.to_string(),
        };
        match &self.ports {
            None => f.write_str(&net),
            Some(p) if p.start() == p.end() => write!(f, "{net}:{}", p.start()),
            Some(p) => write!(f, "{net}:{}-{}", p.start(), p.end()),
        }
    }
}

impl serde::Serialize for AllowRule {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for AllowRule {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A refused destination.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{addr} is {kind} address; only public addresses are reachable unless the operator allows this one (--allow-egress)")]
pub struct Refused {
    /// The address refused.
    pub addr: IpAddr,
    /// What kind of inward address it is.
    pub kind: Inward,
}

/// The egress policy: public addresses, plus the operator's rules.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressPolicy {
    /// Inward destinations the operator allows.
    pub allow: Vec<AllowRule>,
}

impl EgressPolicy {
    /// A policy allowing public addresses and `allow`.
    pub fn new(allow: Vec<AllowRule>) -> Self {
        Self { allow }
    }

    /// A policy allowing every address (an operator's explicit opt-out,
    /// e.g. `--webhook-allow-private`).
    pub fn allow_all() -> Self {
        Self::new(vec![
            "0.0.0.0/0".parse().expect("literal"),
            "::/0".parse().expect("literal"),
        ])
    }

    /// Whether a connection to `addr` may be made.
    pub fn check(&self, addr: SocketAddr) -> Result<(), Refused> {
        match inward_kind(addr.ip()) {
            None => Ok(()),
            Some(_) if self.allow.iter().any(|r| r.matches(addr)) => Ok(()),
            Some(kind) => Err(Refused {
                addr: addr.ip(),
                kind,
            }),
        }
    }
}

/// Why [`resolve`] gave no address to connect to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// The host is, or resolves to, a refused address.
    #[error("{host}: {refused}")]
    Refused {
        /// The host as given.
        host: String,
        /// The refused address and its kind.
        #[source]
        refused: Refused,
    },
    /// The name did not resolve.
    #[error("{host} does not resolve: {reason}")]
    Unresolved {
        /// The host as given.
        host: String,
        /// The resolver's message.
        reason: String,
    },
}

/// Resolves `host` (a name or an IP literal, IPv6 with or without
/// brackets) and checks every address it stands for against `policy`.
/// Returns the addresses a caller must connect to: only these, never a
/// second lookup's.
pub async fn resolve(
    host: &str,
    port: u16,
    policy: &EgressPolicy,
) -> Result<Vec<SocketAddr>, ResolveError> {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let addrs: Vec<SocketAddr> = match bare.parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => tokio::net::lookup_host((bare, port))
            .await
            .map_err(|e| ResolveError::Unresolved {
                host: host.to_string(),
                reason: e.to_string(),
            })?
            .collect(),
    };
    if addrs.is_empty() {
        return Err(ResolveError::Unresolved {
            host: host.to_string(),
            reason: "no addresses".into(),
        });
    }
    for a in &addrs {
        policy.check(*a).map_err(|refused| ResolveError::Refused {
            host: host.to_string(),
            refused,
        })?;
    }
    Ok(addrs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(s: &str) -> Option<Inward> {
        inward_kind(s.parse().unwrap())
    }

    #[test]
    fn inward_addresses_are_named_and_public_ones_pass() {
        for (ip, k) in [
            ("127.0.0.1", Inward::Loopback),
            ("127.255.0.9", Inward::Loopback),
            ("10.1.2.3", Inward::Private),
            ("172.16.0.1", Inward::Private),
            ("172.31.255.255", Inward::Private),
            ("192.168.1.1", Inward::Private),
            ("169.254.169.254", Inward::LinkLocal),
            ("100.100.100.200", Inward::Shared),
            ("100.64.0.1", Inward::Shared),
            ("0.0.0.0", Inward::Unspecified),
            ("0.1.2.3", Inward::Unspecified),
            ("224.0.0.1", Inward::Multicast),
            ("255.255.255.255", Inward::Multicast),
            ("::1", Inward::Loopback),
            ("::", Inward::Unspecified),
            ("fd00::1", Inward::UniqueLocal),
            ("fe80::1", Inward::LinkLocal),
            ("ff02::1", Inward::Multicast),
            ("::ffff:127.0.0.1", Inward::Loopback),
            ("::ffff:169.254.169.254", Inward::LinkLocal),
        ] {
            assert_eq!(kind(ip), Some(k), "{ip}");
        }
        for ip in [
            "8.8.8.8",
            "172.32.0.1",
            "100.128.0.1",
            "100.63.255.255",
            "192.169.0.1",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
        ] {
            assert_eq!(kind(ip), None, "{ip}");
        }
    }

    #[test]
    fn the_prefix_list_says_what_the_address_rule_says() {
        let nets = inward_nets();
        for ip in [
            "127.0.0.1",
            "10.9.8.7",
            "172.20.0.1",
            "192.168.7.7",
            "169.254.169.254",
            "100.100.100.200",
            "0.0.0.0",
            "239.1.1.1",
            "::1",
            "fd12::3",
            "fe80::9",
            "ff05::2",
            "8.8.8.8",
            "2606:4700::1111",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            let by_net = nets.iter().find(|(n, _)| n.contains(&ip)).map(|(_, k)| *k);
            assert_eq!(by_net, inward_kind(ip), "{ip}");
        }
    }

    #[test]
    fn rules_parse_print_and_match() {
        let r: AllowRule = "10.2.0.0/16:5432".parse().unwrap();
        assert_eq!(r.to_string(), "10.2.0.0/16:5432");
        assert!(r.matches("10.2.3.4:5432".parse().unwrap()));
        assert!(!r.matches("10.2.3.4:5433".parse().unwrap()));
        assert!(!r.matches("10.3.0.1:5432".parse().unwrap()));
        let r: AllowRule = "127.0.0.1".parse().unwrap();
        assert_eq!(r.to_string(), "127.0.0.1/32");
        assert!(r.matches("127.0.0.1:1".parse().unwrap()));
        assert!(r.matches("[::ffff:127.0.0.1]:1".parse().unwrap()));
        let r: AllowRule = "10.0.0.9/8:8000-8100".parse().unwrap();
        assert_eq!(r.to_string(), "10.0.0.0/8:8000-8100");
        assert!(r.matches("10.200.0.1:8050".parse().unwrap()));
        assert!(!r.matches("10.200.0.1:8101".parse().unwrap()));
        let r: AllowRule = "[fd00::/8]:443".parse().unwrap();
        assert_eq!(r.to_string(), "[fd00::/8]:443");
        assert!(r.matches("[fd00::5]:443".parse().unwrap()));
        let r: AllowRule = "fd00::/8".parse().unwrap();
        assert_eq!(r.ports, None);
        for bad in [
            "",
            "nope",
            "10.0.0.0/33",
            "10.0.0.1:0",
            "10.0.0.1:9-8",
            "10.0.0.1:x",
            "[fd00::/8",
            "[::1]x",
        ] {
            let e = bad.parse::<AllowRule>().unwrap_err();
            assert!(e.to_string().contains("expected CIDR"), "{bad}: {e}");
        }
        let rules: Vec<AllowRule> =
            serde_json::from_str(r#"["10.2.0.0/16:5432", "[fd00::/8]:443"]"#).unwrap();
        assert_eq!(
            serde_json::to_string(&rules).unwrap(),
            r#"["10.2.0.0/16:5432","[fd00::/8]:443"]"#
        );
        assert!(serde_json::from_str::<AllowRule>(r#""10.0.0.1:0""#).is_err());
    }

    #[test]
    fn the_policy_refuses_inward_and_honours_the_allow_list() {
        let p = EgressPolicy::default();
        assert!(p.check("8.8.8.8:443".parse().unwrap()).is_ok());
        let e = p.check("169.254.169.254:80".parse().unwrap()).unwrap_err();
        assert_eq!(e.kind, Inward::LinkLocal);
        assert!(e.to_string().contains("--allow-egress"), "{e}");
        let p = EgressPolicy::new(vec!["10.0.0.1:5672".parse().unwrap()]);
        assert!(p.check("10.0.0.1:5672".parse().unwrap()).is_ok());
        assert!(p.check("10.0.0.1:5432".parse().unwrap()).is_err());
        assert!(EgressPolicy::allow_all()
            .check("127.0.0.1:1".parse().unwrap())
            .is_ok());
    }

    #[tokio::test]
    async fn names_and_literals_are_judged_by_what_they_reach() {
        let p = EgressPolicy::default();
        let e = resolve("[::1]", 9, &p).await.unwrap_err();
        assert!(matches!(e, ResolveError::Refused { .. }), "{e}");
        // `localhost` is a name, resolved from /etc/hosts, and refused.
        let e = resolve("localhost", 9, &p).await.unwrap_err();
        assert!(matches!(e, ResolveError::Refused { .. }), "{e}");
        let ok = resolve(
            "127.0.0.1",
            9,
            &EgressPolicy::new(vec!["127.0.0.0/8".parse().unwrap()]),
        )
        .await
        .unwrap();
        assert_eq!(ok, vec!["127.0.0.1:9".parse().unwrap()]);
        assert_eq!(resolve("8.8.8.8", 443, &p).await.unwrap()[0].port(), 443);
    }
}
