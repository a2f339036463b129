//! A client of `slurmrestd`'s OpenAPI plugin `v0.0.38` (Slurm 22.05): the
//! few calls the executor needs and the parts of their bodies it reads.
//!
//! The transport is plain HTTP/1.1 over TCP or a unix socket (hyper, one
//! connection per call: slurmrestd closes idle connections anyway, and a
//! unix socket is what `rest_auth/local` needs). Authentication is either
//! none (`rest_auth/local`: slurmrestd trusts the socket peer's uid) or a
//! JWT (`rest_auth/jwt`, `X-SLURM-USER-NAME` and `X-SLURM-USER-TOKEN`).
//!
//! This module only speaks the protocol: it never decides what a job
//! state means for Flotilla ([`super::state`] does).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use flotilla_core::node::ExecutorKind;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};

use crate::ExecutorError;

/// The OpenAPI plugin this client speaks (Debian 12's slurmrestd serves
/// v0.0.36 to v0.0.38; v0.0.38 is the newest there).
pub const API: &str = "/slurm/v0.0.38";

/// Longest one call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Where slurmrestd listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `http://host:port`.
    Tcp {
        /// `host:port`, as connected to and sent in `Host`.
        authority: String,
    },
    /// `unix:/path/to/socket`.
    Unix {
        /// The socket.
        path: PathBuf,
    },
}

impl Endpoint {
    /// Parses `http://host:port[/]` or `unix:/path`.
    pub fn parse(s: &str) -> Result<Self, ExecutorError> {
        let s = s.trim();
        if let Some(path) = s.strip_prefix("unix:") {
            let path = path.trim_start_matches("//");
            if !path.starts_with('/') {
                return Err(refused(format!(
                    "slurmrestd address `{s}`: a unix socket needs an absolute path (unix:/run/slurmrestd.socket)"
                )));
            }
            return Ok(Endpoint::Unix { path: path.into() });
        }
        let Some(rest) = s.strip_prefix("http://") else {
            return Err(refused(format!(
                "slurmrestd address `{s}`: expected http://host:port or unix:/path"
            )));
        };
        let authority = rest.trim_end_matches('/');
        if authority.is_empty() || authority.contains('/') {
            return Err(refused(format!(
                "slurmrestd address `{s}`: expected http://host:port (no path)"
            )));
        }
        Ok(Endpoint::Tcp {
            authority: authority.to_string(),
        })
    }
}

/// How calls authenticate.
#[derive(Clone, Default)]
pub enum Auth {
    /// None: `rest_auth/local` over a unix socket.
    #[default]
    Local,
    /// `rest_auth/jwt`: a token from `scontrol token` for `user`.
    Jwt {
        /// The Slurm user jobs are submitted as.
        user: String,
        /// The token.
        token: String,
    },
}

impl std::fmt::Debug for Auth {
    /// Never prints the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Auth::Local => f.write_str("Local"),
            Auth::Jwt { user, .. } => f
                .debug_struct("Jwt")
                .field("user", user)
                .field("token", &"<redacted>")
                .finish(),
        }
    }
}

fn refused(message: String) -> ExecutorError {
    ExecutorError::Refused {
        engine: ExecutorKind::Slurm,
        message,
    }
}

fn unavailable(message: String) -> ExecutorError {
    ExecutorError::Unavailable {
        engine: ExecutorKind::Slurm,
        message,
    }
}

fn protocol(message: String) -> ExecutorError {
    ExecutorError::Protocol {
        engine: ExecutorKind::Slurm,
        message,
    }
}

/// One error slurmrestd reports in a body's `errors` list.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ApiError {
    /// What failed.
    #[serde(default)]
    pub error: String,
    /// Slurm's error number, when given.
    #[serde(default)]
    pub error_number: Option<i64>,
    /// Slurm's error code, when given.
    #[serde(default)]
    pub error_code: Option<i64>,
    /// More detail, when given.
    #[serde(default)]
    pub description: Option<String>,
}

impl ApiError {
    fn text(&self) -> String {
        match &self.description {
            Some(d) if !d.is_empty() => format!("{}: {d}", self.error),
            _ => self.error.clone(),
        }
    }
}

fn errors_text(errors: &[ApiError]) -> String {
    errors
        .iter()
        .map(ApiError::text)
        .collect::<Vec<_>>()
        .join("; ")
}

/// `GET /nodes`.
#[derive(Debug, Clone, Deserialize)]
pub struct NodesResponse {
    /// Errors, empty on success.
    #[serde(default)]
    pub errors: Vec<ApiError>,
    /// The nodes.
    #[serde(default)]
    pub nodes: Vec<Node>,
}

/// One node as slurmrestd reports it.
#[derive(Debug, Clone, Deserialize)]
pub struct Node {
    /// Slurm's node name.
    pub name: String,
    /// Base state, lowercase (`idle`, `mixed`, `allocated`, `down`, …).
    #[serde(default)]
    pub state: String,
    /// State flags (`DRAIN`, `NOT_RESPONDING`, …).
    #[serde(default)]
    pub state_flags: Vec<String>,
    /// CPUs.
    #[serde(default)]
    pub cpus: u64,
    /// Memory, MiB.
    #[serde(default)]
    pub real_memory: u64,
    /// Generic resources, `gpu:h100:2,gpu:a100:1(S:0)`.
    #[serde(default)]
    pub gres: String,
    /// Partitions it belongs to.
    #[serde(default)]
    pub partitions: Vec<String>,
}

/// `GET /partitions`.
#[derive(Debug, Clone, Deserialize)]
pub struct PartitionsResponse {
    /// Errors, empty on success.
    #[serde(default)]
    pub errors: Vec<ApiError>,
    /// The partitions.
    #[serde(default)]
    pub partitions: Vec<Partition>,
}

/// One partition.
#[derive(Debug, Clone, Deserialize)]
pub struct Partition {
    /// Its name.
    pub name: String,
    /// Its nodes as a host list expression (`flotilla-n[1-2]`).
    #[serde(default)]
    pub nodes: String,
}

/// `GET /jobs`.
#[derive(Debug, Clone, Deserialize)]
pub struct JobsResponse {
    /// Errors, empty on success.
    #[serde(default)]
    pub errors: Vec<ApiError>,
    /// The jobs slurmctld still knows (finished ones for `MinJobAge`).
    #[serde(default)]
    pub jobs: Vec<Job>,
}

/// One job as slurmrestd reports it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Job {
    /// Job id.
    pub job_id: u64,
    /// Job name (the executor names a job after its instance).
    #[serde(default)]
    pub name: String,
    /// Comment (the executor writes `flotilla:<node>` there).
    #[serde(default)]
    pub comment: String,
    /// State, uppercase (`PENDING`, `RUNNING`, `COMPLETED`, …).
    #[serde(default)]
    pub job_state: String,
    /// The batch script's wait status (`exit << 8`, or the signal).
    #[serde(default)]
    pub exit_code: Option<i64>,
    /// Submission, Unix seconds.
    #[serde(default)]
    pub submit_time: i64,
    /// Start, Unix seconds (0: not started).
    #[serde(default)]
    pub start_time: i64,
    /// End, Unix seconds; while it runs, the end its time limit allows.
    #[serde(default)]
    pub end_time: i64,
    /// The nodes it runs on.
    #[serde(default)]
    pub nodes: String,
    /// Why it waits or ended (`Resources`, `None`, …).
    #[serde(default)]
    pub state_reason: String,
    /// Where its output goes.
    #[serde(default)]
    pub standard_output: String,
}

/// `POST /job/submit`.
#[derive(Debug, Clone, Serialize)]
pub struct Submission {
    /// The batch script.
    pub script: String,
    /// Its options (sbatch's, by their long names).
    pub job: JobProperties,
}

/// The sbatch options the executor sets.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct JobProperties {
    /// `--job-name`.
    pub name: String,
    /// `--comment`.
    pub comment: String,
    /// `--partition`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partition: Option<String>,
    /// `--nodelist`: the one node Flotilla placed it on.
    pub nodelist: String,
    /// `--nodes`.
    pub nodes: String,
    /// `--ntasks`.
    pub tasks: u32,
    /// `--cpus-per-task`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpus_per_task: Option<u32>,
    /// `--mem`, MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_per_node: Option<u64>,
    /// `--gres`, `gpu:N`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gres: Option<String>,
    /// The job's whole environment (slurmrestd requires one).
    pub environment: BTreeMap<String, String>,
    /// `--chdir`.
    pub current_working_directory: String,
    /// `--output`: stdout and stderr both.
    pub standard_output: String,
    /// `--no-requeue`: Flotilla decides where failed work runs again, and
    /// a job must never run twice. (`"requeue": false` is accepted by
    /// v0.0.38 but leaves the job requeueable.)
    pub no_requeue: bool,
}

/// The answer to a submission.
#[derive(Debug, Clone, Deserialize)]
pub struct SubmitResponse {
    /// Errors, empty on success.
    #[serde(default)]
    pub errors: Vec<ApiError>,
    /// The new job's id.
    #[serde(default)]
    pub job_id: Option<u64>,
}

/// A body with only `errors` (the answer to a cancel).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ErrorsOnly {
    /// Errors, empty on success.
    #[serde(default)]
    pub errors: Vec<ApiError>,
}

/// A client of one slurmrestd.
#[derive(Debug, Clone)]
pub struct RestClient {
    endpoint: Endpoint,
    auth: Auth,
}

impl RestClient {
    /// A client of `endpoint` authenticating with `auth`.
    pub fn new(endpoint: Endpoint, auth: Auth) -> Self {
        Self { endpoint, auth }
    }

    /// The user jobs run as, when known (JWT).
    pub fn user(&self) -> Option<&str> {
        match &self.auth {
            Auth::Jwt { user, .. } => Some(user),
            Auth::Local => None,
        }
    }

    /// `GET /nodes`.
    pub async fn nodes(&self) -> Result<Vec<Node>, ExecutorError> {
        let r: NodesResponse = self.call("GET", &format!("{API}/nodes"), None).await?;
        ok(&r.errors, "listing nodes")?;
        Ok(r.nodes)
    }

    /// `GET /partitions`.
    pub async fn partitions(&self) -> Result<Vec<Partition>, ExecutorError> {
        let r: PartitionsResponse = self.call("GET", &format!("{API}/partitions"), None).await?;
        ok(&r.errors, "listing partitions")?;
        Ok(r.partitions)
    }

    /// `GET /jobs`.
    pub async fn jobs(&self) -> Result<Vec<Job>, ExecutorError> {
        let r: JobsResponse = self.call("GET", &format!("{API}/jobs"), None).await?;
        ok(&r.errors, "listing jobs")?;
        Ok(r.jobs)
    }

    /// `POST /job/submit`: the new job's id.
    pub async fn submit(&self, submission: &Submission) -> Result<u64, ExecutorError> {
        let body = serde_json::to_vec(submission)
            .map_err(|e| protocol(format!("cannot encode the submission: {e}")))?;
        let r: SubmitResponse = self
            .call("POST", &format!("{API}/job/submit"), Some(body))
            .await?;
        if !r.errors.is_empty() {
            return Err(refused(format!(
                "submission of `{}` refused: {}",
                submission.job.name,
                errors_text(&r.errors)
            )));
        }
        r.job_id
            .ok_or_else(|| protocol("a submission was answered without a job_id".into()))
    }

    /// `DELETE /job/{id}`: cancels the job as `scancel` does (SIGTERM to
    /// every step, SIGKILL after the cluster's `KillWait`). A job that is
    /// already over is not an error.
    pub async fn cancel(&self, job_id: u64) -> Result<(), ExecutorError> {
        match self
            .call::<ErrorsOnly>("DELETE", &format!("{API}/job/{job_id}"), None)
            .await
        {
            Ok(r) if r.errors.is_empty() => Ok(()),
            Ok(r) if already_over(&r.errors) => Ok(()),
            Ok(r) => Err(refused(format!(
                "cancel of job {job_id} refused: {}",
                errors_text(&r.errors)
            ))),
            Err(e) => Err(e),
        }
    }

    async fn call<T: serde::de::DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<T, ExecutorError> {
        let what = format!("{method} {path}");
        let (status, bytes) = tokio::time::timeout(CALL_TIMEOUT, self.send(method, path, body))
            .await
            .map_err(|_| unavailable(format!("{what}: no answer within {CALL_TIMEOUT:?}")))??;
        let parsed: Result<T, _> = serde_json::from_slice(&bytes);
        match status {
            200..=299 => parsed.map_err(|e| protocol(format!("{what}: {e}"))),
            // slurmrestd answers a failed operation with 500 and the
            // reason in the body's `errors`: let the caller read them.
            500 => match parsed {
                Ok(v) => Ok(v),
                Err(_) => Err(unavailable(format!(
                    "{what}: status 500: {}",
                    String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
                ))),
            },
            401 | 403 => Err(refused(format!(
                "{what}: status {status}: authentication refused (check the Slurm user and token)"
            ))),
            s if s >= 500 => Err(unavailable(format!("{what}: status {s}"))),
            s => Err(refused(format!(
                "{what}: status {s}: {}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
            ))),
        }
    }

    async fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(u16, Bytes), ExecutorError> {
        let what = format!("{method} {path}");
        let transport = |e: &dyn std::fmt::Display| unavailable(format!("{what}: {e}"));
        let host = match &self.endpoint {
            Endpoint::Tcp { authority } => authority.clone(),
            Endpoint::Unix { .. } => "localhost".to_string(),
        };
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, host)
            .header(hyper::header::ACCEPT, "application/json");
        if body.is_some() {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        if let Auth::Jwt { user, token } = &self.auth {
            req = req
                .header("X-SLURM-USER-NAME", user)
                .header("X-SLURM-USER-TOKEN", token);
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| protocol(format!("{what}: {e}")))?;
        let resp = match &self.endpoint {
            Endpoint::Tcp { authority } => {
                let stream = tokio::net::TcpStream::connect(authority)
                    .await
                    .map_err(|e| transport(&e))?;
                send_on(TokioIo::new(stream), req)
                    .await
                    .map_err(|e| transport(&e))?
            }
            Endpoint::Unix { path } => {
                let stream = tokio::net::UnixStream::connect(path)
                    .await
                    .map_err(|e| transport(&e))?;
                send_on(TokioIo::new(stream), req)
                    .await
                    .map_err(|e| transport(&e))?
            }
        };
        Ok(resp)
    }
}

async fn send_on<I>(io: I, req: Request<Full<Bytes>>) -> Result<(u16, Bytes), hyper::Error>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    let driver = tokio::spawn(conn);
    let resp = sender.send_request(req).await;
    let out = match resp {
        Ok(resp) => {
            let status = resp.status().as_u16();
            resp.into_body()
                .collect()
                .await
                .map(|b| (status, b.to_bytes()))
        }
        Err(e) => Err(e),
    };
    drop(sender);
    driver.abort();
    out
}

fn ok(errors: &[ApiError], what: &str) -> Result<(), ExecutorError> {
    if errors.is_empty() {
        Ok(())
    } else {
        Err(unavailable(format!("{what}: {}", errors_text(errors))))
    }
}

/// Slurm's "the job is already over" answers to a cancel (invalid job id
/// once purged, already completing or done).
fn already_over(errors: &[ApiError]) -> bool {
    errors.iter().all(|e| {
        let t = e.text().to_ascii_lowercase();
        t.contains("already") || t.contains("completed") || t.contains("invalid job id")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        assert_eq!(
            Endpoint::parse("http://127.0.0.1:6820/").unwrap(),
            Endpoint::Tcp {
                authority: "127.0.0.1:6820".into()
            }
        );
        assert_eq!(
            Endpoint::parse("unix:/run/slurmrestd.socket").unwrap(),
            Endpoint::Unix {
                path: "/run/slurmrestd.socket".into()
            }
        );
        assert_eq!(
            Endpoint::parse("unix:///run/s.sock").unwrap(),
            Endpoint::Unix {
                path: "/run/s.sock".into()
            }
        );
        for bad in ["https://h:1", "h:1", "unix:rel", "http://h:1/slurm"] {
            let e = Endpoint::parse(bad).unwrap_err();
            assert!(!e.is_transient(), "{bad}: {e}");
        }
    }

    #[test]
    fn auth_debug_hides_the_token() {
        let a = Auth::Jwt {
            user: "u".into(),
            token: "secret".into(),
        };
        assert!(!format!("{a:?}").contains("secret"));
    }

    /// Bodies recorded from Debian 12's slurmrestd 22.05.8 (`testdata/`).
    #[test]
    fn recorded_bodies_parse() {
        let nodes: NodesResponse =
            serde_json::from_str(include_str!("testdata/nodes.json")).unwrap();
        assert!(nodes.errors.is_empty());
        assert_eq!(nodes.nodes.len(), 2);
        let n = &nodes.nodes[0];
        assert_eq!(n.name, "flotilla-n1");
        assert_eq!(n.gres, "gpu:h100:2");
        assert_eq!((n.cpus, n.real_memory), (4, 8000));
        assert_eq!(n.partitions, vec!["gpu".to_string()]);
        assert_eq!(n.state, "idle");

        let parts: PartitionsResponse =
            serde_json::from_str(include_str!("testdata/partitions.json")).unwrap();
        assert_eq!(parts.partitions[0].name, "gpu");

        let jobs: JobsResponse = serde_json::from_str(include_str!("testdata/jobs.json")).unwrap();
        assert!(jobs.errors.is_empty());
        assert!(!jobs.jobs.is_empty());
        for j in &jobs.jobs {
            assert!(j.job_id > 0);
            assert!(!j.job_state.is_empty());
        }

        let refused: SubmitResponse =
            serde_json::from_str(include_str!("testdata/submit_refused.json")).unwrap();
        assert_eq!(refused.job_id, None);
        assert!(errors_text(&refused.errors).contains("Disabled key"));
        let ok: SubmitResponse =
            serde_json::from_str(include_str!("testdata/submit.json")).unwrap();
        assert!(ok.errors.is_empty() && ok.job_id.is_some());
    }

    #[test]
    fn submission_uses_sbatch_option_names() {
        let s = Submission {
            script: "#!/bin/sh\n".into(),
            job: JobProperties {
                name: "inst_1".into(),
                comment: "flotilla:n1".into(),
                partition: Some("gpu".into()),
                nodelist: "n1".into(),
                nodes: "1".into(),
                tasks: 1,
                cpus_per_task: None,
                memory_per_node: None,
                gres: Some("gpu:2".into()),
                environment: BTreeMap::from([("PATH".into(), "/bin".into())]),
                current_working_directory: "/tmp".into(),
                standard_output: "/out/inst_1.log".into(),
                no_requeue: true,
            },
        };
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["job"]["nodelist"], "n1");
        assert_eq!(v["job"]["gres"], "gpu:2");
        assert_eq!(v["job"]["environment"]["PATH"], "/bin");
        assert!(v["job"].get("cpus_per_task").is_none());
        // `required_nodes` is refused by v0.0.38 and `argv` crashes 22.05's
        // slurmrestd: never send them.
        assert!(v["job"].get("required_nodes").is_none());
        assert!(v["job"].get("argv").is_none());
    }
}
