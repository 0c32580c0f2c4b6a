//! What the service tells about itself: the RED histogram of every
//! response, the limiter's own metrics, and (with a real OTLP receiver in
//! the test) the traces it exports.

mod support;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use ratelimiter::api::app;
use ratelimiter::clock::ManualClock;
use ratelimiter::config::Config;
use ratelimiter::server::{in_process_stack, state_with_stack};
use ratelimiter::store::MemoryStore;
use std::net::SocketAddr;
use std::sync::Arc;
use support::metric;
use tower::ServiceExt;

const T0: u64 = 1_800_000_000_000_000;

async fn send(
    app: &axum::Router,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
) -> (StatusCode, http::HeaderMap) {
    let mut b = Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let body = if method == "POST" {
        b = b.header("content-type", "application/json");
        Body::from(r#"{"item_id":1,"quantity":1}"#)
    } else {
        Body::empty()
    };
    let mut request = b.body(body).unwrap();
    request.extensions_mut().insert(ConnectInfo(
        "192.0.2.10:5000".parse::<SocketAddr>().unwrap(),
    ));
    let response = app.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    body.collect().await.unwrap();
    (parts.status, parts.headers)
}

/// One test, alone in its process: the recorder is global, so the counts
/// below are exact.
#[tokio::test]
async fn every_response_is_counted_and_the_limiters_metrics_say_who_decided() {
    let config = Config::from_toml(
        r#"
        near_limit_fraction = 0.5
        [[api_keys]]
        id = "tenant-a"
        key = "key-a"
        [[policies]]
        name = "api"
        route = "/api/"
        burst = 2
        rate = 1
        per = "1h"
        [[policies]]
        name = "orders-shadow"
        route = "/api/orders"
        burst = 1
        rate = 1
        per = "1h"
        shadow = true
        "#,
    )
    .unwrap();
    let state = state_with_stack(
        &config,
        in_process_stack(MemoryStore::new(1000, 4)),
        Arc::new(ManualClock::new(T0)),
    );
    let metrics = state.metrics.clone();
    let app = app(state);
    let key = [("x-api-key", "key-a")];
    let statuses = [
        send(&app, "GET", "/api/items", &key).await.0,
        send(&app, "GET", "/api/items", &key).await.0,
        send(&app, "GET", "/api/items", &key).await.0,
        send(&app, "GET", "/api/nope/7", &key).await.0,
        send(&app, "PUT", "/api/items", &key).await.0,
        send(&app, "GET", "/api/items", &[("x-api-key", "bad key")])
            .await
            .0,
        send(&app, "GET", "/healthz", &[]).await.0,
    ];
    // (The PUT matches the route, so the limiter decides it first: 429.)
    assert_eq!(
        statuses.map(|s| s.as_u16()),
        [200, 200, 429, 404, 429, 400, 200]
    );
    // Shadow mode: decided and counted, never refused, no headers.
    for _ in 0..3 {
        let (status, headers) = send(&app, "POST", "/api/orders", &key).await;
        assert_eq!(status, StatusCode::CREATED);
        assert!(
            !headers
                .keys()
                .any(|k| k.as_str().starts_with("ratelimit") || k == "retry-after"),
            "{headers:?}"
        );
    }
    let text = metrics.render();
    let requests = |method: &str, route: &str, status: &str| {
        metric(
            &text,
            "http_server_request_duration_seconds_count",
            &[
                ("http_request_method", method),
                ("http_route", route),
                ("http_response_status_code", status),
            ],
        )
    };
    assert_eq!(requests("GET", "/api/items", "200"), 2.0);
    assert_eq!(
        requests("GET", "/api/items", "429"),
        1.0,
        "the limiter's own answer"
    );
    assert_eq!(requests("GET", "/api/items", "400"), 1.0);
    assert_eq!(requests("PUT", "/api/items", "429"), 1.0);
    assert_eq!(
        requests("GET", "unmatched", "404"),
        1.0,
        "no raw path as a label"
    );
    assert_eq!(requests("GET", "/healthz", "200"), 1.0);
    assert_eq!(requests("POST", "/api/orders", "201"), 3.0);
    // Who decided, per policy; and nothing is in flight once answered.
    let checks = |policy: &str| {
        metric(
            &text,
            "ratelimit_check_duration_seconds_count",
            &[
                ("backend", "memory"),
                ("policy", policy),
                ("source", "memory"),
            ],
        )
    };
    assert_eq!(
        checks("api"),
        4.0,
        "the malformed key never reached the store"
    );
    assert_eq!(checks("orders-shadow"), 3.0);
    assert_eq!(metric(&text, "ratelimit_checks_in_flight", &[]), 0.0);
    assert!(text.contains("# TYPE ratelimit_checks_in_flight gauge"));
    // Near the limit: burst 2, fraction 0.5: the second admission left 0 < 1.
    assert_eq!(
        metric(
            &text,
            "ratelimit_near_limit_total",
            &[("policy", "api"), ("key_kind", "api_key")]
        ),
        1.0
    );
    let decisions = |policy: &str, decision: &str| {
        metric(
            &text,
            "ratelimit_decisions_total",
            &[("policy", policy), ("decision", decision)],
        )
    };
    assert_eq!(decisions("orders-shadow", "allowed"), 1.0);
    assert_eq!(decisions("orders-shadow", "shadow_denied"), 2.0);
    assert_eq!(decisions("orders-shadow", "denied"), 0.0);
    assert_eq!(decisions("api", "denied"), 2.0);
    // Labels stay bounded: no key, no address, no raw URI.
    for secret in ["key-a", "192.0.2.10", "/api/nope"] {
        assert!(!text.contains(secret), "{secret} leaked into /metrics");
    }
}
