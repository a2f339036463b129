//! Shared test support.

#[allow(
    dead_code,
    unused_imports,
    reason = "each test binary uses a different part of the support"
)]
pub mod fake_kube;
