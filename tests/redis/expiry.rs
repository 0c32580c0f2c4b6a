//! Keys expire when their bucket is full again, never sooner, whatever
//! path a write takes; a denial writes nothing.

use super::*;

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

/// Whatever path a write takes (a new TTL, or keeping the old one), the key
/// outlives its bucket's refill by at least half the margin; and dense
/// spending rarely pays for a new TTL. The token bucket and GCRA both keep
/// their expiry as the value's third double.
#[tokio::test]
async fn key_expiry_always_covers_the_refill_and_is_rarely_reset() {
    let redis = RedisServer::start().unwrap();
    let settings = settings(vec![redis.url()], false);
    let store = lua(&settings).await;
    let mut conn = RedisConnection::connect(&settings).await.unwrap();
    let margin_us = settings.ttl_margin.as_micros() as u64;
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        let limit = Limit::per_second(1000, 100)
            .unwrap()
            .with_algorithm(algorithm);
        let key = BucketKey(77);
        let name = redis_key("test:", algorithm, key);
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
            assert_eq!(value.len(), 24, "{algorithm:?}");
            let expires = f64::from_le_bytes(value[16..24].try_into().unwrap()) as u64;
            let reset = d.reset.as_micros() as u64;
            assert!(
                expires >= now + reset + margin_us / 2,
                "{algorithm:?}: expires {expires} < now {now} + reset {reset} + margin/2"
            );

            let pttl: i64 = redis::cmd("PTTL")
                .arg(&name)
                .query_async(&mut conn)
                .await
                .unwrap();
            // The server's TTL, not only the remembered expiry, covers the
            // refill (the test's `now` runs ahead of the server's clock).
            assert!(
                pttl as u64 * 1000 + 1000 >= reset + margin_us / 2,
                "{algorithm:?}: pttl {pttl} ms < reset {reset} us + margin/2"
            );
            if pttl > last_pttl {
                refreshes += 1;
            }
            last_pttl = pttl;
        }
        assert!(writes > 100, "{algorithm:?}: only {writes} admitted");
        assert!(
            refreshes * 4 < writes,
            "{algorithm:?}: {refreshes} TTL resets for {writes} writes"
        );
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
