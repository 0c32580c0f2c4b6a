//! What the deny cache and the leases each keep per key: a map from bucket
//! keys in locked shards, bounded in size, that makes room by forgetting
//! what its owner says is stale and otherwise takes nothing new.

use crate::clock::Micros;
use crate::key::{BucketKey, BuildKeyBits};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// A power of two: the shard is the key's top `log2(SHARDS)` bits.
const SHARDS: usize = 16;
const _: () = assert!(SHARDS.is_power_of_two() && SHARDS > 1);

/// A shard's map, hashed by the key's low bits ([`BuildKeyBits`]): the
/// key is a keyed hash, uniform already.
type Shard<V> = HashMap<BucketKey, V, BuildKeyBits>;

/// A bounded per-key table of `V`, in locked shards.
#[derive(Debug)]
pub(super) struct KeyTable<V> {
    shards: Box<[Mutex<Shard<V>>]>,
    per_shard: usize,
}

impl<V> KeyTable<V> {
    /// A table of at most about `max_keys` entries.
    pub(super) fn new(max_keys: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            per_shard: max_keys.div_ceil(SHARDS).max(1),
        }
    }

    /// The shard holding `key`, locked.
    pub(super) fn shard(&self, key: BucketKey) -> MutexGuard<'_, Shard<V>> {
        // The key is a keyed hash, uniform: its high bits pick the shard,
        // its low bits (the map's hash) its place in it. Taking both from
        // the same bits would leave each shard's keys a sixteenth of its
        // map's slots.
        self.shards[(key.0 >> (128 - SHARDS.trailing_zeros())) as usize]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `shard` (of this table) has room for `key`: it holds it
    /// already, or is not full, or is no longer full once the entries
    /// `keep` refuses are dropped.
    pub(super) fn room(
        &self,
        shard: &mut Shard<V>,
        key: BucketKey,
        keep: impl FnMut(&V) -> bool,
    ) -> bool {
        if shard.len() < self.per_shard || shard.contains_key(&key) {
            return true;
        }
        let mut keep = keep;
        shard.retain(|_, v| keep(v));
        shard.len() < self.per_shard
    }

    /// Entries now (stale ones included until swept).
    pub(super) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }
}

/// A duration in microseconds, saturating.
pub(super) fn micros(d: Duration) -> Micros {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
