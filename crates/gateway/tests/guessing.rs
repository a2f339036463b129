//! Requests without a valid key, limited per source address, over real
//! sockets with an in-memory control plane that counts what it is asked:
//! past the burst, unknown keys are answered 429 with `Retry-After`
//! without asking the control plane; a key seen valid keeps working from
//! the same address; another address has its own budget.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use common::{client, config, grant, route, tenant};
use flotilla_core::gateway::{KeyGrant, RouteTable};
use flotilla_gateway::{Control, ControlFuture, GatewayConfig, StaticControl};

/// A control plane that counts key lookups.
struct Counting {
    inner: StaticControl,
    asked: AtomicU32,
}

impl Control for Counting {
    fn routes(&self) -> ControlFuture<'_, RouteTable> {
        self.inner.routes()
    }
    fn authorize<'a>(&'a self, key: &'a str) -> ControlFuture<'a, Option<KeyGrant>> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        self.inner.authorize(key)
    }
    fn report(&self, s: Vec<flotilla_core::gateway::EndpointSignals>) -> ControlFuture<'_, ()> {
        self.inner.report(s)
    }
    fn meter(&self, u: Vec<flotilla_core::gateway::RequestUsage>) -> ControlFuture<'_, ()> {
        self.inner.meter(u)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guesses_past_the_burst_get_429_without_asking_and_valid_keys_pass() {
    let alice = tenant();
    let inner = StaticControl::new();
    inner.set_routes(RouteTable {
        endpoints: vec![route(&alice, "chat", Vec::new())],
    });
    inner.set_key("alice-key", grant(&alice));
    let control = Arc::new(Counting {
        inner,
        asked: AtomicU32::new(0),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gw = flotilla_gateway::serve(
        listener,
        control.clone() as Arc<dyn Control>,
        GatewayConfig {
            anonymous_rate_limit_per_second: 10,
            ..config()
        },
    )
    .await
    .unwrap();
    let http = client();
    let models = format!("{}/v1/models", gw.url());
    let status = |key: String| {
        let (http, models) = (http.clone(), models.clone());
        async move {
            let r = http.get(models).bearer_auth(key).send().await.unwrap();
            let retry = r
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_string());
            (r.status().as_u16(), retry)
        }
    };
    assert_eq!(status("alice-key".into()).await.0, 200);
    let started = std::time::Instant::now();
    let (mut answered, mut limited, mut valid) = (0u32, 0u32, Vec::new());
    for i in 0..300 {
        match status(format!("guess-{i}")).await {
            (401, _) => answered += 1,
            (429, Some(r)) => {
                limited += 1;
                assert!(r.parse::<u64>().is_ok_and(|s| s >= 1), "{r}");
            }
            other => panic!("guess {i}: {other:?}"),
        }
        if i % 30 == 0 {
            valid.push(status("alice-key".into()).await.0);
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let asked = control.asked.load(Ordering::SeqCst);
    eprintln!(
        "300 guesses in {elapsed:.2}s: {answered} 401, {limited} 429, control asked {asked} times"
    );
    assert!(answered >= 20, "the burst: {answered}");
    assert!(
        f64::from(answered) <= 21.0 + 10.0 * elapsed,
        "{answered} answered in {elapsed:.2}s"
    );
    assert_eq!(answered + limited, 300);
    assert_eq!(valid, vec![200; valid.len()], "the valid key was held back");
    // While the address is held, guesses are not asked about: the
    // control plane saw each answered guess, at most one more guess per
    // answered one (the one that found the quota spent and held the
    // address) and the valid key's lookups (the cache's time to live is
    // zero in these tests).
    assert!(
        asked <= 2 * answered + 1 + valid.len() as u32,
        "asked {asked}, answered {answered}"
    );
    assert!(asked < 300, "every guess was asked about: {asked}");
    gw.shutdown().await;
}
