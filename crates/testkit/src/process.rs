//! The real `flotilla` binary in a temporary home: a server, agents and CLI
//! calls, each a separate process, and a blocking HTTP client over std that
//! shares no code with what it tests.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A free loopback port (bound then released; the race is harmless here).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A child process killed (SIGKILL) when dropped.
#[derive(Debug)]
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `f` every 100 ms until it holds; panics after `limit`.
pub fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out after {limit:?} waiting for {what}");
}

/// One blocking HTTP/1.1 request; the body is JSON when it parses, else a
/// string. Chunked answers are reassembled.
pub fn http(
    method: &str,
    url: &str,
    key: Option<&str>,
    body: Option<&str>,
) -> std::io::Result<(u16, Value)> {
    use std::io::{Read, Write};
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| std::io::Error::other("only http:// URLs"))?;
    let (host, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let path = if path.is_empty() { "/" } else { path };
    let mut s = std::net::TcpStream::connect(host)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let body = body.unwrap_or("");
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    s.write_all(body.as_bytes())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let status: u16 = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    if status == 0 {
        return Err(std::io::Error::other("no HTTP answer"));
    }
    let (head, payload) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let payload = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(payload)
    } else {
        payload.to_string()
    };
    Ok((
        status,
        serde_json::from_str(&payload).unwrap_or(Value::String(payload)),
    ))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// A shell script for isolation tests: tries each `(name, command)` of
/// `attacks` and prints `probe NAME allowed` or `probe NAME denied`, then
/// `uid <its uid>` and `probe-done`.
pub fn probe_script(attacks: &[(&str, String)]) -> String {
    let mut script = String::from(
        "try() { if sh -c \"$2\" >/dev/null 2>&1; then echo \"probe $1 allowed\"; else echo \"probe $1 denied\"; fi; }\n",
    );
    for (name, cmd) in attacks {
        script.push_str(&format!("try {name} \"{}\"\n", cmd.replace('"', "\\\"")));
    }
    script.push_str("echo \"uid $(id -u)\"\necho probe-done\n");
    script
}

/// What [`probe_script`] printed: each probe's outcome by name, and the
/// uid it ran as.
pub fn probe_outcomes(lines: &[String]) -> (BTreeMap<String, String>, Option<u32>) {
    let probes = lines
        .iter()
        .filter_map(|l| l.strip_prefix("probe "))
        .filter_map(|l| l.split_once(' '))
        .map(|(n, o)| (n.to_string(), o.to_string()))
        .collect();
    let uid = lines
        .iter()
        .find_map(|l| l.strip_prefix("uid "))
        .and_then(|u| u.parse().ok());
    (probes, uid)
}

/// The uid a host process runs as.
pub fn uid_of(pid: u32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("process status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|u| u.parse().ok())
        .expect("a uid")
}

/// A temporary home for the binary: config and data directories, logs,
/// and the port its server listens on.
#[derive(Debug)]
pub struct Home {
    /// The `flotilla` binary under test.
    pub bin: PathBuf,
    /// Everything lives below this directory.
    pub dir: tempfile::TempDir,
    /// The server's port.
    pub port: u16,
    /// `None`: the default SQLite file in the data directory.
    pub database_url: Option<String>,
    /// The server's `--heartbeat-timeout`, in seconds.
    pub heartbeat_timeout: u64,
    /// `RUST_LOG` of every process.
    pub log_level: &'static str,
    /// Run every process as this uid (and gid) instead of the test's own:
    /// a root test playing an ordinary user. Own [`Home::dir`] by it first.
    pub uid: Option<u32>,
    /// More arguments for every `flotilla server` of this home
    /// (`--allow-egress 127.0.0.1:5672`).
    pub server_args: Vec<String>,
    /// More environment for every `flotilla server` of this home (test
    /// hooks such as `FLOTILLA_TEST_HOLD_LEASE_LOCK`).
    pub server_env: Vec<(String, String)>,
    /// More arguments for every `flotilla gateway` of this home.
    pub gateway_args: Vec<String>,
}

/// Workloads outlive their agent on purpose (a restarted agent adopts
/// them), so a test that ends, or fails, with work still running would
/// leave it behind. Every process whose command line names this home's
/// directory (a sandbox, a server, an agent) is killed with it; a sandbox's
/// pid namespace takes its workload down with it. A test that panicked
/// first prints the processes' logs: a timeout's cause is usually there.
impl Drop for Home {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump_logs();
        }
        let needle = self.dir.path().to_string_lossy().into_owned();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return;
        };
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<i32>().ok())
            else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                continue;
            };
            if String::from_utf8_lossy(&cmdline).contains(&needle) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        // `flotilla agent --work-dir DIR/agent`, and `flotilla up`'s agent
        // in its data directory.
        remove_workload_cgroups(&self.dir.path().join("agent"));
        remove_workload_cgroups(&self.data().join("agent"));
    }
}

/// Removes the cgroups the process runtime of agents working in
/// `work_dir` made (`flotilla/<node>-<hash>` of each tree, see
/// `flotilla_core::node::workload_cgroup`): killed agents leave them
/// behind. Kills what is still in them first (only this home's work is).
fn remove_workload_cgroups(work_dir: &Path) {
    let suffix = flotilla_core::node::workload_cgroup("", work_dir);
    let root = Path::new("/sys/fs/cgroup");
    let trees: Vec<PathBuf> = if root.join("cgroup.controllers").is_file() {
        vec![root.join("flotilla")]
    } else {
        ["memory", "cpu", "cpuacct", "pids"]
            .iter()
            .map(|c| root.join(c).join("flotilla"))
            .collect()
    };
    let dirs = |p: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(p)
            .map(|d| {
                d.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.is_dir())
                    .collect()
            })
            .unwrap_or_default()
    };
    for tree in trees {
        let agents = dirs(&tree).into_iter().filter(|d| {
            d.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(&suffix))
        });
        for agent in agents {
            for group in dirs(&agent) {
                for _ in 0..100 {
                    let procs =
                        std::fs::read_to_string(group.join("cgroup.procs")).unwrap_or_default();
                    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                        let _ = nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(pid),
                            nix::sys::signal::Signal::SIGKILL,
                        );
                    }
                    if std::fs::remove_dir(&group).is_ok() || !group.exists() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            let _ = std::fs::remove_dir(&agent);
        }
    }
}

impl Home {
    /// A fresh home for `bin` (pass `env!("CARGO_BIN_EXE_flotilla")`).
    pub fn new(bin: impl Into<PathBuf>) -> Self {
        Self {
            bin: bin.into(),
            dir: tempfile::tempdir().expect("temporary directory"),
            port: free_port(),
            database_url: None,
            heartbeat_timeout: 15,
            log_level: "info",
            uid: None,
            server_args: Vec::new(),
            server_env: Vec::new(),
            gateway_args: Vec::new(),
        }
    }

    /// The server's base URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The data directory (`FLOTILLA_DATA_DIR`).
    pub fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// A directory every workload of this home's agents sees read-write
    /// (`--sandbox-share`), like a team's shared volume: where a test's
    /// workloads keep checkpoints across attempts.
    pub fn shared(&self) -> PathBuf {
        let dir = self.dir.path().join("shared");
        std::fs::create_dir_all(&dir).expect("shared directory");
        // Workloads run as per-tenant users: they must be able to write.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777))
            .expect("shared directory mode");
        dir
    }

    /// A command for the binary with this home's environment and nothing
    /// inherited that would point it elsewhere.
    pub fn cmd(&self) -> Command {
        let mut c = Command::new(&self.bin);
        c.env("FLOTILLA_CONFIG_DIR", self.dir.path().join("config"))
            .env("FLOTILLA_DATA_DIR", self.data())
            .env_remove("FLOTILLA_API_KEY")
            .env_remove("FLOTILLA_SERVER")
            .env_remove("FLOTILLA_DATABASE_URL")
            .env("RUST_LOG", self.log_level)
            .stdin(Stdio::null());
        if let Some(uid) = self.uid {
            use std::os::unix::process::CommandExt;
            // std drops root's supplementary groups along with the uid.
            c.uid(uid).gid(uid).current_dir("/");
        }
        c
    }

    /// A log file of this home, appended to.
    pub fn log(&self, name: &str) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{name}.log")))
            .expect("log file")
    }

    /// Starts `flotilla server` and waits until it answers.
    pub fn server(&self) -> Proc {
        self.server_at(self.port)
    }

    /// Starts another `flotilla server` of this home (same data directory
    /// and database: a replica) on `port`, logging to `server-PORT.log`,
    /// and waits until it answers.
    pub fn server_at(&self, port: u16) -> Proc {
        let log = if port == self.port {
            "server".to_string()
        } else {
            format!("server-{port}")
        };
        let url = format!("http://127.0.0.1:{port}");
        let mut c = self.cmd();
        c.args(["server", "--bind", &format!("127.0.0.1:{port}")])
            .arg("--data-dir")
            .arg(self.data())
            .args(["--heartbeat-timeout", &self.heartbeat_timeout.to_string()]);
        if let Some(url) = &self.database_url {
            c.args(["--database-url", url]);
        }
        c.args(&self.server_args);
        c.envs(self.server_env.iter().map(|(k, v)| (k, v)));
        let child = c
            .stdout(self.log(&log))
            .stderr(self.log(&log))
            .spawn()
            .expect("start flotilla server");
        let server = Proc(child);
        wait_until("the server answers", Duration::from_secs(120), || {
            http("GET", &format!("{url}/healthz"), None, None)
                .map(|(s, _)| s == 200)
                .unwrap_or(false)
        });
        server
    }

    /// Starts `flotilla up` (server and agent in one process, the node
    /// called `box` with `gpus` simulated, e.g. `2xH100`) on this home's
    /// port, with `extra` arguments, logging to `log`, and waits until it
    /// answers. Its gateway binds a free port, not the default 7430, which
    /// another `up` on the machine may hold.
    pub fn up(&self, gpus: &str, extra: &[&str], log: &str) -> Proc {
        let child = self
            .cmd()
            .args(["up", "--bind", &format!("127.0.0.1:{}", self.port)])
            .args(["--gateway-bind", &format!("127.0.0.1:{}", free_port())])
            .args(["--simulate-gpus", gpus, "--node-name", "box"])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(self.log(log))
            .spawn()
            .expect("start flotilla up");
        let up = Proc(child);
        wait_until("up answers", Duration::from_secs(60), || {
            http("GET", &format!("{}/healthz", self.url()), None, None)
                .map(|(s, _)| s == 200)
                .unwrap_or(false)
        });
        up
    }

    /// Starts `flotilla agent` with simulated GPUs and the server's token.
    pub fn agent(&self, name: &str, simulate: &str) -> Proc {
        self.agent_to(name, simulate, &self.url())
    }

    /// Starts `flotilla agent` reporting to `servers` (one URL, or several
    /// comma-separated replicas), logging to `agent.log`.
    pub fn agent_to(&self, name: &str, simulate: &str, servers: &str) -> Proc {
        self.agent_with(name, simulate, servers, &[])
    }

    /// Like [`Home::agent_to`], with `extra` arguments (`--runtime
    /// container --docker-host …`).
    pub fn agent_with(&self, name: &str, simulate: &str, servers: &str, extra: &[&str]) -> Proc {
        let path = self.data().join("agent.token");
        wait_until("the agent token", Duration::from_secs(20), || {
            std::fs::read_to_string(&path).is_ok_and(|t| !t.trim().is_empty())
        });
        let token = std::fs::read_to_string(&path).expect("agent token");
        let child = self
            .cmd()
            .args(["agent", "--server", servers, "--token", token.trim()])
            .args(["--name", name, "--simulate-gpus", simulate, "--work-dir"])
            .arg(self.dir.path().join("agent"))
            // Workloads may keep files across attempts in `shared()`, and
            // exec the binary under test (an endpoint's replica).
            .arg("--sandbox-share")
            .arg(format!("{}:rw", self.shared().display()))
            .arg("--sandbox-share")
            .arg(self.bin.parent().expect("the binary's directory"))
            .args(extra)
            .stdout(self.log("agent"))
            .stderr(self.log("agent"))
            .spawn()
            .expect("start flotilla agent");
        Proc(child)
    }

    /// Starts `flotilla gateway` against this home's server with the
    /// agent token, on `port`, logging to `gateway.log`, and waits until
    /// it listens.
    pub fn gateway(&self, port: u16) -> Proc {
        let path = self.data().join("agent.token");
        wait_until("the agent token", Duration::from_secs(20), || {
            std::fs::read_to_string(&path).is_ok_and(|t| !t.trim().is_empty())
        });
        let token = std::fs::read_to_string(&path).expect("agent token");
        let child = self
            .cmd()
            .args(["--server", &self.url(), "gateway", "--token", token.trim()])
            .args(["--bind", &format!("127.0.0.1:{port}")])
            .args(&self.gateway_args)
            .stdout(self.log("gateway"))
            .stderr(self.log("gateway"))
            .spawn()
            .expect("start flotilla gateway");
        let gw = Proc(child);
        wait_until("the gateway listens", Duration::from_secs(30), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        gw
    }

    /// Runs a CLI command against this home's server.
    pub fn cli(&self, key: Option<&str>, args: &[&str]) -> Output {
        let mut c = self.cmd();
        c.args(["--server", &self.url()]).args(args);
        if let Some(k) = key {
            c.env("FLOTILLA_API_KEY", k);
        }
        c.output().expect("run flotilla")
    }

    /// `flotilla run --detach ARGS` with `key`: the new instance's id;
    /// panics unless it succeeds.
    pub fn run_detached(&self, key: &str, args: &[&str]) -> String {
        let mut all = vec!["run", "--detach"];
        all.extend_from_slice(args);
        let out = self.cli(Some(key), &all);
        assert!(
            out.status.success(),
            "flotilla run failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Runs a CLI command with `--json`; panics unless it succeeds.
    pub fn cli_json(&self, key: Option<&str>, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = self.cli(key, &all);
        assert!(
            out.status.success(),
            "flotilla {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "flotilla {args:?}: {e}: {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }

    /// The operator key the first start saved.
    pub fn operator_key(&self) -> String {
        let path = self.dir.path().join("config/credentials.json");
        // The server answers before its first-start bootstrap has saved
        // the file: wait for it to be whole.
        let read = || -> Option<Value> { serde_json::from_slice(&std::fs::read(&path).ok()?).ok() };
        wait_until("the saved credentials", Duration::from_secs(20), || {
            read().is_some_and(|c| c["api_key"].is_string())
        });
        let creds = read().expect("credentials JSON");
        creds["api_key"].as_str().expect("api_key").to_string()
    }

    /// A new tenant `name` and a tenant admin key for it, made through the
    /// CLI with the operator key: `(tenant id, key)`.
    pub fn tenant(&self, name: &str) -> (String, String) {
        let op = self.operator_key();
        let t = self.cli_json(Some(&op), &["tenants", "create", name]);
        let id = t["id"].as_str().expect("tenant id").to_string();
        let k = self.cli_json(
            Some(&op),
            &["keys", "create", "--role", "tenant_admin", "--tenant", &id],
        );
        (id, k["secret"].as_str().expect("key secret").to_string())
    }

    /// Waits (up to a minute) until `free` GPUs of `model` are free: the
    /// local node of `up` registered and nothing holds them.
    pub fn wait_free_gpus(&self, key: &str, model: &str, free: u64) {
        wait_until("the local node's GPUs", Duration::from_secs(60), || {
            self.get(key, "/v1/gpu-types")["items"]
                .as_array()
                .is_some_and(|ts| {
                    ts.iter()
                        .any(|t| t["name"] == model && t["free"].as_u64() == Some(free))
                })
        });
    }

    /// GET `path` with `key`; panics unless 200.
    pub fn get(&self, key: &str, path: &str) -> Value {
        let (status, body) = http("GET", &format!("{}{path}", self.url()), Some(key), None)
            .expect("the server answers");
        assert_eq!(status, 200, "GET {path}: {body}");
        body
    }

    /// Runs `call` with a client of this home's server as `key`, on a
    /// thread of its own with a runtime of its own: the tests that drive a
    /// [`Home`] are mostly synchronous, and an asynchronous one could not
    /// start a runtime inside its own.
    fn with_client<T, F, Fut>(&self, key: &str, call: F) -> T
    where
        T: Send,
        F: FnOnce(flotilla_client::Client) -> Fut + Send,
        Fut: std::future::Future<Output = T>,
    {
        let client =
            flotilla_client::Client::new(&self.url(), key).expect("a client of this home's server");
        std::thread::scope(|s| {
            s.spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime for the client")
                    .block_on(call(client))
            })
            .join()
            .expect("the client's thread")
        })
    }

    /// The output lines of instance `id` so far (its first 1,000), as
    /// `key` reads them.
    pub fn log_lines(&self, key: &str, id: &str) -> Vec<String> {
        let page = self
            .with_client(key, |c| async move { c.logs_page(id, 0).await })
            .unwrap_or_else(|e| panic!("reading the log of {id}: {e}"));
        page.items.into_iter().map(|l| l.line).collect()
    }

    /// `(tenant, status)` of each audit entry for `route` on object `id`,
    /// as the operator key `op` reads the audit log (its last 1,000).
    pub fn audit_statuses(&self, op: &str, route: &str, id: &str) -> Vec<(String, u16)> {
        let entries = self
            .with_client(op, |c| async move { c.audit(None, Some(1000)).await })
            .unwrap_or_else(|e| panic!("reading the audit log: {e}"));
        entries
            .into_iter()
            .filter(|e| e.route == route && e.object_id.as_deref() == Some(id))
            .map(|e| (e.tenant_id.to_string(), e.status))
            .collect()
    }

    /// The attacks on the control plane's files every isolation test
    /// makes (for [`probe_script`]): its saved credentials, its data
    /// directory, its database and the agent token.
    pub fn control_plane_attacks(&self) -> Vec<(&'static str, String)> {
        let data = self.data();
        let creds = self.dir.path().join("config/credentials.json");
        vec![
            ("credentials", format!("cat '{}'", creds.display())),
            ("data-dir", format!("ls '{}'", data.display())),
            ("database", format!("cat '{}/flotilla.db'", data.display())),
            (
                "agent-token",
                format!("cat '{}/agent.token'", data.display()),
            ),
        ]
    }

    /// Prints the last lines of the servers' and agents' logs (on failure).
    pub fn dump_logs(&self) {
        let mut names: Vec<String> = std::fs::read_dir(self.dir.path())
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter_map(|e| e.file_name().into_string().ok())
                    .filter_map(|n| n.strip_suffix(".log").map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        for name in names {
            if let Ok(s) = std::fs::read_to_string(self.dir.path().join(format!("{name}.log"))) {
                let lines: Vec<&str> = s.lines().collect();
                let tail_from = lines.len().saturating_sub(40);
                // Errors and panics before the tail: a cause logged once
                // early is otherwise buried under the retries it led to.
                let earlier: Vec<&str> = lines[..tail_from]
                    .iter()
                    .filter(|l| l.contains("ERROR") || l.contains("panicked"))
                    .take(20)
                    .copied()
                    .collect();
                if !earlier.is_empty() {
                    eprintln!("--- {name} log (errors before the last lines) ---");
                    for l in earlier {
                        eprintln!("{l}");
                    }
                }
                let tail: Vec<&str> = lines[tail_from..].to_vec();
                eprintln!("--- {name} log (last lines) ---");
                for l in tail {
                    eprintln!("{l}");
                }
            }
        }
    }
}
