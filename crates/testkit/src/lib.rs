//! Fixtures shared by Flotilla's test suites, so that each suite tests its
//! subject instead of re-implementing its set-up.
//!
//! - [`db`]: a fresh store on SQLite, and on PostgreSQL when
//!   `FLOTILLA_TEST_DATABASE_URL` is set (from `flotilla-testdb`, which
//!   also holds `backend_suite!`; the store's own tests use that crate so
//!   they build no server).
//! - [`server`]: the control plane in-process on an ephemeral port, with a
//!   small client and helpers to make tenants, keys and nodes.
//! - [`brokers`]: whether RabbitMQ / NATS answer here, and unique queue
//!   names, for the queue trigger suites.
//! - [`process`]: the real `flotilla` binary as server, agent and CLI in a
//!   temporary home, and a minimal blocking HTTP client independent of the
//!   code under test.
//!
//! - [`containers`]: Podman's Docker API service and the local busybox
//!   image, for the container runtime's end-to-end tests.
//!
//! Test-only: never a dependency of a shipped crate.

pub mod brokers;
pub mod containers;
pub mod db;
pub mod process;
pub mod server;

pub use flotilla_testdb::backend_suite;
