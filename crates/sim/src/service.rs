//! How long a request holds a replica: the service model per GPU type.
//!
//! One replica serves an 8B-parameter-class model (Llama-3-8B shape) on one
//! GPU. It runs up to `max_concurrency` sequences at once (continuous
//! batching); each request holds one slot for its prefill, then its decode.
//! Prefill ends at the first token, so time to first token is the wait for
//! a slot (queueing, including waiting for a replica's cold start) plus
//! prefill.
//!
//! Numbers for the H100 (SXM, 80 GB), derived from the datasheet and
//! checked against published serving throughput:
//!
//! - **Prefill 15,000 tokens/s.** Prefill is compute-bound at about
//!   `2 × 8e9` FLOP per token; 989 TFLOP/s dense BF16 (NVIDIA H100
//!   datasheet) gives 62,000 tokens/s at full utilisation; we assume 25 %
//!   model FLOP utilisation, the usual range for serving stacks with
//!   mixed batches.
//! - **Decode 80 tokens/s per sequence at 32 concurrent sequences**
//!   (2,560 tokens/s per replica). Decode is bandwidth-bound: each step
//!   reads the 16 GB of BF16 weights plus the batch's KV cache from
//!   3.35 TB/s HBM3, at most ~200 steps/s; ~40 % of that is what vLLM's
//!   published Llama-3-8B H100 throughput benchmarks reach at batch 32
//!   (2–4k output tokens/s).
//! - **Max concurrency 32** sequences per replica: a conservative batch at
//!   which per-sequence decode speed is still interactive.
//!
//! Other GPU types in Flotilla's catalog scale both rates by their
//! `relative_performance` against the H100; a type with less than 24 GiB
//! cannot hold the model and its KV cache and is refused.

use flotilla_core::catalog::Catalog;
use serde::{Deserialize, Serialize};

use crate::trace::Request;
use crate::SimError;

/// Per-replica service rates on one GPU type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceModel {
    /// Catalog name of the GPU type.
    pub gpu: String,
    /// Prompt tokens per second processed by one request's prefill.
    pub prefill_tokens_per_s: f64,
    /// Generated tokens per second of one sequence at full batch.
    pub decode_tokens_per_s: f64,
    /// Sequences one replica serves at once.
    pub max_concurrency: u32,
}

/// The reference numbers, for the H100 (see the module documentation).
const H100_PREFILL: f64 = 15_000.0;
const H100_DECODE: f64 = 80.0;
const MAX_CONCURRENCY: u32 = 32;

impl ServiceModel {
    /// The model for `gpu`, a name from Flotilla's GPU catalog.
    pub fn for_gpu(gpu: &str) -> Result<Self, SimError> {
        let catalog = Catalog::default();
        let m = catalog
            .get(gpu)
            .ok_or_else(|| SimError::invalid("gpu", format!("unknown GPU type {gpu:?}")))?;
        if m.memory_gib < 24 {
            return Err(SimError::invalid(
                "gpu",
                format!(
                    "{} has {} GiB; an 8B model needs at least 24",
                    m.name, m.memory_gib
                ),
            ));
        }
        let h100 = catalog.get("H100").map_or(3.17, |h| h.relative_performance);
        let f = m.relative_performance / h100;
        Ok(Self {
            gpu: m.name.clone(),
            prefill_tokens_per_s: H100_PREFILL * f,
            decode_tokens_per_s: H100_DECODE * f,
            max_concurrency: MAX_CONCURRENCY,
        })
    }

    /// Prefill time of `r`, in milliseconds (at least 1).
    pub fn prefill_ms(&self, r: &Request) -> u64 {
        ms(f64::from(r.input_tokens) / self.prefill_tokens_per_s)
    }

    /// Decode time of `r`, in milliseconds.
    pub fn decode_ms(&self, r: &Request) -> u64 {
        if r.output_tokens == 0 {
            0
        } else {
            ms(f64::from(r.output_tokens) / self.decode_tokens_per_s)
        }
    }

    /// Time `r` holds a slot: prefill plus decode.
    pub fn service_ms(&self, r: &Request) -> u64 {
        self.prefill_ms(r) + self.decode_ms(r)
    }
}

fn ms(seconds: f64) -> u64 {
    ((seconds * 1000.0).ceil() as u64).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h100_rates_and_request_times() {
        let s = ServiceModel::for_gpu("h100").unwrap();
        assert_eq!(s.gpu, "H100");
        let r = Request {
            arrival_ms: 0,
            input_tokens: 3_000,
            output_tokens: 160,
        };
        assert_eq!(s.prefill_ms(&r), 200);
        assert_eq!(s.service_ms(&r), 200 + 2_000);
    }

    #[test]
    fn small_or_unknown_gpus_are_refused() {
        let e = ServiceModel::for_gpu("T4").unwrap_err().to_string();
        assert!(e.contains("gpu") && e.contains("24"), "{e}");
        assert!(ServiceModel::for_gpu("Z9").is_err());
        let b200 = ServiceModel::for_gpu("B200").unwrap();
        assert!(b200.prefill_tokens_per_s > H100_PREFILL);
    }
}
