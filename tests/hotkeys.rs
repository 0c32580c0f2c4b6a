//! The hot-key detector on a real Redis Cluster (and on a standalone Redis
//! and the memory backend), read from `/metrics` as Prometheus reads it:
//! the hottest key named by tenant (or address), with the slot its Redis
//! key really hashes to, the node that really serves that slot, and its
//! share of that node's calls; and the signal for a proxy that is not
//! trusted.

mod support;

use ratelimiter::clock::ManualClock;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use support::{TestServer, client};
use testkit::RedisCluster;

const T0: u64 = 1_800_000_000_000_000;

/// A cluster's nodes as a TOML list of seed URLs.
fn seeds(cluster: &RedisCluster) -> String {
    let urls: Vec<String> = cluster.urls().iter().map(|u| format!("{u:?}")).collect();
    urls.join(", ")
}

/// Each sample of `name`: its labels and value.
fn samples(text: &str, name: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    text.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix('{')?;
            let (labels, value) = rest.rsplit_once("} ")?;
            let labels = labels
                .split("\",")
                .map(|pair| {
                    let (k, v) = pair.split_once("=\"").unwrap();
                    (k.to_owned(), v.trim_end_matches('"').to_owned())
                })
                .collect();
            Some((labels, value.parse().unwrap()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hot_key_is_named_with_the_slot_and_node_that_really_hold_it() {
    let cluster = RedisCluster::start().unwrap();
    let seeds = seeds(&cluster);
    let clock = Arc::new(ManualClock::new(T0));
    let config = format!(
        r#"
        backend = "lua"
        key_secret = "hot-keys-test-secret"
        [redis]
        cluster = [{seeds}]
        prefix = "hot:"
        topology_refresh = "100ms"
        [hot_keys]
        tracked = 16
        top = 3
        addresses = "show"
        [[api_keys]]
        id = "tenant-hot"
        key = "key-hot"
        [[api_keys]]
        id = "tenant-cold"
        key = "key-cold"
        [[policies]]
        name = "api"
        route = "/api/"
        burst = 1000
        rate = 1000
        anonymous = {{ burst = 1000, rate = 1000 }}
        "#
    );
    let server = TestServer::start(&config, clock.clone()).await;
    let http = client();
    // Until the slot map has been read, a node is `unknown`.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut untrusted_before = None;
    for (key, n) in [("key-hot", 60), ("key-cold", 10), ("", 5)] {
        for _ in 0..n {
            let headers: &[(&str, &str)] = if key.is_empty() {
                // Not a trusted proxy (none is): the header is ignored.
                &[("x-forwarded-for", "198.51.100.1")]
            } else {
                &[("x-api-key", key)]
            };
            let r = server.get(&http, "/api/items", headers).await;
            assert_eq!(r.status(), 200);
        }
        if untrusted_before.is_none() {
            let text = server.metrics(&http).await;
            untrusted_before = Some(support::metric(
                &text,
                "ratelimit_untrusted_forwarded_total",
                &[],
            ));
        }
    }
    // Still inside the first window: nothing complete to show yet.
    let text = server.metrics(&http).await;
    assert!(
        samples(&text, "ratelimit_hot_key_checks_per_second").is_empty(),
        "{text}"
    );
    clock.advance(10_000_000);
    let text = server.metrics(&http).await;

    assert_eq!(
        support::metric(&text, "ratelimit_untrusted_forwarded_total", &[])
            - untrusted_before.unwrap(),
        5.0,
        "every anonymous request sent X-Forwarded-For from an untrusted peer"
    );

    let checks = samples(&text, "ratelimit_hot_key_checks_per_second");
    let names: Vec<&str> = checks.iter().map(|(l, _)| l["key"].as_str()).collect();
    assert_eq!(names, ["tenant-hot", "tenant-cold", "127.0.0.1"], "{text}");
    let rates: Vec<f64> = checks.iter().map(|(_, v)| *v).collect();
    assert_eq!(rates, [6.0, 1.0, 0.5], "per second over the 10 s window");
    let kinds: Vec<&str> = checks.iter().map(|(l, _)| l["key_kind"].as_str()).collect();
    assert_eq!(kinds, ["api_key", "api_key", "ip"]);

    // The slot labels are the slots the script's keys really live in, and
    // the node labels the nodes that really serve them.
    let mut real_slots = BTreeSet::new();
    for node in &cluster.nodes {
        let keys = node.cli(&["keys", "hot:*"]).unwrap();
        for key in keys.lines().map(str::trim).filter(|k| !k.is_empty()) {
            real_slots.insert(cluster.keyslot(key).unwrap());
        }
    }
    let labelled: BTreeSet<u16> = checks
        .iter()
        .map(|(l, _)| l["slot"].parse().unwrap())
        .collect();
    assert_eq!(labelled, real_slots, "{text}");
    let mut calls_by_node: BTreeMap<String, f64> = BTreeMap::new();
    for (labels, rate) in &checks {
        let slot: u16 = labels["slot"].parse().unwrap();
        let owner = &cluster.nodes[cluster.owner(slot).unwrap()];
        assert_eq!(
            labels["node"],
            format!("127.0.0.1:{}", owner.port),
            "{text}"
        );
        *calls_by_node.entry(labels["node"].clone()).or_default() += rate;
    }

    // Every check went to Redis: calls equal checks, and each key's share
    // is its calls over all calls to its node.
    let calls = samples(&text, "ratelimit_hot_key_store_calls_per_second");
    assert_eq!(
        calls.iter().map(|(_, v)| *v).collect::<Vec<_>>(),
        rates,
        "{text}"
    );
    for (labels, share) in samples(&text, "ratelimit_hot_key_node_share") {
        let (_, rate) = checks
            .iter()
            .find(|(l, _)| l["key"] == labels["key"])
            .unwrap();
        let want = rate / calls_by_node[&labels["node"]];
        assert!((share - want).abs() < 1e-9, "{labels:?}: {share} != {want}");
    }

    // A window later with no traffic, the list is empty again.
    clock.advance(10_000_000);
    let text = server.metrics(&http).await;
    assert!(samples(&text, "ratelimit_hot_key_checks_per_second").is_empty());
    server.shutdown().await;
}

/// The detector and the one policy every one-node test here runs under.
const DETECTOR_AND_POLICY: &str = r#"
    [hot_keys]
    tracked = 16
    top = 3
    [[policies]]
    name = "api"
    route = "/api/"
    burst = 1000
    rate = 1000
    "#;

/// On a store with one node (`backend`: its line and its `[redis]`
/// section, if any): 60 checks of one tenant and 20 of another in a
/// window, each key's share of all the store's calls, on `node`.
async fn one_node_shares(backend: &str, node: &str) {
    let clock = Arc::new(ManualClock::new(T0));
    let config = format!(
        r#"
        key_secret = "hot-keys-test-secret"
        {backend}
        [[api_keys]]
        id = "tenant-hot"
        key = "key-hot"
        [[api_keys]]
        id = "tenant-cold"
        key = "key-cold"
        {DETECTOR_AND_POLICY}"#
    );
    let server = TestServer::start(&config, clock.clone()).await;
    let http = client();
    for (key, n) in [("key-hot", 60), ("key-cold", 20)] {
        for _ in 0..n {
            let r = server.get(&http, "/api/items", &[("x-api-key", key)]).await;
            assert_eq!(r.status(), 200);
        }
    }
    clock.advance(10_000_000);
    let text = server.metrics(&http).await;
    let shares = samples(&text, "ratelimit_hot_key_node_share");
    let by_key: BTreeMap<&str, (&str, f64)> = shares
        .iter()
        .map(|(l, v)| (l["key"].as_str(), (l["node"].as_str(), *v)))
        .collect();
    assert_eq!(by_key.len(), 2, "{text}");
    assert_eq!(by_key["tenant-hot"], (node, 0.75), "{text}");
    assert_eq!(by_key["tenant-cold"], (node, 0.25), "{text}");
    let calls = samples(&text, "ratelimit_hot_key_store_calls_per_second");
    let rates: Vec<f64> = calls.iter().map(|(_, v)| *v).collect();
    assert_eq!(rates, [6.0, 2.0], "every check was the store's: {text}");
    server.shutdown().await;
}

/// On the memory backend every key lives on one node, `memory`: a key's
/// share is of all the instance's store calls, whatever its slot (the
/// detector counts no slots there).
#[tokio::test]
async fn on_the_memory_backend_a_share_is_of_all_the_instances_calls() {
    one_node_shares("backend = \"memory\"", "memory").await;
}

/// EVALSHA calls a Redis served (`cmdstat_evalsha`'s calls, less the
/// failed ones: the first call to a node that has not loaded the script
/// yet fails with NOSCRIPT, and redis-rs loads it and calls again).
fn evalsha_calls(redis: &testkit::RedisServer) -> u64 {
    let stats = redis.cli(&["info", "commandstats"]).unwrap();
    let Some(fields) = stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:"))
    else {
        return 0;
    };
    let field = |name: &str| -> u64 {
        fields
            .split(',')
            .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
            .map_or(0, |v| v.trim().parse().unwrap())
    };
    field("calls") - field("failed_calls")
}

/// A real surge on one tenant, through a real Redis and real HTTP: with
/// the deny cache on, Redis is called for at most 5 % of the requests, and
/// no more are admitted than one exact bucket allows over the surge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deny_cache_spares_redis_a_surge_and_admits_nothing_more() {
    let redis = testkit::RedisServer::start().unwrap();
    let clock = Arc::new(ratelimiter::clock::FastClock::default());
    let config = format!(
        r#"
        backend = "lua"
        key_secret = "deny-cache-test-secret"
        [redis]
        url = "{}"
        response_timeout = "2s"
        # A check that misses its deadline on a loaded machine falls back
        # to the local share, whose hand-back ceiling then keeps denials
        # out of the cache for a while: a different test.
        [failure]
        deadline = "2s"
        [hot_keys]
        window = "1s"
        [[api_keys]]
        id = "tenant-hot"
        key = "key-hot"
        [[policies]]
        name = "api"
        route = "/api/"
        burst = 20
        rate = 10
        deny_cache = true
        "#,
        redis.url()
    );
    let server = TestServer::start(&config, clock).await;
    let http = client();
    let before = evalsha_calls(&redis);
    let started = std::time::Instant::now();
    let surge: Vec<_> = (0..4)
        .map(|_| {
            let (http, url) = (http.clone(), server.url("/api/items"));
            tokio::spawn(async move {
                let mut admitted = 0u64;
                for _ in 0..500 {
                    let r = http
                        .get(&url)
                        .header("x-api-key", "key-hot")
                        .send()
                        .await
                        .unwrap();
                    match r.status().as_u16() {
                        200 => admitted += 1,
                        429 => assert!(r.headers().contains_key("retry-after")),
                        other => panic!("status {other}"),
                    }
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for task in surge {
        admitted += task.await.unwrap();
    }
    let seconds = started.elapsed().as_secs_f64();
    let calls = evalsha_calls(&redis) - before;
    // One exact bucket: the burst, and 10 a second after it (+1 for the
    // token that may have been refilling when the surge began).
    let exact = 20.0 + 10.0 * seconds + 1.0;
    assert!(
        admitted as f64 <= exact,
        "{admitted} admitted in {seconds:.2} s, one bucket allows {exact:.0}"
    );
    assert!(admitted >= 20, "{admitted}: the burst itself was refused");
    assert!(
        calls * 20 <= 2000,
        "{calls} Redis calls for 2000 requests ({admitted} admitted in {seconds:.2} s)"
    );
    server.shutdown().await;
}

/// A sharded tenant on a real 3-node cluster: its requests are decided by
/// three sub-buckets whose Redis keys live on three nodes, one call each
/// in turn; together they admit the burst (never more), the client sees
/// the whole limit, and the hot-key metrics show the tenant on each node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_key_spreads_over_the_nodes_and_admits_one_burst() {
    let cluster = RedisCluster::start().unwrap();
    let seeds = seeds(&cluster);
    let clock = Arc::new(ManualClock::new(T0));
    let config = format!(
        r#"
        backend = "lua"
        key_secret = "shards-test-secret"
        [redis]
        cluster = [{seeds}]
        prefix = "sh:"
        topology_refresh = "100ms"
        [hot_keys]
        tracked = 16
        top = 5
        [[api_keys]]
        id = "tenant-hot"
        key = "key-hot"
        [[api_keys]]
        id = "tenant-cold"
        key = "key-cold"
        [[policies]]
        name = "api"
        route = "/api/"
        burst = 30
        rate = 1
        per = "1h"
        shards = 3
        shard_keys = ["tenant-hot"]
        "#
    );
    let server = TestServer::start(&config, clock.clone()).await;
    let http = client();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before: Vec<u64> = cluster.nodes.iter().map(evalsha_calls).collect();
    let mut admitted = 0;
    for n in 0..60 {
        let r = server
            .get(&http, "/api/items", &[("x-api-key", "key-hot")])
            .await;
        let h = |name: &str| r.headers()[name].to_str().unwrap().to_owned();
        assert_eq!(h("ratelimit-limit"), "30", "request {n}");
        match r.status().as_u16() {
            200 => admitted += 1,
            429 => assert_eq!(h("ratelimit-remaining"), "0"),
            other => panic!("status {other}"),
        }
    }
    assert_eq!(admitted, 30, "three sub-buckets of 10: the burst, no more");
    let calls: Vec<u64> = cluster
        .nodes
        .iter()
        .zip(&before)
        .map(|(node, before)| evalsha_calls(node) - before)
        .collect();
    assert_eq!(calls, [20, 20, 20], "one call per request, in turn");
    // The unnamed tenant is one bucket on one node.
    for _ in 0..6 {
        server
            .get(&http, "/api/items", &[("x-api-key", "key-cold")])
            .await;
    }
    let mut keys = 0;
    for node in &cluster.nodes {
        let found = node.cli(&["keys", "sh:*"]).unwrap();
        keys += found.lines().filter(|k| !k.trim().is_empty()).count();
    }
    assert_eq!(keys, 3 + 1, "three sub-buckets and one plain bucket");

    clock.advance(10_000_000);
    let text = server.metrics(&http).await;
    let checks = samples(&text, "ratelimit_hot_key_checks_per_second");
    let hot: Vec<_> = checks
        .iter()
        .filter(|(l, _)| l["key"] == "tenant-hot")
        .collect();
    let nodes: BTreeSet<&str> = hot.iter().map(|(l, _)| l["node"].as_str()).collect();
    assert_eq!(hot.len(), 3, "{text}");
    assert_eq!(nodes.len(), 3, "one sub-bucket per node: {text}");
    assert!(hot.iter().all(|(_, rate)| *rate == 2.0), "{text}");
    server.shutdown().await;
}

/// The detector counts store calls by slot only where the slots are on
/// several nodes, a Cluster's: on a standalone Redis every slot is on the
/// one server, and hashing each check's key to its slot would buy nothing.
/// Asked of the whole stack the service builds, so every wrapper passes
/// the question on to the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_are_counted_only_where_they_are_spread_over_nodes() {
    use ratelimiter::config::Config;
    use ratelimiter::server::{build_limiter, build_stack};
    let redis = testkit::RedisServer::start().unwrap();
    let cluster = RedisCluster::start().unwrap();
    let url = format!("url = \"{}\"", redis.url());
    let seeds = format!("cluster = [{}]", seeds(&cluster));
    let backends = [
        ("memory", "", false),
        ("lua", url.as_str(), false),
        ("naive", url.as_str(), false),
        ("lua", seeds.as_str(), true),
    ];
    for (backend, redis, spread) in backends {
        let config = Config::from_toml(&format!(
            "backend = \"{backend}\"\nkey_secret = \"hot-keys-test-secret\"\n\
             [redis]\n{redis}\n{DETECTOR_AND_POLICY}"
        ))
        .unwrap();
        let stack = build_stack(&config).await.unwrap();
        let clock = Arc::new(ManualClock::new(T0));
        let limiter = build_limiter(&config, Arc::clone(&stack.store), clock);
        let hot = limiter.hot_keys().expect("the detector is on");
        assert_eq!(hot.counts_slots(), spread, "{backend} {redis}");
    }
}

/// On a standalone Redis the detector counts no slots, and still names
/// the server as the node of every key, each key's share of all its calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_standalone_redis_the_node_is_the_server() {
    let redis = testkit::RedisServer::start().unwrap();
    let backend = format!(
        "backend = \"lua\"\n[redis]\nurl = \"{}\"\nprefix = \"hot:\"",
        redis.url()
    );
    one_node_shares(&backend, &redis.url().replace("redis://", "")).await;
}
