//! `flotilla nodes cordon|uncordon|drain|events|reset-gpu`: taking nodes
//! and GPUs out of placement and back, and what happened to them.

use std::process::ExitCode;

use anyhow::{anyhow, Result};
use flotilla_core::api::{DrainReport, Node, NodeEvent};
use flotilla_core::id::{GpuId, NodeId};
use serde_json::{json, Value};

use crate::client::decode;
use crate::ctx::Ctx;
use crate::output::{self, outln, print_json, print_table, table};

fn node_id(raw: &str) -> Result<NodeId> {
    NodeId::parse(raw.trim(), "node id").map_err(|e| anyhow!("{e}"))
}

/// POSTs a node action (its body empty). With `--json` the answer is
/// printed as it came and `None` returned, the command then printing
/// nothing more; otherwise the answer decoded for the command to show.
async fn act<T: serde::de::DeserializeOwned>(ctx: &Ctx, path: &str) -> Result<Option<T>> {
    let raw: Value = ctx.client.post(path, &json!({})).await?;
    if ctx.json {
        print_json(&raw)?;
        return Ok(None);
    }
    decode(raw).map(Some)
}

/// `flotilla nodes cordon ID` / `uncordon ID`.
pub async fn cordon(ctx: &Ctx, id: &str, cordoned: bool) -> Result<ExitCode> {
    let id = node_id(id)?;
    let verb = if cordoned { "cordon" } else { "uncordon" };
    let Some(n) = act::<Node>(ctx, &format!("/v1/nodes/{id}/{verb}")).await? else {
        return Ok(ExitCode::SUCCESS);
    };
    outln!("{} {}: {}", n.id, n.name, output::node_state(&n))?;
    Ok(ExitCode::SUCCESS)
}

/// `flotilla nodes drain ID`.
pub async fn drain(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    let id = node_id(id)?;
    let Some(r) = act::<DrainReport>(ctx, &format!("/v1/nodes/{id}/drain")).await? else {
        return Ok(ExitCode::SUCCESS);
    };
    outln!(
        "{} {}: {}; {} instance(s) stopping",
        r.node.id,
        r.node.name,
        output::node_state(&r.node),
        r.stopping.len()
    )?;
    for i in &r.stopping {
        outln!("  {i}")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `flotilla nodes reset-gpu NODE GPU`.
pub async fn reset_gpu(ctx: &Ctx, id: &str, gpu: &str) -> Result<ExitCode> {
    let id = node_id(id)?;
    let gpu = GpuId::parse(gpu.trim(), "gpu id").map_err(|e| anyhow!("{e}"))?;
    let Some(n) = act::<Node>(ctx, &format!("/v1/nodes/{id}/gpus/{gpu}/reset")).await? else {
        return Ok(ExitCode::SUCCESS);
    };
    outln!("{} {}: gpus {}", n.id, n.name, output::node_gpus(&n))?;
    Ok(ExitCode::SUCCESS)
}

/// `flotilla nodes events ID`.
pub async fn events(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    let id = node_id(id)?;
    let raw: Vec<Value> = ctx
        .client
        .list(&format!("/v1/nodes/{id}/events"), &[], None)
        .await?;
    if ctx.json {
        print_json(&raw)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut t = table(["SEQ", "AT", "KIND", "GPU", "MESSAGE"]);
    for v in raw {
        let e: NodeEvent = decode(v)?;
        t.add_row([
            e.seq.to_string(),
            e.at.format("%Y-%m-%d %H:%M:%S").to_string(),
            e.kind,
            e.gpu_id.map(|g| g.to_string()).unwrap_or_default(),
            e.message,
        ]);
    }
    print_table(&t)?;
    Ok(ExitCode::SUCCESS)
}

/// `flotilla advise ID`: an instance's (`inst_…`) or an endpoint's
/// (`ep_…`) utilisation and right-sizing advice.
pub async fn advise(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    let id = id.trim();
    let (path, what) = if id.starts_with("ep_") {
        let id =
            flotilla_core::id::EndpointId::parse(id, "endpoint id").map_err(|e| anyhow!("{e}"))?;
        (format!("/v1/endpoints/{id}/advice"), id.to_string())
    } else {
        let id =
            flotilla_core::id::InstanceId::parse(id, "instance id").map_err(|e| anyhow!("{e}"))?;
        (format!("/v1/instances/{id}/advice"), id.to_string())
    };
    let raw: Value = ctx.client.get(&path, &[]).await?;
    if ctx.json {
        print_json(&raw)?;
        return Ok(ExitCode::SUCCESS);
    }
    let (summary, recommendation, per) = if what.starts_with("ep_") {
        let a: flotilla_core::advice::EndpointAdvice = decode(raw)?;
        let per = format!(" over {} replica(s)", a.replicas);
        (a.summary, a.recommendation, per)
    } else {
        let a: flotilla_core::advice::InstanceAdvice = decode(raw)?;
        (a.summary, a.recommendation, String::new())
    };
    let Some(s) = summary else {
        outln!("{what}: no GPU readings yet (simulated GPUs report none)")?;
        return Ok(ExitCode::SUCCESS);
    };
    outln!(
        "utilisation: mean {:.1} %, p95 {} %, idle {:.0} % of {} readings{per}",
        s.mean_util_pct,
        s.p95_util_pct,
        s.idle_fraction * 100.0,
        s.samples
    )?;
    outln!("peak memory: {} MiB per GPU", s.peak_memory_mib)?;
    if let Some(r) = &recommendation {
        outln!("advice:      {}", r.reason)?;
    }
    Ok(ExitCode::SUCCESS)
}
