//! Node pools grown through a capacity provider: the join handshake of a
//! new machine's agent, and the operators' view of the pools.

use axum::extract::State;
use axum::Json;
use flotilla_core::id::KeyId;
use flotilla_core::nodepool::{JoinNode, Joined, NodePoolView};
use flotilla_core::tenant::Role;
use flotilla_store::keys::NewKey;

use crate::auth::{hash_secret, mint_secret, Caller};
use crate::error::{ApiError, ApiResult};
use crate::extract::ApiJson;
use crate::state::AppState;

/// Trades a one-time join token (what a node-pool machine is booted with)
/// for an agent key of that machine alone, and says the node name and pool
/// it registers under. No bearer key: the token is the credential. A token
/// is good once and until it expires; a used, expired or unknown one is
/// refused with 401 and says which.
#[utoipa::path(post, path = "/v1/agent/join", tag = "agent", request_body = JoinNode, security(()),
    responses((status = 200, body = Joined), (status = 401, body = flotilla_core::api::ErrorBody)))]
pub async fn join(
    State(st): State<AppState>,
    ApiJson(req): ApiJson<JoinNode>,
) -> ApiResult<Json<Joined>> {
    let token = req.token.trim();
    if token.is_empty() {
        return Err(ApiError::bad_request("token", "must not be empty"));
    }
    let hash = hash_secret(token);
    // One budget for every join: guessing tokens is throttled as a whole.
    st.check_rate("agent-join")?;
    let Some(tenant) = st.store().join_token_tenant(&hash).await? else {
        return Err(ApiError::unauthenticated(
            "join token refused: unknown join token",
        ));
    };
    let minted = mint_secret();
    let now = st.now();
    let (t, r) = st.ids();
    let key = NewKey {
        id: KeyId::generate(t, r),
        tenant_id: tenant,
        role: Role::Provider,
        name: "node-pool machine".to_string(),
        prefix: minted.prefix,
        secret_hash: minted.hash,
    };
    match st.store().redeem_join_token(&hash, &key, now).await? {
        Ok(grant) => {
            tracing::info!(machine = %grant.machine, pool = %grant.pool, "join token redeemed");
            Ok(Json(Joined {
                agent_token: minted.secret,
                name: grant.machine,
                pool: grant.pool,
            }))
        }
        Err(refusal) => {
            tracing::warn!(%refusal, "join token refused");
            Err(ApiError::unauthenticated(format!(
                "join token refused: {refusal}"
            )))
        }
    }
}

/// The node pools this server grows and shrinks, with their machines
/// (operators).
#[utoipa::path(get, path = "/v1/node-pools", tag = "nodes",
    responses((status = 200, body = Vec<NodePoolView>), (status = 403, body = flotilla_core::api::ErrorBody)))]
pub async fn list_node_pools(
    State(st): State<AppState>,
    caller: Caller,
) -> ApiResult<Json<Vec<NodePoolView>>> {
    if !caller.is_operator() {
        return Err(ApiError::forbidden("only operators see node pools"));
    }
    let mut out = Vec::new();
    for pool in &st.config().node_pools {
        out.push(crate::nodepools::view(&st, pool).await?);
    }
    Ok(Json(out))
}
