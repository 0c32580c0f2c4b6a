//! Parsing helpers for config values: periods, proxies, names, digests.
//! Each returns the problem as text; the caller names the field.

use ipnet::IpNet;
use std::time::Duration;

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

/// A CIDR block, or one address (a /32 or /128).
pub fn parse_proxy(text: &str) -> Result<IpNet, String> {
    let text = text.trim();
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<std::net::IpAddr>().map(IpNet::from))
        .map_err(|_| format!("{text:?} is not a CIDR block or an IP address"))
}

/// A name fit for a header, a metric label and a log line:
/// `[A-Za-z0-9_.-]{1,64}`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// 64 hex digits as 32 bytes.
pub fn parse_hex32(text: &str) -> Option<[u8; 32]> {
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

/// `<hostname>-<pid>`, or `instance-<pid>` if the hostname is not a valid name.
pub fn default_instance_id() -> String {
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
