//! The tenant's pages: the GPU catalog, instances (launch, logs, stop),
//! jobs, endpoints (replicas against traffic, latency against the SLO),
//! usage and invoices (cost chart, CSV), budget, API keys and the cost
//! estimator. Each reads and writes through the API as the signed-in key.

use std::collections::BTreeMap;
use std::str::FromStr;

use axum::extract::{Form, Path, Query, State};
use axum::http::header::{CONTENT_DISPOSITION, CONTENT_TYPE};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use flotilla_billing::api::{BudgetView, PriceCatalog, SetBudget, SpotPrices};
use flotilla_billing::estimate::{BillingModel, Estimate, GpuWorkload, Workload};
use flotilla_billing::invoice::InvoiceStatus;
use flotilla_billing::Invoice;
use flotilla_core::api::{ApiKey, CreateApiKey, CreatedApiKey, GpuTypeView, Instance};
use flotilla_core::endpoint::{CreateEndpoint, Endpoint};
use flotilla_core::instance::{BillingClass, CreateInstance};
use flotilla_core::tenant::Role;
use maud::{html, Markup};
use rust_decimal::Decimal;

use super::fmt::{amount, at, at_opt, opt, per_hour, unit_price, word};
use super::session::Session;
use super::{
    badge, check, csrf_field, field, fragment, is_htmx, json_data, page, table, ConsoleError,
    ConsoleResult, ConsoleState, Fields, Sample,
};

/// Samples kept per endpoint chart (10 minutes at one every 2 s).
const SERIES_LEN: usize = 300;

pub(super) fn routes() -> Router<ConsoleState> {
    Router::new()
        .route("/gpus", get(gpus))
        .route("/instances", get(instances).post(launch))
        .route("/instances/{id}", get(instance))
        .route("/instances/{id}/logs", get(instance_logs))
        .route("/instances/{id}/stop", post(stop_instance))
        .route("/jobs", get(jobs))
        .route("/endpoints", get(endpoints).post(deploy))
        .route("/endpoints/{id}", get(endpoint))
        .route("/endpoints/{id}/series", get(endpoint_series))
        .route("/endpoints/{id}/delete", post(delete_endpoint))
        .route("/billing", get(billing))
        .route("/invoices/draft/{period}", get(draft_invoice))
        .route("/invoices/draft/{period}/csv", get(draft_invoice_csv))
        .route("/invoices/{id}", get(final_invoice))
        .route("/invoices/{id}/csv", get(final_invoice_csv))
        .route("/budget", get(budget).post(set_budget))
        .route("/keys", get(keys).post(create_key))
        .route("/keys/{id}/revoke", post(revoke_key))
        .route("/estimate", get(estimate))
}

/// A path segment as the API expects it: ids are `[a-z0-9_]`; anything
/// else cannot name an object, and is refused before it reaches a URL.
pub(super) fn seg(raw: &str) -> ConsoleResult<&str> {
    if !raw.is_empty()
        && raw.len() <= 100
        && raw
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        Ok(raw)
    } else {
        Err(ConsoleError::Api {
            status: axum::http::StatusCode::NOT_FOUND,
            message: "no such object".into(),
        })
    }
}

/// `KEY=VALUE` lines as an environment.
fn env_lines(text: Option<&str>) -> ConsoleResult<BTreeMap<String, String>> {
    let mut env = BTreeMap::new();
    for line in text.unwrap_or("").lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (k, v) = line
            .split_once('=')
            .ok_or_else(|| ConsoleError::field("env", format!("`{line}` is not KEY=VALUE")))?;
        env.insert(k.trim().to_string(), v.to_string());
    }
    Ok(env)
}

fn parse_num<T: std::str::FromStr>(f: &Fields, name: &'static str) -> ConsoleResult<Option<T>> {
    field(f, name)
        .map(|v| {
            v.parse::<T>()
                .map_err(|_| ConsoleError::field(name, format!("`{v}` is not a number")))
        })
        .transpose()
}

// ---- GPUs ------------------------------------------------------------------

async fn gpus(s: Session, h: HeaderMap) -> ConsoleResult<Response> {
    let types = s.api.gpu_types().await?;
    let prices = s.api.prices().await?;
    // Without spot prices the catalog still shows, spot as —.
    let spot = s.api.spot_prices().await.ok();
    let body = gpus_body(types, &prices, spot.as_ref());
    if is_htmx(&h) {
        return Ok(fragment(body));
    }
    Ok(page(&s, "GPUs", "/gpus", body))
}

/// The GPU catalog: each model with its free GPUs, its on-demand price
/// in the version in force and its latest spot price per hour; models the
/// pool has first.
fn gpus_body(
    mut types: Vec<GpuTypeView>,
    prices: &PriceCatalog,
    spot: Option<&SpotPrices>,
) -> Markup {
    let version = prices
        .versions
        .iter()
        .find(|v| v.version == prices.in_force);
    types.sort_by_key(|t| t.total == 0);
    let rows = types
        .iter()
        .map(|t| {
            let name = t.model.name.as_str();
            let od = version
                .and_then(|v| v.on_demand.get(name))
                .map(|p| per_hour(p.per_gpu_second));
            let spot = spot
                .and_then(|sp| sp.latest.iter().find(|p| p.model == name))
                .map(|p| per_hour(p.per_gpu_second));
            html! {
                tr data-model=(name) {
                    th scope="row" { (name) }
                    td { (word(&t.model.vendor)) }
                    td.num { (t.model.memory_gib) " GiB" }
                    td.num.free { (t.free) " / " (t.total) }
                    td { meter min="0" max=(t.total.max(1)) value=(t.free) aria-label={ (name) " GPUs free" } {} }
                    td.num { (opt(od)) }
                    td.num { (opt(spot)) }
                }
            }
        })
        .collect();
    html! {
        div #catalog hx-get="/gpus" hx-trigger="every 5s" hx-swap="outerHTML" hx-select="#catalog" {
            (table(&format!("GPU models, free now, and prices per GPU-hour in {} (catalog version {})", prices.currency, prices.in_force),
                &["Model", "Vendor", "Memory", "Free / total", "Availability", "On demand /h", "Spot /h"],
                rows, "No GPU models in the catalog"))
        }
        p { a.button href="/instances#launch" { "Launch an instance" } }
    }
}

// ---- Instances -------------------------------------------------------------

/// An instance's GPUs as `flotilla ps` writes them: `2 × H100`, a share
/// as `0.25 × L40S`, a MIG slice as `H100 1g.10gb`; the models asked
/// (`H100|A100`) or `any` until it is placed.
fn instance_gpus(i: &Instance) -> String {
    let model = match &i.gpu_model {
        Some(m) => m.clone(),
        None if i.gpu_types.is_empty() => "any".to_string(),
        None => i.gpu_types.join("|"),
    };
    if let Some(f) = i.gpu_fraction {
        return format!("{f} × {model}");
    }
    if let Some(p) = &i.mig_profile {
        return format!("{model} {p}");
    }
    format!("{} × {model}", i.gpus)
}

fn instance_row(i: &Instance) -> Markup {
    html! {
        tr data-instance=(i.id) {
            th scope="row" { a href={ "/instances/" (i.id) } { (i.id) } }
            td { (i.name.as_deref().unwrap_or("")) }
            td { (badge(i.state.as_str())) }
            td.reason { (i.state_reason) }
            td.num.gpus { (instance_gpus(i)) }
            td { (opt(i.node_id.as_ref())) }
            td { (at(&i.created_at)) }
        }
    }
}

/// The names of the catalog's models, for the forms' model lists.
fn model_names(types: &[GpuTypeView]) -> Vec<String> {
    types.iter().map(|t| t.model.name.clone()).collect()
}

async fn instances(s: Session, h: HeaderMap) -> ConsoleResult<Response> {
    let mut list = s.api.instances(None, Some(200)).await?;
    list.reverse();
    let rows = list.iter().map(instance_row).collect();
    let tbl = html! {
        div #instances hx-get="/instances" hx-trigger="every 2s" hx-swap="outerHTML" hx-select="#instances" {
            (table("Instances, newest first", &["Id", "Name", "State", "Reason", "GPUs", "Node", "Created"], rows,
                "No instances yet: launch one below"))
        }
    };
    if is_htmx(&h) {
        return Ok(fragment(tbl));
    }
    let models = model_names(&s.api.gpu_types().await?);
    let body = html! {
        (tbl)
        section #launch aria-labelledby="launch-h" {
            h2 #launch-h { "Launch an instance" }
            form.grid method="post" action="/instances" {
                (csrf_field(&s))
                label for="i-name" { "Name (optional)" }
                input #i-name name="name" maxlength="63";
                label for="i-model" { "GPU model" }
                select #i-model name="model" {
                    option value="" { "Any model" }
                    @for m in &models { option value=(m) { (m) } }
                }
                label for="i-count" { "Whole GPUs" }
                input #i-count name="gpus" type="number" min="1" max="64" value="1";
                label for="i-share" { "Or a share of one GPU (0.05–0.95)" }
                input #i-share name="gpu_fraction" type="number" min="0.05" max="0.95" step="0.05" placeholder="whole GPUs";
                label for="i-class" { "Billing class" }
                select #i-class name="billing_class" {
                    option value="on_demand" { "On demand" }
                    option value="spot" { "Spot (preemptible, cheaper)" }
                    option value="reserved" { "Reserved (under a commitment)" }
                }
                label for="i-cmd" { "Command (run with sh -c)" }
                input #i-cmd name="command" placeholder="python train.py";
                label for="i-image" { "Or a container image" }
                input #i-image name="image" placeholder="registry.example/app:1";
                label for="i-env" { "Environment (KEY=VALUE per line)" }
                textarea #i-env name="env" rows="3" {}
                div.actions { button type="submit" { "Launch" } }
            }
        }
    };
    Ok(page(&s, "Instances", "/instances", body))
}

async fn launch(s: Session, Form(f): Form<Fields>) -> ConsoleResult<Response> {
    check(&s, &f)?;
    let inst = s.api.create_instance(&launch_request(&f)?).await?;
    Ok(Redirect::to(&format!("/instances/{}", inst.id)).into_response())
}

/// The launch form as the API's request: one GPU with a share, the
/// command run by `sh -c`, an unknown billing class refused by its name.
fn launch_request(f: &Fields) -> ConsoleResult<CreateInstance> {
    let gpu_fraction: Option<f64> = parse_num(f, "gpu_fraction")?;
    let gpus = if gpu_fraction.is_some() {
        1
    } else {
        parse_num(f, "gpus")?.unwrap_or(1)
    };
    let billing_class = match field(f, "billing_class") {
        None => BillingClass::default(),
        Some(b) => BillingClass::parse(b).ok_or_else(|| {
            ConsoleError::field(
                "billing_class",
                format!("`{b}` is not one of on_demand, spot, reserved"),
            )
        })?,
    };
    Ok(CreateInstance {
        gpus,
        name: field(f, "name").map(str::to_string),
        gpu_types: field(f, "model").map(str::to_string).into_iter().collect(),
        cpu_milli: None,
        memory_mb: None,
        disk_mb: None,
        command: shell_command(field(f, "command")),
        env: env_lines(field(f, "env"))?,
        workdir: None,
        billing_class,
        priority: None,
        tier: None,
        preemptible: None,
        gpu_fraction,
        mig_profile: None,
        image: field(f, "image").map(str::to_string),
        ports: Vec::new(),
        scratch_mb: None,
    })
}

/// A command line as `sh -c` runs it; none when the field is blank.
fn shell_command(c: Option<&str>) -> Vec<String> {
    c.map(|c| vec!["sh".into(), "-c".into(), c.into()])
        .unwrap_or_default()
}

async fn instance(s: Session, Path(id): Path<String>, h: HeaderMap) -> ConsoleResult<Response> {
    let id = seg(&id)?;
    let i = s.api.instance(id).await?;
    let summary = instance_summary(&s, &i);
    if is_htmx(&h) {
        return Ok(fragment(summary));
    }
    let title = format!("Instance {}", i.name.as_deref().unwrap_or(id));
    let state = i.state.as_str();
    let body = html! {
        p.muted { (id) }
        (summary)
        div.tabs role="tablist" aria-label="Instance views" {
            button #tab-logs type="button" role="tab" aria-selected="true" aria-controls="panel-logs" { "Logs" }
            button #tab-terminal type="button" role="tab" aria-selected="false" aria-controls="panel-terminal" tabindex="-1" { "Terminal" }
        }
        section #panel-logs role="tabpanel" aria-labelledby="logs-h" {
            h2 #logs-h { "Logs" }
            div.logs #logs role="log" aria-live="polite" tabindex="0" {
                (log_poller(id, 0))
            }
        }
        section #panel-terminal role="tabpanel" aria-labelledby="terminal-h" hidden {
            h2 #terminal-h { "Terminal" }
            (terminal_panel(&s, id, state))
        }
    };
    Ok(page(&s, &title, "/instances", body))
}

/// The instance page's live part: its facts, the stop button while it
/// can still be stopped, its lifecycle; polled while it is not final.
fn instance_summary(s: &Session, i: &Instance) -> Markup {
    use flotilla_core::instance::InstanceState as S;
    let live = matches!(
        i.state,
        S::Pending | S::Scheduled | S::Starting | S::Running
    );
    html! {
        div #summary hx-get={ "/instances/" (i.id) } hx-trigger=[live.then_some("every 2s")] hx-swap="outerHTML" hx-select="#summary" {
            dl.facts {
                dt { "State" } dd #state { (badge(i.state.as_str())) }
                dt { "Reason" } dd { (i.state_reason) }
                dt { "GPUs" } dd #gpus { (instance_gpus(i)) }
                dt { "Node" } dd { (opt(i.node_id.as_ref())) }
                dt { "Exit code" } dd { (opt(i.exit_code)) }
                dt { "Started" } dd { (at_opt(i.started_at.as_ref())) }
                dt { "Finished" } dd { (at_opt(i.finished_at.as_ref())) }
            }
            @if live && !i.stop_requested {
                form method="post" action={ "/instances/" (i.id) "/stop" } {
                    (csrf_field(s))
                    button.danger type="submit" { "Stop instance" }
                }
            }
            (table("Lifecycle", &["When", "State", "Why"], i.events.iter().map(|e| html! {
                tr { td { (at(&e.at)) } td { (badge(e.state.as_str())) } td { (e.reason) } }
            }).collect(), "No events"))
        }
    }
}

/// The terminal tab: a shell inside a running instance (xterm.js,
/// driven by `console.js` over [`super::terminal`]'s WebSocket), or why
/// there is none.
fn terminal_panel(s: &Session, id: &str, state: &str) -> Markup {
    if state != "running" {
        let why = match state {
            "pending" | "scheduled" | "starting" => format!(
                "The instance is {state}: its terminal opens once it runs. Reload this page then."
            ),
            _ => format!("The instance is {state}: only a running instance has a terminal."),
        };
        return html! { p #terminal-why { (why) } };
    }
    html! {
        link rel="stylesheet" href="/assets/xterm.css";
        script src="/assets/xterm.min.js" defer {}
        script src="/assets/addon-fit.min.js" defer {}
        p.help #terminal-help {
            "A shell inside the instance (bash, else sh), as its workload's user, in its working directory, "
            "as `flotilla shell` opens. Each opening is recorded in the audit log."
        }
        div.term-bar {
            button #terminal-reconnect type="button" disabled { "Reconnect" }
            span #terminal-status role="status" aria-live="polite" data-state="idle" { "Not connected" }
        }
        div.terminal #terminal data-ws={ "/instances/" (id) "/terminal" } data-csrf=(s.csrf)
            role="group" aria-label={ "Terminal of instance " (id) } aria-describedby="terminal-help" {}
    }
}

/// The element that fetches the next lines once, then replaces itself
/// with them and a new poller: the log grows without refetching.
fn log_poller(id: &str, since: u64) -> Markup {
    html! {
        span.poll hx-get={ "/instances/" (id) "/logs?since=" (since) } hx-trigger="load delay:1s" hx-swap="outerHTML" {}
    }
}

#[derive(serde::Deserialize)]
struct SinceQuery {
    since: Option<u64>,
}

async fn instance_logs(
    s: Session,
    Path(id): Path<String>,
    Query(q): Query<SinceQuery>,
) -> ConsoleResult<Response> {
    let id = seg(&id)?;
    let since = q.since.unwrap_or(0);
    let lines = s.api.logs_page(id, since).await?.items;
    let next = lines.last().map_or(since, |l| l.seq + 1);
    // Keep polling while the instance can still write, or lines remain.
    let more = if lines.len() == flotilla_client::LOG_PAGE_SIZE {
        true
    } else {
        {
            use flotilla_core::instance::InstanceState as S;
            let state = s.api.instance(id).await?.state;
            !matches!(state, S::Succeeded | S::Failed | S::Stopped | S::Lost) || !lines.is_empty()
        }
    };
    Ok(fragment(html! {
        @for l in &lines {
            div class={ "line " (word(&l.stream)) } { (flotilla_core::text::escape_controls(&l.line)) }
        }
        @if more { (log_poller(id, next)) } @else { div.end { "— end of output —" } }
    }))
}

async fn stop_instance(
    s: Session,
    Path(id): Path<String>,
    Form(f): Form<Fields>,
) -> ConsoleResult<Response> {
    check(&s, &f)?;
    let id = seg(&id)?;
    s.api.stop_instance(id).await?;
    Ok(Redirect::to(&format!("/instances/{id}")).into_response())
}

// ---- Jobs ------------------------------------------------------------------

async fn jobs(s: Session) -> ConsoleResult<Response> {
    let mut list = s.api.jobs(None).await?;
    list.reverse();
    let rows = list
        .iter()
        .map(|j| {
            html! {
                tr {
                    th scope="row" { (j.id) }
                    td { (j.spec.name.as_deref().unwrap_or("")) }
                    td { (badge(j.state.as_str())) }
                    td.reason { (j.state_reason) }
                    td.num { (j.spec.nodes) " × " (j.spec.gpus) }
                    td.num { (j.attempts) }
                    td { (at(&j.created_at)) }
                }
            }
        })
        .collect();
    let body = html! {
        (table("Jobs, newest first", &["Id", "Name", "State", "Reason", "Nodes × GPUs", "Attempt", "Created"], rows,
            "No jobs: submit one with `flotilla jobs submit`"))
    };
    Ok(page(&s, "Jobs", "/jobs", body))
}

// ---- Endpoints -------------------------------------------------------------

/// Replicas routed to, of those not yet stopped.
fn ready_replicas(e: &Endpoint) -> usize {
    e.replicas.iter().filter(|r| r.ready).count()
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

fn endpoint_row(e: &Endpoint) -> Markup {
    html! {
        tr data-endpoint=(e.id) {
            th scope="row" { a href={ "/endpoints/" (e.id) } { (e.name) } }
            td.num { (ready_replicas(e)) " / " (e.replicas.len()) }
            td.num { (opt(e.desired_replicas)) }
            td { (e.reason.as_deref().unwrap_or("")) }
            td.num { (e.spec.min_replicas) "–" (e.spec.max_replicas) }
            td.num { (e.spec.slo_p95_ms) " ms" }
        }
    }
}

async fn endpoints(s: Session) -> ConsoleResult<Response> {
    let rows = s.api.endpoints().await?.iter().map(endpoint_row).collect();
    let body = html! {
        (table("Endpoints", &["Name", "Ready / replicas", "Desired", "Reason", "Min–max", "SLO p95"], rows,
            "No endpoints yet: deploy one below"))
        section aria-labelledby="deploy-h" {
            h2 #deploy-h { "Deploy an endpoint" }
            form.grid method="post" action="/endpoints" {
                (csrf_field(&s))
                label for="e-name" { "Name (a DNS label)" }
                input #e-name name="name" required pattern="[a-z0-9]([a-z0-9-]*[a-z0-9])?" maxlength="63";
                label for="e-cmd" { "Replica command (run with sh -c; serve HTTP on $PORT)" }
                input #e-cmd name="command" placeholder="exec my-server --port $PORT";
                label for="e-image" { "Or a container image" }
                input #e-image name="image";
                label for="e-models" { "Model names it serves (comma separated)" }
                input #e-models name="models" placeholder="chat";
                label for="e-share" { "Share of one GPU per replica (blank: one whole GPU)" }
                input #e-share name="gpu_fraction" type="number" min="0.05" max="0.95" step="0.05";
                label for="e-min" { "Min replicas" }
                input #e-min name="min_replicas" type="number" min="0" value="0";
                label for="e-max" { "Max replicas" }
                input #e-max name="max_replicas" type="number" min="1" value="4";
                label for="e-slo" { "SLO p95 (ms)" }
                input #e-slo name="slo_p95_ms" type="number" min="1" value="800";
                label for="e-env" { "Environment (KEY=VALUE per line)" }
                textarea #e-env name="env" rows="2" {}
                div.actions { button type="submit" { "Deploy" } }
            }
        }
    };
    Ok(page(&s, "Endpoints", "/endpoints", body))
}

async fn deploy(s: Session, Form(f): Form<Fields>) -> ConsoleResult<Response> {
    check(&s, &f)?;
    let ep = s.api.create_endpoint(&deploy_request(&f)?).await?;
    Ok(Redirect::to(&format!("/endpoints/{}", ep.id)).into_response())
}

/// The deploy form as the API's request; what it leaves blank takes the
/// API's default.
fn deploy_request(f: &Fields) -> ConsoleResult<CreateEndpoint> {
    let name = field(f, "name").ok_or_else(|| ConsoleError::field("name", "enter a name"))?;
    Ok(CreateEndpoint {
        name: name.to_string(),
        command: shell_command(field(f, "command")),
        env: env_lines(field(f, "env"))?,
        image: field(f, "image").map(str::to_string),
        models: field(f, "models")
            .map(|m| {
                m.split(',')
                    .map(str::trim)
                    .filter(|m| !m.is_empty())
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default(),
        gpu_fraction: parse_num(f, "gpu_fraction")?,
        min_replicas: parse_num(f, "min_replicas")?,
        max_replicas: parse_num(f, "max_replicas")?,
        slo_p95_ms: parse_num(f, "slo_p95_ms")?,
        ..CreateEndpoint::default()
    })
}

async fn endpoint(s: Session, Path(id): Path<String>, h: HeaderMap) -> ConsoleResult<Response> {
    let id = seg(&id)?;
    let e = s.api.endpoint(id).await?;
    let live = endpoint_live(&e);
    if is_htmx(&h) {
        return Ok(fragment(live));
    }
    let body = html! {
        p.muted { (id) " · revision " (e.revision) " · policy " (e.spec.policy) }
        section aria-labelledby="chart-h" {
            h2 #chart-h { "Replicas against traffic" }
            div.chart #replica-chart data-series={ "/endpoints/" (id) "/series" } data-kind="replicas"
                role="img" aria-label="Chart of ready replicas, desired replicas and requests per second over time" {}
            h2 { "Latency against the SLO" }
            div.chart #latency-chart data-series={ "/endpoints/" (id) "/series" } data-kind="latency"
                role="img" aria-label="Chart of p95 latency and the SLO over time" {}
            p.help { "Sampled every 2 s while this page is open; the server keeps the last 10 minutes." }
        }
        (live)
        form method="post" action={ "/endpoints/" (id) "/delete" } {
            (csrf_field(&s))
            button.danger type="submit" { "Delete endpoint" }
        }
    };
    Ok(page(
        &s,
        &format!("Endpoint {}", e.name),
        "/endpoints",
        body,
    ))
}

/// The endpoint page's live part, polled every 2 s: its replicas against
/// the autoscaler's decision and its spec.
fn endpoint_live(e: &Endpoint) -> Markup {
    html! {
        div #ep-state hx-get={ "/endpoints/" (e.id) } hx-trigger="every 2s" hx-swap="outerHTML" hx-select="#ep-state" {
            dl.facts {
                dt { "Ready replicas" } dd #ready-replicas { (ready_replicas(e)) " of " (e.replicas.len()) }
                dt { "Desired replicas" } dd { (opt(e.desired_replicas)) }
                dt { "Why" } dd { (e.reason.as_deref().unwrap_or("")) }
                dt { "Replicas" } dd { (e.spec.min_replicas) "–" (e.spec.max_replicas) }
                dt { "SLO p95" } dd { (e.spec.slo_p95_ms) " ms" }
                dt { "Models" } dd { (e.spec.models.join(", ")) }
            }
            (table("Replicas", &["Instance", "Revision", "State", "Ready", "Draining"], e.replicas.iter().map(|r| html! { tr {
                th scope="row" { a href={ "/instances/" (r.instance_id) } { (r.instance_id) } }
                td.num { (r.revision) }
                td { (badge(r.state.as_str())) }
                td { (yes_no(r.ready)) }
                td { (yes_no(r.draining)) }
            } }).collect(), "No replicas (scaled to zero)"))
        }
    }
}

/// An endpoint's chart data, as `console.js` reads it.
#[derive(serde::Serialize)]
struct Series {
    points: Vec<Sample>,
}

/// The endpoint's chart series: samples it now (at most once a second),
/// then returns the kept points.
async fn endpoint_series(
    State(st): State<ConsoleState>,
    s: Session,
    Path(id): Path<String>,
) -> ConsoleResult<Response> {
    let id = seg(&id)?;
    let e = s.api.endpoint(id).await?;
    let now = st.now().timestamp();
    let signals = e.signals.as_ref();
    let requests_total = signals.map_or(0, |g| g.requests_total);
    let mut map = st
        .series
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let q = map.entry(id.to_string()).or_default();
    if q.back().is_none_or(|last| last.t < now) {
        let rps = q
            .back()
            .map(|last| {
                let dt = (now - last.t).max(1) as f64;
                requests_total.saturating_sub(last.requests_total) as f64 / dt
            })
            .unwrap_or(0.0);
        q.push_back(Sample {
            t: now,
            ready: ready_replicas(&e) as u32,
            replicas: e.replicas.len() as u32,
            desired: e.desired_replicas.unwrap_or(0),
            rps,
            in_flight: signals.map_or(0, |g| g.in_flight.saturating_add(g.queued)),
            p95_ms: signals.and_then(|g| g.latency_p95_ms),
            slo_ms: e.spec.slo_p95_ms,
            requests_total,
        });
        while q.len() > SERIES_LEN {
            q.pop_front();
        }
    }
    let points: Vec<Sample> = q.iter().cloned().collect();
    drop(map);
    Ok(super::secure(Json(Series { points })))
}

async fn delete_endpoint(
    s: Session,
    Path(id): Path<String>,
    Form(f): Form<Fields>,
) -> ConsoleResult<Response> {
    check(&s, &f)?;
    let id = seg(&id)?;
    s.api.delete_endpoint(id).await?;
    Ok(Redirect::to("/endpoints").into_response())
}

// ---- Usage and invoices ----------------------------------------------------

fn this_month(st: &ConsoleState) -> String {
    st.now().format("%Y-%m").to_string()
}

fn invoice_lines(inv: &Invoice) -> Markup {
    let currency = &inv.currency().code;
    html! {
        (table("Lines", &["Description", "Model", "Quantity", "Unit", "Unit price", "Amount"], inv.lines().iter().map(|l| html! {
            tr {
                td { (l.description) }
                td { (l.model.as_deref().unwrap_or("")) }
                td.num { (l.quantity.round_dp(3).normalize()) }
                td { (l.unit) }
                td.num { (unit_price(l.unit_price)) }
                td.num { (amount(l.amount, currency)) }
            }
        }).collect(), "No charges in this period"))
        dl.facts.totals {
            dt { "Subtotal" } dd { (amount(inv.subtotal(), currency)) }
            dt { "Total" } dd #invoice-total { (amount(inv.total(), currency)) }
        }
    }
}

/// A month as the billing page names it: `2026-12`.
fn month_of(t: &chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m").to_string()
}

/// A decimal for the charts, which plot floats.
fn plotted(d: Decimal) -> f64 {
    d.to_string().parse().unwrap_or(0.0)
}

/// The cost chart's data, as `console.js` reads it.
#[derive(serde::Serialize)]
struct CostChart<'a> {
    months: Vec<&'a str>,
    totals: Vec<f64>,
    models: Vec<&'a str>,
    model_totals: Vec<f64>,
    currency: &'a str,
}

async fn billing(State(st): State<ConsoleState>, s: Session) -> ConsoleResult<Response> {
    let month = this_month(&st);
    let draft = s.api.invoice_preview(&month).await?;
    let finals = s.api.invoices().await?;
    Ok(page(
        &s,
        "Usage & invoices",
        "/billing",
        billing_body(&s, &month, &draft, &finals),
    ))
}

/// The billing page: cost by month (final invoices, then this month's
/// draft) and this month's cost by model, the draft's lines, the final
/// invoices newest first.
fn billing_body(s: &Session, month: &str, draft: &Invoice, finals: &[Invoice]) -> Markup {
    let currency = draft.currency().code.as_str();
    let mut months: Vec<(String, f64)> = finals
        .iter()
        .filter(|i| s.is_operator() || *i.tenant() == s.tenant_id)
        .map(|i| (month_of(&i.period().start), plotted(i.total())))
        .collect();
    months.push((month.to_string(), plotted(draft.total())));
    let mut by_model: BTreeMap<String, f64> = BTreeMap::new();
    for l in draft.lines() {
        let key = l.model.clone().unwrap_or_else(|| word(&l.kind));
        *by_model.entry(key).or_default() += plotted(l.amount);
    }
    let chart = CostChart {
        months: months.iter().map(|m| m.0.as_str()).collect(),
        totals: months.iter().map(|m| m.1).collect(),
        models: by_model.keys().map(String::as_str).collect(),
        model_totals: by_model.values().copied().collect(),
        currency,
    };
    html! {
        section aria-labelledby="cost-h" {
            h2 #cost-h { "Cost by month (" (currency) ")" }
            (json_data("cost-data", &chart))
            div.chart #cost-chart data-json="cost-data" data-kind="cost" role="img"
                aria-label="Bar chart of the invoice total of each month" {}
        }
        section aria-labelledby="draft-h" {
            h2 #draft-h { "This month so far (" (month) ", draft)" }
            p { a #open-draft href={ "/invoices/draft/" (month) } { "Open this month's invoice" } " · "
                a href={ "/invoices/draft/" (month) "/csv" } download { "Download CSV" } }
            (invoice_lines(draft))
        }
        section aria-labelledby="final-h" {
            h2 #final-h { "Final invoices" }
            (table("Finalised invoices", &["Invoice", "Period", "Tenant", "Total", "CSV"], finals.iter().rev().map(|i| html! { tr {
                th scope="row" { a href={ "/invoices/" (i.id()) } { (i.id()) } }
                td { (month_of(&i.period().start)) }
                td { (i.tenant()) }
                td.num { (amount(i.total(), &i.currency().code)) }
                td { a href={ "/invoices/" (i.id()) "/csv" } download { "CSV" } }
            } }).collect(), "No final invoices yet: a month is finalised 72 hours after it ends"))
        }
    }
}

fn valid_month(p: &str) -> ConsoleResult<&str> {
    let ok = p.len() == 7
        && p.as_bytes()[4] == b'-'
        && p.bytes()
            .enumerate()
            .all(|(i, b)| i == 4 || b.is_ascii_digit());
    if ok {
        Ok(p)
    } else {
        Err(ConsoleError::field("period", "must be YYYY-MM"))
    }
}

async fn draft_invoice(
    State(st): State<ConsoleState>,
    s: Session,
    Path(period): Path<String>,
) -> ConsoleResult<Response> {
    let period = valid_month(&period)?;
    let inv = s.api.invoice_preview(period).await?;
    let check = reconciliation(&st, &s, &inv).await?;
    let body = html! {
        p { "Draft: rated now from the ledger with the prices in force; it may still change until the month is finalised." }
        p { a.button #download-csv href={ "/invoices/draft/" (period) "/csv" } download { "Download CSV" } }
        (invoice_lines(&inv))
        (check)
    };
    Ok(page(
        &s,
        &format!("Invoice {period} (draft)"),
        "/billing",
        body,
    ))
}

fn csv_download(name: &str, body: String) -> Response {
    super::secure((
        [
            (CONTENT_TYPE, "text/csv; charset=utf-8".to_string()),
            (
                CONTENT_DISPOSITION,
                format!("attachment; filename=\"{name}\""),
            ),
        ],
        body,
    ))
}

async fn draft_invoice_csv(s: Session, Path(period): Path<String>) -> ConsoleResult<Response> {
    let period = valid_month(&period)?;
    let inv = s.api.invoice_preview(period).await?;
    // The same writer as the API's CSV of final invoices.
    let csv = flotilla_billing::export::invoices_csv(&[inv]).map_err(ConsoleError::internal)?;
    Ok(csv_download(&format!("invoice-{period}-draft.csv"), csv))
}

async fn final_invoice(
    State(st): State<ConsoleState>,
    s: Session,
    Path(id): Path<String>,
) -> ConsoleResult<Response> {
    let id = seg(&id)?;
    let inv = s.api.invoice(id).await?;
    let check = reconciliation(&st, &s, &inv).await?;
    let finalised = match inv.status() {
        InvoiceStatus::Finalised { at: t } => at(&t),
        InvoiceStatus::Draft => "—".into(),
    };
    let body = html! {
        p.muted { "Finalised " (finalised) " · tenant " (inv.tenant()) }
        p { a.button #download-csv href={ "/invoices/" (id) "/csv" } download { "Download CSV" } }
        (invoice_lines(&inv))
        (check)
    };
    Ok(page(&s, &format!("Invoice {id}"), "/billing", body))
}

/// The invoice's reconciliation, for operators: the ledger its lines are
/// rated from against what the executors saw its tenant's instances run
/// over its period (up to a little before now), at the API's default
/// threshold. A mark when nothing differs; otherwise every difference with
/// its cause. Tenants see nothing (the API answers only operators).
async fn reconciliation(st: &ConsoleState, s: &Session, inv: &Invoice) -> ConsoleResult<Markup> {
    if !s.is_operator() {
        return Ok(html! {});
    }
    let period = inv.period();
    // Metering writes one-minute slices: the API's own default end.
    let until = period.end.min(st.now() - chrono::Duration::minutes(2));
    if until <= period.start {
        return Ok(html! {});
    }
    let stamp =
        |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let report = s
        .api
        .billing_reconcile(&flotilla_client::ReconcileQuery {
            since: Some(stamp(period.start)),
            until: Some(stamp(until)),
            threshold_s: None,
        })
        .await?;
    let ours: Vec<_> = report
        .differences
        .iter()
        .filter(|d| d.tenant == *inv.tenant())
        .collect();
    let threshold = report.threshold_seconds.normalize();
    Ok(html! {
        section aria-labelledby="reconciled-h" {
            h2 #reconciled-h { "Reconciliation" }
            @if ours.is_empty() {
                p.ok #reconciled { "✓ Reconciled: to " (at(&until)) ", the ledger bills what the executors saw this tenant's instances run (no difference over " (threshold) " s)." }
            } @else {
                p.bad #reconciled { "⚠ " (ours.len()) " difference(s) over " (threshold) " s between the ledger and what the executors saw, to " (at(&until)) ":" }
                (table("Differences", &["Instance", "Cause", "Billed s", "Observed s", "Difference s"], ours.iter().map(|d| html! { tr {
                    th scope="row" { (d.instance) }
                    td { (word(&d.cause)) }
                    td.num { (d.billed_seconds.normalize()) }
                    td.num { (d.observed_seconds.normalize()) }
                    td.num { (d.difference_seconds.normalize()) }
                } }).collect(), ""))
            }
        }
    })
}

async fn final_invoice_csv(s: Session, Path(id): Path<String>) -> ConsoleResult<Response> {
    let id = seg(&id)?;
    let csv = s.api.invoice_csv(id).await?;
    Ok(csv_download(&format!("{id}.csv"), csv))
}

// ---- Budget ----------------------------------------------------------------

async fn budget(s: Session) -> ConsoleResult<Response> {
    let b = match s.api.budget(None).await {
        Ok(v) => Some(v),
        Err(e) if e.is_not_found() => None,
        Err(e) => return Err(e.into()),
    };
    Ok(page(&s, "Budget", "/budget", budget_body(&s, b.as_ref())))
}

/// The budget page: the budget in force (if any) against this month's
/// spend, and the form that sets it.
fn budget_body(s: &Session, b: Option<&BudgetView>) -> Markup {
    html! {
        @if let Some(b) = b {
            @let cur = b.currency.as_str();
            dl.facts {
                dt { "Limit" } dd { (amount(b.limit, cur)) }
                dt { "Spent this month" } dd #spend { (amount(b.spend, cur)) }
                dt { "Thresholds" } dd { (b.thresholds.iter().map(|t| format!("{t}%")).collect::<Vec<_>>().join(", ")) }
                dt { "Hard cap on spot work" } dd { (yes_no(b.hard_cap)) }
            }
            label for="budget-meter" { "Spent of limit" }
            meter #budget-meter min="0" max=(b.limit) value=(b.spend) high=(b.limit * Decimal::new(8, 1)) {}
        } @else {
            p { "No budget set." }
        }
        section aria-labelledby="set-h" {
            h2 #set-h { "Set the monthly budget" }
            form.grid method="post" action="/budget" {
                (csrf_field(s))
                label for="b-limit" { "Limit" }
                input #b-limit name="limit" inputmode="decimal" required value=(b.map(|b| b.limit.to_string()).unwrap_or_default());
                label for="b-thr" { "Alert thresholds, % (comma separated)" }
                input #b-thr name="thresholds" value="50, 80, 100";
                label for="b-cap" { "Hard cap: no new spot work once reached" }
                input #b-cap name="hard_cap" type="checkbox" value="true" checked[b.is_some_and(|b| b.hard_cap)];
                label for="b-hook" { "Webhook URL (optional)" }
                input #b-hook name="webhook_url" type="url";
                div.actions { button type="submit" { "Save budget" } }
            }
        }
    }
}

async fn set_budget(s: Session, Form(f): Form<Fields>) -> ConsoleResult<Response> {
    check(&s, &f)?;
    s.api.set_budget(&budget_request(&f)?).await?;
    Ok(Redirect::to("/budget").into_response())
}

/// The budget form as the API's request: the limit a decimal, the
/// thresholds whole percents (`%` allowed), each refused by its name.
fn budget_request(f: &Fields) -> ConsoleResult<SetBudget> {
    let limit = field(f, "limit").ok_or_else(|| ConsoleError::field("limit", "enter a limit"))?;
    let limit = Decimal::from_str(limit)
        .map_err(|_| ConsoleError::field("limit", format!("`{limit}` is not a decimal number")))?;
    let thresholds = field(f, "thresholds")
        .map(|t| {
            t.split(',')
                .map(str::trim)
                .filter(|x| !x.is_empty())
                .map(|x| {
                    x.trim_end_matches('%').parse::<u32>().map_err(|_| {
                        ConsoleError::field("thresholds", format!("`{x}` is not a whole percent"))
                    })
                })
                .collect::<ConsoleResult<Vec<_>>>()
        })
        .transpose()?;
    Ok(SetBudget {
        tenant: None,
        limit,
        thresholds,
        hard_cap: field(f, "hard_cap") == Some("true"),
        webhook_url: field(f, "webhook_url").map(str::to_string),
        webhook_secret: None,
    })
}

// ---- API keys --------------------------------------------------------------

async fn keys_page(s: &Session, created: Option<&CreatedApiKey>) -> ConsoleResult<Response> {
    let list = s.api.keys().await?;
    Ok(page(s, "API keys", "/keys", keys_body(s, &list, created)))
}

/// The keys page: a key just created with its secret (shown this once),
/// every key with a revoke button until revoked, the form for a new one.
fn keys_body(s: &Session, list: &[ApiKey], created: Option<&CreatedApiKey>) -> Markup {
    let rows = list
        .iter()
        .map(|k| {
            html! { tr {
                th scope="row" { (k.id) }
                td { (k.name) }
                td { (k.role.as_str()) }
                td { code { (k.prefix) "…" } }
                td { (at(&k.created_at)) }
                td {
                    @if let Some(r) = &k.revoked_at { "revoked " (at(r)) } @else {
                        form.inline method="post" action={ "/keys/" (k.id) "/revoke" } {
                            (csrf_field(s))
                            button.danger type="submit" aria-label={ "Revoke key " (k.id) } { "Revoke" }
                        }
                    }
                }
            } }
        })
        .collect();
    html! {
        @if let Some(c) = created {
            div.notice role="status" {
                p { "New key " (c.key.id) ". Copy its secret now: it is shown once." }
                p { code #new-secret { (c.secret) } }
            }
        }
        (table("API keys", &["Id", "Name", "Role", "Prefix", "Created", ""], rows, "No keys"))
        section aria-labelledby="newkey-h" {
            h2 #newkey-h { "Create a key" }
            form.grid method="post" action="/keys" {
                (csrf_field(s))
                label for="k-name" { "Name" }
                input #k-name name="name" required maxlength="100";
                label for="k-role" { "Role" }
                select #k-role name="role" {
                    option value="tenant_member" { "Member: run work, read billing" }
                    option value="tenant_admin" { "Admin: also keys and budget" }
                    @if s.is_operator() { option value="operator" { "Operator" } option value="provider" { "Provider" } }
                }
                div.actions { button type="submit" { "Create key" } }
            }
        }
    }
}

async fn keys(s: Session) -> ConsoleResult<Response> {
    keys_page(&s, None).await
}

async fn create_key(s: Session, Form(f): Form<Fields>) -> ConsoleResult<Response> {
    check(&s, &f)?;
    let created = s.api.create_key(&key_request(&s, &f)?).await?;
    keys_page(&s, Some(&created)).await
}

/// The key form as the API's request, for the session's tenant.
fn key_request(s: &Session, f: &Fields) -> ConsoleResult<CreateApiKey> {
    let role = match field(f, "role") {
        None => Role::TenantMember,
        Some(r) => Role::parse(r).ok_or_else(|| {
            ConsoleError::field(
                "role",
                format!("`{r}` is not one of operator, tenant_admin, tenant_member, provider"),
            )
        })?,
    };
    Ok(CreateApiKey {
        tenant_id: Some(s.tenant_id.clone()),
        role,
        name: field(f, "name").unwrap_or("console").to_string(),
        endpoints: None,
    })
}

async fn revoke_key(
    s: Session,
    Path(id): Path<String>,
    Form(f): Form<Fields>,
) -> ConsoleResult<Response> {
    check(&s, &f)?;
    let id = seg(&id)?;
    let id = flotilla_core::id::KeyId::parse(id, "key_id")
        .map_err(|e| ConsoleError::field("key_id", e.message))?;
    s.api.revoke_key(&id).await?;
    Ok(Redirect::to("/keys").into_response())
}

// ---- Estimator -------------------------------------------------------------

#[derive(serde::Deserialize, Default)]
struct EstimateQuery {
    model: Option<String>,
    gpus: Option<String>,
    hours_per_day: Option<String>,
    tier: Option<String>,
}

async fn estimate(s: Session, Query(q): Query<EstimateQuery>) -> ConsoleResult<Response> {
    let models = model_names(&s.api.gpu_types().await?);
    let model = q.model.clone().filter(|m| !m.is_empty());
    let gpus = q.gpus.as_deref().unwrap_or("1");
    let hours = q.hours_per_day.as_deref().unwrap_or("8");
    let tier = q.tier.as_deref().unwrap_or("2");
    let result = if q.gpus.is_some() {
        Some(
            s.api
                .estimate(&estimate_request(model.clone(), gpus, hours, tier)?)
                .await?,
        )
    } else {
        None
    };
    let body = html! {
        form.grid method="get" action="/estimate" {
            label for="x-model" { "GPU model" }
            select #x-model name="model" {
                option value="" { "Every model" }
                @for m in &models { option value=(m) selected[model.as_deref() == Some(m.as_str())] { (m) } }
            }
            label for="x-gpus" { "GPUs" }
            input #x-gpus name="gpus" type="number" min="1" value=(gpus);
            label for="x-hours" { "Hours a day" }
            input #x-hours name="hours_per_day" type="number" min="0" max="24" step="0.5" value=(hours);
            label for="x-tier" { "Tier" }
            select #x-tier name="tier" {
                option value="2" selected[tier == "2"] { "2: may be preempted (spot allowed)" }
                option value="1" selected[tier == "1"] { "1: never preempted" }
            }
            div.actions { button type="submit" { "Estimate" } }
        }
        @if let Some(r) = &result { (estimate_result(r)) }
    };
    Ok(page(&s, "Cost estimator", "/estimate", body))
}

/// An estimate: the cheapest option that meets the workload, then every
/// option by model and billing model.
fn estimate_result(r: &Estimate) -> Markup {
    let cur = r.currency.code.as_str();
    html! {
        @if let Some(c) = &r.cheapest {
            p.notice role="status" { "Cheapest that meets it: " strong { (c.model) " " (billing_model(&c.billing_model)) } " at " (amount(c.monthly_cost, cur)) " a month." }
        }
        (table(&format!("Monthly cost by billing model (price version {})", r.price_version), &["Model", "Billing model", "GPUs", "Monthly cost", "Meets", "Note"],
            r.options.iter().map(|o| html! { tr {
                td { (o.model) }
                td { (billing_model(&o.billing_model)) }
                td.num { (o.gpus) }
                td.num { (amount(o.monthly_cost, cur)) }
                td { (yes_no(o.meets)) }
                td { (o.note) }
            } }).collect(), "No options"))
    }
}

/// The estimator's query as the API's workload: GPUs held for some
/// hours a day, busy all that time, serving no requests.
fn estimate_request(
    model: Option<String>,
    gpus: &str,
    hours_per_day: &str,
    tier: &str,
) -> ConsoleResult<Workload> {
    Ok(Workload::Gpu(GpuWorkload {
        model,
        gpus: gpus
            .parse()
            .map_err(|_| ConsoleError::field("gpus", "must be a whole number"))?,
        hours_per_day: Decimal::from_str(hours_per_day)
            .map_err(|_| ConsoleError::field("hours_per_day", "must be a number"))?,
        duty_cycle: Decimal::ONE,
        tier: tier
            .parse()
            .map_err(|_| ConsoleError::field("tier", "must be 1 or 2"))?,
        serves_requests: false,
    }))
}

/// `on demand`, `spot`, `serverless`, or a reserved offer with its term
/// and discount.
fn billing_model(m: &BillingModel) -> String {
    match m {
        BillingModel::Reserved {
            term_days,
            discount,
        } => format!(
            "reserved {term_days} days, {}% off",
            (discount * Decimal::from(100)).normalize()
        ),
        BillingModel::OnDemand => "on demand".into(),
        BillingModel::Spot => "spot".into(),
        BillingModel::Serverless => "serverless".into(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// A session of `role` (its client reaches nothing: pages render
    /// from values given to them).
    fn session(role: Role) -> Session {
        let api = flotilla_client::Client::new("http://127.0.0.1:1", "flt_x").unwrap();
        super::super::session::Sessions::default().open(
            api,
            role,
            flotilla_core::id::TenantId::generate(1, 1),
            "acme".into(),
        )
    }

    #[test]
    fn path_segments_that_cannot_be_ids_are_refused() {
        assert!(seg("inst_01abc").is_ok());
        for bad in ["", "../v1/keys", "a?b", "a/b", "a%2Fb"] {
            assert!(seg(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn environment_lines_parse_and_name_the_bad_one() {
        let env = env_lines(Some("A=1\n\n# c\nB = x=y\n")).unwrap();
        assert_eq!(env.get("A").map(String::as_str), Some("1"));
        assert_eq!(env.get("B").map(String::as_str), Some(" x=y"));
        let e = env_lines(Some("nope")).unwrap_err();
        assert!(e.to_string().contains("env"), "{e}");
    }

    #[test]
    fn months_are_checked() {
        assert!(valid_month("2026-12").is_ok());
        for bad in ["2026-1", "2026/12", "abcd-ef", "2026-123"] {
            assert!(valid_month(bad).is_err(), "{bad}");
        }
    }

    fn form(pairs: &[(&str, &str)]) -> Fields {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// The message of a refused form, which must name the API's field.
    fn refusal<T>(r: ConsoleResult<T>) -> String {
        match r {
            Err(e) => e.to_string(),
            Ok(_) => panic!("the form was accepted"),
        }
    }

    #[test]
    fn the_launch_form_builds_the_api_request() {
        let r = launch_request(&form(&[
            ("name", "train"),
            ("model", "H100"),
            ("gpus", "2"),
            ("billing_class", "spot"),
            ("command", "python train.py"),
            ("env", "A=1"),
        ]))
        .unwrap();
        assert_eq!(r.gpus, 2);
        assert_eq!(r.name.as_deref(), Some("train"));
        assert_eq!(r.gpu_types, ["H100"]);
        assert_eq!(r.billing_class, BillingClass::Spot);
        assert_eq!(r.command, ["sh", "-c", "python train.py"]);
        assert_eq!(r.env.get("A").map(String::as_str), Some("1"));
        // A share is one GPU, whatever the count says.
        let r = launch_request(&form(&[("gpus", "4"), ("gpu_fraction", "0.25")])).unwrap();
        assert_eq!((r.gpus, r.gpu_fraction), (1, Some(0.25)));
        assert!(r.command.is_empty() && r.gpu_types.is_empty());
        for (k, v) in [
            ("gpus", "two"),
            ("gpu_fraction", "half"),
            ("billing_class", "free"),
        ] {
            let e = refusal(launch_request(&form(&[(k, v)])));
            assert!(e.starts_with(&format!("{k}: ")), "{e}");
        }
    }

    #[test]
    fn the_deploy_form_builds_the_api_request() {
        let r = deploy_request(&form(&[
            ("name", "chat"),
            ("models", "chat, , code"),
            ("gpu_fraction", "0.5"),
            ("min_replicas", "1"),
            ("max_replicas", "2"),
            ("slo_p95_ms", "2000"),
        ]))
        .unwrap();
        assert_eq!(r.name, "chat");
        assert_eq!(r.models, ["chat", "code"]);
        assert_eq!(r.gpu_fraction, Some(0.5));
        assert_eq!((r.min_replicas, r.max_replicas), (Some(1), Some(2)));
        assert_eq!(r.slo_p95_ms, Some(2000));
        assert_eq!(r.policy, None, "left to the API's default");
        for k in ["min_replicas", "max_replicas", "slo_p95_ms", "gpu_fraction"] {
            let e = refusal(deploy_request(&form(&[("name", "chat"), (k, "-x")])));
            assert!(e.starts_with(&format!("{k}: ")), "{e}");
        }
        assert!(refusal(deploy_request(&form(&[]))).starts_with("name: "));
    }

    #[test]
    fn the_budget_form_builds_the_api_request() {
        let r = budget_request(&form(&[
            ("limit", "250.50"),
            ("thresholds", "50, 80%,100"),
            ("hard_cap", "true"),
        ]))
        .unwrap();
        assert_eq!(r.limit, Decimal::new(25050, 2));
        assert_eq!(r.thresholds, Some(vec![50, 80, 100]));
        assert!(r.hard_cap && r.webhook_url.is_none());
        assert!(refusal(budget_request(&form(&[("limit", "lots")]))).starts_with("limit: "));
        let e = refusal(budget_request(&form(&[
            ("limit", "1"),
            ("thresholds", "half"),
        ])));
        assert!(e.starts_with("thresholds: "), "{e}");
    }

    #[test]
    fn the_key_form_builds_the_api_request() {
        let s = session(Role::TenantAdmin);
        let r = key_request(&s, &form(&[("name", "ci"), ("role", "tenant_admin")])).unwrap();
        assert_eq!(r.role, Role::TenantAdmin);
        assert_eq!(r.name, "ci");
        assert_eq!(r.tenant_id.as_ref(), Some(&s.tenant_id));
        assert_eq!(
            key_request(&s, &form(&[])).unwrap().role,
            Role::TenantMember
        );
        assert!(refusal(key_request(&s, &form(&[("role", "root")]))).starts_with("role: "));
    }

    #[test]
    fn the_estimate_query_builds_the_api_workload() {
        let Workload::Gpu(w) = estimate_request(Some("H100".into()), "2", "7.5", "2").unwrap()
        else {
            panic!("a GPU workload")
        };
        assert_eq!((w.gpus, w.tier), (2, 2));
        assert_eq!(w.hours_per_day, Decimal::new(75, 1));
        assert_eq!(w.model.as_deref(), Some("H100"));
        for (k, e) in [
            ("gpus", estimate_request(None, "x", "8", "2")),
            ("hours_per_day", estimate_request(None, "1", "x", "2")),
            ("tier", estimate_request(None, "1", "8", "x")),
        ] {
            let e = refusal(e);
            assert!(e.starts_with(&format!("{k}: ")), "{e}");
        }
    }

    /// An instance as the API answers it, with `extra` fields over a
    /// running one on node-less defaults.
    fn instance_of(extra: serde_json::Value) -> Instance {
        let mut v = json!({
            "id": flotilla_core::id::InstanceId::generate(1, 1),
            "tenant_id": flotilla_core::id::TenantId::generate(1, 1),
            "name": "train",
            "state": "running",
            "state_reason": "started",
            "gpus": 2,
            "gpu_ids": [],
            "stop_requested": false,
            "created_at": "2026-12-01T10:00:00.5Z",
            "started_at": "2026-12-01T10:00:05Z",
            "events": [{"state": "running", "reason": "started", "at": "2026-12-01T10:00:05Z"}],
            "gpu_types": ["H100", "A100"],
            "cpu_milli": 1000,
            "memory_mb": 1024,
            "command": ["sleep", "1"],
            "env": {},
            "billing_class": "on_demand",
        });
        if let (Some(v), serde_json::Value::Object(extra)) = (v.as_object_mut(), extra) {
            v.extend(extra);
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn instances_render_from_the_typed_answer() {
        let i = instance_of(json!({}));
        assert_eq!(instance_gpus(&i), "2 × H100|A100");
        let html = instance_summary(&session(Role::TenantMember), &i).into_string();
        for want in [
            ">running</span>",
            "<dd>started</dd>",
            "<dd>—</dd>",
            "2026-12-01 10:00:05",
            "Stop instance",
            "every 2s",
        ] {
            assert!(html.contains(want), "{want} in {html}");
        }
        let row = instance_row(&i).into_string();
        assert!(
            row.contains("2026-12-01 10:00:00") && row.contains(">train<"),
            "{row}"
        );
        let done = instance_of(json!({
            "state": "failed", "exit_code": 3, "gpu_model": "L40S", "gpu_fraction": 0.25,
            "node_id": flotilla_core::id::NodeId::generate(1, 1),
        }));
        assert_eq!(instance_gpus(&done), "0.25 × L40S");
        let html = instance_summary(&session(Role::TenantMember), &done).into_string();
        assert!(
            html.contains("<dd>3</dd>") && !html.contains("Stop instance"),
            "{html}"
        );
        assert!(
            !html.contains("every 2s"),
            "a final instance is not polled: {html}"
        );
        let mig = instance_of(json!({"gpu_model": "H100", "mig_profile": "1g.10gb", "gpus": 1}));
        assert_eq!(instance_gpus(&mig), "H100 1g.10gb");
    }

    #[test]
    fn endpoints_render_from_the_typed_answer() {
        let spec = deploy_request(&form(&[
            ("name", "chat"),
            ("command", "serve"),
            ("models", "chat, code"),
            ("min_replicas", "1"),
            ("max_replicas", "3"),
            ("slo_p95_ms", "800"),
        ]))
        .unwrap()
        .validate(&flotilla_core::catalog::Catalog::default())
        .unwrap();
        let replica = |ready| {
            json!({"instance_id": flotilla_core::id::InstanceId::generate(1, 1), "revision": 2,
                "state": "running", "url": "http://x", "ready": ready, "draining": false})
        };
        let e: Endpoint = serde_json::from_value(json!({
            "id": flotilla_core::id::EndpointId::generate(1, 1),
            "tenant_id": flotilla_core::id::TenantId::generate(1, 1),
            "name": "chat",
            "revision": 2,
            "spec": spec,
            "desired_replicas": 2,
            "reason": "slo",
            "replicas": [replica(true), replica(false)],
            "deleting": false,
            "created_at": "2026-12-01T10:00:00Z",
            "updated_at": "2026-12-01T10:00:00Z",
        }))
        .unwrap();
        let row = endpoint_row(&e).into_string();
        for want in [">chat</a>", "1 / 2", ">2<", ">slo<", "1–3", "800 ms"] {
            assert!(row.contains(want), "{want} in {row}");
        }
        let live = endpoint_live(&e).into_string();
        for want in [
            "1 of 2",
            "<dd>chat, code</dd>",
            "<dd>1–3</dd>",
            "<td>yes</td>",
            "<td>no</td>",
        ] {
            assert!(live.contains(want), "{want} in {live}");
        }
    }

    /// An invoice as the API answers it: one H100 line, in `status`.
    fn invoice_of(tenant: &flotilla_core::id::TenantId, status: serde_json::Value) -> Invoice {
        serde_json::from_value(json!({
            "id": flotilla_core::id::InvoiceId::generate(1, 1),
            "tenant": tenant,
            "period": {"start": "2026-11-01T00:00:00Z", "end": "2026-12-01T00:00:00Z"},
            "currency": {"code": "EUR", "minor_units": 2},
            "status": status,
            "lines": [{
                "kind": "on_demand", "description": "H100 on demand", "model": "H100",
                "quantity": "3600.00049", "unit": "gpu_second",
                "unit_price": "0.0008305555555555555555555556", "amount": "2.99",
                "price_version": 1, "price_point_at": null, "reference": null, "tier": null,
            }],
            "subtotal": "2.99",
            "total": "2.985",
        }))
        .unwrap()
    }

    #[test]
    fn invoices_render_from_the_typed_answer() {
        let s = session(Role::TenantAdmin);
        let inv = invoice_of(&s.tenant_id, json!({"state": "draft"}));
        let lines = invoice_lines(&inv).into_string();
        for want in [
            "<td>H100 on demand</td>",
            "<td>H100</td>",
            ">3600<",
            "<td>gpu_second</td>",
            ">0.0008305556<",
            "2.99 EUR",
            "2.98 EUR",
        ] {
            assert!(lines.contains(want), "{want} in {lines}");
        }
        let fin = invoice_of(
            &s.tenant_id,
            json!({"state": "finalised", "at": "2026-12-04T00:00:00Z"}),
        );
        let body = billing_body(&s, "2026-12", &inv, &[fin]).into_string();
        for want in [
            "Cost by month (EUR)",
            r#""months":["2026-11","2026-12"]"#,
            r#""models":["H100"]"#,
            "<td>2026-11</td>",
            "This month so far (2026-12, draft)",
        ] {
            assert!(body.contains(want), "{want} in {body}");
        }
    }

    #[test]
    fn budget_keys_and_estimates_render_from_the_typed_answers() {
        let s = session(Role::TenantAdmin);
        let b: BudgetView = serde_json::from_value(json!({
            "tenant": s.tenant_id, "limit": "250", "currency": "EUR", "thresholds": [50, 80],
            "hard_cap": true, "webhook_url": null, "period_start": "2026-12-01T00:00:00Z",
            "spend": "12.345", "alerts": [], "deliveries": [],
        }))
        .unwrap();
        let html = budget_body(&s, Some(&b)).into_string();
        for want in [
            "250 EUR",
            "12.34 EUR",
            "<dd>50%, 80%</dd>",
            "<dd>yes</dd>",
            r#"max="250""#,
            r#"value="250""#,
        ] {
            assert!(html.contains(want), "{want} in {html}");
        }
        assert!(budget_body(&s, None)
            .into_string()
            .contains("No budget set."));

        let key: ApiKey = serde_json::from_value(json!({
            "id": flotilla_core::id::KeyId::generate(1, 1), "tenant_id": s.tenant_id,
            "role": "tenant_member", "name": "ci", "prefix": "flt_ab",
            "created_at": "2026-12-01T10:00:00Z", "revoked_at": "2026-12-02T10:00:00Z",
        }))
        .unwrap();
        let created = CreatedApiKey {
            key: key.clone(),
            secret: "flt_secret".into(),
        };
        let html = keys_body(&s, std::slice::from_ref(&key), Some(&created)).into_string();
        for want in [
            format!("New key {}.", key.id),
            "flt_secret".into(),
            "<td>tenant_member</td>".into(),
            "flt_ab…".into(),
            "revoked 2026-12-02 10:00:00".into(),
        ] {
            assert!(html.contains(&want), "{want} in {html}");
        }

        let option = |billing_model, cost: &str, meets| {
            json!({"model": "H100", "billing_model": billing_model, "gpus": 2,
                "monthly_cost": cost, "meets": meets, "note": "n"})
        };
        let e: Estimate = serde_json::from_value(json!({
            "currency": {"code": "USD", "minor_units": 2}, "price_version": 3,
            "month_seconds": 2_592_000,
            "options": [
                option(json!({"kind": "on_demand"}), "100", true),
                option(json!({"kind": "reserved", "term_days": 365, "discount": "0.35"}), "65", true),
            ],
            "cheapest": option(json!({"kind": "reserved", "term_days": 365, "discount": "0.35"}), "65", true),
        }))
        .unwrap();
        let html = estimate_result(&e).into_string();
        for want in [
            "Cheapest that meets it: <strong>H100 reserved 365 days, 35% off</strong> at 65 USD a month.",
            "(price version 3)",
            "<td>on demand</td>",
            "100 USD",
        ] {
            assert!(html.contains(want), "{want} in {html}");
        }
    }

    /// A price catalog as the API answers it: version 1 (H100 at 2.99
    /// an hour, an L40S price and no spot band for it) in force.
    pub(crate) fn catalog() -> PriceCatalog {
        let flat = json!({"kind": "flat", "unit_price": "0"});
        serde_json::from_value(json!({
            "in_force": 1,
            "currency": "USD",
            "versions": [{
                "version": 1,
                "effective_from": "2026-01-01T00:00:00Z",
                "currency": {"code": "USD", "minor_units": 2},
                "on_demand": {
                    "H100": {"per_gpu_second": "0.0008305555555555555555555556"},
                    "L40S": {"per_gpu_second": "0.0003"},
                },
                "spot": {"H100": {"floor": "0.0002", "ceiling": "0.0006"}},
                "serverless": {"per_request": flat, "per_million_input_tokens": flat,
                    "per_million_output_tokens": flat, "per_gpu_second": {}},
                "reserved_offers": [{"term_days": 365, "discount": "0.35"}],
                "per_instance_second": "0",
                "per_storage_gb_second": "0",
            }],
        }))
        .unwrap()
    }

    #[test]
    fn the_gpu_catalog_renders_from_the_typed_answers() {
        let model = |name: &str, total: u32, free: u32| {
            let mut m = serde_json::to_value(
                flotilla_core::catalog::Catalog::default()
                    .get(name)
                    .unwrap()
                    .clone(),
            )
            .unwrap();
            if let Some(o) = m.as_object_mut() {
                o.insert("total".into(), json!(total));
                o.insert("free".into(), json!(free));
            }
            serde_json::from_value::<GpuTypeView>(m).unwrap()
        };
        let spot: SpotPrices = serde_json::from_value(json!({
            "latest": [{"model": "H100", "at": "2026-12-01T00:00:00Z", "utilisation": "0.5",
                "per_gpu_second": "0.0004", "price_version": 1}],
            "history": [],
        }))
        .unwrap();
        let types = vec![model("L40S", 0, 0), model("H100", 8, 3)];
        let html = gpus_body(types, &catalog(), Some(&spot)).into_string();
        for want in [
            "prices per GPU-hour in USD (catalog version 1)",
            "<td>nvidia</td>",
            "3 / 8",
            ">2.99<",
            ">1.44<",
            ">1.08<",
        ] {
            assert!(html.contains(want), "{want} in {html}");
        }
        let (h100, l40s) = (
            html.find("data-model=\"H100\""),
            html.find("data-model=\"L40S\""),
        );
        assert!(h100 < l40s, "models the pool has come first");
        let no_spot = gpus_body(vec![model("H100", 1, 1)], &catalog(), None).into_string();
        assert!(
            no_spot.contains(">2.99</td><td class=\"num\">—<"),
            "{no_spot}"
        );
    }

    #[test]
    fn reserved_offers_read_as_words() {
        let r = BillingModel::Reserved {
            term_days: 365,
            discount: Decimal::new(3, 1),
        };
        assert_eq!(billing_model(&r), "reserved 365 days, 30% off");
        assert_eq!(billing_model(&BillingModel::OnDemand), "on demand");
        assert_eq!(billing_model(&BillingModel::Spot), "spot");
    }
}
