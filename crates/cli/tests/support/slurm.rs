//! What the tests that drive the real Slurm cluster share: finding the
//! cluster `scripts/slurm-cluster start` left running, reading and
//! cancelling its jobs, and reading an instance, its log and its metered
//! time back from the server.
//!
//! Each test binary includes this module and uses part of it, hence the
//! `dead_code` allowance.
#![allow(dead_code)]

use std::collections::BTreeMap;

use flotilla_backends::slurm::rest::{Auth, Endpoint, Job, RestClient};
use flotilla_testkit::process::Home;
use serde_json::Value;

/// What `scripts/slurm-cluster` wrote to its `env` file.
pub struct Cluster {
    pub vars: BTreeMap<String, String>,
    rest: RestClient,
    rt: tokio::runtime::Runtime,
}

impl Cluster {
    /// The running cluster, or why there is none.
    pub fn find() -> Result<Self, String> {
        let dir = std::env::var("FLOTILLA_SLURM_DIR")
            .unwrap_or_else(|_| "/var/tmp/flotilla-slurm".to_string());
        let path = format!("{dir}/env");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("{path}: {e} (run scripts/slurm-cluster start)"))?;
        let vars: BTreeMap<String, String> = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        for k in [
            "FLOTILLA_SLURMRESTD",
            "FLOTILLA_SLURM_USER",
            "FLOTILLA_SLURM_TOKEN",
            "FLOTILLA_SLURM_OUTPUT_DIR",
        ] {
            if !vars.contains_key(k) {
                return Err(format!("{path} lacks {k}"));
            }
        }
        let endpoint = Endpoint::parse(&vars["FLOTILLA_SLURMRESTD"]).map_err(|e| e.to_string())?;
        let rest = RestClient::new(
            endpoint,
            Auth::Jwt {
                user: vars["FLOTILLA_SLURM_USER"].clone(),
                token: vars["FLOTILLA_SLURM_TOKEN"].clone(),
            },
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let nodes = rt
            .block_on(rest.nodes())
            .map_err(|e| format!("slurmrestd does not answer: {e}"))?;
        if nodes.len() < 2 {
            return Err(format!("the cluster has {} nodes, 2 needed", nodes.len()));
        }
        Ok(Self { vars, rest, rt })
    }

    /// Every job slurmrestd knows.
    pub fn jobs(&self) -> Vec<Job> {
        self.rt.block_on(self.rest.jobs()).expect("GET /jobs")
    }

    /// The newest Slurm job of an instance (`None` also while slurmrestd
    /// does not answer: callers poll).
    pub fn job_of(&self, instance: &str) -> Option<Job> {
        self.rt
            .block_on(self.rest.jobs())
            .ok()?
            .into_iter()
            .filter(|j| j.name == instance)
            .max_by_key(|j| j.job_id)
    }

    /// Cancels every job Flotilla submitted that still runs: what an
    /// earlier, failed run left, and what this one leaves.
    pub fn cancel_ours(&self) {
        let Ok(jobs) = self.rt.block_on(self.rest.jobs()) else {
            return;
        };
        for j in jobs {
            if j.comment.starts_with("flotilla:")
                && matches!(j.job_state.as_str(), "PENDING" | "RUNNING" | "CONFIGURING")
            {
                let _ = self.rt.block_on(self.rest.cancel(j.job_id));
            }
        }
    }
}

/// Cancels this run's Slurm jobs however the test ends: they live in the
/// cluster, outside the test's processes.
/// `None`: no cluster, nothing to cancel.
pub struct CancelOnDrop<'a>(pub Option<&'a Cluster>);

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.0 {
            c.cancel_ours();
        }
    }
}

pub fn instance(env: &Home, key: &str, id: &str) -> Value {
    env.get(key, &format!("/v1/instances/{id}"))
}

pub fn log_lines(env: &Home, key: &str, id: &str) -> Vec<String> {
    env.get(key, &format!("/v1/instances/{id}/logs"))["items"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|l| l["line"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

pub fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// What Flotilla bills a Slurm job, in milliseconds: Slurm's record in
/// whole seconds, `end_time - start_time`, at least one second for a job
/// that ran (docs/billing.md, sources of truth per executor).
pub fn billed_ms_by_the_rule(job: &Job) -> i64 {
    (job.end_time - job.start_time).max(1) * 1000
}

/// A time of the API (RFC 3339) in Unix milliseconds; `None` when absent.
pub fn unix_ms(v: &Value) -> Option<i64> {
    chrono::DateTime::parse_from_rfc3339(v.as_str()?)
        .ok()
        .map(|d| d.timestamp_millis())
}

/// Milliseconds of `instance_seconds` usage metered for `id`.
pub fn metered_ms(env: &Home, key: &str, id: &str) -> i64 {
    let mut total = 0;
    let mut cursor: Option<String> = None;
    loop {
        let mut path =
            "/v1/usage?from=2000-01-01T00:00:00Z&to=2100-01-01T00:00:00Z&limit=1000".to_string();
        if let Some(c) = &cursor {
            path.push_str(&format!("&cursor={c}"));
        }
        let page = env.get(key, &path);
        for e in page["items"].as_array().into_iter().flatten() {
            if e["subject"]["id"] != id || !e["meter"].to_string().contains("instance_seconds") {
                continue;
            }
            let t = |f: &str| unix_ms(&e[f]).unwrap_or(0);
            total += t("end") - t("start");
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => return total,
        }
    }
}

/// Seconds of `instance_seconds` usage metered for `id`.
pub fn metered_secs(env: &Home, key: &str, id: &str) -> f64 {
    metered_ms(env, key, id) as f64 / 1000.0
}
