//! From layered settings to a [`Config`]: every value checked, every error
//! naming its field (`policies[1].burst`), and the rules other modules own
//! asked of them (an algorithm's limits of the algorithm, a backend's
//! support of the backend, the local share of the failure policy).

use super::file::Settings;
use super::parse::{default_instance_id, parse_period, parse_proxy, valid_name};
use super::{Config, ConfigError};
use crate::algorithm::Algorithm;
use crate::failover::try_share;
use crate::identity::ApiKeys;
use crate::mitigation::{lease_take, shard_limit};
use std::time::Duration;

mod policies;
mod redis;
mod rls;
mod sections;

use policies::{api_keys, override_keys, policies, shards};
use redis::redis;
use rls::rls;
pub(super) use sections::http;
use sections::{failover, hot_keys, memory, tracing};

fn invalid(field: impl Into<String>, message: impl std::fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.to_string(),
    }
}

/// A name field (an instance id, an API key's id, a policy's name): it
/// ends up in headers, metric labels and log lines ([`valid_name`]).
fn check_name(field: impl Into<String>, name: &str) -> Result<(), ConfigError> {
    if valid_name(name) {
        Ok(())
    } else {
        Err(invalid(field, "must be 1-64 characters of [A-Za-z0-9_.-]"))
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
    check_name("instance_id", &instance_id)?;

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
        override_keys(i, p, &api_keys, s.ipv6_prefix)?;
    }
    // A lease must be able to live: the fleet's leases fit under the burst,
    // with room left for the shared bucket to refill into.
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
        if p.lease <= p.cost {
            return Err(invalid(
                field,
                format!(
                    "must be above the cost {}: a lease no dearer than the request grants nothing beyond it",
                    p.cost
                ),
            ));
        }
        for limit in p.limits() {
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
            let sub = shard_limit(&limit, p.shards).unwrap_or(limit);
            if lease_take(&sub, 0, p.lease, failover.instances).is_none() {
                let burst = sub.burst();
                let what = if p.shards > 1 {
                    format!("a sub-bucket's burst {burst} (burst / shards)")
                } else {
                    format!("the burst {burst}")
                };
                // A token of room, more above a token a microsecond.
                let room = sub
                    .rate_units_per_us()
                    .max(1)
                    .div_ceil(sub.units_per_token());
                return Err(invalid(
                    field,
                    format!(
                        "{} instances (failure.instances) x lease {}, plus {room} token(s) of room to refill, must stay below {what}: leases held by the whole fleet must fit in one bucket",
                        failover.instances, p.lease,
                    ),
                ));
            }
        }
    }
    // Every policy's local share must be a limit the service can keep.
    for (i, p) in policies.iter().enumerate() {
        for limit in p.limits() {
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

    let rls = rls(s.rls, &policies)?;

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
        rls,
        ignored_env: Vec::new(),
    })
}
