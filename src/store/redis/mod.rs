//! Limit state in Redis: the atomic Lua store and, deliberately, a racy one.
//!
//! The moment two instances run behind a balancer, in-process buckets lie:
//! N instances admit N times the limit. Moving the state into Redis fixes
//! that only if the read-modify-write is atomic:
//!
//! - [`LuaStore`] (`--backend lua`) runs each algorithm's script with
//!   EVALSHA (loaded again on NOSCRIPT, as redis-rs `Script` does). Redis runs a script
//!   to the end before anything else, so read, refill, spend and write are
//!   one step and no two instances can spend the same token.
//! - [`NaiveStore`] (`--backend naive`) does GET, computes with the same pure
//!   core in Rust, then SET. Between another instance's GET and SET this one
//!   can read the same token, and both spend it. It exists to *measure* that
//!   race (`cargo run -p loadtest -- race`); it is never a default.
//!
//! Keys are `<prefix><algorithm tag>{<bucket hex>}`: the hash tag keeps
//! every key a script touches in one cluster slot, and the prefix lets
//! deployments share a Redis. Keys expire when their state would equal no
//! state again (plus a margin), which is exactly "no key".
//!
//! Connections: one pipelined connection per process to a standalone server,
//! our own ([`pipe`]: it reconnects, and does less per check than the
//! redis crate's multiplexed connection; what a check costs this process
//! is in docs/performance.md, "Client side of a Redis check"), or one such
//! connection per node of a cluster ([`cluster`]: a dead master fails
//! only its own keys' checks); concurrent checks are pipelined on each. Timeouts and retries are set for a request path: the redis
//! crate's defaults (500 ms response timeout, 6 retries) would stall every
//! request behind a sick Redis. `rediss://` URLs connect over TLS ([`tls`]);
//! credentials come in the URL (`rediss://user:password@host`).

mod call;
pub mod cluster;
mod lua;
mod naive;
pub mod pipe;
pub mod resp;
pub mod tls;
pub mod topology;

pub use lua::LuaStore;
pub use naive::{NaiveStore, decode_state, encode_state};
pub use tls::{ClientIdentity, RedisTls};
pub use topology::{Node, Topology};

use super::StoreError;
use crate::algorithm::Algorithm;
use crate::key::BucketKey;
use pipe::{Pipe, PipeSettings};
use redis::aio::ConnectionLike;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, IntoConnectionInfo, Pipeline, RedisError, RedisFuture, Value};
use resp::Command;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OnceCell;

/// How to reach Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisSettings {
    /// `redis://host:port[/db]` for standalone, or the seed nodes of a
    /// cluster; `rediss://` for TLS.
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
    /// How often a cluster's slot map is re-read (see [`topology`]).
    pub topology_refresh: Duration,
    /// What TLS connections trust and show (with `rediss://` URLs).
    pub tls: RedisTls,
}

impl RedisSettings {
    /// `urls` (standalone, or a cluster's seeds) with the config file's
    /// defaults for the rest: prefix `rl:`, 200 ms to connect, 50 ms per
    /// answer, one retry, a TTL margin and topology refresh of 1 s, TLS
    /// trusting the system's roots. Benches and tests change what they
    /// need with `..RedisSettings::new(..)`.
    pub fn new(urls: Vec<String>, cluster: bool) -> Self {
        Self {
            urls,
            cluster,
            prefix: "rl:".to_owned(),
            connect_timeout: Duration::from_millis(200),
            response_timeout: Duration::from_millis(50),
            retries: 1,
            ttl_margin: Duration::from_secs(1),
            topology_refresh: Duration::from_secs(1),
            tls: RedisTls::default(),
        }
    }
}

/// A standalone or cluster connection; both pipeline concurrent callers.
/// [`RedisConnection::call`] sends a command; the redis crate's
/// `ConnectionLike` (`query_async`, pipelines, `Script::load_async`) works
/// on it too.
/// It knows which node serves a key ([`Topology`]).
#[derive(Clone)]
pub struct RedisConnection {
    link: Link,
    topology: Arc<Topology>,
}

#[derive(Clone)]
enum Link {
    /// One server, reconnecting on failure: our own pipelined connection.
    Standalone(Pipe),
    /// A Redis Cluster: our own connection per node for checks
    /// ([`cluster`]), and the redis crate's cluster connection, made on
    /// first use, for the rest.
    Cluster(LazyCluster, Arc<cluster::Nodes>),
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
        f.write_str(match self.link {
            Link::Standalone(_) => "RedisConnection::Standalone",
            Link::Cluster(..) => "RedisConnection::Cluster",
        })
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match &mut self.link {
            Link::Standalone(c) => c.req_packed_command(cmd),
            Link::Cluster(c, _) => Box::pin(async move {
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
        match &mut self.link {
            Link::Standalone(c) => c.req_packed_commands(pipeline, offset, count),
            Link::Cluster(c, _) => Box::pin(async move {
                let mut connection = c.get().await?;
                connection
                    .req_packed_commands(pipeline, offset, count)
                    .await
            }),
        }
    }

    fn get_db(&self) -> i64 {
        match &self.link {
            Link::Standalone(c) => c.get_db(),
            // Cluster has database 0 only.
            Link::Cluster(..) => 0,
        }
    }
}

/// TCP settings for every connection to Redis: Nagle's algorithm off. A
/// check is one small command; with Nagle on (the redis crate's default),
/// a second check written while the first is unacknowledged waits for that
/// ACK, which the server's side delays until it has something to send:
/// concurrent checks then take up to two round trips instead of one.
/// Measured with `loadtest capacity` (docs/capacity.md).
pub fn tcp_settings() -> redis::io::tcp::TcpSettings {
    redis::io::tcp::TcpSettings::default().set_nodelay(true)
}

/// A standalone server's connection info: `url` parsed (address,
/// credentials, database), with [`tcp_settings`] as the redis crate would
/// use them; our own connection ([`pipe`]) turns Nagle off itself.
pub fn connection_info(url: &str) -> redis::RedisResult<redis::ConnectionInfo> {
    Ok(url.into_connection_info()?.set_tcp_settings(tcp_settings()))
}

/// Whether `url` connects over TLS, once it is known to be a URL the
/// service can use: `redis://` or `rediss://`, parseable, with certificate
/// checks on. The error says what is wrong without repeating the URL,
/// which may carry a password.
pub fn check_url(url: &str) -> Result<bool, String> {
    if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
        return Err("is not a redis:// or rediss:// (TLS) URL".into());
    }
    let info = url
        .into_connection_info()
        .map_err(|e| format!("is not a valid Redis URL: {e}"))?;
    match info.addr() {
        redis::ConnectionAddr::TcpTls { insecure: true, .. } => Err(
            "#insecure would turn certificate checks off; trust a private CA with redis.tls_ca_file instead"
                .into(),
        ),
        redis::ConnectionAddr::TcpTls { .. } => Ok(true),
        _ => Ok(false),
    }
}

/// Our connection's settings for the server `info` names.
fn pipe_settings(info: redis::ConnectionInfo, settings: &RedisSettings) -> PipeSettings {
    PipeSettings {
        info,
        tls: settings.tls.clone(),
        connect_timeout: settings.connect_timeout,
        response_timeout: settings.response_timeout,
        retries: settings.retries,
    }
}

impl RedisConnection {
    /// Connects as `settings` say, lazily: the first command connects (and
    /// a failed attempt is retried by a later command), so the service
    /// starts while Redis is away. Only invalid settings fail here.
    pub async fn connect(settings: &RedisSettings) -> Result<Self, RedisError> {
        tls::install_crypto_provider();
        if settings.cluster {
            let mut builder = redis::cluster::ClusterClientBuilder::new(settings.urls.clone())
                .connection_timeout(settings.connect_timeout)
                .response_timeout(settings.response_timeout)
                .retries(settings.retries)
                .min_retry_wait(1)
                .max_retry_wait(50)
                .tcp_settings(tcp_settings());
            if let Some(certificates) = settings.tls.certificates() {
                builder = builder.certs(certificates);
            }
            let client = builder.build()?;
            let seeds = settings
                .urls
                .iter()
                .map(|url| {
                    let info = connection_info(url)?;
                    let label = match info.addr() {
                        redis::ConnectionAddr::Tcp(host, port)
                        | redis::ConnectionAddr::TcpTls { host, port, .. } => {
                            format!("{host}:{port}")
                        }
                        _ => url.clone(),
                    };
                    Ok((Arc::from(label), pipe_settings(info, settings)))
                })
                .collect::<Result<Vec<_>, RedisError>>()?;
            let nodes = Arc::new(cluster::Nodes::new(seeds).ok_or_else(|| {
                RedisError::from((redis::ErrorKind::Client, "no cluster seed URL"))
            })?);
            let link = Link::Cluster(
                LazyCluster {
                    shared: Arc::new((client, OnceCell::new())),
                },
                Arc::clone(&nodes),
            );
            let topology = Topology::cluster(nodes, settings.topology_refresh);
            Ok(Self { link, topology })
        } else {
            let url = settings
                .urls
                .first()
                .map(String::as_str)
                .unwrap_or("redis://127.0.0.1:6379");
            let pipe = Pipe::new(pipe_settings(connection_info(url)?, settings));
            Ok(Self {
                link: Link::Standalone(pipe),
                topology: Arc::new(Topology::standalone(url)),
            })
        }
    }

    /// Where keys live.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }
}

/// A reply to [`RedisConnection::call`].
#[derive(Debug)]
pub enum Reply {
    /// As read from our standalone connection, not yet decoded: a script's
    /// bulk string is read in place ([`resp::bulk_string`]).
    Frame(bytes::Bytes),
    /// As the redis crate's cluster connection decoded it.
    Value(Value),
}

impl Reply {
    /// The reply as the redis crate's value.
    pub fn into_value(self) -> Result<Value, RedisError> {
        match self {
            Reply::Frame(frame) => resp::decode(&frame),
            Reply::Value(value) => Ok(value),
        }
    }
}

impl RedisConnection {
    /// Sends `command` and returns its reply; an error reply is an error.
    pub async fn call(&self, command: &impl Command) -> Result<Reply, RedisError> {
        match &self.link {
            Link::Standalone(pipe) => {
                let frame = pipe.call(command).await?;
                if frame.first() == Some(&b'-') {
                    // An error reply: the redis crate's error for it.
                    return resp::decode(&frame).map(Reply::Value);
                }
                Ok(Reply::Frame(frame))
            }
            Link::Cluster(_, nodes) => nodes
                .call(&self.topology, command.slot(), command, None)
                .await
                .map(Reply::Frame),
        }
    }

    /// [`RedisConnection::call`] of an EVALSHA of `script`: on NOSCRIPT the
    /// script is loaded (on the node that said so, in a cluster) and the
    /// command sent again.
    pub async fn call_script(
        &self,
        command: &impl Command,
        script: &redis::Script,
    ) -> Result<Reply, RedisError> {
        match &self.link {
            Link::Standalone(_) => match self.call(command).await {
                Err(e)
                    if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                {
                    script.load_async(&mut self.clone()).await?;
                    self.call(command).await
                }
                reply => reply,
            },
            Link::Cluster(_, nodes) => nodes
                .call(&self.topology, command.slot(), command, Some(script))
                .await
                .map(Reply::Frame),
        }
    }

    /// PING: can this connection answer right now?
    pub async fn ping(&self) -> Result<(), StoreError> {
        match &self.link {
            Link::Standalone(_) => {
                let mut connection = self.clone();
                let _: String = redis::cmd("PING").query_async(&mut connection).await?;
                Ok(())
            }
            // Some master answers: a dead one's keys are its breaker's
            // business (`/readyz` names it), not a reason to call the
            // whole instance unready.
            Link::Cluster(_, nodes) => {
                let mut last = None;
                for node in self.topology.nodes_or(nodes.seeds()) {
                    let answer = match nodes.pipe(&node) {
                        Ok(pipe) => pipe.call(&redis::cmd("PING")).await,
                        Err(e) => Err(e),
                    };
                    match answer.and_then(|frame| resp::decode(&frame)) {
                        Ok(_) => return Ok(()),
                        Err(e) => last = Some(e),
                    }
                }
                Err(last
                    .unwrap_or_else(|| RedisError::from((redis::ErrorKind::Client, "no node")))
                    .into())
            }
        }
    }
}

/// The Redis key of `key` under `algorithm`: `<prefix><tag>{<32 hex digits>}`.
pub fn redis_key(prefix: &str, algorithm: Algorithm, key: BucketKey) -> String {
    let mut name = String::with_capacity(prefix.len() + algorithm.key_tag().len() + 34);
    name.push_str(prefix);
    name.push_str(algorithm.key_tag());
    name.extend(hash_tag(key).map(char::from));
    name
}

/// Writes [`redis_key`] into `out` (a command's next argument), with no
/// `String` in between.
pub fn write_redis_key(
    out: &mut impl std::io::Write,
    prefix: &str,
    algorithm: Algorithm,
    key: BucketKey,
) -> std::io::Result<()> {
    out.write_all(prefix.as_bytes())?;
    out.write_all(algorithm.key_tag().as_bytes())?;
    out.write_all(&hash_tag(key))
}

/// `{<32 hex digits>}`: the hash tag that keeps every key of a bucket in
/// the bucket's slot.
pub(super) fn hash_tag(key: BucketKey) -> [u8; 34] {
    let mut tag = [b'{'; 34];
    tag[1..33].copy_from_slice(&key.hex());
    tag[33] = b'}';
    tag
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_carry_a_hash_tag_and_the_prefix() {
        let key = redis_key("rl:", Algorithm::TokenBucket, BucketKey(0xabc));
        assert_eq!(key, "rl:{00000000000000000000000000000abc}");
        let key = redis_key("rl:", Algorithm::SlidingLog, BucketKey(0xabc));
        assert_eq!(key, "rl:log:{00000000000000000000000000000abc}");
    }

    #[test]
    fn keys_written_into_a_command_are_the_keys() {
        for (prefix, key) in [("rl:", BucketKey(0xabc)), ("", BucketKey(u128::MAX / 7))] {
            for algorithm in Algorithm::ALL {
                let mut written = Vec::new();
                write_redis_key(&mut written, prefix, algorithm, key).unwrap();
                let name = redis_key(prefix, algorithm, key);
                assert_eq!(written, name.as_bytes());
                assert_eq!(name, format!("{prefix}{}{{{key}}}", algorithm.key_tag()));
            }
        }
    }

    #[test]
    fn every_key_of_a_bucket_is_in_the_buckets_slot() {
        for bucket in [BucketKey(0xabc), BucketKey(u128::MAX / 3)] {
            for algorithm in Algorithm::ALL {
                // (Prefixes are validated free of braces, which would move
                // the hash tag.)
                let name = redis_key("rl:", algorithm, bucket);
                assert_eq!(topology::slot(name.as_bytes()), bucket.slot(), "{name}");
            }
        }
    }

    #[tokio::test]
    async fn connections_turn_nagle_off() {
        // Our own connection's socket.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let tcp = pipe::connect_tcp("127.0.0.1", port).await.unwrap();
        assert!(tcp.nodelay().unwrap());
        // The redis crate's (a cluster's).
        assert!(tcp_settings().nodelay());
        let info = connection_info("redis://127.0.0.1:6380/0").unwrap();
        assert!(info.tcp_settings().nodelay());
        assert_eq!(info.addr().to_string(), "127.0.0.1:6380");
        assert!(connection_info("not a url").is_err());
    }
}
