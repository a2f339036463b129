//! Each workload's own network: what a tenant's process may reach.
//!
//! Without this, a workload shares the host's network: it finds another
//! tenant's replica in `/proc/net/tcp` and calls it without a key, and it
//! reaches every service listening on the host's loopback (the database as
//! superuser, the brokers with default passwords) and, on a cloud VM, the
//! metadata service at 169.254.169.254.
//!
//! As root, with `ip`, `nft` and `nsenter` (Debian's `iproute2`,
//! `nftables`, `util-linux`), the process runtime gives every workload a
//! network namespace of its own ([`Namespaces::attach`]): a veth pair whose
//! host end joins the tenant's bridge (`flb<slot>`, subnet
//! `10.213.<slot>.0/24`, the bridge at `.1`), and bubblewrap runs inside
//! it (`nsenter --net=`). One nftables table the agent owns,
//! `inet flotilla`, decides what crosses the bridges:
//!
//! - **to the internet**: allowed, masqueraded (IP forwarding on);
//! - **to inward addresses** ([`flotilla_egress::inward_nets`]: loopback,
//!   private ranges, link-local, shared space; other tenants' bridges are
//!   in `10.0.0.0/8`): refused, and to the host itself (any of its
//!   addresses) refused, unless the operator allows a network and ports
//!   (`--allow-egress CIDR[:PORTS]`, [`AllowRule`]). A rule for a loopback
//!   address with ports maps those ports of the workload's own `127.0.0.1`
//!   to the host's `127.0.0.1` (a broker on the host's loopback);
//! - **into a workload**: only replies, the tenant's own workloads on the
//!   same bridge, and the host: an endpoint replica's `PORT` on the host's
//!   `127.0.0.1` is forwarded to the replica's namespace (where the host's
//!   gateway and the server's readiness probe reach it as before), and
//!   inside the namespace to its own loopback, so a replica listening on
//!   `127.0.0.1` is reached too. Workloads have no IPv6.
//!
//! Claims (a tenant's slot, a workload's address, the attachment record)
//! are files under `/run/flotilla/net`, host-wide because bridges and the
//! table are: agents on one host share them under a file lock, and like
//! the kernel objects they describe they end with a reboot. An attachment
//! outlives the agent: a restarted agent adopts the running workload in
//! its namespace unchanged and detaches it when it ends.
//!
//! Elsewhere (an ordinary user, or the tools missing) the network is
//! shared with the host, said at start and on the node ([`Network::describe`]).

use std::fs;
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use flotilla_egress::{inward_nets, AllowRule, IpNet};
use serde::{Deserialize, Serialize};

/// Where the host-wide claims and records live (a tmpfs: they end with
/// the kernel objects they describe).
pub const DEFAULT_RUN_DIR: &str = "/run/flotilla/net";
/// The first two octets of the workloads' addresses: slot `s` (a tenant)
/// is `10.213.s.0/24`. Inside `10.0.0.0/8`, so every tenant's subnet is an
/// inward address to every other.
const POOL: [u8; 2] = [10, 213];
/// The nftables table (family `inet`) the agent owns on the host, and
/// (family `ip`) inside each workload's namespace.
pub const TABLE: &str = "flotilla";
/// An empty chain naming the host table's layout: a table without it was
/// made by another version of the agent and is replaced.
const LAYOUT: &str = "layout_1";
/// Tenant bridges are `flb<slot>`; the host ends of veth pairs
/// `flv<slot>x<host>` (at most 10 characters of Linux's 15).
const BRIDGE_PREFIX: &str = "flb";
/// The workload's end of its veth pair, inside its namespace.
const WORKLOAD_IF: &str = "eth0";
/// How old an attachment without a process must be before it is swept:
/// well past the moment between its set-up and its workload's start.
const SWEEP_AFTER: std::time::Duration = std::time::Duration::from_secs(120);
/// How often attachments are checked for a workload that is gone.
const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(60);
/// Slots (tenants on this host at once) and hosts (workloads per tenant).
const SLOTS: std::ops::RangeInclusive<u8> = 1..=254;
const HOSTS: std::ops::RangeInclusive<u8> = 2..=254;

/// Why a workload's network could not be set up or torn down.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// A claim, record or sysctl file could not be read or written.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A command (`ip`, `nft`, `nsenter`) failed.
    #[error("`{command}` failed: {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// What it said.
        stderr: String,
    },
    /// No slot or address is left.
    #[error("{0}")]
    Exhausted(&'static str),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NetError {
    let what = what.into();
    move |source| NetError::Io { what, source }
}

/// How the process runtime connects workloads.
#[derive(Debug, Clone)]
pub enum Network {
    /// A namespace per workload behind the agent's firewall.
    Isolated(Namespaces),
    /// The host's network, shared: nothing stops a workload from reaching
    /// what the host reaches.
    Shared {
        /// Why it is not isolated.
        why: String,
    },
}

impl Network {
    /// Isolates workloads when this host allows it (root, the tools, the
    /// kernel's namespaces and nftables), else says why not. Sets up the
    /// host's table and turns IP forwarding on. Blocking.
    pub fn probe(allow: Vec<AllowRule>) -> Network {
        let shared = |why: String| {
            tracing::warn!(reason = %why, "workloads share the host's network: they can reach the host's loopback services, other tenants' workloads and the cloud metadata service");
            Network::Shared { why }
        };
        if !nix::unistd::geteuid().is_root() {
            return shared("the agent is not root (a namespace per workload needs root)".into());
        }
        let mut found = Vec::new();
        for tool in ["ip", "nft", "nsenter"] {
            match super::sandbox::find_program(tool) {
                Some(path) => found.push(path),
                None => {
                    return shared(format!(
                        "`{tool}` is not installed (Debian's iproute2, nftables, util-linux)"
                    ))
                }
            }
        }
        let ns = Namespaces {
            run_dir: PathBuf::from(DEFAULT_RUN_DIR),
            allow,
            nsenter: found.pop().unwrap_or_default(),
        };
        match ns.prepare_host() {
            Ok(()) => {
                tracing::info!(allow_egress = ?ns.allow.iter().map(ToString::to_string).collect::<Vec<_>>(), "workloads get a network namespace each; egress to inward addresses refused unless allowed");
                Network::Isolated(ns)
            }
            Err(e) => shared(format!("cannot set up the workload firewall: {e}")),
        }
    }

    /// What the node reports at registration (`flotilla nodes show`).
    pub fn report(&self, allow: &[AllowRule]) -> flotilla_core::api::NodeNetwork {
        flotilla_core::api::NodeNetwork {
            isolated: matches!(self, Network::Isolated(_)),
            detail: self.describe(),
            allow_egress: allow.iter().map(ToString::to_string).collect(),
        }
    }

    /// One line for the node's record and `flotilla nodes show`.
    pub fn describe(&self) -> String {
        match self {
            Network::Isolated(_) => {
                "isolated: behind the agent's firewall (nftables `inet flotilla`)".into()
            }
            Network::Shared { why } => format!("NOT isolated, shared with the host: {why}"),
        }
    }
}

/// Workloads' namespaces, bridges and firewall on this host.
#[derive(Debug, Clone)]
pub struct Namespaces {
    run_dir: PathBuf,
    allow: Vec<AllowRule>,
    /// `nsenter`'s absolute path: workloads start through it.
    nsenter: PathBuf,
}

/// One workload's place on the network, recorded while it exists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    /// The instance.
    pub instance: String,
    /// Its tenant's slot (`10.213.<slot>.0/24`, bridge `flb<slot>`).
    pub slot: u8,
    /// Its host octet.
    pub host: u8,
    /// The replica port forwarded from the host's loopback, if any.
    pub port: Option<u16>,
}

impl Attachment {
    /// The workload's address.
    pub fn addr(&self) -> Ipv4Addr {
        Ipv4Addr::new(POOL[0], POOL[1], self.slot, self.host)
    }

    /// The named network namespace (`/run/netns/<name>`).
    pub fn netns(&self) -> String {
        netns_name(&self.instance)
    }

    /// The path `nsenter --net=` takes.
    pub fn netns_path(&self) -> PathBuf {
        Path::new("/run/netns").join(self.netns())
    }

    fn bridge(&self) -> String {
        bridge_name(self.slot)
    }

    fn veth(&self) -> String {
        format!("flv{}x{}", self.slot, self.host)
    }
}

/// The namespace name of an instance.
pub fn netns_name(instance: &str) -> String {
    format!("fl-{instance}")
}

fn bridge_name(slot: u8) -> String {
    format!("{BRIDGE_PREFIX}{slot}")
}

fn gateway_of(slot: u8) -> Ipv4Addr {
    Ipv4Addr::new(POOL[0], POOL[1], slot, 1)
}

impl Namespaces {
    /// The operator's allow rules.
    pub fn allow(&self) -> &[AllowRule] {
        &self.allow
    }

    /// The `nsenter` program a workload starts through.
    pub fn nsenter(&self) -> &Path {
        &self.nsenter
    }

    /// Gives `instance` (of `owner`, a tenant) a namespace on its tenant's
    /// bridge; `port`: a replica port to forward from the host's loopback.
    /// A leftover namespace of the same instance is replaced. Blocking.
    pub fn attach(
        &self,
        instance: &str,
        owner: &str,
        port: Option<u16>,
    ) -> Result<Attachment, NetError> {
        let _lock = self.lock()?;
        self.sweep();
        if let Some(old) = self.record(instance) {
            self.teardown(&old)?;
        }
        let slot = self.claim_slot(owner)?;
        self.ensure_bridge(slot)?;
        let host = self.claim_host(slot, instance)?;
        // Forward the port only when nothing on the host listens on it: a
        // tenant's `PORT` must never capture a host service's connections.
        let port = port.filter(|p| {
            *p >= 1024 && std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, *p)).is_ok()
        });
        let a = Attachment {
            instance: instance.to_string(),
            slot,
            host,
            port,
        };
        self.write_record(&a)?;
        if let Err(e) = self.plumb(&a) {
            let _ = self.teardown(&a);
            return Err(e);
        }
        Ok(a)
    }

    /// Removes `instance`'s namespace, its forward and its claims, and
    /// its tenant's bridge when no workload is left on it. Nothing
    /// recorded: nothing to do. Blocking.
    pub fn detach(&self, instance: &str) -> Result<(), NetError> {
        let _lock = self.lock()?;
        match self.record(instance) {
            Some(a) => self.teardown(&a),
            None => Ok(()),
        }
    }

    /// Holds the containers on an engine network (`subnet`, its gateway
    /// on the host) to the same policy: other networks' and inward
    /// addresses and the host refused (but the gateway's DNS), unless
    /// allowed; the network's own containers reach each other. Matched by
    /// source address, since the engine names its bridges itself.
    /// Idempotent. Blocking.
    pub fn guard_containers(
        &self,
        subnet: flotilla_egress::IpNet,
        gateway: Option<Ipv4Addr>,
    ) -> Result<(), NetError> {
        let IpNet::V4(subnet) = subnet else {
            return Ok(());
        };
        let _lock = self.lock()?;
        let mut script = format!(
            "add element inet {TABLE} container_nets {{ {subnet} }}\n\
             add element inet {TABLE} container_pairs {{ {subnet} . {subnet} }}\n\
             flush chain inet {TABLE} c_allow\n"
        );
        if let Some(gw) = gateway {
            script.push_str(&format!(
                "add element inet {TABLE} container_gws {{ {gw} }}\n"
            ));
        }
        for rule in &self.allow {
            if let Some((net, ports)) = rule_v4(rule) {
                script.push_str(&format!(
                    "add rule inet {TABLE} c_allow meta l4proto {{ tcp, udp }} ip daddr {net}{ports} accept\n"
                ));
            }
        }
        run("nft", &["-f", "-"], Some(&script)).map(|_| ())
    }

    /// The attachment recorded for `instance`.
    pub fn record(&self, instance: &str) -> Option<Attachment> {
        let text = fs::read_to_string(self.run_dir.join("attached").join(instance)).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// Tears down attachments whose workload is gone: no process left in
    /// the namespace a while after it was made (an agent that crashed
    /// before releasing it, or a caller that never does). Called with the
    /// lock held.
    fn sweep(&self) {
        // At most once a minute on this host, whichever agent asks: each
        // record costs an `ip` call.
        let mark = self.run_dir.join("swept");
        let recent = fs::metadata(&mark)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age < SWEEP_EVERY));
        if recent {
            return;
        }
        let _ = fs::write(&mark, format!("{:?}", std::time::SystemTime::now()));
        let Ok(dir) = fs::read_dir(self.run_dir.join("attached")) else {
            return;
        };
        for entry in dir.flatten() {
            let old_enough = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > SWEEP_AFTER));
            let Some(a) = entry.file_name().to_str().and_then(|i| self.record(i)) else {
                continue;
            };
            if !old_enough {
                continue;
            }
            let empty = run("ip", &["netns", "pids", &a.netns()], None)
                .map_or(true, |pids| pids.trim().is_empty());
            if empty {
                tracing::info!(instance_id = %a.instance, "removing the network of a workload that is gone");
                let _ = self.teardown(&a);
            }
        }
        // A bridge whose last workload's teardown was cut short.
        let Ok(slots) = fs::read_dir(self.run_dir.join("slots")) else {
            return;
        };
        for slot in slots.flatten() {
            if let Some(slot) = slot.file_name().to_str().and_then(|s| s.parse::<u8>().ok()) {
                self.drop_bridge_if_empty(slot);
            }
        }
    }

    /// Removes the tenant's bridge, its rules and its slot once no
    /// workload is on it. Called with the lock held.
    fn drop_bridge_if_empty(&self, slot: u8) {
        let br = bridge_name(slot);
        let ports = fs::read_dir(Path::new("/sys/class/net").join(&br).join("brif"))
            .map(|d| d.count())
            .unwrap_or(0);
        let hosts_left = fs::read_dir(self.run_dir.join("hosts").join(slot.to_string()))
            .map(|d| d.count())
            .unwrap_or(0);
        if ports == 0 && hosts_left == 0 {
            let _ = run("ip", &["link", "delete", &br], None);
            let _ = run("nft", &["-f", "-"], Some(&drop_bridge_rules(slot)));
            let _ = fs::remove_file(self.run_dir.join("slots").join(slot.to_string()));
        }
    }

    fn lock(&self) -> Result<fs::File, NetError> {
        fs::create_dir_all(&self.run_dir).map_err(io("creating the network run directory"))?;
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(self.run_dir.join("lock"))
            .map_err(io("opening the network lock"))?;
        file.lock().map_err(io("taking the network lock"))?;
        Ok(file)
    }

    /// Creates the host's table when missing (another agent may have
    /// made it), and turns IP forwarding on.
    fn prepare_host(&self) -> Result<(), NetError> {
        let _lock = self.lock()?;
        self.sweep();
        fs::write("/proc/sys/net/ipv4/ip_forward", "1").map_err(io("turning IP forwarding on"))?;
        if run("nft", &["list", "chain", "inet", TABLE, LAYOUT], None).is_ok() {
            return Ok(());
        }
        let _ = run("nft", &["delete", "table", "inet", TABLE], None);
        run("nft", &["-f", "-"], Some(&host_table())).map(|_| ())
    }

    /// The tenant's slot: the one it holds, or a free one.
    fn claim_slot(&self, owner: &str) -> Result<u8, NetError> {
        let dir = self.run_dir.join("slots");
        fs::create_dir_all(&dir).map_err(io("creating the slot claims"))?;
        for slot in SLOTS {
            if fs::read_to_string(dir.join(slot.to_string())).is_ok_and(|o| o == owner) {
                return Ok(slot);
            }
        }
        for slot in SLOTS {
            if claim(&dir.join(slot.to_string()), owner)? {
                return Ok(slot);
            }
        }
        Err(NetError::Exhausted(
            "every tenant slot on this host is taken",
        ))
    }

    fn claim_host(&self, slot: u8, instance: &str) -> Result<u8, NetError> {
        let dir = self.run_dir.join("hosts").join(slot.to_string());
        fs::create_dir_all(&dir).map_err(io("creating the address claims"))?;
        for host in HOSTS {
            if claim(&dir.join(host.to_string()), instance)? {
                return Ok(host);
            }
        }
        Err(NetError::Exhausted(
            "every address of the tenant's subnet is taken",
        ))
    }

    fn write_record(&self, a: &Attachment) -> Result<(), NetError> {
        let dir = self.run_dir.join("attached");
        fs::create_dir_all(&dir).map_err(io("creating the attachment records"))?;
        let text = serde_json::to_string(a).unwrap_or_default();
        fs::write(dir.join(&a.instance), text).map_err(io("recording the attachment"))
    }

    /// The tenant's bridge, its address and its rules (rewritten each time:
    /// the allow rules are this agent's).
    fn ensure_bridge(&self, slot: u8) -> Result<(), NetError> {
        let br = bridge_name(slot);
        if !Path::new("/sys/class/net").join(&br).exists() {
            run("ip", &["link", "add", &br, "type", "bridge"], None)?;
        }
        let gw = format!("{}/24", gateway_of(slot));
        run("ip", &["addr", "replace", &gw, "dev", &br], None)?;
        run("ip", &["link", "set", &br, "up"], None)?;
        // The host's loopback reaches replicas through the bridge.
        fs::write(format!("/proc/sys/net/ipv4/conf/{br}/route_localnet"), "1")
            .map_err(io(format!("route_localnet on {br}")))?;
        run("nft", &["-f", "-"], Some(&bridge_rules(slot, &self.allow)))?;
        Ok(())
    }

    /// The namespace, its veth pair, addresses, routes and rules.
    fn plumb(&self, a: &Attachment) -> Result<(), NetError> {
        let ns = a.netns();
        let addr = format!("{}/24", a.addr());
        let gw = gateway_of(a.slot).to_string();
        // A namespace left by a crash between its creation and its record.
        let _ = run("ip", &["netns", "delete", &ns], None);
        run("ip", &["netns", "add", &ns], None)?;
        run(
            "ip",
            &[
                "link",
                "add",
                &a.veth(),
                "type",
                "veth",
                "peer",
                "name",
                WORKLOAD_IF,
                "netns",
                &ns,
            ],
            None,
        )?;
        run(
            "ip",
            &["link", "set", &a.veth(), "master", &a.bridge(), "up"],
            None,
        )?;
        run(
            "ip",
            &["-n", &ns, "addr", "add", &addr, "dev", WORKLOAD_IF],
            None,
        )?;
        run("ip", &["-n", &ns, "link", "set", WORKLOAD_IF, "up"], None)?;
        run("ip", &["-n", &ns, "link", "set", "lo", "up"], None)?;
        run(
            "ip",
            &["-n", &ns, "route", "add", "default", "via", &gw],
            None,
        )?;
        let net = format!("--net={}", a.netns_path().display());
        // Inside: the replica's loopback is reached through eth0, and no
        // IPv6 (the firewall is IPv4's).
        run(
            "nsenter",
            &[
                &net,
                "sh",
                "-c",
                "echo 1 > /proc/sys/net/ipv4/conf/eth0/route_localnet && echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6",
            ],
            None,
        )?;
        run(
            "nsenter",
            &[&net, "nft", "-f", "-"],
            Some(&workload_rules(a, &self.allow)),
        )?;
        if let Some(port) = a.port {
            // A leftover forward of the port (a replica that ended while
            // no agent ran) gives way.
            let _ = run(
                "nft",
                &[&format!(
                    "delete element inet {TABLE} replicas {{ {port} }}"
                )],
                None,
            );
            run(
                "nft",
                &[&format!(
                    "add element inet {TABLE} replicas {{ {port} : {} }}",
                    a.addr()
                )],
                None,
            )?;
        }
        Ok(())
    }

    /// Undoes [`Self::attach`]: every step tolerates what is already gone.
    fn teardown(&self, a: &Attachment) -> Result<(), NetError> {
        if let Some(port) = a.port {
            // Only our own forward: the port may have been given to
            // another replica since.
            let _ = run(
                "nft",
                &[&format!(
                    "delete element inet {TABLE} replicas {{ {port} : {} }}",
                    a.addr()
                )],
                None,
            );
        }
        let _ = run("ip", &["netns", "delete", &a.netns()], None);
        let _ = run("ip", &["link", "delete", &a.veth()], None);
        let _ = fs::remove_file(
            self.run_dir
                .join("hosts")
                .join(a.slot.to_string())
                .join(a.host.to_string()),
        );
        let _ = fs::remove_file(self.run_dir.join("attached").join(&a.instance));
        self.drop_bridge_if_empty(a.slot);
        Ok(())
    }
}

/// Creates `path` holding `owner` unless it exists: whether it did.
fn claim(path: &Path, owner: &str) -> Result<bool, NetError> {
    match fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(mut f) => {
            f.write_all(owner.as_bytes())
                .map_err(io(format!("writing {}", path.display())))?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(io(format!("claiming {}", path.display()))(e)),
    }
}

/// Runs `program args` (with `stdin`), its stdout on success.
fn run(program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, NetError> {
    let command = format!("{program} {}", args.join(" "));
    let failed = |stderr: String| NetError::Command {
        command: command.clone(),
        stderr,
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| failed(e.to_string()))?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes())
            .map_err(|e| failed(e.to_string()))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| failed(e.to_string()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(failed(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ))
    }
}

/// The IPv4 networks refused by default.
fn inward4() -> Vec<String> {
    inward_nets()
        .into_iter()
        .filter_map(|(net, _)| match net {
            IpNet::V4(n) => Some(n.to_string()),
            IpNet::V6(_) => None,
        })
        .collect()
}

/// The host's table (see the module): the per-bridge chains hang off the
/// two verdict maps, the replica forwards are a map of ports.
fn host_table() -> String {
    let inward = inward4().join(", ");
    format!(
        r#"table inet {TABLE} {{
    set inward4 {{ type ipv4_addr; flags interval; elements = {{ {inward} }}; }}
    map allow_by_bridge {{ type ifname : verdict; }}
    map nat_by_bridge {{ type ifname : verdict; }}
    map replicas {{ type inet_service : ipv4_addr; }}
    set container_nets {{ type ipv4_addr; flags interval; }}
    set container_pairs {{ type ipv4_addr . ipv4_addr; flags interval; }}
    set container_gws {{ type ipv4_addr; }}
    chain {LAYOUT} {{
    }}
    chain forward {{
        type filter hook forward priority filter - 5; policy accept;
        iifname "{BRIDGE_PREFIX}*" jump egress
        oifname "{BRIDGE_PREFIX}*" jump ingress
        ip saddr @container_nets jump c_egress
    }}
    chain input {{
        type filter hook input priority filter - 5; policy accept;
        iifname "{BRIDGE_PREFIX}*" jump to_host
        ip saddr @container_nets jump c_to_host
    }}
    chain c_allow {{
    }}
    chain c_egress {{
        ct state established,related accept
        ip saddr . ip daddr @container_pairs accept
        jump c_allow
        ip daddr @inward4 reject with icmpx admin-prohibited
    }}
    chain c_to_host {{
        ct state established,related accept
        ip daddr @container_gws meta l4proto {{ tcp, udp }} th dport 53 accept
        jump c_allow
        reject with icmpx admin-prohibited
    }}
    chain egress {{
        ct state established,related accept
        meta nfproto ipv6 drop
        iifname vmap @allow_by_bridge
        ip daddr @inward4 reject with icmpx admin-prohibited
    }}
    chain ingress {{
        ct state established,related accept
        drop
    }}
    chain to_host {{
        ct state established,related accept
        iifname vmap @allow_by_bridge
        reject with icmpx admin-prohibited
    }}
    chain nat_pre {{
        type nat hook prerouting priority -100; policy accept;
        iifname vmap @nat_by_bridge
    }}
    chain nat_out {{
        type nat hook output priority -100; policy accept;
        ip daddr 127.0.0.1 dnat ip to tcp dport map @replicas
    }}
    chain nat_post {{
        type nat hook postrouting priority 100; policy accept;
        oifname "{BRIDGE_PREFIX}*" ip saddr 127.0.0.0/8 masquerade
        iifname "{BRIDGE_PREFIX}*" oifname != "{BRIDGE_PREFIX}*" masquerade
    }}
}}
"#
    )
}

/// An allow rule's IPv4 network and `nft` port match (empty: any port of
/// TCP and UDP); `None` for IPv6 (workloads have none).
fn rule_v4(rule: &AllowRule) -> Option<(String, String)> {
    let IpNet::V4(net) = rule.net else {
        return None;
    };
    let ports = match &rule.ports {
        None => String::new(),
        Some(p) if p.start() == p.end() => format!(" th dport {}", p.start()),
        Some(p) => format!(" th dport {}-{}", p.start(), p.end()),
    };
    Some((net.to_string(), ports))
}

/// Whether `rule` maps ports of the workload's loopback to the host's: a
/// loopback network with ports.
fn maps_loopback(rule: &AllowRule) -> bool {
    match rule.net {
        IpNet::V4(n) => n.network().is_loopback() && n.prefix_len() >= 8 && rule.ports.is_some(),
        IpNet::V6(_) => false,
    }
}

/// The tenant bridge's chains: its own subnet (not the bridge's address,
/// which is the host's) and the allowed networks pass; loopback rules'
/// ports addressed to the bridge reach the host's loopback. The same chain
/// judges what goes through the host and what goes to it.
fn bridge_rules(slot: u8, allow: &[AllowRule]) -> String {
    let br = bridge_name(slot);
    let subnet = format!("{}.{}.{slot}.0/24", POOL[0], POOL[1]);
    let gw = gateway_of(slot);
    let mut s = format!(
        "add chain inet {TABLE} a_{br}\nflush chain inet {TABLE} a_{br}\n\
         add chain inet {TABLE} n_{br}\nflush chain inet {TABLE} n_{br}\n\
         add rule inet {TABLE} a_{br} ip daddr {subnet} ip daddr != {gw} accept\n"
    );
    for rule in allow {
        let Some((net, ports)) = rule_v4(rule) else {
            continue;
        };
        s.push_str(&format!(
            "add rule inet {TABLE} a_{br} meta l4proto {{ tcp, udp }} ip daddr {net}{ports} accept\n"
        ));
        if maps_loopback(rule) {
            s.push_str(&format!(
                "add rule inet {TABLE} n_{br} ip daddr {gw} meta l4proto tcp{ports} dnat ip to 127.0.0.1\n"
            ));
        }
    }
    s.push_str(&format!(
        "add element inet {TABLE} allow_by_bridge {{ \"{br}\" : jump a_{br} }}\n\
         add element inet {TABLE} nat_by_bridge {{ \"{br}\" : jump n_{br} }}\n"
    ));
    s
}

fn drop_bridge_rules(slot: u8) -> String {
    let br = bridge_name(slot);
    format!(
        "delete element inet {TABLE} allow_by_bridge {{ \"{br}\" }}\n\
         delete element inet {TABLE} nat_by_bridge {{ \"{br}\" }}\n\
         delete chain inet {TABLE} a_{br}\ndelete chain inet {TABLE} n_{br}\n"
    )
}

/// The workload namespace's table: its replica port reaches its loopback;
/// loopback allow rules' ports go to the host through the bridge.
fn workload_rules(a: &Attachment, allow: &[AllowRule]) -> String {
    let mut pre = String::new();
    if let Some(port) = a.port {
        pre = format!(
            "iifname \"{WORKLOAD_IF}\" ip daddr {} tcp dport {port} dnat ip to 127.0.0.1",
            a.addr()
        );
    }
    let gw = gateway_of(a.slot);
    let out: Vec<String> = allow
        .iter()
        .filter(|r| maps_loopback(r))
        .filter_map(|r| {
            let (net, ports) = rule_v4(r)?;
            Some(format!(
                "ip daddr {net} meta l4proto tcp{ports} dnat ip to {gw}"
            ))
        })
        .collect();
    format!(
        r#"table ip {TABLE} {{
    chain pre {{
        type nat hook prerouting priority -100; policy accept;
        {pre}
    }}
    chain out {{
        type nat hook output priority -100; policy accept;
        {}
    }}
    chain post {{
        type nat hook postrouting priority 100; policy accept;
        oifname "{WORKLOAD_IF}" ip saddr 127.0.0.0/8 masquerade
    }}
}}
"#,
        out.join("\n        ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_linux_limits() {
        let a = Attachment {
            instance: "inst_x".into(),
            slot: 254,
            host: 254,
            port: None,
        };
        assert!(a.veth().len() <= 15, "{}", a.veth());
        assert!(a.bridge().len() <= 15);
        assert_eq!(a.addr(), Ipv4Addr::new(10, 213, 254, 254));
    }

    #[test]
    fn the_host_table_refuses_every_inward_v4_network() {
        let t = host_table();
        for net in [
            "127.0.0.0/8",
            "10.0.0.0/8",
            "169.254.0.0/16",
            "100.64.0.0/10",
        ] {
            assert!(t.contains(net), "{net} missing");
        }
        assert!(!t.contains("fe80"), "no IPv6 in an ipv4_addr set");
    }

    #[test]
    fn allow_rules_become_bridge_rules_and_loopback_maps() {
        let allow: Vec<AllowRule> = [
            "198.18.0.1:5000-5001",
            "127.0.0.1:5672",
            "10.2.0.0/16",
            "fd00::/8",
        ]
        .iter()
        .map(|r| r.parse().unwrap())
        .collect();
        let rules = bridge_rules(7, &allow);
        assert!(
            rules.contains("ip daddr 10.213.7.0/24 ip daddr != 10.213.7.1 accept"),
            "the tenant's own workloads, not the host behind the bridge: {rules}"
        );
        assert!(
            rules.contains("ip daddr 198.18.0.1/32 th dport 5000-5001 accept"),
            "{rules}"
        );
        assert!(rules.contains("ip daddr 10.2.0.0/16 accept"), "{rules}");
        assert!(
            rules.contains(
                "n_flb7 ip daddr 10.213.7.1 meta l4proto tcp th dport 5672 dnat ip to 127.0.0.1"
            ),
            "{rules}"
        );
        assert!(!rules.contains("fd00"), "{rules}");
        assert!(
            !maps_loopback(&"127.0.0.1".parse().unwrap()),
            "a portless loopback rule would capture the workload's own loopback"
        );
        let a = Attachment {
            instance: "inst_x".into(),
            slot: 7,
            host: 9,
            port: Some(8123),
        };
        let ns = workload_rules(&a, &allow);
        assert!(
            ns.contains("ip daddr 10.213.7.9 tcp dport 8123 dnat ip to 127.0.0.1"),
            "{ns}"
        );
        assert!(
            ns.contains(
                "ip daddr 127.0.0.1/32 meta l4proto tcp th dport 5672 dnat ip to 10.213.7.1"
            ),
            "{ns}"
        );
    }

    /// The generated rules are valid for this kernel and `nft` (checked,
    /// never applied: `nft --check`). Needs root.
    #[test]
    fn the_rules_pass_nfts_check() {
        if !nix::unistd::geteuid().is_root()
            || crate::runtime::sandbox::find_program("nft").is_none()
        {
            eprintln!("skipping: `nft --check` needs root and nftables");
            return;
        }
        let allow: Vec<AllowRule> = ["198.18.0.1:5000-5001", "127.0.0.1:5672", "10.2.0.0/16"]
            .iter()
            .map(|r| r.parse().unwrap())
            .collect();
        let a = Attachment {
            instance: "inst_x".into(),
            slot: 7,
            host: 9,
            port: Some(8123),
        };
        let host = host_table() + &bridge_rules(7, &allow);
        run("nft", &["--check", "-f", "-"], Some(&host)).unwrap();
        run(
            "nft",
            &["--check", "-f", "-"],
            Some(&workload_rules(&a, &allow)),
        )
        .unwrap();
    }
}
