//! Reading the API's times in the tests that compare billed time with
//! the run an instance's events record. Each test binary uses what it
//! needs, hence the `dead_code` allowance.
#![allow(dead_code)]

use chrono::{DateTime, Utc};
use serde_json::Value;

/// An RFC 3339 time from the API.
pub fn time(v: &Value) -> DateTime<Utc> {
    v.as_str()
        .unwrap_or_else(|| panic!("not a time: {v}"))
        .parse()
        .unwrap_or_else(|e| panic!("not a time: {v}: {e}"))
}

/// The instance's event `at` for `state`.
pub fn event_at(inst: &Value, state: &str) -> DateTime<Utc> {
    inst["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["state"] == state)
        .map(|e| time(&e["at"]))
        .unwrap_or_else(|| panic!("no {state} event: {inst}"))
}
