//! Leases against one exact bucket: a fleet taking tokens ahead never
//! admits more than the bucket alone, fed the same requests.

use super::*;
use crate::mitigation::{Leases, lease_life};
use crate::store::{FailureMode, StoreError};
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Whatever the interleaving, everything a fleet with leases
    /// admitted is something one exact bucket admits in full: no
    /// over-admission. (What it refused beyond the exact bucket is
    /// the expired tokens: measured, not bounded here.)
    #[test]
    fn a_fleet_with_leases_never_admits_more_than_one_exact_bucket(
        (limit, lease, instances, requests) in case(),
    ) {
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
        let verdicts = exact(&limit, &admitted);
        for (n, ok) in verdicts.iter().enumerate() {
            prop_assert!(ok, "admission {} of {:?} is more than one bucket allows ({} from leases)", n, admitted[n], leased);
        }
    }
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
        // Drain the bucket: the last admissions come from a lease.
        for i in 0..8 {
            ask(T0 + i);
        }
        let after = T0 + 8 + pause_ms * 1_000;
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

/// Records what it is asked, and answers from a memory store or fails.
#[derive(Debug)]
struct Recording {
    inner: MemoryStore,
    failing: Mutex<bool>,
    asked: Mutex<Vec<(u64, FailureMode)>>,
}

impl Store for Recording {
    fn check(&self, check: Check) -> crate::store::CheckFuture<'_> {
        self.asked
            .lock()
            .unwrap()
            .push((check.cost, check.on_failure));
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
fn one_call_for_a_lease_then_local_spends_and_no_lease_ever_falls_back() {
    let rt = runtime();
    let store = Arc::new(Recording {
        inner: MemoryStore::new(64, 1),
        failing: Mutex::new(false),
        asked: Mutex::new(Vec::new()),
    });
    let leases = Leases::new(Arc::clone(&store), 1, 16);
    // Burst 100, 100/s: a lease of 10 after the first take leaves 90.
    let limit = Limit::per_second(100, 100).unwrap();
    let at = |now| {
        Check::new(BucketKey(3), limit, 1, now)
            .on_failure(FailureMode::Local)
            .with_lease(10)
    };
    // A full bucket: the first requests go alone (a lease could not be
    // held); once the bucket is drained enough, one call takes a lease
    // and the next requests spend it.
    let sources: Vec<Source> = (0..40u64)
        .map(|i| rt.block_on(leases.check(at(T0 + i))).unwrap().source)
        .collect();
    let first_lease = sources.iter().position(|s| *s == Source::Lease).unwrap();
    assert!(first_lease > 1, "{sources:?}");
    let asked = store.asked.lock().unwrap().clone();
    assert!(
        asked[..first_lease - 1]
            .iter()
            .all(|&(cost, mode)| cost == 1 && mode == FailureMode::Local),
        "{asked:?}"
    );
    assert_eq!(
        asked[first_lease - 1],
        (10, FailureMode::Closed),
        "the take: the lease's cost, no fallback"
    );
    assert_eq!(sources[first_lease - 1], Source::Memory);
    assert!(
        sources[first_lease..first_lease + 9]
            .iter()
            .all(|s| *s == Source::Lease),
        "{sources:?}"
    );
    assert!(
        asked.len() < 40 - 9,
        "{} calls for 40 requests",
        asked.len()
    );
    // The store fails now: once the held tokens are spent, the lease
    // take fails, and the request goes down alone, with its own mode.
    *store.failing.lock().unwrap() = true;
    let mut now = T0 + 40;
    while rt.block_on(leases.check(at(now))).is_ok() {
        now += 1;
    }
    let asked = store.asked.lock().unwrap().clone();
    assert_eq!(
        asked[asked.len() - 2..],
        [(10, FailureMode::Closed), (1, FailureMode::Local)]
    );
    // Without `lease`, nothing changes.
    store.asked.lock().unwrap().clear();
    *store.failing.lock().unwrap() = false;
    let plain = rt
        .block_on(leases.check(Check::new(BucketKey(4), limit, 1, T0)))
        .unwrap();
    assert_eq!(plain.source, Source::Memory);
    assert_eq!(*store.asked.lock().unwrap(), [(1, FailureMode::Local)]);
    assert_eq!(leases.len(), 1, "only the leasing key is remembered");
}

/// Holds a lease take (a check of more than one token) until a permit
/// is added; single-token checks pass through.
#[derive(Debug)]
struct Gated {
    inner: MemoryStore,
    gate: tokio::sync::Semaphore,
    asked: Mutex<Vec<u64>>,
}

impl Store for Gated {
    fn check(&self, check: Check) -> crate::store::CheckFuture<'_> {
        self.asked.lock().unwrap().push(check.cost);
        crate::store::CheckFuture::waiting(async move {
            if check.cost > 1 {
                let _pass = self.gate.acquire().await.expect("gate open");
            }
            self.inner.check(check).await
        })
    }
    fn backend(&self) -> &'static str {
        "gated"
    }
}

/// One lease is taken at a time per key and instance: while a take is
/// on its way, the key's other requests go to the store alone (a token
/// each) rather than each taking a lease of their own.
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
        // The first request goes alone: nothing seen of the key yet.
        leases.check(at(T0)).await.unwrap();
        let spawn = |now| {
            let leases = Arc::clone(&leases);
            tokio::spawn(async move { leases.check(at(now)).await })
        };
        // The next takes a lease, and waits at the gate.
        let take = spawn(T0 + 1);
        tokio::task::yield_now().await;
        assert_eq!(*store.asked.lock().unwrap(), [1, 10]);
        // Meanwhile four more: each alone, none takes another lease.
        for i in 2..6 {
            let alone = tokio::time::timeout(Duration::from_secs(5), spawn(T0 + i));
            let c = alone.await.expect("waited for another take").unwrap();
            assert_eq!(c.unwrap().source, Source::Memory);
        }
        assert_eq!(*store.asked.lock().unwrap(), [1, 10, 1, 1, 1, 1]);
        assert!(!take.is_finished());
        // The take lands; its tokens serve the next requests.
        store.gate.add_permits(1);
        let c = take.await.unwrap().unwrap();
        assert_eq!(c.source, Source::Memory);
        let c = leases.check(at(T0 + 7)).await.unwrap();
        assert_eq!(c.source, Source::Lease);
        assert_eq!(store.asked.lock().unwrap().len(), 6);
    });
}
