//! Space-Saving (Metwally, Agrawal, El Abbadi, 2005): the heaviest keys of
//! a stream in fixed memory.
//!
//! It tracks at most `capacity` keys. A tracked key's count goes up by its
//! weight. An untracked key takes the place of the key with the smallest
//! count, and inherits that count as its possible overestimate (`error`).
//! What that buys, for a stream of total weight `N`:
//! - `count - error <= true weight <= count` for every tracked key;
//! - every key heavier than `N / capacity` is tracked;
//! - the counts add up to `N` exactly.
//!
//! The property tests in `tests.rs` hold the code to these three.
//! Finding the smallest count is a scan: the detector's capacity is small
//! (a few hundred), and a scan over one contiguous `Vec` is cheaper there
//! than keeping a heap or the paper's bucket lists up to date on every hit.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hash};

/// One tracked key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry<K, V> {
    /// The key.
    pub key: K,
    /// Its weight since it was tracked, plus `error`.
    pub count: u64,
    /// How much of `count` it may not have earned: the count of the key it
    /// replaced.
    pub error: u64,
    /// What the caller keeps beside it (made when the key is tracked).
    pub value: V,
}

impl<K, V> Entry<K, V> {
    /// The weight it certainly had (`count - error`).
    pub fn guaranteed(&self) -> u64 {
        self.count - self.error
    }
}

/// The summary: at most `capacity` keys, indexed by a map hashed with
/// `S` (std's SipHash unless the keys are uniform already, as bucket keys
/// are: [`crate::key::BuildKeyBits`]).
#[derive(Debug, Clone)]
pub struct SpaceSaving<K, V, S = RandomState> {
    capacity: usize,
    entries: Vec<Entry<K, V>>,
    index: HashMap<K, usize, S>,
    total: u64,
}

impl<K: Hash + Eq + Copy, V, S: BuildHasher + Default> SpaceSaving<K, V, S> {
    /// A summary tracking at most `capacity` keys (at least one).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            capacity,
            entries: Vec::with_capacity(capacity),
            index: HashMap::with_capacity_and_hasher(capacity, S::default()),
            total: 0,
        }
    }

    /// Counts `weight` for `key`; `make` gives the value of a key that
    /// starts being tracked (a replaced key's value is dropped). Returns the
    /// key's entry.
    pub fn offer(&mut self, key: K, weight: u64, make: impl FnOnce() -> V) -> &mut Entry<K, V> {
        self.total += weight;
        let at = match self.index.get(&key) {
            Some(&at) => {
                self.entries[at].count += weight;
                at
            }
            None if self.entries.len() < self.capacity => {
                self.entries.push(Entry {
                    key,
                    count: weight,
                    error: 0,
                    value: make(),
                });
                self.index.insert(key, self.entries.len() - 1);
                self.entries.len() - 1
            }
            None => {
                let (at, smallest) = self
                    .entries
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, e)| e.count)
                    .map(|(at, e)| (at, e.count))
                    .expect("a full summary has entries");
                let replaced = std::mem::replace(
                    &mut self.entries[at],
                    Entry {
                        key,
                        count: smallest + weight,
                        error: smallest,
                        value: make(),
                    },
                );
                self.index.remove(&replaced.key);
                self.index.insert(key, at);
                at
            }
        };
        &mut self.entries[at]
    }

    /// The `n` entries with the largest guaranteed weight, largest first.
    pub fn top(&self, n: usize) -> Vec<&Entry<K, V>> {
        let mut all: Vec<_> = self.entries.iter().collect();
        all.sort_by(|a, b| {
            b.guaranteed()
                .cmp(&a.guaranteed())
                .then(b.count.cmp(&a.count))
        });
        all.truncate(n);
        all
    }

    /// The entry of `key`, if tracked.
    pub fn get(&self, key: &K) -> Option<&Entry<K, V>> {
        self.index.get(key).map(|&at| &self.entries[at])
    }

    /// The total weight offered (`N`).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// How many keys it may track.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets everything, keeping the memory.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.index.clear();
        self.total = 0;
    }
}
