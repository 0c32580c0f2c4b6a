//! Readiness that tells the truth, on a real
//! redis-server through a real listener: an instance whose checks were
//! mostly decided by its fallback is `degraded`, with the share, even once
//! its breaker has closed again and Redis answers a PING.

mod support;

use ratelimiter::clock::ManualClock;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;
use testkit::RedisServer;

const T0: u64 = 1_800_000_000_000_000;

async fn readyz(server: &support::TestServer, http: &reqwest::Client) -> (u16, Value) {
    let r = server.get(http, "/readyz", &[]).await;
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// GET /api/items `n` times; the `RateLimit-Limit` each answer showed
/// (1000: Redis decided; 500: the local share of two instances).
async fn items(server: &support::TestServer, http: &reqwest::Client, n: usize) -> Vec<String> {
    let mut limits = Vec::with_capacity(n);
    for _ in 0..n {
        let r = server.get(http, "/api/items", &[]).await;
        assert_eq!(r.status(), 200);
        limits.push(support::header(&r, "ratelimit-limit").to_owned());
    }
    limits
}

/// Redis refuses the script for a while (its ACL takes EVALSHA away; PING
/// still answers), then gives it back: the breaker opens, probes, closes.
/// Afterwards everything a PING and the breaker's state can say is
/// healthy, yet most recent decisions were the local share's: `/readyz`
/// says `degraded` with that share (200: the failure mode is `local`), and
/// `ratelimit_fallback_share` shows it. Checks decided by Redis again
/// dilute the share until it is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_reports_the_fallback_share_after_the_breaker_closes() {
    let redis = RedisServer::start().unwrap();
    let config = format!(
        "backend = \"lua\"\nkey_secret = \"0123456789abcdef0123\"\n\
         [redis]\nurl = \"{}\"\nresponse_timeout = \"2s\"\n\
         [failure]\ndeadline = \"2s\"\ninstances = 2\nbreaker_failures = 3\nbreaker_cooldown = \"50ms\"\n\
         [[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = 1000\nrate = 1\nper = \"1h\"\n",
        redis.url()
    );
    let server = support::TestServer::start(&config, Arc::new(ManualClock::new(T0))).await;
    let http = support::client();

    assert!(items(&server, &http, 10).await.iter().all(|l| l == "1000"));
    let (status, ready) = readyz(&server, &http).await;
    assert_eq!(
        (status, &ready["status"]),
        (200, &"ready".into()),
        "{ready}"
    );
    assert_eq!(ready["fallback_share"], 0.0, "{ready}");

    redis
        .cli(&["ACL", "SETUSER", "default", "-evalsha"])
        .unwrap();
    assert!(
        items(&server, &http, 30).await.iter().all(|l| l == "500"),
        "the local share decides"
    );
    redis
        .cli(&["ACL", "SETUSER", "default", "+evalsha"])
        .unwrap();
    // After the cooldown, one probe finds Redis and closes the breaker.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(items(&server, &http, 1).await, ["1000"]);

    let (status, ready) = readyz(&server, &http).await;
    assert_eq!(status, 200, "failing locally, the instance still serves");
    assert_eq!(ready["status"], "degraded", "{ready}");
    assert_eq!(ready["breaker"], "closed", "{ready}");
    assert!(ready.get("error").is_none(), "PING answers: {ready}");
    let share = ready["fallback_share"].as_f64().unwrap();
    // 30 of 41 checks, as the window weighs them (it may have moved on).
    assert!((0.5..=0.8).contains(&share), "{ready}");
    assert!(ready["breaker_opens"].as_u64().unwrap() >= 1, "{ready}");
    let metrics = server.metrics(&http).await;
    let gauge = support::metric(&metrics, "ratelimit_fallback_share", &[]);
    assert!(
        (0.5..=0.8).contains(&gauge),
        "ratelimit_fallback_share {gauge}"
    );

    // Redis decides again: 600 more checks bring 30 fallbacks under 5 %.
    assert!(items(&server, &http, 600).await.iter().all(|l| l == "1000"));
    let (status, ready) = readyz(&server, &http).await;
    assert_eq!(
        (status, &ready["status"]),
        (200, &"ready".into()),
        "{ready}"
    );
    assert!(ready["fallback_share"].as_f64().unwrap() < 0.05, "{ready}");
}
