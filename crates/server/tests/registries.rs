//! Registry credentials over real HTTP: validation names the field, the
//! secret is write-only and sealed at rest, another tenant neither sees nor
//! uses a credential, and an assignment carries the login only for an
//! instance whose image is on that registry, only until the agent reports
//! it. Also the node image cache an agent reports, shown on the node.
//!
//! No registry is reachable here, so a real pull with the credential is not
//! tested: the agent's side is the container runtime's `ensure_image`.

use std::time::Duration;

use flotilla_core::api::ObservedPhase;
use flotilla_core::node::RuntimeKind;
use flotilla_testkit::server::{fast, start, TestServer as Server};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

const SECRET: &str = "glpat-very-secret-token-0123456789";

async fn tenant(s: &Server, name: &str) -> (String, String, String) {
    let id = s.create_tenant(name).await;
    let admin = s.key(&id, "tenant_admin").await;
    let member = s.key(&id, "tenant_member").await;
    (id, admin, member)
}

async fn wait_for<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test]
async fn bad_credentials_are_refused_naming_the_field_and_store_nothing() {
    let s = start(fast()).await;
    let (_, admin, member) = tenant(&s, "acme").await;
    let cases = [
        (
            json!({"registry": "https://r.example", "username": "u", "secret": "s"}),
            "registry",
        ),
        (
            json!({"registry": "r.example/path", "username": "u", "secret": "s"}),
            "registry",
        ),
        (
            json!({"registry": "r.example:99999", "username": "u", "secret": "s"}),
            "registry",
        ),
        (
            json!({"registry": "r.example", "username": "", "secret": "s"}),
            "username",
        ),
        (
            json!({"registry": "r.example", "username": "u", "secret": ""}),
            "secret",
        ),
        (
            json!({"registry": "r.example", "username": "u", "secret": "x".repeat(9000)}),
            "secret",
        ),
    ];
    for (body, field) in cases {
        let r = post_login(&s, &admin, body.clone()).await;
        assert_eq!(
            r.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{body}: {}",
            r.body
        );
        assert_eq!(
            r.body["error"]["details"]["field"], field,
            "{body}: {}",
            r.body
        );
    }
    for body in [
        json!({"registry": "r.example", "username": "u"}),
        json!({"registry": "r.example", "username": "u", "secret": "s", "email": "x"}),
    ] {
        let r = post_login(&s, &admin, body.clone()).await;
        assert!(r.status.is_client_error(), "{body}: {}", r.status);
    }
    // Members use them (through their instances) but do not manage them.
    let r = post_login(
        &s,
        &member,
        json!({"registry": "r.example", "username": "u", "secret": "s"}),
    )
    .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let list = s
        .ok(&member, Method::GET, "/v1/registry-credentials", None)
        .await;
    assert_eq!(list["items"], json!([]));
}

#[tokio::test]
async fn the_secret_is_write_only_sealed_and_the_tenants_alone() {
    let s = start(fast()).await;
    let (_, a_admin, a_member) = tenant(&s, "tenant-a").await;
    let (_, b_admin, b_member) = tenant(&s, "tenant-b").await;
    let body = json!({"registry": "Registry.Example.com", "username": "ci-bot", "secret": SECRET});
    let r = post_login(&s, &a_admin, body.clone()).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert!(!r.body.to_string().contains(SECRET), "{}", r.body);
    assert!(r.body.get("secret").is_none());
    assert_eq!(r.body["registry"], "registry.example.com");
    let id = r.body["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("rcred_"));

    let list = s
        .ok(&a_member, Method::GET, "/v1/registry-credentials", None)
        .await;
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    assert!(!list.to_string().contains(SECRET));

    // At rest: sealed.
    let sealed = s
        .store
        .sealed_registry_secret(&flotilla_core::id::RegistryCredentialId::parse(&id, "id").unwrap())
        .await
        .unwrap();
    assert!(sealed.starts_with("v1:") && !sealed.contains(SECRET));

    // One per registry.
    let r = post_login(&s, &a_admin, body).await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.body);

    // Tenant B sees nothing and cannot remove it.
    for key in [&b_admin, &b_member] {
        let list = s
            .ok(key, Method::GET, "/v1/registry-credentials", None)
            .await;
        assert_eq!(list["items"], json!([]));
        assert_eq!(remove(&s, key, &id).await, StatusCode::NOT_FOUND);
    }
    // A's member may not remove it; A's admin may.
    assert_eq!(remove(&s, &a_member, &id).await, StatusCode::FORBIDDEN);
    assert_eq!(remove(&s, &a_admin, &id).await, StatusCode::NO_CONTENT);
    let list = s
        .ok(&a_member, Method::GET, "/v1/registry-credentials", None)
        .await;
    assert_eq!(list["items"], json!([]));
}

async fn post_login(s: &Server, key: &str, body: Value) -> flotilla_testkit::server::Resp {
    s.request(key, Method::POST, "/v1/registry-credentials", Some(body))
        .await
}

async fn remove(s: &Server, key: &str, id: &str) -> StatusCode {
    s.request(
        key,
        Method::DELETE,
        &format!("/v1/registry-credentials/{id}"),
        None,
    )
    .await
    .status
}

fn auth_of<'a>(assignments: &'a [Value], inst: &str) -> &'a Value {
    let a = assignments
        .iter()
        .find(|a| a["instance_id"] == inst)
        .unwrap_or_else(|| panic!("no assignment for {inst}: {assignments:?}"));
    &a["registry_auth"]
}

#[tokio::test]
async fn an_assignment_carries_the_login_only_for_its_registry_and_tenant() {
    let s = start(fast()).await;
    let (a, a_admin, a_member) = tenant(&s, "tenant-a").await;
    let (_, b_admin, b_member) = tenant(&s, "tenant-b").await;
    let provider = s.key(&a, "provider").await;
    // Image instances are placed on container nodes only.
    let node = s
        .register_node_running(
            &provider,
            "img-node",
            &[("H100", 4)],
            RuntimeKind::Container,
        )
        .await;
    s.ok(
        &a_admin,
        Method::POST,
        "/v1/registry-credentials",
        Some(json!({"registry": "registry.example.com", "username": "ci-bot", "secret": SECRET})),
    )
    .await;
    // B has a login elsewhere only.
    s.ok(
        &b_admin,
        Method::POST,
        "/v1/registry-credentials",
        Some(json!({"registry": "ghcr.io", "username": "b", "secret": "b-secret"})),
    )
    .await;
    let create = |key: String, image: &'static str| {
        let s = &s;
        async move {
            s.ok(
                &key,
                Method::POST,
                "/v1/instances",
                Some(json!({"gpus": 1, "image": image})),
            )
            .await["id"]
                .as_str()
                .unwrap()
                .to_string()
        }
    };
    let private = create(a_member.clone(), "registry.example.com/team/app:1").await;
    let public = create(a_member.clone(), "docker.io/library/busybox:1").await;
    let elsewhere = create(a_member.clone(), "other.example.com/team/app:1").await;
    let b_same_registry = create(b_member.clone(), "registry.example.com/b/app:1").await;
    wait_for("all four placed on the node", || async {
        s.sync(&provider, &node, Vec::new()).await.len() == 4
    })
    .await;
    let assignments = s.sync(&provider, &node, Vec::new()).await;
    let auth = auth_of(&assignments, &private);
    assert_eq!(auth["registry"], "registry.example.com");
    assert_eq!(auth["username"], "ci-bot");
    assert_eq!(auth["secret"], SECRET);
    for other in [&public, &elsewhere, &b_same_registry] {
        assert!(
            auth_of(&assignments, other).is_null(),
            "{other}: {assignments:?}"
        );
    }
    // Once the agent reports the instance, the login is not sent again.
    let again = s
        .sync(
            &provider,
            &node,
            vec![(private.clone(), ObservedPhase::Starting)],
        )
        .await;
    assert!(auth_of(&again, &private).is_null(), "{again:?}");
}

#[tokio::test]
async fn a_nodes_image_cache_is_reported_with_its_sync_and_shown_on_the_node() {
    let s = start(fast()).await;
    let t = s.create_tenant("prov").await;
    let provider = s.key(&t, "provider").await;
    let node = s
        .register_node_running(
            &provider,
            "cache-node",
            &[("H100", 1)],
            RuntimeKind::Container,
        )
        .await;
    let images = json!([
        {"image": "registry.example.com/app:1", "id": "sha256:aaa", "size_bytes": 123456789,
         "last_used": "2026-01-02T03:04:05Z"},
        {"image": "busybox:latest", "id": "sha256:bbb", "size_bytes": 4096,
         "last_used": "2026-01-03T03:04:05Z"}
    ]);
    let sync = format!("/v1/agent/nodes/{node}/sync");
    s.ok(
        &provider,
        Method::POST,
        &sync,
        Some(json!({"observed": [], "images": images})),
    )
    .await;
    let shown = s
        .ok(&provider, Method::GET, &format!("/v1/nodes/{node}"), None)
        .await;
    assert_eq!(shown["images"][0]["image"], "busybox:latest", "{shown}");
    assert_eq!(shown["images"][1]["size_bytes"], 123456789);
    assert_eq!(shown["images"][1]["id"], "sha256:aaa");
    // A sync without the field keeps what was reported.
    s.ok(
        &provider,
        Method::POST,
        &sync,
        Some(json!({"observed": []})),
    )
    .await;
    let shown = s
        .ok(&s.operator, Method::GET, &format!("/v1/nodes/{node}"), None)
        .await;
    assert_eq!(shown["images"].as_array().unwrap().len(), 2);
    // A bad entry names itself and changes nothing.
    let r = s
        .request(
            &provider,
            Method::POST,
            &sync,
            Some(json!({"observed": [], "images": [
                {"image": "a", "id": "sha256:1", "size_bytes": 1},
                {"image": "a", "id": "sha256:2", "size_bytes": 1}
            ]})),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    assert_eq!(r.body["error"]["details"]["field"], "images[1].image");
    let shown = s
        .ok(&provider, Method::GET, &format!("/v1/nodes/{node}"), None)
        .await;
    assert_eq!(shown["images"].as_array().unwrap().len(), 2);
    // An empty report empties it.
    s.ok(
        &provider,
        Method::POST,
        &sync,
        Some(json!({"observed": [], "images": []})),
    )
    .await;
    let shown = s
        .ok(&provider, Method::GET, &format!("/v1/nodes/{node}"), None)
        .await;
    assert!(shown.get("images").is_none(), "{shown}");
}
