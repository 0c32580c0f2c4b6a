//! Nanoseconds per check: our `MemoryStore` against governor's keyed limiter.
//!
//! All run in one criterion process so their ratios are meaningful. Same
//! quota on both sides (burst 100, 10 per second), measured with one hot key
//! and with 10 000 keys visited in turn, in two pairings:
//! - `memory_store` vs `governor`: each as deployed, reading its production
//!   clock on every check (ours `FastClock`, governor its quanta clock);
//! - `memory_store_fixed_now` vs `governor_fake_clock`: no clock cost on
//!   either side (ours gets `now` once, governor a `FakeRelativeClock`), so
//!   only the algorithm and the keyed store are compared.
//!
//! `memory_store_system_clock` shows what a `clock_gettime` per check would
//! cost instead (`SystemClock`). Results are in `docs/bench-memory.md`.
//!
//! Both limiters soon drain every bucket and then mostly deny: at this quota a
//! key refills far slower than the loop revisits it. That is the path a
//! limiter under attack spends its time on, and it is the same on both sides.
//!
//! Bench names are stable (`cargo test --benches` and saved baselines use
//! them): `<group>/<function>` with groups `1_key`, `10k_keys`.

use criterion::{BenchmarkGroup, Criterion, criterion_group, measurement::WallTime};
use governor::clock::FakeRelativeClock;
use governor::middleware::{NoOpMiddleware, StateInformationMiddleware};
use governor::nanos::Nanos;
use governor::state::keyed::DefaultKeyedStateStore;
use governor::{Quota, RateLimiter};
use ratelimiter::algorithm::Limit;
use ratelimiter::clock::{Clock, FastClock, SystemClock};
use ratelimiter::store::{BucketKey, Check, MemoryStore};
use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

const BURST: u32 = 100;
const PER_SECOND: u32 = 10;
const MAX_KEYS: usize = 1_000_000;
const SHARDS: usize = 64;

/// Production keys are keyed SipHash outputs: spread over all 128 bits. An
/// odd multiplier spreads the index into the high bits (which pick the shard)
/// and the low bits (which the shard map hashes).
const SPREAD: u128 = 0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835;

fn keys(n: usize) -> Vec<u128> {
    (1..=n as u128).map(|i| i.wrapping_mul(SPREAD)).collect()
}

/// Benchmarks `check` on keys visited in turn, with a fresh state per bench.
fn cycle<K: Copy>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    keys: &[K],
    mut check: impl FnMut(K),
) {
    let mut i = 0;
    group.bench_function(name, |b| {
        b.iter(|| {
            let key = keys[i];
            i = if i + 1 == keys.len() { 0 } else { i + 1 };
            check(black_box(key));
        })
    });
}

fn bench_keys(group: &mut BenchmarkGroup<'_, WallTime>, n: usize) {
    let keys = keys(n);
    let store_keys: Vec<BucketKey> = keys.iter().map(|&k| BucketKey(k)).collect();
    // governor hashes its keys itself (SipHash via RandomState); u64 keys are
    // what a caller of it would most likely use.
    let governor_keys: Vec<u64> = keys.iter().map(|&k| k as u64).collect();
    let limit = Limit::per_second(u64::from(BURST), u64::from(PER_SECOND)).expect("valid limit");

    // One request value per caller, as the limiter builds one per request:
    // each check sets its key and instant.
    let mut check = Check::new(BucketKey(0), limit, 1, 0);

    let store = MemoryStore::new(MAX_KEYS, SHARDS);
    let clock = FastClock::default();
    cycle(group, "memory_store", &store_keys, |key| {
        check.key = key;
        check.now = clock.now();
        black_box(store.decide(&check)).ok();
    });

    let store = MemoryStore::new(MAX_KEYS, SHARDS);
    cycle(group, "memory_store_system_clock", &store_keys, |key| {
        check.key = key;
        check.now = SystemClock.now();
        black_box(store.decide(&check)).ok();
    });

    let store = MemoryStore::new(MAX_KEYS, SHARDS);
    let now = SystemClock.now();
    cycle(group, "memory_store_fixed_now", &store_keys, |key| {
        check.key = key;
        check.now = black_box(now);
        black_box(store.decide(&check)).ok();
    });

    let quota = Quota::per_second(NonZeroU32::new(PER_SECOND).expect("nonzero"))
        .allow_burst(NonZeroU32::new(BURST).expect("nonzero"));
    // DefaultKeyedStateStore: a DashMap with governor's default features.
    let limiter = RateLimiter::keyed(quota);
    cycle(group, "governor", &governor_keys, |key| {
        black_box(limiter.check_key(&key)).ok();
    });

    let limiter: RateLimiter<u64, _, FakeRelativeClock, NoOpMiddleware<Nanos>> = RateLimiter::new(
        quota,
        DefaultKeyedStateStore::<u64>::default(),
        FakeRelativeClock::default(),
    );
    cycle(group, "governor_fake_clock", &governor_keys, |key| {
        black_box(limiter.check_key(&key)).ok();
    });

    // What RateLimit-Remaining needs from governor: its state snapshot.
    let limiter = RateLimiter::keyed(quota).with_middleware::<StateInformationMiddleware>();
    cycle(group, "governor_state_info", &governor_keys, |key| {
        black_box(limiter.check_key(&key)).ok();
    });
}

/// The clocks alone: what each check pays to learn `now`.
fn clocks(c: &mut Criterion) {
    let mut group = c.benchmark_group("clock");
    group
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    let fast = FastClock::default();
    group.bench_function("fast_clock", |b| b.iter(|| black_box(fast.now())));
    group.bench_function("system_clock", |b| b.iter(|| black_box(SystemClock.now())));
    let quanta = governor::clock::QuantaClock::default();
    group.bench_function("governor_quanta_clock", |b| {
        b.iter(|| black_box(governor::clock::Clock::now(&quanta)))
    });
    group.finish();
}

fn memory_check(c: &mut Criterion) {
    for (name, n) in [("1_key", 1), ("10k_keys", 10_000)] {
        let mut group = c.benchmark_group(name);
        group
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3));
        bench_keys(&mut group, n);
        group.finish();
    }
}

criterion_group!(benches, memory_check, clocks);

/// One check of each variant the fixed-work modes below run, by bench
/// name, each with its own fresh state.
type Variant = (&'static str, Box<dyn FnMut(u128)>);

fn variants() -> Vec<Variant> {
    let limit = Limit::per_second(u64::from(BURST), u64::from(PER_SECOND)).expect("valid limit");
    let quota = Quota::per_second(NonZeroU32::new(PER_SECOND).expect("nonzero"))
        .allow_burst(NonZeroU32::new(BURST).expect("nonzero"));
    let check = Check::new(BucketKey(0), limit, 1, 0);
    let deployed = {
        let (mut check, store, clock) = (
            check,
            MemoryStore::new(MAX_KEYS, SHARDS),
            FastClock::default(),
        );
        move |key| {
            check.key = BucketKey(key);
            check.now = clock.now();
            black_box(store.decide(&check)).ok();
        }
    };
    let fixed_now = {
        let (mut check, store, now) =
            (check, MemoryStore::new(MAX_KEYS, SHARDS), SystemClock.now());
        move |key| {
            check.key = BucketKey(key);
            check.now = black_box(now);
            black_box(store.decide(&check)).ok();
        }
    };
    let governor = {
        let limiter = RateLimiter::keyed(quota);
        move |key: u128| {
            black_box(limiter.check_key(&(key as u64))).ok();
        }
    };
    let governor_fake_clock = {
        let limiter: RateLimiter<u64, _, FakeRelativeClock, NoOpMiddleware<Nanos>> =
            RateLimiter::new(
                quota,
                DefaultKeyedStateStore::<u64>::default(),
                FakeRelativeClock::default(),
            );
        move |key: u128| {
            black_box(limiter.check_key(&(key as u64))).ok();
        }
    };
    vec![
        ("memory_store", Box::new(deployed)),
        ("governor", Box::new(governor)),
        ("memory_store_fixed_now", Box::new(fixed_now)),
        ("governor_fake_clock", Box::new(governor_fake_clock)),
    ]
}

/// Runs `checks` checks of `variant` on `keys` visited in turn (from
/// where `next` left off); returns the wall time per check.
fn run(variant: &mut dyn FnMut(u128), keys: &[u128], next: &mut usize, checks: usize) -> f64 {
    let start = Instant::now();
    for _ in 0..checks {
        variant(black_box(keys[*next]));
        *next = if *next + 1 == keys.len() {
            0
        } else {
            *next + 1
        };
    }
    start.elapsed().as_nanos() as f64 / checks as f64
}

fn numbers(spec: &str, what: &str) -> [usize; 2] {
    let mut parts = spec.split(':').map(|p| p.parse::<usize>().expect(what));
    match (parts.next(), parts.next(), parts.next()) {
        (Some(a), Some(b), None) => [a, b],
        _ => panic!("{what}, not {spec:?}"),
    }
}

/// `MEMORY_CHECK_LOOP=<bench>:<keys>:<checks>` (e.g.
/// `memory_store_fixed_now:10000:1000000`) runs that many checks of one
/// variant and exits, instead of criterion: a fixed amount of work for
/// `valgrind --tool=callgrind`, whose instruction counts repeat exactly
/// where this VM's timings do not. Variants: `memory_store_fixed_now`,
/// `governor_fake_clock`, `memory_store`, `governor`.
fn fixed_loop(spec: &str) {
    let (name, rest) = spec.split_once(':').expect("<bench>:<keys>:<checks>");
    let [n, checks] = numbers(rest, "<bench>:<keys>:<checks>");
    let mut all = variants();
    let (_, variant) = all
        .iter_mut()
        .find(|(v, _)| *v == name)
        .unwrap_or_else(|| panic!("no loop variant {name:?}"));
    run(variant, &keys(n), &mut 0, checks);
}

/// `MEMORY_CHECK_INTERLEAVE=<keys>:<rounds>`: every variant in turn, a
/// million checks each (more for many keys), `rounds` times, then each one's min / median / max
/// ns per check. On a machine whose load comes and goes, turns taken
/// within a second of each other see the same load, which consecutive
/// criterion benches (seconds apart) do not.
fn interleaved(spec: &str) {
    const CHUNK: usize = 1_000_000;
    let [n, rounds] = numbers(spec, "<keys>:<rounds>");
    let keys = keys(n);
    let mut all = variants();
    let mut times = vec![Vec::new(); all.len()];
    let mut next = vec![0; all.len()];
    // A first round unrecorded: it drains the buckets (the admissions),
    // so that every recorded one measures what criterion does.
    for round in 0..=rounds {
        for (i, (_, variant)) in all.iter_mut().enumerate() {
            let t = run(variant, &keys, &mut next[i], CHUNK.max(n * 200));
            if round > 0 {
                times[i].push(t);
            }
        }
    }
    for ((name, _), mut t) in all.iter().zip(times) {
        t.sort_by(f64::total_cmp);
        println!(
            "{n} keys {name}: {:.1} / {:.1} / {:.1} ns per check (min / median / max of {rounds})",
            t[0],
            t[t.len() / 2],
            t[t.len() - 1]
        );
    }
}

fn main() {
    if let Ok(spec) = std::env::var("MEMORY_CHECK_LOOP") {
        fixed_loop(&spec);
        return;
    }
    if let Ok(spec) = std::env::var("MEMORY_CHECK_INTERLEAVE") {
        interleaved(&spec);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
