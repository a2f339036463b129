//! Helpers shared by the CLI's integration tests.

pub mod slurm;
pub mod times;
