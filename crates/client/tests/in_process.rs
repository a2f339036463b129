//! The client over an in-process connection: the same requests, answers
//! and errors as over the network, with no socket.

use axum::http::HeaderMap;
use axum::routing::get;
use axum::{Json, Router};
use flotilla_client::{Client, InProcess, RetryPolicy};

/// `router` served on every connection the client opens.
fn served(router: Router) -> InProcess {
    InProcess::new(move || {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(server), service)
                .with_upgrades()
                .await;
        });
        client
    })
}

#[tokio::test]
async fn requests_reach_the_router_with_the_key_and_answers_decode() {
    let router = Router::new()
        .route(
            "/v1/echo",
            get(|h: HeaderMap| async move {
                let auth = h
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_string();
                Json(serde_json::json!({ "auth": auth }))
            }),
        )
        .fallback(|| async {
            (
                axum::http::StatusCode::NOT_FOUND,
                Json(
                    serde_json::json!({"error": {"code": "not_found", "message": "no such thing"}}),
                ),
            )
        });
    let client = Client::in_process(served(router), "flt_secret")
        .retry(RetryPolicy::none())
        .build()
        .unwrap();
    assert_eq!(client.servers(), [flotilla_client::IN_PROCESS_URL]);
    let v: serde_json::Value = client.get("/v1/echo", &[]).await.unwrap();
    assert_eq!(v["auth"], "Bearer flt_secret");
    let other = client.with_token("flt_other");
    let v: serde_json::Value = other.get("/v1/echo", &[]).await.unwrap();
    assert_eq!(v["auth"], "Bearer flt_other");
    let e = client
        .get::<serde_json::Value>("/v1/nothing", &[])
        .await
        .unwrap_err();
    assert_eq!(e.status(), Some(404));
    assert_eq!(e.message(), "no such thing");
}
