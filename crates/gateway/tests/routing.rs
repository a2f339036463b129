//! Routing and refusals: by path, host and model; 401, 404 across tenants,
//! 429 over the rate limit, 402 over the hard cap, 400 without a model, and
//! the activator's full queue (429) and passed deadline (503).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use flotilla_core::gateway::RouteTable;
use flotilla_gateway::StaticControl;
use serde_json::Value;

async fn error_code(resp: reqwest::Response) -> (u16, String, Option<String>) {
    let status = resp.status().as_u16();
    let retry = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body: Value = resp.json().await.expect("an error is JSON");
    let code = body["error"]["code"]
        .as_str()
        .expect("error.code")
        .to_string();
    assert!(
        body["error"]["message"].is_string(),
        "error.message in {body}"
    );
    assert!(body["error"]["type"].is_string(), "error.type in {body}");
    (status, code, retry)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_reach_their_endpoint_by_path_host_and_model_and_others_are_refused() {
    let emu = emulator(|_| {}).await;
    let control = Arc::new(StaticControl::new());
    let alice = tenant();
    let bob = tenant();
    let limited_emu = emulator(|c| c.model = "limited-model".into()).await;
    let mut limited = route(&alice, "limited", vec![replica(&limited_emu, 1)]);
    limited.models = vec!["limited-model".into()];
    limited.rate_limit_rps = Some(2);
    let chat_ep = route(&alice, "chat", vec![replica(&emu, 1)]);
    control.set_routes(RouteTable {
        endpoints: vec![chat_ep.clone(), limited.clone()],
    });
    control.set_key("alice-key", grant(&alice));
    control.set_key("bob-key", grant(&bob));
    let mut capped = grant(&alice);
    capped.over_hard_cap = true;
    control.set_key("capped-key", capped);
    let mut scoped = grant(&alice);
    scoped.endpoints = vec![limited.id.clone()];
    control.set_key("scoped-key", scoped);
    let mut cfg = config();
    cfg.domain = Some("gw.test".into());
    let gw = gateway(&control, cfg).await;
    let http = client();
    let url = gw.url();
    let body = chat("hello", 2, false);

    // By model, by path prefix, by host.
    let r = post(
        &http,
        &format!("{url}/v1/chat/completions"),
        "alice-key",
        &body,
    )
    .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 2);
    let r = post(
        &http,
        &format!("{url}/e/chat/v1/chat/completions"),
        "alice-key",
        &body,
    )
    .await;
    assert_eq!(r.status(), 200);
    let r = post_host(
        &http,
        &format!("{url}/v1/chat/completions"),
        "chat.gw.test",
        "alice-key",
        &serde_json::json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(r.status(), 200, "host routing needs no model");

    // The caller's models.
    let r = http
        .get(format!("{url}/v1/models"))
        .bearer_auth("alice-key")
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    let mut ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, vec![MODEL, "limited-model"]);
    let r = http
        .get(format!("{url}/v1/models"))
        .bearer_auth("bob-key")
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["data"].as_array().unwrap().len(), 0);

    // 401: no key, unknown key.
    let r = http
        .post(format!("{url}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(error_code(r).await.0, 401);
    let r = post(
        &http,
        &format!("{url}/v1/chat/completions"),
        "nobody",
        &body,
    )
    .await;
    assert_eq!(error_code(r).await, (401, "invalid_api_key".into(), None));

    // 404: another tenant's endpoint, by name, host and model.
    let r = post(
        &http,
        &format!("{url}/e/chat/v1/chat/completions"),
        "bob-key",
        &body,
    )
    .await;
    assert_eq!(
        error_code(r).await,
        (404, "endpoint_not_found".into(), None)
    );
    let r = post_host(
        &http,
        &format!("{url}/v1/chat/completions"),
        "chat.gw.test",
        "bob-key",
        &body,
    )
    .await;
    assert_eq!(error_code(r).await.0, 404);
    let r = post(
        &http,
        &format!("{url}/v1/chat/completions"),
        "bob-key",
        &body,
    )
    .await;
    assert_eq!(error_code(r).await, (404, "model_not_found".into(), None));
    // A key scoped to another endpoint of the same tenant: 404 too.
    let r = post(
        &http,
        &format!("{url}/e/chat/v1/chat/completions"),
        "scoped-key",
        &body,
    )
    .await;
    assert_eq!(error_code(r).await.0, 404);

    // 400 naming the field.
    let r = post(
        &http,
        &format!("{url}/v1/chat/completions"),
        "alice-key",
        &serde_json::json!({"messages": []}),
    )
    .await;
    let status = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(status, 400);
    assert!(
        v["error"]["message"].as_str().unwrap().starts_with("model"),
        "{v}"
    );

    // 402 over the hard cap.
    let r = post(
        &http,
        &format!("{url}/v1/chat/completions"),
        "capped-key",
        &body,
    )
    .await;
    assert_eq!(
        error_code(r).await,
        (402, "insufficient_quota".into(), None)
    );

    // 429 over the key's rate limit (2/s, burst 2), with Retry-After.
    let limited_body =
        serde_json::json!({"model": "limited-model", "prompt": "x", "max_tokens": 1});
    let mut statuses = Vec::new();
    let mut retry_after = None;
    for _ in 0..6 {
        let r = post(
            &http,
            &format!("{url}/v1/completions"),
            "alice-key",
            &limited_body,
        )
        .await;
        statuses.push(r.status().as_u16());
        if r.status() == 429 {
            let (_, code, retry) = error_code(r).await;
            assert_eq!(code, "rate_limit_exceeded");
            retry_after = retry;
        }
    }
    assert!(
        statuses.iter().filter(|s| **s == 200).count() >= 2,
        "{statuses:?}"
    );
    assert!(statuses.contains(&429), "{statuses:?}");
    assert_eq!(retry_after.as_deref(), Some("1"));
    // Another key has its own budget.
    let r = post(
        &http,
        &format!("{url}/v1/completions"),
        "scoped-key",
        &limited_body,
    )
    .await;
    assert_eq!(r.status(), 200);

    // The gateway's own surfaces.
    let r = http.get(format!("{url}/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // `/metrics` names every endpoint: an operator's key only.
    for key in [None, Some("alice-key")] {
        let mut req = http.get(format!("{url}/metrics"));
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        let r = req.send().await.unwrap();
        assert_eq!(error_code(r).await.0, 401, "{key:?}");
    }
    control.set_operator_key("operator-key");
    let metrics = http
        .get(format!("{url}/metrics"))
        .bearer_auth("operator-key")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("gateway_requests_total"), "{metrics}");
    assert!(
        metrics.contains("gateway_time_to_first_byte_seconds_bucket"),
        "{metrics}"
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_429_and_a_passed_deadline_503() {
    let control = Arc::new(StaticControl::new());
    let alice = tenant();
    let mut ep = route(&alice, "cold", Vec::new());
    ep.queue_limit = 2;
    ep.queue_timeout_ms = 2000;
    control.set_routes(RouteTable {
        endpoints: vec![ep],
    });
    control.set_key("k", grant(&alice));
    let gw = gateway(&control, config()).await;
    let http = client();
    let send = |http: reqwest::Client, url: String| async move {
        let started = std::time::Instant::now();
        let r = post(
            &http,
            &format!("{url}/v1/chat/completions"),
            "k",
            &chat("hi", 1, false),
        )
        .await;
        (started.elapsed(), error_code(r).await)
    };
    let a = tokio::spawn(send(http.clone(), gw.url()));
    let b = tokio::spawn(send(http.clone(), gw.url()));
    let queued = || control.reports().iter().any(|s| s.queued == 2);
    wait_until(
        "two queued requests reported",
        Duration::from_secs(10),
        queued,
    )
    .await;
    let (took, third) = send(http.clone(), gw.url()).await;
    assert_eq!(third, (429, "queue_full".into(), Some("1".into())));
    assert!(
        took < Duration::from_millis(300),
        "a full queue answers at once, took {took:?}"
    );
    for waiter in [a, b] {
        let (took, r) = waiter.await.unwrap();
        assert_eq!(r, (503, "no_replica_available".into(), Some("1".into())));
        assert!(
            took >= Duration::from_millis(1900),
            "answered at the deadline, took {took:?}"
        );
        assert!(
            took < Duration::from_secs(10),
            "not long past it, took {took:?}"
        );
    }
    // Refused requests are metered too, with their status and no replica.
    wait_until("3 usage records", Duration::from_secs(10), || {
        control.usage().len() == 3
    })
    .await;
    let usage = control.usage();
    assert!(usage.iter().all(|u| u.instance_id.is_none()));
    assert_eq!(usage.iter().filter(|u| u.status == 503).count(), 2);
    gw.shutdown().await;
}

/// A control plane that answers key lookups slowly and counts them.
struct SlowKeys {
    inner: Arc<StaticControl>,
    asked: std::sync::atomic::AtomicU32,
}

impl flotilla_gateway::Control for SlowKeys {
    fn routes(&self) -> flotilla_gateway::ControlFuture<'_, RouteTable> {
        self.inner.routes()
    }

    fn authorize<'a>(
        &'a self,
        key: &'a str,
    ) -> flotilla_gateway::ControlFuture<'a, Option<flotilla_core::gateway::KeyGrant>> {
        self.asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            self.inner.authorize(key).await
        })
    }

    fn report(
        &self,
        signals: Vec<flotilla_core::gateway::EndpointSignals>,
    ) -> flotilla_gateway::ControlFuture<'_, ()> {
        self.inner.report(signals)
    }

    fn meter(
        &self,
        usage: Vec<flotilla_core::gateway::RequestUsage>,
    ) -> flotilla_gateway::ControlFuture<'_, ()> {
        self.inner.meter(usage)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_with_an_uncached_key_ask_the_control_plane_once() {
    use flotilla_gateway::Control;
    let alice = tenant();
    let statik = Arc::new(StaticControl::new());
    statik.set_routes(RouteTable {
        endpoints: vec![route(&alice, "chat", Vec::new())],
    });
    statik.set_key("alice-key", grant(&alice));
    let control = Arc::new(SlowKeys {
        inner: statik,
        asked: Default::default(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let cfg = flotilla_gateway::GatewayConfig {
        auth_cache_ttl: Duration::from_secs(60),
        ..config()
    };
    let gw = flotilla_gateway::serve(listener, control.clone() as Arc<dyn Control>, cfg)
        .await
        .expect("gateway starts");
    let http = client();
    let url = gw.url();
    let calls = |key: &'static str| {
        let (http, url) = (http.clone(), url.clone());
        (0..20).map(move |_| {
            let (http, url) = (http.clone(), format!("{url}/v1/models"));
            tokio::spawn(async move {
                http.get(url)
                    .bearer_auth(key)
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
                    .unwrap_or(0)
            })
        })
    };
    let good: Vec<_> = calls("alice-key").collect();
    for h in good {
        assert_eq!(h.await.unwrap(), 200);
    }
    assert_eq!(control.asked.load(std::sync::atomic::Ordering::SeqCst), 1);
    let bad: Vec<_> = calls("nobody-key").collect();
    for h in bad {
        assert_eq!(h.await.unwrap(), 401);
    }
    // The unknown key was asked about once too, and its absence cached.
    assert_eq!(control.asked.load(std::sync::atomic::Ordering::SeqCst), 2);
    gw.shutdown().await;
}
