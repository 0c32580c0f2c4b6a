//! The failure policy's logic, against a store that can be switched down,
//! hung or restarted empty. (Real Redis faults, with real processes, are in
//! `cargo run -p loadtest -- outage`, asserted by `loadtest/tests/commands/faults.rs`,
//! and start-up without Redis in `tests/process.rs`.)

use super::*;
use crate::algorithm::{Algorithm, Limit};
use crate::key::BucketKey;
use crate::store::MemoryStore;
use std::sync::atomic::{AtomicU32, Ordering};

const T0: Micros = 1_800_000_000_000_000;
const SEC: Micros = 1_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Health {
    Up,
    Refusing,
    Hung,
    /// Answers, after this long.
    Slow(Duration),
}

/// A real in-process store behind a switch: up, refusing connections (an
/// error at once), or hung (never answers). `restart` forgets every bucket,
/// as a redis-server without persistence does.
#[derive(Debug)]
struct Switch {
    inner: Mutex<Arc<MemoryStore>>,
    health: Mutex<Health>,
    calls: AtomicU32,
}

impl Switch {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Arc::new(MemoryStore::new(1000, 1))),
            health: Mutex::new(Health::Up),
            calls: AtomicU32::new(0),
        })
    }
    fn set(&self, health: Health) {
        *self.health.lock().unwrap() = health;
    }
    fn restart(&self) {
        *self.inner.lock().unwrap() = Arc::new(MemoryStore::new(1000, 1));
    }
    fn calls(&self) -> u32 {
        self.calls.load(Ordering::Relaxed)
    }
}

impl Store for Switch {
    fn check(&self, check: Check) -> CheckFuture<'_> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let health = *self.health.lock().unwrap();
        let inner = Arc::clone(&self.inner.lock().unwrap());
        CheckFuture::waiting(async move {
            match health {
                // It plays a Redis: its answers are the shared store's.
                Health::Up => inner.check(check).await.map(|checked| Checked {
                    source: Source::Redis,
                    ..checked
                }),
                Health::Refusing => Err(StoreError::Redis(::redis::RedisError::from(
                    std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
                ))),
                Health::Hung => std::future::pending().await,
                Health::Slow(wait) => {
                    tokio::time::sleep(wait).await;
                    inner.check(check).await.map(|checked| Checked {
                        source: Source::Redis,
                        ..checked
                    })
                }
            }
        })
    }

    fn backend(&self) -> &'static str {
        "switch"
    }
}

fn settings(instances: u64) -> FailoverSettings {
    FailoverSettings {
        instances,
        deadline: Duration::from_millis(20),
        breaker_failures: 3,
        breaker_cooldown: Duration::from_millis(500),
        mode: FailureMode::Local,
    }
}

/// The stack `server.rs` builds around a shared store, on the switch.
fn failover(store: &Arc<Switch>, instances: u64) -> Failover<Deadline<Arc<Switch>>> {
    let settings = settings(instances);
    Failover::new(
        Deadline::new(Arc::clone(store), settings.deadline),
        &settings,
        LocalShare::new(instances, 1000, 1),
    )
}

/// As `server.rs` builds it: a call that misses the deadline goes on for
/// `allowance` (the Redis response timeout) in case it is answered late.
fn failover_awaiting_late_answers(
    store: &Arc<Switch>,
    allowance: Duration,
) -> Failover<Deadline<Arc<Switch>>> {
    let settings = settings(1);
    Failover::new(
        Deadline::new(Arc::clone(store), settings.deadline).late_within(allowance),
        &settings,
        LocalShare::new(1, 1000, 1),
    )
}

/// One check of `cost` for `key` under `limit` at `now`, failing by `mode`.
async fn check(
    f: &impl Store,
    key: u128,
    limit: Limit,
    cost: u64,
    now: Micros,
    mode: FailureMode,
) -> Result<Checked, StoreError> {
    f.check(Check::new(BucketKey(key), limit, cost, now).on_failure(mode))
        .await
}

/// Spends as much as admitted: `n` requests at `now`; returns how many passed.
async fn burst(f: &impl Store, limit: Limit, n: u32, now: Micros, mode: FailureMode) -> u32 {
    let mut admitted = 0;
    for _ in 0..n {
        let checked = check(f, 7, limit, 1, now, mode).await;
        if matches!(checked, Ok(Checked { decision: Some(d), .. }) if d.allowed) {
            admitted += 1;
        }
    }
    admitted
}

#[test]
fn n_local_shares_admit_at_most_the_limit_between_them() {
    let limit = Limit::per_second(100, 10).unwrap();
    for n in 1..=7u64 {
        let share = share(&limit, n, 1);
        assert_eq!(share.burst(), (100 / n).max(1));
        // N instances, each saturating its own share for 10 s.
        let stores: Vec<MemoryStore> = (0..n).map(|_| MemoryStore::new(10, 1)).collect();
        let mut admitted = 0u64;
        for step in 0..=1000u64 {
            let now = T0 + step * 10_000;
            for s in &stores {
                while s
                    .decide(&Check::new(BucketKey(1), share, 1, now))
                    .unwrap()
                    .allowed
                {
                    admitted += 1;
                }
            }
        }
        let bound = 100 + 10 * 10;
        assert!(admitted <= bound, "n={n}: {admitted} > {bound}");
        assert!(
            admitted * 100 >= bound * 90,
            "n={n}: only {admitted} of {bound}"
        );
    }
    // A cost above the share's burst still fits a local bucket.
    assert_eq!(share(&Limit::per_second(4, 1).unwrap(), 3, 2).burst(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_hung_store_costs_a_request_the_deadline_and_no_more() {
    let store = Switch::new();
    let f = failover(&store, 1);
    let limit = Limit::per_second(10, 1).unwrap();
    store.set(Health::Hung);
    let started = tokio::time::Instant::now();
    let checked = check(&f, 1, limit, 1, T0, FailureMode::Local)
        .await
        .unwrap();
    assert_eq!(started.elapsed(), Duration::from_millis(20));
    assert_eq!(checked.source, Source::Local);
    assert!(checked.decision.unwrap().allowed);
}

#[tokio::test(start_paused = true)]
async fn the_breaker_stops_calling_a_failing_store_then_probes_once() {
    let store = Switch::new();
    let f = failover(&store, 1);
    let limit = Limit::per_second(1000, 1).unwrap();
    store.set(Health::Hung);
    for _ in 0..3 {
        check(&f, 1, limit, 1, T0, FailureMode::Local)
            .await
            .unwrap();
    }
    assert_eq!(store.calls(), 3);
    assert_eq!(f.breaker().state(), BreakerState::Open);
    // Open: requests are decided at once, without a call.
    let started = tokio::time::Instant::now();
    for i in 0..50 {
        let c = check(&f, 1, limit, 1, T0 + i, FailureMode::Local)
            .await
            .unwrap();
        assert_eq!(c.source, Source::Local);
    }
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert_eq!(store.calls(), 3);
    // After the cooldown (on the breaker's monotonic clock) one probe goes
    // out; it finds the store back.
    tokio::time::advance(Duration::from_millis(500)).await;
    store.set(Health::Up);
    let c = check(&f, 1, limit, 1, T0 + SEC / 2, FailureMode::Local)
        .await
        .unwrap();
    assert_eq!(c.source, Source::Redis);
    assert_eq!(store.calls(), 4);
    assert_eq!(f.breaker().state(), BreakerState::Closed);
}

/// A check that misses its deadline but is answered within the allowance
/// proves the store alive: the request was decided by its failure mode at
/// the deadline, but the breaker does not count a failure. (What a starved
/// instance sees: the answer waits in the socket, not in Redis.) One that
/// is not answered within the allowance is a failure.
#[tokio::test(start_paused = true)]
async fn late_answers_keep_the_breaker_closed_and_missing_ones_open_it() {
    let store = Switch::new();
    let f = failover_awaiting_late_answers(&store, Duration::from_millis(50));
    let limit = Limit::per_second(1000, 1).unwrap();
    // 30 ms: past the 20 ms deadline, within the 50 ms allowance.
    store.set(Health::Slow(Duration::from_millis(30)));
    for i in 0..10 {
        let started = tokio::time::Instant::now();
        let c = check(&f, 1, limit, 1, T0 + i, FailureMode::Local)
            .await
            .unwrap();
        assert_eq!(started.elapsed(), Duration::from_millis(20), "the deadline");
        assert_eq!(c.source, Source::Local);
        // The late answer comes in.
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert_eq!(
        f.breaker().state(),
        BreakerState::Closed,
        "ten deadline misses, every one answered: the store is alive"
    );
    assert_eq!(store.calls(), 10, "every check still asked the store");
    let recent = f.breaker().recent();
    assert_eq!(recent.fallback_share, 1.0, "yet the fallback decided them");

    // 80 ms: not answered within the allowance: failures.
    store.set(Health::Slow(Duration::from_millis(80)));
    for i in 0..3 {
        check(&f, 1, limit, 1, T0 + 20 + i, FailureMode::Local)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert_eq!(f.breaker().state(), BreakerState::Open);
    assert_eq!(f.breaker().recent().breaker_opens, 1);
}

/// What `/readyz` reads: the share of recent checks the fallback decided,
/// over the window, whatever the breaker's state is now.
#[tokio::test(start_paused = true)]
async fn the_recent_share_counts_fallbacks_and_fades() {
    let store = Switch::new();
    let f = failover(&store, 2);
    let limit = Limit::per_second(1000, 1).unwrap();
    for i in 0..10 {
        check(&f, 1, limit, 1, T0 + i, FailureMode::Local)
            .await
            .unwrap();
    }
    assert_eq!(f.breaker().recent().fallback_share, 0.0);
    store.set(Health::Refusing);
    for i in 0..10 {
        check(&f, 1, limit, 1, T0 + 10 + i, FailureMode::Local)
            .await
            .unwrap();
    }
    let recent = f.breaker().recent();
    assert_eq!(recent.fallback_share, 0.5, "{recent:?}");
    assert_eq!(recent.breaker_opens, 1);
    // Back, and a probe closes the breaker: the share stays until the
    // window forgets it.
    store.set(Health::Up);
    tokio::time::advance(Duration::from_millis(500)).await;
    check(&f, 1, limit, 1, T0 + SEC, FailureMode::Local)
        .await
        .unwrap();
    assert_eq!(f.breaker().state(), BreakerState::Closed);
    assert!(f.breaker().recent().fallback_share > 0.45);
    tokio::time::advance(2 * RECENT_WINDOW).await;
    assert_eq!(f.breaker().recent().fallback_share, 0.0);
}

#[tokio::test(start_paused = true)]
async fn each_mode_answers_for_itself_while_the_store_refuses() {
    let store = Switch::new();
    let f = failover(&store, 4);
    let limit = Limit::per_second(40, 4).unwrap();
    store.set(Health::Refusing);

    let open = check(&f, 1, limit, 1, T0, FailureMode::Open).await.unwrap();
    assert_eq!(open.source, Source::FailOpen);
    assert_eq!(open.decision, None, "failing open counts nothing");

    let Err(StoreError::Unavailable { retry_after }) =
        check(&f, 1, limit, 1, T0, FailureMode::Closed).await
    else {
        panic!("closed must refuse");
    };
    assert!(retry_after >= Duration::from_secs(1));

    // Local: a quarter of the burst (Redis never answered for this client,
    // so its share starts full), then the share's rate (1/s).
    assert_eq!(burst(&f, limit, 20, T0, FailureMode::Local).await, 10);
    assert_eq!(burst(&f, limit, 20, T0 + SEC, FailureMode::Local).await, 1);
    let c = check(&f, 1, limit, 1, T0 + SEC, FailureMode::Local)
        .await
        .unwrap();
    assert_eq!(c.source, Source::Local);
    assert_eq!(c.limit.burst(), 10, "headers show the share in force");
}

/// Take-over and hand-back: a client that spent its whole burst in Redis
/// gets no fresh local share when Redis goes away, and no fresh burst when
/// Redis returns empty (restarted) or refilled (it was only unreachable).
#[tokio::test(start_paused = true)]
async fn redis_returning_grants_no_fresh_burst() {
    for (restarted, ceiling) in [(true, true), (false, true), (true, false), (false, false)] {
        let store = Switch::new();
        let f = failover(&store, 3);
        let f = if ceiling {
            f
        } else {
            f.without_hand_back_ceiling()
        };
        let limit = Limit::per_second(30, 3).unwrap();
        let local = FailureMode::Local;
        assert_eq!(
            burst(&f, limit, 40, T0, local).await,
            30,
            "Redis: the burst"
        );
        store.set(Health::Refusing);
        // The local share (10 tokens, 1/s) starts where Redis left off:
        // empty, so a second later it holds one token.
        assert_eq!(burst(&f, limit, 40, T0 + SEC, local).await, 1);
        store.set(Health::Up);
        if restarted {
            store.restart();
        }
        // The breaker opened; the first request after the cooldown probes.
        tokio::time::advance(Duration::from_secs(1)).await;
        let back = T0 + 2 * SEC;
        let admitted = burst(&f, limit, 40, back, local).await;
        assert_eq!(f.breaker().state(), BreakerState::Closed);
        if !ceiling {
            // Without the ceiling, what Redis holds: a fresh burst if it
            // restarted empty, else its 2 s of refill (6), on top of the
            // local share's token: 37 in 2 s where one bucket allows 36.
            assert_eq!(admitted, if restarted { 30 } else { 6 }, "no ceiling");
            continue;
        }
        // The local bucket refilled 1 of 10 tokens in the second since:
        // the shared bucket may hold a tenth of its capacity, 3 tokens.
        assert_eq!(admitted, 3, "restarted={restarted}");
        // Once the local bucket would be full again (10 s), Redis alone
        // decides: and it refilled at the full rate meanwhile.
        let later = back + 10 * SEC;
        assert_eq!(burst(&f, limit, 40, later, local).await, 30);
    }
}

/// Whatever the failure mode, a Redis restarted empty hands back no fresh
/// burst: not after fail-open or fail-closed (the local share never
/// decided anything), nor to a client that sent nothing while Redis was
/// away. Its local bucket, mirrored before the outage, refilled through it
/// as one bucket would have, and that is its ceiling.
#[tokio::test(start_paused = true)]
async fn a_restart_after_any_fallback_grants_no_fresh_burst() {
    let limit = Limit::per_second(30, 3).unwrap();
    for mode in [FailureMode::Open, FailureMode::Closed, FailureMode::Local] {
        for ceiling in [true, false] {
            let store = Switch::new();
            let f = failover(&store, 3);
            let f = if ceiling {
                f
            } else {
                f.without_hand_back_ceiling()
            };
            assert_eq!(burst(&f, limit, 40, T0, mode).await, 30, "Redis: the burst");
            store.set(Health::Refusing);
            // Another client meets the outage; the spent one sends nothing.
            let c = check(&f, 9, limit, 1, T0 + SEC, mode).await;
            assert_ne!(c.map(|c| c.source).ok(), Some(Source::Redis));
            store.set(Health::Up);
            store.restart();
            tokio::time::advance(Duration::from_secs(1)).await;
            // Two seconds after spending its burst, one bucket holds 6.
            let admitted = burst(&f, limit, 40, T0 + 2 * SEC, mode).await;
            assert_eq!(f.breaker().state(), BreakerState::Closed);
            let expected = if ceiling { 6 } else { 30 };
            assert_eq!(admitted, expected, "{mode:?}, ceiling {ceiling}");
        }
    }
}

/// Window algorithms mirror the room their window has left, not their
/// "reset" (which for them is when the count clears): losing Redis neither
/// hands out a fresh local share nor shuts the client out.
#[tokio::test(start_paused = true)]
async fn a_window_policy_falls_back_to_the_room_it_had() {
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindow] {
        let store = Switch::new();
        let f = failover(&store, 1);
        let limit = Limit::per_second(100, 10)
            .unwrap()
            .with_algorithm(algorithm);
        let local = FailureMode::Local;
        assert_eq!(burst(&f, limit, 40, T0, local).await, 40, "{algorithm:?}");
        store.set(Health::Refusing);
        // 60 of 100 were left; the local share (a bucket) starts there.
        assert_eq!(
            burst(&f, limit, 100, T0 + 1, local).await,
            60,
            "{algorithm:?}"
        );
    }
}

/// A ceiling set off by another client's fallback never squeezes a client
/// that Redis kept deciding, even when the share is not an exact 1/N (10
/// tokens over 3 instances: shares of 3).
#[tokio::test(start_paused = true)]
async fn the_ceiling_spares_clients_that_never_fell_back() {
    let store = Switch::new();
    let f = failover(&store, 3);
    let limit = Limit::per_second(10, 1).unwrap();
    let local = FailureMode::Local;
    // The victim spends half its burst through Redis.
    assert_eq!(burst(&f, limit, 5, T0, local).await, 5);
    // Another client meets a refusing Redis once: the ceiling is now live.
    store.set(Health::Refusing);
    let c = check(&f, 2, limit, 1, T0 + 1, local).await.unwrap();
    assert_eq!(c.source, Source::Local);
    store.set(Health::Up);
    // The victim, still decided by Redis, spends its refill (one per
    // second) and keeps the other half of its bucket.
    for second in 1..=9 {
        let c = check(&f, 7, limit, 1, T0 + second * SEC, local)
            .await
            .unwrap();
        assert_eq!(c.source, Source::Redis);
        let d = c.decision.unwrap();
        assert!(d.allowed, "second {second}");
        assert_eq!(d.remaining, 5, "second {second}");
    }
}

/// The breaker keeps its own monotonic time: a wall clock stepping back an
/// hour while it is open does not keep Redis bypassed for that hour.
#[tokio::test(start_paused = true)]
async fn the_breaker_ignores_wall_clock_steps() {
    let store = Switch::new();
    let f = failover(&store, 1);
    let limit = Limit::per_second(1000, 1).unwrap();
    store.set(Health::Refusing);
    for _ in 0..3 {
        check(&f, 1, limit, 1, T0, FailureMode::Local)
            .await
            .unwrap();
    }
    assert_eq!(f.breaker().state(), BreakerState::Open);
    store.set(Health::Up);
    tokio::time::advance(Duration::from_millis(500)).await;
    let c = check(&f, 1, limit, 1, T0 - 3600 * SEC, FailureMode::Local)
        .await
        .unwrap();
    assert_eq!(c.source, Source::Redis);
    assert_eq!(f.breaker().state(), BreakerState::Closed);
}

/// A cluster of [`Switch`]es: each half of the slots is served by one of
/// them, as its slot map says, and the map can change (a master failing
/// over to its replica).
#[derive(Debug)]
struct Cluster {
    nodes: Vec<(Arc<str>, Arc<Switch>)>,
    /// The node serving slots below 8192, and the one serving the rest.
    halves: Mutex<[usize; 2]>,
}

impl Cluster {
    fn new(names: &[&str]) -> Self {
        Self {
            nodes: names
                .iter()
                .map(|n| (Arc::from(*n), Switch::new()))
                .collect(),
            halves: Mutex::new([0, 1]),
        }
    }
    fn serving(&self, slot: u16) -> usize {
        self.halves.lock().unwrap()[usize::from(slot >= 8192)]
    }
}

impl Store for Cluster {
    fn check(&self, check: Check) -> CheckFuture<'_> {
        self.nodes[self.serving(check.key.slot())].1.check(check)
    }

    fn backend(&self) -> &'static str {
        "cluster"
    }

    fn slot_owner(&self, slot: u16) -> Option<Arc<str>> {
        Some(Arc::clone(&self.nodes[self.serving(slot)].0))
    }
}

/// A key whose slot is in the lower half (`false`) or the upper (`true`).
fn key_in_half(upper: bool, skip: u128) -> u128 {
    (skip..)
        .find(|&k| (BucketKey(k).slot() >= 8192) == upper)
        .unwrap()
}

/// One node failing sends only the keys it serves to the failure mode: its
/// breaker opens, the other node's keys are still decided by Redis and
/// `/readyz` names the one node. When its slots fail over to another node,
/// that node's own breaker (closed) takes the keys back at once, and the
/// dead node's open breaker is forgotten once no check has gone to it for
/// a while.
#[tokio::test(start_paused = true)]
async fn a_failing_node_sends_only_its_own_keys_to_the_fallback() {
    let cluster = Arc::new(Cluster::new(&["a:1", "b:1", "c:1"]));
    let settings = settings(1);
    let f = Failover::new(
        Deadline::new(Arc::clone(&cluster), settings.deadline),
        &settings,
        LocalShare::new(1, 1000, 1),
    );
    let limit = Limit::per_second(1000, 1).unwrap();
    let (on_a, on_b) = (key_in_half(false, 0), key_in_half(true, 0));
    cluster.nodes[0].1.set(Health::Hung);
    for i in 0..20 {
        let a = check(&f, on_a, limit, 1, T0 + i, FailureMode::Local).await;
        assert_eq!(a.unwrap().source, Source::Local);
        let b = check(&f, on_b, limit, 1, T0 + i, FailureMode::Local).await;
        assert_eq!(b.unwrap().source, Source::Redis, "b's keys stay exact");
    }
    assert_eq!(cluster.nodes[0].1.calls(), 3, "a's breaker opened at 3");
    assert_eq!(f.breaker().state(), BreakerState::Open);
    let degraded: Vec<_> = f.breaker().degraded();
    assert_eq!(degraded, [(Arc::from("a:1"), BreakerState::Open)]);

    // a's replica, c, is promoted: the slot map names c for a's slots.
    cluster.halves.lock().unwrap()[0] = 2;
    let a = check(&f, on_a, limit, 1, T0 + 30, FailureMode::Local).await;
    assert_eq!(
        a.unwrap().source,
        Source::Redis,
        "c decides a's keys at once"
    );
    assert_eq!(f.breaker().degraded().len(), 1, "a's breaker is still held");
    // A window without a check to a: it is forgotten.
    for step in 1..=11 {
        tokio::time::advance(Duration::from_secs(1)).await;
        check(&f, on_b, limit, 1, T0 + step * SEC, FailureMode::Local)
            .await
            .unwrap();
    }
    assert_eq!(f.breaker().degraded(), []);
    assert_eq!(f.breaker().state(), BreakerState::Closed);
}

/// A standalone store has one breaker, known from the start and kept
/// however long no check goes to it: nothing else can take its keys.
#[tokio::test(start_paused = true)]
async fn one_node_keeps_its_one_breaker() {
    let store = Switch::new();
    let f = failover(&store, 1);
    let limit = Limit::per_second(1000, 1).unwrap();
    store.set(Health::Refusing);
    for _ in 0..3 {
        check(&f, 1, limit, 1, T0, FailureMode::Local)
            .await
            .unwrap();
    }
    tokio::time::advance(Duration::from_secs(60)).await;
    assert_eq!(
        f.breaker().degraded(),
        [(Arc::from("switch"), BreakerState::Open)]
    );
}
