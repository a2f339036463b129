//! `flotilla jobs …`: submit, list, show, queue, cancel, logs, and the
//! job half of `flotilla explain`. Like every client command, these only
//! call the API; the job rules live in the server.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use chrono::Utc;
use clap::Subcommand;
use flotilla_core::api::Job;
use flotilla_core::id::JobId;
use flotilla_core::job::{CreateJob, JobState, Locality, RestartPolicy};

use crate::commands::{end_work, instance_logs, WorkArgs};
use crate::ctx::Ctx;
use crate::output::{age, one_line, outln, print_answer, print_table, table};
use crate::queue::{queue_row, work_queue};

/// `flotilla jobs` actions.
#[derive(Debug, Subcommand)]
pub enum JobsCommand {
    /// Submit a job: a gang of `--nodes` members (ranks) of `--gpus /
    /// --nodes` GPUs each, placed all together or not at all.
    Submit(Box<SubmitArgs>),
    /// List jobs (finished ones with --all or --state).
    List {
        /// Include finished jobs.
        #[arg(long, short = 'a')]
        all: bool,
        /// Only jobs in this state.
        #[arg(long, value_parser = parse_state)]
        state: Option<JobState>,
    },
    /// A job's spec, members of every attempt and history.
    Show {
        /// Job id.
        id: String,
    },
    /// Queued jobs in the order the scheduler tries them, with position
    /// and reason.
    Queue,
    /// Cancel a job: queued, it ends at once; running, its members stop.
    Cancel {
        /// Job id.
        id: String,
    },
    /// Print one rank's output (of the latest attempt that has it).
    Logs {
        /// Job id.
        id: String,
        /// Rank whose output to print.
        #[arg(long, default_value_t = 0)]
        rank: u32,
        /// Keep printing until that member ends.
        #[arg(long, short = 'f')]
        follow: bool,
    },
}

/// `flotilla jobs submit` options: the work (the arguments `flotilla run`
/// takes, per member), and what makes it a gang.
#[derive(Debug, clap::Args)]
#[command(group = clap::ArgGroup::new("what").required(true).args(["image", "command"]).multiple(true))]
pub struct SubmitArgs {
    #[command(flatten)]
    pub work: WorkArgs,
    /// Members of the gang (ranks), each on a node of its own.
    #[arg(long, default_value_t = 1, value_name = "K")]
    pub nodes: u32,
    /// `never` or `on-failure` (restart the whole gang).
    #[arg(long, value_parser = parse_restart, default_value = "never", value_name = "never|on-failure")]
    pub restart: RestartPolicy,
    /// Restarts after failures with `--restart on-failure` (default 3).
    #[arg(long, value_name = "N")]
    pub max_retries: Option<u32>,
    /// Keep every member in one pool or one region.
    #[arg(long, value_parser = parse_locality, default_value = "any", value_name = "any|same-pool|same-region")]
    pub locality: Locality,
    /// Longest one attempt may run, in seconds; then the job fails. A
    /// limit lets the job start early, in capacity held for later work.
    #[arg(long = "time-limit", value_name = "SECONDS")]
    pub time_limit_s: Option<u64>,
    /// Wait for the job to end; exit 0 only if it succeeded.
    #[arg(long, short = 'w')]
    pub wait: bool,
}

fn parse_restart(s: &str) -> std::result::Result<RestartPolicy, String> {
    RestartPolicy::parse(s.trim()).ok_or_else(|| format!("expected never or on-failure, got `{s}`"))
}

fn parse_locality(s: &str) -> std::result::Result<Locality, String> {
    Locality::parse(s.trim())
        .ok_or_else(|| format!("expected any, same-pool or same-region, got `{s}`"))
}

fn parse_state(s: &str) -> std::result::Result<JobState, String> {
    JobState::parse(&s.trim().to_ascii_lowercase()).ok_or_else(|| {
        let all: Vec<&str> = JobState::ALL.iter().map(|s| s.as_str()).collect();
        format!("unknown state `{s}`; one of: {}", all.join(", "))
    })
}

fn job_id(s: &str) -> Result<JobId> {
    JobId::parse(s.trim(), "job id").map_err(|e| anyhow!("{e}"))
}

/// Runs one `flotilla jobs` action.
pub async fn dispatch(ctx: &Ctx, command: JobsCommand) -> Result<ExitCode> {
    match command {
        JobsCommand::Submit(args) => submit(ctx, *args).await,
        JobsCommand::List { all, state } => list(ctx, all, state).await,
        JobsCommand::Show { id } => show(ctx, &id).await,
        JobsCommand::Queue => queue(ctx).await,
        JobsCommand::Cancel { id } => cancel(ctx, &id).await,
        JobsCommand::Logs { id, rank, follow } => logs(ctx, &id, rank, follow).await,
    }
}

async fn submit(ctx: &Ctx, args: SubmitArgs) -> Result<ExitCode> {
    let gpus = args.work.gpus;
    let req = CreateJob::from_member(
        args.work.into_request(),
        gpus,
        Some(args.nodes),
        args.restart,
        args.max_retries,
        args.locality,
        args.time_limit_s,
    );
    let job = ctx.client.create_job(&req).await?;
    if !args.wait {
        if ctx.json {
            print_answer(&job)?;
        } else {
            outln!("{}", job.id)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!("{} submitted; waiting for it to end", job.id);
    let mut last = (job.state, job.attempts);
    loop {
        let j = ctx.client.job(&job.id).await?;
        if (j.state, j.attempts) != last {
            eprintln!(
                "{} {} (attempt {}): {}",
                j.id,
                j.state.as_str(),
                j.attempts,
                one_line(&j.state_reason)
            );
            last = (j.state, j.attempts);
        }
        if j.state.is_terminal() {
            if ctx.json {
                print_answer(&j)?;
            } else {
                outln!("{} {}", j.id, j.state.as_str())?;
            }
            return Ok(if j.state == JobState::Succeeded {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            });
        }
        // Work the pool can never hold waits forever: say so and stop
        // waiting (the job stays queued, for a pool that may grow).
        if crate::queue::unschedulable(&j.state_reason) {
            eprintln!(
                "{}: {}; it stays queued (cancel it with `flotilla jobs cancel {}`)",
                j.id,
                one_line(&j.state_reason),
                j.id
            );
            return Ok(ExitCode::from(3));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `4xH100 (2x2)`: total GPUs, then members x GPUs per member.
async fn list(ctx: &Ctx, all: bool, state: Option<JobState>) -> Result<ExitCode> {
    let hide_final = !all && state.is_none();
    let mut shown = ctx.client.jobs(state).await?;
    if hide_final {
        shown.retain(|j| !j.state.is_terminal());
    }
    if ctx.json {
        print_answer(&shown)?;
        return Ok(ExitCode::SUCCESS);
    }
    let now = Utc::now();
    let mut t = table(["ID", "NAME", "STATE", "GPUS", "ATTEMPTS", "AGE", "REASON"]);
    for j in shown {
        t.add_row([
            j.id.to_string(),
            j.spec.name.clone().unwrap_or_else(|| "-".into()),
            j.state.as_str().to_string(),
            crate::output::job_gpus(&j),
            j.attempts.to_string(),
            age(now, j.created_at),
            one_line(&j.state_reason),
        ]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}

async fn get(ctx: &Ctx, id: &str) -> Result<Job> {
    Ok(ctx.client.job(&job_id(id)?).await?)
}

/// The lines `flotilla jobs show` and `flotilla explain JOB` print.
fn describe(j: &Job) -> Vec<String> {
    let s = &j.spec;
    let mut out = vec![
        format!("{} is {}: {}", j.id, j.state.as_str(), j.state_reason),
        format!(
            "asked for: {} GPU(s) of {} as {} member(s) of {}, {} milli-CPU and {} MiB each, tier {}, priority {}, {}preemptible, billed {}",
            s.gpus,
            if s.gpu_types.is_empty() { "any model".to_string() } else { s.gpu_types.join(" or ") },
            s.nodes,
            s.gpus_per_member(),
            s.cpu_milli,
            s.memory_mb,
            s.tier,
            s.priority,
            if s.preemptible { "" } else { "not " },
            s.billing_class.as_str()
        ),
        format!(
            "locality: {}; time limit: {}; restart: {} (max retries {}); attempts {}, failures {}{}",
            s.locality.as_str(),
            s.time_limit_s.map_or("none".to_string(), |t| format!("{t} s")),
            s.restart_policy.as_str(),
            s.max_retries,
            j.attempts,
            j.failures,
            if j.cancel_requested { "; cancel requested" } else { "" }
        ),
        format!("command: {}", s.command.join(" ")),
    ];
    if j.members.is_empty() {
        out.push("members: none placed yet; the gang is placed whole or not at all".into());
    } else {
        out.push("members:".into());
        for m in &j.members {
            out.push(format!(
                "  attempt {} rank {}  {}  {:<9}  {}{}",
                m.attempt,
                m.rank,
                m.instance_id,
                m.state.as_str(),
                m.node_id
                    .as_ref()
                    .map_or("-".to_string(), |n| n.to_string()),
                m.exit_code.map_or(String::new(), |c| format!("  exit {c}"))
            ));
        }
    }
    crate::output::history(
        &mut out,
        j.events
            .iter()
            .map(|e| (e.at, e.state.as_str(), &*e.reason)),
    );
    out
}

async fn show(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    let j = get(ctx, id).await?;
    if ctx.json {
        print_answer(&j)?;
        return Ok(ExitCode::SUCCESS);
    }
    for line in describe(&j) {
        outln!("{line}")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `flotilla explain JOB_ID`: why a job waits, where its members went.
pub async fn explain(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    show(ctx, id).await
}

async fn queue(ctx: &Ctx) -> Result<ExitCode> {
    work_queue(ctx, ctx.client.job_queue().await?, queue_row)
}

async fn cancel(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    let job = ctx.client.cancel_job(&job_id(id)?).await?;
    end_work(ctx, &job, "stopping its members", |j: &Job| {
        (j.id.to_string(), j.state.as_str(), j.state.is_terminal())
    })
}

async fn logs(ctx: &Ctx, id: &str, rank: u32, follow_it: bool) -> Result<ExitCode> {
    let j = get(ctx, id).await?;
    if rank >= j.spec.nodes {
        bail!(
            "rank {rank} is out of range: {} has ranks 0..{}",
            j.id,
            j.spec.nodes
        );
    }
    let Some(member) = j
        .members
        .iter()
        .filter(|m| m.rank == rank)
        .max_by_key(|m| m.attempt)
    else {
        bail!(
            "{} has not started yet ({}): no output",
            j.id,
            one_line(&j.state_reason)
        );
    };
    instance_logs(ctx, member.instance_id.as_str(), follow_it).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restart_and_state_names_parse() {
        assert_eq!(parse_restart("on-failure"), Ok(RestartPolicy::OnFailure));
        assert_eq!(parse_restart("never"), Ok(RestartPolicy::Never));
        assert!(parse_restart("always").unwrap_err().contains("on-failure"));
        assert_eq!(parse_state("Queued"), Ok(JobState::Queued));
        assert!(parse_state("done").is_err());
        assert_eq!(parse_locality("same-region"), Ok(Locality::SameRegion));
        assert!(parse_locality("rack").is_err());
        assert!(job_id("inst_01jd3x7k2q9v8m4n6p5r0s1t2w").is_err());
    }
}
