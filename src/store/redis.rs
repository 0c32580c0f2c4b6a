//! Bucket state in Redis: the atomic Lua store and, deliberately, a racy one.
//!
//! The moment two instances run behind a balancer, in-process buckets lie:
//! N instances admit N times the limit. Moving the state into Redis fixes
//! that only if the read-modify-write is atomic:
//!
//! - [`LuaStore`] (`--backend lua`) runs `lua/token_bucket.lua` with EVALSHA
//!   (redis-rs `Script` reloads it on NOSCRIPT). Redis runs a script to the
//!   end before anything else, so read, refill, spend and write are one step
//!   and no two instances can spend the same token.
//! - [`NaiveStore`] (`--backend naive`) does GET, computes with the same pure
//!   core in Rust, then SET. Between another instance's GET and SET this one
//!   can read the same token, and both spend it. It exists to *measure* that
//!   race (`cargo run -p loadtest -- race`); it is never a default.
//!
//! Both store the same value (three little-endian doubles: tokens in units,
//! the instant they were computed for, and when the key expires) under
//! `<prefix>{<bucket hex>}`:
//! the hash tag keeps every key a script touches in one cluster slot, and
//! the prefix lets deployments share a Redis. Keys expire when their bucket
//! would be full again (plus a margin), which is exactly "no key".
//!
//! Connections: one multiplexed connection per process (standalone, through
//! a `ConnectionManager` that reconnects) or a cluster connection; concurrent
//! checks are pipelined on it. Timeouts and retries are set for a request
//! path: the client defaults (500 ms response timeout, 6 retries) would stall
//! every request behind a sick Redis.

use super::{BoxFuture, BucketKey, Store, StoreError};
use crate::algorithm::{Algorithm, Window};
use crate::bucket::{self, BucketState, Decision, Limit};
use crate::clock::Micros;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, Script, Value};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OnceCell;

/// The token bucket script, as shipped in `lua/`.
pub const TOKEN_BUCKET_LUA: &str = include_str!("../../lua/token_bucket.lua");

/// How to reach Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisSettings {
    /// `redis://host:port[/db]` for standalone, or the seed nodes of a cluster.
    pub urls: Vec<String>,
    /// Whether `urls` are cluster seed nodes.
    pub cluster: bool,
    /// Prefix of every key (before the hash tag).
    pub prefix: String,
    /// Time allowed to open a connection.
    pub connect_timeout: Duration,
    /// Time allowed for one command's answer.
    pub response_timeout: Duration,
    /// Reconnection attempts (standalone) or retries (cluster) per failure.
    pub retries: u32,
    /// Added to a bucket's time-to-full to get its key's TTL.
    pub ttl_margin: Duration,
}

/// A standalone or cluster connection; both pipeline concurrent callers.
#[derive(Clone)]
pub enum RedisConnection {
    /// One server, reconnecting on failure.
    Standalone(ConnectionManager),
    /// A Redis Cluster, routed by slot, connected on first use.
    Cluster(LazyCluster),
}

/// A cluster connection made on first use and kept: the service starts
/// while the cluster is away and connects when it appears (the failure
/// policy meanwhile decides; its breaker keeps the attempts few). Concurrent
/// first uses wait for one attempt instead of each opening connections.
#[derive(Clone)]
pub struct LazyCluster {
    // One allocation shared by every clone (a connection is cloned per check).
    shared: Arc<(ClusterClient, OnceCell<ClusterConnection>)>,
}

impl std::fmt::Debug for LazyCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyCluster")
            .field("connected", &self.shared.1.initialized())
            .finish()
    }
}

impl LazyCluster {
    async fn get(&self) -> Result<ClusterConnection, RedisError> {
        if let Some(connection) = self.shared.1.get() {
            return Ok(connection.clone());
        }
        // Connecting (slot map, one connection per master) can outlast the
        // check's deadline, which drops this future: run it in its own task
        // so that a dropped caller does not abort it and the next caller
        // finds it done, instead of every attempt being cut short forever.
        let shared = Arc::clone(&self.shared);
        tokio::spawn(async move {
            let (client, connection) = &*shared;
            connection
                .get_or_try_init(|| client.get_async_connection())
                .await
                .cloned()
        })
        .await
        .map_err(|e| {
            RedisError::from((
                redis::ErrorKind::Client,
                "cluster connect task failed",
                e.to_string(),
            ))
        })?
    }
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RedisConnection::Standalone(_) => "RedisConnection::Standalone",
            RedisConnection::Cluster(_) => "RedisConnection::Cluster",
        })
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConnection::Standalone(c) => c.req_packed_command(cmd),
            RedisConnection::Cluster(c) => Box::pin(async move {
                let mut connection = c.get().await?;
                connection.req_packed_command(cmd).await
            }),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConnection::Standalone(c) => c.req_packed_commands(pipeline, offset, count),
            RedisConnection::Cluster(c) => Box::pin(async move {
                let mut connection = c.get().await?;
                connection
                    .req_packed_commands(pipeline, offset, count)
                    .await
            }),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConnection::Standalone(c) => c.get_db(),
            // Cluster has database 0 only.
            RedisConnection::Cluster(_) => 0,
        }
    }
}

impl RedisConnection {
    /// Connects as `settings` say, lazily: the first command connects (and
    /// a failed attempt is retried by a later command), so the service
    /// starts while Redis is away. Only invalid settings fail here.
    pub async fn connect(settings: &RedisSettings) -> Result<Self, RedisError> {
        if settings.cluster {
            let client = redis::cluster::ClusterClientBuilder::new(settings.urls.clone())
                .connection_timeout(settings.connect_timeout)
                .response_timeout(settings.response_timeout)
                .retries(settings.retries)
                .min_retry_wait(1)
                .max_retry_wait(50)
                .build()?;
            Ok(Self::Cluster(LazyCluster {
                shared: Arc::new((client, OnceCell::new())),
            }))
        } else {
            let url = settings
                .urls
                .first()
                .map(String::as_str)
                .unwrap_or("redis://127.0.0.1:6379");
            let client = redis::Client::open(url)?;
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(settings.connect_timeout))
                .set_response_timeout(Some(settings.response_timeout))
                .set_number_of_retries(settings.retries as usize)
                .set_min_delay(Duration::from_millis(1))
                .set_max_delay(Duration::from_millis(50));
            Ok(Self::Standalone(ConnectionManager::new_lazy_with_config(
                client, config,
            )?))
        }
    }
}

impl RedisConnection {
    /// PING: can this connection answer right now?
    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut connection = self.clone();
        let _: String = redis::cmd("PING").query_async(&mut connection).await?;
        Ok(())
    }
}

/// The Redis key of a bucket: `<prefix>{<32 hex digits>}`.
pub fn redis_key(prefix: &str, key: BucketKey) -> String {
    format!("{prefix}{{{key}}}")
}

/// The stored value: tokens, last and the key's expiry (microseconds), as
/// three little-endian doubles (what the Lua script's
/// `struct.pack('<d<d<d', ...)` writes). Exact: all are integers of at most
/// 2^53.
pub fn encode_state(state: BucketState, expires: Micros) -> [u8; 24] {
    let mut out = [0u8; 24];
    out[..8].copy_from_slice(&(state.tokens as f64).to_le_bytes());
    out[8..16].copy_from_slice(&(state.last as f64).to_le_bytes());
    out[16..].copy_from_slice(&(expires as f64).to_le_bytes());
    out
}

/// The bucket state in a value written by [`encode_state`] (or the
/// script); `None` for a value of another shape.
pub fn decode_state(bytes: &[u8]) -> Option<BucketState> {
    let tokens = f64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let last = f64::from_le_bytes(bytes.get(8..16)?.try_into().ok()?);
    if bytes.len() != 24 || !(tokens >= 0.0 && last >= 0.0) {
        return None;
    }
    Some(BucketState {
        tokens: tokens as u64,
        last: last as u64,
    })
}

/// The TTL for a bucket full again in `reset`: rounded up to whole
/// milliseconds, plus the margin (as the script computes it).
fn ttl_ms(reset: Duration, margin: Duration) -> u64 {
    u64::try_from((reset + margin).as_micros().div_ceil(1000)).unwrap_or(u64::MAX)
}

/// Parses the script's reply, `"<allowed> <remaining> <retry_us> <reset_us>"`.
fn parse_reply(reply: &str) -> Option<(bool, u64, u64, u64)> {
    let mut fields = reply.split(' ').map(str::parse::<u64>);
    let allowed = fields.next()?.ok()?;
    let remaining = fields.next()?.ok()?;
    let retry = fields.next()?.ok()?;
    let reset = fields.next()?.ok()?;
    if fields.next().is_some() || allowed > 1 {
        return None;
    }
    Some((allowed == 1, remaining, retry, reset))
}

/// The atomic store: one EVALSHA per check.
#[derive(Debug)]
pub struct LuaStore {
    connection: RedisConnection,
    script: Script,
    others: [Script; 4],
    prefix: String,
    ttl_margin_us: u64,
}

/// The other algorithms' scripts, as shipped in `lua/` (index: see
/// [`LuaStore::script_for`]).
pub const GCRA_LUA: &str = include_str!("../../lua/gcra.lua");
/// See [`GCRA_LUA`].
pub const FIXED_WINDOW_LUA: &str = include_str!("../../lua/fixed_window.lua");
/// See [`GCRA_LUA`].
pub const SLIDING_LOG_LUA: &str = include_str!("../../lua/sliding_log.lua");
/// See [`GCRA_LUA`].
pub const SLIDING_WINDOW_LUA: &str = include_str!("../../lua/sliding_window.lua");

/// The Redis key of a bucket under `algorithm`. Each algorithm stores a
/// different shape (a sorted set for the log), so each has its own key
/// space: a policy switched to another algorithm starts afresh instead of
/// misreading the old value (or failing with WRONGTYPE).
pub fn algorithm_key(prefix: &str, algorithm: Algorithm, key: BucketKey) -> String {
    match algorithm {
        Algorithm::TokenBucket => redis_key(prefix, key),
        Algorithm::Gcra => format!("{prefix}gcra:{{{key}}}"),
        Algorithm::FixedWindow => format!("{prefix}fw:{{{key}}}"),
        Algorithm::SlidingLog => format!("{prefix}log:{{{key}}}"),
        Algorithm::SlidingWindow => format!("{prefix}sw:{{{key}}}"),
    }
}

impl LuaStore {
    /// A store on `connection`.
    pub fn new(connection: RedisConnection, settings: &RedisSettings) -> Self {
        Self {
            connection,
            script: Script::new(TOKEN_BUCKET_LUA),
            others: [
                Script::new(GCRA_LUA),
                Script::new(FIXED_WINDOW_LUA),
                Script::new(SLIDING_LOG_LUA),
                Script::new(SLIDING_WINDOW_LUA),
            ],
            prefix: settings.prefix.clone(),
            ttl_margin_us: u64::try_from(settings.ttl_margin.as_micros()).unwrap_or(u64::MAX),
        }
    }

    /// The token bucket script's SHA1, as EVALSHA sends it.
    pub fn script_hash(&self) -> &str {
        self.script.get_hash()
    }

    /// The script that runs `algorithm`.
    pub fn script_for(&self, algorithm: Algorithm) -> &Script {
        match algorithm {
            Algorithm::TokenBucket => &self.script,
            Algorithm::Gcra => &self.others[0],
            Algorithm::FixedWindow => &self.others[1],
            Algorithm::SlidingLog => &self.others[2],
            Algorithm::SlidingWindow => &self.others[3],
        }
    }

    /// The Redis key of `key` under `algorithm` with this store's prefix.
    pub fn key_name(&self, algorithm: Algorithm, key: BucketKey) -> String {
        algorithm_key(&self.prefix, algorithm, key)
    }

    /// The decision for `key`, straight from the script.
    pub async fn check_key(
        &self,
        key: BucketKey,
        limit: &Limit,
        cost: u64,
        now: Micros,
    ) -> Result<Decision, StoreError> {
        self.check_key_within(key, limit, cost, now, None).await
    }

    /// [`LuaStore::check_key`] with a ceiling in units (ARGV[7]).
    pub async fn check_key_within(
        &self,
        key: BucketKey,
        limit: &Limit,
        cost: u64,
        now: Micros,
        ceiling: Option<u64>,
    ) -> Result<Decision, StoreError> {
        limit.check_cost(cost)?;
        let mut connection = self.connection.clone();
        let algorithm = limit.algorithm();
        let mut invocation = self
            .script_for(algorithm)
            .key(self.key_name(algorithm, key));
        invocation.arg(now).arg(cost);
        match algorithm {
            Algorithm::TokenBucket | Algorithm::Gcra => {
                invocation
                    .arg(limit.units_per_token())
                    .arg(limit.rate_units_per_us())
                    .arg(limit.capacity_units());
            }
            Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::SlidingWindow => {
                let window = Window::of(limit);
                invocation.arg(window.limit).arg(window.window_us);
            }
        }
        invocation.arg(self.ttl_margin_us);
        // The hand-back ceiling is a bucket level: only the token bucket
        // takes it (the other algorithms hand back without one).
        if let (Some(ceiling), Algorithm::TokenBucket) = (ceiling, algorithm) {
            // At most the capacity, so the script's integers stay exact.
            invocation.arg(ceiling.min(limit.capacity_units()));
        }
        let reply: String = invocation.invoke_async(&mut connection).await?;
        let (allowed, remaining, retry_after, reset) = parse_reply(&reply).ok_or_else(|| {
            RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "rate limit script reply",
                reply.clone(),
            ))
        })?;
        Ok(Decision {
            allowed,
            limit: limit.burst(),
            remaining,
            retry_after: Duration::from_micros(retry_after),
            reset: Duration::from_micros(reset),
        })
    }
}

impl Store for LuaStore {
    fn check_within(
        &self,
        key: BucketKey,
        limit: Limit,
        cost: u64,
        now: Micros,
        ceiling: Option<u64>,
    ) -> BoxFuture<'_, Result<Decision, StoreError>> {
        Box::pin(async move { self.check_key_within(key, &limit, cost, now, ceiling).await })
    }

    fn backend(&self) -> &'static str {
        "lua"
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(self.connection.ping())
    }
}

/// The racy baseline: GET, decide in Rust, SET. See the module docs.
#[derive(Debug)]
pub struct NaiveStore {
    connection: RedisConnection,
    prefix: String,
    ttl_margin: Duration,
}

impl NaiveStore {
    /// A store on `connection`.
    pub fn new(connection: RedisConnection, settings: &RedisSettings) -> Self {
        Self {
            connection,
            prefix: settings.prefix.clone(),
            ttl_margin: settings.ttl_margin,
        }
    }

    /// Step 1 of 2: read the bucket (`None`: absent, i.e. full).
    pub async fn read(&self, key: BucketKey) -> Result<Option<BucketState>, StoreError> {
        let mut connection = self.connection.clone();
        let raw: Option<Vec<u8>> = redis::cmd("GET")
            .arg(redis_key(&self.prefix, key))
            .query_async(&mut connection)
            .await?;
        Ok(raw.as_deref().and_then(decode_state))
    }

    /// Step 2 of 2: decide on what was read and write the result back,
    /// unconditionally: whatever another instance wrote since step 1 is lost.
    pub async fn decide_and_write(
        &self,
        key: BucketKey,
        read: Option<BucketState>,
        limit: &Limit,
        cost: u64,
        now: Micros,
        ceiling: Option<u64>,
    ) -> Result<Decision, StoreError> {
        let (decision, state) =
            bucket::check_within(limit, read, cost, now, ceiling.unwrap_or(u64::MAX))?;
        if decision.allowed {
            let mut connection = self.connection.clone();
            let redis_key = redis_key(&self.prefix, key);
            if decision.reset.is_zero() {
                let () = redis::cmd("DEL")
                    .arg(redis_key)
                    .query_async(&mut connection)
                    .await?;
            } else {
                let ttl = ttl_ms(decision.reset, self.ttl_margin);
                let () = redis::cmd("SET")
                    .arg(redis_key)
                    .arg(&encode_state(state, now + ttl * 1000)[..])
                    .arg("PX")
                    .arg(ttl)
                    .query_async(&mut connection)
                    .await?;
            }
        }
        Ok(decision)
    }
}

impl Store for NaiveStore {
    fn check_within(
        &self,
        key: BucketKey,
        limit: Limit,
        cost: u64,
        now: Micros,
        ceiling: Option<u64>,
    ) -> BoxFuture<'_, Result<Decision, StoreError>> {
        Box::pin(async move {
            StoreError::token_bucket_only("naive", &limit)?;
            let read = self.read(key).await?;
            self.decide_and_write(key, read, &limit, cost, now, ceiling)
                .await
        })
    }

    fn backend(&self) -> &'static str {
        "naive"
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(self.connection.ping())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_replies_parse_strictly() {
        assert_eq!(parse_reply("1 99 0 100000"), Some((true, 99, 0, 100_000)));
        assert_eq!(
            parse_reply("0 0 4503599627370496 1"),
            Some((false, 0, 1 << 52, 1))
        );
        for bad in ["", "1 2 3", "1 2 3 4 5", "2 0 0 0", "1 -1 0 0", "1 2.5 0 0"] {
            assert_eq!(parse_reply(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn state_encoding_round_trips_exactly_at_the_limits() {
        for state in [
            BucketState { tokens: 0, last: 0 },
            BucketState {
                tokens: crate::bucket::MAX_EXACT,
                last: 1 << 53,
            },
            BucketState {
                tokens: 123_456_789,
                last: 1_800_000_000_123_457,
            },
        ] {
            assert_eq!(decode_state(&encode_state(state, 1 << 53)), Some(state));
        }
        assert_eq!(decode_state(b"short"), None);
        assert_eq!(decode_state(&[0xff; 24]), None, "NaN is not a state");
        assert_eq!(decode_state(&[0; 16]), None);
    }

    #[test]
    fn keys_carry_a_hash_tag_and_the_prefix() {
        let key = redis_key("rl:", BucketKey(0xabc));
        assert_eq!(key, "rl:{00000000000000000000000000000abc}");
    }

    #[test]
    fn ttl_rounds_up_and_adds_the_margin() {
        assert_eq!(
            ttl_ms(Duration::from_micros(1), Duration::from_millis(1000)),
            1001
        );
        assert_eq!(ttl_ms(Duration::from_micros(3000), Duration::ZERO), 3);
    }
}
