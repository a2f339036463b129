//! `flotilla queue`: one queue, as the scheduler sees it. Instances and
//! jobs wait in one order (priority, fair share, age), so they are listed
//! together by their position, as the console's queue page shows them;
//! `flotilla jobs queue` still lists the jobs alone.

use std::process::ExitCode;

use anyhow::Result;
use flotilla_core::api::JobQueueEntry;
use serde_json::Value;

use crate::ctx::Ctx;
use crate::output::{age, one_line, outln, print_answer, print_json, print_table, table};

/// The prefix of a waiting reason for work the pool can never hold (more
/// distinct machines or GPUs than it has); the scheduler writes it.
const UNSCHEDULABLE: &str = "unschedulable in this pool";

/// Whether a waiting reason says the pool can never hold the work, so
/// that waiting for it (`--wait`) ends with an error instead of never.
pub(crate) fn unschedulable(reason: &str) -> bool {
    reason.starts_with(UNSCHEDULABLE)
}

/// `flotilla queue`: instances and jobs by position, with why each waits.
/// `--json`: the server's entries, each with `"kind"`: `instance` or `job`.
pub async fn all(ctx: &Ctx) -> Result<ExitCode> {
    let instances = ctx.client.instance_queue().await?;
    let jobs = ctx.client.job_queue().await?;
    let mut entries: Vec<(QueueRow, Value)> = Vec::new();
    for e in instances {
        let raw = serde_json::to_value(&e)?;
        let i = e.instance;
        let row = QueueRow {
            position: e.position,
            gpus: crate::output::instance_gpus(&i),
            id: i.id.to_string(),
            name: i.name,
            priority: i.priority,
            tier: i.tier,
            created_at: i.created_at,
            reason: i.state_reason,
        };
        entries.push((row, with_kind(raw, "instance")));
    }
    for e in jobs {
        let raw = serde_json::to_value(&e)?;
        entries.push((queue_row(e), with_kind(raw, "job")));
    }
    entries.sort_by(|a, b| (a.0.position, &a.0.id).cmp(&(b.0.position, &b.0.id)));
    if ctx.json {
        let raw: Vec<Value> = entries.into_iter().map(|(_, v)| v).collect();
        print_json(&raw)?;
        return Ok(ExitCode::SUCCESS);
    }
    if entries.is_empty() {
        outln!("the queue is empty: no instance or job is waiting for GPUs")?;
        return Ok(ExitCode::SUCCESS);
    }
    print_queue(entries.into_iter().map(|(row, _)| row))?;
    Ok(ExitCode::SUCCESS)
}

fn with_kind(mut raw: Value, kind: &str) -> Value {
    if let Value::Object(o) = &mut raw {
        o.insert("kind".into(), Value::String(kind.into()));
    }
    raw
}

/// One line of a queue as `queue` and `jobs queue` print it.
pub(crate) struct QueueRow {
    pub position: u32,
    pub id: String,
    pub name: Option<String>,
    pub priority: i32,
    pub tier: u8,
    pub gpus: String,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub reason: String,
}

/// Prints a queue the server listed, one row per entry: the entries
/// themselves with `--json`, a table otherwise.
pub(crate) fn work_queue<E: serde::Serialize>(
    ctx: &Ctx,
    entries: Vec<E>,
    row: impl Fn(E) -> QueueRow,
) -> Result<ExitCode> {
    if ctx.json {
        print_answer(&entries)?;
        return Ok(ExitCode::SUCCESS);
    }
    if entries.is_empty() {
        // A bare header reads like a broken command; say what it means.
        outln!("the queue is empty: nothing is waiting for GPUs")?;
        return Ok(ExitCode::SUCCESS);
    }
    print_queue(entries.into_iter().map(row))?;
    Ok(ExitCode::SUCCESS)
}

/// The queue's table: one row per waiting instance or job, in the order
/// given (`queue` and `jobs queue` print the same columns).
pub(crate) fn print_queue(rows: impl IntoIterator<Item = QueueRow>) -> Result<()> {
    let now = chrono::Utc::now();
    let mut t = table(["POS", "ID", "NAME", "PRIO", "TIER", "GPUS", "AGE", "REASON"]);
    for r in rows {
        t.add_row([
            r.position.to_string(),
            r.id,
            r.name.unwrap_or_else(|| "-".into()),
            r.priority.to_string(),
            r.tier.to_string(),
            r.gpus,
            age(now, r.created_at),
            one_line(&r.reason),
        ]);
    }
    print_table(&t)?;
    Ok(())
}

/// A waiting job as a line of the queue (`jobs queue`, `queue`).
pub(crate) fn queue_row(e: JobQueueEntry) -> QueueRow {
    let j = e.job;
    QueueRow {
        position: e.position,
        gpus: crate::output::job_gpus(&j),
        id: j.id.to_string(),
        name: j.spec.name,
        priority: j.spec.priority,
        tier: j.spec.tier,
        created_at: j.created_at,
        reason: j.state_reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedulers_wording_is_recognised() {
        // The text `flotilla_sched::pass::Wait::Unschedulable` describes.
        let w = flotilla_sched::pass::Wait::Unschedulable("nodes: asks 2".into());
        assert!(unschedulable(&w.describe(|_| String::new())));
        assert!(!unschedulable("waiting for GPUs: 0/1 nodes fit"));
    }
}
