//! Pure translations between Slurm and Flotilla: job states to observed
//! phases (with Slurm's own times), GRES strings to GPUs, and a command's
//! argv to a batch script that runs it without a shell reading it.

use chrono::{DateTime, TimeZone, Utc};
use flotilla_core::api::{DiscoveredGpu, ObservedPhase};
use flotilla_core::catalog::Catalog;

use super::rest::Job;

/// What a Slurm job state means for the instance it runs.
#[derive(Debug, Clone, PartialEq)]
pub enum JobPhase {
    /// Waiting for resources or being set up: the instance starts.
    Waiting,
    /// Running since `start_time`.
    Running,
    /// Over, with this exit code (128 + signal when a signal ended it);
    /// `cancelled` when `scancel` (Flotilla's stop) ended it.
    Over {
        /// Exit code, shell style.
        code: i32,
        /// Ended by a cancel.
        cancelled: bool,
    },
    /// Ended before it ever ran (`start_time` 0) for a reason other than a
    /// cancel: Slurm could not start it.
    NeverStarted {
        /// Why, from Slurm's state and reason.
        reason: String,
    },
}

/// 128 + SIGTERM, what a shell reports for a job `scancel` ended.
pub const CANCELLED_CODE: i32 = 143;
/// 128 + SIGKILL, for a job Slurm killed for exceeding its memory.
pub const OOM_CODE: i32 = 137;
/// `timeout(1)`'s code, for a job that reached its time limit.
pub const TIMEOUT_CODE: i32 = 124;

/// Shell-style exit code of a wait status (`exit << 8 | signal`).
pub fn exit_code(status: i64) -> i32 {
    let status = status.clamp(0, i64::from(i32::MAX)) as i32;
    let signal = status & 0x7f;
    if signal != 0 {
        128 + signal
    } else {
        (status >> 8) & 0xff
    }
}

/// The phase of a job from its state. Unknown states are treated as still
/// waiting: the next observation will tell more, and reporting an end that
/// did not happen would free GPUs that are still in use.
pub fn phase(job: &Job) -> JobPhase {
    let status = job.exit_code.unwrap_or(0);
    let code = exit_code(status);
    let started = job.start_time > 0;
    let state = job.job_state.to_ascii_uppercase();
    // A base state may come with flags (`CANCELLED by 0`, `RUNNING+…`).
    let base = state
        .split(|c: char| !c.is_ascii_alphabetic() && c != '_')
        .next()
        .unwrap_or("");
    let nonzero = |fallback: i32| if code != 0 { code } else { fallback };
    match base {
        "PENDING" | "CONFIGURING" | "REQUEUED" | "REQUEUE_HOLD" | "REQUEUE_FED" | "RESIZING"
        | "SUSPENDED" | "STOPPED" | "SIGNALING" | "STAGE_OUT" | "RESV_DEL_HOLD" => {
            if started && base != "PENDING" && base != "CONFIGURING" {
                JobPhase::Running
            } else {
                JobPhase::Waiting
            }
        }
        "RUNNING" | "COMPLETING" => JobPhase::Running,
        "COMPLETED" => JobPhase::Over {
            code,
            cancelled: false,
        },
        "CANCELLED" => JobPhase::Over {
            code: nonzero(CANCELLED_CODE),
            cancelled: true,
        },
        "FAILED" if !started => JobPhase::NeverStarted {
            reason: format!("Slurm failed the job before it ran ({})", job.state_reason),
        },
        "FAILED" => JobPhase::Over {
            code: nonzero(1),
            cancelled: false,
        },
        "TIMEOUT" | "DEADLINE" => JobPhase::Over {
            code: nonzero(TIMEOUT_CODE),
            cancelled: false,
        },
        "OUT_OF_MEMORY" => JobPhase::Over {
            code: OOM_CODE,
            cancelled: false,
        },
        // Slurm's own preemption (a higher-priority Slurm job, not
        // Flotilla's): the work ended without being asked to by Flotilla.
        "PREEMPTED" => JobPhase::Over {
            code: nonzero(CANCELLED_CODE),
            cancelled: false,
        },
        "NODE_FAIL" | "BOOT_FAIL" | "LAUNCH_FAILED" if !started => JobPhase::NeverStarted {
            reason: format!("Slurm reported {base} ({})", job.state_reason),
        },
        "NODE_FAIL" | "BOOT_FAIL" | "LAUNCH_FAILED" => JobPhase::Over {
            code: nonzero(1),
            cancelled: false,
        },
        _ => JobPhase::Waiting,
    }
}

/// Unix seconds as a time; 0 or out of range: `None`.
pub fn time(secs: i64) -> Option<DateTime<Utc>> {
    if secs <= 0 {
        return None;
    }
    Utc.timestamp_opt(secs, 0).single()
}

/// The least a job Slurm ran is billed: one second, Slurm's unit.
///
/// Slurm 22.05 records a job's start and end in whole seconds (slurmctld's
/// `time(NULL)`; slurmdbd's accounting keeps the same two numbers, and its
/// `elapsed` is their difference), so the truth Flotilla bills a Slurm job
/// by is that record: `end_time - start_time`. A job that started and
/// ended within one second is recorded as 0 s, yet it ran; and slurmctld's
/// scheduler allocates on its timer just after a second begins, so most
/// jobs under a second (all of those measured on the test cluster) would
/// be recorded as 0 s and run free. Such a job is billed one second.
pub const MIN_BILLED: chrono::Duration = chrono::Duration::seconds(1);

/// What the bridge reports of a job: its phase, when that phase began, and
/// once it is over, when it began running.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    /// The instance's phase.
    pub phase: ObservedPhase,
    /// When that phase began, in Slurm's times.
    pub at: DateTime<Utc>,
    /// Slurm's `start_time` of a job that is over and ran: the server
    /// meters from it even when no report ever said the job was running
    /// (a job that ran and ended between two bridge rounds).
    pub started_at: Option<DateTime<Utc>>,
}

/// The observed phase of `job` and when it began, in Slurm's times:
/// submission while it waits, start while it runs, end once over (so the
/// server meters what Slurm ran: `end_time - start_time`, at least
/// [`MIN_BILLED`] for a job that ran). `now` stands in for a time Slurm has
/// not set. A job over whose billed end is still ahead of `now` (a job
/// under a second, just ended) is reported running until then: the server
/// takes no end later than its own clock, so reporting it sooner would cut
/// the bill below the rule.
pub fn observed(job: &Job, now: DateTime<Utc>) -> Observation {
    let submit = time(job.submit_time).unwrap_or(now);
    let ran = time(job.start_time);
    let start = ran.unwrap_or(submit);
    // While a job runs, `end_time` is the end its time limit allows:
    // read only once the job is over.
    let end = time(job.end_time).unwrap_or(now).max(start);
    let pid = u32::try_from(job.job_id).unwrap_or(u32::MAX);
    let at = |phase, at| Observation {
        phase,
        at,
        started_at: None,
    };
    match phase(job) {
        JobPhase::Waiting => at(ObservedPhase::Starting, submit),
        JobPhase::Running => at(ObservedPhase::Running { pid }, start),
        JobPhase::Over { code, cancelled } => {
            let Some(started) = ran else {
                // Cancelled before it ran: nothing to meter.
                return at(
                    ObservedPhase::Exited {
                        code,
                        stopped: cancelled,
                    },
                    end,
                );
            };
            let billed_end = end.max(started + MIN_BILLED);
            if billed_end > now {
                return at(ObservedPhase::Running { pid }, started);
            }
            Observation {
                phase: ObservedPhase::Exited {
                    code,
                    stopped: cancelled,
                },
                at: billed_end,
                started_at: Some(started),
            }
        }
        JobPhase::NeverStarted { reason } => at(ObservedPhase::FailedToStart { reason }, end),
    }
}

/// Whether a job is over (its output is complete).
pub fn is_over(job: &Job) -> bool {
    matches!(
        phase(job),
        JobPhase::Over { .. } | JobPhase::NeverStarted { .. }
    )
}

/// One GRES entry of a node, `gpu:h100:2(S:0-1)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gres {
    /// `gpu`, `shard`, …
    pub name: String,
    /// `h100`; `None` when the entry has no type.
    pub kind: Option<String>,
    /// How many.
    pub count: u32,
}

/// Parses a node's `gres` string (`gpu:h100:2,gpu:a100:1(S:0)`, `(null)`
/// or empty when none). Entries it cannot read are skipped with their
/// text returned, so the caller can say which.
pub fn parse_gres(s: &str) -> (Vec<Gres>, Vec<String>) {
    let mut out = Vec::new();
    let mut bad = Vec::new();
    let s = s.trim();
    if s.is_empty() || s == "(null)" || s.eq_ignore_ascii_case("n/a") {
        return (out, bad);
    }
    // Commas also appear inside a socket list (`(S:0,1)`): split on the
    // ones outside parentheses.
    let mut depth = 0u32;
    let mut parts = Vec::new();
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    parts.push(cur);
    for part in parts {
        let entry = part.split('(').next().unwrap_or("").trim();
        let fields: Vec<&str> = entry.split(':').collect();
        let parsed = match fields.as_slice() {
            [name] => Some((name, None, "1")),
            [name, count] if count.parse::<u32>().is_ok() => Some((name, None, *count)),
            [name, kind] => Some((name, Some(*kind), "1")),
            [name, kind, count] => Some((name, Some(*kind), *count)),
            _ => None,
        };
        match parsed.and_then(|(n, k, c)| Some((n, k, c.parse::<u32>().ok()?))) {
            Some((name, kind, count)) if !name.is_empty() => out.push(Gres {
                name: name.to_string(),
                kind: kind.map(str::to_string),
                count,
            }),
            _ => bad.push(part.trim().to_string()),
        }
    }
    (out, bad)
}

/// The GPUs of a node from its GRES: every `gpu` entry, numbered from 0 in
/// Slurm's order (the order of gres.conf, which is also the order of
/// `CUDA_VISIBLE_DEVICES` indices within a job's allocation). A type names
/// the catalog model (`h100` → `H100`); an untyped entry takes
/// `default_model`. Err names an entry whose model Flotilla does not know.
pub fn gpus(
    node: &str,
    gres: &str,
    catalog: &Catalog,
    default_model: Option<&str>,
) -> Result<Vec<DiscoveredGpu>, String> {
    let (entries, bad) = parse_gres(gres);
    if let Some(b) = bad.first() {
        return Err(format!("node {node}: cannot read GRES entry `{b}`"));
    }
    let mut out = Vec::new();
    for g in entries.iter().filter(|g| g.name == "gpu") {
        let wanted = g.kind.as_deref().or(default_model).ok_or_else(|| {
            format!(
                "node {node}: GRES `gpu:{}` has no type; pass a default GPU model",
                g.count
            )
        })?;
        let model = catalog
            .get(wanted)
            .or_else(|| catalog.get(&wanted.replace('_', "-")))
            .ok_or_else(|| format!("node {node}: GPU type `{wanted}` is not a catalog model"))?;
        for _ in 0..g.count {
            let index = out.len() as u32;
            out.push(DiscoveredGpu {
                index,
                model: model.name.clone(),
                uuid: format!("slurm-{node}-gpu{index}"),
                memory_mib: u64::from(model.memory_gib) * 1024,
                vendor: model.vendor,
                mig_mode: false,
            });
        }
    }
    Ok(out)
}

/// Quotes one word for a POSIX shell: inside single quotes nothing is
/// special, and a single quote is closed, escaped and reopened.
pub fn shell_quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// The batch script that runs `argv` as is: `exec` of the quoted words, so
/// no shell expansion, substitution or word splitting touches them.
/// slurmrestd 22.05's `argv` field would say the same without quoting, but
/// it crashes slurmrestd (`general protection fault` in libslurmfull), so
/// the words go into the script. Err when argv is empty or a word holds a
/// NUL (which no process argument can).
pub fn script(instance: &str, argv: &[String]) -> Result<String, String> {
    if argv.is_empty() {
        return Err("the instance has no command".into());
    }
    if argv.iter().any(|a| a.contains('\0')) {
        return Err("a command argument contains a NUL byte".into());
    }
    let words: Vec<String> = argv.iter().map(|a| shell_quote(a)).collect();
    Ok(format!(
        "#!/bin/sh\n# Flotilla instance {instance}\nexec {}\n",
        words.join(" ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_core::api::ObservedPhase;

    fn job(state: &str, exit: i64, start: i64, end: i64) -> Job {
        Job {
            job_id: 42,
            name: "inst_x".into(),
            comment: "flotilla:n1".into(),
            job_state: state.into(),
            exit_code: Some(exit),
            submit_time: 1_000,
            start_time: start,
            end_time: end,
            nodes: "n1".into(),
            state_reason: "None".into(),
            standard_output: String::new(),
        }
    }

    #[test]
    fn states_map_to_phases() {
        let cases = [
            (job("PENDING", 0, 0, 0), JobPhase::Waiting),
            (job("CONFIGURING", 0, 1_001, 0), JobPhase::Waiting),
            (job("RUNNING", 0, 1_001, 9_999_999), JobPhase::Running),
            (job("COMPLETING", 0, 1_001, 1_005), JobPhase::Running),
            (
                job("COMPLETED", 0, 1_001, 1_005),
                JobPhase::Over {
                    code: 0,
                    cancelled: false,
                },
            ),
            (
                job("FAILED", 3 << 8, 1_001, 1_005),
                JobPhase::Over {
                    code: 3,
                    cancelled: false,
                },
            ),
            (
                job("CANCELLED", 15, 1_001, 1_005),
                JobPhase::Over {
                    code: 143,
                    cancelled: true,
                },
            ),
            (
                job("CANCELLED", 0, 0, 1_005),
                JobPhase::Over {
                    code: 143,
                    cancelled: true,
                },
            ),
            (
                job("PREEMPTED", 0, 1_001, 1_005),
                JobPhase::Over {
                    code: 143,
                    cancelled: false,
                },
            ),
            (
                job("TIMEOUT", 0, 1_001, 1_005),
                JobPhase::Over {
                    code: 124,
                    cancelled: false,
                },
            ),
            (
                job("NODE_FAIL", 0, 1_001, 1_005),
                JobPhase::Over {
                    code: 1,
                    cancelled: false,
                },
            ),
            (
                job("OUT_OF_MEMORY", 0, 1_001, 1_005),
                JobPhase::Over {
                    code: 137,
                    cancelled: false,
                },
            ),
            (job("SOMETHING_NEW", 0, 1_001, 1_005), JobPhase::Waiting),
        ];
        for (j, want) in cases {
            assert_eq!(phase(&j), want, "{}", j.job_state);
        }
        assert!(matches!(
            phase(&job("NODE_FAIL", 0, 0, 1_005)),
            JobPhase::NeverStarted { .. }
        ));
        assert!(matches!(
            phase(&job("FAILED", 1 << 8, 0, 1_005)),
            JobPhase::NeverStarted { .. }
        ));
    }

    #[test]
    fn wait_statuses_become_shell_codes() {
        assert_eq!(exit_code(0), 0);
        assert_eq!(exit_code(127 << 8), 127);
        assert_eq!(exit_code(9), 137);
        assert_eq!(exit_code(15), 143);
        assert_eq!(exit_code(-1), 0);
    }

    #[test]
    fn observed_uses_slurm_times() {
        let now = Utc.timestamp_opt(5_000, 0).unwrap();
        let o = observed(&job("PENDING", 0, 0, 0), now);
        assert_eq!(
            (o.phase, o.at.timestamp()),
            (ObservedPhase::Starting, 1_000)
        );
        // A running job's end_time is its time limit: ignored.
        let o = observed(&job("RUNNING", 0, 1_001, 99_999), now);
        assert_eq!(
            (o.phase, o.at.timestamp(), o.started_at),
            (ObservedPhase::Running { pid: 42 }, 1_001, None)
        );
        // Over: its end, with its start, so a job no report saw running is
        // metered from Slurm's start.
        let o = observed(&job("COMPLETED", 0, 1_001, 1_061), now);
        assert_eq!(
            (
                o.phase,
                o.at.timestamp(),
                o.started_at.map(|t| t.timestamp())
            ),
            (
                ObservedPhase::Exited {
                    code: 0,
                    stopped: false
                },
                1_061,
                Some(1_001)
            )
        );
        let o = observed(&job("CANCELLED", 15, 1_001, 1_061), now);
        assert_eq!(
            o.phase,
            ObservedPhase::Exited {
                code: 143,
                stopped: true
            }
        );
        // Cancelled while pending: no start, nothing to meter.
        let o = observed(&job("CANCELLED", 0, 0, 1_061), now);
        assert_eq!((o.at.timestamp(), o.started_at), (1_061, None));
    }

    /// A job Slurm records as 0 s (start == end: it ran under a second) is
    /// billed one second, and its exit is reported only once that second
    /// has passed.
    #[test]
    fn a_sub_second_job_is_billed_one_second() {
        let j = job("COMPLETED", 0, 4_000, 4_000);
        let done = |now: i64| observed(&j, Utc.timestamp_opt(now, 0).unwrap());
        let o = done(4_000);
        assert_eq!(
            (o.phase, o.at.timestamp(), o.started_at),
            (ObservedPhase::Running { pid: 42 }, 4_000, None)
        );
        for now in [4_001, 4_100] {
            let o = done(now);
            assert_eq!(
                (
                    o.phase,
                    o.at.timestamp(),
                    o.started_at.map(|t| t.timestamp())
                ),
                (
                    ObservedPhase::Exited {
                        code: 0,
                        stopped: false
                    },
                    4_001,
                    Some(4_000)
                )
            );
        }
        // One second or more recorded: exactly Slurm's record.
        let o = observed(
            &job("COMPLETED", 0, 4_000, 4_001),
            Utc.timestamp_opt(4_001, 0).unwrap(),
        );
        assert_eq!(
            (o.at - o.started_at.unwrap()).num_milliseconds(),
            1_000,
            "{o:?}"
        );
    }

    /// Every job in a `GET /jobs` body recorded from slurmrestd 22.05.8 maps
    /// to the phase its state says.
    #[test]
    fn recorded_jobs_map() {
        let r: super::super::rest::JobsResponse =
            serde_json::from_str(include_str!("testdata/jobs.json")).unwrap();
        let now = Utc::now();
        let mut seen = std::collections::BTreeSet::new();
        for j in &r.jobs {
            let Observation {
                phase: p,
                at,
                started_at,
            } = observed(j, now);
            seen.insert(j.job_state.clone());
            match j.job_state.as_str() {
                "COMPLETED" => {
                    assert_eq!(
                        p,
                        ObservedPhase::Exited {
                            code: 0,
                            stopped: false
                        }
                    );
                    assert_eq!(at.timestamp(), j.end_time.max(j.start_time + 1));
                    assert_eq!(started_at.map(|t| t.timestamp()), Some(j.start_time));
                }
                "FAILED" => {
                    assert!(
                        matches!(p, ObservedPhase::Exited { code, stopped: false } if code != 0),
                        "{p:?}"
                    );
                }
                "CANCELLED" => {
                    assert!(matches!(p, ObservedPhase::Exited { stopped: true, .. }));
                }
                "RUNNING" => {
                    assert_eq!(at.timestamp(), j.start_time);
                    assert!(matches!(p, ObservedPhase::Running { .. }));
                }
                "PENDING" => assert_eq!(p, ObservedPhase::Starting),
                other => panic!("recorded state {other} not covered"),
            }
        }
        for s in ["COMPLETED", "FAILED", "CANCELLED", "RUNNING", "PENDING"] {
            assert!(seen.contains(s), "the recording has no {s} job");
        }
    }

    #[test]
    fn gres_parses() {
        let (g, bad) = parse_gres("gpu:h100:2(S:0-1),gpu:a100:1,shard:4,gpu:1");
        assert!(bad.is_empty());
        assert_eq!(g.len(), 4);
        assert_eq!(g[0].kind.as_deref(), Some("h100"));
        assert_eq!(g[0].count, 2);
        assert_eq!((g[2].name.as_str(), g[2].count), ("shard", 4));
        assert_eq!((g[3].kind.as_deref(), g[3].count), (None, 1));
        assert_eq!(parse_gres("(null)").0, vec![]);
        assert_eq!(parse_gres("gpu:a:b:c").1, vec!["gpu:a:b:c".to_string()]);
        let (g, _) = parse_gres("gpu:h100:2(S:0,1),gpu:a100:1");
        assert_eq!(g.len(), 2);
    }

    #[test]
    fn gpus_come_from_the_catalog() {
        let c = Catalog::default();
        let g = gpus("n1", "gpu:h100:2", &c, None).unwrap();
        assert_eq!(g.len(), 2);
        assert_eq!(g[1].index, 1);
        assert_eq!(g[0].model, "H100");
        assert_eq!(g[0].memory_mib, 80 * 1024);
        assert_ne!(g[0].uuid, g[1].uuid);
        assert!(gpus("n1", "gpu:2", &c, None)
            .unwrap_err()
            .contains("no type"));
        assert_eq!(gpus("n1", "gpu:2", &c, Some("L40S")).unwrap().len(), 2);
        assert!(gpus("n1", "gpu:tpu9:1", &c, None)
            .unwrap_err()
            .contains("tpu9"));
        assert!(gpus("n1", "", &c, None).unwrap().is_empty());
    }

    #[test]
    fn scripts_quote_every_word() {
        let argv: Vec<String> = ["sh", "-c", "echo \"$X\" 'a'; $(rm -rf /)", "it's"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let s = script("inst_1", &argv).unwrap();
        assert_eq!(
            s.lines().last().unwrap(),
            r#"exec 'sh' '-c' 'echo "$X" '\''a'\''; $(rm -rf /)' 'it'\''s'"#
        );
        assert!(script("inst_1", &[]).is_err());
        assert!(script("inst_1", &["a\0b".to_string()]).is_err());
    }

    /// The quoting survives a real shell: each word comes back unchanged.
    #[test]
    fn quoted_words_round_trip_through_sh() {
        let words = [
            "plain",
            "two words",
            "it's",
            "$HOME",
            "`id`",
            "a\nb",
            "\\",
            "",
        ];
        let quoted: Vec<String> = words.iter().map(|w| shell_quote(w)).collect();
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("printf '%s\\0' {}", quoted.join(" ")))
            .output()
            .unwrap();
        let got: Vec<&str> = std::str::from_utf8(&out.stdout)
            .unwrap()
            .split('\0')
            .collect();
        assert_eq!(&got[..words.len()], &words[..]);
    }
}
