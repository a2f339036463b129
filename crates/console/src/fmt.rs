//! How the console writes money, prices and times, from the API's typed
//! values: amounts to the cent, unit prices at the catalog's precision
//! ([`flotilla_billing::money::display_unit_price`], shared with the CLI),
//! per-second prices also per hour, times in UTC.

use std::str::FromStr;

use rust_decimal::Decimal;
use serde_json::Value;

/// An amount with its currency code, to the cent as the pages have
/// always shown it: `12.34 USD`.
pub fn amount(d: Decimal, currency: &str) -> String {
    format!("{} {currency}", d.round_dp(2))
}

/// A unit price at the catalog's precision.
pub fn unit_price(d: Decimal) -> String {
    flotilla_billing::money::display_unit_price(d)
}

/// A per-second price as a price per hour, at the catalog's precision
/// and at least to the cent (`2.00`, `0.105`); `—` if it overflows.
pub fn per_hour(per_second: Decimal) -> String {
    per_second
        .checked_mul(Decimal::from(3600))
        .and_then(|h| Decimal::from_str(&flotilla_billing::money::display_unit_price(h)).ok())
        .map(|mut h| {
            if h.scale() < 2 {
                h.rescale(2);
            }
            h.to_string()
        })
        .unwrap_or_else(|| "—".into())
}

/// A time shortened to `YYYY-MM-DD HH:MM:SS` (UTC).
pub fn at(t: &chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S").to_string()
}

/// An optional time as [`at`] writes it, `—` when absent.
pub fn at_opt(t: Option<&chrono::DateTime<chrono::Utc>>) -> String {
    t.map_or_else(|| "—".into(), at)
}

/// An optional value, `—` when absent.
pub fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "—".into(), |v| v.to_string())
}

/// The wire name of a unit enum (a state, a stream, a kind): the word
/// the API sends, so pages and API speak alike.
pub fn word<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prices_show_at_catalog_precision() {
        let d = |s: &str| Decimal::from_str(s).unwrap();
        assert_eq!(
            unit_price(d("0.0004166666666666666666666667")),
            "0.0004166667"
        );
        assert_eq!(per_hour(d("0.0004166666666666666666666667")), "1.50");
        assert_eq!(per_hour(d("0.0000291666666666666666666667")), "0.105");
        assert_eq!(amount(d("12.345"), "USD"), "12.34 USD");
        let t = chrono::DateTime::parse_from_rfc3339("2026-12-01T10:00:00.5Z").unwrap();
        assert_eq!(at(&t.with_timezone(&chrono::Utc)), "2026-12-01 10:00:00");
    }
}
