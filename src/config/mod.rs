//! The one typed configuration: a TOML file, command-line flags and
//! environment variables, validated at start-up with the bad field named.
//!
//! Precedence: flag > environment variable > file > default. Policies and
//! API keys are structured and live in the file only.
//!
//! | field | flag / env | default |
//! |---|---|---|
//! | `listen` | `--listen` / `RL_LISTEN` | `127.0.0.1:8080` |
//! | `backend` | `--backend` / `RL_BACKEND` | `memory` |
//! | `instance_id` | `--instance-id` / `RL_INSTANCE_ID` | `<hostname>-<pid>` |
//! | `trusted_proxies` | `--trusted-proxy` (repeatable) / `RL_TRUSTED_PROXIES` (comma separated) | none |
//! | `trusted_proxy_warn_addresses` | `--trusted-proxy-warn-addresses` / `RL_TRUSTED_PROXY_WARN_ADDRESSES` | `256` |
//! | `key_secret` | `--key-secret` / `RL_KEY_SECRET` | random per process |
//! | `ipv6_prefix` | `--ipv6-prefix` / `RL_IPV6_PREFIX` | `64` |
//! | `near_limit_fraction` | `--near-limit-fraction` / `RL_NEAR_LIMIT_FRACTION` | `0.2` |
//! | `http.header_timeout` | `--http-header-timeout` / `RL_HTTP_HEADER_TIMEOUT` | `10s` (also the keep-alive idle timeout) |
//! | `http.request_timeout` | `--http-request-timeout` / `RL_HTTP_REQUEST_TIMEOUT` | `30s` |
//! | `http.max_connections` | `--http-max-connections` / `RL_HTTP_MAX_CONNECTIONS` | `512` |
//! | `http.max_connections_per_address` | `--http-max-connections-per-address` / `RL_HTTP_MAX_CONNECTIONS_PER_ADDRESS` | `128` |
//! | `http.body_limit` | `--http-body-limit` / `RL_HTTP_BODY_LIMIT` | `2097152` (bytes) |
//! | `memory.max_keys` | `--memory-max-keys` / `RL_MEMORY_MAX_KEYS` | `1000000` |
//! | `memory.shards` | `--memory-shards` / `RL_MEMORY_SHARDS` | `64` |
//! | `redis.url` | `--redis-url` / `RL_REDIS_URL` | `redis://127.0.0.1:6379` (`rediss://` for TLS; credentials in the URL) |
//! | `redis.cluster` | `--redis-cluster` (repeatable seed URL) / `RL_REDIS_CLUSTER` (comma separated) | none: standalone |
//! | `redis.prefix` | `--redis-prefix` / `RL_REDIS_PREFIX` | `rl:` |
//! | `redis.connect_timeout` | `--redis-connect-timeout` / `RL_REDIS_CONNECT_TIMEOUT` | `200ms` |
//! | `redis.response_timeout` | `--redis-response-timeout` / `RL_REDIS_RESPONSE_TIMEOUT` | `50ms` |
//! | `redis.retries` | `--redis-retries` / `RL_REDIS_RETRIES` | `1` |
//! | `redis.ttl_margin` | `--redis-ttl-margin` / `RL_REDIS_TTL_MARGIN` | `1s` |
//! | `redis.topology_refresh` | `--redis-topology-refresh` / `RL_REDIS_TOPOLOGY_REFRESH` | `1s` |
//! | `redis.tls_ca_file` | `--redis-tls-ca-file` / `RL_REDIS_TLS_CA_FILE` | none: `rediss://` trusts the system's roots |
//! | `redis.tls_client_cert` | `--redis-tls-client-cert` / `RL_REDIS_TLS_CLIENT_CERT` | none: no client certificate |
//! | `redis.tls_client_key` | `--redis-tls-client-key` / `RL_REDIS_TLS_CLIENT_KEY` | none |
//! | `failure.mode` | `--failure-mode` / `RL_FAILURE_MODE` | `local` (`open`, `closed`, `local`; per policy: `failure_mode`) |
//! | `failure.deadline` | `--failure-deadline` / `RL_FAILURE_DEADLINE` | `10ms` |
//! | `failure.instances` | `--failure-instances` / `RL_FAILURE_INSTANCES` | `1` |
//! | `failure.breaker_failures` | `--breaker-failures` / `RL_BREAKER_FAILURES` | `5` |
//! | `failure.breaker_cooldown` | `--breaker-cooldown` / `RL_BREAKER_COOLDOWN` | `500ms` |
//! | `tracing.endpoint` | `--otlp-endpoint` / `OTEL_EXPORTER_OTLP_ENDPOINT` | none: traces are not exported |
//! | `tracing.protocol` | `--otlp-protocol` / `OTEL_EXPORTER_OTLP_PROTOCOL` | `http/protobuf` (or `grpc`) |
//! | `tracing.service_name` | `--service-name` / `OTEL_SERVICE_NAME` | `ratelimiter` |
//! | `tracing.sampler` | `--traces-sampler` / `OTEL_TRACES_SAMPLER` | `parentbased_traceidratio` |
//! | `tracing.sampler_arg` | `--traces-sampler-arg` / `OTEL_TRACES_SAMPLER_ARG` | `1.0` |
//! | `tracing.queue_size` | `--trace-queue-size` / `RL_TRACE_QUEUE_SIZE` | `2048` |
//! | `tracing.batch_delay` | `--trace-batch-delay` / `RL_TRACE_BATCH_DELAY` | `1s` |
//! | `tracing.export_timeout` | `--trace-export-timeout` / `RL_TRACE_EXPORT_TIMEOUT` | `5s` |
//! | `hot_keys.tracked` | `--hot-keys-tracked` / `RL_HOT_KEYS_TRACKED` | `128` (0: no detection) |
//! | `hot_keys.top` | `--hot-keys-top` / `RL_HOT_KEYS_TOP` | `5` |
//! | `hot_keys.window` | `--hot-keys-window` / `RL_HOT_KEYS_WINDOW` | `10s` |
//! | `hot_keys.addresses` | `--hot-keys-addresses` / `RL_HOT_KEYS_ADDRESSES` | `hash` (or `show`) |
//! | `deny_cache.max_keys` | `--deny-cache-max-keys` / `RL_DENY_CACHE_MAX_KEYS` | `100000` |
//! | `rls.listen` | `--rls-listen` / `RL_RLS_LISTEN` | none: Envoy's rate limit service is not served |
//! | `rls.max_message_bytes` | `--rls-max-message-bytes` / `RL_RLS_MAX_MESSAGE_BYTES` | `4194304` |
//! | `[[api_keys]]` | file only | none |
//! | `[[policies]]` | file only | one policy `api`: route `/api/`, burst 100, 10/s |
//! | `[[rls.domains]]` | file only | none |
//!
//! The defaults are declared once, in [`file::Settings::default`]; the flags'
//! help quotes them, and a test holds this table and docs/configuration.md's to them.
//! A policy's `algorithm` (default `token_bucket`; `gcra`, `fixed_window`,
//! `sliding_window`; `sliding_log` needs backend `lua`) reads the same
//! `burst`/`rate`/`per`: see [`crate::algorithm`].
//!
//! # Layout
//! - `cli.rs`: the flags (clap), in the file's shape;
//! - `file.rs`: the file's shape, and every default;
//! - `parse.rs`: periods, proxies, names, digests;
//! - `validate/`: from layered [`file::Settings`] to a [`Config`], with
//!   the field named in every error: `mod.rs` the whole and the rules
//!   across sections, `sections.rs` HTTP, memory, failover, tracing and
//!   hot keys, `redis.rs` the Redis URL, TLS and client, `policies.rs`
//!   API keys, limits, algorithms and key sharding.
//!
//! The layering itself is figment's: defaults, then the file, then the
//! flags, merged key by key. Its extraction errors carry the key path, which
//! is turned into the same `policies[0].burst` field names validation uses.

mod cli;
pub mod file;
mod otel;
mod parse;
mod validate;

pub use cli::{
    Cli, DenyCacheFlags, FailureFlags, HotKeyFlags, HttpFlags, MemoryFlags, RedisFlags, RlsFlags,
    TracingFlags, default_of,
};
pub use otel::OtelEnv;
pub use parse::parse_period;

use crate::descriptors::Domain;
use crate::failover::FailoverSettings;
use crate::hotkeys::HotKeySettings;
use crate::policy::Policy;
use crate::store::Backend;
use crate::store::redis::RedisSettings;
use crate::telemetry::TracingSettings;
use figment::Figment;
use figment::providers::{Format, Serialized, Toml};
use ipnet::IpNet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Memory backend settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryConfig {
    /// Most buckets held at once.
    pub max_keys: usize,
    /// Lock shards (a power of two).
    pub shards: usize,
}

/// What a connection and a request may cost the instance (`[http]`; see
/// `server::connections`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpConfig {
    /// The longest wait for a request's headers, counted from when the
    /// connection starts waiting (so also the keep-alive idle timeout).
    pub header_timeout: Duration,
    /// The longest one request may take after its headers, body included.
    pub request_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections open at once from one address (trusted proxies exempt).
    pub max_connections_per_address: usize,
    /// The largest request body, in bytes.
    pub body_limit: usize,
}

impl Default for HttpConfig {
    /// The declared defaults (`file::Settings::default`), for states built
    /// without a config.
    fn default() -> Self {
        validate::http(file::Settings::default().http).expect("the defaults are valid")
    }
}

/// A configured API key: its id and the SHA-256 of the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKeyConfig {
    /// The id buckets are keyed by (never the key itself).
    pub id: String,
    /// SHA-256 of the key.
    pub sha256: [u8; 32],
}

/// Envoy's rate limit service (`[rls]`; see [`crate::rls`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RlsConfig {
    /// Where it listens (`None`: not served).
    pub listen: Option<SocketAddr>,
    /// The largest request message, in bytes.
    pub max_message_bytes: usize,
    /// Which policy limits which descriptors.
    pub domains: Vec<Domain>,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Where limit state lives.
    pub backend: Backend,
    /// This instance's name.
    pub instance_id: String,
    /// Proxies whose `X-Forwarded-For` is believed.
    pub trusted_proxies: Vec<IpNet>,
    /// Trusted ranges holding more addresses than this are warned about.
    pub trusted_proxy_warn_addresses: u64,
    /// The SipHash key for client identities; `None` means random at start.
    pub key_secret: Option<[u8; 16]>,
    /// Prefix length IPv6 clients are keyed by.
    pub ipv6_prefix: u8,
    /// Admissions leaving less than this fraction of the limit count as
    /// near it.
    pub near_limit_fraction: f64,
    /// Connection and request bounds of the HTTP server.
    pub http: HttpConfig,
    /// Memory backend settings (also the local share's size).
    pub memory: MemoryConfig,
    /// Redis settings (used by the naive and lua backends).
    pub redis: RedisSettings,
    /// Deadline, breaker and failure mode around Redis.
    pub failover: FailoverSettings,
    /// Trace export.
    pub tracing: TracingSettings,
    /// The hot-key detector.
    pub hot_keys: HotKeySettings,
    /// Most denials the deny cache remembers.
    pub deny_cache_max_keys: usize,
    /// Verified API keys.
    pub api_keys: Vec<ApiKeyConfig>,
    /// Route policies.
    pub policies: Vec<Policy>,
    /// Envoy's rate limit service.
    pub rls: RlsConfig,
    /// `OTEL_*` variables that were ignored, one line each, for the
    /// service to warn about once it logs.
    pub ignored_env: Vec<String>,
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
    #[error("config file {path}: {}{message}", field.as_deref().map(|f| format!("{f}: ")).unwrap_or_default())]
    Parse {
        /// The file (`<inline>` for text).
        path: PathBuf,
        /// The field at fault, e.g. `policies[0].burst` (`None`: the file
        /// is not TOML at all).
        field: Option<String>,
        /// The parser's message.
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

/// `policies.0.burst` as `policies[0].burst`.
fn field_name(path: &[String]) -> String {
    let mut out = String::new();
    for part in path {
        if part.bytes().all(|b| b.is_ascii_digit()) && !out.is_empty() {
            out.push_str(&format!("[{part}]"));
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(part);
        }
    }
    out
}

impl Config {
    /// The trusted proxy ranges holding more than
    /// `trusted_proxy_warn_addresses` addresses. Every client inside a
    /// trusted range may write its own `X-Forwarded-For` and so choose its
    /// own bucket: right for a subnet of proxies, a surprise for a whole
    /// network (`10.0.0.0/8`).
    pub fn wide_trusted_ranges(&self) -> Vec<IpNet> {
        self.trusted_proxies
            .iter()
            .filter(|net| {
                let host_bits = u32::from(net.max_prefix_len() - net.prefix_len());
                // None: more addresses than a u128 holds (an IPv6 /0).
                1u128
                    .checked_shl(host_bits)
                    .is_none_or(|n| n > u128::from(self.trusted_proxy_warn_addresses))
            })
            .copied()
            .collect()
    }

    /// Reads the file named by `cli.config` (if any) and layers the
    /// process's `OTEL_*` variables and the flags over it.
    pub fn load(cli: Cli) -> Result<Self, ConfigError> {
        let env = OtelEnv::read(|name| std::env::var(name).ok());
        match &cli.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                Self::layered(path.clone(), &text, env, &cli)
            }
            None => Self::layered(PathBuf::from("<none>"), "", env, &cli),
        }
    }

    /// Parses and validates a config from TOML text, with no flags and no
    /// environment.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        Self::layered(
            PathBuf::from("<inline>"),
            text,
            OtelEnv::default(),
            &Cli::default(),
        )
    }

    /// Defaults, then the file's `text`, then the `OTEL_*` variables, then
    /// the flags; then validation.
    fn layered(path: PathBuf, text: &str, env: OtelEnv, cli: &Cli) -> Result<Self, ConfigError> {
        let settings: file::Settings = Figment::new()
            .merge(Serialized::defaults(file::Settings::default()))
            .merge(Toml::string(text))
            .merge(Serialized::defaults(&env))
            .merge(Serialized::defaults(cli))
            .extract()
            .map_err(|e| {
                // Several errors can be chained; the first names the field.
                let field = (!e.path.is_empty()).then(|| field_name(&e.path));
                ConfigError::Parse {
                    path,
                    field,
                    message: e.kind.to_string(),
                }
            })?;
        let mut config = validate::validate(settings)?;
        if env.disabled {
            config.tracing.endpoint = None;
        }
        config.ignored_env = env.warnings;
        Ok(config)
    }
}

#[cfg(test)]
mod tests;
