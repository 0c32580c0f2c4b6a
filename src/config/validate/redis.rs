//! The Redis section: its URL, TLS files and client settings.

use super::{duration, invalid};
use crate::config::ConfigError;
use crate::config::file::RedisFile;
use crate::store::redis::tls::{self, IdentityError};
use crate::store::redis::{ClientIdentity, RedisSettings, RedisTls, check_url};

/// A Redis URL field: whether it is TLS (see [`check_url`]).
pub(super) fn redis_url(field: &str, url: &str) -> Result<bool, ConfigError> {
    check_url(url).map_err(|m| invalid(field, m))
}

/// A path field, empty meaning unset (an empty environment variable).
pub(super) fn path(p: Option<String>) -> Option<String> {
    p.filter(|p| !p.trim().is_empty())
}

/// The contents of the file a field names.
pub(super) fn read_file(field: &str, path: &str) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| invalid(field, format!("cannot read {path}: {e}")))
}

/// The TLS files, read and checked now, so that a bad one fails at
/// start-up rather than at the first connection.
pub(super) fn redis_tls(r: &RedisFile) -> Result<RedisTls, ConfigError> {
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

pub(super) fn redis(r: RedisFile) -> Result<RedisSettings, ConfigError> {
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
