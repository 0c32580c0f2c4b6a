//! Command-line flags, each also read from its environment variable.
//!
//! The flags serialize in the file's shape (`--redis-url` is `redis.url`),
//! leaving out what was not given, so they layer over a file key by key.
//! Defaults are not declared here: a flag's absence must not override the
//! file. Each help text quotes the default from [`super::file::Settings`].

use super::file::Settings;
use crate::hotkeys::AddressDisplay;
use crate::store::{Backend, FailureMode};
use crate::telemetry::{OtlpProtocol, SamplerKind};
use clap::{Args, Parser};
use serde::Serialize;
use std::path::PathBuf;

/// `text [default: <the value of `key` in the defaults>]`.
fn help(text: &str, key: &str) -> String {
    format!("{text} [default: {}]", default_of(key))
}

/// A default as the docs write it, looked up by its dotted key.
pub fn default_of(key: &str) -> String {
    let defaults =
        toml::Value::try_from(Settings::default()).unwrap_or(toml::Value::Boolean(false));
    let value = key.split('.').try_fold(&defaults, |v, k| v.get(k));
    match value {
        Some(toml::Value::String(s)) => s.clone(),
        Some(toml::Value::Array(a)) if a.is_empty() => "none".into(),
        Some(other) => other.to_string(),
        None => "none".into(),
    }
}

/// Command-line flags; each can also come from the environment.
#[derive(Debug, Clone, Default, Parser, Serialize)]
#[command(
    name = "ratelimiter",
    version,
    about = "A sample API behind an exact, observable rate limiter"
)]
pub struct Cli {
    /// TOML configuration file
    #[arg(long, env = "RL_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    #[arg(long, env = "RL_LISTEN", help = help("Address to listen on", "listen"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    #[arg(long, env = "RL_BACKEND", value_enum, help = help("Where limit state lives", "backend"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<Backend>,
    #[arg(
        long,
        env = "RL_INSTANCE_ID",
        help = "This instance's name in metrics and logs [default: <hostname>-<pid>]"
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    #[arg(
        long = "trusted-proxy",
        env = "RL_TRUSTED_PROXIES",
        value_delimiter = ',',
        help = help("A proxy whose X-Forwarded-For is believed (CIDR or address; repeatable)", "trusted_proxies")
    )]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub trusted_proxies: Vec<String>,
    /// Secret for hashing client identities; instances sharing a store must share it [default: random]
    #[arg(long, env = "RL_KEY_SECRET", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_secret: Option<String>,
    #[arg(long, env = "RL_TRUSTED_PROXY_WARN_ADDRESSES", help = help("Warn at start-up about a trusted proxy range holding more addresses than this: every client inside it may choose its own address", "trusted_proxy_warn_addresses"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trusted_proxy_warn_addresses: Option<u64>,
    #[arg(long, env = "RL_IPV6_PREFIX", help = help("IPv6 clients are keyed by this prefix length", "ipv6_prefix"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ipv6_prefix: Option<u8>,
    #[arg(long, env = "RL_NEAR_LIMIT_FRACTION", help = help("An admitted request leaving less than this fraction of its limit counts as near the limit", "near_limit_fraction"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub near_limit_fraction: Option<f64>,
    #[command(flatten)]
    pub http: HttpFlags,
    #[command(flatten)]
    pub memory: MemoryFlags,
    #[command(flatten)]
    pub redis: RedisFlags,
    #[command(flatten)]
    pub failure: FailureFlags,
    #[command(flatten)]
    pub tracing: TracingFlags,
    #[command(flatten)]
    pub hot_keys: HotKeyFlags,
    #[command(flatten)]
    pub deny_cache: DenyCacheFlags,
    #[command(flatten)]
    pub rls: RlsFlags,
}

/// `[http]` flags.
#[derive(Debug, Clone, Default, Args, Serialize)]
pub struct HttpFlags {
    #[arg(long = "http-header-timeout", env = "RL_HTTP_HEADER_TIMEOUT", help = help("Longest wait for a request's headers, and for the next request on an idle keep-alive connection", "http.header_timeout"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub header_timeout: Option<String>,
    #[arg(long = "http-request-timeout", env = "RL_HTTP_REQUEST_TIMEOUT", help = help("Longest one request may take after its headers, body included (then 408)", "http.request_timeout"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_timeout: Option<String>,
    #[arg(long = "http-max-connections", env = "RL_HTTP_MAX_CONNECTIONS", help = help("Connections open at once; more are closed as they arrive", "http.max_connections"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
    #[arg(long = "http-max-connections-per-address", env = "RL_HTTP_MAX_CONNECTIONS_PER_ADDRESS", help = help("Connections open at once from one client address (trusted proxies exempt)", "http.max_connections_per_address"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections_per_address: Option<usize>,
    #[arg(long = "http-body-limit", env = "RL_HTTP_BODY_LIMIT", help = help("Largest request body in bytes; a larger Content-Length is refused (413) before it is read", "http.body_limit"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body_limit: Option<usize>,
}

/// `[memory]` flags.
#[derive(Debug, Clone, Default, Args, Serialize)]
pub struct MemoryFlags {
    #[arg(long = "memory-max-keys", env = "RL_MEMORY_MAX_KEYS", help = help("Most buckets the memory backend holds", "memory.max_keys"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_keys: Option<usize>,
    #[arg(long = "memory-shards", env = "RL_MEMORY_SHARDS", help = help("Lock shards of the memory backend", "memory.shards"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shards: Option<usize>,
}

/// `[redis]` flags.
#[derive(Debug, Clone, Default, Args, Serialize)]
pub struct RedisFlags {
    // URLs may carry a password: --help does not show the environment's.
    #[arg(long = "redis-url", env = "RL_REDIS_URL", hide_env_values = true, help = help("Redis URL for the naive and lua backends (rediss:// for TLS; credentials as rediss://user:password@host)", "redis.url"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// A Redis Cluster seed node URL (repeatable); switches to cluster mode
    #[arg(
        long = "redis-cluster",
        env = "RL_REDIS_CLUSTER",
        hide_env_values = true,
        value_delimiter = ','
    )]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cluster: Vec<String>,
    #[arg(long = "redis-prefix", env = "RL_REDIS_PREFIX", help = help("Prefix of every Redis key", "redis.prefix"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    #[arg(long = "redis-connect-timeout", env = "RL_REDIS_CONNECT_TIMEOUT", help = help("Time allowed to open a Redis connection", "redis.connect_timeout"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connect_timeout: Option<String>,
    #[arg(long = "redis-response-timeout", env = "RL_REDIS_RESPONSE_TIMEOUT", help = help("Time allowed for one Redis answer", "redis.response_timeout"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response_timeout: Option<String>,
    #[arg(long = "redis-retries", env = "RL_REDIS_RETRIES", help = help("Reconnection attempts / cluster retries per failure", "redis.retries"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retries: Option<u32>,
    #[arg(long = "redis-ttl-margin", env = "RL_REDIS_TTL_MARGIN", help = help("Added to a bucket's time-to-full for its key's TTL", "redis.ttl_margin"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl_margin: Option<String>,
    #[arg(long = "redis-topology-refresh", env = "RL_REDIS_TOPOLOGY_REFRESH", help = help("How often a cluster's slot map is re-read (per-node metrics follow it)", "redis.topology_refresh"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topology_refresh: Option<String>,
    /// PEM CA certificates trusted by rediss:// connections instead of the system's roots [default: none: the system's roots]
    #[arg(long = "redis-tls-ca-file", env = "RL_REDIS_TLS_CA_FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_ca_file: Option<String>,
    /// A PEM client certificate for rediss:// servers that ask for one (with --redis-tls-client-key) [default: none]
    #[arg(long = "redis-tls-client-cert", env = "RL_REDIS_TLS_CLIENT_CERT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_client_cert: Option<String>,
    /// The client certificate's PEM private key [default: none]
    #[arg(long = "redis-tls-client-key", env = "RL_REDIS_TLS_CLIENT_KEY")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_client_key: Option<String>,
}

/// `[failure]` flags.
#[derive(Debug, Clone, Default, Args, Serialize)]
pub struct FailureFlags {
    #[arg(long = "failure-mode", env = "RL_FAILURE_MODE", value_enum, help = help("What policies do while Redis cannot decide", "failure.mode"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<FailureMode>,
    #[arg(long = "failure-deadline", env = "RL_FAILURE_DEADLINE", help = help("The longest a request waits on Redis", "failure.deadline"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline: Option<String>,
    #[arg(long = "failure-instances", env = "RL_FAILURE_INSTANCES", help = help("Instances sharing the limit; the local fallback enforces 1/N of it", "failure.instances"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instances: Option<u64>,
    #[arg(long = "breaker-failures", env = "RL_BREAKER_FAILURES", help = help("Consecutive Redis failures that open the circuit breaker", "failure.breaker_failures"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breaker_failures: Option<u32>,
    #[arg(long = "breaker-cooldown", env = "RL_BREAKER_COOLDOWN", help = help("How long the open breaker waits before probing Redis", "failure.breaker_cooldown"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breaker_cooldown: Option<String>,
}

/// `[tracing]` flags. OpenTelemetry's own variables (`OTEL_*`) are read
/// apart, in `otel.rs`: a bad one is ignored with a warning, where a bad
/// flag stops the start.
#[derive(Debug, Clone, Default, Args, Serialize)]
pub struct TracingFlags {
    /// The OTLP collector, e.g. http://127.0.0.1:4318; or OTEL_EXPORTER_OTLP_ENDPOINT [default: none: traces are not exported]
    #[arg(long = "otlp-endpoint")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    #[arg(long = "otlp-protocol", value_enum, help = help("OTLP transport; or OTEL_EXPORTER_OTLP_PROTOCOL", "tracing.protocol"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub protocol: Option<OtlpProtocol>,
    #[arg(long = "service-name", help = help("service.name of the exported spans; or OTEL_SERVICE_NAME", "tracing.service_name"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_name: Option<String>,
    #[arg(long = "traces-sampler", value_enum, help = help("Which traces to keep; or OTEL_TRACES_SAMPLER", "tracing.sampler"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sampler: Option<SamplerKind>,
    #[arg(long = "traces-sampler-arg", help = help("The ratio of the ratio samplers, 0 to 1; or OTEL_TRACES_SAMPLER_ARG", "tracing.sampler_arg"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sampler_arg: Option<f64>,
    #[arg(long = "trace-queue-size", env = "RL_TRACE_QUEUE_SIZE", help = help("Spans waiting for export, at most (more are dropped, counted)", "tracing.queue_size"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_size: Option<usize>,
    #[arg(long = "trace-batch-delay", env = "RL_TRACE_BATCH_DELAY", help = help("The longest a span waits for its batch", "tracing.batch_delay"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_delay: Option<String>,
    #[arg(long = "trace-export-timeout", env = "RL_TRACE_EXPORT_TIMEOUT", help = help("The longest one export may take", "tracing.export_timeout"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub export_timeout: Option<String>,
}

/// `[hot_keys]` flags.
#[derive(Debug, Clone, Default, Args, Serialize)]
pub struct HotKeyFlags {
    #[arg(long = "hot-keys-tracked", env = "RL_HOT_KEYS_TRACKED", help = help("Keys the hot-key detector tracks at once (0: off)", "hot_keys.tracked"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tracked: Option<usize>,
    #[arg(long = "hot-keys-top", env = "RL_HOT_KEYS_TOP", help = help("Hot keys exported in /metrics", "hot_keys.top"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top: Option<usize>,
    #[arg(long = "hot-keys-window", env = "RL_HOT_KEYS_WINDOW", help = help("The hot-key detector's window", "hot_keys.window"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window: Option<String>,
    #[arg(long = "hot-keys-addresses", env = "RL_HOT_KEYS_ADDRESSES", value_enum, help = help("Hot addresses in the key label: show them, or a short hash", "hot_keys.addresses"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub addresses: Option<AddressDisplay>,
}

/// `[deny_cache]` flags.
#[derive(Debug, Clone, Default, Args, Serialize)]
pub struct DenyCacheFlags {
    #[arg(id = "deny_cache_max_keys", long = "deny-cache-max-keys", env = "RL_DENY_CACHE_MAX_KEYS", help = help("Most denials an instance remembers for policies with deny_cache", "deny_cache.max_keys"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_keys: Option<usize>,
}

/// `[rls]` flags.
#[derive(Debug, Clone, Default, Args, Serialize)]
pub struct RlsFlags {
    #[arg(id = "rls_listen", long = "rls-listen", env = "RL_RLS_LISTEN", help = help("Address Envoy's rate limit service (gRPC) listens on", "rls.listen"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    #[arg(id = "rls_max_message_bytes", long = "rls-max-message-bytes", env = "RL_RLS_MAX_MESSAGE_BYTES", help = help("Largest rate limit request message in bytes", "rls.max_message_bytes"))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_message_bytes: Option<usize>,
}
