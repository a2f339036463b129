//! Typed methods of the node routes (`/v1/nodes`: the pool's machines,
//! taking them and their GPUs out of placement and back, what happened to
//! them) and of the GPU catalog (`/v1/gpu-types`).

use flotilla_core::api::{DrainReport, GpuTypeView, Node, NodeEvent};
use flotilla_core::id::{GpuId, NodeId};

use crate::client::Client;
use crate::Result;

impl Client {
    /// Every catalog model with the pool's capacity (`GET /v1/gpu-types`,
    /// all pages).
    pub async fn gpu_types(&self) -> Result<Vec<GpuTypeView>> {
        self.list("/v1/gpu-types", &[], None).await
    }

    /// Every node the key sees (`GET /v1/nodes`, all pages).
    pub async fn nodes(&self) -> Result<Vec<Node>> {
        self.list("/v1/nodes", &[], None).await
    }

    /// `GET /v1/nodes/{id}`.
    pub async fn node(&self, id: &NodeId) -> Result<Node> {
        self.get(&format!("/v1/nodes/{id}"), &[]).await
    }

    /// `POST /v1/nodes/{id}/cordon` (`cordoned`) or `…/uncordon`: keeps
    /// new work off the node, or lets it back.
    pub async fn cordon_node(&self, id: &NodeId, cordoned: bool) -> Result<Node> {
        let verb = if cordoned { "cordon" } else { "uncordon" };
        self.post(&format!("/v1/nodes/{id}/{verb}"), &serde_json::Map::new())
            .await
    }

    /// `POST /v1/nodes/{id}/drain`: cordons the node and stops its work.
    pub async fn drain_node(&self, id: &NodeId) -> Result<DrainReport> {
        self.post(&format!("/v1/nodes/{id}/drain"), &serde_json::Map::new())
            .await
    }

    /// `POST /v1/nodes/{id}/gpus/{gpu}/reset`: clears a GPU's fault.
    pub async fn reset_gpu(&self, id: &NodeId, gpu: &GpuId) -> Result<Node> {
        self.post(
            &format!("/v1/nodes/{id}/gpus/{gpu}/reset"),
            &serde_json::Map::new(),
        )
        .await
    }

    /// Every event of a node (`GET /v1/nodes/{id}/events`, all pages).
    pub async fn node_events(&self, id: &NodeId) -> Result<Vec<NodeEvent>> {
        self.list(&format!("/v1/nodes/{id}/events"), &[], None)
            .await
    }
}
