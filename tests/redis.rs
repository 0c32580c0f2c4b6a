//! The Redis stores against real redis-server processes (standalone and a
//! 3-node cluster), started on free loopback ports and killed on drop.

mod support;

use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use ratelimiter::algorithm::token_bucket::{self, BucketState};
use ratelimiter::algorithm::{Algorithm, Limit, MAX_EXACT};
use ratelimiter::store::redis::{RedisConnection, RedisSettings, redis_key};
use ratelimiter::store::{BucketKey, Check, LuaStore, NaiveStore, Store};
use std::sync::Arc;
use std::time::Duration;
use testkit::{RedisCluster, RedisServer};

const T0: u64 = 1_800_000_000_000_000;

fn settings(urls: Vec<String>, cluster: bool) -> RedisSettings {
    RedisSettings {
        prefix: "test:".into(),
        connect_timeout: Duration::from_secs(2),
        response_timeout: Duration::from_secs(2),
        retries: 2,
        ..RedisSettings::new(urls, cluster)
    }
}

/// Whether one request of cost 1 passes through `store` at T0.
async fn allowed(store: &impl Store, key: BucketKey, limit: Limit) -> bool {
    let checked = store.check(Check::new(key, limit, 1, T0)).await.unwrap();
    checked.decision.unwrap().allowed
}

async fn lua(settings: &RedisSettings) -> LuaStore {
    LuaStore::new(RedisConnection::connect(settings).await.unwrap(), settings)
}

/// Random (limit, calls) cases: odd periods, backwards steps, long idles.
/// (burst, rate, period_us), the first instant, and steps of (dt, cost,
/// ceiling percent).
type Case = ((u64, u64, u64), u64, Vec<(i64, u64, Option<u64>)>);

/// The largest instant a case starts at: 2^52 µs after the epoch (the year
/// 2112), so every instant plus every wait stays within 2^53.
const LATE: u64 = 1 << 52;

/// Small limits (the service's usual ones), where every quantity is a
/// small integer.
fn small_limits() -> impl Strategy<Value = (u64, u64, u64)> {
    (
        1u64..=50,
        1u64..=30,
        prop_oneof![Just(1_000_000u64), Just(60_000_000), 1u64..=7_000_000],
    )
}

/// Limits over the whole range `Limit::new` accepts: capacities up to
/// exactly 2^52 units, rates up to 2^52 units a microsecond, rates that do
/// not divide the period, periods of a microsecond to days.
fn wide_limits() -> impl Strategy<Value = (u64, u64, u64)> {
    let period = prop_oneof![
        Just(1u64),
        Just(3),
        Just(7_000_003),
        Just(1_000_000),
        Just(86_400_000_000),
        1u64..=1_000_000_000,
    ];
    (
        period,
        any::<prop::sample::Index>(),
        any::<prop::sample::Index>(),
        0usize..4,
    )
        .prop_map(|(period, b, r, shape)| {
            let max_burst = MAX_EXACT / period;
            let burst = match shape {
                0 => max_burst,
                1 => max_burst - b.index(max_burst.min(1000) as usize) as u64,
                _ => 1 + b.index(max_burst as usize) as u64,
            };
            let rate = match shape {
                2 => MAX_EXACT - r.index(1000) as u64,
                _ => 1 + r.index(MAX_EXACT as usize) as u64,
            };
            (burst.max(1), rate, period)
        })
        .prop_filter("a limit the service accepts", |&(b, r, p)| {
            Limit::new(b, r, Duration::from_micros(p)).is_ok()
        })
}

fn cases(limits: impl Strategy<Value = (u64, u64, u64)>) -> impl Strategy<Value = Case> {
    (limits, prop_oneof![Just(T0), Just(LATE - (1 << 40))]).prop_flat_map(|(limit, start)| {
        let steps = prop::collection::vec(
            (
                prop_oneof![
                    5 => 0i64..=3_000,
                    3 => 0i64..=3_000_000,
                    1 => 0i64..=200_000_000,
                    1 => 0i64..=(1 << 38),
                    1 => -2_000_000i64..=0,
                ],
                prop_oneof![4 => 0..=limit.0.min(4), 1 => Just(limit.0)],
                prop::option::weighted(0.2, 0u64..=110),
            ),
            1..120,
        );
        (Just(limit), Just(start), steps)
    })
}

/// Which paths of the token-bucket script's arithmetic a run took, computed
/// from the same quantities the script computes.
#[derive(Debug, Default)]
struct Paths {
    /// A refill product `elapsed × rate` above 2^53, so not exact in a
    /// double: the clamp to the capacity must make it exact.
    inexact_refill: u64,
    /// A wait whose deficit is not a whole number of microseconds' refill:
    /// the quotient is rounded up by the correction loop.
    rounded_up_wait: u64,
    /// Quantities above 2^50: where a double has fewer than 3 bits below
    /// the units place.
    near_the_limit: u64,
}

/// The Rust core and the Lua script, fed the same (now, cost, limit), give
/// identical decisions: allowed, remaining, retry_after and reset, with and
/// without a ceiling. Returns which arithmetic paths the cases took.
fn differential(
    store: &LuaStore,
    rt: &tokio::runtime::Runtime,
    cases: u32,
    limits: impl Strategy<Value = (u64, u64, u64)>,
) -> Paths {
    // A key per case, never reused by another call on the same server.
    static KEYS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut runner = TestRunner::new(ProptestConfig::with_cases(cases));
    let paths = std::cell::RefCell::new(Paths::default());
    runner
        .run(
            &cases_strategy(limits),
            |((burst, rate, period), start, steps)| {
                let n = KEYS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                let bucket_key = BucketKey(
                    u128::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835),
                );
                let limit = Limit::new(burst, rate, Duration::from_micros(period)).unwrap();
                let (unit, per_us, cap) = (
                    limit.units_per_token(),
                    limit.rate_units_per_us(),
                    limit.capacity_units(),
                );
                let mut state: Option<BucketState> = None;
                let mut now = start as i64;
                for (dt, cost, percent) in steps {
                    now += dt;
                    let ceiling = percent.map(|p| limit.capacity_units() / 100 * p);
                    {
                        let mut paths = paths.borrow_mut();
                        if let Some(s) = state {
                            let elapsed = (now as u64).saturating_sub(s.last);
                            if u128::from(elapsed) * u128::from(per_us) > 1 << 53 {
                                paths.inexact_refill += 1;
                            }
                        }
                        if cap > 1 << 50 {
                            paths.near_the_limit += 1;
                        }
                    }
                    let (expected, next) = token_bucket::check_within(
                        &limit,
                        state,
                        cost,
                        now as u64,
                        ceiling.unwrap_or(u64::MAX),
                    )
                    .unwrap();
                    if per_us != 1 {
                        // The units the script divides by the rate: what the
                        // bucket misses to be full, and (denied) to admit.
                        let deficits =
                            [cap - next.tokens, (cost * unit).saturating_sub(next.tokens)];
                        if deficits.iter().any(|d| d % per_us != 0) {
                            paths.borrow_mut().rounded_up_wait += 1;
                        }
                    }
                    // The stores keep no key for a full bucket.
                    if expected.allowed {
                        state = (!expected.reset.is_zero()).then_some(next);
                    }
                    let got = rt
                        .block_on(store.decide(
                            &Check::new(bucket_key, limit, cost, now as u64).with_ceiling(ceiling),
                        ))
                        .unwrap();
                    prop_assert_eq!(
                        got,
                        expected,
                        "now={} cost={} ceiling={:?} limit={:?}",
                        now,
                        cost,
                        ceiling,
                        limit
                    );
                }
                Ok(())
            },
        )
        .unwrap();
    paths.into_inner()
}

fn cases_strategy(limits: impl Strategy<Value = (u64, u64, u64)>) -> impl Strategy<Value = Case> {
    cases(limits)
}

/// Both kinds of limits, many cases: the small ones as the service runs
/// them, and the whole accepted range, where the script's arithmetic
/// leaves small integers: products past 2^53 that only the clamp makes
/// exact, and waits the correction loop rounds up.
fn differential_everywhere(store: &LuaStore, rt: &tokio::runtime::Runtime, cases: u32) {
    differential(store, rt, cases, small_limits());
    let paths = differential(store, rt, cases, wide_limits());
    eprintln!("paths taken over the whole range: {paths:?}");
    assert!(paths.inexact_refill > 0, "{paths:?}");
    assert!(paths.rounded_up_wait > 0, "{paths:?}");
    assert!(paths.near_the_limit > 0, "{paths:?}");
}

#[test]
fn lua_script_matches_the_rust_core_on_a_real_redis() {
    let redis = RedisServer::start().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(lua(&settings(vec![redis.url()], false)));
    differential_everywhere(&store, &rt, 256);
}

#[test]
fn lua_script_matches_the_rust_core_on_a_redis_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(lua(&settings(cluster.urls(), true)));
    differential_everywhere(&store, &rt, 128);
    // The keys really spread over the three masters.
    let holding = cluster
        .nodes
        .iter()
        .filter(|n| n.cli(&["dbsize"]).unwrap().trim() != "0")
        .count();
    assert!(holding >= 2, "keys landed on only {holding} node(s)");
}

/// GCRA, fixed window, sliding log and sliding-window counter: each Lua
/// script against its Rust core, the same random (now, cost, limit)
/// sequences (backward steps included), identical decisions.
fn differential_algorithms(store: &LuaStore, rt: &tokio::runtime::Runtime, cases: u32) {
    use ratelimiter::algorithm::{self, Algorithm};
    for algorithm in [
        Algorithm::Gcra,
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
    ] {
        let mut runner = TestRunner::new(ProptestConfig::with_cases(cases));
        let key = std::cell::Cell::new(0u128);
        runner
            .run(
                &cases_strategy(small_limits()),
                |((burst, rate, period), _, steps)| {
                    key.set(key.get() + 1);
                    let bucket_key = BucketKey(
                        (key.get() + 1000 * algorithm as u128)
                            .wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835),
                    );
                    let limit = Limit::new(burst, rate, Duration::from_micros(period))
                        .unwrap()
                        .with_algorithm(algorithm);
                    let mut state = None;
                    let mut now = T0 as i64;
                    for (dt, cost, _) in steps {
                        now += dt;
                        let (expected, next) =
                            algorithm::check(&limit, state.take(), cost, now as u64).unwrap();
                        state = next;
                        let got = rt
                            .block_on(
                                store.decide(&Check::new(bucket_key, limit, cost, now as u64)),
                            )
                            .unwrap();
                        prop_assert_eq!(
                            got,
                            expected,
                            "{:?} now={} cost={} limit={:?}",
                            algorithm,
                            now,
                            cost,
                            limit
                        );
                    }
                    Ok(())
                },
            )
            .unwrap();
    }
}

#[test]
fn every_algorithm_script_matches_its_rust_core_on_a_real_redis() {
    let redis = RedisServer::start().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(lua(&settings(vec![redis.url()], false)));
    differential_algorithms(&store, &rt, 64);
}

#[test]
fn every_algorithm_script_matches_its_rust_core_on_a_redis_cluster() {
    let cluster = RedisCluster::start().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(lua(&settings(cluster.urls(), true)));
    differential_algorithms(&store, &rt, 12);
}

#[tokio::test]
async fn keys_expire_when_full_again_and_denials_write_nothing() {
    let redis = RedisServer::start().unwrap();
    let settings = settings(vec![redis.url()], false);
    let store = lua(&settings).await;
    let key = BucketKey(42);
    let name = redis_key("test:", Algorithm::TokenBucket, key);
    // 2 tokens, 1 per second: spend both.
    let limit = Limit::per_second(2, 1).unwrap();
    for _ in 0..2 {
        assert!(
            store
                .decide(&Check::new(key, limit, 1, T0))
                .await
                .unwrap()
                .allowed
        );
    }
    let ttl: u64 = redis.cli(&["pttl", &name]).unwrap().trim().parse().unwrap();
    // Full again in 2 s, plus the 1 s margin.
    assert!((2_900..=3_000).contains(&ttl), "pttl {ttl}");
    let before = redis.cli(&["get", &name]).unwrap();
    let denied = store
        .decide(&Check::new(key, limit, 1, T0 + 500_000))
        .await
        .unwrap();
    assert!(!denied.allowed);
    assert_eq!(denied.retry_after, Duration::from_millis(500));
    assert_eq!(
        redis.cli(&["get", &name]).unwrap(),
        before,
        "a denial wrote"
    );
    // A zero-cost peek after the bucket refilled removes the key.
    let peek = store
        .decide(&Check::new(key, limit, 0, T0 + 2_000_000))
        .await
        .unwrap();
    assert_eq!(peek.remaining, 2);
    assert_eq!(redis.cli(&["exists", &name]).unwrap().trim(), "0");
    // No script's code (comments aside) reads the server clock.
    for algorithm in Algorithm::ALL {
        let code: String = algorithm
            .script()
            .lines()
            .map(|l| l.split("--").next().unwrap_or_default())
            .collect();
        assert!(code.contains("redis.call("), "{algorithm:?}");
        assert!(
            !code.to_uppercase().contains("TIME"),
            "{algorithm:?}'s script reads a clock"
        );
    }
    assert!(Algorithm::TokenBucket.script().contains("redis.call('GET'"));
}

#[tokio::test]
async fn evalsha_survives_script_flush() {
    let redis = RedisServer::start().unwrap();
    let store = lua(&settings(vec![redis.url()], false)).await;
    let limit = Limit::per_second(5, 1).unwrap();
    assert!(
        store
            .decide(&Check::new(BucketKey(1), limit, 1, T0))
            .await
            .unwrap()
            .allowed
    );
    redis.cli(&["script", "flush"]).unwrap();
    // NOSCRIPT makes redis-rs load the script and retry.
    let d = store
        .decide(&Check::new(BucketKey(1), limit, 1, T0))
        .await
        .unwrap();
    assert_eq!(d.remaining, 3);
    assert!(
        redis
            .cli(&[
                "script",
                "exists",
                store.script_hash(Algorithm::TokenBucket)
            ])
            .unwrap()
            .contains('1')
    );
}

/// The naive store's race, deterministically: two instances read the last
/// token before either writes, and both spend it.
#[tokio::test]
async fn naive_read_modify_write_double_spends_the_last_token() {
    let redis = RedisServer::start().unwrap();
    let settings = settings(vec![redis.url()], false);
    let a = NaiveStore::new(
        RedisConnection::connect(&settings).await.unwrap(),
        &settings,
    );
    let b = NaiveStore::new(
        RedisConnection::connect(&settings).await.unwrap(),
        &settings,
    );
    let limit = Limit::new(3, 1, Duration::from_secs(3600)).unwrap();
    let key = BucketKey(7);
    // Spend 2 of 3 tokens: one left.
    for _ in 0..2 {
        assert!(allowed(&a, key, limit).await);
    }
    let seen_by_a = a.read(key).await.unwrap();
    let seen_by_b = b.read(key).await.unwrap();
    assert_eq!(seen_by_a, seen_by_b);
    let first = a
        .decide_and_write(&Check::new(key, limit, 1, T0), seen_by_a)
        .await
        .unwrap();
    let second = b
        .decide_and_write(&Check::new(key, limit, 1, T0), seen_by_b)
        .await
        .unwrap();
    assert!(first.allowed && second.allowed, "both spent the last token");
    // 4 admitted from a bucket of 3; the stored state shows only 3 spent.
    assert!(!allowed(&a, key, limit).await);

    // The same interleaving cannot happen to the script: it is one step.
    let lua = lua(&settings).await;
    let key = BucketKey(8);
    let (x, y) = tokio::join!(
        async {
            let mut n = 0;
            for _ in 0..50 {
                n += u32::from(
                    lua.decide(&Check::new(key, limit, 1, T0))
                        .await
                        .unwrap()
                        .allowed,
                );
            }
            n
        },
        async {
            let mut n = 0;
            for _ in 0..50 {
                n += u32::from(
                    lua.decide(&Check::new(key, limit, 1, T0))
                        .await
                        .unwrap()
                        .allowed,
                );
            }
            n
        }
    );
    assert_eq!(x + y, 3);
}

#[tokio::test]
async fn concurrent_lua_checks_from_many_connections_never_over_admit() {
    let redis = RedisServer::start().unwrap();
    let settings = settings(vec![redis.url()], false);
    let mut stores = Vec::new();
    for _ in 0..4 {
        stores.push(Arc::new(lua(&settings).await));
    }
    let limit = Limit::new(100, 1, Duration::from_secs(3600)).unwrap();
    let mut tasks = Vec::new();
    for i in 0..32 {
        let store = Arc::clone(&stores[i % 4]);
        tasks.push(tokio::spawn(async move {
            let mut n = 0u32;
            for _ in 0..20 {
                n += u32::from(
                    store
                        .decide(&Check::new(BucketKey(99), limit, 1, T0))
                        .await
                        .unwrap()
                        .allowed,
                );
            }
            n
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    assert_eq!(admitted, 100, "640 concurrent checks on a bucket of 100");
}

#[tokio::test]
async fn redis_errors_are_classified() {
    // Nothing listens on this port: the first command is refused.
    let port = testkit::free_port().unwrap();
    let s = settings(vec![format!("redis://127.0.0.1:{port}")], false);
    let store = lua(&s).await;
    let err = store
        .decide(&Check::new(
            BucketKey(1),
            Limit::per_second(1, 1).unwrap(),
            1,
            T0,
        ))
        .await
        .unwrap_err();
    assert!(
        ["connection_refused", "io", "connection_dropped"].contains(&err.kind()),
        "{err} classified as {}",
        err.kind()
    );
    // A Redis that hangs (SIGSTOP is issue 5's; here, a listener that never
    // answers) is a timeout within the configured response timeout.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut s = settings(
        vec![format!(
            "redis://127.0.0.1:{}",
            silent.local_addr().unwrap().port()
        )],
        false,
    );
    s.response_timeout = Duration::from_millis(100);
    s.connect_timeout = Duration::from_millis(100);
    s.retries = 0;
    let store = lua(&s).await;
    let started = std::time::Instant::now();
    let err = store
        .decide(&Check::new(
            BucketKey(1),
            Limit::per_second(1, 1).unwrap(),
            1,
            T0,
        ))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "timeout", "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// Whatever path a write takes (a new TTL, or keeping the old one), the key
/// outlives its bucket's refill by at least half the margin; and dense
/// spending rarely pays for a new TTL.
#[tokio::test]
async fn key_expiry_always_covers_the_refill_and_is_rarely_reset() {
    let redis = RedisServer::start().unwrap();
    let settings = settings(vec![redis.url()], false);
    let store = lua(&settings).await;
    let mut conn = RedisConnection::connect(&settings).await.unwrap();
    let margin_us = settings.ttl_margin.as_micros() as u64;
    let limit = Limit::per_second(1000, 100).unwrap();
    let key = BucketKey(77);
    let name = redis_key("test:", Algorithm::TokenBucket, key);
    let mut now = T0;
    let (mut writes, mut refreshes, mut last_pttl) = (0, 0, 0i64);
    for i in 0..600u64 {
        now += (i * 7919) % 9_000; // 0..9 ms apart: faster than the 100/s refill
        let d = store.decide(&Check::new(key, limit, 1, now)).await.unwrap();
        if !d.allowed {
            continue;
        }
        writes += 1;
        let value: Vec<u8> = redis::cmd("GET")
            .arg(&name)
            .query_async(&mut conn)
            .await
            .unwrap();
        let expires = f64::from_le_bytes(value[16..24].try_into().unwrap()) as u64;
        let reset = d.reset.as_micros() as u64;
        assert!(
            expires >= now + reset + margin_us / 2,
            "expires {expires} < now {now} + reset {reset} + margin/2"
        );
        let pttl: i64 = redis::cmd("PTTL")
            .arg(&name)
            .query_async(&mut conn)
            .await
            .unwrap();
        if pttl > last_pttl {
            refreshes += 1;
        }
        last_pttl = pttl;
    }
    assert!(writes > 100, "only {writes} admitted");
    assert!(
        refreshes * 4 < writes,
        "{refreshes} TTL resets for {writes} writes"
    );
}

/// The HTTP contract holds for the window algorithms too, with their own
/// meaning of reset: a fixed window of 10 per 10 s, on a manual clock.
#[tokio::test]
async fn a_fixed_window_policy_speaks_the_same_headers_over_http() {
    use ratelimiter::clock::ManualClock;
    let redis = RedisServer::start().unwrap();
    let w = 10_000_000;
    // 4 s into a window.
    let start = (T0 / w + 1) * w + 4_000_000;
    let clock = ManualClock::new(start);
    let config = format!(
        "backend = \"lua\"\nkey_secret = \"0123456789abcdef0123\"\n\
         [redis]\nurl = \"{}\"\nprefix = \"http-fw:\"\nresponse_timeout = \"2s\"\n\
         [failure]\ndeadline = \"2s\"\nmode = \"closed\"\n\
         [[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 10\nrate = 1\nalgorithm = \"fixed_window\"\n",
        redis.url()
    );
    let server = support::TestServer::start(&config, Arc::new(clock.clone())).await;
    let http = support::client();
    for i in 0..10u64 {
        let r = server.get(&http, "/api/items", &[]).await;
        assert_eq!(r.status(), 200, "request {i}");
        assert_eq!(support::header(&r, "ratelimit-limit"), "10");
        assert_eq!(
            support::header(&r, "ratelimit-remaining"),
            (9 - i).to_string()
        );
        // The count resets at the window's end, 6 s away.
        assert_eq!(support::header(&r, "ratelimit-reset"), "6");
        assert_eq!(support::header(&r, "ratelimit-policy"), "\"api\";q=10;w=10");
    }
    let r = server.get(&http, "/api/items", &[]).await;
    assert_eq!(r.status(), 429);
    assert_eq!(support::header(&r, "retry-after"), "6");
    // At the boundary the whole limit is back: the fixed window's weakness.
    clock.set(start + 6_000_000);
    let r = server.get(&http, "/api/items", &[]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(support::header(&r, "ratelimit-remaining"), "9");
}

/// A policy changed under live keys (burst lowered or raised, so the window
/// length changes too) neither breaks the scripts' replies nor locks a
/// client out: every answer parses, and no wait exceeds the longer window.
#[tokio::test]
async fn a_changed_policy_neither_breaks_replies_nor_locks_clients_out() {
    use ratelimiter::algorithm::Algorithm;
    let redis = RedisServer::start().unwrap();
    let store = lua(&settings(vec![redis.url()], false)).await;
    for algorithm in Algorithm::ALL {
        let key = BucketKey(0xC4A9_0000 + algorithm as u128);
        let limit = |burst| {
            Limit::per_second(burst, 1)
                .unwrap()
                .with_algorithm(algorithm)
        };
        for _ in 0..15 {
            assert!(
                store
                    .decide(&Check::new(key, limit(20), 1, T0))
                    .await
                    .unwrap()
                    .allowed
            );
        }
        // Lowered: the stored count is above the new limit.
        for burst in [5, 40, 20] {
            let d = store
                .decide(&Check::new(key, limit(burst), 1, T0 + 1_000))
                .await
                .unwrap_or_else(|e| panic!("{algorithm:?} burst {burst}: {e}"));
            assert!(d.remaining <= burst, "{algorithm:?}: {d:?}");
            assert!(
                d.retry_after <= Duration::from_secs(40) && d.reset <= Duration::from_secs(80),
                "{algorithm:?} burst {burst}: {d:?}"
            );
            let ttl: i64 = redis
                .cli(&["pttl", &store.key_name(algorithm, key)])
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            assert!(
                ttl <= 90_000,
                "{algorithm:?} burst {burst}: key lives {ttl} ms"
            );
        }
    }
}

/// Found by the differential test: a trim at a later instant, then a step
/// back to the newest entry's instant, must not reuse a member name (the
/// sorted set would silently count two tokens as one).
#[tokio::test]
async fn sliding_log_members_stay_unique_after_a_later_trim() {
    use ratelimiter::algorithm::{self, Algorithm};
    let redis = RedisServer::start().unwrap();
    let store = lua(&settings(vec![redis.url()], false)).await;
    let limit = Limit::new(46, 15, Duration::from_micros(2_093_494))
        .unwrap()
        .with_algorithm(Algorithm::SlidingLog);
    let steps: [(i64, u64); 9] = [
        (0, 1),
        (1_706_741, 0),
        (-1, 0),
        (387_980, 0),
        (2_950_642, 1),
        (670_860, 0),
        (703_827, 0),
        (-1_395_342, 3),
        (1_690, 3),
    ];
    let (mut now, mut state) = (T0 as i64, None);
    for (dt, cost) in steps {
        now += dt;
        let (expected, next) = algorithm::check(&limit, state.take(), cost, now as u64).unwrap();
        state = next;
        let got = store
            .decide(&Check::new(BucketKey(77), limit, cost, now as u64))
            .await
            .unwrap();
        assert_eq!(got, expected, "now={now} cost={cost}");
    }
}

/// Every Redis call is timed by the node that served it. In a cluster the
/// node comes from the slot map, and follows a slot moved to another node
/// (its keys with it: the bucket carries on where it was).
#[test]
fn redis_calls_are_labelled_by_their_node_and_the_label_follows_a_moved_slot() {
    use ratelimiter::store::redis::topology;
    let handle = ratelimiter::metrics::install();
    let cluster = RedisCluster::start().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut s = settings(cluster.urls(), true);
    s.prefix = "moved:".into();
    s.topology_refresh = Duration::from_millis(100);
    let store = rt.block_on(lua(&s));
    let key = BucketKey(0x5107_0000);
    let name = store.key_name(Algorithm::TokenBucket, key);
    let slot = cluster.keyslot(&name).unwrap();
    assert_eq!(
        topology::slot(name.as_bytes()),
        slot,
        "our CRC16 is the cluster's"
    );
    let from = cluster.owner(slot).unwrap();
    let to = (from + 1) % cluster.nodes.len();
    let node = |i: usize| format!("127.0.0.1:{}", cluster.nodes[i].port);
    let calls = |i: usize| {
        support::metric(
            &handle.render(),
            "ratelimit_redis_call_duration_seconds_count",
            &[("node", &node(i)), ("script", "token_bucket")],
        )
    };
    let limit = Limit::new(1000, 1, Duration::from_secs(3600)).unwrap();
    let mut remaining = Vec::new();
    // Until the task has read the slot map, a call is labelled `unknown`.
    let mut check_until_on = |i: usize| {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let before = calls(i);
            let d = rt
                .block_on(store.decide(&Check::new(key, limit, 1, T0)))
                .unwrap();
            remaining.push(d.remaining);
            if calls(i) == before + 1.0 {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "calls never labelled {}",
                node(i)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    check_until_on(from);
    let others: Vec<f64> = (0..3).filter(|&i| i != from).map(calls).collect();
    check_until_on(from);
    assert_eq!(
        (0..3).filter(|&i| i != from).map(calls).collect::<Vec<_>>(),
        others,
        "a call of slot {slot} was labelled with another node"
    );
    cluster.move_slot(slot, to).unwrap();
    check_until_on(to);
    // The key moved with its slot: the bucket counted on, never reset.
    assert!(
        remaining.windows(2).all(|w| w[1] + 1 == w[0]),
        "{remaining:?}"
    );
}

/// A call the deadline cuts short is counted against its node, as a
/// `deadline` error, on the Redis call's own metrics.
#[tokio::test]
async fn a_call_cut_short_by_the_deadline_is_counted_against_its_node() {
    use ratelimiter::failover::Deadline;
    let handle = ratelimiter::metrics::install();
    let redis = RedisServer::start().unwrap();
    let mut s = settings(vec![redis.url()], false);
    s.response_timeout = Duration::from_secs(5);
    let store = Deadline::new(lua(&s).await, Duration::from_millis(100));
    let node = format!("127.0.0.1:{}", redis.port);
    let errors = || {
        support::metric(
            &handle.render(),
            "ratelimit_redis_errors_total",
            &[("node", &node), ("kind", "deadline")],
        )
    };
    let limit = Limit::per_second(10, 1).unwrap();
    // Connected and answering first.
    assert!(allowed(&store, BucketKey(1), limit).await);
    assert_eq!(errors(), 0.0);
    redis.pause().unwrap();
    let err = store
        .check(Check::new(BucketKey(1), limit, 1, T0))
        .await
        .unwrap_err();
    redis.resume().unwrap();
    assert_eq!(err.kind(), "deadline");
    assert_eq!(errors(), 1.0);
}

/// The hand-back ceiling against a real Redis restart: a client spends its
/// burst in Redis; Redis is killed (the local share takes over, starting
/// where Redis left off) and restarted empty. With the ceiling, the client
/// gets back only what one bucket would hold by then (3 of 30); in a
/// deliberately broken build without it, the empty Redis hands it all 30
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_redis_hands_back_no_fresh_burst() {
    use ratelimiter::failover::{Deadline, Failover, FailoverSettings, LocalShare};
    use ratelimiter::store::{FailureMode, Source};
    for ceiling in [true, false] {
        let mut redis = RedisServer::start().unwrap();
        let settings = settings(vec![redis.url()], false);
        let failover_settings = FailoverSettings {
            mode: FailureMode::Local,
            deadline: Duration::from_secs(2),
            instances: 3,
            breaker_failures: 1,
            breaker_cooldown: Duration::from_millis(200),
        };
        let f = Failover::new(
            Deadline::new(lua(&settings).await, failover_settings.deadline),
            &failover_settings,
            LocalShare::new(3, 1000, 1),
        );
        let f = if ceiling {
            f
        } else {
            f.without_hand_back_ceiling()
        };
        let limit = Limit::per_second(30, 3).unwrap();
        let key = BucketKey(77);
        let burst = |now: u64| {
            let f = &f;
            async move {
                let mut by = std::collections::BTreeMap::<&str, u32>::new();
                for _ in 0..40 {
                    let c = f
                        .check(Check::new(key, limit, 1, now).on_failure(FailureMode::Local))
                        .await
                        .unwrap();
                    if c.decision.unwrap().allowed {
                        *by.entry(c.source.as_str()).or_default() += 1;
                    }
                }
                by
            }
        };
        assert_eq!(burst(T0).await.get("redis"), Some(&30));
        redis.kill().unwrap();
        // The local share (10 at 1/s) starts empty, as Redis left it.
        let away = burst(T0 + 1_000_000).await;
        assert_eq!(away.get("local"), Some(&1), "{away:?}");
        redis.restart().unwrap();
        // Until the connection is back and the breaker has cooled down.
        let back = T0 + 2_000_000;
        let mut admitted = 0;
        let mut from_redis = false;
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let c = f
                .check(Check::new(key, limit, 0, back).on_failure(FailureMode::Local))
                .await
                .unwrap();
            if c.source == Source::Redis {
                from_redis = true;
                break;
            }
        }
        assert!(from_redis, "Redis never decided again");
        admitted += burst(back).await.values().sum::<u32>();
        if ceiling {
            assert_eq!(admitted, 3, "a tenth of the bucket, as one bucket holds");
        } else {
            assert_eq!(admitted, 30, "without the ceiling: a fresh burst");
        }
    }
}

/// The stored bucket: (tokens, last, expires) as the script packs them.
async fn stored(url: &str, name: &str) -> Option<(f64, f64, f64)> {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let raw: Option<Vec<u8>> = redis::cmd("GET")
        .arg(name)
        .query_async(&mut conn)
        .await
        .unwrap();
    let raw = raw?;
    assert_eq!(raw.len(), 24);
    let f = |i: usize| f64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().unwrap());
    Some((f(0), f(1), f(2)))
}

/// A key left to expire in Redis (no peek deletes it): when it is gone the
/// bucket is full, exactly as the Rust core says it is by then.
#[tokio::test]
async fn a_key_expires_in_redis_and_the_bucket_is_full() {
    let redis = RedisServer::start().unwrap();
    let mut settings = settings(vec![redis.url()], false);
    settings.ttl_margin = Duration::from_millis(50);
    let store = lua(&settings).await;
    let key = BucketKey(4242);
    let name = redis_key("test:", Algorithm::TokenBucket, key);
    // 2 tokens at 20/s: one spent is full again in 50 ms; the key lives
    // 50 ms more (the margin).
    let limit = Limit::per_second(2, 20).unwrap();
    let spent = store.decide(&Check::new(key, limit, 1, T0)).await.unwrap();
    assert!(spent.allowed);
    let pttl: i64 = redis.cli(&["pttl", &name]).unwrap().trim().parse().unwrap();
    assert!((1..=100).contains(&pttl), "pttl {pttl}");
    let started = std::time::Instant::now();
    while redis.cli(&["exists", &name]).unwrap().trim() != "0" {
        assert!(started.elapsed() < Duration::from_secs(10), "never expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Expired: full, as the core says 100 ms later (both tokens).
    let later = T0 + 100_000;
    let (expected, _) = token_bucket::check_within(
        &limit,
        Some(BucketState {
            tokens: limit.capacity_units() - limit.units_per_token(),
            last: T0,
        }),
        2,
        later,
        u64::MAX,
    )
    .unwrap();
    let got = store
        .decide(&Check::new(key, limit, 2, later))
        .await
        .unwrap();
    assert!(got.allowed);
    assert_eq!(got, expected);
}

/// The TTL runs on the server's clock, "full" on the instances': expiry
/// loses nothing while instances' clocks agree within half the margin.
/// The worst case: instance A, ahead by `d`, empties the bucket and sets
/// the TTL (full + margin, by its clock); instance B, on the server's time,
/// spends again just when the TTL left is exactly full + margin / 2 by
/// B's reckoning, so the script keeps it. The key then expires
/// `d - margin / 2` before the bucket is full: only a skew beyond half the
/// margin loses tokens (a full bucket early).
#[tokio::test]
async fn expiry_loses_nothing_while_clocks_agree_within_half_the_margin() {
    let redis = RedisServer::start().unwrap();
    let settings = settings(vec![redis.url()], false); // margin 1 s
    let store = lua(&settings).await;
    let limit = Limit::per_second(10, 10).unwrap();
    for (n, (skew_ms, loses)) in [
        (0, false),
        (250, false),
        (500, false),
        (600, true),
        (1000, true),
    ]
    .into_iter()
    .enumerate()
    {
        let key = BucketKey(5000 + n as u128);
        let name = redis_key("test:", Algorithm::TokenBucket, key);
        let skew = skew_ms * 1000;
        // Server time S0 = T0. A's clock reads T0 + skew: it empties the
        // bucket; full in 1 s, the key lives 1 s + the margin.
        let a = store
            .decide(&Check::new(key, limit, 10, T0 + skew))
            .await
            .unwrap();
        assert!(a.allowed);
        let (_, _, expires_a) = stored(&redis.url(), &name).await.unwrap();
        // B, 0.5 s after A's instant: 5 tokens back, it spends them; full
        // in 1 s from B's now, and A's TTL has exactly 1.5 s = reset +
        // half the margin left: kept.
        let b_now = T0 + skew + 500_000;
        let b = store
            .decide(&Check::new(key, limit, 5, b_now))
            .await
            .unwrap();
        assert!(b.allowed);
        let (_, _, expires_b) = stored(&redis.url(), &name).await.unwrap();
        assert_eq!(expires_b, expires_a, "skew {skew_ms} ms: the TTL was kept");
        // Expiry in server time: A's expiry by A's clock, less its skew.
        let expiry = expires_a as u64 - skew;
        let full = b_now + b.reset.as_micros() as u64;
        assert_eq!(
            expiry < full,
            loses,
            "skew {skew_ms} ms: expiry at {expiry}, full at {full}"
        );
        // 0.1 s later B spends the token that came back: full in 1 s, and
        // the TTL left (1.4 s) is under full + half the margin: renewed.
        let b2 = store
            .decide(&Check::new(key, limit, 1, b_now + 100_000))
            .await
            .unwrap();
        assert!(b2.allowed);
        let (_, _, expires_b2) = stored(&redis.url(), &name).await.unwrap();
        assert_ne!(
            expires_b2, expires_a,
            "skew {skew_ms} ms: the TTL was renewed"
        );
    }
}

/// A denial writes nothing, as Redis itself reports every command a script
/// runs (MONITOR): the denied check's script does its GET and nothing else,
/// for each algorithm that promises it. (The sliding log trims expired
/// entries on every call, a denial included.)
#[tokio::test]
async fn a_denial_runs_only_reads() {
    let redis = RedisServer::start().unwrap();
    let store = lua(&settings(vec![redis.url()], false)).await;
    for algorithm in [
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
    ] {
        let limit = Limit::per_second(2, 1).unwrap().with_algorithm(algorithm);
        let key = BucketKey(6000 + algorithm as u128);
        for _ in 0..2 {
            assert!(
                store
                    .decide(&Check::new(key, limit, 1, T0))
                    .await
                    .unwrap()
                    .allowed
            );
        }
        let mut monitor = std::process::Command::new("redis-cli")
            .args(["-p", &redis.port.to_string(), "monitor"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // MONITOR prints OK once it is listening.
        let mut out = std::io::BufReader::new(monitor.stdout.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert_eq!(line.trim(), "OK");
        let denied = store
            .decide(&Check::new(key, limit, 1, T0 + 100_000))
            .await
            .unwrap();
        assert!(!denied.allowed, "{algorithm:?}");
        // A marker after the script: everything before it is the denial's.
        redis.cli(&["echo", "end-of-denial"]).unwrap();
        let mut commands = Vec::new();
        loop {
            line.clear();
            std::io::BufRead::read_line(&mut out, &mut line).unwrap();
            if line.contains("end-of-denial") {
                break;
            }
            if line.contains(" lua]") {
                commands.push(line.split('"').nth(1).unwrap_or_default().to_uppercase());
            }
        }
        monitor.kill().unwrap();
        monitor.wait().unwrap();
        assert!(
            !commands.is_empty(),
            "{algorithm:?}: no script command seen"
        );
        assert!(
            commands.iter().all(|c| c == "GET" || c == "MGET"),
            "{algorithm:?}: a denial ran {commands:?}"
        );
    }
}
