//! Leases with fencing tokens: which server replica is the leader (and
//! runs the control loops), and the check that refuses the writes of one
//! that no longer is.
//!
//! A lease is one row: its holder, until when it holds, and a token that
//! grows whenever the lease changes hands. The holder renews well before
//! it runs out; another replica takes it only once it has. A store made
//! with [`Store::fenced`] checks, at the start of every write transaction
//! it opens, that the lease still carries its token, and fails with
//! [`StoreError::Fenced`] otherwise. On PostgreSQL that check locks the
//! row `FOR SHARE`, so a takeover (an `UPDATE` of the row) waits for the
//! writes already under way and every later write sees the new token;
//! SQLite has a single writer, so the read alone is enough there.
//!
//! # A holder that stalls holding the row
//!
//! A holder frozen (SIGSTOP, a VM paused, a host swapping) while inside a
//! fenced transaction keeps its share lock on the lease row for as long
//! as its session lives, and a frozen process's session never ends by
//! itself. A takeover's `UPDATE` would queue behind that lock forever,
//! and every later `FOR SHARE` of the other replicas would queue behind
//! the `UPDATE`: the whole cluster stalls on one paused process. Three
//! PostgreSQL timeouts ([`Timeouts`]) keep that from happening:
//!
//! - every connection has `idle_in_transaction_session_timeout`, so
//!   PostgreSQL ends the session of a process that stopped inside a
//!   transaction, rolling it back and releasing its locks;
//! - the lease's statements run on a pool of their own whose connections
//!   have a short `lock_timeout` and `statement_timeout`: a renewal or
//!   takeover that cannot get the row soon gives up ([`StoreError::Busy`],
//!   "not this round") instead of queueing, so it never holds up the
//!   fence checks behind it, and never waits for the main pool;
//! - a fenced transaction sets `lock_timeout` for itself (`SET LOCAL`),
//!   so its fence check and writes give up rather than wait on a stalled
//!   lock.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::Row;

use crate::{at, ms, Backend, Result, Store, StoreError};

/// The lease of the replica that runs the control loops.
pub const LEADER: &str = "leader";

/// A lease as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Its name ([`LEADER`]).
    pub name: String,
    /// Who holds it (a replica's id).
    pub holder: String,
    /// The fencing token of the current holding.
    pub token: i64,
    /// When it runs out unless renewed.
    pub expires_at: DateTime<Utc>,
    /// When the current holding began.
    pub acquired_at: DateTime<Utc>,
}

impl Lease {
    /// Whether `holder` holds it at `now`.
    pub fn held_by(&self, holder: &str, now: DateTime<Utc>) -> bool {
        self.holder == holder && self.expires_at > now
    }
}

/// Whose writes a fenced store makes: a lease and the token its holder got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// The lease's name.
    pub name: String,
    /// The token the writes are made under.
    pub token: i64,
}

/// How long PostgreSQL lets a session of this store idle inside a
/// transaction or wait for a lock (see the module doc); derived from the
/// leader lease's time to live. Unused on SQLite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// `idle_in_transaction_session_timeout` of every connection: a
    /// session idle inside a transaction this long belongs to a stalled
    /// process (no transaction of the store awaits anything but its own
    /// statements); PostgreSQL ends it and releases its locks.
    pub idle_in_transaction: Duration,
    /// `lock_timeout` of the lease's connections: how long a renewal or
    /// takeover waits for the row. Long enough for the holder's own fenced
    /// transactions to commit, short enough that the fence checks queued
    /// behind it are not held up.
    pub lease_lock: Duration,
    /// `statement_timeout` of the lease's connections: a lease statement
    /// slower than this is as good as lost; shorter than the election
    /// loop's own timeout, so PostgreSQL cancels the statement rather
    /// than leave it queued on a connection the loop gave up on.
    pub lease_statement: Duration,
    /// `lock_timeout` of every fenced transaction (`SET LOCAL`).
    pub fence_lock: Duration,
}

impl Timeouts {
    /// The timeouts for a leader lease living `ttl`, renewed every third
    /// of it: idle in a transaction for a whole lease (at least 2 s), a
    /// lease statement waits a sixth of it for a lock (0.1-1 s) and runs
    /// for a quarter at most (0.2-2 s), a fenced transaction waits half of
    /// it (0.5-2 s).
    pub fn for_lease(ttl: Duration) -> Self {
        let clamp = |d: Duration, lo: u64, hi: u64| {
            d.clamp(Duration::from_millis(lo), Duration::from_millis(hi))
        };
        Self {
            idle_in_transaction: ttl.max(Duration::from_secs(2)),
            lease_lock: clamp(ttl / 6, 100, 1000),
            lease_statement: clamp(ttl / 4, 200, 2000),
            fence_lock: clamp(ttl / 2, 500, 2000),
        }
    }

    /// The `SET` statements of every connection.
    pub(crate) fn session_settings(&self) -> Vec<String> {
        vec![format!(
            "SET idle_in_transaction_session_timeout = {}",
            self.idle_in_transaction.as_millis()
        )]
    }

    /// The `SET` statements of the lease's connections.
    pub(crate) fn lease_settings(&self) -> Vec<String> {
        let mut v = self.session_settings();
        v.push(format!(
            "SET lock_timeout = {}",
            self.lease_lock.as_millis()
        ));
        v.push(format!(
            "SET statement_timeout = {}",
            self.lease_statement.as_millis()
        ));
        v
    }
}

impl Default for Timeouts {
    /// Those of the default leader lease (5 s: a heartbeat timeout of 15 s).
    fn default() -> Self {
        Self::for_lease(Duration::from_secs(5))
    }
}

fn lease(r: &sqlx::any::AnyRow) -> Result<Lease> {
    Ok(Lease {
        name: r.try_get("name")?,
        holder: r.try_get("holder")?,
        token: r.try_get("token")?,
        expires_at: at(r.try_get("expires_at")?),
        acquired_at: at(r.try_get("acquired_at")?),
    })
}

/// Reads lease `name` in `tx`, then commits: a change to a lease answers
/// with the row as its own transaction left it, not as a later writer's.
async fn commit_reading(
    mut tx: sqlx::Transaction<'static, sqlx::Any>,
    name: &str,
) -> Result<Lease> {
    let row = sqlx::query("SELECT * FROM leases WHERE name = $1")
        .bind(name)
        .fetch_one(&mut *tx)
        .await?;
    crate::txn::commit(tx).await?;
    lease(&row)
}

impl Store {
    /// Takes or renews the lease `name` for `holder` until `now + ttl`:
    /// granted when it is free, ran out, or is `holder`'s already. Returns
    /// the lease as it stands afterwards, whoever holds it; the caller
    /// holds it when [`Lease::held_by`] says so. The token grows by one on
    /// every grant that is not the renewal of a holding still current, so
    /// a holder that let its lease run out starts a new term too.
    ///
    /// A compare-and-set that does not queue: when the row is locked past
    /// [`Timeouts::lease_lock`] (a stalled holder inside a fenced
    /// transaction), fails with [`StoreError::Busy`], "not this time".
    pub async fn acquire_lease(
        &self,
        name: &str,
        holder: &str,
        ttl: chrono::Duration,
        now: DateTime<Utc>,
    ) -> Result<Lease> {
        let until = ms(now + ttl);
        let mut tx = crate::txn::begin(self.lease_pool()).await?;
        // A first grant: an expired row with token 0, which the update
        // below takes like any lease that ran out (token 1).
        sqlx::query(
            "INSERT INTO leases (name, holder, token, expires_at, acquired_at) VALUES ($1, '', 0, 0, 0) \
             ON CONFLICT (name) DO NOTHING",
        )
        .bind(name)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE leases SET \
               token = CASE WHEN holder = $2 AND expires_at > $3 THEN token ELSE token + 1 END, \
               acquired_at = CASE WHEN holder = $2 AND expires_at > $3 THEN acquired_at ELSE $3 END, \
               holder = $2, expires_at = $4 \
             WHERE name = $1 AND (holder = $2 OR expires_at <= $3)",
        )
        .bind(name)
        .bind(holder)
        .bind(ms(now))
        .bind(until)
        .execute(&mut *tx)
        .await?;
        commit_reading(tx, name).await
    }

    /// Hands the lease from `from` to `to` whether or not it ran out, under
    /// a new token: for a holder known to be gone (its process ended) that
    /// could not give it back. Returns the lease as it stands afterwards
    /// (unchanged when `from` no longer holds it).
    pub async fn take_over_lease(
        &self,
        name: &str,
        from: &str,
        to: &str,
        ttl: chrono::Duration,
        now: DateTime<Utc>,
    ) -> Result<Lease> {
        let mut tx = crate::txn::begin(self.lease_pool()).await?;
        sqlx::query(
            "UPDATE leases SET holder = $3, token = token + 1, expires_at = $4, acquired_at = $5 \
             WHERE name = $1 AND holder = $2",
        )
        .bind(name)
        .bind(from)
        .bind(to)
        .bind(ms(now + ttl))
        .bind(ms(now))
        .execute(&mut *tx)
        .await?;
        commit_reading(tx, name).await
    }

    /// Gives the lease up at once if `holder` holds it (a clean shutdown),
    /// so another replica need not wait for it to run out. The token is
    /// kept; the next grant increments it.
    pub async fn release_lease(&self, name: &str, holder: &str) -> Result<bool> {
        let n = sqlx::query("UPDATE leases SET expires_at = 0 WHERE name = $1 AND holder = $2")
            .bind(name)
            .bind(holder)
            .execute(self.lease_pool())
            .await?
            .rows_affected();
        Ok(n > 0)
    }

    /// The lease `name`, if it was ever granted.
    pub async fn lease(&self, name: &str) -> Result<Option<Lease>> {
        sqlx::query("SELECT * FROM leases WHERE name = $1")
            .bind(name)
            .fetch_optional(self.lease_pool())
            .await?
            .as_ref()
            .map(lease)
            .transpose()
    }

    /// This store, making every write transaction conditional on the lease
    /// `name` still carrying `token` (see the module doc). Reads are not
    /// affected. Cheap: the pools are shared.
    pub fn fenced(&self, name: &str, token: i64) -> Store {
        let mut s = self.clone();
        s.fence = Some(std::sync::Arc::new(Fence {
            name: name.to_string(),
            token,
        }));
        s
    }

    /// The fence of this store, if it is fenced.
    pub fn fence(&self) -> Option<&Fence> {
        self.fence.as_deref()
    }

    /// Begins a write transaction; on a fenced store, first checks (and on
    /// PostgreSQL share-locks) the lease row. Every write transaction of
    /// the repository modules starts here.
    ///
    /// On SQLite the transaction takes the write lock up front, as `BEGIN
    /// IMMEDIATE` would. A deferred transaction that reads first (the fence
    /// check always does, so does a quota check) fails at once with
    /// `SQLITE_BUSY`, without the busy wait, when another connection
    /// committed between its first read and its first write; the leader's
    /// lease renewals and the agents' syncs made that common under load
    /// (node registration answered 500, the metering pass logged "database
    /// is locked"). Taking the lock first queues it behind the busy timeout
    /// instead. This needs every transaction to nest no other store call
    /// that writes (it would wait on itself): none does, the re-reads that
    /// follow a write come after its commit.
    pub(crate) async fn begin(&self) -> Result<sqlx::Transaction<'static, sqlx::Any>> {
        let mut tx = crate::txn::begin(self.writer()).await?;
        if self.backend() == Backend::Sqlite {
            sqlx::query(TAKE_WRITE_LOCK).execute(&mut *tx).await?;
        }
        if let Some(f) = self.fence() {
            let sql = match self.backend() {
                Backend::Postgres => {
                    // Neither the check nor the writes wait long for a
                    // lock (see the module doc).
                    let set = format!(
                        "SET LOCAL lock_timeout = {}",
                        self.timeouts().fence_lock.as_millis()
                    );
                    sqlx::query(&set).execute(&mut *tx).await?;
                    "SELECT token FROM leases WHERE name = $1 FOR SHARE"
                }
                Backend::Sqlite => "SELECT token FROM leases WHERE name = $1",
            };
            let current: Option<i64> = sqlx::query_scalar(sql)
                .bind(&f.name)
                .fetch_optional(&mut *tx)
                .await?;
            check(f, current)?;
        }
        Ok(tx)
    }

    /// Test hook, not for production code: begins a write transaction
    /// (on a fenced store, the fence check, which share-locks the lease
    /// row on PostgreSQL), awaits `hold` inside it, then commits. What a
    /// replica stalled inside a fenced write looks like to the others.
    #[doc(hidden)]
    pub async fn hold_write_transaction<F: std::future::Future>(
        &self,
        hold: F,
    ) -> Result<F::Output> {
        let mut tx = self.begin().await?;
        let out = hold.await;
        sqlx::query("SELECT 1").execute(&mut *tx).await?;
        crate::txn::commit(tx).await?;
        Ok(out)
    }

    /// The fence check inside a transaction of the native SQLite pool
    /// (usage ingestion), which cannot use [`Store::begin`].
    pub(crate) async fn check_fence_sqlite(
        &self,
        tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>,
    ) -> Result<()> {
        if let Some(f) = self.fence() {
            let current: Option<i64> =
                sqlx::query_scalar("SELECT token FROM leases WHERE name = ?")
                    .bind(&f.name)
                    .fetch_optional(&mut **tx)
                    .await?;
            check(f, current)?;
        }
        Ok(())
    }
}

fn check(f: &Fence, current: Option<i64>) -> Result<()> {
    match current {
        Some(t) if t == f.token => Ok(()),
        current => Err(StoreError::Fenced {
            lease: f.name.clone(),
            token: f.token,
            current,
        }),
    }
}

/// Takes SQLite's write lock when run as a transaction's first statement:
/// an UPDATE acquires it before evaluating its WHERE clause, so one that
/// matches nothing writes nothing and still holds the lock until the end,
/// waiting behind the busy timeout like any first write. Not `BEGIN
/// IMMEDIATE` through sqlx's `begin_with`: on a pooled connection whose
/// previous transaction was dropped uncommitted, that fails with "attempted
/// to call begin_with at non-zero transaction depth" (seen: every agent
/// sync answered 500 until the server restarted).
pub(crate) const TAKE_WRITE_LOCK: &str = "UPDATE leases SET name = name WHERE 1 = 0";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_current_token_passes() {
        let f = Fence {
            name: LEADER.into(),
            token: 3,
        };
        assert!(check(&f, Some(3)).is_ok());
        assert!(matches!(
            check(&f, Some(4)),
            Err(StoreError::Fenced {
                token: 3,
                current: Some(4),
                ..
            })
        ));
        assert!(matches!(
            check(&f, None),
            Err(StoreError::Fenced { current: None, .. })
        ));
    }
}
