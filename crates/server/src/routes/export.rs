//! CSV export of usage events and invoice lines, for spreadsheets and
//! accounting tools: a list route answers CSV instead of JSON when asked
//! with `?format=csv` or `Accept: text/csv`.
//!
//! A CSV answer holds the same page the JSON answer would (lists always
//! paginate); the next page's cursor is in the `X-Next-Cursor` header, since
//! a CSV body has nowhere to put it. Values are written by the `csv` crate,
//! so commas, quotes and newlines in descriptions are quoted correctly.

use axum::http::{header, HeaderMap, HeaderValue, Uri};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, SecondsFormat, Utc};
use flotilla_billing::invoice::Invoice;
use flotilla_billing::meter::{GpuShare, Meter, UsageEvent};
use serde::Deserialize;

use crate::error::ApiError;
use crate::extract::serde_urlencoded_query;

/// The media type of CSV answers.
pub const TEXT_CSV: &str = "text/csv; charset=utf-8";

#[derive(Deserialize)]
struct FormatQuery {
    format: Option<String>,
}

/// Whether the request asks for CSV: `format=csv` (or `format=json` for
/// JSON, whatever the `Accept` header) wins over `Accept: text/csv`.
pub fn wants_csv(uri: &Uri, headers: &HeaderMap) -> Result<bool, ApiError> {
    let q: FormatQuery = serde_urlencoded_query(uri.query())?;
    match q.format.as_deref() {
        Some("csv") => return Ok(true),
        Some("json") => return Ok(false),
        Some(_) => return Err(ApiError::bad_request("format", "must be csv or json")),
        None => {}
    }
    Ok(headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|m| m.split(';').next().unwrap_or("").trim() == "text/csv"))
}

fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn finish(w: csv::Writer<Vec<u8>>) -> Result<String, ApiError> {
    let bytes = w.into_inner().map_err(|e| ApiError::internal(e.error()))?;
    String::from_utf8(bytes).map_err(ApiError::internal)
}

/// One row per event: its key, subject, meter (model and share for GPU
/// meters), billing class, interval, amount, node and what it corrects.
pub fn usage_csv(events: &[UsageEvent]) -> Result<String, ApiError> {
    let mut w = csv::Writer::from_writer(Vec::new());
    w.write_record([
        "tenant",
        "source",
        "id",
        "subject_kind",
        "subject_id",
        "meter",
        "model",
        "share",
        "billing_class",
        "start",
        "end",
        "amount",
        "node",
        "corrects",
    ])
    .map_err(ApiError::internal)?;
    for e in events {
        let (meter, model, share) = match &e.meter {
            Meter::GpuSeconds { model, share } => (
                "gpu_seconds",
                model.as_str(),
                match share {
                    GpuShare::Whole => "whole".to_string(),
                    GpuShare::Fraction { milli } => format!("milli:{milli}"),
                    GpuShare::Mig(p) => format!("mig:{}", p.name),
                },
            ),
            Meter::InstanceSeconds => ("instance_seconds", "", String::new()),
            Meter::StorageGbSeconds => ("storage_gb_seconds", "", String::new()),
            Meter::ParkedGbSeconds => ("parked_gb_seconds", "", String::new()),
            Meter::Requests => ("requests", "", String::new()),
            Meter::InputTokens => ("input_tokens", "", String::new()),
            Meter::OutputTokens => ("output_tokens", "", String::new()),
        };
        let subject_kind = serde_json::to_value(e.subject.kind)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        w.write_record([
            e.key.tenant.as_str(),
            &e.key.source,
            &e.key.id,
            &subject_kind,
            &e.subject.id,
            meter,
            model,
            &share,
            e.billing_class.as_str(),
            &time(e.start),
            &time(e.end),
            &e.amount.to_string(),
            e.node.as_ref().map(|n| n.as_str()).unwrap_or(""),
            &e.corrects
                .as_ref()
                .map(|c| c.to_string())
                .unwrap_or_default(),
        ])
        .map_err(ApiError::internal)?;
    }
    finish(w)
}

/// One row per invoice line: [`flotilla_billing::export::invoices_csv`],
/// shared with the console's download of a draft invoice.
pub fn invoices_csv(invoices: &[Invoice]) -> Result<String, ApiError> {
    flotilla_billing::export::invoices_csv(invoices).map_err(ApiError::internal)
}

/// A CSV answer, with the next page's cursor in `X-Next-Cursor`.
pub fn csv_response(body: String, next_cursor: Option<&str>) -> Response {
    let mut resp = (
        [(header::CONTENT_TYPE, HeaderValue::from_static(TEXT_CSV))],
        body,
    )
        .into_response();
    if let Some(c) = next_cursor.and_then(|c| HeaderValue::from_str(c).ok()) {
        resp.headers_mut().insert("x-next-cursor", c);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_and_accept_choose_csv() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::ACCEPT, HeaderValue::from_str(v).unwrap());
            m
        };
        let u = |s: &str| s.parse::<Uri>().unwrap();
        assert!(wants_csv(&u("/v1/usage?format=csv"), &HeaderMap::new()).unwrap());
        assert!(!wants_csv(&u("/v1/usage"), &HeaderMap::new()).unwrap());
        assert!(wants_csv(&u("/v1/usage"), &h("application/json, text/csv;q=0.9")).unwrap());
        assert!(!wants_csv(&u("/v1/usage?format=json"), &h("text/csv")).unwrap());
        assert!(wants_csv(&u("/v1/usage?format=xml"), &HeaderMap::new()).is_err());
    }

    #[test]
    fn usage_rows_quote_what_needs_quoting() {
        let e: UsageEvent = serde_json::from_value(serde_json::json!({
            "key": {"tenant": flotilla_core::id::TenantId::generate(1, 1), "source": "a,b", "id": "x\"y"},
            "subject": {"kind": "instance", "id": "inst_1"},
            "meter": {"meter": "gpu_seconds", "model": "H100", "share": {"kind": "milli", "milli": 500}},
            "billing_class": "spot",
            "start": "2025-01-01T00:00:00Z", "end": "2025-01-01T00:01:00Z",
            "amount": "2"
        }))
        .unwrap();
        let text = usage_csv(&[e]).unwrap();
        let mut r = csv::Reader::from_reader(text.as_bytes());
        let rows: Vec<csv::StringRecord> = r.records().map(|r| r.unwrap()).collect();
        assert_eq!(rows.len(), 1);
        assert_eq!(&rows[0][1], "a,b");
        assert_eq!(&rows[0][2], "x\"y");
        assert_eq!(&rows[0][7], "milli:500");
        assert_eq!(&rows[0][9], "2025-01-01T00:00:00.000Z");
    }
}
