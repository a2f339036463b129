//! Placements for the store suites. The store's correctness does not depend
//! on where work goes (the planner in `flotilla-sched` decides that), only
//! on its conditional writes, so these tests take the first GPUs that fit,
//! and hand the store the waiting work as a pass would have read it.

use flotilla_core::id::{InstanceId, WorkId};
use flotilla_core::placement::{NodeSnapshot, Placement, PlacementRequest};
use flotilla_store::waiting::PendingWork;
use flotilla_store::Store;
use flotilla_testdb::rnd;

/// The first ready, uncordoned node (in snapshot order) with `req.gpus`
/// GPUs of one allowed model that fit `req.share`, and the CPU and memory.
pub fn first_fitting(nodes: &[NodeSnapshot], req: &PlacementRequest) -> Option<Placement> {
    nodes
        .iter()
        .filter(|n| n.ready && !n.cordoned)
        .filter(|n| n.cpu_milli_free >= req.cpu_milli && n.memory_mb_free >= req.memory_mb)
        .find_map(|n| {
            let mut by_model: Vec<(&str, Vec<_>)> = Vec::new();
            for g in &n.gpus {
                let allowed = req.models.is_empty() || req.models.contains(&g.model);
                if !allowed || !req.share.fits(g) {
                    continue;
                }
                match by_model.iter_mut().find(|(m, _)| *m == g.model) {
                    Some((_, v)) => v.push(g.id.clone()),
                    None => by_model.push((&g.model, vec![g.id.clone()])),
                }
            }
            by_model
                .into_iter()
                .find(|(_, gpus)| gpus.len() >= req.gpus as usize)
                .map(|(model, gpus)| Placement {
                    node: n.id.clone(),
                    model: model.to_string(),
                    gpus: gpus.into_iter().take(req.gpus as usize).collect(),
                    share: req.share.clone(),
                })
        })
}

/// Work `id` as a scheduling pass reads it from the queue: what
/// [`Store::schedule_work`] is handed back. Panics when it is not waiting.
pub async fn waiting(s: &Store, id: impl Into<WorkId>) -> PendingWork {
    let id = id.into();
    s.pending_work(10_000)
        .await
        .unwrap()
        .into_iter()
        .find(|w| w.id() == id)
        .unwrap_or_else(|| panic!("{id} is not waiting"))
}

/// The id of a job's new member, as the server mints one.
pub fn new_member() -> InstanceId {
    InstanceId::generate(2, rnd())
}
