//! The in-process store: every algorithm whose state fits 16 bytes, in a
//! concurrent, sharded, memory-bounded [`Table`].
//!
//! Each algorithm packs its own state ([`crate::algorithm::Packed`]): its
//! counts, and the instant from which the state is the same as none (a
//! bucket's `full_at`, a window's end). That instant is what lets the table
//! sweep idle entries exactly without knowing their limits; see [`table`]
//! for the memory bound. The sliding log, whose state grows with traffic,
//! needs Redis and is refused here by name.

pub mod table;

pub use table::{Slot, Table};

use super::{Check, CheckFuture, Checked, Source, Store, StoreError};
use crate::algorithm::{self, Decision, PackedError};
use std::time::Duration;

/// In-memory limit store. See the module documentation.
#[derive(Debug)]
pub struct MemoryStore {
    table: Table,
}

impl MemoryStore {
    /// A store holding at most about `max_keys` buckets in `shards` shards
    /// (rounded up to a power of two). Both are at least 1.
    pub fn new(max_keys: usize, shards: usize) -> Self {
        Self {
            table: Table::new(max_keys, shards),
        }
    }

    /// The synchronous decision behind [`Store::check`], for callers that
    /// can use it directly (benchmarks, the local share's tests).
    pub fn decide(&self, check: &Check) -> Result<Decision, StoreError> {
        let limit = &check.limit;
        algorithm::check_packable(limit, check.cost).map_err(refused)?;
        Ok(algorithm::decide_in(
            self.table.slot(check.key, check.now),
            limit,
            check.cost,
            check.now,
            check.ceiling,
        ))
    }

    /// [`MemoryStore::decide`] with the check's take beyond its cost
    /// ([`Check::take`]): the decision and the extra tokens granted.
    pub fn decide_taking(&self, check: &Check) -> Result<(Decision, u64), StoreError> {
        let Some(take) = check.take else {
            return self.decide(check).map(|decision| (decision, 0));
        };
        let limit = &check.limit;
        algorithm::check_packable(limit, check.cost).map_err(refused)?;
        Ok(algorithm::take_in(
            self.table.slot(check.key, check.now),
            limit,
            check.cost,
            check.now,
            check.ceiling,
            take,
        ))
    }

    /// The table the buckets live in, for layers that keep their own
    /// buckets beside the store's decisions (the failure policy's share).
    pub fn table(&self) -> &Table {
        &self.table
    }

    /// Buckets currently held (all shards; a snapshot).
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Entries evicted before they were full again (the inexact path), ever.
    pub fn pressure_evictions(&self) -> u64 {
        self.table.pressure_evictions()
    }

    /// The most buckets this store holds at once.
    pub fn capacity(&self) -> usize {
        self.table.capacity()
    }
}

/// Why the store refused a request (out of line: the hot path never needs it).
#[cold]
#[inline(never)]
fn refused(e: PackedError) -> StoreError {
    match e {
        PackedError::Cost(e) => StoreError::CostExceedsBurst(e),
        PackedError::DoesNotPack(algorithm) => StoreError::UnsupportedAlgorithm {
            backend: "memory",
            algorithm: algorithm.as_str(),
        },
    }
}

impl Store for MemoryStore {
    fn check(&self, check: Check) -> CheckFuture<'_> {
        let checked = self.decide_taking(&check).map(|(decision, extra)| Checked {
            extra,
            ..Checked::decided(decision, check.limit, Source::Memory)
        });
        CheckFuture::ready(checked)
    }

    /// Answered when called: it never waits.
    fn longest_wait(&self) -> Option<Duration> {
        Some(Duration::ZERO)
    }

    fn backend(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests;
