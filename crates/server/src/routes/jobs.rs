//! Jobs: submit (quota-checked), list, get, cancel, and the job queue.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use flotilla_core::api::{Job, JobQueueEntry, Page};
use flotilla_core::id::JobId;
use flotilla_core::job::{CreateJob, JobState};
use flotilla_core::tenant::Role;
use serde::Deserialize;

use super::{page, page_req, path_id};
use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::{serde_urlencoded_query, ApiJson, Pagination};
use crate::schedule::Queued;
use crate::state::AppState;

const WORK_ROLES: [Role; 2] = [Role::TenantAdmin, Role::TenantMember];

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
    #[derive(Deserialize)]
    struct Filter {
        state: Option<String>,
    }
    let f: Filter = serde_urlencoded_query(uri.query())?;
    let state = match f.state {
        None => None,
        Some(s) => Some(JobState::parse(&s).ok_or_else(|| {
            ApiError::bad_request(
                "state",
                format!(
                    "unknown state `{s}`; one of queued, running, succeeded, failed, cancelled"
                ),
            )
        })?),
    };
    Ok(page(
        st.store()
            .list_jobs(caller.scope(), state, &page_req(&p))
            .await?,
    ))
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
    ApiJson(req): ApiJson<CreateJob>,
) -> ApiResult<(StatusCode, Json<Job>)> {
    caller.require(&WORK_ROLES, "submit jobs")?;
    let spec = req.validate(st.catalog())?;
    super::instances::mig_mode_available(&st, &spec.share(st.catalog()), &spec.gpu_types).await?;
    let (t, r) = st.ids();
    let id = JobId::generate(t, r);
    let job = st
        .store()
        .create_job(&id, &caller.tenant_id, &spec, st.now())
        .await?;
    tracing::info!(job = %job.id, tenant = %job.tenant_id, gpus = spec.gpus, nodes = spec.nodes, "job submitted");
    st.notify_change();
    Ok((StatusCode::CREATED, Json(job)))
}

async fn visible(st: &AppState, caller: &Caller, raw: &str) -> ApiResult<Job> {
    let id = path_id(raw, "job_id", JobId::parse)?;
    let job = st.store().job(&id).await?;
    if !caller.sees(&job.tenant_id) {
        return Err(ApiError::not_found("job"));
    }
    Ok(job)
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
    Ok(Json(visible(&st, &caller, &raw).await?))
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
    let job = visible(&st, &caller, &raw).await?;
    caller.require(&WORK_ROLES, "cancel jobs")?;
    let job = st.store().cancel_job(&job.id, st.now()).await?;
    tracing::info!(job = %job.id, state = job.state.as_str(), "cancel requested");
    st.notify_change();
    Ok(Json(job))
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
    let order = crate::schedule::queue_all(&st).await?;
    let mut items = Vec::new();
    for (i, q) in order.iter().enumerate() {
        let Queued::Job(j) = q else { continue };
        if !caller.sees(&j.tenant_id) {
            continue;
        }
        let job = match st.store().job(&j.id).await {
            Ok(job) => job,
            Err(flotilla_store::StoreError::NotFound(_)) => continue,
            Err(e) => return Err(e.into()),
        };
        // Placed or cancelled between the two reads: no longer queued.
        if job.state != JobState::Queued {
            continue;
        }
        items.push(JobQueueEntry {
            position: u32::try_from(i + 1).unwrap_or(u32::MAX),
            job,
        });
    }
    Ok(Json(Page {
        items,
        next_cursor: None,
    }))
}
