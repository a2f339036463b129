//! What an instance's GPUs are doing: the latest driver readings of the
//! GPUs it holds, for its tenant (operators scrape the whole pool at
//! `/metrics`).

use axum::extract::{Path, State};
use axum::Json;
use flotilla_core::advice::{EndpointAdvice, InstanceAdvice};
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

/// Utilisation summary of an endpoint's replicas (every replica's GPU
/// readings together) and the cheapest catalog class one replica could run
/// on, with the hourly cost effect per replica.
#[utoipa::path(get, path = "/v1/endpoints/{endpoint_id}/advice", tag = "endpoints",
    params(("endpoint_id" = String, Path, description = "endpoint id (ep_…)")),
    responses((status = 200, body = EndpointAdvice), (status = 404, body = flotilla_core::api::ErrorBody)))]
pub async fn endpoint_advice(
    State(st): State<AppState>,
    caller: Caller,
    Path(raw): Path<String>,
) -> ApiResult<Json<EndpointAdvice>> {
    let id = super::path_id(&raw, "endpoint_id", flotilla_core::id::EndpointId::parse)?;
    let ep = st.store().endpoint(&id).await?;
    if !caller.sees(&ep.tenant_id) {
        return Err(crate::error::ApiError::not_found("endpoint"));
    }
    let mut samples = Vec::new();
    let mut replicas = 0;
    let mut model: Option<String> = None;
    // Oldest first: the newest replica's model is the one kept.
    for r in st.store().endpoint_replicas(&id).await? {
        let mine = st.profile(&r.instance_id);
        if mine.is_empty() {
            continue;
        }
        replicas += 1;
        samples.extend(mine);
        if let Ok(inst) = st.store().instance(&r.instance_id).await {
            if inst.gpu_model.is_some() {
                model = inst.gpu_model;
            }
        }
    }
    let summary = flotilla_core::advice::summarise(&samples);
    let recommendation = match (&summary, &model) {
        (Some(s), Some(m)) => {
            flotilla_core::advice::recommend(s, m, ep.spec.gpus, st.catalog().models()).ok()
        }
        _ => None,
    };
    Ok(Json(EndpointAdvice {
        endpoint_id: id,
        gpu_model: model,
        gpus_per_replica: ep.spec.gpus,
        replicas,
        summary,
        recommendation,
    }))
}
