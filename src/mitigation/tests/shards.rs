//! Key sharding against one exact bucket: a key split over sub-buckets
//! never admits more than the whole, and its sub-keys spread over slots.

use super::*;
use crate::key::SLOTS;
use crate::mitigation::{MAX_SHARDS, Sharded, shard_key, shard_limit};

/// A token-bucket or GCRA limit with at least `shards` tokens.
fn case() -> impl Strategy<Value = (Limit, u16, usize, Vec<(usize, u64, u64)>)> {
    (2u16..=5, 1usize..=3).prop_flat_map(|(shards, instances)| {
        (
            (
                prop::sample::select(vec![Algorithm::TokenBucket, Algorithm::Gcra]),
                u64::from(shards)..=60,
                1u64..=20,
                prop_oneof![Just(1_000_000u64), 1_000u64..=3_000_000],
            )
                .prop_map(|(a, b, r, p)| {
                    Limit::new(b, r, Duration::from_micros(p))
                        .unwrap()
                        .with_algorithm(a)
                }),
            Just(shards),
            Just(instances),
            requests(3, 1),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Sub-bucket `i` is a pure function of (key, i, S), lands in the
    /// middle half of the i-th S-th of the slots, and no two coincide.
    #[test]
    fn sub_buckets_are_fixed_and_land_on_their_own_part_of_the_slots(
        key in any::<u128>(),
        shards in 2u16..=MAX_SHARDS,
    ) {
        let width = SLOTS as u16 / shards;
        let subs: Vec<BucketKey> = (0..shards).map(|i| shard_key(BucketKey(key), i, shards)).collect();
        for (i, sub) in subs.iter().enumerate() {
            let i = i as u16;
            prop_assert_eq!(*sub, shard_key(BucketKey(key), i, shards));
            let slot = sub.slot();
            prop_assert!(
                (i * width + width / 4..i * width + width / 4 + width / 2).contains(&slot),
                "sub-bucket {} of {}: slot {}", i, shards, slot
            );
            prop_assert_ne!(*sub, BucketKey(key));
        }
    }

    /// Sub-buckets hold at most the burst between them and refill at
    /// exactly the rate.
    #[test]
    fn sub_limits_add_up_to_no_more_than_the_limit(
        burst in 1u64..=1_000_000,
        rate in 1u64..=1_000,
        period in 1u64..=100_000_000,
        shards in 1u16..=MAX_SHARDS,
    ) {
        prop_assume!(burst >= u64::from(shards));
        let Ok(limit) = Limit::new(burst, rate, Duration::from_micros(period)) else {
            return Ok(());
        };
        let sub = shard_limit(&limit, shards).unwrap();
        let s = u128::from(shards);
        prop_assert!(u128::from(sub.burst()) * s <= u128::from(burst));
        prop_assert!(u128::from(sub.burst()) * s > u128::from(burst) - s);
        // rate/period = S × sub-rate/sub-period, as exact fractions.
        prop_assert_eq!(
            u128::from(limit.rate_units_per_us()) * u128::from(sub.units_per_token()),
            s * u128::from(sub.rate_units_per_us()) * u128::from(limit.units_per_token())
        );
    }

    /// Whatever the interleaving, a fleet deciding on sub-buckets admits
    /// nothing one exact bucket of the whole limit would not.
    #[test]
    fn a_sharded_fleet_never_admits_more_than_one_exact_bucket(
        (limit, shards, instances, requests) in case(),
    ) {
        let rt = runtime();
        let shared = Arc::new(MemoryStore::new(64, 1));
        let fleet: Vec<_> = (0..instances).map(|_| Sharded::new(Arc::clone(&shared))).collect();
        let mut now = T0;
        let mut admitted = Vec::new();
        for &(i, dt, cost) in &requests {
            now += dt;
            let check = Check::new(BucketKey(11), limit, cost, now).with_shards(shards);
            let c = rt.block_on(fleet[i % instances].check(check)).unwrap();
            let d = c.decision.unwrap();
            prop_assert!(c.shard.is_some());
            prop_assert_eq!(c.limit, limit);
            prop_assert_eq!(d.limit, limit.burst());
            prop_assert!(d.remaining <= limit.burst());
            if d.allowed {
                admitted.push((now, cost));
            }
        }
        for (n, ok) in exact(&limit, &admitted).iter().enumerate() {
            prop_assert!(ok, "admission {} of {:?} is more than one bucket allows", n, admitted[n]);
        }
    }
}

/// Requests spaced at the rate, round robin over the sub-buckets: each
/// sees every S-th of them, exactly its own rate. After the burst is
/// drained, the first S - 1 find their sub-bucket short of a whole token
/// (it had less time to refill than one bucket would have): that is the
/// under-admission of sharding, once; none is refused after them.
#[test]
fn steady_traffic_at_the_rate_is_refused_only_while_the_turns_settle() {
    let rt = runtime();
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        for shards in [2u16, 3, 4, 7] {
            let limit = Limit::per_second(28, 10).unwrap().with_algorithm(algorithm);
            let sharded = Sharded::new(MemoryStore::new(64, 1));
            let mut subs = std::collections::HashSet::new();
            let mut ask = |now| {
                let check = Check::new(BucketKey(3), limit, 1, now).with_shards(shards);
                let c = rt.block_on(sharded.check(check)).unwrap();
                subs.insert(c.shard.unwrap());
                c.decision.unwrap().allowed
            };
            // The burst, cut to S x (28 / S), is all the burst admits.
            let burst = (0..28).filter(|_| ask(T0)).count() as u64;
            assert_eq!(burst, 28 / u64::from(shards) * u64::from(shards));
            // Then 2000 requests 100 ms apart, as one bucket admits all.
            let refused: Vec<u64> = (1..=2_000u64).filter(|i| !ask(T0 + i * 100_000)).collect();
            let settling: Vec<u64> = (1..u64::from(shards)).collect();
            assert_eq!(refused, settling, "{algorithm:?} x{shards}");
            assert_eq!(subs.len(), usize::from(shards));
        }
    }
}

#[test]
fn unsharded_checks_pass_through_untouched() {
    let rt = runtime();
    let sharded = Sharded::new(MemoryStore::new(64, 1));
    let alone = MemoryStore::new(64, 1);
    let limit = Limit::per_second(5, 1).unwrap();
    for i in 0..10 {
        let check = Check::new(BucketKey(4), limit, 1, T0 + i);
        let (a, b) = (
            rt.block_on(sharded.check(check)).unwrap(),
            rt.block_on(alone.check(check)).unwrap(),
        );
        assert_eq!(a, b);
        assert_eq!(a.shard, None);
    }
}

/// A client sees the whole limit: the sub-bucket's remaining tokens
/// times S, its `Retry-After`.
#[test]
fn answers_speak_of_the_whole_limit() {
    let rt = runtime();
    let sharded = Sharded::new(MemoryStore::new(64, 1));
    let limit = Limit::per_second(30, 3).unwrap();
    let check = Check::new(BucketKey(5), limit, 1, T0).with_shards(3);
    let first = rt.block_on(sharded.check(check)).unwrap();
    let d = first.decision.unwrap();
    assert!(d.allowed);
    assert_eq!((d.limit, d.remaining), (30, 27), "9 left of 10, times 3");
    // Drain all three: the next is refused with the sub-bucket's wait,
    // one token at 1/s.
    for _ in 0..29 {
        rt.block_on(sharded.check(check)).unwrap();
    }
    let d = rt.block_on(sharded.check(check)).unwrap().decision.unwrap();
    assert!(!d.allowed);
    assert_eq!((d.limit, d.remaining), (30, 0));
    assert_eq!(d.retry_after, Duration::from_secs(1));
}
