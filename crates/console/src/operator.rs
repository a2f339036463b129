//! The operator's pages (the fleet map with cordon buttons, the queue with
//! reasons, tenants and quotas, the price catalog) and the provider's
//! page (its nodes, their use, and payout statements).

use axum::extract::{Form, Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;
use flotilla_billing::api::PriceCatalog;
use flotilla_billing::payout::PayoutStatement;
use flotilla_core::id::NodeId;
use flotilla_core::offer::{NodeOffer, OfferWindow};
use flotilla_core::tenant::Role;
use maud::{html, Markup};

use super::fmt::{amount, at, opt, per_hour, unit_price, word};
use super::session::Session;
use super::{
    badge, check, csrf_field, fragment, is_htmx, page, table, ConsoleError, ConsoleResult,
    ConsoleState, Fields,
};

pub(super) fn routes() -> Router<ConsoleState> {
    Router::new()
        .route("/fleet", get(fleet))
        .route("/fleet/{node}/cordon", post(cordon))
        .route("/queue", get(queue))
        .route("/tenants", get(tenants))
        .route("/prices", get(prices))
        .route("/provider", get(provider))
        .route("/provider/{node}/offer", post(set_offer))
}

/// A 404 unless the key is an operator's now: asked of the API, so a key
/// revoked or changed since sign-in is refused.
pub(super) async fn require_operator(s: &Session) -> ConsoleResult<()> {
    if s.api.me().await?.key.role == Role::Operator {
        Ok(())
    } else {
        Err(ConsoleError::Api {
            status: axum::http::StatusCode::NOT_FOUND,
            message: "no such page for this key".into(),
        })
    }
}

/// How a GPU cell is coloured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ColourBy {
    /// Share held by work (always known).
    Allocation,
    /// Kernel utilisation from telemetry.
    Utilisation,
    /// Core temperature from telemetry.
    Temperature,
}

impl ColourBy {
    fn parse(s: Option<&str>) -> Self {
        match s {
            Some("utilisation") => Self::Utilisation,
            Some("temperature") => Self::Temperature,
            _ => Self::Allocation,
        }
    }
    fn as_str(self) -> &'static str {
        match self {
            Self::Allocation => "allocation",
            Self::Utilisation => "utilisation",
            Self::Temperature => "temperature",
        }
    }
}

/// A heat level 0–5 for a value in `0..=max` (`None`: no reading).
fn level(v: Option<f64>, max: f64) -> Option<u8> {
    v.map(|x| ((x / max).clamp(0.0, 1.0) * 5.0).round() as u8)
}

#[derive(serde::Deserialize, Default)]
struct FleetQuery {
    by: Option<String>,
}

async fn fleet(
    State(st): State<ConsoleState>,
    s: Session,
    Query(q): Query<FleetQuery>,
    h: HeaderMap,
) -> ConsoleResult<Response> {
    require_operator(&s).await?;
    let by = ColourBy::parse(q.by.as_deref());
    let nodes = s.api.nodes().await?;
    let telemetry = (st.telemetry)();
    let map = html! {
        div #fleet hx-get={ "/fleet?by=" (by.as_str()) } hx-trigger="every 3s" hx-swap="outerHTML" hx-select="#fleet" {
            @if nodes.is_empty() { p { "No nodes have joined yet: start `flotilla agent` on a GPU machine." } }
            ul.fleet {
                @for n in &nodes {
                    @let nid = n.id.as_str();
                    @let state = n.state.as_str();
                    @let cordoned = n.cordoned;
                    @let samples = telemetry.get(&n.id);
                    li.node .unhealthy[state != "ready"] .cordoned[cordoned] data-node=(nid) data-name=(n.name) {
                        div.node-head {
                            strong { (n.name) }
                            " " (badge(state))
                            @if cordoned { " " (badge("cordoned")) }
                            span.muted { " " (n.region) " · " (n.pool) @if n.simulated { " · simulated" } }
                        }
                        ol.gpus aria-label={ "GPUs of " (n.name) } {
                            @for g in &n.gpus {
                                @let idx = g.index;
                                @let sample = samples.and_then(|t| t.iter().find(|x| x.index == idx));
                                @let used = f64::from(g.used_milli);
                                @let (lvl, text) = match by {
                                    ColourBy::Allocation => (level(Some(used), 1000.0), format!("{:.0}% allocated", used / 10.0)),
                                    ColourBy::Utilisation => {
                                        let u = sample.and_then(|x| x.gpu_util_pct).map(f64::from);
                                        (level(u, 100.0), u.map(|u| format!("{u:.0}% busy")).unwrap_or_else(|| "no reading".into()))
                                    }
                                    ColourBy::Temperature => {
                                        let t = sample.and_then(|x| x.temperature_c).map(f64::from);
                                        (level(t.map(|t| t - 30.0), 60.0), t.map(|t| format!("{t:.0} °C")).unwrap_or_else(|| "no reading".into()))
                                    }
                                };
                                li class={ "gpu heat" (lvl.map(|l| l.to_string()).unwrap_or_else(|| "-none".into())) }
                                    title={ (g.model) " #" (idx) ": " (text) } {
                                    span.gpu-model { (g.model) }
                                    span.gpu-val { (text) }
                                }
                            }
                        }
                        form.inline method="post" action={ "/fleet/" (nid) "/cordon" } {
                            (csrf_field(&s))
                            input type="hidden" name="cordoned" value=(if cordoned { "false" } else { "true" });
                            button type="submit" .danger[!cordoned] aria-label={ (if cordoned { "Uncordon " } else { "Cordon " }) (n.name) } {
                                (if cordoned { "Uncordon" } else { "Cordon" })
                            }
                        }
                    }
                }
            }
        }
    };
    if is_htmx(&h) {
        return Ok(fragment(map));
    }
    let body = html! {
        form.inline method="get" action="/fleet" {
            label for="by" { "Colour GPUs by " }
            select #by name="by" {
                @for b in [ColourBy::Allocation, ColourBy::Utilisation, ColourBy::Temperature] {
                    option value=(b.as_str()) selected[b == by] { (b.as_str()) }
                }
            }
            " " button type="submit" { "Show" }
        }
        p.legend aria-hidden="true" {
            "Low " @for l in 0..=5u8 { span class={ "swatch heat" (l) } {} } " high · "
            span.swatch.heat-none {} " no reading"
        }
        (map)
    };
    Ok(page(&s, "Fleet map", "/fleet", body))
}

async fn cordon(
    s: Session,
    Path(node): Path<String>,
    Form(f): Form<Fields>,
) -> ConsoleResult<Response> {
    check(&s, &f)?;
    require_operator(&s).await?;
    let id =
        NodeId::parse(&node, "node_id").map_err(|e| ConsoleError::field("node_id", e.message))?;
    let cordoned = super::field(&f, "cordoned") != Some("false");
    // The API's own route: it records the change in the audit log and
    // wakes the next pass, which must skip the node at once.
    s.api.cordon_node(&id, cordoned).await?;
    tracing::info!(node = %id, cordoned, "node cordon changed from the console");
    Ok(Redirect::to("/fleet").into_response())
}

async fn queue(s: Session) -> ConsoleResult<Response> {
    let inst = s.api.instance_queue().await?;
    let jobs = s.api.job_queue().await?;
    let rows: Vec<Markup> = inst
        .iter()
        .map(|e| {
            let i = &e.instance;
            html! { tr {
                td.num { (e.position) }
                th scope="row" { a href={ "/instances/" (i.id) } { (i.id) } }
                td { (i.tenant_id) }
                td.num { (i.gpus) }
                td.reason { (i.state_reason) }
                td { (at(&i.created_at)) }
            } }
        })
        .collect();
    let job_rows: Vec<Markup> = jobs
        .iter()
        .map(|e| {
            html! { tr {
                td.num { (e.position) }
                th scope="row" { (e.job.id) }
                td { (e.job.tenant_id) }
                td.reason { (e.job.state_reason) }
            } }
        })
        .collect();
    let body = html! {
        div #queue hx-get="/queue" hx-trigger="every 3s" hx-swap="outerHTML" hx-select="#queue" {
            (table("Pending instances in queue order", &["#", "Instance", "Tenant", "GPUs", "Why it waits", "Queued"], rows,
                "The queue is empty: nothing is waiting for GPUs"))
            (table("Pending jobs in queue order", &["#", "Job", "Tenant", "Why it waits"], job_rows, "No jobs are waiting"))
        }
    };
    Ok(page(&s, "Queue", "/queue", body))
}

async fn tenants(s: Session) -> ConsoleResult<Response> {
    require_operator(&s).await?;
    let list = s.api.tenants().await?;
    let mut rows = Vec::new();
    for t in &list {
        // A tenant whose quota cannot be read still gets its row.
        let q = s.api.quota(&t.id).await.ok();
        let quota = q.as_ref().map(|q| &q.quota);
        let per_model = quota
            .map(|q| {
                q.gpus_per_model
                    .iter()
                    .map(|(k, v)| format!("{k} ≤ {v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default();
        rows.push(html! { tr {
            th scope="row" { (t.name) }
            td { (t.id) }
            td.num { (opt(q.as_ref().map(|q| q.usage.gpus_total))) }
            td.num { (quota.and_then(|q| q.gpus_total).map(|n| n.to_string()).unwrap_or_else(|| "no limit".into())) }
            td { (per_model) }
            td.num { (opt(quota.and_then(|q| q.gpus_guaranteed))) }
            td.num { (opt(quota.and_then(|q| q.weight))) }
        } });
    }
    let body = table(
        "Tenants, their GPUs in use and quotas",
        &[
            "Name",
            "Id",
            "GPUs in use",
            "GPU quota",
            "Per model",
            "Guaranteed",
            "Weight",
        ],
        rows,
        "No tenants",
    );
    Ok(page(&s, "Tenants & quotas", "/tenants", body))
}

async fn prices(s: Session) -> ConsoleResult<Response> {
    let p = s.api.prices().await?;
    Ok(page(&s, "Price catalog", "/prices", prices_body(&p)))
}

/// Every catalog version, newest first, the one in force marked: GPU
/// prices per hour and the reserved offers.
fn prices_body(p: &PriceCatalog) -> Markup {
    let dash = || "—".to_string();
    html! {
        @for v in p.versions.iter().rev() {
            section {
                h2 { "Version " (v.version) @if v.version == p.in_force { " (in force)" } }
                p.muted { "Effective from " (at(&v.effective_from)) }
                (table(&format!("GPU prices per hour, {}", p.currency), &["Model", "On demand /h", "Spot floor /h", "Spot ceiling /h"],
                    v.on_demand.iter().map(|(model, od)| {
                        let band = v.spot.get(model);
                        html! { tr {
                            th scope="row" { (model) }
                            td.num { (per_hour(od.per_gpu_second)) }
                            td.num { (band.map_or_else(dash, |b| per_hour(b.floor))) }
                            td.num { (band.map_or_else(dash, |b| per_hour(b.ceiling))) }
                        } }
                    }).collect(), "No GPU prices"))
                (table("Reserved offers", &["Term (days)", "Discount"],
                    v.reserved_offers.iter().map(|o| html! { tr {
                        td.num { (o.term_days) }
                        td.num { (unit_price(o.discount)) }
                    } }).collect(), "No reserved offers"))
            }
        }
    }
}

async fn provider(State(st): State<ConsoleState>, s: Session) -> ConsoleResult<Response> {
    if !s.is_provider() {
        return Err(ConsoleError::Api {
            status: axum::http::StatusCode::NOT_FOUND,
            message: "no such page for this key".into(),
        });
    }
    let nodes = s.api.nodes().await?;
    let month = st.now().format("%Y-%m").to_string();
    // Without a statement the page still shows the nodes and offers.
    let statements = s
        .api
        .payouts(&month)
        .await
        .map(|p| p.items)
        .unwrap_or_default();
    let mine = |n: &&flotilla_core::api::Node| s.is_operator() || n.owner_tenant_id == s.tenant_id;
    let node_rows = nodes
        .iter()
        .filter(mine)
        .map(|n| {
            let gpus = &n.gpus;
            let used: u64 = gpus.iter().map(|g| u64::from(g.used_milli)).sum();
            html! { tr {
                th scope="row" { (n.name) }
                td { (badge(n.state.as_str())) @if n.cordoned { " " (badge("cordoned")) } }
                td.num { (gpus.len()) }
                td.num { (format!("{:.0}%", if gpus.is_empty() { 0.0 } else { used as f64 / (gpus.len() as f64 * 10.0) })) }
            } }
        })
        .collect();
    let now = st.now();
    let mut offers = Vec::new();
    for n in nodes.iter().filter(mine) {
        let offer = s.api.node_offer(&n.id).await?;
        offers.push((n.id.to_string(), n.name.clone(), offer));
    }
    let body = html! {
        (table("Your nodes and their use now", &["Node", "State", "GPUs", "Allocated"], node_rows, "No nodes: join one with `flotilla agent`"))
        h2 { "When your GPUs are offered (UTC)" }
        p.help { "One window a line: optional days, then start-end, e.g. `mon,tue,wed,thu,fri 18:00-08:00` "
            "(past midnight) or `12:00-14:00` (every day). No lines: always offered. Outside its windows a node "
            "takes no new work; work still running is stopped, with notice, " (flotilla_core::offer::NOTICE.num_minutes()) " minutes before a window closes." }
        @for (nid, name, offer) in &offers {
            section.offer data-node=(nid) data-name=(name) {
                h3 { (name) " · offered now: "
                    span.offered { (if offer.offered_at(now) { "yes" } else { "no (outside its windows)" }) } }
                form method="post" action={ "/provider/" (nid) "/offer" } {
                    (csrf_field(&s))
                    label for={ "w-" (nid) } { "Offer windows of " (name) }
                    br;
                    textarea id={ "w-" (nid) } name="windows" rows="3" cols="40" {
                        (offer.windows.iter().map(window_line).collect::<Vec<_>>().join("\n"))
                    }
                    br;
                    button type="submit" { "Save windows of " (name) }
                }
            }
        }
        h2 { "Payout statements, " (month) }
        @if statements.is_empty() { p { "No payout statement for this month yet." } }
        @for p in &statements { (payout_statement(p)) }
    };
    Ok(page(&s, "My GPUs & payouts", "/provider", body))
}

/// One provider's payout statement: its lines, gross, fee and payout.
fn payout_statement(p: &PayoutStatement) -> Markup {
    let cur = p.currency.code.as_str();
    html! {
        (table(&format!("Provider {}", p.provider), &["Model", "Kind", "GPU-seconds", "Unit price", "Gross"],
            p.lines.iter().map(|l| html! { tr {
                td { (l.model) } td { (word(&l.kind)) }
                td.num { (l.gpu_seconds) } td.num { (unit_price(l.unit_price)) }
                td.num { (amount(l.gross, cur)) }
            } }).collect(), "No usage on these nodes this month"))
        dl.facts.totals {
            dt { "Gross" } dd { (amount(p.gross, cur)) }
            dt { "Operator fee" } dd { (amount(p.operator_fee, cur)) }
            dt { "Payout" } dd { (amount(p.payout, cur)) }
        }
    }
}

/// A window as the provider page writes it: `mon,tue 08:00-18:00`.
fn window_line(w: &OfferWindow) -> String {
    if w.days.is_empty() {
        format!("{}-{}", w.start, w.end)
    } else {
        format!("{} {}-{}", w.days.join(","), w.start, w.end)
    }
}

/// The provider page's lines as windows; checked by the API after.
fn parse_windows(text: &str) -> ConsoleResult<Vec<OfferWindow>> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (days, span) = match l.rsplit_once(' ') {
                Some((d, span)) => (
                    d.split(',')
                        .map(|d| d.trim().to_ascii_lowercase())
                        .filter(|d| !d.is_empty())
                        .collect(),
                    span,
                ),
                None => (Vec::new(), l),
            };
            let (start, end) = span.split_once('-').ok_or_else(|| {
                ConsoleError::field("windows", format!("`{l}` is not `[days] HH:MM-HH:MM`"))
            })?;
            Ok(OfferWindow {
                days,
                start: start.trim().to_string(),
                end: end.trim().to_string(),
            })
        })
        .collect()
}

async fn set_offer(
    s: Session,
    Path(node): Path<String>,
    Form(f): Form<Fields>,
) -> ConsoleResult<Response> {
    check(&s, &f)?;
    let id =
        NodeId::parse(&node, "node_id").map_err(|e| ConsoleError::field("node_id", e.message))?;
    let offer = NodeOffer {
        windows: parse_windows(super::field(&f, "windows").unwrap_or(""))?,
    };
    s.api.set_node_offer(&id, &offer).await?;
    Ok(Redirect::to("/provider").into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offer_lines_round_trip() {
        let w = parse_windows("mon,TUE 18:00-08:00\n\n12:00-14:00\n").unwrap();
        assert_eq!(w.len(), 2);
        assert_eq!(w[0].days, vec!["mon", "tue"]);
        assert_eq!((w[0].start.as_str(), w[0].end.as_str()), ("18:00", "08:00"));
        assert!(w[1].days.is_empty());
        assert_eq!(window_line(&w[0]), "mon,tue 18:00-08:00");
        assert_eq!(window_line(&w[1]), "12:00-14:00");
        assert!(parse_windows("sometimes").is_err());
    }

    #[test]
    fn prices_and_payouts_render_from_the_typed_answers() {
        let html = prices_body(&crate::tenant::tests::catalog()).into_string();
        for want in [
            "Version 1 (in force)",
            "Effective from 2026-01-01 00:00:00",
            "GPU prices per hour, USD",
            ">2.99<",
            ">0.72<",
            ">2.16<",
            ">365<",
            ">0.35<",
        ] {
            assert!(html.contains(want), "{want} in {html}");
        }
        // L40S has an on-demand price and no spot band.
        assert!(
            html.contains(">1.08</td><td class=\"num\">—</td><td class=\"num\">—<"),
            "{html}"
        );
        let p: PayoutStatement = serde_json::from_value(serde_json::json!({
            "provider": flotilla_core::id::ProviderId::generate(1, 1),
            "period": {"start": "2026-12-01T00:00:00Z", "end": "2027-01-01T00:00:00Z"},
            "currency": {"code": "USD", "minor_units": 2},
            "lines": [{"model": "H100", "kind": "spot", "gpu_seconds": "3600", "unit_price": "0.0004",
                "gross": "1.44", "price_version": 1, "price_point_at": null}],
            "gross": "1.44", "operator_fee": "0.144", "payout": "1.296",
        }))
        .unwrap();
        let html = payout_statement(&p).into_string();
        for want in [
            format!("Provider {}", p.provider),
            "<td>spot</td>".into(),
            ">3600<".into(),
            ">0.0004<".into(),
            "1.44 USD".into(),
            "0.14 USD".into(),
            "1.30 USD".into(),
        ] {
            assert!(html.contains(&want), "{want} in {html}");
        }
    }

    #[test]
    fn heat_levels_are_clamped_and_missing_readings_stay_missing() {
        assert_eq!(level(Some(0.0), 100.0), Some(0));
        assert_eq!(level(Some(100.0), 100.0), Some(5));
        assert_eq!(level(Some(250.0), 100.0), Some(5));
        assert_eq!(level(Some(-5.0), 100.0), Some(0));
        assert_eq!(level(None, 100.0), None);
        assert_eq!(ColourBy::parse(Some("temperature")), ColourBy::Temperature);
        assert_eq!(ColourBy::parse(Some("x")), ColourBy::Allocation);
    }
}
