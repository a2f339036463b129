//! Database fixtures for Flotilla's test suites: fresh stores, one database
//! each, so tests run in parallel, and [`backend_suite!`] which runs one
//! suite on SQLite and on PostgreSQL.
//!
//! This crate is apart from `flotilla-testkit` (which starts the server and
//! the real binary) so that the store's tests build no server: the store
//! sits below the server and its tests must not depend on it.
//!
//! Test-only: never a dependency of a shipped crate. Panics (a failed
//! fixture is a failed test) are its way to report errors.

use std::sync::atomic::{AtomicU64, Ordering};

use flotilla_store::Store;

static SEQ: AtomicU64 = AtomicU64::new(1);

/// Randomness for the ids a suite generates, unique across the suites'
/// tests and processes that share one PostgreSQL (a counter and the pid).
pub fn rnd() -> u128 {
    let n = SEQ.fetch_add(1, Ordering::Relaxed) as u128;
    n << 40 | std::process::id() as u128
}

/// The suites' fixed "now": decisions take a clock, so tests pass one.
pub fn t0() -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::from_timestamp(1_800_000_000, 0).expect("a valid instant")
}

/// A store on its own database; dropping it removes a SQLite file (a
/// PostgreSQL database is left for `.ci/run` to drop: its name starts with
/// `flotilla_t_`).
#[derive(Debug)]
pub struct TestDb {
    /// The store.
    pub store: Store,
    _dir: Option<tempfile::TempDir>,
}

/// A store on a new SQLite file in a temporary directory.
pub async fn sqlite() -> TestDb {
    let dir = tempfile::tempdir().expect("temporary directory");
    let url = format!("sqlite://{}/t.db?mode=rwc", dir.path().display());
    TestDb {
        store: Store::connect(&url).await.expect("SQLite store"),
        _dir: Some(dir),
    }
}

/// `base` (a PostgreSQL URL) with its database replaced by `name`.
pub fn with_database(base: &str, name: &str) -> String {
    let (without_query, query) = match base.find('?') {
        Some(q) => (&base[..q], &base[q..]),
        None => (base, ""),
    };
    let authority_end = without_query.find("://").map_or(0, |s| s + 3);
    match without_query[authority_end..].find('/') {
        Some(slash) => format!("{}/{name}{query}", &without_query[..authority_end + slash]),
        None => format!("{without_query}/{name}{query}"),
    }
}

/// Creates a fresh PostgreSQL database and returns its URL, or `None`
/// (with a message) when `FLOTILLA_TEST_DATABASE_URL` is not set. Panics
/// when it is set but PostgreSQL does not answer: CI must not skip.
pub async fn postgres_url(prefix: &str) -> Option<String> {
    let Ok(base) = std::env::var("FLOTILLA_TEST_DATABASE_URL") else {
        eprintln!("skipping the PostgreSQL half: FLOTILLA_TEST_DATABASE_URL is not set");
        return None;
    };
    use sqlx::Connection;
    let name = format!(
        "flotilla_t_{prefix}_{}_{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let mut admin = sqlx::PgConnection::connect(&base)
        .await
        .expect("FLOTILLA_TEST_DATABASE_URL is set but PostgreSQL does not answer");
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name}"))
        .execute(&mut admin)
        .await
        .expect("drop database");
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await
        .expect("create database");
    Some(with_database(&base, &name))
}

/// A store on a new PostgreSQL database (see [`postgres_url`]).
pub async fn postgres(prefix: &str) -> Option<TestDb> {
    let url = postgres_url(prefix).await?;
    Some(TestDb {
        store: Store::connect(&url).await.expect("PostgreSQL store"),
        _dir: None,
    })
}

/// Re-exported for [`backend_suite!`].
pub use flotilla_store;

/// Runs each named `async fn(&Store)` of the calling module as two tests:
/// `sqlite_backend::NAME` and `postgres_backend::NAME` (the latter skips
/// with a message when `FLOTILLA_TEST_DATABASE_URL` is unset).
#[macro_export]
macro_rules! backend_suite {
    ($prefix:literal: $($name:ident),* $(,)?) => {
        mod sqlite_backend {
            $(
                #[tokio::test]
                async fn $name() {
                    let db = $crate::sqlite().await;
                    assert_eq!(db.store.backend(), $crate::flotilla_store::Backend::Sqlite);
                    super::$name(&db.store).await;
                }
            )*
        }
        mod postgres_backend {
            $(
                #[tokio::test]
                async fn $name() {
                    if let Some(db) = $crate::postgres($prefix).await {
                        assert_eq!(db.store.backend(), $crate::flotilla_store::Backend::Postgres);
                        super::$name(&db.store).await;
                    }
                }
            )*
        }
    };
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn database_name_is_replaced_and_the_query_kept() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/test", "x"),
            "postgres://postgres@127.0.0.1:5432/x"
        );
        assert_eq!(
            with_database("postgres://u:p@h/test?sslmode=disable", "x"),
            "postgres://u:p@h/x?sslmode=disable"
        );
        assert_eq!(
            with_database("postgres://h:5432", "x"),
            "postgres://h:5432/x"
        );
    }
}
