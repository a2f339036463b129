//! Typed methods of a node's offer (`/v1/nodes/{id}/offer`): the weekly
//! windows in which its provider offers its GPUs.

use flotilla_core::id::NodeId;
use flotilla_core::offer::NodeOffer;

use crate::client::Client;
use crate::Result;

impl Client {
    /// `GET /v1/nodes/{id}/offer`: when the node's GPUs are offered.
    pub async fn node_offer(&self, id: &NodeId) -> Result<NodeOffer> {
        self.get(&format!("/v1/nodes/{id}/offer"), &[]).await
    }

    /// `PUT /v1/nodes/{id}/offer`: replaces the node's windows; the
    /// offer as stored.
    pub async fn set_node_offer(&self, id: &NodeId, offer: &NodeOffer) -> Result<NodeOffer> {
        self.put(&format!("/v1/nodes/{id}/offer"), offer).await
    }
}
