//! The audit log and the last operator key, run against every backend:
//! SQLite always, PostgreSQL when `FLOTILLA_TEST_DATABASE_URL` is set.
//! Entries come back newest first, by tenant when asked, page by page;
//! the last live operator key cannot be revoked, even by two revocations
//! racing each other.

use chrono::Duration;
use flotilla_core::api::AuditEntry;
use flotilla_core::id::{AuditId, KeyId, TenantId};
use flotilla_core::tenant::Role;
use flotilla_store::keys::NewKey;
use flotilla_store::{PageReq, Store, StoreError};
use flotilla_testdb::{rnd, t0};

flotilla_testdb::backend_suite!(
    "audit":
    audit_entries_page_newest_first_by_tenant,
    the_last_operator_key_is_never_revoked,
);

async fn tenant(s: &Store) -> TenantId {
    let id = TenantId::generate(1, rnd());
    s.create_tenant(&id, &format!("t{}", rnd()), t0())
        .await
        .unwrap();
    id
}

async fn audit_entries_page_newest_first_by_tenant(s: &Store) {
    let (a, b) = (tenant(s).await, tenant(s).await);
    let key = KeyId::generate(1, rnd());
    let mut written = Vec::new();
    for i in 0..5u64 {
        let at = t0() + Duration::seconds(i as i64);
        let e = AuditEntry {
            id: AuditId::generate(at.timestamp_millis() as u64, rnd()),
            at,
            key_id: key.clone(),
            tenant_id: if i % 2 == 0 { a.clone() } else { b.clone() },
            method: "POST".into(),
            route: "/v1/instances".into(),
            object_id: (i != 4).then(|| format!("inst_{i}")),
            status: if i == 3 { 422 } else { 201 },
            request_id: (i == 0).then(|| "req-1".to_string()),
        };
        s.record_audit(&e).await.unwrap();
        written.push(e);
    }
    let all = s.list_audit(None, &PageReq::new(None, 100)).await.unwrap();
    let newest_first: Vec<_> = written.iter().rev().cloned().collect();
    assert_eq!(
        all.items, newest_first,
        "every field read back, newest first"
    );
    assert_eq!(all.next, None);

    let only_a = s
        .list_audit(Some(&a), &PageReq::new(None, 100))
        .await
        .unwrap();
    let ids: Vec<_> = only_a.items.iter().map(|e| e.id.clone()).collect();
    assert_eq!(
        ids,
        vec![
            written[4].id.clone(),
            written[2].id.clone(),
            written[0].id.clone()
        ]
    );

    // Two at a time, the cursor walks back in time without repeats.
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = s.list_audit(None, &PageReq::new(cursor, 2)).await.unwrap();
        assert!(page.items.len() <= 2);
        seen.extend(page.items.into_iter().map(|e| e.id));
        match page.next {
            Some(n) => cursor = Some(n),
            None => break,
        }
    }
    let want: Vec<_> = newest_first.iter().map(|e| e.id.clone()).collect();
    assert_eq!(seen, want);
}

async fn key(s: &Store, tenant: &TenantId, role: Role) -> KeyId {
    let id = KeyId::generate(1, rnd());
    s.create_key(
        &NewKey {
            id: id.clone(),
            tenant_id: tenant.clone(),
            role,
            name: "k".into(),
            prefix: "flt_x".into(),
            secret_hash: format!("{:032x}", rnd()),
        },
        t0(),
    )
    .await
    .unwrap();
    id
}

async fn the_last_operator_key_is_never_revoked(s: &Store) {
    let t = tenant(s).await;
    let first = key(s, &t, Role::Operator).await;
    let admin = key(s, &t, Role::TenantAdmin).await;
    assert!(matches!(
        s.revoke_key(&first, t0()).await,
        Err(StoreError::Conflict(m)) if m.contains("last operator key")
    ));
    assert!(s.key(&first).await.unwrap().revoked_at.is_none());
    // Other roles are revoked as before, twice a no-op.
    assert!(s
        .revoke_key(&admin, t0())
        .await
        .unwrap()
        .revoked_at
        .is_some());
    assert!(s
        .revoke_key(&admin, t0())
        .await
        .unwrap()
        .revoked_at
        .is_some());

    // Two operator keys revoked at once: one revocation wins, never both.
    let mut survivor = first;
    for _ in 0..5 {
        let other = key(s, &t, Role::Operator).await;
        let (x, y) = tokio::join!(s.revoke_key(&survivor, t0()), s.revoke_key(&other, t0()));
        match (&x, &y) {
            (Ok(_), Err(StoreError::Conflict(_))) => survivor = other,
            (Err(StoreError::Conflict(_)), Ok(_)) => {}
            _ => panic!("exactly one revocation must win: {x:?} {y:?}"),
        }
        assert!(s.has_operator_key().await.unwrap());
        assert!(s.key(&survivor).await.unwrap().revoked_at.is_none());
    }
}
