//! An OpenAI-compatible model-server emulator for tests, demos and
//! benchmarks: `/v1/chat/completions`, `/v1/completions` (both streaming
//! as server-sent events), `/v1/embeddings`, `/v1/models`, `/health` and
//! `/metrics`.
//!
//! It behaves like an inference server where it matters to a gateway and
//! an autoscaler: it is not ready until its weights "load" (a cold start of
//! `load_delay_ms`), it prefills the prompt and decodes output tokens at
//! configured rates, it serves a bounded number of requests at once and
//! queues (then refuses with 429) beyond that, and it keeps an LRU prefix
//! cache so a prompt whose prefix it has seen prefills only the rest, which
//! makes cache-affine routing measurably faster. It never computes
//! anything: the output is filler text of the requested length. Tokens are
//! counted by a simple deterministic tokenizer (see [`tokens`]).
//!
//! With a model size (`--model-gb`) it loads its weights from a readiness
//! tier (`--tier`, or `FLOTILLA_LOAD_TIER` as the node's agent sets it):
//! the load takes the tier's restore time, `overhead + size / bandwidth`
//! (`flotilla_scale::tiers`; each tier's speed is a flag, defaults from
//! the published measurements there), added to `load_delay_ms`. `/health`
//! names the tier and the load time in `x-flotilla-load-tier` and
//! `x-flotilla-load-ms` headers.
//!
//! [`Emulator::start`] runs one in-process on a real socket; the
//! `flotilla-emulator` binary runs one as a process. [`Emulator::kill`]
//! drops every connection at once, as a crashed process would.

mod api;
pub mod tokens;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use flotilla_scale::tiers::{ReadinessTiers, Tier, TierSpeed};

/// How the emulated model server behaves. Every option is also a flag and
/// an environment variable of the `flotilla-emulator` binary.
#[derive(Debug, Clone, clap::Args)]
pub struct EmulatorConfig {
    /// Address to listen on.
    #[arg(long, env = "FLOTILLA_EMULATOR_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 picks a free one (printed on the first line).
    #[arg(long, env = "FLOTILLA_EMULATOR_PORT", default_value_t = 0)]
    pub port: u16,
    /// The model name served (and listed by `/v1/models`).
    #[arg(
        long,
        env = "FLOTILLA_EMULATOR_MODEL",
        default_value = "emulated-model"
    )]
    pub model: String,
    /// Weight-load time: `/health` answers 503 and requests are refused
    /// until it has passed.
    #[arg(long, env = "FLOTILLA_EMULATOR_LOAD_DELAY_MS", default_value_t = 0)]
    pub load_delay_ms: u64,
    /// Size of the model's weights, GB: with it, the load also takes the
    /// tier's restore time of that many GB (see `--tier`).
    #[arg(long, env = "FLOTILLA_MODEL_GB")]
    pub model_gb: Option<f64>,
    /// Where the weights load from: parked (host memory), cached (local
    /// disk) or remote (download); default remote. Only with `--model-gb`.
    #[arg(long, env = "FLOTILLA_LOAD_TIER")]
    pub tier: Option<String>,
    /// Host-memory-to-GPU bandwidth of a parked restore, GB/s.
    #[arg(
        long,
        env = "FLOTILLA_EMULATOR_PARKED_GB_PER_S",
        default_value_t = 50.0
    )]
    pub parked_gb_per_s: f64,
    /// Fixed part of a parked restore (waking the engine), ms.
    #[arg(
        long,
        env = "FLOTILLA_EMULATOR_PARKED_OVERHEAD_MS",
        default_value_t = 500
    )]
    pub parked_overhead_ms: u64,
    /// Local-disk read bandwidth of a cached start, GB/s.
    #[arg(long, env = "FLOTILLA_EMULATOR_CACHED_GB_PER_S", default_value_t = 6.5)]
    pub cached_gb_per_s: f64,
    /// Fixed part of a cached start (container and engine start), ms.
    #[arg(
        long,
        env = "FLOTILLA_EMULATOR_CACHED_OVERHEAD_MS",
        default_value_t = 10_000
    )]
    pub cached_overhead_ms: u64,
    /// Download bandwidth of a remote start, GB/s.
    #[arg(long, env = "FLOTILLA_EMULATOR_REMOTE_GB_PER_S", default_value_t = 0.5)]
    pub remote_gb_per_s: f64,
    /// Fixed part of a remote start (image pull and start), ms.
    #[arg(
        long,
        env = "FLOTILLA_EMULATOR_REMOTE_OVERHEAD_MS",
        default_value_t = 30_000
    )]
    pub remote_overhead_ms: u64,
    /// Prompt tokens prefilled per second; 0 prefills instantly.
    #[arg(
        long,
        env = "FLOTILLA_EMULATOR_PREFILL_TOKENS_PER_S",
        default_value_t = 0.0
    )]
    pub prefill_tokens_per_s: f64,
    /// Output tokens decoded per second per request; 0 decodes instantly.
    #[arg(
        long,
        env = "FLOTILLA_EMULATOR_DECODE_TOKENS_PER_S",
        default_value_t = 0.0
    )]
    pub decode_tokens_per_s: f64,
    /// Requests served at once (the engine's batch); 0 is unlimited.
    /// Requests beyond it wait in a queue.
    #[arg(long, env = "FLOTILLA_EMULATOR_MAX_CONCURRENCY", default_value_t = 0)]
    pub max_concurrency: u32,
    /// Requests that may wait for a slot before new ones get 429.
    #[arg(long, env = "FLOTILLA_EMULATOR_MAX_QUEUE", default_value_t = 1024)]
    pub max_queue: u32,
    /// How long a request may wait for a slot before it gets 429.
    #[arg(
        long,
        env = "FLOTILLA_EMULATOR_QUEUE_TIMEOUT_MS",
        default_value_t = 30_000
    )]
    pub queue_timeout_ms: u64,
    /// Prompt tokens kept in the prefix cache; 0 disables it.
    #[arg(
        long,
        env = "FLOTILLA_EMULATOR_PREFIX_CACHE_TOKENS",
        default_value_t = 0
    )]
    pub prefix_cache_tokens: u64,
    /// Output tokens when a request gives no `max_tokens`.
    #[arg(
        long,
        env = "FLOTILLA_EMULATOR_DEFAULT_MAX_TOKENS",
        default_value_t = 16
    )]
    pub default_max_tokens: u32,
}

impl Default for EmulatorConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 0,
            model: "emulated-model".into(),
            load_delay_ms: 0,
            model_gb: None,
            tier: None,
            parked_gb_per_s: 50.0,
            parked_overhead_ms: 500,
            cached_gb_per_s: 6.5,
            cached_overhead_ms: 10_000,
            remote_gb_per_s: 0.5,
            remote_overhead_ms: 30_000,
            prefill_tokens_per_s: 0.0,
            decode_tokens_per_s: 0.0,
            max_concurrency: 0,
            max_queue: 1024,
            queue_timeout_ms: 30_000,
            prefix_cache_tokens: 0,
            default_max_tokens: 16,
        }
    }
}

impl EmulatorConfig {
    /// The tier speeds the flags describe.
    pub fn tiers(&self) -> ReadinessTiers {
        ReadinessTiers {
            parked: TierSpeed {
                bandwidth_gb_per_s: self.parked_gb_per_s,
                overhead_ms: self.parked_overhead_ms,
            },
            cached: TierSpeed {
                bandwidth_gb_per_s: self.cached_gb_per_s,
                overhead_ms: self.cached_overhead_ms,
            },
            remote: TierSpeed {
                bandwidth_gb_per_s: self.remote_gb_per_s,
                overhead_ms: self.remote_overhead_ms,
            },
        }
    }

    /// How the weights load: the tier (none without a model size) and
    /// the whole load time, ms (`load_delay_ms` plus the tier's restore).
    pub fn load(&self) -> Result<(Option<Tier>, u64), EmulatorError> {
        let Some(gb) = self.model_gb else {
            return Ok((None, self.load_delay_ms));
        };
        if !(gb.is_finite() && gb > 0.0) {
            return Err(EmulatorError::Config {
                field: "model_gb",
                message: format!("must be a number of GB greater than 0, got {gb}"),
            });
        }
        let tier = match self.tier.as_deref() {
            None | Some("") => Tier::Remote,
            Some(t) => t.parse::<Tier>().map_err(|_| EmulatorError::Config {
                field: "tier",
                message: format!("must be parked, cached or remote, got `{t}`"),
            })?,
        };
        let tiers = self.tiers();
        tiers.validate().map_err(|e| EmulatorError::Config {
            field: "tiers",
            message: e.to_string(),
        })?;
        Ok((
            Some(tier),
            self.load_delay_ms
                .saturating_add(tiers.restore_ms(tier, gb)),
        ))
    }
}

/// Counters the emulator keeps; also exported on `/metrics`.
#[derive(Debug, Default)]
pub struct Stats {
    /// Requests answered or streaming now.
    pub in_flight: AtomicU64,
    /// Requests waiting for a concurrency slot.
    pub queued: AtomicU64,
    /// Inference requests received.
    pub requests: AtomicU64,
    /// Prompt tokens received.
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens found in the prefix cache.
    pub cached_prompt_tokens: AtomicU64,
    /// Requests refused with 429 (queue full or waited too long).
    pub rejected: AtomicU64,
}

/// What a starting emulator failed at.
#[derive(Debug, thiserror::Error)]
pub enum EmulatorError {
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A rate or limit is out of range.
    #[error("invalid option {field}: {message}")]
    Config {
        /// The flag.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
}

pub(crate) struct State {
    config: EmulatorConfig,
    /// The tier the weights load from, when a model size is given.
    pub(crate) tier: Option<Tier>,
    /// The whole load time, ms.
    pub(crate) load_ms: u64,
    ready: AtomicBool,
    slots: Option<Arc<Semaphore>>,
    cache: Mutex<tokens::PrefixCache>,
    stats: Arc<Stats>,
    registry: prometheus_client::registry::Registry,
}

/// A running emulator.
pub struct Emulator {
    addr: SocketAddr,
    stats: Arc<Stats>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Emulator {
    /// Binds `config.host:config.port` and serves there.
    pub async fn start(config: EmulatorConfig) -> Result<Self, EmulatorError> {
        let addr = format!("{}:{}", config.host, config.port);
        let listener = TcpListener::bind(&addr)
            .await
            .map_err(|source| EmulatorError::Bind { addr, source })?;
        Self::serve(listener, config)
    }

    /// Serves on an already bound listener.
    pub fn serve(listener: TcpListener, config: EmulatorConfig) -> Result<Self, EmulatorError> {
        for (field, v) in [
            ("prefill_tokens_per_s", config.prefill_tokens_per_s),
            ("decode_tokens_per_s", config.decode_tokens_per_s),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(EmulatorError::Config {
                    field,
                    message: format!("must be a finite number >= 0, got {v}"),
                });
            }
        }
        let (tier, load_ms) = config.load()?;
        let addr = listener
            .local_addr()
            .map_err(|source| EmulatorError::Bind {
                addr: config.host.clone(),
                source,
            })?;
        let stats = Arc::new(Stats::default());
        let registry = api::registry(&stats);
        let state = Arc::new(State {
            slots: (config.max_concurrency > 0)
                .then(|| Arc::new(Semaphore::new(config.max_concurrency as usize))),
            cache: Mutex::new(tokens::PrefixCache::new(config.prefix_cache_tokens)),
            ready: AtomicBool::new(load_ms == 0),
            tier,
            load_ms,
            stats: stats.clone(),
            registry,
            config,
        });
        if !state.ready.load(Ordering::Relaxed) {
            let state = state.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(state.load_ms)).await;
                state.ready.store(true, Ordering::Release);
            });
        }
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, api::router(state), stopped));
        Ok(Self {
            addr,
            stats,
            stop,
            task,
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://{addr}`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The emulator's counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Stops at once: the listener closes and every open connection is
    /// dropped mid-request, as when the process is killed.
    pub fn kill(self) {
        self.task.abort();
    }

    /// Stops accepting and waits for the requests in progress to finish.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

async fn accept_loop(
    listener: TcpListener,
    router: axum::Router,
    mut stopped: watch::Receiver<bool>,
) {
    // Connections live in this task's JoinSet: aborting the task (kill)
    // drops the set, which aborts them all and closes their sockets.
    let mut connections = JoinSet::new();
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(hyper_util::rt::TokioTimer::new());
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let service = TowerToHyperService::new(router.clone());
                let conn = builder.serve_connection(TokioIo::new(stream), service);
                let conn = graceful.watch(conn);
                connections.spawn(async move {
                    let _ = conn.await;
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            _ = stopped.changed() => break,
        }
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = async { while connections.join_next().await.is_some() {} } => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_defaults_are_the_documented_tier_speeds() {
        assert_eq!(EmulatorConfig::default().tiers(), ReadinessTiers::default());
    }

    #[test]
    fn the_load_adds_the_tier_restore_to_the_delay() {
        let mut c = EmulatorConfig {
            load_delay_ms: 100,
            ..EmulatorConfig::default()
        };
        assert_eq!(c.load().unwrap(), (None, 100));
        c.model_gb = Some(16.0);
        // Remote by default: 30 s + 16 GB at 0.5 GB/s.
        assert_eq!(c.load().unwrap(), (Some(Tier::Remote), 100 + 62_000));
        c.tier = Some("parked".into());
        assert_eq!(c.load().unwrap(), (Some(Tier::Parked), 100 + 820));
        c.tier = Some("warm-ish".into());
        assert!(matches!(
            c.load(),
            Err(EmulatorError::Config { field: "tier", .. })
        ));
        c.tier = None;
        c.model_gb = Some(f64::NAN);
        assert!(matches!(
            c.load(),
            Err(EmulatorError::Config {
                field: "model_gb",
                ..
            })
        ));
    }
}
