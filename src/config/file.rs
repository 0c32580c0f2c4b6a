//! The settings as a file holds them, and every default, declared once.
//!
//! [`Settings::default`] is the bottom layer of the configuration; a file,
//! then the flags and environment ([`super::Cli`]), are layered over it by
//! key (see [`super::Config::load`]). Values stay as written (durations as
//! `"10ms"`), so the defaults go through the same validation as anything a
//! user writes. Unknown keys are errors: a typo must not leave a default
//! limit in force.

use crate::algorithm::Algorithm;
use crate::hotkeys::AddressDisplay;
use crate::store::{Backend, FailureMode};
use crate::telemetry::{OtlpProtocol, SamplerKind};
use serde::{Deserialize, Serialize};

/// Every setting, as layered. See the module docs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// `listen`.
    pub listen: String,
    /// `backend`.
    pub backend: Backend,
    /// `instance_id` (`None`: `<hostname>-<pid>`).
    pub instance_id: Option<String>,
    /// `trusted_proxies`.
    pub trusted_proxies: Vec<String>,
    /// `trusted_proxy_warn_addresses`: a trusted range holding more
    /// addresses than this is warned about at start-up.
    pub trusted_proxy_warn_addresses: u64,
    /// `key_secret` (`None`: random per process).
    pub key_secret: Option<String>,
    /// `ipv6_prefix`.
    pub ipv6_prefix: u8,
    /// `near_limit_fraction`: an admitted request that leaves less than this
    /// fraction of its limit is counted as near the limit.
    pub near_limit_fraction: f64,
    /// `[http]`.
    pub http: HttpFile,
    /// `[memory]`.
    pub memory: MemoryFile,
    /// `[redis]`.
    pub redis: RedisFile,
    /// `[failure]`.
    pub failure: FailureFile,
    /// `[tracing]`.
    pub tracing: TracingFile,
    /// `[hot_keys]`.
    pub hot_keys: HotKeysFile,
    /// `[deny_cache]`.
    pub deny_cache: DenyCacheFile,
    /// `[[api_keys]]`.
    pub api_keys: Vec<ApiKeyFile>,
    /// `[[policies]]`.
    pub policies: Vec<PolicyFile>,
    /// `[rls]`.
    pub rls: RlsFile,
}

/// `[rls]`: Envoy's rate limit service (see [`crate::rls`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RlsFile {
    /// Where the gRPC service listens (`None`: it is not served).
    pub listen: Option<String>,
    /// The largest request message, in bytes.
    pub max_message_bytes: usize,
    /// `[[rls.domains]]`: which policy limits which descriptors.
    #[serde(default)]
    pub domains: Vec<DomainFile>,
}

/// One `[[rls.domains]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DomainFile {
    /// The domain Envoy's filter sends.
    pub domain: String,
    /// Its top-level descriptor rules.
    #[serde(default)]
    pub descriptors: Vec<DescriptorFile>,
}

/// One descriptor rule: `{ key = "api_key", policy = "per-key" }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DescriptorFile {
    /// The entry's key.
    pub key: String,
    /// The entry's value (absent: any value, a bucket per value).
    pub value: Option<String>,
    /// The policy a descriptor ending here gets.
    pub policy: Option<String>,
    /// Rules for the next entry.
    #[serde(default)]
    pub descriptors: Vec<DescriptorFile>,
}

/// `[http]`: what a connection may cost the instance (see
/// `server::connections`). Each bounds what a client that never finishes
/// can hold: a descriptor, a task, a slot under the cap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpFile {
    /// The longest a connection may wait for a request's headers to end,
    /// counted from when it starts waiting: when it opens, and after each
    /// response (so it is also the keep-alive idle timeout).
    pub header_timeout: String,
    /// The longest one request may take once its headers are in, its body
    /// included: a stalled body is answered 408 and the connection closed.
    pub request_timeout: String,
    /// Connections open at once; more are closed as they arrive.
    pub max_connections: usize,
    /// Connections open at once from one client address (an IPv6 client:
    /// its `ipv6_prefix` network); trusted proxies are exempt.
    pub max_connections_per_address: usize,
    /// The largest request body, in bytes; a larger declared
    /// `Content-Length` is answered 413 before any of it is read.
    pub body_limit: usize,
}

/// `[memory]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryFile {
    /// Most buckets held at once.
    pub max_keys: usize,
    /// Lock shards (a power of two).
    pub shards: usize,
}

/// `[redis]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisFile {
    /// Standalone server URL (ignored when `cluster` is set).
    pub url: String,
    /// Cluster seed node URLs; non-empty switches to cluster mode.
    pub cluster: Vec<String>,
    /// Prefix of every key.
    pub prefix: String,
    /// Time allowed to open a connection.
    pub connect_timeout: String,
    /// Time allowed for one answer.
    pub response_timeout: String,
    /// Reconnection attempts / cluster retries per failure.
    pub retries: u32,
    /// Added to a key's time-to-full for its TTL.
    pub ttl_margin: String,
    /// How often a cluster's slot map is re-read.
    pub topology_refresh: String,
    /// PEM CA certificates trusted by `rediss://` connections (`None`: the
    /// system's roots).
    pub tls_ca_file: Option<String>,
    /// A PEM client certificate, for servers that ask for one.
    pub tls_client_cert: Option<String>,
    /// The client certificate's PEM private key.
    pub tls_client_key: Option<String>,
}

/// `[failure]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailureFile {
    /// The mode of policies that do not set their own.
    pub mode: FailureMode,
    /// The longest a request waits on Redis.
    pub deadline: String,
    /// Instances sharing each limit.
    pub instances: u64,
    /// Consecutive failures that open the breaker.
    pub breaker_failures: u32,
    /// How long the open breaker waits before probing.
    pub breaker_cooldown: String,
}

/// `[tracing]`: OpenTelemetry trace export.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingFile {
    /// The OTLP collector (`None`: no export).
    pub endpoint: Option<String>,
    /// `grpc` or `http/protobuf`.
    pub protocol: OtlpProtocol,
    /// `service.name`.
    pub service_name: String,
    /// Which traces to keep.
    pub sampler: SamplerKind,
    /// The ratio of the ratio samplers.
    pub sampler_arg: f64,
    /// Spans waiting for export, at most; more are dropped and counted.
    pub queue_size: usize,
    /// The longest a span waits for its batch.
    pub batch_delay: String,
    /// The longest one export may take.
    pub export_timeout: String,
}

/// `[hot_keys]`: the heavy-hitter detector (see [`crate::hotkeys`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotKeysFile {
    /// Keys tracked at once per window (0 turns detection off).
    pub tracked: usize,
    /// Keys exported in `/metrics`.
    pub top: usize,
    /// The length of one window.
    pub window: String,
    /// `show` addresses in the `key` label, or `hash` them.
    pub addresses: AddressDisplay,
}

/// `[deny_cache]`: the denials an instance remembers for the policies
/// that set `deny_cache = true` (see [`crate::mitigation::DenyCache`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DenyCacheFile {
    /// Most denials remembered at once.
    pub max_keys: usize,
}

/// One `[[api_keys]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyFile {
    /// The id buckets are keyed by.
    pub id: String,
    /// The key itself (or `key_sha256`).
    pub key: Option<String>,
    /// The key's SHA-256, hex (or `key`).
    pub key_sha256: Option<String>,
}

/// A limit as written: `anonymous = { burst = 20, rate = 2 }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitFile {
    /// Tokens.
    pub burst: u64,
    /// Tokens refilled per `per`.
    pub rate: u64,
    /// The period (default `1s`).
    pub per: Option<String>,
}

/// One `[[policies]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyFile {
    /// Name in headers and metrics.
    pub name: String,
    /// Route template prefix (absent: only descriptor rules use it).
    pub route: Option<String>,
    /// Methods (all if absent).
    pub methods: Option<Vec<String>>,
    /// No limit on this route.
    #[serde(default)]
    pub unlimited: bool,
    /// Tokens.
    pub burst: Option<u64>,
    /// Tokens refilled per `per`.
    pub rate: Option<u64>,
    /// The period (default `1s`).
    pub per: Option<String>,
    /// Tokens one request costs (default 1).
    pub cost: Option<u64>,
    /// The limit of clients without a verified API key.
    pub anonymous: Option<LimitFile>,
    /// What this policy does while Redis cannot decide.
    pub failure_mode: Option<FailureMode>,
    /// The algorithm (default `token_bucket`).
    pub algorithm: Option<Algorithm>,
    /// Decide and count, never refuse.
    #[serde(default)]
    pub shadow: bool,
    /// Answer 429 locally while a denial from the store holds.
    #[serde(default)]
    pub deny_cache: bool,
    /// Tokens an instance takes at most with a request's call and spends
    /// locally (0: none).
    #[serde(default)]
    pub lease: u64,
    /// Sub-buckets each key is split over (default 1: none).
    pub shards: Option<u16>,
    /// Only these keys are split: API key ids or client addresses.
    #[serde(default)]
    pub shard_keys: Vec<String>,
    /// Limits of their own for some keys (a partner's contract).
    #[serde(default)]
    pub overrides: Vec<OverrideFile>,
}

/// `overrides = [{ keys = ["tenant-01"], burst = 5000, rate = 5000 }]`:
/// these keys' limit on the policy, instead of the policy's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverrideFile {
    /// API key ids or client addresses.
    pub keys: Vec<String>,
    /// Tokens.
    pub burst: u64,
    /// Tokens refilled per `per`.
    pub rate: u64,
    /// The period (default `1s`).
    pub per: Option<String>,
}

impl Default for Settings {
    /// Every default of the service.
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            backend: Backend::Memory,
            instance_id: None,
            trusted_proxies: Vec::new(),
            // A /24 (or an IPv6 /120): a subnet of proxies, not a network.
            trusted_proxy_warn_addresses: 256,
            key_secret: None,
            ipv6_prefix: 64,
            // envoy ratelimit's near-limit ratio is 0.8 of the limit used.
            near_limit_fraction: 0.2,
            http: HttpFile {
                // A request's headers come in one packet or a few; ten
                // seconds is ample on a slow mobile link, and an idle
                // keep-alive connection is closed after as long (nginx in
                // front closes its idle ones after 5 s: see nginx/).
                header_timeout: "10s".into(),
                // A 2 MB body at 100 kB/s takes 20 s.
                request_timeout: "30s".into(),
                // Half the 1024 descriptors a process gets by default
                // (ulimit -n): the rest stay for Redis, logs and the
                // listener. Raise both together.
                max_connections: 512,
                // One host holds at most a quarter of the cap: a thousand
                // slow sockets from one address cannot take them all.
                max_connections_per_address: 128,
                // axum's default.
                body_limit: 2 * 1024 * 1024,
            },
            memory: MemoryFile {
                max_keys: 1_000_000,
                shards: 64,
            },
            redis: RedisFile {
                url: "redis://127.0.0.1:6379".into(),
                cluster: Vec::new(),
                prefix: "rl:".into(),
                connect_timeout: "200ms".into(),
                // A request path cannot wait the client's 500 ms default.
                response_timeout: "50ms".into(),
                retries: 1,
                ttl_margin: "1s".into(),
                topology_refresh: "1s".into(),
                tls_ca_file: None,
                tls_client_cert: None,
                tls_client_key: None,
            },
            failure: FailureFile {
                mode: FailureMode::Local,
                // ~100 loopback round trips; see `failover`.
                deadline: "10ms".into(),
                instances: 1,
                breaker_failures: 5,
                breaker_cooldown: "500ms".into(),
            },
            tracing: TracingFile {
                endpoint: None,
                // The OTLP specification's default transport.
                protocol: OtlpProtocol::HttpProtobuf,
                service_name: "ratelimiter".into(),
                // Follow the caller's decision; keep every trace we start
                // (lower the ratio under real traffic).
                sampler: SamplerKind::ParentbasedTraceIdRatio,
                sampler_arg: 1.0,
                queue_size: 2048,
                batch_delay: "1s".into(),
                export_timeout: "5s".into(),
            },
            hot_keys: HotKeysFile {
                // Every key above 1/128 of the checks is certainly tracked;
                // a scan of 128 counts per new key.
                tracked: 128,
                top: 5,
                window: "10s".into(),
                addresses: AddressDisplay::Hash,
            },
            deny_cache: DenyCacheFile {
                // About 100 bytes each: 10 MB at most.
                max_keys: 100_000,
            },
            api_keys: Vec::new(),
            // Without policies in the file: every /api/ route, 100 at 10/s.
            policies: vec![PolicyFile {
                name: "api".into(),
                route: Some("/api/".into()),
                methods: None,
                unlimited: false,
                burst: Some(100),
                rate: Some(10),
                per: None,
                cost: None,
                anonymous: None,
                failure_mode: None,
                algorithm: None,
                shadow: false,
                deny_cache: false,
                lease: 0,
                shards: None,
                shard_keys: Vec::new(),
                overrides: Vec::new(),
            }],
            rls: RlsFile {
                listen: None,
                // Far above what Envoy forwards with its default header
                // limit (60 KiB a descriptor that copies a header): a
                // message refused here goes through Envoy unlimited.
                max_message_bytes: 4 * 1024 * 1024,
                domains: Vec::new(),
            },
        }
    }
}
