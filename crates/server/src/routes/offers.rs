//! A provider's offer of its node: the weekly windows (UTC) when its GPUs
//! are offered. Outside them the node takes no new work, and work running
//! when a window closes is stopped with notice ([`crate::offers`]).

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::Json;
use flotilla_core::id::NodeId;
use flotilla_core::offer::NodeOffer;
use flotilla_core::tenant::Role;

use super::path_id;
use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::parse_json;
use crate::state::AppState;

/// A node the caller owns (operators: any), or 404.
pub(super) async fn own_node(st: &AppState, caller: &Caller, raw: &str) -> ApiResult<NodeId> {
    let id = path_id(raw, "node_id", NodeId::parse)?;
    let owner = st.store().node_owner(&id).await?;
    if !caller.sees(&owner) {
        return Err(ApiError::not_found("node"));
    }
    Ok(id)
}

/// When the node's GPUs are offered (`windows` empty: always).
#[utoipa::path(get, path = "/v1/nodes/{node_id}/offer", tag = "nodes",
    params(("node_id" = String, Path, description = "node id (node_…)")),
    responses((status = 200, body = NodeOffer), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn get_offer(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<NodeOffer>> {
    let id = own_node(&st, &caller, &raw).await?;
    Ok(Json(st.store().node_offer(&id).await?))
}

/// Sets when the node's GPUs are offered (its provider or an operator):
/// `{"windows": [{"days": ["mon", …], "start": "HH:MM", "end": "HH:MM"}]}`
/// in UTC; an `end` at or before `start` runs past midnight; no windows:
/// always offered. Takes effect at the next scheduling pass.
#[utoipa::path(put, path = "/v1/nodes/{node_id}/offer", tag = "nodes", request_body = NodeOffer,
    params(("node_id" = String, Path, description = "node id (node_…)")),
    responses((status = 200, body = NodeOffer), (status = 403, body = flotilla_core::api::ErrorBody),
              (status = 404, body = flotilla_core::api::ErrorBody), (status = 422, body = flotilla_core::api::ErrorBody)))]
pub async fn set_offer(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    body: Bytes,
) -> ApiResult<Json<NodeOffer>> {
    // Another tenant's node is 404 whatever the body: read it only after.
    let id = own_node(&st, &caller, &raw).await?;
    caller.require(&[Role::Provider], "set a node's offer")?;
    let offer: NodeOffer = parse_json(&body)?;
    offer.validate()?;
    st.store().set_node_offer(&id, &offer).await?;
    tracing::info!(node = %id, windows = offer.windows.len(), "node offer set");
    st.notify_change();
    Ok(Json(offer))
}
