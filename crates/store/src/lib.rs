//! Flotilla's persistence: one schema and one set of queries that run on
//! SQLite (the embedded default: a file, WAL, foreign keys on) and on
//! PostgreSQL (selected by a `postgres://` URL), through sqlx's `Any`
//! driver. A repository module per aggregate.
//!
//! Every function takes `now` from the caller: the store never reads the
//! clock, so what it records is what the decision code decided. Database
//! errors are mapped to [`StoreError`] here, never leaked as SQL codes.

use std::str::FromStr;

use chrono::{DateTime, Utc};
use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{AnyPool, Executor, SqlitePool};

pub mod audit;
pub mod budgets;
pub mod capacity;
pub mod endpoints;
pub mod fleet;
pub mod history;
pub mod idempotency;
pub mod instances;
pub mod invoices;
pub mod jobs;
pub mod keys;
pub mod leases;
pub mod logs;
pub mod nodes;
pub mod pass;
pub mod prices;
pub mod providers;
pub mod reconcile;
pub mod registry_credentials;
pub mod secrets;
pub mod ssh_keys;
pub mod tenants;
mod txn;
pub mod usage;
pub mod vertical;
pub mod waiting;
pub mod weights;
mod work;

pub(crate) use work::WorkTable;

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The row does not exist (or is not visible to the caller).
    #[error("{0} not found")]
    NotFound(&'static str),
    /// A unique value is taken.
    #[error("{0} already exists")]
    AlreadyExists(String),
    /// The row is not in a state that allows the change.
    #[error("{0}")]
    Conflict(String),
    /// A quota would be exceeded.
    #[error(transparent)]
    Quota(#[from] flotilla_core::QuotaExceeded),
    /// The database URL is not usable.
    #[error("invalid database url: {0}")]
    BadUrl(String),
    /// Stored data does not decode (a bug or a manual edit).
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// The database cannot be reached now; a retry may succeed.
    #[error("database unavailable: {0}")]
    Unavailable(#[source] sqlx::Error),
    /// A row lock could not be had within `lock_timeout`, or a statement
    /// ran past `statement_timeout` (PostgreSQL 55P03, 57014): most often
    /// a lock held by a stalled process (see [`leases::Timeouts`]). Given
    /// up instead of queued; a retry shortly may succeed.
    #[error("database busy: {0}")]
    Busy(#[source] sqlx::Error),
    /// The database failed.
    #[error("database error: {0}")]
    Database(#[source] sqlx::Error),
    /// A fenced write (see [`Store::fenced`]) under a token the lease no
    /// longer carries: the caller lost the lease and must stop writing.
    #[error("lease `{lease}` is no longer held under token {token} (now {current:?})")]
    Fenced {
        /// The lease.
        lease: String,
        /// The caller's token.
        token: i64,
        /// The lease's token now (`None`: never granted).
        current: Option<i64>,
    },
    /// A sealed secret could not be opened, or the key could not be had.
    #[error(transparent)]
    Secret(#[from] secrets::SecretError),
    /// Migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        if let sqlx::Error::Database(db) = &e {
            if db.kind() == sqlx::error::ErrorKind::UniqueViolation {
                return StoreError::AlreadyExists(db.message().to_string());
            }
            // lock_not_available, query_canceled: a lock or statement
            // timeout of ours (see `leases::Timeouts`).
            if matches!(db.code().as_deref(), Some("55P03" | "57014")) {
                return StoreError::Busy(e);
            }
            // SQLITE_BUSY, SQLITE_LOCKED and their extended codes: the
            // file's lock stayed taken past the busy timeout.
            if sqlite_busy(db.code().as_deref()) {
                return StoreError::Busy(e);
            }
        }
        if matches!(
            e,
            sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_)
        ) {
            return StoreError::Unavailable(e);
        }
        if matches!(e, sqlx::Error::RowNotFound) {
            return StoreError::NotFound("row");
        }
        StoreError::Database(e)
    }
}

/// Whether `code`, a SQLite result code as sqlx reports it (the extended
/// code, in decimal), is `SQLITE_BUSY` (5) or `SQLITE_LOCKED` (6) or one
/// of their extended forms (the primary code is the low byte).
fn sqlite_busy(code: Option<&str>) -> bool {
    code.and_then(|c| c.parse::<i32>().ok())
        .is_some_and(|c| matches!(c & 0xff, 5 | 6))
}

impl StoreError {
    /// Whether trying again shortly may succeed: the database could not
    /// be reached, or a lock stayed taken past its timeout.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Unavailable(_) | StoreError::Busy(_))
    }
}

/// Result of store calls.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Which database a store talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Embedded SQLite file.
    Sqlite,
    /// PostgreSQL server.
    Postgres,
}

/// A connection pool plus the backend it talks to. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    backend: Backend,
    /// On a SQLite file, a native pool on the same file for the hot write
    /// path (usage ingestion): sqlx's own SQLite driver with positional
    /// `?` parameters binds large multi-row statements in linear time,
    /// where `$N` parameters (which the `Any` queries must use) cost a
    /// lookup per parameter that grows with their number. `None` for an
    /// in-memory SQLite database (a second pool would be another
    /// database) and for PostgreSQL.
    sqlite: Option<SqlitePool>,
    /// On a SQLite file, a pool of one connection that every write of the
    /// `Any` queries goes through (see [`Store::writer`]). `None` for an
    /// in-memory SQLite database and for PostgreSQL, whose writes use
    /// `pool`.
    writer: Option<AnyPool>,
    /// On PostgreSQL, a small pool of its own for the lease (reads,
    /// renewals, takeovers), whose connections give up on a lock or a
    /// statement after [`leases::Timeouts`]: a takeover never queues
    /// behind a stalled holder, and never waits for a connection of the
    /// main pool. `None` on SQLite, where the lease goes through `writer`.
    lease_pool: Option<AnyPool>,
    /// The timeouts the pools were made with.
    timeouts: leases::Timeouts,
    /// Set on a store made by [`Store::fenced`]: its write transactions
    /// check this lease token first.
    fence: Option<std::sync::Arc<leases::Fence>>,
}

/// A page request: items after `after` (an id), at most `limit`.
#[derive(Debug, Clone, Default)]
pub struct PageReq {
    /// Exclusive lower bound on the id.
    pub after: Option<String>,
    /// Most items to return.
    pub limit: u32,
}

impl PageReq {
    /// Items after `after`, at most `limit` (clamped to 1..=1000).
    pub fn new(after: Option<String>, limit: u32) -> Self {
        Self {
            after,
            limit: limit.clamp(1, 1000),
        }
    }

    pub(crate) fn after_or_empty(&self) -> &str {
        self.after.as_deref().unwrap_or("")
    }

    /// Fetch one more than asked, to learn whether a next page exists.
    pub(crate) fn fetch(&self) -> i64 {
        i64::from(self.limit) + 1
    }
}

/// One page of results; `next` is the cursor of the following page.
#[derive(Debug, Clone)]
pub struct PageOf<T> {
    /// The items.
    pub items: Vec<T>,
    /// Cursor for the next page, if there is one.
    pub next: Option<String>,
}

impl<T> PageOf<T> {
    pub(crate) fn from_overfetch(
        mut items: Vec<T>,
        req: &PageReq,
        id: impl Fn(&T) -> String,
    ) -> Self {
        let next = if items.len() > req.limit as usize {
            items.truncate(req.limit as usize);
            items.last().map(id)
        } else {
            None
        };
        Self { items, next }
    }
}

impl Store {
    /// The rows of one page of a list, optionally of one tenant. `sql`
    /// binds `$1` to the cursor (`''` on the first page), `$2` to the
    /// tenant (`''`: every tenant) and `$3` to one more than the page
    /// holds, the convention every such list query follows.
    pub(crate) async fn page_rows(
        &self,
        sql: &str,
        only: Option<&flotilla_core::id::TenantId>,
        page: &PageReq,
    ) -> Result<Vec<sqlx::any::AnyRow>> {
        Ok(sqlx::query(sql)
            .bind(page.after_or_empty())
            .bind(only.map(|t| t.as_str()).unwrap_or(""))
            .bind(page.fetch())
            .fetch_all(self.pool())
            .await?)
    }

    /// Connects to `url` (`sqlite://PATH?mode=rwc` or `postgres://…`) and
    /// applies the embedded migrations, with the default
    /// [`leases::Timeouts`].
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, leases::Timeouts::default()).await
    }

    /// [`Store::connect`] with the timeouts of a given leader lease (see
    /// [`leases::Timeouts::for_lease`]); they apply on PostgreSQL only.
    pub async fn connect_with(url: &str, timeouts: leases::Timeouts) -> Result<Self> {
        sqlx::any::install_default_drivers();
        let backend = if url.starts_with("sqlite:") {
            Backend::Sqlite
        } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
            Backend::Postgres
        } else {
            return Err(StoreError::BadUrl(format!(
                "`{url}`: expected sqlite://PATH or postgres://…"
            )));
        };
        let opts =
            AnyConnectOptions::from_str(url).map_err(|e| StoreError::BadUrl(e.to_string()))?;
        let pool = any_pool(
            backend,
            &opts,
            match backend {
                // SQLite has one writer; a few readers beside it is plenty.
                Backend::Sqlite => 4,
                Backend::Postgres => 16,
            },
            timeouts.session_settings(),
        )
        .await?;
        sqlx::migrate!("./migrations").run(&pool).await?;
        let file =
            backend == Backend::Sqlite && !url.contains(":memory:") && !url.contains("mode=memory");
        let (sqlite, writer) = if file {
            (
                Some(native_sqlite(url).await?),
                Some(any_pool(backend, &opts, 1, Vec::new()).await?),
            )
        } else {
            (None, None)
        };
        let lease_pool = if backend == Backend::Postgres {
            // Two: the election loop uses one at a time; the second serves
            // a read of the lease (health, `claim_single`) beside it.
            Some(any_pool(backend, &opts, 2, timeouts.lease_settings()).await?)
        } else {
            None
        };
        tracing::debug!(
            ?backend,
            native = sqlite.is_some(),
            ?timeouts,
            "store ready"
        );
        Ok(Self {
            pool,
            backend,
            sqlite,
            writer,
            lease_pool,
            timeouts,
            fence: None,
        })
    }

    /// The pool every write of the `Any` queries goes through: on a SQLite
    /// file one connection, so that writers of this process queue in order
    /// for it (an async wait, first come first served) instead of meeting
    /// on SQLite's file lock, where a loser sleeps in SQLite's busy handler
    /// on a backoff of up to 100 ms per try while holding a connection of
    /// the pool, and a burst of writers is served in no order at all
    /// (issue 15 measured 314 creates/s with a p99 of 583 ms at 16
    /// connections before; bench/results/api.md has them since). Reads stay on [`Store::pool`] and, under
    /// WAL, never wait for the writer. Other processes and the native
    /// usage pool still meet this one on the file lock, under the busy
    /// timeout. On PostgreSQL and in-memory SQLite, the one pool.
    ///
    /// A write transaction must not wait for another write while it holds
    /// the writer (it would wait on itself); on SQLite that was already a
    /// lock wait until the busy timeout.
    pub(crate) fn writer(&self) -> &AnyPool {
        self.writer.as_ref().unwrap_or(&self.pool)
    }

    /// The pool the lease's statements go through (see the field).
    pub(crate) fn lease_pool(&self) -> &AnyPool {
        self.lease_pool.as_ref().unwrap_or_else(|| self.writer())
    }

    /// The timeouts this store was made with.
    pub fn timeouts(&self) -> &leases::Timeouts {
        &self.timeouts
    }

    /// The native SQLite pool of a SQLite file store (see the field).
    pub(crate) fn sqlite_pool(&self) -> Option<&SqlitePool> {
        self.sqlite.as_ref()
    }

    /// The backend in use.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The pool, for the repository modules.
    pub(crate) fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Closes every connection (waits for checked-out ones).
    pub async fn close(&self) {
        if let Some(native) = &self.sqlite {
            native.close().await;
        }
        if let Some(writer) = &self.writer {
            writer.close().await;
        }
        if let Some(lease) = &self.lease_pool {
            lease.close().await;
        }
        self.pool.close().await;
    }

    /// A cheap query proving the database answers.
    pub async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }
}

/// An `Any` pool of at most `max` connections; on SQLite each connection
/// is set up for WAL, foreign keys, a busy timeout and synchronous NORMAL;
/// on PostgreSQL each runs the `settings` statements (`SET …`, see
/// [`leases::Timeouts`]) first.
async fn any_pool(
    backend: Backend,
    opts: &AnyConnectOptions,
    max: u32,
    settings: Vec<String>,
) -> Result<AnyPool> {
    let settings = std::sync::Arc::new(settings);
    Ok(AnyPoolOptions::new()
        .max_connections(max)
        .after_connect(move |conn, _meta| {
            let settings = settings.clone();
            Box::pin(async move {
                if backend == Backend::Postgres {
                    for set in settings.iter() {
                        conn.execute(set.as_str()).await?;
                    }
                }
                if backend == Backend::Sqlite {
                    // WAL lets readers proceed while one writer commits;
                    // the busy timeout queues writers of other processes
                    // (and the native usage pool) instead of failing.
                    conn.execute("PRAGMA journal_mode = WAL").await?;
                    conn.execute("PRAGMA foreign_keys = ON").await?;
                    conn.execute("PRAGMA busy_timeout = 10000").await?;
                    conn.execute("PRAGMA synchronous = NORMAL").await?;
                }
                Ok(())
            })
        })
        .connect_with(opts.clone())
        .await?)
}

/// A native pool on the SQLite file at `url`, with the same settings as
/// the `Any` pool's connections (WAL, foreign keys, busy timeout,
/// synchronous NORMAL). Writers on both pools queue on SQLite's lock.
async fn native_sqlite(url: &str) -> Result<SqlitePool> {
    let opts = SqliteConnectOptions::from_str(url)
        .map_err(|e| StoreError::BadUrl(e.to_string()))?
        .journal_mode(SqliteJournalMode::Wal)
        .foreign_keys(true)
        .busy_timeout(std::time::Duration::from_secs(10))
        .synchronous(SqliteSynchronous::Normal)
        // Ingestion inserts into three B-trees (rows, key, tenant/end) that
        // outgrow SQLite's default 2 MiB page cache after ~10k events; a
        // larger cache and memory-mapped reads keep their upper pages hot
        // (measured: +20-30% events/s). Both are upper bounds, per
        // connection, not allocations.
        .pragma("cache_size", "-65536")
        .pragma("mmap_size", "268435456");
    Ok(SqlitePoolOptions::new()
        // Only usage batches write through it, one at a time anyway.
        .max_connections(2)
        .connect_with(opts)
        .await?)
}

/// `UPDATE table SET column = CASE id WHEN $1 THEN $2 … END WHERE id IN
/// ($1, $3, …)` for `n` rows, each bound as its id then its new value (a
/// BIGINT): many rows' different values in one statement, on both
/// databases. Callers keep `n` to a few hundred (bind limits).
pub(crate) fn keyed_bigint_update(table: &str, column: &str, n: usize) -> String {
    let mut cases = String::new();
    let mut ids = Vec::with_capacity(n);
    for k in 0..n {
        cases.push_str(&format!(
            " WHEN ${} THEN CAST(${} AS BIGINT)",
            2 * k + 1,
            2 * k + 2
        ));
        ids.push(format!("${}", 2 * k + 1));
    }
    format!(
        "UPDATE {table} SET {column} = CASE id{cases} END WHERE id IN ({})",
        ids.join(", ")
    )
}

/// `Ok` when a write by key touched `rows` > 0 rows, else
/// [`StoreError::NotFound`] naming `what`: an UPDATE or DELETE whose key
/// matches nothing means the caller named something that does not exist.
pub(crate) fn touched(rows: u64, what: &'static str) -> Result<()> {
    if rows == 0 {
        return Err(StoreError::NotFound(what));
    }
    Ok(())
}

/// `$1, $2, …, $n`: the parameters of an `IN` list of `n` values.
pub(crate) fn params(n: usize) -> String {
    (1..=n)
        .map(|i| format!("${i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// UTC milliseconds as stored.
pub(crate) fn ms(t: DateTime<Utc>) -> i64 {
    t.timestamp_millis()
}

/// Stored milliseconds back to UTC time.
pub(crate) fn at(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(ms).unwrap_or_default()
}

pub(crate) fn json<T: serde::de::DeserializeOwned>(s: &str, what: &str) -> Result<T> {
    serde_json::from_str(s).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

pub(crate) fn to_json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "null".into())
}

#[cfg(test)]
mod tests {
    use super::sqlite_busy;

    #[test]
    fn sqlite_busy_and_locked_codes_are_busy_and_others_are_not() {
        // SQLITE_BUSY, SQLITE_LOCKED, SQLITE_BUSY_SNAPSHOT (517),
        // SQLITE_LOCKED_SHAREDCACHE (262).
        for code in ["5", "6", "517", "262"] {
            assert!(sqlite_busy(Some(code)), "{code}");
        }
        // SQLITE_CONSTRAINT_UNIQUE (2067), SQLITE_ERROR, PostgreSQL's
        // lock_not_available, none.
        for code in [Some("2067"), Some("1"), Some("55P03"), None] {
            assert!(!sqlite_busy(code), "{code:?}");
        }
    }
}
