//! Typed methods of the registry-credential routes
//! (`/v1/registry-credentials`): logins the agents use to pull a tenant's
//! private images. Secrets go in and never come back.

use flotilla_core::api::Page;
use flotilla_core::id::RegistryCredentialId;
use flotilla_core::registry::{CreateRegistryCredential, RegistryCredential};

use crate::client::Client;
use crate::Result;

impl Client {
    /// `GET /v1/registry-credentials`: the tenant's logins (one page: the
    /// server lists them all at once).
    pub async fn registry_credentials(&self) -> Result<Vec<RegistryCredential>> {
        let page: Page<RegistryCredential> = self.get("/v1/registry-credentials", &[]).await?;
        Ok(page.items)
    }

    /// `POST /v1/registry-credentials`.
    pub async fn add_registry_credential(
        &self,
        req: &CreateRegistryCredential,
    ) -> Result<RegistryCredential> {
        self.post("/v1/registry-credentials", req).await
    }

    /// `DELETE /v1/registry-credentials/{id}`.
    pub async fn remove_registry_credential(&self, id: &RegistryCredentialId) -> Result<()> {
        self.delete(&format!("/v1/registry-credentials/{id}")).await
    }
}
