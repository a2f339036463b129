//! Errors of the domain layer. They carry the offending field so that the
//! API can tell a user exactly what to fix.

use serde::Serialize;

/// A request value that breaks a rule; `field` is the JSON path of the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize)]
#[error("{field}: {message}")]
pub struct FieldError {
    /// JSON path of the offending value, e.g. `gpus` or `env.PATH`.
    pub field: String,
    /// What is wrong, in lowercase, without trailing punctuation.
    pub message: String,
}

impl FieldError {
    /// Builds an error for `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// A request that would take a tenant over one of its quotas.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize)]
#[error("quota {quota} exceeded: limit {limit}, in use {in_use}, requested {requested}")]
pub struct QuotaExceeded {
    /// Which quota: `gpus_total` or `gpus.<MODEL>`.
    pub quota: String,
    /// The configured limit.
    pub limit: u32,
    /// GPUs held by the tenant's live instances.
    pub in_use: u32,
    /// GPUs this request asks for.
    pub requested: u32,
}
