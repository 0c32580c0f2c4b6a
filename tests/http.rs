//! The HTTP contract through a real listener on a free port.

mod support;

use ratelimiter::clock::{ManualClock, SystemClock};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{TestServer, client, header};

const T0: u64 = 1_800_000_000_000_000;

const KEYS: &str = r#"
[[api_keys]]
id = "tenant-a"
key = "key-a"
[[api_keys]]
id = "tenant-b"
key = "key-b"
"#;

/// One `/api/` policy of `burst` tokens refilled at 1/s.
fn policy(burst: u64) -> String {
    format!("[[policies]]\nname = \"api\"\nroute = \"/api/\"\nburst = {burst}\nrate = 1\n")
}

#[tokio::test]
async fn one_key_gets_exactly_what_the_maths_predicts() {
    let clock = ManualClock::new(T0);
    let server = TestServer::start(KEYS, Arc::new(clock.clone())).await;
    let http = client();
    let mut admitted = 0;
    let mut denied = 0;
    for i in 0..150u64 {
        let r = server
            .get(&http, "/api/items", &[("x-api-key", "key-a")])
            .await;
        assert_eq!(header(&r, "ratelimit-limit"), "100");
        assert_eq!(header(&r, "ratelimit-policy"), "\"api\";q=100;w=10");
        if i < 100 {
            assert_eq!(r.status(), 200, "request {i}");
            let remaining = 99 - i;
            assert_eq!(header(&r, "ratelimit-remaining"), remaining.to_string());
            // Spent tokens come back at 10/s: full again in spent/10 s, rounded up.
            assert_eq!(
                header(&r, "ratelimit-reset"),
                (i + 1).div_ceil(10).to_string()
            );
            let t = if remaining > 0 { 0 } else { 1 };
            assert_eq!(
                header(&r, "ratelimit"),
                format!("\"api\";r={remaining};t={t}")
            );
            assert!(r.headers().get("retry-after").is_none());
            admitted += 1;
        } else {
            assert_eq!(r.status(), 429, "request {i}");
            assert_eq!(header(&r, "retry-after"), "1");
            assert_eq!(header(&r, "ratelimit-remaining"), "0");
            assert_eq!(header(&r, "ratelimit-reset"), "10");
            assert_eq!(header(&r, "ratelimit"), "\"api\";r=0;t=1");
            assert_eq!(header(&r, "content-type"), "application/problem+json");
            let body: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
            assert_eq!(body["status"], 429);
            assert_eq!(body["retry_after"], 1);
            denied += 1;
        }
    }
    assert_eq!((admitted, denied), (100, 50));

    // A different key is independent.
    let r = server
        .get(&http, "/api/items", &[("authorization", "Bearer key-b")])
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "ratelimit-remaining"), "99");

    // Honouring Retry-After works: 1 s later exactly 10 tokens are back.
    clock.advance(1_000_000);
    let mut after = Vec::new();
    for _ in 0..11 {
        let r = server
            .get(&http, "/api/items", &[("x-api-key", "key-a")])
            .await;
        after.push(r.status().as_u16());
    }
    assert_eq!(after, [vec![200; 10], vec![429]].concat());
    server.shutdown().await;
}

#[tokio::test]
async fn spoofed_forwarded_for_from_an_untrusted_peer_is_ignored() {
    let server = TestServer::start(&policy(5), Arc::new(ManualClock::new(T0))).await;
    let http = client();
    let mut statuses = Vec::new();
    for i in 0..8 {
        // A fresh forged client address each time: must not buy fresh buckets.
        let r = server
            .get(
                &http,
                "/api/items",
                &[("x-forwarded-for", &format!("203.0.113.{i}"))],
            )
            .await;
        statuses.push(r.status().as_u16());
    }
    assert_eq!(statuses, [vec![200; 5], vec![429; 3]].concat());
}

#[tokio::test]
async fn behind_a_trusted_proxy_the_rightmost_untrusted_address_is_the_client() {
    let config = format!(
        "trusted_proxies = [\"127.0.0.1/32\", \"10.0.0.0/8\"]\n{}",
        policy(3)
    );
    let server = TestServer::start(&config, Arc::new(ManualClock::new(T0))).await;
    let http = client();
    let get = async |xff: String| {
        let r = server
            .get(&http, "/api/items", &[("x-forwarded-for", &xff)])
            .await;
        r.status().as_u16()
    };
    // 198.51.100.7 forges a different left-most entry each time; the proxy
    // chain (10.0.0.2, then us via 127.0.0.1) appends the real address.
    let mut statuses = Vec::new();
    for i in 0..5 {
        statuses.push(get(format!("192.0.2.{i}, 198.51.100.7, 10.0.0.2")).await);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    // Another real client behind the same proxies has its own bucket.
    assert_eq!(get("198.51.100.8, 10.0.0.2".into()).await, 200);
    // Garbage where a trusted proxy should have written an address: 400.
    assert_eq!(get("198.51.100.7, not-an-ip".into()).await, 400);
}

#[tokio::test]
async fn with_the_system_clock_admissions_stay_within_burst_plus_refill() {
    // Real time: the count depends on how long 150 requests take, so the
    // assertion is the bound itself, computed from the measured duration.
    let server = TestServer::start(KEYS, Arc::new(SystemClock)).await;
    let http = client();
    let started = Instant::now();
    let mut admitted = 0u64;
    let mut last_retry_after = None;
    for _ in 0..150 {
        let r = server
            .get(&http, "/api/items", &[("x-api-key", "key-a")])
            .await;
        if r.status() == 200 {
            admitted += 1;
        } else {
            assert_eq!(r.status(), 429);
            last_retry_after = Some(header(&r, "retry-after").parse::<u64>().unwrap());
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let bound = 100 + (elapsed * 10.0).ceil() as u64;
    assert!(
        (100..=bound).contains(&admitted),
        "admitted {admitted}, bound {bound} after {elapsed:.3}s"
    );
    if let Some(wait) = last_retry_after {
        assert!(wait >= 1);
        tokio::time::sleep(Duration::from_secs(wait)).await;
        let r = server
            .get(&http, "/api/items", &[("x-api-key", "key-a")])
            .await;
        assert_eq!(r.status(), 200, "denied after waiting Retry-After");
    }
}
