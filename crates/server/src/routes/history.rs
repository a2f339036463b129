//! `GET /v1/history/demand`: the cluster's recorded demand of a window and
//! the machines of its pool, for `flotilla simulate --from-history` to
//! replay through the scheduling pass under other settings. Operators
//! only: it lists every tenant's work.

use axum::extract::State;
use axum::Json;
use chrono::Duration;
use flotilla_core::history::{DemandHistory, RecordedNode, RecordedWork};
use flotilla_core::node::RuntimeKind;
use flotilla_core::placement::GpuShare;
use flotilla_store::history::RecordedInstance;
use flotilla_store::PageReq;
use serde::Deserialize;

use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::{required_instant, serde_urlencoded_query};
use crate::state::AppState;

/// The longest window one call reads.
const MAX_WINDOW_DAYS: i64 = 92;

#[derive(Debug, Deserialize)]
struct Window {
    from: Option<String>,
    to: Option<String>,
}

/// Thousandths of a GPU one GPU of `share` takes, as the scheduling pass
/// counts it (a MIG slice by the larger of its compute and memory parts).
fn milli_of(share: &GpuShare) -> u32 {
    match share {
        GpuShare::Whole => 1000,
        GpuShare::Fraction { milli } => u32::from(*milli),
        GpuShare::Mig(p) => {
            u32::from(flotilla_sched::pass::mig_milli(p.compute_slices, p.memory_slices).0)
        }
    }
}

fn from_instance(r: RecordedInstance) -> RecordedWork {
    let i = r.instance;
    RecordedWork {
        id: i.id.into(),
        tenant_id: i.tenant_id,
        members: 1,
        gpus: i.gpus,
        gpu_milli: milli_of(&r.share),
        mig: matches!(r.share, GpuShare::Mig(_)),
        gpu_types: i.gpu_types,
        cpu_milli: i.cpu_milli,
        memory_mb: i.memory_mb,
        tier: i.tier,
        priority: i.priority,
        preemptible: i.preemptible,
        runtime: RuntimeKind::for_work(i.image.is_some()),
        submitted_at: i.created_at,
        started_at: r.placed_at,
        finished_at: i.finished_at,
        gpu_model: i.gpu_model,
    }
}

#[utoipa::path(get, path = "/v1/history/demand", tag = "nodes",
    params(("from" = String, Query, description = "RFC 3339 start, inclusive"),
           ("to" = String, Query, description = "RFC 3339 end, exclusive; at most 92 days after from")),
    responses((status = 200, body = DemandHistory),
              (status = 400, body = flotilla_core::api::ErrorBody),
              (status = 403, body = flotilla_core::api::ErrorBody)))]
pub async fn demand(
    State(st): State<AppState>,
    caller: Caller,
    uri: axum::http::Uri,
) -> ApiResult<Json<DemandHistory>> {
    caller.require(&[], "read the cluster's demand history")?;
    let q: Window = serde_urlencoded_query(uri.query())?;
    let from = required_instant(q.from.as_deref(), "from")?;
    let to = required_instant(q.to.as_deref(), "to")?;
    if from >= to {
        return Err(ApiError::bad_request("to", "must be after from"));
    }
    if to - from > Duration::days(MAX_WINDOW_DAYS) {
        return Err(ApiError::bad_request(
            "to",
            format!("the window may be at most {MAX_WINDOW_DAYS} days"),
        ));
    }
    let (instances, jobs) = st.store().recorded_demand(from, to).await?;
    let mut works: Vec<RecordedWork> = instances.into_iter().map(from_instance).collect();
    for j in jobs {
        let share = j.spec.share(st.catalog());
        works.push(RecordedWork {
            id: j.id.into(),
            tenant_id: j.tenant_id,
            members: j.spec.nodes.max(1),
            gpus: j.spec.gpus_per_member(),
            gpu_milli: milli_of(&share),
            mig: matches!(share, GpuShare::Mig(_)),
            gpu_types: j.spec.gpu_types.clone(),
            cpu_milli: j.spec.cpu_milli,
            memory_mb: j.spec.memory_mb,
            tier: j.spec.tier,
            priority: j.spec.priority,
            preemptible: j.spec.preemptible,
            runtime: RuntimeKind::for_work(j.spec.image.is_some()),
            submitted_at: j.created_at,
            started_at: j.started_at,
            finished_at: j.finished_at,
            gpu_model: None,
        });
    }
    works.sort_by(|a, b| (a.submitted_at, a.id.as_str()).cmp(&(b.submitted_at, b.id.as_str())));
    let mut nodes = Vec::new();
    let mut after = None;
    loop {
        let page = st.store().list_nodes(&PageReq::new(after, 1000)).await?;
        for n in page.items {
            nodes.push(RecordedNode {
                name: n.name,
                region: n.region,
                pool: n.pool,
                runtime: n.runtime,
                cpu_milli: n.cpu_milli,
                memory_mb: n.memory_mb,
                mig: n.gpus.iter().map(|g| g.mig_mode).collect(),
                gpus: n.gpus.into_iter().map(|g| g.model).collect(),
            });
        }
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    Ok(Json(DemandHistory {
        from,
        to,
        works,
        nodes,
        placement_policy: st.config().placement_policy.name().to_string(),
    }))
}
