//! [`ApiControl`]: the gateway's [`Control`] over the control plane's API
//! (`/v1/gateway/*` through the typed `flotilla-client`), with a provider
//! key (the agent token) or an operator key. The gateway never reads the
//! database; this is the only way it learns routes and keys.

use flotilla_client::Client;
use flotilla_core::gateway::{EndpointSignals, KeyGrant, RequestUsage, RouteTable};

use crate::control::{Control, ControlError, ControlFuture};

/// The control plane reached over HTTP (failing over between its URLs,
/// retrying idempotent calls, as every `flotilla-client` does).
#[derive(Debug, Clone)]
pub struct ApiControl {
    client: Client,
}

impl ApiControl {
    /// A control over `client`, whose key must be a provider or operator
    /// key.
    pub fn new(client: Client) -> Self {
        Self { client }
    }
}

fn err(what: &str) -> impl FnOnce(flotilla_client::Error) -> ControlError + '_ {
    move |e| ControlError::with_source(what.to_string(), e)
}

impl Control for ApiControl {
    fn routes(&self) -> ControlFuture<'_, RouteTable> {
        Box::pin(async move {
            self.client
                .gateway_routes()
                .await
                .map_err(err("reading the route table"))
        })
    }

    fn authorize<'a>(&'a self, key: &'a str) -> ControlFuture<'a, Option<KeyGrant>> {
        Box::pin(async move {
            self.client
                .gateway_authorize(key)
                .await
                .map_err(err("authorizing a key"))
        })
    }

    fn is_operator<'a>(&'a self, key: &'a str) -> ControlFuture<'a, bool> {
        Box::pin(async move {
            // Who the key is, asked with the key itself: an unknown or
            // revoked key is answered 401, which is a plain `false`.
            match self.client.with_token(key).me().await {
                Ok(me) => Ok(me.key.role == flotilla_core::tenant::Role::Operator),
                Err(e) if e.status().is_some_and(|s| s == 401 || s == 403) => Ok(false),
                Err(e) => Err(ControlError::with_source("asking who a key is", e)),
            }
        })
    }

    fn report(&self, signals: Vec<EndpointSignals>) -> ControlFuture<'_, ()> {
        Box::pin(async move {
            if signals.is_empty() {
                return Ok(());
            }
            self.client
                .gateway_signals(signals)
                .await
                .map(drop)
                .map_err(err("reporting demand"))
        })
    }

    fn meter(&self, usage: Vec<RequestUsage>) -> ControlFuture<'_, ()> {
        Box::pin(async move {
            if usage.is_empty() {
                return Ok(());
            }
            let out = self
                .client
                .gateway_usage(usage)
                .await
                .map_err(err("metering requests"))?;
            for r in &out.rejected {
                // Refused for good (invalid, late): re-sending cannot help.
                tracing::warn!(rejection = %r, "the ledger refused a request's usage");
            }
            Ok(())
        })
    }
}
