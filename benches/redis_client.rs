//! The client side of one Lua check: this process's CPU per `LuaStore`
//! check, against what the same checks cost the Redis server, in one run.
//!
//! The bench starts its own `redis-server` on a free 127.0.0.1 port
//! (testkit), pinned to CPU 0; run the bench pinned elsewhere so the two do
//! not share a core:
//!
//! ```sh
//! taskset -c 1 cargo bench --bench redis_client
//! ```
//!
//! Each criterion "iteration" is one check, and its time is this process's
//! CPU time (`CLOCK_PROCESS_CPUTIME_ID`: user and system, every thread),
//! not wall time: encoding the EVALSHA, the connection's driver, the
//! socket syscalls, decoding the reply, the futures. Two shapes, each at
//! three depths (1: each check waits for its answer, and pays its own
//! write and read syscalls; 16 and 64: that many concurrent checks
//! pipelined on the one connection, as under load, a batch sharing one
//! write and one read):
//!
//! - `N_in_flight`: N checks at a time in one `FuturesUnordered`, on
//!   tokio's current-thread runtime (all one thread's work).
//! - `N_tasks`: as the service runs them, each check awaited by its own
//!   task (the service's is the request's connection task), N tasks each
//!   checking in a loop, on a multi-thread runtime with one worker, as a
//!   service pinned to one core has (`BENCH_WORKERS=2` gives it two, both
//!   on the CPU the bench is pinned to). This shape shows what the first
//!   hides: a task woken by the running task runs next (tokio's LIFO
//!   slot), so a driver that wrote at once would write each check in its
//!   own syscall; it yields once under concurrency instead
//!   (`src/store/redis/pipe.rs`, `Connection::take_output`).
//!
//! Redis's side over the same window (warm-up included, as for ours):
//! `INFO commandstats` (`usec` per EVALSHA: the script's own time) and
//! `INFO cpu` (the whole server per check, its networking included). After
//! each bench a line prints both and the ratios ours / Redis's; the figures
//! are in docs/performance.md ("Client side of a Redis check").
//!
//! Every check is admitted (a bucket far larger than the traffic) on
//! 10 000 keys: the script's write path, the costlier one. The service's
//! telemetry is installed as a default config installs it: the metrics
//! recorder (each call's duration goes into its node's histogram) and the
//! log subscriber, under which the Redis span's callsite is disabled (no
//! trace endpoint). Without a subscriber, `tracing` hands every span to
//! the `log` crate instead, a path the service never takes and whose cost
//! would be counted as the client's.

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, criterion_group};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use nix::time::{ClockId, clock_gettime};
use ratelimiter::algorithm::Limit;
use ratelimiter::clock::{Clock, SystemClock};
use ratelimiter::config::Config;
use ratelimiter::store::redis::{RedisConnection, RedisSettings};
use ratelimiter::store::{BucketKey, Check, LuaStore};
use ratelimiter::telemetry;
use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use testkit::RedisServer;
use tokio::runtime::Runtime;

const KEYS: u128 = 10_000;

/// This process's CPU time so far (every thread, user and system).
fn process_cpu() -> Duration {
    let t = clock_gettime(ClockId::CLOCK_PROCESS_CPUTIME_ID).expect("process CPU clock");
    Duration::new(t.tv_sec() as u64, t.tv_nsec() as u32)
}

fn settings(url: &str) -> RedisSettings {
    RedisSettings {
        prefix: "bench:".to_owned(),
        connect_timeout: Duration::from_secs(2),
        response_timeout: Duration::from_secs(2),
        ..RedisSettings::new(vec![url.to_owned()], false)
    }
}

/// Redis's counters: EVALSHA calls, their own time (us), server CPU (s).
#[derive(Debug, Clone, Copy)]
struct ServerStats {
    calls: f64,
    usec: f64,
    cpu: f64,
}

fn field(info: &str, name: &str) -> f64 {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} in INFO"))
}

async fn server_stats(admin: &mut RedisConnection) -> ServerStats {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .arg("cpu")
        .query_async(admin)
        .await
        .expect("INFO");
    let line = info
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
        .unwrap_or("calls=0,usec=0");
    let get = |key: &str| -> f64 {
        line.split(',')
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    ServerStats {
        calls: get("calls"),
        usec: get("usec"),
        cpu: field(&info, "used_cpu_user") + field(&info, "used_cpu_sys"),
    }
}

/// Benches `name`: `run(iters)` makes that many checks, and its time is
/// this process's CPU. The line after compares ours with Redis's, over the
/// bench's whole window (warm-up included, as for ours).
fn measure(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    runtime: &Runtime,
    admin: &mut RedisConnection,
    mut run: impl FnMut(u64),
) {
    let before = runtime.block_on(server_stats(admin));
    let (mut client, mut checks) = (Duration::ZERO, 0u64);
    group.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let start = process_cpu();
            run(iters);
            let spent = process_cpu() - start;
            client += spent;
            checks += iters;
            spent
        })
    });
    let after = runtime.block_on(server_stats(admin));
    // Our INFO calls are not EVALSHAs; their server CPU is negligible
    // beside hundreds of thousands of checks.
    let calls = after.calls - before.calls;
    let script_us = (after.usec - before.usec) / calls;
    let server_us = (after.cpu - before.cpu) * 1e6 / calls;
    let client_us = client.as_secs_f64() * 1e6 / checks as f64;
    println!(
        "{name}: {checks} checks; client CPU {client_us:.2} us/check; Redis EVALSHA \
         {script_us:.2} us/call (commandstats), server CPU {server_us:.2} us/check \
         (INFO cpu); client/script {:.2}, client/server CPU {:.2}",
        client_us / script_us,
        client_us / server_us,
    );
}

fn redis_client(c: &mut Criterion) {
    let server = RedisServer::start_pinned(0).expect("redis-server");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // The service's telemetry, as a default config has it.
    let config = Config::from_toml("").expect("the default config");
    ratelimiter::metrics::install();
    let _telemetry = runtime
        .block_on(async { telemetry::init(&config.tracing, "bench") })
        .expect("telemetry");
    let settings = settings(&server.url());
    let connection = runtime
        .block_on(RedisConnection::connect(&settings))
        .expect("connect");
    let mut admin = connection.clone();
    let store = LuaStore::new(connection, &settings);
    // Far more than the traffic: every check is admitted (the write path).
    let limit = Limit::new(1_000_000_000_000, 1_000_000, Duration::from_secs(1)).expect("limit");
    let next = Cell::new(0u128);
    // `now` read once: reading a clock is the limiter's work, not the
    // store's (and this bucket never empties).
    let now = SystemClock.now();
    let check = || {
        let n = next.get();
        next.set(if n + 1 == KEYS { 0 } else { n + 1 });
        Check::new(BucketKey(n), limit, 1, now)
    };
    // Loads the script and checks that it answers.
    runtime
        .block_on(store.decide(&check()))
        .expect("a first check");

    let mut group = c.benchmark_group("lua_check_client_cpu");
    group
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for depth in [1u64, 16, 64] {
        let name = format!("{depth}_in_flight");
        measure(&mut group, &name, &runtime, &mut admin, |iters| {
            runtime.block_on(async {
                let mut left = iters;
                while left > 0 {
                    let now = left.min(depth);
                    // One `FuturesUnordered` at every depth: `join_all`
                    // changes how it polls above 30 futures, which would
                    // make the deep run's harness differ from the others'.
                    let mut batch: FuturesUnordered<_> = (0..now)
                        .map(|_| {
                            let check = check();
                            let store = &store;
                            async move { store.decide(&check).await }
                        })
                        .collect();
                    while let Some(result) = batch.next().await {
                        result.expect("check");
                    }
                    left -= now;
                }
            })
        });
    }

    // The service's shape: a multi-thread runtime, a task per check in
    // flight. Its own connection, whose driver runs on that runtime.
    let workers = std::env::var("BENCH_WORKERS").map_or(1, |w| {
        w.parse()
            .expect("BENCH_WORKERS: a number of worker threads")
    });
    let service = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime");
    let store = Arc::new(LuaStore::new(
        service
            .block_on(RedisConnection::connect(&settings))
            .expect("connect"),
        &settings,
    ));
    let next_key = Arc::new(AtomicU64::new(0));
    for depth in [1u64, 16, 64] {
        let name = format!("{depth}_tasks");
        measure(&mut group, &name, &runtime, &mut admin, |iters| {
            service.block_on(async {
                let tasks: Vec<_> = (0..depth)
                    .map(|task| {
                        let (store, next_key) = (Arc::clone(&store), Arc::clone(&next_key));
                        let share = iters / depth + u64::from(task < iters % depth);
                        tokio::spawn(async move {
                            for _ in 0..share {
                                let n = next_key.fetch_add(1, Ordering::Relaxed);
                                let key = BucketKey(u128::from(n) % KEYS);
                                let check = Check::new(key, limit, 1, now);
                                store.decide(&check).await.expect("check");
                            }
                        })
                    })
                    .collect();
                for task in tasks {
                    task.await.expect("a checking task");
                }
            })
        });
    }
    group.finish();
    drop(service);
    drop(server);
}

criterion_group!(benches, redis_client);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
