//! The edge check of a tenant-chosen destination: a queue trigger's
//! broker, a budget webhook, a registry login. When the URL is set, a
//! literal address or a name that already resolves inward (loopback,
//! private, link-local, …; see `flotilla-egress`) is refused with 422
//! naming the field, so the tenant hears at once. A name that does not
//! resolve (yet) is accepted: every connection resolves and checks it
//! again and connects only to the addresses it checked, so this check is
//! a courtesy, not the guard.

use std::time::Duration;

use flotilla_core::error::FieldError;
use flotilla_egress::{EgressPolicy, ResolveError};

use crate::error::{ApiError, ApiResult};

/// How long setting a destination waits for its host to resolve.
pub const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// Refuses (422, `field`) `host:port` when it is, or already resolves to,
/// an address `policy` refuses. Never connects.
pub async fn check_destination(
    policy: &EgressPolicy,
    host: &str,
    port: u16,
    field: &str,
) -> ApiResult<()> {
    match tokio::time::timeout(
        RESOLVE_TIMEOUT,
        flotilla_egress::resolve(host, port, policy),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e @ ResolveError::Refused { .. })) => {
            Err(ApiError::field(FieldError::new(field, e.to_string())))
        }
        Ok(Err(ResolveError::Unresolved { host, reason })) => {
            tracing::info!(host = %host, reason = %reason, field, "destination does not resolve yet; checked again at every connection");
            Ok(())
        }
        Err(_) => {
            tracing::info!(host = %host, field, "destination did not resolve in time; checked again at every connection");
            Ok(())
        }
    }
}

/// Refuses (422, `queue_triggers[i].url`) the first trigger whose broker
/// is, or already resolves to, an address `policy` refuses.
pub async fn check_triggers(
    policy: &EgressPolicy,
    triggers: &[flotilla_core::queue_trigger::QueueTrigger],
) -> ApiResult<()> {
    for (i, t) in triggers.iter().enumerate() {
        let field = format!("queue_triggers[{i}].url");
        let (host, port) = flotilla_triggers::destination(t).ok_or_else(|| {
            ApiError::field(FieldError::new(field.clone(), "must name a broker host"))
        })?;
        check_destination(policy, host, port, &field).await?;
    }
    Ok(())
}
