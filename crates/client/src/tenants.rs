//! Typed methods of the tenant routes: tenants and their quotas, API keys,
//! and the audit log of mutating calls.

use flotilla_core::api::{
    ApiKey, AuditEntry, CreateApiKey, CreateTenant, CreatedApiKey, QuotaView, Tenant,
};
use flotilla_core::id::{KeyId, TenantId};
use flotilla_core::quota::Quota;

use crate::client::Client;
use crate::paths::{KEYS, TENANTS};
use crate::Result;

impl Client {
    /// Every tenant the key sees (`GET /v1/tenants`, all pages).
    pub async fn tenants(&self) -> Result<Vec<Tenant>> {
        self.list(TENANTS, &[], None).await
    }

    /// `POST /v1/tenants` (operators).
    pub async fn create_tenant(&self, req: &CreateTenant) -> Result<Tenant> {
        self.post(TENANTS, req).await
    }

    /// `GET /v1/tenants/{id}/quota`: its limits and what it uses now.
    pub async fn quota(&self, tenant: &TenantId) -> Result<QuotaView> {
        self.get(&format!("{TENANTS}/{tenant}/quota"), &[]).await
    }

    /// `PUT /v1/tenants/{id}/quota` (operators): replaces its limits.
    pub async fn set_quota(&self, tenant: &TenantId, quota: &Quota) -> Result<QuotaView> {
        self.put(&format!("{TENANTS}/{tenant}/quota"), quota).await
    }

    /// Every key the key sees (`GET /v1/keys`, all pages).
    pub async fn keys(&self) -> Result<Vec<ApiKey>> {
        self.list(KEYS, &[], None).await
    }

    /// `POST /v1/keys`: the new key with its secret, shown this once.
    pub async fn create_key(&self, req: &CreateApiKey) -> Result<CreatedApiKey> {
        self.post(KEYS, req).await
    }

    /// `DELETE /v1/keys/{id}`: the key, revoked.
    pub async fn revoke_key(&self, id: &KeyId) -> Result<ApiKey> {
        self.delete_json(&format!("{KEYS}/{id}")).await
    }

    /// The newest entries of the audit log (`GET /v1/audit`), at most
    /// `limit` (all without one); of one tenant with `tenant`
    /// (operators: others see their own anyway).
    pub async fn audit(
        &self,
        tenant: Option<&TenantId>,
        limit: Option<usize>,
    ) -> Result<Vec<AuditEntry>> {
        let q: Vec<(&str, String)> = tenant
            .iter()
            .map(|t| ("tenant_id", t.to_string()))
            .collect();
        self.list("/v1/audit", &q, limit).await
    }
}
