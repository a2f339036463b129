//! Request traces: the one input format the simulator's core loop reads
//! ([`Trace`], arrivals sorted by time) and the readers that build it from
//! the formats in the wild. This is the only module besides
//! [`crate::coldstart`] that touches files; everything it returns is plain
//! data, so the core loop stays free of I/O.
//!
//! Formats, detected from the header line (or the `.jsonl` extension):
//!
//! - **Azure LLM inference 2023** (`AzureLLMInferenceTrace_{code,conv}.csv`):
//!   `TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps like
//!   `2023-11-16 18:17:03.9799600`.
//! - **GenTD26** text-to-image requests (`lora_request_trace.csv`): the
//!   arrival process of `gmt_create` (one-second resolution, unsorted) with
//!   `prompt_length` characters read as `ceil(chars / 4)` input tokens and
//!   `num_inference_steps` as generated tokens (one denoising step per
//!   decode step; 30 when empty). The LLM service model then prices each
//!   request, so the trace contributes its arrival shape, not image
//!   latencies.
//! - **Generic CSV**: header `arrival_ms,input_tokens,output_tokens`,
//!   arrival in milliseconds from any origin, rows in any order.
//! - **Generic JSONL**: one object per line,
//!   `{"arrival_ms": 0, "input_tokens": 512, "output_tokens": 128}`.
//!
//! Arrivals are shifted so the first request arrives at 0.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use chrono::NaiveDateTime;
use serde::{Deserialize, Serialize};

use crate::SimError;

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Arrival, milliseconds from the start of the trace.
    pub arrival_ms: u64,
    /// Prompt (context) tokens: what prefill processes.
    pub input_tokens: u32,
    /// Generated tokens: what decode produces.
    pub output_tokens: u32,
}

/// A request trace: a name for reports and requests sorted by arrival.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    /// Short name shown in reports (`azure-code`, `viral-spike`, ...).
    pub name: String,
    requests: Vec<Request>,
}

impl Trace {
    /// A trace from requests in any order: sorted by arrival (stable, so
    /// equal arrivals keep their input order) and shifted to start at 0.
    pub fn new(name: impl Into<String>, mut requests: Vec<Request>) -> Result<Self, SimError> {
        if requests.is_empty() {
            return Err(SimError::EmptyTrace);
        }
        requests.sort_by_key(|r| r.arrival_ms);
        let t0 = requests[0].arrival_ms;
        for r in &mut requests {
            r.arrival_ms -= t0;
        }
        Ok(Self {
            name: name.into(),
            requests,
        })
    }

    /// The requests, sorted by arrival.
    pub fn requests(&self) -> &[Request] {
        &self.requests
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// Whether the trace has no request (never true for a built trace).
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// The busiest `len_ms` of the trace, starting on a whole hour from
    /// its start (the earliest such window with the most arrivals),
    /// shifted to start at 0: how a trace of weeks becomes a benchmark
    /// run of a day.
    pub fn busiest(&self, len_ms: u64) -> Self {
        const HOUR: u64 = 3_600_000;
        let hours = self.duration_ms() / HOUR + 1;
        let mut per_hour = vec![0usize; hours as usize];
        for r in &self.requests {
            per_hour[(r.arrival_ms / HOUR) as usize] += 1;
        }
        let span = len_ms.div_ceil(HOUR).max(1) as usize;
        let mut best = (0usize, 0usize);
        for start in 0..per_hour.len() {
            let n: usize = per_hour[start..(start + span).min(per_hour.len())]
                .iter()
                .sum();
            if n > best.1 {
                best = (start, n);
            }
        }
        let from = best.0 as u64 * HOUR;
        let requests: Vec<Request> = self
            .requests
            .iter()
            .filter(|r| r.arrival_ms >= from && r.arrival_ms < from + len_ms)
            .map(|r| Request {
                arrival_ms: r.arrival_ms - from,
                ..*r
            })
            .collect();
        Self {
            name: self.name.clone(),
            requests,
        }
    }

    /// Arrival of the last request, in milliseconds.
    pub fn duration_ms(&self) -> u64 {
        self.requests.last().map_or(0, |r| r.arrival_ms)
    }
}

/// The formats [`parse`] understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Azure LLM inference trace 2023.
    Azure,
    /// GenTD26 `lora_request_trace.csv`.
    GenTd26,
    /// `arrival_ms,input_tokens,output_tokens`.
    GenericCsv,
    /// One JSON object per line.
    Jsonl,
}

/// Read a trace file, detecting its format; the trace is named after the
/// file stem (`AzureLLMInferenceTrace_code` becomes `azure-code`).
pub fn load(path: &Path) -> Result<Trace, SimError> {
    let file = std::fs::File::open(path).map_err(|source| SimError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let jsonl = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("jsonl") || e.eq_ignore_ascii_case("json"));
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "trace".to_string());
    let name = match stem.as_str() {
        "AzureLLMInferenceTrace_code" => "azure-code".to_string(),
        "AzureLLMInferenceTrace_conv" => "azure-conv".to_string(),
        "lora_request_trace" => "gentd26".to_string(),
        _ => stem,
    };
    parse(&name, file, jsonl.then_some(Format::Jsonl))
}

/// Parse a trace from `input`; `format` of `None` detects it from the
/// header line.
pub fn parse(name: &str, input: impl Read, format: Option<Format>) -> Result<Trace, SimError> {
    let mut lines = BufReader::new(input).lines().enumerate();
    let mut requests = Vec::new();
    let format = match format {
        Some(Format::Jsonl) => Format::Jsonl,
        given => {
            let Some((_, header)) = lines.next() else {
                return Err(SimError::EmptyTrace);
            };
            let header = header.map_err(|e| SimError::parse(1, "header", e.to_string()))?;
            let detected = detect(header.trim_start_matches('\u{feff}'))?;
            given.unwrap_or(detected)
        }
    };
    for (i, line) in lines {
        let n = i + 1;
        let line = line.map_err(|e| SimError::parse(n, "line", e.to_string()))?;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let r = match format {
            Format::Azure => azure_row(n, line)?,
            Format::GenTd26 => gentd_row(n, line)?,
            Format::GenericCsv => generic_row(n, line)?,
            Format::Jsonl => serde_json::from_str::<Request>(line)
                .map_err(|e| SimError::parse(n, "json", e.to_string()))?,
        };
        requests.push(r);
    }
    Trace::new(name, requests)
}

fn detect(header: &str) -> Result<Format, SimError> {
    let h = header.to_ascii_lowercase();
    if h.starts_with("timestamp,contexttokens,generatedtokens") {
        Ok(Format::Azure)
    } else if h.starts_with("gmt_create,") {
        Ok(Format::GenTd26)
    } else if h.starts_with("arrival_ms,input_tokens,output_tokens") {
        Ok(Format::GenericCsv)
    } else {
        Err(SimError::parse(
            1,
            "header",
            format!(
                "unknown trace header {header:?}; expected the Azure LLM, GenTD26 or \
                 `arrival_ms,input_tokens,output_tokens` header"
            ),
        ))
    }
}

fn datetime_ms(n: usize, field: &'static str, s: &str) -> Result<u64, SimError> {
    let t = NaiveDateTime::parse_from_str(s.trim(), "%Y-%m-%d %H:%M:%S%.f")
        .map_err(|e| SimError::parse(n, field, format!("{s:?}: {e}")))?;
    let ms = t.and_utc().timestamp_millis();
    u64::try_from(ms).map_err(|_| SimError::parse(n, field, format!("{s:?} is before 1970")))
}

fn int(n: usize, field: &'static str, s: &str) -> Result<u32, SimError> {
    s.trim()
        .parse::<u32>()
        .map_err(|e| SimError::parse(n, field, format!("{s:?}: {e}")))
}

fn azure_row(n: usize, line: &str) -> Result<Request, SimError> {
    let mut it = line.split(',');
    let (Some(ts), Some(ctx), Some(gen)) = (it.next(), it.next(), it.next()) else {
        return Err(SimError::parse(n, "line", "expected 3 columns".into()));
    };
    Ok(Request {
        arrival_ms: datetime_ms(n, "TIMESTAMP", ts)?,
        input_tokens: int(n, "ContextTokens", ctx)?,
        output_tokens: int(n, "GeneratedTokens", gen)?,
    })
}

fn generic_row(n: usize, line: &str) -> Result<Request, SimError> {
    let mut it = line.split(',');
    let (Some(t), Some(i), Some(o)) = (it.next(), it.next(), it.next()) else {
        return Err(SimError::parse(n, "line", "expected 3 columns".into()));
    };
    let arrival_ms = t
        .trim()
        .parse::<u64>()
        .map_err(|e| SimError::parse(n, "arrival_ms", format!("{t:?}: {e}")))?;
    Ok(Request {
        arrival_ms,
        input_tokens: int(n, "input_tokens", i)?,
        output_tokens: int(n, "output_tokens", o)?,
    })
}

/// One GenTD26 row; column positions are fixed by the dataset's README.
fn gentd_row(n: usize, line: &str) -> Result<Request, SimError> {
    {
        let cols: Vec<&str> = line.split(',').collect();
        if cols.len() < 9 {
            return Err(SimError::parse(n, "line", "expected 11 columns".into()));
        }
        let float = |field: &'static str, s: &str, default: f64| -> Result<f64, SimError> {
            let s = s.trim();
            if s.is_empty() {
                return Ok(default);
            }
            match s.parse::<f64>() {
                Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
                _ => Err(SimError::parse(
                    n,
                    field,
                    format!("{s:?} is not a number >= 0"),
                )),
            }
        };
        let chars = float("prompt_length", cols[5], 0.0)?;
        let steps = float("num_inference_steps", cols[8], 30.0)?;
        Ok(Request {
            arrival_ms: datetime_ms(n, "gmt_create", cols[0])?,
            input_tokens: ((chars / 4.0).ceil() as u32).max(1),
            output_tokens: (steps.round() as u32).max(1),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn azure_rows_shift_to_zero() {
        let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                   2023-11-16 18:17:04.0319600,3180,8\n\
                   2023-11-16 18:17:03.9799600,4808,10\n";
        let t = parse("a", csv.as_bytes(), None).unwrap();
        assert_eq!(t.requests()[0].arrival_ms, 0);
        assert_eq!(t.requests()[0].input_tokens, 4808);
        assert_eq!(t.requests()[1].arrival_ms, 52);
        assert_eq!(t.duration_ms(), 52);
    }

    #[test]
    fn gentd26_reads_prompt_and_steps() {
        let csv = "gmt_create,predict_type,predict_status,exec_time_seconds,groupId,prompt_length,negative_prompt_length,num_images_per_prompt,num_inference_steps,checkpoint_model_version_id,num_lora\n\
                   2024-11-15 16:57:50,TXT_2_IMG,SUCCEED,32.0,G0000,63.0,26.0,1.0,30.0,M0000,0\n\
                   2024-11-15 16:57:49,TXT_2_IMG,SUCCEED,32.0,G0000,,26.0,1.0,,M0000,0\n";
        let t = parse("g", csv.as_bytes(), None).unwrap();
        assert_eq!(
            t.requests()[0],
            Request {
                arrival_ms: 0,
                input_tokens: 1,
                output_tokens: 30
            }
        );
        assert_eq!(
            t.requests()[1],
            Request {
                arrival_ms: 1000,
                input_tokens: 16,
                output_tokens: 30
            }
        );
    }

    #[test]
    fn busiest_window_keeps_the_densest_hours() {
        let mut reqs: Vec<Request> = (0..5u64)
            .map(|h| Request {
                arrival_ms: h * 3_600_000,
                input_tokens: 1,
                output_tokens: 1,
            })
            .collect();
        reqs.extend((0..10u64).map(|i| Request {
            arrival_ms: 3 * 3_600_000 + 1_000 + i,
            input_tokens: 1,
            output_tokens: 1,
        }));
        let t = Trace::new("t", reqs).unwrap();
        let b = t.busiest(3_600_000);
        assert_eq!(b.len(), 11);
        assert_eq!(b.requests()[0].arrival_ms, 0);
        assert_eq!(b.duration_ms(), 1_009);
    }

    #[test]
    fn generic_csv_and_jsonl_agree() {
        let csv = "arrival_ms,input_tokens,output_tokens\n100,5,6\n0,1,2\n";
        let jsonl = "{\"arrival_ms\":100,\"input_tokens\":5,\"output_tokens\":6}\n\n{\"arrival_ms\":0,\"input_tokens\":1,\"output_tokens\":2}\n";
        let a = parse("x", csv.as_bytes(), None).unwrap();
        let b = parse("x", jsonl.as_bytes(), Some(Format::Jsonl)).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn bad_input_names_line_and_field() {
        let csv = "arrival_ms,input_tokens,output_tokens\n0,1,2\n5,x,2\n";
        let e = parse("x", csv.as_bytes(), None).unwrap_err().to_string();
        assert!(e.contains("line 3") && e.contains("input_tokens"), "{e}");
        let e = parse("x", "what,is,this\n".as_bytes(), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("header"), "{e}");
        assert!(matches!(
            parse("x", "".as_bytes(), None),
            Err(SimError::EmptyTrace)
        ));
        let only_header = "arrival_ms,input_tokens,output_tokens\n";
        assert!(matches!(
            parse("x", only_header.as_bytes(), None),
            Err(SimError::EmptyTrace)
        ));
    }
}
