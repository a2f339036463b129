//! The Nova client against a local fake of Keystone v3 and the compute API
//! v2.1 (axum, on a loopback port) that answers with the payloads the API
//! reference documents: a token in `X-Subject-Token` with its service
//! catalog, flavors with `extra_specs` (microversion 2.61), `202` with the
//! documented body for `POST /servers`, `403 {"forbidden": ...} Quota
//! exceeded for instances` past the quota, servers that go to `ERROR` with
//! the fault "No valid host was found. There are not enough hosts
//! available.", `404 {"itemNotFound": ...}`, `GET /limits` with
//! `limits.absolute`. Spot: a reclaimer announces it through server
//! metadata (`PUT /servers/{id}/metadata/{key}`, the documented metadata
//! call) or stops a preemptible server without notice.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use base64::Engine as _;
use flotilla_backends::capacity::openstack::{Nova, NovaConfig, INTERRUPT_AT_KEY};
use flotilla_backends::capacity::{
    CapacityError, CapacityProvider, Join, MachineState, ProvisionRequest,
};
use serde_json::{json, Value};

#[derive(Default)]
struct Cloud {
    /// Base URL of the fake (for the catalog).
    base: String,
    /// Tokens issued and still good.
    tokens: Vec<String>,
    issued: u32,
    /// id -> (server JSON, GETs seen)
    servers: BTreeMap<String, (Value, u32)>,
    max_instances: i64,
    /// Every POST /servers body.
    posted: Vec<Value>,
    next: u32,
}

type Shared = Arc<Mutex<Cloud>>;

fn authorized(cloud: &Cloud, headers: &HeaderMap) -> bool {
    headers
        .get("X-Auth-Token")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| cloud.tokens.iter().any(|k| k == t))
}

fn unauthorized() -> Response {
    // Keystone's and Nova's documented 401 body.
    (
        StatusCode::UNAUTHORIZED,
        Json(json!({"error": {"code": 401, "title": "Unauthorized",
            "message": "The request you have made requires authentication."}})),
    )
        .into_response()
}

async fn tokens(State(s): State<Shared>, Json(body): Json<Value>) -> Response {
    let user = &body["auth"]["identity"]["password"]["user"];
    if user["name"] != "flotilla" || user["password"] != "s3cret" {
        return unauthorized();
    }
    assert_eq!(body["auth"]["scope"]["project"]["name"], "gpu-project");
    let mut c = s.lock().unwrap();
    c.issued += 1;
    let token = format!("gAAAAAB{}", c.issued);
    c.tokens.push(token.clone());
    let compute = format!("{}/compute/v2.1", c.base);
    let mut h = HeaderMap::new();
    h.insert("X-Subject-Token", token.parse().unwrap());
    (
        StatusCode::CREATED,
        h,
        Json(json!({"token": {
            "methods": ["password"],
            "expires_at": "2030-01-01T00:00:00.000000Z",
            "issued_at": "2029-12-31T23:00:00.000000Z",
            "project": {"domain": {"id": "default", "name": "Default"}, "id": "a6944d763bf64ee6a275f1263fae0352", "name": "gpu-project"},
            "user": {"domain": {"id": "default", "name": "Default"}, "id": "ee4dfb6e5540447cb3741905149d9b6e", "name": "flotilla"},
            "catalog": [
                {"type": "identity", "name": "keystone", "id": "1", "endpoints": [
                    {"id": "1a", "interface": "public", "region": "RegionOne", "region_id": "RegionOne", "url": format!("{}/v3", c.base)}]},
                {"type": "compute", "name": "nova", "id": "2", "endpoints": [
                    {"id": "2a", "interface": "public", "region": "RegionOne", "region_id": "RegionOne", "url": compute},
                    {"id": "2b", "interface": "internal", "region": "RegionOne", "region_id": "RegionOne", "url": "http://10.0.0.1:8774/v2.1"},
                    {"id": "2c", "interface": "public", "region": "RegionTwo", "region_id": "RegionTwo", "url": "http://192.0.2.1:8774/v2.1"}]}
            ]
        }})),
    )
        .into_response()
}

fn flavors_json() -> Value {
    json!({"flavors": [
        {"OS-FLV-DISABLED:disabled": false, "OS-FLV-EXT-DATA:ephemeral": 0, "disk": 20,
         "id": "1", "name": "m1.small", "os-flavor-access:is_public": true, "ram": 2048,
         "rxtx_factor": 1.0, "swap": "", "vcpus": 1, "description": null,
         "extra_specs": {}, "links": []},
        {"OS-FLV-DISABLED:disabled": false, "OS-FLV-EXT-DATA:ephemeral": 0, "disk": 200,
         "id": "7", "name": "gpu.h100x8", "os-flavor-access:is_public": true, "ram": 1024000,
         "rxtx_factor": 1.0, "swap": "", "vcpus": 96, "description": "8x H100 SXM",
         "extra_specs": {"pci_passthrough:alias": "h100-sxm:8", "hw:cpu_policy": "dedicated"}, "links": []},
        {"OS-FLV-DISABLED:disabled": false, "OS-FLV-EXT-DATA:ephemeral": 0, "disk": 100,
         "id": "8", "name": "gpu.a100x2.preemptible", "os-flavor-access:is_public": true, "ram": 256000,
         "rxtx_factor": 1.0, "swap": "", "vcpus": 24, "description": null,
         "extra_specs": {"pci_passthrough:alias": "a100:2", "flotilla:preemptible": "true"}, "links": []}
    ]})
}

async fn flavors(State(s): State<Shared>, headers: HeaderMap) -> Response {
    let c = s.lock().unwrap();
    if !authorized(&c, &headers) {
        return unauthorized();
    }
    assert_eq!(
        headers.get("OpenStack-API-Version").unwrap(),
        "compute 2.61",
        "the microversion that lists extra specs"
    );
    Json(flavors_json()).into_response()
}

async fn limits(State(s): State<Shared>, headers: HeaderMap) -> Response {
    let c = s.lock().unwrap();
    if !authorized(&c, &headers) {
        return unauthorized();
    }
    let used = c.servers.len() as i64;
    Json(json!({"limits": {"absolute": {
        "maxImageMeta": 128, "maxPersonality": 5, "maxPersonalitySize": 10240,
        "maxSecurityGroupRules": 20, "maxSecurityGroups": 10, "maxServerMeta": 128,
        "maxTotalCores": -1, "maxTotalFloatingIps": 10, "maxTotalInstances": c.max_instances,
        "maxTotalKeypairs": 100, "maxTotalRAMSize": 1536000, "maxServerGroups": 10,
        "maxServerGroupMembers": 10, "totalCoresUsed": used * 96, "totalInstancesUsed": used,
        "totalRAMUsed": used * 1024000, "totalSecurityGroupsUsed": 1, "totalFloatingIpsUsed": 0,
        "totalServerGroupsUsed": 0}, "rate": []}}))
    .into_response()
}

async fn create_server(
    State(s): State<Shared>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let mut c = s.lock().unwrap();
    if !authorized(&c, &headers) {
        return unauthorized();
    }
    c.posted.push(body.clone());
    let used = c.servers.len() as i64;
    if used >= c.max_instances {
        return (
            StatusCode::FORBIDDEN,
            Json(json!({"forbidden": {"code": 403, "message": format!(
                "Quota exceeded for instances: Requested 1, but already used {used} of {} instances",
                c.max_instances)}})),
        )
            .into_response();
    }
    let req = &body["server"];
    let flavor = flavors_json()["flavors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == req["flavorRef"])
        .cloned()
        .expect("a known flavorRef");
    c.next += 1;
    let id = format!("f5dc173b-6804-445a-a6d8-{:012x}", c.next);
    // The fake's scheduler has no host for an H100 box named `nohost-*`.
    let no_host = req["name"]
        .as_str()
        .unwrap_or_default()
        .starts_with("nohost");
    let server = json!({
        "OS-DCF:diskConfig": "AUTO",
        "OS-EXT-AZ:availability_zone": "nova",
        "OS-EXT-STS:power_state": 0,
        "OS-EXT-STS:task_state": "scheduling",
        "OS-EXT-STS:vm_state": "building",
        "accessIPv4": "", "accessIPv6": "", "addresses": {},
        "created": "2029-12-31T23:10:00Z",
        "flavor": {"disk": flavor["disk"], "ephemeral": 0, "extra_specs": flavor["extra_specs"],
                   "original_name": flavor["name"], "ram": flavor["ram"], "swap": 0, "vcpus": flavor["vcpus"]},
        "hostId": "", "id": id,
        "image": {"id": req["imageRef"], "links": []},
        "key_name": null, "locked": false,
        "metadata": req["metadata"],
        "name": req["name"],
        "status": "BUILD",
        "tags": req["tags"],
        "tenant_id": "a6944d763bf64ee6a275f1263fae0352",
        "updated": "2029-12-31T23:10:00Z",
        "user_id": "ee4dfb6e5540447cb3741905149d9b6e",
        "x-no-host": no_host
    });
    c.servers.insert(id.clone(), (server, 0));
    (
        StatusCode::ACCEPTED,
        Json(json!({"server": {
            "OS-DCF:diskConfig": "AUTO", "adminPass": "6NpUwoz2QDRN", "id": id,
            "links": [{"href": format!("{}/compute/v2.1/servers/{id}", c.base), "rel": "self"}],
            "security_groups": [{"name": "default"}]}})),
    )
        .into_response()
}

fn not_found(id: &str) -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(json!({"itemNotFound": {"code": 404, "message": format!("Instance {id} could not be found.")}})),
    )
        .into_response()
}

async fn show_server(
    State(s): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let mut c = s.lock().unwrap();
    if !authorized(&c, &headers) {
        return unauthorized();
    }
    let Some((server, gets)) = c.servers.get_mut(&id) else {
        return not_found(&id);
    };
    *gets += 1;
    // The first look finds it building; after that it is built, or failed.
    if *gets > 1 && server["status"] == "BUILD" {
        if server["x-no-host"] == true {
            server["status"] = json!("ERROR");
            server["OS-EXT-STS:vm_state"] = json!("error");
            server["fault"] = json!({"code": 500, "created": "2029-12-31T23:10:05Z",
                "message": "No valid host was found. There are not enough hosts available."});
        } else {
            server["status"] = json!("ACTIVE");
            server["OS-EXT-STS:vm_state"] = json!("active");
            server["OS-EXT-STS:power_state"] = json!(1);
        }
    }
    let mut shown = server.clone();
    if let Some(o) = shown.as_object_mut() {
        o.remove("x-no-host");
    }
    Json(json!({ "server": shown })).into_response()
}

async fn delete_server(
    State(s): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let mut c = s.lock().unwrap();
    if !authorized(&c, &headers) {
        return unauthorized();
    }
    match c.servers.remove(&id) {
        Some(_) => StatusCode::NO_CONTENT.into_response(),
        None => not_found(&id),
    }
}

async fn list_servers(
    State(s): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    let c = s.lock().unwrap();
    if !authorized(&c, &headers) {
        return unauthorized();
    }
    let servers: Vec<Value> = c
        .servers
        .values()
        .filter(|(v, _)| {
            q.get("tags").is_none_or(|t| {
                v["tags"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|x| x == t.as_str()))
            })
        })
        .map(|(v, _)| v.clone())
        .collect();
    Json(json!({ "servers": servers })).into_response()
}

/// `PUT /servers/{id}/metadata/{key}` with `{"meta": {key: value}}`.
async fn set_meta(
    State(s): State<Shared>,
    headers: HeaderMap,
    Path((id, key)): Path<(String, String)>,
    Json(body): Json<Value>,
) -> Response {
    let mut c = s.lock().unwrap();
    if !authorized(&c, &headers) {
        return unauthorized();
    }
    let Some((server, _)) = c.servers.get_mut(&id) else {
        return not_found(&id);
    };
    server["metadata"][&key] = body["meta"][&key].clone();
    Json(json!({"meta": {key.clone(): body["meta"][&key]}})).into_response()
}

async fn fake() -> (String, Shared) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let state: Shared = Arc::new(Mutex::new(Cloud {
        base: base.clone(),
        max_instances: 2,
        ..Cloud::default()
    }));
    let app = Router::new()
        .route("/v3/auth/tokens", post(tokens))
        .route("/compute/v2.1/flavors/detail", get(flavors))
        .route("/compute/v2.1/limits", get(limits))
        .route("/compute/v2.1/servers", post(create_server))
        .route("/compute/v2.1/servers/detail", get(list_servers))
        .route(
            "/compute/v2.1/servers/{id}",
            get(show_server).delete(delete_server),
        )
        .route("/compute/v2.1/servers/{id}/metadata/{key}", put(set_meta))
        .with_state(state.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (base, state)
}

fn nova(base: &str, password: &str) -> Nova {
    let mut aliases = BTreeMap::new();
    aliases.insert("h100-sxm".to_string(), "H100".to_string());
    aliases.insert("a100".to_string(), "A100-80GB".to_string());
    Nova::new(NovaConfig {
        auth_url: format!("{base}/v3"),
        username: "flotilla".into(),
        password: password.into(),
        user_domain: "Default".into(),
        project: "gpu-project".into(),
        project_domain: "Default".into(),
        region: "RegionOne".into(),
        image: "70a599e0-31e7-49b7-b260-868f441e862b".into(),
        network: Some("3cb9bc59-5699-4588-a4b1-b87f96708bc6".into()),
        gpu_aliases: aliases,
    })
    .unwrap()
}

fn req(name: &str, flavor: &str, spot: bool) -> ProvisionRequest {
    ProvisionRequest {
        name: name.into(),
        instance_type: flavor.into(),
        region: None,
        spot,
        join: Some(Join {
            server_url: "http://cp.example:7420".into(),
            token: "fjt_abc".into(),
            tls_fingerprint: None,
        }),
    }
}

#[tokio::test]
async fn regions_instance_types_and_quota_come_from_the_documented_payloads() {
    let (base, _) = fake().await;
    let n = nova(&base, "s3cret");
    let regions: Vec<String> = n
        .regions()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(regions, ["RegionOne", "RegionTwo"]);
    let types = n.instance_types().await.unwrap();
    let h100 = types.iter().find(|t| t.name == "gpu.h100x8").unwrap();
    assert_eq!(
        (h100.gpu_model.as_deref(), h100.gpus, h100.vcpus, h100.spot),
        (Some("H100"), 8, 96, false)
    );
    let a100 = types
        .iter()
        .find(|t| t.name == "gpu.a100x2.preemptible")
        .unwrap();
    assert_eq!(
        (a100.gpu_model.as_deref(), a100.gpus, a100.spot),
        (Some("A100-80GB"), 2, true)
    );
    let small = types.iter().find(|t| t.name == "m1.small").unwrap();
    assert_eq!((small.gpu_model.as_deref(), small.gpus), (None, 0));
    let q = n.quota("RegionOne").await.unwrap();
    assert_eq!((q.instances.max, q.instances.used), (Some(2), 0));
    assert_eq!(q.vcpus.max, None, "-1 is unlimited");
    assert_eq!(q.admits(h100), Some(1), "RAM admits one 8xH100 box");
    assert!(n.quota("RegionTwo").await.is_err());
}

#[tokio::test]
async fn a_server_is_created_booted_and_deleted_and_quota_is_enforced() {
    let (base, cloud) = fake().await;
    let n = nova(&base, "s3cret");
    let m = n
        .provision(0, &req("gpu-a1", "gpu.h100x8", false))
        .await
        .unwrap();
    assert_eq!(m.state, MachineState::Provisioning);
    assert_eq!((m.gpus, m.instance_type.as_str()), (8, "gpu.h100x8"));
    // What was sent: the flavor's id, the image, the network, the tag, and
    // the boot script with the join token as base64 user data.
    let sent = cloud.lock().unwrap().posted[0]["server"].clone();
    assert_eq!(sent["flavorRef"], "7");
    assert_eq!(
        sent["networks"][0]["uuid"],
        "3cb9bc59-5699-4588-a4b1-b87f96708bc6"
    );
    assert_eq!(sent["tags"][0], "flotilla");
    let script = base64::engine::general_purpose::STANDARD
        .decode(sent["user_data"].as_str().unwrap())
        .unwrap();
    let script = String::from_utf8(script).unwrap();
    assert!(script.starts_with("#!/bin/sh"), "{script}");
    assert!(
        script.contains("--server 'http://cp.example:7420' --join-token 'fjt_abc'"),
        "{script}"
    );

    assert_eq!(
        n.describe(0, &m.id).await.unwrap().state,
        MachineState::Provisioning
    );
    assert_eq!(
        n.describe(0, &m.id).await.unwrap().state,
        MachineState::Running
    );

    // Quota: the second fits, the third is refused with Nova's message.
    n.provision(0, &req("gpu-a2", "gpu.h100x8", false))
        .await
        .unwrap();
    let e = n
        .provision(0, &req("gpu-a3", "gpu.h100x8", false))
        .await
        .unwrap_err();
    match &e {
        CapacityError::QuotaExceeded { message } => assert!(
            message
                .starts_with("Quota exceeded for instances: Requested 1, but already used 2 of 2"),
            "{message}"
        ),
        other => panic!("expected quota exceeded, got {other}"),
    }
    assert!(!e.is_transient(), "quota needs a person");

    n.terminate(0, &m.id).await.unwrap();
    n.terminate(0, &m.id).await.unwrap(); // 404: already gone is fine
    assert!(matches!(
        n.describe(0, &m.id).await,
        Err(CapacityError::NotFound { .. })
    ));
    assert!(matches!(
        n.provision(0, &req("x", "gpu.b200x8", false)).await,
        Err(CapacityError::UnknownInstanceType { .. })
    ));
    assert!(
        matches!(
            n.provision(0, &req("x", "gpu.h100x8", true)).await,
            Err(CapacityError::NoSpot { .. })
        ),
        "an on-demand flavor is not spot"
    );
}

#[tokio::test]
async fn no_valid_host_is_no_capacity() {
    let (base, _) = fake().await;
    let n = nova(&base, "s3cret");
    let m = n
        .provision(0, &req("nohost-1", "gpu.h100x8", false))
        .await
        .unwrap();
    let _ = n.describe(0, &m.id).await.unwrap();
    match n.describe(0, &m.id).await.unwrap().state {
        MachineState::Failed {
            reason,
            no_capacity,
        } => {
            assert!(no_capacity);
            assert!(reason.starts_with("No valid host was found"), "{reason}");
        }
        other => panic!("expected a failed server, got {other:?}"),
    }
}

#[tokio::test]
async fn spot_interruptions_are_announced_or_seen() {
    let (base, cloud) = fake().await;
    let n = nova(&base, "s3cret");
    let a = n
        .provision(0, &req("spot-1", "gpu.a100x2.preemptible", true))
        .await
        .unwrap();
    let b = n
        .provision(0, &req("spot-2", "gpu.a100x2.preemptible", true))
        .await
        .unwrap();
    assert!(a.spot);
    let sent = cloud.lock().unwrap().posted[0]["server"].clone();
    assert_eq!(sent["metadata"]["flotilla:preemptible"], "true");
    assert!(n.interruptions(1_000).await.unwrap().is_empty());

    // The reclaimer announces one ahead of time through metadata...
    let token = cloud.lock().unwrap().tokens[0].clone();
    let url = format!(
        "{base}/compute/v2.1/servers/{}/metadata/{INTERRUPT_AT_KEY}",
        a.id
    );
    let resp = reqwest::Client::new()
        .put(url)
        .header("X-Auth-Token", token)
        .json(&json!({"meta": {INTERRUPT_AT_KEY: "2030-01-01T00:02:00Z"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // ...and stops the other one without notice.
    {
        let mut c = cloud.lock().unwrap();
        let (server, _) = c.servers.get_mut(&b.id).unwrap();
        server["status"] = json!("SHUTOFF");
    }
    let now = 1_893_456_000_000; // 2030-01-01T00:00:00Z
    let mut notes = n.interruptions(now).await.unwrap();
    notes.sort_by_key(|x| x.terminate_at_ms);
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert_eq!(
        (notes[0].machine.as_str(), notes[0].terminate_at_ms),
        (b.id.as_str(), now)
    );
    assert_eq!(notes[1].machine, a.id);
    assert_eq!(notes[1].terminate_at_ms, now + 120_000);
    assert_eq!(notes[1].noticed_at_ms, now);
    // A server Flotilla deleted itself is no interruption.
    n.terminate(now, &b.id).await.unwrap();
    let notes = n.interruptions(now).await.unwrap();
    assert_eq!(notes.len(), 1);
}

#[tokio::test]
async fn an_expired_token_is_renewed_once_and_bad_credentials_are_refused() {
    let (base, cloud) = fake().await;
    let n = nova(&base, "s3cret");
    n.instance_types().await.unwrap();
    // Keystone revokes every token: the next call gets 401 and renews.
    cloud.lock().unwrap().tokens.clear();
    n.instance_types().await.unwrap();
    assert_eq!(cloud.lock().unwrap().issued, 2);
    let bad = nova(&base, "wrong");
    match bad.instance_types().await {
        Err(CapacityError::Auth { message }) => {
            assert!(message.contains("requires authentication"), "{message}")
        }
        other => panic!("expected an auth error, got {other:?}"),
    }
}
