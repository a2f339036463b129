//! Registry credentials and node image caches, on every backend: a
//! credential's secret is sealed at rest and opens only with the key that
//! sealed it, only for its own tenant and registry; a node's reported
//! images replace what was stored.

use chrono::Duration;
use flotilla_core::api::{NodeImage, RegisterNode};
use flotilla_core::id::{NodeId, RegistryCredentialId, TenantId};
use flotilla_core::registry::CreateRegistryCredential;
use flotilla_store::secrets::{SecretError, SecretKey};
use flotilla_store::{Store, StoreError};
use flotilla_testdb::{rnd, t0};

flotilla_testdb::backend_suite!(
    "images":
    a_credential_round_trips_sealed_and_opens_only_with_its_key,
    another_tenant_neither_sees_nor_uses_nor_deletes_a_credential,
    a_nodes_reported_images_replace_the_stored_ones,
);

async fn tenant(s: &Store) -> TenantId {
    let t = TenantId::generate(1, rnd());
    s.create_tenant(&t, &format!("t{}", rnd()), t0())
        .await
        .unwrap();
    t
}

fn cred(registry: &str, secret: &str) -> CreateRegistryCredential {
    CreateRegistryCredential {
        registry: registry.into(),
        username: "robot$ci".into(),
        secret: secret.into(),
    }
    .validate()
    .unwrap()
}

async fn a_credential_round_trips_sealed_and_opens_only_with_its_key(s: &Store) {
    let key = SecretKey::generate();
    let t = tenant(s).await;
    let id = RegistryCredentialId::generate(1, rnd());
    let secret = "s3cr3t-token-that-must-never-be-stored-plain";
    let made = s
        .add_registry_credential(&id, &t, &cred("Registry.Example:5000", secret), &key, t0())
        .await
        .unwrap();
    assert_eq!(made.registry, "registry.example:5000");
    assert_eq!(
        s.registry_credentials(&t).await.unwrap(),
        vec![made.clone()]
    );

    // At rest: sealed, no trace of the secret (nor of its hex).
    let sealed = s.sealed_registry_secret(&id).await.unwrap();
    assert!(sealed.starts_with("v1:"));
    assert!(!sealed.contains(secret));
    assert!(!sealed.contains(&hex_of(secret)));

    // Opened for its registry only.
    let auth = s
        .registry_auth(&t, "registry.example:5000", &key)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (
            auth.registry.as_str(),
            auth.username.as_str(),
            auth.secret.as_str()
        ),
        ("registry.example:5000", "robot$ci", secret)
    );
    assert!(s
        .registry_auth(&t, "other.example", &key)
        .await
        .unwrap()
        .is_none());

    // Another key: a typed error, never an anonymous pull.
    let wrong = s
        .registry_auth(&t, "registry.example:5000", &SecretKey::generate())
        .await
        .unwrap_err();
    assert!(
        matches!(wrong, StoreError::Secret(SecretError::WrongKey)),
        "{wrong:?}"
    );

    // One per registry; deleting it frees the registry.
    let dup = s
        .add_registry_credential(
            &RegistryCredentialId::generate(1, rnd()),
            &t,
            &cred("registry.example:5000", "x"),
            &key,
            t0(),
        )
        .await
        .unwrap_err();
    assert!(matches!(dup, StoreError::AlreadyExists(_)), "{dup:?}");
    s.delete_registry_credential(&t, &id).await.unwrap();
    assert!(s.registry_credentials(&t).await.unwrap().is_empty());
    assert!(s
        .registry_auth(&t, "registry.example:5000", &key)
        .await
        .unwrap()
        .is_none());
    assert!(matches!(
        s.delete_registry_credential(&t, &id).await,
        Err(StoreError::NotFound(_))
    ));
}

fn hex_of(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

async fn another_tenant_neither_sees_nor_uses_nor_deletes_a_credential(s: &Store) {
    let key = SecretKey::generate();
    let (a, b) = (tenant(s).await, tenant(s).await);
    let id = RegistryCredentialId::generate(1, rnd());
    s.add_registry_credential(&id, &a, &cred("ghcr.io", "a-secret"), &key, t0())
        .await
        .unwrap();
    assert!(s.registry_credentials(&b).await.unwrap().is_empty());
    assert!(s
        .registry_auth(&b, "ghcr.io", &key)
        .await
        .unwrap()
        .is_none());
    assert!(matches!(
        s.delete_registry_credential(&b, &id).await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(s.registry_credentials(&a).await.unwrap().len(), 1);
    // Each tenant may have its own login to the same registry.
    s.add_registry_credential(
        &RegistryCredentialId::generate(1, rnd()),
        &b,
        &cred("ghcr.io", "b-secret"),
        &key,
        t0(),
    )
    .await
    .unwrap();
    let auth_b = s.registry_auth(&b, "ghcr.io", &key).await.unwrap().unwrap();
    assert_eq!(auth_b.secret, "b-secret");
    let auth_a = s.registry_auth(&a, "ghcr.io", &key).await.unwrap().unwrap();
    assert_eq!(auth_a.secret, "a-secret");
}

async fn a_nodes_reported_images_replace_the_stored_ones(s: &Store) {
    let t = tenant(s).await;
    let req = RegisterNode {
        name: format!("img-node-{}", rnd()),
        region: None,
        pool: None,
        cpu_milli: 8_000,
        memory_mb: 16_000,
        simulated: true,
        gpus: Vec::new(),
        agent_version: "test".into(),
        runtime: Default::default(),
        executor: Default::default(),
        running: Vec::new(),
        unenforced_limits: Vec::new(),
        network: None,
    };
    let node = s
        .register_node(&t, &req, || (NodeId::generate(1, rnd()), Vec::new()), t0())
        .await
        .unwrap()
        .id;
    assert!(s.node(&node).await.unwrap().images.is_empty());
    let img = |image: &str, used: Option<i64>| NodeImage {
        image: image.into(),
        id: format!("sha256:{image}"),
        size_bytes: 1 << 33,
        last_used: used.map(|s| t0() + Duration::seconds(s)),
    };
    let first = vec![img("a:1", Some(1)), img("b:1", Some(5)), img("c:1", None)];
    assert!(s.set_node_images(&node, &first, t0()).await.unwrap());
    let shown = s.node(&node).await.unwrap().images;
    assert_eq!(
        shown.iter().map(|i| i.image.as_str()).collect::<Vec<_>>(),
        ["b:1", "a:1", "c:1"],
        "most recently used first, never used last"
    );
    assert_eq!(shown[0], first[1]);
    // The same report again writes nothing.
    assert!(!s.set_node_images(&node, &first, t0()).await.unwrap());
    // A change replaces the whole set.
    let second = vec![img("b:1", Some(9))];
    assert!(s.set_node_images(&node, &second, t0()).await.unwrap());
    assert_eq!(s.node_images(&node).await.unwrap(), second);
    assert!(s.set_node_images(&node, &[], t0()).await.unwrap());
    assert!(s.node_images(&node).await.unwrap().is_empty());
}
