//! From layered settings to a [`Config`]: every value checked, every error
//! naming its field (`policies[1].burst`), and the rules other modules own
//! asked of them (an algorithm's limits of the algorithm, a backend's
//! support of the backend, the local share of the failure policy).

use super::file::{
    ApiKeyFile, FailureFile, HotKeysFile, HttpFile, LimitFile, MemoryFile, PolicyFile, RedisFile,
    Settings, TracingFile,
};
use super::parse::{default_instance_id, parse_hex32, parse_period, parse_proxy, valid_name};
use super::{ApiKeyConfig, Config, ConfigError, HttpConfig, MemoryConfig};
use crate::algorithm::{Algorithm, Limit, LimitError};
use crate::failover::{FailoverSettings, try_share};
use crate::hotkeys::HotKeySettings;
use crate::identity::{ApiKeys, valid_key};
use crate::mitigation::{MAX_SHARDS, shard_limit};
use crate::policy::Policy;
use crate::store::Backend;
use crate::store::redis::tls::{self, IdentityError};
use crate::store::redis::{ClientIdentity, RedisSettings, RedisTls, check_url};
use crate::telemetry::TracingSettings;
use std::net::{IpAddr, Ipv6Addr};
use std::time::Duration;

fn invalid(field: impl Into<String>, message: impl std::fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.to_string(),
    }
}

/// A duration field.
fn duration(field: &str, text: &str) -> Result<Duration, ConfigError> {
    parse_period(text).map_err(|m| invalid(field, m))
}

/// Validates layered settings.
pub(super) fn validate(s: Settings) -> Result<Config, ConfigError> {
    let listen = s
        .listen
        .parse()
        .map_err(|_| invalid("listen", format!("{:?} is not an address:port", s.listen)))?;

    let instance_id = s.instance_id.unwrap_or_else(default_instance_id);
    if !valid_name(&instance_id) {
        return Err(invalid(
            "instance_id",
            "must be 1-64 characters of [A-Za-z0-9_.-]",
        ));
    }

    let trusted_proxies = s
        .trusted_proxies
        .iter()
        .enumerate()
        .map(|(i, p)| parse_proxy(p).map_err(|m| invalid(format!("trusted_proxies[{i}]"), m)))
        .collect::<Result<Vec<_>, _>>()?;

    let key_secret = match s.key_secret {
        None => None,
        Some(secret) if secret.len() < 16 => {
            return Err(invalid("key_secret", "must be at least 16 characters"));
        }
        Some(secret) => {
            let digest = ApiKeys::digest(&secret);
            let mut key = [0u8; 16];
            key.copy_from_slice(&digest[..16]);
            Some(key)
        }
    };

    if s.ipv6_prefix > 128 {
        return Err(invalid("ipv6_prefix", "must be between 0 and 128"));
    }
    if !(0.0..=1.0).contains(&s.near_limit_fraction) {
        return Err(invalid(
            "near_limit_fraction",
            "must be a fraction of the limit, from 0 to 1",
        ));
    }

    let http = http(s.http)?;
    let memory = memory(s.memory)?;
    let backend = s.backend;
    if backend.is_shared() && key_secret.is_none() {
        return Err(invalid(
            "key_secret",
            format!(
                "is required with backend {}: instances sharing Redis must hash client identities alike",
                backend.as_str()
            ),
        ));
    }
    let redis = redis(s.redis)?;
    let failover = failover(s.failure)?;
    let tracing = tracing(s.tracing)?;
    let hot_keys = hot_keys(s.hot_keys)?;
    if s.deny_cache.max_keys == 0 {
        return Err(invalid(
            "deny_cache.max_keys",
            "must be at least 1 (turn the cache off per policy instead)",
        ));
    }
    let api_keys = api_keys(s.api_keys)?;
    let mut policies = policies(s.policies, backend)?;
    for (i, p) in policies.iter_mut().enumerate() {
        shards(i, p, &api_keys, s.ipv6_prefix)?;
    }
    // A lease must be able to live: the fleet's leases fit under the burst.
    for (i, p) in policies.iter().enumerate() {
        if p.lease == 0 {
            continue;
        }
        let field = format!("policies[{i}].lease");
        if p.lease == 1 {
            return Err(invalid(
                field,
                "must be 0 (off) or at least 2: a lease of one token is a plain check",
            ));
        }
        for limit in [p.limit, p.anonymous].into_iter().flatten() {
            if limit.algorithm() != Algorithm::TokenBucket {
                return Err(invalid(
                    field,
                    format!(
                        "leases need algorithm token_bucket, not {}",
                        limit.algorithm().as_str()
                    ),
                ));
            }
            // A sharded key leases from each sub-bucket.
            let burst = limit.burst() / u64::from(p.shards);
            if p.lease.saturating_mul(failover.instances) >= burst {
                let what = if p.shards > 1 {
                    format!("a sub-bucket's burst {burst} (burst / shards)")
                } else {
                    format!("the burst {burst}")
                };
                return Err(invalid(
                    field,
                    format!(
                        "{} instances (failure.instances) x lease {} must stay below {what}: leases held by the whole fleet must fit in one bucket",
                        failover.instances, p.lease,
                    ),
                ));
            }
        }
    }
    // Every policy's local share must be a limit the service can keep.
    for (i, p) in policies.iter().enumerate() {
        for limit in [p.limit, p.anonymous].into_iter().flatten() {
            // A sharded key's local share is each sub-bucket's.
            let limit = shard_limit(&limit, p.shards).unwrap_or(limit);
            if try_share(&limit, failover.instances, p.cost).is_err() {
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

    Ok(Config {
        listen,
        backend,
        instance_id,
        trusted_proxies,
        trusted_proxy_warn_addresses: s.trusted_proxy_warn_addresses,
        key_secret,
        ipv6_prefix: s.ipv6_prefix,
        near_limit_fraction: s.near_limit_fraction,
        http,
        memory,
        redis,
        failover,
        tracing,
        hot_keys,
        deny_cache_max_keys: s.deny_cache.max_keys,
        api_keys,
        policies,
    })
}

/// Key sharding on policy `i` (`shards`, `shard_keys`): a split the
/// sub-buckets can keep, of keys that exist. Addresses are normalized as
/// the limiter keys them (a mapped IPv4 as IPv4, IPv6 cut to its prefix).
fn shards(
    i: usize,
    p: &mut Policy,
    api_keys: &[ApiKeyConfig],
    ipv6_prefix: u8,
) -> Result<(), ConfigError> {
    let field = format!("policies[{i}].shards");
    if !(1..=MAX_SHARDS).contains(&p.shards) {
        return Err(invalid(
            field,
            format!("must be from 1 (off) to {MAX_SHARDS}"),
        ));
    }
    if p.shards == 1 {
        if !p.shard_keys.is_empty() {
            return Err(invalid(
                format!("policies[{i}].shard_keys"),
                "names keys to split, but shards is 1: set shards too",
            ));
        }
        return Ok(());
    }
    for limit in [p.limit, p.anonymous].into_iter().flatten() {
        let algorithm = limit.algorithm();
        if !matches!(algorithm, Algorithm::TokenBucket | Algorithm::Gcra) {
            return Err(invalid(
                field,
                format!(
                    "sharding needs algorithm token_bucket or gcra, not {}: a window split in S is not a window of 1/S",
                    algorithm.as_str()
                ),
            ));
        }
        let sub = shard_limit(&limit, p.shards).map_err(|e| {
            invalid(
                &field,
                format!("burst {} split {} ways: {e}", limit.burst(), p.shards),
            )
        })?;
        if sub.burst() < p.cost {
            return Err(invalid(
                field,
                format!(
                    "burst {} / shards {} leaves {} tokens a sub-bucket, below the cost {}: no request could be admitted",
                    limit.burst(),
                    p.shards,
                    sub.burst(),
                    p.cost
                ),
            ));
        }
    }
    for (j, key) in p.shard_keys.iter_mut().enumerate() {
        if let Ok(ip) = key.parse::<IpAddr>() {
            let ip = match ip.to_canonical() {
                IpAddr::V6(v6) if ipv6_prefix < 128 => {
                    let mask = u128::MAX
                        .checked_shl(128 - u32::from(ipv6_prefix))
                        .unwrap_or(0);
                    IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask))
                }
                ip => ip,
            };
            *key = ip.to_string();
        } else if !api_keys.iter().any(|k| &k.id == key) {
            return Err(invalid(
                format!("policies[{i}].shard_keys[{j}]"),
                format!("{key:?} is neither a client address nor a configured api_keys id"),
            ));
        }
    }
    Ok(())
}

/// Most keys the detector may track: a new key scans them all.
const MAX_TRACKED: usize = 4096;

fn hot_keys(h: HotKeysFile) -> Result<HotKeySettings, ConfigError> {
    if h.tracked > MAX_TRACKED {
        return Err(invalid(
            "hot_keys.tracked",
            format!("must be at most {MAX_TRACKED} (each new key scans every tracked one)"),
        ));
    }
    if h.top > h.tracked {
        return Err(invalid(
            "hot_keys.top",
            format!(
                "must be at most hot_keys.tracked ({}): only tracked keys can be exported",
                h.tracked
            ),
        ));
    }
    if h.top > 100 {
        return Err(invalid(
            "hot_keys.top",
            "must be at most 100: each exported key is a series in every scrape",
        ));
    }
    let window = duration("hot_keys.window", &h.window)?;
    if !(Duration::from_secs(1)..=Duration::from_secs(600)).contains(&window) {
        return Err(invalid(
            "hot_keys.window",
            "must be from 1s to 10m: shorter is noise, longer hides a hot key for as long",
        ));
    }
    Ok(HotKeySettings {
        tracked: h.tracked,
        top: h.top,
        window,
        addresses: h.addresses,
    })
}

fn tracing(t: TracingFile) -> Result<TracingSettings, ConfigError> {
    let endpoint = match t.endpoint.map(|e| e.trim().to_owned()) {
        // An empty variable is how an environment says "none".
        None => None,
        Some(e) if e.is_empty() => None,
        Some(e) if e.starts_with("http://") || e.starts_with("https://") => Some(e),
        Some(e) => {
            return Err(invalid(
                "tracing.endpoint",
                format!("{e:?} is not an http:// or https:// URL"),
            ));
        }
    };
    if !(0.0..=1.0).contains(&t.sampler_arg) {
        return Err(invalid(
            "tracing.sampler_arg",
            "must be a ratio from 0 to 1",
        ));
    }
    if !(1..=1_000_000).contains(&t.queue_size) {
        return Err(invalid("tracing.queue_size", "must be from 1 to 1000000"));
    }
    if t.service_name.is_empty() {
        return Err(invalid("tracing.service_name", "must not be empty"));
    }
    Ok(TracingSettings {
        endpoint,
        protocol: t.protocol,
        service_name: t.service_name,
        sampler: t.sampler,
        sampler_arg: t.sampler_arg,
        queue_size: t.queue_size,
        batch_delay: duration("tracing.batch_delay", &t.batch_delay)?,
        export_timeout: duration("tracing.export_timeout", &t.export_timeout)?,
    })
}

pub(super) fn http(h: HttpFile) -> Result<HttpConfig, ConfigError> {
    let header_timeout = duration("http.header_timeout", &h.header_timeout)?;
    if header_timeout > Duration::from_secs(300) {
        return Err(invalid(
            "http.header_timeout",
            "must be at most 5m: it is how long a silent or trickling client may hold a connection",
        ));
    }
    let request_timeout = duration("http.request_timeout", &h.request_timeout)?;
    if request_timeout > Duration::from_secs(3600) {
        return Err(invalid(
            "http.request_timeout",
            "must be at most 1h: it is how long a stalled body may hold a connection",
        ));
    }
    if h.max_connections == 0 {
        return Err(invalid("http.max_connections", "must be at least 1"));
    }
    if !(1..=h.max_connections).contains(&h.max_connections_per_address) {
        return Err(invalid(
            "http.max_connections_per_address",
            format!(
                "must be from 1 to http.max_connections ({}); set it to that to cap only the total",
                h.max_connections
            ),
        ));
    }
    if h.body_limit == 0 {
        return Err(invalid("http.body_limit", "must be at least 1 byte"));
    }
    Ok(HttpConfig {
        header_timeout,
        request_timeout,
        max_connections: h.max_connections,
        max_connections_per_address: h.max_connections_per_address,
        body_limit: h.body_limit,
    })
}

fn memory(m: MemoryFile) -> Result<MemoryConfig, ConfigError> {
    if m.max_keys == 0 {
        return Err(invalid("memory.max_keys", "must be at least 1"));
    }
    if m.shards == 0 || !m.shards.is_power_of_two() || m.shards > 4096 {
        return Err(invalid(
            "memory.shards",
            "must be a power of two from 1 to 4096",
        ));
    }
    Ok(MemoryConfig {
        max_keys: m.max_keys,
        shards: m.shards,
    })
}

fn failover(f: FailureFile) -> Result<FailoverSettings, ConfigError> {
    let deadline = duration("failure.deadline", &f.deadline)?;
    if deadline > Duration::from_secs(10) {
        return Err(invalid(
            "failure.deadline",
            "must be at most 10s: it is how long a request may wait on Redis",
        ));
    }
    if !(1..=10_000).contains(&f.instances) {
        return Err(invalid("failure.instances", "must be from 1 to 10000"));
    }
    if f.breaker_failures == 0 {
        return Err(invalid("failure.breaker_failures", "must be at least 1"));
    }
    Ok(FailoverSettings {
        mode: f.mode,
        deadline,
        instances: f.instances,
        breaker_failures: f.breaker_failures,
        breaker_cooldown: duration("failure.breaker_cooldown", &f.breaker_cooldown)?,
    })
}

/// A Redis URL field: whether it is TLS (see [`check_url`]).
fn redis_url(field: &str, url: &str) -> Result<bool, ConfigError> {
    check_url(url).map_err(|m| invalid(field, m))
}

/// A path field, empty meaning unset (an empty environment variable).
fn path(p: Option<String>) -> Option<String> {
    p.filter(|p| !p.trim().is_empty())
}

/// The contents of the file a field names.
fn read_file(field: &str, path: &str) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| invalid(field, format!("cannot read {path}: {e}")))
}

/// The TLS files, read and checked now, so that a bad one fails at
/// start-up rather than at the first connection.
fn redis_tls(r: &RedisFile) -> Result<RedisTls, ConfigError> {
    let ca = match path(r.tls_ca_file.clone()) {
        None => None,
        Some(file) => {
            let field = "redis.tls_ca_file";
            let pem = read_file(field, &file)?;
            tls::check_ca(&pem).map_err(|m| invalid(field, format!("{file}: {m}")))?;
            Some(pem)
        }
    };
    let (cert_field, key_field) = ("redis.tls_client_cert", "redis.tls_client_key");
    let client = match (
        path(r.tls_client_cert.clone()),
        path(r.tls_client_key.clone()),
    ) {
        (None, None) => None,
        (Some(_), None) => {
            return Err(invalid(key_field, format!("is required with {cert_field}")));
        }
        (None, Some(_)) => {
            return Err(invalid(cert_field, format!("is required with {key_field}")));
        }
        (Some(cert_file), Some(key_file)) => {
            let cert = read_file(cert_field, &cert_file)?;
            let key = read_file(key_field, &key_file)?;
            tls::check_identity(&cert, &key).map_err(|e| match e {
                IdentityError::Cert(m) => invalid(cert_field, format!("{cert_file}: {m}")),
                IdentityError::Key(m) => invalid(key_field, format!("{key_file}: {m}")),
            })?;
            Some(ClientIdentity { cert, key })
        }
    };
    Ok(RedisTls { ca, client })
}

fn redis(r: RedisFile) -> Result<RedisSettings, ConfigError> {
    let tls = redis_tls(&r)?;
    let (urls, cluster, url_field) = if r.cluster.is_empty() {
        (vec![r.url], false, "redis.url".to_owned())
    } else {
        (r.cluster, true, "redis.cluster[0]".to_owned())
    };
    let mut uses_tls = None;
    for (i, url) in urls.iter().enumerate() {
        let field = if cluster {
            format!("redis.cluster[{i}]")
        } else {
            url_field.clone()
        };
        let is_tls = redis_url(&field, url)?;
        if *uses_tls.get_or_insert(is_tls) != is_tls {
            return Err(invalid(
                field,
                "mixes redis:// and rediss:// seeds: a cluster speaks TLS on every node or none",
            ));
        }
    }
    if uses_tls == Some(false) && tls != RedisTls::default() {
        let field = if tls.ca.is_some() {
            "redis.tls_ca_file"
        } else {
            "redis.tls_client_cert"
        };
        return Err(invalid(
            field,
            format!("is for TLS connections, but {url_field} is redis://: use rediss://"),
        ));
    }
    if r.prefix.len() > 64
        || r.prefix.contains(['{', '}'])
        || r.prefix.chars().any(char::is_whitespace)
    {
        return Err(invalid(
            "redis.prefix",
            "must be at most 64 characters without braces (they would move the hash tag) or spaces",
        ));
    }
    let response_timeout = duration("redis.response_timeout", &r.response_timeout)?;
    let connect_timeout = duration("redis.connect_timeout", &r.connect_timeout)?;
    if r.retries > 10 {
        return Err(invalid(
            "redis.retries",
            "must be at most 10 on a request path",
        ));
    }
    Ok(RedisSettings {
        urls,
        cluster,
        prefix: r.prefix,
        connect_timeout,
        response_timeout,
        retries: r.retries,
        ttl_margin: duration("redis.ttl_margin", &r.ttl_margin)?,
        topology_refresh: duration("redis.topology_refresh", &r.topology_refresh)?,
        tls,
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
                valid_key(key.as_bytes()).map_err(|e| invalid(format!("{field}.key"), e))?;
                ApiKeys::digest(&key)
            }
            (None, Some(hex)) => parse_hex32(&hex)
                .ok_or_else(|| invalid(format!("{field}.key_sha256"), "must be 64 hex digits"))?,
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

fn build_limit(field: &str, limit: &LimitFile) -> Result<Limit, ConfigError> {
    let period = match &limit.per {
        Some(p) => duration(&format!("{field}.per"), p)?,
        None => Duration::from_secs(1),
    };
    Limit::new(limit.burst, limit.rate, period).map_err(|e| {
        let which = match e {
            LimitError::ZeroBurst | LimitError::TooLarge => "burst",
            LimitError::ZeroRate => "rate",
            LimitError::ZeroPeriod => "per",
        };
        invalid(format!("{field}.{which}"), e)
    })
}

/// What an algorithm needs, asked of its description and the backend's:
/// a backend that runs it, and limits it keeps exactly at a size the
/// backend holds.
fn check_algorithm(
    field: &str,
    algorithm: Algorithm,
    backend: Backend,
    limits: &[Limit],
) -> Result<(), ConfigError> {
    if !backend.runs(algorithm) {
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
        algorithm
            .check_limit(limit)
            .map_err(|e| invalid(format!("{field}.burst"), e))?;
        let most = backend.max_burst(algorithm);
        if limit.burst() > most {
            return Err(invalid(
                format!("{field}.burst"),
                format!(
                    "{} with backend {} keeps its state in 16 bytes: burst must be at most {most}",
                    algorithm.as_str(),
                    backend.as_str()
                ),
            ));
        }
    }
    Ok(())
}

fn policies(list: Vec<PolicyFile>, backend: Backend) -> Result<Vec<Policy>, ConfigError> {
    let mut out: Vec<Policy> = Vec::with_capacity(list.len());
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
                || p.shadow
                || p.deny_cache
                || p.lease > 0
                || p.shards.is_some()
                || !p.shard_keys.is_empty()
            {
                return Err(invalid(
                    &field,
                    "an unlimited policy takes no burst, rate, cost, anonymous limit, failure_mode, algorithm, shadow, deny_cache, lease, shards or shard_keys",
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
            let keyed = LimitFile {
                burst,
                rate,
                per: p.per.clone(),
            };
            let limit = build_limit(&field, &keyed)?;
            let anonymous = match &p.anonymous {
                Some(a) => build_limit(&format!("{field}.anonymous"), a)?,
                None => limit,
            };
            let algorithm = p.algorithm.unwrap_or_default();
            check_algorithm(&field, algorithm, backend, &[limit, anonymous])?;
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
        out.push(Policy {
            name: p.name,
            route: p.route,
            methods,
            limit,
            anonymous,
            cost,
            failure_mode: p.failure_mode,
            shadow: p.shadow,
            deny_cache: p.deny_cache,
            lease: p.lease,
            shards: p.shards.unwrap_or(1),
            shard_keys: p.shard_keys,
        });
    }
    Ok(out)
}
