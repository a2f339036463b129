//! Currency, the one rounding rule, billing periods and checked decimal
//! arithmetic. `Decimal` operators panic on overflow; billing must never
//! panic on input, so rating goes through the checked helpers here.

use chrono::{DateTime, Datelike, NaiveDate, TimeZone, Utc};
use rust_decimal::{Decimal, RoundingStrategy};
use serde::{Deserialize, Serialize};

use crate::error::BillingError;
use crate::Result;

/// An ISO 4217 currency and how many minor units it has (USD: 2, JPY: 0).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Currency {
    /// Three-letter ISO code, upper case.
    pub code: String,
    /// Digits after the decimal point of the smallest unit.
    pub minor_units: u32,
}

impl Currency {
    /// A validated currency.
    pub fn new(code: &str, minor_units: u32) -> Result<Self> {
        if code.len() != 3 || !code.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(BillingError::invalid(
                "currency.code",
                format!("must be a three-letter upper-case ISO 4217 code, got `{code}`"),
            ));
        }
        if minor_units > 4 {
            return Err(BillingError::invalid(
                "currency.minor_units",
                format!("must be between 0 and 4, got {minor_units}"),
            ));
        }
        Ok(Self {
            code: code.to_string(),
            minor_units,
        })
    }

    /// US dollars, two minor units (cents).
    pub fn usd() -> Self {
        Self {
            code: "USD".into(),
            minor_units: 2,
        }
    }

    /// THE rounding rule of Flotilla billing, applied once per invoice or
    /// payout line and nowhere else: round half to even ("banker's
    /// rounding") to the currency's minor units, e.g. 0.125 -> 0.12,
    /// 0.135 -> 0.14, -0.125 -> -0.12. Half-even is used because it has no
    /// upward bias over many lines, which is what auditors expect (it is
    /// also IEEE 754's default). Quantities and unit prices are never
    /// rounded; totals are exact sums of rounded lines, so an invoice always
    /// equals the sum of its lines. The result always carries exactly
    /// `minor_units` decimals (`5` -> `5.00`) and never a negative zero, so
    /// equal amounts serialise to equal bytes.
    pub fn round(&self, amount: Decimal) -> Decimal {
        let mut r =
            amount.round_dp_with_strategy(self.minor_units, RoundingStrategy::MidpointNearestEven);
        r.rescale(self.minor_units);
        if r.is_zero() {
            r.set_sign_positive(true);
        }
        r
    }
}

/// Decimal places a unit price is shown with. Catalog prices are set per
/// hour with at most four decimals and stored per second (the hourly price
/// / 3600, exact to 28 digits); ten places keep four significant digits of
/// a per-second price of a cent an hour, and drop the 28-digit tail that
/// says nothing to a reader. Display only: rating uses the exact price.
pub const UNIT_PRICE_DISPLAY_DP: u32 = 10;

/// A unit price as the console and the CLI show it: rounded half-even to
/// [`UNIT_PRICE_DISPLAY_DP`] places, trailing zeros dropped
/// (`0.0004166666666666666666666667` -> `0.0004166667`, `2.50` -> `2.5`).
pub fn display_unit_price(price: Decimal) -> String {
    let r = price
        .round_dp_with_strategy(UNIT_PRICE_DISPLAY_DP, RoundingStrategy::MidpointNearestEven)
        .normalize();
    if r.is_zero() {
        "0".into()
    } else {
        r.to_string()
    }
}

/// A half-open billing period `[start, end)`, in UTC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Period {
    /// First instant of the period.
    pub start: DateTime<Utc>,
    /// First instant after the period.
    pub end: DateTime<Utc>,
}

impl Period {
    /// A validated period; `start` must be before `end`.
    pub fn new(start: DateTime<Utc>, end: DateTime<Utc>) -> Result<Self> {
        if start >= end {
            return Err(BillingError::invalid(
                "period",
                format!("start {start} must be before end {end}"),
            ));
        }
        Ok(Self { start, end })
    }

    /// The calendar month `year-month` in UTC, the usual invoice period.
    pub fn month(year: i32, month: u32) -> Result<Self> {
        let first = NaiveDate::from_ymd_opt(year, month, 1).ok_or_else(|| {
            BillingError::invalid("month", format!("{year}-{month} is not a month"))
        })?;
        let next = if first.month() == 12 {
            NaiveDate::from_ymd_opt(year + 1, 1, 1)
        } else {
            NaiveDate::from_ymd_opt(year, month + 1, 1)
        }
        .ok_or_else(|| BillingError::invalid("month", format!("{year}-{month} is out of range")))?;
        let at = |d: NaiveDate| d.and_hms_opt(0, 0, 0).map(|n| Utc.from_utc_datetime(&n));
        match (at(first), at(next)) {
            (Some(s), Some(e)) => Self::new(s, e),
            _ => Err(BillingError::invalid("month", "out of range")),
        }
    }

    /// Whether `t` lies in the period.
    pub fn contains(&self, t: DateTime<Utc>) -> bool {
        self.start <= t && t < self.end
    }

    /// Length in milliseconds.
    pub fn millis(&self) -> i64 {
        (self.end - self.start).num_milliseconds()
    }
}

/// Milliseconds from `a` to `b` (negative if `b` is earlier).
pub(crate) fn millis(a: DateTime<Utc>, b: DateTime<Utc>) -> i64 {
    (b - a).num_milliseconds()
}

/// `a * b`, or an overflow error naming `what`.
pub(crate) fn mul(a: Decimal, b: Decimal, what: &'static str) -> Result<Decimal> {
    a.checked_mul(b).ok_or(BillingError::Overflow { what })
}

/// `a + b`, or an overflow error naming `what`.
pub(crate) fn add(a: Decimal, b: Decimal, what: &'static str) -> Result<Decimal> {
    a.checked_add(b).ok_or(BillingError::Overflow { what })
}

/// `a - b`, or an overflow error naming `what`.
pub(crate) fn sub(a: Decimal, b: Decimal, what: &'static str) -> Result<Decimal> {
    a.checked_sub(b).ok_or(BillingError::Overflow { what })
}

/// `a / b`, or an overflow error naming `what` (also for `b == 0`).
pub(crate) fn div(a: Decimal, b: Decimal, what: &'static str) -> Result<Decimal> {
    a.checked_div(b).ok_or(BillingError::Overflow { what })
}

/// An integer as a `Decimal`, or an overflow error.
pub(crate) fn dec_i128(v: i128, what: &'static str) -> Result<Decimal> {
    Decimal::try_from_i128_with_scale(v, 0).map_err(|_| BillingError::Overflow { what })
}

/// Sum of decimals, checked.
pub(crate) fn sum<I: IntoIterator<Item = Decimal>>(it: I, what: &'static str) -> Result<Decimal> {
    it.into_iter()
        .try_fold(Decimal::ZERO, |acc, x| add(acc, x, what))
}

/// The tidy form of a quantity for display and serialisation: no trailing
/// zeros, no negative zero. Applied to quantities only, never to amounts.
pub(crate) fn tidy(d: Decimal) -> Decimal {
    let mut n = d.normalize();
    if n.is_zero() {
        n.set_sign_positive(true);
    }
    n
}

#[cfg(test)]
mod tests {

    #[test]
    fn unit_prices_display_at_catalog_precision() {
        use std::str::FromStr;
        let per_second = Decimal::from_str("1.5").unwrap() / Decimal::from(3600);
        assert_eq!(display_unit_price(per_second), "0.0004166667");
        assert_eq!(
            display_unit_price(Decimal::from_str("2.50").unwrap()),
            "2.5"
        );
        assert_eq!(display_unit_price(Decimal::ZERO), "0");
        assert_eq!(
            display_unit_price(Decimal::from_str("-0.00000000001").unwrap()),
            "0"
        );
    }

    use super::*;
    use std::str::FromStr;

    #[test]
    fn rounding_is_half_even_at_minor_units() {
        let usd = Currency::usd();
        let d = |s| Decimal::from_str(s).unwrap();
        assert_eq!(usd.round(d("0.125")).to_string(), "0.12");
        assert_eq!(usd.round(d("0.135")).to_string(), "0.14");
        assert_eq!(usd.round(d("-0.125")).to_string(), "-0.12");
        assert_eq!(usd.round(d("5")).to_string(), "5.00");
        assert_eq!(usd.round(d("-0.001")).to_string(), "0.00");
        let jpy = Currency::new("JPY", 0).unwrap();
        assert_eq!(jpy.round(d("2.5")).to_string(), "2");
    }

    #[test]
    fn months_and_bad_currencies() {
        let p = Period::month(2025, 12).unwrap();
        assert_eq!(p.millis(), 31 * 86_400_000);
        assert!(Period::month(2025, 13).is_err());
        assert!(
            matches!(Currency::new("usd", 2), Err(BillingError::Invalid { field, .. }) if field == "currency.code")
        );
    }
}
