//! `/metrics` over real HTTP: GPU telemetry sent with an agent's sync comes
//! out under the DCGM exporter's names and labels, with the instance that
//! holds each GPU; capacity gauges follow the store; bad samples are refused
//! naming the field; only operators may scrape, and a tenant reads its own
//! instance's GPUs at `/v1/instances/{id}/telemetry`.

use std::time::Duration;

use flotilla_testkit::server::{fast, start, TestServer};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

/// The value of the one series of `metric` whose labels include every
/// `label="value"` pair in `with`; `None` when there is none. Panics when
/// several match, so an assertion cannot pass on the wrong series.
fn series(text: &str, metric: &str, with: &[(&str, &str)]) -> Option<f64> {
    let found: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")))
        .filter(|l| {
            with.iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .map(|l| {
            l.rsplit_once(' ')
                .and_then(|(_, v)| v.parse().ok())
                .unwrap_or_else(|| panic!("unparsable sample line {l}"))
        })
        .collect();
    assert!(found.len() <= 1, "{metric} {with:?} matches {found:?}");
    found.first().copied()
}

async fn scrape(s: &TestServer, key: &str) -> (StatusCode, String, String) {
    let r = s.raw(key, Method::GET, "/metrics", None, &[]).await;
    let ctype = r
        .headers
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let text = match r.body {
        Value::String(t) => t,
        other => other.to_string(),
    };
    (r.status, ctype, text)
}

async fn sync(s: &TestServer, key: &str, node: &str, gpus: Value) -> (StatusCode, Value) {
    s.call(
        key,
        Method::POST,
        &format!("/v1/agent/nodes/{node}/sync"),
        Some(json!({"observed": [], "wait_ms": 0, "gpus": gpus})),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn telemetry_is_exported_under_dcgm_names_with_the_holding_instance() {
    let s = start(fast()).await;
    let tenant = s.create_tenant("acme").await;
    let member = s.key(&tenant, "tenant_member").await;
    let provider = s.key(&tenant, "provider").await;
    let node = s.register_node(&provider, "gpu-01", &[("H100", 2)]).await;

    // One instance takes one of the two GPUs.
    let (status, inst) = s
        .call(
            &member,
            Method::POST,
            "/v1/instances",
            Some(json!({"gpus": 1, "command": ["train"]})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{inst}");
    let inst_id = inst["id"].as_str().unwrap().to_string();
    let mut held = None;
    for _ in 0..200 {
        let n = s
            .ok(&s.operator, Method::GET, &format!("/v1/nodes/{node}"), None)
            .await;
        held = n["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["instance_id"] == inst_id.as_str())
            .map(|g| g["uuid"].as_str().unwrap().to_string());
        if held.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let held = held.expect("the instance is placed on gpu-01");
    let other = if held == "GPU-gpu-01-0" {
        "GPU-gpu-01-1"
    } else {
        "GPU-gpu-01-0"
    };
    let index_of = |uuid: &str| uuid.rsplit('-').next().unwrap().parse::<u32>().unwrap();

    // A bad sample is refused, naming it, and records nothing.
    let (status, body) = sync(
        &s,
        &provider,
        &node,
        json!([{"index": 0, "uuid": "GPU-gpu-01-0", "device_name": "NVIDIA H100 80GB HBM3", "gpu_util_pct": 101}]),
    )
    .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(body["error"]["details"]["field"], "gpus[0].gpu_util_pct");
    let (_, _, text) = scrape(&s, &s.operator).await;
    assert!(!text.contains("DCGM_FI_DEV_GPU_UTIL{"), "{text}");

    // The busy GPU reports every counter; the idle one no power reading;
    // a sample for a device the node never registered is ignored.
    let (status, body) = sync(
        &s,
        &provider,
        &node,
        json!([
            {"index": index_of(&held), "uuid": held, "device_name": "NVIDIA H100 80GB HBM3",
             "gpu_util_pct": 87, "mem_copy_util_pct": 41, "fb_used_mib": 61234, "fb_free_mib": 20325,
             "temperature_c": 64, "power_w": 512.25, "sm_clock_mhz": 1980},
            {"index": index_of(other), "uuid": other, "device_name": "NVIDIA H100 80GB HBM3",
             "gpu_util_pct": 0, "fb_used_mib": 0, "fb_free_mib": 81559, "temperature_c": 31},
            {"index": 7, "uuid": "GPU-not-registered", "device_name": "NVIDIA H100 80GB HBM3",
             "gpu_util_pct": 99}
        ]),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");

    let (status, ctype, text) = scrape(&s, &s.operator).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(ctype.starts_with("application/openmetrics-text"), "{ctype}");
    assert!(text.trim_end().ends_with("# EOF"), "{text}");
    let busy = [
        ("UUID", held.as_str()),
        ("Hostname", "gpu-01"),
        ("modelName", "NVIDIA H100 80GB HBM3"),
        ("instance_id", inst_id.as_str()),
        ("node_id", node.as_str()),
    ];
    assert_eq!(series(&text, "DCGM_FI_DEV_GPU_UTIL", &busy), Some(87.0));
    assert_eq!(
        series(&text, "DCGM_FI_DEV_MEM_COPY_UTIL", &busy),
        Some(41.0)
    );
    assert_eq!(series(&text, "DCGM_FI_DEV_FB_USED", &busy), Some(61234.0));
    assert_eq!(series(&text, "DCGM_FI_DEV_FB_FREE", &busy), Some(20325.0));
    assert_eq!(series(&text, "DCGM_FI_DEV_GPU_TEMP", &busy), Some(64.0));
    assert_eq!(
        series(&text, "DCGM_FI_DEV_POWER_USAGE", &busy),
        Some(512.25)
    );
    assert_eq!(series(&text, "DCGM_FI_DEV_SM_CLOCK", &busy), Some(1980.0));
    let device = format!("nvidia{}", index_of(&held));
    assert_eq!(
        series(
            &text,
            "DCGM_FI_DEV_GPU_UTIL",
            &[("UUID", held.as_str()), ("device", device.as_str())]
        ),
        Some(87.0)
    );
    let idle = [("UUID", other), ("instance_id", "")];
    assert_eq!(series(&text, "DCGM_FI_DEV_GPU_UTIL", &idle), Some(0.0));
    assert_eq!(series(&text, "DCGM_FI_DEV_POWER_USAGE", &idle), None);
    assert!(!text.contains("GPU-not-registered"), "{text}");

    assert_eq!(
        series(
            &text,
            "flotilla_gpus",
            &[("model", "H100"), ("state", "allocated")]
        ),
        Some(1.0)
    );
    assert_eq!(
        series(
            &text,
            "flotilla_gpus",
            &[("model", "H100"), ("state", "free")]
        ),
        Some(1.0)
    );
    assert_eq!(
        series(&text, "flotilla_nodes", &[("state", "ready")]),
        Some(1.0)
    );

    // The tenant sees its own instance's GPU, and only that one.
    let t = s
        .ok(
            &member,
            Method::GET,
            &format!("/v1/instances/{inst_id}/telemetry"),
            None,
        )
        .await;
    assert_eq!(t["node_id"], node.as_str(), "{t}");
    let gpus = t["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 1, "{t}");
    assert_eq!(gpus[0]["uuid"], held.as_str());
    assert_eq!(gpus[0]["gpu_util_pct"], 87);
    assert_eq!(gpus[0]["power_w"], 512.25);
    assert!(t["at"].is_string(), "{t}");
    let stranger_tenant = s.create_tenant("other").await;
    let stranger = s.key(&stranger_tenant, "tenant_member").await;
    let (status, _) = s
        .call(
            &stranger,
            Method::GET,
            &format!("/v1/instances/{inst_id}/telemetry"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // Tenants' keys may not scrape: the labels name their instances.
    let (status, _, _) = scrape(&s, &member).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _, _) = scrape(&s, "flt_0000").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}
