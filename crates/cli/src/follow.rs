//! Following an instance to its end: its log lines go to stdout and stderr
//! as they arrive, its state changes to stderr, and the follow stream is
//! reopened from the next sequence number whenever it breaks (a server
//! restart loses no line and repeats none).
//!
//! Used by `flotilla run` (which also turns Ctrl-C into one stop request)
//! and `flotilla logs -f`. stdout carries only the instance's stdout lines.

use std::io::Write;
use std::time::Duration;

use anyhow::{anyhow, Result};
use flotilla_core::api::{Instance, LogLine, LogStream};
use flotilla_core::instance::InstanceState;
use flotilla_core::text::escape_controls;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::client::{self, Client, LogFollow};
use crate::daemon::Signals;
use crate::output::state_line;

/// How often the state is polled while following.
const POLL_INTERVAL: Duration = Duration::from_millis(500);
/// Once the state is final, how long the stream may take to end by itself
/// before the rest of the log is read page by page.
const FINAL_GRACE: Duration = Duration::from_secs(3);
/// How long the server may stay unreachable before giving up: long enough
/// for a restart, short enough not to hang on a server that is gone.
const GIVE_UP_AFTER: Duration = Duration::from_secs(60);
/// Longest wait between reconnects.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// What to do besides printing lines.
pub struct FollowOptions {
    /// Print state changes to stderr.
    pub progress: bool,
    /// Print each line as one JSON object on stdout instead of its text.
    pub json: bool,
    /// Stop the instance on the first SIGINT/SIGTERM, give up on the
    /// second. Without it the default signal handling ends the process.
    pub signals: Option<Signals>,
}

/// How following ended.
pub enum Followed {
    /// The instance reached a final state (or was lost).
    Final(Box<Instance>),
    /// The user interrupted twice; the instance is left stopping.
    Abandoned,
}

/// The process exit code `flotilla run` returns for a final instance.
pub fn exit_code_for(inst: &Instance) -> u8 {
    match inst.state {
        InstanceState::Succeeded => 0,
        InstanceState::Failed => match inst.exit_code {
            Some(c) if (1..=255).contains(&c) => c as u8,
            _ => 1,
        },
        InstanceState::Stopped => 130,
        _ => 1,
    }
}

/// Writes one log line where it belongs, flushed so that a reader of a
/// pipe sees it at once.
pub fn write_line(line: &LogLine, json: bool) -> Result<()> {
    let res = if json {
        let text = serde_json::to_string(line)?;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{text}").and_then(|()| out.flush())
    } else {
        // The workload's control characters as text: they must not act
        // on the reader's terminal (`--json` gives them as they are).
        let text = escape_controls(&line.line);
        match line.stream {
            LogStream::Stdout => {
                let mut out = std::io::stdout().lock();
                writeln!(out, "{text}").and_then(|()| out.flush())
            }
            LogStream::Stderr => {
                let mut err = std::io::stderr().lock();
                writeln!(err, "{text}").and_then(|()| err.flush())
            }
        }
    };
    res.map_err(|e| anyhow::Error::new(e).context("writing the instance's output"))
}

/// Watches the instance's state: prints each new transition (and changes
/// of the pending reason) when `progress`, and publishes the instance once
/// it is final. Poll errors are skipped: the server may be restarting.
async fn poll_states(
    client: Client,
    initial: Instance,
    progress: bool,
    tx: watch::Sender<Option<Instance>>,
) {
    let id = initial.id.to_string();
    let mut printed = 0usize;
    let mut pending_reason: Option<String> = None;
    let mut report = |inst: &Instance| {
        if !progress {
            return;
        }
        // After a restart the server may hold fewer events than were seen.
        printed = printed.min(inst.events.len());
        for ev in &inst.events[printed..] {
            if ev.state.is_terminal() {
                continue;
            }
            if ev.state == InstanceState::Pending {
                if ev.reason.is_empty() {
                    continue;
                }
                pending_reason = Some(ev.reason.clone());
            }
            eprintln!("{}", state_line(inst, ev.state, &ev.reason));
        }
        printed = inst.events.len();
        if inst.state == InstanceState::Pending
            && !inst.state_reason.is_empty()
            && pending_reason.as_deref() != Some(inst.state_reason.as_str())
        {
            pending_reason = Some(inst.state_reason.clone());
            eprintln!("pending: {}", crate::output::one_line(&inst.state_reason));
        }
    };
    report(&initial);
    if initial.state.is_terminal() {
        let _ = tx.send(Some(initial));
        return;
    }
    loop {
        tokio::time::sleep(POLL_INTERVAL).await;
        let Ok(inst) = client.instance(&id).await else {
            continue;
        };
        report(&inst);
        if inst.state.is_terminal() {
            let _ = tx.send(Some(inst));
            return;
        }
    }
}

enum Event {
    Line(Result<Option<LogLine>>),
    Signal,
    FinalSeen,
    GraceOver,
}

/// Reads the next line, (re)connecting first when there is no stream.
/// A successful reconnect clears `failing_since`.
async fn next_line(
    client: &Client,
    id: &str,
    since: u64,
    stream: &mut Option<LogFollow>,
    delay: Duration,
    failing_since: &mut Option<Instant>,
    progress: bool,
) -> Result<Option<LogLine>> {
    if stream.is_none() {
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        *stream = Some(client.follow_logs(id, since).await?);
        if failing_since.take().is_some() && progress {
            eprintln!("reconnected");
        }
    }
    match stream.as_mut() {
        Some(s) => Ok(s.next().await?),
        None => Ok(None),
    }
}

async fn maybe_signal(signals: &mut Option<Signals>) {
    match signals {
        Some(s) => s.recv().await,
        None => std::future::pending().await,
    }
}

async fn maybe_sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Follows `initial` until it is final, printing its log from `since`.
pub async fn follow(
    client: &Client,
    initial: Instance,
    since: u64,
    mut opts: FollowOptions,
) -> Result<Followed> {
    let id = initial.id.to_string();
    let (tx, mut final_rx) = watch::channel::<Option<Instance>>(None);
    let poller = tokio::spawn(poll_states(client.clone(), initial, opts.progress, tx));
    // Abort the poller however this function ends.
    struct AbortOnDrop(tokio::task::JoinHandle<()>);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let _poller = AbortOnDrop(poller);

    let mut next_seq = since;
    let mut stream: Option<LogFollow> = None;
    let mut delay = Duration::ZERO;
    let mut failing_since: Option<Instant> = None;
    let mut grace_until: Option<Instant> = None;
    let mut final_known = false;
    let mut stop_sent = false;

    let final_instance = loop {
        let event = tokio::select! {
            biased;
            _ = maybe_signal(&mut opts.signals) => Event::Signal,
            r = final_rx.changed(), if !final_known => match r {
                Ok(()) => Event::FinalSeen,
                // The poller ended without a final state (aborted): ignore.
                Err(_) => { final_known = true; continue; }
            },
            _ = maybe_sleep_until(grace_until) => Event::GraceOver,
            r = next_line(client, &id, next_seq, &mut stream, delay, &mut failing_since, opts.progress) => {
                Event::Line(r)
            }
        };
        match event {
            Event::Line(Ok(Some(line))) => {
                delay = Duration::ZERO;
                if line.seq >= next_seq {
                    next_seq = line.seq + 1;
                    write_line(&line, opts.json)?;
                }
            }
            Event::Line(Ok(None)) => {
                // The server ended the stream: normally because the
                // instance is final. Check; otherwise reopen shortly.
                stream = None;
                match client.instance(&id).await {
                    Ok(inst) if inst.state.is_terminal() || inst.state == InstanceState::Lost => {
                        break inst;
                    }
                    _ => delay = POLL_INTERVAL,
                }
            }
            Event::Line(Err(e)) => {
                stream = None;
                if !client::is_transient(&e) {
                    return Err(e);
                }
                if failing_since.is_none() && opts.progress {
                    eprintln!(
                        "lost the connection to the server ({}); reconnecting",
                        crate::error_line(&e)
                    );
                }
                let since = *failing_since.get_or_insert_with(Instant::now);
                if since.elapsed() > GIVE_UP_AFTER {
                    return Err(anyhow!("gave up following {id}: {e:#}"));
                }
                tracing::debug!(error = %e, "log stream broke; reconnecting");
                delay = (delay * 2).clamp(Duration::from_millis(250), MAX_BACKOFF);
            }
            Event::Signal => {
                if stop_sent {
                    eprintln!("no longer following {id}; it keeps stopping");
                    return Ok(Followed::Abandoned);
                }
                stop_sent = true;
                eprintln!("stopping {id}");
                match client.stop_instance(&id).await {
                    Ok(_) => {}
                    // Already final: the stream ends by itself.
                    Err(e) if e.is_conflict() => {}
                    Err(e) => eprintln!("error: stopping {id}: {}", client::describe(&e)),
                }
            }
            Event::FinalSeen => {
                final_known = true;
                grace_until = Some(Instant::now() + FINAL_GRACE);
            }
            Event::GraceOver => {
                grace_until = None;
                let inst = final_rx.borrow().clone();
                match inst {
                    Some(inst) => break inst,
                    None => continue,
                }
            }
        }
    };
    drop(stream);
    // Whatever the stream did not deliver (it ended early, or never came).
    // The outcome is known by now, so a server that went away meanwhile
    // (`flotilla up` shutting down) costs a warning, not the exit code.
    match client.logs_all(&id, next_seq).await {
        Ok(lines) => {
            for line in lines {
                write_line(&line, opts.json)?;
            }
        }
        Err(e) => eprintln!("warning: could not read the rest of the log: {e:#}"),
    }
    Ok(Followed::Final(Box::new(final_instance)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inst(state: InstanceState, exit_code: Option<i32>) -> Instance {
        let json = serde_json::json!({
            "id": "inst_01jd3x7k2q9v8m4n6p5r0s1t2w",
            "tenant_id": "ten_01jd3x7k2q9v8m4n6p5r0s1t2w",
            "state": state,
            "state_reason": "",
            "gpus": 1,
            "gpu_types": [],
            "cpu_milli": 1000,
            "memory_mb": 1024,
            "command": ["true"],
            "env": {},
            "billing_class": "on_demand",
            "gpu_ids": [],
            "exit_code": exit_code,
            "stop_requested": false,
            "created_at": "2025-01-01T00:00:00Z",
            "events": []
        });
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn exit_codes_follow_the_final_state() {
        use InstanceState::*;
        assert_eq!(exit_code_for(&inst(Succeeded, Some(0))), 0);
        assert_eq!(exit_code_for(&inst(Failed, Some(3))), 3);
        assert_eq!(exit_code_for(&inst(Failed, Some(137))), 137);
        assert_eq!(exit_code_for(&inst(Failed, None)), 1);
        assert_eq!(exit_code_for(&inst(Failed, Some(0))), 1);
        assert_eq!(exit_code_for(&inst(Failed, Some(-1))), 1);
        assert_eq!(exit_code_for(&inst(Failed, Some(300))), 1);
        assert_eq!(exit_code_for(&inst(Stopped, None)), 130);
        assert_eq!(exit_code_for(&inst(Lost, None)), 1);
    }
}
