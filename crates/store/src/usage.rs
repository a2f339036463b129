//! The usage ledger in SQL: flotilla-billing's append-only event log, with
//! its rules ([`check_append`]) applied batch by batch.
//!
//! Exactly-once comes from the key, not from the sender: every event is
//! inserted under the primary key (tenant_id, source, event_id) in one
//! transaction per batch, so a batch is either wholly committed or not at
//! all, and a sender that crashed (or whose server crashed) re-sends
//! everything and the key absorbs what was already committed. A batch is
//! first inserted with plain INSERTs (new events, the common case, at the
//! speed of a bulk load); if a key is already stored the batch is rolled
//! back and redone with `ON CONFLICT DO NOTHING RETURNING`, which names the
//! new rows. Rows already there are then compared with what was sent: same
//! payload is a duplicate, another payload a conflict (refused), exactly as
//! the in-memory reference ledger decides.
//!
//! Rating does not read millions of events back one by one: every batch
//! also adds the events it inserted (never a duplicate) to the
//! `usage_rollup` table, in the same transaction, and
//! [`Store::usage_rollup`] reads those rows (one per meter and interval,
//! packed by the database into one text value per meter so that the
//! driver returns a few rows, and joined into steady stretches), which
//! rate to the same invoice (see its documentation for why that is exact).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use chrono::{DateTime, Duration, SubsecRound, Utc};
use flotilla_billing::meter::{
    check_append, Appended, EventKey, Meter, ShareUnits, Subject, SubjectKind, UsageEvent,
    MAX_COUNT, MAX_EVENT_DAYS, MAX_UNITS,
};
use flotilla_billing::{BillingError, Period};
use flotilla_core::id::{NodeId, TenantId};
use flotilla_core::instance::BillingClass;
use rust_decimal::prelude::ToPrimitive;
use rust_decimal::Decimal;
use sqlx::Row;

use crate::{at, json, ms, to_json, Result, Store, StoreError};

/// Columns written per event.
const COLS: usize = 18;

/// Events per INSERT on `backend`. PostgreSQL: 500 rows × 18 binds, well
/// under its 65,535 binds, large enough that round trips are noise.
/// SQLite (through the store's native SQLite pool, positional `?`
/// parameters): 1,000 rows × 18 binds, under SQLite's 32,766. Every
/// statement is a round trip to sqlx's SQLite worker thread (tens of µs
/// on a busy machine), so the fewer the better. With `$N` parameters sqlx
/// would look up each parameter's name, a scan that grows with their
/// number (quadratic per statement), which is why `$N` statements must
/// stay small.
pub fn insert_chunk(backend: crate::Backend) -> usize {
    match backend {
        crate::Backend::Sqlite => 1000,
        crate::Backend::Postgres => 500,
    }
}

/// The statement sizes a batch is cut into: full chunks, then the rest in
/// hundreds, tens and ones, so that every statement is one of four
/// prepared (and cached) shapes whatever the batch size.
fn statement_rows(left: usize, full: usize) -> usize {
    [full, 100, 10, 1]
        .into_iter()
        .find(|&n| n <= full && n <= left)
        .unwrap_or(1)
}

/// Keys per lookup of already-stored events (3 binds each).
const PROBE_CHUNK: usize = 1000;

/// Most events one call may append; the API allows 10,000 per request.
pub const MAX_BATCH: usize = 100_000;

pub(crate) const EVENT_COLUMNS: &str =
    "tenant_id, source, event_id, subject_kind, subject_id, meter, \
     meter_detail, model, share_units, billing_class, start_ms, end_ms, amount, amount_int, \
     node_id, corrects_source, corrects_id, received_at";

/// Why one event of a batch was not recorded.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Rejection {
    /// Position of the event in the batch.
    pub index: usize,
    /// Its key as `tenant/source/id`.
    pub key: String,
    /// `invalid`, `unknown_tenant`, `key_conflict` or `late`.
    pub code: &'static str,
    /// The field at fault, for `invalid` and `unknown_tenant`.
    pub field: Option<String>,
    /// What is wrong, lowercase.
    pub message: String,
}

/// What one batch did. `accepted + duplicates + rejected.len()` is the
/// batch size.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct AppendOutcome {
    /// Events recorded by this call.
    pub accepted: u64,
    /// Events already recorded with the same payload (harmless re-sends).
    pub duplicates: u64,
    /// Events refused, each with its reason.
    pub rejected: Vec<Rejection>,
}

/// The stored form of one event, computed once per event.
struct Flat<'a> {
    e: &'a UsageEvent,
    subject_kind: &'static str,
    meter: &'static str,
    /// The meter as JSON, shared by the batch's events of the same meter
    /// (see [`MeterDetails`]).
    meter_detail: Arc<str>,
    model: &'a str,
    share_units: i64,
    amount: String,
    amount_int: Option<i64>,
}

/// The write transaction of one batch: on the native SQLite pool when the
/// store has one, else on the `Any` pool.
enum LedgerTx {
    Any(sqlx::Transaction<'static, sqlx::Any>),
    Sqlite(sqlx::Transaction<'static, sqlx::Sqlite>),
}

/// Binds the columns of `$chunk`'s events (in [`EVENT_COLUMNS`] order) to
/// a query of either driver.
macro_rules! bind_events {
    ($q:expr, $chunk:expr, $now_ms:expr) => {{
        let mut q = $q;
        for f in $chunk {
            let e = f.e;
            let (cs, ci) = match &e.corrects {
                Some(k) => (Some(k.source.as_str()), Some(k.id.as_str())),
                None => (None, None),
            };
            q = q
                .bind(e.key.tenant.as_str())
                .bind(e.key.source.as_str())
                .bind(e.key.id.as_str())
                .bind(f.subject_kind)
                .bind(e.subject.id.as_str())
                .bind(f.meter)
                .bind(&*f.meter_detail)
                .bind(f.model)
                .bind(f.share_units)
                .bind(e.billing_class.as_str())
                .bind(ms(e.start))
                .bind(ms(e.end))
                .bind(f.amount.as_str())
                .bind(f.amount_int)
                .bind(e.node.as_ref().map(|n| n.as_str()))
                .bind(cs)
                .bind(ci)
                .bind($now_ms);
        }
        q
    }};
}

fn subject_kind_str(k: SubjectKind) -> &'static str {
    match k {
        SubjectKind::Instance => "instance",
        SubjectKind::Job => "job",
        SubjectKind::Endpoint => "endpoint",
    }
}

fn parse_subject_kind(s: &str) -> Result<SubjectKind> {
    Ok(match s {
        "instance" => SubjectKind::Instance,
        "job" => SubjectKind::Job,
        "endpoint" => SubjectKind::Endpoint,
        other => return Err(StoreError::Corrupt(format!("usage subject kind `{other}`"))),
    })
}

fn meter_str(m: &Meter) -> &'static str {
    match m {
        Meter::GpuSeconds { .. } => "gpu_seconds",
        Meter::InstanceSeconds => "instance_seconds",
        Meter::StorageGbSeconds => "storage_gb_seconds",
        Meter::ParkedGbSeconds => "parked_gb_seconds",
        Meter::Requests => "requests",
        Meter::InputTokens => "input_tokens",
        Meter::OutputTokens => "output_tokens",
    }
}

/// Count meters are rated by their end alone (see `quantity_within`).
fn is_count_meter(kind: &str) -> bool {
    matches!(kind, "requests" | "input_tokens" | "output_tokens")
}

/// The JSON of each distinct meter of a batch, serialised once: a batch
/// holds a handful of meters (model × share) over thousands of events, and
/// serialising a meter costs more than hashing it.
#[derive(Default)]
struct MeterDetails<'a>(HashMap<&'a Meter, Arc<str>>);

impl<'a> MeterDetails<'a> {
    fn of(&mut self, m: &'a Meter) -> Arc<str> {
        self.0
            .entry(m)
            .or_insert_with(|| Arc::from(to_json(m)))
            .clone()
    }
}

impl<'a> Flat<'a> {
    fn new(e: &'a UsageEvent, details: &mut MeterDetails<'a>) -> Self {
        let (model, share_units) = match &e.meter {
            Meter::GpuSeconds { model, share } => (model.as_str(), share.units()),
            _ => ("", 0),
        };
        let amount_int = if e.amount.fract().is_zero() {
            e.amount.to_i64()
        } else {
            None
        };
        Self {
            e,
            subject_kind: subject_kind_str(e.subject.kind),
            meter: meter_str(&e.meter),
            meter_detail: details.of(&e.meter),
            model,
            share_units: i64::try_from(share_units).unwrap_or(i64::MAX),
            // A whole amount's text is its integer's (what `normalize`
            // would print), without the decimal formatting.
            amount: match amount_int {
                Some(n) => n.to_string(),
                None => e.amount.normalize().to_string(),
            },
            amount_int,
        }
    }
}

/// The parts of the ledger rules that need no database: the billing
/// crate's validation, plus the one thing SQL cannot store faithfully
/// (sub-millisecond times), refused so that a re-send of a stored event
/// always compares equal to it. The API calls this to answer 422.
pub fn validate_event(e: &UsageEvent) -> Result<(), BillingError> {
    e.validate()?;
    for (field, t) in [("start", e.start), ("end", e.end)] {
        if t.trunc_subsecs(3) != t {
            return Err(BillingError::invalid(
                field,
                "must be a whole number of milliseconds",
            ));
        }
    }
    Ok(())
}

fn rejection(index: usize, e: &UsageEvent, err: BillingError) -> Rejection {
    let key = e.key.to_string();
    match err {
        BillingError::Invalid { field, message } => Rejection {
            index,
            key,
            code: "invalid",
            field: Some(field),
            message,
        },
        BillingError::KeyConflict { .. } => Rejection {
            index,
            key,
            code: "key_conflict",
            field: None,
            message: err.to_string(),
        },
        BillingError::LateEvent { .. } => Rejection {
            index,
            key,
            code: "late",
            field: Some("end".into()),
            message: err.to_string(),
        },
        other => Rejection {
            index,
            key,
            code: "invalid",
            field: None,
            message: other.to_string(),
        },
    }
}

/// Appends the VALUES tuples of a multi-row statement: `rows` tuples of
/// `cols` parameters, `?` when `positional` (the native SQLite driver), else
/// numbered `$1, $2, …` (the `Any` driver, PostgreSQL).
fn push_values(sql: &mut String, rows: usize, cols: usize, positional: bool) {
    for r in 0..rows {
        if r > 0 {
            sql.push(',');
        }
        sql.push('(');
        for c in 0..cols {
            if c > 0 {
                sql.push(',');
            }
            if positional {
                sql.push('?');
            } else {
                sql.push('$');
                sql.push_str(&(r * cols + c + 1).to_string());
            }
        }
        sql.push(')');
    }
}

/// How a batch's events are inserted (see [`Store::append_usage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InsertMode {
    /// A plain INSERT: fails with a unique violation if a key is stored.
    Plain,
    /// `ON CONFLICT DO NOTHING RETURNING` the keys inserted.
    Careful,
}

/// A multi-row INSERT of `rows` events in `mode`; `positional`: `?`
/// parameters (the native SQLite driver), else `$N` (the `Any` driver,
/// PostgreSQL).
fn insert_sql(rows: usize, positional: bool, mode: InsertMode) -> String {
    let mut sql = String::with_capacity(128 + rows * COLS * 6);
    sql.push_str("INSERT INTO usage_events (");
    sql.push_str(EVENT_COLUMNS);
    sql.push_str(") VALUES ");
    push_values(&mut sql, rows, COLS, positional);
    if mode == InsertMode::Careful {
        sql.push_str(
            " ON CONFLICT (tenant_id, source, event_id) DO NOTHING \
             RETURNING tenant_id, source, event_id",
        );
    }
    sql
}

fn probe_sql(keys: usize, positional: bool) -> String {
    let mut sql = format!(
        "SELECT {EVENT_COLUMNS} FROM usage_events WHERE (tenant_id, source, event_id) IN (VALUES "
    );
    for i in 0..keys {
        if i > 0 {
            sql.push(',');
        }
        if positional {
            sql.push_str("(?, ?, ?)");
        } else {
            sql.push_str(&format!("(${}, ${}, ${})", i * 3 + 1, i * 3 + 2, i * 3 + 3));
        }
    }
    sql.push(')');
    sql
}

/// One stored row (of the `Any` or the native SQLite driver) back as the
/// event it records.
pub(crate) fn decode<'r, R>(r: &'r R) -> Result<UsageEvent>
where
    R: Row,
    &'static str: sqlx::ColumnIndex<R>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let tenant: String = r.try_get("tenant_id")?;
    let tenant = TenantId::parse(&tenant, "tenant_id")
        .map_err(|e| StoreError::Corrupt(format!("usage tenant: {e}")))?;
    let node: Option<String> = r.try_get("node_id")?;
    let node = node
        .map(|n| NodeId::parse(&n, "node_id"))
        .transpose()
        .map_err(|e| StoreError::Corrupt(format!("usage node: {e}")))?;
    let class: String = r.try_get("billing_class")?;
    let amount: String = r.try_get("amount")?;
    let cs: Option<String> = r.try_get("corrects_source")?;
    let ci: Option<String> = r.try_get("corrects_id")?;
    let corrects = match (cs, ci) {
        (Some(source), Some(id)) => Some(EventKey {
            tenant: tenant.clone(),
            source,
            id,
        }),
        _ => None,
    };
    Ok(UsageEvent {
        key: EventKey {
            tenant,
            source: r.try_get("source")?,
            id: r.try_get("event_id")?,
        },
        subject: Subject {
            kind: parse_subject_kind(&r.try_get::<String, _>("subject_kind")?)?,
            id: r.try_get("subject_id")?,
        },
        meter: json(&r.try_get::<String, _>("meter_detail")?, "usage meter")?,
        billing_class: BillingClass::parse(&class)
            .ok_or_else(|| StoreError::Corrupt(format!("usage billing class `{class}`")))?,
        start: at(r.try_get("start_ms")?),
        end: at(r.try_get("end_ms")?),
        amount: amount
            .parse()
            .map_err(|_| StoreError::Corrupt(format!("usage amount `{amount}`")))?,
        node,
        corrects,
    })
}

/// The group of a rollup row: everything rating looks at except the amount.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct GroupKey {
    meter_detail: String,
    billing_class: String,
    subject_kind: String,
    subject: String,
    start_ms: i64,
    end_ms: i64,
}

impl GroupKey {
    /// The group an event falls in; must match the SQL of `usage_rollup`.
    fn of(e: &UsageEvent, per_subject: bool) -> Self {
        let meter = meter_str(&e.meter);
        let keep_subject = per_subject
            && meter == "gpu_seconds"
            && e.billing_class == BillingClass::OnDemand
            && e.subject.kind != SubjectKind::Endpoint;
        Self {
            meter_detail: to_json(&e.meter),
            billing_class: e.billing_class.as_str().to_string(),
            subject_kind: subject_kind_str(e.subject.kind).to_string(),
            subject: if keep_subject {
                e.subject.id.clone()
            } else {
                String::new()
            },
            start_ms: if is_count_meter(meter) {
                ms(e.end)
            } else {
                ms(e.start)
            },
            end_ms: ms(e.end),
        }
    }
}

/// Largest whole amount summed into `usage_rollup`; larger ones (and
/// fractional ones) are read one by one. Must match the `2^40` of
/// migration 0005 (its backfill and partial index) and of
/// [`Store::usage_rollup`]'s SQL. It keeps a row's BIGINT total from
/// overflowing short of 2^23 events of the same instant.
const ROLLUP_MAX: i64 = 1 << 40;

/// The key of a `usage_rollup` row: tenant, meter detail, billing class,
/// subject kind, subject (always `''`: rows sum over subjects), `s`
/// (start, or end for count meters) and end.
type RollKey<'a> = (
    &'a str,
    &'a str,
    &'static str,
    &'static str,
    &'a str,
    i64,
    i64,
);

const ROLLUP_COLS: usize = 9;

/// The key of a `usage_node_rollup` row (migration 0009): node, meter
/// detail, billing class, subject kind, start and end.
type NodeRollKey<'a> = (&'a str, &'a str, &'static str, &'static str, i64, i64);

const NODE_ROLLUP_COLS: usize = 8;

/// The sums one batch adds: per tenant (`usage_rollup`, what invoices
/// read) and per node (`usage_node_rollup`, what payouts read), and the
/// tenants it recorded new events for (`usage_marks`).
#[derive(Default)]
struct BatchSums<'a> {
    tenant: HashMap<RollKey<'a>, (i64, i64)>,
    node: HashMap<NodeRollKey<'a>, (i64, i64)>,
    marked: BTreeSet<&'a str>,
}

/// Adds a newly inserted event to the batch's rollup sums, if its amount is
/// summed there: to its tenant's, and, for GPU time on a node, to the
/// node's.
fn add_to_rollup<'a>(sums: &mut BatchSums<'a>, f: &'a Flat<'a>) -> Result<()> {
    sums.marked.insert(f.e.key.tenant.as_str());
    let Some(amount) = f.amount_int.filter(|a| *a <= ROLLUP_MAX) else {
        return Ok(());
    };
    let e = f.e;
    if let (Some(node), "gpu_seconds") = (&e.node, f.meter) {
        let key: NodeRollKey<'a> = (
            node.as_str(),
            &*f.meter_detail,
            e.billing_class.as_str(),
            f.subject_kind,
            ms(e.start),
            ms(e.end),
        );
        let slot = sums.node.entry(key).or_insert((0, 0));
        slot.0 += amount;
        slot.1 += 1;
    }
    let roll = &mut sums.tenant;
    let key: RollKey<'a> = (
        e.key.tenant.as_str(),
        &*f.meter_detail,
        e.billing_class.as_str(),
        f.subject_kind,
        // Summed over subjects (see the migration).
        "",
        if is_count_meter(f.meter) {
            ms(e.end)
        } else {
            ms(e.start)
        },
        ms(e.end),
    );
    let slot = roll.entry(key).or_insert((0, 0));
    // At most MAX_BATCH × 2^40 per batch: no i64 overflow.
    slot.0 += amount;
    slot.1 += 1;
    Ok(())
}

fn upsert_sql(rows: usize, positional: bool) -> String {
    let mut sql = String::from(
        "INSERT INTO usage_rollup (tenant_id, meter_detail, billing_class, subject_kind, subj, \
         s, end_ms, total, n) VALUES ",
    );
    push_values(&mut sql, rows, ROLLUP_COLS, positional);
    sql.push_str(
        " ON CONFLICT (tenant_id, meter_detail, billing_class, subject_kind, subj, s, end_ms) \
         DO UPDATE SET total = usage_rollup.total + excluded.total, \
         n = usage_rollup.n + excluded.n",
    );
    sql
}

/// Binds rollup rows to a query of either driver.
macro_rules! bind_rollup {
    ($q:expr, $rows:expr) => {{
        let mut q = $q;
        for ((t, m, c, k, subj, s, end), (total, n)) in $rows {
            q = q
                .bind(*t)
                .bind(*m)
                .bind(*c)
                .bind(*k)
                .bind(*subj)
                .bind(*s)
                .bind(*end)
                .bind(*total)
                .bind(*n);
        }
        q
    }};
}

fn node_upsert_sql(rows: usize, positional: bool) -> String {
    let mut sql = String::from(
        "INSERT INTO usage_node_rollup (node_id, meter_detail, billing_class, subject_kind, \
         start_ms, end_ms, total, n) VALUES ",
    );
    push_values(&mut sql, rows, NODE_ROLLUP_COLS, positional);
    sql.push_str(
        " ON CONFLICT (node_id, meter_detail, billing_class, subject_kind, start_ms, end_ms) \
         DO UPDATE SET total = usage_node_rollup.total + excluded.total, \
         n = usage_node_rollup.n + excluded.n",
    );
    sql
}

/// Binds node rollup rows to a query of either driver.
macro_rules! bind_node_rollup {
    ($q:expr, $rows:expr) => {{
        let mut q = $q;
        for ((node, m, c, k, s, end), (total, n)) in $rows {
            q = q
                .bind(*node)
                .bind(*m)
                .bind(*c)
                .bind(*k)
                .bind(*s)
                .bind(*end)
                .bind(*total)
                .bind(*n);
        }
        q
    }};
}

/// Runs `$body` on the ledger transaction of either driver, with `$conn`
/// bound to it and `$positional` true on the native SQLite one (`?`
/// placeholders). The two transactions are different types, so the body
/// is written once and compiled for each.
macro_rules! on_ledger {
    ($tx:expr, |$conn:ident, $positional:ident| $body:block) => {
        match $tx {
            LedgerTx::Any($conn) => {
                let $positional = false;
                $body
            }
            LedgerTx::Sqlite($conn) => {
                let $positional = true;
                $body
            }
        }
    };
}

/// Adds the batch's sums to `usage_rollup` and `usage_node_rollup`: one
/// multi-row upsert each (more only past `chunk` rows; none for a table
/// with nothing to add), in key order so that concurrent batches lock
/// rows in the same order.
async fn upsert_rollup(tx: &mut LedgerTx, sums: &BatchSums<'_>, chunk: usize) -> Result<()> {
    // One bump per tenant with new events (sorted: same lock order).
    let marked: Vec<&str> = sums.marked.iter().copied().collect();
    for part in marked.chunks(chunk.max(1)) {
        let mut sql = String::from("INSERT INTO usage_marks (tenant_id, appended) VALUES ");
        for i in 0..part.len() {
            if i > 0 {
                sql.push(',');
            }
            match tx {
                LedgerTx::Any(_) => sql.push_str(&format!("(${}, 1)", i + 1)),
                LedgerTx::Sqlite(_) => sql.push_str("(?, 1)"),
            }
        }
        sql.push_str(" ON CONFLICT (tenant_id) DO UPDATE SET appended = usage_marks.appended + 1");
        on_ledger!(tx, |conn, _positional| {
            let mut q = sqlx::query(&sql);
            for t in part {
                q = q.bind(*t);
            }
            q.execute(&mut **conn).await?;
        });
    }
    let mut nodes: Vec<_> = sums.node.iter().collect();
    nodes.sort_unstable_by(|a, b| a.0.cmp(b.0));
    for part in nodes.chunks(chunk.max(1)) {
        on_ledger!(tx, |conn, positional| {
            let sql = node_upsert_sql(part.len(), positional);
            bind_node_rollup!(sqlx::query(&sql), part)
                .execute(&mut **conn)
                .await?;
        });
    }
    let mut rows: Vec<_> = sums.tenant.iter().collect();
    rows.sort_unstable_by(|a, b| a.0.cmp(b.0));
    for part in rows.chunks(chunk.max(1)) {
        on_ledger!(tx, |conn, positional| {
            let sql = upsert_sql(part.len(), positional);
            bind_rollup!(sqlx::query(&sql), part)
                .execute(&mut **conn)
                .await?;
        });
    }
    Ok(())
}

/// The text columns of rollup rows, interned: a rollup read holds many
/// rows (one per interval of a meter: about one per minute of a fleet
/// metered in one-minute slices, 172,800 for the benchmark's 10M-event
/// month) over a handful of distinct meters, classes and kinds (or
/// subjects, or nodes), so each row is kept as four numbers and its
/// interval instead of four strings in an ordered map (allocating and
/// comparing those strings per row took about 1.5 s of that month's
/// 4.4 s on SQLite).
#[derive(Default)]
struct Names {
    ids: HashMap<String, u32>,
    names: Vec<String>,
}

impl Names {
    fn id(&mut self, s: &str) -> u32 {
        if let Some(i) = self.ids.get(s) {
            return *i;
        }
        let i = self.names.len() as u32;
        self.names.push(s.to_string());
        self.ids.insert(s.to_string(), i);
        i
    }

    /// Each id's place in the byte order of the names: spans sorted by
    /// ranks are in the order of their strings.
    fn ranks(&self) -> Vec<u32> {
        let mut order: Vec<u32> = (0..self.names.len() as u32).collect();
        order.sort_unstable_by(|a, b| self.names[*a as usize].cmp(&self.names[*b as usize]));
        let mut rank = vec![0; order.len()];
        for (r, id) in order.into_iter().enumerate() {
            rank[id as usize] = r as u32;
        }
        rank
    }

    fn name(&self, id: u32) -> &str {
        &self.names[id as usize]
    }
}

/// One rollup row as read: its four text columns interned (meter detail,
/// billing class, subject kind and subject; or node, meter detail,
/// billing class and subject kind), its interval and summed amount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    cols: [u32; 4],
    start_ms: i64,
    end_ms: i64,
    total: i128,
}

/// The aggregate that packs a group's rows into one text value,
/// `start,end,total;…` (see [`packed_sql`]).
fn concat_fn(backend: crate::Backend) -> &'static str {
    match backend {
        crate::Backend::Sqlite => "group_concat",
        crate::Backend::Postgres => "string_agg",
    }
}

/// Wraps a rollup query (columns: four text columns, then `s`, `end_ms`,
/// `total`, `n`) so that it returns one row per value of the four text
/// columns, its rows packed into one text value `s,end,total;…` and their
/// `n` summed. The rows are still read, by the database; what this saves
/// is the driver's cost per row returned: sqlx's SQLite driver hands every
/// row from its worker thread through a channel, with a wake-up and an
/// allocation per value (about 2 s of the 10M-event month's 4.4 s on
/// SQLite, its 172,800 rows), and the `Any` driver on PostgreSQL copies
/// every value into its own row. Packing is the one aggregate both
/// databases have that keeps every row; joining rows into stretches in
/// SQL takes window functions, which cost SQLite more (about 4 s over the
/// same rows on the benchmark machine) than the driver did.
fn packed_sql(backend: crate::Backend, cols: [&str; 4], inner: &str) -> String {
    let [a, b, c, d] = cols;
    format!(
        "SELECT {a}, {b}, {c}, {d}, \
         {f}(CAST(s AS TEXT) || ',' || CAST(end_ms AS TEXT) || ',' || CAST(total AS TEXT), ';') \
           AS spans, \
         CAST(SUM(n) AS BIGINT) AS n \
         FROM ({inner}) r GROUP BY {a}, {b}, {c}, {d}",
        f = concat_fn(backend)
    )
}

/// Reads one row of a [`packed_sql`] query into `out`; returns the number
/// of events summed into it. Strings are borrowed from the row and copied
/// only the first time they occur.
fn read_packed<'r, R>(r: &'r R, names: &mut Names, out: &mut Vec<Span>) -> Result<i64>
where
    R: Row,
    usize: sqlx::ColumnIndex<R>,
    &'r str: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let mut cols = [0u32; 4];
    for (i, c) in cols.iter_mut().enumerate() {
        *c = names.id(r.try_get::<&str, _>(i)?);
    }
    let packed: &str = r.try_get(4)?;
    let bad = || StoreError::Corrupt(format!("packed rollup rows `{packed:.80}`"));
    for one in packed.split(';') {
        let mut f = one.split(',').map(|v| v.parse::<i64>().map_err(|_| bad()));
        let (Some(start_ms), Some(end_ms), Some(total), None) =
            (f.next(), f.next(), f.next(), f.next())
        else {
            return Err(bad());
        };
        out.push(Span {
            cols,
            start_ms: start_ms?,
            end_ms: end_ms?,
            total: i128::from(total?),
        });
    }
    Ok(r.try_get(5)?)
}

/// Sorts spans by their columns' strings, then start and end (the order
/// [`merge_adjacent`] walks), summing spans of the same group.
fn sort_spans(mut spans: Vec<Span>, names: &Names) -> Vec<Span> {
    let rank = names.ranks();
    spans.sort_unstable_by_key(|s| (s.cols.map(|c| rank[c as usize]), s.start_ms, s.end_ms));
    let mut out: Vec<Span> = Vec::with_capacity(spans.len());
    for s in spans {
        match out.last_mut() {
            Some(last)
                if last.cols == s.cols
                    && last.start_ms == s.start_ms
                    && last.end_ms == s.end_ms =>
            {
                last.total += s.total;
            }
            _ => out.push(s),
        }
    }
    out
}

/// Joins time-meter spans that follow each other (`[a, b)` then `[b, c)`,
/// same four columns) with the same total into one `[a, c)`: rating cuts
/// every interval by time (price versions, spot points, reserved capacity)
/// and is linear in it, and the on-demand minimum looks only at a
/// subject's time and first start, so the invoice (or payout) is the
/// same, from far fewer events (a fleet metered in one-minute slices
/// becomes one event per steady stretch). Count meters (their details'
/// ids in `counts`) are rated at their end, so they are left alone; a join
/// never covers more than an event may (`MAX_EVENT_DAYS`). Time meters
/// over an empty interval (corrections that restate nothing) hold no
/// usage and are dropped. `spans` must be sorted as [`sort_spans`] sorts
/// them; `meter_col` is the column of the meter detail.
fn merge_adjacent(spans: Vec<Span>, counts: &[u32], meter_col: usize) -> Vec<Span> {
    let max_span = MAX_EVENT_DAYS * 86_400_000;
    let mut out: Vec<Span> = Vec::new();
    for g in spans {
        let is_count = counts.contains(&g.cols[meter_col]);
        if g.start_ms >= g.end_ms && !is_count {
            continue;
        }
        if let Some(last) = out.last_mut() {
            if !is_count
                && last.total == g.total
                && last.end_ms == g.start_ms
                && g.end_ms - last.start_ms <= max_span
                && last.cols == g.cols
            {
                last.end_ms = g.end_ms;
                continue;
            }
        }
        out.push(g);
    }
    out
}

/// The ids of the count meters' details among `names` (those that occur).
fn count_ids(names: &Names) -> Vec<u32> {
    [Meter::Requests, Meter::InputTokens, Meter::OutputTokens]
        .iter()
        .filter_map(|m| names.ids.get(&to_json(m)).copied())
        .collect()
}

/// What a rollup read, for reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rollup {
    /// Events that rate exactly like the tenant's stored events.
    pub events: Vec<UsageEvent>,
    /// Stored events summed into them.
    pub stored_events: u64,
}

impl Rollup {
    /// The summed `events` followed by the events passed through
    /// unsummed (`singles`). Voiding is already applied to both, so a
    /// pass-through correction must not void a rollup row by key: its
    /// `corrects` is dropped, and one that restates nothing (an empty
    /// interval of a time meter) is left out.
    fn with_singles(
        mut events: Vec<UsageEvent>,
        singles: BTreeMap<EventKey, UsageEvent>,
        stored_events: u64,
    ) -> Self {
        events.extend(
            singles
                .into_values()
                .filter(|e| !(e.meter.is_rate() && e.start >= e.end))
                .map(|mut e| {
                    e.corrects = None;
                    e
                }),
        );
        Rollup {
            events,
            stored_events,
        }
    }
}

impl Store {
    /// Appends a batch under flotilla-billing's ledger rules, in ONE
    /// transaction: new events are recorded; an event whose key is already
    /// stored with the same payload is a duplicate (accepted, nothing
    /// changes, checked before the grace window so re-sending after a
    /// crash is always safe); with another payload it is refused
    /// (`key_conflict`); a new event that ended more than `grace` before
    /// `now` is refused (`late`); invalid events and events of unknown
    /// tenants are refused. Within a batch the first occurrence of a key
    /// wins and later ones are judged against it.
    pub async fn append_usage(
        &self,
        batch: &[UsageEvent],
        grace: Duration,
        now: DateTime<Utc>,
    ) -> Result<AppendOutcome> {
        if batch.len() > MAX_BATCH {
            return Err(StoreError::Conflict(format!(
                "a usage batch holds at most {MAX_BATCH} events, got {}",
                batch.len()
            )));
        }
        let mut out = AppendOutcome::default();
        let known = self.known_tenants(batch).await?;
        // First valid occurrence of every key in the batch.
        let mut first: HashMap<&EventKey, usize> = HashMap::with_capacity(batch.len());
        let mut fresh: Vec<Flat<'_>> = Vec::with_capacity(batch.len());
        let mut details = MeterDetails::default();
        // Late events may still be duplicates of stored ones.
        let mut late: Vec<(usize, &UsageEvent, BillingError)> = Vec::new();
        for (i, e) in batch.iter().enumerate() {
            if let Err(err) = validate_event(e) {
                out.rejected.push(rejection(i, e, err));
                continue;
            }
            if !known.contains(e.key.tenant.as_str()) {
                out.rejected.push(Rejection {
                    index: i,
                    key: e.key.to_string(),
                    code: "unknown_tenant",
                    field: Some("key.tenant".into()),
                    message: format!("tenant {} does not exist", e.key.tenant),
                });
                continue;
            }
            if let Some(&j) = first.get(&e.key) {
                match check_append(e, Some(&batch[j]), grace, now) {
                    Ok(_) => out.duplicates += 1,
                    Err(err) => out.rejected.push(rejection(i, e, err)),
                }
                continue;
            }
            first.insert(&e.key, i);
            match check_append(e, None, grace, now) {
                Ok(_) => fresh.push(Flat::new(e, &mut details)),
                Err(err) => late.push((i, e, err)),
            }
        }

        let now_ms = ms(now);
        let base = out;
        // New events are the common case: a plain INSERT of them costs what
        // a bulk load does, where `ON CONFLICT DO NOTHING` costs PostgreSQL
        // a speculative insertion per row (measured in psql on PostgreSQL
        // 15: 300,000 rows took about 1.6x a plain INSERT's time; on SQLite
        // the two cost the same). A key already stored (a re-send after a
        // crash, a concurrent append of the same keys) fails the plain
        // INSERT with a unique violation at its first chunk holding one;
        // the batch is then rolled back and redone `Careful`: `ON CONFLICT
        // DO NOTHING RETURNING` the keys each statement inserted, so that
        // the rollup adds exactly the new events and the others are probed
        // and judged. A re-send thus costs one failed statement more.
        let mut mode = InsertMode::Plain;
        let out = loop {
            match self
                .append_fresh(
                    base.clone(),
                    &fresh,
                    &late,
                    &first,
                    grace,
                    now,
                    now_ms,
                    mode,
                )
                .await?
            {
                Some(out) => break out,
                None if mode == InsertMode::Plain => mode = InsertMode::Careful,
                None => {
                    return Err(StoreError::Conflict(
                        "usage append could not tell new events from stored ones".into(),
                    ))
                }
            }
        };
        Ok(out)
    }

    /// The transactional part of [`Store::append_usage`]: inserts `fresh`,
    /// judges the keys already stored and adds the new events to the
    /// rollup, all in one transaction. `None` (nothing committed, the
    /// transaction rolled back): in [`InsertMode::Plain`], a key was
    /// already stored.
    #[allow(clippy::too_many_arguments)]
    async fn append_fresh(
        &self,
        mut out: AppendOutcome,
        fresh: &[Flat<'_>],
        late: &[(usize, &UsageEvent, BillingError)],
        first: &HashMap<&EventKey, usize>,
        grace: Duration,
        now: DateTime<Utc>,
        now_ms: i64,
        mode: InsertMode,
    ) -> Result<Option<AppendOutcome>> {
        let mut tx = match self.sqlite_pool() {
            Some(native) => {
                // The write lock first, for the reason given at `Store::begin`.
                let mut tx = native.begin().await?;
                sqlx::query(crate::leases::TAKE_WRITE_LOCK)
                    .execute(&mut *tx)
                    .await?;
                self.check_fence_sqlite(&mut tx).await?;
                LedgerTx::Sqlite(tx)
            }
            None => LedgerTx::Any(self.begin().await?),
        };
        let chunk_len = insert_chunk(self.backend());
        let positional = matches!(tx, LedgerTx::Sqlite(_));
        let mut sqls: Vec<(usize, String)> = Vec::with_capacity(4);
        // Keys not inserted by their chunk: stored before, to be compared.
        let mut probe: Vec<(usize, &UsageEvent)> = Vec::new();
        let mut inserted_in_probed = 0u64;
        // The new integer events of the batch, summed by rollup row.
        let mut roll = BatchSums::default();
        let mut rest: &[Flat<'_>] = fresh;
        while !rest.is_empty() {
            let rows = statement_rows(rest.len(), chunk_len);
            let (chunk, tail) = rest.split_at(rows);
            rest = tail;
            let at = match sqls.iter().position(|(n, _)| *n == rows) {
                Some(at) => at,
                None => {
                    sqls.push((rows, insert_sql(rows, positional, mode)));
                    sqls.len() - 1
                }
            };
            let sql = sqls[at].1.as_str();
            if mode == InsertMode::Plain {
                let done = match &mut tx {
                    LedgerTx::Any(tx) => bind_events!(sqlx::query(sql), chunk, now_ms)
                        .execute(&mut **tx)
                        .await
                        .map(|r| r.rows_affected()),
                    LedgerTx::Sqlite(tx) => bind_events!(sqlx::query(sql), chunk, now_ms)
                        .execute(&mut **tx)
                        .await
                        .map(|r| r.rows_affected()),
                };
                match done {
                    Ok(n) if n == chunk.len() as u64 => {}
                    Ok(n) => {
                        return Err(StoreError::Conflict(format!(
                            "a usage INSERT of {} events recorded {n}",
                            chunk.len()
                        )))
                    }
                    Err(e)
                        if e.as_database_error()
                            .is_some_and(|d| d.is_unique_violation()) =>
                    {
                        // A key of the chunk is stored: redo `Careful`.
                        match tx {
                            LedgerTx::Any(tx) => tx.rollback().await?,
                            LedgerTx::Sqlite(tx) => tx.rollback().await?,
                        }
                        return Ok(None);
                    }
                    Err(e) => return Err(e.into()),
                }
                out.accepted += chunk.len() as u64;
                for f in chunk {
                    add_to_rollup(&mut roll, f)?;
                }
                continue;
            }
            // `Careful`: the keys this statement inserted.
            let returned: Vec<(String, String, String)> = match &mut tx {
                LedgerTx::Any(tx) => {
                    let mut keys = Vec::new();
                    for r in bind_events!(sqlx::query(sql), chunk, now_ms)
                        .fetch_all(&mut **tx)
                        .await?
                    {
                        keys.push((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?));
                    }
                    keys
                }
                LedgerTx::Sqlite(tx) => {
                    let mut keys = Vec::new();
                    for r in bind_events!(sqlx::query(sql), chunk, now_ms)
                        .fetch_all(&mut **tx)
                        .await?
                    {
                        keys.push((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?));
                    }
                    keys
                }
            };
            let new_keys: HashSet<(&str, &str, &str)> = returned
                .iter()
                .map(|(t, s, i)| (t.as_str(), s.as_str(), i.as_str()))
                .collect();
            let inserted = new_keys.len() as u64;
            out.accepted += inserted;
            if inserted == chunk.len() as u64 {
                for f in chunk {
                    add_to_rollup(&mut roll, f)?;
                }
            } else {
                for f in chunk {
                    let k = &f.e.key;
                    if new_keys.contains(&(k.tenant.as_str(), k.source.as_str(), k.id.as_str())) {
                        add_to_rollup(&mut roll, f)?;
                    }
                }
                // Some keys were already stored. Every key of the chunk is
                // now stored; those equal to what was sent are new or
                // duplicates (the difference is `inserted`), the others
                // conflict.
                inserted_in_probed += inserted;
                probe.extend(chunk.iter().map(|f| (first[&f.e.key], f.e)));
            }
        }
        upsert_rollup(&mut tx, &roll, chunk_len).await?;
        let mut probed_equal = 0u64;
        let probed_fresh = probe.len() as u64;
        let mut lookups: Vec<(usize, &UsageEvent)> = probe;
        lookups.extend(late.iter().map(|(i, e, _)| (*i, *e)));
        let keys = lookups.iter().map(|(_, e)| &e.key);
        let stored = match &mut tx {
            LedgerTx::Any(tx) => fetch_keys(tx, keys).await?,
            LedgerTx::Sqlite(tx) => fetch_keys_sqlite(tx, keys).await?,
        };
        for (n, (i, e)) in lookups.iter().enumerate() {
            let fresh_one = (n as u64) < probed_fresh;
            match (stored.get(&e.key), fresh_one) {
                (Some(old), true) => match check_append(e, Some(old), grace, now) {
                    Ok(_) => probed_equal += 1,
                    Err(err) => out.rejected.push(rejection(*i, e, err)),
                },
                (Some(old), false) => match check_append(e, Some(old), grace, now) {
                    Ok(Appended::Duplicate) | Ok(Appended::New) => out.duplicates += 1,
                    Err(err) => out.rejected.push(rejection(*i, e, err)),
                },
                (None, true) => {
                    // Cannot happen (no row is ever deleted); refuse rather
                    // than count it, so the totals stay honest.
                    return Err(StoreError::Conflict(format!(
                        "usage event {} vanished during its append",
                        e.key
                    )));
                }
                (None, false) => {
                    let err = late
                        .iter()
                        .find(|(j, _, _)| j == i)
                        .map(|(_, _, err)| err.clone())
                        .unwrap_or_else(|| BillingError::invalid("end", "late"));
                    out.rejected.push(rejection(*i, e, err));
                }
            }
        }
        // Equal rows among probed chunks are those chunks' inserts plus
        // their duplicates.
        out.duplicates += probed_equal.saturating_sub(inserted_in_probed);
        match tx {
            LedgerTx::Any(tx) => crate::txn::commit(tx).await?,
            LedgerTx::Sqlite(tx) => tx.commit().await?,
        }
        out.rejected.sort_by_key(|r| r.index);
        Ok(Some(out))
    }

    /// The ids among the batch's tenants that exist.
    async fn known_tenants(&self, batch: &[UsageEvent]) -> Result<HashSet<String>> {
        let wanted: HashSet<&str> = batch.iter().map(|e| e.key.tenant.as_str()).collect();
        let mut known = HashSet::with_capacity(wanted.len());
        let wanted: Vec<&str> = wanted.into_iter().collect();
        for chunk in wanted.chunks(PROBE_CHUNK) {
            let marks: Vec<String> = (1..=chunk.len()).map(|i| format!("${i}")).collect();
            let sql = format!("SELECT id FROM tenants WHERE id IN ({})", marks.join(","));
            let mut q = sqlx::query(&sql);
            for t in chunk {
                q = q.bind(*t);
            }
            for r in q.fetch_all(self.pool()).await? {
                known.insert(r.try_get::<String, _>("id")?);
            }
        }
        Ok(known)
    }

    /// The GPU usage that providers' nodes carried in the period, summed
    /// into events that give the same payout statements as every tenant's
    /// stored events on those nodes would (`payout_statement`), whatever
    /// the number of events: read from `usage_node_rollup` (migration
    /// 0009), which `append_usage` keeps, plus the few events it does not
    /// sum (fractional or huge amounts), read one by one.
    ///
    /// Why this is exact: a payout prices an event's GPU time at list
    /// price by model, share, billing class, subject kind and interval,
    /// linearly in its amount; tenant, subject and source change nothing.
    /// Corrections are applied as `effective_events` applies them to a
    /// tenant's events: every event of the window named by a correction of
    /// the window (any tenant's, with or without a node) is taken out of
    /// its group. The correction itself counts where it ran, like any
    /// event. Summed events have synthetic keys (the nil tenant, source
    /// `node-rollup`) and no corrections.
    pub async fn usage_on_nodes(&self, period: Period) -> Result<Rollup> {
        const PROVIDER_NODES: &str =
            "node_id IN (SELECT id FROM nodes WHERE provider_id IS NOT NULL)";
        let sql = packed_sql(
            self.backend(),
            ["node_id", "meter_detail", "billing_class", "subject_kind"],
            &format!(
                "SELECT node_id, meter_detail, billing_class, subject_kind, start_ms AS s, \
                 end_ms, total, n FROM usage_node_rollup \
                 WHERE {PROVIDER_NODES} AND start_ms < $1 AND end_ms >= $2"
            ),
        );
        let mut names = Names::default();
        let mut spans: Vec<Span> = Vec::new();
        let mut stored_events: u64 = 0;
        // On SQLite through its native driver, as for `usage_rollup`.
        match self.sqlite_pool() {
            Some(native) => {
                for r in &sqlx::query(&sql)
                    .bind(ms(period.end))
                    .bind(ms(period.start))
                    .fetch_all(native)
                    .await?
                {
                    stored_events += read_packed(r, &mut names, &mut spans)?.max(0) as u64;
                }
            }
            None => {
                for r in &sqlx::query(&sql)
                    .bind(ms(period.end))
                    .bind(ms(period.start))
                    .fetch_all(self.pool())
                    .await?
                {
                    stored_events += read_packed(r, &mut names, &mut spans)?.max(0) as u64;
                }
            }
        }
        let window = "start_ms < $1 AND end_ms >= $2";
        // Written like the partial index `usage_events_node_unrolled`'s
        // condition, so that it is used.
        let unrolled = sqlx::query(&format!(
            "SELECT {EVENT_COLUMNS} FROM usage_events WHERE {window} AND node_id IS NOT NULL \
             AND meter = 'gpu_seconds' AND (amount_int IS NULL OR amount_int > 1099511627776) \
             AND {PROVIDER_NODES}"
        ))
        .bind(ms(period.end))
        .bind(ms(period.start))
        .fetch_all(self.pool())
        .await?;
        let mut singles: BTreeMap<EventKey, UsageEvent> = BTreeMap::new();
        for r in &unrolled {
            let e = decode(r)?;
            stored_events += 1;
            singles.insert(e.key.clone(), e);
        }
        let voids = sqlx::query(&format!(
            "SELECT DISTINCT tenant_id, corrects_source, corrects_id FROM usage_events \
             WHERE {window} AND corrects_id IS NOT NULL"
        ))
        .bind(ms(period.end))
        .bind(ms(period.start))
        .fetch_all(self.pool())
        .await?;
        let mut minus: HashMap<([u32; 4], i64, i64), i128> = HashMap::new();
        if !voids.is_empty() {
            let voided: Vec<EventKey> = voids
                .iter()
                .map(|r| {
                    let t: String = r.try_get("tenant_id")?;
                    Ok(EventKey {
                        tenant: TenantId::from_trusted(t),
                        source: r.try_get("corrects_source")?,
                        id: r.try_get("corrects_id")?,
                    })
                })
                .collect::<Result<_>>()?;
            let mut conn = self.pool().acquire().await?;
            for (k, e) in fetch_keys(&mut conn, voided.iter()).await? {
                if !(e.start < period.end && e.end >= period.start) {
                    continue;
                }
                if singles.remove(&k).is_some() {
                    continue;
                }
                let (Some(node), Some(amount)) = (&e.node, e.amount.to_i64()) else {
                    continue;
                };
                let detail = to_json(&e.meter);
                let cols = [
                    node.as_str(),
                    detail.as_str(),
                    e.billing_class.as_str(),
                    subject_kind_str(e.subject.kind),
                ]
                .map(|c| names.ids.get(c).copied());
                // Absent: not a provider's node, or not GPU time.
                if let [Some(a), Some(b), Some(c), Some(d)] = cols {
                    *minus
                        .entry(([a, b, c, d], ms(e.start), ms(e.end)))
                        .or_insert(0) += i128::from(amount);
                }
            }
        }
        let mut spans = sort_spans(spans, &names);
        if !minus.is_empty() {
            for s in &mut spans {
                if let Some(m) = minus.get(&(s.cols, s.start_ms, s.end_ms)) {
                    s.total -= m;
                }
            }
        }
        // Every span here is GPU time (no count meters): empty intervals
        // (corrections that restate nothing) are dropped and steady
        // stretches joined, exact for the payout as for an invoice.
        let spans = merge_adjacent(spans, &[], 1);
        let nil = TenantId::generate(0, 0);
        let mut events = Vec::with_capacity(spans.len() + singles.len());
        let mut meters: HashMap<u32, Meter> = HashMap::new();
        let mut n = 0u64;
        for g in spans {
            let [node, detail, class, kind] = g.cols;
            let meter = match meters.get(&detail) {
                Some(m) => m.clone(),
                None => {
                    let m: Meter = json(names.name(detail), "usage meter")?;
                    meters.insert(detail, m.clone());
                    m
                }
            };
            let class = BillingClass::parse(names.name(class)).ok_or_else(|| {
                StoreError::Corrupt(format!("usage billing class `{}`", names.name(class)))
            })?;
            let kind = parse_subject_kind(names.name(kind))?;
            let node = NodeId::from_trusted(names.name(node).to_string());
            let mut left = g.total;
            while left > 0 {
                let part = left.min(i128::from(MAX_UNITS));
                left -= part;
                n += 1;
                events.push(UsageEvent {
                    key: EventKey {
                        tenant: nil.clone(),
                        source: "node-rollup".into(),
                        id: format!("{n:012}"),
                    },
                    subject: Subject {
                        kind,
                        id: "rollup".into(),
                    },
                    meter: meter.clone(),
                    billing_class: class,
                    start: at(g.start_ms),
                    end: at(g.end_ms),
                    amount: Decimal::from(part as i64),
                    node: Some(node.clone()),
                    corrects: None,
                });
            }
        }
        Ok(Rollup::with_singles(events, singles, stored_events))
    }

    /// Every tenant's usage mark: a counter bumped by each append that
    /// recorded new events for it. A mark that moved means new usage.
    pub async fn usage_marks(&self) -> Result<HashMap<TenantId, i64>> {
        let rows = sqlx::query("SELECT tenant_id, appended FROM usage_marks")
            .fetch_all(self.pool())
            .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    TenantId::from_trusted(r.try_get("tenant_id")?),
                    r.try_get("appended")?,
                ))
            })
            .collect()
    }

    /// Every stored event of `tenant` whose usage touches the period
    /// (`start < period.end` and `end >= period.start`, the reference
    /// ledger's rule), sorted by key: the input of `build_invoice`.
    pub async fn usage_for(&self, tenant: &TenantId, period: Period) -> Result<Vec<UsageEvent>> {
        let rows = sqlx::query(&format!(
            "SELECT {EVENT_COLUMNS} FROM usage_events WHERE tenant_id = $1 AND start_ms < $2 \
             AND end_ms >= $3 ORDER BY source, event_id"
        ))
        .bind(tenant.as_str())
        .bind(ms(period.end))
        .bind(ms(period.start))
        .fetch_all(self.pool())
        .await?;
        let mut out = rows.iter().map(decode).collect::<Result<Vec<_>>>()?;
        // The database's collation may not be byte order; the key's is.
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// `tenant`'s events from `source` whose key starts with `prefix` (one
    /// instance's lifecycle usage: `inst_…/`) and that end after `after`,
    /// sorted by key: what metering billed past an end it learned of late,
    /// which it corrects from what the ledger holds rather than from what
    /// it would have written (that depends on when its passes ran).
    pub async fn usage_keyed_after(
        &self,
        tenant: &TenantId,
        source: &str,
        prefix: &str,
        after: DateTime<Utc>,
    ) -> Result<Vec<UsageEvent>> {
        // `LIKE` narrows (its `_` matches any character, and SQLite's is
        // case-insensitive); the exact prefix is checked below.
        let rows = sqlx::query(&format!(
            "SELECT {EVENT_COLUMNS} FROM usage_events WHERE tenant_id = $1 AND end_ms > $2 \
             AND source = $3 AND event_id LIKE $4"
        ))
        .bind(tenant.as_str())
        .bind(ms(after))
        .bind(source)
        .bind(format!("{prefix}%"))
        .fetch_all(self.pool())
        .await?;
        let mut out = rows
            .iter()
            .map(decode)
            .filter(|e| e.as_ref().map_or(true, |e| e.key.id.starts_with(prefix)))
            .collect::<Result<Vec<_>>>()?;
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// A page of `tenant`'s events touching `[from, to)`, in order of
    /// `(end, source, id)`; `after` is the last `(end, source, id)` of the
    /// previous page. Returns the page and whether more follow.
    pub async fn list_usage(
        &self,
        tenant: &TenantId,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        after: Option<(DateTime<Utc>, String, String)>,
        limit: u32,
    ) -> Result<(Vec<UsageEvent>, bool)> {
        let limit = limit.clamp(1, 1000);
        let (a_end, a_source, a_id) = match &after {
            Some((t, s, i)) => (ms(*t), s.as_str(), i.as_str()),
            None => (i64::MIN, "", ""),
        };
        let rows = sqlx::query(&format!(
            "SELECT {EVENT_COLUMNS} FROM usage_events WHERE tenant_id = $1 AND start_ms < $2 \
             AND end_ms >= $3 AND (end_ms > $4 OR (end_ms = $4 AND (source > $5 OR \
             (source = $5 AND event_id > $6)))) ORDER BY end_ms, source, event_id LIMIT $7"
        ))
        .bind(tenant.as_str())
        .bind(ms(to))
        .bind(ms(from))
        .bind(a_end)
        .bind(a_source)
        .bind(a_id)
        .bind(i64::from(limit) + 1)
        .fetch_all(self.pool())
        .await?;
        let mut items = rows.iter().map(decode).collect::<Result<Vec<_>>>()?;
        let more = items.len() > limit as usize;
        items.truncate(limit as usize);
        Ok((items, more))
    }

    /// Number of stored events and their GPU time in unit-milliseconds
    /// (share units × ms, see `SHARE_UNITS_PER_GPU`), over every tenant:
    /// what exactly-once checks compare with what was sent.
    pub async fn usage_totals(&self) -> Result<(i64, i128)> {
        let n: i64 = sqlx::query("SELECT COUNT(*) AS n FROM usage_events")
            .fetch_one(self.pool())
            .await?
            .try_get("n")?;
        // Summed per row in Rust: the product overflows no i128, and a
        // SQL SUM of it could overflow BIGINT.
        let rows = sqlx::query(
            "SELECT share_units, amount_int, start_ms, end_ms FROM usage_events \
             WHERE meter = 'gpu_seconds'",
        )
        .fetch_all(self.pool())
        .await?;
        let mut unit_ms: i128 = 0;
        for r in rows {
            let units: i64 = r.try_get("share_units")?;
            let amount: Option<i64> = r.try_get("amount_int")?;
            let (s, e): (i64, i64) = (r.try_get("start_ms")?, r.try_get("end_ms")?);
            unit_ms += i128::from(units) * i128::from(amount.unwrap_or(0)) * i128::from(e - s);
        }
        Ok((n, unit_ms))
    }

    /// The tenant's usage touching the period, summed into events that
    /// rate to the same invoice as [`Store::usage_for`]'s. Without
    /// `per_subject` they are read from the `usage_rollup` table that
    /// `append_usage` keeps (a few rows per interval, whatever the number
    /// of events); with it, summed from the events in SQL (one aggregate
    /// scan: per-subject rows would be about one per event). Either way the
    /// database returns one row per meter, class, subject kind and subject,
    /// its intervals packed into one value (`packed_sql`), and intervals
    /// that follow each other at the same total are joined
    /// (`merge_adjacent`).
    ///
    /// Why this is exact for `build_invoice`: every quantity it computes is
    /// linear in an event's amount and depends otherwise only on the
    /// meter, billing class, subject kind, `[start, end)` (price versions,
    /// spot points and reserved capacity are cut by time) and, for the
    /// on-demand minimum, the subject. So events equal in all of those are
    /// summed into one (split again where an amount would pass the
    /// billing crate's per-event limits); count meters only look at `end`,
    /// so their `start` is not grouped on. Subjects are kept only when
    /// `per_subject` (the price book has an on-demand minimum). Events
    /// with fractional amounts, or whole amounts over 2^40 (kept out of
    /// the rollup so that its BIGINT sums cannot overflow), are passed
    /// through as they are (SQLite would sum text as floating point). Corrections are applied the way
    /// `effective_events` does: every event of the window named by a
    /// correction of the window is subtracted from its group.
    pub async fn usage_rollup(
        &self,
        tenant: &TenantId,
        period: Period,
        per_subject: bool,
    ) -> Result<Rollup> {
        // `s < end AND end_ms >= start` is the events' window: for time
        // meters `s` is the start; count meters are rated by their end
        // alone, and one ending after the period rates nothing.
        let sql = if per_subject {
            // The on-demand minimum needs each subject's time: summed
            // from the events (one aggregate scan), since per-subject rows
            // at ingestion would be about one per event.
            "SELECT meter_detail, billing_class, subject_kind, \
               CASE WHEN meter = 'gpu_seconds' AND billing_class = 'on_demand' \
                    AND subject_kind <> 'endpoint' THEN subject_id ELSE '' END AS subj, \
               CASE WHEN meter IN ('requests', 'input_tokens', 'output_tokens') \
                    THEN end_ms ELSE start_ms END AS s, \
               end_ms, CAST(SUM(amount_int) AS BIGINT) AS total, COUNT(*) AS n \
             FROM usage_events \
             WHERE tenant_id = $1 AND start_ms < $2 AND end_ms >= $3 \
               AND amount_int IS NOT NULL AND amount_int <= 1099511627776 \
             GROUP BY meter_detail, billing_class, subject_kind, subj, s, end_ms"
        } else {
            "SELECT meter_detail, billing_class, subject_kind, subj, s, end_ms, total, n \
             FROM usage_rollup WHERE tenant_id = $1 AND s < $2 AND end_ms >= $3"
        };
        let sql = packed_sql(
            self.backend(),
            ["meter_detail", "billing_class", "subject_kind", "subj"],
            sql,
        );
        let mut names = Names::default();
        let mut spans: Vec<Span> = Vec::new();
        let mut stored_events: u64 = 0;
        // On SQLite through its native driver: the `Any` driver copies
        // every value once more.
        match self.sqlite_pool() {
            Some(native) => {
                for r in &sqlx::query(&sql)
                    .bind(tenant.as_str())
                    .bind(ms(period.end))
                    .bind(ms(period.start))
                    .fetch_all(native)
                    .await?
                {
                    stored_events += read_packed(r, &mut names, &mut spans)?.max(0) as u64;
                }
            }
            None => {
                for r in &sqlx::query(&sql)
                    .bind(tenant.as_str())
                    .bind(ms(period.end))
                    .bind(ms(period.start))
                    .fetch_all(self.pool())
                    .await?
                {
                    stored_events += read_packed(r, &mut names, &mut spans)?.max(0) as u64;
                }
            }
        }
        let window =
            |sql: &str| format!("{sql} WHERE tenant_id = $1 AND start_ms < $2 AND end_ms >= $3");
        let fractional = sqlx::query(
            &(window(&format!("SELECT {EVENT_COLUMNS} FROM usage_events"))
                // The condition of the partial index `usage_events_unrolled`
                // (migration 0005), written alike so that it is used.
                + " AND (amount_int IS NULL OR amount_int > 1099511627776)"),
        )
        .bind(tenant.as_str())
        .bind(ms(period.end))
        .bind(ms(period.start))
        .fetch_all(self.pool())
        .await?;
        let mut singles: BTreeMap<EventKey, UsageEvent> = BTreeMap::new();
        for r in &fractional {
            let e = decode(r)?;
            stored_events += 1;
            singles.insert(e.key.clone(), e);
        }
        let voids = sqlx::query(
            &(window("SELECT DISTINCT corrects_source, corrects_id FROM usage_events")
                + " AND corrects_id IS NOT NULL"),
        )
        .bind(tenant.as_str())
        .bind(ms(period.end))
        .bind(ms(period.start))
        .fetch_all(self.pool())
        .await?;
        let voided: Vec<EventKey> = voids
            .iter()
            .map(|r| {
                Ok(EventKey {
                    tenant: tenant.clone(),
                    source: r.try_get("corrects_source")?,
                    id: r.try_get("corrects_id")?,
                })
            })
            .collect::<Result<_>>()?;
        // What the corrections take out of each group, by group (the
        // group's strings interned; a group whose strings were never read
        // holds nothing to take from).
        let mut minus: HashMap<([u32; 4], i64, i64), i128> = HashMap::new();
        if !voided.is_empty() {
            let mut conn = self.pool().acquire().await?;
            let targets = fetch_keys(&mut conn, voided.iter()).await?;
            for (k, e) in targets {
                if !(e.start < period.end && e.end >= period.start) {
                    continue;
                }
                if singles.remove(&k).is_some() {
                    continue;
                }
                let g = GroupKey::of(&e, per_subject);
                let cols = [
                    &g.meter_detail,
                    &g.billing_class,
                    &g.subject_kind,
                    &g.subject,
                ]
                .map(|c| names.ids.get(c.as_str()).copied());
                if let ([Some(a), Some(b), Some(c), Some(d)], Some(amount)) =
                    (cols, e.amount.to_i64())
                {
                    *minus
                        .entry(([a, b, c, d], g.start_ms, g.end_ms))
                        .or_insert(0) += i128::from(amount);
                }
            }
        }
        let mut spans = sort_spans(spans, &names);
        if !minus.is_empty() {
            for s in &mut spans {
                if let Some(m) = minus.get(&(s.cols, s.start_ms, s.end_ms)) {
                    s.total -= m;
                }
            }
        }
        let spans = merge_adjacent(spans, &count_ids(&names), 0);
        let mut events = Vec::with_capacity(spans.len() + singles.len());
        let mut n = 0u64;
        // A handful of distinct meters over many rows: parsed once each.
        let mut meters: HashMap<u32, Meter> = HashMap::new();
        for g in spans {
            let [detail, class, kind, subject] = g.cols;
            let meter = match meters.get(&detail) {
                Some(m) => m.clone(),
                None => {
                    let m: Meter = json(names.name(detail), "usage meter")?;
                    meters.insert(detail, m.clone());
                    m
                }
            };
            let limit = match meter {
                Meter::GpuSeconds { .. } | Meter::InstanceSeconds => i128::from(MAX_UNITS),
                _ => i128::from(MAX_COUNT),
            };
            let class = BillingClass::parse(names.name(class)).ok_or_else(|| {
                StoreError::Corrupt(format!("usage billing class `{}`", names.name(class)))
            })?;
            let kind = parse_subject_kind(names.name(kind))?;
            let subject = names.name(subject);
            let mut left = g.total;
            while left > 0 {
                let part = left.min(limit);
                left -= part;
                n += 1;
                events.push(UsageEvent {
                    key: EventKey {
                        tenant: tenant.clone(),
                        source: "rollup".into(),
                        id: format!("{n:012}"),
                    },
                    subject: Subject {
                        kind,
                        id: if subject.is_empty() {
                            "rollup".into()
                        } else {
                            subject.to_string()
                        },
                    },
                    meter: meter.clone(),
                    billing_class: class,
                    start: at(g.start_ms),
                    end: at(g.end_ms),
                    amount: Decimal::from(part as i64),
                    node: None,
                    corrects: None,
                });
            }
        }
        Ok(Rollup::with_singles(events, singles, stored_events))
    }
}

/// Defines a probe of stored events by key for one connection type: the
/// `Any` connection and the native SQLite one differ only in their type and
/// placeholder style, so one body serves both.
macro_rules! fetch_keys_on {
    ($(#[$doc:meta])* $name:ident, $conn:ty, $positional:expr) => {
        $(#[$doc])*
        async fn $name<'k>(
            conn: &mut $conn,
            keys: impl Iterator<Item = &'k EventKey>,
        ) -> Result<HashMap<EventKey, UsageEvent>> {
            let keys: Vec<&EventKey> = keys.collect();
            let mut out = HashMap::with_capacity(keys.len());
            for chunk in keys.chunks(PROBE_CHUNK) {
                let sql = probe_sql(chunk.len(), $positional);
                let mut q = sqlx::query(&sql);
                for k in chunk {
                    q = q
                        .bind(k.tenant.as_str())
                        .bind(k.source.as_str())
                        .bind(k.id.as_str());
                }
                for r in q.fetch_all(&mut *conn).await? {
                    let e = decode(&r)?;
                    out.insert(e.key.clone(), e);
                }
            }
            Ok(out)
        }
    };
}

fetch_keys_on!(
    /// Stored events with the given keys, by key.
    fetch_keys,
    sqlx::AnyConnection,
    false
);
fetch_keys_on!(
    /// [`fetch_keys`] on the native SQLite driver (inside its transaction).
    fetch_keys_sqlite,
    sqlx::SqliteConnection,
    true
);
