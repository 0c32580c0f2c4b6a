//! Who is asking: the key a request is limited under.
//!
//! An API key (`X-Api-Key`, or `Authorization: Bearer`) identifies a client
//! better than an address: thousands of users share one NAT or CDN address.
//! But a header is attacker-controlled, so it may only ever *narrow* a limit:
//!
//! - API keys are verified against the configured list. An unknown key does
//!   not get a bucket of its own (rotating random keys would otherwise buy
//!   unlimited quota); it is limited by address like an anonymous client and
//!   then answered 401.
//! - The client address is the TCP peer. `X-Forwarded-For` is read only when
//!   the peer is a configured trusted proxy, and then the right-most address
//!   that is not itself a trusted proxy is the client: everything to its
//!   left was written by the client and proves nothing.
//! - IPv6 clients are keyed by their prefix (default /64): one subscriber
//!   commonly holds a whole /64 and could otherwise rotate through 2^64 keys.
//!
//! What reaches a store is a keyed SipHash of (policy, identity), so a store,
//! a Redis dump or a log of keys never holds a credential or an address.
//! Malformed headers are an error (400), never a panic and never a bypass.

pub use crate::key::KeyKind;

use crate::descriptors::DescriptorId;
use crate::key::BucketKey;
use http::HeaderMap;
use ipnet::IpNet;
use sha2::{Digest, Sha256};
use siphasher::sip128::{Hasher128, SipHasher13};
use std::collections::HashMap;
use std::hash::Hasher;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

/// Longest API key accepted (bytes). Longer values are refused, not truncated.
pub const MAX_API_KEY_LEN: usize = 256;
/// Longest `X-Forwarded-For` (all header lines together) accepted, in bytes.
pub const MAX_FORWARDED_FOR_LEN: usize = 2048;
/// Most addresses accepted in `X-Forwarded-For`.
pub const MAX_FORWARDED_FOR_HOPS: usize = 32;

/// A request whose identifying headers cannot be used. Each maps to a 400
/// response (or 500 for [`IdentityError::NoPeerAddress`]) and a metric label.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// An API key longer than [`MAX_API_KEY_LEN`].
    #[error("the API key is longer than {MAX_API_KEY_LEN} bytes")]
    ApiKeyTooLong,
    /// An API key that is empty or has characters outside visible ASCII.
    #[error("the API key must be 1 or more visible ASCII characters")]
    ApiKeyInvalid,
    /// Two different API keys in one request (two `X-Api-Key` lines, or an
    /// `X-Api-Key` and a different bearer token).
    #[error("the request carries more than one different API key")]
    ApiKeyConflict,
    /// `X-Forwarded-For` from a trusted proxy that is too long.
    #[error(
        "X-Forwarded-For is longer than {MAX_FORWARDED_FOR_LEN} bytes or {MAX_FORWARDED_FOR_HOPS} addresses"
    )]
    ForwardedForTooLong,
    /// `X-Forwarded-For` from a trusted proxy with an entry that is not an address.
    #[error("X-Forwarded-For holds an entry that is not an IP address")]
    ForwardedForInvalid,
    /// The server was built without peer addresses (a wiring bug).
    #[error("the peer address of the connection is unknown")]
    NoPeerAddress,
}

impl IdentityError {
    /// The bounded label used for this error in metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            IdentityError::ApiKeyTooLong => "api_key_too_long",
            IdentityError::ApiKeyInvalid => "api_key_invalid",
            IdentityError::ApiKeyConflict => "api_key_conflict",
            IdentityError::ForwardedForTooLong => "forwarded_for_too_long",
            IdentityError::ForwardedForInvalid => "forwarded_for_invalid",
            IdentityError::NoPeerAddress => "no_peer_address",
        }
    }
}

/// What a bucket is keyed by, before hashing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// The configured id of a verified API key (never the key itself).
    ApiKey(Arc<str>),
    /// A client address (IPv6 already cut to its prefix).
    Ip(IpAddr),
    /// A descriptor sent to Envoy's rate limit service.
    Descriptor(Arc<DescriptorId>),
}

/// The configured API keys, by the SHA-256 of the key.
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    by_digest: HashMap<[u8; 32], Arc<str>>,
}

impl ApiKeys {
    /// Keys from (id, SHA-256 of the key) pairs.
    pub fn from_digests(entries: impl IntoIterator<Item = (String, [u8; 32])>) -> Self {
        Self {
            by_digest: entries
                .into_iter()
                .map(|(id, digest)| (digest, Arc::from(id)))
                .collect(),
        }
    }

    /// The SHA-256 of a key, as stored.
    pub fn digest(key: &str) -> [u8; 32] {
        Sha256::digest(key.as_bytes()).into()
    }

    /// The id of `key`, if it is configured.
    pub fn verify(&self, key: &str) -> Option<Arc<str>> {
        self.by_digest.get(&Self::digest(key)).cloned()
    }

    /// How many keys are configured.
    pub fn len(&self) -> usize {
        self.by_digest.len()
    }

    /// Whether no key is configured.
    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }
}

/// Turns a request's peer address and headers into an [`Identity`].
#[derive(Debug, Clone)]
pub struct Identifier {
    api_keys: ApiKeys,
    trusted_proxies: Vec<IpNet>,
    ipv6_prefix: u8,
}

impl Identifier {
    /// `ipv6_prefix` is clamped to 128.
    pub fn new(api_keys: ApiKeys, trusted_proxies: Vec<IpNet>, ipv6_prefix: u8) -> Self {
        Self {
            api_keys,
            trusted_proxies,
            ipv6_prefix: ipv6_prefix.min(128),
        }
    }

    /// Identify a request. `peer` is the TCP peer (`None` only if the server
    /// was wired without connection info, which is reported, not guessed).
    pub fn identify(
        &self,
        headers: &HeaderMap,
        peer: Option<IpAddr>,
    ) -> Result<(Identity, KeyKind), IdentityError> {
        self.identify_request(headers, peer).0
    }

    /// [`Identifier::identify`], and [`Identifier::ignores_forwarding`],
    /// from one pass over the request's headers.
    pub fn identify_request(
        &self,
        headers: &HeaderMap,
        peer: Option<IpAddr>,
    ) -> (Result<(Identity, KeyKind), IdentityError>, bool) {
        let presented = Presented::scan(headers);
        let ignores_forwarding = self.ignores_presented(&presented, peer);
        (self.identify_presented(presented, peer), ignores_forwarding)
    }

    fn identify_presented(
        &self,
        presented: Presented<'_>,
        peer: Option<IpAddr>,
    ) -> Result<(Identity, KeyKind), IdentityError> {
        let key = presented.api_key?;
        if let Some(id) = key.and_then(|key| self.api_keys.verify(key)) {
            return Ok((Identity::ApiKey(id), KeyKind::ApiKey));
        }
        let peer = peer.ok_or(IdentityError::NoPeerAddress)?;
        let ip = if presented.forwarded {
            self.client_ip(presented.headers, peer)?
        } else {
            // Nothing forwarded: the peer, whoever it is (what client_ip
            // finds, without looking the header up again).
            peer.to_canonical()
        };
        let kind = if key.is_some() {
            KeyKind::UnknownApiKey
        } else {
            KeyKind::Ip
        };
        Ok((Identity::Ip(self.mask(ip)), kind))
    }

    /// The trusted proxy ranges.
    pub fn trusted_proxies(&self) -> &[IpNet] {
        &self.trusted_proxies
    }

    /// Whom a connection from `peer` counts against under the server's
    /// per-address connection cap: the address as an anonymous client is
    /// keyed (an IPv6 one by its `ipv6_prefix` network: one host has a
    /// whole /64 to connect from), or `None` for a trusted proxy, whose
    /// connections carry every client behind it.
    pub fn connection_owner(&self, peer: IpAddr) -> Option<IpAddr> {
        let peer = peer.to_canonical();
        (!self.is_trusted(peer)).then(|| self.mask(peer))
    }

    /// Whether `peer` sent `X-Forwarded-For` without being a trusted proxy,
    /// so the header is ignored. Now and then, a client trying to choose its
    /// own bucket; on nearly every request, a proxy that should be trusted
    /// and is not.
    pub fn ignores_forwarding(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> bool {
        self.ignores_presented(&Presented::scan(headers), peer)
    }

    fn ignores_presented(&self, presented: &Presented<'_>, peer: Option<IpAddr>) -> bool {
        presented.forwarded && peer.is_some_and(|p| self.ignores(p))
    }

    /// Whether forwarding from `peer` is ignored: it is not a trusted proxy.
    fn ignores(&self, peer: IpAddr) -> bool {
        !self.is_trusted(peer.to_canonical())
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        self.trusted_proxies.iter().any(|net| net.contains(&ip))
    }

    /// The client address: the peer, or if the peer is a trusted proxy, the
    /// right-most untrusted `X-Forwarded-For` entry.
    pub fn client_ip(&self, headers: &HeaderMap, peer: IpAddr) -> Result<IpAddr, IdentityError> {
        let peer = peer.to_canonical();
        if !self.is_trusted(peer) {
            return Ok(peer);
        }
        let hops = forwarded_for(headers)?;
        let mut client = peer;
        for hop in hops.iter().rev() {
            client = *hop;
            if !self.is_trusted(*hop) {
                break;
            }
        }
        // Every hop trusted (or none): the left-most is the furthest we know.
        Ok(client)
    }

    fn mask(&self, ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V4(_) => ip,
            IpAddr::V6(v6) => {
                let bits = u128::from(v6);
                let mask = if self.ipv6_prefix == 0 {
                    0
                } else {
                    u128::MAX << (128 - u32::from(self.ipv6_prefix))
                };
                IpAddr::V6(Ipv6Addr::from(bits & mask))
            }
        }
    }
}

/// An API key as accepted on the wire and in the config: 1 to
/// [`MAX_API_KEY_LEN`] visible ASCII characters.
pub fn valid_key(value: &[u8]) -> Result<&str, IdentityError> {
    if value.len() > MAX_API_KEY_LEN {
        return Err(IdentityError::ApiKeyTooLong);
    }
    if value.is_empty() || !value.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(IdentityError::ApiKeyInvalid);
    }
    // Visible ASCII is valid UTF-8.
    std::str::from_utf8(value).map_err(|_| IdentityError::ApiKeyInvalid)
}

/// `X-Api-Key`. Names as constants, compared with each header's name
/// (and, for `X-Forwarded-For`, looked up: a `&str` name would be parsed
/// on every lookup).
const X_API_KEY: http::HeaderName = http::HeaderName::from_static("x-api-key");
/// `X-Forwarded-For`.
const X_FORWARDED_FOR: http::HeaderName = http::HeaderName::from_static("x-forwarded-for");

/// What a request's headers present to identify it by, found in one pass
/// over them. Looking up `X-Api-Key`, `Authorization` and
/// `X-Forwarded-For` by name would hash each name and probe the map, three
/// times a request, most times to find nothing: comparing each header's
/// name to the three costs less for any request of usual size (a name
/// of another length differs at its length, a standard one at its tag).
#[derive(Debug, Clone)]
struct Presented<'a> {
    /// The API key, validated but not verified; or why the request's keys
    /// are refused: the first malformed key in the headers' order (a
    /// `HeaderMap` keeps each name's lines together, names in the order
    /// they first came), else two different keys. Which refusal is named
    /// can change with that order; that the request is refused cannot.
    api_key: Result<Option<&'a str>, IdentityError>,
    /// Whether an `X-Forwarded-For` line came.
    forwarded: bool,
    headers: &'a HeaderMap,
}

impl<'a> Presented<'a> {
    fn scan(headers: &'a HeaderMap) -> Self {
        let mut api_key = Ok(None);
        let mut forwarded = false;
        for (name, value) in headers {
            let key = if *name == X_API_KEY {
                valid_key(value.as_bytes())
            } else if *name == http::header::AUTHORIZATION {
                let bytes = value.as_bytes();
                // Only the Bearer scheme carries an API key; other schemes
                // (Basic) are someone else's business and leave the
                // request anonymous.
                if bytes.len() > 7 && bytes[..7].eq_ignore_ascii_case(b"bearer ") {
                    valid_key(bytes[7..].trim_ascii())
                } else {
                    continue;
                }
            } else {
                forwarded |= *name == X_FORWARDED_FOR;
                continue;
            };
            api_key = match (api_key, key) {
                (Ok(mut found), Ok(key)) => merge(&mut found, key).map(|()| found),
                // A malformed key is named over a conflict, whatever the
                // headers' order.
                (Ok(_) | Err(IdentityError::ApiKeyConflict), Err(malformed)) => Err(malformed),
                (refused, _) => refused,
            };
        }
        Self {
            api_key,
            forwarded,
            headers,
        }
    }
}

fn merge<'a>(found: &mut Option<&'a str>, key: &'a str) -> Result<(), IdentityError> {
    match found {
        Some(existing) if *existing != key => Err(IdentityError::ApiKeyConflict),
        _ => {
            *found = Some(key);
            Ok(())
        }
    }
}

/// Parses every `X-Forwarded-For` line, in order, into addresses.
fn forwarded_for(headers: &HeaderMap) -> Result<Vec<IpAddr>, IdentityError> {
    let mut total = 0;
    let mut hops = Vec::new();
    for value in headers.get_all(X_FORWARDED_FOR) {
        total += value.len();
        if total > MAX_FORWARDED_FOR_LEN {
            return Err(IdentityError::ForwardedForTooLong);
        }
        let text = value
            .to_str()
            .map_err(|_| IdentityError::ForwardedForInvalid)?;
        for entry in text.split(',') {
            if hops.len() == MAX_FORWARDED_FOR_HOPS {
                return Err(IdentityError::ForwardedForTooLong);
            }
            hops.push(parse_hop(entry.trim()).ok_or(IdentityError::ForwardedForInvalid)?);
        }
    }
    Ok(hops)
}

/// An address, optionally with a port (`1.2.3.4:80`, `[::1]:80`).
fn parse_hop(entry: &str) -> Option<IpAddr> {
    entry
        .parse::<IpAddr>()
        .ok()
        .or_else(|| entry.parse::<SocketAddr>().ok().map(|s| s.ip()))
        .map(|ip| ip.to_canonical())
}

/// Keyed hashing of (policy, identity) into a [`BucketKey`].
#[derive(Clone)]
pub struct KeyHasher {
    secret: [u8; 16],
}

impl std::fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyHasher { secret: <redacted> }")
    }
}

impl KeyHasher {
    /// A hasher keyed by `secret`. Instances sharing a store must share it.
    pub fn new(secret: [u8; 16]) -> Self {
        Self { secret }
    }

    /// The bucket of `identity` under `policy`.
    pub fn bucket_key(&self, policy: &str, identity: &Identity) -> BucketKey {
        let mut h = SipHasher13::new_with_key(&self.secret);
        // Length-prefixed fields, so ("ab", "c") and ("a", "bc") differ.
        h.write_u64(policy.len() as u64);
        h.write(policy.as_bytes());
        match identity {
            Identity::ApiKey(id) => {
                h.write_u8(b'k');
                h.write_u64(id.len() as u64);
                h.write(id.as_bytes());
            }
            Identity::Ip(IpAddr::V4(v4)) => {
                h.write_u8(b'4');
                h.write(&v4.octets());
            }
            Identity::Ip(IpAddr::V6(v6)) => {
                h.write_u8(b'6');
                h.write(&v6.octets());
            }
            Identity::Descriptor(d) => {
                h.write_u8(b'd');
                let mut field = |text: &str| {
                    h.write_u64(text.len() as u64);
                    h.write(text.as_bytes());
                };
                field(&d.domain);
                for (key, value) in &d.entries {
                    field(key);
                    field(value);
                }
            }
        }
        BucketKey(h.finish128().as_u128())
    }
}

#[cfg(test)]
mod tests;
