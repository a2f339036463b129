//! Fresh stores for tests: `flotilla-testdb`'s fixtures, re-exported so
//! suites that also start a server need one test-support crate.

pub use flotilla_testdb::{postgres, postgres_url, sqlite, with_database, TestDb};
