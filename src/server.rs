//! Bind, serve, shut down gracefully; and build an instance from config.

use crate::api::{AppState, app};
use crate::clock::{Clock, FastClock};
use crate::config::{Backend, Config};
use crate::metrics as m;
use crate::policy::Limiter;
use crate::store::redis::RedisConnection;
use crate::store::{LuaStore, MemoryStore, NaiveStore, Store};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// Builds the store the config names. Standalone Redis connects lazily (the
/// service starts while Redis is away); a cluster must answer now.
pub async fn build_store(config: &Config) -> Result<Arc<dyn Store>, redis::RedisError> {
    Ok(match config.backend {
        Backend::Memory => Arc::new(MemoryStore::new(
            config.memory.max_keys,
            config.memory.shards,
        )),
        Backend::Naive => {
            let connection = RedisConnection::connect(&config.redis).await?;
            Arc::new(NaiveStore::new(connection, &config.redis))
        }
        Backend::Lua => {
            let connection = RedisConnection::connect(&config.redis).await?;
            Arc::new(LuaStore::new(connection, &config.redis))
        }
    })
}

/// Builds the shared state of one instance from validated config.
pub async fn build_state(
    config: &Config,
    clock: Arc<dyn Clock>,
) -> Result<AppState, redis::RedisError> {
    let store = build_store(config).await?;
    Ok(state_with_store(config, store, clock))
}

/// The shared state of one instance around a given store.
pub fn state_with_store(config: &Config, store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> AppState {
    let handle = m::install();
    metrics::gauge!(m::INSTANCE_INFO, "instance" => config.instance_id.clone(), "backend" => config.backend.as_str())
        .set(1.0);
    let limiter = Arc::new(Limiter::new(config, store, clock));
    AppState::new(limiter, handle, &config.instance_id)
}

/// Why an instance could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The Redis connection could not be set up (a cluster did not answer).
    #[error("cannot set up the Redis connection: {0}")]
    Redis(#[from] redis::RedisError),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("serving failed: {0}")]
    Serve(std::io::Error),
}

/// Runs one instance as configured until ctrl-c or SIGTERM: what the
/// `ratelimiter` binary does (and what load tests spawn).
pub async fn run(config: Config) -> Result<(), RunError> {
    if config.key_secret.is_none() {
        tracing::warn!(
            "key_secret not set: identities are hashed with a random per-process key; set RL_KEY_SECRET when instances share a store"
        );
    }
    let state = build_state(&config, Arc::new(FastClock::default())).await?;
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| RunError::Bind {
            addr: config.listen,
            source,
        })?;
    tracing::info!(
        listen = %listener.local_addr().map_err(RunError::Serve)?,
        instance = %config.instance_id,
        backend = config.backend.as_str(),
        policies = config.policies.len(),
        api_keys = config.api_keys.len(),
        "serving"
    );
    serve(listener, state, shutdown_signal())
        .await
        .map_err(RunError::Serve)
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`).
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// Serves `state` on `listener` until `shutdown` completes, then finishes
/// the requests in flight.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // Histograms are drained on render; upkeep bounds memory if nobody scrapes.
    let handle = state.metrics.clone();
    let upkeep = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            handle.run_upkeep();
        }
    });
    let router = app(state);
    let result = axum::serve(
        listener,
        router.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await;
    upkeep.abort();
    result
}

/// Completes on ctrl-c or SIGTERM (what `docker stop` and systemd send).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("shutdown signal received; finishing requests in flight");
}
