//! Billing commands: `prices`, `invoices`, `budget`, `estimate`,
//! `payouts`, `billing reconcile`, and CSV export of usage and invoices.
//! Each is a thin client of the API: it sends what was typed and prints
//! what came back, read through the API's own types
//! (`flotilla_billing::api` and billing's domain types), never by key.

use std::process::ExitCode;

use anyhow::{anyhow, bail, Context, Result};
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use flotilla_billing::api::{FinalizeRequest, NewTerm, SetBudget};
use flotilla_billing::estimate::{
    BillingModel, EstimateOption, GpuWorkload, ServerlessWorkload, Workload,
};
use flotilla_billing::invoice::{Invoice, InvoiceStatus};
use flotilla_billing::price::{CreditKind, DiscountScope, Payment};
use flotilla_client::UsageRange;
use flotilla_core::id::TenantId;
use rust_decimal::Decimal;
use serde_json::Value;

use crate::ctx::Ctx;
use crate::output::{outln, print_answer, print_table, table, wire};

pub(crate) fn this_month() -> String {
    Utc::now().format("%Y-%m").to_string()
}

/// `flotilla prices`.
#[derive(Debug, Subcommand)]
pub enum PricesCommand {
    /// Publish the next catalog version from a JSON file (operators): a
    /// version as `flotilla prices --json` lists it; `version` may be left
    /// out.
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
        let v = ctx.client.publish_prices(&body).await?;
        if ctx.json {
            print_answer(&v)?;
        } else {
            outln!(
                "published price version {} (effective {})",
                v.version,
                wire(&v.effective_from)
            )?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let catalog = ctx.client.prices().await?;
    if ctx.json {
        print_answer(&catalog)?;
        return Ok(ExitCode::SUCCESS);
    }
    let in_force = catalog.in_force;
    let mut t = table(["VERSION", "EFFECTIVE FROM", "STATE"]);
    for v in &catalog.versions {
        let state = match v.version.cmp(&in_force) {
            std::cmp::Ordering::Less => "past",
            std::cmp::Ordering::Equal => "in force",
            std::cmp::Ordering::Greater => "scheduled",
        };
        t.add_row([
            v.version.to_string(),
            wire(&v.effective_from),
            state.to_string(),
        ]);
    }
    print_table(&t)?;
    let Some(cur) = catalog.versions.iter().find(|v| v.version == in_force) else {
        return Ok(ExitCode::SUCCESS);
    };
    let spot = ctx.client.spot_prices().await?;
    outln!(
        "\nversion {in_force}, prices in {} per GPU-hour",
        catalog.currency
    )?;
    let hour = |d: Decimal| -> String { (d * Decimal::from(3600)).round_dp(4).to_string() };
    let mut t = table([
        "MODEL",
        "ON-DEMAND",
        "SPOT FLOOR",
        "SPOT CEILING",
        "SPOT NOW",
        "SERVERLESS",
    ]);
    for (model, od) in &cur.on_demand {
        let now = spot
            .latest
            .iter()
            .find(|p| &p.model == model)
            .map(|p| hour(p.per_gpu_second))
            .unwrap_or_default();
        let band = cur.spot.get(model);
        t.add_row([
            model.clone(),
            hour(od.per_gpu_second),
            band.map(|b| hour(b.floor)).unwrap_or_default(),
            band.map(|b| hour(b.ceiling)).unwrap_or_default(),
            now,
            cur.serverless
                .per_gpu_second
                .get(model)
                .map(|d| hour(*d))
                .unwrap_or_default(),
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
    Finalise {
        /// Month, `YYYY-MM`.
        #[arg(long)]
        period: String,
        /// Only this tenant (id).
        #[arg(long)]
        tenant: Option<String>,
    },
}

fn status_name(s: InvoiceStatus) -> &'static str {
    match s {
        InvoiceStatus::Draft => "draft",
        InvoiceStatus::Finalised { .. } => "finalised",
    }
}

fn print_invoice(inv: &Invoice) -> Result<()> {
    let currency = &inv.currency().code;
    let state = status_name(inv.status());
    outln!(
        "invoice {} for {} ({} to {}), {state}",
        inv.id(),
        inv.tenant(),
        wire(&inv.period().start),
        wire(&inv.period().end)
    )?;
    let mut t = table(["LINE", "QUANTITY", "UNIT", "UNIT PRICE", "AMOUNT", "PRICE"]);
    for l in inv.lines() {
        let price = match (l.price_version, l.price_point_at) {
            (None, _) => l.reference.clone().unwrap_or_default(),
            (Some(v), None) => format!("v{v}"),
            (Some(v), Some(at)) => format!("v{v} spot@{}", wire(&at)),
        };
        t.add_row([
            l.description.clone(),
            wire(&l.quantity),
            l.unit.clone(),
            flotilla_billing::money::display_unit_price(l.unit_price),
            wire(&l.amount),
            price,
        ]);
    }
    print_table(&t)?;
    outln!("total: {} {currency}", wire(&inv.total()))?;
    Ok(())
}

/// `flotilla invoices …`.
pub async fn invoices(ctx: &Ctx, command: Option<InvoicesCommand>) -> Result<ExitCode> {
    match command.unwrap_or(InvoicesCommand::List { csv: false }) {
        InvoicesCommand::List { csv: true } => {
            print!("{}", ctx.client.invoices_csv().await?);
        }
        InvoicesCommand::List { csv: false } => {
            let items = ctx.client.invoices().await?;
            if ctx.json {
                print_answer(&items)?;
                return Ok(ExitCode::SUCCESS);
            }
            let mut t = table(["ID", "TENANT", "PERIOD", "STATUS", "TOTAL"]);
            for i in items {
                t.add_row([
                    i.id().to_string(),
                    i.tenant().to_string(),
                    wire(&i.period().start).chars().take(7).collect(),
                    status_name(i.status()).to_string(),
                    format!("{} {}", wire(&i.total()), i.currency().code),
                ]);
            }
            print_table(&t)?;
        }
        InvoicesCommand::Show { id, csv } => {
            if !id.starts_with("inv_") {
                bail!("`{id}` is not an invoice id (inv_…)");
            }
            if csv {
                print!("{}", ctx.client.invoice_csv(&id).await?);
                return Ok(ExitCode::SUCCESS);
            }
            let inv = ctx.client.invoice(&id).await?;
            if ctx.json {
                print_answer(&inv)?;
            } else {
                print_invoice(&inv)?;
            }
        }
        InvoicesCommand::Preview { period } => {
            let period = period.unwrap_or_else(this_month);
            let inv = ctx.client.invoice_preview(&period).await?;
            if ctx.json {
                print_answer(&inv)?;
            } else {
                print_invoice(&inv)?;
            }
        }
        InvoicesCommand::Finalise { period, tenant } => {
            let tenant = tenant
                .map(|t| TenantId::parse(t.trim(), "--tenant"))
                .transpose()
                .map_err(|e| anyhow!("{e}"))?;
            let done = ctx
                .client
                .finalise_invoices(&FinalizeRequest { period, tenant })
                .await?;
            if ctx.json {
                print_answer(&done)?;
                return Ok(ExitCode::SUCCESS);
            }
            let mut t = table(["TENANT", "INVOICE", "TOTAL", "RESULT"]);
            for i in &done.finalised {
                t.add_row([
                    i.tenant().to_string(),
                    i.id().to_string(),
                    format!("{} {}", wire(&i.total()), i.currency().code),
                    "finalised".into(),
                ]);
            }
            for k in &done.skipped {
                t.add_row([
                    k.tenant.to_string(),
                    String::new(),
                    String::new(),
                    k.reason.replace('_', " "),
                ]);
            }
            print_table(&t)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `flotilla usage --csv`: every event of the range as CSV.
pub async fn usage_csv(ctx: &Ctx, range: &UsageRange) -> Result<ExitCode> {
    print!("{}", ctx.client.usage_csv(range).await?);
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
    let b = match command {
        Some(BudgetCommand::Set(b)) => {
            // The secret goes only with a URL to sign deliveries to.
            let webhook_secret = b.webhook_url.as_ref().and(b.webhook_secret);
            let req = SetBudget {
                tenant: tenant.clone(),
                limit: b.limit,
                thresholds: (!b.thresholds.is_empty()).then_some(b.thresholds),
                hard_cap: b.hard_cap,
                webhook_url: b.webhook_url,
                webhook_secret,
            };
            ctx.client.set_budget(&req).await?
        }
        None => {
            match ctx.client.budget(tenant.as_deref()).await {
                Ok(b) => b,
                // No budget is a state, not a failure: say so and how to
                // set one.
                Err(e) if e.is_not_found() && !ctx.json => {
                    outln!(
                        "no budget set for {}: nothing is alerted or capped \
                         (set one with `flotilla budget set --limit AMOUNT`)",
                        tenant.as_deref().unwrap_or("your tenant")
                    )?;
                    return Ok(ExitCode::SUCCESS);
                }
                Err(e) => return Err(e.into()),
            }
        }
    };
    if ctx.json {
        print_answer(&b)?;
        return Ok(ExitCode::SUCCESS);
    }
    let cur = &b.currency;
    outln!(
        "budget of {}: {} {cur} a month{}",
        b.tenant,
        wire(&b.limit),
        if b.hard_cap {
            ", hard cap on spot and preemptible work"
        } else {
            ""
        }
    )?;
    let thresholds: Vec<String> = b.thresholds.iter().map(|t| format!("{t}%")).collect();
    outln!(
        "spent this month: {} {cur}; alerts at {}",
        wire(&b.spend),
        thresholds.join(", ")
    )?;
    if let Some(u) = &b.webhook_url {
        outln!("webhook: {u}")?;
    }
    if !b.alerts.is_empty() {
        let mut t = table(["ALERT", "SPEND", "AT"]);
        for a in &b.alerts {
            t.add_row([
                format!("{}%", a.threshold_percent),
                wire(&a.spend),
                wire(&a.at),
            ]);
        }
        print_table(&t)?;
    }
    if !b.deliveries.is_empty() {
        let mut t = table(["DELIVERY", "STATE", "ATTEMPTS", "LAST"]);
        for d in &b.deliveries {
            let last = match (d.last_status, &d.last_error) {
                (None, None) => String::new(),
                (Some(st), None) => st.to_string(),
                (_, Some(e)) => e.clone(),
            };
            t.add_row([d.id.clone(), wire(&d.state), d.attempts.to_string(), last]);
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
    /// Serverless: GB of model weights kept parked in host memory all
    /// month (billed per GB-hour).
    #[arg(long, default_value = "0", requires = "rps")]
    parked_gb: rust_decimal::Decimal,
}

pub async fn estimate(ctx: &Ctx, a: EstimateArgs) -> Result<ExitCode> {
    let workload = match (a.rps, a.count) {
        (Some(rps), _) => Workload::Serverless(ServerlessWorkload {
            model: a.gpu,
            requests_per_second: rps,
            input_tokens_per_request: a.input_tokens,
            output_tokens_per_request: a.output_tokens,
            gpu_seconds_per_request: a.gpu_seconds_per_request,
            tier: a.tier,
            parked_gb: a.parked_gb,
        }),
        (None, Some(count)) => Workload::Gpu(GpuWorkload {
            model: a.gpu,
            gpus: count,
            hours_per_day: a.hours_per_day,
            duty_cycle: a.duty_cycle,
            tier: a.tier,
            serves_requests: a.serves_requests,
        }),
        (None, None) => {
            return Err(anyhow!(
                "say what to estimate: --count N (dedicated GPUs) or --rps R (serverless)"
            ))
        }
    };
    let est = ctx.client.estimate(&workload).await?;
    if ctx.json {
        print_answer(&est)?;
        return Ok(ExitCode::SUCCESS);
    }
    let cur = &est.currency.code;
    let model_name = |o: &EstimateOption| -> String {
        match &o.billing_model {
            BillingModel::Reserved { term_days, .. } => format!("reserved {term_days} days"),
            BillingModel::OnDemand => "on-demand".to_string(),
            BillingModel::Spot => "spot".to_string(),
            BillingModel::Serverless => "serverless".to_string(),
        }
    };
    let mut t = table(["MODEL", "BILLING", "GPUS", "MONTHLY", "MEETS", "NOTE"]);
    for o in &est.options {
        t.add_row([
            o.model.clone(),
            model_name(o),
            o.gpus.to_string(),
            format!("{} {cur}", wire(&o.monthly_cost)),
            if o.meets { "yes" } else { "no" }.to_string(),
            o.note.clone(),
        ]);
    }
    print_table(&t)?;
    match &est.cheapest {
        Some(c) => outln!(
            "cheapest that meets it: {} {} at {} {cur} a month (30 days, price version {})",
            c.model,
            model_name(c),
            wire(&c.monthly_cost),
            est.price_version
        )?,
        None => outln!("no option meets this workload")?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `flotilla payouts`: provider payout statements of a month.
pub async fn payouts(ctx: &Ctx, period: Option<String>) -> Result<ExitCode> {
    let period = period.unwrap_or_else(this_month);
    let payouts = ctx.client.payouts(&period).await?;
    if ctx.json {
        print_answer(&payouts)?;
        return Ok(ExitCode::SUCCESS);
    }
    if payouts.items.is_empty() {
        outln!("no payouts for {period}")?;
    }
    for p in &payouts.items {
        let cur = &p.currency.code;
        outln!("payout statement {period} for {}", p.provider)?;
        let mut t = table(["MODEL", "KIND", "GPU-SECONDS", "UNIT PRICE", "GROSS"]);
        for l in &p.lines {
            t.add_row([
                l.model.clone(),
                wire(&l.kind),
                wire(&l.gpu_seconds),
                flotilla_billing::money::display_unit_price(l.unit_price),
                wire(&l.gross),
            ]);
        }
        print_table(&t)?;
        outln!(
            "gross {} {cur}, operator fee {} {cur}, payout {} {cur}",
            wire(&p.gross),
            wire(&p.operator_fee),
            wire(&p.payout)
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Exit status of `flotilla billing reconcile` when it found differences
/// (0: none; 1: the check itself failed, like every command's error; 2:
/// bad arguments), so that a script or a cron job can tell them apart.
pub const DIFFERENCES_FOUND: u8 = 3;

/// `flotilla billing …`.
#[derive(Debug, Subcommand)]
pub enum BillingCommand {
    /// Compare, per instance, the seconds the ledger bills with the
    /// seconds its executor saw it run, and list every difference beyond
    /// the threshold with its cause (operators). Exits 3 when it finds
    /// any, 0 when none.
    Reconcile {
        /// Start of the window (RFC 3339; default: an hour before its end).
        #[arg(long)]
        since: Option<String>,
        /// End of the window (RFC 3339; default: two minutes ago, so
        /// metering has caught up).
        #[arg(long)]
        until: Option<String>,
        /// Seconds per instance a difference may reach unreported
        /// (default 1: usage is metered to the millisecond; the second is
        /// room for clocks to disagree).
        #[arg(long = "threshold-s", value_name = "SECONDS")]
        threshold_s: Option<String>,
    },
}

/// `flotilla billing reconcile`.
pub async fn billing(ctx: &Ctx, command: BillingCommand) -> Result<ExitCode> {
    let BillingCommand::Reconcile {
        since,
        until,
        threshold_s,
    } = command;
    let q = flotilla_client::ReconcileQuery {
        since,
        until,
        threshold_s,
    };
    let r = ctx.client.billing_reconcile(&q).await?;
    let code = if r.differences.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(DIFFERENCES_FOUND)
    };
    if ctx.json {
        print_answer(&r)?;
        return Ok(code);
    }
    outln!(
        "reconciled {} to {}: {} instance(s), {} s billed, {} s observed running, threshold {} s",
        r.since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        r.until.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        r.instances,
        r.billed_seconds,
        r.observed_seconds,
        r.threshold_seconds
    )?;
    if r.differences.is_empty() {
        outln!("no differences: the ledger bills what the executors saw run")?;
        return Ok(code);
    }
    let mut t = table([
        "INSTANCE",
        "TENANT",
        "CAUSE",
        "BILLED S",
        "OBSERVED S",
        "DIFFERENCE S",
    ]);
    for d in &r.differences {
        t.add_row([
            d.instance.clone(),
            d.tenant.to_string(),
            d.cause.as_str().to_string(),
            d.billed_seconds.to_string(),
            d.observed_seconds.to_string(),
            d.difference_seconds.to_string(),
        ]);
    }
    print_table(&t)?;
    outln!("{} difference(s)", r.differences.len())?;
    Ok(code)
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
        start: DateTime<Utc>,
        /// Term in days.
        #[arg(long)]
        term_days: u32,
        /// `monthly` or `upfront`.
        #[arg(long, default_value = "monthly", value_parser = wire_name::<Payment>)]
        payment: Payment,
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
        #[arg(long, default_value = "all", value_parser = wire_name::<DiscountScope>)]
        scope: DiscountScope,
        /// First period it applies to (RFC 3339 start).
        #[arg(long)]
        from: DateTime<Utc>,
        /// Periods starting before this (RFC 3339); default: no end.
        #[arg(long)]
        until: Option<DateTime<Utc>>,
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
        #[arg(long, default_value = "promotional", value_parser = wire_name::<CreditKind>)]
        kind: CreditKind,
        /// Usable by periods starting before this (RFC 3339).
        #[arg(long)]
        expires_at: Option<DateTime<Utc>>,
    },
}

/// A name as the API spells it (`monthly`, `on_demand`, `prepaid`, …),
/// read by the wire type's own deserialiser so that the two cannot
/// disagree; its error lists the names there are.
fn wire_name<T: serde::de::DeserializeOwned>(s: &str) -> std::result::Result<T, String> {
    serde_json::from_value(Value::String(s.trim().to_string())).map_err(|e| e.to_string())
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
        None => ctx.client.me().await?.tenant.id.to_string(),
    };
    if !tenant.starts_with("ten_") {
        bail!("`{tenant}` is not a tenant id (ten_…)");
    }
    if let Some(cmd) = command {
        let term = match cmd {
            TermsCommand::Commitment {
                id,
                model,
                gpus,
                start,
                term_days,
                payment,
                discount,
            } => NewTerm::Commitment {
                id,
                model,
                gpus,
                start,
                term_days,
                payment,
                discount,
            },
            TermsCommand::Discount {
                id,
                percent,
                scope,
                from,
                until,
            } => NewTerm::Discount {
                id,
                percent,
                scope,
                from,
                until,
            },
            TermsCommand::Credit {
                id,
                amount,
                kind,
                expires_at,
            } => NewTerm::Credit {
                id,
                credit_kind: kind,
                amount,
                granted_at: None,
                expires_at,
            },
        };
        let added = ctx.client.add_term(&tenant, &term).await?;
        if ctx.json {
            print_answer(&added)?;
            return Ok(ExitCode::SUCCESS);
        }
        outln!("added {} `{}`", added.kind(), added.id())?;
        return Ok(ExitCode::SUCCESS);
    }
    let terms = ctx.client.terms(&tenant).await?;
    if ctx.json {
        print_answer(&terms)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut t = table(["TERM", "ID", "DETAIL"]);
    for c in &terms.commitments {
        t.add_row([
            "commitment".to_string(),
            c.id.clone(),
            format!(
                "{}×{} {} to {}, {}, {} per GPU-second (price v{})",
                c.gpus,
                c.model,
                wire(&c.start),
                wire(&c.end),
                wire(&c.payment),
                wire(&c.per_gpu_second),
                c.price_version
            ),
        ]);
    }
    for d in &terms.discounts {
        t.add_row([
            "discount".to_string(),
            d.id.clone(),
            format!(
                "{}% off {} from {}",
                wire(&d.percent),
                wire(&d.scope),
                wire(&d.from)
            ),
        ]);
    }
    for c in &terms.credits {
        let drawn = terms
            .credit_drawn
            .get(&c.id)
            .map_or_else(|| "0".to_string(), wire);
        t.add_row([
            format!("{} credit", wire(&c.kind)),
            c.id.clone(),
            format!("{} granted, {drawn} drawn", wire(&c.amount)),
        ]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}
