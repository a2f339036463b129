//! The typed route methods against a loopback server that records what it
//! was asked: each method sends its route's method, path and query, and
//! reads the answer as the route's type.

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use flotilla_billing::api::{AddedTerm, NewTerm};
use flotilla_client::{Client, UsageRange};
use flotilla_core::id::{NodeId, RegistryCredentialId, TenantId};
use flotilla_core::job::JobState;
use serde_json::{json, Value};

/// Requests seen: `METHOD path?query` and the body.
type Seen = Arc<Mutex<Vec<(String, Value)>>>;

/// Answers every request with `answer(path)` and records it.
async fn serve(answer: fn(&str) -> Response) -> (Client, Seen) {
    let seen: Seen = Arc::default();
    let log = seen.clone();
    let app = Router::new().fallback(move |method: Method, uri: Uri, body: Bytes| {
        let log = log.clone();
        async move {
            let body = serde_json::from_slice(&body).unwrap_or(Value::Null);
            log.lock().unwrap().push((format!("{method} {uri}"), body));
            answer(uri.path())
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (Client::new(&url, "key").unwrap(), seen)
}

fn empty_page(_: &str) -> Response {
    Json(json!({"items": [], "next_cursor": null})).into_response()
}

fn lines(seen: &Seen) -> Vec<String> {
    seen.lock()
        .unwrap()
        .iter()
        .map(|(l, _)| l.clone())
        .collect()
}

#[tokio::test]
async fn list_methods_send_their_filters_as_query_parameters() {
    let (c, seen) = serve(empty_page).await;
    let tenant = TenantId::parse("ten_01jd3x7k2q9v8m4n6p5r0s1t2w", "t").unwrap();
    assert!(c.audit(Some(&tenant), Some(5)).await.unwrap().is_empty());
    let range = UsageRange {
        from: "2025-01-01T00:00:00Z".into(),
        to: "2025-02-01T00:00:00Z".into(),
    };
    assert!(c.usage(&range).await.unwrap().is_empty());
    assert!(c.jobs(Some(JobState::Queued)).await.unwrap().is_empty());
    assert!(c.instances(None, None).await.unwrap().is_empty());
    assert!(c.job_queue().await.unwrap().is_empty());
    assert!(c.registry_credentials().await.unwrap().is_empty());
    assert_eq!(
        lines(&seen),
        [
            "GET /v1/audit?tenant_id=ten_01jd3x7k2q9v8m4n6p5r0s1t2w&limit=5",
            "GET /v1/usage?from=2025-01-01T00%3A00%3A00Z&to=2025-02-01T00%3A00%3A00Z&limit=100",
            "GET /v1/jobs?state=queued&limit=100",
            "GET /v1/instances?limit=100",
            "GET /v1/jobs/queue",
            "GET /v1/registry-credentials",
        ]
    );
}

#[tokio::test]
async fn actions_post_an_empty_object_and_deletes_name_the_object() {
    let (c, seen) = serve(|_| StatusCode::NO_CONTENT.into_response()).await;
    let node = NodeId::parse("node_01jd3x7k2q9v8m4n6p5r0s1t2w", "n").unwrap();
    // No body decodes as no node: the request is what is checked here.
    c.cordon_node(&node, false).await.unwrap_err();
    let cred = RegistryCredentialId::parse("rcred_01jd3x7k2q9v8m4n6p5r0s1t2w", "r").unwrap();
    c.remove_registry_credential(&cred).await.unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen[0],
        (
            "POST /v1/nodes/node_01jd3x7k2q9v8m4n6p5r0s1t2w/uncordon".to_string(),
            json!({})
        )
    );
    assert_eq!(
        seen[1].0,
        "DELETE /v1/registry-credentials/rcred_01jd3x7k2q9v8m4n6p5r0s1t2w"
    );
}

#[tokio::test]
async fn an_added_term_is_read_as_the_kind_asked_for() {
    let (c, seen) = serve(|_| {
        (
            StatusCode::CREATED,
            Json(json!({
                "id": "promo", "tenant": "ten_01jd3x7k2q9v8m4n6p5r0s1t2w", "kind": "promotional",
                "amount": "25", "granted_at": "2025-01-01T00:00:00Z", "expires_at": null
            })),
        )
            .into_response()
    })
    .await;
    let term: NewTerm = serde_json::from_value(json!({
        "kind": "credit", "id": "promo", "credit_kind": "promotional", "amount": "25",
        "granted_at": null, "expires_at": null
    }))
    .unwrap();
    let added = c
        .add_term("ten_01jd3x7k2q9v8m4n6p5r0s1t2w", &term)
        .await
        .unwrap();
    assert!(matches!(added, AddedTerm::Credit(_)), "{added:?}");
    assert_eq!((added.kind(), added.id()), ("credit", "promo"));
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen[0].0,
        "POST /v1/tenants/ten_01jd3x7k2q9v8m4n6p5r0s1t2w/terms"
    );
    assert_eq!(seen[0].1["kind"], "credit");
    // On the wire the added term is the bare grant, as the server wrote it.
    assert_eq!(serde_json::to_value(&added).unwrap()["amount"], "25");
}
