//! Jobs: batch and training work run by a gang of instances (one per
//! rank), placed all together or not at all, restarted whole on failure
//! when asked to, and requeued whole when any member is preempted.
//!
//! This module holds the request validation and the job's decision rule
//! ([`step`]): given the job and the states of its current members, what
//! happens next. It is pure so that the server's loop and the simulator
//! apply the same rule, and so every case is unit-tested here.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::catalog::Catalog;
use crate::error::FieldError;
use crate::instance::{InstanceState, MAX_GPUS_PER_INSTANCE};

/// Where a job is in its life. Its members (instances) carry the detail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting for the whole gang to fit (first run, a restart after a
    /// failure, or a requeue after a preemption).
    Queued,
    /// Members are placed and run (or start, or are being stopped).
    Running,
    /// Every member of one attempt exited 0.
    Succeeded,
    /// A member failed and no retry is left.
    Failed,
    /// Cancelled on request.
    Cancelled,
}

impl JobState {
    /// Every state.
    pub const ALL: [JobState; 5] = [
        Self::Queued,
        Self::Running,
        Self::Succeeded,
        Self::Failed,
        Self::Cancelled,
    ];

    /// Stable lowercase name, as stored and sent.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Final states: no member runs and none will.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

/// What happens when a member fails.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RestartPolicy {
    /// The job fails with its first failing member.
    #[default]
    Never,
    /// The whole gang is stopped and queued again, up to `max_retries` times.
    OnFailure,
}

impl RestartPolicy {
    /// Stable name, as stored, sent and typed on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Never => "never",
            Self::OnFailure => "on_failure",
        }
    }

    /// Parses a name; `on-failure` is accepted as the CLI spells it.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "never" => Some(Self::Never),
            "on_failure" | "on-failure" => Some(Self::OnFailure),
            _ => None,
        }
    }
}

/// Where a gang's members may go relative to each other.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Locality {
    /// Any nodes.
    #[default]
    Any,
    /// Nodes of one pool (the topology domain Flotilla knows: a group of
    /// alike, well-connected nodes).
    SamePool,
    /// Nodes of one region.
    SameRegion,
}

impl Locality {
    /// Stable name, as sent and typed on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Any => "any",
            Self::SamePool => "same_pool",
            Self::SameRegion => "same_region",
        }
    }

    /// Parses a name; `same-pool` and `same-region` as the CLI spells them.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "any" => Some(Self::Any),
            "same_pool" | "same-pool" => Some(Self::SamePool),
            "same_region" | "same-region" => Some(Self::SameRegion),
            _ => None,
        }
    }
}

/// Most ranks one job may have.
pub const MAX_NODES: u32 = 64;
/// Most retries one job may ask for.
pub const MAX_RETRIES: u32 = 100;
/// Longest time limit: 30 days.
pub const MAX_TIME_LIMIT_S: u64 = 30 * 24 * 3600;
/// Retries an `on_failure` job gets when it does not say.
pub const DEFAULT_RETRIES: u32 = 3;
/// Prefix of the variables Flotilla sets for job members; users cannot
/// set them, or a rank could lie about who it is.
pub const RESERVED_ENV_PREFIX: &str = "FLOTILLA_JOB_";

crate::work::work_request! {
    /// What a tenant asks for when submitting a job.
    pub struct CreateJob {
        /// GPUs of the whole job; each member gets `gpus / nodes`, all of one
        /// model on one node (with a share: `gpus` equals `nodes`).
        pub gpus: u32,
        /// Members of the gang (ranks), placed all together or not at all
        /// (default 1), each on a node of its own, as Slurm's `-N` places them.
        #[serde(default)]
        pub nodes: Option<u32>,
        /// `never` (default) or `on_failure`.
        #[serde(default)]
        pub restart_policy: RestartPolicy,
        /// Restarts after failures, for `on_failure` (default 3, at most 100;
        /// must be 0 or absent with `never`). Preemptions do not count.
        #[serde(default)]
        pub max_retries: Option<u32>,
        /// `any` (default), `same_pool` or `same_region`: keep every member in
        /// one pool or one region.
        #[serde(default)]
        pub locality: Locality,
        /// Longest one attempt may run, in seconds (1 to 30 days). Members
        /// still running then are stopped and the job fails, without retry.
        /// Knowing when a job ends at the latest lets the scheduler backfill it
        /// ahead of a waiting head, and plan that head's start.
        #[serde(default)]
        pub time_limit_s: Option<u64>,
    }
}

crate::work::resolved_work! {
    from_spec;
    /// A validated job request: what the store keeps and every member is
    /// made from.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
    pub struct JobSpec {
        /// Display name.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub name: Option<String>,
        /// GPUs of the whole job.
        pub gpus: u32,
        /// Members.
        pub nodes: u32,
        /// Restart policy.
        pub restart_policy: RestartPolicy,
        /// Restarts allowed after failures.
        pub max_retries: u32,
        /// Where the members may go relative to each other.
        #[serde(default)]
        pub locality: Locality,
        /// Longest one attempt may run, in seconds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub time_limit_s: Option<u64>,
    }
}

impl JobSpec {
    /// What each member takes of its GPUs: whole GPUs, a fraction of one,
    /// or a MIG instance of the catalog's profile.
    pub fn share(&self, catalog: &Catalog) -> crate::placement::GpuShare {
        use crate::placement::GpuShare;
        if let Some((p, _)) = self
            .mig_profile
            .as_deref()
            .and_then(|n| catalog.mig_profile(n))
        {
            return GpuShare::Mig(p);
        }
        match self.gpu_fraction.map(|f| (f * 1000.0).round()) {
            // Validated to 1..1000 milli.
            Some(m) if (1.0..1000.0).contains(&m) => GpuShare::Fraction { milli: m as u16 },
            _ => GpuShare::Whole,
        }
    }

    /// GPUs of one member.
    pub fn gpus_per_member(&self) -> u32 {
        self.gpus / self.nodes.max(1)
    }
}

impl CreateJob {
    /// Validates against the catalog and fills in defaults. Every error
    /// names the JSON path of the value at fault. Member-level rules are
    /// the instance's own (one member is one instance).
    pub fn validate(self, catalog: &Catalog) -> Result<JobSpec, FieldError> {
        let nodes = self.nodes.unwrap_or(1);
        if nodes == 0 || nodes > MAX_NODES {
            return Err(FieldError::new(
                "nodes",
                format!("must be between 1 and {MAX_NODES}, got {nodes}"),
            ));
        }
        if self.gpus == 0 {
            return Err(FieldError::new("gpus", "must be at least 1"));
        }
        // `u32::is_multiple_of` is newer than the workspace's rust-version.
        #[allow(clippy::manual_is_multiple_of)]
        let uneven = self.gpus % nodes != 0;
        if uneven {
            return Err(FieldError::new(
                "gpus",
                format!(
                    "must be divisible by nodes ({nodes}): every member gets the same GPUs, got {}",
                    self.gpus
                ),
            ));
        }
        let per = self.gpus / nodes;
        if per > MAX_GPUS_PER_INSTANCE {
            return Err(FieldError::new(
                "gpus",
                format!(
                    "{per} per member is over {MAX_GPUS_PER_INSTANCE} (one node); use more nodes"
                ),
            ));
        }
        if let Some(k) = self.env.keys().find(|k| k.starts_with(RESERVED_ENV_PREFIX)) {
            return Err(FieldError::new(
                format!("env.{k}"),
                "FLOTILLA_JOB_* variables are set by flotilla for each member",
            ));
        }
        let max_retries = match (self.restart_policy, self.max_retries) {
            (RestartPolicy::Never, None | Some(0)) => 0,
            (RestartPolicy::Never, Some(_)) => {
                return Err(FieldError::new(
                    "max_retries",
                    "needs restart_policy on_failure",
                ))
            }
            (RestartPolicy::OnFailure, None) => DEFAULT_RETRIES,
            (RestartPolicy::OnFailure, Some(n)) if n > MAX_RETRIES => {
                return Err(FieldError::new(
                    "max_retries",
                    format!("must be at most {MAX_RETRIES}, got {n}"),
                ))
            }
            (RestartPolicy::OnFailure, Some(n)) => n,
        };
        if let Some(t) = self.time_limit_s {
            if t == 0 || t > MAX_TIME_LIMIT_S {
                return Err(FieldError::new(
                    "time_limit_s",
                    format!("must be between 1 and {MAX_TIME_LIMIT_S} seconds, got {t}"),
                ));
            }
        }
        let member = self.to_member(per).validate(catalog)?;
        let name = member.name.clone();
        Ok(JobSpec::from_spec(
            member,
            name,
            self.gpus,
            nodes,
            self.restart_policy,
            max_retries,
            self.locality,
            self.time_limit_s,
        ))
    }
}

/// The variables a member runs with, on top of the job's own: who it is
/// in the gang and where the others are (node names by rank, so rank 0's
/// node is the rendezvous point).
pub fn member_env(
    job_id: &str,
    rank: u32,
    world_size: u32,
    attempt: u32,
    nodes_by_rank: &[String],
) -> BTreeMap<String, String> {
    [
        ("FLOTILLA_JOB_ID", job_id.to_string()),
        ("FLOTILLA_JOB_RANK", rank.to_string()),
        ("FLOTILLA_JOB_WORLD_SIZE", world_size.to_string()),
        ("FLOTILLA_JOB_ATTEMPT", attempt.to_string()),
        ("FLOTILLA_JOB_NODES", nodes_by_rank.join(",")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// What [`step`] needs of a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobProgress {
    /// Restart policy.
    pub restart_policy: RestartPolicy,
    /// Restarts allowed after failures.
    pub max_retries: u32,
    /// Failed attempts so far.
    pub failures: u32,
    /// A cancel was asked for.
    pub cancel_requested: bool,
    /// The job's time limit per attempt, for the reason.
    pub time_limit_s: Option<u64>,
    /// When the current attempt must end (ms), from its time limit.
    pub deadline_ms: Option<u64>,
    /// Now (ms).
    pub now_ms: u64,
}

/// What [`step`] needs of one member of the current attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberStatus {
    /// Rank.
    pub rank: u32,
    /// Instance state.
    pub state: InstanceState,
    /// A stop (or preemption) is under way.
    pub stop_requested: bool,
    /// The work it was preempted for, if it was.
    pub preempted_by: Option<String>,
    /// Exit status, once exited.
    pub exit_code: Option<i32>,
}

/// What to do next with a running job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobStep {
    /// Nothing: members run, or stop.
    Wait,
    /// Stop these members (indices into the member list).
    Stop {
        /// Members to stop.
        members: Vec<usize>,
        /// Why, for the job's reason.
        reason: String,
    },
    /// Preempt these members for `by`, with the notice, as one of them was.
    Preempt {
        /// Members to preempt.
        members: Vec<usize>,
        /// The work the preemption makes room for.
        by: String,
    },
    /// Every member is final: queue the gang again.
    Requeue {
        /// Whether this counts against `max_retries` (failures do,
        /// preemptions do not).
        failure: bool,
        /// Why.
        reason: String,
    },
    /// Every member is final: the job ends.
    Finish {
        /// Final state.
        state: JobState,
        /// Why.
        reason: String,
    },
}

fn time_limit(job: &JobProgress) -> String {
    match job.time_limit_s {
        Some(t) => format!("time limit of {t} s reached"),
        None => "time limit reached".to_string(),
    }
}

fn describe(m: &MemberStatus) -> String {
    match (m.state, m.exit_code) {
        (InstanceState::Failed, Some(c)) => format!("rank {} failed (exit code {c})", m.rank),
        (InstanceState::Failed, None) => format!("rank {} failed", m.rank),
        (s, _) => format!("rank {} {}", m.rank, s.as_str()),
    }
}

/// The job rule. A member failing (or stopped by someone other than the
/// job) stops the others; once every member is final, the job succeeds
/// when all exited 0, is requeued when a member was preempted (the
/// preemption reaches every member first), restarts on failure while
/// retries remain, and fails otherwise. A cancel wins over everything; an
/// attempt past its time limit is stopped and the job fails, without retry.
/// A `lost` member counts as failed: the gang is stopped (the lost member
/// included, which ends it at once) rather than left hanging on a node
/// that may never return.
pub fn step(job: &JobProgress, members: &[MemberStatus]) -> JobStep {
    let overdue = job.deadline_ms.is_some_and(|d| job.now_ms >= d);
    let live: Vec<usize> = members
        .iter()
        .enumerate()
        .filter(|(_, m)| !m.state.is_terminal())
        .map(|(i, _)| i)
        .collect();
    let unstopped: Vec<usize> = live
        .iter()
        .copied()
        .filter(|&i| !members[i].stop_requested)
        .collect();
    let preempted = members.iter().find_map(|m| m.preempted_by.clone());
    // A lost member breaks the gang too: its node stopped answering, and
    // the other ranks cannot progress without it (a collective would hang).
    let broken = members.iter().find(|m| {
        m.preempted_by.is_none()
            && matches!(
                m.state,
                InstanceState::Failed | InstanceState::Stopped | InstanceState::Lost
            )
    });
    if !live.is_empty() {
        if job.cancel_requested {
            return if unstopped.is_empty() {
                JobStep::Wait
            } else {
                JobStep::Stop {
                    members: unstopped,
                    reason: "cancel requested: stopping every member".to_string(),
                }
            };
        }
        if let Some(by) = preempted {
            return if unstopped.is_empty() {
                JobStep::Wait
            } else {
                JobStep::Preempt {
                    members: unstopped,
                    by,
                }
            };
        }
        if overdue {
            return if unstopped.is_empty() {
                JobStep::Wait
            } else {
                JobStep::Stop {
                    members: unstopped,
                    reason: format!("{}: stopping every member", time_limit(job)),
                }
            };
        }
        if let Some(b) = broken {
            if !unstopped.is_empty() {
                return JobStep::Stop {
                    members: unstopped,
                    reason: format!("{}: stopping the other members", describe(b)),
                };
            }
        }
        return JobStep::Wait;
    }
    if members.is_empty() {
        // Placed members are created in one transaction with the job's
        // move to running; none means a corrupt row, which must not loop.
        return JobStep::Finish {
            state: JobState::Failed,
            reason: "running without members".to_string(),
        };
    }
    if job.cancel_requested {
        return JobStep::Finish {
            state: JobState::Cancelled,
            reason: "cancelled on request".to_string(),
        };
    }
    if let Some(by) = preempted {
        return JobStep::Requeue {
            failure: false,
            reason: format!("preempted by {by}; requeued whole"),
        };
    }
    let Some(b) = members.iter().find(|m| m.state != InstanceState::Succeeded) else {
        return JobStep::Finish {
            state: JobState::Succeeded,
            reason: format!("all {} members exited 0", members.len()),
        };
    };
    if overdue {
        return JobStep::Finish {
            state: JobState::Failed,
            reason: time_limit(job),
        };
    }
    let what = describe(b);
    if job.restart_policy == RestartPolicy::OnFailure && job.failures < job.max_retries {
        JobStep::Requeue {
            failure: true,
            reason: format!(
                "{what}; restarting the gang (retry {} of {})",
                job.failures + 1,
                job.max_retries
            ),
        }
    } else if job.restart_policy == RestartPolicy::OnFailure {
        JobStep::Finish {
            state: JobState::Failed,
            reason: format!("{what}; no retries left ({} used)", job.max_retries),
        }
    } else {
        JobStep::Finish {
            state: JobState::Failed,
            reason: what,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instance::BillingClass;
    use InstanceState::*;

    fn req() -> CreateJob {
        CreateJob {
            name: None,
            gpus: 8,
            nodes: Some(2),
            gpu_types: vec![],
            cpu_milli: None,
            memory_mb: None,
            command: vec!["train".into()],
            env: BTreeMap::new(),
            workdir: None,
            billing_class: BillingClass::Spot,
            priority: None,
            tier: None,
            preemptible: None,
            restart_policy: RestartPolicy::OnFailure,
            max_retries: None,
            locality: Locality::Any,
            time_limit_s: None,
            gpu_fraction: None,
            mig_profile: None,
            image: None,
            ports: Vec::new(),
            scratch_mb: None,
            disk_mb: None,
        }
    }

    #[test]
    fn valid_request_gets_defaults() {
        let s = req().validate(&Catalog::default()).unwrap();
        assert_eq!((s.gpus, s.nodes, s.gpus_per_member()), (8, 2, 4));
        assert_eq!((s.tier, s.preemptible, s.max_retries), (2, true, 3));
        let one = CreateJob {
            nodes: None,
            restart_policy: RestartPolicy::Never,
            ..req()
        }
        .validate(&Catalog::default())
        .unwrap();
        assert_eq!((one.nodes, one.max_retries), (1, 0));
    }

    #[test]
    fn each_bad_value_names_its_field() {
        let c = Catalog::default();
        let cases = [
            (CreateJob { gpus: 7, ..req() }, "gpus"),
            // A share is one GPU per member: 8 GPUs over 2 members is not.
            (
                CreateJob {
                    gpu_fraction: Some(0.5),
                    ..req()
                },
                "gpus",
            ),
            (
                CreateJob {
                    gpus: 2,
                    gpu_types: vec!["L40S".into()],
                    mig_profile: Some("1g.10gb".into()),
                    ..req()
                },
                "mig_profile",
            ),
            (CreateJob { gpus: 0, ..req() }, "gpus"),
            (CreateJob { gpus: 130, ..req() }, "gpus"),
            (
                CreateJob {
                    nodes: Some(0),
                    ..req()
                },
                "nodes",
            ),
            (
                CreateJob {
                    nodes: Some(65),
                    ..req()
                },
                "nodes",
            ),
            (
                CreateJob {
                    max_retries: Some(101),
                    ..req()
                },
                "max_retries",
            ),
            (
                CreateJob {
                    restart_policy: RestartPolicy::Never,
                    max_retries: Some(2),
                    ..req()
                },
                "max_retries",
            ),
            (
                CreateJob {
                    env: [("FLOTILLA_JOB_RANK".to_string(), "0".to_string())].into(),
                    ..req()
                },
                "env.FLOTILLA_JOB_RANK",
            ),
            (
                CreateJob {
                    tier: Some(1),
                    preemptible: Some(true),
                    ..req()
                },
                "preemptible",
            ),
            (
                CreateJob {
                    command: vec![],
                    ..req()
                },
                "command",
            ),
        ];
        for (r, field) in cases {
            assert_eq!(r.validate(&c).unwrap_err().field, field);
        }
    }

    #[test]
    fn names_round_trip() {
        for s in JobState::ALL {
            assert_eq!(JobState::parse(s.as_str()), Some(s));
        }
        assert_eq!(
            RestartPolicy::parse("on-failure"),
            Some(RestartPolicy::OnFailure)
        );
        assert_eq!(RestartPolicy::parse("always"), None);
        for l in [Locality::Any, Locality::SamePool, Locality::SameRegion] {
            assert_eq!(Locality::parse(l.as_str()), Some(l));
        }
        assert_eq!(Locality::parse("same-region"), Some(Locality::SameRegion));
        assert_eq!(Locality::parse("rack"), None);
    }

    #[test]
    fn member_env_names_rank_world_and_nodes() {
        let e = member_env("job_x", 1, 2, 3, &["a".into(), "b".into()]);
        assert_eq!(e["FLOTILLA_JOB_RANK"], "1");
        assert_eq!(e["FLOTILLA_JOB_WORLD_SIZE"], "2");
        assert_eq!(e["FLOTILLA_JOB_ATTEMPT"], "3");
        assert_eq!(e["FLOTILLA_JOB_NODES"], "a,b");
        assert!(e.keys().all(|k| k.starts_with(RESERVED_ENV_PREFIX)));
    }

    fn m(rank: u32, state: InstanceState) -> MemberStatus {
        MemberStatus {
            rank,
            state,
            stop_requested: false,
            preempted_by: None,
            exit_code: match state {
                Succeeded => Some(0),
                Failed => Some(1),
                _ => None,
            },
        }
    }

    fn job(policy: RestartPolicy, max: u32, failures: u32) -> JobProgress {
        JobProgress {
            restart_policy: policy,
            max_retries: max,
            failures,
            cancel_requested: false,
            time_limit_s: None,
            deadline_ms: None,
            now_ms: 0,
        }
    }

    #[test]
    fn an_attempt_past_its_time_limit_is_stopped_and_fails_without_retry() {
        let mut j = job(RestartPolicy::OnFailure, 3, 0);
        j.deadline_ms = Some(1_000);
        j.now_ms = 999;
        assert_eq!(step(&j, &[m(0, Running), m(1, Running)]), JobStep::Wait);
        j.now_ms = 1_000;
        match step(&j, &[m(0, Running), m(1, Succeeded)]) {
            JobStep::Stop { members, reason } => {
                assert_eq!(members, vec![0]);
                assert!(
                    reason.starts_with("time limit reached: stopping"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            step(&j, &[m(0, Stopped), m(1, Succeeded)]),
            JobStep::Finish {
                state: JobState::Failed,
                ..
            }
        ));
        // Everything succeeded just in time: it succeeded.
        assert!(matches!(
            step(&j, &[m(0, Succeeded), m(1, Succeeded)]),
            JobStep::Finish {
                state: JobState::Succeeded,
                ..
            }
        ));
        let bad = CreateJob {
            time_limit_s: Some(0),
            ..req()
        };
        assert_eq!(
            bad.validate(&Catalog::default()).unwrap_err().field,
            "time_limit_s"
        );
    }

    #[test]
    fn all_exit_zero_succeeds_and_an_early_finisher_does_not_stop_the_rest() {
        let j = job(RestartPolicy::Never, 0, 0);
        assert_eq!(step(&j, &[m(0, Succeeded), m(1, Running)]), JobStep::Wait);
        assert!(matches!(
            step(&j, &[m(0, Succeeded), m(1, Succeeded)]),
            JobStep::Finish {
                state: JobState::Succeeded,
                ..
            }
        ));
    }

    #[test]
    fn a_failing_member_stops_the_others_then_restarts_or_fails() {
        let j = job(RestartPolicy::OnFailure, 2, 0);
        let ms = [m(0, Running), m(1, Failed), m(2, Scheduled)];
        match step(&j, &ms) {
            JobStep::Stop { members, reason } => {
                assert_eq!(members, vec![0, 2]);
                assert!(reason.contains("rank 1 failed (exit code 1)"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        // Stops under way: wait for them.
        let mut stopping = ms.clone();
        stopping[0].stop_requested = true;
        stopping[2].stop_requested = true;
        assert_eq!(step(&j, &stopping), JobStep::Wait);
        let done = [m(0, Stopped), m(1, Failed), m(2, Stopped)];
        match step(&j, &done) {
            JobStep::Requeue { failure, reason } => {
                assert!(failure);
                assert!(reason.contains("retry 1 of 2"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        match step(&job(RestartPolicy::OnFailure, 2, 2), &done) {
            JobStep::Finish { state, reason } => {
                assert_eq!(state, JobState::Failed);
                assert!(reason.contains("no retries left"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            step(&job(RestartPolicy::Never, 0, 0), &done),
            JobStep::Finish {
                state: JobState::Failed,
                ..
            }
        ));
    }

    #[test]
    fn a_preempted_member_brings_the_whole_gang_down_and_requeues_it_for_free() {
        let j = job(RestartPolicy::Never, 0, 0);
        let mut ms = [m(0, Running), m(1, Running)];
        ms[1].stop_requested = true;
        ms[1].preempted_by = Some("inst_x".into());
        assert_eq!(
            step(&j, &ms),
            JobStep::Preempt {
                members: vec![0],
                by: "inst_x".into()
            }
        );
        let mut done = [m(0, Stopped), m(1, Stopped)];
        for d in &mut done {
            d.preempted_by = Some("inst_x".into());
        }
        // A member that exited 0 during the notice changes nothing.
        done[0].state = Succeeded;
        assert!(matches!(
            step(&j, &done),
            JobStep::Requeue { failure: false, .. }
        ));
    }

    #[test]
    fn cancel_wins_and_a_lost_member_stops_the_gang() {
        let mut j = job(RestartPolicy::OnFailure, 5, 0);
        j.cancel_requested = true;
        assert_eq!(
            step(&j, &[m(0, Running), m(1, Failed)]),
            JobStep::Stop {
                members: vec![0],
                reason: "cancel requested: stopping every member".into()
            }
        );
        assert!(matches!(
            step(&j, &[m(0, Stopped), m(1, Failed)]),
            JobStep::Finish {
                state: JobState::Cancelled,
                ..
            }
        ));
        let j = job(RestartPolicy::Never, 0, 0);
        match step(&j, &[m(0, Lost), m(1, Running)]) {
            JobStep::Stop { members, reason } => {
                assert_eq!(members, vec![0, 1]);
                assert!(reason.starts_with("rank 0 lost"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            step(&j, &[]),
            JobStep::Finish {
                state: JobState::Failed,
                ..
            }
        ));
    }
}
