//! The job loop: applies `flotilla-core`'s job rule ([`flotilla_core::job::step`])
//! to every running job. A failing member stops the others, a preempted
//! member brings the preemption (and its notice) to every member, and once
//! all members are final the job ends, restarts or is requeued. Placement
//! of queued jobs is the schedule pass's ([`crate::reconcile`]). Every
//! change is conditional on the job's attempt, so a pass may be cut at any
//! line and rerun.

use flotilla_core::id::WorkId;
use flotilla_core::job::{self, JobProgress, JobState, JobStep, MemberStatus};
use flotilla_store::StoreError;

use crate::state::AppState;

fn ms_of(t: chrono::DateTime<chrono::Utc>) -> u64 {
    t.timestamp_millis().max(0) as u64
}

/// One pass over the running jobs. Returns how many changed.
pub async fn jobs_pass(st: &AppState) -> Result<usize, StoreError> {
    let mut changed = 0;
    for rj in st.store().running_jobs().await? {
        let j = &rj.job;
        // The attempt started when its members were placed (created).
        let placed = rj.members.iter().map(|m| m.created_at).min();
        let deadline_ms = match (placed, j.spec.time_limit_s) {
            (Some(at), Some(limit)) => Some(ms_of(at).saturating_add(limit.saturating_mul(1000))),
            _ => None,
        };
        let progress = JobProgress {
            restart_policy: j.spec.restart_policy,
            max_retries: j.spec.max_retries,
            failures: j.failures,
            cancel_requested: j.cancel_requested,
            time_limit_s: j.spec.time_limit_s,
            deadline_ms,
            now_ms: ms_of(st.now()),
        };
        let members: Vec<MemberStatus> = rj
            .members
            .iter()
            .map(|m| MemberStatus {
                rank: m.job.as_ref().map_or(0, |x| x.rank),
                state: m.state,
                stop_requested: m.stop_requested,
                preempted_by: m.preempted_by.as_ref().map(|b| b.to_string()),
                exit_code: m.exit_code,
            })
            .collect();
        let now = st.now();
        match job::step(&progress, &members) {
            JobStep::Wait => {}
            JobStep::Stop { members, reason } => {
                for i in members {
                    let Some(m) = rj.members.get(i) else { continue };
                    match st.store().request_stop(&m.id, now).await {
                        // Ended meanwhile: nothing to stop.
                        Ok(_) | Err(StoreError::Conflict(_)) => {}
                        Err(e) => return Err(e),
                    }
                }
                tracing::info!(job = %j.id, reason, "stopping job members");
                st.store().note_job(&j.id, &reason, now).await?;
                changed += 1;
            }
            JobStep::Preempt { members, by } => {
                let by = WorkId::from_trusted(by);
                for i in members {
                    let Some(m) = rj.members.get(i) else { continue };
                    if st.store().preempt(&m.id, &by, now).await? {
                        tracing::info!(job = %j.id, member = %m.id, by = %by, "job member preempted with its gang");
                    }
                }
                let reason = format!("preempted by {by}: every member got the notice");
                st.store().note_job(&j.id, &reason, now).await?;
                changed += 1;
            }
            JobStep::Requeue { failure, reason } => {
                if st
                    .store()
                    .settle_job(&j.id, j.attempts, JobState::Queued, failure, &reason, now)
                    .await?
                {
                    tracing::info!(job = %j.id, failure, reason, "job requeued");
                    changed += 1;
                }
            }
            JobStep::Finish { state, reason } => {
                if st
                    .store()
                    .settle_job(&j.id, j.attempts, state, false, &reason, now)
                    .await?
                {
                    tracing::info!(job = %j.id, state = state.as_str(), reason, "job ended");
                    changed += 1;
                }
            }
        }
    }
    if changed > 0 {
        st.notify_change();
    }
    Ok(changed)
}
