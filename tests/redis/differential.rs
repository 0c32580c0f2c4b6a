//! The Lua scripts against their Rust cores, on random cases: standalone
//! and on a cluster.

use super::*;

/// Random (limit, calls) cases: odd periods, backwards steps, long idles.
/// (burst, rate, period_us), the first instant, and steps of (dt, cost,
/// ceiling percent, a lease's take beyond the cost as (extra, leave)).
type Case = ((u64, u64, u64), u64, Vec<Step>);
type Step = (i64, u64, Option<u64>, Option<(u64, u64)>);

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

fn cases_strategy(
    limits: impl Strategy<Value = (u64, u64, u64)>,
    takes: bool,
) -> impl Strategy<Value = Case> {
    (limits, prop_oneof![Just(T0), Just(LATE - (1 << 40))]).prop_flat_map(move |(limit, start)| {
        let burst = limit.0.min(1 << 40);
        let take = if takes {
            prop::option::weighted(0.6, (0..=burst + 1, 0..=burst + 2)).boxed()
        } else {
            Just(None).boxed()
        };
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
                take,
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
    /// Tokens granted beyond the cost, by lease takes.
    granted: u64,
}

/// The Rust core and the Lua script, fed the same (now, cost, limit), give
/// identical decisions: allowed, remaining, retry_after and reset, with and
/// without a ceiling, and (with `takes`) the same tokens granted beyond the
/// cost. Returns which arithmetic paths the cases took.
fn differential(
    store: &LuaStore,
    rt: &tokio::runtime::Runtime,
    cases: u32,
    limits: impl Strategy<Value = (u64, u64, u64)>,
    takes: bool,
) -> Paths {
    // A key per case, never reused by another call on the same server.
    static KEYS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut runner = TestRunner::new(ProptestConfig::with_cases(cases));
    let paths = std::cell::RefCell::new(Paths::default());
    runner
        .run(
            &cases_strategy(limits, takes),
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
                let mut granted = 0;
                for (dt, cost, percent, take) in steps {
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
                    let take = take.map(|(extra, leave)| TakeUpTo { extra, leave });
                    let (expected, next, extra) = token_bucket::check_up_to(
                        &limit,
                        state,
                        cost,
                        now as u64,
                        ceiling.unwrap_or(u64::MAX),
                        take.unwrap_or(TakeUpTo::NONE),
                    )
                    .unwrap();
                    granted += extra;
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
                    let mut check =
                        Check::new(bucket_key, limit, cost, now as u64).with_ceiling(ceiling);
                    check.take = take;
                    let got = rt.block_on(store.decide_taking(&check)).unwrap();
                    prop_assert_eq!(
                        got,
                        (expected, extra),
                        "now={} cost={} ceiling={:?} take={:?} limit={:?}",
                        now,
                        cost,
                        ceiling,
                        take,
                        limit
                    );
                }
                paths.borrow_mut().granted += granted;
                Ok(())
            },
        )
        .unwrap();
    paths.into_inner()
}

/// Both kinds of limits, many cases: the small ones as the service runs
/// them, and the whole accepted range, where the script's arithmetic
/// leaves small integers: products past 2^53 that only the clamp makes
/// exact, and waits the correction loop rounds up.
fn differential_everywhere(store: &LuaStore, rt: &tokio::runtime::Runtime, cases: u32) {
    differential(store, rt, cases, small_limits(), false);
    let paths = differential(store, rt, cases, wide_limits(), false);
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

/// A lease's take (up to N beyond the cost, only if at most L remain): the
/// script grants what the Rust core grants, over both kinds of limits.
#[test]
fn a_take_beyond_the_cost_matches_the_rust_core_on_a_real_redis() {
    let redis = RedisServer::start().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(lua(&settings(vec![redis.url()], false)));
    let small = differential(&store, &rt, 256, small_limits(), true);
    assert!(small.granted > 0, "{small:?}");
    let wide = differential(&store, &rt, 128, wide_limits(), true);
    eprintln!("paths taken with takes over the whole range: {wide:?}");
    assert!(wide.granted > 0, "{wide:?}");
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
                &cases_strategy(small_limits(), true),
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
                    for (dt, cost, _, take) in steps {
                        now += dt;
                        let (expected, next) =
                            algorithm::check(&limit, state.take(), cost, now as u64).unwrap();
                        state = next;
                        // Only a token bucket takes beyond the cost.
                        let mut check = Check::new(bucket_key, limit, cost, now as u64);
                        check.take = take.map(|(extra, leave)| TakeUpTo { extra, leave });
                        let got = rt.block_on(store.decide_taking(&check)).unwrap();
                        prop_assert_eq!(
                            got,
                            (expected, 0),
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
