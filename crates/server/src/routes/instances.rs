//! Instances: create (quota-checked), list, get, stop, logs (with follow).

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use flotilla_core::api::{Instance, LogLine, Page, QueueEntry};
use flotilla_core::id::InstanceId;
use flotilla_core::instance::{CreateInstance, InstanceState};
use flotilla_core::placement::GpuShare;
use flotilla_core::FieldError;
use serde::Deserialize;

use super::work::{self, WORK_ROLES};
use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::{serde_urlencoded_query, ApiJson, Pagination};
use crate::state::AppState;

/// Instances of the caller's tenant (operators: all), optionally in one state.
#[utoipa::path(get, path = "/v1/instances", tag = "instances",
    params(("limit" = Option<u32>, Query, description = "page size, 1-1000"), ("cursor" = Option<String>, Query, description = "from next_cursor"),
           ("state" = Option<InstanceState>, Query, description = "only instances in this state")),
    responses((status = 200, body = Page<Instance>)))]
pub async fn list_instances(
    State(st): State<AppState>,
    caller: Caller,
    p: Pagination,
    uri: axum::http::Uri,
) -> ApiResult<Json<Page<Instance>>> {
    work::list(&st, &caller, &p, &uri).await
}

/// Rents GPUs and runs a command on them. The instance starts `pending`;
/// the scheduler places it on a node with enough free GPUs of an allowed
/// model, or leaves it pending with the reason in `state_reason`.
#[utoipa::path(post, path = "/v1/instances", tag = "instances", request_body = CreateInstance,
    params(("Idempotency-Key" = Option<String>, Header, description = "replays the first answer for a retried request")),
    responses((status = 201, body = Instance), (status = 422, body = flotilla_core::api::ErrorBody), (status = 403, body = flotilla_core::api::ErrorBody)))]
pub async fn create_instance(
    State(st): State<AppState>,
    caller: Caller,
    ApiJson(mut req): ApiJson<CreateInstance>,
) -> ApiResult<(StatusCode, Json<Instance>)> {
    caller.require(&WORK_ROLES, "create instances")?;
    let ask = crate::request_defaults::Ask {
        gpus: req.gpus,
        gpu_types: &req.gpu_types,
        gpu_fraction: req.gpu_fraction,
        mig_profile: req.mig_profile.as_deref(),
    };
    crate::request_defaults::fill(&st, ask, &mut req.cpu_milli, &mut req.memory_mb).await?;
    let spec = req.validate(st.catalog())?;
    mig_mode_available(&st, &spec.share, &spec.gpu_types).await?;
    // A hard-capped budget refuses new spot/preemptible work (never tier 1).
    crate::budgets::admit_instance(&st, &caller.tenant_id, &spec).await?;
    let (t, r) = st.ids();
    let id = InstanceId::generate(t, r);
    let inst = st
        .store()
        .create_instance(&id, &caller.tenant_id, &spec, st.now())
        .await?;
    tracing::info!(instance = %inst.id, tenant = %inst.tenant_id, gpus = inst.gpus, "instance created");
    // For the pass; no node runs it yet.
    st.notify_control();
    Ok((StatusCode::CREATED, Json(inst)))
}

/// A MIG profile needs a GPU in MIG mode: when no registered GPU of the
/// models offering the profile is in MIG mode, the request could never be
/// placed (MIG mode is node configuration an operator sets, not something
/// the scheduler can change), so it is refused, naming `mig_profile`, rather
/// than left pending forever.
pub(crate) async fn mig_mode_available(
    st: &AppState,
    share: &GpuShare,
    gpu_types: &[String],
) -> ApiResult<()> {
    let GpuShare::Mig(profile) = share else {
        return Ok(());
    };
    let snapshot = st.store().placement_snapshot().await?;
    let any = snapshot
        .iter()
        .flat_map(|n| &n.gpus)
        .any(|g| g.mig_mode && gpu_types.contains(&g.model));
    if any {
        return Ok(());
    }
    Err(FieldError::new(
        "mig_profile",
        format!(
            "no {} GPU is in MIG mode, so no MIG instance `{}` can be placed; ask for whole GPUs or a gpu_fraction instead",
            gpu_types.join(" or "),
            profile.name
        ),
    )
    .into())
}

/// Pending instances of the caller's tenant (operators: all) in the order
/// the scheduler tries them: priority, then fair share across tenants, then
/// FIFO. `position` counts every tenant's work ahead; `state_reason` says
/// why each is not placed yet. The queue is read whole (the scheduler looks
/// at the oldest 500 pending instances), so there is never a next page.
#[utoipa::path(get, path = "/v1/queue", tag = "instances",
    responses((status = 200, body = Page<QueueEntry>)))]
pub async fn list_queue(
    State(st): State<AppState>,
    caller: Caller,
) -> ApiResult<Json<Page<QueueEntry>>> {
    // Jobs are listed by GET /v1/jobs/queue; they count in positions.
    work::queue(&st, &caller, |position, instance| QueueEntry {
        position,
        instance,
    })
    .await
}

pub(crate) async fn visible(st: &AppState, caller: &Caller, raw: &str) -> ApiResult<Instance> {
    work::visible(st, caller, raw).await
}

/// One instance with its lifecycle events.
#[utoipa::path(get, path = "/v1/instances/{instance_id}", tag = "instances",
    params(("instance_id" = String, Path, description = "instance id (inst_…)")),
    responses((status = 200, body = Instance), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn get_instance(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<Instance>> {
    Ok(Json(visible(&st, &caller, &raw).await?))
}

/// Stops an instance: SIGTERM, a grace period, then SIGKILL. A pending
/// one stops at once. 409 when it already ended.
#[utoipa::path(post, path = "/v1/instances/{instance_id}/stop", tag = "instances",
    params(("instance_id" = String, Path, description = "instance id (inst_…)"),
           ("Idempotency-Key" = Option<String>, Header, description = "replays the first answer for a retried request")),
    responses((status = 200, body = Instance), (status = 404, body = flotilla_core::api::ErrorBody), (status = 409, body = flotilla_core::api::ErrorBody)))]
pub async fn stop_instance(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<Instance>> {
    work::end(&st, &caller, &raw).await
}

#[derive(Deserialize)]
struct LogQuery {
    since: Option<String>,
    follow: Option<String>,
}

/// Output of an instance. Without `follow`: a page of lines from `since`
/// (or `cursor`); `next_cursor` is the next seq. With `follow=true`: an
/// NDJSON stream of lines that ends when the instance is final and every
/// line was sent.
#[utoipa::path(get, path = "/v1/instances/{instance_id}/logs", tag = "instances",
    params(("instance_id" = String, Path, description = "instance id (inst_…)"),
           ("since" = Option<u64>, Query, description = "first seq to return, at most 2^63-1"),
           ("follow" = Option<bool>, Query, description = "stream as NDJSON until the instance ends"),
           ("limit" = Option<u32>, Query, description = "page size, 1-1000"), ("cursor" = Option<String>, Query, description = "from next_cursor")),
    responses((status = 200, description = "a page, or with follow=true an application/x-ndjson stream of LogLine, one a line",
               content((Page<LogLine> = "application/json"), (LogLine = "application/x-ndjson"))),
              (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn instance_logs(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    p: Pagination,
    uri: axum::http::Uri,
) -> ApiResult<Response> {
    let inst = visible(&st, &caller, &raw).await?;
    let q: LogQuery = serde_urlencoded_query(uri.query())?;
    let parse_seq = |s: &str, field: &str| {
        // Sequence numbers are stored as signed 64-bit integers.
        s.parse::<u64>()
            .ok()
            .filter(|n| i64::try_from(*n).is_ok())
            .ok_or_else(|| {
                ApiError::bad_request(
                    field,
                    format!("must be a log sequence number from 0 to {}", i64::MAX),
                )
            })
    };
    let since = match (&q.since, &p.cursor) {
        (Some(s), _) => parse_seq(s, "since")?,
        (None, Some(c)) => parse_seq(c, "cursor")?,
        (None, None) => 0,
    };
    let follow = match q.follow.as_deref() {
        None | Some("false") | Some("0") => false,
        Some("true") | Some("1") => true,
        Some(_) => return Err(ApiError::bad_request("follow", "must be true or false")),
    };
    if !follow {
        let lines = st.store().logs(&inst.id, since, p.limit).await?;
        let next_cursor = (lines.len() == p.limit as usize)
            .then(|| lines.last().map(|l| (l.seq + 1).to_string()))
            .flatten();
        return Ok(Json(Page {
            items: lines,
            next_cursor,
        })
        .into_response());
    }
    let stream = futures::stream::unfold(
        Follow {
            st,
            id: inst.id,
            next: since,
            done: false,
            changes: None,
        },
        Follow::step,
    );
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .map_err(ApiError::internal)
}

/// State of one log follower.
struct Follow {
    st: AppState,
    id: InstanceId,
    next: u64,
    done: bool,
    /// Assignment changes (a stop) and node reports (log lines, exits).
    changes: Option<(
        tokio::sync::watch::Receiver<u64>,
        tokio::sync::watch::Receiver<u64>,
    )>,
}

impl Follow {
    async fn step(mut self) -> Option<(Result<bytes::Bytes, std::io::Error>, Self)> {
        if self.done {
            return None;
        }
        let (mut changes, mut reports) = self
            .changes
            .get_or_insert_with(|| (self.st.subscribe(), self.st.subscribe_control()))
            .clone();
        let mut shutdown = self.st.shutdown_signal();
        loop {
            // Mark seen before reading, so a change after the read wakes us.
            changes.borrow_and_update();
            reports.borrow_and_update();
            let final_state = match self.st.store().instance(&self.id).await {
                Ok(i) => i.state.is_terminal(),
                Err(e) => return Some((Err(std::io::Error::other(e.to_string())), self)),
            };
            let lines = match self.st.store().logs(&self.id, self.next, 500).await {
                Ok(l) => l,
                Err(e) => return Some((Err(std::io::Error::other(e.to_string())), self)),
            };
            if !lines.is_empty() {
                let mut buf = Vec::with_capacity(lines.len() * 64);
                for l in &lines {
                    if serde_json::to_writer(&mut buf, l).is_ok() {
                        buf.push(b'\n');
                    }
                }
                self.next = lines.last().map_or(self.next, |l| l.seq + 1);
                return Some((Ok(buf.into()), self));
            }
            // The agent pushes every line before it reports the exit, so a
            // final state with nothing left to read means the log is whole.
            if final_state || *shutdown.borrow() {
                self.done = true;
                return None;
            }
            tokio::select! {
                _ = changes.changed() => {}
                _ = reports.changed() => {}
                _ = shutdown.changed() => {}
                _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            }
        }
    }
}
