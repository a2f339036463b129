//! Registered SSH public keys, on every backend: stored and listed per
//! tenant, found by fingerprint only within their tenant, one fingerprint
//! once per tenant, and removed only by their own tenant.

use flotilla_core::id::{SshKeyId, TenantId};
use flotilla_core::ssh_key::SshKey;
use flotilla_store::{Store, StoreError};
use flotilla_testdb::{rnd, t0};

flotilla_testdb::backend_suite!(
    "ssh_keys":
    keys_round_trip_and_a_fingerprint_is_registered_once_per_tenant,
    another_tenant_neither_sees_nor_matches_nor_removes_a_key,
);

async fn tenant(s: &Store) -> TenantId {
    let t = TenantId::generate(1, rnd());
    s.create_tenant(&t, &format!("t{}", rnd()), t0())
        .await
        .unwrap();
    t
}

fn key(fingerprint: &str) -> SshKey {
    SshKey {
        id: SshKeyId::generate(1, rnd()),
        name: "laptop".into(),
        algorithm: "ssh-ed25519".into(),
        fingerprint: fingerprint.into(),
        public_key: format!("ssh-ed25519 AAAA{fingerprint}"),
        created_at: t0(),
    }
}

async fn keys_round_trip_and_a_fingerprint_is_registered_once_per_tenant(s: &Store) {
    let t = tenant(s).await;
    let a = s.add_ssh_key(&t, &key("SHA256:aaa")).await.unwrap();
    let b = s.add_ssh_key(&t, &key("SHA256:bbb")).await.unwrap();
    let listed = s.ssh_keys(&t).await.unwrap();
    assert_eq!(listed.len(), 2);
    assert!(listed.contains(&a) && listed.contains(&b));
    assert_eq!(
        s.ssh_key_by_fingerprint(&t, "SHA256:aaa").await.unwrap(),
        Some(a.clone())
    );
    assert_eq!(
        s.ssh_key_by_fingerprint(&t, "SHA256:zzz").await.unwrap(),
        None
    );

    let dup = s.add_ssh_key(&t, &key("SHA256:aaa")).await.unwrap_err();
    assert!(
        matches!(&dup, StoreError::AlreadyExists(m) if m.contains("SHA256:aaa")),
        "{dup:?}"
    );

    s.delete_ssh_key(&t, &a.id).await.unwrap();
    assert_eq!(s.ssh_keys(&t).await.unwrap(), vec![b]);
    assert_eq!(
        s.ssh_key_by_fingerprint(&t, "SHA256:aaa").await.unwrap(),
        None
    );
    assert!(matches!(
        s.delete_ssh_key(&t, &a.id).await,
        Err(StoreError::NotFound(_))
    ));
    // Removed, the fingerprint may be registered again.
    s.add_ssh_key(&t, &key("SHA256:aaa")).await.unwrap();
}

async fn another_tenant_neither_sees_nor_matches_nor_removes_a_key(s: &Store) {
    let (a, b) = (tenant(s).await, tenant(s).await);
    let k = s.add_ssh_key(&a, &key("SHA256:shared")).await.unwrap();
    assert!(s.ssh_keys(&b).await.unwrap().is_empty());
    assert_eq!(
        s.ssh_key_by_fingerprint(&b, "SHA256:shared").await.unwrap(),
        None
    );
    assert!(matches!(
        s.delete_ssh_key(&b, &k.id).await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(s.ssh_keys(&a).await.unwrap(), vec![k]);
    // The same key may be registered by another tenant (one person in
    // two tenants).
    s.add_ssh_key(&b, &key("SHA256:shared")).await.unwrap();
}
