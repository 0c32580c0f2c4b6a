//! Who a bucket belongs to, as every layer sees it: the keyed hash the
//! stores index by, and how the client was identified.
//!
//! Shared vocabulary: this module imports nothing of the crate, so identity
//! (which makes keys) and the stores (which use them) both depend on it and
//! not on each other.

use std::fmt;

/// The key of one bucket: a keyed 128-bit hash of (policy, client identity).
///
/// Being a keyed hash, it is uniformly distributed and cannot be steered by
/// clients, which is what lets stores use its bits directly for sharding and
/// hashing, and it never reveals the credential or address it came from.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BucketKey(pub u128);

impl fmt::Debug for BucketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BucketKey({self})")
    }
}

impl fmt::Display for BucketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// How a request was identified; also a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    /// A configured API key.
    ApiKey,
    /// No API key: the client address.
    Ip,
    /// An API key that is not configured: limited by address, answered 401.
    UnknownApiKey,
}

impl KeyKind {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyKind::ApiKey => "api_key",
            KeyKind::Ip => "ip",
            KeyKind::UnknownApiKey => "unknown_api_key",
        }
    }
}
