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
use ratelimiter::middleware::Front;
use ratelimiter::server::{in_process_stack, state_with_stack};
use ratelimiter::store::MemoryStore;
use std::net::SocketAddr;
use std::sync::Arc;
use support::metric;
use tower::ServiceExt;

const T0: u64 = 1_800_000_000_000_000;

async fn send(
    app: &Front,
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

// ---- Traces: the real binary, a real Redis, a real OTLP receiver. ----

use std::process::{Command, Stdio};
use std::time::Duration;
use testkit::{ChildGuard, OtlpReceiver, ReceivedSpan, RedisServer, free_port, wait_for_port};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimiter");
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// The binary on the lua backend, with `env` (the OTEL_* variables).
fn traced(redis: &RedisServer, env: &[(&str, &str)]) -> (ChildGuard, u16) {
    // About spans, not latency: no deadline misses on a busy machine.
    traced_with(
        redis,
        env,
        &["--failure-deadline", "2s", "--redis-response-timeout", "2s"],
    )
}

fn traced_with(redis: &RedisServer, env: &[(&str, &str)], flags: &[&str]) -> (ChildGuard, u16) {
    let port = free_port().unwrap();
    let mut command = Command::new(BIN);
    command
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--instance-id", "traced-1", "--backend", "lua"])
        .args([
            "--redis-url",
            &redis.url(),
            "--key-secret",
            "tracing-test-secret",
        ])
        .args(flags)
        .env(
            "RL_CONFIG",
            concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/traced.toml"),
        )
        .env("RL_TRACE_BATCH_DELAY", "100ms")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        command.env(k, v);
    }
    let child = ChildGuard(command.spawn().unwrap());
    wait_for_port(port, "ratelimiter").unwrap();
    (child, port)
}

/// The client address the test's (trusted) proxy forwards.
const CLIENT_ADDRESS: &str = "203.0.113.77";

/// GETs `/api/items` with the test's API key, forwarded for
/// [`CLIENT_ADDRESS`] (and `traceparent` if given); the status.
async fn get(port: u16, traceparent: Option<&str>) -> u16 {
    let mut request = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{port}/api/items"))
        .header("x-api-key", "trace-key")
        .header("x-forwarded-for", CLIENT_ADDRESS);
    if let Some(tp) = traceparent {
        request = request.header("traceparent", tp);
    }
    request.send().await.unwrap().status().as_u16()
}

/// The spans of one trace as a tree, root first (printed by the tests;
/// docs/observability.md shows one).
fn tree(spans: &[ReceivedSpan]) -> String {
    fn walk(spans: &[ReceivedSpan], parent: &str, depth: usize, out: &mut String) {
        for span in spans.iter().filter(|s| s.parent_span_id == parent) {
            let kind = match span.kind {
                2 => "server",
                3 => "client",
                _ => "internal",
            };
            let attributes: Vec<String> = span
                .attributes
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            out.push_str(&format!(
                "{}{} [{kind}] {}\n",
                "  ".repeat(depth),
                span.name,
                attributes.join(" ")
            ));
            walk(spans, &span.span_id, depth + 1, out);
        }
    }
    let ids: Vec<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    let mut out = String::new();
    if let Some(root) = spans
        .iter()
        .find(|s| !ids.contains(&s.parent_span_id.as_str()))
    {
        walk(spans, &root.parent_span_id, 0, &mut out);
    }
    out
}

fn by_name<'a>(spans: &'a [ReceivedSpan], name: &str) -> &'a ReceivedSpan {
    spans
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no span {name} in {spans:#?}"))
}

/// The caller's trace goes on through the server span, the limiter's check
/// and the Redis call, each the parent of the next, with the attributes
/// docs/observability.md lists and no key or credential, over either transport.
async fn one_request_is_one_trace(protocol: &str) {
    let redis = RedisServer::start().unwrap();
    let receiver = OtlpReceiver::start().await.unwrap();
    let endpoint = if protocol == "grpc" {
        &receiver.grpc
    } else {
        &receiver.http
    };
    let (_child, port) = traced(
        &redis,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol),
            ("OTEL_SERVICE_NAME", "ratelimiter-test"),
        ],
    );
    let traceparent = format!("00-{TRACE}-{CALLER_SPAN}-01");
    assert_eq!(get(port, Some(&traceparent)).await, 200);
    let spans = receiver
        .trace(TRACE, 3, Duration::from_secs(10))
        .await
        .unwrap();
    println!("{protocol}: trace {TRACE}\n{}", tree(&spans));
    let server = by_name(&spans, "GET /api/items");
    let check = by_name(&spans, "ratelimit.check");
    let call = by_name(&spans, "EVALSHA");
    assert_eq!(tree(&spans).lines().count(), 3, "one tree of three spans");
    let transport = if protocol == "grpc" { "grpc" } else { "http" };
    assert!(spans.iter().all(|s| s.transport == transport));
    // Parented in order, the first under the caller's span.
    assert_eq!(server.parent_span_id, CALLER_SPAN);
    assert_eq!(check.parent_span_id, server.span_id);
    assert_eq!(call.parent_span_id, check.span_id);
    assert_eq!(
        (server.kind, check.kind, call.kind),
        (2, 1, 3),
        "server, internal, client"
    );
    let has = |span: &ReceivedSpan, pairs: &[(&str, &str)]| {
        for (k, v) in pairs {
            assert_eq!(
                span.attributes.get(*k).map(String::as_str),
                Some(*v),
                "{k} on {}: {:?}",
                span.name,
                span.attributes
            );
        }
    };
    has(
        server,
        &[
            ("http.request.method", "GET"),
            ("http.route", "/api/items"),
            ("http.response.status_code", "200"),
        ],
    );
    has(
        check,
        &[
            ("ratelimit.policy", "api"),
            ("ratelimit.algorithm", "token_bucket"),
            ("ratelimit.decision", "allowed"),
            ("ratelimit.source", "redis"),
            ("ratelimit.key_kind", "api_key"),
        ],
    );
    let redis_port = redis.port.to_string();
    has(
        call,
        &[
            ("db.system.name", "redis"),
            ("db.operation.name", "EVALSHA"),
            ("db.redis.script", "token_bucket"),
            ("server.address", "127.0.0.1"),
            ("server.port", &redis_port),
        ],
    );
    assert_eq!(
        server.resource.get("service.name").unwrap(),
        "ratelimiter-test"
    );
    assert_eq!(
        server.resource.get("service.instance.id").unwrap(),
        "traced-1"
    );
    for span in &spans {
        for value in span.attributes.values() {
            assert!(!value.contains("trace-key"), "the API key on {}", span.name);
            assert!(
                !value.contains(CLIENT_ADDRESS),
                "the client address on {}",
                span.name
            );
        }
        for event in &span.events {
            assert!(!event.contains("trace-key") && !event.contains(CLIENT_ADDRESS));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_over_grpc() {
    one_request_is_one_trace("grpc").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_over_http_protobuf() {
    one_request_is_one_trace("http/protobuf").await;
}

/// Parent-based ratio sampling: at ratio 0 this service starts no trace
/// of its own, but keeps going one its caller sampled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_based_ratio_follows_the_callers_decision() {
    let redis = RedisServer::start().unwrap();
    let receiver = OtlpReceiver::start().await.unwrap();
    let (_child, port) = traced(
        &redis,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.grpc),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "0"),
        ],
    );
    for _ in 0..5 {
        assert_eq!(get(port, None).await, 200);
    }
    let sampled = format!("00-{TRACE}-{CALLER_SPAN}-01");
    assert_eq!(get(port, Some(&sampled)).await, 200);
    let spans = receiver
        .trace(TRACE, 3, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(spans.len(), 3);
    // Everything sampled arrived with the caller's trace: nothing else.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        receiver.spans().iter().all(|s| s.trace_id == TRACE),
        "{:#?}",
        receiver.spans()
    );
}

/// `OTEL_SDK_DISABLED=true` turns tracing off, whatever else is set: with
/// a collector named, every request sampled and a caller's sampled
/// traceparent, not one span leaves the process. Without it, the same
/// requests arrive (the control).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otel_sdk_disabled_exports_nothing() {
    let redis = RedisServer::start().unwrap();
    for disabled in ["true", "false"] {
        let receiver = OtlpReceiver::start().await.unwrap();
        let (_child, port) = traced(
            &redis,
            &[
                ("OTEL_SDK_DISABLED", disabled),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.grpc),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                ("OTEL_TRACES_SAMPLER", "always_on"),
            ],
        );
        let sampled = format!("00-{TRACE}-{CALLER_SPAN}-01");
        for _ in 0..3 {
            assert_eq!(get(port, None).await, 200);
        }
        assert_eq!(get(port, Some(&sampled)).await, 200);
        if disabled == "false" {
            receiver
                .trace(TRACE, 3, Duration::from_secs(10))
                .await
                .unwrap();
        } else {
            // Several batch delays (100 ms) for anything that would go out.
            tokio::time::sleep(Duration::from_secs(1)).await;
            assert!(receiver.spans().is_empty(), "{:#?}", receiver.spans());
        }
    }
}

/// A collector that is not there, or that never answers, costs requests
/// nothing: every request is served, and the spans that cannot go out are
/// dropped and counted instead of queueing without bound. Without an
/// endpoint, nothing is exported and nothing is logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absent_or_silent_collector_costs_requests_nothing() {
    let redis = RedisServer::start().unwrap();
    let metric_of = |port: u16, reason: &'static str| async move {
        let text = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        metric(
            &text,
            "ratelimit_trace_spans_dropped_total",
            &[("reason", reason)],
        )
    };
    // Nothing listens here: every export fails at once.
    let refused = format!("http://127.0.0.1:{}", free_port().unwrap());
    // This one accepts connections and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!("http://{}", silent.local_addr().unwrap());
    for (endpoint, reason) in [(&refused, "export_failed"), (&silent_url, "queue_full")] {
        let (_child, port) = traced(
            &redis,
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
                ("RL_TRACE_QUEUE_SIZE", "8"),
                ("RL_TRACE_EXPORT_TIMEOUT", "30s"),
            ],
        );
        for _ in 0..60 {
            assert!([200, 429].contains(&get(port, None).await));
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while metric_of(port, reason).await == 0.0 {
            assert!(
                std::time::Instant::now() < deadline,
                "no span counted as dropped ({reason}) for {endpoint}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // No endpoint: nothing exported, and the log says only that it serves.
    let receiver = OtlpReceiver::start().await.unwrap();
    let (mut child, port) = traced(&redis, &[]);
    for _ in 0..30 {
        assert!(
            [200, 429].contains(&get(port, Some(&format!("00-{TRACE}-{CALLER_SPAN}-01"))).await)
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(receiver.spans().is_empty());
    let _ = child.0.kill();
    let _ = child.0.wait();
    let mut output = String::new();
    std::io::Read::read_to_string(&mut child.0.stderr.take().unwrap(), &mut output).unwrap();
    let lines = output.lines().count();
    assert!(lines <= 2, "the log, without an exporter:\n{output}");
}

/// Trace id number `n` of a test.
fn trace_id(n: u32) -> String {
    format!("{n:08x}{}", &TRACE[8..])
}

/// What went wrong with Redis shows on the trace: a call that missed the
/// deadline and was never answered, a refused connection, and once the
/// breaker opens, a check that did not call Redis at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_misses_failures_and_breaker_skips_show_on_the_trace() {
    let mut redis = RedisServer::start().unwrap();
    let receiver = OtlpReceiver::start().await.unwrap();
    let (_child, port) = traced_with(
        &redis,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.grpc),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ],
        &[
            "--failure-deadline",
            "200ms",
            "--redis-response-timeout",
            "400ms",
            "--breaker-failures",
            "3",
            "--breaker-cooldown",
            "1h",
        ],
    );
    let traced_get = |n: u32| {
        let traceparent = format!("00-{}-{CALLER_SPAN}-01", trace_id(n));
        async move { get(port, Some(&traceparent)).await }
    };
    assert_eq!(traced_get(1).await, 200, "connected");
    redis.pause().unwrap();
    assert_eq!(traced_get(2).await, 200, "the local share decides");
    // The call goes on for the rest of the 400 ms response timeout in case
    // Redis answers late; it stays paused past that, so it never does.
    tokio::time::sleep(Duration::from_millis(800)).await;
    redis.resume().unwrap();
    redis.kill().unwrap();
    for n in 3..=6 {
        assert_eq!(traced_get(n).await, 200);
    }
    let spans = receiver
        .trace(&trace_id(2), 3, Duration::from_secs(10))
        .await
        .unwrap();
    let call = by_name(&spans, "EVALSHA");
    // Dropped past its allowance, or the client's own timeout first.
    assert!(
        matches!(
            call.attributes.get("error.type").map(String::as_str),
            Some("deadline" | "timeout")
        ),
        "{call:?}"
    );
    assert_eq!(
        by_name(&spans, "ratelimit.check")
            .attributes
            .get("ratelimit.source")
            .map(String::as_str),
        Some("local")
    );
    let spans = receiver
        .trace(&trace_id(3), 3, Duration::from_secs(10))
        .await
        .unwrap();
    let refused = by_name(&spans, "EVALSHA")
        .attributes
        .get("error.type")
        .cloned();
    assert!(
        matches!(
            refused.as_deref(),
            Some("connection_refused" | "connection_dropped" | "io")
        ),
        "{refused:?}"
    );
    // Two failures before: the third opens the breaker (request 4); from
    // request 5 on, Redis is not called and the check says so.
    let spans = receiver
        .trace(&trace_id(6), 2, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(spans.iter().all(|s| s.name != "EVALSHA"), "{spans:#?}");
    let check = by_name(&spans, "ratelimit.check");
    assert!(
        check.events.iter().any(|e| e.contains("redis skipped")),
        "{:?}",
        check.events
    );
}
