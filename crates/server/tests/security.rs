//! Fixes found by probing the API, each over real HTTP with a real SQLite
//! store: authentication before idempotent replays, a rate limit for
//! requests without a valid key, the last operator key, bounded numbers;
//! and the audit log of every mutating call.

use std::time::Duration;

use flotilla_server::ServerConfig;
use flotilla_testkit::server::{fast, start, TestServer as Server};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

async fn wait_for<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while tokio::time::Instant::now() < deadline {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

/// A tenant and its admin's secret.
async fn tenant_admin(s: &Server, name: &str) -> (String, String) {
    let t = s.create_tenant(name).await;
    let admin = s.key(&t, "tenant_admin").await;
    (t, admin)
}

async fn key_id(s: &Server, secret: &str) -> String {
    s.ok(secret, Method::GET, "/v1/me", None).await["key"]["id"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn a_revoked_key_gets_no_idempotent_replay() {
    let s = start(fast()).await;
    let (_t, admin) = tenant_admin(&s, "replay").await;
    let body = r#"{"role": "tenant_member", "name": "ci"}"#;
    let h = [("idempotency-key", "mint-1")];
    let first = s
        .raw(&admin, Method::POST, "/v1/keys", Some(body.into()), &h)
        .await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    let minted = first.body["secret"].as_str().unwrap().to_string();
    // While the key lives, a retry replays the answer.
    let again = s
        .raw(&admin, Method::POST, "/v1/keys", Some(body.into()), &h)
        .await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.headers.get("idempotent-replayed").unwrap(), "true");

    let admin_id = key_id(&s, &admin).await;
    s.ok(
        &s.operator,
        Method::DELETE,
        &format!("/v1/keys/{admin_id}"),
        None,
    )
    .await;
    let replay = s
        .raw(&admin, Method::POST, "/v1/keys", Some(body.into()), &h)
        .await;
    assert_eq!(replay.status, StatusCode::UNAUTHORIZED, "{}", replay.body);
    assert!(replay.headers.get("idempotent-replayed").is_none());
    assert!(
        !replay.body.to_string().contains(&minted),
        "the minted secret is not replayed: {}",
        replay.body
    );
    // Nor for no key or someone else's key with the same Idempotency-Key.
    let r = reqwest::Client::new()
        .post(format!("{}/v1/keys", s.url))
        .header("idempotency-key", "mint-1")
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    assert!(!r.text().await.unwrap().contains(&minted));
    let (_t2, other) = tenant_admin(&s, "other").await;
    let theirs = s
        .raw(&other, Method::POST, "/v1/keys", Some(body.into()), &h)
        .await;
    assert_eq!(theirs.status, StatusCode::CREATED);
    assert_ne!(theirs.body["secret"].as_str().unwrap(), minted);
}

#[tokio::test]
async fn requests_without_a_valid_key_are_rate_limited_by_address() {
    let s = start(ServerConfig {
        anonymous_rate_limit_per_second: 5,
        ..fast()
    })
    .await;
    let http = reqwest::Client::new();
    let (mut unauthorized, mut limited, mut retry_after) = (0u64, 0u64, None);
    let started = tokio::time::Instant::now();
    for i in 0..200 {
        let mut req = http.get(format!("{}/v1/instances", s.url));
        if i % 2 == 0 {
            req = req.bearer_auth(format!("flt_{:064x}", i));
        }
        let r = req.send().await.unwrap();
        match r.status() {
            StatusCode::UNAUTHORIZED => unauthorized += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                limited += 1;
                retry_after = r
                    .headers()
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
                let body: Value = r.json().await.unwrap();
                assert_eq!(body["error"]["code"], "rate_limited");
            }
            other => panic!("unexpected {other}"),
        }
    }
    // A burst of 10, then 5 a second, whatever this machine's speed.
    let allowed = 10 + (5.0 * started.elapsed().as_secs_f64()).ceil() as u64 + 1;
    assert!(unauthorized >= 10, "the burst gets through: {unauthorized}");
    assert!(
        unauthorized <= allowed,
        "{unauthorized} went through, at most {allowed} may"
    );
    assert_eq!(unauthorized + limited, 200);
    assert!(retry_after.is_some_and(|s| s >= 1), "{retry_after:?}");
    // A valid key is not held up by the address's bad requests, and
    // probes need no key and are not limited.
    for _ in 0..20 {
        assert_eq!(
            s.request(&s.operator, Method::GET, "/v1/me", None)
                .await
                .status,
            StatusCode::OK
        );
        let h = http.get(format!("{}/healthz", s.url)).send().await.unwrap();
        assert_eq!(h.status(), StatusCode::OK);
    }
}

#[tokio::test]
async fn the_last_operator_key_cannot_be_revoked() {
    let s = start(fast()).await;
    let first = key_id(&s, &s.operator).await;
    let r = s
        .request(
            &s.operator,
            Method::DELETE,
            &format!("/v1/keys/{first}"),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{}", r.body);
    assert!(
        r.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("last operator key"),
        "{}",
        r.body
    );
    assert_eq!(
        s.request(&s.operator, Method::GET, "/v1/me", None)
            .await
            .status,
        StatusCode::OK,
        "still works"
    );
    // With a second operator key the first can go; then the second is last.
    let me = s.ok(&s.operator, Method::GET, "/v1/me", None).await;
    let second = s
        .key(me["tenant"]["id"].as_str().unwrap(), "operator")
        .await;
    s.ok(&second, Method::DELETE, &format!("/v1/keys/{first}"), None)
        .await;
    let second_id = key_id(&s, &second).await;
    let r = s
        .request(
            &second,
            Method::DELETE,
            &format!("/v1/keys/{second_id}"),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::CONFLICT);
}

#[tokio::test]
async fn numbers_beyond_what_the_store_keeps_are_refused_naming_the_field() {
    let s = start(fast()).await;
    let (t, admin) = tenant_admin(&s, "numbers").await;
    let prov = s.key(&t, "provider").await;
    // Every list without a path parameter refuses limit=2^31.
    let doc = s.ok(&admin, Method::GET, "/v1/openapi.json", None).await;
    let mut lists = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        let Some(get) = item.get("get") else { continue };
        let takes_limit = get["parameters"]
            .as_array()
            .is_some_and(|ps| ps.iter().any(|p| p["name"] == "limit"));
        if !takes_limit || path.contains('{') {
            continue;
        }
        lists += 1;
        let r = s
            .request(
                &s.operator,
                Method::GET,
                // `from` and `to` for the lists that need them (usage).
                &format!(
                    "{path}?from=2026-01-01T00:00:00Z&to=2026-02-01T00:00:00Z&limit=2147483648"
                ),
                None,
            )
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{path}: {}", r.body);
        assert_eq!(r.body["error"]["details"]["field"], "limit", "{path}");
    }
    assert!(lists >= 8, "only {lists} lists found");

    let node = s.register_node(&prov, "n1", &[("H100", 1)]).await;
    let inst = s
        .ok(
            &admin,
            Method::POST,
            "/v1/instances",
            Some(json!({"gpus": 1, "command": ["sleep", "60"]})),
        )
        .await["id"]
        .as_str()
        .unwrap()
        .to_string();
    for q in ["since=9223372036854775808", "cursor=9223372036854775808"] {
        let field = q.split('=').next().unwrap();
        let r = s
            .request(
                &admin,
                Method::GET,
                &format!("/v1/instances/{inst}/logs?{q}"),
                None,
            )
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{q}: {}", r.body);
        assert_eq!(r.body["error"]["details"]["field"], field);
    }
    let r = s
        .request(
            &admin,
            Method::GET,
            &format!("/v1/instances/{inst}/logs?since=9223372036854775807"),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "the largest seq is fine");

    // An agent's log line with seq 2^63.
    wait_for("the instance placed", || async {
        let i = s
            .ok(&admin, Method::GET, &format!("/v1/instances/{inst}"), None)
            .await;
        i["node_id"].as_str() == Some(node.as_str())
    })
    .await;
    let r = s
        .request(
            &prov,
            Method::POST,
            &format!("/v1/agent/instances/{inst}/logs"),
            Some(json!({"lines": [
                {"seq": 0, "stream": "stdout", "at": "2026-12-01T00:00:00Z", "line": "ok"},
                {"seq": 9223372036854775808u64, "stream": "stdout", "at": "2026-12-01T00:00:00Z", "line": "x"}
            ]})),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    assert_eq!(r.body["error"]["details"]["field"], "lines[1].seq");
    let logs = s
        .ok(
            &admin,
            Method::GET,
            &format!("/v1/instances/{inst}/logs"),
            None,
        )
        .await;
    assert_eq!(logs["items"], json!([]), "nothing of the batch stored");

    // A node claiming 2^63 MB of memory.
    let r = s
        .request(
            &prov,
            Method::POST,
            "/v1/agent/register",
            Some(json!({
                "name": "huge", "cpu_milli": 1000, "memory_mb": 9223372036854775808u64,
                "simulated": true, "gpus": [], "agent_version": "t", "runtime": "process"
            })),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{}", r.body);
    assert_eq!(r.body["error"]["details"]["field"], "memory_mb");
}

#[tokio::test]
async fn every_mutating_call_is_audited_and_tenants_read_their_own() {
    let s = start(fast()).await;
    let (ta, admin_a) = tenant_admin(&s, "audit-a").await;
    let (tb, admin_b) = tenant_admin(&s, "audit-b").await;
    let member_a = s
        .ok(
            &admin_a,
            Method::POST,
            "/v1/keys",
            Some(json!({"role": "tenant_member", "name": "m"})),
        )
        .await;
    let member_secret = member_a["secret"].as_str().unwrap().to_string();
    let member_key = member_a["key"]["id"].as_str().unwrap().to_string();
    let inst = s
        .raw(
            &admin_a,
            Method::POST,
            "/v1/instances",
            Some(r#"{"gpus": 1, "command": ["x"]}"#.into()),
            &[("x-request-id", "audit-req-1")],
        )
        .await;
    assert_eq!(inst.status, StatusCode::CREATED);
    let inst = inst.body["id"].as_str().unwrap().to_string();
    s.ok(
        &admin_a,
        Method::POST,
        &format!("/v1/instances/{inst}/stop"),
        None,
    )
    .await;
    let refused = s
        .request(
            &admin_a,
            Method::POST,
            "/v1/instances",
            Some(json!({"gpus": 0, "command": ["x"]})),
        )
        .await;
    assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY);
    s.ok(
        &admin_b,
        Method::POST,
        "/v1/keys",
        Some(json!({"role": "tenant_member", "name": "b"})),
    )
    .await;
    // Not recorded: reads, estimates, calls without a valid key.
    s.ok(&admin_a, Method::GET, "/v1/instances", None).await;
    let anon = s
        .request("flt_nope", Method::POST, "/v1/instances", Some(json!({})))
        .await;
    assert_eq!(anon.status, StatusCode::UNAUTHORIZED);

    let a_id = key_id(&s, &admin_a).await;
    let page = s.ok(&admin_a, Method::GET, "/v1/audit", None).await;
    let items = page["items"].as_array().unwrap();
    let got: Vec<(String, String, Option<String>, u64)> = items
        .iter()
        .map(|e| {
            assert_eq!(e["tenant_id"], ta.as_str());
            assert_eq!(e["key_id"], a_id.as_str());
            (
                e["method"].as_str().unwrap().to_string(),
                e["route"].as_str().unwrap().to_string(),
                e["object_id"].as_str().map(str::to_string),
                e["status"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            ("POST".into(), "/v1/instances".into(), None, 422),
            (
                "POST".into(),
                "/v1/instances/{instance_id}/stop".into(),
                Some(inst.clone()),
                200
            ),
            (
                "POST".into(),
                "/v1/instances".into(),
                Some(inst.clone()),
                201
            ),
            ("POST".into(), "/v1/keys".into(), Some(member_key), 201),
        ],
        "tenant A's calls, newest first"
    );
    assert_eq!(items[2]["request_id"], "audit-req-1");
    assert!(
        !page.to_string().contains(&member_secret),
        "a minted secret never reaches the log"
    );

    // B sees its own; a member may not read; A may not ask for B's.
    let b = s.ok(&admin_b, Method::GET, "/v1/audit", None).await;
    assert_eq!(b["items"].as_array().unwrap().len(), 1);
    assert_eq!(b["items"][0]["tenant_id"], tb.as_str());
    let r = s
        .request(&member_secret, Method::GET, "/v1/audit", None)
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let r = s
        .request(
            &admin_a,
            Method::GET,
            &format!("/v1/audit?tenant_id={tb}"),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);

    // The operator reads everyone's (its own tenant and key creations
    // too), page by page, or one tenant's.
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/audit?limit=2&cursor={c}"),
            None => "/v1/audit?limit=2".to_string(),
        };
        let p = s.ok(&s.operator, Method::GET, &path, None).await;
        all.extend(p["items"].as_array().unwrap().iter().cloned());
        match p["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    // 2 tenants and 2 admin keys by the operator, 4 calls of A, 1 of B.
    assert_eq!(all.len(), 9, "{all:#?}");
    let ids: std::collections::HashSet<_> = all.iter().map(|e| e["id"].clone()).collect();
    assert_eq!(ids.len(), 9, "no entry twice across pages");
    let only_b = s
        .ok(
            &s.operator,
            Method::GET,
            &format!("/v1/audit?tenant_id={tb}"),
            None,
        )
        .await;
    assert_eq!(only_b["items"].as_array().unwrap().len(), 1);
}

/// The value of `name` in a `Set-Cookie` header of `r`.
fn set_cookie(r: &reqwest::Response, name: &str) -> String {
    r.headers()
        .get_all(reqwest::header::SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(|v| v.strip_prefix(&format!("{name}=")))
        .and_then(|v| v.split(';').next())
        .unwrap_or_else(|| panic!("no {name} cookie"))
        .to_string()
}

/// The first hidden `csrf` field of a page.
fn csrf_of(html: &str) -> String {
    let at = html.find("name=\"csrf\"").expect("a csrf field");
    let rest = &html[at..];
    let v = rest.find("value=\"").expect("its value") + 7;
    rest[v..v + rest[v..].find('"').unwrap()].to_string()
}

/// A click in the console is the API call it makes, through the same
/// authentication and audit layers: minting a key from the console's keys
/// page leaves an audit entry under the signed-in key.
#[tokio::test]
async fn a_console_action_is_audited_like_the_api_call_it_makes() {
    let s = start(fast()).await;
    let (_t, admin) = tenant_admin(&s, "console-audit").await;
    let admin_id = key_id(&s, &admin).await;
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let login = http.get(format!("{}/login", s.url)).send().await.unwrap();
    let login_cookie = set_cookie(&login, "flotilla_login");
    let token = csrf_of(&login.text().await.unwrap());
    let signed = http
        .post(format!("{}/login", s.url))
        .header("cookie", format!("flotilla_login={login_cookie}"))
        .form(&[("csrf", token.as_str()), ("api_key", admin.as_str())])
        .send()
        .await
        .unwrap();
    assert!(
        signed.status().is_redirection() || signed.status().is_success(),
        "sign-in answered {}",
        signed.status()
    );
    let session = format!(
        "flotilla_session={}",
        set_cookie(&signed, "flotilla_session")
    );
    let keys = http
        .get(format!("{}/keys", s.url))
        .header("cookie", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(keys.status(), StatusCode::OK);
    let csrf = csrf_of(&keys.text().await.unwrap());
    let minted = http
        .post(format!("{}/keys", s.url))
        .header("cookie", &session)
        .form(&[
            ("csrf", csrf.as_str()),
            ("name", "from-the-console"),
            ("role", "tenant_member"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(minted.status(), StatusCode::OK);

    let page = s.ok(&admin, Method::GET, "/v1/audit", None).await;
    let items = page["items"].as_array().unwrap();
    assert!(
        items.iter().any(|e| e["method"] == "POST"
            && e["route"] == "/v1/keys"
            && e["key_id"] == admin_id.as_str()
            && e["status"] == 201),
        "no audit entry for the console's key: {page}"
    );
}

/// Signs in to the console with `key`: the session cookie (as a `cookie`
/// header value) and the CSRF token of its pages.
async fn console_sign_in(s: &Server, http: &reqwest::Client, key: &str) -> (String, String) {
    let login = http.get(format!("{}/login", s.url)).send().await.unwrap();
    let login_cookie = set_cookie(&login, "flotilla_login");
    let token = csrf_of(&login.text().await.unwrap());
    let signed = http
        .post(format!("{}/login", s.url))
        .header("cookie", format!("flotilla_login={login_cookie}"))
        .form(&[("csrf", token.as_str()), ("api_key", key)])
        .send()
        .await
        .unwrap();
    let session = format!(
        "flotilla_session={}",
        set_cookie(&signed, "flotilla_session")
    );
    let page = http
        .get(format!("{}/instances", s.url))
        .header("cookie", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    let csrf = csrf_of(&page.text().await.unwrap());
    (session, csrf)
}

/// The console's terminal tab is the API's exec session: its WebSocket
/// opens only from the console's own origin with the session's form
/// token, the API's refusal comes back as the session's error frame, and
/// the opening is in the audit log under the signed-in key, as
/// `flotilla shell`'s would be.
#[tokio::test]
async fn the_console_terminal_is_the_apis_audited_exec_session() {
    use reqwest::header::{CONNECTION, SEC_WEBSOCKET_KEY, SEC_WEBSOCKET_VERSION, UPGRADE};
    use tokio::io::AsyncReadExt as _;

    let s = start(fast()).await;
    let (_t, admin) = tenant_admin(&s, "console-terminal").await;
    let admin_id = key_id(&s, &admin).await;
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let (session, csrf) = console_sign_in(&s, &http, &admin).await;
    // No node joined: the instance stays pending, which the API refuses
    // to enter (409).
    let inst = s
        .ok(
            &admin,
            Method::POST,
            "/v1/instances",
            Some(json!({"gpus": 1, "command": ["sleep", "60"]})),
        )
        .await;
    let id = inst["id"].as_str().unwrap().to_string();
    let terminal = |origin: &str, token: &str| {
        http.get(format!(
            "{}/instances/{id}/terminal?csrf={token}&cols=100&rows=30",
            s.url
        ))
        .header("cookie", &session)
        .header("origin", origin)
        .header(CONNECTION, "Upgrade")
        .header(UPGRADE, "websocket")
        .header(SEC_WEBSOCKET_VERSION, "13")
        .header(SEC_WEBSOCKET_KEY, "dGhlIHNhbXBsZSBub25jZQ==")
    };
    let foreign = terminal("http://evil.example", &csrf).send().await.unwrap();
    assert_eq!(foreign.status(), StatusCode::FORBIDDEN, "another origin");
    let tokenless = terminal(&s.url, "nope").send().await.unwrap();
    assert_eq!(tokenless.status(), StatusCode::FORBIDDEN, "a wrong token");

    let open = terminal(&s.url, &csrf).send().await.unwrap();
    assert_eq!(open.status(), StatusCode::SWITCHING_PROTOCOLS);
    let mut socket = open.upgrade().await.unwrap();
    // The server's first message is one unmasked binary WebSocket frame
    // (0x82, a length under 126) holding the session's error frame (tag 6).
    let mut buf = Vec::new();
    let read = async {
        while buf.len() < 2 || buf.len() < 2 + usize::from(buf[1] & 0x7f) {
            let mut chunk = [0u8; 512];
            let n = socket.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the socket closed after {buf:?}");
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("the error frame");
    assert_eq!(buf[0], 0x82, "a binary frame: {buf:?}");
    let payload = &buf[2..2 + usize::from(buf[1] & 0x7f)];
    assert_eq!(payload[0], 6, "an error frame: {payload:?}");
    let message = String::from_utf8_lossy(&payload[1..]);
    assert!(message.contains("not running"), "{message}");

    let page = s.ok(&admin, Method::GET, "/v1/audit", None).await;
    let items = page["items"].as_array().unwrap();
    let exec: Vec<_> = items
        .iter()
        .filter(|e| e["route"] == "/v1/instances/{instance_id}/exec")
        .collect();
    assert_eq!(exec.len(), 1, "one opening reached the API: {page}");
    assert_eq!(exec[0]["method"], "GET");
    assert_eq!(exec[0]["key_id"], admin_id.as_str());
    assert_eq!(exec[0]["object_id"], id.as_str());
    assert_eq!(exec[0]["status"], 409);
}
