//! Paths of the API spelled once, for the routes someone names without
//! going through a typed method: the test kit's router on a manual clock
//! (no HTTP, so no [`crate::Client`]), a person reading the docs' URLs, and
//! a load generator speaking the gateway's OpenAI-compatible API with its
//! own HTTP client. The typed methods of these routes build their requests
//! from the same constants.

/// `POST`: create a tenant; `GET`: list them.
pub const TENANTS: &str = "/v1/tenants";
/// `POST`: mint a key; `GET`: list them.
pub const KEYS: &str = "/v1/keys";
/// `POST`: an agent registers its node.
pub const AGENT_REGISTER: &str = "/v1/agent/register";
/// `POST`: an agent's sync of `node`: what it observed, what it is to run.
pub fn agent_sync(node: &str) -> String {
    format!("/v1/agent/nodes/{node}/sync")
}
/// The API's reference, as HTML.
pub const DOCS: &str = "/v1/docs";
/// The API's OpenAPI document.
pub const OPENAPI: &str = "/v1/openapi.json";

/// The gateway's OpenAI-compatible API (served by the gateway, not the
/// control plane).
pub mod openai {
    /// `GET`: the models (endpoints) the key may call.
    pub const MODELS: &str = "/v1/models";
    /// `POST`: a chat completion.
    pub const CHAT_COMPLETIONS: &str = "/v1/chat/completions";
}
