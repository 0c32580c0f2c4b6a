//! The policies: API keys, limits and what each algorithm and backend
//! allows of them, and key sharding.

use super::{check_name, duration, invalid};
use crate::algorithm::{Algorithm, Limit, LimitError};
use crate::config::file::{ApiKeyFile, LimitFile, OverrideFile, PolicyFile};
use crate::config::parse::parse_hex32;
use crate::config::{ApiKeyConfig, ConfigError};
use crate::identity::{ApiKeys, valid_key};
use crate::mitigation::{MAX_SHARDS, shard_limit};
use crate::policy::{Override, Policy};
use crate::store::Backend;
use std::net::{IpAddr, Ipv6Addr};
use std::time::Duration;

/// Key sharding on policy `i` (`shards`, `shard_keys`): a split the
/// sub-buckets can keep, of keys that exist. Addresses are normalized as
/// the limiter keys them (a mapped IPv4 as IPv4, IPv6 cut to its prefix).
pub(super) fn shards(
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
    for limit in p.limits().collect::<Vec<_>>() {
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
    keys(
        &format!("policies[{i}].shard_keys"),
        &mut p.shard_keys,
        api_keys,
        ipv6_prefix,
    )
}

/// Keys named in a policy (`field`): configured API key ids, or client
/// addresses, normalized as the limiter keys them (a mapped IPv4 as IPv4,
/// IPv6 cut to its prefix).
fn keys(
    field: &str,
    keys: &mut [String],
    api_keys: &[ApiKeyConfig],
    ipv6_prefix: u8,
) -> Result<(), ConfigError> {
    for (j, key) in keys.iter_mut().enumerate() {
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
                format!("{field}[{j}]"),
                format!("{key:?} is neither a client address nor a configured api_keys id"),
            ));
        }
    }
    Ok(())
}

/// The keys of policy `i`'s overrides: ones that exist, each in one
/// override at most.
pub(super) fn override_keys(
    i: usize,
    p: &mut Policy,
    api_keys: &[ApiKeyConfig],
    ipv6_prefix: u8,
) -> Result<(), ConfigError> {
    let mut seen: Vec<String> = Vec::new();
    for (j, o) in p.overrides.iter_mut().enumerate() {
        let field = format!("policies[{i}].overrides[{j}].keys");
        if o.keys.is_empty() {
            return Err(invalid(field, "names no key: an override is for some keys"));
        }
        keys(&field, &mut o.keys, api_keys, ipv6_prefix)?;
        for (k, key) in o.keys.iter().enumerate() {
            if seen.contains(key) {
                return Err(invalid(
                    format!("{field}[{k}]"),
                    format!("{key:?} has an override already: one limit a key"),
                ));
            }
            seen.push(key.clone());
        }
    }
    Ok(())
}

/// An override's limit, with the policy's algorithm and what it needs.
fn build_override(
    field: &str,
    o: &OverrideFile,
    algorithm: Algorithm,
    backend: Backend,
    cost: u64,
) -> Result<Override, ConfigError> {
    let limit = build_limit(
        field,
        &LimitFile {
            burst: o.burst,
            rate: o.rate,
            per: o.per.clone(),
        },
    )?;
    check_algorithm(field, algorithm, backend, &[limit])?;
    if cost > limit.burst() {
        return Err(invalid(
            format!("{field}.burst"),
            format!(
                "{} is below the policy's cost {cost}: no request could ever be admitted",
                limit.burst()
            ),
        ));
    }
    Ok(Override {
        keys: o.keys.clone(),
        limit: limit.with_algorithm(algorithm),
    })
}

pub(super) fn api_keys(list: Vec<ApiKeyFile>) -> Result<Vec<ApiKeyConfig>, ConfigError> {
    let mut out: Vec<ApiKeyConfig> = Vec::with_capacity(list.len());
    for (i, k) in list.into_iter().enumerate() {
        let field = format!("api_keys[{i}]");
        check_name(format!("{field}.id"), &k.id)?;
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

pub(super) fn build_limit(field: &str, limit: &LimitFile) -> Result<Limit, ConfigError> {
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
pub(super) fn check_algorithm(
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

pub(super) fn policies(
    list: Vec<PolicyFile>,
    backend: Backend,
) -> Result<Vec<Policy>, ConfigError> {
    let mut out: Vec<Policy> = Vec::with_capacity(list.len());
    for (i, p) in list.into_iter().enumerate() {
        let field = format!("policies[{i}]");
        check_name(format!("{field}.name"), &p.name)?;
        if out.iter().any(|o| o.name == p.name) {
            return Err(invalid(
                format!("{field}.name"),
                format!("duplicate policy {:?}", p.name),
            ));
        }
        if p.route.as_ref().is_some_and(|r| !r.starts_with('/')) {
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
        let (limit, anonymous, overrides) = if p.unlimited {
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
                || !p.overrides.is_empty()
            {
                return Err(invalid(
                    &field,
                    "an unlimited policy takes no burst, rate, cost, anonymous limit, failure_mode, algorithm, shadow, deny_cache, lease, shards, shard_keys or overrides",
                ));
            }
            (None, None, Vec::new())
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
            let overrides = p
                .overrides
                .iter()
                .enumerate()
                .map(|(j, o)| {
                    build_override(
                        &format!("{field}.overrides[{j}]"),
                        o,
                        algorithm,
                        backend,
                        cost,
                    )
                })
                .collect::<Result<Vec<_>, _>>()?;
            (Some(limit), Some(anonymous), overrides)
        };
        if out.iter().any(|o| {
            p.route.is_some()
                && o.route == p.route
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
            overrides,
        });
    }
    Ok(out)
}
