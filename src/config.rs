//! The one typed configuration: a TOML file, command-line flags and
//! environment variables, validated at start-up with the bad field named.
//!
//! Precedence: flag > environment variable > file > default. Every field
//! below lists its flag, env name and default. Policies and API keys are
//! structured and live in the file only.
//!
//! | field | flag / env | default |
//! |---|---|---|
//! | `listen` | `--listen` / `RL_LISTEN` | `127.0.0.1:8080` |
//! | `backend` | `--backend` / `RL_BACKEND` | `memory` |
//! | `instance_id` | `--instance-id` / `RL_INSTANCE_ID` | `<hostname>-<pid>` |
//! | `trusted_proxies` | `--trusted-proxy` (repeatable) / `RL_TRUSTED_PROXIES` (comma separated) | none |
//! | `key_secret` | `--key-secret` / `RL_KEY_SECRET` | random per process |
//! | `ipv6_prefix` | `--ipv6-prefix` / `RL_IPV6_PREFIX` | `64` |
//! | `memory.max_keys` | `--memory-max-keys` / `RL_MEMORY_MAX_KEYS` | `1000000` |
//! | `memory.shards` | `--memory-shards` / `RL_MEMORY_SHARDS` | `64` |
//! | `redis.url` | `--redis-url` / `RL_REDIS_URL` | `redis://127.0.0.1:6379` |
//! | `redis.cluster` | `--redis-cluster` (repeatable seed URL) / `RL_REDIS_CLUSTER` (comma separated) | none: standalone |
//! | `redis.prefix` | `--redis-prefix` / `RL_REDIS_PREFIX` | `rl:` |
//! | `redis.connect_timeout` | `--redis-connect-timeout` / `RL_REDIS_CONNECT_TIMEOUT` | `200ms` |
//! | `redis.response_timeout` | `--redis-response-timeout` / `RL_REDIS_RESPONSE_TIMEOUT` | `50ms` |
//! | `redis.retries` | `--redis-retries` / `RL_REDIS_RETRIES` | `1` |
//! | `redis.ttl_margin` | `--redis-ttl-margin` / `RL_REDIS_TTL_MARGIN` | `1s` |
//! | `failure.mode` | `--failure-mode` / `RL_FAILURE_MODE` | `local` (`open`, `closed`, `local`; per policy: `failure_mode`) |
//! | `failure.deadline` | `--failure-deadline` / `RL_FAILURE_DEADLINE` | `10ms` |
//! | `failure.instances` | `--failure-instances` / `RL_FAILURE_INSTANCES` | `1` |
//! | `failure.breaker_failures` | `--breaker-failures` / `RL_BREAKER_FAILURES` | `5` |
//! | `failure.breaker_cooldown` | `--breaker-cooldown` / `RL_BREAKER_COOLDOWN` | `500ms` |
//! | `[[api_keys]]` | file only | none |
//! | `[[policies]]` | file only | one policy `api`: route `/api/`, burst 100, 10/s |
//!
//! A policy's `algorithm` (default `token_bucket`; `gcra`, `fixed_window`,
//! `sliding_window`; `sliding_log` needs backend `lua`) reads the same
//! `burst`/`rate`/`per`: see [`crate::algorithm`].

use crate::algorithm::{Algorithm, Window};
use crate::bucket::{Limit, LimitError};
use crate::failover::{FailoverSettings, FailureMode};
use crate::identity::ApiKeys;
use crate::store::redis::RedisSettings;
use clap::{Parser, ValueEnum};
use ipnet::IpNet;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where bucket state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// In this process: exact, fast, but each instance has its own buckets.
    Memory,
    /// Redis, GET/compute/SET: racy on purpose, the baseline to beat.
    Naive,
    /// Redis, one atomic Lua script per check.
    Lua,
}

impl Backend {
    /// The name used on the command line and in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Naive => "naive",
            Backend::Lua => "lua",
        }
    }
}

/// Command-line flags; each can also come from the environment.
#[derive(Debug, Clone, Default, Parser)]
#[command(
    name = "ratelimiter",
    version,
    about = "A sample API behind an exact, observable rate limiter"
)]
pub struct Cli {
    /// Address to listen on [default: 127.0.0.1:8080]
    #[arg(long, env = "RL_LISTEN")]
    pub listen: Option<String>,
    /// Where bucket state lives [default: memory]
    #[arg(long, env = "RL_BACKEND", value_enum)]
    pub backend: Option<Backend>,
    /// TOML configuration file
    #[arg(long, env = "RL_CONFIG")]
    pub config: Option<PathBuf>,
    /// This instance's name in metrics and logs [default: <hostname>-<pid>]
    #[arg(long, env = "RL_INSTANCE_ID")]
    pub instance_id: Option<String>,
    /// A proxy whose X-Forwarded-For is believed (CIDR or address; repeatable)
    #[arg(
        long = "trusted-proxy",
        env = "RL_TRUSTED_PROXIES",
        value_delimiter = ','
    )]
    pub trusted_proxies: Vec<String>,
    /// Secret for hashing client identities; instances sharing a store must share it [default: random]
    #[arg(long, env = "RL_KEY_SECRET", hide_env_values = true)]
    pub key_secret: Option<String>,
    /// IPv6 clients are keyed by this prefix length [default: 64]
    #[arg(long, env = "RL_IPV6_PREFIX")]
    pub ipv6_prefix: Option<u8>,
    /// Most buckets the memory backend holds [default: 1000000]
    #[arg(long, env = "RL_MEMORY_MAX_KEYS")]
    pub memory_max_keys: Option<usize>,
    /// Lock shards of the memory backend [default: 64]
    #[arg(long, env = "RL_MEMORY_SHARDS")]
    pub memory_shards: Option<usize>,
    /// Redis URL for the naive and lua backends [default: redis://127.0.0.1:6379]
    #[arg(long, env = "RL_REDIS_URL")]
    pub redis_url: Option<String>,
    /// A Redis Cluster seed node URL (repeatable); switches to cluster mode
    #[arg(
        long = "redis-cluster",
        env = "RL_REDIS_CLUSTER",
        value_delimiter = ','
    )]
    pub redis_cluster: Vec<String>,
    /// Prefix of every Redis key [default: rl:]
    #[arg(long, env = "RL_REDIS_PREFIX")]
    pub redis_prefix: Option<String>,
    /// Time allowed to open a Redis connection [default: 200ms]
    #[arg(long, env = "RL_REDIS_CONNECT_TIMEOUT")]
    pub redis_connect_timeout: Option<String>,
    /// Time allowed for one Redis answer [default: 50ms]
    #[arg(long, env = "RL_REDIS_RESPONSE_TIMEOUT")]
    pub redis_response_timeout: Option<String>,
    /// Reconnection attempts / cluster retries per failure [default: 1]
    #[arg(long, env = "RL_REDIS_RETRIES")]
    pub redis_retries: Option<u32>,
    /// Added to a bucket's time-to-full for its key's TTL [default: 1s]
    #[arg(long, env = "RL_REDIS_TTL_MARGIN")]
    pub redis_ttl_margin: Option<String>,
    /// What policies do while Redis cannot decide [default: local]
    #[arg(long, env = "RL_FAILURE_MODE", value_enum)]
    pub failure_mode: Option<FailureMode>,
    /// The longest a request waits on Redis [default: 10ms]
    #[arg(long, env = "RL_FAILURE_DEADLINE")]
    pub failure_deadline: Option<String>,
    /// Instances sharing the limit; the local fallback enforces 1/N of it [default: 1]
    #[arg(long, env = "RL_FAILURE_INSTANCES")]
    pub failure_instances: Option<u64>,
    /// Consecutive Redis failures that open the circuit breaker [default: 5]
    #[arg(long, env = "RL_BREAKER_FAILURES")]
    pub breaker_failures: Option<u32>,
    /// How long the open breaker waits before probing Redis [default: 500ms]
    #[arg(long, env = "RL_BREAKER_COOLDOWN")]
    pub breaker_cooldown: Option<String>,
}

/// The file, as written. Unknown fields are errors (a typo must not be
/// silently ignored and leave a default limit in force).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    backend: Option<Backend>,
    instance_id: Option<String>,
    trusted_proxies: Option<Vec<String>>,
    key_secret: Option<String>,
    ipv6_prefix: Option<u8>,
    #[serde(default)]
    memory: MemoryFile,
    #[serde(default)]
    redis: RedisFile,
    #[serde(default)]
    failure: FailureFile,
    #[serde(default)]
    api_keys: Vec<ApiKeyFile>,
    policies: Option<Vec<PolicyFile>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct MemoryFile {
    max_keys: Option<usize>,
    shards: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RedisFile {
    url: Option<String>,
    cluster: Option<Vec<String>>,
    prefix: Option<String>,
    connect_timeout: Option<String>,
    response_timeout: Option<String>,
    retries: Option<u32>,
    ttl_margin: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FailureFile {
    mode: Option<FailureMode>,
    deadline: Option<String>,
    instances: Option<u64>,
    breaker_failures: Option<u32>,
    breaker_cooldown: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ApiKeyFile {
    id: String,
    key: Option<String>,
    key_sha256: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitFile {
    burst: u64,
    rate: u64,
    per: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    name: String,
    route: String,
    methods: Option<Vec<String>>,
    #[serde(default)]
    unlimited: bool,
    burst: Option<u64>,
    rate: Option<u64>,
    per: Option<String>,
    cost: Option<u64>,
    anonymous: Option<LimitFile>,
    failure_mode: Option<FailureMode>,
    algorithm: Option<Algorithm>,
}

/// Memory backend settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryConfig {
    /// Most buckets held at once.
    pub max_keys: usize,
    /// Lock shards (a power of two).
    pub shards: usize,
}

/// A validated route policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyConfig {
    /// Name, `[A-Za-z0-9_.-]{1,64}`: shown in headers and metric labels.
    pub name: String,
    /// Prefix of the route template (e.g. `/api/` or `/api/orders`); the
    /// longest matching prefix wins.
    pub route: String,
    /// Methods this policy applies to; empty means all.
    pub methods: Vec<http::Method>,
    /// `None`: the route is not limited.
    pub limit: Option<Limit>,
    /// The limit for clients without a verified API key (defaults to `limit`).
    pub anonymous: Option<Limit>,
    /// Tokens one request costs.
    pub cost: u64,
    /// What this policy does while Redis cannot decide (`None`: `failure.mode`).
    pub failure_mode: Option<FailureMode>,
}

/// A configured API key: its id and the SHA-256 of the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKeyConfig {
    /// The id buckets are keyed by (never the key itself).
    pub id: String,
    /// SHA-256 of the key.
    pub sha256: [u8; 32],
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Where bucket state lives.
    pub backend: Backend,
    /// This instance's name.
    pub instance_id: String,
    /// Proxies whose `X-Forwarded-For` is believed.
    pub trusted_proxies: Vec<IpNet>,
    /// The SipHash key for client identities; `None` means random at start.
    pub key_secret: Option<[u8; 16]>,
    /// Prefix length IPv6 clients are keyed by.
    pub ipv6_prefix: u8,
    /// Memory backend settings.
    pub memory: MemoryConfig,
    /// Redis settings (used by the naive and lua backends).
    pub redis: RedisSettings,
    /// Deadline, breaker and failure mode around Redis.
    pub failover: FailoverSettings,
    /// Verified API keys.
    pub api_keys: Vec<ApiKeyConfig>,
    /// Route policies.
    pub policies: Vec<PolicyConfig>,
}

/// A configuration that cannot be used, naming the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML or has unknown or mistyped fields.
    #[error("config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message (names the key and line).
        message: String,
    },
    /// A field has a value that cannot work.
    #[error("invalid config: {field}: {message}")]
    Invalid {
        /// The field, e.g. `policies[1].burst`.
        field: String,
        /// What is wrong.
        message: String,
    },
}

fn invalid(field: impl Into<String>, message: impl std::fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.to_string(),
    }
}

/// The largest burst a `sliding_log` policy may have: its log holds one
/// sorted-set member per token admitted in the window, per client.
pub const SLIDING_LOG_MAX: u64 = 100_000;

/// The built-in policy used when the file defines none.
pub fn default_policies() -> Vec<PolicyConfig> {
    let limit = Limit::per_second(100, 10).expect("constant limit is valid");
    vec![PolicyConfig {
        name: "api".into(),
        route: "/api/".into(),
        methods: Vec::new(),
        limit: Some(limit),
        anonymous: Some(limit),
        cost: 1,
        failure_mode: None,
    }]
}

/// Parses `500ms`, `1s`, `2m`, `1h`, `1d` (a whole number and a unit).
pub fn parse_period(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?} has no unit (use ms, s, m, h or d)"))?;
    let (digits, unit) = text.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?} does not start with a whole number"))?;
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        other => return Err(format!("unknown unit {other:?} (use ms, s, m, h or d)")),
    };
    n.checked_mul(unit_ms)
        .map(Duration::from_millis)
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("{text:?} must be positive and below 2^64 ms"))
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

fn build_limit(
    field: &str,
    burst: u64,
    rate: u64,
    per: Option<&str>,
) -> Result<Limit, ConfigError> {
    let period = match per {
        Some(p) => parse_period(p).map_err(|m| invalid(format!("{field}.per"), m))?,
        None => Duration::from_secs(1),
    };
    Limit::new(burst, rate, period).map_err(|e| {
        let which = match e {
            LimitError::ZeroBurst => "burst",
            LimitError::ZeroRate => "rate",
            LimitError::ZeroPeriod => "per",
            LimitError::TooLarge => "burst",
        };
        invalid(format!("{field}.{which}"), e)
    })
}

fn parse_proxy(field: &str, text: &str) -> Result<IpNet, ConfigError> {
    let text = text.trim();
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<std::net::IpAddr>().map(IpNet::from))
        .map_err(|_| {
            invalid(
                field,
                format!("{text:?} is not a CIDR block or an IP address"),
            )
        })
}

fn default_instance_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| valid_name(h))
        .unwrap_or_else(|| "instance".into());
    let id = format!("{host}-{}", std::process::id());
    if valid_name(&id) {
        id
    } else {
        format!("instance-{}", std::process::id())
    }
}

fn parse_hex32(text: &str) -> Option<[u8; 32]> {
    let text = text.trim();
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl Config {
    /// Reads the file named by `cli.config` (if any) and merges the flags.
    pub fn load(cli: Cli) -> Result<Self, ConfigError> {
        let file = match &cli.config {
            Some(path) => Self::read_file(path)?,
            None => FileConfig::default(),
        };
        Self::merge(cli, file)
    }

    /// Parses and validates a config from TOML text, with no flags.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let file = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: PathBuf::from("<inline>"),
            message: e.to_string(),
        })?;
        Self::merge(Cli::default(), file)
    }

    fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })
    }

    fn merge(cli: Cli, file: FileConfig) -> Result<Self, ConfigError> {
        let listen_text = cli
            .listen
            .or(file.listen)
            .unwrap_or_else(|| "127.0.0.1:8080".into());
        let listen = listen_text
            .parse()
            .map_err(|_| invalid("listen", format!("{listen_text:?} is not an address:port")))?;

        let instance_id = cli
            .instance_id
            .or(file.instance_id)
            .unwrap_or_else(default_instance_id);
        if !valid_name(&instance_id) {
            return Err(invalid(
                "instance_id",
                "must be 1-64 characters of [A-Za-z0-9_.-]",
            ));
        }

        let proxies = if cli.trusted_proxies.is_empty() {
            file.trusted_proxies.unwrap_or_default()
        } else {
            cli.trusted_proxies
        };
        let trusted_proxies = proxies
            .iter()
            .enumerate()
            .map(|(i, p)| parse_proxy(&format!("trusted_proxies[{i}]"), p))
            .collect::<Result<Vec<_>, _>>()?;

        let key_secret = match cli.key_secret.or(file.key_secret) {
            None => None,
            Some(s) if s.len() < 16 => {
                return Err(invalid("key_secret", "must be at least 16 characters"));
            }
            Some(s) => {
                let digest = ApiKeys::digest(&s);
                let mut secret = [0u8; 16];
                secret.copy_from_slice(&digest[..16]);
                Some(secret)
            }
        };

        let ipv6_prefix = cli.ipv6_prefix.or(file.ipv6_prefix).unwrap_or(64);
        if ipv6_prefix > 128 {
            return Err(invalid("ipv6_prefix", "must be between 0 and 128"));
        }

        let max_keys = cli
            .memory_max_keys
            .or(file.memory.max_keys)
            .unwrap_or(1_000_000);
        if max_keys == 0 {
            return Err(invalid("memory.max_keys", "must be at least 1"));
        }
        let shards = cli.memory_shards.or(file.memory.shards).unwrap_or(64);
        if shards == 0 || !shards.is_power_of_two() || shards > 4096 {
            return Err(invalid(
                "memory.shards",
                "must be a power of two from 1 to 4096",
            ));
        }

        let backend = cli.backend.or(file.backend).unwrap_or(Backend::Memory);
        if backend != Backend::Memory && key_secret.is_none() {
            return Err(invalid(
                "key_secret",
                format!(
                    "is required with backend {}: instances sharing Redis must hash client identities alike",
                    backend.as_str()
                ),
            ));
        }
        let redis = Self::redis(RedisFile {
            url: cli.redis_url.or(file.redis.url),
            cluster: if cli.redis_cluster.is_empty() {
                file.redis.cluster
            } else {
                Some(cli.redis_cluster)
            },
            prefix: cli.redis_prefix.or(file.redis.prefix),
            connect_timeout: cli.redis_connect_timeout.or(file.redis.connect_timeout),
            response_timeout: cli.redis_response_timeout.or(file.redis.response_timeout),
            retries: cli.redis_retries.or(file.redis.retries),
            ttl_margin: cli.redis_ttl_margin.or(file.redis.ttl_margin),
        })?;

        let failover = Self::failover(FailureFile {
            mode: cli.failure_mode.or(file.failure.mode),
            deadline: cli.failure_deadline.or(file.failure.deadline),
            instances: cli.failure_instances.or(file.failure.instances),
            breaker_failures: cli.breaker_failures.or(file.failure.breaker_failures),
            breaker_cooldown: cli.breaker_cooldown.or(file.failure.breaker_cooldown),
        })?;

        let api_keys = Self::api_keys(file.api_keys)?;
        let policies = match file.policies {
            None => default_policies(),
            Some(list) => Self::policies(list, backend)?,
        };
        // Every policy's local share must be a limit the service can keep.
        for (i, p) in policies.iter().enumerate() {
            for limit in [p.limit, p.anonymous].into_iter().flatten() {
                if crate::failover::try_share(&limit, failover.instances, p.cost).is_err() {
                    return Err(invalid(
                        "failure.instances",
                        format!(
                            "policies[{i}]'s local share (burst / {n} at rate / {n}) is too large to keep exactly; use a shorter period",
                            n = failover.instances
                        ),
                    ));
                }
            }
        }

        Ok(Self {
            listen,
            backend,
            instance_id,
            trusted_proxies,
            key_secret,
            ipv6_prefix,
            memory: MemoryConfig { max_keys, shards },
            redis,
            failover,
            api_keys,
            policies,
        })
    }

    fn failover(f: FailureFile) -> Result<FailoverSettings, ConfigError> {
        let defaults = FailoverSettings::default();
        let duration = |field: &str, value: Option<String>, default: Duration| match value {
            None => Ok(default),
            Some(text) => parse_period(&text).map_err(|m| invalid(format!("failure.{field}"), m)),
        };
        let deadline = duration("deadline", f.deadline, defaults.deadline)?;
        if deadline > Duration::from_secs(10) {
            return Err(invalid(
                "failure.deadline",
                "must be at most 10s: it is how long a request may wait on Redis",
            ));
        }
        let instances = f.instances.unwrap_or(defaults.instances);
        if !(1..=10_000).contains(&instances) {
            return Err(invalid("failure.instances", "must be from 1 to 10000"));
        }
        let breaker_failures = f.breaker_failures.unwrap_or(defaults.breaker_failures);
        if breaker_failures == 0 {
            return Err(invalid("failure.breaker_failures", "must be at least 1"));
        }
        Ok(FailoverSettings {
            mode: f.mode.unwrap_or(defaults.mode),
            deadline,
            instances,
            breaker_failures,
            breaker_cooldown: duration(
                "breaker_cooldown",
                f.breaker_cooldown,
                defaults.breaker_cooldown,
            )?,
        })
    }

    fn redis(r: RedisFile) -> Result<RedisSettings, ConfigError> {
        let duration = |field: &str, value: Option<String>, default: &str| {
            parse_period(value.as_deref().unwrap_or(default))
                .map_err(|m| invalid(format!("redis.{field}"), m))
        };
        let check_url = |field: String, url: &str| {
            if url.starts_with("redis://") || url.starts_with("rediss://") {
                Ok(())
            } else {
                Err(invalid(field, format!("{url:?} is not a redis:// URL")))
            }
        };
        let (urls, cluster) = match r.cluster {
            Some(seeds) if !seeds.is_empty() => {
                for (i, url) in seeds.iter().enumerate() {
                    check_url(format!("redis.cluster[{i}]"), url)?;
                }
                (seeds, true)
            }
            _ => {
                let url = r.url.unwrap_or_else(|| "redis://127.0.0.1:6379".into());
                check_url("redis.url".into(), &url)?;
                (vec![url], false)
            }
        };
        let prefix = r.prefix.unwrap_or_else(|| "rl:".into());
        if prefix.len() > 64
            || prefix.contains(['{', '}'])
            || prefix.chars().any(char::is_whitespace)
        {
            return Err(invalid(
                "redis.prefix",
                "must be at most 64 characters without braces (they would move the hash tag) or spaces",
            ));
        }
        let response_timeout = duration("response_timeout", r.response_timeout, "50ms")?;
        let connect_timeout = duration("connect_timeout", r.connect_timeout, "200ms")?;
        let retries = r.retries.unwrap_or(1);
        if retries > 10 {
            return Err(invalid(
                "redis.retries",
                "must be at most 10 on a request path",
            ));
        }
        Ok(RedisSettings {
            urls,
            cluster,
            prefix,
            connect_timeout,
            response_timeout,
            retries,
            ttl_margin: duration("ttl_margin", r.ttl_margin, "1s")?,
        })
    }

    fn api_keys(list: Vec<ApiKeyFile>) -> Result<Vec<ApiKeyConfig>, ConfigError> {
        let mut out: Vec<ApiKeyConfig> = Vec::with_capacity(list.len());
        for (i, k) in list.into_iter().enumerate() {
            let field = format!("api_keys[{i}]");
            if !valid_name(&k.id) {
                return Err(invalid(
                    format!("{field}.id"),
                    "must be 1-64 characters of [A-Za-z0-9_.-]",
                ));
            }
            let sha256 = match (k.key, k.key_sha256) {
                (Some(key), None) => {
                    crate::identity::valid_key(key.as_bytes())
                        .map_err(|e| invalid(format!("{field}.key"), e))?;
                    ApiKeys::digest(&key)
                }
                (None, Some(hex)) => parse_hex32(&hex).ok_or_else(|| {
                    invalid(format!("{field}.key_sha256"), "must be 64 hex digits")
                })?,
                _ => {
                    return Err(invalid(&field, "set exactly one of key or key_sha256"));
                }
            };
            if out.iter().any(|o| o.id == k.id) {
                return Err(invalid(
                    format!("{field}.id"),
                    format!("duplicate id {:?}", k.id),
                ));
            }
            if out.iter().any(|o| o.sha256 == sha256) {
                return Err(invalid(&field, "the same key is configured twice"));
            }
            out.push(ApiKeyConfig { id: k.id, sha256 });
        }
        Ok(out)
    }

    /// What an algorithm needs: a backend that has it (the log needs Redis;
    /// the racy baseline keeps token buckets only), and limits its script
    /// computes exactly.
    fn check_algorithm(
        field: &str,
        algorithm: Algorithm,
        backend: Backend,
        limits: &[Limit],
    ) -> Result<(), ConfigError> {
        if algorithm == Algorithm::TokenBucket {
            return Ok(());
        }
        let supported = match backend {
            Backend::Lua => true,
            // The log's state grows with traffic: Redis only.
            Backend::Memory => algorithm != Algorithm::SlidingLog,
            // The racy baseline exists to measure the race, on buckets.
            Backend::Naive => false,
        };
        if !supported {
            return Err(invalid(
                format!("{field}.algorithm"),
                format!(
                    "{} is not available with backend {} (sliding_log needs lua; naive keeps token buckets only)",
                    algorithm.as_str(),
                    backend.as_str()
                ),
            ));
        }
        for limit in limits {
            let window = Window::of(limit);
            match algorithm {
                Algorithm::SlidingWindow
                    if u128::from(window.limit) * u128::from(window.window_us)
                        > u128::from(crate::bucket::MAX_EXACT) * 2 =>
                {
                    return Err(invalid(
                        format!("{field}.burst"),
                        "burst x window (in microseconds) must not exceed 2^53 for sliding_window",
                    ));
                }
                Algorithm::SlidingWindow
                    if backend == Backend::Memory && window.limit > u64::from(u32::MAX) =>
                {
                    return Err(invalid(
                        format!("{field}.burst"),
                        "sliding_window in memory keeps two 32-bit counts: burst must be below 2^32",
                    ));
                }
                Algorithm::SlidingLog if window.limit > SLIDING_LOG_MAX => {
                    return Err(invalid(
                        format!("{field}.burst"),
                        format!(
                            "sliding_log keeps one entry per token in the window: burst must be at most {SLIDING_LOG_MAX}"
                        ),
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn policies(list: Vec<PolicyFile>, backend: Backend) -> Result<Vec<PolicyConfig>, ConfigError> {
        let mut out: Vec<PolicyConfig> = Vec::with_capacity(list.len());
        for (i, p) in list.into_iter().enumerate() {
            let field = format!("policies[{i}]");
            if !valid_name(&p.name) {
                return Err(invalid(
                    format!("{field}.name"),
                    "must be 1-64 characters of [A-Za-z0-9_.-]",
                ));
            }
            if out.iter().any(|o| o.name == p.name) {
                return Err(invalid(
                    format!("{field}.name"),
                    format!("duplicate policy {:?}", p.name),
                ));
            }
            if !p.route.starts_with('/') {
                return Err(invalid(format!("{field}.route"), "must start with '/'"));
            }
            let methods = p
                .methods
                .unwrap_or_default()
                .iter()
                .enumerate()
                .map(|(j, m)| {
                    http::Method::from_bytes(m.to_ascii_uppercase().as_bytes()).map_err(|_| {
                        invalid(
                            format!("{field}.methods[{j}]"),
                            format!("{m:?} is not an HTTP method"),
                        )
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let cost = p.cost.unwrap_or(1);
            let (limit, anonymous) = if p.unlimited {
                if p.burst.is_some()
                    || p.rate.is_some()
                    || p.anonymous.is_some()
                    || p.cost.is_some()
                    || p.failure_mode.is_some()
                    || p.algorithm.is_some()
                {
                    return Err(invalid(
                        &field,
                        "an unlimited policy takes no burst, rate, cost, anonymous limit, failure_mode or algorithm",
                    ));
                }
                (None, None)
            } else {
                let burst = p.burst.ok_or_else(|| {
                    invalid(
                        format!("{field}.burst"),
                        "is required (or set unlimited = true)",
                    )
                })?;
                let rate = p.rate.ok_or_else(|| {
                    invalid(
                        format!("{field}.rate"),
                        "is required (or set unlimited = true)",
                    )
                })?;
                let limit = build_limit(&field, burst, rate, p.per.as_deref())?;
                let anonymous = match &p.anonymous {
                    Some(a) => build_limit(
                        &format!("{field}.anonymous"),
                        a.burst,
                        a.rate,
                        a.per.as_deref(),
                    )?,
                    None => limit,
                };
                let algorithm = p.algorithm.unwrap_or_default();
                Self::check_algorithm(&field, algorithm, backend, &[limit, anonymous])?;
                let (limit, anonymous) = (
                    limit.with_algorithm(algorithm),
                    anonymous.with_algorithm(algorithm),
                );
                for (l, f) in [(limit, "burst"), (anonymous, "anonymous.burst")] {
                    if cost > l.burst() {
                        return Err(invalid(
                            format!("{field}.cost"),
                            format!(
                                "{cost} exceeds {f} {}: no request could ever be admitted",
                                l.burst()
                            ),
                        ));
                    }
                }
                (Some(limit), Some(anonymous))
            };
            if out.iter().any(|o| {
                o.route == p.route
                    && (o.methods.is_empty()
                        || methods.is_empty()
                        || o.methods.iter().any(|m| methods.contains(m)))
            }) {
                return Err(invalid(
                    format!("{field}.route"),
                    format!(
                        "route {:?} overlaps an earlier policy for the same methods",
                        p.route
                    ),
                ));
            }
            out.push(PolicyConfig {
                name: p.name,
                route: p.route,
                methods,
                limit,
                anonymous,
                cost,
                failure_mode: p.failure_mode,
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
