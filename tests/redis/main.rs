//! The Redis stores against real redis-server processes (standalone and a
//! 3-node cluster), started on free loopback ports and killed on drop.

#[path = "../support/mod.rs"]
mod support;

mod differential;
mod expiry;

use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use ratelimiter::algorithm::token_bucket::{self, BucketState, TakeUpTo};
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
    let (first, _) = a
        .decide_and_write(&Check::new(key, limit, 1, T0), seen_by_a)
        .await
        .unwrap();
    let (second, _) = b
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
    // A Redis that hangs (a listener that never answers) is a timeout
    // within the configured response timeout.
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
