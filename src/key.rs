//! Who a bucket belongs to, as every layer sees it: the keyed hash the
//! stores index by, and how the client was identified.
//!
//! Shared vocabulary: this module imports nothing of the crate, so identity
//! (which makes keys) and the stores (which use them) both depend on it and
//! not on each other.

use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};

/// The key of one bucket: a keyed 128-bit hash of (policy, client identity).
///
/// Being a keyed hash, it is uniformly distributed and cannot be steered by
/// clients, which is what lets stores use its bits directly for sharding and
/// hashing, and it never reveals the credential or address it came from.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BucketKey(pub u128);

impl BucketKey {
    /// The Redis Cluster slot of this bucket: stores put the key's hex in
    /// the hash tag (`<prefix><tag>{<hex>}`), so every key of the bucket,
    /// whatever its algorithm, lives in this slot.
    pub fn slot(self) -> u16 {
        cluster_slot(&self.hex())
    }

    /// The key as 32 lowercase hex digits, as [`fmt::Display`] writes it
    /// and Redis keys carry it, without a formatter: a Lua check writes it
    /// straight into its command, and `{:032x}` through `fmt` would be a
    /// visible share of the client's CPU per check (docs/performance.md,
    /// "Client side of a Redis check").
    pub fn hex(self) -> [u8; 32] {
        let mut hex = [0u8; 32];
        let digits = b"0123456789abcdef";
        // A byte at a time: shifting the u128 for each digit costs more
        // instructions.
        for (pair, byte) in hex.chunks_exact_mut(2).zip(self.0.to_be_bytes()) {
            pair[0] = digits[usize::from(byte >> 4)];
            pair[1] = digits[usize::from(byte & 0xf)];
        }
        hex
    }
}

/// Slots in a Redis Cluster.
pub const SLOTS: usize = 16_384;

/// The Redis Cluster slot of a hash tag: CRC16 (XMODEM: polynomial 0x1021,
/// initial 0) mod 16384, as the cluster hashes. Table-driven: the hot-key
/// detector and key sharding compute slots on the request path.
pub fn cluster_slot(tag: &[u8]) -> u16 {
    let crc = tag.iter().fold(0u16, |crc, &b| {
        (crc << 8) ^ CRC16[usize::from((crc >> 8) as u8 ^ b)]
    });
    crc % SLOTS as u16
}

/// CRC16/XMODEM of each byte value.
const CRC16: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

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

/// The [`Hasher`] of maps keyed by bucket keys: it passes a key's low 64
/// bits through. A keyed hash is uniform already and no client can steer
/// it (see [`BucketKey`]), so hashing it again, with SipHash as std's maps
/// do, is wasted work on the request path, where the hot-key detector, the
/// mitigations' tables and the in-process store look keys up
/// (docs/http-cost.md).
#[derive(Debug, Default, Clone, Copy)]
pub struct KeyBits(u64);

/// Builds [`KeyBits`] hashers.
pub type BuildKeyBits = BuildHasherDefault<KeyBits>;

impl Hasher for KeyBits {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached for a key that is not a keyed hash's bits; folds the
        // bytes in, so such a map still works, if slowly.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        // The bits themselves when written alone (the state starts at 0);
        // combined with what came before, so a composite key still
        // hashes all its parts.
        self.0 = self.0.rotate_left(5) ^ n;
    }

    fn write_u128(&mut self, n: u128) {
        // A `BucketKey`'s derived `Hash`.
        self.write_u64(n as u64);
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
    /// A descriptor sent to Envoy's rate limit service.
    Descriptor,
}

impl KeyKind {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyKind::ApiKey => "api_key",
            KeyKind::Ip => "ip",
            KeyKind::UnknownApiKey => "unknown_api_key",
            KeyKind::Descriptor => "descriptor",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_lives_in_the_slot_of_its_hex() {
        // The Redis Cluster specification's reference: CRC16 0x31C3.
        assert_eq!(cluster_slot(b"123456789"), 0x31C3);
        for key in [0, 1, 0xdead_beef, u128::MAX, 0x0123_4567_89ab_cdef << 64] {
            let key = BucketKey(key);
            assert_eq!(&key.hex()[..], key.to_string().as_bytes());
            assert_eq!(
                key.slot(),
                cluster_slot(key.to_string().as_bytes()),
                "{key}"
            );
        }
    }

    /// A bucket key is hashed to its low 64 bits, as is, with no rounds of
    /// mixing; bytes (a key that is not a keyed hash) are still told apart.
    #[test]
    fn key_bits_pass_a_bucket_keys_low_bits_through() {
        use std::hash::BuildHasher;
        let bits = BuildKeyBits::default();
        for key in [0, 1, 0xdead_beef, u128::MAX, 0x0123_4567_89ab_cdef << 64] {
            assert_eq!(bits.hash_one(BucketKey(key)), key as u64, "{key:x}");
        }
        assert_ne!(bits.hash_one("ab"), bits.hash_one("ba"));
        // A composite key hashes all its parts.
        let (a, b) = (BucketKey(1), BucketKey(2));
        assert_ne!(bits.hash_one((a, b)), bits.hash_one((a, a)));
    }
}
