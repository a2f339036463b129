//! `flotilla-emulator`: an OpenAI-compatible model server that needs no
//! GPU (see the `flotilla_emulator` crate). Prints `listening on ADDR` as
//! its first line so a parent started with `--port 0` learns the port.

use std::io::Write;

use clap::Parser;
use flotilla_emulator::{Emulator, EmulatorConfig};

#[derive(Debug, Parser)]
#[command(
    name = "flotilla-emulator",
    version,
    about = "An OpenAI-compatible model-server emulator"
)]
struct Cli {
    #[command(flatten)]
    config: EmulatorConfig,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let emulator = Emulator::start(cli.config).await?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {}", emulator.addr())?;
        out.flush()?;
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    emulator.shutdown().await;
    Ok(())
}
