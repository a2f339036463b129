//! Human output: borderless tables, relative ages and the one-line
//! renderings of GPUs, nodes and instance states that several commands
//! share. Machine output (`--json`) bypasses this module.

use std::io::Write;

use chrono::{DateTime, Utc};
use comfy_table::{presets, ContentArrangement, Table};
use flotilla_core::api::{Instance, Node};
use flotilla_core::instance::InstanceState;

/// `println!` that returns the error of a closed stdout (`flotilla ps |
/// head`) instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::output::write_out(format_args!($($arg)*))
    };
}
pub(crate) use outln;

/// `println!` for the long-running processes: a closed stdout (`flotilla up
/// | grep -m1 flt_`) must not take the server down, so errors are dropped.
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = $crate::output::write_out(format_args!($($arg)*));
    }};
}
pub(crate) use say;

/// Writes one line to stdout and flushes it.
pub fn write_out(args: std::fmt::Arguments<'_>) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)?;
    out.write_all(b"\n")?;
    out.flush()
}

/// Whether an error is a write to a closed pipe: the reader went away,
/// which is no reason for an error message.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .map(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            .or_else(|| {
                c.downcast_ref::<serde_json::Error>()
                    .map(|j| j.io_error_kind() == Some(std::io::ErrorKind::BrokenPipe))
            })
            .unwrap_or(false)
    })
}

/// A borderless table with the given header.
pub fn table<const N: usize>(header: [&str; N]) -> Table {
    let mut t = Table::new();
    t.load_preset(presets::NOTHING)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(header);
    // No padding on the left and two spaces between columns, like `kubectl`.
    for col in t.column_iter_mut() {
        col.set_padding((0, 2));
    }
    t
}

/// Prints a table to stdout, trimming the padding comfy-table leaves at
/// the ends of lines.
pub fn print_table(t: &Table) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    for line in t.lines() {
        writeln!(out, "{}", line.trim_end())?;
    }
    out.flush()
}

/// Prints an answer of the API for `--json`, read through its type and
/// written again by way of [`serde_json::Value`]: objects then print with
/// their keys in the order `Value` keeps them (sorted), the order `--json`
/// has always shown the server's answers in, whichever type read them.
pub fn print_answer<T: serde::Serialize>(answer: &T) -> anyhow::Result<()> {
    print_json(&serde_json::to_value(answer)?)
}

/// Prints any serialisable value as pretty JSON on stdout.
pub fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value)?;
    writeln!(out)?;
    out.flush()?;
    Ok(())
}

/// A relative age such as `12s`, `5m`, `3h` or `4d`. Times in the future
/// (clock skew between machines) count as `0s`.
pub fn age(now: DateTime<Utc>, then: DateTime<Utc>) -> String {
    let secs = (now - then).num_seconds().max(0);
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m", s / 60),
        s if s < 86_400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

/// `2xH100` once placed; before, the request: `2xH100|A100-80GB` or `2xany`.
pub fn instance_gpus(inst: &Instance) -> String {
    let model = match &inst.gpu_model {
        Some(m) => m.clone(),
        None if inst.gpu_types.is_empty() => "any".to_string(),
        None => inst.gpu_types.join("|"),
    };
    if let Some(f) = inst.gpu_fraction {
        return format!("{f} × {model}");
    }
    if let Some(p) = &inst.mig_profile {
        return format!("{model} {p}");
    }
    format!("{}x{model}", inst.gpus)
}

/// A GPU meter's model with its share, as `ps` shows an instance's:
/// `L40S` for whole GPUs, `0.25 × L40S` for a share, `H100 1g.10gb` for
/// a MIG instance.
pub fn metered_gpu(model: &str, share: &flotilla_core::placement::GpuShare) -> String {
    share.label(model)
}

/// Where an instance's published ports are reached, comma-separated; `-`
/// when it publishes none (or they are not known yet).
pub fn instance_urls(inst: &Instance) -> String {
    if inst.published_ports.is_empty() {
        return "-".to_string();
    }
    inst.published_ports
        .iter()
        .map(|p| p.url.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

/// A node's GPUs by model, in first-seen order: `4xH100 (2 free)`, models
/// separated by `, `; `-` for a node without GPUs.
pub fn node_gpus(node: &Node) -> String {
    let mut models: Vec<(&str, u32, u32)> = Vec::new();
    for g in &node.gpus {
        // A GPU out of placement by a fault is not free.
        let free = u32::from(g.instance_id.is_none() && g.used_milli == 0 && g.fault.is_none());
        match models.iter_mut().find(|(m, _, _)| *m == g.model) {
            Some(entry) => {
                entry.1 += 1;
                entry.2 += free;
            }
            None => models.push((&g.model, 1, free)),
        }
    }
    if models.is_empty() {
        return "-".to_string();
    }
    models
        .iter()
        .map(|(m, n, free)| format!("{n}x{m} ({free} free)"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A node's state column: `ready`, `unreachable`, plus `,cordoned` and
/// `,simulated` flags.
pub fn node_state(node: &Node) -> String {
    let mut s = node.state.as_str().to_string();
    if node.cordoned {
        s.push_str(",cordoned");
    }
    if node.simulated {
        s.push_str(",simulated");
    }
    s
}

/// The progress line `flotilla run` prints when an instance enters `state`.
pub fn state_line(inst: &Instance, state: InstanceState, reason: &str) -> String {
    let node = inst.node_id.as_ref().map(|n| n.as_str()).unwrap_or("?");
    let reason = one_line(reason);
    // Reasons often repeat the state ("stopped (exit code 143)").
    let with_reason = |s: &str| {
        if reason.is_empty() {
            s.to_string()
        } else if reason.starts_with(s) {
            reason.clone()
        } else {
            format!("{s}: {reason}")
        }
    };
    match state {
        InstanceState::Scheduled => format!("scheduled on {node} ({})", instance_gpus(inst)),
        InstanceState::Starting => format!("starting on {node}"),
        InstanceState::Running => format!("running on {node}"),
        InstanceState::Failed => match inst.exit_code {
            Some(code) if !reason.contains(&code.to_string()) => {
                format!("{} (exit code {code})", with_reason("failed"))
            }
            _ => with_reason("failed"),
        },
        other => with_reason(other.as_str()),
    }
}

/// A value as the API writes it (a time in RFC 3339, a decimal or an enum
/// by its wire name, nothing for `null`), so tables show what `--json`
/// shows.
pub fn wire<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(serde_json::Value::Null) | Err(_) => String::new(),
        Ok(other) => other.to_string(),
    }
}

/// Keeps a cell on one line: a reason with a newline would break the table.
pub fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Appends a work's transitions, oldest first, under `history:`: when
/// (UTC, milliseconds), the state entered and why.
pub fn history<'a>(
    out: &mut Vec<String>,
    events: impl Iterator<Item = (chrono::DateTime<chrono::Utc>, &'a str, &'a str)>,
) {
    out.push("history:".into());
    for (at, state, reason) in events {
        out.push(format!(
            "  {}  {state:<9}  {reason}",
            at.format("%Y-%m-%d %H:%M:%S%.3fZ")
        ));
    }
}

/// A job's GPUs as lists show them: the total, then nodes × per node.
pub(crate) fn job_gpus(j: &flotilla_core::api::Job) -> String {
    let model = if j.spec.gpu_types.is_empty() {
        "any".to_string()
    } else {
        j.spec.gpu_types.join("|")
    };
    format!(
        "{}x{model} ({}x{})",
        j.spec.gpus,
        j.spec.nodes,
        j.spec.gpus_per_member()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn metered_shares_read_as_ps_shows_them() {
        use flotilla_billing::meter::GpuShare;
        assert_eq!(
            metered_gpu("L40S", &GpuShare::Fraction { milli: 250 }),
            "0.25 × L40S"
        );
        assert_eq!(
            metered_gpu("H100", &GpuShare::Fraction { milli: 500 }),
            "0.5 × H100"
        );
        assert_eq!(metered_gpu("H100", &GpuShare::Whole), "H100");
        let mig = GpuShare::mig_named("1g.10gb").unwrap();
        assert_eq!(metered_gpu("H100", &mig), "H100 1g.10gb");
    }

    #[test]
    fn ages_use_the_largest_whole_unit() {
        let now = Utc.with_ymd_and_hms(2025, 1, 2, 12, 0, 0).unwrap();
        let ago = |s: i64| age(now, now - chrono::Duration::seconds(s));
        assert_eq!(ago(0), "0s");
        assert_eq!(ago(12), "12s");
        assert_eq!(ago(59), "59s");
        assert_eq!(ago(60), "1m");
        assert_eq!(ago(5 * 60 + 59), "5m");
        assert_eq!(ago(3600), "1h");
        assert_eq!(ago(3 * 3600 + 1800), "3h");
        assert_eq!(ago(86_400 * 4 + 7), "4d");
        assert_eq!(ago(-30), "0s", "future times are clock skew");
    }

    #[test]
    fn one_line_collapses_whitespace() {
        assert_eq!(one_line(" a\n b\tc "), "a b c");
    }
}
