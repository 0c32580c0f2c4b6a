//! The API service binary: parse config, bind, serve until a signal.

use clap::Parser;
use ratelimiter::config::{Cli, Config};
use ratelimiter::server;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = Config::load(Cli::parse())?;
    server::run(config).await?;
    Ok(())
}
