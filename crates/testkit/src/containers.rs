//! A container engine for the tests that run the real binary with
//! `--runtime container`: Podman's Docker-compatible service, installed and
//! started by `scripts/podman-service`, with the busybox test image that
//! script imports (no registry is reachable from CI).
//!
//! As root (CI) an engine that cannot start fails the test; as an ordinary
//! user without a running service the test is skipped with a message.

use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;

/// Where the engine answers and the image the tests run.
#[derive(Debug, Clone)]
pub struct Engine {
    /// `unix:///…/podman.sock`, for `--docker-host`.
    pub docker_host: String,
    /// The local busybox image (sh, httpd, nc, wget).
    pub image: String,
}

impl Engine {
    /// The socket's path.
    pub fn socket(&self) -> &str {
        self.docker_host
            .strip_prefix("unix://")
            .unwrap_or(&self.docker_host)
    }

    /// A Docker API call through the socket, by `curl` (independent of
    /// the runtime under test); the answer as JSON (`Null` when empty).
    pub fn api(&self, method: &str, path: &str) -> Value {
        let out = Command::new("curl")
            .args(["-sS", "--max-time", "60", "-X", method, "--unix-socket"])
            .arg(self.socket())
            .arg(format!("http://d{path}"))
            .output()
            .expect("run curl");
        assert!(
            out.status.success(),
            "{method} {path}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if out.stdout.iter().all(u8::is_ascii_whitespace) {
            return Value::Null;
        }
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "{method} {path}: {e}: {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }

    /// Every container (running or not) that `node`'s agent made, as the
    /// engine lists them.
    pub fn containers_of(&self, node: &str) -> Vec<Value> {
        let filters = format!(r#"{{"label":["flotilla.node={node}"]}}"#);
        let path = format!("/containers/json?all=true&filters={}", percent(&filters));
        self.api("GET", &path)
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Removes `node`'s containers, running or not.
    pub fn remove_containers_of(&self, node: &str) {
        for c in self.containers_of(node) {
            if let Some(id) = c["Id"].as_str() {
                let _ = self.api("DELETE", &format!("/containers/{id}?force=true&v=true"));
            }
        }
    }

    /// A guard that removes `node`'s containers when dropped (a test's
    /// containers outlive its processes: they belong to the engine).
    pub fn sweep_on_drop(&self, node: &str) -> Sweep {
        Sweep {
            engine: self.clone(),
            node: node.to_string(),
        }
    }
}

/// Removes a node's containers when dropped; see [`Engine::sweep_on_drop`].
#[derive(Debug)]
pub struct Sweep {
    engine: Engine,
    node: String,
}

impl Drop for Sweep {
    fn drop(&mut self) {
        self.engine.remove_containers_of(&self.node);
    }
}

fn percent(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}

/// The engine, or `None` (skip, with a message) where it cannot run: no
/// root to install or start it and no service already running.
pub fn engine() -> Option<&'static Engine> {
    static ENGINE: OnceLock<Option<Engine>> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/podman-service");
            let out = Command::new(script)
                .arg("--env")
                .output()
                .expect("run scripts/podman-service");
            if !out.status.success() {
                let stderr = String::from_utf8_lossy(&out.stderr);
                if out.status.code() == Some(3) && !is_root() {
                    eprintln!("skipping container tests: {stderr}");
                    return None;
                }
                panic!("scripts/podman-service failed ({}): {stderr}", out.status);
            }
            let text = String::from_utf8_lossy(&out.stdout);
            let get = |k: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(&format!("export {k}='")))
                    .map(|v| v.trim_end_matches('\'').to_string())
                    .unwrap_or_else(|| panic!("no {k} in {text}"))
            };
            Some(Engine {
                docker_host: get("DOCKER_HOST"),
                image: get("FLOTILLA_TEST_IMAGE"),
            })
        })
        .as_ref()
}

#[cfg(test)]
mod tests {
    #[test]
    fn filters_are_percent_encoded() {
        assert_eq!(
            super::percent(r#"{"label":["a=b"]}"#),
            "%7B%22label%22%3A%5B%22a%3Db%22%5D%7D"
        );
    }
}
