//! What the instance and job routes share. An instance is work of one
//! member and a job a gang of them; on the API they are two resources with
//! the same life: listed by state, read by id (404 for another tenant's),
//! ended on request, and shown in one queue order. Each resource says what
//! differs in a [`Kind`]; the handlers in `instances` and `jobs` stay one
//! line each, so a rule written here holds for both.

use std::future::Future;

use axum::http::Uri;
use axum::Json;
use flotilla_core::api::{Instance, Job, Page};
use flotilla_core::id::{InstanceId, JobId, NodeId, TenantId, WorkId};
use flotilla_core::instance::InstanceState;
use flotilla_core::job::JobState;
use flotilla_core::tenant::Role;
use flotilla_core::FieldError;
use flotilla_store::{PageOf, PageReq, Store, StoreError};
use serde::Deserialize;

use super::{page, page_req, path_id};
use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::{serde_urlencoded_query, Pagination};
use crate::state::AppState;

/// Who may create, stop and cancel work.
pub(crate) const WORK_ROLES: [Role; 2] = [Role::TenantAdmin, Role::TenantMember];

type StoreResult<T> = Result<T, StoreError>;

/// One resource's way of doing what all work does.
pub(crate) trait Kind: Sized + Send + 'static {
    /// Its id.
    type Id: Clone + Send + Sync + std::fmt::Display;
    /// Its life states.
    type State: Copy + Send + Sync + PartialEq;
    /// Singular noun, as errors and logs say it.
    const NOUN: &'static str;
    /// The path parameter naming it.
    const ID_PARAM: &'static str;
    /// Every state, for the `state` filter's error.
    const STATES: &'static [Self::State];
    /// The state a queued work of this kind is in.
    const WAITING: Self::State;
    /// What ending it on request is called (`stop`, `cancel`).
    const END: &'static str;

    fn parse_id(raw: &str, field: &str) -> Result<Self::Id, FieldError>;
    fn state_name(s: Self::State) -> &'static str;
    fn id(&self) -> &Self::Id;
    fn tenant(&self) -> &TenantId;
    fn state(&self) -> Self::State;
    /// Its id when `q` names a work of this kind.
    fn queued(q: &WorkId) -> Option<&Self::Id>;
    fn load<'a>(
        store: &'a Store,
        id: &'a Self::Id,
    ) -> impl Future<Output = StoreResult<Self>> + Send + 'a;
    fn list<'a>(
        store: &'a Store,
        scope: Option<&'a TenantId>,
        state: Option<Self::State>,
        page: &'a PageReq,
    ) -> impl Future<Output = StoreResult<PageOf<Self>>> + Send + 'a;
    /// The nodes whose assignments ending it changes, when known
    /// (`None`: wake every held sync).
    fn nodes(&self) -> Option<Vec<NodeId>>;
    /// Asks the work to end: a waiting one ends at once, a running one is
    /// stopped with a grace period. A conflict when it already ended.
    fn end<'a>(
        store: &'a Store,
        id: &'a Self::Id,
        now: chrono::DateTime<chrono::Utc>,
    ) -> impl Future<Output = StoreResult<Self>> + Send + 'a;
}

/// A page of the caller's work (operators: everyone's), optionally in one
/// state (`?state=`; an unknown name is a 400 listing the known ones).
pub(crate) async fn list<K: Kind>(
    st: &AppState,
    caller: &Caller,
    p: &Pagination,
    uri: &Uri,
) -> ApiResult<Json<Page<K>>> {
    #[derive(Deserialize)]
    struct Filter {
        state: Option<String>,
    }
    let f: Filter = serde_urlencoded_query(uri.query())?;
    let state = match f.state {
        None => None,
        Some(s) => Some(
            K::STATES
                .iter()
                .copied()
                .find(|k| K::state_name(*k) == s)
                .ok_or_else(|| {
                    let known: Vec<&str> = K::STATES.iter().map(|k| K::state_name(*k)).collect();
                    ApiError::bad_request(
                        "state",
                        format!("unknown state `{s}`; one of {}", known.join(", ")),
                    )
                })?,
        ),
    };
    Ok(page(
        K::list(st.store(), caller.scope(), state, &page_req(p)).await?,
    ))
}

/// The work a path names, when the caller may see it; 404 otherwise, the
/// same answer as for work that does not exist.
pub(crate) async fn visible<K: Kind>(st: &AppState, caller: &Caller, raw: &str) -> ApiResult<K> {
    let id = path_id(raw, K::ID_PARAM, K::parse_id)?;
    let work = K::load(st.store(), &id).await?;
    if !caller.sees(work.tenant()) {
        return Err(ApiError::not_found(K::NOUN));
    }
    Ok(work)
}

/// Ends the work a path names on the caller's request.
pub(crate) async fn end<K: Kind>(st: &AppState, caller: &Caller, raw: &str) -> ApiResult<Json<K>> {
    let work: K = visible(st, caller, raw).await?;
    caller.require(&WORK_ROLES, &format!("{} {}s", K::END, K::NOUN))?;
    let work = K::end(st.store(), work.id(), st.now()).await?;
    tracing::info!(work = %work.id(), state = K::state_name(work.state()), action = K::END, "end requested");
    // Only the syncs of the nodes that hold it need to hear of the stop.
    match work.nodes() {
        Some(nodes) => st.notify_nodes(&nodes),
        None => st.notify_change(),
    }
    Ok(Json(work))
}

/// The caller's queued work of kind `K` in the order the scheduler tries
/// every tenant's work, with its 1-based place in that whole order. Read
/// whole, so there is never a next page.
pub(crate) async fn queue<K: Kind, E>(
    st: &AppState,
    caller: &Caller,
    entry: impl Fn(u32, K) -> E,
) -> ApiResult<Json<Page<E>>> {
    let plan = crate::schedule::current_plan(st).await?;
    let mut items = Vec::new();
    for (i, q) in plan.order.iter().enumerate() {
        let Some(id) = K::queued(q) else { continue };
        let work = match K::load(st.store(), id).await {
            Ok(w) => w,
            // Deleted between the two reads: no longer queued.
            Err(StoreError::NotFound(_)) => continue,
            Err(e) => return Err(e.into()),
        };
        // Placed or ended between the two reads: no longer queued.
        if !caller.sees(work.tenant()) || work.state() != K::WAITING {
            continue;
        }
        items.push(entry(u32::try_from(i + 1).unwrap_or(u32::MAX), work));
    }
    Ok(Json(Page {
        items,
        next_cursor: None,
    }))
}

impl Kind for Instance {
    type Id = InstanceId;
    type State = InstanceState;
    const NOUN: &'static str = "instance";
    const ID_PARAM: &'static str = "instance_id";
    const STATES: &'static [InstanceState] = &InstanceState::ALL;
    const WAITING: InstanceState = InstanceState::Pending;
    const END: &'static str = "stop";

    fn parse_id(raw: &str, field: &str) -> Result<InstanceId, FieldError> {
        InstanceId::parse(raw, field)
    }
    fn state_name(s: InstanceState) -> &'static str {
        s.as_str()
    }
    fn id(&self) -> &InstanceId {
        &self.id
    }
    fn tenant(&self) -> &TenantId {
        &self.tenant_id
    }
    fn state(&self) -> InstanceState {
        self.state
    }
    fn queued(q: &WorkId) -> Option<&InstanceId> {
        match q {
            WorkId::Instance(id) => Some(id),
            WorkId::Job(_) => None,
        }
    }
    fn load<'a>(
        store: &'a Store,
        id: &'a InstanceId,
    ) -> impl Future<Output = StoreResult<Self>> + Send + 'a {
        store.instance(id)
    }
    fn list<'a>(
        store: &'a Store,
        scope: Option<&'a TenantId>,
        state: Option<InstanceState>,
        page: &'a PageReq,
    ) -> impl Future<Output = StoreResult<PageOf<Self>>> + Send + 'a {
        store.list_instances(scope, state, page)
    }
    fn nodes(&self) -> Option<Vec<NodeId>> {
        Some(self.node_id.iter().cloned().collect())
    }
    fn end<'a>(
        store: &'a Store,
        id: &'a InstanceId,
        now: chrono::DateTime<chrono::Utc>,
    ) -> impl Future<Output = StoreResult<Self>> + Send + 'a {
        store.request_stop(id, now)
    }
}

impl Kind for Job {
    type Id = JobId;
    type State = JobState;
    const NOUN: &'static str = "job";
    const ID_PARAM: &'static str = "job_id";
    const STATES: &'static [JobState] = &JobState::ALL;
    const WAITING: JobState = JobState::Queued;
    const END: &'static str = "cancel";

    fn parse_id(raw: &str, field: &str) -> Result<JobId, FieldError> {
        JobId::parse(raw, field)
    }
    fn state_name(s: JobState) -> &'static str {
        s.as_str()
    }
    fn id(&self) -> &JobId {
        &self.id
    }
    fn tenant(&self) -> &TenantId {
        &self.tenant_id
    }
    fn state(&self) -> JobState {
        self.state
    }
    fn nodes(&self) -> Option<Vec<NodeId>> {
        // Its members' nodes are not on the job itself.
        None
    }
    fn queued(q: &WorkId) -> Option<&JobId> {
        match q {
            WorkId::Job(id) => Some(id),
            WorkId::Instance(_) => None,
        }
    }
    fn load<'a>(
        store: &'a Store,
        id: &'a JobId,
    ) -> impl Future<Output = StoreResult<Self>> + Send + 'a {
        store.job(id)
    }
    fn list<'a>(
        store: &'a Store,
        scope: Option<&'a TenantId>,
        state: Option<JobState>,
        page: &'a PageReq,
    ) -> impl Future<Output = StoreResult<PageOf<Self>>> + Send + 'a {
        store.list_jobs(scope, state, page)
    }
    fn end<'a>(
        store: &'a Store,
        id: &'a JobId,
        now: chrono::DateTime<chrono::Utc>,
    ) -> impl Future<Output = StoreResult<Self>> + Send + 'a {
        store.cancel_job(id, now)
    }
}
