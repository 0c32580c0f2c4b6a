//! A concurrent, sharded, memory-bounded map from bucket keys to packed
//! states: what the in-process store and the failure policy's local share
//! both keep their buckets in.
//!
//! Entries live in `shards` hash maps, each behind its own
//! `std::sync::Mutex` (not a tokio one: nothing awaits while it is held, and
//! the critical section is a hash lookup and a few integer operations). The
//! shard is chosen from the key's high bits and the map hashes its low bits:
//! keys are keyed hashes already, so hashing them again would be wasted
//! work, and a client cannot aim many keys at one shard.
//!
//! # Memory bound
//! No entry means a state equal to none (a full bucket, an expired window).
//! An entry past its `full_at` is therefore equivalent to no entry and can
//! be dropped without changing any decision (for a clock that does not step
//! back; after a backward step a forgotten bucket's waits can be shorter by
//! that step). When a shard reaches its share of `max_keys`, it first
//! sweeps such idle entries. Only if that frees less than an eighth of the
//! shard does it evict the entries closest to `full_at`: those grant the
//! least extra quota when forgotten. That second kind of eviction is the one
//! inexact path and is counted separately
//! (`ratelimit_memory_evictions_total{reason="pressure"}`), so an undersized
//! `max_keys` shows on the dashboard instead of silently loosening limits.

use crate::algorithm::{Packed, PackedSlot};
use crate::clock::Micros;
use crate::key::{BucketKey, BuildKeyBits};
use crate::metrics as m;
use std::collections::HashMap;
use std::hash::Hasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// A [`BucketKey`] as two `u64`s: 8-byte aligned (a `u128` is 16), so a map
/// slot is 32 bytes instead of 48 and more of the map stays in cache: two
/// slots to a cache line, none straddling two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SlotKey {
    hi: u64,
    lo: u64,
}

impl From<BucketKey> for SlotKey {
    fn from(key: BucketKey) -> Self {
        Self {
            hi: (key.0 >> 64) as u64,
            lo: key.0 as u64,
        }
    }
}

impl std::hash::Hash for SlotKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The low half of a keyed hash is already uniform (module docs).
        state.write_u64(self.lo);
    }
}

/// Hashed by the key's low bits ([`BuildKeyBits`]; module docs).
type Map = HashMap<SlotKey, Packed, BuildKeyBits>;

/// The table. See the module documentation.
#[derive(Debug)]
pub struct Table {
    shards: Box<[Mutex<Map>]>,
    shard_bits: u32,
    per_shard: usize,
    pressure_evictions: AtomicU64,
}

impl Table {
    /// A table holding at most about `max_keys` entries in `shards` shards
    /// (rounded up to a power of two). Both are at least 1.
    pub fn new(max_keys: usize, shards: usize) -> Self {
        let shards = shards.max(1).next_power_of_two();
        let per_shard = max_keys.max(1).div_ceil(shards);
        Self {
            shards: (0..shards).map(|_| Mutex::new(Map::default())).collect(),
            shard_bits: shards.trailing_zeros(),
            per_shard,
            pressure_evictions: AtomicU64::new(0),
        }
    }

    fn shard(&self, key: SlotKey) -> MutexGuard<'_, Map> {
        let index = if self.shard_bits == 0 {
            0
        } else {
            (key.hi >> (64 - self.shard_bits)) as usize
        };
        // Poisoning cannot leave a map half-updated (every update is one
        // assignment, insert or remove), so a poisoned lock is safe to use.
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `decide` on `key`'s entry under its shard's lock: it reads the
    /// entry (`None`: no entry) and leaves in it what to keep (`None`: no
    /// entry). `now` is for sweeping when a new entry needs room.
    ///
    /// The common case, a known key, takes one probe and updates in place.
    #[inline]
    pub fn update<R>(
        &self,
        key: BucketKey,
        now: Micros,
        decide: impl FnOnce(&mut Option<Packed>) -> R,
    ) -> R {
        let slot = SlotKey::from(key);
        let mut map = self.shard(slot);
        let entry = map.get_mut(&slot);
        let mut kept = entry.as_deref().copied();
        // One call site, so the decision inlines here.
        let result = decide(&mut kept);
        match (entry, kept) {
            // A denial changes nothing: leave the line clean (most checks
            // under attack are denials, and 10k keys outgrow the cache).
            (Some(entry), Some(next)) => {
                if *entry != next {
                    *entry = next;
                }
            }
            (Some(_), None) => {
                map.remove(&slot);
            }
            (None, Some(next)) => {
                if map.len() >= self.per_shard {
                    let pressure = make_room(&mut map, self.per_shard, now);
                    if pressure > 0 {
                        self.pressure_evictions
                            .fetch_add(pressure, Ordering::Relaxed);
                    }
                }
                map.insert(slot, next);
            }
            (None, None) => {}
        }
        result
    }

    /// `key`'s entry as a slot for [`crate::algorithm::decide_in`], which
    /// [`Table::update`]s it at `now`.
    #[inline]
    pub fn slot(&self, key: BucketKey, now: Micros) -> Slot<'_> {
        Slot {
            table: self,
            key,
            now,
        }
    }

    /// `key`'s entry, if any. Changes nothing.
    pub fn get(&self, key: BucketKey) -> Option<Packed> {
        let slot = SlotKey::from(key);
        self.shard(slot).get(&slot).copied()
    }

    /// Entries currently held (all shards; a snapshot).
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entries evicted before their `full_at` (the inexact path), ever.
    pub fn pressure_evictions(&self) -> u64 {
        self.pressure_evictions.load(Ordering::Relaxed)
    }

    /// The most entries this table holds at once.
    pub fn capacity(&self) -> usize {
        self.per_shard * self.shards.len()
    }
}

/// One key's entry in a [`Table`], at an instant: see [`Table::slot`].
#[derive(Debug, Clone, Copy)]
pub struct Slot<'a> {
    table: &'a Table,
    key: BucketKey,
    now: Micros,
}

impl PackedSlot for Slot<'_> {
    #[inline(always)]
    fn update<R>(self, step: impl FnOnce(&mut Option<Packed>) -> R) -> R {
        self.table.update(self.key, self.now, step)
    }
}

/// Frees at least an eighth of a full shard: idle entries first (exact),
/// then those closest to `full_at`. Returns how many of the latter
/// (pressure evictions) it made.
fn make_room(map: &mut Map, per_shard: usize, now: Micros) -> u64 {
    let want_free = (per_shard / 8).max(1);
    let before = map.len();
    map.retain(|_, e| e.full_at > now);
    let idle = before - map.len();
    if idle > 0 {
        metrics::counter!(m::MEMORY_EVICTIONS_TOTAL, "reason" => "idle").increment(idle as u64);
    }
    let target = per_shard.saturating_sub(want_free);
    if map.len() > target {
        let excess = map.len() - target;
        let mut by_full_at: Vec<(Micros, SlotKey)> =
            map.iter().map(|(k, e)| (e.full_at, *k)).collect();
        by_full_at.select_nth_unstable_by_key(excess - 1, |(full_at, _)| *full_at);
        for (_, key) in &by_full_at[..excess] {
            map.remove(key);
        }
        metrics::counter!(m::MEMORY_EVICTIONS_TOTAL, "reason" => "pressure")
            .increment(excess as u64);
        return excess as u64;
    }
    0
}
