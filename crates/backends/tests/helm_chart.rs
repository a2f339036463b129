//! Offline checks of `deploy/` (no `helm` binary on the build machines):
//! every chart template is YAML once its template actions are blanked out;
//! the executor's ClusterRole grants every API call the executor makes;
//! the values' executor config is a valid `KubeConfig`; the server reads
//! its database URL from a Secret and runs as non-root; the Dockerfile
//! builds locked and runs as non-root. When `helm` is on `PATH` the chart
//! is also linted and rendered with it.

#![cfg(feature = "kubernetes")]

use std::path::{Path, PathBuf};

use flotilla_backends::kube::KubeConfig;
use serde_json::Value;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

fn chart() -> PathBuf {
    deploy().join("helm/flotilla")
}

/// The template with each line that is only a template action removed
/// and each inline action replaced by a plain scalar: what is left must
/// be the YAML the chart renders, minus the values.
fn blank_actions(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with("{{") && t.ends_with("}}") && t.matches("{{").count() == 1 {
            continue;
        }
        let mut rest = line;
        let mut blanked = String::new();
        while let Some(start) = rest.find("{{") {
            blanked.push_str(&rest[..start]);
            let end = rest[start..]
                .find("}}")
                .map(|e| start + e + 2)
                .unwrap_or(rest.len());
            blanked.push_str("TEMPLATED");
            rest = &rest[end..];
        }
        blanked.push_str(rest);
        out.push_str(&blanked);
        out.push('\n');
    }
    out
}

fn templates() -> Vec<(String, Vec<Value>)> {
    let mut out = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(chart().join("templates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    entries.sort();
    for path in entries {
        let text = std::fs::read_to_string(&path).unwrap();
        let docs: Vec<Value> = serde_saphyr::from_multiple(&blank_actions(&text))
            .unwrap_or_else(|e| panic!("{} is not YAML once rendered: {e}", path.display()));
        out.push((
            path.file_name().unwrap().to_string_lossy().into_owned(),
            docs,
        ));
    }
    out
}

#[test]
fn every_template_is_a_kubernetes_object() {
    let all = templates();
    assert!(
        all.len() >= 7,
        "{:?}",
        all.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    for (name, docs) in &all {
        assert!(!docs.is_empty(), "{name}");
        for d in docs {
            assert!(d["apiVersion"].is_string(), "{name}: apiVersion");
            assert!(d["kind"].is_string(), "{name}: kind");
            assert!(!d["metadata"]["name"].is_null(), "{name}: metadata.name");
        }
    }
    let kinds: Vec<&str> = all
        .iter()
        .flat_map(|(_, d)| d.iter().filter_map(|d| d["kind"].as_str()))
        .collect();
    for k in [
        "Deployment",
        "Service",
        "ConfigMap",
        "Secret",
        "ClusterRole",
        "ClusterRoleBinding",
        "ServiceAccount",
    ] {
        assert!(kinds.contains(&k), "no {k} in the chart: {kinds:?}");
    }
}

#[test]
fn the_executor_role_allows_every_call_the_executor_makes() {
    let all = templates();
    let role = all
        .iter()
        .flat_map(|(_, d)| d.iter())
        .find(|d| d["kind"] == "ClusterRole")
        .expect("a ClusterRole");
    let rules = role["rules"].as_array().unwrap();
    let allows = |group: &str, resource: &str, verb: &str| {
        rules.iter().any(|r| {
            let has = |key: &str, v: &str| {
                r[key]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|x| x == v || x == "*"))
            };
            has("apiGroups", group) && has("resources", resource) && has("verbs", verb)
        })
    };
    // What `KubeExecutor` calls: inventory (list nodes), the pod watch
    // (list + watch pods in all namespaces), create/delete pods, logs,
    // server-side apply (patch) of namespace, quota, policy and pull
    // secrets, and deleting pull secrets.
    for (group, resource, verb) in [
        ("", "nodes", "list"),
        ("", "pods", "list"),
        ("", "pods", "watch"),
        ("", "pods", "create"),
        ("", "pods", "delete"),
        ("", "pods/log", "get"),
        ("", "namespaces", "patch"),
        ("", "resourcequotas", "patch"),
        ("networking.k8s.io", "networkpolicies", "patch"),
        ("", "secrets", "patch"),
        ("", "secrets", "delete"),
    ] {
        assert!(
            allows(group, resource, verb),
            "the role lacks {verb} {group}/{resource}"
        );
    }
    // And nothing wider than that: no wildcard, no escalation verbs.
    for r in rules {
        for key in ["apiGroups", "resources", "verbs"] {
            assert!(!r[key].as_array().unwrap().iter().any(|x| x == "*"), "{r}");
        }
        for bad in ["escalate", "bind", "impersonate"] {
            assert!(
                !r["verbs"].as_array().unwrap().iter().any(|x| x == bad),
                "{r}"
            );
        }
    }
}

#[test]
fn the_server_reads_its_database_url_from_a_secret_and_runs_unprivileged() {
    let all = templates();
    let server = all
        .iter()
        .find(|(n, _)| n == "deployment.yaml")
        .map(|(_, d)| &d[0])
        .unwrap();
    let c = &server["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["args"][0], "server");
    let env = c["env"].as_array().unwrap();
    let db = env
        .iter()
        .find(|e| e["name"] == "FLOTILLA_DATABASE_URL")
        .unwrap();
    assert!(db["value"].is_null(), "never in clear");
    assert!(db["valueFrom"]["secretKeyRef"].is_object());
    let key = env
        .iter()
        .find(|e| e["name"] == "FLOTILLA_SECRETS_KEY")
        .unwrap();
    assert!(key["value"].is_null() && key["valueFrom"]["secretKeyRef"].is_object());
    let mounts = c["volumeMounts"].as_array().unwrap();
    assert!(
        mounts.iter().any(|m| m["mountPath"] == "/tmp"),
        "a writable /tmp on a read-only root"
    );

    let values: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(chart().join("values.yaml")).unwrap())
            .unwrap();
    assert_eq!(values["podSecurityContext"]["runAsNonRoot"], true);
    assert_eq!(values["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(values["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(
        values["database"]["url"], "",
        "no credentials in the chart's defaults"
    );
}

#[test]
fn the_values_executor_config_is_a_kube_config() {
    let values: Value =
        serde_saphyr::from_str(&std::fs::read_to_string(chart().join("values.yaml")).unwrap())
            .unwrap();
    let config: KubeConfig =
        serde_json::from_value(values["executor"]["kubernetes"]["config"].clone())
            .expect("executor.kubernetes.config must deserialize as KubeConfig");
    assert_eq!(
        config.node_selector.as_deref(),
        Some("nvidia.com/gpu.present=true")
    );
    assert_eq!(config.tenant_quota["requests.nvidia.com/gpu"], "64");
    // An unknown key is refused, so a typo in values fails loudly.
    let mut bad = values["executor"]["kubernetes"]["config"].clone();
    bad["pool_lable"] = Value::String("x".into());
    assert!(serde_json::from_value::<KubeConfig>(bad).is_err());
}

#[test]
fn the_dockerfile_builds_locked_and_runs_the_server_unprivileged() {
    let d = std::fs::read_to_string(deploy().join("Dockerfile")).unwrap();
    assert!(d.contains("cargo build --release --locked"));
    assert!(d.contains("FROM debian:bookworm-slim"));
    assert!(d.contains("USER 10001"));
    assert!(d.contains(r#"CMD ["server", "--bind", "0.0.0.0:7420"]"#));
    // Multi-stage: the runtime copies only the binary.
    assert_eq!(
        d.matches("\nFROM ").count() + usize::from(d.starts_with("FROM ")),
        2
    );
}

#[test]
fn helm_lints_and_renders_the_chart_when_it_is_installed() {
    let Ok(out) = std::process::Command::new("helm").arg("version").output() else {
        eprintln!(
            "helm is not installed: lint and render skipped (the YAML checks above still ran)"
        );
        return;
    };
    assert!(out.status.success());
    let set = [
        "--set",
        "database.url=postgres://flotilla@db/flotilla",
        "--set",
        "executor.kubernetes.enabled=true",
        "--set",
        "executor.kubernetes.tokenSecret=flotilla-agent-token",
    ];
    let lint = std::process::Command::new("helm")
        .arg("lint")
        .arg(chart())
        .args(set)
        .output()
        .unwrap();
    assert!(
        lint.status.success(),
        "{}",
        String::from_utf8_lossy(&lint.stdout)
    );
    let rendered = std::process::Command::new("helm")
        .args(["template", "flotilla"])
        .arg(chart())
        .args(set)
        .output()
        .unwrap();
    assert!(
        rendered.status.success(),
        "{}",
        String::from_utf8_lossy(&rendered.stderr)
    );
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&String::from_utf8_lossy(&rendered.stdout)).unwrap();
    assert!(docs.iter().any(|d| d["kind"] == "ClusterRole"));
}
