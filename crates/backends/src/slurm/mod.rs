//! The Slurm executor: Flotilla's placed work as Slurm batch jobs, through
//! `slurmrestd` (OpenAPI plugin v0.0.38, Slurm 22.05).
//!
//! - **Inventory**: every node slurmrestd lists (optionally only those of
//!   some partitions), its first partition as the Flotilla pool, its GRES
//!   `gpu:<type>:<n>` as `n` GPUs of the catalog model `<type>`.
//! - **Apply**: an assignment becomes one batch job named after the
//!   instance, pinned to the node Flotilla chose (`--nodelist`, one node,
//!   one task) with `--gres=gpu:N` for its N GPUs, the instance's
//!   environment, and its argv quoted into the script ([`state::script`]).
//!   Output (stdout and stderr together) goes to
//!   `<output dir>/<instance>.log`, which this process reads back as the
//!   instance's log: in production the output directory must be on a
//!   filesystem shared by the compute nodes and the bridge's host (NFS,
//!   Lustre, …), as Slurm's own `--output` files are. A stop cancels the
//!   job (`DELETE /job/{id}`: SIGTERM, SIGKILL after the cluster's
//!   `KillWait`), and so does a Flotilla job on a node the server no
//!   longer assigns it to.
//! - **Observe**: the jobs whose comment is `flotilla:<node>`, their states
//!   mapped by [`state::observed`], with Slurm's submit, start and end
//!   times, so that usage is metered from what Slurm ran: Slurm's record in
//!   whole seconds, `end_time - start_time`, at least one second for a job
//!   that ran ([`state::MIN_BILLED`]). An exit carries the job's start, so
//!   a job that ran and ended between two rounds is metered from it.
//!
//! Slurm chooses which GPUs of the node a job gets; Flotilla's choice is
//! passed as `FLOTILLA_GPU_INDICES` and counts agree as long as Flotilla
//! is the only submitter to those nodes (give Flotilla its own partition).
//! A job is never resubmitted by this process once submitted, and one
//! that Slurm still knows is never submitted again: the engine is the
//! source of truth (keep `MinJobAge` at least a few minutes so finished
//! jobs stay visible until reported).

pub mod rest;
pub mod state;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use flotilla_core::api::{
    Assignment, LogLine, LogStream, ObservedInstance, ObservedPhase, RegisterNode,
};
use flotilla_core::catalog::Catalog;
use flotilla_core::id::InstanceId;
use flotilla_core::node::{ExecutorKind, RuntimeKind};
use futures::future::BoxFuture;
use futures::FutureExt;

use crate::{Executor, ExecutorError};
pub use rest::{Auth, Endpoint};
use rest::{Job, JobProperties, RestClient, Submission};

/// The comment every job this executor submits carries, before the node.
pub const COMMENT_PREFIX: &str = "flotilla:";
/// How long a job list is reused between calls of one round.
const JOBS_TTL: Duration = Duration::from_millis(500);
/// Most log lines returned by one [`Executor::logs`] call.
const MAX_LOG_LINES: usize = 5_000;
/// The `PATH` a job gets when the instance sets none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How the executor reaches Slurm and what it offers.
#[derive(Debug, Clone)]
pub struct SlurmConfig {
    /// slurmrestd: `http://host:port` or `unix:/path`.
    pub slurmrestd: String,
    /// How calls authenticate.
    pub auth: Auth,
    /// Where jobs write their output; readable here and writable on the
    /// compute nodes (a shared filesystem in production).
    pub output_dir: PathBuf,
    /// Region of the nodes (server default `local`).
    pub region: Option<String>,
    /// Only nodes of these partitions (empty: every node).
    pub partitions: Vec<String>,
    /// Model of GPUs whose GRES has no type.
    pub default_gpu_model: Option<String>,
    /// The GPUs are simulated (device files without a driver, as in the
    /// test cluster).
    pub simulated: bool,
}

impl SlurmConfig {
    /// A configuration for `slurmrestd` with `auth`, output in
    /// `output_dir`, every node, real GPUs.
    pub fn new(slurmrestd: impl Into<String>, auth: Auth, output_dir: impl Into<PathBuf>) -> Self {
        Self {
            slurmrestd: slurmrestd.into(),
            auth,
            output_dir: output_dir.into(),
            region: None,
            partitions: Vec::new(),
            default_gpu_model: None,
            simulated: false,
        }
    }
}

/// Where reading an instance's output file got to.
#[derive(Debug, Clone, Copy, Default)]
struct LogCursor {
    /// Byte offset after the last complete line returned.
    offset: u64,
    /// Lines returned so far (the next line's seq).
    lines: u64,
}

#[derive(Debug, Default)]
struct Local {
    /// Node name → the partition its jobs are submitted to.
    partition_of: HashMap<String, String>,
    /// Jobs this process submitted, by instance: never submitted twice,
    /// even before `GET /jobs` shows them.
    submitted: HashMap<InstanceId, (String, u64)>,
    /// Jobs this process asked Slurm to cancel.
    cancelled: HashSet<u64>,
    /// Assignments Slurm refused or that cannot run on Slurm: node,
    /// reason, when.
    failed: HashMap<InstanceId, (String, String, DateTime<Utc>)>,
    /// Output read so far.
    logs: HashMap<InstanceId, LogCursor>,
}

/// A Slurm cluster behind slurmrestd as an [`Executor`].
pub struct SlurmExecutor {
    client: RestClient,
    config: SlurmConfig,
    catalog: Catalog,
    jobs: tokio::sync::Mutex<Option<(tokio::time::Instant, Arc<Vec<Job>>)>>,
    local: Mutex<Local>,
}

impl std::fmt::Debug for SlurmExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlurmExecutor")
            .field("config", &self.config)
            .finish()
    }
}

fn refused(message: String) -> ExecutorError {
    ExecutorError::Refused {
        engine: ExecutorKind::Slurm,
        message,
    }
}

/// The instance and node of a job this executor submitted.
fn ours(job: &Job) -> Option<(InstanceId, &str)> {
    let node = job.comment.strip_prefix(COMMENT_PREFIX)?;
    let id = InstanceId::parse(&job.name, "name").ok()?;
    Some((id, node))
}

impl SlurmExecutor {
    /// An executor for `config`; fails on a malformed slurmrestd address.
    pub fn new(config: SlurmConfig) -> Result<Self, ExecutorError> {
        let endpoint = Endpoint::parse(&config.slurmrestd)?;
        Ok(Self {
            client: RestClient::new(endpoint, config.auth.clone()),
            config,
            catalog: Catalog::default(),
            jobs: tokio::sync::Mutex::new(None),
            local: Mutex::new(Local::default()),
        })
    }

    fn local(&self) -> std::sync::MutexGuard<'_, Local> {
        // A panic while holding it cannot leave it half-written in a way
        // that matters more than stopping: take the data as it is.
        self.local.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The jobs slurmctld knows, reused for [`JOBS_TTL`] so one round's
    /// calls for many nodes make one request.
    async fn jobs(&self) -> Result<Arc<Vec<Job>>, ExecutorError> {
        let mut cached = self.jobs.lock().await;
        if let Some((at, jobs)) = cached.as_ref() {
            if at.elapsed() < JOBS_TTL {
                return Ok(jobs.clone());
            }
        }
        let jobs = Arc::new(self.client.jobs().await?);
        *cached = Some((tokio::time::Instant::now(), jobs.clone()));
        Ok(jobs)
    }

    async fn forget_jobs(&self) {
        *self.jobs.lock().await = None;
    }

    /// The newest job of each of our instances on `node`.
    fn ours_on<'j>(jobs: &'j [Job], node: &str) -> BTreeMap<InstanceId, &'j Job> {
        let mut out: BTreeMap<InstanceId, &Job> = BTreeMap::new();
        for j in jobs {
            if let Some((id, n)) = ours(j) {
                if n == node && out.get(&id).is_none_or(|o| o.job_id < j.job_id) {
                    out.insert(id, j);
                }
            }
        }
        out
    }

    /// The output file of an instance.
    pub fn output_path(&self, instance: &InstanceId) -> PathBuf {
        self.config
            .output_dir
            .join(format!("{}.log", instance.as_str()))
    }

    fn submission(&self, node: &str, a: &Assignment) -> Result<Submission, String> {
        if let Some(image) = &a.image {
            return Err(format!(
                "Slurm nodes run commands, not container images (`{}`)",
                image.image
            ));
        }
        if !a.gpu_slices.is_empty() {
            return Err("Slurm nodes take whole GPUs only (no fractions or MIG)".into());
        }
        let script = state::script(a.instance_id.as_str(), &a.command)?;
        let mut environment = BTreeMap::new();
        environment.insert("PATH".to_string(), DEFAULT_PATH.to_string());
        for (k, v) in &a.env {
            environment.insert(k.clone(), v.clone());
        }
        environment.insert(
            "FLOTILLA_INSTANCE_ID".into(),
            a.instance_id.as_str().to_string(),
        );
        let indices: Vec<String> = a.gpu_indices.iter().map(u32::to_string).collect();
        environment.insert("FLOTILLA_GPU_INDICES".into(), indices.join(","));
        let partition = self.local().partition_of.get(node).cloned();
        Ok(Submission {
            script,
            job: JobProperties {
                name: a.instance_id.as_str().to_string(),
                comment: format!("{COMMENT_PREFIX}{node}"),
                partition,
                nodelist: node.to_string(),
                nodes: "1".into(),
                tasks: 1,
                cpus_per_task: a
                    .cpu_milli
                    .map(|m| m.div_ceil(1000).max(1))
                    .filter(|c| *c > 1),
                memory_per_node: a.memory_mb,
                gres: (!a.gpu_indices.is_empty()).then(|| format!("gpu:{}", a.gpu_indices.len())),
                environment,
                current_working_directory: a
                    .workdir
                    .clone()
                    .unwrap_or_else(|| self.config.output_dir.to_string_lossy().into_owned()),
                standard_output: self
                    .output_path(&a.instance_id)
                    .to_string_lossy()
                    .into_owned(),
                no_requeue: true,
            },
        })
    }

    async fn submit(&self, node: &str, a: &Assignment) -> Result<(), ExecutorError> {
        let sub = match self.submission(node, a) {
            Ok(s) => s,
            Err(reason) => {
                tracing::warn!(instance_id = %a.instance_id, %reason, "cannot run on slurm");
                self.local()
                    .failed
                    .insert(a.instance_id.clone(), (node.into(), reason, Utc::now()));
                return Ok(());
            }
        };
        match self.client.submit(&sub).await {
            Ok(job_id) => {
                tracing::info!(instance_id = %a.instance_id, job_id, node, "submitted to slurm");
                self.local()
                    .submitted
                    .insert(a.instance_id.clone(), (node.to_string(), job_id));
                self.forget_jobs().await;
                Ok(())
            }
            Err(e @ ExecutorError::Refused { .. }) => {
                tracing::warn!(instance_id = %a.instance_id, error = %e, "slurm refused the job");
                self.local().failed.insert(
                    a.instance_id.clone(),
                    (node.into(), e.to_string(), Utc::now()),
                );
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    async fn cancel(&self, instance: &InstanceId, job_id: u64) -> Result<(), ExecutorError> {
        if self.local().cancelled.contains(&job_id) {
            return Ok(());
        }
        self.client.cancel(job_id).await?;
        tracing::info!(instance_id = %instance, job_id, "cancelled in slurm");
        self.local().cancelled.insert(job_id);
        self.forget_jobs().await;
        Ok(())
    }

    async fn apply_node(
        &self,
        node: &str,
        assignments: &[Assignment],
    ) -> Result<(), ExecutorError> {
        let jobs = self.jobs().await?;
        let existing = Self::ours_on(&jobs, node);
        let mut first_error = None;
        for a in assignments {
            let id = &a.instance_id;
            let job = existing
                .get(id)
                .map(|j| (j.job_id, state::is_over(j)))
                .or_else(|| {
                    self.local()
                        .submitted
                        .get(id)
                        .filter(|(n, _)| n == node)
                        .map(|(_, job_id)| (*job_id, false))
                });
            let r = match job {
                Some((job_id, false)) if a.stop => self.cancel(id, job_id).await,
                Some(_) => Ok(()),
                None if a.stop => Ok(()),
                None if self.local().failed.contains_key(id) => Ok(()),
                None => self.submit(node, a).await,
            };
            if let Err(e) = r {
                first_error.get_or_insert(e);
            }
        }
        // Ours on this node but no longer assigned here: the server gave
        // up on it (lost, moved), so it must not run on.
        for (id, job) in &existing {
            if !state::is_over(job) && !assignments.iter().any(|a| &a.instance_id == id) {
                tracing::warn!(instance_id = %id, job_id = job.job_id, node, "orphaned slurm job, cancelling");
                if let Err(e) = self.cancel(id, job.job_id).await {
                    first_error.get_or_insert(e);
                }
            }
        }
        // What the server no longer lists for this node is done with for
        // good (an instance id is never assigned again once dropped; a
        // requeue makes a new instance): forget it.
        {
            let assigned = |id: &InstanceId| assignments.iter().any(|a| &a.instance_id == id);
            let mut local = self.local();
            local
                .submitted
                .retain(|id, (n, _)| n != node || assigned(id));
            local
                .failed
                .retain(|id, (n, _, _)| n != node || assigned(id));
            let on_node: HashSet<InstanceId> = existing.keys().cloned().collect();
            local
                .logs
                .retain(|id, _| !on_node.contains(id) || assigned(id));
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    async fn observe_node(&self, node: &str) -> Result<Vec<ObservedInstance>, ExecutorError> {
        let jobs = self.jobs().await?;
        let now = Utc::now();
        let mut out: Vec<ObservedInstance> = Self::ours_on(&jobs, node)
            .into_iter()
            .map(|(id, job)| {
                let state::Observation {
                    phase,
                    at,
                    started_at,
                } = state::observed(job, now);
                ObservedInstance {
                    instance_id: id,
                    phase,
                    at,
                    started_at,
                    message: (job.job_state == "PENDING")
                        .then(|| format!("slurm job {} pending: {}", job.job_id, job.state_reason)),
                    container: None,
                    weights_tier: None,
                    limit_exceeded: None,
                }
            })
            .collect();
        let local = self.local();
        for (id, (n, reason, at)) in &local.failed {
            if n == node && !out.iter().any(|o| &o.instance_id == id) {
                out.push(ObservedInstance {
                    instance_id: id.clone(),
                    phase: ObservedPhase::FailedToStart {
                        reason: reason.clone(),
                    },
                    at: *at,
                    started_at: None,
                    message: None,
                    container: None,
                    weights_tier: None,
                    limit_exceeded: None,
                });
            }
        }
        // Submitted, not yet listed by slurmctld: starting.
        for (id, (n, job_id)) in &local.submitted {
            if n == node && !out.iter().any(|o| &o.instance_id == id) {
                out.push(ObservedInstance {
                    instance_id: id.clone(),
                    phase: ObservedPhase::Starting,
                    at: now,
                    started_at: None,
                    message: Some(format!("submitted as slurm job {job_id}")),
                    container: None,
                    weights_tier: None,
                    limit_exceeded: None,
                });
            }
        }
        Ok(out)
    }

    async fn inventory_now(&self) -> Result<Vec<RegisterNode>, ExecutorError> {
        let nodes = self.client.nodes().await?;
        let jobs = self.jobs().await?;
        let mut out = Vec::new();
        let mut partition_of = HashMap::new();
        for n in nodes {
            let partition = if self.config.partitions.is_empty() {
                n.partitions.first().cloned()
            } else {
                match n
                    .partitions
                    .iter()
                    .find(|p| self.config.partitions.contains(p))
                {
                    Some(p) => Some(p.clone()),
                    None => continue,
                }
            };
            let gpus = match state::gpus(
                &n.name,
                &n.gres,
                &self.catalog,
                self.config.default_gpu_model.as_deref(),
            ) {
                Ok(g) => g,
                Err(reason) => {
                    tracing::warn!(node = %n.name, %reason, "slurm node left out");
                    continue;
                }
            };
            if let Some(p) = &partition {
                partition_of.insert(n.name.clone(), p.clone());
            }
            let running = Self::ours_on(&jobs, &n.name)
                .into_iter()
                .filter(|(_, j)| !state::is_over(j))
                .map(|(id, _)| id)
                .collect();
            out.push(RegisterNode {
                name: n.name.clone(),
                region: self.config.region.clone(),
                pool: partition,
                cpu_milli: n.cpus.saturating_mul(1000),
                memory_mb: n.real_memory,
                simulated: self.config.simulated,
                gpus,
                agent_version: concat!("slurm-executor/", env!("CARGO_PKG_VERSION")).to_string(),
                runtime: RuntimeKind::Process,
                executor: ExecutorKind::Slurm,
                running,
                unenforced_limits: Vec::new(),
                network: None,
            });
        }
        self.local().partition_of = partition_of;
        Ok(out)
    }

    async fn logs_now(
        &self,
        instance: &InstanceId,
        since: u64,
    ) -> Result<Vec<LogLine>, ExecutorError> {
        // The last line may lack its newline only once the job is over.
        let over = {
            let jobs = self.jobs().await?;
            jobs.iter()
                .filter(|j| ours(j).is_some_and(|(id, _)| &id == instance))
                .max_by_key(|j| j.job_id)
                .is_some_and(state::is_over)
        };
        let cursor = self
            .local()
            .logs
            .get(instance)
            .copied()
            .filter(|c| c.lines == since)
            .unwrap_or_default();
        let path = self.output_path(instance);
        let read = tokio::task::spawn_blocking(move || read_lines(&path, cursor, since, over))
            .await
            .map_err(|e| refused(format!("log reader failed: {e}")))?;
        let (lines, cursor) = match read {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => {
                return Err(ExecutorError::Unavailable {
                    engine: ExecutorKind::Slurm,
                    message: format!("reading the output of {instance}: {e}"),
                })
            }
        };
        self.local().logs.insert(instance.clone(), cursor);
        let now = Utc::now();
        Ok(lines
            .into_iter()
            .enumerate()
            .map(|(i, line)| LogLine {
                seq: since + i as u64,
                stream: LogStream::Stdout,
                at: now,
                line,
            })
            .collect())
    }
}

/// Reads lines from `path` starting at line `since`: from `cursor` when it
/// is at that line, else by skipping from the start. A last line without
/// its newline is returned only when `complete` (the writer is done).
fn read_lines(
    path: &std::path::Path,
    cursor: LogCursor,
    since: u64,
    complete: bool,
) -> std::io::Result<(Vec<String>, LogCursor)> {
    let mut f = std::fs::File::open(path)?;
    let mut cursor = if cursor.lines == since {
        cursor
    } else {
        LogCursor::default()
    };
    f.seek(SeekFrom::Start(cursor.offset))?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)?;
    let mut out = Vec::new();
    let mut start = 0usize;
    while let Some(nl) = buf[start..].iter().position(|b| *b == b'\n') {
        let line = &buf[start..start + nl];
        start += nl + 1;
        if cursor.lines >= since {
            if out.len() >= MAX_LOG_LINES {
                start -= nl + 1;
                break;
            }
            out.push(String::from_utf8_lossy(line).into_owned());
        }
        cursor.lines += 1;
        cursor.offset += (nl + 1) as u64;
    }
    if complete && start < buf.len() && out.len() < MAX_LOG_LINES {
        let line = &buf[start..];
        if cursor.lines >= since {
            out.push(String::from_utf8_lossy(line).into_owned());
        }
        cursor.lines += 1;
        cursor.offset += line.len() as u64;
    }
    Ok((out, cursor))
}

impl Executor for SlurmExecutor {
    fn kind(&self) -> ExecutorKind {
        ExecutorKind::Slurm
    }

    fn inventory(&self) -> BoxFuture<'_, Result<Vec<RegisterNode>, ExecutorError>> {
        self.inventory_now().boxed()
    }

    fn apply<'a>(
        &'a self,
        node: &'a str,
        assignments: &'a [Assignment],
    ) -> BoxFuture<'a, Result<(), ExecutorError>> {
        self.apply_node(node, assignments).boxed()
    }

    fn observe<'a>(
        &'a self,
        node: &'a str,
    ) -> BoxFuture<'a, Result<Vec<ObservedInstance>, ExecutorError>> {
        self.observe_node(node).boxed()
    }

    fn logs<'a>(
        &'a self,
        instance: &'a InstanceId,
        since: u64,
    ) -> BoxFuture<'a, Result<Vec<LogLine>, ExecutorError>> {
        self.logs_now(instance, since).boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &std::path::Path, s: &str) {
        std::fs::write(path, s).unwrap();
    }

    #[test]
    fn log_lines_resume_from_the_cursor() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("i.log");
        write(&p, "a\nb\npart");
        let (lines, c) = read_lines(&p, LogCursor::default(), 0, false).unwrap();
        assert_eq!(lines, vec!["a", "b"]);
        assert_eq!((c.lines, c.offset), (2, 4));
        write(&p, "a\nb\npartial\nc\n");
        let (lines, c) = read_lines(&p, c, 2, false).unwrap();
        assert_eq!(lines, vec!["partial", "c"]);
        assert_eq!(c.lines, 4);
        // A caller that lost lines asks again from an earlier seq.
        let (lines, _) = read_lines(&p, c, 1, false).unwrap();
        assert_eq!(lines, vec!["b", "partial", "c"]);
        // The unterminated tail comes once the job is over.
        write(&p, "a\nb\npartial\nc\nend");
        let (lines, c) = read_lines(&p, c, 4, false).unwrap();
        assert!(lines.is_empty());
        let (lines, c) = read_lines(&p, c, 4, true).unwrap();
        assert_eq!(lines, vec!["end"]);
        assert_eq!(c.lines, 5);
        let (lines, _) = read_lines(&p, c, 5, true).unwrap();
        assert!(lines.is_empty());
    }

    fn assignment(id: &str) -> Assignment {
        Assignment {
            instance_id: InstanceId::parse(id, "id").unwrap(),
            tenant_id: None,
            command: vec!["sh".into(), "-c".into(), "echo $X".into()],
            env: BTreeMap::from([("X".into(), "1; rm -rf /".into())]),
            workdir: None,
            gpu_indices: vec![0, 1],
            gpu_uuids: vec!["a".into(), "b".into()],
            gpu_slices: vec![],
            stop: false,
            stop_grace_ms: 10_000,
            image: None,
            cpu_milli: Some(1500),
            memory_mb: Some(1024),
            registry_auth: None,
            disk_mb: None,
        }
    }

    #[test]
    fn an_assignment_becomes_a_pinned_submission() {
        let ex = SlurmExecutor::new(SlurmConfig::new(
            "http://127.0.0.1:1",
            Auth::Local,
            "/shared/out",
        ))
        .unwrap();
        ex.local().partition_of.insert("n1".into(), "gpu".into());
        let id = InstanceId::generate(1, 2);
        let a = assignment(id.as_str());
        let s = ex.submission("n1", &a).unwrap();
        assert_eq!(s.job.name, id.as_str());
        assert_eq!(s.job.comment, "flotilla:n1");
        assert_eq!(s.job.nodelist, "n1");
        assert_eq!(s.job.partition.as_deref(), Some("gpu"));
        assert_eq!(s.job.gres.as_deref(), Some("gpu:2"));
        assert_eq!(s.job.cpus_per_task, Some(2));
        assert_eq!(s.job.environment["X"], "1; rm -rf /");
        assert_eq!(s.job.environment["FLOTILLA_GPU_INDICES"], "0,1");
        assert!(s.job.environment.contains_key("PATH"));
        assert_eq!(
            s.job.standard_output,
            format!("/shared/out/{}.log", id.as_str())
        );
        assert!(s.job.no_requeue);
        assert!(s.script.ends_with("exec 'sh' '-c' 'echo $X'\n"));
        let mut img = a.clone();
        img.image = Some(serde_json::from_value(serde_json::json!({"image": "busybox"})).unwrap());
        assert!(ex.submission("n1", &img).unwrap_err().contains("images"));
        let mut none = a;
        none.gpu_indices.clear();
        assert_eq!(ex.submission("n1", &none).unwrap().job.gres, None);
    }

    #[test]
    fn only_our_jobs_count() {
        let r: rest::JobsResponse =
            serde_json::from_str(include_str!("testdata/jobs.json")).unwrap();
        let n1 = SlurmExecutor::ours_on(&r.jobs, "flotilla-n1");
        let n2 = SlurmExecutor::ours_on(&r.jobs, "flotilla-n2");
        assert!(!n1.is_empty() || !n2.is_empty());
        for j in n1.values().chain(n2.values()) {
            assert!(j.comment.starts_with(COMMENT_PREFIX));
        }
        let foreign = r.jobs.iter().filter(|j| ours(j).is_none()).count();
        assert!(
            foreign > 0,
            "the recording has a job not submitted by flotilla"
        );
    }
}
