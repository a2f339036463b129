//! What an instance's GPUs are doing: the latest driver readings of the
//! GPUs it holds, for its tenant (operators scrape the whole pool at
//! `/metrics`).

use axum::extract::{Path, State};
use axum::Json;
use flotilla_core::advice::InstanceAdvice;
use flotilla_core::api::InstanceTelemetry;

use super::instances::visible;
use crate::auth::Caller;
use crate::error::ApiResult;
use crate::state::AppState;

/// The latest telemetry of the GPUs an instance holds: utilisation,
/// memory, temperature, power and clock, as its node's agent last read
/// them through NVML. Empty while it holds no GPU, on simulated GPUs, or
/// when its node has been silent for longer than the heartbeat timeout.
#[utoipa::path(get, path = "/v1/instances/{instance_id}/telemetry", tag = "instances",
    params(("instance_id" = String, Path, description = "instance id (inst_…)")),
    responses((status = 200, body = InstanceTelemetry), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn instance_telemetry(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<InstanceTelemetry>> {
    let inst = visible(&st, &caller, &raw).await?;
    let mut answer = InstanceTelemetry {
        instance_id: inst.id.clone(),
        node_id: inst.node_id.clone(),
        at: None,
        gpus: Vec::new(),
    };
    // An ended instance's GPUs may already serve someone else.
    let holds = !inst.state.is_terminal() && !inst.gpu_ids.is_empty();
    let Some(node_id) = inst.node_id.as_ref().filter(|_| holds) else {
        return Ok(Json(answer));
    };
    let Some(reading) = st.fresh_telemetry().remove(node_id) else {
        return Ok(Json(answer));
    };
    let node = st.store().node(node_id).await?;
    let held: Vec<_> = node
        .gpus
        .iter()
        .filter(|g| inst.gpu_ids.contains(&g.id))
        .collect();
    answer.gpus = reading
        .gpus
        .into_iter()
        .filter(|s| held.iter().any(|g| g.index == s.index && g.uuid == s.uuid))
        .collect();
    answer.at = (!answer.gpus.is_empty()).then_some(reading.at);
    Ok(Json(answer))
}

/// Utilisation summary (mean and p95 GPU utilisation, peak memory, idle
/// fraction) of an instance's GPUs, and a right-sizing recommendation with
/// its hourly cost effect at the catalog's list prices.
#[utoipa::path(get, path = "/v1/instances/{instance_id}/advice", tag = "instances",
    params(("instance_id" = String, Path, description = "instance id (inst_…)")),
    responses((status = 200, body = InstanceAdvice), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn instance_advice(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<InstanceAdvice>> {
    let inst = visible(&st, &caller, &raw).await?;
    let summary = flotilla_core::advice::summarise(&st.profile(&inst.id));
    let recommendation = match (&summary, &inst.gpu_model) {
        (Some(s), Some(model)) => {
            flotilla_core::advice::recommend(s, model, inst.gpus, st.catalog().models()).ok()
        }
        _ => None,
    };
    Ok(Json(InstanceAdvice {
        instance_id: inst.id,
        gpu_model: inst.gpu_model,
        gpus: inst.gpus,
        summary,
        recommendation,
    }))
}
