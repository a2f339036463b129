//! Budgets: per-tenant spend alerts at thresholds (50/80/100 % by default,
//! each crossed at most once per period), an optional hard cap that refuses
//! new spot and serverless capacity but never touches tier 1 work, and the
//! HMAC-SHA256 signature of webhook payloads.
//!
//! Delivery of webhooks (retries, queues) is the server's job; this module
//! only decides and signs.

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};
use flotilla_core::id::TenantId;
use hmac::{Hmac, Mac};
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::error::BillingError;
use crate::money;
use crate::Result;

/// The HTTP header that carries [`sign_webhook`]'s signature.
pub const SIGNATURE_HEADER: &str = "Flotilla-Signature";

/// The default alert thresholds, in percent of the limit.
pub const DEFAULT_THRESHOLDS: [u32; 3] = [50, 80, 100];

/// A tenant's budget for each billing period.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    /// The tenant.
    pub tenant: TenantId,
    /// Spend limit per period, in the catalog currency.
    pub limit: Decimal,
    /// ISO currency code of `limit`.
    pub currency: String,
    /// Alert thresholds in percent, e.g. `[50, 80, 100]`.
    pub thresholds: Vec<u32>,
    /// Refuse new spot and serverless capacity once spend reaches the limit.
    pub hard_cap: bool,
}

impl Budget {
    /// Checks the limit and thresholds.
    pub fn validate(&self) -> Result<()> {
        if self.limit <= Decimal::ZERO {
            return Err(BillingError::invalid("limit", "must be positive"));
        }
        if self.thresholds.is_empty() || self.thresholds.iter().any(|t| *t == 0 || *t > 1000) {
            return Err(BillingError::invalid(
                "thresholds",
                "must be 1 to 1000 percent each, at least one",
            ));
        }
        Ok(())
    }
}

/// What has already been alerted this period; the store keeps it so each
/// threshold fires once even across restarts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetState {
    /// Start of the period the set refers to.
    pub period_start: Option<DateTime<Utc>>,
    /// Thresholds (percent) already crossed in that period.
    pub crossed: BTreeSet<u32>,
}

/// An alert, the body of the budget webhook.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetAlert {
    /// The tenant.
    pub tenant: TenantId,
    /// Start of the period.
    pub period_start: DateTime<Utc>,
    /// The threshold crossed, in percent.
    pub threshold_percent: u32,
    /// Spend when it was noticed.
    pub spend: Decimal,
    /// The limit.
    pub limit: Decimal,
    /// ISO currency code.
    pub currency: String,
    /// When it was noticed.
    pub at: DateTime<Utc>,
}

/// Compares `spend` with the budget and returns the alerts for thresholds
/// newly crossed, lowest first, updating `state`. A new `period_start`
/// resets the state: each threshold fires once per period, however often
/// this is called and however spend moves.
pub fn check_budget(
    budget: &Budget,
    state: &mut BudgetState,
    period_start: DateTime<Utc>,
    spend: Decimal,
    now: DateTime<Utc>,
) -> Result<Vec<BudgetAlert>> {
    budget.validate()?;
    if state.period_start != Some(period_start) {
        *state = BudgetState {
            period_start: Some(period_start),
            crossed: BTreeSet::new(),
        };
    }
    let mut thresholds = budget.thresholds.clone();
    thresholds.sort_unstable();
    thresholds.dedup();
    let mut out = Vec::new();
    for t in thresholds {
        let level = money::div(
            money::mul(budget.limit, Decimal::from(t), "budget")?,
            Decimal::ONE_HUNDRED,
            "budget",
        )?;
        if spend >= level && state.crossed.insert(t) {
            out.push(BudgetAlert {
                tenant: budget.tenant.clone(),
                period_start,
                threshold_percent: t,
                spend,
                limit: budget.limit,
                currency: budget.currency.clone(),
                at: now,
            });
        }
    }
    Ok(out)
}

/// Kinds of capacity a tenant may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CapacityKind {
    /// An on-demand instance or job.
    OnDemand,
    /// Capacity drawn from a commitment (already paid for).
    Reserved,
    /// Spot.
    Spot,
    /// A serverless replica.
    Serverless,
}

/// Decides whether new capacity may start under the hard cap. Only spot and
/// serverless capacity of tier 2 or lower priority is refused: on-demand
/// and reserved are deliberate purchases, and tier 1 work is the tenant's
/// production — the cap never refuses or stops it. The cap never stops
/// running work at all; it only refuses new capacity.
pub fn admit(budget: &Budget, spend: Decimal, kind: CapacityKind, tier: u8) -> Result<()> {
    if !budget.hard_cap || spend < budget.limit || tier <= 1 {
        return Ok(());
    }
    let kind = match kind {
        CapacityKind::Spot => "spot",
        CapacityKind::Serverless => "serverless",
        CapacityKind::OnDemand | CapacityKind::Reserved => return Ok(()),
    };
    Err(BillingError::BudgetCapReached {
        tenant: budget.tenant.to_string(),
        spend,
        limit: budget.limit,
        currency: budget.currency.clone(),
        kind,
    })
}

/// The signature header of a webhook: `t=<unix seconds>,v1=<hex>` where the
/// hex is HMAC-SHA256 over `"<unix seconds>.<payload>"` with the tenant's
/// secret. Signing the timestamp with the body stops replays of old
/// deliveries (the receiver checks it is recent).
pub fn sign_webhook(secret: &[u8], at: DateTime<Utc>, payload: &[u8]) -> Result<String> {
    let t = at.timestamp();
    Ok(format!(
        "t={t},v1={}",
        hex::encode(mac(secret, t, payload)?.finalize().into_bytes())
    ))
}

/// Verifies a header made by [`sign_webhook`]: well-formed, at most
/// `tolerance_secs` from `now`, and a matching MAC (compared in constant
/// time).
pub fn verify_webhook(
    secret: &[u8],
    header: &str,
    payload: &[u8],
    now: DateTime<Utc>,
    tolerance_secs: i64,
) -> Result<()> {
    let mut t = None;
    let mut sig = None;
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", v)) => t = v.parse::<i64>().ok(),
            Some(("v1", v)) => sig = hex::decode(v).ok(),
            _ => {}
        }
    }
    let (Some(t), Some(sig)) = (t, sig) else {
        return Err(BillingError::BadSignature {
            reason: "header must be t=<unix seconds>,v1=<hex>",
        });
    };
    if (now.timestamp() - t).abs() > tolerance_secs {
        return Err(BillingError::BadSignature {
            reason: "timestamp outside the tolerance",
        });
    }
    mac(secret, t, payload)?
        .verify_slice(&sig)
        .map_err(|_| BillingError::BadSignature {
            reason: "signature does not match",
        })
}

fn mac(secret: &[u8], t: i64, payload: &[u8]) -> Result<Hmac<Sha256>> {
    let mut m = Hmac::<Sha256>::new_from_slice(secret)
        .map_err(|_| BillingError::invalid("secret", "unusable key"))?;
    m.update(t.to_string().as_bytes());
    m.update(b".");
    m.update(payload);
    Ok(m)
}

/// Where a delivery is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryState {
    /// Waiting for its next attempt.
    Pending,
    /// The receiver answered 2xx.
    Delivered,
    /// Out of attempts.
    Failed,
}

/// One webhook delivery and its log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivery {
    /// Delivery id.
    pub id: String,
    /// The tenant.
    pub tenant: TenantId,
    /// Receiver URL.
    pub url: String,
    /// The JSON body sent (the alert).
    pub body: String,
    /// Pending, delivered or failed.
    pub state: DeliveryState,
    /// Attempts made.
    pub attempts: u32,
    /// When the next attempt is due (pending only).
    pub next_attempt_at: DateTime<Utc>,
    /// HTTP status of the last attempt, if it got one.
    pub last_status: Option<u16>,
    /// Why the last attempt failed.
    pub last_error: Option<String>,
    /// When a receiver accepted it.
    pub delivered_at: Option<DateTime<Utc>>,
    /// When it was queued.
    pub created_at: DateTime<Utc>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(hard_cap: bool) -> Budget {
        Budget {
            tenant: TenantId::generate(1, 1),
            limit: Decimal::from(1000),
            currency: "USD".into(),
            thresholds: DEFAULT_THRESHOLDS.to_vec(),
            hard_cap,
        }
    }

    #[test]
    fn each_threshold_fires_once_per_period() {
        let b = budget(false);
        let mut st = BudgetState::default();
        let p = DateTime::from_timestamp(0, 0).unwrap();
        let now = p;
        let a = check_budget(&b, &mut st, p, Decimal::from(850), now).unwrap();
        assert_eq!(
            a.iter().map(|a| a.threshold_percent).collect::<Vec<_>>(),
            vec![50, 80]
        );
        assert!(check_budget(&b, &mut st, p, Decimal::from(900), now)
            .unwrap()
            .is_empty());
        assert_eq!(
            check_budget(&b, &mut st, p, Decimal::from(1000), now)
                .unwrap()
                .len(),
            1
        );
        let next = DateTime::from_timestamp(86_400 * 31, 0).unwrap();
        assert_eq!(
            check_budget(&b, &mut st, next, Decimal::from(600), now)
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn hard_cap_spares_tier_one_and_on_demand() {
        let b = budget(true);
        let over = Decimal::from(1000);
        assert!(admit(&b, over, CapacityKind::Spot, 2).is_err());
        assert!(admit(&b, over, CapacityKind::Serverless, 3).is_err());
        assert!(admit(&b, over, CapacityKind::Serverless, 1).is_ok());
        assert!(admit(&b, over, CapacityKind::OnDemand, 3).is_ok());
        assert!(admit(&b, Decimal::from(999), CapacityKind::Spot, 3).is_ok());
        assert!(admit(&budget(false), over, CapacityKind::Spot, 3).is_ok());
    }

    #[test]
    fn webhook_signatures_verify_and_reject() {
        let at = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let h = sign_webhook(b"whsec", at, b"{\"a\":1}").unwrap();
        assert!(h.starts_with("t=1700000000,v1="));
        verify_webhook(b"whsec", &h, b"{\"a\":1}", at, 300).unwrap();
        assert!(verify_webhook(b"whsec", &h, b"{\"a\":2}", at, 300).is_err());
        assert!(verify_webhook(b"other", &h, b"{\"a\":1}", at, 300).is_err());
        let later = at + chrono::Duration::seconds(301);
        assert!(verify_webhook(b"whsec", &h, b"{\"a\":1}", later, 300).is_err());
        assert!(verify_webhook(b"whsec", "garbage", b"", at, 300).is_err());
    }
}
