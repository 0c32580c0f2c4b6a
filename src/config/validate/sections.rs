//! The settings sections: HTTP, memory, failover, tracing, hot keys.

use super::{duration, invalid};
use crate::config::file::{FailureFile, HotKeysFile, HttpFile, MemoryFile, TracingFile};
use crate::config::{ConfigError, HttpConfig, MemoryConfig};
use crate::failover::FailoverSettings;
use crate::hotkeys::HotKeySettings;
use crate::telemetry::TracingSettings;
use std::time::Duration;

/// Most keys the detector may track: a new key scans them all.
const MAX_TRACKED: usize = 4096;

pub(super) fn hot_keys(h: HotKeysFile) -> Result<HotKeySettings, ConfigError> {
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

pub(super) fn tracing(t: TracingFile) -> Result<TracingSettings, ConfigError> {
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

pub(in crate::config) fn http(h: HttpFile) -> Result<HttpConfig, ConfigError> {
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

pub(super) fn memory(m: MemoryFile) -> Result<MemoryConfig, ConfigError> {
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

pub(super) fn failover(f: FailureFile) -> Result<FailoverSettings, ConfigError> {
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
