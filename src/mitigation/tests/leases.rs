//! Leases against one exact bucket: a fleet taking tokens ahead never
//! admits more than the bucket alone, fed the same requests.

use super::*;
use crate::algorithm::token_bucket::TakeUpTo;
use crate::mitigation::{Leases, lease_life, lease_take};
use crate::store::{FailureMode, StoreError};
use proptest::test_runner::TestRunner;
use std::sync::Mutex;

/// A token bucket big enough for `instances` leases of `lease`.
fn case() -> impl Strategy<Value = (Limit, u64, u64, Vec<(usize, u64, u64)>)> {
    (1u64..=3, 2u64..=6).prop_flat_map(|(instances, lease)| {
        (
            (
                instances * lease + 1..=instances * lease + 40,
                1u64..=20,
                prop_oneof![Just(1_000_000u64), 1_000u64..=3_000_000],
            )
                .prop_map(|(b, r, p)| Limit::new(b, r, Duration::from_micros(p)).unwrap()),
            Just(lease),
            Just(instances),
            requests(3, 2),
        )
    })
}

/// Whatever the interleaving, everything a fleet with leases admitted is
/// something one exact bucket admits in full: no over-admission. (What it
/// refused beyond the exact bucket is the expired tokens: measured, not
/// bounded here.) And leases were spent: a fleet that never leased would
/// prove nothing.
#[test]
fn a_fleet_with_leases_never_admits_more_than_one_exact_bucket() {
    let mut runner = TestRunner::new(ProptestConfig::with_cases(512));
    let leased_in_all = std::cell::Cell::new(0u64);
    runner
        .run(&case(), |(limit, lease, instances, requests)| {
            let rt = runtime();
            let shared = Arc::new(MemoryStore::new(64, 1));
            let fleet: Vec<_> = (0..instances)
                .map(|_| Leases::new(Arc::clone(&shared), instances, 16))
                .collect();
            let mut now = T0;
            let mut admitted = Vec::new();
            let mut leased = 0;
            for &(i, dt, cost) in &requests {
                now += dt;
                let check = Check::new(BucketKey(9), limit, cost, now).with_lease(lease);
                let c = rt.block_on(fleet[i % fleet.len()].check(check)).unwrap();
                if c.decision.unwrap().allowed {
                    admitted.push((now, cost));
                    leased += u64::from(c.source == Source::Lease);
                }
            }
            leased_in_all.set(leased_in_all.get() + leased);
            let verdicts = exact(&limit, &admitted);
            for (n, ok) in verdicts.iter().enumerate() {
                prop_assert!(
                    ok,
                    "admission {} of {:?} is more than one bucket allows ({} from leases)",
                    n,
                    admitted[n],
                    leased
                );
            }
            Ok(())
        })
        .unwrap();
    assert!(leased_in_all.get() > 0, "no case spent a lease");
}

/// The hardest interleaving for a lease: tokens held through the
/// longest pause it may live, then spent in a burst on a bucket that
/// refilled meanwhile. At every pause, what was admitted is something
/// one exact bucket admits in full.
#[test]
fn tokens_held_through_any_pause_never_add_to_a_burst() {
    let rt = runtime();
    let limit = Limit::per_second(10, 10).unwrap();
    let mut leased_late = 0;
    for pause_ms in 0..=1_100u64 {
        let shared = Arc::new(MemoryStore::new(64, 1));
        let leases = Leases::new(Arc::clone(&shared), 1, 16);
        let mut admitted = Vec::new();
        let mut ask = |now: Micros| {
            let check = Check::new(BucketKey(5), limit, 1, now).with_lease(3);
            let c = rt.block_on(leases.check(check)).unwrap();
            if c.decision.unwrap().allowed {
                admitted.push((now, 1));
            }
            c.source
        };
        // Drain the bucket: the last admission comes from a lease, one of
        // whose tokens is still held.
        for i in 0..7 {
            ask(T0 + i);
        }
        let after = T0 + 7 + pause_ms * 1_000;
        leased_late += u64::from(ask(after) == Source::Lease);
        for i in 1..20 {
            ask(after + i);
        }
        let verdicts = exact(&limit, &admitted);
        assert!(
            verdicts.iter().all(|ok| *ok),
            "pause {pause_ms} ms: {admitted:?} is more than one bucket allows"
        );
    }
    assert!(leased_late > 0, "no pause was spent from a held lease");
}

#[test]
fn a_lease_lives_until_the_room_under_the_burst_is_refilled() {
    // Burst 100 at 10/s; 3 instances leasing 10.
    let limit = Limit::per_second(100, 10).unwrap();
    // After the take 40 remain: room 100 - 41 - 30 = 29 tokens, 2.9 s.
    assert_eq!(lease_life(&limit, 40, 10, 3), 2_900_000);
    // A nearly full bucket leaves no room: not held at all.
    assert_eq!(lease_life(&limit, 69, 10, 3), 0);
    assert_eq!(lease_life(&limit, 99, 10, 3), 0);
}

/// The take asks for the rest of the lease, granted only where it can
/// live: at most `B - 2 - K x N` whole tokens left, the last count whose
/// lease life is positive.
#[test]
fn a_take_is_granted_only_where_its_lease_can_live() {
    let limit = Limit::per_second(100, 10).unwrap();
    let take = lease_take(&limit, 1, 10, 3).unwrap();
    assert_eq!(
        take,
        TakeUpTo {
            extra: 9,
            leave: 68
        }
    );
    assert!(lease_life(&limit, take.leave, 10, 3) > 0);
    assert_eq!(lease_life(&limit, take.leave + 1, 10, 3), 0);
    assert_eq!(lease_take(&limit, 4, 10, 3).unwrap().extra, 6);
    // Nothing beyond a request as dear as the lease.
    assert_eq!(lease_take(&limit, 10, 10, 3), None);
    assert_eq!(lease_take(&limit, 12, 10, 3), None);
    // A fleet whose leases fill the burst but one token: never any room.
    let tight = Limit::per_second(31, 10).unwrap();
    assert_eq!(lease_take(&tight, 1, 10, 3), None);
}

/// Above a token a microsecond, a lease needs more room to live a
/// microsecond: the take leaves less.
#[test]
fn a_take_leaves_room_for_a_microsecond_at_any_rate() {
    // 2,000,000 a second: 2 tokens refill each microsecond.
    let fast = Limit::per_second(2_000_000, 2_000_000).unwrap();
    let take = lease_take(&fast, 1, 10, 3).unwrap();
    assert_eq!(take.leave, 2_000_000 - 1 - 30 - 2);
    assert!(lease_life(&fast, take.leave, 10, 3) > 0);
    assert_eq!(lease_life(&fast, take.leave + 1, 10, 3), 0);
}

/// The local share decides a request whose take found the store failed,
/// and grants nothing beyond its cost: no lease is held from it, and the
/// next request asks the store again.
#[test]
fn a_take_the_store_cannot_answer_is_the_local_shares_request_alone() {
    let rt = runtime();
    // Every call fails: the local share (this one instance's whole limit)
    // decides them all.
    let leases = Leases::new(super::failover(u64::MAX, 1), 1, 16);
    let limit = Limit::per_second(100, 100).unwrap();
    for i in 0..12u64 {
        let check = Check::new(BucketKey(6), limit, 1, T0 + i)
            .on_failure(FailureMode::Local)
            .with_lease(10);
        let c = rt.block_on(leases.check(check)).unwrap();
        // From the fourth on, a bucket as low as the share's would grant
        // the take's 9 more.
        assert_eq!((c.source, c.extra), (Source::Local, 0), "request {i}");
        assert_eq!(c.decision.unwrap().remaining, 99 - i, "the cost alone");
    }
}

/// What a store was asked: the cost, whether it carried a take, the
/// failure mode.
type Asked = (u64, bool, FailureMode);

/// Records what it is asked, and answers from a memory store or fails.
#[derive(Debug)]
struct Recording {
    inner: MemoryStore,
    failing: Mutex<bool>,
    asked: Mutex<Vec<Asked>>,
}

impl Store for Recording {
    fn check(&self, check: Check) -> crate::store::CheckFuture<'_> {
        self.asked
            .lock()
            .unwrap()
            .push((check.cost, check.take.is_some(), check.on_failure));
        if *self.failing.lock().unwrap() {
            return crate::store::CheckFuture::ready(Err(StoreError::Deadline(
                crate::store::Late::unknown(),
            )));
        }
        self.inner.check(check)
    }
    fn backend(&self) -> &'static str {
        "recording"
    }
}

#[test]
fn every_request_is_one_call_and_a_take_goes_down_as_the_request_would() {
    let rt = runtime();
    let store = Arc::new(Recording {
        inner: MemoryStore::new(64, 1),
        failing: Mutex::new(false),
        asked: Mutex::new(Vec::new()),
    });
    let leases = Leases::new(Arc::clone(&store), 1, 16);
    // Burst 100, 100/s, one instance leasing 10: a lease is granted once
    // at most 88 tokens are left after it.
    let limit = Limit::per_second(100, 100).unwrap();
    let at = |now| {
        Check::new(BucketKey(3), limit, 1, now)
            .on_failure(FailureMode::Local)
            .with_lease(10)
    };
    let answers: Vec<Checked> = (0..40u64)
        .map(|i| rt.block_on(leases.check(at(T0 + i))).unwrap())
        .collect();
    let sources: Vec<Source> = answers.iter().map(|c| c.source).collect();
    // 99 and 98 left: a lease could not live, so none is granted; at 97
    // the take has 9 more (88 left), and the next 9 requests spend them.
    assert_eq!(
        answers[..3].iter().map(|c| c.extra).collect::<Vec<_>>(),
        [0, 0, 9],
        "{sources:?}"
    );
    assert_eq!(answers[2].decision.unwrap().remaining, 97, "88 + 9 held");
    assert!(sources[..3].iter().all(|s| *s == Source::Memory));
    assert!(
        sources[3..12].iter().all(|s| *s == Source::Lease),
        "{sources:?}"
    );
    assert_eq!(sources[12], Source::Memory, "the next take");
    // One call per request the lease did not serve, each the request's
    // own cost and mode, with a take.
    let asked = store.asked.lock().unwrap().clone();
    let leased = sources.iter().filter(|s| **s == Source::Lease).count();
    assert_eq!(asked.len(), 40 - leased);
    assert!(leased >= 30, "{sources:?}");
    assert!(
        asked.iter().all(|a| *a == (1, true, FailureMode::Local)),
        "{asked:?}"
    );
    // The store fails now: once the held tokens are spent, the request's
    // one call goes down, with its own mode (a failover layer below would
    // decide it from the local share, which grants no lease).
    *store.failing.lock().unwrap() = true;
    let mut now = T0 + 40;
    while rt.block_on(leases.check(at(now))).is_ok() {
        now += 1;
    }
    let failed = store.asked.lock().unwrap().len() - asked.len();
    assert_eq!(failed, 1, "one call, no second try");
    // Without `lease`, nothing changes.
    store.asked.lock().unwrap().clear();
    *store.failing.lock().unwrap() = false;
    let plain = rt
        .block_on(leases.check(Check::new(BucketKey(4), limit, 1, T0)))
        .unwrap();
    assert_eq!(plain.source, Source::Memory);
    assert_eq!(
        *store.asked.lock().unwrap(),
        [(1, false, FailureMode::Local)]
    );
    assert_eq!(leases.len(), 1, "only the leasing key is remembered");
}

/// Holds a take (a check with a lease's take) until a permit is added;
/// other checks pass through.
#[derive(Debug)]
struct Gated {
    inner: MemoryStore,
    gate: tokio::sync::Semaphore,
    asked: Mutex<Vec<bool>>,
}

impl Store for Gated {
    fn check(&self, check: Check) -> crate::store::CheckFuture<'_> {
        self.asked.lock().unwrap().push(check.take.is_some());
        crate::store::CheckFuture::waiting(async move {
            if check.take.is_some() {
                // One permit, one take.
                self.gate.acquire().await.expect("gate open").forget();
            }
            self.inner.check(check).await
        })
    }
    fn backend(&self) -> &'static str {
        "gated"
    }
}

/// One lease is taken at a time per key and instance: while a take is
/// on its way, the key's other requests go to the store without one
/// rather than each taking a lease of their own (which would replace,
/// and so waste, the first).
#[test]
fn one_lease_take_at_a_time_per_key() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let store = Arc::new(Gated {
        inner: MemoryStore::new(64, 1),
        gate: tokio::sync::Semaphore::new(0),
        asked: Mutex::new(Vec::new()),
    });
    let leases = Arc::new(Leases::new(Arc::clone(&store), 1, 16));
    let limit = Limit::per_second(100, 100).unwrap();
    let at = move |now| {
        Check::new(BucketKey(5), limit, 1, now)
            .on_failure(FailureMode::Local)
            .with_lease(10)
    };
    rt.block_on(async {
        // 60 spent elsewhere: a lease of 10 can be held from here.
        store
            .inner
            .check(Check::new(BucketKey(5), limit, 60, T0))
            .await
            .unwrap();
        let spawn = |now| {
            let leases = Arc::clone(&leases);
            tokio::spawn(async move { leases.check(at(now)).await })
        };
        // The first takes a lease, and waits at the gate.
        let take = spawn(T0);
        tokio::task::yield_now().await;
        assert_eq!(*store.asked.lock().unwrap(), [true]);
        // Meanwhile four more: each alone, none takes another lease.
        for i in 1..5 {
            let alone = tokio::time::timeout(Duration::from_secs(5), spawn(T0 + i));
            let c = alone.await.expect("waited for another take").unwrap();
            assert_eq!(c.unwrap().source, Source::Memory);
        }
        assert_eq!(
            *store.asked.lock().unwrap(),
            [true, false, false, false, false]
        );
        assert!(!take.is_finished());
        // The take lands; its tokens serve the next requests.
        store.gate.add_permits(1);
        let c = take.await.unwrap().unwrap();
        assert_eq!((c.source, c.extra), (Source::Memory, 9));
        let c = leases.check(at(T0 + 6)).await.unwrap();
        assert_eq!(c.source, Source::Lease);
        assert_eq!(store.asked.lock().unwrap().len(), 5);
        // The rest of the lease, then a take dropped on its way (its
        // request timed out): the next request takes again.
        for i in 7..15 {
            assert_eq!(
                leases.check(at(T0 + i)).await.unwrap().source,
                Source::Lease
            );
        }
        let late = tokio::time::timeout(Duration::from_millis(20), leases.check(at(T0 + 15)));
        assert!(late.await.is_err(), "held at the gate");
        store.gate.add_permits(1);
        let c = leases.check(at(T0 + 16)).await.unwrap();
        assert_eq!((c.source, c.extra), (Source::Memory, 9));
        assert_eq!(store.asked.lock().unwrap()[5..], [true, true]);
    });
}
