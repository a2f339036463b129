//! Billing commands: `prices`, `invoices`, `budget`, `estimate`,
//! `payouts`, and CSV export of usage and invoices. Each is a thin client
//! of the API: it sends what was typed and prints what came back.

use std::process::ExitCode;

use anyhow::{anyhow, bail, Context, Result};
use chrono::Utc;
use clap::{Args, Subcommand};
use serde_json::{json, Value};

use crate::client;
use crate::commands::Ctx;
use crate::output::{outln, print_json, print_table, table};

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn this_month() -> String {
    Utc::now().format("%Y-%m").to_string()
}

/// `flotilla prices`.
#[derive(Debug, Subcommand)]
pub enum PricesCommand {
    /// Publish the next catalog version from a JSON file (operators): the
    /// body `GET /v1/prices` lists per version; `version` may be left out.
    Set {
        /// The version as JSON.
        #[arg(long, value_name = "FILE")]
        file: std::path::PathBuf,
    },
}

/// `flotilla prices`: the version in force, every version, and spot.
pub async fn prices(ctx: &Ctx, command: Option<PricesCommand>) -> Result<ExitCode> {
    if let Some(PricesCommand::Set { file }) = command {
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        let body: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", file.display()))?;
        let v = ctx.client.post("/v1/prices", &body).await?;
        if ctx.json {
            print_json(&v)?;
        } else {
            outln!(
                "published price version {} (effective {})",
                s(&v["version"]),
                s(&v["effective_from"])
            )?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let raw = ctx.client.get("/v1/prices", &[]).await?;
    if ctx.json {
        print_json(&raw)?;
        return Ok(ExitCode::SUCCESS);
    }
    let in_force = raw["in_force"].as_u64().unwrap_or(0);
    let versions = raw["versions"].as_array().cloned().unwrap_or_default();
    let mut t = table(["VERSION", "EFFECTIVE FROM", "STATE"]);
    for v in &versions {
        let n = v["version"].as_u64().unwrap_or(0);
        let state = match n.cmp(&in_force) {
            std::cmp::Ordering::Less => "past",
            std::cmp::Ordering::Equal => "in force",
            std::cmp::Ordering::Greater => "scheduled",
        };
        t.add_row([n.to_string(), s(&v["effective_from"]), state.to_string()]);
    }
    print_table(&t)?;
    let Some(cur) = versions
        .iter()
        .find(|v| v["version"].as_u64() == Some(in_force))
    else {
        return Ok(ExitCode::SUCCESS);
    };
    let spot = ctx.client.get("/v1/prices/spot", &[]).await?;
    let currency = s(&raw["currency"]);
    outln!("\nversion {in_force}, prices in {currency} per GPU-hour")?;
    let hour = |v: &Value| -> String {
        s(v).parse::<rust_decimal::Decimal>()
            .map(|d| {
                (d * rust_decimal::Decimal::from(3600))
                    .round_dp(4)
                    .to_string()
            })
            .unwrap_or_default()
    };
    let mut t = table([
        "MODEL",
        "ON-DEMAND",
        "SPOT FLOOR",
        "SPOT CEILING",
        "SPOT NOW",
        "SERVERLESS",
    ]);
    for (model, od) in cur["on_demand"].as_object().into_iter().flatten() {
        let now = spot["latest"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["model"] == model.as_str())
            .map(|p| hour(&p["per_gpu_second"]))
            .unwrap_or_default();
        t.add_row([
            model.clone(),
            hour(&od["per_gpu_second"]),
            hour(&cur["spot"][model]["floor"]),
            hour(&cur["spot"][model]["ceiling"]),
            now,
            hour(&cur["serverless"]["per_gpu_second"][model]),
        ]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}

/// `flotilla invoices`.
#[derive(Debug, Subcommand)]
pub enum InvoicesCommand {
    /// List finalised invoices.
    List {
        /// Print every line of every invoice as CSV.
        #[arg(long)]
        csv: bool,
    },
    /// Show one invoice with its lines.
    Show {
        /// Invoice id.
        id: String,
        /// Print its lines as CSV.
        #[arg(long)]
        csv: bool,
    },
    /// The draft invoice of a month, rated from the usage ledger.
    Preview {
        /// Month, `YYYY-MM` (default: this month).
        #[arg(long)]
        period: Option<String>,
    },
    /// Finalise a month's invoices (operators): rated, made immutable,
    /// stored.
    Finalize {
        /// Month, `YYYY-MM`.
        #[arg(long)]
        period: String,
        /// Only this tenant (id).
        #[arg(long)]
        tenant: Option<String>,
    },
}

fn print_invoice(raw: &Value) -> Result<()> {
    let currency = s(&raw["currency"]["code"]);
    let state = s(&raw["status"]["state"]);
    outln!(
        "invoice {} for {} ({} to {}), {state}",
        s(&raw["id"]),
        s(&raw["tenant"]),
        s(&raw["period"]["start"]),
        s(&raw["period"]["end"])
    )?;
    let mut t = table(["LINE", "QUANTITY", "UNIT", "UNIT PRICE", "AMOUNT", "PRICE"]);
    for l in raw["lines"].as_array().into_iter().flatten() {
        let price = match (&l["price_version"], &l["price_point_at"]) {
            (Value::Null, _) => s(&l["reference"]),
            (v, Value::Null) => format!("v{}", s(v)),
            (v, at) => format!("v{} spot@{}", s(v), s(at)),
        };
        t.add_row([
            s(&l["description"]),
            s(&l["quantity"]),
            s(&l["unit"]),
            s(&l["unit_price"]),
            s(&l["amount"]),
            price,
        ]);
    }
    print_table(&t)?;
    outln!("total: {} {currency}", s(&raw["total"]))?;
    Ok(())
}

/// `flotilla invoices …`.
pub async fn invoices(ctx: &Ctx, command: Option<InvoicesCommand>) -> Result<ExitCode> {
    match command.unwrap_or(InvoicesCommand::List { csv: false }) {
        InvoicesCommand::List { csv: true } => {
            print!("{}", ctx.client.list_csv("/v1/invoices", &[]).await?);
        }
        InvoicesCommand::List { csv: false } => {
            let items = ctx.client.list("/v1/invoices", &[], None).await?;
            if ctx.json {
                print_json(&items)?;
                return Ok(ExitCode::SUCCESS);
            }
            let mut t = table(["ID", "TENANT", "PERIOD", "STATUS", "TOTAL"]);
            for i in &items {
                t.add_row([
                    s(&i["id"]),
                    s(&i["tenant"]),
                    s(&i["period"]["start"]).chars().take(7).collect(),
                    s(&i["status"]["state"]),
                    format!("{} {}", s(&i["total"]), s(&i["currency"]["code"])),
                ]);
            }
            print_table(&t)?;
        }
        InvoicesCommand::Show { id, csv } => {
            if !id.starts_with("inv_") {
                bail!("`{id}` is not an invoice id (inv_…)");
            }
            let path = format!("/v1/invoices/{id}");
            if csv {
                print!("{}", ctx.client.get_csv(&path, &[]).await?.0);
                return Ok(ExitCode::SUCCESS);
            }
            let raw = ctx.client.get(&path, &[]).await?;
            if ctx.json {
                print_json(&raw)?;
            } else {
                print_invoice(&raw)?;
            }
        }
        InvoicesCommand::Preview { period } => {
            let period = period.unwrap_or_else(this_month);
            let raw = ctx
                .client
                .get("/v1/invoices/preview", &[("period", period)])
                .await?;
            if ctx.json {
                print_json(&raw)?;
            } else {
                print_invoice(&raw)?;
            }
        }
        InvoicesCommand::Finalize { period, tenant } => {
            let mut body = json!({ "period": period });
            if let Some(t) = tenant {
                body["tenant"] = json!(t);
            }
            let raw = ctx.client.post("/v1/invoices/finalize", &body).await?;
            if ctx.json {
                print_json(&raw)?;
                return Ok(ExitCode::SUCCESS);
            }
            let mut t = table(["TENANT", "INVOICE", "TOTAL", "RESULT"]);
            for i in raw["finalised"].as_array().into_iter().flatten() {
                t.add_row([
                    s(&i["tenant"]),
                    s(&i["id"]),
                    format!("{} {}", s(&i["total"]), s(&i["currency"]["code"])),
                    "finalised".into(),
                ]);
            }
            for k in raw["skipped"].as_array().into_iter().flatten() {
                t.add_row([
                    s(&k["tenant"]),
                    String::new(),
                    String::new(),
                    s(&k["reason"]).replace('_', " "),
                ]);
            }
            print_table(&t)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `flotilla usage --csv`: every event of the range as CSV.
pub async fn usage_csv(ctx: &Ctx, query: &[(&str, String)]) -> Result<ExitCode> {
    print!("{}", ctx.client.list_csv("/v1/usage", query).await?);
    Ok(ExitCode::SUCCESS)
}

/// `flotilla budget set`.
#[derive(Debug, Args)]
pub struct BudgetSet {
    /// Spend limit per month, in the catalog currency.
    #[arg(long)]
    limit: rust_decimal::Decimal,
    /// Refuse new spot and preemptible work (tier 2 and 3) once spend
    /// reaches the limit; tier-1 work is never refused.
    #[arg(long)]
    hard_cap: bool,
    /// Alert threshold in percent (repeatable; default 50, 80, 100).
    #[arg(long = "threshold", value_name = "PERCENT")]
    thresholds: Vec<u32>,
    /// URL alerts are POSTed to.
    #[arg(long, requires = "webhook_secret")]
    webhook_url: Option<String>,
    /// Key that signs deliveries (HMAC-SHA256, 16-256 characters).
    #[arg(long, env = "FLOTILLA_WEBHOOK_SECRET", hide_env_values = true)]
    webhook_secret: Option<String>,
}

/// `flotilla budget`.
#[derive(Debug, Subcommand)]
pub enum BudgetCommand {
    /// Set or replace the budget.
    Set(BudgetSet),
}

/// `flotilla budget [set …]`.
pub async fn budget(
    ctx: &Ctx,
    tenant: Option<String>,
    command: Option<BudgetCommand>,
) -> Result<ExitCode> {
    let raw = match command {
        Some(BudgetCommand::Set(b)) => {
            let mut body = json!({ "limit": b.limit.to_string(), "hard_cap": b.hard_cap });
            if let Some(t) = &tenant {
                body["tenant"] = json!(t);
            }
            if !b.thresholds.is_empty() {
                body["thresholds"] = json!(b.thresholds);
            }
            if let Some(u) = b.webhook_url {
                body["webhook_url"] = json!(u);
                body["webhook_secret"] = json!(b.webhook_secret);
            }
            ctx.client.put("/v1/budget", &body).await?
        }
        None => {
            let q: Vec<(&str, String)> = tenant.iter().map(|t| ("tenant", t.clone())).collect();
            match ctx.client.get("/v1/budget", &q).await {
                Ok(raw) => raw,
                // No budget is a state, not a failure: say so and how to
                // set one.
                Err(e) if client::is_not_found(&e) && !ctx.json => {
                    outln!(
                        "no budget set for {}: nothing is alerted or capped \
                         (set one with `flotilla budget set --limit AMOUNT`)",
                        tenant.as_deref().unwrap_or("your tenant")
                    )?;
                    return Ok(ExitCode::SUCCESS);
                }
                Err(e) => return Err(e),
            }
        }
    };
    if ctx.json {
        print_json(&raw)?;
        return Ok(ExitCode::SUCCESS);
    }
    let cur = s(&raw["currency"]);
    outln!(
        "budget of {}: {} {cur} a month{}",
        s(&raw["tenant"]),
        s(&raw["limit"]),
        if raw["hard_cap"] == true {
            ", hard cap on spot and preemptible work"
        } else {
            ""
        }
    )?;
    let thresholds: Vec<String> = raw["thresholds"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| format!("{}%", s(t)))
        .collect();
    outln!(
        "spent this month: {} {cur}; alerts at {}",
        s(&raw["spend"]),
        thresholds.join(", ")
    )?;
    if let Some(u) = raw["webhook_url"].as_str() {
        outln!("webhook: {u}")?;
    }
    let alerts = raw["alerts"].as_array().cloned().unwrap_or_default();
    if !alerts.is_empty() {
        let mut t = table(["ALERT", "SPEND", "AT"]);
        for a in &alerts {
            t.add_row([
                format!("{}%", s(&a["threshold_percent"])),
                s(&a["spend"]),
                s(&a["at"]),
            ]);
        }
        print_table(&t)?;
    }
    let deliveries = raw["deliveries"].as_array().cloned().unwrap_or_default();
    if !deliveries.is_empty() {
        let mut t = table(["DELIVERY", "STATE", "ATTEMPTS", "LAST"]);
        for d in &deliveries {
            let last = match (&d["last_status"], &d["last_error"]) {
                (Value::Null, Value::Null) => String::new(),
                (st, Value::Null) => s(st),
                (_, e) => s(e),
            };
            t.add_row([s(&d["id"]), s(&d["state"]), s(&d["attempts"]), last]);
        }
        print_table(&t)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `flotilla estimate`: a dedicated-GPU workload (`--gpu`, `--count`,
/// `--hours-per-day`, `--duty-cycle`) or a serverless one (`--rps`, the
/// tokens and GPU time per request).
#[derive(Debug, Args)]
pub struct EstimateArgs {
    /// GPU model (default: every model).
    #[arg(long)]
    gpu: Option<String>,
    /// GPUs held at once.
    #[arg(long, conflicts_with = "rps")]
    count: Option<u32>,
    /// Hours a day the GPUs are held (0-24).
    #[arg(long, default_value = "24")]
    hours_per_day: rust_decimal::Decimal,
    /// Fraction of held time with work running (0-1).
    #[arg(long, default_value = "1")]
    duty_cycle: rust_decimal::Decimal,
    /// 1: must not be preempted; 2-3: tolerates preemption.
    #[arg(long, default_value_t = 2)]
    tier: u8,
    /// The workload serves requests (so serverless could run it).
    #[arg(long)]
    serves_requests: bool,
    /// Serverless: average requests per second.
    #[arg(long)]
    rps: Option<rust_decimal::Decimal>,
    /// Serverless: input tokens per request.
    #[arg(long, default_value = "0", requires = "rps")]
    input_tokens: rust_decimal::Decimal,
    /// Serverless: output tokens per request.
    #[arg(long, default_value = "0", requires = "rps")]
    output_tokens: rust_decimal::Decimal,
    /// Serverless: GPU-seconds of compute per request.
    #[arg(long, default_value = "0", requires = "rps")]
    gpu_seconds_per_request: rust_decimal::Decimal,
}

/// `flotilla estimate …`.
pub async fn estimate(ctx: &Ctx, a: EstimateArgs) -> Result<ExitCode> {
    let body = match (a.rps, a.count) {
        (Some(rps), _) => json!({
            "kind": "serverless",
            "model": a.gpu,
            "requests_per_second": rps.to_string(),
            "input_tokens_per_request": a.input_tokens.to_string(),
            "output_tokens_per_request": a.output_tokens.to_string(),
            "gpu_seconds_per_request": a.gpu_seconds_per_request.to_string(),
            "tier": a.tier,
        }),
        (None, Some(count)) => json!({
            "kind": "gpu",
            "model": a.gpu,
            "gpus": count,
            "hours_per_day": a.hours_per_day.to_string(),
            "duty_cycle": a.duty_cycle.to_string(),
            "tier": a.tier,
            "serves_requests": a.serves_requests,
        }),
        (None, None) => {
            return Err(anyhow!(
                "say what to estimate: --count N (dedicated GPUs) or --rps R (serverless)"
            ))
        }
    };
    let raw = ctx.client.post("/v1/estimates", &body).await?;
    if ctx.json {
        print_json(&raw)?;
        return Ok(ExitCode::SUCCESS);
    }
    let cur = s(&raw["currency"]["code"]);
    let model_name = |o: &Value| -> String {
        let bm = &o["billing_model"];
        match bm["kind"].as_str().unwrap_or("") {
            "reserved" => format!("reserved {} days", s(&bm["term_days"])),
            other => other.replace('_', "-"),
        }
    };
    let mut t = table(["MODEL", "BILLING", "GPUS", "MONTHLY", "MEETS", "NOTE"]);
    for o in raw["options"].as_array().into_iter().flatten() {
        t.add_row([
            s(&o["model"]),
            model_name(o),
            s(&o["gpus"]),
            format!("{} {cur}", s(&o["monthly_cost"])),
            if o["meets"] == true { "yes" } else { "no" }.to_string(),
            s(&o["note"]),
        ]);
    }
    print_table(&t)?;
    match raw["cheapest"].as_object() {
        Some(_) => outln!(
            "cheapest that meets it: {} {} at {} {cur} a month (30 days, price version {})",
            s(&raw["cheapest"]["model"]),
            model_name(&raw["cheapest"]),
            s(&raw["cheapest"]["monthly_cost"]),
            s(&raw["price_version"])
        )?,
        None => outln!("no option meets this workload")?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `flotilla payouts`: provider payout statements of a month.
pub async fn payouts(ctx: &Ctx, period: Option<String>) -> Result<ExitCode> {
    let period = period.unwrap_or_else(this_month);
    let raw = ctx
        .client
        .get("/v1/payouts", &[("period", period.clone())])
        .await?;
    if ctx.json {
        print_json(&raw)?;
        return Ok(ExitCode::SUCCESS);
    }
    let items = raw["items"].as_array().cloned().unwrap_or_default();
    if items.is_empty() {
        outln!("no payouts for {period}")?;
    }
    for p in &items {
        let cur = s(&p["currency"]["code"]);
        outln!("payout statement {period} for {}", s(&p["provider"]))?;
        let mut t = table(["MODEL", "KIND", "GPU-SECONDS", "UNIT PRICE", "GROSS"]);
        for l in p["lines"].as_array().into_iter().flatten() {
            t.add_row([
                s(&l["model"]),
                s(&l["kind"]),
                s(&l["gpu_seconds"]),
                s(&l["unit_price"]),
                s(&l["gross"]),
            ]);
        }
        print_table(&t)?;
        outln!(
            "gross {} {cur}, operator fee {} {cur}, payout {} {cur}",
            s(&p["gross"]),
            s(&p["operator_fee"]),
            s(&p["payout"])
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `flotilla terms add …`: one term for a tenant (operators).
#[derive(Debug, Subcommand)]
pub enum TermsCommand {
    /// Add a reserved commitment, priced at the on-demand price in force at
    /// its start less the discount (locked).
    Commitment {
        /// Id, unique among the tenant's commitments.
        #[arg(long)]
        id: String,
        /// GPU model.
        #[arg(long)]
        model: String,
        /// Whole GPUs committed.
        #[arg(long)]
        gpus: u32,
        /// Start of the term (RFC 3339).
        #[arg(long)]
        start: String,
        /// Term in days.
        #[arg(long)]
        term_days: u32,
        /// `monthly` or `upfront`.
        #[arg(long, default_value = "monthly")]
        payment: String,
        /// Discount fraction (0.3 = 30 %); default: the catalog's offer.
        #[arg(long)]
        discount: Option<rust_decimal::Decimal>,
    },
    /// Add a percentage discount.
    Discount {
        /// Id.
        #[arg(long)]
        id: String,
        /// Percent off, above 0 and at most 100.
        #[arg(long)]
        percent: rust_decimal::Decimal,
        /// `all`, `on_demand`, `reserved`, `spot` or `serverless`.
        #[arg(long, default_value = "all")]
        scope: String,
        /// First period it applies to (RFC 3339 start).
        #[arg(long)]
        from: String,
        /// Periods starting before this (RFC 3339); default: no end.
        #[arg(long)]
        until: Option<String>,
    },
    /// Add a credit or prepaid balance.
    Credit {
        /// Id.
        #[arg(long)]
        id: String,
        /// Amount in the catalog currency.
        #[arg(long)]
        amount: rust_decimal::Decimal,
        /// `promotional` or `prepaid`.
        #[arg(long, default_value = "promotional")]
        kind: String,
        /// Usable by periods starting before this (RFC 3339).
        #[arg(long)]
        expires_at: Option<String>,
    },
}

/// `flotilla terms [--tenant T] [commitment|discount|credit …]`: a
/// tenant's commitments, discounts and credits, or add one.
pub async fn terms(
    ctx: &Ctx,
    tenant: Option<String>,
    command: Option<TermsCommand>,
) -> Result<ExitCode> {
    let tenant = match tenant {
        Some(t) => t,
        None => s(&ctx.client.me().await?["tenant"]["id"]),
    };
    if !tenant.starts_with("ten_") {
        bail!("`{tenant}` is not a tenant id (ten_…)");
    }
    let path = format!("/v1/tenants/{tenant}/terms");
    if let Some(cmd) = command {
        let body = match cmd {
            TermsCommand::Commitment {
                id,
                model,
                gpus,
                start,
                term_days,
                payment,
                discount,
            } => json!({"kind": "commitment", "id": id, "model": model, "gpus": gpus,
                "start": start, "term_days": term_days, "payment": payment,
                "discount": discount.map(|d| d.to_string())}),
            TermsCommand::Discount {
                id,
                percent,
                scope,
                from,
                until,
            } => json!({"kind": "discount", "id": id, "percent": percent.to_string(),
                "scope": scope, "from": from, "until": until}),
            TermsCommand::Credit {
                id,
                amount,
                kind,
                expires_at,
            } => json!({"kind": "credit", "id": id, "amount": amount.to_string(),
                "credit_kind": kind, "expires_at": expires_at}),
        };
        let v = ctx.client.post(&path, &body).await?;
        if ctx.json {
            print_json(&v)?;
        } else {
            outln!("added {} `{}`", s(&body["kind"]), s(&v["id"]))?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let raw = ctx.client.get(&path, &[]).await?;
    if ctx.json {
        print_json(&raw)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut t = table(["TERM", "ID", "DETAIL"]);
    for c in raw["commitments"].as_array().into_iter().flatten() {
        t.add_row([
            "commitment".to_string(),
            s(&c["id"]),
            format!(
                "{}×{} {} to {}, {}, {} per GPU-second (price v{})",
                s(&c["gpus"]),
                s(&c["model"]),
                s(&c["start"]),
                s(&c["end"]),
                s(&c["payment"]),
                s(&c["per_gpu_second"]),
                s(&c["price_version"])
            ),
        ]);
    }
    for d in raw["discounts"].as_array().into_iter().flatten() {
        t.add_row([
            "discount".to_string(),
            s(&d["id"]),
            format!(
                "{}% off {} from {}",
                s(&d["percent"]),
                s(&d["scope"]),
                s(&d["from"])
            ),
        ]);
    }
    for c in raw["credits"].as_array().into_iter().flatten() {
        let id = s(&c["id"]);
        let drawn = s(&raw["credit_drawn"][&id]);
        t.add_row([
            format!("{} credit", s(&c["kind"])),
            id,
            format!(
                "{} granted, {} drawn",
                s(&c["amount"]),
                if drawn.is_empty() { "0".into() } else { drawn }
            ),
        ]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}
