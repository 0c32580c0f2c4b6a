use super::*;
use crate::algorithm::{Limit, token_bucket};
use crate::clock::Micros;
use crate::key::BucketKey;
use proptest::prelude::*;
use std::sync::Arc;

const T0: Micros = 1_700_000_000_000_000;

fn limit() -> Limit {
    Limit::per_second(10, 5).unwrap()
}

#[test]
fn keys_are_independent() {
    let store = MemoryStore::new(1000, 4);
    for _ in 0..10 {
        assert!(
            store
                .decide(&Check::new(BucketKey(1), limit(), 1, T0))
                .unwrap()
                .allowed
        );
    }
    assert!(
        !store
            .decide(&Check::new(BucketKey(1), limit(), 1, T0))
            .unwrap()
            .allowed
    );
    assert!(
        store
            .decide(&Check::new(BucketKey(2), limit(), 1, T0))
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
                let got = roomy.decide(&Check::new(BucketKey(k), limit, cost, now as u64)).unwrap();
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
        .decide(&Check::new(BucketKey(1), limit, 1, T0))
        .unwrap_err();
    assert_eq!(err.kind(), "unsupported_algorithm");
}

#[test]
fn full_buckets_hold_no_entry() {
    let store = MemoryStore::new(1000, 4);
    store
        .decide(&Check::new(BucketKey(7), limit(), 0, T0))
        .unwrap();
    assert!(store.is_empty(), "a peek at a full bucket stored something");
    store
        .decide(&Check::new(BucketKey(7), limit(), 1, T0))
        .unwrap();
    assert_eq!(store.len(), 1);
    // 1 token at 5/s is back after 200 ms: the entry goes.
    store
        .decide(&Check::new(BucketKey(7), limit(), 0, T0 + 200_000))
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
                                .decide(&Check::new(BucketKey(9), limit, 1, T0))
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
        store.decide(&Check::new(key, limit(), 1, T0)).unwrap();
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
            let (expected, next) = token_bucket::check(&limit, state, cost, now as u64).unwrap();
            state = (!expected.reset.is_zero()).then_some(next);
            prop_assert_eq!(store.decide(&Check::new(BucketKey(5), limit, cost, now as u64)).unwrap(), expected);
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
            let a = small.decide(&Check::new(key, limit, cost, now)).unwrap();
            let b = big.decide(&Check::new(key, limit, cost, now)).unwrap();
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
        store
            .decide(&Check::new(BucketKey(k), fast, 1, T0))
            .unwrap();
    }
    store
        .decide(&Check::new(BucketKey(100), slow_limit, 1, T0))
        .unwrap();
    assert_eq!(store.len(), 8);
    // 1 s later the fast ones are full (idle); a new key forces a sweep.
    store
        .decide(&Check::new(BucketKey(200), fast, 1, T0 + 1_000_000))
        .unwrap();
    assert_eq!(store.len(), 2, "only the idle entries should have gone");
    // The slow bucket kept its state: still empty.
    assert!(
        !store
            .decide(&Check::new(BucketKey(100), slow_limit, 1, T0 + 1_000_000))
            .unwrap()
            .allowed
    );
}
