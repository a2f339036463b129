//! A real Prometheus (the Debian package's `prometheus` and `promtool`)
//! scrapes a real `flotilla server` and `flotilla agent`, started by this
//! test on free ports with a generated configuration that loads
//! `deploy/prometheus/flotilla-rules.yml`:
//!
//! - PromQL through Prometheus' HTTP API returns the series Flotilla
//!   exports with their labels (DCGM names from the agent's readings, the
//!   fleet's gauges, the control plane's histograms and counters);
//! - `promtool check rules` passes on the alert rules, and Prometheus
//!   loads them;
//! - every query of every dashboard in `deploy/grafana/` returns data.
//!
//! Without `prometheus` on the PATH the test says so and passes, unless
//! `FLOTILLA_REQUIRE_PROMETHEUS=1` (CI installs the package and sets it).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use flotilla_testkit::process::{free_port, http, wait_until, Home, Proc};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_flotilla");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `GET /api/v1/query?query=Q` on Prometheus: the result vector.
fn query(prom: &str, q: &str) -> Vec<Value> {
    let enc: String = q
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect();
    let (status, body) = http(
        "GET",
        &format!("{prom}/api/v1/query?query={enc}"),
        None,
        None,
    )
    .expect("prometheus answers");
    assert_eq!(status, 200, "query `{q}`: {body}");
    assert_eq!(body["status"], "success", "query `{q}`: {body}");
    body["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Whether a sample's value is a number (not NaN: a quantile over a
/// histogram with no new observations in its window is NaN).
fn finite(sample: &Value) -> bool {
    sample["value"][1]
        .as_str()
        .and_then(|v| v.parse::<f64>().ok())
        .is_some_and(f64::is_finite)
}

fn usage(endpoint: &str, n: u32, ms: i64) -> Value {
    let now = chrono::Utc::now();
    let requests: Vec<Value> = (0..n)
        .map(|_| {
            json!({
                "request_id": format!("req_{}", ulid_like()),
                "endpoint_id": endpoint,
                // Served by a replica: billed, so the ledger ingests it.
                "instance_id": "inst_01J00000000000000000000000",
                "started_at": now - chrono::Duration::milliseconds(ms),
                "finished_at": now,
                "status": 200, "input_tokens": 0, "output_tokens": 0
            })
        })
        .collect();
    json!({ "requests": requests })
}

/// A fresh 26-character Crockford base32 id body.
fn ulid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let t = chrono::Utc::now().timestamp_nanos_opt().unwrap_or(0) as u64;
    const A: &[u8] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
    let mut v = (u128::from(t) << 64) | u128::from(n);
    let mut s = vec![b'0'; 26];
    for c in s.iter_mut().rev() {
        *c = A[(v % 32) as usize];
        v /= 32;
    }
    s[0] = b'0';
    String::from_utf8(s).unwrap()
}

#[test]
fn prometheus_scrapes_server_and_agent_and_every_dashboard_query_has_data() {
    if !have("prometheus") || !have("promtool") {
        assert!(
            std::env::var("FLOTILLA_REQUIRE_PROMETHEUS").as_deref() != Ok("1"),
            "FLOTILLA_REQUIRE_PROMETHEUS=1 but `prometheus` or `promtool` is not on the PATH \
             (apt-get install prometheus)"
        );
        eprintln!(
            "skipped: `prometheus` and `promtool` are not installed (Debian package `prometheus`); \
             set FLOTILLA_REQUIRE_PROMETHEUS=1 to fail instead"
        );
        return;
    }
    let rules = repo().join("deploy/prometheus/flotilla-rules.yml");
    let check = Command::new("promtool")
        .arg("check")
        .arg("rules")
        .arg(&rules)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );

    let env = Home::new(BIN);
    let _server = env.server();
    let op = env.operator_key();
    let readings = env.dir.path().join("readings.json");
    // GPU 0 busy and warm; GPU 1 raised XID 79 (the server takes it out).
    std::fs::write(
        &readings,
        r#"{"0": {"gpu_util_pct": 40, "fb_used_mib": 2048, "temperature_c": 61, "power_w": 180.5, "sm_clock_mhz": 1755},
            "1": {"gpu_util_pct": 0, "temperature_c": 48, "last_xid": 79}}"#,
    )
    .unwrap();
    let agent_port = free_port();
    let _agent = env.agent_with(
        "prom-node",
        "2xH100",
        &env.url(),
        &[
            "--simulated-telemetry",
            readings.to_str().unwrap(),
            "--metrics-bind",
            &format!("127.0.0.1:{agent_port}"),
        ],
    );
    let (tenant, key) = env.tenant("prom");
    let provider = std::fs::read_to_string(env.data().join("agent.token"))
        .unwrap()
        .trim()
        .to_string();
    let (status, ep) = http(
        "POST",
        &format!("{}/v1/endpoints", env.url()),
        Some(&key),
        Some(&json!({"name": "chat", "command": ["sleep", "600"], "min_replicas": 0}).to_string()),
    )
    .unwrap();
    assert!(
        status == 201 || status == 200,
        "create endpoint: {status} {ep}"
    );
    let endpoint = ep["id"].as_str().unwrap().to_string();

    // Prometheus, on a free port, scraping both every second.
    let dir = env.dir.path().join("prometheus");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("operator-key"), &op).unwrap();
    std::fs::copy(&rules, dir.join("flotilla-rules.yml")).unwrap();
    let server_target = env.url().trim_start_matches("http://").to_string();
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
         rule_files:\n  - flotilla-rules.yml\n\
         scrape_configs:\n\
         \x20 - job_name: flotilla-server\n\
         \x20   authorization:\n      type: Bearer\n      credentials_file: {key}\n\
         \x20   static_configs:\n      - targets: [\"{server_target}\"]\n\
         \x20 - job_name: flotilla-agent\n\
         \x20   static_configs:\n      - targets: [\"127.0.0.1:{agent_port}\"]\n",
        key = dir.join("operator-key").display(),
    );
    std::fs::write(dir.join("prometheus.yml"), &config).unwrap();
    let check = Command::new("promtool")
        .arg("check")
        .arg("config")
        .arg(dir.join("prometheus.yml"))
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "promtool check config: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let port = free_port();
    let prom = format!("http://127.0.0.1:{port}");
    let _prometheus = Proc(
        Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(env.log("prometheus"))
            .stderr(env.log("prometheus"))
            .spawn()
            .expect("start prometheus"),
    );
    wait_until("prometheus is ready", Duration::from_secs(60), || {
        http("GET", &format!("{prom}/-/ready"), None, None).is_ok_and(|(s, _)| s == 200)
    });
    wait_until("both targets are up", Duration::from_secs(60), || {
        let up = query(&prom, "up == 1");
        up.len() == 2
    });

    // Activity while Prometheus watches, so rates and quantiles have data:
    // work is placed (and metered), the gateway reports requests in two
    // batches a few scrapes apart.
    let post_usage = |n, ms| {
        let (status, body) = http(
            "POST",
            &format!("{}/v1/gateway/usage", env.url()),
            Some(&provider),
            Some(&usage(&endpoint, n, ms).to_string()),
        )
        .unwrap();
        assert_eq!(status, 200, "{body}");
    };
    post_usage(3, 120);
    std::thread::sleep(Duration::from_secs(3));
    let inst = env.run_detached(&key, &["--gpus", "1", "--", "sleep", "600"]);
    wait_until("the instance runs", Duration::from_secs(30), || {
        env.get(&key, &format!("/v1/instances/{inst}"))["state"] == "running"
    });
    let queued = env.run_detached(&key, &["--gpus", "1", "--", "sleep", "600"]);
    post_usage(5, 900);

    // Expected series and labels.
    wait_until(
        "the agent's readings reach Prometheus",
        Duration::from_secs(60),
        || {
            !query(
                &prom,
                r#"DCGM_FI_DEV_GPU_UTIL{job="flotilla-agent",gpu="0"}"#,
            )
            .is_empty()
        },
    );
    let util = query(
        &prom,
        r#"DCGM_FI_DEV_GPU_UTIL{job="flotilla-agent",gpu="0"}"#,
    );
    let m = &util[0]["metric"];
    assert_eq!(m["Hostname"], "prom-node", "{m}");
    assert_eq!(m["modelName"], "Simulated H100", "{m}");
    assert_eq!(m["device"], "nvidia0", "{m}");
    assert!(m["UUID"].as_str().is_some_and(|u| !u.is_empty()), "{m}");
    assert_eq!(util[0]["value"][1], "40");
    wait_until(
        "the server exports the running instance's GPU",
        Duration::from_secs(60),
        || {
            query(
                &prom,
                &format!(r#"DCGM_FI_DEV_GPU_UTIL{{job="flotilla-server",instance_id="{inst}"}}"#),
            )
            .len()
                == 1
        },
    );
    wait_until("GPU 1 is faulty", Duration::from_secs(60), || {
        query(
            &prom,
            r#"flotilla_gpu_faulty{gpu="1",reason="xid error 79"}"#,
        )
        .len()
            == 1
    });
    assert_eq!(
        query(&prom, r#"flotilla_gpus{model="H100",state="faulty"}"#)[0]["value"][1],
        "1"
    );
    assert_eq!(query(&prom, "flotilla_leader")[0]["value"][1], "1");
    wait_until(
        "the second instance waits in the queue",
        Duration::from_secs(60),
        || query(&prom, r#"flotilla_queue_depth{kind="instance"} == 1"#).len() == 1,
    );
    let _ = queued;
    assert_eq!(
        query(
            &prom,
            &format!(r#"flotilla_tenant_instances{{tenant_id="{tenant}",state="running"}}"#)
        )[0]["value"][1],
        "1"
    );
    // The alert on XID errors fires from the agent's and the server's series.
    wait_until("the XID alert fires", Duration::from_secs(60), || {
        !query(
            &prom,
            r#"ALERTS{alertname="FlotillaGpuXidOrEccErrors",alertstate="firing"}"#,
        )
        .is_empty()
    });
    let (_, loaded) = http("GET", &format!("{prom}/api/v1/rules"), None, None).unwrap();
    let groups = loaded["data"]["groups"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(groups.len(), 3, "the three rule groups load: {loaded}");

    // Every dashboard query returns data (template variables as "All").
    let mut checked = 0;
    for name in ["fleet", "tenant", "endpoint"] {
        let path = repo().join(format!("deploy/grafana/flotilla-{name}.json"));
        let dash: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for panel in dash["panels"].as_array().unwrap() {
            for target in panel["targets"].as_array().unwrap() {
                let expr = target["expr"]
                    .as_str()
                    .unwrap()
                    .replace("$tenant", ".*")
                    .replace("$endpoint", ".*");
                let mut result = Vec::new();
                wait_until(
                    &format!("{name} / {}: `{expr}` has data", panel["title"]),
                    Duration::from_secs(60),
                    || {
                        result = query(&prom, &expr);
                        result.iter().any(finite)
                    },
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 26, "every dashboard query was checked");
    // The variables' own queries list values too.
    for (metric, label) in [
        ("flotilla_tenant_instances", "tenant_id"),
        ("flotilla_endpoint_desired_replicas", "endpoint"),
    ] {
        let (_, v) = http(
            "GET",
            &format!("{prom}/api/v1/label/{label}/values?match[]={metric}"),
            None,
            None,
        )
        .unwrap();
        assert!(
            v["data"].as_array().is_some_and(|a| !a.is_empty()),
            "{metric} {label}: {v}"
        );
    }
}
