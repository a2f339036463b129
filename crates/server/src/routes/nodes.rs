//! Nodes: visible to operators and to the tenant (provider) that owns them.

use axum::extract::{Path, State};
use axum::Json;
use flotilla_core::api::{DrainReport, Node, NodeEvent, Page};
use flotilla_core::id::{GpuId, NodeId};
use flotilla_core::tenant::Role;

use super::{page_req, path_id};
use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::Pagination;
use crate::state::AppState;

/// Nodes the caller may see, with their GPUs.
#[utoipa::path(get, path = "/v1/nodes", tag = "nodes",
    params(("limit" = Option<u32>, Query, description = "page size, 1-1000"), ("cursor" = Option<String>, Query, description = "from next_cursor")),
    responses((status = 200, body = Page<Node>)))]
pub async fn list_nodes(
    State(st): State<AppState>,
    caller: Caller,
    p: Pagination,
) -> ApiResult<Json<Page<Node>>> {
    let page = st.store().list_nodes(&page_req(&p)).await?;
    Ok(Json(Page {
        items: page
            .items
            .into_iter()
            .filter(|n| caller.sees(&n.owner_tenant_id))
            .collect(),
        next_cursor: page.next,
    }))
}

/// One node.
#[utoipa::path(get, path = "/v1/nodes/{node_id}", tag = "nodes",
    params(("node_id" = String, Path, description = "node id (node_…)")),
    responses((status = 200, body = Node), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn get_node(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<Node>> {
    let id = path_id(&raw, "node_id", NodeId::parse)?;
    let node = st.store().node(&id).await?;
    if !caller.sees(&node.owner_tenant_id) {
        return Err(ApiError::not_found("node"));
    }
    Ok(Json(node))
}

/// Roles that may take a node out of and back into placement: besides
/// operators, the provider that owns it (maintenance on its own machine).
const NODE_ADMIN_ROLES: [Role; 2] = [Role::Provider, Role::TenantAdmin];

/// The node a path names, when the caller may administer it.
async fn administered(st: &AppState, caller: &Caller, raw: &str, action: &str) -> ApiResult<Node> {
    let id = path_id(raw, "node_id", NodeId::parse)?;
    let node = st.store().node(&id).await?;
    if !caller.sees(&node.owner_tenant_id) {
        return Err(ApiError::not_found("node"));
    }
    caller.require(&NODE_ADMIN_ROLES, action)?;
    Ok(node)
}

/// Cordons a node: no new work is placed on it; what runs keeps running.
#[utoipa::path(post, path = "/v1/nodes/{node_id}/cordon", tag = "nodes",
    params(("node_id" = String, Path, description = "node id (node_…)")),
    responses((status = 200, body = Node), (status = 403, body = flotilla_core::api::ErrorBody), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn cordon_node(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<Node>> {
    set_cordoned(st, caller, raw, true).await
}

/// Uncordons a node: it takes new work again.
#[utoipa::path(post, path = "/v1/nodes/{node_id}/uncordon", tag = "nodes",
    params(("node_id" = String, Path, description = "node id (node_…)")),
    responses((status = 200, body = Node), (status = 403, body = flotilla_core::api::ErrorBody), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn uncordon_node(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<Node>> {
    set_cordoned(st, caller, raw, false).await
}

async fn set_cordoned(
    st: AppState,
    caller: Caller,
    raw: String,
    cordoned: bool,
) -> ApiResult<Json<Node>> {
    let verb = if cordoned { "cordon" } else { "uncordon" };
    let node = administered(&st, &caller, &raw, &format!("{verb} nodes")).await?;
    let was = node.cordoned;
    st.store().set_node_cordoned(&node.id, cordoned).await?;
    let node = st.store().node(&node.id).await?;
    if was != cordoned {
        let kind = if cordoned { "cordoned" } else { "uncordoned" };
        let message = format!("{kind} by {} key {}", caller.role.as_str(), caller.key_id);
        st.store()
            .add_node_event(&node.id, kind, &message, st.now())
            .await?;
        tracing::info!(node = %node.id, cordoned, "node cordon changed");
        // For the pass; a cordon stops nothing.
        st.notify_control();
    }
    Ok(Json(node))
}

/// Drains a node: cordons it and stops every instance on it (with its
/// grace period). A job whose member was stopped restarts on another node
/// as its restart policy says (`on_failure` with retries left); a plain
/// instance ends `stopped`.
#[utoipa::path(post, path = "/v1/nodes/{node_id}/drain", tag = "nodes",
    params(("node_id" = String, Path, description = "node id (node_…)")),
    responses((status = 200, body = DrainReport), (status = 403, body = flotilla_core::api::ErrorBody), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn drain_node(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<DrainReport>> {
    let node = administered(&st, &caller, &raw, "drain nodes").await?;
    let stopping = st.store().drain_node(&node.id, st.now()).await?;
    tracing::info!(node = %node.id, stopping = stopping.len(), "node drained");
    st.notify_change();
    Ok(Json(DrainReport {
        node: st.store().node(&node.id).await?,
        stopping,
    }))
}

/// Brings a GPU taken out of placement by a fault back (after the board
/// was checked or replaced). Operators only: a fault protects tenants'
/// work. A GPU whose agent still reports the fault goes out again.
#[utoipa::path(post, path = "/v1/nodes/{node_id}/gpus/{gpu_id}/reset", tag = "nodes",
    params(("node_id" = String, Path, description = "node id (node_…)"), ("gpu_id" = String, Path, description = "gpu id (gpu_…)")),
    responses((status = 200, body = Node), (status = 403, body = flotilla_core::api::ErrorBody), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn reset_gpu(
    State(st): State<AppState>,
    caller: Caller,
    Path((raw, raw_gpu)): Path<(String, String)>,
) -> ApiResult<Json<Node>> {
    let id = path_id(&raw, "node_id", NodeId::parse)?;
    let gpu = path_id(&raw_gpu, "gpu_id", GpuId::parse)?;
    let node = st.store().node(&id).await?;
    // Another tenant's node is not found, whatever the role.
    if !caller.sees(&node.owner_tenant_id) {
        return Err(ApiError::not_found("node"));
    }
    caller.require(&[Role::Operator], "reset gpus")?;
    if !node.gpus.iter().any(|g| g.id == gpu) {
        return Err(ApiError::not_found("gpu"));
    }
    if st.store().set_gpu_fault(&id, &gpu, None, st.now()).await? {
        st.notify_control();
    }
    Ok(Json(st.store().node(&id).await?))
}

/// A node's events, oldest first: GPU faults and resets, cordons, drains,
/// unreachability.
#[utoipa::path(get, path = "/v1/nodes/{node_id}/events", tag = "nodes",
    params(("node_id" = String, Path, description = "node id (node_…)"),
        ("limit" = Option<u32>, Query, description = "page size, 1-1000"), ("cursor" = Option<String>, Query, description = "from next_cursor")),
    responses((status = 200, body = Page<NodeEvent>), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn node_events(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    p: Pagination,
) -> ApiResult<Json<Page<NodeEvent>>> {
    let id = path_id(&raw, "node_id", NodeId::parse)?;
    let node = st.store().node(&id).await?;
    if !caller.sees(&node.owner_tenant_id) {
        return Err(ApiError::not_found("node"));
    }
    let req = page_req(&p);
    let after: u64 = match req.after.as_deref() {
        None => 0,
        Some(c) => c
            .parse()
            .map_err(|_| ApiError::bad_request("cursor", "not a cursor of this list"))?,
    };
    let limit = req.limit;
    let mut items = st.store().node_events(&id, after, limit + 1).await?;
    let next_cursor = if items.len() > limit as usize {
        items.truncate(limit as usize);
        items.last().map(|e| e.seq.to_string())
    } else {
        None
    };
    Ok(Json(Page { items, next_cursor }))
}
