//! HTTPS as a user runs it: the real `flotilla` binary serving the API and
//! the gateway over TLS (a self-signed certificate made at first start, or
//! the operator's files), and the CLI and agents trusting it by pinned
//! fingerprint or CA file, each a separate process on ephemeral ports.
//!
//! What checks the server here shares no code with it: the plain-HTTP
//! probe is the test kit's std client, the gateway is called through
//! reqwest's own certificate verification, and the fingerprint is
//! recomputed with `openssl` where it is installed.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use flotilla_testkit::process::{free_port, http, wait_until, Home, Proc};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

/// A command of the home without TLS settings inherited from the test's
/// environment.
fn cmd(env: &Home) -> Command {
    let mut c = env.cmd();
    c.env_remove("FLOTILLA_TLS")
        .env_remove("FLOTILLA_TLS_CERT")
        .env_remove("FLOTILLA_TLS_KEY")
        .env_remove("FLOTILLA_TLS_FINGERPRINT")
        .env_remove("FLOTILLA_CA_CERT");
    c
}

fn cli(env: &Home, args: &[&str]) -> Output {
    cmd(env).args(args).output().expect("run flotilla")
}

fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn failed(out: &Output, what: &str) -> String {
    assert!(
        !out.status.success(),
        "{what} should fail: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Waits until `port` answers a plain-HTTP request with the HTTPS
/// listener's 400 `https_required`: the server is up and speaks only TLS.
fn wait_https(port: u16) {
    wait_until("the HTTPS port answers", Duration::from_secs(60), || {
        matches!(
            http("GET", &format!("http://127.0.0.1:{port}/healthz"), None, None),
            Ok((400, body)) if body["error"]["code"] == "https_required"
        )
    });
}

/// The last `sha256:…` fingerprint in `log`, once one is there.
fn printed_fingerprint(env: &Home, log: &str, nth: usize) -> String {
    let path = env.dir.path().join(format!("{log}.log"));
    let found = || -> Vec<String> {
        std::fs::read_to_string(&path)
            .unwrap_or_default()
            .split_whitespace()
            .filter(|w| w.starts_with("sha256:") && w.len() == 7 + 64)
            .map(str::to_string)
            .collect()
    };
    wait_until("the printed fingerprint", Duration::from_secs(30), || {
        found().len() >= nth
    });
    found()[nth - 1].clone()
}

/// The fingerprint `openssl` computes for a PEM certificate, in our form;
/// `None` without openssl.
fn openssl_fingerprint(cert: &Path) -> Option<String> {
    let out = Command::new("openssl")
        .args(["x509", "-noout", "-fingerprint", "-sha256", "-in"])
        .arg(cert)
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let hex: String = text
        .split_once('=')?
        .1
        .trim()
        .chars()
        .filter(|c| *c != ':')
        .collect();
    Some(format!("sha256:{}", hex.to_lowercase()))
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn start_server(env: &Home, tls: &[&str]) -> Proc {
    let child = cmd(env)
        .args(["server", "--bind", &format!("127.0.0.1:{}", env.port)])
        .arg("--data-dir")
        .arg(env.data())
        .args(tls)
        .stdout(env.log("server"))
        .stderr(env.log("server"))
        .spawn()
        .expect("start flotilla server");
    let server = Proc(child);
    wait_https(env.port);
    server
}

fn stop(proc: &mut Proc) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(proc.0.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let start = std::time::Instant::now();
    loop {
        if let Some(status) = proc.0.try_wait().unwrap() {
            assert!(status.success(), "stops cleanly: {status:?}");
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "did not stop");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `flotilla server --tls self-signed`: the CLI by pin, by CA file and by
/// saved credentials; a wrong pin and plain HTTP refused with clear words;
/// an agent joins and runs an instance over HTTPS, an agent with a wrong
/// pin is refused; the certificate is kept (0600 key) across a restart.
#[test]
fn a_self_signed_server_is_pinned_by_the_cli_and_agents_and_kept_across_restarts() {
    let env = Home::new(BIN);
    let url = format!("https://127.0.0.1:{}", env.port);
    let mut server = start_server(&env, &["--tls", "self-signed"]);
    let fp = printed_fingerprint(&env, "server", 1);
    let cert = env.data().join("tls.crt");
    let key_file = env.data().join("tls.key");
    assert_eq!(mode(&key_file), 0o600, "the key is owner-only");
    if let Some(f) = openssl_fingerprint(&cert) {
        assert_eq!(f, fp, "the printed fingerprint is the certificate's");
    } else {
        eprintln!("openssl not installed: fingerprint not recomputed");
    }
    let creds: serde_json::Value = {
        let key = env.operator_key();
        let path = env.dir.path().join("config/credentials.json");
        let c: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        assert_eq!(c["api_key"], key.as_str());
        c
    };
    assert_eq!(creds["server"], url.as_str(), "{creds}");
    assert_eq!(creds["tls_fingerprint"], fp.as_str(), "{creds}");
    let key = creds["api_key"].as_str().unwrap().to_string();

    // By pin, given on the command line.
    let out = cli(
        &env,
        &[
            "--server",
            &url,
            "--tls-fingerprint",
            &fp,
            "--api-key",
            &key,
            "gpus",
        ],
    );
    assert!(ok(&out, "gpus by pin").contains("H100"));
    // By the saved credentials alone.
    assert!(ok(&cli(&env, &["gpus"]), "gpus by saved credentials").contains("H100"));
    // By the certificate as a CA file, under a name it carries.
    let by_name = format!("https://localhost:{}", env.port);
    let out = cmd(&env)
        .args(["--server", &by_name, "--api-key", &key, "--ca-cert"])
        .arg(&cert)
        .arg("gpus")
        .output()
        .unwrap();
    assert!(ok(&out, "gpus by CA file").contains("H100"));

    // A wrong pin: refused, both fingerprints named.
    let wrong = format!("sha256:{}", "00".repeat(32));
    let out = cli(
        &env,
        &[
            "--server",
            &url,
            "--tls-fingerprint",
            &wrong,
            "--api-key",
            &key,
            "gpus",
        ],
    );
    let e = failed(&out, "a wrong pin");
    assert!(
        e.contains(&format!(
            "the server's certificate has fingerprint {fp}, not the pinned {wrong}"
        )),
        "{e}"
    );
    // The system's roots do not vouch for a self-signed certificate.
    let out = cli(&env, &["--server", &url, "--api-key", &key, "gpus"]);
    let e = failed(&out, "no pin");
    assert!(e.contains("--tls-fingerprint"), "{e}");
    // Plain HTTP to the HTTPS port: told to use https.
    let plain = format!("http://127.0.0.1:{}", env.port);
    let out = cli(&env, &["--server", &plain, "--api-key", &key, "gpus"]);
    let e = failed(&out, "plain HTTP");
    assert!(e.contains("this server speaks HTTPS"), "{e}");

    // An agent joins by pin and runs work.
    let token = std::fs::read_to_string(env.data().join("agent.token")).unwrap();
    let agent = |name: &str, pin: &str, log: &str| {
        Proc(
            cmd(&env)
                .args(["agent", "--server", &url, "--tls-fingerprint", pin])
                .args(["--token", token.trim(), "--name", name])
                .args(["--simulate-gpus", "2xH100", "--work-dir"])
                .arg(env.dir.path().join(name))
                .stdout(env.log(log))
                .stderr(env.log(log))
                .spawn()
                .expect("start flotilla agent"),
        )
    };
    let _agent = agent("tls-node", &fp, "agent");
    wait_until("the node is ready", Duration::from_secs(60), || {
        ok(&cli(&env, &["nodes"]), "nodes").contains("ready")
    });
    let out = cli(
        &env,
        &[
            "run",
            "--gpus",
            "1",
            "--",
            "sh",
            "-c",
            "echo over-tls on $CUDA_VISIBLE_DEVICES",
        ],
    );
    assert!(
        ok(&out, "run over HTTPS").contains("over-tls on"),
        "{out:?}"
    );

    // An agent pinning another certificate stops at registration, saying
    // why.
    let mut bad = agent("bad-pin", &wrong, "bad-agent");
    wait_until(
        "the mis-pinned agent exits",
        Duration::from_secs(60),
        || bad.0.try_wait().unwrap().is_some(),
    );
    assert!(!bad.0.wait().unwrap().success());
    let log = std::fs::read_to_string(env.dir.path().join("bad-agent.log")).unwrap();
    assert!(
        log.contains(&format!("has fingerprint {fp}, not the pinned {wrong}")),
        "{log}"
    );
    let nodes = ok(&cli(&env, &["nodes"]), "nodes");
    assert!(!nodes.contains("bad-pin"), "{nodes}");

    // A gateway of its own: HTTPS with a self-signed certificate in the
    // data directory's `gateway/`, calling the control plane by pin. An
    // unknown key is answered 401 only once the control plane said so
    // (were it unreachable, 503).
    let gw_port = free_port();
    let _gateway = Proc(
        cmd(&env)
            .args(["--server", &url, "--tls-fingerprint", &fp, "gateway"])
            .args(["--token", token.trim(), "--tls", "self-signed"])
            .args(["--bind", &format!("127.0.0.1:{gw_port}")])
            .stdout(env.log("gateway"))
            .stderr(env.log("gateway"))
            .spawn()
            .expect("start flotilla gateway"),
    );
    wait_https(gw_port);
    let gw_cert = env.data().join("gateway/tls.crt");
    assert_eq!(mode(&env.data().join("gateway/tls.key")), 0o600);
    assert_ne!(
        std::fs::read(&gw_cert).unwrap(),
        std::fs::read(&cert).unwrap()
    );
    let ca = reqwest::Certificate::from_pem(&std::fs::read(&gw_cert).unwrap()).unwrap();
    let answer = tokio::runtime::Runtime::new().unwrap().block_on(async {
        reqwest::Client::builder()
            .add_root_certificate(ca)
            .build()
            .unwrap()
            .get(format!("https://localhost:{gw_port}/v1/models"))
            .bearer_auth("flt_not_a_key")
            .send()
            .await
            .map(|r| r.status().as_u16())
            .map_err(|e| format!("{e:?}"))
    });
    assert_eq!(answer, Ok(401));

    // A restart keeps the certificate: same file, same fingerprint, and
    // the saved pin still holds.
    let before = std::fs::read(&cert).unwrap();
    stop(&mut server);
    let _server = start_server(&env, &["--tls", "self-signed"]);
    assert_eq!(printed_fingerprint(&env, "server", 2), fp);
    assert_eq!(std::fs::read(&cert).unwrap(), before);
    assert_eq!(mode(&key_file), 0o600);
    let log = std::fs::read_to_string(env.dir.path().join("server.log")).unwrap();
    assert!(log.contains("(kept,"), "{log}");
    assert!(ok(&cli(&env, &["gpus"]), "gpus after the restart").contains("H100"));
}

/// `flotilla up --tls self-signed`: the API and the gateway both serve
/// HTTPS with the one certificate, the local agent and the gateway reach
/// the API by its pin, and plain HTTP to either port is told to use TLS.
#[test]
fn up_serves_the_api_and_the_gateway_over_https() {
    let env = Home::new(BIN);
    let gw_port = free_port();
    let mut up = Proc(
        cmd(&env)
            .args(["up", "--bind", &format!("127.0.0.1:{}", env.port)])
            .args(["--gateway-bind", &format!("127.0.0.1:{gw_port}")])
            .args(["--tls", "self-signed", "--simulate-gpus", "2xH100"])
            .stdout(Stdio::piped())
            .stderr(env.log("up"))
            .spawn()
            .expect("start flotilla up"),
    );
    wait_https(env.port);
    wait_https(gw_port);
    let key = env.operator_key();
    // The local agent registered over HTTPS by the pin.
    wait_until("the local node is ready", Duration::from_secs(60), || {
        ok(&cli(&env, &["nodes"]), "nodes").contains("ready")
    });

    // The gateway, through reqwest's own verification with the
    // certificate as CA: it answers for the key only after asking the
    // control plane, over the pinned HTTPS.
    let ca = reqwest::Certificate::from_pem(&std::fs::read(env.data().join("tls.crt")).unwrap())
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let gateway = format!("https://localhost:{gw_port}");
    let status = |key: &str| {
        rt.block_on(async {
            let client = reqwest::Client::builder()
                .add_root_certificate(ca.clone())
                .build()
                .unwrap();
            client
                .get(format!("{gateway}/v1/models"))
                .bearer_auth(key)
                .send()
                .await
                .map(|r| r.status().as_u16())
                .map_err(|e| format!("{e:?}"))
        })
    };
    // Inference keys are tenants' keys.
    let tenant: serde_json::Value = serde_json::from_str(&ok(
        &cli(&env, &["--json", "tenants", "create", "acme"]),
        "tenants create",
    ))
    .unwrap();
    let minted: serde_json::Value = serde_json::from_str(&ok(
        &cli(
            &env,
            &[
                "--json",
                "keys",
                "create",
                "--role",
                "tenant_admin",
                "--tenant",
                tenant["id"].as_str().unwrap(),
            ],
        ),
        "keys create",
    ))
    .unwrap();
    assert_eq!(status(minted["secret"].as_str().unwrap()), Ok(200));
    assert_eq!(status(&key), Ok(401), "not an inference key");
    assert_eq!(status("flt_not_a_key"), Ok(401));
    // Without trusting the certificate, reqwest refuses the gateway.
    let untrusting = rt.block_on(async {
        reqwest::Client::new()
            .get(format!("{gateway}/v1/models"))
            .send()
            .await
    });
    assert!(untrusting.is_err(), "{untrusting:?}");

    // `flotilla demo` drives its load through the HTTPS gateway, trusting
    // it by the saved pin (the one certificate serves both ports).
    let out = cmd(&env)
        .args(["demo", "--gateway", &format!("https://127.0.0.1:{gw_port}")])
        .args(["--duration", "5", "--peak-rps", "2", "--base-rps", "1"])
        .args(["--max", "1", "--load-delay-ms", "200"])
        .output()
        .unwrap();
    let shown = ok(&out, "demo over HTTPS");
    assert!(shown.contains(" 0 failed"), "{shown}");
    assert!(shown.contains("requests:"), "{shown}");

    stop(&mut up);
    let mut printed = String::new();
    up.0.stdout
        .take()
        .unwrap()
        .read_to_string(&mut printed)
        .unwrap();
    assert!(
        printed.contains(&format!("API:      https://127.0.0.1:{}", env.port)),
        "{printed}"
    );
    assert!(
        printed.contains(&format!("gateway:  https://127.0.0.1:{gw_port}")),
        "{printed}"
    );
    assert!(printed.contains("fingerprint"), "{printed}");
}

/// The operator's own certificate files: served when they match, and a
/// start refused with the file named when they cannot be read or do not
/// match, before any key is minted.
#[test]
fn certificate_files_are_served_or_refused_with_the_file_named() {
    let env = Home::new(BIN);
    let certs = env.dir.path().join("certs");
    let a = flotilla_tls::ServerTls::self_signed(&certs.join("a"), &["localhost".into()]).unwrap();
    flotilla_tls::ServerTls::self_signed(&certs.join("b"), &["localhost".into()]).unwrap();
    let (cert_a, key_a) = (certs.join("a/tls.crt"), certs.join("a/tls.key"));
    let key_b = certs.join("b/tls.key");
    let server = |cert: &Path, key: &Path| {
        let mut c = cmd(&env);
        c.args(["server", "--bind", &format!("127.0.0.1:{}", env.port)])
            .arg("--data-dir")
            .arg(env.data())
            .arg("--tls-cert")
            .arg(cert)
            .arg("--tls-key")
            .arg(key);
        c
    };

    let out = server(&cert_a, &key_b).output().unwrap();
    let e = failed(&out, "a mismatched key");
    assert!(
        e.contains(&format!(
            "the TLS key {} does not belong to the certificate {}",
            key_b.display(),
            cert_a.display()
        )),
        "{e}"
    );
    let missing = certs.join("missing.key");
    let out = server(&cert_a, &missing).output().unwrap();
    let e = failed(&out, "a missing key");
    assert!(
        e.contains(&format!("cannot read the TLS key {}", missing.display())),
        "{e}"
    );
    assert!(
        !env.dir.path().join("config/credentials.json").exists(),
        "no operator key was minted by a refused start"
    );
    let out = cmd(&env)
        .args(["server", "--tls-cert"])
        .arg(&cert_a)
        .output()
        .unwrap();
    let e = failed(&out, "a certificate without its key");
    assert!(e.contains("--tls-key"), "{e}");

    let child = server(&cert_a, &key_a)
        .stdout(env.log("server"))
        .stderr(env.log("server"))
        .spawn()
        .unwrap();
    let _server = Proc(child);
    wait_https(env.port);
    let key = env.operator_key();
    let by_name = format!("https://localhost:{}", env.port);
    let out = cmd(&env)
        .args(["--server", &by_name, "--api-key", &key, "--ca-cert"])
        .arg(&cert_a)
        .arg("gpus")
        .output()
        .unwrap();
    assert!(ok(&out, "gpus by CA file").contains("H100"));
    let out = cli(
        &env,
        &[
            "--server",
            &by_name,
            "--api-key",
            &key,
            "--tls-fingerprint",
            &a.fingerprint().to_string(),
            "gpus",
        ],
    );
    assert!(ok(&out, "gpus by pin").contains("H100"));
}

/// A node pool behind a self-signed HTTPS server: its machines are given
/// the certificate's pin with their join token and join by it.
#[test]
fn node_pool_machines_join_a_self_signed_server_by_its_pin() {
    let env = Home::new(BIN);
    let _server = start_server(
        &env,
        &[
            "--tls",
            "self-signed",
            "--node-pool",
            "name=burst,provider=local,type=1xH100,min=1,max=1,idle=300,boot=120",
        ],
    );
    env.operator_key();
    wait_until(
        "the pool's machine joins over HTTPS",
        Duration::from_secs(90),
        || {
            let nodes = ok(&cli(&env, &["nodes"]), "nodes");
            nodes
                .lines()
                .any(|l| l.contains("burst-") && l.contains("ready"))
        },
    );
}
