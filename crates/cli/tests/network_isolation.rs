//! Tenants are sealed off from each other and from the host on the
//! network, on the process runtime: the real `flotilla` server, agent
//! (root: a network namespace per workload on a bridge per tenant, the
//! `inet flotilla` firewall) and gateway; tenant A serves an endpoint
//! replica (`flotilla emulator`), tenant B's workload tries what an
//! attacker would and every attempt fails: A's replica (at its namespace
//! address, at A's bridge, at `127.0.0.1:PORT`), a listener on the host's
//! loopback, the host's PostgreSQL, a listener on the host's own
//! non-loopback address and one on 169.254.169.254 (on a link this
//! test creates, so that a leak stays on this machine). Each refusal is
//! preceded by a precondition: the target answers from the host. B does
//! reach the address the agent was started to allow (`--allow-egress`), on
//! the allowed port only, and A's own workload and the gateway reach A's
//! replica.
//!
//! Needs root (as CI runs); skipped with a message otherwise. Every
//! packet goes to this machine's loopback or to addresses on links this
//! test or the agent creates.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use flotilla_testkit::process::{free_port, http, probe_outcomes, probe_script, wait_until, Home};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");
/// Generous: a loaded two-core CI machine.
const LONG: Duration = Duration::from_secs(180);

/// A link this test owns, holding addresses of its own on the host,
/// removed on drop (even on failure). A veth pair (both ends on the
/// host): not every kernel has the `dummy` module.
struct Dummy(String);

impl Dummy {
    fn new(name: &str, addrs: &[Ipv4Addr]) -> Dummy {
        // A leftover of an earlier run with the same name.
        let _ = Command::new("ip")
            .args(["link", "delete", name])
            .stderr(std::process::Stdio::null())
            .status();
        let peer = format!("{name}p");
        assert!(
            ip(&["link", "add", name, "type", "veth", "peer", "name", &peer]),
            "ip link add {name}"
        );
        let d = Dummy(name.to_string());
        for a in addrs {
            assert!(ip(&["addr", "add", &format!("{a}/32"), "dev", name]));
        }
        assert!(ip(&["link", "set", name, "up"]));
        assert!(ip(&["link", "set", &peer, "up"]));
        d
    }
}

impl Drop for Dummy {
    fn drop(&mut self) {
        let _ = ip(&["link", "delete", &self.0]);
    }
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .status()
        .is_ok_and(|s| s.success())
}

fn ip_out(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().expect("ip runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A TCP listener answering every connection with a line, on its own
/// thread for the rest of the test.
fn listen(addr: Ipv4Addr) -> SocketAddr {
    let l = TcpListener::bind((addr, 0)).unwrap_or_else(|e| panic!("bind {addr}: {e}"));
    let at = l.local_addr().expect("address");
    std::thread::spawn(move || {
        for mut s in l.incoming().flatten() {
            use std::io::Write as _;
            let _ = s.write_all(b"hi\n");
        }
    });
    at
}

/// The precondition of every refusal: the target answers from the host.
fn answers_from_host(at: SocketAddr) -> bool {
    TcpStream::connect_timeout(&at, Duration::from_secs(5)).is_ok()
}

/// A probe opening a TCP connection to `at` from inside a workload.
fn tcp_probe(name: &str, at: SocketAddr) -> (String, String) {
    (
        name.to_string(),
        format!(
            "timeout 15 bash -c 'exec 3<>/dev/tcp/{}/{}'",
            at.ip(),
            at.port()
        ),
    )
}

/// The host's first global IPv4 address not on a link of ours or the
/// agent's.
fn host_address() -> Option<Ipv4Addr> {
    ip_out(&["-4", "-o", "addr", "show", "scope", "global"])
        .lines()
        .filter(|l| {
            let dev = l.split_whitespace().nth(1).unwrap_or("");
            !dev.starts_with("flb") && !dev.starts_with("fltd")
        })
        .find_map(|l| {
            let cidr = l.split_whitespace().nth(3)?;
            cidr.split('/').next()?.parse().ok()
        })
}

/// Runs `probes` as `key`'s workload and returns each probe's outcome.
fn probe(
    home: &Home,
    key: &str,
    probes: &[(String, String)],
) -> (String, std::collections::BTreeMap<String, String>) {
    let attacks: Vec<(&str, String)> = probes
        .iter()
        .map(|(n, c)| (n.as_str(), c.clone()))
        .collect();
    let id = home.run_detached(
        key,
        &["--gpus", "1", "--", "sh", "-c", &probe_script(&attacks)],
    );
    wait_until("the probes end", LONG, || {
        home.log_lines(key, &id).iter().any(|l| l == "probe-done")
    });
    let lines = home.log_lines(key, &id);
    let (outcomes, _) = probe_outcomes(&lines);
    assert_eq!(outcomes.len(), probes.len(), "{lines:?}");
    (id, outcomes)
}

/// `flotilla nodes show` of the node named `name`, as text.
fn node_show(home: &Home, name: &str) -> String {
    let op = home.operator_key();
    let mut id = String::new();
    wait_until("the node registers", LONG, || {
        let nodes = home.get(&op, "/v1/nodes?limit=100");
        id = nodes["items"]
            .as_array()
            .and_then(|n| n.iter().find(|n| n["name"] == name))
            .and_then(|n| n["id"].as_str())
            .unwrap_or_default()
            .to_string();
        !id.is_empty()
    });
    let out = home.cli(Some(&op), &["nodes", "show", &id]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn chat(gw: &str, key: &str) -> u16 {
    let body = json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 2})
    .to_string();
    http(
        "POST",
        &format!("{gw}/v1/chat/completions"),
        Some(key),
        Some(&body),
    )
    .map_or(0, |(s, _)| s)
}

/// What tenants must not reach (and the one address they may), each
/// answering from the host: listeners on the host's loopback, its own
/// address, every address, 169.254.169.254 and an allow-listed address
/// (both on a dummy link of this test), and PostgreSQL.
struct Targets {
    _dummy: Dummy,
    on_loopback: SocketAddr,
    on_metadata: SocketAddr,
    allowed: SocketAddr,
    not_allowed: SocketAddr,
    on_host_ip: SocketAddr,
    on_every_address: SocketAddr,
    postgres: SocketAddr,
}

impl Targets {
    /// `salt` keeps two tests of one run apart.
    fn new(salt: u32) -> Targets {
        // Unique per run: other tests create links at the same time.
        let tag = (std::process::id()
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos())
            ^ salt)
            & 0xfff;
        let metadata = Ipv4Addr::new(169, 254, 169, 254);
        let allowed_ip = Ipv4Addr::new(198, 18, (tag >> 4) as u8, (tag & 0xf) as u8 + 1);
        let dummy = Dummy::new(&format!("fltd{tag:x}"), &[metadata, allowed_ip]);
        let host_ip = host_address().expect("the host has a global IPv4 address");
        let t = Targets {
            _dummy: dummy,
            on_loopback: listen(Ipv4Addr::LOCALHOST),
            on_metadata: listen(metadata),
            allowed: listen(allowed_ip),
            not_allowed: listen(allowed_ip),
            on_host_ip: listen(host_ip),
            on_every_address: listen(Ipv4Addr::UNSPECIFIED),
            postgres: "127.0.0.1:5432".parse().expect("literal"),
        };
        for (what, at) in [
            ("a listener on the host's loopback", t.on_loopback),
            ("a listener on 169.254.169.254", t.on_metadata),
            ("the allowed listener", t.allowed),
            (
                "a listener on the allowed address, another port",
                t.not_allowed,
            ),
            ("a listener on the host's own address", t.on_host_ip),
            (
                "a listener on every address",
                SocketAddr::from((Ipv4Addr::LOCALHOST, t.on_every_address.port())),
            ),
            ("PostgreSQL", t.postgres),
        ] {
            assert!(
                answers_from_host(at),
                "precondition: {what} at {at} answers from the host"
            );
        }
        t
    }

    /// The `--allow-egress` rule for the allowed listener, as the node
    /// shows it.
    fn allow_rule(&self) -> String {
        format!("{}/32:{}", self.allowed.ip(), self.allowed.port())
    }
}

#[test]
fn tenants_are_sealed_off_on_the_process_runtime() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipping network_isolation: a network namespace per workload needs root (CI runs as root)");
        return;
    }
    let t = Targets::new(1);

    let home = Home::new(BIN);
    let _server = home.server();
    let allow = t.allow_rule();
    let _agent = home.agent_with(
        "net-node",
        "4xH100",
        &home.url(),
        &["--allow-egress", &allow],
    );
    let gw_port = free_port();
    let _gw = home.gateway(gw_port);
    let gw = format!("http://127.0.0.1:{gw_port}");
    let (_, key_a) = home.tenant("alpha");
    let (_, key_b) = home.tenant("beta");
    // The node says how its workloads' network is isolated.
    let shown = node_show(&home, "net-node");
    assert!(shown.contains("network:   isolated"), "{shown}");
    assert!(shown.contains(&format!("also allowed: {allow}")), "{shown}");

    // A's endpoint: an emulator replica listening on its loopback.
    let replica = format!("exec {BIN} emulator --port \"$PORT\" --model chat");
    let out = home.cli(
        Some(&key_a),
        &[
            "endpoints",
            "deploy",
            "chat",
            "--model",
            "chat",
            "--min",
            "1",
            "--max",
            "1",
            "--",
            "sh",
            "-c",
            &replica,
        ],
    );
    assert!(
        out.status.success(),
        "deploy: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_until("the gateway reaches A's replica", LONG, || {
        chat(&gw, &key_a) == 200
    });
    let ep = home.cli_json(Some(&key_a), &["endpoints", "show", "chat"]);
    let replica_id = ep["replicas"][0]["instance_id"]
        .as_str()
        .expect("a replica")
        .to_string();
    let port: u16 = ep["replicas"][0]["url"]
        .as_str()
        .and_then(|u| u.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .expect("the replica's port");
    let netns = format!("fl-{replica_id}");
    let replica_ip: Ipv4Addr = ip_out(&["-n", &netns, "-4", "-o", "addr", "show", "dev", "eth0"])
        .split_whitespace()
        .nth(3)
        .and_then(|c| c.split('/').next())
        .and_then(|a| a.parse().ok())
        .expect("the replica has its own namespace and address");
    let a_replica = SocketAddr::from((replica_ip, port));
    let a_bridge = SocketAddr::from((
        Ipv4Addr::from(u32::from(replica_ip) & 0xffff_ff00 | 1),
        port,
    ));
    let replica_on_loopback = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    assert!(
        answers_from_host(a_replica),
        "precondition: A's replica answers at {a_replica}"
    );
    assert!(
        answers_from_host(replica_on_loopback),
        "precondition: A's replica answers at {replica_on_loopback} (the gateway's way)"
    );

    // Tenant B attacks.
    let denied = [
        tcp_probe("a-replica", a_replica),
        tcp_probe("a-replica-via-bridge", a_bridge),
        tcp_probe("a-replica-on-loopback", replica_on_loopback),
        tcp_probe("host-loopback-listener", t.on_loopback),
        tcp_probe("postgres-loopback", t.postgres),
        tcp_probe("host-address-listener", t.on_host_ip),
        tcp_probe("metadata", t.on_metadata),
        // The host behind the workload's own gateway (its bridge's address).
        (
            "host-via-own-gateway".to_string(),
            format!(
                "timeout 15 bash -c 'exec 3<>/dev/tcp/'$(ip -4 route show default | cut -d' ' -f3)'/{}'",
                t.on_every_address.port()
            ),
        ),
        tcp_probe("allowed-address-other-port", t.not_allowed),
    ];
    let mut b_probes = denied.to_vec();
    b_probes.push(tcp_probe("allowed", t.allowed));
    // The gateway probe's precondition: the workload knows its gateway.
    b_probes.push((
        "has-default-route".to_string(),
        "ip -4 route show default | grep -q via".to_string(),
    ));
    let (b_id, outcomes) = probe(&home, &key_b, &b_probes);
    for (name, _) in &denied {
        assert_eq!(
            outcomes[name], "denied",
            "tenant B reached {name}: {outcomes:?}"
        );
    }
    assert_eq!(
        outcomes["allowed"], "allowed",
        "the allow-listed address: {outcomes:?}"
    );
    assert_eq!(outcomes["has-default-route"], "allowed", "{outcomes:?}");

    // A's own workload reaches A's replica; the gateway still does.
    let (a_id, outcomes) = probe(&home, &key_a, &[tcp_probe("own-replica", a_replica)]);
    assert_eq!(outcomes["own-replica"], "allowed", "{outcomes:?}");
    assert_eq!(chat(&gw, &key_a), 200, "the gateway reaches A's replica");

    // Ended workloads' namespaces are removed, and with the replica its
    // forward and, the tenant's last workload gone, A's bridge.
    let out = home.cli(Some(&key_a), &["endpoints", "delete", "chat"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for id in [&a_id, &b_id, &replica_id] {
        let ns = format!("/run/netns/fl-{id}");
        wait_until("an ended workload's namespace is removed", LONG, || {
            !Path::new(&ns).exists()
        });
    }
    let a_bridge_link = format!("/sys/class/net/flb{}", replica_ip.octets()[2]);
    wait_until("A's bridge is removed", LONG, || {
        !Path::new(&a_bridge_link).exists()
    });
    assert!(
        !answers_from_host(replica_on_loopback),
        "the replica's forward is gone with it"
    );
}

/// A probe from a busybox container: connects with `nc` and expects the
/// test listeners' greeting.
fn nc_probe(name: &str, at: SocketAddr) -> (String, String) {
    (
        name.to_string(),
        format!(
            "timeout 15 nc -w 5 {} {} </dev/null | grep -q hi",
            at.ip(),
            at.port()
        ),
    )
}

/// The same policy for the container runtime: tenant B's container (on
/// its network with a route out) reaches neither A's replica container,
/// nor the host's listeners, nor 169.254.169.254, but reaches the
/// allow-listed address; A's own container and the gateway reach A's
/// replica.
#[test]
fn tenants_are_sealed_off_on_the_container_runtime() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipping network_isolation (containers): the workload firewall needs root (CI runs as root)");
        return;
    }
    let Some(engine) = flotilla_testkit::containers::engine() else {
        return;
    };
    let t = Targets::new(2);
    let home = Home::new(BIN);
    let node = format!("netc-{}-{}", std::process::id(), home.port);
    let _sweep = engine.sweep_on_drop(&node);
    let _server = home.server();
    let allow = t.allow_rule();
    let _agent = home.agent_with(
        &node,
        "4xH100",
        &home.url(),
        &[
            "--runtime",
            "container",
            "--docker-host",
            &engine.docker_host,
            "--allow-egress",
            &allow,
        ],
    );
    let gw_port = free_port();
    let _gw = home.gateway(gw_port);
    let (_, key_a) = home.tenant("alpha");
    let (_, key_b) = home.tenant("beta");
    let shown = node_show(&home, &node);
    assert!(shown.contains("network:   isolated"), "{shown}");
    assert!(shown.contains(&format!("also allowed: {allow}")), "{shown}");

    // A's endpoint: busybox httpd in a container.
    let out = home.cli(
        Some(&key_a),
        &[
            "endpoints",
            "deploy",
            "web",
            "--image",
            &engine.image,
            "--min",
            "1",
            "--readiness-path",
            "/index.html",
            "--",
            "sh",
            "-c",
            "exec httpd -f -p \"$PORT\" -h /www",
        ],
    );
    assert!(
        out.status.success(),
        "deploy: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let through_gateway = || {
        http(
            "GET",
            &format!("http://127.0.0.1:{gw_port}/e/web/index.html"),
            Some(&key_a),
            None,
        )
        .map_or(0, |(s, _)| s)
    };
    wait_until("the gateway reaches A's replica", LONG, || {
        through_gateway() == 200
    });
    let ep = home.cli_json(Some(&key_a), &["endpoints", "show", "web"]);
    let replica_id = ep["replicas"][0]["instance_id"]
        .as_str()
        .expect("a replica")
        .to_string();
    let container = engine
        .containers_of(&node)
        .into_iter()
        .find(|c| c["Labels"]["flotilla.instance"] == replica_id.as_str())
        .expect("the replica's container");
    let info = engine.api(
        "GET",
        &format!(
            "/containers/{}/json",
            container["Id"].as_str().unwrap_or("")
        ),
    );
    let a_ip: Ipv4Addr = info["NetworkSettings"]["Networks"]
        .as_object()
        .and_then(|n| n.values().find_map(|v| v["IPAddress"].as_str()))
        .and_then(|ip| ip.parse().ok())
        .unwrap_or_else(|| panic!("A's replica's address: {info}"));
    let a_gateway: Ipv4Addr = info["NetworkSettings"]["Networks"]
        .as_object()
        .and_then(|n| n.values().find_map(|v| v["Gateway"].as_str()))
        .and_then(|ip| ip.parse().ok())
        .unwrap_or_else(|| panic!("A's network's gateway: {info}"));
    let a_replica = SocketAddr::from((a_ip, 8080));
    assert!(
        answers_from_host(a_replica),
        "precondition: A's replica answers at {a_replica}"
    );
    let fetch_a = format!(
        "printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | timeout 15 nc -w 5 {a_ip} 8080 | grep -q 'flotilla test image'"
    );

    // Tenant B attacks from a container with a published port (a network
    // with a route out).
    let denied = [
        ("a-replica".to_string(), fetch_a.clone()),
        nc_probe("host-loopback-listener", t.on_loopback),
        nc_probe("host-address-listener", t.on_host_ip),
        nc_probe(
            "host-via-a-gateway",
            SocketAddr::from((a_gateway, t.on_every_address.port())),
        ),
        nc_probe("metadata", t.on_metadata),
        nc_probe("allowed-address-other-port", t.not_allowed),
    ];
    let mut attacks: Vec<(&str, String)> = denied
        .iter()
        .map(|(n, c)| (n.as_str(), c.clone()))
        .collect();
    let allowed = nc_probe("allowed", t.allowed);
    attacks.push((allowed.0.as_str(), allowed.1.clone()));
    let script = probe_script(&attacks) + "exec sleep 300\n";
    let b = home.run_detached(
        &key_b,
        &[
            "--cpus",
            "0.25",
            "--image",
            &engine.image,
            "-p",
            "9090",
            "--",
            "sh",
            "-c",
            &script,
        ],
    );
    wait_until("B's probes end", LONG, || {
        home.log_lines(&key_b, &b).iter().any(|l| l == "probe-done")
    });
    let lines = home.log_lines(&key_b, &b);
    let (outcomes, _) = probe_outcomes(&lines);
    assert_eq!(outcomes.len(), attacks.len(), "{lines:?}");
    for (name, _) in &denied {
        assert_eq!(
            outcomes[name], "denied",
            "tenant B reached {name}: {lines:?}"
        );
    }
    assert_eq!(
        outcomes["allowed"], "allowed",
        "the allow-listed address: {lines:?}"
    );

    // A's own container reaches A's replica; the gateway still does.
    let a2 = home.run_detached(
        &key_a,
        &["--cpus", "0.25", "--image", &engine.image, "-p", "7070", "--", "sh", "-c",
          &format!("if {fetch_a}; then echo same-tenant-ok; else echo same-tenant-failed; fi; exec sleep 300")],
    );
    wait_until("A's own container's probe ends", LONG, || {
        home.log_lines(&key_a, &a2)
            .iter()
            .any(|l| l.starts_with("same-tenant-"))
    });
    let lines = home.log_lines(&key_a, &a2);
    assert!(
        lines.iter().any(|l| l == "same-tenant-ok"),
        "A's own container reaches A's replica: {lines:?}"
    );
    assert_eq!(through_gateway(), 200, "the gateway reaches A's replica");
}
