//! Test support over the fake Kubernetes API server
//! (`flotilla_backends::kube::fake`, feature `testing`): the recorded
//! bodies under `tests/fixtures/kube/` and a condition wait.

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

pub use flotilla_backends::kube::fake::{FakeKube, FakeNode, Reply, Then};

/// A fixture's text.
pub fn fixture(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/kube")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Polls `check` until it gives `Some`, for up to a generous deadline (the
/// machine may be loaded); panics with `what` when it never does.
pub async fn wait_for<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
