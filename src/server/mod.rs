//! Wiring and serving: the one place an instance is assembled from its
//! config (the store stack, the limiter, the handlers' state), then bound,
//! served and shut down gracefully. How connections are accepted, capped
//! and timed out is [`connections`] (the header timeout: [`head_timeout`]).

pub mod connections;
pub mod head_timeout;

use crate::api::{AppState, Health, app};
use crate::clock::{Clock, FastClock};
use crate::config::{Cli, Config, ConfigError};
use crate::failover::{BreakerHandle, Deadline, Failover, LocalShare};
use crate::hotkeys::HotKeys;
use crate::identity::{ApiKeys, Identifier, KeyHasher};
use crate::limiter::{CurrentLimiter, Limiter};
use crate::metrics as m;
use crate::mitigation::{DenyCache, Leases, Sharded};
use crate::policy::Policies;
use crate::rls::RateLimiter;
use crate::store::redis::RedisConnection;
use crate::store::{Backend, Counted, LuaStore, MemoryStore, NaiveStore, Store};
use crate::telemetry;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;

/// The store stack an instance decides through, and a handle on its
/// breaker (for `/readyz`) if it has one.
#[derive(Debug, Clone)]
pub struct Stack {
    /// The outermost layer.
    pub store: Arc<dyn Store>,
    /// The failure policy's breaker (`None` for an in-process store).
    pub breaker: Option<BreakerHandle>,
}

/// The stack around an in-process store: its errors counted. There is
/// nothing to fail over from.
pub fn in_process_stack(store: MemoryStore) -> Stack {
    Stack {
        store: Arc::new(Counted::new(store)),
        breaker: None,
    }
}

/// Keys holding a lease at once, at most (about 100 bytes each).
const LEASE_KEYS: usize = 100_000;

/// `stack` under the mitigations (each acts only for the policies that
/// turn it on): key sharding outermost, so everything below sees one
/// sub-bucket as any other bucket (its own denials cached, its own leases,
/// its own local share); then the deny cache, so a remembered denial costs
/// neither a lease, the breaker, the deadline nor a call; then the leases,
/// above the failure policy, whose local share never pays for a lease.
pub fn mitigated(stack: Stack, config: &Config) -> Stack {
    let leases = Leases::new(stack.store, config.failover.instances, LEASE_KEYS);
    Stack {
        store: Arc::new(Sharded::new(DenyCache::new(
            leases,
            config.deny_cache_max_keys,
        ))),
        breaker: stack.breaker,
    }
}

/// The stack around a shared store (Redis, or a test's stand-in), from the
/// inside out: a deadline on every call, its errors counted, then the
/// breaker and the failure modes with this instance's local share.
pub fn shared_stack<S: Store>(store: S, config: &Config) -> Stack {
    // The breaker sets its gauges as it is made: the recorder must exist.
    m::install();
    let settings = &config.failover;
    let local = LocalShare::new(
        settings.instances,
        config.memory.max_keys,
        config.memory.shards,
    );
    let failover = Failover::new(
        // A late answer may still arrive within the Redis client's own
        // response timeout: until then, a deadline miss is not yet Redis's
        // fault (see `failover::Deadline`).
        Counted::new(
            Deadline::new(store, settings.deadline).late_within(config.redis.response_timeout),
        ),
        settings,
        local,
    );
    let breaker = failover.breaker();
    Stack {
        store: Arc::new(failover),
        breaker: Some(breaker),
    }
}

/// Builds the stack the config names. Redis connects lazily (the service
/// starts while Redis is away); only invalid settings fail here.
pub async fn build_stack(config: &Config) -> Result<Stack, redis::RedisError> {
    let stack = match config.backend {
        Backend::Memory => in_process_stack(MemoryStore::new(
            config.memory.max_keys,
            config.memory.shards,
        )),
        Backend::Naive => {
            let connection = RedisConnection::connect(&config.redis).await?;
            shared_stack(NaiveStore::new(connection, &config.redis), config)
        }
        Backend::Lua => {
            let connection = RedisConnection::connect(&config.redis).await?;
            shared_stack(LuaStore::new(connection, &config.redis), config)
        }
    };
    Ok(mitigated(stack, config))
}

/// The limiter the config describes, deciding through `store`.
pub fn build_limiter(config: &Config, store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> Limiter {
    let secret = config.key_secret.unwrap_or_else(|| {
        let mut secret = [0u8; 16];
        // Without OS randomness the process cannot keep identities
        // private; refusing to start is better than a guessable key.
        getrandom::fill(&mut secret).expect("the OS random source is unavailable");
        secret
    });
    let hot_keys = hot_keys(config, &*store);
    limiter_with(config, KeyHasher::new(secret), store, clock, hot_keys)
}

/// The hot-key detector `config` asks for, for `store`: keys counted by
/// Redis Cluster slot where the store's slots are on several nodes (a
/// Cluster), on one node where they are not (the in-process store, a
/// standalone Redis). Asked of the store rather than the config, so a
/// stack assembled by hand (a test's) is counted as what it is.
fn hot_keys(config: &Config, store: &dyn Store) -> Option<Arc<HotKeys>> {
    let hot = if store.one_node() {
        HotKeys::on_one_node(config.hot_keys)
    } else {
        HotKeys::new(config.hot_keys)
    };
    hot.map(Arc::new)
}

/// The limiter the config describes, keying buckets with `hasher` (a
/// reload keeps the running one: with a random secret, a new one would
/// re-key, so reset, every bucket), with a given hot-key detector.
fn limiter_with(
    config: &Config,
    hasher: KeyHasher,
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    hot_keys: Option<Arc<HotKeys>>,
) -> Limiter {
    let api_keys = ApiKeys::from_digests(config.api_keys.iter().map(|k| (k.id.clone(), k.sha256)));
    Limiter::new(
        Policies::new(&config.policies, config.failover.mode),
        Identifier::new(api_keys, config.trusted_proxies.clone(), config.ipv6_prefix),
        hasher,
        store,
        clock,
        config.near_limit_fraction,
    )
    .with_hot_keys(hot_keys)
    .with_descriptors(&config.rls.domains)
}

/// Builds the shared state of one instance from validated config.
pub async fn build_state(
    config: &Config,
    clock: Arc<dyn Clock>,
) -> Result<AppState, redis::RedisError> {
    let stack = build_stack(config).await?;
    Ok(state_with_stack(config, stack, clock))
}

/// The shared state of one instance around a given stack.
pub fn state_with_stack(config: &Config, stack: Stack, clock: Arc<dyn Clock>) -> AppState {
    let handle = m::install();
    metrics::gauge!(m::INSTANCE_INFO, "instance_id" => config.instance_id.clone(), "backend" => config.backend.as_str())
        .set(1.0);
    let limiter = Arc::new(CurrentLimiter::new(build_limiter(
        config,
        Arc::clone(&stack.store),
        clock,
    )));
    let health = Health {
        store: stack.store,
        breaker: stack.breaker,
        failure_mode: config.failover.mode,
    };
    AppState::new(limiter, health, handle, &config.instance_id).with_http(config.http.clone())
}

/// Re-reads the config on demand (SIGHUP) and puts a new limiter in force.
///
/// What a reload may change: the policies, API keys, trusted proxies, the
/// IPv6 prefix, the near-limit fraction and the hot-key detector: all of
/// it lives in the limiter, which is replaced whole. The store stack is
/// kept, so live buckets (in Redis or in memory), the local share and the
/// breaker carry on. What needs a restart (the listen address, the HTTP bounds, the
/// backend, Redis, the failure settings, tracing, the instance id, the
/// key secret, which keys every bucket) refuses the whole reload, naming
/// the fields: a file is applied entirely or not at all.
#[derive(Debug)]
pub struct Reloader {
    cli: Cli,
    running: Mutex<Config>,
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    limiter: Arc<CurrentLimiter>,
}

/// Why a reload was refused (the running config stays).
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The file cannot be read or is not a valid config.
    #[error(transparent)]
    Invalid(#[from] ConfigError),
    /// Fields that only a restart can change were changed.
    #[error("{} changed; these take effect only on a restart", .0.join(", "))]
    NeedsRestart(Vec<&'static str>),
}

impl ReloadError {
    /// The `result` label of `ratelimit_config_reloads_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            ReloadError::Invalid(_) => "invalid",
            ReloadError::NeedsRestart(_) => "needs_restart",
        }
    }
}

/// The fields of `new` that differ from `running` and need a restart.
pub fn restart_only_changes(running: &Config, new: &Config) -> Vec<&'static str> {
    let mut changed = Vec::new();
    let mut check = |field: &'static str, same: bool| {
        if !same {
            changed.push(field);
        }
    };
    check("listen", running.listen == new.listen);
    check("backend", running.backend == new.backend);
    check("instance_id", running.instance_id == new.instance_id);
    check("key_secret", running.key_secret == new.key_secret);
    check("http", running.http == new.http);
    check("memory", running.memory == new.memory);
    check("redis", running.redis == new.redis);
    check("failure", running.failover == new.failover);
    check("tracing", running.tracing == new.tracing);
    check(
        "rls.listen",
        running.rls.listen == new.rls.listen
            && running.rls.max_message_bytes == new.rls.max_message_bytes,
    );
    changed
}

impl Reloader {
    /// Reloads from the file and flags of `cli` (the ones the instance
    /// started with) into `state`'s limiter, deciding through `store`.
    pub fn new(
        cli: Cli,
        running: Config,
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        state: &AppState,
    ) -> Self {
        Self {
            cli,
            running: Mutex::new(running),
            store,
            clock,
            limiter: Arc::clone(&state.limiter),
        }
    }

    /// Reads and validates the config again, and if it is good and changes
    /// nothing that needs a restart, puts it in force. Counted and logged
    /// either way.
    pub fn reload(&self) -> Result<(), ReloadError> {
        let result = self.try_reload();
        let outcome = match &result {
            Ok(()) => "applied",
            Err(e) => e.kind(),
        };
        metrics::counter!(m::CONFIG_RELOADS_TOTAL, "result" => outcome).increment(1);
        match &result {
            Ok(()) => tracing::info!(
                generation = self.limiter.generation(),
                "config reloaded: the new policies, keys and trusted proxies are in force"
            ),
            Err(error) => {
                tracing::error!(%error, "config reload refused; the running config stays in force")
            }
        }
        result
    }

    fn try_reload(&self) -> Result<(), ReloadError> {
        let new = Config::load(self.cli.clone())?;
        let mut running = self
            .running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let changed = restart_only_changes(&running, &new);
        if !changed.is_empty() {
            return Err(ReloadError::NeedsRestart(changed));
        }
        for range in new.wide_trusted_ranges() {
            tracing::warn!(%range, "trusted proxy range holds more than {} addresses: every client inside it can choose its own bucket", new.trusted_proxy_warn_addresses);
        }
        // The same detector settings: keep its windows, so a reload does
        // not blank the hot-key panels.
        let current = self.limiter.get();
        let hot_keys = match current.hot_keys() {
            Some(hot) if hot.settings() == new.hot_keys => Some(Arc::clone(hot)),
            _ => hot_keys(&new, &*self.store),
        };
        self.limiter.replace(limiter_with(
            &new,
            current.hasher().clone(),
            Arc::clone(&self.store),
            Arc::clone(&self.clock),
            hot_keys,
        ));
        *running = new;
        Ok(())
    }
}

/// Reloads on every SIGHUP until the process ends.
#[cfg(unix)]
async fn reload_on_hangup(reloader: Reloader) {
    let mut hangups = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGHUP: config reload is off");
            return;
        }
    };
    while hangups.recv().await.is_some() {
        tracing::info!("SIGHUP: reloading the config");
        // Errors are logged and counted by `reload`.
        let _ = reloader.reload();
    }
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
    /// Telemetry could not start.
    #[error(transparent)]
    Telemetry(#[from] telemetry::TelemetryError),
}

/// Runs one instance as configured until ctrl-c or SIGTERM: what the
/// `ratelimiter` binary does (and what load tests spawn). With `cli` (the
/// flags and file it was loaded from), SIGHUP reloads the config.
pub async fn run(config: Config, cli: Option<Cli>) -> Result<(), RunError> {
    let telemetry = telemetry::init(&config.tracing, &config.instance_id)?;
    let result = run_instance(&config, cli).await;
    // Spans still queued go out before the process ends.
    telemetry.shutdown(Duration::from_secs(2)).await;
    result
}

async fn run_instance(config: &Config, cli: Option<Cli>) -> Result<(), RunError> {
    for ignored in &config.ignored_env {
        tracing::warn!("{ignored}");
    }
    for range in config.wide_trusted_ranges() {
        tracing::warn!(
            %range,
            "trusted proxy range holds more than {} addresses: every client inside it can set X-Forwarded-For and choose its own bucket; trust the proxies' own addresses (trusted_proxy_warn_addresses sets this warning's threshold)",
            config.trusted_proxy_warn_addresses
        );
    }
    if let Some(limit) = connections::over_descriptor_limit(config.http.max_connections) {
        tracing::warn!(
            max_connections = config.http.max_connections,
            open_files_limit = limit,
            "http.max_connections plus {} descriptors for everything else is over the process's open-files limit: accept will fail at the limit before the cap applies; raise ulimit -n (LimitNOFILE) or lower http.max_connections",
            connections::RESERVED_DESCRIPTORS
        );
    }
    if config.key_secret.is_none() {
        tracing::warn!(
            "key_secret not set: identities are hashed with a random per-process key; set RL_KEY_SECRET when instances share a store"
        );
    }
    let clock: Arc<dyn Clock> = Arc::new(FastClock::default());
    let stack = build_stack(config).await?;
    let store = Arc::clone(&stack.store);
    let state = state_with_stack(config, stack, Arc::clone(&clock));
    #[cfg(unix)]
    if let Some(cli) = cli {
        let reloader = Reloader::new(cli, config.clone(), store, clock, &state);
        tokio::spawn(reload_on_hangup(reloader));
    }
    #[cfg(not(unix))]
    let _ = (cli, store);
    if let Some(addr) = config.rls.listen {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| RunError::Bind { addr, source })?;
        tracing::info!(listen = %addr, domains = config.rls.domains.len(), "serving Envoy's rate limit service");
        let service = RateLimiter::new(Arc::clone(&state.limiter));
        let max = config.rls.max_message_bytes;
        tokio::spawn(async move {
            if let Err(error) = serve_rls(listener, service, max, shutdown_signal()).await {
                tracing::error!(%error, "the rate limit service stopped");
            }
        });
    }
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

/// Serves `state` on `listener` until `shutdown` completes, then finishes
/// the requests in flight; within `state.http`'s timeouts and caps.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // The exporter's upkeep (see `MetricsHandle::run_upkeep`), also when
    // nobody scrapes.
    let handle = state.metrics.clone();
    let upkeep = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            handle.run_upkeep();
        }
    });
    let settings = state.http.clone();
    let limiter = Arc::clone(&state.limiter);
    let front = app(state);
    let result =
        connections::serve_connections(listener, front, limiter, &settings, shutdown).await;
    upkeep.abort();
    result
}

/// Serves Envoy's rate limit service on `listener` until `shutdown`
/// completes, refusing messages above `max_message_bytes`.
pub async fn serve_rls(
    listener: TcpListener,
    service: RateLimiter,
    max_message_bytes: usize,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    // Our accept, not tonic's `TcpIncoming`: tonic retries a failed accept
    // at once and logs it only at trace level.
    let incoming = futures_util::stream::unfold(listener, |listener| async move {
        let (stream, _) = connections::accept(&listener, "rls").await;
        // Answers are written whole; Nagle would only delay them.
        let _ = stream.set_nodelay(true);
        Some((Ok::<_, std::io::Error>(stream), listener))
    });
    tonic::transport::Server::builder()
        .add_service(service.into_service(max_message_bytes))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Limit;
    use crate::key::BucketKey;
    use crate::store::{Check, FailureMode, Source, StoreError};

    /// With the memory backend, memory decides: no failure policy, no
    /// share, whatever the policy's failure mode.
    #[tokio::test]
    async fn an_in_process_primary_is_used_as_is() {
        let config = Config::from_toml("[failure]\ninstances = 3\n").unwrap();
        assert_eq!(config.backend, Backend::Memory);
        let stack = build_stack(&config).await.unwrap();
        assert!(stack.breaker.is_none(), "nothing to fail over from");
        let limit = Limit::per_second(5, 1).unwrap();
        let check = Check::new(BucketKey(1), limit, 1, 1_800_000_000_000_000)
            .on_failure(FailureMode::Closed);
        let c = stack.store.check(check).await.unwrap();
        assert_eq!(c.source, Source::Memory);
        assert_eq!(c.limit, limit, "no share: memory is not a fallback");
        let too_costly = Check { cost: 6, ..check };
        assert!(matches!(
            stack.store.check(too_costly).await,
            Err(StoreError::CostExceedsBurst(_))
        ));
    }

    /// The in-process stack, as built, answers without waiting through
    /// every layer (no boxed future, so no allocation, per check): plain,
    /// sharded, a deny-cache miss and hit, a store error, and a spent
    /// lease. (Taking a lease is a future of its own.)
    #[tokio::test]
    async fn the_in_process_stack_answers_at_once() {
        let config = Config::from_toml("").unwrap();
        let store = build_stack(&config).await.unwrap().store;
        let limit = Limit::per_second(10, 1).unwrap();
        let at = |key| Check::new(BucketKey(key), limit, 1, 1_800_000_000_000_000);
        let ready = |check: Check| {
            let answer = store.check(check);
            assert!(answer.is_ready(), "{check:?} waited");
            answer
        };
        assert_eq!(ready(at(1)).await.unwrap().source, Source::Memory);
        assert!(ready(at(2).with_shards(4)).await.unwrap().shard.is_some());
        let denied = Check { cost: 10, ..at(3) }.with_deny_cache(true);
        assert!(ready(denied).await.unwrap().decision.unwrap().allowed);
        assert!(!ready(denied).await.unwrap().decision.unwrap().allowed);
        assert_eq!(ready(denied).await.unwrap().source, Source::DenyCache);
        assert!(ready(Check { cost: 11, ..at(4) }).await.is_err());
        // The first check half drains the bucket (a lease lives while the
        // bucket refills), the second takes a lease, the third spends it.
        let leased = at(5).with_lease(2);
        let draining = Check { cost: 5, ..leased };
        assert_eq!(store.check(draining).await.unwrap().source, Source::Memory);
        assert_eq!(store.check(leased).await.unwrap().source, Source::Memory);
        assert_eq!(ready(leased).await.unwrap().source, Source::Lease);
    }
}
