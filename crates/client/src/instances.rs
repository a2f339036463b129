//! Typed methods of the instance routes beyond create, read, stop and
//! logs (in `routes`): listing, the queue of waiting instances, GPU
//! telemetry and right-sizing advice.

use flotilla_core::advice::{EndpointAdvice, InstanceAdvice};
use flotilla_core::api::{Instance, InstanceTelemetry, Page, QueueEntry};
use flotilla_core::id::{EndpointId, InstanceId};
use flotilla_core::instance::InstanceState;

use crate::client::Client;
use crate::Result;

impl Client {
    /// The key's instances (`GET /v1/instances`), only those in `state`
    /// with one, and the first `limit` with one (all pages without).
    pub async fn instances(
        &self,
        state: Option<InstanceState>,
        limit: Option<usize>,
    ) -> Result<Vec<Instance>> {
        let q: Vec<(&str, String)> = state
            .iter()
            .map(|s| ("state", s.as_str().to_string()))
            .collect();
        self.list("/v1/instances", &q, limit).await
    }

    /// `GET /v1/queue`: instances waiting for GPUs, in the scheduler's
    /// order (one page: the server lists the whole queue at once).
    pub async fn instance_queue(&self) -> Result<Vec<QueueEntry>> {
        let page: Page<QueueEntry> = self.get("/v1/queue", &[]).await?;
        Ok(page.items)
    }

    /// `GET /v1/instances/{id}/telemetry`: the latest readings of its GPUs.
    pub async fn instance_telemetry(&self, id: &InstanceId) -> Result<InstanceTelemetry> {
        self.get(&format!("/v1/instances/{id}/telemetry"), &[])
            .await
    }

    /// `GET /v1/instances/{id}/advice`: utilisation and right-sizing.
    pub async fn instance_advice(&self, id: &InstanceId) -> Result<InstanceAdvice> {
        self.get(&format!("/v1/instances/{id}/advice"), &[]).await
    }

    /// `GET /v1/endpoints/{id}/advice`: utilisation over its replicas and
    /// right-sizing.
    pub async fn endpoint_advice(&self, id: &EndpointId) -> Result<EndpointAdvice> {
        self.get(&format!("/v1/endpoints/{id}/advice"), &[]).await
    }
}
