//! Nodes: visible to operators and to the tenant (provider) that owns them.

use axum::extract::{Path, State};
use axum::Json;
use flotilla_core::api::{Node, Page};
use flotilla_core::id::NodeId;

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
