//! A human-readable API reference rendered from the OpenAPI document, so it
//! works offline and cannot disagree with the code.

use std::fmt::Write;

use utoipa::openapi::path::{HttpMethod, Operation};
use utoipa::openapi::OpenApi;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn operations(doc: &OpenApi) -> Vec<(String, &'static str, &Operation)> {
    let mut out = Vec::new();
    for (path, item) in doc.paths.paths.iter() {
        let methods: [(&'static str, &Option<Operation>); 5] = [
            ("GET", &item.get),
            ("POST", &item.post),
            ("PUT", &item.put),
            ("PATCH", &item.patch),
            ("DELETE", &item.delete),
        ];
        for (m, op) in methods {
            if let Some(op) = op {
                out.push((path.clone(), m, op));
            }
        }
    }
    out
}

/// Renders the reference page.
pub fn render(doc: &OpenApi) -> String {
    let _ = HttpMethod::Get;
    let mut html = String::from(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>Flotilla API</title>\
         <style>body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#1b1f24}\
         code{background:#f1f3f5;padding:.1rem .3rem;border-radius:3px}\
         .op{border-top:1px solid #dde;padding:.6rem 0}.m{display:inline-block;width:4.5rem;font-weight:700}\
         .GET{color:#0a7}.POST{color:#07c}.PUT{color:#a60}.DELETE{color:#c22}small{color:#667}</style></head><body>",
    );
    let _ = write!(html, "<h1>{}</h1>", esc(&doc.info.title));
    if let Some(d) = &doc.info.description {
        let _ = write!(html, "<p>{}</p>", esc(d));
    }
    html.push_str("<p>Machine-readable: <a href=\"/v1/openapi.json\">/v1/openapi.json</a>.</p>");
    let mut ops = operations(doc);
    ops.sort_by(|a, b| {
        let tag = |o: &Operation| {
            o.tags
                .as_ref()
                .and_then(|t| t.first().cloned())
                .unwrap_or_default()
        };
        (tag(a.2), &a.0).cmp(&(tag(b.2), &b.0))
    });
    let mut current = String::new();
    for (path, method, op) in ops {
        let tag = op
            .tags
            .as_ref()
            .and_then(|t| t.first().cloned())
            .unwrap_or_default();
        if tag != current {
            let _ = write!(html, "<h2>{}</h2>", esc(&tag));
            current = tag;
        }
        let _ = write!(
            html,
            "<div class=\"op\"><span class=\"m {method}\">{method}</span><code>{}</code>",
            esc(&path)
        );
        if let Some(s) = &op.summary {
            let _ = write!(html, "<div>{}</div>", esc(s));
        }
        if let Some(d) = &op.description {
            let _ = write!(html, "<div><small>{}</small></div>", esc(d));
        }
        let codes: Vec<&String> = op.responses.responses.keys().collect();
        let _ = write!(
            html,
            "<div><small>responses: {}</small></div></div>",
            esc(&codes
                .iter()
                .map(|c| c.as_str())
                .collect::<Vec<_>>()
                .join(", "))
        );
    }
    html.push_str("</body></html>");
    html
}
