//! This instance's share of every limit: mirrored from Redis while Redis
//! decides, enforced while it cannot, and used to hand buckets back without
//! a fresh burst. See [`super`] for why each step exists.
//!
//! The share is a token bucket whatever the policy's algorithm (the mirror
//! and the ceiling are bucket levels), kept in an in-process store of its
//! own.

use crate::algorithm::token_bucket::BucketState;
use crate::algorithm::{Algorithm, Decision, Limit, LimitError, Mirror};
use crate::clock::Micros;
use crate::key::BucketKey;
use crate::store::memory::Table;
use crate::store::{Check, Checked, MemoryStore, Source, StoreError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The local share of `limit` among `instances`, for a request of `cost`:
/// a bucket of `max(burst / N, cost, 1)` tokens refilled at `rate / N`, so
/// N instances behind a balancer admit about the limit between them.
pub fn share(limit: &Limit, instances: u64, cost: u64) -> Limit {
    // Config validation builds every policy's share at start-up, so this
    // cannot fail at run time; the whole limit is the fallback only for a
    // limit built without that validation.
    try_share(limit, instances, cost).unwrap_or(limit.with_algorithm(Algorithm::TokenBucket))
}

/// [`share`], or why its limit cannot be represented (`burst × period × N`
/// beyond what the integer arithmetic keeps exact).
pub fn try_share(limit: &Limit, instances: u64, cost: u64) -> Result<Limit, LimitError> {
    // Whatever the policy's algorithm, the local share is a token bucket:
    // its mirror and ceiling are bucket levels.
    let limit = limit.with_algorithm(Algorithm::TokenBucket);
    if instances <= 1 {
        return Ok(limit);
    }
    // At least one token (or the cost) each: with a burst below N the fleet
    // can pass up to N of them between its local shares.
    let burst = (limit.burst() / instances).max(cost).max(1);
    // rate / (period × N), in the limit's own units: period_us is the
    // reduced period, rate_units_per_us the reduced rate.
    let period_us = limit
        .units_per_token()
        .checked_mul(instances)
        .ok_or(LimitError::TooLarge)?;
    Limit::new(
        burst,
        limit.rate_units_per_us(),
        Duration::from_micros(period_us),
    )
}

/// The tokens (in units) `key`'s bucket holds at `now` if it is not full;
/// `None` if it is full (holds no entry). Changes nothing.
fn level(table: &Table, key: BucketKey, limit: &Limit, now: Micros) -> Option<u64> {
    let packed = table.get(key).filter(|p| p.full_at > now)?;
    Some(BucketState::unpack(packed, limit).level_at(limit, now))
}

/// This instance's share of every limit. See the module docs.
#[derive(Debug)]
pub struct LocalShare {
    instances: u64,
    store: MemoryStore,
    /// Until when some local bucket may be below full: ceilings are looked
    /// up only before this instant, so the normal path costs one atomic load.
    until: AtomicU64,
    /// Until when some bucket mirrored from Redis may be below full. Not a
    /// ceiling's trigger by itself (a client Redis alone decides needs
    /// none); a fallback in any mode moves `until` here, since Redis may
    /// then come back empty for every client that had spent from it.
    mirrored_until: AtomicU64,
}

impl LocalShare {
    /// Shares for `instances` instances, in a store of `max_keys` buckets.
    pub fn new(instances: u64, max_keys: usize, shards: usize) -> Self {
        Self {
            instances,
            store: MemoryStore::new(max_keys, shards),
            until: AtomicU64::new(0),
            mirrored_until: AtomicU64::new(0),
        }
    }

    fn share(&self, check: &Check) -> Limit {
        share(&check.limit, self.instances, check.cost)
    }

    /// Keeps the local share at the shared state's level, so that losing
    /// Redis does not hand every client a fresh local burst: a bucket to
    /// the same time until full, a window to the same fraction of room left.
    pub fn mirror(&self, check: &Check, decision: &Decision) {
        let share = self.share(check);
        let cap = share.capacity_units();
        let tokens = match check.limit.algorithm().mirror() {
            Mirror::TimeToFull => {
                let reset = u64::try_from(decision.reset.as_micros()).unwrap_or(u64::MAX);
                cap - reset.saturating_mul(share.rate_units_per_us()).min(cap)
            }
            Mirror::RoomLeft => {
                let room = u128::from(decision.remaining.min(decision.limit)) * u128::from(cap)
                    / u128::from(decision.limit.max(1));
                room as u64
            }
        };
        // Full is no entry; otherwise the bucket holds `tokens` as of now.
        let next = (tokens < cap).then(|| {
            BucketState {
                tokens,
                last: check.now,
            }
            .pack(&share)
        });
        if let Some(p) = &next
            && p.full_at > self.mirrored_until.load(Ordering::Relaxed)
        {
            self.mirrored_until.fetch_max(p.full_at, Ordering::Relaxed);
        }
        self.store
            .table()
            .update(check.key, check.now, |state| *state = next);
    }

    /// The ceiling for a shared token bucket while the local one refills:
    /// the level that is full again when the local bucket is. Mirroring
    /// sets the local bucket by the same time to full, so for a client that
    /// never fell back the ceiling is the shared level itself (less one
    /// microsecond of refill, so it cannot bind by rounding), and for one
    /// that spent its local share it is what the fallback left.
    pub fn ceiling(&self, check: &Check) -> Option<u64> {
        let limit = &check.limit;
        if !limit.algorithm().takes_ceiling() || check.now >= self.until.load(Ordering::Relaxed) {
            return None;
        }
        let share = self.share(check);
        let level = level(self.store.table(), check.key, &share, check.now)?;
        let to_full = (share.capacity_units() - level.min(share.capacity_units()))
            / share.rate_units_per_us();
        let deficit = u128::from(to_full.saturating_sub(1)) * u128::from(limit.rate_units_per_us());
        Some(u128::from(limit.capacity_units()).saturating_sub(deficit) as u64)
    }

    /// Redis failed a check, whatever the mode: until every bucket mirrored
    /// so far is full again, Redis's answers carry ceilings. Redis may come
    /// back restarted empty, and a client that had spent its burst there
    /// would otherwise get a fresh one, whether or not this instance
    /// decided anything for it meanwhile (fail-open and fail-closed decide
    /// nothing; a quiet client sends nothing).
    pub fn fell_back(&self) {
        let mirrored = self.mirrored_until.load(Ordering::Relaxed);
        self.until.fetch_max(mirrored, Ordering::Relaxed);
    }

    /// Decides `check` by this instance's share alone.
    pub fn decide(&self, check: &Check) -> Result<Checked, StoreError> {
        let share = self.share(check);
        let decision = self
            .store
            .decide(&Check::new(check.key, share, check.cost, check.now))?;
        let full_at = check
            .now
            .saturating_add(u64::try_from(decision.reset.as_micros()).unwrap_or(u64::MAX));
        self.until.fetch_max(full_at, Ordering::Relaxed);
        Ok(Checked::decided(decision, share, Source::Local))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T0: Micros = 1_700_000_000_000_000;

    proptest! {
        /// A bucket mirrored from another's `reset` holds at most what the
        /// other holds, less than one microsecond's refill less, and is
        /// full again at the same instant.
        #[test]
        fn set_reset_mirrors_a_bucket_by_time_to_full(
            burst in 1u64..200,
            rate in 1u64..50,
            period in prop_oneof![Just(1_000_000u64), 1u64..5_000_000],
            spends in prop::collection::vec((0u64..3_000_000, 0u64..=3), 1..40),
        ) {
            let limit = Limit::new(burst, rate, Duration::from_micros(period)).unwrap();
            let original = MemoryStore::new(10, 1);
            // One instance: the share is the limit itself.
            let mirror = LocalShare::new(1, 10, 1);
            let key = BucketKey(3);
            let mut now = T0;
            for (dt, cost) in spends {
                now += dt;
                let check = Check::new(key, limit, cost.min(burst), now);
                let d = original.decide(&check).unwrap();
                mirror.mirror(&check, &d);
                let (a, b) = (
                    level(original.table(), key, &limit, now),
                    level(mirror.store.table(), key, &limit, now),
                );
                prop_assert_eq!(a.is_some(), b.is_some());
                if let (Some(a), Some(b)) = (a, b) {
                    prop_assert!(b <= a && a - b < limit.rate_units_per_us());
                }
                let full = now + d.reset.as_micros() as u64;
                prop_assert_eq!(level(mirror.store.table(), key, &limit, full), None);
                if full > now {
                    prop_assert!(level(mirror.store.table(), key, &limit, full - 1).is_some());
                }
            }
        }
    }
}
