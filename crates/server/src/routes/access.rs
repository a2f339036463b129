//! Sessions into running instances over WebSockets: `exec` (a command, or
//! with `tty` an interactive shell), `port-forward` and `ssh` (an SSH
//! connection, see [`crate::ssh`]) for tenants, and the agent's dial-back.
//! See [`crate::access`] for how the two meet, and `docs/access.md` for
//! the frames they carry.
//!
//! A tenant reaches only its own running instances (another tenant's are
//! 404, like every other route); each opening is written to the audit log
//! by the audit layer, refusals included.

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Response};
use flotilla_core::access::{AccessKind, Frame};
use flotilla_core::id::{AccessSessionId, NodeId};
use flotilla_core::tenant::Role;
use futures::SinkExt as _;
use serde::Deserialize;

use super::path_id;
use super::work::WORK_ROLES;
use crate::access::{running_node, splice, NOT_DIALLED};
use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::serde_urlencoded_query;
use crate::state::AppState;

/// The upgrade, or why the request is not one: a plain GET is told so
/// only after it was found allowed (a stranger's instance stays 404).
type Upgrade = Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>;

#[derive(Deserialize)]
struct ExecQuery {
    command: Option<String>,
    tty: Option<bool>,
    cols: Option<u16>,
    rows: Option<u16>,
}

#[derive(Deserialize)]
struct PortQuery {
    port: Option<String>,
}

/// Runs a command inside a running instance, as its workload's user, in
/// its working directory, with its environment: a WebSocket of binary
/// frames (standard input in; standard output, standard error and the exit
/// code out; with `tty=true` one terminal stream and resizes). See
/// `docs/access.md` for the frames.
#[utoipa::path(get, path = "/v1/instances/{instance_id}/exec", tag = "instances",
    params(("instance_id" = String, Path, description = "instance id (inst_…)"),
           ("command" = String, Query, description = "program and arguments, as a JSON array of strings"),
           ("tty" = Option<bool>, Query, description = "run it on a pseudo-terminal (an interactive shell)"),
           ("cols" = Option<u16>, Query, description = "the terminal's initial width"),
           ("rows" = Option<u16>, Query, description = "the terminal's initial height")),
    responses((status = 101, description = "switched to a WebSocket of session frames"),
              (status = 404, body = flotilla_core::api::ErrorBody),
              (status = 409, body = flotilla_core::api::ErrorBody)))]
pub async fn exec(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    RawQuery(query): RawQuery,
    ws: Upgrade,
) -> ApiResult<Response> {
    // Another tenant's instance is 404 whatever else the request says.
    let inst = super::instances::visible(&st, &caller, &raw).await?;
    let q: ExecQuery = serde_urlencoded_query(query.as_deref())?;
    let command = q
        .command
        .ok_or_else(|| ApiError::bad_request("command", "is required"))?;
    let command: Vec<String> = serde_json::from_str(&command)
        .map_err(|_| ApiError::bad_request("command", "must be a JSON array of strings"))?;
    let kind = AccessKind::Exec {
        command,
        tty: q.tty.unwrap_or(false),
        cols: q.cols.unwrap_or(80),
        rows: q.rows.unwrap_or(24),
    };
    open(st, caller, inst, kind, ws).await
}

/// A TCP stream to `port` on the loopback address inside a running
/// instance (its network namespace; a container's own address), carried
/// over a WebSocket of binary frames.
#[utoipa::path(get, path = "/v1/instances/{instance_id}/port-forward", tag = "instances",
    params(("instance_id" = String, Path, description = "instance id (inst_…)"),
           ("port" = u16, Query, description = "the instance's port, 1-65535")),
    responses((status = 101, description = "switched to a WebSocket of session frames"),
              (status = 404, body = flotilla_core::api::ErrorBody),
              (status = 409, body = flotilla_core::api::ErrorBody)))]
pub async fn port_forward(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    RawQuery(query): RawQuery,
    ws: Upgrade,
) -> ApiResult<Response> {
    let inst = super::instances::visible(&st, &caller, &raw).await?;
    let q: PortQuery = serde_urlencoded_query(query.as_deref())?;
    let port = q
        .port
        .ok_or_else(|| ApiError::bad_request("port", "is required"))?
        .parse::<u16>()
        .map_err(|_| ApiError::bad_request("port", "must be 1-65535"))?;
    open(st, caller, inst, AccessKind::PortForward { port }, ws).await
}

/// Connects an SSH client to a running instance: after the upgrade, the
/// WebSocket's binary messages carry the bytes of one SSH connection (what
/// `flotilla ssh ID`, an SSH `ProxyCommand`, pipes between `ssh` and the
/// server), and the server is its SSH server (see [`crate::ssh`]). The
/// SSH login takes a key the instance's tenant registered
/// (`/v1/ssh-keys`); commands, shells, `scp`/`sftp` and TCP forwards to
/// the instance's loopback address each become a session like exec's.
#[utoipa::path(get, path = "/v1/instances/{instance_id}/ssh", tag = "instances",
    params(("instance_id" = String, Path, description = "instance id (inst_…)")),
    responses((status = 101, description = "switched to a WebSocket carrying one SSH connection's bytes"),
              (status = 404, body = flotilla_core::api::ErrorBody),
              (status = 409, body = flotilla_core::api::ErrorBody)))]
pub async fn ssh(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
    ws: Upgrade,
) -> ApiResult<Response> {
    let inst = super::instances::visible(&st, &caller, &raw).await?;
    admit(&caller, &inst)?;
    // 503 before the upgrade on a server without a secrets key, which the
    // host key is made from.
    let host_key = crate::ssh::host_key(&st)?;
    let ws = ws.map_err(|e| ApiError::bad_request("upgrade", e.body_text()))?;
    tracing::info!(instance = %inst.id, key = %caller.key_id, "ssh connection opened");
    let door = crate::ssh::Door::new(st, inst.tenant_id, inst.id);
    Ok(ws
        .on_upgrade(move |socket| crate::ssh::serve(door, host_key, socket))
        .into_response())
}

/// Whether `caller` may enter `inst` now: a role that runs work, and an
/// instance that runs (409 otherwise); the node it runs on.
fn admit(caller: &Caller, inst: &flotilla_core::api::Instance) -> ApiResult<NodeId> {
    caller.require(&WORK_ROLES, "enter instances")?;
    running_node(inst).map_err(ApiError::conflict)
}

/// Checks the caller may enter the instance, records the session for the
/// instance's node, wakes the node's sync and, once upgraded, waits for
/// the agent's WebSocket and splices the two.
async fn open(
    st: AppState,
    caller: Caller,
    inst: flotilla_core::api::Instance,
    kind: AccessKind,
    ws: Upgrade,
) -> ApiResult<Response> {
    caller.require(&WORK_ROLES, "enter instances")?;
    // A bad query value is a 400 naming it (as on every GET).
    kind.validate()
        .map_err(|e| ApiError::bad_request(&e.field, e.message))?;
    let node = running_node(&inst).map_err(ApiError::conflict)?;
    let ws = ws.map_err(|e| ApiError::bad_request("upgrade", e.body_text()))?;
    let name = kind.name();
    let dialling = st
        .access()
        .enter(node, inst.id.clone(), kind, st.ids(), || st.notify_change());
    tracing::info!(session = %dialling.id, instance = %inst.id, key = %caller.key_id, kind = name, "access session opened");
    Ok(ws
        .on_upgrade(move |mut tenant| async move {
            match dialling.agent(st.access()).await {
                Some(agent) => splice(tenant, agent).await,
                None => {
                    let end = Frame::Error(NOT_DIALLED.to_string());
                    let _ = tenant.send(Message::Binary(end.encode().into())).await;
                    let _ = tenant.close().await;
                }
            }
        })
        .into_response())
}

/// The agent's end of a session its sync listed: spliced with the
/// tenant's. 404 for a session that is not (or no longer) waiting, or is
/// another node's.
#[utoipa::path(get, path = "/v1/agent/nodes/{node_id}/sessions/{session_id}", tag = "agent",
    params(("node_id" = String, Path, description = "node id (node_…)"),
           ("session_id" = String, Path, description = "session id (acc_…)")),
    responses((status = 101, description = "switched to a WebSocket of session frames"),
              (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn agent_session(
    State(st): State<AppState>,
    caller: Caller,
    Path((raw_node, raw_session)): Path<(String, String)>,
    ws: Upgrade,
) -> ApiResult<Response> {
    let node = path_id(&raw_node, "node_id", NodeId::parse)?;
    let session = path_id(&raw_session, "session_id", AccessSessionId::parse)?;
    let owner = st.store().node(&node).await?.owner_tenant_id;
    if !caller.sees(&owner) {
        return Err(ApiError::not_found("node"));
    }
    caller.require(&[Role::Provider], "serve sessions")?;
    let ws = ws.map_err(|e| ApiError::bad_request("upgrade", e.body_text()))?;
    let tenant = st
        .access()
        .claim(&node, &session)
        .ok_or_else(|| ApiError::not_found("session"))?;
    Ok(ws
        .on_upgrade(move |agent: WebSocket| async move {
            if let Err(agent) = tenant.send(agent) {
                // The tenant left meanwhile.
                let mut agent = agent;
                let _ = agent.close().await;
            }
        })
        .into_response())
}
