//! PostgreSQL over TLS: the store honours `sslmode` in its database URL
//! (sqlx with rustls). Needs `FLOTILLA_TEST_DATABASE_URL` and a server
//! with TLS on, as Debian's default cluster is (`ssl = on` with the
//! snakeoil certificate); says so and passes otherwise.
//!
//! `require` encrypts (the server's `pg_stat_ssl` shows the store's
//! connections encrypted), `disable` does not, and `verify-full` checks
//! the certificate: the snakeoil certificate is signed by no public root,
//! and names the host, not 127.0.0.1, so it is refused both without
//! `sslrootcert` and with it.

use sqlx::{Connection, Row};

fn with(url: &str, params: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{params}")
}

/// Connections of the store to `db` that are (and are not) encrypted,
/// seen from a plain connection of its own.
async fn store_connections(observer: &mut sqlx::PgConnection, db: &str) -> (i64, i64) {
    let row = sqlx::query(
        "SELECT COUNT(*) FILTER (WHERE s.ssl) AS tls, COUNT(*) FILTER (WHERE NOT s.ssl) AS plain \
         FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
         WHERE a.datname = $1 AND a.pid <> pg_backend_pid()",
    )
    .bind(db)
    .fetch_one(observer)
    .await
    .unwrap();
    (row.get("tls"), row.get("plain"))
}

#[tokio::test]
async fn sslmode_in_the_database_url_is_honoured() {
    let Some(url) = flotilla_testdb::postgres_url("tls").await else {
        return;
    };
    let db = url
        .split('?')
        .next()
        .unwrap()
        .rsplit('/')
        .next()
        .unwrap()
        .to_string();
    let mut observer = sqlx::PgConnection::connect(&with(&url, "sslmode=disable"))
        .await
        .unwrap();
    let ssl: String = sqlx::query_scalar("SHOW ssl")
        .fetch_one(&mut observer)
        .await
        .unwrap();
    if ssl != "on" {
        eprintln!("skipping: this PostgreSQL server has ssl = {ssl}");
        return;
    }
    let cert_file: String = sqlx::query_scalar("SHOW ssl_cert_file")
        .fetch_one(&mut observer)
        .await
        .unwrap();

    let store = flotilla_store::Store::connect(&with(&url, "sslmode=require"))
        .await
        .expect("sslmode=require connects");
    store.ping().await.unwrap();
    let (tls, plain) = store_connections(&mut observer, &db).await;
    assert!(
        tls >= 1 && plain == 0,
        "require: {tls} encrypted, {plain} plain"
    );
    store.close().await;

    let store = flotilla_store::Store::connect(&with(&url, "sslmode=disable"))
        .await
        .expect("sslmode=disable connects");
    store.ping().await.unwrap();
    let (tls, plain) = store_connections(&mut observer, &db).await;
    assert!(
        tls == 0 && plain >= 1,
        "disable: {tls} encrypted, {plain} plain"
    );
    store.close().await;

    let refused = flotilla_store::Store::connect(&with(&url, "sslmode=verify-full")).await;
    assert!(
        refused.is_err(),
        "verify-full must refuse a certificate no known root signed"
    );
    if std::path::Path::new(&cert_file).exists() {
        let refused = flotilla_store::Store::connect(&with(
            &url,
            &format!("sslmode=verify-full&sslrootcert={cert_file}"),
        ))
        .await;
        assert!(
            refused.is_err(),
            "verify-full must refuse a certificate that does not name 127.0.0.1"
        );
    }
}
