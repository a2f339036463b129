//! Jobs: submit (quota-checked), list, get, cancel, and the job queue.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use flotilla_core::api::{Job, JobQueueEntry, Page};
use flotilla_core::id::JobId;
use flotilla_core::job::{CreateJob, JobState};

use super::work::{self, WORK_ROLES};
use crate::auth::Caller;
use crate::error::ApiResult;
use crate::extract::{ApiJson, Pagination};
use crate::state::AppState;

/// Jobs of the caller's tenant (operators: all), optionally in one state.
#[utoipa::path(get, path = "/v1/jobs", tag = "jobs",
    params(("limit" = Option<u32>, Query, description = "page size, 1-1000"), ("cursor" = Option<String>, Query, description = "from next_cursor"),
           ("state" = Option<JobState>, Query, description = "only jobs in this state")),
    responses((status = 200, body = Page<Job>)))]
pub async fn list_jobs(
    State(st): State<AppState>,
    caller: Caller,
    p: Pagination,
    uri: axum::http::Uri,
) -> ApiResult<Json<Page<Job>>> {
    work::list(&st, &caller, &p, &uri).await
}

/// Submits a job: `nodes` members (ranks) of `gpus / nodes` GPUs each,
/// placed all together or not at all. It starts `queued`; each member runs
/// the command with `FLOTILLA_JOB_ID`, `FLOTILLA_JOB_RANK`,
/// `FLOTILLA_JOB_WORLD_SIZE`, `FLOTILLA_JOB_ATTEMPT` and
/// `FLOTILLA_JOB_NODES` (node names by rank) set.
#[utoipa::path(post, path = "/v1/jobs", tag = "jobs", request_body = CreateJob,
    params(("Idempotency-Key" = Option<String>, Header, description = "replays the first answer for a retried request")),
    responses((status = 201, body = Job), (status = 422, body = flotilla_core::api::ErrorBody), (status = 403, body = flotilla_core::api::ErrorBody)))]
pub async fn create_job(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(mut req): ApiJson<CreateJob>,
) -> ApiResult<(StatusCode, Json<Job>)> {
    caller.require(&WORK_ROLES, "submit jobs")?;
    // Per member: `gpus` is the whole job's (validation refuses an uneven split).
    let ask = crate::request_defaults::Ask {
        gpus: req.gpus / req.nodes.unwrap_or(1).max(1),
        gpu_types: &req.gpu_types,
        gpu_fraction: req.gpu_fraction,
        mig_profile: req.mig_profile.as_deref(),
    };
    crate::request_defaults::fill(&st, ask, &mut req.cpu_milli, &mut req.memory_mb).await?;
    let spec = req.validate(st.catalog())?;
    super::instances::mig_mode_available(&st, &spec.share(st.catalog()), &spec.gpu_types).await?;
    let (t, r) = st.ids();
    let id = JobId::generate(t, r);
    let job = st
        .store()
        .create_job(&id, &caller.tenant_id, &spec, st.now())
        .await?;
    tracing::info!(job = %job.id, tenant = %job.tenant_id, gpus = spec.gpus, nodes = spec.nodes, "job submitted");
    // For the pass; no node runs it yet.
    st.notify_control();
    Ok((StatusCode::CREATED, Json(job)))
}

/// One job with every attempt's members and its events.
#[utoipa::path(get, path = "/v1/jobs/{job_id}", tag = "jobs",
    params(("job_id" = String, Path, description = "job id (job_…)")),
    responses((status = 200, body = Job), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn get_job(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<Job>> {
    Ok(Json(work::visible(&st, &caller, &raw).await?))
}

/// Cancels a job. A queued one ends `cancelled` at once; a running one's
/// members are stopped (SIGTERM, a grace period, SIGKILL) and it ends
/// `cancelled` once they have. 409 when it already ended.
#[utoipa::path(post, path = "/v1/jobs/{job_id}/cancel", tag = "jobs",
    params(("job_id" = String, Path, description = "job id (job_…)"),
           ("Idempotency-Key" = Option<String>, Header, description = "replays the first answer for a retried request")),
    responses((status = 200, body = Job), (status = 404, body = flotilla_core::api::ErrorBody), (status = 409, body = flotilla_core::api::ErrorBody)))]
pub async fn cancel_job(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<Job>> {
    work::end(&st, &caller, &raw).await
}

/// Queued jobs of the caller's tenant (operators: all) in the order the
/// scheduler tries them, the same order as `GET /v1/queue` (instances and
/// jobs share one queue: priority, then fair share across tenants, then
/// FIFO). `position` counts every piece of work ahead; `state_reason` says
/// why the gang is not placed yet. Read whole, so there is never a next
/// page.
#[utoipa::path(get, path = "/v1/jobs/queue", tag = "jobs",
    responses((status = 200, body = Page<JobQueueEntry>)))]
pub async fn job_queue(
    State(st): State<AppState>,
    caller: Caller,
) -> ApiResult<Json<Page<JobQueueEntry>>> {
    work::queue(&st, &caller, |position, job| JobQueueEntry {
        position,
        job,
    })
    .await
}
