//! The metering benchmark (`scripts/bench metering`): batched ingestion
//! through `append_usage` (the ledger rules, dedup and conflict detection
//! included) against a plain batched INSERT of the same rows into a table
//! of the same shape in the same database, and the time to rate one
//! tenant's month (the rollup table kept at ingestion + `build_invoice`)
//! and a provider's payout statement of the same events (the node rollup
//! table kept at ingestion + `payout_statement`), on SQLite and, when it
//! answers, PostgreSQL. Writes `metering.json` and `metering.md` into
//! `$FLOTILLA_BENCH_OUT` (default `bench/results`).
//!
//! Knobs: `FLOTILLA_BENCH_INGEST_EVENTS` (default 200,000),
//! `FLOTILLA_BENCH_INVOICE_EVENTS` (default 1,000,000; the 10 M
//! is reached by setting it, the default extrapolates linearly and says
//! so), `FLOTILLA_TEST_DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`).

use std::collections::BTreeMap;
use std::time::Instant;

use chrono::{DateTime, Duration, Utc};
use flotilla_billing::invoice::{build_invoice, InvoiceInput};
use flotilla_billing::meter::{EventKey, GpuShare, Meter, Subject, SubjectKind, UsageEvent};
use flotilla_billing::payout::{payout_statement, PayoutPolicy};
use flotilla_billing::price::{PriceBook, PriceVersion, SpotSeries};
use flotilla_billing::Period;
use flotilla_core::api::{DiscoveredGpu, RegisterNode};
use flotilla_core::catalog::Vendor;
use flotilla_core::id::{GpuId, InvoiceId, NodeId, ProviderId, TenantId};
use flotilla_core::instance::BillingClass;
use flotilla_store::{Backend, Store};
use rust_decimal::Decimal;
use serde_json::json;

const BATCH: usize = 10_000;

fn env_n(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

/// 2025-01-01T00:00:00Z.
fn jan() -> DateTime<Utc> {
    DateTime::from_timestamp(1_735_689_600, 0).unwrap()
}

/// Event `i` of a tenant: one-minute slices of 200 instances (agents
/// meter per slice), every tenth a MIG share, every seventh spot-free
/// reserved-free on-demand A100.
fn event(t: &TenantId, source: &str, i: usize, node: Option<&NodeId>) -> UsageEvent {
    let subject = i % 200;
    let minute = (i / 200) as i64;
    let start = jan() + Duration::minutes(minute % (60 * 24 * 30));
    let share = if matches!(subject % 10, 0) {
        GpuShare::mig_named("3g.40gb").unwrap()
    } else {
        GpuShare::Whole
    };
    UsageEvent {
        key: EventKey {
            tenant: t.clone(),
            source: source.into(),
            id: format!("inst_{subject:04}/gpu/{i}"),
        },
        subject: Subject {
            kind: SubjectKind::Instance,
            id: format!("inst_{subject:04}"),
        },
        meter: Meter::GpuSeconds {
            model: if matches!(subject % 7, 0) {
                "A100-80GB"
            } else {
                "H100"
            }
            .into(),
            share,
        },
        billing_class: BillingClass::OnDemand,
        start,
        end: start + Duration::minutes(1),
        amount: Decimal::from(1 + (subject % 4) as u32),
        node: node.cloned(),
        corrects: None,
    }
}

fn book() -> PriceBook {
    let v: PriceVersion = serde_json::from_value(json!({
        "version": 1,
        "effective_from": "1970-01-01T00:00:00Z",
        "currency": {"code": "USD", "minor_units": 2},
        "on_demand": {
            "H100": {"per_gpu_second": "0.00083"},
            "A100-80GB": {"per_gpu_second": "0.00055"}
        },
        "spot": {},
        "serverless": {
            "per_request": {"kind": "flat", "unit_price": "0"},
            "per_million_input_tokens": {"kind": "flat", "unit_price": "0"},
            "per_million_output_tokens": {"kind": "flat", "unit_price": "0"},
            "per_gpu_second": {}
        },
        "reserved_offers": [],
        "per_instance_second": "0",
        "per_storage_gb_second": "0"
    }))
    .expect("price version");
    PriceBook::new(v).expect("price book")
}

/// The table of a plain INSERT: the columns, types and primary key of
/// `usage_events` and its (tenant_id, end_ms) index (not its four partial
/// indexes, which hold none of these rows).
fn raw_ddl(name: &str) -> [String; 3] {
    [
        format!("DROP TABLE IF EXISTS usage_raw_{name}"),
        format!(
            "CREATE TABLE usage_raw_{name} (tenant_id TEXT NOT NULL, source TEXT NOT NULL, \
             event_id TEXT NOT NULL, subject_kind TEXT NOT NULL, subject_id TEXT NOT NULL, \
             meter TEXT NOT NULL, meter_detail TEXT NOT NULL, model TEXT NOT NULL, \
             share_units BIGINT NOT NULL, billing_class TEXT NOT NULL, start_ms BIGINT NOT NULL, \
             end_ms BIGINT NOT NULL, amount TEXT NOT NULL, amount_int BIGINT, node_id TEXT, \
             corrects_source TEXT, corrects_id TEXT, received_at BIGINT NOT NULL, \
             PRIMARY KEY (tenant_id, source, event_id))"
        ),
        format!("CREATE INDEX usage_raw_{name}_tenant_end ON usage_raw_{name} (tenant_id, end_ms)"),
    ]
}

/// `INSERT INTO usage_raw_<name> … VALUES` with `chunk` rows of `?`
/// (positional) or `$N` parameters.
fn raw_sql(name: &str, chunk: usize, positional: bool) -> String {
    let mut sql = format!(
        "INSERT INTO usage_raw_{name} (tenant_id, source, event_id, subject_kind, subject_id, \
         meter, meter_detail, model, share_units, billing_class, start_ms, end_ms, amount, \
         amount_int, node_id, corrects_source, corrects_id, received_at) VALUES "
    );
    for r in 0..chunk {
        if r > 0 {
            sql.push(',');
        }
        let cols: Vec<String> = (1..=18)
            .map(|c| {
                if positional {
                    "?".to_string()
                } else {
                    format!("${}", r * 18 + c)
                }
            })
            .collect();
        sql.push_str(&format!("({})", cols.join(",")));
    }
    sql
}

/// Precomputed outside the timing, as a hand-written bulk loader would.
fn raw_rows(events: &[UsageEvent]) -> Vec<[String; 4]> {
    events
        .iter()
        .map(|e| {
            [
                serde_json::to_string(&e.meter).unwrap(),
                match &e.meter {
                    Meter::GpuSeconds { model, .. } => model.clone(),
                    _ => String::new(),
                },
                e.amount.to_string(),
                e.billing_class.as_str().to_string(),
            ]
        })
        .collect()
}

/// Binds the rows of one raw chunk, on either driver.
macro_rules! bind_raw {
    ($sql:expr, $ce:expr, $cr:expr) => {{
        let mut q = sqlx::query($sql);
        for (e, r) in $ce.iter().zip($cr) {
            q = q
                .bind(e.key.tenant.as_str())
                .bind(e.key.source.as_str())
                .bind(e.key.id.as_str())
                .bind("instance")
                .bind(e.subject.id.as_str())
                .bind("gpu_seconds")
                .bind(r[0].as_str())
                .bind(r[1].as_str())
                .bind(7000_i64)
                .bind(r[3].as_str())
                .bind(e.start.timestamp_millis())
                .bind(e.end.timestamp_millis())
                .bind(r[2].as_str())
                .bind(1_i64)
                .bind(None::<String>)
                .bind(None::<String>)
                .bind(None::<String>)
                .bind(0_i64);
        }
        q
    }};
}

/// A plain batched INSERT into its own table `usage_raw_<name>` (the
/// shape and keys of `usage_events`), one transaction per batch, `chunk`
/// rows per statement, no conflict handling, no checks: on SQLite's native
/// sqlx driver (the one `append_usage` uses on SQLite, `?` parameters) or
/// through sqlx's `Any` driver (`$N` parameters, what `append_usage` uses
/// on PostgreSQL).
enum Raw {
    Native(sqlx::SqlitePool, String, usize),
    Any(sqlx::AnyPool, String, usize),
}

impl Raw {
    async fn native(store_url: &str, name: &str, chunk: usize) -> Raw {
        use sqlx::sqlite::SqliteSynchronous;
        use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
        use std::str::FromStr;
        let opts = SqliteConnectOptions::from_str(store_url)
            .expect("url")
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(std::time::Duration::from_secs(10))
            // The same page cache and mmap as the store's native pool.
            .pragma("cache_size", "-65536")
            .pragma("mmap_size", "268435456");
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(opts)
            .await
            .expect("connect");
        for sql in raw_ddl(name) {
            sqlx::query(&sql).execute(&pool).await.expect("raw table");
        }
        Raw::Native(pool, raw_sql(name, chunk, true), chunk)
    }

    async fn any(store_url: &str, name: &str, chunk: usize) -> Raw {
        use sqlx::any::AnyPoolOptions;
        use sqlx::Executor;
        let pool = AnyPoolOptions::new()
            .max_connections(1)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    if conn.backend_name() == "SQLite" {
                        conn.execute("PRAGMA journal_mode = WAL").await?;
                        conn.execute("PRAGMA synchronous = NORMAL").await?;
                        conn.execute("PRAGMA busy_timeout = 10000").await?;
                    }
                    Ok(())
                })
            })
            .connect(store_url)
            .await
            .expect("connect");
        for sql in raw_ddl(name) {
            sqlx::query(&sql).execute(&pool).await.expect("raw table");
        }
        Raw::Any(pool, raw_sql(name, chunk, false), chunk)
    }

    /// Inserts one batch (whole chunks), in one transaction.
    async fn batch(&self, events: &[UsageEvent], rows: &[[String; 4]]) -> std::time::Duration {
        let t0 = Instant::now();
        match self {
            Raw::Native(pool, sql, chunk) => {
                let mut tx = pool.begin().await.expect("begin");
                for (ce, cr) in events.chunks(*chunk).zip(rows.chunks(*chunk)) {
                    assert_eq!(ce.len(), *chunk, "the raw path takes whole chunks");
                    bind_raw!(sql, ce, cr)
                        .execute(&mut *tx)
                        .await
                        .expect("raw insert");
                }
                tx.commit().await.expect("commit");
            }
            Raw::Any(pool, sql, chunk) => {
                let mut tx = pool.begin().await.expect("begin");
                for (ce, cr) in events.chunks(*chunk).zip(rows.chunks(*chunk)) {
                    assert_eq!(ce.len(), *chunk, "the raw path takes whole chunks");
                    bind_raw!(sql, ce, cr)
                        .execute(&mut *tx)
                        .await
                        .expect("raw insert");
                }
                tx.commit().await.expect("commit");
            }
        }
        t0.elapsed()
    }

    async fn close(self) {
        match self {
            Raw::Native(pool, ..) => pool.close().await,
            Raw::Any(pool, ..) => pool.close().await,
        }
    }
}

/// Ingestion of `events` (a multiple of `BATCH`) through `append_usage`
/// and through each plain INSERT of `raws`, batch by batch in turn (the
/// order rotating from batch to batch), so that the machine's load, shared
/// with other work, weighs on all of them alike. Events per second of
/// `append_usage`, then of each of `raws`.
async fn ingest_side_by_side(
    store: &Store,
    raws: &[Raw],
    events: &[UsageEvent],
    grace: Duration,
    now: DateTime<Utc>,
) -> (f64, Vec<f64>) {
    // Precomputed outside the timing, as a hand-written bulk loader would.
    let rows = raw_rows(events);
    let mut ledger = std::time::Duration::ZERO;
    let mut raw = vec![std::time::Duration::ZERO; raws.len()];
    for (k, (b, r)) in events.chunks(BATCH).zip(rows.chunks(BATCH)).enumerate() {
        for turn in 0..=raws.len() {
            let which = (turn + k) % (raws.len() + 1);
            if which == raws.len() {
                let t0 = Instant::now();
                let out = store.append_usage(b, grace, now).await.expect("append");
                ledger += t0.elapsed();
                assert_eq!(out.accepted as usize, b.len(), "{:?}", out.rejected.first());
            } else {
                raw[which] += raws[which].batch(b, r).await;
            }
        }
    }
    let n = events.len() as f64;
    (
        n / ledger.as_secs_f64(),
        raw.iter().map(|d| n / d.as_secs_f64()).collect(),
    )
}

struct Row {
    store: &'static str,
    events_per_s: f64,
    raw_insert_events_per_s: f64,
    raw_any_events_per_s: Option<f64>,
    invoice_events: usize,
    invoice_s: f64,
    rollup_rows: usize,
    load_events_per_s: f64,
    payout_s: f64,
    payout_rows: usize,
}

async fn run(store_name: &'static str, url: &str, ingest: usize, invoice: usize) -> Row {
    let store = Store::connect(url).await.expect("connect");
    let now = jan() + Duration::days(31);
    let grace = Duration::days(400);
    let t = TenantId::generate(1, 1);
    store
        .create_tenant(&t, "bench", jan())
        .await
        .expect("tenant");
    let t2 = TenantId::generate(2, 2);
    store
        .create_tenant(&t2, "bench-invoice", jan())
        .await
        .expect("tenant");

    let events: Vec<UsageEvent> = (0..ingest)
        .map(|i| event(&t, "agent:bench", i, None))
        .collect();
    let chunk = flotilla_store::usage::insert_chunk(store.backend());
    let raws = match store.backend() {
        Backend::Sqlite => vec![
            Raw::native(url, "native", chunk).await,
            // The previous baseline: the `Any` driver at its best chunk
            // (small, `$N` parameters).
            Raw::any(url, "any", 10).await,
        ],
        Backend::Postgres => vec![Raw::any(url, "any", chunk).await],
    };
    let (events_per_s, raw_rates) = ingest_side_by_side(&store, &raws, &events, grace, now).await;
    for raw in raws {
        raw.close().await;
    }
    let raw_insert_events_per_s = raw_rates[0];
    let raw_any_events_per_s = raw_rates.get(1).copied();
    drop(events);

    // The invoice tenant, loaded through the same ledger path, on a
    // provider's node: the same events make the provider's payout.
    let provider = store
        .provider_for_tenant(&t, &ProviderId::generate(4, 4), jan())
        .await
        .expect("provider");
    let node = store
        .register_node(
            &t,
            &RegisterNode {
                name: "bench-node".into(),
                region: None,
                pool: None,
                cpu_milli: 1000,
                memory_mb: 1024,
                simulated: true,
                gpus: vec![DiscoveredGpu {
                    index: 0,
                    model: "H100".into(),
                    uuid: "GPU-0".into(),
                    memory_mib: 81920,
                    vendor: Vendor::Nvidia,
                    mig_mode: false,
                }],
                agent_version: "bench".into(),
                runtime: Default::default(),
                executor: Default::default(),
                running: Vec::new(),
                unenforced_limits: Vec::new(),
                network: None,
            },
            || (NodeId::generate(5, 5), vec![GpuId::generate(6, 6)]),
            jan(),
        )
        .await
        .expect("node")
        .id;
    store
        .set_node_provider(&node, Some(&provider))
        .await
        .expect("node provider");
    let t1 = Instant::now();
    let mut i = 0;
    while i < invoice {
        let n = BATCH.min(invoice - i);
        let b: Vec<UsageEvent> = (i..i + n)
            .map(|k| event(&t2, "agent:inv", k, Some(&node)))
            .collect();
        store.append_usage(&b, grace, now).await.expect("load");
        i += n;
    }
    let load_events_per_s = invoice as f64 / t1.elapsed().as_secs_f64();
    if url.starts_with("postgres") {
        use sqlx::Executor;
        let pool = sqlx::AnyPool::connect(url).await.expect("connect");
        pool.execute("ANALYZE usage_events").await.expect("analyze");
        pool.execute("ANALYZE usage_rollup").await.expect("analyze");
        pool.execute("ANALYZE usage_node_rollup")
            .await
            .expect("analyze");
        pool.close().await;
    }
    let period = Period::month(2025, 1).expect("month");
    let book = book();
    let id = InvoiceId::generate(3, 3);
    let t2s = Instant::now();
    let rollup = store
        .usage_rollup(&t2, period, false)
        .await
        .expect("rollup");
    let draft = build_invoice(InvoiceInput {
        id: &id,
        tenant: &t2,
        period,
        events: &rollup.events,
        book: &book,
        spot: &SpotSeries::new(),
        commitments: &[],
        discounts: &[],
        credits: &[],
        credit_used_before: &BTreeMap::new(),
    })
    .expect("invoice");
    let invoice_s = t2s.elapsed().as_secs_f64();
    assert_eq!(rollup.stored_events as usize, invoice);
    eprintln!(
        "{store_name}: total {} over {} lines from {} rollup rows",
        draft.invoice.total(),
        draft.invoice.lines().len(),
        rollup.events.len()
    );
    // The provider's payout statement of the same month: every tenant's
    // usage on its nodes (here the invoice tenant's 10M events), read from
    // `usage_node_rollup`, priced and less the operator's fee.
    let t3 = Instant::now();
    let owners = store.node_providers().await.expect("owners");
    let on_nodes = store.usage_on_nodes(period).await.expect("node rollup");
    let statement = payout_statement(
        &provider,
        period,
        &owners,
        &on_nodes.events,
        &book,
        &SpotSeries::new(),
        &PayoutPolicy {
            operator_fee_percent: Decimal::from(15),
        },
    )
    .expect("payout");
    let payout_s = t3.elapsed().as_secs_f64();
    assert_eq!(on_nodes.stored_events as usize, invoice);
    eprintln!(
        "{store_name}: payout gross {} from {} node rollup rows in {payout_s:.3} s",
        statement.gross,
        on_nodes.events.len()
    );
    store.close().await;
    Row {
        payout_s,
        payout_rows: on_nodes.events.len(),
        store: store_name,
        events_per_s,
        raw_insert_events_per_s,
        raw_any_events_per_s,
        invoice_events: invoice,
        invoice_s,
        rollup_rows: rollup.events.len(),
        load_events_per_s,
    }
}

async fn fresh_postgres(base: &str) -> Option<String> {
    use sqlx::Connection;
    let mut admin = sqlx::PgConnection::connect(base).await.ok()?;
    let name = format!("flotilla_bench_{}", std::process::id());
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await
        .ok()?;
    let i = base.rfind('/')?;
    Some(format!("{}/{name}", &base[..i]))
}

#[tokio::main]
async fn main() {
    let ingest = env_n("FLOTILLA_BENCH_INGEST_EVENTS", 200_000).max(BATCH) / BATCH * BATCH;
    let invoice = env_n("FLOTILLA_BENCH_INVOICE_EVENTS", 1_000_000);
    let out = std::env::var("FLOTILLA_BENCH_OUT").unwrap_or_else(|_| "bench/results".into());
    let mut rows = Vec::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let sqlite = format!("sqlite://{}/bench.db?mode=rwc", dir.path().display());
    rows.push(run("sqlite", &sqlite, ingest, invoice).await);
    let base = std::env::var("FLOTILLA_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    match fresh_postgres(&base).await {
        Some(url) => rows.push(run("postgresql", &url, ingest, invoice).await),
        None => eprintln!("metering bench: PostgreSQL at {base} does not answer; SQLite only"),
    }
    let extrapolate = 10_000_000.0 / invoice as f64;
    let json_rows: Vec<_> = rows
        .iter()
        .map(|r| {
            json!({
                "store": r.store,
                "events_per_s": r.events_per_s.round(),
                "raw_insert_events_per_s": r.raw_insert_events_per_s.round(),
                "raw_insert_any_driver_events_per_s": r.raw_any_events_per_s.map(f64::round),
                "invoice_10m_events_s": (r.invoice_s * extrapolate * 1000.0).round() / 1000.0,
                "invoice_measured_events": r.invoice_events,
                "invoice_measured_s": (r.invoice_s * 1000.0).round() / 1000.0,
                "invoice_10m_extrapolated": r.invoice_events != 10_000_000,
                "rollup_rows": r.rollup_rows,
                "ledger_load_events_per_s": r.load_events_per_s.round(),
                "payout_10m_events_s": (r.payout_s * extrapolate * 1000.0).round() / 1000.0,
                "payout_measured_s": (r.payout_s * 1000.0).round() / 1000.0,
                "payout_node_rollup_rows": r.payout_rows,
                "ingest_events": ingest,
            })
        })
        .collect();
    std::fs::create_dir_all(&out).expect("out dir");
    std::fs::write(
        format!("{out}/metering.json"),
        serde_json::to_string_pretty(&json_rows).expect("json") + "\n",
    )
    .expect("write json");
    let mut md = String::from(
        "| store | events/s (append_usage) | raw INSERT events/s | ratio | raw INSERT, `Any` driver | invoice of 10M events (s) | measured on | rollup rows | payout of 10M events (s) | node rollup rows |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |\n",
    );
    for r in &rows {
        md.push_str(&format!(
            "| {} | {:.0} | {:.0} | {:.2} | {} | {:.2}{} | {} events in {:.3} s | {} | {:.2}{} | {} |\n",
            r.store,
            r.events_per_s,
            r.raw_insert_events_per_s,
            r.events_per_s / r.raw_insert_events_per_s,
            r.raw_any_events_per_s
                .map_or("(same)".to_string(), |v| format!("{v:.0}")),
            r.invoice_s * extrapolate,
            if r.invoice_events == 10_000_000 {
                String::new()
            } else {
                format!(" (extrapolated ×{extrapolate:.0}, linear)")
            },
            r.invoice_events,
            r.invoice_s,
            r.rollup_rows,
            r.payout_s * extrapolate,
            if r.invoice_events == 10_000_000 {
                String::new()
            } else {
                " (extrapolated, linear)".to_string()
            },
            r.payout_rows,
        ));
    }
    std::fs::write(format!("{out}/metering.table.md"), md).expect("write md");
    eprintln!("metering bench: wrote {out}/metering.json");
}
