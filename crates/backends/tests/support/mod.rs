//! Shared test support.

pub mod fake_kube;
