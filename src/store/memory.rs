//! The in-process store: concurrent, sharded, memory bounded.
//!
//! Buckets live in `shards` hash maps, each behind its own `std::sync::Mutex`
//! (not a tokio one: nothing awaits while it is held, and the critical
//! section is a hash lookup and a few integer operations). The shard is chosen
//! from the key's high bits and the map hashes its low bits: keys are keyed
//! hashes already, so hashing them again would be wasted work, and a client
//! cannot aim many keys at one shard.
//!
//! # Memory bound
//! No entry means a full bucket. An entry whose bucket has refilled to full
//! (`now >= full_at`) is therefore equivalent to no entry and can be dropped
//! without changing any decision (for a clock that does not step back; after
//! a backward step a forgotten bucket's waits can be shorter by that step). When a shard reaches its share of
//! `max_keys`, it first sweeps such idle entries. Only if that frees less than
//! an eighth of the shard does it evict the entries closest to full (earliest
//! `full_at`): those grant the least extra quota when forgotten. That second
//! kind of eviction is the one inexact path and is counted separately
//! (`ratelimit_memory_evictions_total{reason="pressure"}`), so an undersized
//! `max_keys` shows on the dashboard instead of silently loosening limits.

use super::{BoxFuture, BucketKey, Store, StoreError};
use crate::bucket::{self, BucketState, CostExceedsBurst, Decision, Limit};
use crate::clock::Micros;
use crate::metrics as m;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// A [`BucketKey`] as two `u64`s: 8-byte aligned (a `u128` is 16), so a map
/// slot is 40 bytes instead of 48 and more of the map stays in cache.
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

/// Passes a [`SlotKey`]'s low 64 bits through (see the module docs).
#[derive(Default)]
struct KeyBitsHasher(u64);

impl Hasher for KeyBitsHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached if a non-u128 type is hashed with this hasher; fold
        // the bytes in so it still works, if slowly.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A bucket as stored: its tokens and the instant it is full again.
///
/// The core's state is `(tokens, last)`. Storing `full_at` instead of
/// `last` lets a sweep recognise idle entries without knowing their limit
/// (`now >= full_at`), and `last` is recovered exactly from the limit that
/// every check passes in, because `full_at = last + ceil(deficit / rate)`.
/// Sixteen bytes, so a slot with its key is 32: two to a cache line, none
/// straddling two.
#[derive(Debug, Clone, Copy)]
struct Entry {
    tokens: u64,
    full_at: Micros,
}

impl Entry {
    fn new(state: BucketState, decision: &Decision, now: Micros) -> Self {
        // Whole microseconds: `reset` is built from them, so nothing is lost.
        // `now + reset` is `last + ceil(deficit / rate)` (see `bucket::check`).
        let reset = decision.reset;
        let wait = reset.as_secs().saturating_mul(1_000_000) + u64::from(reset.subsec_micros());
        Self {
            tokens: state.tokens,
            full_at: now.saturating_add(wait),
        }
    }

    fn state(&self, limit: &Limit) -> BucketState {
        let deficit = limit.capacity_units().saturating_sub(self.tokens);
        let rate = limit.rate_units_per_us();
        let refill = if rate == 1 {
            deficit
        } else {
            deficit.div_ceil(rate)
        };
        BucketState {
            tokens: self.tokens,
            last: self.full_at.saturating_sub(refill),
        }
    }
}

type Map = HashMap<SlotKey, Entry, BuildHasherDefault<KeyBitsHasher>>;

/// Reads an algorithm's state from an entry (given the window length).
type ToState = fn(&Entry, u64) -> crate::algorithm::State;
/// Packs an algorithm's state into an entry (`None`: another algorithm's).
type ToEntry = fn(&crate::algorithm::State, u64) -> Option<Entry>;

/// In-memory bucket store. See the module documentation.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Mutex<Map>]>,
    shard_bits: u32,
    per_shard: usize,
    pressure_evictions: AtomicU64,
}

impl MemoryStore {
    /// A store holding at most about `max_keys` buckets in `shards` shards
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

    fn shard(&self, key: SlotKey) -> &Mutex<Map> {
        let index = if self.shard_bits == 0 {
            0
        } else {
            (key.hi >> (64 - self.shard_bits)) as usize
        };
        &self.shards[index]
    }

    /// The synchronous check behind [`Store::check`].
    pub fn check_sync(
        &self,
        key: BucketKey,
        limit: &Limit,
        cost: u64,
        now: Micros,
    ) -> Result<Decision, CostExceedsBurst> {
        self.check_sync_within(key, limit, cost, now, u64::MAX)
    }

    /// [`MemoryStore::check_sync`] with a ceiling in units (see
    /// [`bucket::check_within`]).
    pub fn check_sync_within(
        &self,
        key: BucketKey,
        limit: &Limit,
        cost: u64,
        now: Micros,
        ceiling: u64,
    ) -> Result<Decision, CostExceedsBurst> {
        let key = SlotKey::from(key);
        // Poisoning cannot leave a map half-updated (every update is one
        // assignment, insert or remove), so a poisoned lock is safe to use.
        let mut map = self
            .shard(key)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // The common case, a known key, takes one probe and updates in place.
        if let Some(entry) = map.get_mut(&key) {
            let (decision, state) =
                bucket::check_within(limit, Some(entry.state(limit)), cost, now, ceiling)?;
            if !decision.allowed {
                // A denial changes nothing (see `bucket::check`).
                return Ok(decision);
            }
            if !decision.reset.is_zero() {
                *entry = Entry::new(state, &decision, now);
                return Ok(decision);
            }
            // Full again: the same as no entry, so keep none.
            map.remove(&key);
            return Ok(decision);
        }
        let (decision, state) = bucket::check_within(limit, None, cost, now, ceiling)?;
        if !decision.reset.is_zero() {
            if map.len() >= self.per_shard {
                let pressure = make_room(&mut map, self.per_shard, now);
                if pressure > 0 {
                    self.pressure_evictions
                        .fetch_add(pressure, Ordering::Relaxed);
                }
            }
            map.insert(key, Entry::new(state, &decision, now));
        }
        Ok(decision)
    }

    /// Decides with the limit's algorithm: the token bucket, GCRA, the
    /// fixed window and the sliding-window counter live here (the log, whose
    /// state grows with traffic, needs Redis).
    ///
    /// Each keeps the same 16-byte entry, with `full_at` the instant its
    /// state is the same as no state (GCRA: the TAT; fixed window: the
    /// window's end; counter: the end of the next window), so idle sweeping
    /// and pressure eviction work unchanged.
    pub fn check_algorithm(
        &self,
        key: BucketKey,
        limit: &Limit,
        cost: u64,
        now: Micros,
        ceiling: Option<u64>,
    ) -> Result<Decision, StoreError> {
        use crate::algorithm::fixed_window::FixedState;
        use crate::algorithm::gcra::GcraState;
        use crate::algorithm::sliding_window::CounterState;
        use crate::algorithm::{self, Algorithm, State, Window};
        let algorithm_name = limit.algorithm().as_str();
        let unsupported = || StoreError::UnsupportedAlgorithm {
            backend: "memory",
            algorithm: algorithm_name,
        };
        let w = Window::of(limit).window_us;
        let (to_state, to_entry): (ToState, ToEntry) = match limit.algorithm() {
            Algorithm::TokenBucket => {
                return self
                    .check_sync_within(key, limit, cost, now, ceiling.unwrap_or(u64::MAX))
                    .map_err(StoreError::from);
            }
            Algorithm::SlidingLog => return Err(unsupported()),
            // Two counts packed in the entry's 64 bits.
            Algorithm::SlidingWindow if limit.burst() > u64::from(u32::MAX) => {
                return Err(unsupported());
            }
            Algorithm::Gcra => (
                |e, _| {
                    State::Gcra(GcraState {
                        tat: e.full_at,
                        rem: e.tokens,
                    })
                },
                |s, _| match s {
                    State::Gcra(g) => Some(Entry {
                        tokens: g.rem,
                        full_at: g.tat,
                    }),
                    _ => None,
                },
            ),
            Algorithm::FixedWindow => (
                |e, w| {
                    // A store lives as long as its config: one window length.
                    State::Fixed(FixedState {
                        index: e.full_at / w - 1,
                        count: e.tokens,
                        window_us: w,
                    })
                },
                |s, w| match s {
                    State::Fixed(f) => Some(Entry {
                        tokens: f.count,
                        full_at: (f.index + 1) * w,
                    }),
                    _ => None,
                },
            ),
            Algorithm::SlidingWindow => (
                |e, w| {
                    State::Counter(CounterState {
                        index: e.full_at / w - 2,
                        cur: e.tokens >> 32,
                        prev: e.tokens & u64::from(u32::MAX),
                        window_us: w,
                    })
                },
                |s, w| match s {
                    State::Counter(c) => Some(Entry {
                        tokens: (c.cur << 32) | c.prev,
                        full_at: (c.index + 2) * w,
                    }),
                    _ => None,
                },
            ),
        };
        let slot = SlotKey::from(key);
        let mut map = self
            .shard(slot)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // An entry past its `full_at` is the same as none on a clock that
        // does not step back; it is read as stored (the sweep drops it), so
        // a step back into its window still finds it, as in Redis.
        let state = map.get(&slot).map(|e| to_state(e, w));
        let (decision, next) = algorithm::check(limit, state, cost, now)?;
        match next.as_ref().and_then(|s| to_entry(s, w)) {
            None => {
                map.remove(&slot);
            }
            Some(entry) => {
                if let Some(existing) = map.get_mut(&slot) {
                    *existing = entry;
                } else {
                    if map.len() >= self.per_shard {
                        let pressure = make_room(&mut map, self.per_shard, now);
                        if pressure > 0 {
                            self.pressure_evictions
                                .fetch_add(pressure, Ordering::Relaxed);
                        }
                    }
                    map.insert(slot, entry);
                }
            }
        }
        Ok(decision)
    }

    /// Sets bucket `key` to the level that is full again `reset` after `now`
    /// (`capacity - reset × rate`, so its `full_at` is exactly `now + reset`);
    /// a zero `reset` removes it (full). How the local fallback mirrors a
    /// shared token bucket: on losing Redis it starts where Redis left off.
    pub fn set_reset(&self, key: BucketKey, limit: &Limit, reset_us: u64, now: Micros) {
        let cap = limit.capacity_units();
        let tokens = cap - reset_us.saturating_mul(limit.rate_units_per_us()).min(cap);
        self.set_level(key, limit, tokens, now);
    }

    /// Sets bucket `key` to hold `tokens` units at `now` (full: no entry).
    pub fn set_level(&self, key: BucketKey, limit: &Limit, tokens: u64, now: Micros) {
        let key = SlotKey::from(key);
        let mut map = self
            .shard(key)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let cap = limit.capacity_units();
        if tokens >= cap {
            map.remove(&key);
            return;
        }
        let rate = limit.rate_units_per_us();
        let entry = Entry {
            tokens,
            full_at: now.saturating_add((cap - tokens).div_ceil(rate)),
        };
        if let Some(slot) = map.get_mut(&key) {
            *slot = entry;
            return;
        }
        if map.len() >= self.per_shard {
            let pressure = make_room(&mut map, self.per_shard, now);
            if pressure > 0 {
                self.pressure_evictions
                    .fetch_add(pressure, Ordering::Relaxed);
            }
        }
        map.insert(key, entry);
    }

    /// The tokens (in units) bucket `key` holds at `now` if it is not full;
    /// `None` if it is full (holds no entry). Changes nothing.
    pub fn level(&self, key: BucketKey, limit: &Limit, now: Micros) -> Option<u64> {
        let key = SlotKey::from(key);
        let map = self
            .shard(key)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let entry = map.get(&key)?;
        if entry.full_at <= now {
            return None;
        }
        let state = entry.state(limit);
        let cap = limit.capacity_units();
        let refill = now
            .saturating_sub(state.last)
            .saturating_mul(limit.rate_units_per_us());
        Some(state.tokens.min(cap).saturating_add(refill).min(cap))
    }

    /// Buckets currently held (all shards; a snapshot).
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entries evicted before they were full again (the inexact path), ever.
    pub fn pressure_evictions(&self) -> u64 {
        self.pressure_evictions.load(Ordering::Relaxed)
    }

    /// The most buckets this store holds at once.
    pub fn capacity(&self) -> usize {
        self.per_shard * self.shards.len()
    }
}

/// Frees at least an eighth of a full shard: idle entries first (exact),
/// then those closest to full. Returns how many of the latter (pressure
/// evictions) it made.
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

impl Store for MemoryStore {
    fn check_within(
        &self,
        key: BucketKey,
        limit: Limit,
        cost: u64,
        now: Micros,
        ceiling: Option<u64>,
    ) -> BoxFuture<'_, Result<Decision, StoreError>> {
        Box::pin(std::future::ready(
            self.check_algorithm(key, &limit, cost, now, ceiling),
        ))
    }

    fn backend(&self) -> &'static str {
        "memory"
    }

    fn in_process(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    const T0: Micros = 1_700_000_000_000_000;

    fn limit() -> Limit {
        Limit::per_second(10, 5).unwrap()
    }

    proptest! {
        /// A bucket set from another's `reset` holds at most what the other
        /// holds, less than one microsecond's refill less, and is full again
        /// at the same instant.
        #[test]
        fn set_reset_mirrors_a_bucket_by_time_to_full(
            burst in 1u64..200,
            rate in 1u64..50,
            period in prop_oneof![Just(1_000_000u64), 1u64..5_000_000],
            spends in prop::collection::vec((0u64..3_000_000, 0u64..=3), 1..40),
        ) {
            let limit = Limit::new(burst, rate, std::time::Duration::from_micros(period)).unwrap();
            let original = MemoryStore::new(10, 1);
            let mirror = MemoryStore::new(10, 1);
            let key = BucketKey(3);
            let mut now = T0;
            for (dt, cost) in spends {
                now += dt;
                let d = original.check_sync(key, &limit, cost.min(burst), now).unwrap();
                mirror.set_reset(key, &limit, d.reset.as_micros() as u64, now);
                let (a, b) = (original.level(key, &limit, now), mirror.level(key, &limit, now));
                prop_assert_eq!(a.is_some(), b.is_some());
                if let (Some(a), Some(b)) = (a, b) {
                    prop_assert!(b <= a && a - b < limit.rate_units_per_us());
                }
                let full = now + d.reset.as_micros() as u64;
                prop_assert_eq!(mirror.level(key, &limit, full), None);
                if full > now {
                    prop_assert!(mirror.level(key, &limit, full - 1).is_some());
                }
            }
        }
    }

    #[test]
    fn keys_are_independent() {
        let store = MemoryStore::new(1000, 4);
        for _ in 0..10 {
            assert!(
                store
                    .check_sync(BucketKey(1), &limit(), 1, T0)
                    .unwrap()
                    .allowed
            );
        }
        assert!(
            !store
                .check_sync(BucketKey(1), &limit(), 1, T0)
                .unwrap()
                .allowed
        );
        assert!(
            store
                .check_sync(BucketKey(2), &limit(), 1, T0)
                .unwrap()
                .allowed
        );
    }

    proptest! {
        /// GCRA, fixed window and sliding-window counter in memory decide
        /// exactly as their pure cores, backward steps included (entries
        /// past their `full_at` read as absent).
        #[test]
        fn other_algorithms_match_their_pure_cores(
            rate in 1u64..20,
            period_ms in 1u64..5_000,
            burst in 1u64..50,
            ops in prop::collection::vec((0u64..=3, -2_000_000i64..3_000_000, 0u128..3), 1..200)
        ) {
            use crate::algorithm::{self, Algorithm};
            for a in [Algorithm::Gcra, Algorithm::FixedWindow, Algorithm::SlidingWindow] {
                let limit = Limit::new(burst, rate, std::time::Duration::from_millis(period_ms))
                    .unwrap()
                    .with_algorithm(a);
                let roomy = MemoryStore::new(64, 1);
                let mut states = [None, None, None];
                let mut now = T0 as i64;
                for &(cost, dt, k) in &ops {
                    now += dt;
                    let cost = cost.min(burst);
                    let state = &mut states[k as usize];
                    let (expected, next) = algorithm::check(&limit, state.take(), cost, now as u64).unwrap();
                    *state = next;
                    let got = roomy.check_algorithm(BucketKey(k), &limit, cost, now as u64, None).unwrap();
                    prop_assert_eq!(got, expected, "{:?} now={} cost={} key={}", a, now, cost, k);
                }
            }
        }
    }

    #[test]
    fn the_log_is_refused_in_memory_by_name() {
        use crate::algorithm::Algorithm;
        let store = MemoryStore::new(10, 1);
        let limit = limit().with_algorithm(Algorithm::SlidingLog);
        let err = store
            .check_algorithm(BucketKey(1), &limit, 1, T0, None)
            .unwrap_err();
        assert_eq!(err.kind(), "unsupported_algorithm");
    }

    #[test]
    fn full_buckets_hold_no_entry() {
        let store = MemoryStore::new(1000, 4);
        store.check_sync(BucketKey(7), &limit(), 0, T0).unwrap();
        assert!(store.is_empty(), "a peek at a full bucket stored something");
        store.check_sync(BucketKey(7), &limit(), 1, T0).unwrap();
        assert_eq!(store.len(), 1);
        // 1 token at 5/s is back after 200 ms: the entry goes.
        store
            .check_sync(BucketKey(7), &limit(), 0, T0 + 200_000)
            .unwrap();
        assert!(store.is_empty());
    }

    #[test]
    fn concurrent_checks_never_over_admit() {
        let store = Arc::new(MemoryStore::new(1000, 8));
        let limit = Limit::per_second(1000, 1).unwrap();
        let admitted: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    let store = &store;
                    s.spawn(move || {
                        (0..600)
                            .filter(|_| {
                                store
                                    .check_sync(BucketKey(9), &limit, 1, T0)
                                    .unwrap()
                                    .allowed
                            })
                            .count()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(admitted, 1000);
    }

    #[test]
    fn memory_stays_bounded_under_many_keys() {
        let store = MemoryStore::new(256, 4);
        for k in 0..10_000u128 {
            // Spread keys over shards like real keyed hashes do.
            let key = BucketKey(k.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835));
            store.check_sync(key, &limit(), 1, T0).unwrap();
        }
        assert!(
            store.len() <= store.capacity(),
            "{} > {}",
            store.len(),
            store.capacity()
        );
        assert!(
            store.pressure_evictions() > 0,
            "10k live buckets in 256 slots must evict"
        );
    }

    proptest! {
        /// The stored form loses nothing: one key through the store answers
        /// exactly like the pure core fed its own states, for any spacing
        /// (backwards steps included) and any rate, given the store's one
        /// rule that a full bucket is kept as no entry. (With a clock that
        /// steps back, forgetting a full bucket forgets the later instant it
        /// was seen at, so a wait can be shorter by at most that step.)
        #[test]
        fn store_matches_the_pure_core(
            rate in 1u64..20,
            period_ms in 1u64..5_000,
            burst in 1u64..50,
            ops in prop::collection::vec((0u64..=3, -2_000_000i64..3_000_000), 1..300)
        ) {
            let limit = Limit::new(burst, rate, std::time::Duration::from_millis(period_ms)).unwrap();
            let store = MemoryStore::new(16, 1);
            let mut state = None;
            let mut now = T0 as i64;
            for (cost, dt) in ops {
                now += dt;
                let cost = cost.min(burst);
                let (expected, next) = bucket::check(&limit, state, cost, now as u64).unwrap();
                state = (!expected.reset.is_zero()).then_some(next);
                prop_assert_eq!(store.check_sync(BucketKey(5), &limit, cost, now as u64).unwrap(), expected);
            }
        }

        /// Evicting idle (full-again) entries never changes a decision: a
        /// small store that must sweep often answers exactly like a store
        /// large enough never to evict, for as long as it has not had to
        /// evict a bucket that was still refilling.
        #[test]
        fn idle_eviction_changes_no_decision(
            ops in prop::collection::vec((0u128..24, 0u64..3, 0u64..120_000), 1..400)
        ) {
            // Burst 2 at 10/s: a bucket is full again at most 200 ms after
            // its last spend, so many of the 24 keys go idle between uses.
            let limit = Limit::per_second(2, 10).unwrap();
            let small = MemoryStore::new(16, 1);
            let big = MemoryStore::new(1 << 20, 1);
            let mut now = T0;
            for (k, cost, dt) in ops {
                now += dt;
                let key = BucketKey(k);
                let a = small.check_sync(key, &limit, cost, now).unwrap();
                let b = big.check_sync(key, &limit, cost, now).unwrap();
                if small.pressure_evictions() > 0 {
                    break;
                }
                prop_assert_eq!(a, b);
            }
        }
    }

    #[test]
    fn sweep_removes_only_idle_entries_and_keeps_decisions() {
        // 8 slots, one shard. Fill 7 with spent buckets that refill in
        // 200 ms, and one that refills in 10 s.
        let store = MemoryStore::new(8, 1);
        let fast = Limit::per_second(1, 5).unwrap();
        let slow_limit = Limit::new(1, 1, std::time::Duration::from_secs(10)).unwrap();
        for k in 0..7 {
            store.check_sync(BucketKey(k), &fast, 1, T0).unwrap();
        }
        store
            .check_sync(BucketKey(100), &slow_limit, 1, T0)
            .unwrap();
        assert_eq!(store.len(), 8);
        // 1 s later the fast ones are full (idle); a new key forces a sweep.
        store
            .check_sync(BucketKey(200), &fast, 1, T0 + 1_000_000)
            .unwrap();
        assert_eq!(store.len(), 2, "only the idle entries should have gone");
        // The slow bucket kept its state: still empty.
        assert!(
            !store
                .check_sync(BucketKey(100), &slow_limit, 1, T0 + 1_000_000)
                .unwrap()
                .allowed
        );
    }
}
