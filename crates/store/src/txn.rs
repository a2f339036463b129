//! Beginning and committing `Any` transactions so that a caller cancelled
//! half-way (a task aborted when a leader's term ends, a timeout, a
//! request whose client went away) cannot leave a pooled connection inside
//! a transaction.
//!
//! sqlx 0.8's PostgreSQL `begin` counts the transaction only once `BEGIN`
//! has answered: a future dropped while waiting for that answer leaves
//! the session inside a transaction that sqlx does not know of. The
//! connection goes back to the pool; its next borrower's `BEGIN` draws
//! "WARNING: there is already a transaction in progress", its statements
//! run inside the stray transaction, and the locks that one took (the
//! lease row's share lock, for a fenced write) stay held. A `commit`
//! dropped after sending `COMMIT` leaves the transaction counted, so the
//! drop queues a `ROLLBACK` after it ("there is no transaction in
//! progress") and the caller cannot tell whether it committed. Both run
//! here on a task of their own, which finishes whatever becomes of the
//! caller: a begun transaction nobody takes is dropped there and rolled
//! back.

use sqlx::{Any, AnyPool, Transaction};

use crate::{Result, StoreError};

/// Begins a transaction on `pool` (see the module doc).
pub(crate) async fn begin(pool: &AnyPool) -> Result<Transaction<'static, Any>> {
    let pool = pool.clone();
    tokio::spawn(async move { pool.begin().await })
        .await
        .map_err(joined)?
        .map_err(StoreError::from)
}

/// Commits `tx` (see the module doc).
pub(crate) async fn commit(tx: Transaction<'static, Any>) -> Result<()> {
    tokio::spawn(tx.commit())
        .await
        .map_err(joined)?
        .map_err(StoreError::from)
}

/// The task did not finish: the runtime is shutting down.
fn joined(e: tokio::task::JoinError) -> StoreError {
    StoreError::Unavailable(sqlx::Error::Io(std::io::Error::other(e)))
}
