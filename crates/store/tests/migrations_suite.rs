//! Migrations that remove things, on every backend: a database migrated up
//! to the version before, holding rows, is migrated by `Store::connect`,
//! and what the migration drops is gone while what it must keep is not.
//! SQLite always, PostgreSQL when `FLOTILLA_TEST_DATABASE_URL` is set.
//!
//! Not a `backend_suite!`: these tests need the database before the store
//! migrates it, so they get a URL rather than a `Store`.

use std::path::Path;

use flotilla_store::{Backend, Store};
use sqlx::AnyPool;

/// The store's migrations up to and including `version`, applied to `url`
/// as an older server would have: the same files, so the same checksums,
/// copied to a directory of their own.
async fn migrated_to(url: &str, version: i64) -> AnyPool {
    sqlx::any::install_default_drivers();
    let dir = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        let v: i64 = name.split('_').next().unwrap().parse().unwrap();
        if v <= version {
            std::fs::copy(&path, dir.path().join(&name)).unwrap();
        }
    }
    let pool = AnyPool::connect(url).await.unwrap();
    sqlx::migrate::Migrator::new(dir.path())
        .await
        .unwrap()
        .run(&pool)
        .await
        .unwrap();
    pool
}

async fn count(pool: &AnyPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Whether the database has a table (or index, `kind`) of that name.
async fn exists(pool: &AnyPool, backend: Backend, kind: &str, name: &str) -> bool {
    let sql = match (backend, kind) {
        (Backend::Sqlite, _) => {
            format!("SELECT COUNT(*) FROM sqlite_master WHERE type = '{kind}' AND name = '{name}'")
        }
        (Backend::Postgres, "table") => format!(
            "SELECT COUNT(*) FROM information_schema.tables \
             WHERE table_schema = current_schema() AND table_name = '{name}'"
        ),
        (Backend::Postgres, _) => format!(
            "SELECT COUNT(*) FROM pg_indexes \
             WHERE schemaname = current_schema() AND indexname = '{name}'"
        ),
    };
    count(pool, &sql).await > 0
}

/// Migration 0037: the replica pools' tables and index go, even with a
/// pool and a member in them; the tenant and the instance the pool
/// started stay.
async fn replica_pool_tables_are_dropped(url: &str) {
    let old = migrated_to(url, 36).await;
    for sql in [
        "INSERT INTO tenants (id, name, created_at, updated_at) \
         VALUES ('ten_1', 'acme', 1, 1)",
        "INSERT INTO instances (id, tenant_id, state, state_reason, gpus, gpu_types, \
         cpu_milli, memory_mb, command, env, billing_class, created_at, updated_at) \
         VALUES ('inst_1', 'ten_1', 'running', '', 1, '[]', 1000, 1024, '[]', '{}', \
         'on_demand', 1, 1)",
        "INSERT INTO replica_pools (id, tenant_id, name, spec, created_at) \
         VALUES ('rpool_1', 'ten_1', 'chat', '{}', 1)",
        "INSERT INTO replica_pool_members (pool_id, instance_id, created_at) \
         VALUES ('rpool_1', 'inst_1', 1)",
    ] {
        sqlx::query(sql).execute(&old).await.unwrap();
    }

    let store = Store::connect(url).await.expect("migrates from 0036");
    let backend = store.backend();
    assert!(exists(&old, backend, "table", "instances").await);
    for table in ["replica_pool_members", "replica_pools"] {
        assert!(
            !exists(&old, backend, "table", table).await,
            "{table} is still there"
        );
    }
    assert!(!exists(&old, backend, "index", "replica_pools_tenant").await);
    assert_eq!(
        count(&old, "SELECT COUNT(*) FROM instances WHERE id = 'inst_1'").await,
        1
    );
    assert_eq!(
        count(&old, "SELECT COUNT(*) FROM tenants WHERE id = 'ten_1'").await,
        1
    );
    store.close().await;
    old.close().await;
}

mod sqlite_backend {
    #[tokio::test]
    async fn replica_pool_tables_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/t.db?mode=rwc", dir.path().display());
        super::replica_pool_tables_are_dropped(&url).await;
    }
}

mod postgres_backend {
    #[tokio::test]
    async fn replica_pool_tables_are_dropped() {
        if let Some(url) = flotilla_testdb::postgres_url("migrations").await {
            super::replica_pool_tables_are_dropped(&url).await;
        }
    }
}
