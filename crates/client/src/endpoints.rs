//! Typed methods of the endpoint routes (`/v1/endpoints`) and of the
//! gateway's protocol (`/v1/gateway/*`, used by the gateway's control
//! client).

use flotilla_core::advice::{VerticalOptIn, VerticalStatus};
use flotilla_core::api::Page;
use flotilla_core::endpoint::{CreateEndpoint, Endpoint, ReplicaLogLine, UpdateEndpoint};
use flotilla_core::gateway::{
    Accepted, AuthorizeRequest, EndpointSignals, KeyGrant, RequestUsage, RouteTable, SignalsBatch,
    UsageBatch,
};

use crate::client::Client;
use crate::Result;

impl Client {
    /// `POST /v1/endpoints`.
    pub async fn create_endpoint(&self, req: &CreateEndpoint) -> Result<Endpoint> {
        self.post("/v1/endpoints", req).await
    }

    /// Every endpoint the key sees (`GET /v1/endpoints`, all pages).
    pub async fn endpoints(&self) -> Result<Vec<Endpoint>> {
        self.list("/v1/endpoints", &[], None).await
    }

    /// `GET /v1/endpoints/{id}`.
    pub async fn endpoint(&self, id: &str) -> Result<Endpoint> {
        self.get(&format!("/v1/endpoints/{id}"), &[]).await
    }

    /// `PATCH /v1/endpoints/{id}`.
    pub async fn update_endpoint(&self, id: &str, req: &UpdateEndpoint) -> Result<Endpoint> {
        self.patch(&format!("/v1/endpoints/{id}"), req).await
    }

    /// `DELETE /v1/endpoints/{id}`.
    pub async fn delete_endpoint(&self, id: &str) -> Result<Endpoint> {
        self.delete_json(&format!("/v1/endpoints/{id}")).await
    }

    /// `GET /v1/endpoints/{id}/logs`: the replicas' output (or one's).
    pub async fn endpoint_logs(
        &self,
        id: &str,
        replica: Option<&str>,
    ) -> Result<Vec<ReplicaLogLine>> {
        let mut q = vec![("limit", "1000".to_string())];
        if let Some(r) = replica {
            q.push(("replica", r.to_string()));
        }
        let page: Page<ReplicaLogLine> = self.get(&format!("/v1/endpoints/{id}/logs"), &q).await?;
        Ok(page.items)
    }

    /// `PUT /v1/endpoints/{id}/vertical`: opt into automatic vertical moves.
    pub async fn set_endpoint_vertical(
        &self,
        id: &str,
        opt_in: &VerticalOptIn,
    ) -> Result<VerticalStatus> {
        self.put(&format!("/v1/endpoints/{id}/vertical"), opt_in)
            .await
    }

    /// `GET /v1/endpoints/{id}/vertical`: the opt-in and its last move.
    pub async fn endpoint_vertical(&self, id: &str) -> Result<VerticalStatus> {
        self.get(&format!("/v1/endpoints/{id}/vertical"), &[]).await
    }

    /// `GET /v1/gateway/routes`.
    pub async fn gateway_routes(&self) -> Result<RouteTable> {
        self.get("/v1/gateway/routes", &[]).await
    }

    /// `POST /v1/gateway/authorize`: `None` for a key that may call
    /// nothing (unknown, revoked, or not a tenant's).
    pub async fn gateway_authorize(&self, key: &str) -> Result<Option<KeyGrant>> {
        let req = AuthorizeRequest {
            key: key.to_string(),
        };
        match self.post_agent("/v1/gateway/authorize", &req, None).await {
            Ok(g) => Ok(Some(g)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `POST /v1/gateway/signals`.
    pub async fn gateway_signals(&self, signals: Vec<EndpointSignals>) -> Result<Accepted> {
        self.post_agent("/v1/gateway/signals", &SignalsBatch { signals }, None)
            .await
    }

    /// `POST /v1/gateway/usage`: idempotent by request id, so safe to
    /// re-send.
    pub async fn gateway_usage(&self, requests: Vec<RequestUsage>) -> Result<Accepted> {
        self.post_agent("/v1/gateway/usage", &UsageBatch { requests }, None)
            .await
    }
}
