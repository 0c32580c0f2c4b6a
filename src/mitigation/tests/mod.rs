//! The deny cache against the exact cores: an instance (or a fleet) with
//! the cache decides exactly as the store alone, fed the same requests.

use super::DenyCache;
use crate::algorithm::{Algorithm, Limit};
use crate::clock::Micros;
use crate::key::BucketKey;
use crate::store::{Backend, Check, Checked, MemoryStore, Source, Store};
use proptest::prelude::*;
use std::sync::Arc;
use std::time::Duration;

const T0: Micros = 1_800_000_000_000_000;

/// A limit of an algorithm the in-process store runs (the exact cores).
fn limit() -> impl Strategy<Value = Limit> {
    let algorithms: Vec<Algorithm> = Algorithm::ALL
        .into_iter()
        .filter(|&a| Backend::Memory.runs(a))
        .collect();
    (
        prop::sample::select(algorithms),
        1u64..=30,
        1u64..=10,
        prop_oneof![Just(1_000_000u64), Just(60_000_000), 1_000u64..=5_000_000],
    )
        .prop_map(|(a, b, r, p)| {
            Limit::new(b, r, Duration::from_micros(p))
                .unwrap()
                .with_algorithm(a)
        })
}

/// (instance, time step, cost): surges (tiny steps) and pauses.
fn requests(instances: usize, max_cost: u64) -> impl Strategy<Value = Vec<(usize, u64, u64)>> {
    let step = prop_oneof![
        6 => 0u64..=2_000,
        3 => 0u64..=500_000,
        1 => 0u64..=30_000_000,
    ];
    prop::collection::vec((0..instances, step, 1..=max_cost), 1..300)
}

/// What one exact bucket admits of `requests` (time, cost), fed alone.
fn exact(limit: &Limit, requests: &[(u64, u64)]) -> Vec<bool> {
    let mut state: Option<crate::algorithm::State> = None;
    requests
        .iter()
        .map(|&(now, cost)| {
            let (d, s) = crate::algorithm::check(limit, state.take(), cost, now).unwrap();
            state = s;
            d.allowed
        })
        .collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
}

/// Feeds `requests` to `instances` deny caches over one shared store and to
/// the store alone; returns (with the caches, alone) answer pairs.
fn run(
    limit: Limit,
    instances: usize,
    requests: &[(usize, u64, u64)],
) -> Vec<(u64, Checked, Checked)> {
    let rt = runtime();
    let shared = Arc::new(MemoryStore::new(64, 1));
    let fleet: Vec<_> = (0..instances)
        .map(|_| DenyCache::new(Arc::clone(&shared), 16))
        .collect();
    let alone = MemoryStore::new(64, 1);
    let mut now = T0;
    requests
        .iter()
        .map(|&(i, dt, cost)| {
            now += dt;
            let check = Check::new(BucketKey(7), limit, cost, now).with_deny_cache(true);
            let with = rt.block_on(fleet[i].check(check)).unwrap();
            let without = rt.block_on(alone.check(check)).unwrap();
            (cost, with, without)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// One instance, one cost: the same decisions, with a 429 from the
    /// cache carrying the store's exact `Retry-After` and reset, and no
    /// more remaining tokens than the store would report.
    #[test]
    fn one_instance_same_cost_decides_exactly_as_the_store(
        limit in limit(),
        cost in 1u64..=3,
        requests in requests(1, 1),
    ) {
        prop_assume!(cost <= limit.burst());
        let requests: Vec<_> = requests.into_iter().map(|(i, dt, _)| (i, dt, cost)).collect();
        for (n, (_, with, without)) in run(limit, 1, &requests).into_iter().enumerate() {
            let (w, wo) = (with.decision.unwrap(), without.decision.unwrap());
            prop_assert_eq!(w.allowed, wo.allowed, "request {}: {:?} vs {:?}", n, with, without);
            if with.source == Source::DenyCache {
                prop_assert_eq!(w.retry_after, wo.retry_after, "request {}", n);
                prop_assert_eq!(w.reset, wo.reset, "request {}", n);
                prop_assert!(w.remaining <= wo.remaining, "request {}", n);
            } else {
                prop_assert_eq!(w, wo, "request {}", n);
            }
        }
    }

    /// A fleet of instances, each with its own cache, over one shared
    /// store, mixed costs: never an admission the store alone would refuse,
    /// never a refusal it would admit.
    #[test]
    fn a_fleet_with_mixed_costs_admits_exactly_what_the_store_admits(
        limit in limit(),
        instances in 1usize..=3,
        requests in requests(3, 4),
    ) {
        let requests: Vec<_> = requests
            .into_iter()
            .map(|(i, dt, cost)| (i % instances, dt, cost.min(limit.burst())))
            .collect();
        for (n, (cost, with, without)) in run(limit, instances, &requests).into_iter().enumerate() {
            let (w, wo) = (with.decision.unwrap(), without.decision.unwrap());
            prop_assert!(!w.allowed || wo.allowed, "request {} (cost {}): over-admitted", n, cost);
            prop_assert!(w.allowed || !wo.allowed, "request {} (cost {}): falsely denied {:?}", n, cost, with);
        }
    }
}

/// Fails its first `failing` calls as a Redis that missed the deadline,
/// then answers from a memory store.
#[derive(Debug)]
struct FailFirst {
    inner: MemoryStore,
    failing: std::sync::atomic::AtomicU64,
}

impl FailFirst {
    fn new(failing: u64) -> Self {
        Self {
            inner: MemoryStore::new(64, 1),
            failing: failing.into(),
        }
    }
}

impl Store for FailFirst {
    fn check(&self, check: Check) -> crate::store::CheckFuture<'_> {
        use std::sync::atomic::Ordering;
        let failed = self
            .failing
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        if failed {
            return crate::store::CheckFuture::ready(Err(crate::store::StoreError::Deadline(
                crate::store::Late::unknown(),
            )));
        }
        self.inner.check(check)
    }
    fn backend(&self) -> &'static str {
        "fail-first"
    }
}

/// The failure policy over a store that fails its first `failing` calls:
/// the local share decides those, and the store's answers then carry the
/// hand-back ceiling. The breaker never opens (it would depend on time).
fn failover(failing: u64, instances: u64) -> crate::failover::Failover<FailFirst> {
    use crate::failover::{Failover, FailoverSettings, LocalShare};
    use crate::store::FailureMode;
    let settings = FailoverSettings {
        mode: FailureMode::Local,
        deadline: Duration::from_millis(10),
        instances,
        breaker_failures: u32::MAX,
        breaker_cooldown: Duration::from_secs(1),
    };
    Failover::new(
        FailFirst::new(failing),
        &settings,
        LocalShare::new(instances, 64, 1),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// After a fallback the store's answers are bounded by the hand-back
    /// ceiling, a level that refills at the policy's rate as the shared
    /// bucket does: a denial under it holds as long as it says, so the
    /// cache keeps it, and an instance with the cache decides as the one
    /// without. Up to one thing: the ceiling is set a microsecond of refill
    /// above each answer it mirrors (so that it cannot bind by rounding),
    /// and the instance without the cache mirrors every denial, so its
    /// ceiling creeps ahead by that much per denial and may admit as much
    /// earlier. The cache never admits earlier than the store. Once the
    /// instance without it has admitted so, the two have spent different
    /// tokens and their later answers are of different histories: the
    /// comparison ends there.
    #[test]
    fn denials_under_a_hand_back_ceiling_are_kept_and_decide_as_the_store(
        burst in 1u64..=30,
        rate in 1u64..=10,
        failing in 1u64..=20,
        instances in 1u64..=3,
        requests in requests(1, 1),
    ) {
        let limit = Limit::per_second(burst, rate).unwrap();
        let rt = runtime();
        let with = DenyCache::new(failover(failing, instances), 16);
        let without = failover(failing, instances);
        let mut now = T0;
        for (n, (_, dt, _)) in requests.into_iter().enumerate() {
            now += dt;
            let check = Check::new(BucketKey(7), limit, 1, now).with_deny_cache(true);
            let w = rt.block_on(with.check(check)).unwrap();
            let wo = rt.block_on(without.check(check)).unwrap();
            let (dw, dwo) = (w.decision.unwrap(), wo.decision.unwrap());
            // At most a microsecond of refill for every answer so far.
            let creep = Duration::from_micros(n as u64 + 1);
            prop_assert!(!dw.allowed || dwo.allowed, "request {}: over-admitted {:?} vs {:?}", n, w, wo);
            if dw.allowed == dwo.allowed {
                if w.source == Source::DenyCache {
                    prop_assert!(dw.retry_after >= dwo.retry_after, "request {}: {:?} vs {:?}", n, w, wo);
                    prop_assert!(dw.retry_after <= dwo.retry_after + creep, "request {}: {:?} vs {:?}", n, w, wo);
                }
            } else {
                prop_assert_eq!(w.source, Source::DenyCache, "request {}: {:?} vs {:?}", n, w, wo);
                prop_assert!(dw.retry_after <= creep, "request {}: refused {:?} early", n, dw.retry_after);
                break;
            }
        }
    }
}

/// The incident's case: a node so busy that checks missed the deadline
/// and fell back, after which every answer carries the hand-back ceiling.
/// The cache still takes the surge off the store.
#[test]
fn after_a_fallback_a_surge_is_still_answered_from_the_cache() {
    let rt = runtime();
    let cache = DenyCache::new(failover(3, 3), 16);
    let limit = Limit::per_second(5, 1).unwrap();
    let mut sources = std::collections::BTreeMap::new();
    for i in 0..1000u64 {
        let check = Check::new(BucketKey(1), limit, 1, T0 + i * 1_000).with_deny_cache(true);
        let c = rt.block_on(cache.check(check)).unwrap();
        *sources.entry(format!("{:?}", c.source)).or_insert(0) += 1;
    }
    assert_eq!(sources.get("Local"), Some(&3), "{sources:?}");
    assert!(
        sources.get("DenyCache").copied().unwrap_or(0) > 900,
        "{sources:?}"
    );
}

#[test]
fn a_surge_is_answered_from_the_cache_and_the_store_is_spared() {
    let rt = runtime();
    let store = Arc::new(MemoryStore::new(64, 1));
    let cache = DenyCache::new(Arc::clone(&store), 16);
    let limit = Limit::per_second(5, 1).unwrap();
    let (mut admitted, mut from_cache) = (0, 0);
    // 1000 requests over 2 s: 5 + 2 admitted.
    for i in 0..1000u64 {
        let check = Check::new(BucketKey(1), limit, 1, T0 + i * 2_000).with_deny_cache(true);
        let c = rt.block_on(cache.check(check)).unwrap();
        admitted += u64::from(c.decision.unwrap().allowed);
        from_cache += u64::from(c.source == Source::DenyCache);
    }
    assert_eq!(
        admitted,
        5 + 1,
        "the burst, and one token at 1 s (2 s is not reached)"
    );
    // The store saw the admissions and one denial per refill gap.
    assert!(
        1000 - from_cache <= 2 * admitted,
        "{from_cache} from the cache"
    );
}

#[test]
fn only_the_policies_that_ask_and_only_the_stores_own_denials() {
    let rt = runtime();
    let cache = DenyCache::new(MemoryStore::new(64, 1), 16);
    let limit = Limit::per_second(1, 1).unwrap();
    let at = |now| Check::new(BucketKey(2), limit, 1, now);
    // Without deny_cache: never answered from the cache.
    for now in [T0, T0 + 1, T0 + 2] {
        let c = rt.block_on(cache.check(at(now))).unwrap();
        assert_eq!(c.source, Source::Memory);
    }
    assert!(cache.is_empty(), "nothing learned for a policy without it");
    // A local share's denial is not remembered (it says nothing of the
    // shared bucket); a denial under a hand-back ceiling is (see
    // `denials_under_a_hand_back_ceiling_are_kept_and_decide_as_the_store`).
    let local = Checked {
        source: Source::Local,
        ..rt.block_on(cache.check(at(T0 + 3))).unwrap()
    };
    assert!(!local.decision.unwrap().allowed);
    cache.learn(&at(T0 + 3).with_deny_cache(true), &local);
    assert!(cache.is_empty());
    let bounded = Checked {
        bounded: true,
        ..rt.block_on(cache.check(at(T0 + 3))).unwrap()
    };
    cache.learn(&at(T0 + 3).with_deny_cache(true), &bounded);
    assert_eq!(cache.len(), 1);
    // A cheaper request is passed down; a different limit too.
    let c = rt
        .block_on(cache.check(at(T0 + 4).with_deny_cache(true)))
        .unwrap();
    assert_eq!(c.source, Source::DenyCache);
    assert_eq!(cache.len(), 1);
    let c = rt
        .block_on(cache.check(at(T0 + 5).with_deny_cache(true)))
        .unwrap();
    assert_eq!(c.source, Source::DenyCache);
    let cheaper = Check {
        cost: 0,
        ..at(T0 + 6)
    }
    .with_deny_cache(true);
    assert_eq!(
        rt.block_on(cache.check(cheaper)).unwrap().source,
        Source::Memory
    );
    let other = Check {
        limit: Limit::per_second(2, 1).unwrap(),
        ..at(T0 + 7)
    }
    .with_deny_cache(true);
    assert_eq!(
        rt.block_on(cache.check(other)).unwrap().source,
        Source::Memory
    );
}

#[test]
fn memory_is_bounded_and_expired_denials_make_room() {
    let rt = runtime();
    let cache = DenyCache::new(MemoryStore::new(10_000, 1), 32);
    let limit = Limit::per_second(1, 1).unwrap();
    // Keys spread over all 128 bits, as keyed hashes are (the table shards
    // by the high bits): an odd multiplier is a bijection.
    let key = |k: u128| BucketKey(k.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835));
    let deny_all = |now: Micros, keys: std::ops::Range<u128>| {
        for k in keys {
            let check = Check::new(key(k), limit, 1, now).with_deny_cache(true);
            rt.block_on(cache.check(check)).unwrap();
            rt.block_on(cache.check(check)).unwrap();
        }
    };
    deny_all(T0, 0..1000);
    assert!(cache.len() <= 32 + 16, "{} remembered", cache.len());
    // A second later every denial has expired: new ones fit.
    deny_all(T0 + 2_000_000, 1000..1010);
    let check = Check::new(key(1005), limit, 1, T0 + 2_000_001).with_deny_cache(true);
    assert_eq!(
        rt.block_on(cache.check(check)).unwrap().source,
        Source::DenyCache
    );
}

/// A store on a Redis node that is away: every layer of the stack must
/// pass its readiness, its slot owners and its bound on, or `/readyz`, the
/// hot-key detector and the front's timer would each see a healthy store.
#[derive(Debug)]
struct AwayNode;

impl Store for AwayNode {
    fn check(&self, _check: Check) -> crate::store::CheckFuture<'_> {
        crate::store::CheckFuture::ready(Err(crate::store::StoreError::Unavailable {
            retry_after: Duration::from_secs(1),
        }))
    }

    fn backend(&self) -> &'static str {
        "away"
    }

    fn longest_wait(&self) -> Option<Duration> {
        Some(Duration::from_millis(3))
    }

    fn ready(&self) -> crate::store::BoxFuture<'_, Result<(), crate::store::StoreError>> {
        Box::pin(std::future::ready(Err(
            crate::store::StoreError::Unavailable {
                retry_after: Duration::from_secs(1),
            },
        )))
    }

    fn slot_owner(&self, slot: u16) -> Option<Arc<str>> {
        (slot == 7).then(|| Arc::from("10.0.0.7:7002"))
    }

    fn one_node(&self) -> bool {
        false
    }
}

/// What `store` answers besides checks, as a line to compare.
async fn facts(store: &dyn Store) -> String {
    format!(
        "{} ready={} slot7={:?} slot8={:?} one_node={} longest_wait={:?}",
        store.backend(),
        store.ready().await.is_ok(),
        store.slot_owner(7),
        store.slot_owner(8),
        store.one_node(),
        store.longest_wait(),
    )
}

#[tokio::test]
async fn every_layer_passes_readiness_slots_and_bounds_on() {
    use crate::failover::{Deadline, Failover, FailoverSettings, LocalShare};
    use crate::mitigation::{Leases, Sharded};
    use crate::store::{Counted, FailureMode};
    let node = |wait: &str| {
        format!(
            "away ready=false slot7=Some(\"10.0.0.7:7002\") slot8=None one_node=false longest_wait=Some({wait})"
        )
    };
    let settings = FailoverSettings {
        instances: 1,
        deadline: Duration::from_millis(20),
        breaker_failures: 3,
        breaker_cooldown: Duration::from_millis(500),
        mode: FailureMode::Local,
    };
    let failover = Failover::new(AwayNode, &settings, LocalShare::new(1, 64, 1));
    assert_eq!(facts(&AwayNode).await, node("3ms"));
    assert_eq!(facts(&Counted::new(AwayNode)).await, node("3ms"));
    assert_eq!(facts(&failover).await, node("3ms"));
    assert_eq!(facts(&DenyCache::new(AwayNode, 64)).await, node("3ms"));
    assert_eq!(facts(&Sharded::new(AwayNode)).await, node("3ms"));
    // A lease is taken with the request's own call.
    assert_eq!(facts(&Leases::new(AwayNode, 1, 64)).await, node("3ms"));
    // The layer that changes the bound: a deadline sets it.
    assert_eq!(
        facts(&Deadline::new(AwayNode, Duration::from_millis(20))).await,
        node("20ms")
    );
    // The whole stack, as the server builds it around a shared store.
    let stack = Sharded::new(DenyCache::new(
        Leases::new(
            Failover::new(
                Counted::new(Deadline::new(AwayNode, Duration::from_millis(20))),
                &settings,
                LocalShare::new(1, 64, 1),
            ),
            1,
            64,
        ),
        64,
    ));
    assert_eq!(facts(&stack).await, node("20ms"));
}

mod leases;
mod shards;
