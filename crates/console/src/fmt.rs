//! How the console writes money, prices and times: amounts at the
//! currency's minor units, unit prices at the catalog's precision
//! ([`flotilla_billing::money::display_unit_price`], shared with the CLI),
//! per-second prices also per hour, times in UTC.

use std::str::FromStr;

use rust_decimal::Decimal;
use serde_json::Value;

/// A decimal carried as a JSON string (or number).
pub fn dec(v: &Value) -> Option<Decimal> {
    match v {
        Value::String(s) => Decimal::from_str(s).ok(),
        Value::Number(n) => Decimal::from_str(&n.to_string()).ok(),
        _ => None,
    }
}

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

/// An amount as [`amount`] writes it, from JSON (until every page reads
/// typed answers).
pub fn amount_json(v: &Value, currency: &str) -> String {
    dec(v).map_or_else(|| "—".into(), |d| amount(d, currency))
}

/// A unit price as [`unit_price`] writes it, from JSON.
pub fn unit_price_json(v: &Value) -> String {
    dec(v).map_or_else(|| "—".into(), unit_price)
}

/// A price per hour as [`per_hour`] writes it, from JSON.
pub fn per_hour_json(per_second: &Value) -> String {
    dec(per_second).map_or_else(|| "—".into(), per_hour)
}

/// An RFC 3339 time shortened to `YYYY-MM-DD HH:MM:SS` (UTC).
pub fn time(v: &Value) -> String {
    match v.as_str() {
        Some(s) => match chrono::DateTime::parse_from_rfc3339(s) {
            Ok(t) => t
                .with_timezone(&chrono::Utc)
                .format("%Y-%m-%d %H:%M:%S")
                .to_string(),
            Err(_) => s.to_string(),
        },
        None => "—".into(),
    }
}

/// A time as [`time`] writes it, from a typed answer.
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

/// A typed answer as JSON, for the pages that still render the API's
/// nested billing documents (price versions, payouts, invoices,
/// estimates) field by field from JSON; decoded through the API's type
/// first, so a change of the wire still fails at the client.
pub fn json<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
        assert_eq!(amount_json(&Value::Null, "USD"), "—");
        assert_eq!(
            time(&json!("2026-12-01T10:00:00.5Z")),
            "2026-12-01 10:00:00"
        );
    }
}
