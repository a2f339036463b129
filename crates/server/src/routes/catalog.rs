//! The GPU catalog with the pool's capacity.

use axum::extract::State;
use axum::Json;
use flotilla_core::api::{GpuTypeView, Page};

use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::Pagination;
use crate::state::AppState;

/// GPU models with total and free GPUs on ready nodes. The cursor is the
/// last model name of the previous page.
#[utoipa::path(get, path = "/v1/gpu-types", tag = "catalog",
    params(("limit" = Option<u32>, Query, description = "page size, 1-1000"), ("cursor" = Option<String>, Query, description = "from next_cursor")),
    responses((status = 200, body = Page<GpuTypeView>)))]
pub async fn list_gpu_types(
    State(st): State<AppState>,
    _caller: Caller,
    p: Pagination,
) -> ApiResult<Json<Page<GpuTypeView>>> {
    let snapshot = st.store().placement_snapshot().await?;
    let models = st.catalog().models();
    let start = match &p.cursor {
        None => 0,
        Some(c) => {
            models
                .iter()
                .position(|m| m.name.replace('-', "_") == *c)
                .ok_or_else(|| {
                    ApiError::bad_request("cursor", "is not a cursor returned by this API")
                })?
                + 1
        }
    };
    let mut items: Vec<GpuTypeView> = models
        .iter()
        .skip(start)
        .take(p.limit as usize)
        .map(|m| {
            let gpus = snapshot
                .iter()
                .filter(|n| n.ready)
                .flat_map(|n| &n.gpus)
                .filter(|g| g.model == m.name);
            let (mut total, mut free) = (0, 0);
            for g in gpus {
                total += 1;
                free += u32::from(g.free);
            }
            GpuTypeView {
                model: m.clone(),
                total,
                free,
            }
        })
        .collect();
    items.shrink_to_fit();
    let next_cursor = (start + items.len() < models.len())
        .then(|| items.last().map(|v| v.model.name.replace('-', "_")))
        .flatten();
    Ok(Json(Page { items, next_cursor }))
}
