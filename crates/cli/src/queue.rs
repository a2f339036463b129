//! `flotilla queue`: one queue, as the scheduler sees it. Instances and
//! jobs wait in one order (priority, fair share, age), so they are listed
//! together by their position, as the console's queue page shows them;
//! `flotilla jobs queue` still lists the jobs alone.

use std::process::ExitCode;

use anyhow::Result;
use flotilla_core::api::{JobQueueEntry, Page, QueueEntry};
use serde_json::Value;

use crate::client::decode;
use crate::commands::{Ctx, QueueRow};
use crate::output::{outln, print_json};

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
    let instances: Page<Value> = ctx.client.get("/v1/queue", &[]).await?;
    let jobs: Page<Value> = ctx.client.get("/v1/jobs/queue", &[]).await?;
    let mut entries: Vec<(QueueRow, Value)> = Vec::new();
    for raw in instances.items {
        let e: QueueEntry = decode(raw.clone())?;
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
    for raw in jobs.items {
        let e: JobQueueEntry = decode(raw.clone())?;
        entries.push((crate::jobs::queue_row(e), with_kind(raw, "job")));
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
    crate::commands::print_queue(entries.into_iter().map(|(row, _)| row))?;
    Ok(ExitCode::SUCCESS)
}

fn with_kind(mut raw: Value, kind: &str) -> Value {
    if let Value::Object(o) = &mut raw {
        o.insert("kind".into(), Value::String(kind.into()));
    }
    raw
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
