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

fn lease(r: &sqlx::any::AnyRow) -> Result<Lease> {
    Ok(Lease {
        name: r.try_get("name")?,
        holder: r.try_get("holder")?,
        token: r.try_get("token")?,
        expires_at: at(r.try_get("expires_at")?),
        acquired_at: at(r.try_get("acquired_at")?),
    })
}

impl Store {
    /// Takes or renews the lease `name` for `holder` until `now + ttl`:
    /// granted when it is free, ran out, or is `holder`'s already. Returns
    /// the lease as it stands afterwards, whoever holds it; the caller
    /// holds it when [`Lease::held_by`] says so. The token grows by one on
    /// every grant that is not the renewal of a holding still current, so
    /// a holder that let its lease run out starts a new term too.
    pub async fn acquire_lease(
        &self,
        name: &str,
        holder: &str,
        ttl: chrono::Duration,
        now: DateTime<Utc>,
    ) -> Result<Lease> {
        let until = ms(now + ttl);
        let mut tx = self.writer().begin().await?;
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
        let row = sqlx::query("SELECT * FROM leases WHERE name = $1")
            .bind(name)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        lease(&row)
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
        let mut tx = self.writer().begin().await?;
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
        let row = sqlx::query("SELECT * FROM leases WHERE name = $1")
            .bind(name)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        lease(&row)
    }

    /// Gives the lease up at once if `holder` holds it (a clean shutdown),
    /// so another replica need not wait for it to run out. The token is
    /// kept; the next grant increments it.
    pub async fn release_lease(&self, name: &str, holder: &str) -> Result<bool> {
        let n = sqlx::query("UPDATE leases SET expires_at = 0 WHERE name = $1 AND holder = $2")
            .bind(name)
            .bind(holder)
            .execute(self.writer())
            .await?
            .rows_affected();
        Ok(n > 0)
    }

    /// The lease `name`, if it was ever granted.
    pub async fn lease(&self, name: &str) -> Result<Option<Lease>> {
        sqlx::query("SELECT * FROM leases WHERE name = $1")
            .bind(name)
            .fetch_optional(self.pool())
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
        let mut tx = self.writer().begin().await?;
        if self.backend() == Backend::Sqlite {
            sqlx::query(TAKE_WRITE_LOCK).execute(&mut *tx).await?;
        }
        if let Some(f) = self.fence() {
            let sql = match self.backend() {
                Backend::Postgres => "SELECT token FROM leases WHERE name = $1 FOR SHARE",
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
