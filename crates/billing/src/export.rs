//! CSV of invoices, one row per line: the writer behind the API's
//! `?format=csv` answers and the console's download of a draft invoice,
//! kept here so that both write the same columns. Pure: it writes to
//! memory.

use chrono::{DateTime, SecondsFormat, Utc};

use crate::invoice::{Invoice, InvoiceStatus};

fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// One row per invoice line, with its invoice's id, tenant, period,
/// status and currency repeated, so the rows of several invoices can be
/// filtered and summed as they are.
pub fn invoices_csv(invoices: &[Invoice]) -> std::io::Result<String> {
    let mut w = csv::Writer::from_writer(Vec::new());
    w.write_record([
        "invoice",
        "tenant",
        "period_start",
        "period_end",
        "status",
        "currency",
        "line",
        "kind",
        "description",
        "model",
        "quantity",
        "unit",
        "unit_price",
        "amount",
        "price_version",
        "price_point_at",
        "reference",
    ])?;
    for inv in invoices {
        let status = match inv.status() {
            InvoiceStatus::Draft => "draft",
            InvoiceStatus::Finalised { .. } => "finalised",
        };
        for (i, l) in inv.lines().iter().enumerate() {
            let kind = serde_json::to_value(l.kind)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            w.write_record([
                inv.id().as_str(),
                inv.tenant().as_str(),
                &time(inv.period().start),
                &time(inv.period().end),
                status,
                &inv.currency().code,
                &(i + 1).to_string(),
                &kind,
                &l.description,
                l.model.as_deref().unwrap_or(""),
                &l.quantity.to_string(),
                &l.unit,
                &l.unit_price.to_string(),
                &l.amount.to_string(),
                &l.price_version.map(|v| v.to_string()).unwrap_or_default(),
                &l.price_point_at.map(time).unwrap_or_default(),
                l.reference.as_deref().unwrap_or(""),
            ])?;
        }
    }
    let bytes = w.into_inner().map_err(|e| e.into_error())?;
    String::from_utf8(bytes).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}
