//! The client against small real HTTP servers on loopback: retry with
//! backoff and `Retry-After`, failover across server URLs, and decoding of
//! answers and error bodies.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use flotilla_client::{Client, Error, RetryPolicy, TransportKind};
use flotilla_core::api::Page;
use serde_json::{json, Value};

/// What a test server has seen.
#[derive(Default)]
struct Seen {
    hits: AtomicUsize,
    keys: Mutex<Vec<Option<String>>>,
}

type Handler = Arc<dyn Fn(usize) -> Response + Send + Sync>;

/// Serves every path with `answer(hit_number)` (0-based) and counts hits.
async fn serve(answer: impl Fn(usize) -> Response + Send + Sync + 'static) -> (String, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let answer: Handler = Arc::new(answer);
    let handler = |State((seen, answer)): State<(Arc<Seen>, Handler)>, headers: HeaderMap| async move {
        let n = seen.hits.fetch_add(1, Ordering::SeqCst);
        let key = headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        seen.keys.lock().unwrap().push(key);
        answer(n)
    };
    let app = Router::new()
        .fallback(handler)
        .with_state((seen.clone(), answer));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

/// A loopback URL nothing listens on.
async fn closed_port() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    url
}

fn ok(v: Value) -> Response {
    Json(v).into_response()
}

fn error(status: StatusCode, code: &str, field: Option<&str>) -> Response {
    let details = field.map_or(json!({}), |f| json!({ "field": f }));
    let body =
        json!({"error": {"code": code, "message": format!("{code} happened"), "details": details}});
    (status, Json(body)).into_response()
}

fn fast() -> RetryPolicy {
    RetryPolicy {
        attempts: 3,
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_secs(3),
    }
}

fn client(servers: &str) -> Client {
    Client::builder(servers, "key")
        .retry(fast())
        .build()
        .unwrap()
}

#[tokio::test]
async fn transient_failures_of_a_get_are_retried_until_it_succeeds() {
    let (url, seen) = serve(|n| match n {
        0 => (StatusCode::BAD_GATEWAY, "<html>proxy</html>").into_response(),
        1 => error(StatusCode::INTERNAL_SERVER_ERROR, "internal", None),
        _ => ok(json!({"n": n})),
    })
    .await;
    let v: Value = client(&url).get("/v1/x", &[]).await.unwrap();
    assert_eq!(v, json!({"n": 2}));
    assert_eq!(seen.hits.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn retries_stop_after_the_policy_s_attempts() {
    let (url, seen) = serve(|_| error(StatusCode::BAD_GATEWAY, "upstream", None)).await;
    let e = client(&url).get::<Value>("/v1/x", &[]).await.unwrap_err();
    assert_eq!(e.status(), Some(502));
    assert_eq!(seen.hits.load(Ordering::SeqCst), 3);
    let (url, seen) = serve(|_| error(StatusCode::BAD_GATEWAY, "upstream", None)).await;
    let once = Client::builder(&url, "key")
        .retry(RetryPolicy::none())
        .build()
        .unwrap();
    once.get::<Value>("/v1/x", &[]).await.unwrap_err();
    assert_eq!(seen.hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_post_is_retried_with_the_same_idempotency_key() {
    let (url, seen) = serve(|n| match n {
        0 => error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", None),
        _ => ok(json!({"id": "inst_1"})),
    })
    .await;
    let v: Value = client(&url)
        .post("/v1/instances", &json!({}))
        .await
        .unwrap();
    assert_eq!(v["id"], "inst_1");
    let keys = seen.keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 2);
    assert!(keys[0].is_some(), "a POST carries a key");
    assert_eq!(keys[0], keys[1], "a retry resends the same key");
    // Another call is another operation: another key.
    let _: Value = client(&url)
        .post("/v1/instances", &json!({}))
        .await
        .unwrap();
    assert_ne!(seen.keys.lock().unwrap()[2], keys[0]);
}

#[tokio::test]
async fn errors_a_retry_cannot_fix_are_returned_at_once_and_decoded() {
    let (url, seen) = serve(|_| {
        error(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_field",
            Some("gpus"),
        )
    })
    .await;
    let e = client(&url).get::<Value>("/v1/x", &[]).await.unwrap_err();
    assert_eq!(seen.hits.load(Ordering::SeqCst), 1);
    match e {
        Error::Api {
            status,
            code,
            message,
            field,
            ..
        } => {
            assert_eq!(status, 422);
            assert_eq!(code, "invalid_field");
            assert_eq!(message, "invalid_field happened");
            assert_eq!(field.as_deref(), Some("gpus"));
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn retry_after_is_waited_for_and_a_longer_one_is_left_to_the_caller() {
    let (url, seen) = serve(|n| match n {
        0 => {
            let mut r = error(StatusCode::TOO_MANY_REQUESTS, "rate_limited", None);
            r.headers_mut().insert("retry-after", "1".parse().unwrap());
            r
        }
        _ => ok(json!(1)),
    })
    .await;
    let started = Instant::now();
    let v: u32 = client(&url).get("/v1/x", &[]).await.unwrap();
    assert_eq!(v, 1);
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(seen.hits.load(Ordering::SeqCst), 2);

    let (url, seen) = serve(|_| {
        let mut r = error(StatusCode::TOO_MANY_REQUESTS, "rate_limited", None);
        r.headers_mut()
            .insert("retry-after", "120".parse().unwrap());
        r
    })
    .await;
    let e = client(&url).get::<Value>("/v1/x", &[]).await.unwrap_err();
    assert_eq!(seen.hits.load(Ordering::SeqCst), 1);
    match e {
        Error::Api {
            status,
            retry_after,
            ..
        } => {
            assert_eq!(status, 429);
            assert_eq!(retry_after, Some(Duration::from_secs(120)));
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn an_unreachable_server_fails_over_to_the_next_and_it_is_remembered() {
    let dead = closed_port().await;
    let (live, seen) = serve(|n| ok(json!(n))).await;
    let c = Client::builder(&format!("{dead},{live}"), "key")
        .retry(RetryPolicy::none())
        .build()
        .unwrap();
    assert_eq!(c.current_server(), dead);
    let v: usize = c.get("/v1/x", &[]).await.unwrap();
    assert_eq!(v, 0);
    assert_eq!(c.current_server(), live);
    // Clones share the memory.
    let v: usize = c.clone().get("/v1/x", &[]).await.unwrap();
    assert_eq!(v, 1);
    assert_eq!(seen.hits.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_503_fails_over_and_the_next_request_starts_at_the_server_that_answered() {
    let (draining, drained) =
        serve(|_| error(StatusCode::SERVICE_UNAVAILABLE, "unavailable", None)).await;
    let (live, seen) = serve(|n| ok(json!(n))).await;
    let c = Client::builder(&format!("{draining},{live}"), "key")
        .retry(RetryPolicy::none())
        .build()
        .unwrap();
    for _ in 0..3 {
        let _: usize = c.get("/v1/x", &[]).await.unwrap();
    }
    assert_eq!(
        drained.hits.load(Ordering::SeqCst),
        1,
        "asked once, then skipped"
    );
    assert_eq!(seen.hits.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn other_errors_do_not_fail_over() {
    let (first, first_seen) = serve(|_| error(StatusCode::NOT_FOUND, "not_found", None)).await;
    let (second, second_seen) = serve(|n| ok(json!(n))).await;
    let e = client(&format!("{first},{second}"))
        .get::<Value>("/v1/x", &[])
        .await
        .unwrap_err();
    assert!(e.is_not_found(), "{e}");
    assert_eq!(first_seen.hits.load(Ordering::SeqCst), 1);
    assert_eq!(second_seen.hits.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn no_server_reachable_names_them_all_after_the_retries() {
    let (a, b) = (closed_port().await, closed_port().await);
    let e = client(&format!("{a},{b}"))
        .get::<Value>("/v1/x", &[])
        .await
        .unwrap_err();
    match &e {
        Error::Transport { kind, server, .. } => {
            assert_eq!(*kind, TransportKind::Connect);
            assert_eq!(server, &format!("{a}, {b}"));
        }
        other => panic!("{other:?}"),
    }
    assert!(e.is_unreachable() && e.is_transient());
    assert_eq!(
        e.to_string(),
        format!("cannot reach the server at {a}, {b}")
    );
}

#[tokio::test]
async fn answers_of_the_wrong_shape_are_decode_errors() {
    let (url, _) = serve(|_| ok(json!({"items": "not a list"}))).await;
    let e = client(&url)
        .get::<Page<u32>>("/v1/x", &[])
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Decode { .. }), "{e}");
    assert!(!e.is_transient());
}

#[tokio::test]
async fn lists_follow_cursors_to_the_end() {
    let app = Router::new().route(
        "/v1/things",
        get(
            |q: axum::extract::Query<std::collections::HashMap<String, String>>| async move {
                let from: u32 = q.get("cursor").map_or(0, |c| c.parse().unwrap());
                let items: Vec<u32> = (from..(from + 2).min(5)).collect();
                let next = (from + 2 < 5).then(|| (from + 2).to_string());
                Json(json!({"items": items, "next_cursor": next}))
            },
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let c = client(&url);
    let all: Vec<u32> = c.list("/v1/things", &[], None).await.unwrap();
    assert_eq!(all, vec![0, 1, 2, 3, 4]);
    let some: Vec<u32> = c.list("/v1/things", &[], Some(3)).await.unwrap();
    assert_eq!(some, vec![0, 1, 2]);
}
