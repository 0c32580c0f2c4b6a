//! The API service binary: parse config, bind, serve until a signal.

use anyhow::Context;
use clap::Parser;
use ratelimiter::clock::FastClock;
use ratelimiter::config::{Cli, Config};
use ratelimiter::server;
use std::sync::Arc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let config = Config::load(Cli::parse())?;
    if config.key_secret.is_none() {
        tracing::warn!(
            "key_secret not set: identities are hashed with a random per-process key; set RL_KEY_SECRET when instances share a store"
        );
    }
    let state = server::build_state(&config, Arc::new(FastClock::default()))
        .await
        .context("cannot set up the Redis connection")?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    tracing::info!(
        listen = %listener.local_addr()?,
        instance = %config.instance_id,
        backend = config.backend.as_str(),
        policies = config.policies.len(),
        api_keys = config.api_keys.len(),
        "serving"
    );
    server::serve(listener, state, server::shutdown_signal()).await?;
    Ok(())
}
