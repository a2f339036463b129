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
            ready: AtomicBool::new(config.load_delay_ms == 0),
            stats: stats.clone(),
            registry,
            config,
        });
        if !state.ready.load(Ordering::Relaxed) {
            let state = state.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(state.config.load_delay_ms)).await;
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
