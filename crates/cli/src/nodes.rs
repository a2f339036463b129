//! `flotilla nodes cordon|uncordon|drain|events|reset-gpu`: taking nodes
//! and GPUs out of placement and back, and what happened to them.

use std::process::ExitCode;

use anyhow::{anyhow, Result};
use flotilla_core::id::{EndpointId, GpuId, InstanceId, NodeId};
use serde::Serialize;

use crate::ctx::Ctx;
use crate::output::{self, outln, print_answer, print_table, table};

fn node_id(raw: &str) -> Result<NodeId> {
    NodeId::parse(raw.trim(), "node id").map_err(|e| anyhow!("{e}"))
}

/// The answer to a node action: with `--json` printed as it is and `None`
/// returned, the command then printing nothing more; otherwise handed back
/// for the command to show.
fn act<T: Serialize>(ctx: &Ctx, answer: T) -> Result<Option<T>> {
    if ctx.json {
        print_answer(&answer)?;
        return Ok(None);
    }
    Ok(Some(answer))
}

/// `flotilla nodes cordon ID` / `uncordon ID`.
pub async fn cordon(ctx: &Ctx, id: &str, cordoned: bool) -> Result<ExitCode> {
    let id = node_id(id)?;
    let Some(n) = act(ctx, ctx.client.cordon_node(&id, cordoned).await?)? else {
        return Ok(ExitCode::SUCCESS);
    };
    outln!("{} {}: {}", n.id, n.name, output::node_state(&n))?;
    Ok(ExitCode::SUCCESS)
}

/// `flotilla nodes drain ID`.
pub async fn drain(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    let id = node_id(id)?;
    let Some(r) = act(ctx, ctx.client.drain_node(&id).await?)? else {
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
    let Some(n) = act(ctx, ctx.client.reset_gpu(&id, &gpu).await?)? else {
        return Ok(ExitCode::SUCCESS);
    };
    outln!("{} {}: gpus {}", n.id, n.name, output::node_gpus(&n))?;
    Ok(ExitCode::SUCCESS)
}

/// `flotilla nodes events ID`.
pub async fn events(ctx: &Ctx, id: &str) -> Result<ExitCode> {
    let id = node_id(id)?;
    let events = ctx.client.node_events(&id).await?;
    if ctx.json {
        print_answer(&events)?;
        return Ok(ExitCode::SUCCESS);
    }
    let mut t = table(["SEQ", "AT", "KIND", "GPU", "MESSAGE"]);
    for e in events {
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
    let (what, summary, recommendation, per) = if id.starts_with("ep_") {
        let id = EndpointId::parse(id, "endpoint id").map_err(|e| anyhow!("{e}"))?;
        let a = ctx.client.endpoint_advice(&id).await?;
        if ctx.json {
            print_answer(&a)?;
            return Ok(ExitCode::SUCCESS);
        }
        let per = format!(" over {} replica(s)", a.replicas);
        (id.to_string(), a.summary, a.recommendation, per)
    } else {
        let id = InstanceId::parse(id, "instance id").map_err(|e| anyhow!("{e}"))?;
        let a = ctx.client.instance_advice(&id).await?;
        if ctx.json {
            print_answer(&a)?;
            return Ok(ExitCode::SUCCESS);
        }
        (id.to_string(), a.summary, a.recommendation, String::new())
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
